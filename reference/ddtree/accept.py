"""DDTree acceptance, greedy and sampled: the NumPy reference.  This docstring is the contract
of ``accept_greedy``, ``sample_targets`` and ``accept_sampled``.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

``accept_greedy(tree, target_tokens, pack=False) -> (acc_idx, acc_len, next_token[, packed])``
    target_tokens [bs, B+1] int: the target's choice after each slot (padding ignored).
    Walk: ``cur = 0, nxt = target[0]; while a child c of cur has token[c] == nxt: accept c,
    cur = c, nxt = target[c]``.  acc_idx [bs, L+1] int32 = accepted slots starting with 0
    (-1 padded), acc_len [bs] int32 in [1, L+1], next_token [bs] int32 = the first unmatched
    target token (the next root, the "bonus" token).  With ``pack``, also
    :func:`pack_committed` of them: what a round commits, as one array to read.

``sample_targets(tree, target_logits, sampling, uniforms) -> target_tokens``
    target_logits [bs, B+1, V] float32 (finite), ``sampling`` a ``Sampling`` with T > 0 (or a
    bare temperature T > 0), uniforms [bs, B+1] float32/64 in [0, 1).  Slot i <= n_nodes draws
    ``inverse_cdf_sample(logits[b, i], sampling, u[b, i])``: the softmax of logits / T,
    truncated by top-k and top-p and renormalised, by inverse CDF over token ids
    (reference/ddtree/sampling.py, the rule and its tie-breaking).  Padding slots get -1.  The
    twins sum in different orders (both float64), so they agree exactly unless ``u`` lies within
    ~1e-12 (relative) of a CDF boundary (or a top-p prefix mass that close to its threshold);
    tests draw u at least 1e-9 away from every boundary.

``accept_sampled(tree, target_logits, sampling, uniforms, pack=False)``
    ``= accept_greedy(tree, sample_targets(...), pack)``.  Every committed token is a genuine sample
    of the truncated target distribution at its context, so the round is lossless for any
    tree (no draft probabilities needed): DDTree's and the chain's tokens follow AR's
    distribution with the same top-p and top-k.  The walk reads a slot's target token only
    when it reaches the slot, so this reference draws at the visited slots alone (the root,
    the accepted nodes): the same outputs as drawing every slot, at a fraction of the cost
    when few nodes are accepted (each draw is a softmax over the vocabulary; the CPU path
    runs this function).
"""
from __future__ import annotations

import numpy as np

from .checks import check_per_slot, check_sample_args, check_tree
from .sampling import inverse_cdf_sample
from .tree import DraftTree

__all__ = ["accept_greedy", "sample_targets", "accept_sampled", "inverse_cdf_sample",
           "pack_committed", "accepted_slots"]


def pack_committed(token, acc_idx, acc_len, next_token) -> np.ndarray:
    """int32 [bs, 2 (L + 1)] of a walk: column 0 acc_len m, columns 1..m the committed
    tokens (the accepted nodes' ``token`` after the root, then ``next_token``, the bonus),
    columns 1..L + 1 past them -1; then columns L + 2 .. L + m the accepted nodes' slots
    ``acc_idx[1:m]`` (increasing: parents precede children), the rest -1.  A DDTree round's
    one host read (kdtree_numba/steps.py); the slots are what ``--budget auto`` learns every
    smaller budget's acceptance from (:func:`accepted_slots`, kdtree_numba/budget.py)."""
    token, acc_idx = np.asarray(token), np.asarray(acc_idx)
    acc_len, next_token = np.asarray(acc_len), np.asarray(next_token)
    bs, width = acc_idx.shape
    packed = np.full((bs, 2 * width), -1, np.int32)
    for b in range(bs):
        m = int(acc_len[b])
        packed[b, 0] = m
        packed[b, 1:m] = token[b, acc_idx[b, 1:m]]
        packed[b, m] = next_token[b]
        packed[b, width + 1:width + m] = acc_idx[b, 1:m]
    return packed


def accepted_slots(packed, b: int) -> np.ndarray:
    """Request ``b``'s accepted nodes' slots (root excluded, increasing) from a
    :func:`pack_committed` array (host)."""
    width = packed.shape[1] // 2
    m = int(packed[b, 0])
    return packed[b, width + 1:width + m]


def _walk(tree: DraftTree, bs: int, max_depth: int, target_at):
    """The acceptance walk of every request, ``target_at(b, slot)`` the target's token after
    a slot, asked only for the slots the walk reaches (contract: module docstring)."""
    acc_idx = np.full((bs, max_depth + 1), -1, np.int32)
    acc_len = np.zeros(bs, np.int32)
    next_token = np.zeros(bs, np.int32)
    for b in range(bs):
        n = int(tree.n_nodes[b])
        children: dict[int, dict[int, int]] = {}
        for c in range(1, n + 1):
            children.setdefault(int(tree.parent[b, c]), {})[int(tree.token[b, c])] = c
        path, cur, nxt = [0], 0, target_at(b, 0)
        while nxt in children.get(cur, {}):
            cur = children[cur][nxt]
            path.append(cur)
            nxt = target_at(b, cur)
        acc_idx[b, :len(path)] = path
        acc_len[b] = len(path)
        next_token[b] = nxt
    return acc_idx, acc_len, next_token


def _packed(tree: DraftTree, walk, pack: bool):
    return walk + (pack_committed(tree.token, *walk),) if pack else walk


def accept_greedy(tree: DraftTree, target_tokens, pack: bool = False):
    """Accepted root-to-node path and the next root token (contract: module docstring)."""
    bs, budget, max_depth = check_tree(tree)
    target = np.asarray(check_per_slot("target_tokens", target_tokens, bs, budget + 1, "iu"))
    return _packed(tree, _walk(tree, bs, max_depth, lambda b, slot: int(target[b, slot])), pack)


def _checked_sampling(tree: DraftTree, target_logits, sampling, uniforms):
    """(bs, budget, the Sampling, logits, float64 uniforms) after sample_targets' checks."""
    bs, budget, _, sampling = check_sample_args(tree, target_logits, sampling, uniforms)
    target_logits, uniforms = np.asarray(target_logits), np.asarray(uniforms, np.float64)
    if not np.isfinite(target_logits).all():
        raise ValueError("target_logits must be finite")
    if np.any(uniforms < 0) or np.any(uniforms >= 1):
        raise ValueError("uniforms must lie in [0, 1)")
    return bs, budget, sampling, target_logits, uniforms


def sample_targets(tree: DraftTree, target_logits, sampling, uniforms):
    """One target sample at every tree slot, -1 at padding (contract: module docstring)."""
    bs, budget, sampling, target_logits, uniforms = _checked_sampling(
        tree, target_logits, sampling, uniforms)
    tokens = np.full((bs, budget + 1), -1, np.int32)
    for b in range(bs):
        for i in range(int(tree.n_nodes[b]) + 1):
            tokens[b, i] = inverse_cdf_sample(target_logits[b, i], sampling, uniforms[b, i])
    return tokens


def accept_sampled(tree: DraftTree, target_logits, sampling, uniforms, pack: bool = False):
    """The greedy walk on target samples, each slot's drawn when the walk reaches it
    (contract: module docstring; = accept_greedy(tree, sample_targets(...)))."""
    bs, _, sampling, target_logits, uniforms = _checked_sampling(
        tree, target_logits, sampling, uniforms)      # the tree checked too

    def target_at(b: int, slot: int) -> int:
        return inverse_cdf_sample(target_logits[b, slot], sampling, uniforms[b, slot])
    return _packed(tree, _walk(tree, bs, int(tree.max_depth), target_at), pack)

"""The device-only steps of decoding, as methods of the model (:class:`DeviceSteps`).

``engine.generate`` drives prefill, AR steps and DDTree rounds from the host; every piece of
device work it asks for is a model forward (kdtree_numba/model.py) or one of these calls, so
the engine never touches the backend's kernels, its array module or the CUDA graphs, and never
builds a graph key.  On the GPU each step below runs through :meth:`DeviceSteps.device_step`:
replayed from one of the model's CUDA graphs once its key repeats (kdtree_numba/graphs.py),
eagerly otherwise.  None of them reads the device: the round's one host read is the engine's
(docs/ENGINE.md, "Sync points").

A DDTree round (docs/DDTREE.md for the kernels):

* :meth:`~DeviceSteps.draft_tree`: drafter logits (divided by the draft temperature t_d where
  it is not 1: :func:`draft_temperature`) -> ``topk_logprobs`` -> ``build_tree`` ->
  ``compile_tree`` (graph key "tree");
* the verify forward (``Model.forward`` on the VerifyInput);
* :meth:`~DeviceSteps.accept`: the target's choice at every node (argmax at T = 0, the
  uniforms ``U_b[start + depth + 1]`` at T > 0), the walk (``accept_greedy`` /
  ``accept_sampled``) with the packing of acc_len, the committed tokens and the accepted
  slots into one int32 array in the walk's launch (``reference.ddtree.pack_committed``), the
  round's one read (graph key "accept");
* :meth:`~DeviceSteps.accepted_rows`: with a DFlash drafter, the verify's captured target
  features at the accepted nodes (graph key "accepted_rows"), the drafter's next context;
* :meth:`~DeviceSteps.compact`: ``compact_kv`` of the accepted rows (graph key "compaction").

Prefill and AR steps choose their next token with :meth:`~DeviceSteps.choose` (graph key
"argmax" at T = 0).
"""
from __future__ import annotations

import numpy as np

from kdtree_numba import cpu
from reference.ddtree import DraftTree, Sampling, as_sampling, check_draft_temperature

__all__ = ["DeviceSteps", "TREE_ARRAYS", "root_only_tree", "tree_uniforms", "tree_phase",
           "accept_phase", "gather_phase", "compaction_phase", "choice_phase",
           "draft_temperature"]


def draft_temperature(sampling, value=None) -> float:
    """The draft temperature t_d a round builds its tree with: the tree is built from the
    drafter's logits / t_d (top-K log-softmax, then the best-first build), so t_d > 1 spreads
    the budget over more of each depth's candidates.  The acceptance never reads the draft
    (every committed token is the target's own choice or sample), so t_d changes how many
    tokens a round commits, never which.  ``value``: a fixed t_d (finite, > 0), or None for
    the default: 1 (the logits as they are) at every temperature (docs/ENGINE.md,
    "Draft temperature", has the measurements behind it).  ``sampling``: a Sampling or a
    bare temperature."""
    if value is not None:
        return check_draft_temperature(value)
    as_sampling(sampling)
    return 1.0


def tree_depth(backend, sampling) -> int | None:
    """The deepest draft row a DDTree round reads (its tree's depth at most), or None for the
    budget's own (a tree of n nodes reaches depth n): ``cpu.SAMPLED_DEPTH`` on the CPU path
    (the reference backend in float32) at T > 0, where a round commits so few tokens that the
    budget pays more spent wide than deep and the drafter's shorter block costs less; None
    elsewhere (T = 0's trees, the GPU's, the float64 reference's stay as they were).  The
    cap shapes the tree only: the acceptance reads the target alone."""
    if as_sampling(sampling).temperature > 0 and backend.cpu_path:
        return cpu.SAMPLED_DEPTH
    return None


TREE_ARRAYS = ("n_nodes", "token", "parent", "depth", "rank", "score")


def root_only_tree(be, bs: int) -> DraftTree:
    """A 1-slot-budget tree with no nodes, on the device: ``sample_targets`` on it samples
    slot 0 only."""
    full = lambda v, dt: np.full((bs, 2), v, dt)  # noqa: E731
    depth = full(-1, np.int32)
    depth[:, 0] = 0
    score = full(-np.inf, np.float64)
    score[:, 0] = 0.0
    return DraftTree(n_nodes=be.asarray(np.zeros(bs, np.int32)),
                     token=be.asarray(full(-1, np.int32)), parent=be.asarray(full(-1, np.int32)),
                     depth=be.asarray(depth), rank=be.asarray(full(-1, np.int32)),
                     score=be.asarray(score), max_depth=1)


def tree_uniforms(xp, table, tree, start):
    """``U_b[start_b + depth + 1]`` for every slot of the tree, gathered on the device from the
    uploaded uniform table [bs, W] (padding slots, depth -1, take depth 0's; positions clip at
    W - 1, as the table covers every position a committed token can have)."""
    pos = start[:, None] + xp.maximum(tree.depth, 0) + 1
    return xp.take_along_axis(table, xp.minimum(pos, table.shape[1] - 1), axis=1)


def choice_phase(ops, xp, sampling: Sampling, tree: DraftTree | None = None):
    """logits [bs, V] (contiguous)[, uniforms [bs, 2]] -> the next token per request [bs]
    int32: the argmax at T = 0, else ``sample_targets``' inverse-CDF rule (top-p and top-k
    included) on ``tree``, a :func:`root_only_tree`, with the uniform of column 0 (column 1
    is the tree's empty slot's).  What AR's step chooses with, from the host loop
    (:meth:`DeviceSteps.choose`) and inside a device program (kdtree_numba/device_ar.py)."""
    if sampling.greedy:
        return ops.argmax

    def sample(logits, uniforms):
        pair = xp.stack([logits, logits], axis=1)
        return xp.ascontiguousarray(ops.sample_targets(tree, pair, sampling, uniforms)[:, 0])
    return sample


def tree_phase(ops, k: int, budget: int, draft_temperature: float = 1.0, lookup=None):
    """draft logits, roots, start[, history] -> (tree, verify inputs): top-K of the logits /
    t_d (float32 division; none at t_d = 1, so no extra launch there), the ``lookup``'s path
    from the token ``history`` mixed in (kdtree_numba/lookup.py; None: none), build,
    compile."""
    scale = np.float32(check_draft_temperature(draft_temperature))

    def run(draft_logits, roots, start, history=None):
        if scale != 1:
            draft_logits = draft_logits / scale
        lp, ids = ops.topk_logprobs(draft_logits, k)
        if lookup is not None:
            lp, ids = lookup.mix(ops, lp, ids, history, start)
        tree = ops.build_tree(lp, ids, budget)
        return tree, ops.compile_tree(tree, roots, start)
    return run


def accept_phase(ops, xp, sampling: Sampling, max_depth: int):
    """verify logits, the tree's arrays[, uniform table, start] -> (acc_idx, acc_len, packed
    committed tokens, next roots): the target's choice at every node, the walk, the packing
    (the next roots are the bonus tokens, the last committed ones)."""
    def run(logits, *arrays):
        tree = DraftTree(*arrays[:len(TREE_ARRAYS)], max_depth=max_depth)
        if sampling.greedy:
            bs, n, V = logits.shape
            target = ops.argmax(logits.reshape(bs * n, V)).reshape(bs, n)
            acc_idx, acc_len, nxt, packed = ops.accept_greedy(tree, target, pack=True)
        else:
            table, start = arrays[len(TREE_ARRAYS):]
            u = tree_uniforms(xp, table, tree, start)
            acc_idx, acc_len, nxt, packed = ops.accept_sampled(tree, logits, sampling, u,
                                                               pack=True)
        # the walk's own int32 outputs: no copies (each was a launch of its own)
        return acc_idx, acc_len, packed, nxt
    return run


def gather_phase(xp, requests=None):
    """rows [bs, W, F], acc_idx [bs, L + 1] -> the rows of the accepted nodes [bs, L + 1, F]
    (padding indices -1 read slot 0).  ``requests``: the column 0..bs-1 [bs, 1] made once by
    the caller (KDTREE_LEAN_ROUND: two launches, where the arange and the int64 copy of the
    indices were two more; the same rows)."""
    def run(rows, acc_idx):
        if requests is not None:
            return rows[requests, xp.maximum(acc_idx, 0)]
        bs = rows.shape[0]
        idx = xp.maximum(acc_idx, 0).astype(np.int64)
        return rows[xp.arange(bs, dtype=np.int64)[:, None], idx]
    return run


def compaction_phase(ops, cache):
    """lengths (the cache's device lengths), acc_idx, acc_len -> (): KVCache.compact_tree on
    device inputs."""
    def run(lengths, acc_idx, acc_len):
        cache.compact_tree(ops, acc_idx, acc_len, lengths=lengths)
        return ()
    return run


class DeviceSteps:
    """The device steps of decoding (module docstring), mixed into ``Model``: they use the
    model's ``backend``, ``graphs`` (a GraphCache, or None: eager), ``vocab_size`` and
    ``_root_trees`` (a dict)."""

    def device_step(self, key: tuple, fn, inputs: tuple, borrow: bool = False,
                    before_capture=None):
        """``fn(*inputs)``, device work only, replayed from one of the model's CUDA graphs when
        it has them (GraphCache.call: captured on the key's second call), else run eagerly on
        device copies of ``inputs`` (host or device arrays).  ``key`` (its first entry names
        the kind of step) must name everything ``fn`` depends on besides the inputs, whose
        shapes and dtypes are added to it here.  ``borrow``: a replay's outputs are the
        graph's own buffers, valid until the key's next call (GraphCache.call);
        ``before_capture``: the key's own capture hook (GraphCache.call)."""
        be = self.backend
        if self.graphs is not None:
            specs = tuple((tuple(int(d) for d in a.shape), np.dtype(a.dtype)) for a in inputs)
            out = self.graphs.call(key + specs, fn, inputs, specs, borrow=borrow,
                                   before_capture=before_capture)
            if out is not None:
                return out
        return fn(*(be.asarray(a) for a in inputs))

    def choose(self, logits, sampling, uniforms: np.ndarray):
        """Next token per request from logits [bs, V], on the device ([bs] int): argmax at
        T = 0, else the inverse-CDF rule of ``sample_targets`` (the same kernel DDTree uses,
        top-p and top-k included) with ``uniforms [bs]`` (host).  ``sampling``: a Sampling or
        a bare temperature."""
        be, ops, xp = self.backend, self.backend.ops, self.backend.xp
        sampling = as_sampling(sampling)
        logits = xp.ascontiguousarray(logits)          # rows of a [bs, n, V] block are strided
        if sampling.greedy:   # one more CUDA graph on the GPU (an eager launch costs ~0.2 ms)
            return self.device_step(("argmax",), choice_phase(ops, xp, sampling), (logits,))
        bs = logits.shape[0]
        tree = self._root_trees.get(bs)   # made once: its arrays are the graph's constants
        if tree is None:
            tree = self._root_trees[bs] = root_only_tree(be, bs)
        # one CUDA graph as at T = 0: eagerly the step was ~8 launches and copies on the
        # host's path (AR at T = 1 idled the GPU half of each step, run 158)
        key = ("sample", sampling.temperature, sampling.top_p, sampling.top_k)
        return self.device_step(key, choice_phase(ops, xp, sampling, tree),
                                (logits, np.stack([uniforms, np.full(bs, 0.5)], axis=1)))

    def draft_tree(self, draft_logits, roots, start, budget: int, k: int | None = None,
                   borrow: bool = False, draft_temperature: float = 1.0, lookup=None,
                   history=None):
        """(DraftTree, VerifyInput) of a round from the drafter's logits [bs, L, V], the roots
        [bs] and the tree's start positions [bs] (the cache lengths): top-K with
        ``k = min(budget, V)`` (or the ``k`` given) of the logits / ``draft_temperature``
        (:func:`draft_temperature`), the best-first build of ``budget`` nodes, the compile.
        ``k = 1, budget = L`` builds the drafter's greedy chain (each node has one child, its
        row's argmax): the engine's "chain" method.  ``borrow``: the arrays
        may be a CUDA graph's own, which the next call of this shape overwrites (the engine's
        round uses them before then; :meth:`device_step`).  ``lookup`` (a
        kdtree_numba.lookup.PromptLookup, or None) mixes its path from ``history`` [bs, H]
        (the requests' tokens by position) into the top-K rows."""
        k = min(budget, self.vocab_size) if k is None else int(k)
        t_d = float(draft_temperature)
        inputs = (draft_logits, roots, start) + ((history,) if lookup is not None else ())
        return self.device_step(("tree", k, budget, t_d, lookup and lookup.key()),
                                tree_phase(self.backend.ops, k, budget, t_d, lookup),
                                inputs, borrow=borrow)

    def accept(self, tree, logits, sampling, table=None, start=None, borrow: bool = False):
        """(acc_idx, acc_len, packed, next_roots) from the verify forward's logits [bs, W, V]
        over ``tree``: greedy at T = 0, else sampled (``sampling``: a Sampling or a bare
        temperature; top-p and top-k truncate every node's target distribution) with the
        uniforms ``table[b, start_b + depth + 1]`` (``table`` [bs, P] float64 on the device,
        ``start`` [bs] int32).  ``packed`` [bs, 2 (L + 1)] int32 holds acc_len, the committed
        tokens and the accepted nodes' slots (``reference.ddtree.pack_committed``): the one
        array the engine reads;
        ``next_roots`` [bs] int32 the bonus tokens.  ``borrow``: as in :meth:`draft_tree`."""
        sampling = as_sampling(sampling)
        arrays = tuple(getattr(tree, name) for name in TREE_ARRAYS)
        if not sampling.greedy:
            arrays += (table, start)
        return self.device_step(
            ("accept", sampling, tree.max_depth),
            accept_phase(self.backend.ops, self.backend.xp, sampling, tree.max_depth),
            (logits,) + arrays, borrow=borrow)

    def committed_tokens(self, packed, roots):
        """A round's root, accepted nodes and bonus [bs, L + 2] on the device, from its packed
        committed tokens (``reference.ddtree.pack_committed``) and its ``roots`` [bs]
        (``drafting.Commit.tokens``: the first acc_len entries are the tokens whose KV the
        round committed, entry acc_len the bonus, the rest token 0).  Nothing is read."""
        xp = self.backend.xp
        width = packed.shape[1] // 2          # L + 1: the accepted slots follow the tokens
        tokens = xp.concatenate([roots.astype(np.int32, copy=False)[:, None],
                                 packed[:, 1:1 + width]], axis=1)
        return xp.maximum(tokens, 0)          # padding: token 0, a valid id

    def last_accepted(self, rows, acc_idx, acc_len):
        """``rows`` [bs, W, ...] (e.g. the verify forward's hidden states) at each request's
        last accepted node: the row whose logits chose the bonus token, the next root."""
        xp = self.backend.xp
        before = xp.maximum(acc_len.astype(np.int32, copy=False) - 1, 0)
        last = xp.take_along_axis(acc_idx, before[:, None], axis=1)[:, 0]
        return rows[xp.arange(rows.shape[0]), last]

    def accepted_rows(self, rows, acc_idx):
        """``rows`` [bs, W, F] (e.g. the verify forward's captured features) at the accepted
        nodes ``acc_idx`` [bs, L + 1]: [bs, L + 1, F], row j the j-th accepted node (the
        root first); rows past each request's acc_len repeat the root's and are to be
        ignored.  A device step (graph key "accepted_rows"): nothing is read."""
        return self.device_step(("accepted_rows",), gather_phase(self.backend.xp),
                                (rows, acc_idx))

    def compact(self, cache, acc_idx, acc_len) -> None:
        """Move the accepted tree rows to the front of the tree block in ``cache``
        (KVCache.compact_tree; launches only).  The lengths do not change: the caller advances
        them once it has read acc_len."""
        self.device_step(("compaction",) + cache.buffer_key(),
                         compaction_phase(self.backend.ops, cache),
                         (cache.device_lengths, acc_idx, acc_len))

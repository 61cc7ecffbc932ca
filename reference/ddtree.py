"""DDTree draft-tree kernels: the NumPy reference.  This docstring is the contract.

``kdtree_numba.ddtree`` implements the same functions with numba.cuda and points here; the
algorithm itself is described in shared/notes/ddtree.md and docs/DDTREE.md.  Everything is
batched over ``bs`` independent requests.  Indices are int32 and padding is -1.

``topk_logprobs(logits, k) -> (lp, ids)``
    logits [bs, L, V] float32 (finite) -> lp [bs, L, k] float32, ids [bs, L, k] int32.
    Per row: the k tokens with the largest logits, ordered by raw float32 logit descending,
    ties by smaller token id (a strict total order, so ``ids`` is exact); ``lp = logit - lse``
    with ``lse = logsumexp(row)``.  Here lse is float64 (max + log of the float64 sum of
    exp(x - max)) and ``lp = float32(float64(logit) - lse)``.  The GPU twin sums float32 exps in
    float64, so its lse differs by < 1e-6; compare lp with ``|d| <= LP_ATOL + LP_RTOL*|lp|``
    and ids exactly.  lp is non-increasing along k.

``build_tree(lp, ids, budget) -> DraftTree``
    lp [bs, L, K] float32 (finite, rows non-increasing), ids [bs, L, K] int32, budget B >= 1.
    Best-first tree of at most B nodes under the root (shared/notes/ddtree.md):
    node N = the N-th popped rank path; a path (r1..rd) is a node at depth d with token
    ``ids[d-1][rd]``; float64 scores, child = ``score + lp[d][0]``, next sibling =
    ``(score - lp[d-1][r]) + lp[d-1][r+1]`` in exactly that order; the best candidate is the
    highest score, ties by the lexicographically smaller rank path.  Bit-exact between twins.
    DraftTree arrays have B + 1 slots, slot 0 is the root, slots 1..n_nodes the popped nodes
    in pop order, slots past n_nodes are padding:

    =========  ==================  =====================  ====================
    field      [bs, B+1]           root (slot 0)          padding slots
    =========  ==================  =====================  ====================
    n_nodes    [bs] int32          number of nodes under the root (<= B; < B only if the
                                   vocabulary is tiny: sum over depths of K**d < B)
    token      int32               -1                     -1
    parent     int32  (< own slot) -1                     -1
    depth      int32  (1..L)       0                      -1
    rank       int32  (0..K-1)     -1                     -1
    score      float64 (<= 0)      0.0                    -inf
    max_depth  int (= L)           the L the tree was built for (sizes ``anc`` and accept)
    =========  ==================  =====================  ====================

``compile_tree(tree, root_token, start) -> VerifyInput``
    root_token [bs] int (the token the verify step feeds at slot 0), start [bs] int (tokens
    already in the KV cache: the root's position).  Returns, with W = B + 1:

    ===========  =====================  =========================================  ===============
    field        shape, dtype           tree slot i <= n_nodes                     padding slot i
    ===========  =====================  =========================================  ===============
    input_ids    [bs, W] int32          root_token (i = 0) / token[i]              root_token
    positions    [bs, W] int32          start + depth[i]                           start
    anc          [bs, W, L+1] int32     anc[i][d] = ancestor of i at depth d for   [i, -1, ...]
                                        d <= depth[i] (anc[i][depth[i]] = i), -1
    visible      [bs, W, W] bool        j == i or j is an ancestor of i            only j == i
    ===========  =====================  =========================================  ===============

    A padding slot is its own root at depth 0, so one rule gives the mask from ``anc``:
    ``visible[i][j] == (pd(j) <= pd(i) and anc[i][pd(j)] == j)`` with ``pd = positions - start``.
    The whole cached prefix is visible to every row (the attention kernel adds it).

``accept_greedy(tree, target_tokens) -> (acc_idx, acc_len, next_token)``
    target_tokens [bs, B+1] int: the target's choice after each slot (padding ignored).
    Walk: ``cur = 0, nxt = target[0]; while a child c of cur has token[c] == nxt: accept c,
    cur = c, nxt = target[c]``.  acc_idx [bs, L+1] int32 = accepted slots starting with 0
    (-1 padded), acc_len [bs] int32 in [1, L+1], next_token [bs] int32 = the first unmatched
    target token (the next root, the "bonus" token).

``sample_targets(tree, target_logits, temperature, uniforms) -> target_tokens``
    target_logits [bs, B+1, V] float32 (finite), temperature T > 0, uniforms [bs, B+1]
    float32/64 in [0, 1).  Slot i <= n_nodes samples softmax(logits/T) by inverse CDF:
    ``w_j = exp((f64(x_j) - f64(max x)) / T)``, ``token = min{t : sum_{j<=t} w_j > u * sum_j w_j}``
    (the last token with w_j > 0 if rounding leaves none).  Padding slots get -1.  The twins
    sum in different orders (both float64), so they agree exactly unless ``u`` lies within
    ~1e-12 (relative) of a CDF boundary; tests draw u at least 1e-9 away from every boundary.

``accept_sampled(tree, target_logits, temperature, uniforms)``
    ``= accept_greedy(tree, sample_targets(...))``.  Every committed token is a genuine target
    sample, so the round is lossless for any tree (no draft probabilities needed).

``compact_kv(caches, past_len, acc_idx, acc_len) -> None``
    caches: a list of arrays of any dtype, each [bs, max_len, width] or a stack
    [n, bs, max_len, width]; past_len [bs] int.  Tree slot i of request b lives in cache row
    past_len[b] + i.  In place, for k < acc_len[b]: row ``past + acc_idx[k]`` moves to row
    ``past + k`` (all moved rows are read before any is written: acc is increasing with
    acc[k] >= k, so a parallel row copy would read rows already overwritten).  Rows past
    ``past + acc_len`` are left as they are.  Needs ``past + acc_idx[acc_len-1] < max_len``
    (ValueError here).
"""
from __future__ import annotations

import dataclasses
import heapq
import numbers

import numpy as np

__all__ = ["DraftTree", "VerifyInput", "topk_logprobs", "build_tree", "compile_tree",
           "accept_greedy", "sample_targets", "accept_sampled", "compact_kv",
           "LP_ATOL", "LP_RTOL"]

# lp tolerance between the twins (the GPU's lse carries < ~4e-7 relative error from float32
# exp terms; both sides then round x - lse to float32: one ulp <= 2**-23 |lp| each).
LP_ATOL = 1e-6
LP_RTOL = 2.0 ** -22


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees (fields: module docstring).  Arrays are NumPy here and device
    arrays from ``kdtree_numba.ddtree`` when it was given device arrays."""
    n_nodes: object
    token: object
    parent: object
    depth: object
    rank: object
    score: object
    max_depth: int

    @property
    def batch(self) -> int:
        return int(self.token.shape[0])

    @property
    def budget(self) -> int:
        return int(self.token.shape[1]) - 1


@dataclasses.dataclass(frozen=True)
class VerifyInput:
    """Inputs of the target's verify forward (fields: module docstring)."""
    input_ids: object
    positions: object
    anc: object
    visible: object


# ----------------------------------------------------------------------------- validation
# These check only metadata (shape, dtype), so the numba twin uses them on device arrays too.

def _dtype_of(x) -> np.dtype:
    return np.dtype(x.dtype)


def check_array(name: str, x, ndim: int, kinds: str = "", dtype=None):
    """Raise TypeError/ValueError unless ``x`` is an array of ``ndim`` dims of the right dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (NumPy, CuPy or numba device), "
                        f"not {type(x).__name__}")
    dt = _dtype_of(x)
    if dtype is not None and dt != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {dt}")
    if kinds and dt.kind not in kinds:
        raise TypeError(f"{name} must have dtype kind in {kinds!r}, got {dt}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        top = "inf" if high is None else high
        raise ValueError(f"{name} = {value} must lie in [{low}, {top}]")
    return value


def check_topk_args(logits, k) -> tuple[int, int, int, int]:
    check_array("logits", logits, 3, dtype=np.float32)
    bs, n_rows, vocab = (int(s) for s in logits.shape)
    if min(bs, n_rows, vocab) == 0:
        raise ValueError(f"logits must be non-empty, got shape {tuple(logits.shape)}")
    return bs, n_rows, vocab, check_int("k", k, 1, vocab)


def check_build_args(lp, ids, budget) -> tuple[int, int, int, int]:
    check_array("lp", lp, 3, dtype=np.float32)
    check_array("ids", ids, 3, dtype=np.int32)
    if tuple(lp.shape) != tuple(ids.shape):
        raise ValueError(f"lp {tuple(lp.shape)} and ids {tuple(ids.shape)} must have one shape")
    bs, n_rows, k = (int(s) for s in lp.shape)
    if min(bs, n_rows, k) == 0:
        raise ValueError(f"lp must be non-empty, got shape {tuple(lp.shape)}")
    return bs, n_rows, k, check_int("budget", budget, 1)


def check_tree(tree) -> tuple[int, int, int]:
    """-> (bs, budget, max_depth) after checking every field's shape and dtype."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    check_array("tree.token", tree.token, 2, dtype=np.int32)
    bs, width = (int(s) for s in tree.token.shape)
    check_array("tree.n_nodes", tree.n_nodes, 1, dtype=np.int32)
    for name in ("parent", "depth", "rank"):
        check_array(f"tree.{name}", getattr(tree, name), 2, dtype=np.int32)
    check_array("tree.score", tree.score, 2, dtype=np.float64)
    for name in ("parent", "depth", "rank", "score"):
        if tuple(getattr(tree, name).shape) != (bs, width):
            raise ValueError(f"tree.{name} must be {(bs, width)}, got "
                             f"{tuple(getattr(tree, name).shape)}")
    if tuple(tree.n_nodes.shape) != (bs,) or width < 2:
        raise ValueError(f"tree.n_nodes must be ({bs},) and budget >= 1")
    return bs, width - 1, check_int("tree.max_depth", tree.max_depth, 1)


def check_per_request(name: str, x, bs: int, kinds: str = "iu"):
    check_array(name, x, 1, kinds)
    if tuple(x.shape) != (bs,):
        raise ValueError(f"{name} must be ({bs},), got {tuple(x.shape)}")
    return x


def check_per_slot(name: str, x, bs: int, width: int, kinds: str):
    check_array(name, x, 2, kinds)
    if tuple(x.shape) != (bs, width):
        raise ValueError(f"{name} must be {(bs, width)}, got {tuple(x.shape)}")
    return x


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    t = float(temperature)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be finite and > 0 (use accept_greedy for T = 0), "
                         f"got {t}")
    return t


def check_sample_args(tree, target_logits, temperature, uniforms) -> tuple[int, int, int, float]:
    bs, budget, _ = check_tree(tree)
    check_array("target_logits", target_logits, 3, dtype=np.float32)
    if tuple(target_logits.shape[:2]) != (bs, budget + 1) or target_logits.shape[2] == 0:
        raise ValueError(f"target_logits must be ({bs}, {budget + 1}, V>0), got "
                         f"{tuple(target_logits.shape)}")
    check_per_slot("uniforms", uniforms, bs, budget + 1, "f")
    return bs, budget, int(target_logits.shape[2]), check_temperature(temperature)


def cache_list(caches) -> list:
    """``caches`` as a list of arrays (a single array is accepted as a list of one)."""
    if hasattr(caches, "shape"):
        return [caches]
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"caches must be a list of arrays, got {type(caches).__name__}")
    return list(caches)


def check_compact_args(caches, past_len, acc_idx, acc_len) -> tuple[list, int, int]:
    """-> (caches as a list, bs, L + 1); every cache is [bs, max_len, width] or [n, bs, ...]."""
    check_array("acc_idx", acc_idx, 2, "iu")
    bs, n_acc = (int(s) for s in acc_idx.shape)
    check_per_request("acc_len", acc_len, bs)
    check_per_request("past_len", past_len, bs)
    caches = cache_list(caches)
    for c, cache in enumerate(caches):
        shape = tuple(getattr(cache, "shape", ()))
        if len(shape) not in (3, 4):
            raise ValueError(f"caches[{c}] must be [bs, max_len, width] or "
                             f"[n, bs, max_len, width], got {getattr(cache, 'shape', cache)!r}")
        if int(shape[-3]) != bs:
            raise ValueError(f"caches[{c}] has batch {shape[-3]}, acc_idx has {bs}")
    return caches, bs, n_acc


# ----------------------------------------------------------------------------- top-K

def _row_topk(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of a float32 row, by value desc then index asc."""
    kth = np.partition(row, row.size - k)[row.size - k]   # the k-th largest value
    cand = np.flatnonzero(row >= kth)                       # >= k indices, ties included
    order = np.lexsort((cand, -row[cand]))                   # value desc, then id asc
    return cand[order[:k]]


def topk_logprobs(logits, k: int):
    """Top-k normalised log-probs per row (contract: module docstring)."""
    bs, n_rows, _, k = check_topk_args(logits, k)
    logits = np.asarray(logits)
    if not np.isfinite(logits).all():
        raise ValueError("logits must be finite")
    lp = np.empty((bs, n_rows, k), np.float32)
    ids = np.empty((bs, n_rows, k), np.int32)
    for b in range(bs):
        for d in range(n_rows):
            row64 = logits[b, d].astype(np.float64)
            top = row64.max()
            lse = top + np.log(np.exp(row64 - top).sum())
            idx = _row_topk(logits[b, d], k)
            ids[b, d] = idx
            lp[b, d] = (row64[idx] - lse).astype(np.float32)
    return lp, ids


# ----------------------------------------------------------------------------- tree builder

def _empty_tree(bs: int, budget: int, max_depth: int) -> DraftTree:
    def full(value, dtype):
        return np.full((bs, budget + 1), value, dtype)
    tree = DraftTree(n_nodes=np.zeros(bs, np.int32), token=full(-1, np.int32),
                     parent=full(-1, np.int32), depth=full(-1, np.int32),
                     rank=full(-1, np.int32), score=full(-np.inf, np.float64),
                     max_depth=max_depth)
    tree.depth[:, 0] = 0
    tree.score[:, 0] = 0.0
    return tree


def _build_one(lp: np.ndarray, ids: np.ndarray, budget: int, tree: DraftTree, b: int) -> None:
    """Best-first pops with a plain heap.  Heap items ``(-score, path, parent, depth, rank)``:
    heapq pops the smallest, i.e. the highest score, then the lexicographically smaller path."""
    n_rows, k = lp.shape
    heap = [(-float(lp[0, 0]), (0,), 0, 1, 0)]
    n = 0
    while heap and n < budget:
        neg, path, parent, depth, rank = heapq.heappop(heap)
        score = -neg
        n += 1
        tree.token[b, n] = ids[depth - 1, rank]
        tree.parent[b, n], tree.depth[b, n], tree.rank[b, n] = parent, depth, rank
        tree.score[b, n] = score
        if rank + 1 < k:   # next sibling: (score - lp[r]) + lp[r+1], in that order
            sib = (score - float(lp[depth - 1, rank])) + float(lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, depth, rank + 1))
        if depth < n_rows:  # first child
            child = score + float(lp[depth, 0])
            heapq.heappush(heap, (-child, path + (0,), n, depth + 1, 0))
    tree.n_nodes[b] = n


def build_tree(lp, ids, budget: int) -> DraftTree:
    """Best-first draft tree under a node budget (contract: module docstring)."""
    bs, n_rows, _, budget = check_build_args(lp, ids, budget)
    lp, ids = np.asarray(lp), np.asarray(ids)
    if not np.isfinite(lp).all():
        raise ValueError("lp must be finite")
    if np.any(np.diff(lp, axis=-1) > 0):
        raise ValueError("every lp row must be non-increasing (as topk_logprobs returns it)")
    tree = _empty_tree(bs, budget, n_rows)
    for b in range(bs):
        _build_one(lp[b], ids[b], budget, tree, b)
    return tree


# ----------------------------------------------------------------------------- verify inputs

def compile_tree(tree: DraftTree, root_token, start) -> VerifyInput:
    """Verify-forward inputs of a tree batch (contract: module docstring)."""
    bs, budget, max_depth = check_tree(tree)
    root_token = np.asarray(check_per_request("root_token", root_token, bs))
    start = np.asarray(check_per_request("start", start, bs))
    width = budget + 1
    input_ids = np.repeat(root_token.astype(np.int32)[:, None], width, axis=1)
    positions = np.repeat(start.astype(np.int32)[:, None], width, axis=1)
    anc = np.full((bs, width, max_depth + 1), -1, np.int32)
    visible = np.zeros((bs, width, width), bool)
    for b in range(bs):
        n = int(tree.n_nodes[b])
        for i in range(width):
            if 0 < i <= n:
                input_ids[b, i] = tree.token[b, i]
                positions[b, i] += tree.depth[b, i]
            node = i
            if i <= n:
                while node >= 0:   # walk up: the ancestor at each depth, i itself included
                    anc[b, i, tree.depth[b, node]] = node
                    visible[b, i, node] = True
                    node = int(tree.parent[b, node])
            else:                  # padding: its own root at depth 0, sees only itself
                anc[b, i, 0] = i
                visible[b, i, i] = True
    return VerifyInput(input_ids, positions, anc, visible)


# ----------------------------------------------------------------------------- acceptance

def accept_greedy(tree: DraftTree, target_tokens):
    """Accepted root-to-node path and the next root token (contract: module docstring)."""
    bs, budget, max_depth = check_tree(tree)
    target = np.asarray(check_per_slot("target_tokens", target_tokens, bs, budget + 1, "iu"))
    acc_idx = np.full((bs, max_depth + 1), -1, np.int32)
    acc_len = np.zeros(bs, np.int32)
    next_token = np.zeros(bs, np.int32)
    for b in range(bs):
        n = int(tree.n_nodes[b])
        children: dict[int, dict[int, int]] = {}
        for c in range(1, n + 1):
            children.setdefault(int(tree.parent[b, c]), {})[int(tree.token[b, c])] = c
        path, cur, nxt = [0], 0, int(target[b, 0])
        while nxt in children.get(cur, {}):
            cur = children[cur][nxt]
            path.append(cur)
            nxt = int(target[b, cur])
        acc_idx[b, :len(path)] = path
        acc_len[b] = len(path)
        next_token[b] = nxt
    return acc_idx, acc_len, next_token


def inverse_cdf_sample(row: np.ndarray, temperature: float, u: float) -> int:
    """One inverse-CDF draw from softmax(row / T) (float64; definition: module docstring)."""
    x = row.astype(np.float64)
    w = np.exp((x - x.max()) / temperature)
    cdf = np.cumsum(w)
    t = int(np.searchsorted(cdf, u * cdf[-1], side="right"))   # first cdf > u * total
    return t if t < row.size else int(np.flatnonzero(w > 0)[-1])


def sample_targets(tree: DraftTree, target_logits, temperature: float, uniforms):
    """One target sample at every tree slot, -1 at padding (contract: module docstring)."""
    bs, budget, _, temperature = check_sample_args(tree, target_logits, temperature, uniforms)
    target_logits, uniforms = np.asarray(target_logits), np.asarray(uniforms, np.float64)
    if not np.isfinite(target_logits).all():
        raise ValueError("target_logits must be finite")
    if np.any(uniforms < 0) or np.any(uniforms >= 1):
        raise ValueError("uniforms must lie in [0, 1)")
    tokens = np.full((bs, budget + 1), -1, np.int32)
    for b in range(bs):
        for i in range(int(tree.n_nodes[b]) + 1):
            tokens[b, i] = inverse_cdf_sample(target_logits[b, i], temperature, uniforms[b, i])
    return tokens


def accept_sampled(tree: DraftTree, target_logits, temperature: float, uniforms):
    """Sample the target at every node, then walk as greedy (contract: module docstring)."""
    return accept_greedy(tree, sample_targets(tree, target_logits, temperature, uniforms))


# ----------------------------------------------------------------------------- KV compaction

def check_accepted(acc: np.ndarray, m: int, b: int) -> None:
    if m < 1 or m > acc.size or acc[0] != 0 or np.any(np.diff(acc[:m]) <= 0):
        raise ValueError(f"request {b}: acc_len {m} / acc_idx {acc.tolist()} is not an "
                         f"accepted path (starts at 0, strictly increasing)")


def compact_kv(caches, past_len, acc_idx, acc_len) -> None:
    """Move accepted tree rows to the front of the tree block, in place (contract: module doc)."""
    caches, bs, _ = check_compact_args(caches, past_len, acc_idx, acc_len)
    acc_idx, acc_len, past_len = (np.asarray(a) for a in (acc_idx, acc_len, past_len))
    for b in range(bs):
        m, past = int(acc_len[b]), int(past_len[b])
        check_accepted(acc_idx[b], m, b)
        src = past + acc_idx[b, :m].astype(np.int64)
        for cache in caches:
            max_len = cache.shape[-2]
            if past < 0 or src[-1] >= max_len:
                raise ValueError(f"request {b}: rows past_len + acc_idx up to {src[-1]} lie "
                                 f"outside the cache (max_len {max_len})")
            rows = cache[..., b, src, :].copy()        # gather every row first, then scatter
            cache[..., b, past:past + m, :] = rows

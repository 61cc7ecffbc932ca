"""DDTree tree builder: the NumPy reference.  This docstring is the contract of ``build_tree``
and of the ``DraftTree`` fields.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

``build_tree(lp, ids, budget) -> DraftTree``
    lp [bs, L, K] float32 (finite, rows non-increasing), ids [bs, L, K] int32, budget B >= 1.
    Best-first tree of at most B nodes under the root (docs/DDTREE.md):
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
"""
from __future__ import annotations

import heapq

import numpy as np

from .checks import check_build_args
from .tree import DraftTree

__all__ = ["build_tree"]


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

"""DDTree verify inputs: the NumPy reference.  This docstring is the contract of
``compile_tree`` and of the ``VerifyInput`` fields.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

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
"""
from __future__ import annotations

import numpy as np

from .checks import check_per_request, check_tree
from .tree import DraftTree, VerifyInput

__all__ = ["compile_tree"]


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

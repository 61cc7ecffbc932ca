"""The DDTree verify mask of one tree, for tests, vectors and examples: the NumPy reference.

``mla_attention``'s ``visible`` argument (contract: reference/attention/mla.py) is this mask for a
tree verify; the engine gets it batched from ``reference.ddtree.compile_tree``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["tree_visible"]


def tree_visible(parents) -> np.ndarray:
    """The ``visible`` mask [n, n] of one tree given by parent indices (``parents[0] = -1``
    is the root, ``parents[i] < i``): row i sees j iff j is i or an ancestor of i.  For
    tests, vectors and examples; the engine gets the mask from ``compile_tree``."""
    n = len(parents)
    vis = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return vis

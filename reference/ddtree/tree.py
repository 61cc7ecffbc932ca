"""The two records the DDTree functions pass around: a batch of draft trees, and the inputs of
the target's verify forward.  Both sides use them: the numba twin returns the same classes
holding device arrays.

Their fields are part of the contract and are tabled with the function that makes them:
``DraftTree`` in build.py (``build_tree``), ``VerifyInput`` in compile.py (``compile_tree``).
"""
from __future__ import annotations

import dataclasses

__all__ = ["DraftTree", "VerifyInput"]


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees (fields: the table in reference/ddtree/build.py).  Arrays are
    NumPy here and device arrays from ``kdtree_numba.ddtree`` when it was given device arrays."""
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
    """Inputs of the target's verify forward (fields: the table in
    reference/ddtree/compile.py)."""
    input_ids: object
    positions: object
    anc: object
    visible: object

"""Token embedding lookup: the NumPy reference (contract: the table in
reference/layers/__init__.py).

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.
"""
from __future__ import annotations

import numpy as np

__all__ = ["embedding"]


def embedding(ids, table) -> np.ndarray:
    """``table[ids]`` as float32: ids [M] integer in [0, V), table [V, D] float32/bf16."""
    ids = np.asarray(ids)
    table = np.asarray(table)
    if ids.ndim != 1 or table.ndim != 2:
        raise ValueError(f"embedding wants ids [M], table [V, D]; got {ids.shape}, {table.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"token id out of range [0, {table.shape[0]})")
    return table[ids].astype(np.float32)

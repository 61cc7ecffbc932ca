"""The dense projection ``y = x w^T``: the NumPy reference (contract: the table in
reference/layers/__init__.py).

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.
"""
from __future__ import annotations

import numpy as np

from .common import as_float64

__all__ = ["linear"]


def linear(x, w) -> np.ndarray:
    """``y [M, N] = x [M, K] @ w [N, K]^T`` (float64 accumulation, float32 result)."""
    x64, w64 = as_float64(x), as_float64(w)
    if x64.ndim != 2 or w64.ndim != 2 or x64.shape[1] != w64.shape[1]:
        raise ValueError(f"linear wants x [M, K], w [N, K]; got {x64.shape}, {w64.shape}")
    return (x64 @ w64.T).astype(np.float32)

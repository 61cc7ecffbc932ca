"""RMSNorm: the NumPy reference (contract: the table in reference/layers/__init__.py).

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.
"""
from __future__ import annotations

import numpy as np

from .common import as_float64

__all__ = ["rmsnorm"]


def rmsnorm(x, weight, eps: float) -> np.ndarray:
    """``y = weight * x / sqrt(mean(x^2, axis=-1) + eps)``; x [M, D] float32, weight [D]."""
    x64, w64 = as_float64(x), as_float64(weight)
    if x64.ndim != 2 or w64.shape != (x64.shape[1],):
        raise ValueError(f"rmsnorm wants x [M, D] and weight [D], got {x64.shape}, {w64.shape}")
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    return (w64 * (x64 * inv)).astype(np.float32)

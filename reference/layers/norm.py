"""RMSNorm: the NumPy reference (contract: the table in reference/layers/__init__.py).

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.
"""
from __future__ import annotations

import numpy as np

from .common import as_float64

__all__ = ["rmsnorm", "add_rmsnorm"]


def rmsnorm(x, weight, eps: float) -> np.ndarray:
    """``y = weight * x / sqrt(mean(x^2, axis=-1) + eps)``; x [M, D] float32, weight [D]."""
    x64, w64 = as_float64(x), as_float64(weight)
    if x64.ndim != 2 or w64.shape != (x64.shape[1],):
        raise ValueError(f"rmsnorm wants x [M, D] and weight [D], got {x64.shape}, {w64.shape}")
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    return (w64 * (x64 * inv)).astype(np.float32)


def add_rmsnorm(x, delta, weight, eps: float):
    """``(s, rmsnorm(s, weight, eps))`` with ``s = x + delta``: a residual add and the norm that
    reads it (the model's two per layer).  ``s`` is the float32 sum, as ``x + delta`` on
    float32 arrays rounds it (so the twin's is bitwise this one)."""
    x32, d32 = np.asarray(x), np.asarray(delta)
    if x32.dtype != np.float32 or d32.dtype != np.float32 or x32.shape != d32.shape:
        raise ValueError(f"add_rmsnorm wants float32 x and delta of one shape, got "
                         f"{x32.dtype} {x32.shape}, {d32.dtype} {d32.shape}")
    s = x32 + d32
    return s, rmsnorm(s, weight, eps)

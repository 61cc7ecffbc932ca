"""Greedy token choice, the row argmax: the NumPy reference (contract: the table in
reference/layers/__init__.py).

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.
"""
from __future__ import annotations

import numpy as np

__all__ = ["argmax"]


def argmax(logits) -> np.ndarray:
    """Index of each row's maximum, int32 [M]; ties (and -0.0 vs 0.0) go to the smaller index,
    a NaN counts as larger than any number (as ``np.argmax``: the first NaN wins)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax wants logits [M, V] with V > 0, got {logits.shape}")
    return np.argmax(logits, axis=1).astype(np.int32)

"""Dtype handling shared by the layer references: every one of them computes in float64."""
from __future__ import annotations

import numpy as np

from formats.int4_group import Int4GroupWeight

__all__ = ["as_float64"]


def as_float64(a) -> np.ndarray:
    """float32 / bfloat16 / float64 array -> float64 (bf16 widens exactly).  A float64 array
    is returned as it is, not copied: no reference writes into what this returns, and the
    reference backend keeps its weights in float64 (kdtree_numba/backends.py), so the
    per-call widening of every weight would otherwise be most of a forward's time.

    An int4-group weight (formats/int4_group.py) is dequantised exactly, ``q * scale`` in
    float64: that is the W4A16 reference, the existing float64 matmul on the dequantised
    weight.  ``moe_ffn`` indexes one expert before widening, so a stacked int4 expert tensor
    is dequantised one expert at a time and stays packed in between."""
    if isinstance(a, Int4GroupWeight):
        return a.dequantize(np.float64)
    a = np.asarray(a)
    if a.dtype == np.float64:
        return a
    if a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    return a.astype(np.float64)

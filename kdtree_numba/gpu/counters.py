"""Arrival counters of the kernels whose last block to finish a tile completes it (the MoE's
combine in its down launch, layers/moe_combine.py; the bf16 GEMM's K slices added by their last
block, layers/mma.py): int32 device arrays kept for the process, zeroed once when made, and set
back to 0 by the block that uses each counter last, so that the next launch -- or a CUDA
graph's next replay -- counts from 0.

Why not a workspace buffer: the engine's ops make a fresh workspace per call, and a buffer
made inside a graph's capture cannot be zeroed by a host upload (the capture would record a
copy from host memory gone by the replay).  Here the zeroing is a kernel on the caller's
stream, captured where the first use is a capture (that graph then zeroes them before each
replay's use: harmless, they are 0 there).  Arrays are never freed (a captured graph may
read them); a larger request makes a larger array.  One array serves every launch of a kind:
launches run in stream order here (the legacy stream, or a capture's blocking stream:
kdtree_numba/gpu/pool.py), so two never count in it at once.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba import compat
from kdtree_numba.compat import SIMULATOR, cuda, kernel
from kdtree_numba.layers.workspace import launch_1d

__all__ = ["arrival_counters"]

_KEPT: dict = {}          # (context, name) -> [arrays, the largest last]


@kernel
def _zero(counters):
    i = cuda.grid(1)
    if i < counters.shape[0]:
        counters[i] = 0


def arrival_counters(name: str, n: int, stream=0):
    """At least ``n`` zeroed int32 counters for the kernels of kind ``name`` in this CUDA
    context (module docstring)."""
    key = (0 if SIMULATOR else id(cuda.current_context()), name)
    kept = _KEPT.setdefault(key, [])
    if kept and kept[-1].shape[0] >= n:
        return kept[-1]
    size = max(64, 1 << (max(n, 1) - 1).bit_length())
    counters = compat.device_empty((size,), np.int32, stream)
    grid, block = launch_1d(size, 256)
    _zero[grid, block, stream](counters)
    kept.append(counters)
    return counters

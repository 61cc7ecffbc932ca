"""``argmax`` on the GPU: one block per row, ties to the smaller index, NaN wins.

Twin: reference/layers/argmax.py; docs/LAYERS.md.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.layers.workspace import device_f32, result_array

__all__ = ["argmax"]


@device_function
def _beats(v, i, best_v, best_i):
    """(v, i) ranks before (best_v, best_i): NaN first, then larger value, then smaller index."""
    if best_i < 0:
        return True
    if math.isnan(v):
        return (not math.isnan(best_v)) or i < best_i
    if math.isnan(best_v):
        return False
    return v > best_v or (v == best_v and i < best_i)


# Loads a thread has in flight at once: a one-row argmax over Kimi's 163,840 logits is 160
# values a thread, and a loop that waits for each load in turn is all memory latency.
_LOADS_IN_FLIGHT = 8


@kernel_factory
def _argmax_kernel(threads: int):
    @kernel
    def argmax_rows(logits, out):
        """One block per row: each thread scans a strided slice (columns t + k*threads in
        ascending order, _LOADS_IN_FLIGHT loads issued together), then a shared-memory tree.
        The order (NaN first, then larger value, then smaller index) is total, so the
        grouping cannot change the winner."""
        vals = cuda.shared.array(threads, np.float32)
        idxs = cuda.shared.array(threads, np.int32)
        batch = cuda.local.array(_LOADS_IN_FLIGHT, np.float32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        width = logits.shape[1]
        best_v = np.float32(0.0)
        best_i = -1
        for i0 in range(t, width, threads * _LOADS_IN_FLIGHT):
            for k in range(_LOADS_IN_FLIGHT):          # unrolled, clamped in bounds
                batch[k] = logits[row, min(i0 + k * threads, width - 1)]
            for k in range(_LOADS_IN_FLIGHT):
                i = i0 + k * threads
                if i < width and _beats(batch[k], i, best_v, best_i):
                    best_v = batch[k]
                    best_i = i
        vals[t] = best_v
        idxs[t] = best_i
        cuda.syncthreads()
        stride = threads // 2
        while stride > 0:
            if t < stride:
                if idxs[t + stride] >= 0 and _beats(vals[t + stride], idxs[t + stride],
                                                    vals[t], idxs[t]):
                    vals[t] = vals[t + stride]
                    idxs[t] = idxs[t + stride]
            cuda.syncthreads()
            stride //= 2
        if t == 0:
            out[row] = idxs[0]
    return argmax_rows


def argmax(logits, *, out=None, stream=0, workspace=None):
    """See reference.argmax: int32 [M], ties to the smaller index, NaN wins."""
    ld = device_f32(logits, "logits", 2, stream)
    if ld.shape[1] == 0:
        raise ValueError("argmax over an empty row")
    y = result_array(out, (ld.shape[0],), np.int32, stream)
    if ld.shape[0]:
        threads = 32 if SIMULATOR else 1024
        _argmax_kernel(threads)[ld.shape[0], threads, stream](ld, y)
    return y

"""``rmsnorm`` on the GPU: one block per row, fp32 sum of squares.

Twin: reference/layers/norm.py; tolerance and design: docs/LAYERS.md.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel
from kdtree_numba.gpu.bits import bf16_bits_to_f32
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
from kdtree_numba.layers.workspace import device_f32, device_weight, result_array

__all__ = ["rmsnorm"]


def _norm_threads():
    return 32 if SIMULATOR else 256


@functools.cache
def _rmsnorm_kernel(threads: int, is_bf16: bool):
    block_reduce = make_block_reduce(1, threads)
    warps = threads // 32
    scr = block_reduce_scratch_shape(1, threads)
    red_shape = (warps + 1, 1)

    @kernel
    def rmsnorm_rows(x, weight, y, eps):
        """One block per row: fp32 sum of squares (butterfly), then w * (x * inv_rms)."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        acc = cuda.local.array(1, np.float32)
        row = cuda.blockIdx.x
        d_total = x.shape[1]
        ss = np.float32(0.0)
        for d in range(cuda.threadIdx.x, d_total, threads):
            v = x[row, d]
            ss += v * v
        acc[0] = ss
        block_reduce(acc, red, scratch)
        inv = np.float32(1.0) / math.sqrt(red[warps, 0] / np.float32(d_total) + eps)
        for d in range(cuda.threadIdx.x, d_total, threads):
            wv = bf16_bits_to_f32(weight[d]) if is_bf16 else weight[d]
            y[row, d] = wv * (x[row, d] * inv)
    return rmsnorm_rows


def rmsnorm(x, weight, eps: float, *, out=None, stream=0, workspace=None):
    """See reference.rmsnorm.  Tolerance: 2e-6 relative (fp32 sum of squares)."""
    xd = device_f32(x, "x", 2, stream)
    wd, kind = device_weight(weight, stream)
    if tuple(wd.shape) != (xd.shape[1],):
        raise ValueError(f"rmsnorm wants weight [{xd.shape[1]}], got {wd.shape}")
    y = result_array(out, xd.shape, np.float32, stream)
    if xd.shape[0]:
        threads = _norm_threads()
        _rmsnorm_kernel(threads, kind == "bf16")[xd.shape[0], threads, stream](
            xd, wd, y, np.float32(eps))
    return y

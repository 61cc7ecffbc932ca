"""What every layer kernel module shares: the GEMM constants, powers of two, ``silu`` and the
ordered K-slice sum of the split-K GEMMs (``sum_splits``).

The numba twin of reference/layers/common.py (which holds the references' dtype handling; the
device arrays and dtypes of the numba functions are in workspace.py).  Why the constants have
these values: docs/LAYERS.md.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel

__all__ = ["add_splits", "SKINNY_MAX_M", "SMALL_WEIGHT_ELEMENTS", "SMALL_WEIGHT_MAX_M",
           "takes_tiled", "GPU_SMS", "CHUNK", "pow2_floor", "pow2_ceil", "silu", "silu_approx",
           "sum_splits"]

SKINNY_MAX_M = 16            # linear(), moe_ffn(): rows up to this use weight streaming
# ... and up to SMALL_WEIGHT_MAX_M rows (a tree verify's, a short prompt's) for a weight this
# small (elements, not bytes: a bf16 weight and its float32 widening take the same kernel, so
# the same bits): streaming it again per 16 rows (from L2) costs less than the tiled kernel,
# whose tiles leave such a weight's launch 1-8 blocks (the demo model on an H100: a 33-row
# verify's tiled launches ~25 us each against ~3 us skinny, run 143; a 192-row prefill 2.23 ->
# 0.89 ms, 256 rows 2.60 -> 1.01, 320 rows 2.93 -> 1.35, run 183).  Every Kimi-K2 weight is
# larger (its router, the smallest, 2.75 M): its prefills keep the tiled kernel
SMALL_WEIGHT_ELEMENTS = 1 << 21
SMALL_WEIGHT_MAX_M = 512


def takes_tiled(m: int, weight_elements: int) -> bool:
    """``method="auto"``'s choice for ``m`` rows of a weight (one expert's gate_up, in
    moe_ffn) of ``weight_elements``: the tiled GEMM above SKINNY_MAX_M rows, except for a weight
    of at most SMALL_WEIGHT_ELEMENTS at up to SMALL_WEIGHT_MAX_M rows.  So a small weight gives
    a row the same bits from a decode to a verify or a prefill of 512 rows, and a large one
    from 17 rows on."""
    return m > SKINNY_MAX_M and (weight_elements > SMALL_WEIGHT_ELEMENTS or
                                 m > SMALL_WEIGHT_MAX_M)
GPU_SMS = 132                # H200; only used to size grids (more SMs just means more waves)
CHUNK = 8                    # K elements per load step: one 16-byte bf16 vector, two fp32 ones


def pow2_floor(v: int) -> int:
    """The largest power of two <= v (1 for v < 2)."""
    return 1 << max(int(v), 1).bit_length() - 1


def pow2_ceil(v: int) -> int:
    """The smallest power of two >= v (1 for v < 2)."""
    return 1 << max(int(v) - 1, 0).bit_length()


@device_function
def silu(v):
    return v / (np.float32(1.0) + math.exp(-v))


if SIMULATOR:
    silu_approx = silu
else:
    from numba.cuda import libdevice

    @device_function
    def silu_approx(v):
        """silu with the division by ``div.approx.f32`` (2 ulp; 0 once 1 + e^-v > 2^126, i.e.
        v < -87, where silu is -0 in float32 anyway): IEEE division compiles to a slow-path
        subroutine call in SASS, and a call anywhere in a kernel serializes its wgmma (ptxas
        C7509).  The grouped MoE's tensor-core kernels use it at every tile, so an expert's
        rows keep their bits whichever tile (warp or warpgroup mma) computes them; their
        output is rounded to bf16, 2^16 times coarser."""
        return libdevice.fast_fdividef(v, np.float32(1.0) + math.exp(-v))


@kernel
def sum_splits(part, y):
    """y[m, n] = sum over s of part[s, m, n], in split order (the K slices of a split-K GEMM).
    A grid row per row of y (then every gridDim.y-th), a thread per column: no flat index
    to divide (a 64-bit division per element held it near 1 TB/s, run 202's Nsight
    Compute).  Launch through :func:`add_splits`."""
    n = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if n < y.shape[1]:
        m = cuda.blockIdx.y
        while m < y.shape[0]:       # a while: range's trip count would divide
            total = part[0, m, n]
            for s in range(1, part.shape[0]):
                total += part[s, m, n]
            y[m, n] = total
            m += cuda.gridDim.y


def add_splits(part, y, stream=0):
    """Launch :func:`sum_splits`: y [M, N] = the splits of part [S, M, N] added in order."""
    m, n = y.shape
    if m and n:
        sum_splits[(-(-n // 256), min(m, 65535)), 256, stream](part, y)

"""The tiled GEMM: ``linear()`` above SKINNY_MAX_M rows and the MoE experts of such steps.

Holds the shapes the heuristics pick (:func:`tiled_config`, K slices), the small device
functions the generated kernels call, and :func:`tiled_kernel`, which compiles gemm_source.py's
source for a config, weight kind and mode.  Twin: reference/layers/linear.py (the contract);
design, tolerances and measurements: docs/LAYERS.md.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.gpu.bits import bf16_bits_to_f32, bf16_hi, bf16_lo
from kdtree_numba.kernel_cache import generated_code
from kdtree_numba.gpu.memory import (ld_cached_f32x4, ld_shared_f32x4, ld_stream_f32x4,
                                     ld_stream_u32x4, store_nowrap_1d, store_nowrap_2d)
from kdtree_numba.layers.common import CHUNK, GPU_SMS, silu
from kdtree_numba.layers.gemm_source import TiledConfig, tiled_source

__all__ = ["TiledConfig", "tiled_splits", "tiled_depth", "tiled_config", "tiled_kernel"]


def tiled_splits(n: int, k: int) -> int:
    """K slices for the tiled linear, from the weight shape alone (so a row's summation order
    never depends on M): none for K < 512; else 8, doubled (up to 64, >= 8 chunks a slice)
    while fewer than two blocks per SM of nominal 128-column tiles would exist.  With >= 8
    slices a sum is at most 8*ceil(K/64) + 7 sequential adds deep, the skinny kernel's bound."""
    kc = -(-k // CHUNK)
    if kc < 64:
        return 1
    splits = 8
    while splits < 64 and -(-n // 128) * splits < 2 * GPU_SMS and kc // (2 * splits) >= 8:
        splits *= 2
    return splits


def tiled_depth(k: int, splits: int) -> int:
    """Sequential fp32 additions behind one tiled output: its K slice, then the slice sum."""
    per_split = -(-(-(-k // CHUNK)) // splits)          # ceil(ceil(k / 8) / splits) chunks
    return CHUNK * per_split + splits - 1


def tiled_config(m: int, n: int, k: int) -> TiledConfig:
    """Default tiled shape for an [m, k] x [n, k]^T product (m > SKINNY_MAX_M): one M tile of
    BM >= m rows up to 128 (tm 12 or 8, whichever pads less; M = 65 -> 3 warps of 2 x 16
    lanes, 72 x 128 tiles), else 96-row M tiles; splits from (n, k) only.  tm = 12 tiles hold
    96 accumulators: capped at 168 registers (a few bytes of spill outside the k loop, checked
    with ptxas) so that 12 warps share an SM.  Other tiles: dev/cuda/layers.py."""
    splits = tiled_splits(n, k)
    if SIMULATOR:
        return TiledConfig(wm=1, wn=1, ly=2, tm=4, tn=8, bk=8, splits=splits)
    if m > 128:
        return TiledConfig(wm=4, wn=1, ly=2, tm=12, tn=8, bk=8, splits=splits,
                           max_registers=168)
    tm = min((12, 8), key=lambda t: (-(-m // (2 * t)) * 2 * t, -t))
    wm = -(-m // (2 * tm))
    # one- and two-warp tiles stage 4x / 2x the vectors per thread: left uncapped (they spill)
    return TiledConfig(wm=wm, wn=1, ly=2, tm=tm, tn=8, bk=8, splits=splits,
                       max_registers=168 if tm == 12 and wm >= 3 else 0)


@device_function
def _ld4_f32_scalar(a, row, k, k_end):
    """a[row, k:k+4] by scalar loads, zero at and past k_end."""
    z = np.float32(0.0)
    return (a[row, k] if k < k_end else z, a[row, k + 1] if k + 1 < k_end else z,
            a[row, k + 2] if k + 2 < k_end else z, a[row, k + 3] if k + 3 < k_end else z)


@device_function
def _ld4_bf16_scalar(w16, row, k, k_end):
    z = np.float32(0.0)
    return (bf16_bits_to_f32(w16[row, k]) if k < k_end else z,
            bf16_bits_to_f32(w16[row, k + 1]) if k + 1 < k_end else z,
            bf16_bits_to_f32(w16[row, k + 2]) if k + 2 < k_end else z,
            bf16_bits_to_f32(w16[row, k + 3]) if k + 3 < k_end else z)


# Small device functions the generated tiled kernels call with constant offsets: after NVVM
# inlines them the offsets are constants again (the accumulators stay in registers), and numba
# types one call instead of 4-8 statements, which is what compile time scales with.
@device_function
def _fma_row8(acc, base, a, b0, b1):
    """acc[base + j] += a * (b0 ++ b1)[j], j < 8, in j order."""
    acc[base] += a * b0[0]
    acc[base + 1] += a * b0[1]
    acc[base + 2] += a * b0[2]
    acc[base + 3] += a * b0[3]
    acc[base + 4] += a * b1[0]
    acc[base + 5] += a * b1[1]
    acc[base + 6] += a * b1[2]
    acc[base + 7] += a * b1[3]


@device_function
def _fma_row4(acc, base, a, b0, b1):
    """acc[base + j] += a * b0[j], j < 4 (b1 unused)."""
    acc[base] += a * b0[0]
    acc[base + 1] += a * b0[1]
    acc[base + 2] += a * b0[2]
    acc[base + 3] += a * b0[3]


@device_function
def _stage4(buf, off, stride, v):
    """Scatter one staged 4-vector down a column of the transposed tile."""
    store_nowrap_1d(buf, off, v[0])
    store_nowrap_1d(buf, off + stride, v[1])
    store_nowrap_1d(buf, off + 2 * stride, v[2])
    store_nowrap_1d(buf, off + 3 * stride, v[3])


@device_function
def _stage8_bf16(buf, off, stride, q):
    """The same for four uint32 words = eight bf16, widened."""
    store_nowrap_1d(buf, off, bf16_lo(q[0]))
    store_nowrap_1d(buf, off + stride, bf16_hi(q[0]))
    store_nowrap_1d(buf, off + 2 * stride, bf16_lo(q[1]))
    store_nowrap_1d(buf, off + 3 * stride, bf16_hi(q[1]))
    store_nowrap_1d(buf, off + 4 * stride, bf16_lo(q[2]))
    store_nowrap_1d(buf, off + 5 * stride, bf16_hi(q[2]))
    store_nowrap_1d(buf, off + 6 * stride, bf16_lo(q[3]))
    store_nowrap_1d(buf, off + 7 * stride, bf16_hi(q[3]))


@device_function
def _put_if(out, row, col, limit, v):
    if col < limit:
        store_nowrap_2d(out, row, col, v)


@device_function
def _store_row8(out, row, col, gstride, limit, acc, base):
    """out[row, col + j] = acc[base + j] (second float4 group at col + gstride), inside limit."""
    _put_if(out, row, col, limit, acc[base])
    _put_if(out, row, col + 1, limit, acc[base + 1])
    _put_if(out, row, col + 2, limit, acc[base + 2])
    _put_if(out, row, col + 3, limit, acc[base + 3])
    _put_if(out, row, col + gstride, limit, acc[base + 4])
    _put_if(out, row, col + gstride + 1, limit, acc[base + 5])
    _put_if(out, row, col + gstride + 2, limit, acc[base + 6])
    _put_if(out, row, col + gstride + 3, limit, acc[base + 7])


@device_function
def _store_row4(out, row, col, gstride, limit, acc, base):
    _put_if(out, row, col, limit, acc[base])
    _put_if(out, row, col + 1, limit, acc[base + 1])
    _put_if(out, row, col + 2, limit, acc[base + 2])
    _put_if(out, row, col + 3, limit, acc[base + 3])


@device_function
def _store_row_silu(out, row, col, limit, acc, base):
    """out[row, col + j] = silu(gate) * up, gate = acc[base + j], up = acc[base + 4 + j]."""
    _put_if(out, row, col, limit, silu(acc[base]) * acc[base + 4])
    _put_if(out, row, col + 1, limit, silu(acc[base + 1]) * acc[base + 5])
    _put_if(out, row, col + 2, limit, silu(acc[base + 2]) * acc[base + 6])
    _put_if(out, row, col + 3, limit, silu(acc[base + 3]) * acc[base + 7])


_TILED_LOADS = {"f32": (ld_stream_f32x4, ld_cached_f32x4),
                "bf16": (ld_stream_u32x4, ld_cached_f32x4),
                "f32s": (_ld4_f32_scalar, _ld4_f32_scalar),
                "bf16s": (_ld4_bf16_scalar, _ld4_f32_scalar)}


def tiled_kernel(cfg: TiledConfig, wkind: str, mode: str = "linear"):
    """The tiled kernel for a load kind ("f32", "bf16", "f32s", "bf16s") and mode.  The K
    slice count is a launch argument: configs that differ only in it share one kernel."""
    return _tiled_kernel_for(dataclasses.replace(cfg, splits=1), wkind, mode)


@kernel_factory
def _tiled_kernel_for(cfg: TiledConfig, wkind: str, mode: str):
    if mode == "gate_up" and cfg.tn != 8:
        raise ValueError("the gate_up kernel pairs gate and up columns: it needs tn = 8")
    ldw, ldx = _TILED_LOADS[wkind]
    # i64(constant): a plain int64 argument; a bare literal would make numba compile one
    # specialisation of the device function per distinct value (most of the compile time).
    namespace = {"cuda": cuda, "np": np, "i64": np.int64, "ldw": ldw, "ldx": ldx,
                 "lds": ld_shared_f32x4,
                 "stage4": _stage4, "stage8": _stage8_bf16, "store_silu": _store_row_silu,
                 "fma_row": _fma_row8 if cfg.tn == 8 else _fma_row4,
                 "store_row": _store_row8 if cfg.tn == 8 else _store_row4}
    src = tiled_source(cfg, wkind, mode)
    generated_code(src, f"tiled {mode} {wkind} {cfg}", namespace)
    options = {"max_registers": cfg.max_registers} if cfg.max_registers else {}
    return kernel(namespace["tiled"], **options)

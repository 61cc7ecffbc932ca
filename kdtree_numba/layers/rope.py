"""``rope`` on the GPU: rotary embeddings (YaRN included), angles and rotation in float64.

Twin: reference/layers/rope.py, which also owns :class:`RopeSpec` and :class:`YarnScaling`
(the tables are computed there, on the host).  Design and tolerance: docs/LAYERS.md.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from kdtree_numba.compat import (SIMULATOR, block_size_options, cuda, kernel, kernel_factory,
                                 to_device)
from kdtree_numba.layers.workspace import device_f32, result_array
from reference.layers import RopeSpec, YarnScaling

__all__ = ["RopeSpec", "YarnScaling", "rope", "rope_tables"]


@kernel_factory
def _rope_kernel(half: int, interleave: bool, threads: int):
    @kernel(**block_size_options(threads))           # up to 1024 threads (it needs 40 registers)
    def rope_rows(x, positions, inv_freq, amplitude, y):
        """One block per token: cos/sin of p*inv_freq in float64 once per token (shared), then
        every head's pairs rotated in float64 and rounded once to float32."""
        cs = cuda.shared.array(half, np.float64)
        sn = cuda.shared.array(half, np.float64)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        p = np.float64(positions[row])
        for i in range(t, half, threads):
            angle = p * inv_freq[i]
            cs[i] = math.cos(angle) * amplitude
            sn[i] = math.sin(angle) * amplitude
        cuda.syncthreads()
        for q in range(t, x.shape[1] * half, threads):
            h = q // half
            i = q - h * half
            if interleave:
                a = np.float64(x[row, h, 2 * i])
                b = np.float64(x[row, h, 2 * i + 1])
            else:
                a = np.float64(x[row, h, i])
                b = np.float64(x[row, h, i + half])
            y[row, h, i] = np.float32(a * cs[i] - b * sn[i])
            y[row, h, i + half] = np.float32(b * cs[i] + a * sn[i])
    return rope_rows


@functools.cache
def rope_tables(spec: RopeSpec):
    """(inv_freq on the device, float64; amplitude), copied once per spec and process."""
    return to_device(spec.inv_freq()), float(spec.amplitude())


def rope(x, positions, spec: RopeSpec, *, out=None, stream=0, workspace=None):
    """See reference.rope.  ``x`` may be a strided view (e.g. the rope part of q); ``out`` must
    not alias ``x``.  Angles and rotation in float64 (inv_freq computed on the host in float64
    by the reference code), so results match the reference to ~1 float32 ulp."""
    xd = device_f32(x, "x", 3, stream)
    pd = to_device(positions, stream=stream)
    m, h, dr = xd.shape
    if dr != spec.head_dim or tuple(pd.shape) != (m,):
        raise ValueError(f"rope wants x [M, H, {spec.head_dim}] and positions [M], got "
                         f"{xd.shape}, {pd.shape}")
    inv_freq, amplitude = rope_tables(spec)
    y = result_array(out, (m, h, dr), np.float32, stream)
    if m:
        # a thread per pair up to 1024 (a decode's 64 heads x 32 pairs: two pairs a thread);
        # the loop over pairs waits for each load in turn, so fewer threads cost latency
        pairs = h * (dr // 2)
        threads = 32 if SIMULATOR else min(1024, 32 * -(-pairs // 32))
        _rope_kernel(dr // 2, spec.interleave, threads)[m, threads, stream](
            xd, pd, inv_freq, amplitude, y)
    return y

"""``rope`` on the GPU: rotary embeddings (YaRN included), angles and rotation in float64.

Twin: reference/layers/rope.py, which also owns :class:`RopeSpec` and :class:`YarnScaling`
(the tables are computed there, on the host).  Design and tolerance: docs/LAYERS.md.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from kdtree_numba.compat import (SIMULATOR, block_size_options, cuda, device_function, kernel,
                                 kernel_factory, to_device)
from kdtree_numba.layers.workspace import device_f32, result_array
from reference.layers import RopeSpec, YarnScaling

__all__ = ["RopeSpec", "YarnScaling", "rope", "rope_tables", "rope_angle", "fill_rope_table",
           "pair_columns", "rotate_pair"]


# The arithmetic every rope kernel shares (this one, and the fused latents and q split of
# layers/latents.py): float64 angles and rotation, one rounding to float32, so each matches
# the reference to ~1 float32 ulp.

@device_function
def rope_angle(p, inv_freq_i, amplitude):
    """(cos, sin) of the angle p * inv_freq_i, each times the YaRN amplitude (float64)."""
    angle = p * inv_freq_i
    return math.cos(angle) * amplitude, math.sin(angle) * amplitude


@device_function
def fill_rope_table(cs, sn, p, inv_freq, amplitude, t, threads, half):
    """A block's shared cos/sin table of position p: thread t fills pairs t, t + threads, ..."""
    for i in range(t, half, threads):
        cs[i], sn[i] = rope_angle(p, inv_freq[i], amplitude)


@device_function
def pair_columns(i, half, interleave):
    """The two columns rotated together as pair i: (2i, 2i + 1) interleaved, else
    (i, i + half) (NeoX halves)."""
    if interleave:
        return 2 * i, 2 * i + 1
    return i, i + half


@device_function
def rotate_pair(a, b, c, s):
    """Pair (a, b) (float64) rotated by (c, s): the two float32 outputs, at columns i and
    i + half of the result."""
    return np.float32(a * c - b * s), np.float32(b * c + a * s)


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
        fill_rope_table(cs, sn, np.float64(positions[row]), inv_freq, amplitude, t, threads,
                        half)
        cuda.syncthreads()
        for q in range(t, x.shape[1] * half, threads):
            h = q // half
            i = q - h * half
            ia, ib = pair_columns(i, half, interleave)
            y[row, h, i], y[row, h, i + half] = rotate_pair(
                np.float64(x[row, h, ia]), np.float64(x[row, h, ib]), cs[i], sn[i])
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

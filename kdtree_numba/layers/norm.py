"""``rmsnorm`` and ``add_rmsnorm`` on the GPU: one block per row, fp32 sum of squares, the
row in registers; ``add_rmsnorm`` adds the residual to the row as it loads it and writes the
sum beside the norm (one launch and one pass where ``x + delta`` then ``rmsnorm`` took two).

Twin: reference/layers/norm.py; tolerance and design: docs/LAYERS.md.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory
from kdtree_numba.gpu.bits import bf16_bits_to_f32
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
from kdtree_numba.layers.workspace import device_f32, device_weight, result_array

__all__ = ["rmsnorm", "add_rmsnorm", "norm_threads", "MAX_PER_THREAD"]


def norm_threads():
    """A norm's block (the fused MLA latents' too: attention/latents.py sums as this does)."""
    return 32 if SIMULATOR else 256


# Values a thread keeps in registers (row width <= MAX_PER_THREAD * threads: Kimi's 7168 at
# 256 threads takes 28); wider rows take the loop kernel.
MAX_PER_THREAD = 32


@kernel_factory
def _rmsnorm_kernel(threads: int, is_bf16: bool, per_thread: int, add: bool = False):
    """One block per row.  ``per_thread`` > 0: the thread's ``per_thread`` values (columns
    t + k*threads) are loaded at once into registers, all loads in flight together, and scaled
    from there: one pass over x and one round trip of memory latency, where a loop waits for
    each load in turn (a one-row norm is all latency); the weight's values are loaded beside
    them.  0: the loop, for rows wider than MAX_PER_THREAD * threads.  Both add a thread's
    squares in the same order (k ascending), so they give the same bits.  ``add``: the row is
    ``x + delta`` (one fp32 add per value, the same rounding as a separate add), written to
    ``s`` as it is loaded; without it ``delta`` and ``s`` are placeholders, never touched."""
    block_reduce = make_block_reduce(1, threads)
    warps = threads // 32
    scr = block_reduce_scratch_shape(1, threads)
    red_shape = (warps + 1, 1)
    regs = max(per_thread, 1)

    @kernel
    def rmsnorm_rows(x, delta, s, weight, y, eps):
        """fp32 sum of squares (a thread's in column order, then the butterfly), then
        w * (x * inv_rms); with ``add`` x + delta for x, stored to s."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        acc = cuda.local.array(1, np.float32)
        vals = cuda.local.array(regs, np.float32)
        wvals = cuda.local.array(regs, np.float32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        d_total = x.shape[1]
        ss = np.float32(0.0)
        if per_thread:
            for k in range(per_thread):   # unrolled: independent loads, clamped in bounds
                d = min(t + k * threads, d_total - 1)
                v = x[row, d] + delta[row, d] if add else x[row, d]
                vals[k] = v if t + k * threads < d_total else np.float32(0.0)
                # the weight's loads go out with x's, so their latency (HBM: a decode step
                # streams gigabytes past L2) overlaps the sum's instead of following it
                wvals[k] = bf16_bits_to_f32(weight[d]) if is_bf16 else weight[d]
            for k in range(per_thread):
                ss += vals[k] * vals[k]
        else:
            for d in range(t, d_total, threads):
                v = x[row, d] + delta[row, d] if add else x[row, d]
                if add:
                    s[row, d] = v
                ss += v * v
        acc[0] = ss
        block_reduce(acc, red, scratch)
        inv = np.float32(1.0) / math.sqrt(red[warps, 0] / np.float32(d_total) + eps)
        if per_thread:
            for k in range(per_thread):
                d = t + k * threads
                if d < d_total:
                    if add:
                        s[row, d] = vals[k]
                    y[row, d] = wvals[k] * (vals[k] * inv)
        else:
            for d in range(t, d_total, threads):
                wv = bf16_bits_to_f32(weight[d]) if is_bf16 else weight[d]
                # the sum this thread stored above (its own columns: no barrier needed)
                v = s[row, d] if add else x[row, d]
                y[row, d] = wv * (v * inv)
    return rmsnorm_rows


def _launch_norm(xd, delta, s, weight, eps: float, out, stream):
    """y = rmsnorm(xd (+ delta, stored to s), weight) by one launch; delta and s None for
    the plain norm."""
    wd, kind = device_weight(weight, stream)
    if tuple(wd.shape) != (xd.shape[1],):
        raise ValueError(f"rmsnorm wants weight [{xd.shape[1]}], got {wd.shape}")
    y = result_array(out, xd.shape, np.float32, stream)
    if xd.shape[0]:
        threads = norm_threads()
        per_thread = -(-xd.shape[1] // threads)
        if per_thread > MAX_PER_THREAD:
            per_thread = 0
        add = delta is not None
        # without the add, x stands for delta and s (the kernel never touches them)
        _rmsnorm_kernel(threads, kind == "bf16", per_thread, add)[
            xd.shape[0], threads, stream](xd, delta if add else xd, s if add else xd, wd, y,
                                          np.float32(eps))
    return y


def rmsnorm(x, weight, eps: float, *, out=None, stream=0, workspace=None):
    """See reference.rmsnorm.  Tolerance: 2e-6 relative (fp32 sum of squares)."""
    return _launch_norm(device_f32(x, "x", 2, stream), None, None, weight, eps, out, stream)


def add_rmsnorm(x, delta, weight, eps: float, *, out=None, sum_out=None, stream=0,
                workspace=None):
    """See reference.add_rmsnorm: ``(s, y)`` with ``s = x + delta`` (bitwise the float32 add)
    and ``y = rmsnorm(s)`` (bitwise :func:`rmsnorm` of s), in one launch.  ``sum_out`` /
    ``out``: result arrays for s / y (new ones otherwise); ``sum_out`` may be x itself, an
    in-place residual (each element is read, then written, by one thread), or a strided view
    (the model's features columns, KDTREE_FEWER_LAUNCHES)."""
    xd = device_f32(x, "x", 2, stream)
    dd = device_f32(delta, "delta", 2, stream)
    if tuple(dd.shape) != tuple(xd.shape):
        raise ValueError(f"add_rmsnorm wants x and delta of one shape, got {tuple(xd.shape)} "
                         f"and {tuple(dd.shape)}")
    # the simulator's arrays are NumPy (as mla_latents' store): the kernel writes a device
    # array whose values come back into the host sum_out
    host = sum_out if SIMULATOR and isinstance(sum_out, np.ndarray) else None
    s = result_array(None if host is not None else sum_out, xd.shape, np.float32, stream)
    y = _launch_norm(xd, dd, s, weight, eps, out, stream)
    if host is not None:
        host[...] = s.copy_to_host(stream=stream)
    return s, y

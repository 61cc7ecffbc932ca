"""``mla_latents`` and ``mla_q_split`` on the GPU: an MLA layer's work between its projections,
one launch each.

The numba twins of reference/layers/latents.py (the contract).  Done by parts, the latents
are four launches (the q_a norm, the kv norm, a copy of the rope columns, the rope) and the
query split two (a copy of the no-rope columns, the rope); at the demo model's widths each of
them is little more than its launch, so together they were about a fifth of a decode step.
Here one block per token does each whole, with the arithmetic of the parts: each norm sums a
thread's squares in the order ``layers/norm.py`` does, over the same number of threads, and
both go through one block reduction whose summation tree depends only on the thread count
(gpu/reduce.py), and the rope's angles and products are rope.py's in float64; so
the results are bitwise those of the parts (tests/test_latents.py checks it), and a model
gives the same tokens with the fused ops or without (``KDTREE_FUSED_LATENTS``,
kdtree_numba/runtime.py, on by default; run 147 checked the bits on an H100).
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory, to_device
from kdtree_numba.gpu.bits import bf16_bits_to_f32
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
from kdtree_numba.gpu.tensorcore import pack_bf16x2
from kdtree_numba.layers.norm import MAX_PER_THREAD, norm_threads
from kdtree_numba.layers.rope import (fill_rope_table, pair_columns, rope_angle, rope_tables,
                                       rotate_pair)
from kdtree_numba.layers.workspace import device_f32, device_weight, result_array

__all__ = ["mla_latents", "mla_q_split"]


@kernel_factory
def _latents_kernel(threads: int, per_q: int, per_c: int, q_bf16: bool, c_bf16: bool,
                    half: int, interleave: bool, store: str = ""):
    """One block per token.  ``per_q`` / ``per_c``: the values of the q / kv segment a thread
    keeps in registers (columns t + k*threads, as layers/norm.py's kernel loads them; per_q 0:
    no q LoRA).  ``store``: "" (c [M, r] and k_pe [M, 1, dr] of their own), "f32" or "bf16"
    (c and k_pe are a cache layer's [slots, r] and [slots, dr], row ``rows[token]``, float32
    or bf16 bits rounded to nearest even as the cache's own write rounds)."""
    bits = store == "bf16"
    block_reduce = make_block_reduce(2, threads)
    warps = threads // 32
    scr = block_reduce_scratch_shape(2, threads)
    red_shape = (warps + 1, 2)
    rq, rc = max(per_q, 1), max(per_c, 1)

    @kernel
    def latents_rows(x, q_w, c_w, positions, inv_freq, amplitude, q_a, c, k_pe, rows, eps):
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        acc = cuda.local.array(2, np.float32)
        qv = cuda.local.array(rq, np.float32)
        qw = cuda.local.array(rq, np.float32)
        cv = cuda.local.array(rc, np.float32)
        cw = cuda.local.array(rc, np.float32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        dst = rows[row] if store else row           # the token's row in c and k_pe
        q_lora = q_a.shape[1] if per_q else 0
        r = c.shape[1]
        # every load first (independent, in flight together), then the sums in column order
        for k in range(per_q):
            d = t + k * threads
            dd = min(d, q_lora - 1)
            qv[k] = x[row, dd] if d < q_lora else np.float32(0.0)
            qw[k] = bf16_bits_to_f32(q_w[dd]) if q_bf16 else q_w[dd]
        for k in range(per_c):
            d = t + k * threads
            dd = min(d, r - 1)
            cv[k] = x[row, q_lora + dd] if d < r else np.float32(0.0)
            cw[k] = bf16_bits_to_f32(c_w[dd]) if c_bf16 else c_w[dd]
        sq = np.float32(0.0)
        for k in range(per_q):
            sq += qv[k] * qv[k]
        sc = np.float32(0.0)
        for k in range(per_c):
            sc += cv[k] * cv[k]
        # the rope key while the sums wait: a thread per pair, layers/rope.py's arithmetic
        p = np.float64(positions[row])
        base = q_lora + r
        for i in range(t, half, threads):
            cs, sn = rope_angle(p, inv_freq[i], amplitude)
            ia, ib = pair_columns(i, half, interleave)
            lo, hi = rotate_pair(np.float64(x[row, base + ia]), np.float64(x[row, base + ib]),
                                 cs, sn)
            if not store:
                k_pe[dst, 0, i] = lo
                k_pe[dst, 0, i + half] = hi
            elif bits:
                k_pe[dst, i] = np.uint16(pack_bf16x2(lo, hi) & 0xFFFF)
                k_pe[dst, i + half] = np.uint16(pack_bf16x2(hi, lo) & 0xFFFF)
            else:
                k_pe[dst, i] = lo
                k_pe[dst, i + half] = hi
        acc[0] = sq
        acc[1] = sc
        block_reduce(acc, red, scratch)
        if per_q:
            inv_q = np.float32(1.0) / math.sqrt(red[warps, 0] / np.float32(q_lora) + eps)
            for k in range(per_q):
                d = t + k * threads
                if d < q_lora:
                    q_a[row, d] = qw[k] * (qv[k] * inv_q)
        inv_c = np.float32(1.0) / math.sqrt(red[warps, 1] / np.float32(r) + eps)
        for k in range(per_c):
            d = t + k * threads
            if d < r:
                v = cw[k] * (cv[k] * inv_c)
                if bits:
                    c[dst, d] = np.uint16(pack_bf16x2(v, v) & 0xFFFF)
                else:
                    c[dst, d] = v
    return latents_rows


@kernel_factory
def _q_split_kernel(threads: int, half: int, interleave: bool):
    @kernel
    def q_split_rows(q, positions, inv_freq, amplitude, q_nope, q_pe):
        """One block per token: cos/sin once (shared, float64), then every head's no-rope
        columns copied and its rope pairs rotated (layers/rope.py's arithmetic)."""
        cs = cuda.shared.array(half, np.float64)
        sn = cuda.shared.array(half, np.float64)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        heads, dn = q_nope.shape[1], q_nope.shape[2]
        for j in range(t, heads * dn, threads):
            h = j // dn
            q_nope[row, h, j - h * dn] = q[row, h, j - h * dn]
        fill_rope_table(cs, sn, np.float64(positions[row]), inv_freq, amplitude, t, threads,
                        half)
        cuda.syncthreads()
        for j in range(t, heads * half, threads):
            h = j // half
            i = j - h * half
            ia, ib = pair_columns(i, half, interleave)
            q_pe[row, h, i], q_pe[row, h, i + half] = rotate_pair(
                np.float64(q[row, h, dn + ia]), np.float64(q[row, h, dn + ib]), cs[i], sn[i])
    return q_split_rows


def _per_thread(width: int, threads: int) -> int:
    per = -(-width // threads)
    if per > MAX_PER_THREAD:
        raise ValueError(f"mla_latents: a segment of {width} columns is wider than "
                         f"{MAX_PER_THREAD * threads} (the registers a thread keeps)")
    return per


def mla_latents(x, q_norm, kv_norm, positions, spec, eps: float, *, q_lora: int, rank: int,
                into=None, stream=0, workspace=None):
    """See reference.layers.mla_latents: ``(q_a, c, k_pe)`` in one launch, bitwise what the
    norms and the rope give by parts (module docstring).  ``into`` (a kvcache.LatentStore):
    c and k_pe go straight to its rows (a cache layer; bf16 bits for a bf16 cache, rounded
    as KVCache.write rounds) and come back as None: the two scatters into the cache that
    followed are gone too."""
    xd = device_f32(x, "x", 2, stream)
    pd = to_device(positions, stream=stream)
    m, dr = xd.shape[0], spec.head_dim
    if xd.shape[1] != q_lora + rank + dr or tuple(pd.shape) != (m,) or \
            (q_lora == 0) != (q_norm is None):
        raise ValueError(f"mla_latents wants x [M, {q_lora} + {rank} + {dr}], positions [M] "
                         f"and a q norm exactly when q_lora > 0, got x {tuple(xd.shape)}, "
                         f"positions {tuple(pd.shape)}")
    cw, c_kind = device_weight(kv_norm, stream)
    qw, q_kind = device_weight(q_norm, stream) if q_lora else (cw, c_kind)
    if tuple(cw.shape) != (rank,) or tuple(qw.shape) != ((q_lora,) if q_lora else (rank,)):
        raise ValueError(f"mla_latents wants norm weights [{q_lora}] and [{rank}], got "
                         f"{tuple(qw.shape)} and {tuple(cw.shape)}")
    threads = norm_threads()
    per_q, per_c = _per_thread(q_lora, threads), _per_thread(rank, threads)
    store = ""
    if into is None:
        c = result_array(None, (m, rank), np.float32, stream)
        k_pe = result_array(None, (m, 1, dr), np.float32, stream)
        rows = pd                                    # a placeholder, never read
    else:
        c, k_pe, rows = (to_device(a, stream=stream) for a in (into.c, into.k_pe, into.rows))
        store = "bf16" if np.dtype(c.dtype) == np.uint16 else "f32"
        if tuple(c.shape[1:]) != (rank,) or tuple(k_pe.shape[1:]) != (dr,) or \
                tuple(rows.shape) != (m,) or c.dtype != k_pe.dtype or \
                np.dtype(c.dtype) not in (np.float32, np.uint16):
            raise ValueError(f"mla_latents wants a store of c [S, {rank}], k_pe [S, {dr}] "
                             f"(float32 or uint16 bf16 bits) and rows [{m}], got "
                             f"{tuple(c.shape)} {c.dtype}, {tuple(k_pe.shape)} {k_pe.dtype}, "
                             f"{tuple(rows.shape)}")
    # without a q LoRA a 2-d placeholder the kernel never touches
    q_a = result_array(None, (m, q_lora), np.float32, stream) if q_lora else c
    if m:
        inv_freq, amplitude = rope_tables(spec)
        _latents_kernel(threads, per_q, per_c, q_kind == "bf16", c_kind == "bf16", dr // 2,
                        spec.interleave, store)[m, threads, stream](
            xd, qw, cw, pd, inv_freq, amplitude, q_a, c, k_pe, rows, np.float32(eps))
    if into is not None:
        # a host store (the simulator's cache arrays are NumPy): the kernel wrote a device
        # copy; its rows come back in place
        for store, written in ((into.c, c), (into.k_pe, k_pe)):
            if isinstance(store, np.ndarray):
                store[...] = written.copy_to_host(stream=stream)
        c = k_pe = None
    return (q_a if q_lora else None), c, k_pe


def mla_q_split(q, positions, spec, *, dn: int, stream=0, workspace=None):
    """See reference.attention.mla_q_split: ``(q_nope, q_pe)`` in one launch."""
    qd = device_f32(q, "q", 3, stream)
    pd = to_device(positions, stream=stream)
    m, heads, width = qd.shape
    dr = spec.head_dim
    if width != dn + dr or tuple(pd.shape) != (m,):
        raise ValueError(f"mla_q_split wants q [M, H, {dn} + {dr}] and positions [M], got "
                         f"{tuple(qd.shape)}, {tuple(pd.shape)}")
    q_nope = result_array(None, (m, heads, dn), np.float32, stream)
    q_pe = result_array(None, (m, heads, dr), np.float32, stream)
    if m:
        inv_freq, amplitude = rope_tables(spec)
        # a thread per copied column up to 1024 (Kimi: 64 heads x 128 columns, 8 a thread)
        threads = 32 if SIMULATOR else min(1024, 32 * -(-heads * max(dn, dr // 2) // 32))
        _q_split_kernel(threads, dr // 2, spec.interleave)[m, threads, stream](
            qd, pd, inv_freq, amplitude, q_nope, q_pe)
    return q_nope, q_pe

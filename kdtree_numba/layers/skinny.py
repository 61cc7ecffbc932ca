"""The skinny (weight-streaming) GEMM: ``linear()`` and the MoE experts up to SKINNY_MAX_M rows.

``y[m, n] = sum_k x[m, k] w[n, k]``: each block streams a few weight rows once (16-byte loads)
and applies them to a few rows of x, so the weights come from HBM about once per call.  Holds
the weight and x loaders (one per weight kind), the generated accumulate loop, SkinnyConfig
and the shapes the heuristics pick, and the ``linear`` kernel; moe.py builds its expert kernels
from the same accumulate loop, which also reads int4-group weights (W4A16: kinds "i4" / "i4s",
the nibbles unpacked and scaled in registers, weights streamed once).  Twin: reference/layers/linear.py (the contract).  Design,
tolerances and measurements: docs/LAYERS.md.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.gpu.bits import bf16_bits_to_f32, bf16_hi, bf16_lo, bits_to_f32
from kdtree_numba.kernel_cache import generated_code
from kdtree_numba.gpu.memory import (cp_async_commit, cp_async_u16x2, cp_async_u32x4,
                                     cp_async_wait_1, cp_async_wait_2, cp_async_wait_3,
                                     cp_async_wait_4, global_row_address, ld_cached_f32x4,
                                     ld_shared_word,
                                     ld_shared_words4, ld_stream_f32x4, ld_stream_u32x4)
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
from kdtree_numba.layers.common import CHUNK, GPU_SMS, pow2_ceil, pow2_floor, silu

__all__ = ["SkinnyConfig", "ROWS_UNROLL", "skinny_threads", "skinny_config", "mt_for",
           "skinny_kind", "swiglu_config", "make_accumulate", "make_skinny_block",
           "skinny_linear_kernel", "I4_CHUNK", "INT4_KINDS", "int4_threads", "int4_chunks"]


@device_function
def _load_w8_f32(w, n, j):
    """Elements [8j, 8j+8) of float32 weight row n."""
    a = ld_stream_f32x4(w, n, CHUNK * j)
    b = ld_stream_f32x4(w, n, CHUNK * j + 4)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


@device_function
def _load_w8_bf16(w32, n, j):
    """Elements [8j, 8j+8) of bf16 weight row n, given the row as uint32 words [N, K/2]."""
    q = ld_stream_u32x4(w32, n, 4 * j)
    return (bf16_lo(q[0]), bf16_hi(q[0]), bf16_lo(q[1]), bf16_hi(q[1]),
            bf16_lo(q[2]), bf16_hi(q[2]), bf16_lo(q[3]), bf16_hi(q[3]))


@device_function
def _load8_cached(w, n, j):
    """Elements [8j, 8j+8) of float32 row n through L1: every x chunk (x rows are read by many
    blocks), and the weight chunks of variant f32_load="cached" (the second 16-byte half of
    each lane's 32 bytes may then hit the sector the first half brought in)."""
    a = ld_cached_f32x4(w, n, CHUNK * j)
    b = ld_cached_f32x4(w, n, CHUNK * j + 4)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


# float32 weights, f32_load="xchg" (the default).  A lane owns 8 consecutive floats (32 bytes)
# per chunk, so the two plain 16-byte loads of a warp each touch 32 sectors and use half of
# each: with L1 bypassed every sector crosses from L2 twice, and fp32 streaming stalls well
# below bf16's rate (one dense 16-byte load per lane).  Here the lower
# half-warp loads the first halves and the upper half-warp the second halves of the 32 chunks
# of the warp's 1 KB span (two fully dense 512-byte loads), and one xor-16 exchange of four
# floats gives every lane its own chunk back.  Same elements per lane, same order: results are
# bit-identical to the plain loads.  Needs every lane of the warp present (the accumulate loop
# keeps its trip count warp-uniform for this kind).
def _make_load_w8_f32_xchg(exchange4):
    def load(w, n, j, lane, c1, scratch):
        # Chunks past c1 are clamped to c1 - 1 (in bounds, no branch before the exchange):
        # such values only ever reach lanes whose own chunk is past c1, which add nothing.
        hi = lane >> 4
        ja = min(j - lane + (lane & 15), c1 - 1)     # chunk this lane half-loads for lanes 0-15
        jb = min(j - lane + (lane & 15) + 16, c1 - 1)   # ... and for lanes 16-31
        a = ld_stream_f32x4(w, n, CHUNK * ja + 4 * hi)
        b = ld_stream_f32x4(w, n, CHUNK * jb + 4 * hi)
        up = hi != 0
        r = exchange4(b[0] if not up else a[0], b[1] if not up else a[1],
                      b[2] if not up else a[2], b[3] if not up else a[3], scratch)
        if up:      # own chunk is jb: its first half came from lane - 16
            return (r[0], r[1], r[2], r[3], b[0], b[1], b[2], b[3])
        return (a[0], a[1], a[2], a[3], r[0], r[1], r[2], r[3])
    return device_function(load)


if SIMULATOR:   # no shuffles: load the lane's own chunk directly (same values)
    @device_function
    def _load_w8_f32_xchg(w, n, j, lane, c1, scratch):
        if j < c1:
            return _load_w8_f32(w, n, j)
        z = np.float32(0.0)
        return (z, z, z, z, z, z, z, z)
else:
    from kdtree_numba.gpu.warp import shfl_xor16_f32x4

    _load_w8_f32_xchg = _make_load_w8_f32_xchg(shfl_xor16_f32x4)


@device_function
def _load_w8_f32_scalar(w, n, j):
    """The same 8 elements by scalar loads, zero past the row end (any K, any alignment)."""
    k0 = CHUNK * j
    k_total = w.shape[1]
    return (w[n, k0] if k0 < k_total else np.float32(0.0),
            w[n, k0 + 1] if k0 + 1 < k_total else np.float32(0.0),
            w[n, k0 + 2] if k0 + 2 < k_total else np.float32(0.0),
            w[n, k0 + 3] if k0 + 3 < k_total else np.float32(0.0),
            w[n, k0 + 4] if k0 + 4 < k_total else np.float32(0.0),
            w[n, k0 + 5] if k0 + 5 < k_total else np.float32(0.0),
            w[n, k0 + 6] if k0 + 6 < k_total else np.float32(0.0),
            w[n, k0 + 7] if k0 + 7 < k_total else np.float32(0.0))


@device_function
def _bf16_at(w16, n, k):
    return bf16_bits_to_f32(w16[n, k]) if k < w16.shape[1] else np.float32(0.0)


@device_function
def _load_w8_bf16_scalar(w16, n, j):
    """Scalar-load twin of _load_w8_bf16; the row is given as uint16 bits [N, K]."""
    k0 = CHUNK * j
    return (_bf16_at(w16, n, k0), _bf16_at(w16, n, k0 + 1), _bf16_at(w16, n, k0 + 2),
            _bf16_at(w16, n, k0 + 3), _bf16_at(w16, n, k0 + 4), _bf16_at(w16, n, k0 + 5),
            _bf16_at(w16, n, k0 + 6), _bf16_at(w16, n, k0 + 7))


# Weight kinds: "f32" / "bf16" stream 16-byte vectors (K % 8 == 0, C-contiguous, 16-byte
# aligned; bf16 rows passed as uint32 words); "f32s" / "bf16s" are the scalar-load fallback for
# any other shape (bf16 rows as uint16).  All kinds add the same products in the same order.
# The skinny kernels load float32 vectors one of three ways (SkinnyConfig.f32_load): "f32x"
# (xchg, default), "f32" (stream: the plain loads) or "f32c" (cached: through L1).
_LOAD_W8 = {"f32": _load_w8_f32, "f32x": _load_w8_f32_xchg, "f32c": _load8_cached,
            "bf16": _load_w8_bf16, "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_bf16_scalar}
_LOAD_X8 = {"f32": _load8_cached, "f32x": _load8_cached, "f32c": _load8_cached,
            "bf16": _load8_cached, "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_f32_scalar,
            "i4": _load8_cached, "i4s": _load_w8_f32_scalar}
_F32_LOAD_KIND = {"xchg": "f32x", "stream": "f32", "cached": "f32c"}


def skinny_kind(load_kind: str, f32_load: str) -> str:
    """The accumulate kind for a load kind: float32 vectors take the configured variant."""
    return _F32_LOAD_KIND[f32_load] if load_kind == "f32" else load_kind


@device_function
def _load_w1(w, n, k, is_bf16):
    """One weight element as float32 (w is float32, or uint16 bf16 bits)."""
    if is_bf16:
        return bf16_bits_to_f32(w[n, k])
    return w[n, k]


# ============================================================================ int4-group weights
# An int4 row (formats/int4_group.py) reaches the kernels as uint32 words [N, K/8]: weight k is
# nibble k % 8 of word k // 8 (lowest bits first), a two's complement q in [-8, 7], and its bf16
# scale (uint16 bits [N, K/g]) is that of group k // g.  A chunk is 32 weights: one 16-byte
# load ("i4") or four word loads, zero past the row end ("i4s", any K % 8 == 0).  Each word is
# xor-ed with 0x8888_8888 once (u = q + 8, unsigned).  Nibble j of a 16-bit half (bits 4j..4j+3,
# j < 4) becomes a float without a shift, in one of two ways (SkinnyConfig.unpack): the
# "denormal" unpack, the default (its comment below), or the "magic" number, here: with one
# AND-OR (bits of 2^23) | (w & 0xF << 4j) is 2^23 + u 16^j, and minus 2^23 + 8 16^j it is q 16^j
# exactly (integers below 2^24); the x element it multiplies was scaled by 16^-j once per x
# load (a power of two: the product rounds as x q does).  The high half takes one shift per
# word.  A dot over 8 weights then takes the scale once: acc += s * sum(x_i q_i).  Nothing
# wider than the packed words exists.
I4_CHUNK = 32                    # int4 weights per load step: one 16-byte vector of 4 words
INT4_KINDS = ("i4", "i4s")
_OFFSET8 = 0x88888888
_MAGIC = 0x4B000000              # the float32 bits of 2^23: 2^23 + v for v < 2^23 by an OR
# 2^23 + 8 * 16^j: (2^23 + u 16^j) - (2^23 + 8 16^j) = (u - 8) 16^j = q 16^j, exact
_MAGIC_Q = tuple(float(2 ** 23 + 8 * 16 ** j) for j in range(4))
_X_SCALE = tuple(float(16.0 ** -j) for j in range(4))


def int4_threads(k: int) -> int:
    """Threads per block of an int4 GEMM over reduction length k: ~2+ chunks of 32 weights
    per thread, 32..256; from k alone (batch invariance), like :func:`skinny_threads`."""
    return skinny_threads(k // 2)


def int4_chunks(k: int) -> int:
    """The number of 32-weight chunks of a row of k weights (the accumulate loop's ``c1``)."""
    return -(-k // I4_CHUNK)


@device_function
def _load_q4(wq, n, j):
    """Words [4j, 4j+4) of int4 row n (weights [32j, 32j+32)) as q + 8 nibbles."""
    v = ld_stream_u32x4(wq, n, 4 * j)
    f = np.uint32(_OFFSET8)
    return (np.uint32(v[0]) ^ f, np.uint32(v[1]) ^ f, np.uint32(v[2]) ^ f,
            np.uint32(v[3]) ^ f)


@device_function
def _word_at(wq, n, i):
    return np.uint32(wq[n, i]) if i < wq.shape[1] else np.uint32(0)


@device_function
def _load_q4_scalar(wq, n, j):
    """_load_q4 by scalar loads; a word past the row end is 0 (every q 0)."""
    f = np.uint32(_OFFSET8)
    return (_word_at(wq, n, 4 * j) ^ f, _word_at(wq, n, 4 * j + 1) ^ f,
            _word_at(wq, n, 4 * j + 2) ^ f, _word_at(wq, n, 4 * j + 3) ^ f)


@device_function
def _scale_at(ws, n, g):
    """The bf16 scale of group g of row n, as float32."""
    return bf16_bits_to_f32(ws[n, g])


@device_function
def _x8_nibble_scaled(xv):
    """x elements [8c, 8c+8) times 16^-j, j = their nibble's place in its half-word (0..3)."""
    s1, s2, s3 = np.float32(_X_SCALE[1]), np.float32(_X_SCALE[2]), np.float32(_X_SCALE[3])
    return (xv[0], xv[1] * s1, xv[2] * s2, xv[3] * s3, xv[4], xv[5] * s1, xv[6] * s2,
            xv[7] * s3)


@device_function
def _q16j(half, mask, magic_q):
    """q 16^j of the nibble ``mask`` selects in a 16-bit half (module comment), exact."""
    return bits_to_f32(np.uint32(_MAGIC) | (half & np.uint32(mask))) - np.float32(magic_q)


@device_function
def _fma8_q4(a, xs, u8, s):
    """a + s * (x . q) over the 8 weights of one offset-8 word, in element order; ``xs``: the x
    elements as :func:`_x8_nibble_scaled` gives them."""
    hi = u8 >> np.uint32(16)
    p = xs[0] * _q16j(u8, 0xF, _MAGIC_Q[0])
    p += xs[1] * _q16j(u8, 0xF0, _MAGIC_Q[1])
    p += xs[2] * _q16j(u8, 0xF00, _MAGIC_Q[2])
    p += xs[3] * _q16j(u8, 0xF000, _MAGIC_Q[3])
    p += xs[4] * _q16j(hi, 0xF, _MAGIC_Q[0])
    p += xs[5] * _q16j(hi, 0xF0, _MAGIC_Q[1])
    p += xs[6] * _q16j(hi, 0xF00, _MAGIC_Q[2])
    p += xs[7] * _q16j(hi, 0xF000, _MAGIC_Q[3])
    return a + p * s


# "denormal" unpack (SkinnyConfig.unpack, the default: the faster one-token GEMV at Kimi
# widths, docs/LAYERS.md): the nibble read as float32 bits with nothing OR-ed in.  Bits below
# 2^24 are the float32 bits * 2^-149 exactly (exponent field 0 or 1), so (w & 0xF << 4j) is
# u 16^j 2^-149 with no offset to subtract: one AND and one FFMA a weight where the magic
# number takes AND-OR, FADD and FFMA.
# x is scaled by 2^(100 - 4j) per x load (exact below |x| = 2^28), so every product is
# x u 2^-49; the u = q + 8 offset leaves 8 x 2^-49 a weight, which the same FMA chain over
# u = 8 (``_bias8_dn``, once per x word, shared by the NR rows) takes back: acc += s' (p - b)
# with s' = s 2^49.  A word of q = 0 gives p == b bit for bit (the same chain), so 0 exactly.
# Not the magic number's bits: the 8-weight partial sums see |x| u, not |x| |q| (within the
# bound of tests/w4a16_cases.py on the tests' data; ~1 bit more rounding per partial sum).
_DN_X_SCALE = tuple(float(2.0 ** (100 - 4 * j)) for j in range(4))
_DN_EIGHT = tuple(float(2.0 ** (3 + 4 * j - 149)) for j in range(4))   # float32 of 8 << 4j
_DN_S = float(2.0 ** 49)


@device_function
def _x8_denormal_scaled(xv):
    """x elements [8c, 8c+8) times 2^(100 - 4j), j their nibble's place in its half-word."""
    s0, s1 = np.float32(_DN_X_SCALE[0]), np.float32(_DN_X_SCALE[1])
    s2, s3 = np.float32(_DN_X_SCALE[2]), np.float32(_DN_X_SCALE[3])
    return (xv[0] * s0, xv[1] * s1, xv[2] * s2, xv[3] * s3, xv[4] * s0, xv[5] * s1,
            xv[6] * s2, xv[7] * s3)


@device_function
def _dn(half, mask):
    return bits_to_f32(half & np.uint32(mask))


@device_function
def _bias8_dn(xs):
    """The dot of ``xs`` with 8 nibbles u = 8, by the chain of :func:`_fma8_q4_dn`."""
    e0, e1 = np.float32(_DN_EIGHT[0]), np.float32(_DN_EIGHT[1])
    e2, e3 = np.float32(_DN_EIGHT[2]), np.float32(_DN_EIGHT[3])
    p = xs[0] * e0
    p += xs[1] * e1
    p += xs[2] * e2
    p += xs[3] * e3
    p += xs[4] * e0
    p += xs[5] * e1
    p += xs[6] * e2
    p += xs[7] * e3
    return p


@device_function
def _fma8_q4_dn(a, xs, u8, s, bias):
    """a + s' (x . u - bias) over one offset-8 word (the "denormal" comment above)."""
    hi = u8 >> np.uint32(16)
    p = xs[0] * _dn(u8, 0xF)
    p += xs[1] * _dn(u8, 0xF0)
    p += xs[2] * _dn(u8, 0xF00)
    p += xs[3] * _dn(u8, 0xF000)
    p += xs[4] * _dn(hi, 0xF)
    p += xs[5] * _dn(hi, 0xF0)
    p += xs[6] * _dn(hi, 0xF00)
    p += xs[7] * _dn(hi, 0xF000)
    return a + (p - bias) * s


@device_function
def _scale_at_dn(ws, n, g):
    return bf16_bits_to_f32(ws[n, g]) * np.float32(_DN_S)


# The cp.async ring (SkinnyConfig.stages; a bench variant): each thread stages its own next
# chunks (16 bytes of words a row, and the 4-byte scale pair holding the chunk's scale) in
# a private slice of shared memory, so STAGES - 1 chunks a row are in flight while one is
# computed, in no register (a register pipeline took 246-255 registers and spilled).  No
# block barrier: a thread reads only what it copied (cp.async.wait_group), and it refills a
# slot only after its FMAs consumed it.  Words: ring[((slot NR + r) T + t) 4 + 0..3], scales
# after them (STAGES NR T 4 words on): ring[.. + (slot NR + r) T + t].  Same loads, same
# products in the same order as the plain kind "i4": the same bits.  Needs the "i4" kind,
# one scale a chunk (group a multiple of 32) and an even number of scales a row (a row's
# scale pairs 4-byte aligned): :func:`int4_ring_ok`.
RING_WORDS = 5        # uint32 words a (slot, row, thread): the chunk's 4 and its scale pair


def int4_ring_ok(load_kind: str, k: int, group: int) -> bool:
    """Whether the cp.async ring (SkinnyConfig.stages) takes an int4 row of k weights."""
    return load_kind == "i4" and group % I4_CHUNK == 0 and (k // group) % 2 == 0


@device_function
def _ring_q4(ring, base, off):
    """The 4 staged words at ring[base + off] as q + 8 nibbles (as :func:`_load_q4`)."""
    v = ld_shared_words4(ring, base, off)
    f = np.uint32(_OFFSET8)
    return (np.uint32(v[0]) ^ f, np.uint32(v[1]) ^ f, np.uint32(v[2]) ^ f,
            np.uint32(v[3]) ^ f)


@device_function
def _ring_scale(ring, base, off, g):
    """Scale g of a row from its staged pair (g even: the low half) as float32."""
    word = np.uint32(ld_shared_word(ring, base, off)[0])
    return bf16_bits_to_f32((word >> np.uint32(16 * (g & 1))) & np.uint32(0xFFFF))


@device_function
def _ring_scale_dn(ring, base, off, g):
    return _ring_scale(ring, base, off, g) * np.float32(_DN_S)


UNPACKS = ("magic", "denormal")
_CP_WAIT = {2: cp_async_wait_1, 3: cp_async_wait_2, 4: cp_async_wait_3, 5: cp_async_wait_4}
RING_STAGES = tuple(_CP_WAIT)


# ============================================================================ skinny GEMM core
# y[m, n] = sum_k x[m, k] w[n, k] for MT rows of x and NR rows of w per block.  The block's
# threads split K into 8-element chunks (thread t takes chunks t, t+THREADS, ...), each thread
# keeps MT*NR partial sums in registers, and the block reduction of kdtree_numba/gpu/reduce.py
# adds them up.  Each weight element is loaded once per block (16-byte streaming loads, UNROLL
# chunks in flight per row); x chunks come through L1.  A row's arithmetic order depends on
# THREADS and the split only.

@functools.cache
def make_accumulate(mt: int, nr: int, threads: int, unroll: int, wkind: str, group: int = 0,
                    stages: int = 0, unpack: str = "denormal"):
    """``accumulate(x, xrows, w, wrows, first, c1, acc, scratch)``: acc[m*NR + r] +=
    x[xrows[m]] . w[wrows[r]] over the chunks first + threadIdx, + THREADS, ... < c1.

    The body is generated as straight-line code (every (u, m, r) spelled out): the partial sums
    must stay in registers, which needs constant indices, and LLVM's loop unroller was seen to
    leave some (mt, rows, unroll) loops rolled, putting ``acc`` in local memory (PTX check).
    The FMA order per output is fixed: chunks in increasing j, the 8 elements in order.
    Kind "f32x" exchanges weight halves across the warp, so its loops count iterations from
    block-uniform values only (``first``, ``c1``: every lane runs them, the compiler can see
    the warp converged at the shuffles) and skip the FMAs of lanes past c1; ``scratch`` is
    only its (test-only) emulated exchange's shared buffer.  The int4 kinds ("i4", "i4s";
    ``group``: weights per scale, a multiple of 8 dividing 32 or a multiple of 32) take ``w``
    as the uint32 words [N, K/8], ``scratch`` as the bf16 scales [N, K/g] and a ninth
    argument ``ring``, a uint32 shared array of ``stages * nr * threads * RING_WORDS`` words
    (any array where ``stages`` is 0); their chunks hold 32 weights (:data:`I4_CHUNK`,
    ``c1`` = :func:`int4_chunks`).  ``stages`` (kind "i4", unroll 1, group % 32 == 0): the
    cp.async ring of that depth; ``unpack``: "denormal" (the default) or "magic" (module
    comments)."""
    int4 = wkind in INT4_KINDS
    if int4 and (group % 8 or (group % I4_CHUNK and I4_CHUNK % group)):
        raise ValueError(f"int4 group size {group}: a multiple of 8 that divides "
                         f"{I4_CHUNK} or is a multiple of it")
    if stages and (wkind != "i4" or unroll != 1 or group % I4_CHUNK
                   or stages not in RING_STAGES):
        raise ValueError(f"the cp.async ring takes kind 'i4', unroll 1, a group size multiple "
                         f"of {I4_CHUNK} and stages in {RING_STAGES}")
    if unpack not in UNPACKS:
        raise ValueError(f"unpack must be one of {UNPACKS}, got {unpack!r}")
    head = ["def accumulate(x, xrows, w, wrows, first, c1, acc, scratch"
            + (", ring):" if int4 else "):"),
            "    j = first + cuda.threadIdx.x"]
    if wkind == "f32x":
        src = [*head, "    lane = cuda.threadIdx.x & 31",
               f"    n_all = (c1 - first) // {threads}",              # every thread has a chunk
               f"    n_any = (c1 - first + {threads - 1}) // {threads}",
               "    it = 0",
               f"    while it + {unroll} <= n_all:",
               *_chunk_group_source(mt, nr, threads, unroll, "        ", True),
               f"        j += {unroll * threads}", f"        it += {unroll}",
               "    while it < n_any:",
               *_chunk_group_source(mt, nr, threads, 1, "        ", True, guard=True),
               f"        j += {threads}", "        it += 1"]
    elif stages:
        src = head + _int4_ring_source(mt, nr, threads, stages, group, unpack)
    else:
        def group_source(u):
            if int4:
                return _int4_group_source(mt, nr, threads, u, "        ", wkind == "i4s",
                                          group, unpack)
            return _chunk_group_source(mt, nr, threads, u, "        ", False)
        if wkind == "i4s":   # the last group of a row: chunks past the row end clamp to it
            head.append("    last_s = scratch.shape[1] - 1")
        src = [*head,
               f"    while j + {(unroll - 1) * threads} < c1:",
               *group_source(unroll),
               f"        j += {unroll * threads}",
               "    while j < c1:",
               *group_source(1),
               f"        j += {threads}"]
    dn = unpack == "denormal"
    namespace = {"load_w8": _LOAD_W8.get(wkind), "load_x8": _LOAD_X8[wkind], "fma8": _fma8,
                 "load_q4": _load_q4_scalar if wkind == "i4s" else _load_q4,
                 "scale_at": _scale_at_dn if dn else _scale_at,
                 "fma8_q4": _fma8_q4_dn if dn else _fma8_q4,
                 "scale_x8": _x8_denormal_scaled if dn else _x8_nibble_scaled,
                 "bias8": _bias8_dn, "ring_q4": _ring_q4,
                 "ring_scale": _ring_scale_dn if dn else _ring_scale,
                 "put_q4": cp_async_u32x4, "put_s2": cp_async_u16x2,
                 "row_address": global_row_address,
                 "cp_commit": cp_async_commit, "cp_wait": _CP_WAIT.get(stages), "cuda": cuda}
    generated_code("\n".join(src), f"accumulate mt={mt} nr={nr} unroll={unroll} {wkind}"
                   + (f" g={group}" if int4 else "") + (f" stages={stages}" if stages else "")
                   + (f" {unpack}" if dn else ""), namespace)
    return device_function(namespace["accumulate"])


def _chunk_group_source(mt, nr, threads, unroll, indent, xchg, guard=False):
    """Source lines: load `unroll` chunks of the NR weight rows (all loads first, so they are
    in flight together), then for each chunk and each live row m of x its NR dot-8 updates
    (under ``if j < c1`` when ``guard``: lanes past the end only help their warp's loads)."""
    lines = []
    for u in range(unroll):
        for r in range(nr):
            call = (f"load_w8(w, wrows[{r}], j + {u * threads}, lane, c1, scratch)" if xchg
                    else f"load_w8(w, wrows[{r}], j + {u * threads})")
            lines.append(f"w{u}_{r} = {call}")
    body = []
    for u in range(unroll):
        for m in range(mt):
            body += [f"row = xrows[{m}]", "if row >= 0:",
                     f"    xv = load_x8(x, row, j + {u * threads})"]
            body += [f"    acc[{m * nr + r}] = fma8(acc[{m * nr + r}], xv, w{u}_{r})"
                     for r in range(nr)]
    if guard:
        lines += ["if j < c1:"] + ["    " + line for line in body]
    else:
        lines += body
    return [indent + line for line in lines]


def _int4_group_source(mt, nr, threads, unroll, indent, scalar, group, unpack):
    """The int4 twin of :func:`_chunk_group_source`: `unroll` chunks of 32 weights of the NR
    rows (4 words and the chunk's 1, 2 or 4 scales each) loaded first, then per chunk, live x
    row and 8-weight word: ``acc += s * (x . q)``, words in order."""
    per = 1 if group % I4_CHUNK == 0 else I4_CHUNK // group     # scales per chunk
    words_per_scale = 4 // per
    lines = []
    for u in range(unroll):
        jj = f"(j + {u * threads})"
        for r in range(nr):
            lines.append(f"q{u}_{r} = load_q4(w, wrows[{r}], {jj})")
            for c in range(per):
                at = f"({jj} * {I4_CHUNK} + {8 * words_per_scale * c}) // {group}"
                at = f"min({at}, last_s)" if scalar else at
                lines.append(f"s{u}_{r}_{c} = scale_at(scratch, wrows[{r}], {at})")
    for u in range(unroll):
        lines += _int4_chunk_compute(mt, nr, f"(j + {u * threads})", u, words_per_scale,
                                     unpack)
    return [indent + line for line in lines]


def _int4_chunk_compute(mt, nr, jj, u, words_per_scale, unpack):
    """Source lines: chunk ``jj``'s FMAs from its loaded words q{u}_r and scales s{u}_r_c."""
    lines = []
    for m in range(mt):
        lines += [f"row = xrows[{m}]", "if row >= 0:"]
        for c in range(4):
            lines.append(f"    xv = scale_x8(load_x8(x, row, 4 * {jj} + {c}))")
            bias = ""
            if unpack == "denormal":     # once per x word, shared by the rows
                lines.append("    xb = bias8(xv)")
                bias = ", xb"
            lines += [f"    acc[{m * nr + r}] = fma8_q4(acc[{m * nr + r}], xv, "
                      f"q{u}_{r}[{c}], s{u}_{r}_{c // words_per_scale}{bias})"
                      for r in range(nr)]
    return lines


def _int4_ring_source(mt, nr, threads, stages, group, unpack):
    """The loop of the cp.async ring (module comment above RING_WORDS): the prologue stages
    chunks j .. j + (STAGES-1) T, one commit group each; each trip waits for its own oldest
    group, computes that chunk, then stages the chunk STAGES ahead into the slot it just
    consumed (after the FMAs: the copy's addresses are not live beside them).  Every trip
    commits one group (empty past the row end), so wait_group(STAGES - 1) always means "this
    trip's chunk landed"."""
    span = stages * nr * threads       # where the scale words start

    def put(slot, jj):
        out = [f"wb = ({slot} * {nr * threads} + t) * 4",
               f"sb = {4 * span} + {slot} * {nr * threads} + t",
               f"g = ({jj}) * {I4_CHUNK} // {group}"]
        for r in range(nr):
            out += [f"put_q4(ring, wb + {4 * r * threads}, w, wrows[{r}], 4 * ({jj}), aw{r})",
                    f"put_s2(ring, sb + {r * threads}, scratch, wrows[{r}], g - (g & 1), "
                    f"as{r})"]
        return out
    lines = ["t = cuda.threadIdx.x"]
    for r in range(nr):      # each row's addresses once (the copies add a column's bytes)
        lines += [f"aw{r} = row_address(w, wrows[{r}])",
                  f"as{r} = row_address(scratch, wrows[{r}])"]
    for p in range(stages):
        lines += [f"if j + {p * threads} < c1:",
                  *["    " + x for x in put(p, f"j + {p * threads}")], "cp_commit()"]
    lines += ["slot = 0", "while j < c1:", "    cp_wait()",
              f"    wb = (slot * {nr * threads} + t) * 4",
              f"    sb = {4 * span} + slot * {nr * threads} + t",
              f"    g = j * {I4_CHUNK} // {group}"]
    for r in range(nr):
        lines += [f"    q0_{r} = ring_q4(ring, wb, {4 * r * threads})",
                  f"    s0_{r}_0 = ring_scale(ring, sb, {r * threads}, g)"]
    lines += ["    " + x for x in _int4_chunk_compute(mt, nr, "j", 0, 4, unpack)]
    lines += [f"    if j + {stages * threads} < c1:",
              *["        " + x for x in put("slot", f"j + {stages * threads}")],
              "    cp_commit()",
              f"    j += {threads}", f"    slot = slot + 1 if slot < {stages - 1} else 0"]
    return ["    " + line for line in lines]


@device_function
def _fma8(a, xv, wv):
    """a + x . w over one 8-element chunk, in element order (one fused multiply-add each)."""
    a += xv[0] * wv[0]
    a += xv[1] * wv[1]
    a += xv[2] * wv[2]
    a += xv[3] * wv[3]
    a += xv[4] * wv[4]
    a += xv[5] * wv[5]
    a += xv[6] * wv[6]
    a += xv[7] * wv[7]
    return a


@dataclass(frozen=True)
class SkinnyConfig:
    """Weight-streaming kernel shape: ``mt`` rows of x and ``rows`` of w per block, ``threads``
    per block (a multiple of 32), ``unroll`` chunks in flight per weight row, ``splits`` blocks
    sharing one row's K range (split-K, then an ordered sum); ``f32_load`` how float32 weight
    vectors are read: "xchg" (dense half-warp loads + one shuffle exchange), "stream" (two
    plain 16-byte loads per lane, L1 bypassed) or "cached" (the same through L1).  The three
    give bit-identical results; bf16 weights ignore it.  ``x_major``: the linear's blocks that
    share x rows run together (weight tiles fastest in the grid) instead of those that share a
    weight tile; for an x that outgrows L2 and the weight (the float32 router at a prefill's
    thousands of rows), which otherwise comes from HBM once per weight tile.  Same bits.
    Four fields only the MoE expert kernels read (layers/moe.py ``_expert_kernel``; bench
    variants until a GPU run picks, all giving the same bits): ``span``, N tiles one block
    runs one after another (its routing reads paid once); ``prefetch``, each tile's weight
    rows (words and scales) asked into L2 by one bulk prefetch a row at the tile's start,
    and with a span the next tile's too (bytes in flight that hold no register);
    ``max_registers``, a ptxas cap (0: none); ``shared_first``, the shared expert's blocks
    (where they ride in the launch) before the routed ones in the grid, not after: the
    heavier blocks start first and the short ones fill the last wave.  Two for the int4
    kinds alone: ``stages``, the cp.async ring's depth (a bench variant; 0: plain loads;
    same bits), ``unpack``, the nibbles' unpacking, "denormal" (the default since run 167)
    or "magic" (other bits, both within the bound)."""
    mt: int
    rows: int
    threads: int
    unroll: int
    splits: int = 1
    f32_load: str = "xchg"
    x_major: bool = False
    span: int = 1
    prefetch: bool = False
    max_registers: int = 0
    stages: int = 0
    shared_first: bool = False
    unpack: str = "denormal"

    def __post_init__(self):
        nacc = self.mt * self.rows
        if self.threads % 32 or nacc & (nacc - 1) or nacc > self.threads:
            raise ValueError(f"bad SkinnyConfig {self}: threads % 32, mt*rows a power of two "
                             f"<= threads")
        if self.span < 1 or self.max_registers < 0:
            raise ValueError(f"bad SkinnyConfig {self}: span >= 1, max_registers >= 0")
        if self.stages and (self.stages not in RING_STAGES or self.unroll != 1):
            raise ValueError(f"bad SkinnyConfig {self}: stages 0 or one of {RING_STAGES}, "
                             f"with unroll 1")
        if self.unpack not in UNPACKS:
            raise ValueError(f"unpack must be one of {UNPACKS}")
        if self.f32_load not in _F32_LOAD_KIND:
            raise ValueError(f"f32_load must be one of {sorted(_F32_LOAD_KIND)}")


def mt_for(m: int) -> int:
    """Rows of x per block for m rows: the next power of two, at most 16 (4 in the simulator)."""
    return min(pow2_ceil(m), 4 if SIMULATOR else 16)


# x rows a block for a small weight (at most this many elements: a small model's projections
# and lm_head; every Kimi-K2 weight is larger) at a verify's rows, by its size.  A block of
# mt_for's 16 x rows against one or two weight rows serialises 16 rows of FMAs per thread
# where a launch-bound round's small weights leave blocks to spare.  dev/cuda/layers.py's
# "rows" sweep (run 154, H100, the demo pair's shapes at 9 / 17 / 33 rows): the fp32 router
# (8 x 256) 5.6 / 6.8 / 6.9 us at mt 16 against 3.9 / 3.8 / 3.8 at mt 2, the FFN's down (256 x
# 768) 7.0 -> 5.5 us at 17 rows, the lm_head (8,192 x 256) 19.6 -> 14.0 us at mt 8.  The bits
# do not depend on mt (skinny_config).
SMALL_WEIGHT_ELEMENTS = 1 << 21
SMALL_WEIGHT_MT = ((1 << 18, 2), (1 << 20, 4), (SMALL_WEIGHT_ELEMENTS, 8))


def small_weight_mt(m: int, n: int, k: int) -> int:
    """x rows a block for an [m, k] x [n, k]^T product (module note above SMALL_WEIGHT_MT):
    mt_for's, or less for a small weight."""
    mt = mt_for(m)
    for elements, cap in SMALL_WEIGHT_MT:
        if n * k <= elements:
            return min(mt, cap)
    return mt


def skinny_threads(k: int) -> int:
    """Threads per block for reduction length k: ~4+ chunks per thread, 32..256.  A function of
    k alone, so a row's summation order never depends on how many rows a call has."""
    if SIMULATOR:
        return 32
    return min(max(pow2_floor(k // CHUNK // 4), 32), 256)


X_MAJOR_MIN_BYTES = 32 << 20   # x beyond this much of the H200's 50 MB L2 is streamed again

# (rows, unroll) per mt, most rows first: each <= ~130 registers per thread on sm_90 for fp32
# and bf16 weights, no local memory (ptxas via nvJitLink; test_kernels_compile_to_registers_only),
# so 3-4 blocks of 128 threads fit an SM.
ROWS_UNROLL = {1: ((8, 2), (4, 2), (2, 4), (1, 4)),
               2: ((4, 2), (2, 4), (1, 4)),
               4: ((4, 1), (2, 2), (1, 4)),
               8: ((4, 1), (2, 2), (1, 2)),
               16: ((2, 2), (1, 1))}


def skinny_config(m: int, n: int, k: int, wkind: str, mt: int | None = None) -> SkinnyConfig:
    """Default kernel shape for an [m, k] x [n, k]^T product: the most weight rows per block
    that still gives every SM four blocks, x chunks times weight tiles (the simulator: the
    fewest blocks); threads from k alone (batch invariance; rows, unroll and the grid order
    change no bit); ``x_major`` for an x that outgrows L2.  Four, not two: a sweep at M = 1
    found rows=2 best for N = 1536 (768 blocks) and rows=1 for N = 576, not the two-block
    choices rows=4 / 2.  ``mt``: x rows a block other than :func:`small_weight_mt`'s (a power
    of two; it moves no bit, so only the time decides it: dev/cuda/layers.py's "rows").
    See docs/LAYERS.md; the sweep: dev/cuda/layers.py."""
    if mt is None:
        mt = small_weight_mt(m, n, k)
    elif mt not in ROWS_UNROLL:
        raise ValueError(f"mt must be one of {sorted(ROWS_UNROLL)}, got {mt}")
    choices = ROWS_UNROLL[mt]
    rows, unroll = choices[-1]
    m_chunks = -(-m // mt)
    for cand_rows, cand_unroll in choices:
        if SIMULATOR or -(-n // cand_rows) * m_chunks >= 4 * GPU_SMS:
            rows, unroll = cand_rows, cand_unroll
            break
    if wkind == "f32" and mt <= 2 and rows * unroll > 4 and (mt, rows) != (1, 2):
        # a float32 chunk is 32 bytes, twice bf16's: half the chunks give the same bytes in
        # flight per thread, and rows * unroll = 16 needed ~200 registers with the exchange.
        # Not at one x row and two weight rows: there (7168 -> 1536, the shape that picks
        # rows = 2) the sweep found unroll 4 faster than 2.
        unroll = max(1, unroll // 2)
    # x past what L2 keeps (and larger than the weight) would come from HBM again per weight
    # tile (the router at a prefill's 4,096 rows); where x fits, the x-major order is slower
    x_bytes = m * k * 4
    x_major = x_bytes > X_MAJOR_MIN_BYTES and x_bytes > n * k * (4 if wkind == "f32" else 2)
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k), unroll=unroll, splits=1,
                        x_major=x_major)


def swiglu_config(cfg: SkinnyConfig) -> SkinnyConfig:
    """The SwiGLU form's shape from ``cfg``, :func:`skinny_config`'s of the whole gate_up
    [2I, K]: a block's weight rows (its accumulators) as the plain kernel's, half of them
    outputs; one output still streams two rows, at the unroll ROWS_UNROLL keeps for two."""
    unroll = cfg.unroll if cfg.rows > 1 else min(cfg.unroll, dict(ROWS_UNROLL[cfg.mt])[2])
    return dataclasses.replace(cfg, rows=max(1, cfg.rows // 2), unroll=unroll, splits=1)


@functools.cache
def make_skinny_block(cfg: SkinnyConfig, wkind: str, swiglu: bool = False):
    """``skinny_block(x, w, out, m_total, n_total, k8, n_mchunks, splits, bid)``: block
    ``bid``'s share of the skinny linear (:func:`skinny_linear_kernel`, which runs it at its
    block index): with ``swiglu`` its SwiGLU form, w is gate_up [2 n_total, K] and
    out[0, m, o] = silu(x[m] . w[o]) * (x[m] . w[n_total + o]), a block's ``cfg.rows``
    outputs streaming their gate and up rows together (as the routed experts' gate_up,
    moe._expert_kernel): each dot product the plain kernel's bits (splits 1 only).  A device
    function so that a launch of other blocks can run it for some of its own (the shared
    expert in the routed experts' launches, moe._expert_kernel); blockDim must be
    ``cfg.threads``."""
    mt, r_out, threads, x_major = cfg.mt, cfg.rows, cfg.threads, cfg.x_major
    nr = 2 * r_out if swiglu else r_out            # weight rows streamed per block
    nacc, warps = mt * nr, threads // 32
    accumulate = make_accumulate(mt, nr, threads, cfg.unroll, skinny_kind(wkind, cfg.f32_load))
    block_reduce = make_block_reduce(nacc, threads)
    scr = block_reduce_scratch_shape(nacc, threads)
    red_shape = (warps + 1, nacc)

    # inlined in numba's IR, before LLVM: the kernel then compiles as if the body were its
    # own (a plain device call left the 16-row bf16 linear at 242 registers where its own
    # body takes 127: tests/test_layers.py's compile check)
    @device_function(inline="always")
    def skinny_block(x, w, out, m_total, n_total, k8, n_mchunks, splits, bid):
        """out[s, m, n] = split s's share of x[m] . w[n]; 1-D grid, m-chunk fastest (blocks
        that share a weight tile run together, so a tile comes from HBM about once), or with
        ``x_major`` weight tile fastest (blocks that share x rows run together)."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        if x_major:
            n_tiles = (n_total + r_out - 1) // r_out
            n0 = (bid % n_tiles) * r_out
            s = (bid // n_tiles) % splits
            m0 = (bid // n_tiles // splits) * mt
        else:
            m0 = (bid % n_mchunks) * mt
            s = (bid // n_mchunks) % splits
            n0 = (bid // n_mchunks // splits) * r_out
        xrows = cuda.local.array(mt, np.int32)
        wrows = cuda.local.array(nr, np.int32)
        acc = cuda.local.array(nacc, np.float32)
        for m in range(mt):
            xrows[m] = m0 + m if m0 + m < m_total else -1
        for r in range(r_out):
            wrows[r] = min(n0 + r, n_total - 1)
            if swiglu:                   # the output's up row after its gate row
                wrows[r_out + r] = n_total + min(n0 + r, n_total - 1)
        for i in range(nacc):
            acc[i] = np.float32(0.0)
        accumulate(x, xrows, w, wrows, s * k8 // splits, (s + 1) * k8 // splits, acc,
                   scratch)
        block_reduce(acc, red, scratch)
        t = cuda.threadIdx.x
        if t < mt * r_out:
            m = t // r_out
            r = t - m * r_out
            if m0 + m < m_total and n0 + r < n_total:
                v = red[warps, m * nr + r]
                if swiglu:
                    v = silu(v) * red[warps, m * nr + r_out + r]
                out[s, m0 + m, n0 + r] = v
    return skinny_block


@kernel_factory
def skinny_linear_kernel(cfg: SkinnyConfig, wkind: str, swiglu: bool = False):
    """The skinny linear (:func:`make_skinny_block`, a block's share, at every block); with
    ``swiglu`` its SwiGLU form, one launch where the linear and the SwiGLU kernel were two."""
    block = make_skinny_block(cfg, wkind, swiglu)

    @kernel
    def skinny_linear(x, w, out, m_total, n_total, k8, n_mchunks, splits):
        block(x, w, out, m_total, n_total, k8, n_mchunks, splits, cuda.blockIdx.x)
    return skinny_linear

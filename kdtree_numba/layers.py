"""The model's non-attention kernels on the GPU (numba.cuda).  Contract: ``reference.layers``.

Same functions, same names and semantics as the reference; kernel designs, tolerances and why
are in docs/LAYERS.md.  Inputs may be NumPy arrays (copied to the device), numba device arrays
or CuPy arrays (wrapped zero-copy); results are numba device arrays left on the device, and no
function synchronises with the host.  Every function takes ``stream=`` (a numba stream, e.g.
``cuda.external_stream(cupy_stream.ptr)`` inside a CUDA-graph capture) and ``workspace=`` (a
:class:`Workspace` whose buffers are reused, so a warmed-up call allocates nothing).

bfloat16 weights are ``ml_dtypes.bfloat16`` arrays (``uint16`` arrays are read as bf16 bit
patterns).  Kernels receive them as integers and widen in-kernel, ``f32 = bits << 16``, because
``numba.cuda.bf16`` exists neither in the simulator nor as a vector load.

Two properties hold by construction and are tested:
* batch invariance: a row's result does not depend on the other rows of the call (linear up to
  ``SKINNY_MAX_M`` rows, moe_ffn, rmsnorm, rope, argmax) -- every row has its own accumulators
  and a summation order fixed by the weight shape alone;
* a bf16 weight gives bit-identical results to the float32 weight holding the same values.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from kdtree_numba.compat import cuda, kernel, device_function, to_device, SIMULATOR  # noqa: F401
from kdtree_numba import compat
from reference.layers import RopeSpec, YarnScaling, _check_routing_args

__all__ = ["rmsnorm", "RopeSpec", "YarnScaling", "rope", "linear", "embedding", "argmax",
           "router_logits", "route_from_logits", "moe_route", "moe_ffn", "Workspace",
           "SkinnyConfig", "TiledConfig", "skinny_config", "SKINNY_MAX_M"]

SKINNY_MAX_M = 1025          # linear(): rows up to this use the weight-streaming kernel
GPU_SMS = 132                # H200; only used to size grids (more SMs just means more waves)
CHUNK = 8                    # K elements per load step: one 16-byte bf16 vector, two fp32 ones

# ============================================================================ primitives
# Three things differ between the GPU and the simulator, and only here: reinterpreting bits as
# float32, 16-byte vector loads (inline PTX), and the warp exchange (shuffle vs shared memory).

if SIMULATOR:
    def _bits_to_f32_py(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def _vload4_py(a, row, col):
        return (a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3])

    _bits_to_f32 = device_function(_bits_to_f32_py)
    _ld_stream_u32x4 = _ld_stream_f32x4 = _ld_cached_f32x4 = device_function(_vload4_py)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    def _make_vload4(elem, ptx_type, constraint, cache_op):
        """An intrinsic ``vload(a2d, row, col) -> 4-tuple``: one 16-byte ``ld.global.nc`` of
        ``a[row, col:col+4]``.  The caller guarantees 16-byte alignment."""
        @intrinsic
        def vload(typingctx, array, row, col):
            if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype == elem):
                return None
            ret = types.UniTuple(elem, 4)

            def codegen(context, builder, sig, args):
                aty, rty, cty = sig.args
                arr, r, c = args
                idx = [context.cast(builder, r, rty, types.intp),
                       context.cast(builder, c, cty, types.intp)]
                ary = context.make_array(aty)(context, builder, value=arr)
                ptr = cgutils.get_item_pointer(context, builder, aty, ary, idx, wraparound=False)
                lty = context.get_value_type(elem)
                fnty = ir.FunctionType(ir.LiteralStructType([lty] * 4), [ptr.type])
                asm = ir.InlineAsm(
                    fnty, f"ld.global.nc{cache_op}.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                    ",".join([f"={constraint}"] * 4) + ",l")
                res = builder.call(asm, [ptr])
                return context.make_tuple(builder, ret,
                                          [builder.extract_value(res, i) for i in range(4)])
            return ret(array, row, col), codegen
        return vload

    # Weights are streamed once: keep them out of L1 so the activations stay there.
    _ld_stream_u32x4 = _make_vload4(types.uint32, "u32", "r", ".L1::no_allocate")
    _ld_stream_f32x4 = _make_vload4(types.float32, "f32", "f", ".L1::no_allocate")
    _ld_cached_f32x4 = _make_vload4(types.float32, "f32", "f", "")

    @device_function
    def _bits_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits))


@device_function
def _bf16_lo(word):
    """The bf16 in the low half of a little-endian uint32 word (the even element)."""
    return _bits_to_f32(np.uint32(word) << np.uint32(16))


@device_function
def _bf16_hi(word):
    return _bits_to_f32(np.uint32(word) & np.uint32(0xFFFF0000))


@device_function
def _bf16_bits_to_f32(bits16):
    return _bits_to_f32(np.uint32(bits16) << np.uint32(16))


@device_function
def _load_w8_f32(w, n, j):
    """Elements [8j, 8j+8) of float32 weight row n."""
    a = _ld_stream_f32x4(w, n, CHUNK * j)
    b = _ld_stream_f32x4(w, n, CHUNK * j + 4)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


@device_function
def _load_w8_bf16(w32, n, j):
    """Elements [8j, 8j+8) of bf16 weight row n, given the row as uint32 words [N, K/2]."""
    q = _ld_stream_u32x4(w32, n, 4 * j)
    return (_bf16_lo(q[0]), _bf16_hi(q[0]), _bf16_lo(q[1]), _bf16_hi(q[1]),
            _bf16_lo(q[2]), _bf16_hi(q[2]), _bf16_lo(q[3]), _bf16_hi(q[3]))


@device_function
def _load_x8(x, row, j):
    a = _ld_cached_f32x4(x, row, CHUNK * j)
    b = _ld_cached_f32x4(x, row, CHUNK * j + 4)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


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
    return _bf16_bits_to_f32(w16[n, k]) if k < w16.shape[1] else np.float32(0.0)


@device_function
def _load_w8_bf16_scalar(w16, n, j):
    """Scalar-load twin of _load_w8_bf16; the row is given as uint16 bits [N, K]."""
    k0 = CHUNK * j
    return (_bf16_at(w16, n, k0), _bf16_at(w16, n, k0 + 1), _bf16_at(w16, n, k0 + 2),
            _bf16_at(w16, n, k0 + 3), _bf16_at(w16, n, k0 + 4), _bf16_at(w16, n, k0 + 5),
            _bf16_at(w16, n, k0 + 6), _bf16_at(w16, n, k0 + 7))


# Weight kinds: "f32" / "bf16" stream 16-byte vectors (K % 8 == 0, C-contiguous, 16-byte
# aligned; bf16 rows passed as uint32 words); "f32s" / "bf16s" are the scalar-load fallback for
# any other shape (bf16 rows as uint16).  Both kinds add the same products in the same order.
_LOAD_W8 = {"f32": _load_w8_f32, "bf16": _load_w8_bf16,
            "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_bf16_scalar}
_LOAD_X8 = {"f32": _load_x8, "bf16": _load_x8,
            "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_f32_scalar}


@device_function
def _load_w1(w, n, k, is_bf16):
    """One weight element as float32 (w is float32, or uint16 bf16 bits)."""
    if is_bf16:
        return _bf16_bits_to_f32(w[n, k])
    return w[n, k]


# ============================================================================ block reduction
# A warp "reduce-scatter" butterfly: at each of the 5 xor steps a lane keeps half of its values
# and receives the partner's copy of that half, so NACC values need NACC-1 shuffles in all
# (not 5*NACC).  Then one shared-memory pass sums the warps, in warp order.

def _scratch_shape(nacc, threads):
    """Shared scratch for the simulator's reductions (a 1x1 dummy on the GPU, never used)."""
    return (max(nacc, 1), threads) if SIMULATOR else (1, 1)


def _make_halving_step(mask, half):
    if SIMULATOR:
        def step(acc, lane, scratch):
            t = cuda.threadIdx.x
            upper = (lane & mask) != 0
            for i in range(half):
                scratch[i, t] = acc[i] if upper else acc[i + half]
            cuda.syncthreads()
            for i in range(half):
                keep = acc[i + half] if upper else acc[i]
                acc[i] = keep + scratch[i, t ^ mask]
            cuda.syncthreads()
    else:
        def step(acc, lane, scratch):
            upper = (lane & mask) != 0
            for i in range(half):
                send = acc[i] if upper else acc[i + half]
                keep = acc[i + half] if upper else acc[i]
                acc[i] = keep + cuda.shfl_xor_sync(0xFFFFFFFF, send, mask)
    return device_function(step)


def _make_allreduce_step(mask):
    if SIMULATOR:
        def step(acc, lane, scratch):
            t = cuda.threadIdx.x
            scratch[0, t] = acc[0]
            cuda.syncthreads()
            acc[0] = acc[0] + scratch[0, t ^ mask]
            cuda.syncthreads()
    else:
        def step(acc, lane, scratch):
            acc[0] = acc[0] + cuda.shfl_xor_sync(0xFFFFFFFF, acc[0], mask)
    return device_function(step)


@functools.cache
def _make_block_reduce(nacc: int, threads: int, butterfly: bool = not SIMULATOR):
    """``block_reduce(acc, red, scratch)``: afterwards ``red[WARPS, i]`` = block sum of acc[i].

    ``red`` is a shared [WARPS+1, NACC] float32 array, ``scratch`` a shared
    ``_scratch_shape(nacc, threads)`` array; ``nacc`` a power of two <= 32*threads.  On the GPU
    (``butterfly``) the summation tree depends only on ``threads``, never on which value is which.
    The simulator sums lanes in order instead (2 barriers rather than 12: barriers are what is
    slow there); tests run the butterfly in the simulator too, with emulated shuffles.
    """
    warps = threads // 32
    if not butterfly:
        @device_function
        def block_reduce_in_order(acc, red, scratch):
            t = cuda.threadIdx.x
            for i in range(nacc):
                scratch[i, t] = acc[i]
            cuda.syncthreads()
            for i in range(t, nacc, threads):
                total = scratch[i, 0]
                for lane in range(1, threads):
                    total += scratch[i, lane]
                red[warps, i] = total
            cuda.syncthreads()
        return block_reduce_in_order

    steps, have, halvings = [], nacc, 0
    for mask in (16, 8, 4, 2, 1):
        if have > 1:
            steps.append(_make_halving_step(mask, have // 2))
            have //= 2
            halvings += 1
        else:
            steps.append(_make_allreduce_step(mask))
    keep, shift = have, 5 - halvings          # lane l ends with values [(l>>shift)*keep, +keep)
    writer_mask = (1 << shift) - 1
    s0, s1, s2, s3, s4 = steps

    @device_function
    def block_reduce(acc, red, scratch):
        t = cuda.threadIdx.x
        lane = t & 31
        s0(acc, lane, scratch)
        s1(acc, lane, scratch)
        s2(acc, lane, scratch)
        s3(acc, lane, scratch)
        s4(acc, lane, scratch)
        if (lane & writer_mask) == 0:
            base = (lane >> shift) * keep
            for i in range(keep):
                red[t >> 5, base + i] = acc[i]
        cuda.syncthreads()
        for i in range(t, nacc, threads):
            total = red[0, i]
            for wp in range(1, warps):
                total += red[wp, i]
            red[warps, i] = total
        cuda.syncthreads()
    return block_reduce


# ============================================================================ skinny GEMM core
# y[m, n] = sum_k x[m, k] w[n, k] for MT rows of x and NR rows of w per block.  The block's
# threads split K into 8-element chunks (thread t takes chunks t, t+THREADS, ...), each thread
# keeps MT*NR partial sums in registers, and the butterfly above adds them up.  Each weight
# element is loaded once per block (16-byte streaming loads, UNROLL chunks in flight per row);
# x chunks come through L1.  A row's arithmetic order depends on THREADS and the split only.

@functools.cache
def _make_accumulate(mt: int, nr: int, threads: int, unroll: int, wkind: str):
    """``accumulate(x, xrows, w, wrows, j0, c1, acc)``: acc[m*NR + r] += x[xrows[m]] .
    w[wrows[r]] over the chunks j0, j0 + THREADS, ... < c1 (j0 = first chunk + threadIdx).

    The body is generated as straight-line code (every (u, m, r) spelled out): the partial sums
    must stay in registers, which needs constant indices, and LLVM's loop unroller was seen to
    leave some (mt, rows, unroll) loops rolled, putting ``acc`` in local memory (PTX check).
    The FMA order per output is fixed: chunks in increasing j, the 8 elements in order."""
    src = ["def accumulate(x, xrows, w, wrows, j0, c1, acc):", "    j = j0",
           f"    while j + {(unroll - 1) * threads} < c1:",
           *_chunk_group_source(mt, nr, threads, unroll, "        "),
           f"        j += {unroll * threads}",
           "    while j < c1:",
           *_chunk_group_source(mt, nr, threads, 1, "        "),
           f"        j += {threads}"]
    namespace = {"load_w8": _LOAD_W8[wkind], "load_x8": _LOAD_X8[wkind], "fma8": _fma8}
    exec(compile("\n".join(src), f"<accumulate mt={mt} nr={nr} unroll={unroll} {wkind}>",
                 "exec"), namespace)
    return device_function(namespace["accumulate"])


def _chunk_group_source(mt, nr, threads, unroll, indent):
    """Source lines: load `unroll` chunks of the NR weight rows (all loads first, so they are
    in flight together), then for each chunk and each live row m of x its NR dot-8 updates."""
    lines = []
    for u in range(unroll):
        for r in range(nr):
            lines.append(f"w{u}_{r} = load_w8(w, wrows[{r}], j + {u * threads})")
    for u in range(unroll):
        for m in range(mt):
            lines += [f"row = xrows[{m}]", "if row >= 0:",
                      f"    xv = load_x8(x, row, j + {u * threads})"]
            lines += [f"    acc[{m * nr + r}] = fma8(acc[{m * nr + r}], xv, w{u}_{r})"
                      for r in range(nr)]
    return [indent + line for line in lines]


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
    sharing one row's K range (split-K, then an ordered sum)."""
    mt: int
    rows: int
    threads: int
    unroll: int
    splits: int = 1

    def __post_init__(self):
        nacc = self.mt * self.rows
        if self.threads % 32 or nacc & (nacc - 1) or nacc > self.threads:
            raise ValueError(f"bad SkinnyConfig {self}: threads % 32, mt*rows a power of two "
                             f"<= threads")


def _pow2_floor(v: int) -> int:
    return 1 << max(int(v), 1).bit_length() - 1


def _pow2_ceil(v: int) -> int:
    return 1 << max(int(v) - 1, 0).bit_length()


def _mt_for(m: int) -> int:
    return min(_pow2_ceil(m), 4 if SIMULATOR else 16)


def skinny_threads(k: int) -> int:
    """Threads per block for reduction length k: ~4+ chunks per thread, 32..256.  A function of
    k alone, so a row's summation order never depends on how many rows a call has."""
    if SIMULATOR:
        return 32
    return min(max(_pow2_floor(k // CHUNK // 4), 32), 256)


# (rows, unroll) per mt, most rows first: each <= ~130 registers per thread on sm_90 for fp32
# and bf16 weights, no local memory (ptxas via nvJitLink; test_kernels_compile_to_registers_only),
# so 3-4 blocks of 128 threads fit an SM.
ROWS_UNROLL = {1: ((8, 2), (4, 2), (2, 4), (1, 4)),
               2: ((4, 2), (2, 4), (1, 4)),
               4: ((4, 1), (2, 2), (1, 4)),
               8: ((4, 1), (2, 2), (1, 2)),
               16: ((2, 2), (1, 1))}


def skinny_config(m: int, n: int, k: int, wkind: str) -> SkinnyConfig:
    """Default kernel shape for an [m, k] x [n, k]^T product: the most weight rows per block
    that still gives every SM two blocks (the simulator: the fewest blocks); threads from k
    alone (batch invariance).  See docs/LAYERS.md; tools/bench_layers.py --only sweep."""
    mt = _mt_for(m)
    choices = ROWS_UNROLL[mt]
    rows, unroll = choices[-1]
    for cand_rows, cand_unroll in choices:
        if SIMULATOR or -(-n // cand_rows) >= 2 * GPU_SMS:
            rows, unroll = cand_rows, cand_unroll
            break
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k), unroll=unroll, splits=1)


@functools.cache
def _skinny_linear_kernel(cfg: SkinnyConfig, wkind: str):
    mt, nr, threads = cfg.mt, cfg.rows, cfg.threads
    nacc, warps = mt * nr, threads // 32
    accumulate = _make_accumulate(mt, nr, threads, cfg.unroll, wkind)
    block_reduce = _make_block_reduce(nacc, threads)
    scr = _scratch_shape(nacc, threads)
    red_shape = (warps + 1, nacc)

    @kernel
    def skinny_linear(x, w, out, m_total, n_total, k8, n_mchunks, splits):
        """out[s, m, n] = split s's share of x[m] . w[n]; 1-D grid, m-chunk fastest (blocks
        that share a weight tile run together, so a tile comes from HBM about once)."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        bid = cuda.blockIdx.x
        m0 = (bid % n_mchunks) * mt
        s = (bid // n_mchunks) % splits
        n0 = (bid // n_mchunks // splits) * nr
        xrows = cuda.local.array(mt, np.int32)
        wrows = cuda.local.array(nr, np.int32)
        acc = cuda.local.array(nacc, np.float32)
        for m in range(mt):
            xrows[m] = m0 + m if m0 + m < m_total else -1
        for r in range(nr):
            wrows[r] = min(n0 + r, n_total - 1)
        for i in range(nacc):
            acc[i] = np.float32(0.0)
        accumulate(x, xrows, w, wrows, s * k8 // splits + cuda.threadIdx.x,
                   (s + 1) * k8 // splits, acc)
        block_reduce(acc, red, scratch)
        t = cuda.threadIdx.x
        if t < nacc:
            m = t // nr
            r = t - m * nr
            if m0 + m < m_total and n0 + r < n_total:
                out[s, m0 + m, n0 + r] = red[warps, t]
    return skinny_linear


@kernel
def _sum_splits(part, y):
    """y[m, n] = sum over s of part[s, m, n], in split order."""
    i = cuda.grid(1)
    n_cols = y.shape[1]
    if i < y.shape[0] * n_cols:
        m = i // n_cols
        n = i - m * n_cols
        total = part[0, m, n]
        for s in range(1, part.shape[0]):
            total += part[s, m, n]
        y[m, n] = total


# ============================================================================ tiled SGEMM
@dataclass(frozen=True)
class TiledConfig:
    """Shared-memory tiled GEMM: a (ty*tm) x (tx*tn) output tile per block of ty*tx threads,
    each thread a tm x tn register tile, K in steps of bk."""
    ty: int = 16
    tx: int = 16
    tm: int = 8
    tn: int = 8
    bk: int = 8


def tiled_config() -> TiledConfig:
    return TiledConfig(4, 4, 2, 2, 4) if SIMULATOR else TiledConfig()


@functools.cache
def _tiled_kernel(cfg: TiledConfig, is_bf16: bool):
    ty, tx, tm, tn, bk = cfg.ty, cfg.tx, cfg.tm, cfg.tn, cfg.bk
    bm, bn, threads, nacc = ty * tm, tx * tn, ty * tx, tm * tn

    @kernel
    def tiled_linear(x, w, y, m_total, n_total, k_total):
        """y = x w^T for the block's tile; w is float32 or uint16 bf16 bits.  Thread (i, j)
        owns rows i + ty*a and columns j + tx*b, so shared reads broadcast or are consecutive."""
        a_s = cuda.shared.array((bk, bm), np.float32)
        b_s = cuda.shared.array((bk, bn), np.float32)
        t = cuda.threadIdx.x
        ti = t // tx
        tj = t - ti * tx
        m0 = cuda.blockIdx.y * bm
        n0 = cuda.blockIdx.x * bn
        acc = cuda.local.array(nacc, np.float32)
        for i in range(nacc):
            acc[i] = np.float32(0.0)
        for k0 in range(0, k_total, bk):
            for i in range(t, bm * bk, threads):
                r = i // bk
                c = i - r * bk
                inside = m0 + r < m_total and k0 + c < k_total
                a_s[c, r] = x[m0 + r, k0 + c] if inside else np.float32(0.0)
            for i in range(t, bn * bk, threads):
                r = i // bk
                c = i - r * bk
                inside = n0 + r < n_total and k0 + c < k_total
                b_s[c, r] = _load_w1(w, n0 + r, k0 + c, is_bf16) if inside else np.float32(0.0)
            cuda.syncthreads()
            for kk in range(bk):
                for a in range(tm):
                    av = a_s[kk, ti + ty * a]
                    for b in range(tn):
                        acc[a * tn + b] += av * b_s[kk, tj + tx * b]
            cuda.syncthreads()
        for a in range(tm):
            for b in range(tn):
                if m0 + ti + ty * a < m_total and n0 + tj + tx * b < n_total:
                    y[m0 + ti + ty * a, n0 + tj + tx * b] = acc[a * tn + b]
    return tiled_linear


# ============================================================================ host helpers

class Workspace:
    """Scratch device buffers kept between calls, keyed by (name, shape, dtype): with one
    workspace per step (and ``out=`` for the results) a warmed-up call allocates nothing, which
    is what a CUDA-graph capture needs.  Results never live in the workspace."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, shape, dtype, stream=0):
        key = (name, tuple(int(s) for s in shape), np.dtype(dtype).str)
        buf = self._buffers.get(key)
        if buf is None:
            buf = _empty(shape, dtype, stream)
            self._buffers[key] = buf
        return buf


def _buffer(workspace, name, shape, dtype, stream):
    if workspace is None:
        return _empty(shape, dtype, stream)
    return workspace.get(name, shape, dtype, stream)


def _empty(shape, dtype, stream=0):
    compat.require_kernels()
    return cuda.device_array(tuple(int(s) for s in shape), dtype=dtype, stream=stream)


def _out(out, shape, dtype, stream=0):
    """The result array: ``out`` (a numba or CuPy device array of that shape and dtype) or a
    new one."""
    if out is None:
        return _empty(shape, dtype, stream)
    if isinstance(out, np.ndarray):
        raise TypeError("out must be a device array (numba or CuPy), not a NumPy array")
    o = to_device(out, stream=stream)
    if tuple(o.shape) != tuple(int(v) for v in shape) or np.dtype(o.dtype) != np.dtype(dtype):
        raise ValueError(f"out must be {np.dtype(dtype)} {tuple(shape)}, got {o.dtype} {o.shape}")
    return o


def _weight_kind(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f32"
    if dtype.name == "bfloat16" or dtype == np.uint16:
        return "bf16"
    raise TypeError(f"weights must be float32 or bfloat16 (uint16 = bf16 bits), got {dtype}")


def _weight(w, stream=0):
    """(device array: float32, or uint16 bf16 bits; kind 'f32' | 'bf16')."""
    kind = _weight_kind(w.dtype)
    if kind == "bf16" and w.dtype != np.uint16:
        w = (np.ascontiguousarray(w) if isinstance(w, np.ndarray) else w).view(np.uint16)
    return to_device(w, stream=stream), kind


def _f32(a, name, ndim, stream=0):
    if np.dtype(a.dtype) != np.float32 or len(a.shape) != ndim:
        raise TypeError(f"{name} must be a {ndim}-d float32 array, got {a.dtype} {a.shape}")
    return to_device(a, stream=stream)


def _is_c_contiguous(a) -> bool:
    if isinstance(a, np.ndarray):
        return a.flags.c_contiguous
    return bool(getattr(a, "is_c_contiguous", lambda: True)())


def _aligned16(a) -> bool:
    """Base address 16-byte aligned (always true in the simulator, which has no addresses)."""
    if SIMULATOR:
        return True
    return a.device_ctypes_pointer.value % 16 == 0 if a.size else True


def _launch_1d(n, threads):
    return max(1, -(-n // threads)), threads


# ============================================================================ linear

def linear(x, w, *, out=None, method: str = "auto", config=None, stream=0, workspace=None):
    """``y [M, N] = x [M, K] w [N, K]^T`` (see reference.linear).

    ``method``: "skinny" (weight streaming: each weight element read once per ``mt`` rows of
    x; 16-byte vector loads when K % 8 == 0 and x, w are C-contiguous and 16-byte aligned,
    scalar loads otherwise), "tiled" (shared-memory SGEMM for prefill), or "auto": skinny up
    to SKINNY_MAX_M rows, else tiled.  ``config`` (a SkinnyConfig or TiledConfig) overrides
    the kernel shape and with it the method.  Error vs the float64 reference: at most
    (depth + 2) 2^-24 sum_k |x_k w_k|, depth = K/8 + 10 skinny, K tiled (docs/LAYERS.md).
    """
    xd = _f32(x, "x", 2, stream)
    wd, kind = _weight(w, stream)
    (m, k), n = xd.shape, wd.shape[0]
    if len(wd.shape) != 2 or wd.shape[1] != k:
        raise ValueError(f"linear wants x [M, K] and w [N, K], got {xd.shape}, {wd.shape}")
    y = _out(out, (m, n), np.float32, stream)
    if m == 0 or n == 0:
        return y
    if method not in ("auto", "skinny", "tiled"):
        raise ValueError(f"method must be auto, skinny or tiled, got {method!r}")
    tiled = isinstance(config, TiledConfig) or method == "tiled" or (
        method == "auto" and m > SKINNY_MAX_M and not isinstance(config, SkinnyConfig))
    if not tiled:
        cfg = config if isinstance(config, SkinnyConfig) else skinny_config(m, n, k, kind)
        _linear_skinny(xd, wd, _load_kind(kind, k, xd, wd), y, cfg, stream, workspace)
    else:
        cfg = config if isinstance(config, TiledConfig) else tiled_config()
        grid = (-(-n // (cfg.tx * cfg.tn)), -(-m // (cfg.ty * cfg.tm)))
        _tiled_kernel(cfg, kind == "bf16")[grid, cfg.ty * cfg.tx, stream](xd, wd, y, m, n, k)
    return y


def _load_kind(kind: str, k: int, *arrays) -> str:
    """kind itself when 16-byte vector loads are legal for every array, else its scalar twin."""
    vector = k % CHUNK == 0 and all(_is_c_contiguous(a) and _aligned16(a) for a in arrays)
    return kind if vector else kind + "s"


def _kernel_weight(wd, load_kind: str):
    """How a kernel of that kind takes the weight: bf16 vector rows as uint32 words."""
    return wd.view(np.uint32) if load_kind == "bf16" else wd


def _linear_skinny(xd, wd, load_kind, y, cfg: SkinnyConfig, stream, workspace):
    (m, k), n = xd.shape, wd.shape[0]
    wk = _kernel_weight(wd, load_kind)
    n_mchunks = -(-m // cfg.mt)
    blocks = n_mchunks * cfg.splits * -(-n // cfg.rows)
    launch = _skinny_linear_kernel(cfg, load_kind)[blocks, cfg.threads, stream]
    k8 = -(-k // CHUNK)
    if cfg.splits == 1:
        launch(xd, wk, y.reshape(1, m, n), m, n, k8, n_mchunks, 1)
        return
    part = _buffer(workspace, "linear.part", (cfg.splits, m, n), np.float32, stream)
    launch(xd, wk, part, m, n, k8, n_mchunks, cfg.splits)
    grid, block = _launch_1d(m * n, 256)
    _sum_splits[grid, block, stream](part, y)


# ============================================================================ RMSNorm

def _norm_threads():
    return 32 if SIMULATOR else 256


@functools.cache
def _rmsnorm_kernel(threads: int, is_bf16: bool):
    block_reduce = _make_block_reduce(1, threads)
    warps = threads // 32
    scr = _scratch_shape(1, threads)
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
            wv = _bf16_bits_to_f32(weight[d]) if is_bf16 else weight[d]
            y[row, d] = wv * (x[row, d] * inv)
    return rmsnorm_rows


def rmsnorm(x, weight, eps: float, *, out=None, stream=0, workspace=None):
    """See reference.rmsnorm.  Tolerance: 2e-6 relative (fp32 sum of squares)."""
    xd = _f32(x, "x", 2, stream)
    wd, kind = _weight(weight, stream)
    if tuple(wd.shape) != (xd.shape[1],):
        raise ValueError(f"rmsnorm wants weight [{xd.shape[1]}], got {wd.shape}")
    y = _out(out, xd.shape, np.float32, stream)
    if xd.shape[0]:
        threads = _norm_threads()
        _rmsnorm_kernel(threads, kind == "bf16")[xd.shape[0], threads, stream](
            xd, wd, y, np.float32(eps))
    return y


# ============================================================================ RoPE

@functools.cache
def _rope_kernel(half: int, interleave: bool, threads: int):
    @kernel
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
def _rope_tables(spec: RopeSpec):
    """(inv_freq on the device, float64; amplitude), copied once per spec and process."""
    return to_device(spec.inv_freq()), float(spec.amplitude())


@functools.cache
def _placeholder():
    """A 1-element device array passed where a kernel ignores an argument."""
    return to_device(np.zeros(1, np.float32))


def rope(x, positions, spec: RopeSpec, *, out=None, stream=0, workspace=None):
    """See reference.rope.  ``x`` may be a strided view (e.g. the rope part of q); ``out`` must
    not alias ``x``.  Angles and rotation in float64 (inv_freq computed on the host in float64
    by the reference code), so results match the reference to ~1 float32 ulp."""
    xd = _f32(x, "x", 3, stream)
    pd = to_device(positions, stream=stream)
    m, h, dr = xd.shape
    if dr != spec.head_dim or tuple(pd.shape) != (m,):
        raise ValueError(f"rope wants x [M, H, {spec.head_dim}] and positions [M], got "
                         f"{xd.shape}, {pd.shape}")
    inv_freq, amplitude = _rope_tables(spec)
    y = _out(out, (m, h, dr), np.float32, stream)
    if m:
        threads = 32 if SIMULATOR else 128
        _rope_kernel(dr // 2, spec.interleave, threads)[m, threads, stream](
            xd, pd, inv_freq, amplitude, y)
    return y


# ============================================================================ embedding, argmax

@functools.cache
def _embedding_kernel(is_bf16: bool):
    @kernel
    def embed(ids, table, y):
        """y[m, d] = table[ids[m], d]; an id outside [0, V) yields a NaN row (no host check)."""
        d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        row = cuda.blockIdx.x
        if d < y.shape[1]:
            tok = ids[row]
            if tok < 0 or tok >= table.shape[0]:
                y[row, d] = np.float32(math.nan)
            elif is_bf16:
                y[row, d] = _bf16_bits_to_f32(table[tok, d])
            else:
                y[row, d] = table[tok, d]
    return embed


def embedding(ids, table, *, out=None, stream=0, workspace=None):
    """See reference.embedding (out-of-range ids give NaN rows here instead of raising)."""
    idd = to_device(ids, stream=stream)
    td, kind = _weight(table, stream)
    m, d = idd.shape[0], td.shape[1]
    y = _out(out, (m, d), np.float32, stream)
    if m:
        threads = 32 if SIMULATOR else 256
        _embedding_kernel(kind == "bf16")[(m, -(-d // threads)), threads, stream](idd, td, y)
    return y


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


@functools.cache
def _argmax_kernel(threads: int):
    @kernel
    def argmax_rows(logits, out):
        """One block per row: each thread scans a strided slice, then a shared-memory tree."""
        vals = cuda.shared.array(threads, np.float32)
        idxs = cuda.shared.array(threads, np.int32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x
        best_v = np.float32(0.0)
        best_i = -1
        for i in range(t, logits.shape[1], threads):
            v = logits[row, i]
            if _beats(v, i, best_v, best_i):
                best_v = v
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
    ld = _f32(logits, "logits", 2, stream)
    if ld.shape[1] == 0:
        raise ValueError("argmax over an empty row")
    y = _out(out, (ld.shape[0],), np.int32, stream)
    if ld.shape[0]:
        threads = 32 if SIMULATOR else 1024
        _argmax_kernel(threads)[ld.shape[0], threads, stream](ld, y)
    return y


# ============================================================================ MoE routing

def router_logits(h, gate_w, *, stream=0, workspace=None):
    """``h gate_w^T`` [M, E] in fp32 through :func:`linear` (gate weights fp32 or bf16)."""
    return linear(h, gate_w, stream=stream, workspace=workspace)


@device_function
def _key_beats(kf, f, ke, e):
    """Expert/group f ranks before e: larger key, or equal key and lower index."""
    return kf > ke or (kf == ke and f < e)


@functools.cache
def _route_kernel(n_experts: int, n_group: int, threads: int, softmax: bool):
    group_size = n_experts // n_group

    @kernel
    def route_rows(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling,
                   out_idx, out_w):
        """One block per token, rules of reference.route_from_logits.  Ranks are counted
        (rank(e) = #experts that beat e), which is exact, order-free and tie-deterministic."""
        score = cuda.shared.array(n_experts, np.float32)
        key = cuda.shared.array(n_experts, np.float32)
        chosen = cuda.shared.array(n_experts, np.int32)
        group_score = cuda.shared.array(n_group, np.float32)
        group_kept = cuda.shared.array(n_group, np.int32)
        picked = cuda.shared.array(n_experts, np.float32)
        tree = cuda.shared.array(threads, np.float32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x

        if softmax:   # s = exp(l - max) / sum, both reductions as shared-memory trees
            top = -np.inf
            for e in range(t, n_experts, threads):
                top = max(top, logits[row, e])
            tree[t] = top
            _tree_reduce(tree, t, threads, True)
            top = tree[0]
            cuda.syncthreads()
            part = np.float32(0.0)
            for e in range(t, n_experts, threads):
                z = math.exp(logits[row, e] - top)
                score[e] = z
                part += z
            tree[t] = part
            _tree_reduce(tree, t, threads, False)
            total = tree[0]
            for e in range(t, n_experts, threads):
                score[e] = score[e] / total
        else:
            for e in range(t, n_experts, threads):
                score[e] = np.float32(1.0) / (np.float32(1.0) + math.exp(-logits[row, e]))
        cuda.syncthreads()
        for e in range(t, n_experts, threads):
            key[e] = score[e] + bias[e] if has_bias else score[e]
        cuda.syncthreads()

        if n_group > 1:
            for g in range(t, n_group, threads):
                first = -np.inf
                second = -np.inf
                for e in range(g * group_size, (g + 1) * group_size):
                    v = key[e]
                    if v > first:
                        second = first
                        first = v
                    elif v > second:
                        second = v
                group_score[g] = first if softmax else first + second
            cuda.syncthreads()
            for g in range(t, n_group, threads):
                rank = 0
                for f in range(n_group):
                    if _key_beats(group_score[f], f, group_score[g], g):
                        rank += 1
                group_kept[g] = 1 if rank < topk_group else 0
            cuda.syncthreads()
            for e in range(t, n_experts, threads):
                if group_kept[e // group_size] == 0:
                    key[e] = -np.inf
            cuda.syncthreads()

        for e in range(t, n_experts, threads):
            rank = 0
            for f in range(n_experts):
                if _key_beats(key[f], f, key[e], e):
                    rank += 1
            chosen[e] = 1 if rank < top_k else 0
        cuda.syncthreads()
        for e in range(t, n_experts, threads):
            if chosen[e] != 0:
                pos = 0
                for f in range(e):
                    pos += chosen[f]
                out_idx[row, pos] = e
                picked[pos] = score[e]
        cuda.syncthreads()
        if t == 0:   # ascending-expert order, one thread: a fixed summation order
            total = np.float32(0.0)
            for j in range(top_k):
                total += picked[j]
            tree[0] = total + np.float32(1e-20) if norm_topk_prob else np.float32(1.0)
        cuda.syncthreads()
        for j in range(t, top_k, threads):
            out_w[row, j] = picked[j] / tree[0] * scaling
    return route_rows


@device_function
def _tree_reduce(buf, t, threads, take_max):
    """buf[0] = max or sum of buf[0:threads] (threads a power of two); ends synchronised."""
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if t < stride:
            if take_max:
                buf[t] = max(buf[t], buf[t + stride])
            else:
                buf[t] = buf[t] + buf[t + stride]
        cuda.syncthreads()
        stride //= 2


def route_from_logits(logits, bias=None, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                      norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                      scoring: str = "sigmoid", out=None, stream=0, workspace=None):
    """See reference.route_from_logits; returns device arrays (idx int32, weight float32)
    (or fills ``out = (idx, weight)``).

    fp32 throughout (the reference is float64): indices equal the reference's except where two
    keys are within fp32 rounding (~1e-7) of each other; weights within 1e-6 relative."""
    ld = _f32(logits, "logits", 2, stream)
    m, n_experts = ld.shape
    _check_routing_args(n_experts, top_k, n_group, topk_group, scoring)
    has_bias = bias is not None
    bd = _f32(bias, "bias", 1, stream) if has_bias else _placeholder()
    if has_bias and bd.shape[0] != n_experts:
        raise ValueError(f"bias must have {n_experts} entries, got {bd.shape}")
    idx, w = (None, None) if out is None else out
    idx = _out(idx, (m, top_k), np.int32, stream)
    w = _out(w, (m, top_k), np.float32, stream)
    if m:
        threads = 32 if SIMULATOR else min(1024, max(32, _pow2_ceil(n_experts)))
        _route_kernel(n_experts, n_group, threads, scoring == "softmax")[m, threads, stream](
            ld, bd, has_bias, top_k, topk_group, bool(norm_topk_prob),
            np.float32(routed_scaling_factor), idx, w)
    return idx, w


def moe_route(h, gate_w, bias=None, *, out=None, stream=0, workspace=None, **routing):
    """See reference.moe_route: fp32 router logits (:func:`linear`) then route_from_logits."""
    logits = _buffer(workspace, "route.logits", (h.shape[0], gate_w.shape[0]), np.float32,
                     stream)
    linear(h, gate_w, out=logits, stream=stream, workspace=workspace)
    return route_from_logits(logits, bias, out=out, stream=stream, workspace=workspace,
                             **routing)


# ============================================================================ MoE FFN
# 1. group_by_expert (one block): counting sort of the M*k (token, expert) entries on the device:
#    per-expert offsets, the compact list of active experts, each entry's slot, each slot's token.
# 2. expert_gate_up: grid = (active expert, tile of R intermediate rows); the block streams R
#    gate rows and the R matching up rows of that expert once and applies them to all the
#    expert's tokens (MT at a time), writing act[slot] = silu(gate h) * (up h).
# 3. expert_down: same grid over D; y_slot[slot] = down_e act[slot].
# 4. shared expert: two linear() calls around a silu-mul kernel.
# 5. combine: out[m] = shared[m] + sum_j weight[m, j] y_slot[slot(m, j)], in j order.
# Entry order inside an expert (atomics) varies, results do not: every slot has its own sums.

@functools.cache
def _group_kernel(n_experts: int, threads: int):
    seg = -(-n_experts // threads)

    @kernel
    def group_by_expert(idx_flat, top_k, offsets, active, n_active, slot_of_entry,
                        token_of_slot):
        count = cuda.shared.array(n_experts, np.int32)
        start = cuda.shared.array(n_experts, np.int32)
        scan_c = cuda.shared.array(threads, np.int32)
        scan_a = cuda.shared.array(threads, np.int32)
        t = cuda.threadIdx.x
        n_entries = idx_flat.shape[0]
        for e in range(t, n_experts, threads):
            count[e] = 0
        cuda.syncthreads()
        for i in range(t, n_entries, threads):
            e = idx_flat[i]
            if 0 <= e < n_experts:   # an invalid index contributes nothing
                slot_of_entry[i] = cuda.atomic.add(count, e, 1)
        cuda.syncthreads()
        mine_c = 0
        mine_a = 0
        for e in range(t * seg, min(t * seg + seg, n_experts)):
            mine_c += count[e]
            mine_a += 1 if count[e] > 0 else 0
        scan_c[t] = mine_c
        scan_a[t] = mine_a
        cuda.syncthreads()
        offset = 1
        while offset < threads:        # Hillis-Steele inclusive scan of both totals
            vc = scan_c[t] + (scan_c[t - offset] if t >= offset else 0)
            va = scan_a[t] + (scan_a[t - offset] if t >= offset else 0)
            cuda.syncthreads()
            scan_c[t] = vc
            scan_a[t] = va
            cuda.syncthreads()
            offset *= 2
        at_c = scan_c[t] - mine_c
        at_a = scan_a[t] - mine_a
        for e in range(t * seg, min(t * seg + seg, n_experts)):
            start[e] = at_c
            offsets[e] = at_c
            if count[e] > 0:
                active[at_a] = e
                at_a += 1
            at_c += count[e]
        if t == threads - 1:
            offsets[n_experts] = scan_c[t]
            n_active[0] = scan_a[t]
        cuda.syncthreads()
        for i in range(t, n_entries, threads):
            e = idx_flat[i]
            if 0 <= e < n_experts:
                s = start[e] + slot_of_entry[i]
                slot_of_entry[i] = s
                token_of_slot[s] = i // top_k
            else:
                slot_of_entry[i] = -1
    return group_by_expert


@functools.cache
def _expert_kernel(cfg: SkinnyConfig, wkind: str, gate_up: bool):
    """expert_gate_up (gate_up=True) or expert_down; cfg.rows = outputs per block."""
    mt, r_out, threads = cfg.mt, cfg.rows, cfg.threads
    nr = 2 * r_out if gate_up else r_out           # weight rows streamed per block
    nacc, warps = mt * nr, threads // 32
    accumulate = _make_accumulate(mt, nr, threads, cfg.unroll, wkind)
    block_reduce = _make_block_reduce(nacc, threads)
    scr = _scratch_shape(nacc, threads)
    red_shape = (warps + 1, nacc)

    @kernel
    def expert_rows(x, token_of_slot, offsets, active, n_active, w3, out, n_out, k8, tiles):
        """gate_up: out = act [slots, Im], x = h [M, D], w3 = gate_up [E, 2Im, D/..];
        down: out = y_slot [slots, D], x = act (rows = slots), w3 = down [E, D, Im/..]."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        a = cuda.blockIdx.x // tiles
        if a >= n_active[0]:
            return
        e = active[a]
        o0 = (cuda.blockIdx.x - a * tiles) * r_out
        w = w3[e]
        wrows = cuda.local.array(nr, np.int32)
        xrows = cuda.local.array(mt, np.int32)
        acc = cuda.local.array(nacc, np.float32)
        for r in range(r_out):
            wrows[r] = min(o0 + r, n_out - 1)
            if gate_up:
                wrows[r_out + r] = n_out + min(o0 + r, n_out - 1)
        t = cuda.threadIdx.x
        s_end = offsets[e + 1]
        for s0 in range(offsets[e], s_end, mt):
            for m in range(mt):
                if s0 + m < s_end:
                    xrows[m] = token_of_slot[s0 + m] if gate_up else s0 + m
                else:
                    xrows[m] = -1
            for i in range(nacc):
                acc[i] = np.float32(0.0)
            accumulate(x, xrows, w, wrows, t, k8, acc)
            block_reduce(acc, red, scratch)
            if t < mt * r_out:
                m = t // r_out
                r = t - m * r_out
                if s0 + m < s_end and o0 + r < n_out:
                    v = red[warps, m * nr + r]
                    if gate_up:
                        v = _silu(v) * red[warps, m * nr + r_out + r]
                    out[s0 + m, o0 + r] = v
            cuda.syncthreads()     # red is reused by the next chunk of tokens
    return expert_rows


@device_function
def _silu(v):
    return v / (np.float32(1.0) + math.exp(-v))


@kernel
def _silu_mul(gu, act):
    """act[m, i] = silu(gu[m, i]) * gu[m, I + i]."""
    i = cuda.grid(1)
    inter = act.shape[1]
    if i < act.shape[0] * inter:
        m = i // inter
        c = i - m * inter
        act[m, c] = _silu(gu[m, c]) * gu[m, inter + c]


@functools.cache
def _combine_kernel(has_shared: bool):
    @kernel
    def combine(y_slot, slot_of_entry, weight, shared_y, out):
        """out[m, d] = shared_y[m, d] + sum_j weight[m, j] * y_slot[slot(m, j), d]."""
        m = cuda.blockIdx.x
        d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        top_k = weight.shape[1]
        if d < out.shape[1]:
            total = shared_y[m, d] if has_shared else np.float32(0.0)
            for j in range(top_k):
                s = slot_of_entry[m * top_k + j]
                if s >= 0:
                    total += weight[m, j] * y_slot[s, d]
            out[m, d] = total
    return combine


def expert_config(m: int, top_k: int, n_experts: int, k_in: int, gate_up: bool) -> SkinnyConfig:
    """Kernel shape for the expert GEMMs: mt ~ tokens per active expert; the most rows of
    ROWS_UNROLL (the grid, active experts x tiles, is large already).  ``rows`` counts outputs
    per block: a gate_up block streams 2*rows weight rows (gate and up)."""
    mt = _mt_for(max(1, -(-m * top_k // min(n_experts, m * top_k))))
    weight_rows, unroll = ROWS_UNROLL[mt][0]
    rows = weight_rows // 2 if gate_up else weight_rows
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k_in), unroll=unroll)


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None, *,
            out=None, stream=0, workspace=None):
    """See reference.moe_ffn.  Tokens are grouped by expert on the device; each active
    expert's weights are streamed once per call (per ``mt`` of its tokens).  Expert weights
    float32 or bf16 (both tensors of one kind; the shared expert may differ).  A dense FFN is
    the one-expert case (expert_idx zeros [M, 1], weight ones)."""
    hd = _f32(h, "h", 2, stream)
    idx = to_device(expert_idx, stream=stream)
    wt = _f32(weight, "weight", 2, stream)
    gud, kind = _weight(gate_up, stream)
    dnd, kind_down = _weight(down, stream)
    m, d = hd.shape
    n_experts, two_im, _ = gud.shape
    inter = two_im // 2
    top_k = idx.shape[1] if len(idx.shape) == 2 else 0
    if (tuple(gud.shape[1:]) != (two_im, d) or tuple(dnd.shape) != (n_experts, d, inter)
            or tuple(idx.shape) != (m, top_k) or tuple(wt.shape) != (m, top_k)
            or kind != kind_down or np.dtype(idx.dtype) != np.int32):
        raise ValueError("moe_ffn wants h [M,D], expert_idx int32 / weight [M,k], gate_up "
                         "[E,2Im,D] and down [E,D,Im] of one dtype")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("pass both shared_gate_up and shared_down, or neither")
    y = _out(out, (m, d), np.float32, stream)
    if m == 0:
        return y
    ws = workspace if workspace is not None else Workspace()
    n_entries = m * top_k
    offsets = ws.get("moe.offsets", (n_experts + 1,), np.int32, stream)
    active = ws.get("moe.active", (n_experts,), np.int32, stream)
    n_active = ws.get("moe.n_active", (1,), np.int32, stream)
    slot_of_entry = ws.get("moe.slot_of_entry", (n_entries,), np.int32, stream)
    token_of_slot = ws.get("moe.token_of_slot", (n_entries,), np.int32, stream)
    act = ws.get("moe.act", (n_entries, inter), np.float32, stream)
    y_slot = ws.get("moe.y_slot", (n_entries, d), np.float32, stream)

    threads = 32 if SIMULATOR else 1024
    _group_kernel(n_experts, threads)[1, threads, stream](
        idx.reshape(n_entries), top_k, offsets, active, n_active, slot_of_entry, token_of_slot)
    max_active = min(n_entries, n_experts)
    for is_gate_up, x_in, w3, out_buf, n_out, k_in in (
            (True, hd, gud, act, inter, d), (False, act, dnd, y_slot, d, inter)):
        load_kind = _load_kind(kind, k_in, x_in, w3)
        cfg = expert_config(m, top_k, n_experts, k_in, is_gate_up)
        tiles = -(-n_out // cfg.rows)
        _expert_kernel(cfg, load_kind, is_gate_up)[max_active * tiles, cfg.threads, stream](
            x_in, token_of_slot, offsets, active, n_active, _kernel_weight(w3, load_kind),
            out_buf, n_out, -(-k_in // CHUNK), tiles)

    shared_y = y_slot   # any float32 2-d array: the kernel ignores it without a shared expert
    if shared_gate_up is not None:
        gu = ws.get("moe.shared_gu", (m, 2 * shared_down.shape[1]), np.float32, stream)
        linear(hd, shared_gate_up, out=gu, stream=stream, workspace=ws)
        s_act = ws.get("moe.shared_act", (m, gu.shape[1] // 2), np.float32, stream)
        grid, block = _launch_1d(s_act.size, 256)
        _silu_mul[grid, block, stream](gu, s_act)
        shared_y = ws.get("moe.shared_y", (m, d), np.float32, stream)
        linear(s_act, shared_down, out=shared_y, stream=stream, workspace=ws)
    threads = 32 if SIMULATOR else 256
    _combine_kernel(shared_gate_up is not None)[(m, -(-d // threads)), threads, stream](
        y_slot, slot_of_entry, wt, shared_y, y)
    return y


# The attention kernels live in kdtree_numba/attention.py; one namespace for the whole model.
try:
    from .attention import *  # noqa: E402,F401,F403
except ImportError:  # pragma: no cover - the attention module is optional here
    pass

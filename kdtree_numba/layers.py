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
* batch invariance: a row's result does not depend on the other rows of the call -- every row
  has its own accumulators and a summation order fixed by the weight shape alone.  rmsnorm,
  rope, argmax: any M.  linear and moe_ffn run one of two kernels by M (``method="auto"``):
  weight streaming up to ``SKINNY_MAX_M`` rows, tiled above; each is batch invariant, and a
  row gets the same bits from any M on the same side, but the two sides sum in different
  orders (a row alone, M = 1, and the same row in a 65-row verify batch differ in the last
  bits; docs/LAYERS.md);
* a bf16 weight gives bit-identical results to the float32 weight holding the same values.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from kdtree_numba.compat import cuda, kernel, device_function, to_device, SIMULATOR  # noqa: F401
from kdtree_numba import compat
from reference.layers import RopeSpec, YarnScaling, _check_routing_args
from kdtree_numba.gpu.bits import bf16_bits_to_f32, bf16_hi, bf16_lo
from kdtree_numba.gpu.memory import (ld_cached_f32x4, ld_shared_f32x4, ld_stream_f32x4,
                                     ld_stream_u32x4, store_nowrap_1d, store_nowrap_2d)
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce, tree_reduce

__all__ = ["rmsnorm", "RopeSpec", "YarnScaling", "rope", "linear", "embedding", "argmax",
           "router_logits", "route_from_logits", "moe_route", "moe_ffn", "Workspace",
           "SkinnyConfig", "TiledConfig", "skinny_config", "tiled_config", "tiled_splits",
           "tiled_depth", "expert_tiled_configs", "expert_alternatives", "SKINNY_MAX_M"]

SKINNY_MAX_M = 16            # linear(), moe_ffn(): rows up to this use weight streaming
GPU_SMS = 132                # H200; only used to size grids (more SMs just means more waves)
CHUNK = 8                    # K elements per load step: one 16-byte bf16 vector, two fp32 ones

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
def _load_w8_f32_cached(w, n, j):
    """As _load_w8_f32 but through L1 (variant f32_load="cached": the second 16-byte half of
    each lane's 32 bytes may then hit the sector the first half brought in)."""
    a = ld_cached_f32x4(w, n, CHUNK * j)
    b = ld_cached_f32x4(w, n, CHUNK * j + 4)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


# float32 weights, f32_load="xchg" (the default).  A lane owns 8 consecutive floats (32 bytes)
# per chunk, so the two plain 16-byte loads of a warp each touch 32 sectors and use half of
# each: with L1 bypassed every sector crosses from L2 twice, and fp32 streaming stalled at
# ~2.75 TB/s while bf16 (one dense 16-byte load per lane) reached 4.4 TB/s.  Here the lower
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
def _load_x8(x, row, j):
    a = ld_cached_f32x4(x, row, CHUNK * j)
    b = ld_cached_f32x4(x, row, CHUNK * j + 4)
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
_LOAD_W8 = {"f32": _load_w8_f32, "f32x": _load_w8_f32_xchg, "f32c": _load_w8_f32_cached,
            "bf16": _load_w8_bf16, "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_bf16_scalar}
_LOAD_X8 = {"f32": _load_x8, "f32x": _load_x8, "f32c": _load_x8, "bf16": _load_x8,
            "f32s": _load_w8_f32_scalar, "bf16s": _load_w8_f32_scalar}
_F32_LOAD_KIND = {"xchg": "f32x", "stream": "f32", "cached": "f32c"}


def _skinny_kind(load_kind: str, f32_load: str) -> str:
    """The accumulate kind for a load kind: float32 vectors take the configured variant."""
    return _F32_LOAD_KIND[f32_load] if load_kind == "f32" else load_kind


@device_function
def _load_w1(w, n, k, is_bf16):
    """One weight element as float32 (w is float32, or uint16 bf16 bits)."""
    if is_bf16:
        return bf16_bits_to_f32(w[n, k])
    return w[n, k]


# ============================================================================ skinny GEMM core
# y[m, n] = sum_k x[m, k] w[n, k] for MT rows of x and NR rows of w per block.  The block's
# threads split K into 8-element chunks (thread t takes chunks t, t+THREADS, ...), each thread
# keeps MT*NR partial sums in registers, and the butterfly above adds them up.  Each weight
# element is loaded once per block (16-byte streaming loads, UNROLL chunks in flight per row);
# x chunks come through L1.  A row's arithmetic order depends on THREADS and the split only.

@functools.cache
def _make_accumulate(mt: int, nr: int, threads: int, unroll: int, wkind: str):
    """``accumulate(x, xrows, w, wrows, first, c1, acc, scratch)``: acc[m*NR + r] +=
    x[xrows[m]] . w[wrows[r]] over the chunks first + threadIdx, + THREADS, ... < c1.

    The body is generated as straight-line code (every (u, m, r) spelled out): the partial sums
    must stay in registers, which needs constant indices, and LLVM's loop unroller was seen to
    leave some (mt, rows, unroll) loops rolled, putting ``acc`` in local memory (PTX check).
    The FMA order per output is fixed: chunks in increasing j, the 8 elements in order.
    Kind "f32x" exchanges weight halves across the warp, so its loops count iterations from
    block-uniform values only (``first``, ``c1``: every lane runs them, the compiler can see
    the warp converged at the shuffles) and skip the FMAs of lanes past c1; ``scratch`` is
    only its (test-only) emulated exchange's shared buffer."""
    head = ["def accumulate(x, xrows, w, wrows, first, c1, acc, scratch):",
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
    else:
        src = [*head,
               f"    while j + {(unroll - 1) * threads} < c1:",
               *_chunk_group_source(mt, nr, threads, unroll, "        ", False),
               f"        j += {unroll * threads}",
               "    while j < c1:",
               *_chunk_group_source(mt, nr, threads, 1, "        ", False),
               f"        j += {threads}"]
    namespace = {"load_w8": _LOAD_W8[wkind], "load_x8": _LOAD_X8[wkind], "fma8": _fma8,
                 "cuda": cuda}
    exec(compile("\n".join(src), f"<accumulate mt={mt} nr={nr} unroll={unroll} {wkind}>",
                 "exec"), namespace)
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
    give bit-identical results; bf16 weights ignore it."""
    mt: int
    rows: int
    threads: int
    unroll: int
    splits: int = 1
    f32_load: str = "xchg"

    def __post_init__(self):
        nacc = self.mt * self.rows
        if self.threads % 32 or nacc & (nacc - 1) or nacc > self.threads:
            raise ValueError(f"bad SkinnyConfig {self}: threads % 32, mt*rows a power of two "
                             f"<= threads")
        if self.f32_load not in _F32_LOAD_KIND:
            raise ValueError(f"f32_load must be one of {sorted(_F32_LOAD_KIND)}")


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
    that still gives every SM four blocks (the simulator: the fewest blocks); threads from k
    alone (batch invariance).  Four, not two: the 2026-11-29 sweep at M = 1 found rows=2 best
    for N = 1536 (768 blocks) and rows=1 for N = 576, not the two-block choices rows=4 / 2.
    See docs/LAYERS.md; tools/bench_layers.py --only sweep."""
    mt = _mt_for(m)
    choices = ROWS_UNROLL[mt]
    rows, unroll = choices[-1]
    for cand_rows, cand_unroll in choices:
        if SIMULATOR or -(-n // cand_rows) >= 4 * GPU_SMS:
            rows, unroll = cand_rows, cand_unroll
            break
    if wkind == "f32" and mt <= 2 and rows * unroll > 4 and (mt, rows) != (1, 2):
        # a float32 chunk is 32 bytes, twice bf16's: half the chunks give the same bytes in
        # flight per thread, and rows * unroll = 16 needed ~200 registers with the exchange.
        # Not at one x row and two weight rows: the full sweep of run 13 (7168 -> 1536, the
        # shape that picks rows = 2) timed unroll 4 at 14.3 us against 15.3 us for 2.
        unroll = max(1, unroll // 2)
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k), unroll=unroll, splits=1)


@functools.cache
def _skinny_linear_kernel(cfg: SkinnyConfig, wkind: str):
    mt, nr, threads = cfg.mt, cfg.rows, cfg.threads
    nacc, warps = mt * nr, threads // 32
    accumulate = _make_accumulate(mt, nr, threads, cfg.unroll, _skinny_kind(wkind, cfg.f32_load))
    block_reduce = make_block_reduce(nacc, threads)
    scr = block_reduce_scratch_shape(nacc, threads)
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
        accumulate(x, xrows, w, wrows, s * k8 // splits, (s + 1) * k8 // splits, acc,
                   scratch)
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


# ============================================================================ tiled GEMM
# For M > SKINNY_MAX_M (the DDTree verify step, M = 65, and prefill) and for the MoE experts of
# such steps.  A block computes a BM x BN output tile for all of its BM rows at once, so each
# weight element comes from HBM once per block (once per call when M <= BM).  Weights and x
# are staged through shared memory in K stages of bk (double-buffered: the next stage's 16-byte
# global loads are in flight in registers while the FMAs of this one run; one barrier per
# stage), transposed so that a warp reads a k-row of the tile with LDS.128.  Thread (warp
# (wm_i, wn_i), lane (ly_i, lx_i)) owns rows rbase + [0, tm) and columns cbase + g*BN/(tn/4)
# + [0, 4) for each float4 group g, so per k step it issues tm/4 + tn/4 LDS.128 (the x loads
# are broadcasts) for tm*tn FMAs.  bf16 weights are widened when staged.  Every output is one
# sequential fp32 sum over its K slice in k order; slices (``splits``) are added in order.

@dataclass(frozen=True)
class TiledConfig:
    """Tiled GEMM shape: ``wm`` x ``wn`` warps, each warp ``ly`` lanes along M by ``32 // ly``
    along N; a thread computes ``tm`` rows (a multiple of 4) x ``tn`` columns (4, or 8 = two
    float4 groups BN/2 apart); K in stages of ``bk`` (a multiple of 8); ``splits`` K slices
    (linear only: separate blocks, then an ordered sum).  BM = wm*ly*tm, BN = wn*(32/ly)*tn."""
    wm: int = 3
    wn: int = 1
    ly: int = 2
    tm: int = 12
    tn: int = 8
    bk: int = 16
    splits: int = 1
    max_registers: int = 0       # ptxas cap (0: none), to fit more blocks per SM

    @property
    def lx(self) -> int:
        return 32 // self.ly

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def bm(self) -> int:
        return self.wm * self.ly * self.tm

    @property
    def bn(self) -> int:
        return self.wn * self.lx * self.tn

    @property
    def smem_bytes(self) -> int:
        return 2 * self.bk * (self.bn + 4 + self.bm + 4) * 4

    def __post_init__(self):
        if (self.tm % 4 or self.tn not in (4, 8) or self.ly not in (1, 2, 4, 8)
                or self.bk % CHUNK or self.bk <= 0 or self.splits < 1 or self.wm < 1
                or self.wn < 1 or self.threads > 1024 or self.smem_bytes > 48 * 1024):
            raise ValueError(f"bad TiledConfig {self}: tm % 4, tn in (4, 8), ly in (1, 2, 4, 8), "
                             f"bk % 8, <= 1024 threads, <= 48 KB shared memory")


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
    with ptxas) so that 12 warps share an SM.  Alternatives: tools/bench_layers.py."""
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


# Alternatives to tiled_config(65, ...) that tools/bench_layers.py times (the GPU tests check
# that they give the default's bits: same K slices, same sums).  The tiles are 72 rows each.
TILED_ALTERNATIVES = {
    "bk16": dict(bk=16),                                     # half the barriers, +regs
    "uncapped": dict(max_registers=0),                       # ~200 registers: 3 blocks/SM
    "6warps-ly1": dict(wm=6, ly=1, tm=12, max_registers=168),    # 72 x 256 tiles
    "9warps-tm8": dict(wm=9, ly=1, tm=8, max_registers=112),     # 64 accumulators
}


def _expert_tile() -> TiledConfig:
    """The expert GEMM tile: BM = 32 rows (4 warps along M, one 8-row group each) by BN = 256
    (32 lanes along N: 128 gate + 128 up outputs), so a warp with no live row skips its FMAs
    and one with 1-4 live rows does half of them."""
    return (TiledConfig(wm=1, wn=1, ly=1, tm=4, tn=8, bk=8) if SIMULATOR else
            TiledConfig(wm=4, wn=1, ly=1, tm=8, tn=8, bk=16))


def expert_tiled_configs(m: int):
    """[(TiledConfig, cmin, cmax)]: the launches of one tiled expert GEMM, each for the
    experts holding cmin <= count < cmax tokens (the others' blocks exit at once).  One launch
    of ``_expert_tile()`` for every count: an expert's tokens go through it in chunks of BM.
    Measured on the H200 at M = 65 (router-picked Kimi-K2 batch, 56 experts, 2026-11-29,
    tools/bench_layers.py --only moe): one class 3.92 ms; two classes (the 72-row tiled-linear
    tile for experts of more than 32 tokens) 5.36 ms; the same with a 16-row small tile 7.38
    ms.  The popular experts' one pass over their weights did not pay for running the two
    classes one after the other.  Other plans: expert_alternatives(m)."""
    return [(_expert_tile(), 1, 1 << 30)]


def expert_alternatives(m: int) -> dict:
    """Other launch plans for the routed experts at m tokens, which tools/bench_layers.py
    times (every plan sums each output the same way: the results are bit-identical)."""
    small = _expert_tile()
    big = dataclasses.replace(tiled_config(max(m, 17), 0, 0), splits=1)
    small16 = dataclasses.replace(small, wm=max(1, small.wm // 2), max_registers=168)  # BM/2
    wide = TiledConfig(wm=1, wn=3, ly=2, tm=12, tn=8, bk=8, max_registers=168)   # 24 x 384
    return {
        "two-class": [(small, 1, small.bm + 1), (big, small.bm + 1, 1 << 30)],
        "two-class-bm16": [(small16, 1, small16.bm + 1), (big, small16.bm + 1, 1 << 30)],
        "small-bk8": [(dataclasses.replace(small, bk=8), 1, 1 << 30)],
        "big-24x384": [(small, 1, 17), (wide, 17, 1 << 30)],
    }


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
    _put_if(out, row, col, limit, _silu(acc[base]) * acc[base + 4])
    _put_if(out, row, col + 1, limit, _silu(acc[base + 1]) * acc[base + 5])
    _put_if(out, row, col + 2, limit, _silu(acc[base + 2]) * acc[base + 6])
    _put_if(out, row, col + 3, limit, _silu(acc[base + 3]) * acc[base + 7])


class _Src:
    """Indented source lines for the generated kernels."""

    def __init__(self):
        self.lines, self.depth = [], 0

    def __call__(self, *lines):
        self.lines += ["    " * self.depth + line for line in lines]

    def indent(self, by=1):
        self.depth += by


def _tiled_source(cfg: TiledConfig, wkind: str, mode: str) -> str:
    """Source of the tiled kernel: mode "linear" (x rows m0.., split-K; out [splits*M, N]),
    "gate_up" (an expert's gathered tokens, gate and up rows side by side, out = act with
    silu(g) * u) or "down" (an expert's slots, out = y_slot).  Shared memory is two flat
    arrays, [2 buffers][bk][BN+4] and [2][bk][BM+4].  Thread t stages the 16-byte vectors
    t, t + THREADS, ... of each tile, row-major (K fastest, so a row's bk elements are read
    contiguously): all of a thread's vectors share one k offset, and their rows and shared
    offsets differ by constants, so only a handful of per-thread values stay live."""
    c = cfg
    bm, bn, threads, lx = c.bm, c.bn, c.threads, c.lx
    bnp, bmp = bn + 4, bm + 4                         # +4 floats: rows stay 16-byte aligned
    vw = 8 if wkind == "bf16" else 4                  # weight elements per staged vector
    wq_n, xq_n = c.bk // vw, c.bk // 4                # vectors per tile row
    lay = dict(c=c, wkind=wkind, mode=mode, bnp=bnp, bmp=bmp, vw=vw,
               gstride=bn // (c.tn // 4), half=bn // 2,
               rw=threads // wq_n, rx=threads // xq_n,          # tile rows per vector step
               nwv=-(-bn * wq_n // threads), nxv=-(-bm * xq_n // threads))
    src = _Src()
    if mode == "linear":
        src("def tiled(x, w, out, m_total, n_total, k_total, n_mtiles, splits, kc_total):")
    else:
        src("def tiled(x, token_of_slot, offsets, active, n_active, w3, out, n_out, k_total, "
            "tiles, cmin, cmax):")
    src.indent()
    align = "" if SIMULATOR else ", alignment=16"
    src(f"wsm = cuda.shared.array({2 * c.bk * bnp}, np.float32{align})",
        f"xsm = cuda.shared.array({2 * c.bk * bmp}, np.float32{align})",
        f"acc = cuda.local.array({c.tm * c.tn}, np.float32)",
        "t = cuda.threadIdx.x", "lane = t & 31", "warp = t >> 5",
        f"ly_i = lane // {lx}", f"lx_i = lane - ly_i * {lx}",
        f"rbase = (warp % {c.wm}) * {c.ly * c.tm} + ly_i * {c.tm}",
        f"cbase = (warp // {c.wm}) * {lx * 4} + lx_i * 4",
        "z = np.float32(0.0)", "z4 = (z, z, z, z)", "u0 = np.uint32(0)",
        "z4u = (u0, u0, u0, u0)", "bid = cuda.blockIdx.x",
        f"wl = t // {wq_n}", f"wq = (t - wl * {wq_n}) * {vw}", f"wo = wq * {bnp} + wl",
        f"xl = t // {xq_n}", f"xq = (t - xl * {xq_n}) * 4", f"xo = xq * {bmp} + xl")
    if mode == "linear":
        src("mt_i = bid % n_mtiles", "rest = bid // n_mtiles", "s = rest % splits",
            f"n0 = (rest // splits) * {bn}", f"m0 = mt_i * {bm}",
            f"k_begin = {CHUNK} * (s * kc_total // splits)",
            f"k_end = min({CHUNK} * ((s + 1) * kc_total // splits), k_total)",
            "orow = s * m_total + m0 + rbase", "nw = n0 + wl", "nlast = n_total - 1")
    else:
        tile_n = lay["half"] if mode == "gate_up" else bn
        src("a = bid // tiles", "if a >= n_active[0]:", "    return", "e = active[a]",
            "count = offsets[e + 1] - offsets[e]", "if count < cmin or count >= cmax:",
            "    return", "w = w3[e]", f"n0 = (bid - a * tiles) * {tile_n}",
            "k_begin = 0", "k_end = k_total", "nw = n0 + wl", "nlast = n_out - 1")
        if mode == "gate_up":     # tile rows [0, half) are gate rows n0.., the rest up rows
            half = lay["half"]
            for i in range(lay["nwv"]):
                src(f"wr{i} = min(nw + {i * lay['rw']}, nlast) if wl + {i * lay['rw']} < {half}"
                    f" else n_out + min(nw + {i * lay['rw'] - half}, nlast)")
    if mode == "linear":
        src(f"rows_here = min({bm}, m_total - m0)")
        _tiled_chunk_source(src, lay)
    else:
        src("s0 = offsets[e]", "s_end = offsets[e + 1]", "while s0 < s_end:")
        src.indent()
        src(f"rows_here = min({bm}, s_end - s0)")
        _tiled_chunk_source(src, lay)
        src(f"s0 += {bm}")
    return "\n".join(src.lines)


def _tiled_chunk_source(src, lay):
    """One pass over the block's K range for rows_here rows, then the epilogue."""
    c, wkind, mode = lay["c"], lay["wkind"], lay["mode"]
    tm4, bnp, bmp, rw, rx = c.tm // 4, lay["bnp"], lay["bmp"], lay["rw"], lay["rx"]
    stage_w, stage_x = c.bk * bnp, c.bk * bmp
    vec_x = wkind in ("f32", "bf16")
    # vector i is a real one when its tile row exists (the last step may be partial)
    w_real = [i * rw + rw <= c.bn for i in range(lay["nwv"])]
    x_real = [i * rx + rx <= c.bm for i in range(lay["nxv"])]
    for i in range(lay["nxv"]):   # x row of each staged x vector (-1: padding, zeros)
        row = {"linear": f"m0 + xl + {i * rx}", "gate_up": f"token_of_slot[s0 + xl + {i * rx}]",
               "down": f"s0 + xl + {i * rx}"}[mode]
        src(f"xr{i} = {row} if xl + {i * rx} < rows_here else -1")
    src(f"for i in range({c.tm * c.tn}):", "    acc[i] = z")
    if mode != "linear":          # live 4-row groups of this thread (warp-uniform when ly = 1)
        src(f"ng = min(max((rows_here - rbase + 3) // 4, 0), {tm4})")

    def load(kexpr):
        src(f"kw = {kexpr} + wq", f"kx = {kexpr} + xq", "okw = kw < k_end", "okx = kx < k_end")
        for i in range(lay["nwv"]):
            ok = "okw" if w_real[i] else f"okw and wl + {i * rw} < {c.bn}"
            row = f"wr{i}" if mode == "gate_up" else f"min(nw + {i * rw}, nlast)"
            if wkind == "bf16":
                src(f"wv{i} = ldw(w, {row}, kw >> 1) if {ok} else z4u")
            elif wkind == "f32":
                src(f"wv{i} = ldw(w, {row}, kw) if {ok} else z4")
            else:
                src(f"wv{i} = ldw(w, {row}, kw, k_end)" +
                    ("" if w_real[i] else f" if wl + {i * rw} < {c.bn} else z4"))
        for i in range(lay["nxv"]):
            if vec_x:
                src(f"xv{i} = ldx(x, xr{i}, kx) if okx and xr{i} >= 0 else z4")
            else:
                src(f"xv{i} = ldx(x, xr{i}, kx, k_end) if xr{i} >= 0 else z4")

    def store(buf):
        for i in range(lay["nwv"]):
            if not w_real[i]:
                src(f"if wl + {i * rw} < {c.bn}:")
                src.indent()
            stage = "stage8" if wkind == "bf16" else "stage4"
            src(f"{stage}(wsm, wo + {buf * stage_w + i * rw}, i64({bnp}), wv{i})")
            if not w_real[i]:
                src.indent(-1)
        for i in range(lay["nxv"]):
            if not x_real[i]:
                src(f"if xl + {i * rx} < {c.bm}:")
                src.indent()
            src(f"stage4(xsm, xo + {buf * stage_x + i * rx}, i64({bmp}), xv{i})")
            if not x_real[i]:
                src.indent(-1)

    def compute(groups):
        # k steps unrolled in pairs: constant shared offsets, no loop counter per step
        src(f"for kp in range({c.bk // 2}):")
        src.indent()
        src(f"xk = xb + kp * {2 * bmp}", f"wk = wb + kp * {2 * bnp}")
        for kk in range(2):
            src(*[f"a{g} = lds(xsm, xk + {kk * bmp + 4 * g})" for g in range(groups)])
            src(*[f"b{g} = lds(wsm, wk + {kk * bnp + g * lay['gstride']})"
                  for g in range(c.tn // 4)])
            b1 = "b1" if c.tn == 8 else "b0"
            src(*[f"fma_row(acc, i64({i * c.tn}), a{i // 4}[{i % 4}], b0, {b1})"
                  for i in range(4 * groups)])
        src.indent(-1)

    src("ks = k_begin")
    load("ks")
    store(0)
    src("cuda.syncthreads()", "buf = 0", "while ks < k_end:")
    src.indent()
    src(f"nxt = ks + {c.bk}", "if nxt < k_end:")
    src.indent()
    load("nxt")
    src.indent(-1)
    src(f"xb = buf * {stage_x} + rbase", f"wb = buf * {stage_w} + cbase")
    if mode == "linear":
        compute(tm4)
    else:
        for groups in range(tm4, 0, -1):
            src(("if" if groups == tm4 else "elif") + f" ng == {groups}:")
            src.indent()
            compute(groups)
            src.indent(-1)
    src("if nxt < k_end:")
    src.indent()
    src("if buf == 0:")
    src.indent()
    store(1)
    src.indent(-1)
    src("else:")
    src.indent()
    store(0)
    src.indent(-2)
    src("cuda.syncthreads()", "ks = nxt", "buf = 1 - buf")
    src.indent(-1)
    _tiled_epilogue_source(src, lay)


def _tiled_epilogue_source(src, lay):
    c, mode = lay["c"], lay["mode"]
    limit = "n_total" if mode == "linear" else "n_out"
    src("col = n0 + cbase")
    for i in range(c.tm):
        row = f"orow + {i}" if mode == "linear" else f"s0 + rbase + {i}"
        if mode == "gate_up":          # column j of group 0 is gate row n0+col, group 1 its up
            call = f"store_silu(out, {row}, col, {limit}, acc, i64({i * 8}))"
        else:
            call = (f"store_row(out, {row}, col, i64({lay['gstride']}), {limit}, acc, "
                    f"i64({i * c.tn}))")
        src(f"if rbase + {i} < rows_here:", "    " + call)


_TILED_LOADS = {"f32": (ld_stream_f32x4, ld_cached_f32x4),
                "bf16": (ld_stream_u32x4, ld_cached_f32x4),
                "f32s": (_ld4_f32_scalar, _ld4_f32_scalar),
                "bf16s": (_ld4_bf16_scalar, _ld4_f32_scalar)}


def _tiled_kernel(cfg: TiledConfig, wkind: str, mode: str = "linear"):
    """The tiled kernel for a load kind ("f32", "bf16", "f32s", "bf16s") and mode.  The K
    slice count is a launch argument: configs that differ only in it share one kernel."""
    return _tiled_kernel_for(dataclasses.replace(cfg, splits=1), wkind, mode)


@functools.cache
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
    src = _tiled_source(cfg, wkind, mode)
    exec(compile(src, f"<tiled {mode} {wkind} {cfg}>", "exec"), namespace)
    options = {"max_registers": cfg.max_registers} if cfg.max_registers else {}
    return kernel(namespace["tiled"], **options)


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
    x), "tiled" (register-blocked shared-memory GEMM: each weight element read once per BM
    rows, BM >= M up to 128), or "auto": skinny up to SKINNY_MAX_M rows, else tiled.
    ``config`` (a SkinnyConfig or TiledConfig) overrides the kernel shape and with it the
    method.  Both use 16-byte vector loads when K % 8 == 0 and x, w are C-contiguous and
    16-byte aligned, scalar loads otherwise.  Error vs the float64 reference: at most
    (depth + 2) 2^-24 sum_k |x_k w_k|, depth = K/8 + 10 skinny, tiled_depth(K, splits) tiled
    (<= K/8 + 15 for K >= 512) (docs/LAYERS.md).
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
    tiled = isinstance(config, TiledConfig) or (method == "tiled" and config is None) or (
        method == "auto" and m > SKINNY_MAX_M and not isinstance(config, SkinnyConfig))
    load_kind = _load_kind(kind, k, xd, wd)
    if not tiled:
        cfg = config if isinstance(config, SkinnyConfig) else skinny_config(m, n, k, kind)
        _linear_skinny(xd, wd, load_kind, y, cfg, stream, workspace)
    else:
        cfg = config if isinstance(config, TiledConfig) else tiled_config(m, n, k)
        _linear_tiled(xd, wd, load_kind, y, cfg, stream, workspace)
    return y


def _load_kind(kind: str, k: int, *arrays) -> str:
    """kind itself when 16-byte vector loads are legal for every array, else its scalar twin."""
    vector = k % CHUNK == 0 and all(_is_c_contiguous(a) and _aligned16(a) for a in arrays)
    return kind if vector else kind + "s"


def _kernel_weight(wd, load_kind: str):
    """How a kernel of that kind takes the weight: bf16 vector rows as uint32 words."""
    return wd.view(np.uint32) if load_kind == "bf16" else wd


def _linear_tiled(xd, wd, load_kind, y, cfg: TiledConfig, stream, workspace):
    (m, k), n = xd.shape, wd.shape[0]
    n_mtiles = -(-m // cfg.bm)
    blocks = n_mtiles * cfg.splits * -(-n // cfg.bn)
    launch = _tiled_kernel(cfg, load_kind, "linear")[blocks, cfg.threads, stream]
    wk, kc = _kernel_weight(wd, load_kind), -(-k // CHUNK)
    if cfg.splits == 1:
        launch(xd, wk, y, m, n, k, n_mtiles, 1, kc)
        return
    part = _buffer(workspace, "linear.part", (cfg.splits, m, n), np.float32, stream)
    launch(xd, wk, part.reshape(cfg.splits * m, n), m, n, k, n_mtiles, cfg.splits, kc)
    grid, block = _launch_1d(m * n, 256)
    _sum_splits[grid, block, stream](part, y)


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
                y[row, d] = bf16_bits_to_f32(table[tok, d])
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
            tree_reduce(tree, t, threads, True)
            top = tree[0]
            cuda.syncthreads()
            part = np.float32(0.0)
            for e in range(t, n_experts, threads):
                z = math.exp(logits[row, e] - top)
                score[e] = z
                part += z
            tree[t] = part
            tree_reduce(tree, t, threads, False)
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
    accumulate = _make_accumulate(mt, nr, threads, cfg.unroll, _skinny_kind(wkind, cfg.f32_load))
    block_reduce = make_block_reduce(nacc, threads)
    scr = block_reduce_scratch_shape(nacc, threads)
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
            accumulate(x, xrows, w, wrows, 0, k8, acc, scratch)
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
    if SIMULATOR:   # no registers to spare there, but blocks cost: the most rows a block allows
        weight_rows = 32 // mt
    rows = weight_rows // 2 if gate_up else weight_rows
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k_in), unroll=unroll)


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None, *,
            method: str = "auto", configs=None, out=None, stream=0, workspace=None):
    """See reference.moe_ffn.  Tokens are grouped by expert on the device.  ``method`` picks
    the routed experts' kernels: "skinny" (each active expert's weights streamed once per
    ``mt`` of its tokens), "tiled" (read once per BM of its tokens, register-blocked) or
    "auto": skinny up to SKINNY_MAX_M tokens, else tiled.  The shared expert is two
    :func:`linear` calls (which pick skinny or tiled by M the same way).  ``configs`` replaces the routed experts'
    tiled launches, ``[(TiledConfig, cmin, cmax)]`` (expert_tiled_configs; benchmarks).
    Expert weights float32 or bf16 (both tensors of one kind; the shared expert may differ).
    A dense FFN is the one-expert case (expert_idx zeros [M, 1], weight ones)."""
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
    if method not in ("auto", "skinny", "tiled"):
        raise ValueError(f"method must be auto, skinny or tiled, got {method!r}")
    y = _out(out, (m, d), np.float32, stream)
    if m == 0:
        return y
    tiled = method == "tiled" or (method == "auto" and m > SKINNY_MAX_M)
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
    lists = (token_of_slot, offsets, active, n_active)
    if tiled:
        _experts_tiled(hd, lists, gud, dnd, kind, act, y_slot, min(n_entries, n_experts), m,
                       top_k, stream, configs)
    else:
        _experts_skinny(hd, lists, gud, dnd, kind, act, y_slot, min(n_entries, n_experts), m,
                        top_k, stream)

    shared_y = y_slot   # any float32 2-d array: the kernel ignores it without a shared expert
    if shared_gate_up is not None:
        sgu, skind = _weight(shared_gate_up, stream)
        sdn, skind_down = _weight(shared_down, stream)
        s_inter = sdn.shape[1]
        if tuple(sgu.shape) != (2 * s_inter, d) or tuple(sdn.shape) != (d, s_inter) \
                or skind != skind_down:
            raise ValueError("shared expert wants gate_up [2Is, D] and down [D, Is] of one dtype")
        # The shared expert sees every token: linear() (skinny up to SKINNY_MAX_M rows, else
        # tiled with K slices, which keep all SMs busy where one expert's tiles would not).
        s_act = ws.get("moe.shared_act", (m, s_inter), np.float32, stream)
        shared_y = ws.get("moe.shared_y", (m, d), np.float32, stream)
        gu = ws.get("moe.shared_gu", (m, 2 * s_inter), np.float32, stream)
        linear(hd, sgu, out=gu, stream=stream, workspace=ws)
        grid, block = _launch_1d(s_act.size, 256)
        _silu_mul[grid, block, stream](gu, s_act)
        linear(s_act, sdn, out=shared_y, stream=stream, workspace=ws)
    threads = 32 if SIMULATOR else 256
    _combine_kernel(shared_gate_up is not None)[(m, -(-d // threads)), threads, stream](
        y_slot, slot_of_entry, wt, shared_y, y)
    return y


def _experts_skinny(hd, lists, gud, dnd, kind, act, y_slot, max_active, m, top_k, stream):
    """expert_gate_up then expert_down with the weight-streaming core (skinny_config shapes)."""
    n_experts, d, inter = dnd.shape
    for is_gate_up, x_in, w3, out_buf, n_out, k_in in (
            (True, hd, gud, act, inter, d), (False, act, dnd, y_slot, d, inter)):
        load_kind = _load_kind(kind, k_in, x_in, w3)
        cfg = expert_config(m, top_k, n_experts, k_in, is_gate_up)
        tiles = -(-n_out // cfg.rows)
        _expert_kernel(cfg, load_kind, is_gate_up)[max_active * tiles, cfg.threads, stream](
            x_in, *lists, _kernel_weight(w3, load_kind), out_buf, n_out, -(-k_in // CHUNK),
            tiles)


def _experts_tiled(hd, lists, gud, dnd, kind, act, y_slot, max_active, m, top_k, stream,
                   launches=None):
    """gate_up then down with the tiled kernel: grid = (active expert, N tile), the tile's
    weights read once per BM of the expert's tokens; one launch per count class
    (expert_tiled_configs: one class by default)."""
    n_experts, d, inter = dnd.shape
    for mode, x_in, w3, out_buf, n_out, k_in in (
            ("gate_up", hd, gud, act, inter, d), ("down", act, dnd, y_slot, d, inter)):
        load_kind = _load_kind(kind, k_in, x_in, w3)
        for cfg, cmin, cmax in launches or expert_tiled_configs(m):
            tiles = -(-n_out // (cfg.bn // 2 if mode == "gate_up" else cfg.bn))
            _tiled_kernel(cfg, load_kind, mode)[max_active * tiles, cfg.threads, stream](
                x_in, *lists, _kernel_weight(w3, load_kind), out_buf, n_out, k_in, tiles,
                cmin, cmax)


# The attention kernels live in kdtree_numba/attention.py; one namespace for the whole model.
try:
    from .attention import *  # noqa: E402,F401,F403
except ImportError:  # pragma: no cover - the attention module is optional here
    pass

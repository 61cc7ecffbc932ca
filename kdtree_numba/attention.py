"""Absorbed-MLA attention (prefill, decode, DDTree verify) as numba.cuda kernels.

The contract (shapes, dtypes, masking, the empty-row rule) is the docstring of
``reference/attention.py``; these functions compute the same thing in float32 on the device.
docs/ATTENTION.md explains the kernel design and the measured speed; the short version:

* One block owns a tile of ``rows`` flattened query-heads (row = i*H + h) of one request and one
  *split* (a contiguous range of key slots).  All query-heads of a request share the same keys
  (MQA with one latent head), so the block stages its queries in shared memory once and streams
  key tiles of ``keys`` slots x (r + dr) floats through shared memory with ``cp.async``; with
  two stages the next tile is in flight while the current one is computed.
* Per key tile: scores are a split-K register-blocked mini-GEMM (each lane an ``8 x 4`` block
  over a slice of the 576 columns, fed by 128-bit shared loads, reduce-scattered across lanes
  with shuffles; with ``k_warps = 2`` two warps share an output block and leave two partial
  tiles).  Then the online softmax: in registers where a warp's block spans whole rows
  ("fused"), else ``row_threads`` threads per row add the partial tiles from shared memory.
  Then every thread accumulates its ``rv x 4cv4`` block of the ``rows x r`` output from the
  probabilities and the same key tile (V = the first r columns).
* Long prefixes are split across blocks (flash-decoding): each split writes its unnormalised
  partial output and (reference max, sum); :func:`_merge_kernel` combines them.  With one
  split the kernel normalises and writes ``u`` directly.

Several tile layouts (:data:`VARIANTS`) compile from the one kernel body; one more,
``"tf32x3"`` (with ``"tf32x3acc"``), is the tensor-core kernel of
:mod:`kdtree_numba.attention_mma` (3xTF32, within the fp32 error bound, GPU only).  ``tools/bench_attention.py`` times them all; :func:`resolve_variant`
picks :data:`DEFAULT_VARIANT` where it runs and :data:`FALLBACK_VARIANT` elsewhere.
"""
from kdtree_numba.compat import cuda, kernel, to_device, SIMULATOR  # noqa: I001

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import float32, int32

from kdtree_numba import compat
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (cp_async16, cp_async_commit, cp_async_strided,
                                     cp_async_wait_all, load_f32x4, store_f32x4)
from kdtree_numba.gpu.reduce import make_reduce_scatter, make_row_group_reducers

__all__ = ["mla_attention", "absorb_q", "apply_uv", "MlaAttentionPlan", "TileConfig",
           "tile_config", "choose_splits", "resolve_variant", "VARIANTS", "DEFAULT_VARIANT",
           "FALLBACK_VARIANT", "FFMA_VARIANTS", "clear_plan_cache"]

NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
RESCALE_SLACK = np.float32(8.0)  # online softmax: lag of the reference point behind the max
MAX_SHARED_BYTES = 232448  # sm_90 opt-in dynamic shared memory per block (227 KiB)


# ---------------------------------------------------------------------------------------------
# Block geometry and masking, shared by the FFMA and the tensor-core kernels
# ---------------------------------------------------------------------------------------------
@inline_device_function
def block_keys(prefix_len, n, chunk):
    """(b, split, prefix, first, end) of this block (grid: row tiles x splits x requests):
    its request b, key split, the request's cached length, and the key slots [first, end):
    ``chunk`` slots from split * chunk, clipped to prefix + n; the last split takes the rest,
    whatever the plan's max_keys promised."""
    split, b = cuda.blockIdx.y, cuda.blockIdx.z
    prefix = prefix_len[b]
    first = split * chunk
    end = min(first + chunk, prefix + n)
    if split == cuda.gridDim.y - 1:
        end = prefix + n
    return b, split, prefix, first, end


@inline_device_function
def masked_score(s, key, end, prefix, visible, b, row_ok, query):
    """Score ``s`` of slot ``key``, or -inf where the slot lies past the split's end or is a new
    token that the row's query must not see (``visible[b, query, key - prefix]``)."""
    if key >= end:
        return NEG_INF
    if key >= prefix:
        if not row_ok:
            return NEG_INF
        if not visible[b, query, key - prefix]:
            return NEG_INF
    return s


def _tile_slot_fn(threads: int):
    """(row, float4 column) of slot ``tid + s*threads`` in a tile ``width4`` float4s wide.

    When ``width4`` divides the thread count the column is fixed per thread and the row steps
    by a constant, which keeps 64-bit division out of the per-tile load loop.
    """
    def tile_slot(tid, s, width4):
        if threads % width4 == 0:
            return tid // width4 + s * (threads // width4), tid % width4
        f = tid + s * threads
        return f // width4, f % width4
    return inline_device_function(tile_slot)


# ---------------------------------------------------------------------------------------------
# Tile configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """Compile-time shape of one attention block (see docs/ATTENTION.md for the layouts).

    Score phase (``rows x keys`` scores per tile, each the dot product of 576 = r + dr columns):
    lane (ks, gk, gr) = (lane % k_lanes, lane / k_lanes % key_lanes, lane / (k_lanes*key_lanes))
    of warp w computes a ``lane_rows x lane_keys`` block over the float4 columns
    ``s + k_splits*j`` with s = ks + k_lanes*(w / warps_per_k); ``k_lanes`` lanes reduce-scatter
    their partial blocks with shuffles and ``k_warps`` warps leave separate partial tiles that the
    softmax threads add.  Within a warp block, lane gr's rows are spread by ``8 / row_lanes``
    so that one 128-bit query load of all gr lanes hits each bank once.
    Softmax: ``row_threads = threads / rows`` consecutive-key threads per row.
    Output phase: thread (g, c) owns rows rv*g .. rv*g+rv-1 and the float4 columns
    4c + 4*cg*t (t < r/(4*cg)); within a warp ``out_lane_cols`` consecutive lanes take
    consecutive c.
    """
    r: int
    dr: int
    threads: int
    rows: int              # M: query-heads per block
    keys: int              # N: key slots per tile
    stages: int            # key-tile buffers: 2 = next tile loads while this one computes
    lane_rows: int         # score block of one lane: lane_rows x lane_keys
    lane_keys: int
    k_lanes: int           # lanes that split one block's columns (reduce-scattered)
    row_lanes: int         # lanes along rows / keys in a warp's score block
    key_lanes: int
    k_warps: int           # warps that split one block's columns (partial tiles in smem)
    cg: int                # output phase: float4 column groups
    rv: int                # output phase: rows per thread
    out_lane_cols: int
    score_unroll: int = 1  # column quads per score-loop iteration (2 spills)
    score_pad: int = 8     # floats added to a score-tile row (rows + 8: conflict-free softmax)
    scratch: int = 0       # floats of shared scratch (the simulator's stand-in for shuffles)

    @property
    def d(self):           # key width r + dr
        return self.r + self.dr

    @property
    def quads(self):       # float4 columns of a key
        return self.d // 4

    @property
    def row_stride(self):  # floats per staged query/key row; +4 shifts rows by 4 banks
        return self.d + 4

    @property
    def score_stride(self):  # floats per key of the transposed score tile [keys][rows + pad]
        return self.rows + self.score_pad

    @property
    def k_splits(self):
        return self.k_lanes * self.k_warps

    @property
    def warp_rows(self):
        return self.lane_rows * self.row_lanes

    @property
    def warp_keys(self):
        return self.lane_keys * self.key_lanes

    @property
    def row_spread(self):  # row distance between the gr lanes of a warp block
        return 8 // self.row_lanes if self.row_lanes > 1 else self.lane_rows

    @property
    def rg(self):          # output row groups
        return self.rows // self.rv

    @property
    def cv4(self):         # float4 column groups per thread
        return self.r // (4 * self.cg)

    @property
    def row_threads(self):  # threads that share one row's softmax (keys split among them)
        return self.threads // self.rows

    def smem_floats(self):
        return (self.rows + self.stages * self.keys) * self.row_stride \
            + self.k_warps * self.keys * self.score_stride + 2 * self.rows + self.scratch

    def smem_bytes(self):
        return 4 * self.smem_floats()

    def validate(self):
        warps = self.threads // 32
        pow2 = (1, 2, 4, 8, 16, 32)
        out_lane_rows = 32 // self.out_lane_cols
        out_warp_rows = -(-self.rg // out_lane_rows)
        ok = (self.r % 4 == 0 and self.dr % 4 == 0 and self.threads % 32 == 0
              and self.stages in (1, 2) and self.score_unroll in (1, 2)
              and self.k_lanes in pow2[:4] and self.row_lanes in pow2[:4]
              and self.k_lanes * self.row_lanes * self.key_lanes == 32
              and warps % self.k_warps == 0 and self.rows % self.warp_rows == 0
              and self.keys % self.warp_keys == 0
              and (self.rows // self.warp_rows) * (self.keys // self.warp_keys)
              == warps // self.k_warps
              and (self.lane_rows * self.lane_keys) % self.k_lanes == 0
              and self.lane_rows % self.row_spread == 0
              and self.threads % self.rows == 0 and self.row_threads in pow2
              and self.keys % self.row_threads == 0
              and self.rows % self.rv == 0 and self.r % (4 * self.cg) == 0
              and self.out_lane_cols in pow2
              and (warps // out_warp_rows) * self.out_lane_cols >= self.cg
              and self.smem_bytes() <= MAX_SHARED_BYTES)
        if not ok:
            raise ValueError(f"inconsistent attention tile configuration {self}")
        return self


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap that divides x."""
    p = cap
    while x % p:
        p //= 2
    return p


# Layouts that compile from the same kernel body (docs/ATTENTION.md compares them).  All stage
# 64 query-heads per block and give each lane an 8 x 4 (wide16: 4 x 4) score block.
# pipe16x2: 256 threads, two stages of 16-key tiles; a warp scores a 16 x 16 block over half the
#           columns, 4 lanes x 2 warps split the columns (fewest shared-memory wavefronts/FMA).
# pipe16:   256 threads, two stages of 16-key tiles; a warp scores an 8 x 16 block over all
#           columns, 8 lanes split them, and the softmax runs in registers (one barrier less).
# tile32:   256 threads, one stage of 32-key tiles (all cp.async issued at once, then waited
#           on), 16 x 16 warp blocks, 4 lanes split the columns: half the tiles, load exposed.
# wide16:   512 threads (16 warps: twice the latency hiding) at <= 128 registers each, two
#           stages of 16-key tiles, 4 x 16 outputs per thread; more instructions per FMA.
# tf32x3:   the tensor-core kernel of kdtree_numba/attention_mma.py (3xTF32 mma.sync, same
#           shared-memory layout and 16-key tiles as pipe16x2); GPU only, r and r + dr
#           multiples of 64.  Its mma chains run over a whole split: 5-12x the FFMA error
#           (within the fp32 bound), 1.06-1.25x of the roof.
# tf32x3acc: the same with short mma chains added in fp32 registers: the FFMA kernels'
#           accuracy at 15-17% more time (1.24-1.46x of the roof; docs/ATTENTION.md).
VARIANTS = {
    "tf32x3": dict(threads=256, keys=16, stages=2, tensor_cores=True, fp32_sums=False),
    "tf32x3acc": dict(threads=256, keys=16, stages=2, tensor_cores=True, fp32_sums=True),
    "pipe16x2": dict(threads=256, keys=16, stages=2, lane_rows=8, k_lanes=4, row_lanes=2,
                     key_lanes=4, k_warps=2),
    "pipe16": dict(threads=256, keys=16, stages=2, lane_rows=8, k_lanes=8, row_lanes=1,
                   key_lanes=4, k_warps=1),
    "tile32": dict(threads=256, keys=32, stages=1, lane_rows=8, k_lanes=4, row_lanes=2,
                   key_lanes=4, k_warps=1),
    "wide16": dict(threads=512, keys=16, stages=2, lane_rows=4, k_lanes=4, row_lanes=2,
                   key_lanes=4, k_warps=2),
}
# DEFAULT_VARIANT runs wherever it can (GPU, widths its tiles fit); elsewhere the best FFMA
# layout: FALLBACK_VARIANT had the best worst case on the H200 (run 3, docs/GPU_RESULTS.md),
# 1.52x / 1.51x / 1.73x of the roof at verify P4096 / P16384 / decode.
DEFAULT_VARIANT = "tf32x3"
FALLBACK_VARIANT = "pipe16x2"
FFMA_VARIANTS = tuple(v for v in VARIANTS if not VARIANTS[v].get("tensor_cores"))


def uses_tensor_cores(variant: str) -> bool:
    return bool(VARIANTS[variant].get("tensor_cores"))


def resolve_variant(variant, r: int, dr: int) -> str:
    """``variant``, checked; or for None the default where it can run, else the fallback."""
    if variant is None:
        if SIMULATOR or not _mma_fits(r, dr):
            return FALLBACK_VARIANT
        return DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r}; have {sorted(VARIANTS)}")
    return variant


def _mma_fits(r: int, dr: int) -> bool:
    from kdtree_numba.attention_mma import mma_fits
    return mma_fits(r, dr)


def gpu_tile_config(r: int, dr: int, variant: str = FALLBACK_VARIANT):
    """64 query-heads per block, ``lane_rows x 4`` score blocks per lane, and (at r = 512,
    256 threads) 8 rows x 16 columns of output per thread; narrower latents get fewer columns.
    The tensor-core variant has its own fixed layout (:class:`~kdtree_numba.attention_mma.
    MmaTileConfig`)."""
    if uses_tensor_cores(variant):
        from kdtree_numba.attention_mma import MmaTileConfig
        return MmaTileConfig(r, dr, fp32_sums=VARIANTS[variant]["fp32_sums"]).validate()
    v = VARIANTS[variant]
    threads, rows = v["threads"], 64
    cg = _pow2_divisor(r // 4, 32)
    cfg = TileConfig(r, dr, threads=threads, rows=rows, keys=v["keys"], stages=v["stages"],
                     lane_rows=v["lane_rows"], lane_keys=4, k_lanes=v["k_lanes"],
                     row_lanes=v["row_lanes"], key_lanes=v["key_lanes"], k_warps=v["k_warps"],
                     cg=cg, rv=max(1, rows * cg // threads), out_lane_cols=min(cg, 8))
    if cfg.smem_bytes() > MAX_SHARED_BYTES:
        cfg = replace(cfg, score_pad=4)
    return cfg.validate()


def sim_tile_config(r: int, dr: int, variant: str = FALLBACK_VARIANT) -> TileConfig:
    """The same layout with one warp per column split and 4 x 2 (8 x 2) lane blocks: the
    simulator costs ~30 ms per syncthreads, so blocks stay small.  It has no tensor cores."""
    if uses_tensor_cores(variant):
        raise ValueError(f"attention variant {variant!r} needs tensor cores; the CUDA "
                         f"simulator has none (use one of {FFMA_VARIANTS})")
    v = VARIANTS[variant]
    threads = 32 * v["k_warps"]
    lane_rows, lane_keys = max(4, v["k_lanes"]), 2  # k_lanes rows keep a fused softmax fused
    rows, keys = lane_rows * v["row_lanes"], lane_keys * v["key_lanes"]
    cg = _pow2_divisor(r // 4, 8)
    return TileConfig(r, dr, threads=threads, rows=rows, keys=keys, stages=v["stages"],
                      lane_rows=lane_rows, lane_keys=lane_keys, k_lanes=v["k_lanes"],
                      row_lanes=v["row_lanes"], key_lanes=v["key_lanes"],
                      k_warps=v["k_warps"], cg=cg, rv=max(1, rows * cg // threads),
                      out_lane_cols=min(cg, 8),
                      scratch=threads * lane_rows * lane_keys).validate()


def tile_config(r: int, dr: int, variant=None):
    """The tile shape used here for latent width r, rope width dr and a layout (None: the
    default that runs here, see :func:`resolve_variant`)."""
    variant = resolve_variant(variant, r, dr)
    return sim_tile_config(r, dr, variant) if SIMULATOR else gpu_tile_config(r, dr, variant)


BLOCK_OVERHEAD_KEYS = 64          # staging queries + writing outputs, in key-slot times
MERGE_BYTES_PER_KEY_TIME = 1.16e6  # HBM bytes the whole GPU moves while a block does one key


def choose_splits(blocks_per_split: int, max_keys: int, tile_keys: int, sm_count: int,
                  partial_bytes_per_block: int, max_splits: int = 64) -> int:
    """Number of key splits with the least modelled time, fewest splits on ties.

    One block fits per SM (the tiles take ~227 KiB of shared memory), so a request alone (decode:
    one row tile) would use one SM per split.  Model, in units of one key slot's time:
    waves * (keys per split, rounded up to tiles, + per-block overhead) + traffic of the partial
    outputs (written by the splits, read by the merge).
    """
    tiles = max(1, -(-max_keys // tile_keys))
    best, best_cost = 1, None
    for s in range(1, min(max_splits, tiles) + 1):
        tiles_per_split = -(-tiles // s)
        if s > 1 and -(-tiles // tiles_per_split) < s:
            continue  # some split would be empty
        waves = -(-blocks_per_split * s // sm_count)
        cost = waves * (tiles_per_split * tile_keys + BLOCK_OVERHEAD_KEYS)
        if s > 1:
            cost += 2 * s * blocks_per_split * partial_bytes_per_block / MERGE_BYTES_PER_KEY_TIME
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
def _row_tile_copier(cfg: TileConfig, rows: int):
    """``issue(smem, off, main, rope, b, first, limit, tid)``: cp.async rows ``first + i``
    (i < rows) of ``[main[b] | rope[b]]`` (widths r and dr) into the tile at smem[off] (row
    stride ``row_stride``); rows >= limit become zeros (their source row is clamped to
    limit - 1 >= 0, so no address leaves the array).  The caller commits.

    When the rows divide the threads evenly, thread tid copies row tid / (T/rows), float4
    columns tid % (T/rows) + (T/rows)*s: one address pair per row and array, the rest are
    constant offsets.  Otherwise float4 slots are dealt out round-robin.
    """
    T, QS = cfg.threads, cfg.row_stride
    DV4, DR4 = cfg.r // 4, cfg.dr // 4
    TPR = T // rows if T % rows == 0 else 0     # threads per row
    if TPR and DV4 % TPR == 0 and DR4 % TPR == 0:
        @inline_device_function
        def issue(smem, off, main, rope, b, first, limit, tid):
            i, quad = tid // TPR, tid % TPR
            src = min(first + i, limit - 1)
            nbytes = int32(16) if first + i < limit else int32(0)
            at = off + i * QS + 4 * quad
            cp_async_strided(smem, at, main, (b, src, 4 * quad), DV4 // TPR, TPR, nbytes)
            cp_async_strided(smem, at + DV4 * 4, rope, (b, src, 4 * quad), DR4 // TPR, TPR,
                             nbytes)
        return issue

    tile_slot = _tile_slot_fn(T)

    @inline_device_function
    def issue_any(smem, off, main, rope, b, first, limit, tid):
        for s in range(-(-rows * DV4 // T)):
            i, quad = tile_slot(tid, s, DV4)
            if rows * DV4 % T == 0 or i < rows:
                nbytes = int32(16) if first + i < limit else int32(0)
                cp_async16(smem, off + i * QS + 4 * quad, main,
                           (b, min(first + i, limit - 1), 4 * quad), nbytes)
        for s in range(-(-rows * DR4 // T)):
            i, quad = tile_slot(tid, s, DR4)
            if rows * DR4 % T == 0 or i < rows:
                nbytes = int32(16) if first + i < limit else int32(0)
                cp_async16(smem, off + i * QS + 4 * (DV4 + quad), rope,
                           (b, min(first + i, limit - 1), 4 * quad), nbytes)
    return issue_any


def _jit_options(cfg: TileConfig) -> dict:
    """Launch bounds past 256 threads, so ptxas keeps to 65536 / threads registers (a launch
    with more would fail).  Not below: for 256 threads they only made ptxas spill."""
    return {"launch_bounds": (cfg.threads,)} if cfg.threads > 256 else {}


@lru_cache(maxsize=None)
def _attention_kernel(cfg):
    """Build the block kernel for one configuration (constants are closed over): the FFMA
    kernel below for a TileConfig, the tensor-core one for an MmaTileConfig."""
    if not isinstance(cfg, TileConfig):
        from kdtree_numba.attention_mma import build_kernel
        return build_kernel(cfg)
    return _ffma_attention_kernel(cfg)


def _ffma_attention_kernel(cfg: TileConfig):
    """The FFMA (CUDA-core) kernel: register-blocked mini-GEMMs, see the module docstring."""
    T, M, N, STAGES = cfg.threads, cfg.rows, cfg.keys, cfg.stages
    Q4 = cfg.quads
    QS, ST = cfg.row_stride, cfg.score_stride
    # score phase
    SA, SB, KL, GK, KW = cfg.lane_rows, cfg.lane_keys, cfg.k_lanes, cfg.key_lanes, cfg.k_warps
    KSP = cfg.k_splits
    QPS = -(-Q4 // KSP)                   # column quads per split
    Q_EXACT = Q4 % KSP == 0
    QU = min(cfg.score_unroll, QPS)       # 1 or 2 quads per loop iteration
    RSP, GRD = cfg.row_spread, cfg.row_spread * cfg.row_lanes  # a -> a%RSP + (a//RSP)*GRD
    WPK = T // 32 // KW                   # warps per column split
    WROWS, WKEYS = cfg.warp_rows, cfg.warp_keys
    RTILES = M // WROWS
    SC = SA * SB
    OWN = SC // KL                        # complete scores a lane holds after reduce-scatter
    H1, H2, H3 = [(SC >> (k + 1)) if (1 << k) < KL else 0 for k in range(3)]
    # output phase
    CG, RV, CV4, CLW = cfg.cg, cfg.rv, cfg.cv4, cfg.out_lane_cols
    RG = cfg.rg
    RLW = 32 // CLW
    WR = -(-RG // RLW)
    P_VEC = RV % 4 == 0                   # a thread's probabilities load as float4s
    ACC, KF, PF = RV * CV4 * 4, SB * 4, RV  # register (local) array sizes
    PU = 2 if N % 2 == 0 else 1           # P.V loop unroll
    # softmax.  Fused: a warp's score block spans whole rows (all N keys, one column split),
    # so after the reduce-scatter lane (ks, gk) holds row a = own0 / SB, keys gk*SB + bb, and
    # the softmax runs in registers (row reductions over the GK lanes ks + KL*gk).
    # Otherwise TPR threads per row take keys part + TPR*jj from the partial tiles in smem.
    FUSED = KW == 1 and cfg.warp_keys == N and SC // KL == SB and cfg.row_lanes == 1
    TPR = cfg.row_threads
    RPW = 32 // TPR                       # rows per warp in the separate softmax layout
    KPT = SB if FUSED else N // TPR       # keys per softmax thread
    SK_STEP = 1 if FUSED else TPR         # key distance between them
    # shared memory: queries [M][QS], key tiles STAGES x [N][QS], partial score tiles
    # KW x [N][ST] (tile 0 then holds the probabilities), rescale factors [M], sums [M],
    # simulator-only scratch
    Q_OFF, KV_OFF = 0, M * QS
    PS_OFF = KV_OFF + STAGES * N * QS
    ALPHA_OFF = PS_OFF + KW * N * ST
    L_OFF = ALPHA_OFF + M
    SCR_OFF = L_OFF + M
    if FUSED:
        row_max, row_sum = make_row_group_reducers(GK, KL, SCR_OFF)
    else:
        row_max, row_sum = make_row_group_reducers(TPR, RPW, SCR_OFF)
    reduce_scatter = make_reduce_scatter(SC, KL, SCR_OFF)
    copy_keys = _row_tile_copier(cfg, N)
    copy_queries = _row_tile_copier(cfg, M)

    QSTEP = 4 * KSP                       # floats between a lane's column quads

    @inline_device_function
    def score_quad(sc, kf, smem, q_at, k_at, col):
        """sc += the lane's block of q k^T over one column quad (q_at, k_at: its offsets)."""
        if Q_EXACT or col < 4 * Q4:
            for bb in range(SB):
                k0, k1, k2, k3 = load_f32x4(smem, k_at + bb * QS)
                kf[4 * bb], kf[4 * bb + 1], kf[4 * bb + 2], kf[4 * bb + 3] = k0, k1, k2, k3
            for a in range(SA):
                q0, q1, q2, q3 = load_f32x4(smem, q_at + (a % RSP + a // RSP * GRD) * QS)
                for bb in range(SB):
                    v = sc[a * SB + bb]
                    v += q0 * kf[4 * bb]
                    v += q1 * kf[4 * bb + 1]
                    v += q2 * kf[4 * bb + 2]
                    v += q3 * kf[4 * bb + 3]
                    sc[a * SB + bb] = v

    @inline_device_function
    def pv_key(acc, pf, smem, p_at, v_at):
        """acc += p[rows] v[columns] for one key (p_at, v_at: offsets of the thread's first)."""
        if P_VEC:
            for a4 in range(RV // 4):
                pf[4 * a4], pf[4 * a4 + 1], pf[4 * a4 + 2], pf[4 * a4 + 3] = \
                    load_f32x4(smem, p_at + 4 * a4)
        else:
            for a in range(RV):
                pf[a] = smem[p_at + a]
        for t in range(CV4):
            v0, v1, v2, v3 = load_f32x4(smem, v_at + 4 * CG * t)
            for a in range(RV):
                p = pf[a]
                x = (a * CV4 + t) * 4
                acc[x] += p * v0
                acc[x + 1] += p * v1
                acc[x + 2] += p * v2
                acc[x + 3] += p * v3

    @kernel(**_jit_options(cfg))
    def mla_attention_tiles(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                            direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        row0 = cuda.blockIdx.x * M
        n_rows = n * heads
        b, split, prefix, kbeg, kend = block_keys(prefix_len, n, chunk)

        copy_queries(smem, Q_OFF, q_abs, q_pe, b, row0, n_rows, tid)
        if STAGES == 2:
            copy_keys(smem, KV_OFF, ckv, kpe, b, kbeg, kend, tid)
        cp_async_commit()

        # score phase: lane (ks, gk, gr) of warp (kw, key tile, row tile)
        ks = lane % KL
        gk = lane // KL % GK
        gr = lane // (KL * GK)
        kw = warp // WPK
        srow0 = (warp % WPK % RTILES) * WROWS + gr * RSP
        skey0 = (warp % WPK // RTILES) * WKEYS + gk * SB
        col0 = 4 * (ks + KL * kw)
        own0 = (ks & 1) * H1 + ((ks >> 1) & 1) * H2 + ((ks >> 2) & 1) * H3
        # softmax phase: row srow, keys sk0 + SK_STEP*jj; row_writer: one lane per row
        if FUSED:
            srow = srow0 + own0 // SB
            sk0, row_writer = skey0, gk == 0
        else:
            srow = warp * RPW + lane % RPW
            sk0, row_writer = lane // RPW, lane // RPW == 0
        srow_ok = row0 + srow < n_rows
        squery = (row0 + srow) // heads   # the new-token index whose mask row applies
        # output phase: rows RV*g + a, float4 columns c + CG*t
        g = (warp % WR) * RLW + lane // CLW
        c = (warp // WR) * CLW + lane % CLW
        pv_ok = g < RG and c < CG

        acc = cuda.local.array(ACC, float32)
        for x in range(ACC):
            acc[x] = ZERO
        sc = cuda.local.array(SC, float32)
        kf = cuda.local.array(KF, float32)
        pf = cuda.local.array(PF, float32)
        sv = cuda.local.array(KPT, float32)
        m_run = NEG_INF  # online-softmax state of this thread's softmax row
        l_run = ZERO

        stage = 0
        for t0 in range(kbeg, kend, N):
            kv = KV_OFF + stage * (N * QS)
            if STAGES == 1:
                cuda.syncthreads()  # the previous tile's readers are done with it
                copy_keys(smem, kv, ckv, kpe, b, t0, kend, tid)
                cp_async_commit()
            cp_async_wait_all()
            cuda.syncthreads()  # tile t0 (and the queries) landed; tile t0 - N is consumed
            if STAGES == 2:
                if t0 + N < kend:  # prefetch the next tile into the other buffer
                    copy_keys(smem, KV_OFF + (1 - stage) * (N * QS), ckv, kpe, b, t0 + N,
                              kend, tid)
                    cp_async_commit()

            # scores: sc[a, bb] = q[row a] . k[key bb] over this lane's column quads
            for x in range(SC):
                sc[x] = ZERO
            q_at = Q_OFF + srow0 * QS + col0
            k_at = kv + skey0 * QS + col0
            for j in range(int32(QPS // QU)):
                score_quad(sc, kf, smem, q_at, k_at, col0 + QSTEP * QU * j)
                if QU == 2:
                    score_quad(sc, kf, smem, q_at + QSTEP, k_at + QSTEP,
                               col0 + QSTEP * (QU * j + 1))
                q_at += QU * QSTEP
                k_at += QU * QSTEP
            if QPS % QU:
                score_quad(sc, kf, smem, q_at, k_at, col0 + QSTEP * (QPS - 1))
            reduce_scatter(sc, ks, own0, smem, tid)
            if FUSED:
                for jj in range(KPT):
                    sv[jj] = sc[jj]
            else:  # leave the partial tile, then gather this thread's row from all of them
                for x in range(OWN):
                    a, bb = (own0 + x) // SB, (own0 + x) % SB
                    row = srow0 + a % RSP + a // RSP * GRD
                    smem[PS_OFF + kw * (N * ST) + (skey0 + bb) * ST + row] = sc[x]
                cuda.syncthreads()
                for jj in range(KPT):
                    at = PS_OFF + (sk0 + SK_STEP * jj) * ST + srow
                    s = smem[at]
                    for w in range(1, KW):
                        s += smem[at + w * (N * ST)]
                    sv[jj] = s

            # online softmax: scale and mask sv; probabilities go to partial tile 0.  The
            # reference point m_run moves only when a score exceeds it by more than
            # RESCALE_SLACK, so most tiles skip rescaling the accumulator (p <= e^8 is harmless
            # in float32); every thread of a row keeps the same (m_run, l_run).
            m_tile = NEG_INF
            for jj in range(KPT):
                s = masked_score(sv[jj] * tau, t0 + sk0 + SK_STEP * jj, kend, prefix, visible,
                                 b, srow_ok, squery)
                sv[jj] = s
                m_tile = max(m_tile, s)
            m_tile = row_max(m_tile, smem, tid)
            alpha = ONE
            if m_tile > m_run + RESCALE_SLACK:  # also the first visible score (m_run = -inf)
                alpha = math.exp(m_run - m_tile)
                m_run = m_tile
            m_safe = m_run if m_run > NEG_INF else ZERO  # nothing visible yet: all p = 0
            total = ZERO
            for jj in range(KPT):
                p = math.exp(sv[jj] - m_safe)
                smem[PS_OFF + (sk0 + SK_STEP * jj) * ST + srow] = p
                total += p
            l_run = l_run * alpha + row_sum(total, smem, tid)
            if row_writer:
                smem[ALPHA_OFF + srow] = alpha
            # the barrier also tells whether any row's reference moved (else skip the rescale)
            rescale = cuda.syncthreads_or(int32(alpha != ONE))

            # acc = alpha * acc + P V for rows RV*g + a, columns of c (V = first DV columns)
            if pv_ok:
                if rescale:
                    for a in range(RV):
                        alpha = smem[ALPHA_OFF + RV * g + a]
                        for x in range(CV4 * 4):
                            acc[a * CV4 * 4 + x] *= alpha
                p_at = PS_OFF + RV * g
                v_at = kv + 4 * c
                for j in range(int32(N // PU)):
                    pv_key(acc, pf, smem, p_at, v_at)
                    if PU == 2:
                        pv_key(acc, pf, smem, p_at + ST, v_at + QS)
                    p_at += PU * ST
                    v_at += PU * QS
            stage = 1 - stage if STAGES == 2 else 0
        cp_async_wait_all()  # nothing may be in flight when the block exits

        # epilogue: normalised u (one split) or the split's partial output and (max, sum)
        if row_writer:
            smem[L_OFF + srow] = l_run
            if not direct and srow_ok:
                part_ml[b, split, row0 + srow, 0] = m_run
                part_ml[b, split, row0 + srow, 1] = l_run
        cuda.syncthreads()
        if pv_ok:
            for a in range(RV):
                row = RV * g + a
                if row0 + row < n_rows:
                    scale = ONE
                    if direct:
                        l_row = smem[L_OFF + row]
                        scale = ONE / l_row if l_row > ZERO else ZERO  # sees nothing -> zeros
                    for t in range(CV4):
                        x = (a * CV4 + t) * 4
                        col = 4 * (c + CG * t)
                        if direct:
                            store_f32x4(out, (b, row0 + row, col), acc[x] * scale,
                                   acc[x + 1] * scale, acc[x + 2] * scale, acc[x + 3] * scale)
                        else:
                            store_f32x4(part_o, (b, split, row0 + row, col), acc[x], acc[x + 1],
                                   acc[x + 2], acc[x + 3])

    return mla_attention_tiles


MERGE_THREADS = 128


@lru_cache(maxsize=None)
def _merge_kernel(r: int):
    """out[b, row] = sum_s w_s O_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s)."""
    DV4 = r // 4

    @kernel
    def merge_splits(part_o, part_ml, splits, out):
        row, b = cuda.blockIdx.x, cuda.blockIdx.y
        m_max = NEG_INF
        for s in range(splits):
            m_max = max(m_max, part_ml[b, s, row, 0])
        m_safe = m_max if m_max > NEG_INF else ZERO
        total = ZERO
        for s in range(splits):
            total += math.exp(part_ml[b, s, row, 0] - m_safe) * part_ml[b, s, row, 1]
        scale = ONE / total if total > ZERO else ZERO
        for quad in range(cuda.threadIdx.x, DV4, cuda.blockDim.x):
            y0 = y1 = y2 = y3 = ZERO
            for s in range(splits):
                w = math.exp(part_ml[b, s, row, 0] - m_safe)
                x0, x1, x2, x3 = load_f32x4(part_o, (b, s, row, 4 * quad))
                y0 += w * x0
                y1 += w * x1
                y2 += w * x2
                y3 += w * x3
            store_f32x4(out, (b, row, 4 * quad), y0 * scale, y1 * scale, y2 * scale, y3 * scale)

    return merge_splits


# ---------------------------------------------------------------------------------------------
# Launch plumbing
# ---------------------------------------------------------------------------------------------
_SMEM_READY = set()


def _allow_large_shared_memory(dispatcher, args, nbytes):
    """Opt the compiled kernel in to > 48 KiB of dynamic shared memory (a no-op in the sim).

    numba-cuda 0.30 launches through cuda.core, which does not raise the per-function limit
    itself; without this the launch fails with CUDA_ERROR_INVALID_VALUE.
    """
    if SIMULATOR or nbytes <= 48 * 1024:
        return
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    compiled = dispatcher.compile(argtypes)
    cufunc = compiled._codelibrary.get_cufunc()
    key = (id(cufunc), nbytes)
    if key in _SMEM_READY:
        return
    from numba.cuda.cudadrv import driver as drv
    attr = drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    drv.driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _SMEM_READY.add(key)


@lru_cache(maxsize=1)
def _sm_count() -> int:
    if SIMULATOR:
        return 4
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


class MlaAttentionPlan:
    """Buffers, split count and configured kernels for one problem shape; call it to run.

    Reuse one plan per shape in a decode loop: it allocates nothing per call, so its launches
    can also be captured in a CUDA graph.  ``max_keys`` bounds ``prefix_len + n`` and only sets
    the split count (default: ``max_len``); ``keys_per_split`` forces a split size (tests);
    ``variant`` picks a tile layout from :data:`VARIANTS` (None: :func:`resolve_variant`).
    """

    def __init__(self, bs, n, heads, r, dr, max_len, *, max_keys=None, keys_per_split=None,
                 variant=None, stream=0):
        compat.require_kernels()
        self.shape = (bs, n, heads, r, dr, max_len)
        variant = resolve_variant(variant, r, dr)
        self.variant = variant
        self.cfg = tile_config(r, dr, variant)
        self.stream = stream
        self.n_rows = n * heads
        row_tiles = -(-self.n_rows // self.cfg.rows)
        max_keys = max_len if max_keys is None else min(int(max_keys), max_len)
        if keys_per_split is None:
            splits = choose_splits(row_tiles * bs, max_keys, self.cfg.keys, _sm_count(),
                                   4 * self.cfg.rows * (r + 2))
            tiles = -(-max(1, max_keys) // self.cfg.keys)
            keys_per_split = -(-tiles // splits) * self.cfg.keys
        self.chunk = int(keys_per_split)
        self.splits = max(1, -(-max_keys // self.chunk))
        self.grid = (row_tiles, self.splits, bs)
        self.attn = _attention_kernel(self.cfg)
        self.merge = _merge_kernel(r) if self.splits > 1 else None
        if self.splits > 1:
            self.part_o = cuda.device_array((bs, self.splits, self.n_rows, r), np.float32,
                                            stream=stream)
            self.part_ml = cuda.device_array((bs, self.splits, self.n_rows, 2), np.float32,
                                             stream=stream)
        else:  # unused by the kernel, but typed arguments must exist
            self.part_o = cuda.device_array((1, 1, 1, 4), np.float32, stream=stream)
            self.part_ml = cuda.device_array((1, 1, 1, 2), np.float32, stream=stream)

    def __call__(self, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=None, stream=None):
        """Run on the plan's stream, or on ``stream`` if given (a CUDA-graph capture's)."""
        bs, n, heads, r, dr, max_len = self.shape
        _check_shapes(self.shape, q_abs, q_pe, ckv, kpe, prefix_len, visible)
        st = self.stream if stream is None else stream
        q_abs3 = to_device(q_abs, st).reshape(bs, self.n_rows, r)
        q_pe3 = to_device(q_pe, st).reshape(bs, self.n_rows, dr)
        ckv_d, kpe_d = to_device(ckv, st), to_device(kpe, st)
        prefix_d = to_device(_as_int32(prefix_len), st)
        visible_d = to_device(_as_bool(visible), st)
        if out is None:
            out = cuda.device_array((bs, n, heads, r), np.float32, stream=st)
        out3 = out.reshape(bs, self.n_rows, r)
        direct = self.splits == 1
        args = (q_abs3, q_pe3, ckv_d, kpe_d, prefix_d, visible_d, np.float32(tau), np.int64(n),
                np.int64(heads), np.int64(self.chunk), direct, out3, self.part_o, self.part_ml)
        nbytes = self.cfg.smem_bytes()
        _allow_large_shared_memory(self.attn, args, nbytes)
        self.attn[self.grid, self.cfg.threads, st, nbytes](*args)
        if not direct:
            self.merge[(self.n_rows, bs), min(MERGE_THREADS, r // 4), st](
                self.part_o, self.part_ml, np.int64(self.splits), out3)
        return out


def _as_int32(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.int32)


def _as_bool(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.bool_)


def _check_shapes(shape, q_abs, q_pe, ckv, kpe, prefix_len, visible):
    bs, n, heads, r, dr, max_len = shape
    want = {"q_abs": (bs, n, heads, r), "q_pe": (bs, n, heads, dr), "ckv": (bs, max_len, r),
            "kpe": (bs, max_len, dr), "prefix_len": (bs,), "visible": (bs, n, n)}
    got = {"q_abs": q_abs, "q_pe": q_pe, "ckv": ckv, "kpe": kpe, "prefix_len": prefix_len,
           "visible": visible}
    for name, arr in got.items():
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]}")
    for name in ("q_abs", "q_pe", "ckv", "kpe"):
        if np.dtype(got[name].dtype) != np.float32:
            raise TypeError(f"{name} must be float32, got {got[name].dtype}")
    if np.dtype(visible.dtype) not in (np.dtype(np.bool_), np.dtype(np.uint8)):
        raise TypeError(f"visible must be bool or uint8, got {visible.dtype}")
    if not compat.is_device_array(prefix_len):
        p = np.asarray(prefix_len)
        if np.any(p < 0) or np.any(p + n > max_len):
            raise ValueError(f"prefix_len + n must lie in [n, max_len={max_len}]: {p}")


@lru_cache(maxsize=16)
def _cached_plan(shape, max_keys, keys_per_split, variant):
    return MlaAttentionPlan(*shape, max_keys=max_keys, keys_per_split=keys_per_split,
                            variant=variant)


def clear_plan_cache() -> None:
    """Forget the plans :func:`mla_attention` keeps per shape (and the kernels they hold), e.g.
    before a CUDA-graph capture that must not reuse plans made outside it."""
    _cached_plan.cache_clear()


def mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, out=None, max_keys=None,
                  keys_per_split=None, variant=None, stream=0):
    """Absorbed-MLA attention on the device; contract in ``reference/attention.py``.

    Inputs may be NumPy, numba device or CuPy arrays (float32; ``visible`` bool or uint8;
    ``prefix_len`` integer).  Returns a numba device array u [bs, n, H, r] float32 (or ``out``).
    A host ``prefix_len`` sets the split count from its maximum; for a device one pass
    ``max_keys`` (>= max(prefix_len) + n) or the cache length ``max_len`` is assumed.
    ``variant`` picks a kernel (:data:`VARIANTS`; all compute the same function; None: the
    tensor-core one where it runs, see :func:`resolve_variant`).
    """
    bs, n, heads, r = q_abs.shape
    shape = (bs, n, heads, r, q_pe.shape[-1], ckv.shape[1])
    if max_keys is None and not compat.is_device_array(prefix_len):
        max_keys = int(np.max(prefix_len)) + n if bs else n
    plan = _cached_plan(shape, max_keys, keys_per_split, variant)
    return plan(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=out, stream=stream)


# ---------------------------------------------------------------------------------------------
# absorb_q / apply_uv: one small GEMM per head, batched over heads in grid.z
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GemmTile:
    tm: int
    tn: int
    tk: int
    ty: int
    tx: int


def _gemm_tile():
    return _GemmTile(8, 8, 4, 4, 4) if SIMULATOR else _GemmTile(64, 64, 16, 16, 16)


@lru_cache(maxsize=None)
def _head_gemm_kernel(tile: _GemmTile, b_transposed: bool):
    """C[m, h*c_hs + col] = sum_k A[m, h*a_hs + k] * B_h[k, col] for every head h = blockIdx.z.

    B_h[k, col] = B[h*b_hs + b_off + k, col], or B[h*b_hs + b_off + col, k] when transposed.
    Plain fp32 shared-memory tiling; each thread owns a (tm/ty) x (tn/tx) interleaved block.
    """
    TM, TN, TK, TY, TX = tile.tm, tile.tn, tile.tk, tile.ty, tile.tx
    FM, FN = TM // TY, TN // TX
    FMN = FM * FN
    THREADS = TY * TX

    @kernel
    def head_gemm(a, a_hs, bmat, b_hs, b_off, cmat, c_hs, m_size, n_size, k_size):
        a_tile = cuda.shared.array((TK, TM), float32)
        b_tile = cuda.shared.array((TK, TN), float32)
        tid = cuda.threadIdx.x
        ty, tx = tid // TX, tid % TX
        n0, m0, h = cuda.blockIdx.x * TN, cuda.blockIdx.y * TM, cuda.blockIdx.z
        acc = cuda.local.array(FMN, float32)
        for x in range(FMN):
            acc[x] = ZERO
        for k0 in range(0, k_size, TK):
            for f in range(tid, TK * TM, THREADS):
                kk, mm = f % TK, f // TK
                ok = m0 + mm < m_size and k0 + kk < k_size
                a_tile[kk, mm] = a[m0 + mm, h * a_hs + k0 + kk] if ok else ZERO
            for f in range(tid, TK * TN, THREADS):
                if b_transposed:
                    kk, nn = f % TK, f // TK
                else:
                    kk, nn = f // TN, f % TN
                ok = n0 + nn < n_size and k0 + kk < k_size
                if b_transposed:
                    bv = bmat[h * b_hs + b_off + n0 + nn, k0 + kk] if ok else ZERO
                else:
                    bv = bmat[h * b_hs + b_off + k0 + kk, n0 + nn] if ok else ZERO
                b_tile[kk, nn] = bv
            cuda.syncthreads()
            for kk in range(TK):
                for i in range(FM):
                    av = a_tile[kk, ty + TY * i]
                    for j in range(FN):
                        acc[i * FN + j] += av * b_tile[kk, tx + TX * j]
            cuda.syncthreads()
        for i in range(FM):
            for j in range(FN):
                mm, nn = m0 + ty + TY * i, n0 + tx + TX * j
                if mm < m_size and nn < n_size:
                    cmat[mm, h * c_hs + nn] = acc[i * FN + j]

    return head_gemm


def _run_head_gemm(a2, a_hs, b2, b_hs, b_off, b_transposed, c2, c_hs, m, n_out, k, heads,
                   stream=0):
    tile = _gemm_tile()
    grid = (-(-n_out // tile.tn), -(-m // tile.tm), heads)
    _head_gemm_kernel(tile, b_transposed)[grid, tile.ty * tile.tx, stream](
        a2, np.int64(a_hs), b2, np.int64(b_hs), np.int64(b_off), c2, np.int64(c_hs),
        np.int64(m), np.int64(n_out), np.int64(k))


def absorb_q(q_nope, kv_b_proj, *, out=None, stream=0):
    """``q_abs[b,i,h,:] = W_UK[h]^T q_nope[b,i,h,:]`` on the device (reference: same name).

    q_nope [bs, n, H, dn] float32, kv_b_proj [H*(dn+dv), r] float32 -> device [bs, n, H, r].
    """
    bs, n, heads, dn = q_nope.shape
    rows, r = kv_b_proj.shape
    per_head = rows // heads
    if rows % heads or per_head <= dn:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dn={dn}")
    tokens = bs * n
    a2 = to_device(_f32(q_nope), stream).reshape(tokens, heads * dn)
    w = to_device(_f32(kv_b_proj), stream)
    if out is None:
        out = cuda.device_array((bs, n, heads, r), np.float32, stream=stream)
    _run_head_gemm(a2, dn, w, per_head, 0, False, out.reshape(tokens, heads * r), r,
                   tokens, r, dn, heads, stream)
    return out


def apply_uv(u, kv_b_proj, dv, *, out=None, stream=0):
    """``o[b,i,h,:] = W_UV[h] u[b,i,h,:]`` on the device (reference: same name).

    u [bs, n, H, r] float32, kv_b_proj [H*(dn+dv), r] float32, dv = v_head_dim
    -> device [bs, n, H, dv].
    """
    bs, n, heads, r = u.shape
    rows = kv_b_proj.shape[0]
    per_head = rows // heads
    if rows % heads or per_head <= dv:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dv={dv}")
    tokens = bs * n
    a2 = to_device(_f32(u), stream).reshape(tokens, heads * r)
    w = to_device(_f32(kv_b_proj), stream)
    if out is None:
        out = cuda.device_array((bs, n, heads, dv), np.float32, stream=stream)
    _run_head_gemm(a2, r, w, per_head, per_head - dv, True, out.reshape(tokens, heads * dv),
                   dv, tokens, dv, r, heads, stream)
    return out


def _f32(x):
    if compat.is_device_array(x):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"expected float32 device array, got {x.dtype}")
        return x
    return np.ascontiguousarray(x, dtype=np.float32)

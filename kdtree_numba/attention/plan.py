"""Planning for absorbed-MLA attention: tile configurations, kernel variants, key splits.

Pure Python, no kernels: what shape a block has (:class:`TileConfig` for the FFMA kernel of
ffma.py, :class:`MmaTileConfig` for the tensor-core kernel of mma.py), which layout runs
(:data:`VARIANTS`, :func:`resolve_variant`) and how many blocks share a request's keys
(:func:`choose_splits`).  A bf16 latent cache has one kernel of its own, bf16.py, shaped by
:class:`Bf16TileConfig` (:func:`bf16_tile_config`); :data:`VARIANTS` are the float32 cache's.
mla.py turns these decisions into an :class:`~kdtree_numba.attention.mla.
MlaAttentionPlan` and launches it.  Contract of the function computed: reference/attention/mla.py;
the layouts and their measured speed: docs/ATTENTION.md.

Two kernels ship (:data:`VARIANTS`): ``"tf32x3"``, the tensor-core kernel of
:mod:`kdtree_numba.attention.mma` (3xTF32, within the fp32 error bound, GPU only), and
``"pipe16x2"``, a tile layout of the FFMA kernel body that runs everywhere.
:func:`resolve_variant` picks :data:`DEFAULT_VARIANT` where it runs and
:data:`FALLBACK_VARIANT` elsewhere; ``tools/bench_attention.py`` times them.
"""
from kdtree_numba.compat import SIMULATOR  # noqa: I001

from dataclasses import dataclass, replace

from kdtree_numba.attention.tiles import MAX_SHARED_BYTES

__all__ = ["TileConfig", "MmaTileConfig", "Bf16TileConfig", "bf16_tile_config", "BF16_VARIANT",
           "VARIANTS", "DEFAULT_VARIANT", "FALLBACK_VARIANT", "FFMA_VARIANTS", "uses_tensor_cores",
           "resolve_variant", "mma_fits", "gpu_tile_config", "sim_tile_config", "tile_config",
           "choose_splits", "MMA_ROWS", "mma_rows", "bf16_fits", "BLOCK_OVERHEAD_KEYS",
           "MERGE_BYTES_PER_KEY_TIME", "INVARIANT_SPLIT_KEYS", "BF16_LAYOUTS",
           "wgmma_attention_fits"]


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
    causal: bool = False   # blocks stop after their last query's keys (tiles.block_keys)
    fused_merge: bool = False  # the last split's block merges (tiles.merge_when_last)

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


@dataclass(frozen=True)
class MmaTileConfig:
    """Compile-time shape of one tensor-core attention block (fixed but for r, dr and rows).

    ``rows`` query-heads per block (16, 32 or 64) in row groups of 16, each served by two warps
    (one per column half): ``threads = 4 rows``.  A warp's work on its 16 rows is the same at
    every ``rows``, so the three shapes give every row the same bits; fewer rows per block only
    spread a small problem (a decode's 64 heads) over more SMs (:func:`mma_rows`)."""
    r: int
    dr: int
    threads: int = 256     # 2 warps (column halves) per 16 rows
    rows: int = 64         # query-heads per block
    keys: int = 16         # key slots per tile: two m16n8k8 n-tiles (scores), k-steps (P V)
    stages: int = 2
    fp32_sums: bool = False  # short mma chains added with FADD (mma.py's docstring)
    causal: bool = False   # blocks stop after their last query's keys (tiles.block_keys)
    fused_merge: bool = False  # the last split's block merges (tiles.merge_when_last)

    @property
    def d(self):
        return self.r + self.dr

    @property
    def row_stride(self):  # floats per staged row; +4 shifts rows by 4 banks
        return self.d + 4

    @property
    def warps(self):
        return self.threads // 32

    def smem_floats(self):  # queries, key stages, score exchange (4 (keys / 8) per lane)
        return ((self.rows + self.stages * self.keys) * self.row_stride
                + self.warps * 4 * (self.keys // 8) * 32)

    def smem_bytes(self):
        return 4 * self.smem_floats()

    def validate(self):
        # column halves of whole 32-column chunks (scores) and 32-column groups (values)
        if self.d % 64 or self.r % 64 or self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"the tensor-core tiles need r and r + dr multiples of 64 and "
                             f"<= {MAX_SHARED_BYTES} bytes of shared memory: {self}")
        if self.rows not in MMA_ROWS or self.threads != 4 * self.rows or self.keys != 16:
            raise ValueError(f"the tensor-core tiles take rows in {MMA_ROWS}, 2 warps per 16 "
                             f"rows (threads = 4 rows) and 16-key tiles: {self}")
        return self


@dataclass(frozen=True)
class Bf16TileConfig:
    """Compile-time shape of one block of the bf16 kernel (bf16.py): a bf16 latent cache on
    bf16 tensor cores.  Same warp roles as :class:`MmaTileConfig` (``rows`` query-heads in row
    groups of 16, two warps per group splitting the score columns and the value columns), but
    tiles hold bf16 in 32-column panels of 16 words and a key tile is ``keys`` (16 or 32) keys:
    the scores are ``keys / 8`` m16n8k16 n-tiles, P V ``keys / 16`` k16 steps.  Any r and dr
    that are multiples of 8 (16-byte rows): staged rows are padded with zero columns to
    ``d_pad`` (whole panels for both warps), and the value columns run in 64-column groups,
    ``groups_per_warp`` for each warp of a pair (a group past r's last is computed again by the
    second warp and not written).

    Four switches change how operands reach the same mma sequence, never a bit of the result
    (bf16.py's docstring; their defaults are the package's layout, :data:`BF16_LAYOUTS`:
    ``ldsm_values`` on, the faster verify: docs/ATTENTION.md): ``stages`` 3
    keeps two key tiles in flight instead of one; ``frag_queries`` stages the queries in
    fragment order, so that one 128-bit load is an mma's A operand as it stands;
    ``lean_staging`` copies a whole key tile without the per-chunk clamp and size select;
    ``ldsm_values`` loads the P V operands with ``ldmatrix.trans`` (no byte permutes)."""
    r: int
    dr: int
    threads: int = 256     # 2 warps (column halves) per 16 rows
    rows: int = 64         # query-heads per block
    keys: int = 32         # key slots per tile
    stages: int = 2        # key-tile buffers: 2 (one tile in flight) or 3 (two)
    causal: bool = False   # blocks stop after their last query's keys (tiles.block_keys)
    fused_merge: bool = False  # the last split's block merges (tiles.merge_when_last)
    frag_queries: bool = False  # query tile in mma A-fragment order (bf16.query_word)
    lean_staging: bool = False  # whole key tiles copied without clamp and size select
    ldsm_values: bool = True    # P V operands by ldmatrix.trans (key tiles: bf16.key_word)
    wgmma: bool = False         # attention/wgmma.py's warpgroup kernel (KDTREE_ATTENTION_WGMMA)

    @property
    def d(self):
        return self.r + self.dr

    @property
    def d_pad(self):       # staged columns: d rounded up to whole 32-column panels per warp
        return -(-self.d // 64) * 64

    @property
    def row_words(self):   # uint32 words of a staged row: d_pad bf16, two per word
        return self.d_pad // 2

    @property
    def value_groups(self):  # 64-column groups covering the r value columns
        return -(-self.r // 64)

    @property
    def groups_per_warp(self):
        return -(-self.value_groups // 2)

    @property
    def warps(self):
        return self.threads // 32

    def smem_words(self):  # queries, key stages, score exchange (4 (keys / 8) floats a lane)
        return ((self.rows + self.stages * self.keys) * self.row_words
                + self.warps * 4 * (self.keys // 8) * 32)

    def smem_bytes(self):
        # the warpgroup kernel's tiles start at a 1,024-byte boundary (the 128-byte swizzle's
        # period, which wgmma applies to absolute shared addresses)
        return 4 * self.smem_words() + 1024 * self.wgmma

    def validate(self):
        if self.wgmma and not wgmma_attention_fits(self.r, self.dr, self.rows, self.keys):
            raise ValueError(f"the warpgroup attention kernel takes 64 rows, 16- or 32-key "
                             f"tiles and r a multiple of 128 up to 512: {self}")
        if self.r % 8 or self.dr % 8 or min(self.r, self.dr) < 8 \
                or self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"the bf16 attention tiles need r and dr multiples of 8 (16-byte "
                             f"rows for cp.async) and <= {MAX_SHARED_BYTES} bytes of shared "
                             f"memory: {self}")
        if self.rows not in MMA_ROWS or self.threads != 4 * self.rows \
                or self.keys not in (16, 32) or self.stages not in (2, 3):
            raise ValueError(f"the bf16 attention tiles take rows in {MMA_ROWS}, 2 warps per 16 "
                             f"rows (threads = 4 rows), 16- or 32-key tiles and 2 or 3 "
                             f"stages: {self}")
        return self


def wgmma_attention_fits(r: int, dr: int, rows: int = 64, keys: int = 32) -> bool:
    """Whether attention/wgmma.py's kernel takes these widths and tile: one warpgroup's 64
    rows (the wgmma's M), each warpgroup's r / 2 value columns whole 64-column panels of at
    most 256 (one m64n{r / 2} product a k16 step), 16- or 32-key tiles (the tiles' limit in
    :meth:`Bf16TileConfig.validate`)."""
    return rows == 64 and keys in (16, 32) and r % 128 == 0 and r <= 512 and dr % 8 == 0


BF16_VARIANT = "bf16"     # what a plan over a bf16 cache reports as its variant
# Keys per tile of the bf16 kernel: 32 on the GPU (16-key tiles were slower), 16 in the
# simulator, whose emulated mma costs two block barriers each.  A module variable so that
# tools/bench_attention.py can time both and the tests can run 32-key tiles in the simulator.
BF16_KEYS = 16 if SIMULATOR else 32
# Layouts of the bf16 kernel: name -> Bf16TileConfig fields.  The package's is the first (the
# fields' defaults: ldsm_values on, the other switches off), and every layout gives the same
# bits (they move the same operands into the same mma sequence, so batch invariance does not
# depend on which runs).  dev/cuda/attention.py adds the candidates (issue 38: decode speed)
# to this dict in its process and tools/bench_attention.py times each; BF16_LAYOUT, a module
# variable like BF16_KEYS, is the one plans build.
BF16_LAYOUTS = {BF16_VARIANT: {}}
BF16_LAYOUT = BF16_VARIANT


def bf16_tile_config(r: int, dr: int, keys: int | None = None,
                     layout: str | None = None) -> Bf16TileConfig:
    """The bf16 kernel's tile for widths r, dr (``keys``: None for :data:`BF16_KEYS`;
    ``layout``: a name in :data:`BF16_LAYOUTS`, None for :data:`BF16_LAYOUT`); ``rows`` is
    set per plan (:func:`mma_rows`)."""
    name = BF16_LAYOUT if layout is None else layout
    if name not in BF16_LAYOUTS:
        raise ValueError(f"unknown bf16 attention layout {name!r}; have {sorted(BF16_LAYOUTS)}")
    return Bf16TileConfig(r, dr, keys=BF16_KEYS if keys is None else keys,
                          **BF16_LAYOUTS[name]).validate()


def bf16_fits(r: int, dr: int) -> bool:
    """Whether the bf16 kernel's tiles fit latent width r and rope width dr."""
    try:
        bf16_tile_config(r, dr)
    except ValueError:
        return False
    return True


MMA_ROWS = (64, 32, 16)   # the tensor-core block's row counts, the default first


def mma_rows(row_count: int, splits: int, bs: int, sm_count: int) -> int:
    """Rows per tensor-core block: 64, halved (down to 16) while the grid (row tiles x splits
    x requests) would still fit in one wave of ``sm_count`` blocks.  A decode's 64 heads with
    one key split are one 64-row block on one SM, whose mma throughput then bounds the whole
    attention; 16-row blocks put it on four.  Never past one wave:
    every block stages its split's keys, so a grid that already fills the GPU (a batch of
    long decodes, bound by the keys' bytes) would read them again for nothing.  Bits do not
    depend on the choice (MmaTileConfig)."""
    rows = MMA_ROWS[0]
    while rows > MMA_ROWS[-1] and -(-row_count // (rows // 2)) * splits * bs <= sm_count:
        rows //= 2
    return rows


def mma_fits(r: int, dr: int) -> bool:
    """Whether the tensor-core tiles fit latent width r and rope width dr."""
    try:
        MmaTileConfig(r, dr).validate()
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Kernel variants and the tile shape each one runs with
# ---------------------------------------------------------------------------------------------
# The kernels the package ships.  tf32x3 is the tensor-core kernel of kdtree_numba/attention/
# mma.py (3xTF32 mma.sync, the same shared-memory layout and 16-key tiles as pipe16x2; GPU only,
# r and r + dr multiples of 64): its mma chains run over a whole split, so its error is a few
# times the FFMA kernels' while staying within the fp32 bound (tests/test_attention_gpu.py).
# pipe16x2 is the FFMA (CUDA-core) layout that runs everywhere else -- the simulator, widths the
# tensor-core tiles do not fit: 256 threads, two stages of 16-key tiles; a warp scores a 16 x 16
# block over half the columns, 4 lanes x 2 warps split the columns (the fewest shared-memory
# wavefronts per FMA).  The other layouts the FFMA body compiles to, and tf32x3 with fp32
# sums, lost on the GPU: dev/cuda/attention.py keeps them (it adds them to this dict) and
# compares them; docs/ATTENTION.md has the design and docs/BENCHMARKS.md the speed.
VARIANTS = {
    "tf32x3": dict(threads=256, keys=16, stages=2, tensor_cores=True, fp32_sums=False),
    "pipe16x2": dict(threads=256, keys=16, stages=2, lane_rows=8, k_lanes=4, row_lanes=2,
                     key_lanes=4, k_warps=2),
}
# DEFAULT_VARIANT runs wherever it can (GPU, widths its tiles fit); FALLBACK_VARIANT elsewhere.
DEFAULT_VARIANT = "tf32x3"
FALLBACK_VARIANT = "pipe16x2"
FFMA_VARIANTS = tuple(v for v in VARIANTS if not VARIANTS[v].get("tensor_cores"))


def uses_tensor_cores(variant: str) -> bool:
    return bool(VARIANTS[variant].get("tensor_cores"))


def resolve_variant(variant, r: int, dr: int) -> str:
    """``variant``, checked; or for None the default where it can run, else the fallback."""
    if variant is None:
        if SIMULATOR or not mma_fits(r, dr):
            return FALLBACK_VARIANT
        return DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"unknown attention variant {variant!r}; have {sorted(VARIANTS)}")
    return variant


def gpu_tile_config(r: int, dr: int, variant: str = FALLBACK_VARIANT):
    """64 query-heads per block, ``lane_rows x 4`` score blocks per lane, and (at r = 512,
    256 threads) 8 rows x 16 columns of output per thread; narrower latents get fewer columns.
    The tensor-core variant has its own fixed layout (:class:`MmaTileConfig`)."""
    if uses_tensor_cores(variant):
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


# ---------------------------------------------------------------------------------------------
# Key splits (flash-decoding)
# ---------------------------------------------------------------------------------------------
# Keys per split of a batch-invariant plan (MlaAttentionPlan(batch_invariant=True)): fixed, so
# the partition of a request's keys into splits -- and with it every row's summation order --
# depends on neither n, bs nor the cache's capacity.  A multiple of every tile's keys (16, 32).
# 128 is a compromise: smaller keeps a decode's blocks short (a lone request's 512 cached keys
# give 4 blocks of 8 tiles), larger keeps a big verify's partial outputs small (n H r 4 bytes per
# split: 8.6 MB at n = 33, H = 64, so 0.28 GB at 4,096 keys).
INVARIANT_SPLIT_KEYS = 128
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

"""The bf16 tensor-core GEMM's plan: which tile (:class:`MmaConfig`) and how many K slices a
product of M rows takes, and the accumulation bound -- plain Python, no kernel (layers/mma.py
holds the kernels and re-exports these names).

Tiles by M (:func:`mma_tile`): one M tile of whole m16 tiles up to 80 rows (a verify reads the
weights once), past 80 rows 128 x 128 on warpgroup mma where the GPU has it
(:func:`wgmma_available`), else 64 x 128.  K slices (:func:`mma_splits`) depend on N and K
only, so a row's bits do not depend on M: the linear is batch invariant.  Measurements behind
each choice: docs/LAYERS.md, "bf16 tensor-core linear".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kdtree_numba import runtime
from kdtree_numba.gpu.memory import MAX_SHARED_BYTES
from kdtree_numba.gpu.tensorcore import wgmma_available
from kdtree_numba.layers.common import GPU_SMS

__all__ = ["PANEL", "SLICE_UNIT", "MIN_SLICED_STAGES", "WarpTiles", "MmaConfig", "WARP_TILE",
           "WGMMA_TILE",
           "wgmma_available", "mma_tile", "unsliced_tile", "mma_config", "mma_splits",
           "swapped_tile", "SWAPPED_ROWS", "with_stream_k",
           "mma_error_coefficient"]

PANEL = 32          # K elements per shared-memory panel row: 64 bytes = 16 uint32 words


class WarpTiles:
    """The block tile of ``wm`` x ``wn`` warps of ``tm`` m16 by ``tn`` n8 tiles (fields of
    the dataclass that derives from it): BM x BN outputs, 32 wm wn threads."""

    @property
    def bm(self) -> int:
        return 16 * self.wm * self.tm

    @property
    def bn(self) -> int:
        return 8 * self.wn * self.tn

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn


@dataclass(frozen=True)
class MmaConfig(WarpTiles):
    """Tile shape: ``wm`` x ``wn`` warps (warp w: wm_i = w % wm, wn_i = w // wm), each ``tm``
    m16 tiles by ``tn`` n8 tiles; K stages of ``bk`` (a multiple of 32) in a ring of
    ``stages`` shared-memory buffers (2 to 4; the cp.async ring of both kernels, linear and
    grouped MoE, keeps ``stages - 1`` in flight);
    ``splits`` K slices (separate blocks, then an ordered fp32 sum); ``max_registers``: a
    ptxas cap (0: none).  BM = 16 wm tm, BN = 8 wn tn.  ``wgmma``: the stages multiplied
    by warpgroup mma (sm_90a) instead, warpgroup q taking rows 64q .. 64q + 63 and all BN
    columns (BM = 64 x threads / 128; wm, wn, tm and tn then only size the tile and the
    staging; at least 3 stages: :func:`ring_function`).  mma_tile's pick past 80 rows on
    sm_90 GPUs (bitwise mma.sync's rows, and faster than it on a prefill's rows).
    ``tma``: the wgmma tile staged by TMA from a producer warp over a persistent grid
    (layers/mma_tma.py; the same bits; rings of up to 8 stages).  ``swap_ab``: with tma, the
    weights as wgmma's A operand (BM weight rows a tile) and x as its B (BN rows of x, any
    multiple of 8 up to 256): y^T's tiles, so a verify's 65 rows take an n = 72 wgmma
    rather than two warpgroups of 64 rows.  ``swizzle``: the panels' width in bytes, 64 (32
    bf16, the cp.async kernels' layout) or with tma 128 (64 bf16 a row, the 128-byte swizzle);
    the same k16 steps in the same order either way, so the same bits.
    ``slices_in_block``: each block runs all ``splits`` K slices itself, each from zero, and
    adds them in slice order (sum_splits' sum, bitwise) before writing y: no partial sums in
    memory, set by the launcher where the M x N tiles alone fill the GPU.  ``sums_in_last``:
    the K slices' blocks write their partial sums, and each output tile's last slice block
    adds them (mma.make_sum_when_last: sum_splits' bits) where a sum launch would
    (:func:`mma_config` at a decode's row; at every M with ``KDTREE_MMA_SUMS_IN_LAST``).
    ``stream_k``: with tma and K slices, the persistent grid's last ``stream_k`` waves of
    tiles (1: the partial one; 2: it and the full one before) shared out slice by slice, so
    every block gets the same number of slices; a tile cut between blocks is completed, in
    slice order, by its last block to finish (layers/mma_tma.py: the same bits; a fold's two
    accumulator sets: :attr:`holds_two_accumulator_sets`); 0: off."""
    wm: int = 4
    wn: int = 2
    tm: int = 2
    tn: int = 8
    bk: int = 64
    splits: int = 1
    max_registers: int = 0
    stages: int = 3
    wgmma: bool = False
    slices_in_block: bool = False
    sums_in_last: bool = False
    tma: bool = False
    swap_ab: bool = False
    swizzle: int = 64
    stream_k: int = 0

    @property
    def stage_bytes(self) -> int:
        return self.bk * (self.bm + self.bn) * 2            # one stage of bf16 x and w tiles

    @property
    def smem_bytes(self) -> int:
        # wgmma: + 512 bytes to align the tiles to the 64-byte swizzle's 512-byte period,
        # which the tensor cores apply to absolute shared addresses
        # (1024 for the 128-byte swizzle's period: a TMA tile's ``swizzle``)
        return self.stages * self.stage_bytes + (
            (1024 if self.swizzle == 128 else 512) if self.wgmma else 0)

    @property
    def x_chunks(self) -> int:
        """16-byte x chunks each thread stages per K stage (whole: __post_init__ checks)."""
        return self.bm * self.bk // 8 // self.threads

    @property
    def w_chunks(self) -> int:
        """16-byte weight chunks each thread stages per K stage."""
        return self.bn * self.bk // 8 // self.threads

    def __post_init__(self):
        if (min(self.wm, self.wn, self.tm, self.tn, self.splits) < 1 or self.bk % PANEL
                or self.bk <= 0 or self.threads > 1024
                or not 2 <= self.stages <= (8 if self.tma else 4)
                or self.smem_bytes + (16 * self.stages if self.tma else 0) > MAX_SHARED_BYTES
                or not self.tma and ((self.bn * self.bk // 8) % self.threads
                                     or (self.bm * self.bk // 8) % self.threads
                                     or self.threads % (self.bk // 8))
                or self.wgmma and (self.threads % 128 or self.bm != self.threads // 2
                                   or self.bn > 256 or self.stages < (2 if self.tma else 3))
                or self.sums_in_last and self.slices_in_block
                or self.tma and (not self.wgmma or self.sums_in_last or self.bk != 2 * PANEL
                                 or self.slices_in_block and self.bn > 128)
                or self.swap_ab and not self.tma
                or self.stream_k not in (0, 1, 2)
                or self.stream_k and (not self.tma or self.slices_in_block or self.bn > 128
                                      or not self.holds_two_accumulator_sets)
                or self.tma and self.threads + 32 > 1024      # the producer's warp too
                or self.swizzle not in ((64, 128) if self.tma else (64,))):
            raise ValueError(f"bad MmaConfig {self}: bk % 32, <= 1024 threads, 2-4 stages, "
                             f"<= 227 KiB shared memory, whole 16-byte staging vectors per "
                             f"thread, each thread's vectors at one column of a stage; wgmma: "
                             f"64 rows per warpgroup of 128 threads, BN <= 256, >= 3 stages; "
                             f"the K slices summed in the block or by the last, not both; "
                             f"tma: wgmma, stages of 64, up to 8 of them, no last-block "
                             f"sums, a fold only up to BN = 128 (two accumulator sets); "
                             f"swap_ab: tma only; swizzle 64, or 128 with tma; stream_k: "
                             f"0-2 waves, tma, its own fold (not slices_in_block), BN <= "
                             f"128, two warpgroups (more with max_registers fitting an SM)")

    @property
    def holds_two_accumulator_sets(self) -> bool:
        """Whether a thread may hold a fold's two sets of BN / 2 accumulators: up to two
        warpgroups, or more with ``max_registers`` capping them all (a TMA tile's producer
        warp too) within an SM's 64 K registers."""
        return self.threads <= 256 or 0 < self.max_registers * (
            self.threads + (32 if self.tma else 0)) <= 65536

    @property
    def frag_tiles(self) -> tuple:
        """(m16 tiles, n8 tiles) of a thread's accumulators, acc[4 (i * tiles_n + j) + e] in
        mma.sync's C layout: tm x tn, or with wgmma 1 x BN / 8 (a warp's 16 rows of its
        warpgroup's 64 by all BN columns)."""
        return (1, self.bn // 8) if self.wgmma else (self.tm, self.tn)


# The K slices' unit: a slice is whole 64-element units (mma_splits, a function of N and K
# only) whatever the tile's stage bk, so every tile sums a row in the same order and a row's
# result does not depend on M.  A stage of 128 that runs past its slice's end zero-fills the
# rest, and mma steps of zeros add exactly 0.
SLICE_UNIT = 64

# K slices only from this many SLICE_UNITs of K (2048 elements): a shorter product (q_b's 24)
# runs faster whole at every M (mma_splits); every product from 32 up (o_proj, q_a + kv_a, the
# dense FFN) gains from its slices at M = 1
MIN_SLICED_STAGES = 32


def mma_tile(m: int) -> MmaConfig:
    """The linear's tile for m rows (its K slices: :func:`mma_splits`).  Up to 16 rows (decode) 16
    x 128 in 3 stages of bk = 128: with cp.async's L2::256B prefetch (gpu/memory.py) each weight
    row's 256 bytes of a stage come from DRAM as one burst (neither bk = 128 without the hint
    nor the hint at bk = 64 gets there).  Elsewhere bk = 64.  Up to 80 rows one M tile of whole
    m16 tiles, 4 warps side by side in N, so a verify's 33-80 rows read the weights once (two
    64-row tiles would do twice the mma work at M = 65): BM x 128 (BM = 16 ceil(m / 16); 4
    stages up to 32 rows, 3 from 33).  At 65-80 rows a warp's 80 x 32 fragments need 168
    registers (no spill); its ldmatrix bytes per mma are 0.58x those of an 80 x 64 tile, which
    waits on shared memory and L2.  Past 80 rows 64 x 128 (4 warps of 32 x 64, 3 stages; 128 x 128
    takes 166 registers at 256 threads: one block an SM), or where :func:`wgmma_available`
    128 x 128 by two warpgroups' wgmma in 4 stages (one stage's products in flight while the
    next is staged).  Every tile gives a row the same bits (bk and the K slices do not depend
    on it; wgmma sums a k16 step as mma.sync does: equal bits, tests/test_layers_mma.py).
    Products without K slices take :func:`unsliced_tile`."""
    mt16 = max(1, -(-m // 16))             # m = 0 (an empty call) takes the 16-row tile
    if mt16 == 1:
        return MmaConfig(wm=1, wn=4, tm=1, tn=4, bk=128, stages=3)
    if mt16 <= 5:
        return MmaConfig(wm=1, wn=4, tm=mt16, tn=4, stages=4 if mt16 <= 2 else 3)
    return WGMMA_TILE if wgmma_available() else WARP_TILE


# Past 80 rows without wgmma: 4 warps of 32 x 64, 3 stages
WARP_TILE = MmaConfig(wm=2, wn=2, tm=2, tn=8, stages=3)
# 2 warpgroups x 64 rows x 128 columns, 4 stages of 64 (128 KiB): faster than WARP_TILE on a
# prefill's rows (docs/BENCHMARKS.md)
WGMMA_TILE = MmaConfig(wm=2, wn=4, tm=4, tn=4, stages=4, wgmma=True)


def unsliced_tile(m: int) -> MmaConfig:
    """:func:`mma_tile` for the products without K slices (the grouped MoE's launches, the
    per-head products), whose N tiles and heads are all their parallelism: at 65-80 rows 80 x 64
    in 4 stages, not 80 x 128, which would halve their blocks (a dense FFN's down projection: 56
    blocks for 132 SMs, and a slower verify).  The same bits either way (no K slices); past 80
    rows mma_tile's (wgmma where available: a prefill's grouped experts, ~512 tokens each)."""
    if max(1, -(-m // 16)) == 5:
        return MmaConfig(wm=1, wn=4, tm=5, tn=2, stages=4)
    return mma_tile(m)


# Rows up to which a sliced linear's tiles add their K slices in their last block rather than
# in a sum launch (the same bits): at one row the last block adds a row of partial sums, and
# the call is one launch fewer (0.5-0.8 us faster on every sliced Kimi-K2 shape, run 200); at
# 65 rows it adds 65 rows alone while the rest of the GPU idles (1.2-2.2x slower)
SUMS_IN_LAST_MAX_M = 1


def swapped_tile(m: int, warpgroups: int, splits: int = 1, swizzle: int = 128) -> MmaConfig:
    """The weights as wgmma's A operand (64 rows a warpgroup) and x's ``m`` rows as its B (n
    = m rounded up to 8, at most 256): y^T's tiles, in as many stages (up to 8) as shared
    memory holds."""
    if not 1 <= m <= 256:
        raise ValueError(f"swapped tiles take 1-256 rows of x, got {m}")
    tn = -(-m // 8)
    stage = 2 * (64 * warpgroups + 8 * tn) * 2 * PANEL
    stages = min(8, (MAX_SHARED_BYTES - 1024) // stage)
    return MmaConfig(wm=4 * warpgroups, wn=1, tm=1, tn=tn, stages=stages, wgmma=True,
                     tma=True, swap_ab=True, splits=splits, swizzle=swizzle)


def with_stream_k(cfg: MmaConfig) -> MmaConfig:
    """A TMA tile with the ``stream_k`` waves ``KDTREE_MMA_STREAM_K`` asks for where the
    tile can hold a fold's two accumulator sets (BN <= 128,
    :attr:`MmaConfig.holds_two_accumulator_sets`); else ``cfg``."""
    waves = runtime.current().mma_stream_k
    if (waves and cfg.tma and cfg.bn <= 128 and cfg.holds_two_accumulator_sets
            and not cfg.slices_in_block):
        return dataclasses.replace(cfg, stream_k=waves)
    return cfg


# Rows whose products take :func:`swapped_tile` where wgmma runs (KDTREE_MMA_TMA): a
# verify's 65 (budget 64) to 80, where mma_tile's 80-row mma.sync tile was 1.05-1.64x slower
# on every Kimi-K2 shape (run 203, H100: 2048 -> 7168 31.5 -> 19.2 us) and the GPU tests
# found the same bits
SWAPPED_ROWS = range(65, 81)


def mma_config(m: int, n: int, k: int) -> MmaConfig:
    """The tile for an [m, k] x [n, k]^T product: :func:`mma_tile` with the K slices of
    :func:`mma_splits`, which does not look at m: a row's result is the same at every M
    (docs/LAYERS.md, "bf16 tensor-core linear"); the slices summed by their last block up to
    :data:`SUMS_IN_LAST_MAX_M` rows.  With ``KDTREE_MMA_TMA=1``, at :data:`SWAPPED_ROWS` on
    sm_90 the TMA kernel's swapped tile (layers/mma_tma.py): two warpgroups of weight rows
    where the 128-row weight tiles alone fill half the GPU (lm_head, the dense FFN's gate_up,
    q_b: faster so in run 203), else one; at one row the same for the sliced products."""
    splits = mma_splits(n, k)
    swapped = m in SWAPPED_ROWS or (m == 1 and splits > 1)
    if swapped and wgmma_available() and runtime.current().mma_tma:   # KDTREE_MMA_TMA=1
        if m > 1:
            return with_stream_k(swapped_tile(m, 2 if -(-n // 128) >= GPU_SMS // 2 else 1,
                                              splits))
        # a decode's sliced products: the swapped tile's 64 weight rows against x's row as an
        # n = 8 B, no slower than the 16-row tile on all 6 sliced Kimi-K2 shapes (run 204, H100:
        # 2048 -> 7168 19.9 -> 16.5 us, 18432 -> 7168 97.0 -> 92.6); the unsliced lm_head and
        # q_b keep it (there the 16-row tile was faster)
        return with_stream_k(swapped_tile(1, 1, splits))
    return dataclasses.replace(mma_tile(m), splits=splits,
                               sums_in_last=splits > 1 and m <= SUMS_IN_LAST_MAX_M)


def mma_splits(n: int, k: int) -> int:
    """K slices: doubled (up to 64, each slice keeping >= 8 stages of 64: twice the deepest
    ring) while more than a quarter of the block slots of the waves that one row of 128-wide N
    tiles takes (the grid at M <= BM; two blocks per SM, what the 16- to 80-row tiles' shared
    memory allows) would idle.  Past that, short slices only add ramps and partial sums (a sweep
    of 1-64 slices at Kimi-K2's shapes picked this rule: dev/bench_splits.py, docs/LAYERS.md).
    Below :data:`MIN_SLICED_STAGES` of K none: a block that short is mostly its ramp, and the
    slices add the partial sums' round trip and a sum launch.  A function of N and K only, never
    of M or the tile, so the linear is batch invariant across M: a row's result is bitwise the
    same whatever M (its partial sums, 8 S M N bytes written and read back, mostly in L2, grow
    with M)."""
    tiles = -(-n // 128)
    stages = -(-k // SLICE_UNIT)
    wave = 2 * GPU_SMS
    splits = 1
    while splits < 64 and stages >= MIN_SLICED_STAGES and stages // (2 * splits) >= 8:
        slots = -(-tiles * splits // wave) * wave
        if 4 * (slots - tiles * splits) <= slots:
            break
        splits *= 2
    return splits


def mma_error_coefficient(k: int, splits: int = 1, bk: int = PANEL) -> float:
    """c with |y - reference| <= c * sum_k |x_k w_k| per output (docs/LAYERS.md): 2^-8 for
    rounding x to bf16, 2^-20 per k16 mma step of the longest K slice (16 units of 2^-24: a
    model of the tensor core's truncating fp32 accumulation, with margin), one 2^-24 per slice
    addition, one for the reference's own float32 rounding."""
    stages = -(-k // bk)
    steps = -(-stages // splits) * (bk // 16)
    return 2.0 ** -8 + (1 + 2.0 ** -8) * (16 * steps + splits) * 2.0 ** -24 + 2.0 ** -24

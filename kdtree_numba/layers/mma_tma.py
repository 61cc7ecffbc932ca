"""The bf16 tensor-core GEMM fed by TMA: one producer warp stages both operands through an
mbarrier ring while two consumer warpgroups only multiply (warpgroup mma), over a persistent
grid of one block an SM (with ``KDTREE_MMA_TMA=1`` on sm_90: past 80 rows, and its swapped
tiles at a verify's 65-80 rows and a decode's sliced products; opt-in until the tree since
run 204 has run on the GPU).

Why (issue 38; Nsight Compute on the cp.async kernel, run 202): the warpgroup tile of
layers/mma.py staged its tiles with every thread's cp.async and a block barrier a stage, and
spent 40% of its stalls on those copies while the tensor pipe was busy 44% of the time, where
cuBLAS's kernel (a producer warpgroup, two consumers, a persistent grid) kept it 91% busy.

The same products as layers/mma.py's warpgroup tile, so the same bits: the same 32-wide
panels in the 64-byte swizzle (TMA writes them: gpu/tma.py), the same K slices (a function
of N and K only) each summed from zero in k16 steps in panel order, added in slice order in
the block (``slices_in_block``: no ramp between slices here, the producer runs on) or written
as partial sums for layers/common.py's ``sum_splits``.  The linear stays batch invariant.

Block: threads [0, 128 w) are w consumer warpgroups of 64 rows each (BM = 64 w) by all BN
columns; thread 128 w issues every copy (the rest of its warp leaves).  Work units: output
tiles in groups of :data:`GROUP_M` M tiles (the M tile fastest within a group, so the blocks
in flight share both operands' tiles in L2), times the K slices when they go through memory;
block b takes units b, b + grid, ...  Stage g of the block lives in ring slot g % stages;
``full[slot]`` completes when the slot's bytes have landed (the producer's expect_tx and
TMA's complete_tx), ``empty[slot]`` when each consumer warp's wgmma reading it has finished
(one arrival a warp after its wgmma wait), which the producer waits on before reusing it.

Stream-K (``cfg.stream_k``, ``KDTREE_MMA_STREAM_K``): a sliced product's tiles run whole,
block b taking tiles b, b + grid, ... (:func:`whole_tiles`), until the last one or two waves,
whose K slices are then shared out evenly, block b taking a contiguous run of them; a tile
cut between blocks goes through a workspace buffer (the block with slice 0 writes its fold,
every other block its slices one by one) and the warpgroup whose slices complete the tile's
count adds them in slice order into y: the fold's bits, and no block ever waits for another.
docs/LAYERS.md, "Stream-K".

x must be rounded to bf16 into a buffer whose tensor map stays valid: a buffer kept per (CUDA
context, K), grown to a power of two of rows (rows past M hold stale bits whose outputs are
never stored: a row's products read only its own x row).  Launches run in stream order
(gpu/counters.py's argument: the engine's work runs on the legacy stream or a capture's
blocking stream, ordered with it), so one buffer serves every call; two streams running
linears of one K at once would race on it.  A buffer outgrown stays allocated: a captured
graph may still round into it and read it through its map.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory
from kdtree_numba.gpu.bits import divmod_u32
from kdtree_numba.gpu.counters import arrival_counters, group_last_to_arrive
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import allow_large_shared_memory, load_l2_f32, store_nowrap_2d
from kdtree_numba.gpu.tensorcore import (wgmma_bf16, wgmma_commit, wgmma_descriptor_128,
                                         wgmma_fence, wgmma_wait_1, wgmma_wait_all)
from kdtree_numba.gpu.tma import (context_key, mbarrier_arrive, mbarrier_expect_tx,
                                  mbarrier_init, mbarrier_init_fence, mbarrier_wait, tensor_map,
                                  tensor_map_acquire, tma_load_panel)
from kdtree_numba.layers.common import add_splits
from kdtree_numba.layers.mma import (WGMMA_TILE, accumulator_origin, fragment_position,
                                     partial_sums, round_into, shared_base, slice_plan,
                                     wgmma_operand)
from kdtree_numba.layers.mma_plan import (  # noqa: F401  (swapped_tile re-exported)
    SLICE_UNIT, MmaConfig, swapped_tile, with_stream_k)
from kdtree_numba.layers.workspace import workspace_buffer

__all__ = ["TMA_TILE", "GROUP_M", "tma_kernel", "tma_linear", "tma_config", "swapped_tile",
           "planned", "wgmma_descriptor_128", "whole_tiles", "WIDE_TILES", "WIDE_FOLDING",
           "register_cap"]

# M tiles per group of the units' order: the blocks in flight (one an SM) then cover about 8
# M tiles by grid / 8 N tiles, whose x and weight tiles both stay in L2
GROUP_M = 8

# Two consumer warpgroups of 64 x 128 and a ring of 6 stages of 64 (192 KiB): the 128 x 128
# tile of layers/mma.py's warpgroup kernel (a fold's two accumulator sets fit its registers),
# its panels 64 wide in the 128-byte swizzle (1.4-1.5x faster than 32-wide 64-byte ones at
# M = 512 on the large Kimi-K2 products, run 204: the same wgmma, other shared-memory reads)
TMA_TILE = MmaConfig(wm=2, wn=4, tm=4, tn=4, stages=6, wgmma=True, tma=True, swizzle=128)


# Wider tiles, fewer staged bytes a FLOP: at 128 x 128 the kernel kept L2 77% busy at M = 512
# (Nsight Compute, run 204), where cuBLAS runs 192 x 128 (run 202).  Unfolded (a fold's two
# accumulator sets do not fit their registers): their sliced products' slices go through
# memory.  bench_layers.py times them beside the default; not picked by mma_config yet
WIDE_TILES = {
    "tma 128 x 256": dataclasses.replace(TMA_TILE, tn=8, stages=4),
    "tma 192 x 128": dataclasses.replace(TMA_TILE, wm=3, stages=5),
    "tma 256 x 128": dataclasses.replace(TMA_TILE, wm=4, stages=4),
}
# 192 x 128 with a fold's two accumulator sets (folded or stream-K): 163-168 registers
# uncapped, more than 416 threads may hold; capped at 152 ptxas spills 32 / 84 bytes
WIDE_FOLDING = dataclasses.replace(WIDE_TILES["tma 192 x 128"], max_registers=152)


def tma_config(cfg: MmaConfig) -> MmaConfig:
    """``cfg`` (a linear's plan: its K slices and fold) on :data:`TMA_TILE`, stream-K with
    ``KDTREE_MMA_STREAM_K``."""
    return with_stream_k(dataclasses.replace(TMA_TILE, splits=cfg.splits,
                                             slices_in_block=cfg.slices_in_block))


def register_cap(cfg: MmaConfig) -> int:
    """The TMA kernel's registers a thread: ``cfg.max_registers``, else as many as let a block
    (its consumers and the producer warp) fit an SM's 65,536.  numba sets no launch bounds,
    so ptxas does not know the block size, and the H100 image's toolchain gave stream-K's
    and the wide tiles more than that: their launches failed (run 205)."""
    return cfg.max_registers or min(255, 65536 // (cfg.threads + 32) // 8 * 8)


def tma_kernel(cfg: MmaConfig):
    """The kernel for a tile shape (K slices are a launch argument; the fold is the shape's;
    stream-K's waves only move the launcher's ``dp_tiles``: one kernel for 1 and 2)."""
    return _tma_kernel_for(dataclasses.replace(cfg, splits=1, stream_k=min(cfg.stream_k, 1)))


wgmma_operand_128 = inline_device_function(wgmma_descriptor_128)


@kernel_factory
def _tma_kernel_for(cfg: MmaConfig):
    from numba import float32, uint32, uint64

    BM, BN, BK, STAGES = cfg.bm, cfg.bn, cfg.bk, cfg.stages
    CONSUMERS = cfg.threads                       # the warpgroups' threads; the producer next
    GROUPS = CONSUMERS // 128                     # consumer warpgroups
    WIDTH = cfg.swizzle // 2                      # bf16 a panel row: 32 or 64
    PANELS = BK // WIDTH
    STEPS = WIDTH // 16                           # k16 steps a panel
    ROW_WORDS = WIDTH // 2                        # uint32 words of a panel row
    ALIGN_BYTES = 1024 if cfg.swizzle == 128 else 512     # the swizzle's period
    describe = wgmma_operand if cfg.swizzle == 64 else wgmma_operand_128
    A_STAGE, B_STAGE = BM * BK // 2, BN * BK // 2  # words of a stage's x and weight tiles
    B_RING = STAGES * A_STAGE                     # the weight ring after the x ring
    STAGE_BYTES = 2 * (BM + BN) * BK
    BARRIERS = 2 * STAGES                         # full[slot], then empty[slot]
    FOLD = cfg.slices_in_block
    STREAM_K = cfg.stream_k
    SWAP = cfg.swap_ab          # A = the weights' rows, B = x's: tiles of y^T
    NACC = BN // 2
    wgmma = wgmma_bf16(BN)
    origin = accumulator_origin(cfg)
    ZERO = float32(0.0)
    ALIGN = None if SIMULATOR else 16

    @inline_device_function
    def tile_of(u, a_tiles, b_tiles):
        """Output tile u -> (A tile, B tile): in groups of GROUP_M A tiles, the A tile fastest
        within a group."""
        group, within = divmod_u32(u, GROUP_M * b_tiles)
        first = group * GROUP_M
        size = min(a_tiles - first, GROUP_M)
        bt, at = divmod_u32(within, size)
        return first + at, bt

    @inline_device_function
    def unit_tile(u, a_tiles, b_tiles, splits):
        """Work unit u -> (A tile, B tile, first K slice): with the slices through memory,
        slice-major."""
        s = 0
        if not FOLD:
            s, u = divmod_u32(u, a_tiles * b_tiles)
        at, bt = tile_of(u, a_tiles, b_tiles)
        return at, bt, s

    @inline_device_function
    def slice_bounds(s, splits, kc_total, k_total):
        """K slice s: whole SLICE_UNITs, as layers/mma.py cuts them."""
        u_begin, _ = divmod_u32(s * kc_total, splits)
        u_end, _ = divmod_u32((s + 1) * kc_total, splits)
        return SLICE_UNIT * u_begin, min(SLICE_UNIT * u_end, k_total)

    @inline_device_function
    def stream_k_range(block, grid, units):
        """Stream-K slice units [first, end) of block ``block`` (of ``grid``): an even share."""
        first, _ = divmod_u32(block * units, grid)
        end, _ = divmod_u32((block + 1) * units, grid)
        return first, end

    @inline_device_function
    def block_share(tiles, dp_tiles, splits):
        """This block's stream-K slice units: the tiles past ``dp_tiles``, ``splits`` each."""
        return stream_k_range(cuda.blockIdx.x, cuda.gridDim.x, (tiles - dp_tiles) * splits)

    @inline_device_function
    def stream_k_block(i, grid, units):
        """The block whose stream-K range holds slice unit i."""
        b, _ = divmod_u32((i + 1) * grid - 1, units)
        return b

    @inline_device_function
    def next_segment(u, i, end, dp_tiles, splits):
        """Stream-K's walk: (tile, stream-K tile, first slice, end slice, u, i, done) of the
        block's next segment: whole tiles u, u + grid, ... below ``dp_tiles``, then its share
        [i, end) of the rest's slices (one loop, so each role's body is inlined once)."""
        if u < dp_tiles:
            return u, 0, 0, splits, u + cuda.gridDim.x, i, False
        if i < end:
            r, s0 = divmod_u32(i, splits)
            s1 = min(splits, s0 + end - i)
            return dp_tiles + r, r, s0, s1, u, i + s1 - s0, False
        return 0, 0, 0, 0, u, i, True

    @inline_device_function
    def next_slot(slot, phase):
        """The ring position after (slot, phase): both roles walk the same stages."""
        if slot + 1 == STAGES:
            return 0, phase ^ 1
        return slot + 1, phase

    @inline_device_function
    def produce_slices(smem, word0, bars, a_maps, a_slot, b_maps, b_slot, a16, b16, at, bt,
                       s_begin, s_end, splits, kc_total, k_total, slot, phase):
        """Stage K slices [s_begin, s_end) of tile (at, bt) through the ring."""
        for s in range(s_begin, s_end):
            k0, k_end = slice_bounds(s, splits, kc_total, k_total)
            while k0 < k_end:
                mbarrier_wait(bars, STAGES + slot, phase ^ 1)          # the slot is free
                mbarrier_expect_tx(bars, slot, STAGE_BYTES)
                for p in range(PANELS):
                    tma_load_panel(smem, word0 + slot * A_STAGE + p * BM * ROW_WORDS,
                                   a_maps, a_slot, a16, k0 + WIDTH * p, at * BM, BM,
                                   bars, slot, WIDTH)
                    tma_load_panel(smem, word0 + B_RING + slot * B_STAGE
                                   + p * BN * ROW_WORDS, b_maps, b_slot, b16,
                                   k0 + WIDTH * p, bt * BN, BN, bars, slot, WIDTH)
                k0 += BK
                slot, phase = next_slot(slot, phase)
        return slot, phase

    @inline_device_function
    def produce(smem, word0, bars, a_maps, a_slot, b_maps, b_slot, a16, b16, units, a_tiles,
                b_tiles, splits, kc_total, k_total, dp_tiles):
        tensor_map_acquire(a_maps, a_slot)
        tensor_map_acquire(b_maps, b_slot)
        slot, phase, u = 0, 0, cuda.blockIdx.x
        if STREAM_K:    # whole tiles, then this block's share of the stream-K slices
            i, end = block_share(a_tiles * b_tiles, dp_tiles, splits)
            while True:
                t, r, s0, s1, u, i, done = next_segment(u, i, end, dp_tiles, splits)
                if done:
                    break
                at, bt = tile_of(t, a_tiles, b_tiles)
                slot, phase = produce_slices(smem, word0, bars, a_maps, a_slot, b_maps, b_slot,
                                             a16, b16, at, bt, s0, s1, splits, kc_total,
                                             k_total, slot, phase)
        else:
            per_unit = splits if FOLD else 1
            while u < units:
                at, bt, s0 = unit_tile(u, a_tiles, b_tiles, splits)
                slot, phase = produce_slices(smem, word0, bars, a_maps, a_slot, b_maps, b_slot,
                                             a16, b16, at, bt, s0, s0 + per_unit, splits,
                                             kc_total, k_total, slot, phase)
                u += cuda.gridDim.x

    @inline_device_function
    def multiply_slice(smem, tiles, a_rows, bars, acc, k0, k_end, slot, phase, lane):
        """acc = the products of K [k0, k_end) from zero, stage by stage off the ring."""
        for i in range(NACC):
            acc[i] = ZERO
        last = -1
        while k0 < k_end:
            mbarrier_wait(bars, slot, phase)                         # the stage has landed
            wgmma_fence()
            for p in range(PANELS):
                for step in range(STEPS):
                    wgmma(acc, smem,
                          describe(a_rows + 4 * (slot * A_STAGE + p * BM * ROW_WORDS)
                                   + 32 * step),
                          describe(tiles + 4 * (B_RING + slot * B_STAGE
                                                + p * BN * ROW_WORDS) + 32 * step))
            wgmma_commit()
            wgmma_wait_1()                      # the stage before is multiplied: free it
            if last >= 0 and lane == 0:
                mbarrier_arrive(bars, STAGES + last)
            last = slot
            k0 += BK
            slot, phase = next_slot(slot, phase)
        wgmma_wait_all()
        if last >= 0 and lane == 0:
            mbarrier_arrive(bars, STAGES + last)
        return slot, phase

    @inline_device_function
    def fold(total, acc, first):
        """The slices added in slice order: sum_splits' expression."""
        for i in range(NACC):
            total[i] = acc[i] if first else total[i] + acc[i]

    @inline_device_function
    def store_tile(out, acc, at, bt, orow, m_total, n_total, warp, lane):
        row0, col0 = origin(warp, 0)
        a0 = at * BM + row0
        b0 = bt * BN + col0
        for j in range(BN // 8):
            for e in range(4):
                r, c = fragment_position(lane, e)
                a = a0 + r
                b = b0 + 8 * j + c
                if SWAP:        # acc holds y^T: a is a column of y, b a row
                    if a < n_total and b < m_total:
                        store_nowrap_2d(out, orow + b, a, acc[4 * j + e])
                elif a < m_total and b < n_total:
                    store_nowrap_2d(out, orow + a, b, acc[4 * j + e])

    @inline_device_function
    def part_store(part, acc, r, s, splits, tid):
        """Slice s (or slot 0: a prefix's fold) of stream-K tile r -> ``part``, each thread's
        accumulators at its own offsets (whichever block completes the tile reads them back
        in the thread that holds those positions there)."""
        base = (r * splits + s) * NACC
        for i in range(NACC):
            part[(base + i) * CONSUMERS + tid] = acc[i]

    @inline_device_function
    def consume_segment(smem, tiles, a_rows, bars, acc, total, out, part, counters, t, r, s0,
                        s1, a_tiles, b_tiles, splits, kc_total, k_total, m_total, n_total,
                        dp_tiles, slot, phase, tid):
        """Stream-K: K slices [s0, s1) of tile t (stream-K tile r when it is cut).  The block
        with slice 0 folds its slices; any other keeps each slice apart in ``part``, since
        only slice order gives sum_splits' bits; each warpgroup's rows of the tile are then
        added, in slice order, into y by the last of the tile's blocks to count its slices
        in that warpgroup's counter."""
        lane = tid & 31
        warp = tid >> 5
        for s in range(s0, s1):
            k0, k_end = slice_bounds(s, splits, kc_total, k_total)
            slot, phase = multiply_slice(smem, tiles, a_rows, bars, acc, k0, k_end, slot,
                                         phase, lane)
            if s0 == 0:
                fold(total, acc, s == 0)
            else:
                part_store(part, acc, r, s, splits, tid)
        at, bt = tile_of(t, a_tiles, b_tiles)
        if s0 == 0 and s1 == splits:
            store_tile(out, total, at, bt, 0, m_total, n_total, warp, lane)
            return slot, phase
        if s0 == 0:
            part_store(part, total, r, 0, splits, tid)
        grid = cuda.gridDim.x
        units = (a_tiles * b_tiles - dp_tiles) * splits
        _, first_end = stream_k_range(stream_k_block(r * splits, grid, units), grid, units)
        prefix_end = min(first_end - r * splits, splits)         # where slot 0's fold ends
        group = tid >> 7
        at_counter = r * GROUPS + group
        # the tile counts its slices (blocks with an empty share may lie between its owners)
        if group_last_to_arrive(counters, at_counter, s1 - s0, splits, bars, 1 + group, 128,
                                (tid & 127) == 0):
            base = r * splits * NACC
            if s0 != 0:
                for i in range(NACC):
                    total[i] = load_l2_f32(part, (base + i) * CONSUMERS + tid)
            for s in range(prefix_end, splits):
                base = (r * splits + s) * NACC
                for i in range(NACC):
                    total[i] += load_l2_f32(part, (base + i) * CONSUMERS + tid)
            store_tile(out, total, at, bt, 0, m_total, n_total, warp, lane)
            if (tid & 127) == 0:
                counters[at_counter] = 0
        return slot, phase

    @inline_device_function
    def consume(smem, tiles, bars, out, part, counters, units, a_tiles, b_tiles, splits,
                kc_total, k_total, m_total, n_total, dp_tiles, tid):
        acc = cuda.local.array(NACC, float32)
        total = cuda.local.array(NACC, float32)
        lane = tid & 31
        warp = tid >> 5
        a_rows = tiles + (tid >> 7) * (64 * 4 * ROW_WORDS)    # the warpgroup's 64 rows
        slot = 0
        phase = 0
        u = cuda.blockIdx.x
        if STREAM_K:
            i, end = block_share(a_tiles * b_tiles, dp_tiles, splits)
            while True:
                t, r, s0, s1, u, i, done = next_segment(u, i, end, dp_tiles, splits)
                if done:
                    return
                slot, phase = consume_segment(smem, tiles, a_rows, bars, acc, total, out, part,
                                              counters, t, r, s0, s1, a_tiles, b_tiles, splits,
                                              kc_total, k_total, m_total, n_total, dp_tiles,
                                              slot, phase, tid)
        per_unit = splits if FOLD else 1
        while u < units:
            at, bt, s0 = unit_tile(u, a_tiles, b_tiles, splits)
            for s in range(s0, s0 + per_unit):
                k0, k_end = slice_bounds(s, splits, kc_total, k_total)
                slot, phase = multiply_slice(smem, tiles, a_rows, bars, acc, k0, k_end, slot,
                                             phase, lane)
                if FOLD:
                    fold(total, acc, s == s0)
            if FOLD:
                store_tile(out, total, at, bt, 0, m_total, n_total, warp, lane)
            else:
                store_tile(out, acc, at, bt, s0 * m_total, m_total, n_total, warp, lane)
            u += cuda.gridDim.x

    @kernel(max_registers=register_cap(cfg))
    def mma_tma_linear(x16, w16, out, x_maps, x_slot, w_maps, w_slot, m_total, n_total,
                       k_total, a_tiles, b_tiles, splits, kc_total, part, counters, dp_tiles):
        """out = x16 w16^T over this block's work units (the module docstring); x16's and
        w16's tensor maps are rows ``x_slot`` of ``x_maps`` and ``w_slot`` of ``w_maps``;
        ``a_tiles`` / ``b_tiles``: the A and B operands' row tiles (x's and the weights', or
        swapped).  Stream-K: the first ``dp_tiles`` tiles whole, the rest's K slices shared
        out (cut tiles through ``part`` and ``counters``; unused otherwise)."""
        smem = cuda.shared.array(0, uint32, alignment=ALIGN)
        bars = cuda.shared.array(BARRIERS, uint64)
        tid = cuda.threadIdx.x
        if tid == 0:
            for b in range(STAGES):
                mbarrier_init(bars, b, 1)                          # the producer's expect_tx
                mbarrier_init(bars, STAGES + b, CONSUMERS // 32)   # a consumer warp each
            mbarrier_init_fence()
        cuda.syncthreads()
        sbase = shared_base(smem)
        # the tiles at the swizzle's period, which TMA and wgmma apply to absolute addresses
        tiles = (sbase + ALIGN_BYTES - 1) & ~(ALIGN_BYTES - 1)
        units = a_tiles * b_tiles * (1 if FOLD else splits)
        if tid >= CONSUMERS:
            if tid != CONSUMERS:
                return
            if SWAP:
                produce(smem, (tiles - sbase) >> 2, bars, w_maps, w_slot, x_maps, x_slot, w16,
                        x16, units, a_tiles, b_tiles, splits, kc_total, k_total, dp_tiles)
            else:
                produce(smem, (tiles - sbase) >> 2, bars, x_maps, x_slot, w_maps, w_slot, x16,
                        w16, units, a_tiles, b_tiles, splits, kc_total, k_total, dp_tiles)
        else:
            consume(smem, tiles, bars, out, part, counters, units, a_tiles, b_tiles, splits,
                    kc_total, k_total, m_total, n_total, dp_tiles, tid)

    return mma_tma_linear


# ------------------------------------------------------------------ host

_X_ROWS: dict = {}      # (context, K) -> the bf16 rows buffer, grown by powers of two
_X_OUTGROWN: list = []  # the buffers they replaced, kept for the graphs that still use them


def _x_rows(m: int, k: int, stream, context=None):
    """The kept [rows >= m, k] uint16 buffer x is rounded into (module docstring)."""
    from kdtree_numba import compat
    key = (context_key() if context is None else context, k)
    buf = _X_ROWS.get(key)
    if buf is None or buf.shape[0] < m:
        if buf is not None:
            _X_OUTGROWN.append(buf)
        rows = max(128, 1 << (m - 1).bit_length())
        buf = _X_ROWS[key] = compat.device_empty((rows, k), np.uint16, stream)
    return buf


@functools.cache
def _sm_count() -> int:
    if SIMULATOR:
        return 2
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def planned(cfg: MmaConfig):
    """The TMA tile a linear planned on ``cfg`` runs (cfg itself when it is one; with
    ``KDTREE_MMA_TMA`` the warpgroup tile's slices and fold on :data:`TMA_TILE`), or None:
    layers/mma.py's cp.async kernels."""
    if cfg.tma:
        return cfg
    if not cfg.wgmma:           # every linear asks: the cheap test first
        return None
    if dataclasses.replace(cfg, splits=1, slices_in_block=False,
                           sums_in_last=False) == WGMMA_TILE and runtime.current().mma_tma:
        return tma_config(cfg)
    return None


def whole_tiles(tiles: int, grid: int, waves: int = 1) -> int:
    """Stream-K: the tiles ``grid`` persistent blocks run whole, one after another (the
    data-parallel waves), before the last ``waves`` waves of tiles -- 1: the partial last
    one; 2: it and the full one before, so each block's share holds more slices and fewer
    tiles are cut -- are shared out slice by slice.  All of them where the tiles fill whole
    waves."""
    full, rest = divmod(tiles, grid)
    if rest == 0:
        return tiles
    return max(0, full - (waves - 1)) * grid


# context -> (float32 [1], int32 [1]): the part and counters arguments of a launch without
# stream-K, which its kernel never reads
_UNUSED: dict = {}


def _no_stream_k(context, stream):
    args = _UNUSED.get(context)
    if args is None:
        from kdtree_numba import compat
        args = _UNUSED[context] = (compat.device_empty((1,), np.float32, stream),
                                   compat.device_empty((1,), np.int32, stream))
    return args


def tma_linear(xd, wd, y, cfg: MmaConfig, stream=0, workspace=None):
    """Launch: y [M, N] = bf16(xd [M, K]) wd^T on ``cfg`` (a ``tma`` tile): its K slices
    (at most K's units) added in the block where mma.folds_slices says (or cfg asks), else
    by a sum launch, or with ``cfg.stream_k`` shared out over the grid (:func:`whole_tiles`,
    the cut tiles' slices through a workspace buffer); the cp.async kernels' slices and
    order, so their bits."""
    (m, k), n = xd.shape, wd.shape[0]
    splits, in_block, in_memory = slice_plan(cfg, m, n, k)
    stream_k = cfg.stream_k if splits > 1 else 0
    if stream_k:
        in_block = in_memory = False
    if (in_block, stream_k) != (cfg.slices_in_block, cfg.stream_k):
        cfg = dataclasses.replace(cfg, slices_in_block=in_block, stream_k=stream_k)
    context = context_key()
    buf = _x_rows(m, k, stream, context)
    round_into(xd, buf, stream)
    x_box, w_box = (cfg.bn, cfg.bm) if cfg.swap_ab else (cfg.bm, cfg.bn)   # rows a box
    x_maps, x_slot = tensor_map(buf, x_box, stream, cfg.swizzle, context)
    w_maps, w_slot = tensor_map(wd, w_box, stream, cfg.swizzle, context)
    target = partial_sums(y, splits, in_memory, workspace, stream)
    a_tiles, b_tiles = ((-(-n // cfg.bm), -(-m // cfg.bn)) if cfg.swap_ab else
                        (-(-m // cfg.bm), -(-n // cfg.bn)))
    tiles = a_tiles * b_tiles
    if stream_k:
        grid = min(tiles * splits, _sm_count())
        dp_tiles = whole_tiles(tiles, grid, stream_k)
        cut = tiles - dp_tiles
        part = workspace_buffer(workspace, "linear.mma_stream_k",
                                (max(1, cut * splits * cfg.bm * cfg.bn),), np.float32, stream)
        counters = arrival_counters("linear.mma_stream_k", max(1, cut * cfg.threads // 128),
                                    stream)
    else:
        grid = min(tiles * (splits if in_memory else 1), _sm_count())
        dp_tiles = tiles
        part, counters = _no_stream_k(context, stream)
    dispatcher = tma_kernel(cfg)
    args = (buf, wd, target, x_maps, x_slot, w_maps, w_slot, m, n, k, a_tiles, b_tiles,
            splits, -(-k // SLICE_UNIT), part, counters, dp_tiles)
    allow_large_shared_memory(dispatcher, args, cfg.smem_bytes)
    dispatcher[grid, cfg.threads + 32, stream, cfg.smem_bytes](*args)
    if in_memory:
        add_splits(target.reshape(splits, m, n), y, stream)

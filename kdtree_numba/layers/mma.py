"""The bf16 tensor-core GEMM behind ``linear(x, w, method="mma")``: ``y = x w^T`` with bf16
weights, x rounded to bf16 (to nearest, ties to even) once per call, fp32 accumulation on
tensor cores (``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``, gpu/tensorcore.py).

Holds the index math of the shared-memory tiles and fragments as plain functions (the kernel
calls them as device functions; tests/test_layers_mma.py replays a whole block with them in
NumPy against the PTX ISA's fragment layout), the kernel factory and the launcher, and
re-exports the plain-Python plan of layers/mma_plan.py (:class:`MmaConfig`,
:func:`mma_config`, :func:`mma_splits`: the shapes linear() uses).  Twin:
reference/layers/linear.py; design, tolerance and measurements: docs/LAYERS.md, "bf16
tensor-core linear".

In short: x is rounded to bf16 once per call (``_round_to_bf16_pairs``, ``cvt.rn.bf16x2.f32``)
into a workspace buffer; a block of ``wm x wn`` warps owns a BM x BN output tile (BM = 16 wm
tm, BN = 8 wn tn) over one K slice.  K runs in stages of ``bk`` (64 for every linear tile)
through a ring of ``stages`` shared buffers (dynamic shared memory, opted in above 48 KiB):
both operands go global -> shared by ``cp.async`` (16 bytes = 8 bf16, zero filled past M, N
or the slice end), through per-thread cursors formed once per K loop, ``stages - 1`` stages
in flight, one barrier per stage.  Shared tiles are 32-wide *panels* of K in natural order,
rows of 64 bytes = four 16-byte chunks, chunk c of row r stored at c ^ ((r >> 1) & 3) (an XOR
swizzle: the 8 rows one ldmatrix matrix reads sit in 8 bank quads).  Per panel and k16 step,
``ldmatrix.x4`` loads an m16 tile's A fragment or two n8 tiles' B fragments in register order
(``.x2`` an odd last n8 tile), so ptxas needs no moves to assemble an A quad from rows g
and g + 8 (a plain 128-bit load of one row would).  Each thread holds tm x tn m16n8
accumulator tiles.  An output's mma chain runs over its K slice in k16 steps in panel order
whatever the tile (bk only groups panels into stages; the slices are cut in units of
SLICE_UNIT = 64 at every bk, a stage past a slice's end zero-filled), and the K slices depend
on N and K only (:func:`mma_splits`), so a row's result is the same at every M: the linear is
batch invariant.

The grouped MoE kernel (layers/moe_mma.py) shares the tile shape and the K loop
(:func:`ring_function`, which takes per-thread row tables so that it can gather rows).

``MmaConfig(wgmma=True)`` multiplies the same staged panels with warpgroup mma (sm_90a;
their layout is wgmma's 64-byte swizzle), bitwise the mma.sync rows: the tile past
80 rows on sm_90 (:data:`WGMMA_TILE`), whose blocks add their own K slices where the M x N tiles
fill the GPU (``slices_in_block``): docs/LAYERS.md, "Warpgroup mma".

Needs K % 8 == 0 and C-contiguous, 16-byte aligned x and w (the 16-byte loads); linear() raises
a ValueError otherwise (``method="tensor-cores"`` falls back to the CUDA-core kernels there).
Tensor cores exist only on the GPU: under the simulator the kernel runs up to its first mma,
which raises NotImplementedError (the tests emulate the warp's mma there).
``method="auto"`` never picks this kernel: rounding x to bf16 is the model's choice
(``make_backend(gemm="tensor-cores")``), not M's.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.gpu.counters import arrival_counters, last_to_arrive
from kdtree_numba.gpu.bits import divmod_u32
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (allow_large_shared_memory, block_sync, cp_async_commit,
                                     cp_async_wait_1, cp_async_wait_2, cp_async_wait_3,
                                     cp_async_wait_4, cp_async_wait_all, load_l2_f32,
                                     store_nowrap_2d)
from kdtree_numba.gpu.tensorcore import (WGMMA_SWIZZLE_64B, fence_proxy_async, mma_bf16_m16n8k16,
                                         pack_bf16x2, wgmma_bf16, wgmma_commit, wgmma_fence,
                                         wgmma_wait_1, wgmma_wait_all)
from kdtree_numba.layers.common import add_splits
from kdtree_numba.layers.mma_plan import (  # noqa: F401  (re-exported: the GEMM's plan)
    PANEL, SLICE_UNIT, SWAPPED_ROWS, WGMMA_TILE, MmaConfig, mma_config, mma_error_coefficient,
    mma_splits, mma_tile, unsliced_tile, wgmma_available)
from kdtree_numba.layers.workspace import launch_1d, workspace_buffer

__all__ = ["MmaConfig", "WGMMA_TILE", "wgmma_available", "mma_tile", "unsliced_tile",
           "mma_config", "mma_splits", "accumulator_origin",
           "mma_error_coefficient", "stage_compute", "ring_function", "ring_wait",
           "w_stage_slot", "panel_word", "ldsm_word", "c_position", "mma_kernel",
           "round_to_bf16", "round_into", "mma_linear", "mma_head_products", "copy_chunk",
           "shared_base", "fragment_position", "wgmma_operand", "folds_slices", "slice_plan",
           "partial_sums",
           "array_base", "ELEM", "WORD"]

WORDS = PANEL // 2  # uint32 words of a panel row (64 bytes)


# ------------------------------------------------------------------ index math (plain Python)
# Shared tiles are uint32 words: panel p of a tile of `rows` rows is words
# [p * rows * 16, (p + 1) * rows * 16); row r of it 16 words, four 16-byte *chunks* of 8 bf16
# (chunk c: the panel's k 8c .. 8c + 7, ascending), chunk c stored at position c ^ ((r >> 1) & 3).

def panel_word(p, rows, row, chunk):
    """Word offset of chunk ``chunk`` of ``row`` in panel p of a tile of ``rows`` rows.  The
    XOR swizzle puts the chunk of 8 consecutive rows (what one ldmatrix matrix reads) in 8
    different bank quads: unswizzled, rows r and r + 2 (128 bytes apart) share one."""
    return (p * rows + row) * WORDS + 4 * (chunk ^ ((row >> 1) & 3))


def w_stage_slot(c, rows, bk):
    """Chunk c of a stage of a tile of ``rows`` rows (x or weights; 8 bf16 = 16 bytes = 4
    words, chunks row-major): (tile row, k offset in the stage, word offset in the tile)."""
    per_row = bk // 8
    row = c // per_row
    kc = c - row * per_row
    return row, 8 * kc, ((kc // 4) * rows + row) * WORDS + 4 * ((kc % 4) ^ ((row >> 1) & 3))
    # = panel_word(kc // 4, rows, row, kc % 4), written out: a device function calls no
    # plain-Python function


def ldsm_word(lane, step, a_operand):
    """Word offset, from row 0 of panel 0 of a fragment's rows (which start at a multiple of 8
    in the tile, so the swizzle sees the same rows), of the 16-byte row ``lane`` gives ldmatrix
    for k16 step ``step`` of a panel (its chunks 2 step and 2 step + 1): matrix m = lane >> 3,
    its row lane & 7.  A (an m16 tile): matrices (rows 0-7, chunk 2s), (rows 8-15, 2s), (rows
    0-7, 2s + 1), (rows 8-15, 2s + 1), which land in registers a0a1, a2a3, a4a5, a6a7.  B (two
    n8 tiles of weight rows): (rows 0-7, 2s), (rows 0-7, 2s + 1), (rows 8-15, 2s), (rows 8-15,
    2s + 1): b0b1, b2b3 of the first tile, then of the second (an x2 load: the first only)."""
    m, r = lane >> 3, lane & 7
    row = 8 * (m & 1) + r if a_operand else 8 * (m >> 1) + r
    chunk = 2 * step + ((m >> 1) if a_operand else (m & 1))
    return row * WORDS + 4 * (chunk ^ ((row >> 1) & 3))       # = panel_word(0, 0, row, chunk)


def c_position(lane, e):
    """(row, column) inside the 16 x 8 tile of accumulator e (0..3) of ``lane``."""
    return (lane >> 2) + 8 * (e >> 1), 2 * (lane & 3) + (e & 1)


_ldsm_word = inline_device_function(ldsm_word)

if SIMULATOR:
    def _fragments(smem, base, offset, lane, step, a_operand, n):
        """What ldmatrix.x4 (n = 4) / .x2 (n = 2) gives ``lane``: register m = word lane % 4
        of row lane // 4 of matrix m, whose address lane 8 m + lane // 4 gives (the simulator
        runs lanes apart, so each reads its words by the layout's formula)."""
        return tuple(smem[base + offset + ldsm_word(8 * m + (lane >> 2), step, a_operand)
                          + (lane & 3)] for m in range(n))

    def _fragments4(smem, base, offset, lane, step, a_operand):
        return _fragments(smem, base, offset, lane, step, a_operand, 4)

    def _fragments2(smem, base, offset, lane, step):
        return _fragments(smem, base, offset, lane, step, False, 2)
else:
    from kdtree_numba.gpu.memory import ldmatrix_x2, ldmatrix_x4

    @inline_device_function
    def _fragments4(smem, base, offset, lane, step, a_operand):
        return ldmatrix_x4(smem, base + _ldsm_word(lane, step, a_operand), offset)

    @inline_device_function
    def _fragments2(smem, base, offset, lane, step):
        return ldmatrix_x2(smem, base + _ldsm_word(lane, step, False), offset)


# A thread's chunk copies go through *cursors* formed once per K loop: a global one stepped
# by a constant per stage and a shared one per ring buffer.  On the GPU they are addresses
# (the 64-bit index math of an element address per chunk and stage would otherwise dominate
# the linear's instructions); in the simulator element and word indices
# (cursor = base + unit * index, base 0, unit 1).
if SIMULATOR:
    ELEM, WORD = 1, 1

    def _shared_base(smem):
        return 0

    def _array_base(arr):
        return 0

    from kdtree_numba.gpu.memory import sim_copy_u16x8

    def _copy_chunk(smem, scursor, arr, cursor, nbytes):
        """Simulator twin of the cp.async below: the 8 bf16 at flat element ``cursor`` of
        ``arr`` -> words smem[scursor:+4] (zeros when nbytes == 0)."""
        sim_copy_u16x8(smem, scursor, arr, divmod(cursor, arr.shape[1]), nbytes)
else:
    from kdtree_numba.gpu.memory import cp_async16_raw, global_address, shared_address
    ELEM, WORD = 2, 4          # bytes per bf16, per shared word

    @inline_device_function
    def _shared_base(smem):
        return shared_address(smem, 0)

    @inline_device_function
    def _array_base(arr):
        return global_address(arr, (0, 0))

    @inline_device_function
    def _copy_chunk(smem, scursor, arr, cursor, nbytes):
        """16 bytes at global address ``cursor`` -> shared address ``scursor`` by cp.async;
        nbytes (16 or 0) are read, the rest zero-filled."""
        cp_async16_raw(scursor, cursor, nbytes)


_w_stage_slot = inline_device_function(w_stage_slot)
_c_position = inline_device_function(c_position)
# c_position as a device function, for the TMA kernel's epilogue (layers/mma_tma.py)
fragment_position = _c_position
# the staging primitives, for the W4A16 kernel's own ring (layers/moe_int4_mma.py): on the GPU
# copy_chunk moves any 16 bytes between the addresses; in the simulator 8 bf16
copy_chunk, shared_base, array_base = _copy_chunk, _shared_base, _array_base


# ------------------------------------------------------------------ kernel

# A wgmma descriptor's fixed fields (PTX ISA, "Matrix Descriptor"): leading byte offset 1
# (unused by K-major swizzled layouts), stride byte offset 512 >> 4 (8 rows of 64 bytes to the
# next 8), swizzle mode 64 bytes in bits 62-63; the start address >> 4 goes in bits 0-13.
_DESC_FIELDS = int(np.uint64((1 << 16) | ((512 >> 4) << 32) | (WGMMA_SWIZZLE_64B << 62))
                   .view(np.int64))


def wgmma_descriptor(address):
    """The descriptor of a K-major bf16 operand in the panel layout (:func:`panel_word`)
    starting at shared byte ``address`` (a multiple of 16; rows 64 bytes apart, 512-byte
    aligned 8-row groups)."""
    return _DESC_FIELDS | ((address & 0x3FFFF) >> 4)


_wgmma_descriptor = inline_device_function(wgmma_descriptor)
# the descriptor as a device function, for the TMA kernel (layers/mma_tma.py)
wgmma_operand = _wgmma_descriptor


@functools.cache
def stage_compute(cfg: MmaConfig):
    """The device function running a K stage's mma steps on this tile shape (ring_function's
    loop calls it; tests patch the mma it calls)."""
    TM, TN, BK = cfg.tm, cfg.tn, cfg.bk
    BM, BN = cfg.bm, cfg.bn
    PANELS = BK // PANEL
    PAIRS, ODD = TN // 2, TN % 2

    if cfg.wgmma:
        wgmma = wgmma_bf16(BN)

        @inline_device_function
        def compute_wgmma(acc, av, bv, smem, sbase, a_at, b_at, arow, brow, tid):
            """acc += this stage's products by warpgroup mma: per panel and k16 step one
            m64nBNk16 of the warpgroup's 64 rows (tid >> 7) against all BN weight rows, both
            operands from the stage's panels (word offsets ``a_at`` / ``b_at`` from the
            tiles' shared byte address ``sbase``; a k16 step is 32 bytes into the 64-byte
            rows, where the hardware applies the panels' swizzle), committed as one group; the
            warpgroup waits only for the previous stage's group, so this stage's products run
            on while the ring stages the next (ring_function keeps the buffer they read
            untouched until the stage after next)."""
            a_rows = sbase + 4 * a_at + (tid >> 7) * (64 * 2 * PANEL)   # 64 rows of 64 bytes
            b_rows = sbase + 4 * b_at
            wgmma_fence()
            for p in range(PANELS):
                for step in range(2):
                    wgmma(acc, smem,
                          _wgmma_descriptor(a_rows + p * BM * 2 * PANEL + 32 * step),
                          _wgmma_descriptor(b_rows + p * BN * 2 * PANEL + 32 * step))
            wgmma_commit()
            wgmma_wait_1()
        return compute_wgmma

    @inline_device_function
    def compute(acc, av, bv, smem, sbase, a_at, b_at, arow, brow, tid):
        """acc += this stage's products: per panel and k16 step, one ldmatrix.x4 per m16 tile
        (its A fragment) and per two n8 tiles (their B fragments; x2 for an odd last one),
        then tm x tn mma.  ``arow`` / ``brow``: the lane's row g of the warp's first m16 / n8
        tile.  The fragments arrive in register order, so assembling A's (rows g, g + 8)
        quads takes no moves."""
        lane = tid & 31
        a_base = a_at + (arow - (lane >> 2)) * WORDS      # the warp's first rows, panel 0
        b_base = b_at + (brow - (lane >> 2)) * WORDS
        for p in range(PANELS):
            for step in range(2):
                for i in range(TM):
                    av[4 * i], av[4 * i + 1], av[4 * i + 2], av[4 * i + 3] = _fragments4(
                        smem, a_base, (p * BM + 16 * i) * WORDS, lane, step, True)
                for h in range(PAIRS):
                    bv[4 * h], bv[4 * h + 1], bv[4 * h + 2], bv[4 * h + 3] = _fragments4(
                        smem, b_base, (p * BN + 16 * h) * WORDS, lane, step, False)
                if ODD:
                    bv[4 * PAIRS], bv[4 * PAIRS + 1] = _fragments2(
                        smem, b_base, (p * BN + 16 * PAIRS) * WORDS, lane, step)
                for i in range(TM):
                    for j in range(TN):
                        o = 4 * (i * TN + j)
                        acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_bf16_m16n8k16(
                            av[4 * i], av[4 * i + 1], av[4 * i + 2], av[4 * i + 3],
                            bv[2 * j], bv[2 * j + 1], acc[o], acc[o + 1], acc[o + 2],
                            acc[o + 3])
    return compute


@functools.cache
def ring_wait(pending: int):
    """``wait_oldest()`` of a cp.async ring that leaves ``pending`` (0-4) commit groups in
    flight: this thread's copies of the oldest stage in flight have landed."""
    if not 0 <= pending <= 4:
        raise ValueError(f"a cp.async ring leaves 0 to 4 groups in flight, not {pending}")

    @inline_device_function
    def wait_oldest():
        if pending == 4:
            cp_async_wait_4()
        elif pending == 3:
            cp_async_wait_3()
        elif pending == 2:
            cp_async_wait_2()
        elif pending == 1:
            cp_async_wait_1()
        else:
            cp_async_wait_all()
    return wait_oldest


@functools.cache
def ring_function(cfg: MmaConfig):
    """The K loop every kernel on this tile shape shares (the linear below, the grouped expert
    kernel of moe_mma.py): ``run_ring(acc, av, bv, smem, x16, xrow, w16, wrow, k_begin, k_end,
    arow, brow, tid)`` adds the block's products over [k_begin, k_end) to ``acc``.

    Both operands are bf16 bits that go global -> shared by ``cp.async`` (16 bytes = 8 bf16),
    through a ring of ``stages`` buffers in dynamic shared memory (the x ring, then the weight
    ring), ``stages - 1`` stages in flight (wgmma: ``stages - 2``, the buffer of the stage
    before being still read by its asynchronous products), one barrier per stage.  Rows come
    from per-thread tables fixed for the whole loop: ``xrow[u]`` / ``wrow[u]`` (int64) is the
    source row of this thread's u-th x / weight chunk of every stage (-1: zero fill), so a
    caller may gather rows (the MoE's tokens) or take them in order (the linear); run_ring
    turns them into its cursors in place (the comment above ``_copy_chunk``)."""
    BK, STAGES = cfg.bk, cfg.stages
    BM, BN, THREADS = cfg.bm, cfg.bn, cfg.threads
    A_STAGE, B_STAGE = BM * BK // 2, BN * BK // 2          # words per stage
    B_BASE = STAGES * A_STAGE                              # the weight ring after the x ring
    XC, WC = cfg.x_chunks, cfg.w_chunks                    # 16-byte chunks per thread, stage
    WGMMA = cfg.wgmma
    AHEAD = STAGES - 2 if WGMMA else STAGES - 1            # stages staged ahead of the mma
    PENDING = AHEAD - 1                                    # groups left in flight by the wait
    PER_ROW = BK // 8                                      # chunks per tile row and stage
    STEP = ELEM * BK                                       # a cursor's advance per stage
    ROW_STEP = THREADS // PER_ROW * WORDS                  # words from chunk u to u + 1
    SAME_SWIZZLE = (THREADS // PER_ROW) % 8 == 0           # ... when the swizzle repeats

    @inline_device_function
    def to_cursors(rows, arr, base, k0, n):
        """rows[u] (this thread's u-th chunk's row of arr, -1: zero-filled) -> in place, its
        global cursor at K position k0 (-1 stays -1)."""
        for u in range(n):
            if rows[u] >= 0:
                rows[u] = base + ELEM * (rows[u] * arr.shape[1] + k0)

    @inline_device_function
    def chunk_cursor(first, sbase, buf_words, u, tid, rows):
        """Shared cursor of this thread's chunk u in a ring buffer ``buf_words`` into the
        array of a tile of ``rows`` rows, ``first`` that of its chunk 0 in buffer 0.  Chunk u
        sits THREADS / PER_ROW rows further; when that is a multiple of 8 (every linear and
        MoE tile: 128 threads) the swizzle repeats and the cursor is a constant further,
        which ptxas folds into the copy; else (the simulator's one-warp tiles) the slot is
        computed."""
        if SAME_SWIZZLE:
            return first + WORD * (buf_words + u * ROW_STEP)
        return sbase + WORD * (buf_words + _w_stage_slot(tid + u * THREADS, rows, BK)[2])

    @inline_device_function
    def issue_stage(smem, xs, ws, sbase, buf, x16, xbase, xcur, w16, wbase, wcur, step, room,
                    tid):
        """cp.async this thread's x and weight chunks of stage ``step`` of the loop into ring
        buffer ``buf``; zero fill for rows -1 and past the slice end (``room``: K elements
        from this thread's stage-0 column to the end).  A zero-filled chunk reads nothing:
        it points at the array's start, never past its end.  ``xs`` / ``ws``: the shared
        cursors of the thread's first x / weight chunk in buffer 0 (``sbase``: the array's)."""
        ok_k = step * BK < room
        for u in range(XC):
            ok = ok_k and xcur[u] >= 0
            _copy_chunk(smem, chunk_cursor(xs, sbase, buf * A_STAGE, u, tid, BM), x16,
                        xcur[u] + step * STEP if ok else xbase, 16 if ok else 0)
        for u in range(WC):
            ok = ok_k and wcur[u] >= 0
            _copy_chunk(smem, chunk_cursor(ws, sbase + WORD * B_BASE, buf * B_STAGE, u, tid, BN),
                        w16, wcur[u] + step * STEP if ok else wbase, 16 if ok else 0)

    wait_oldest = ring_wait(PENDING)
    compute = stage_compute(cfg)

    @inline_device_function
    def run_ring(acc, av, bv, smem, x16, xrow, w16, wrow, k_begin, k_end, arow, brow, tid):
        n_stages = (k_end - k_begin + BK - 1) // BK
        # every chunk of a thread sits at the same column of its stage (THREADS % PER_ROW
        # == 0, MmaConfig checks), so one bound serves them all
        kk = 8 * (tid % PER_ROW)
        room = k_end - k_begin - kk
        sbase, xbase, wbase = _shared_base(smem), _array_base(x16), _array_base(w16)
        if WGMMA:   # the tiles 512-byte aligned (MmaConfig.smem_bytes has the room)
            sbase = (sbase + 511) & ~511
        to_cursors(xrow, x16, xbase, k_begin + kk, XC)
        to_cursors(wrow, w16, wbase, k_begin + kk, WC)
        xs = sbase + WORD * _w_stage_slot(tid, BM, BK)[2]
        ws = sbase + WORD * (B_BASE + _w_stage_slot(tid, BN, BK)[2])
        # stage i lives in buffer i % STAGES; AHEAD stages fly ahead of the mma, one commit
        # group per stage (empty past the slice end, so the wait counts hold)
        for i in range(AHEAD):
            if i < n_stages:
                issue_stage(smem, xs, ws, sbase, i, x16, xbase, xrow, w16, wbase, wrow, i, room,
                            tid)
            cp_async_commit()
        buf = 0
        ahead_buf = AHEAD                    # = (i + AHEAD) % STAGES, without the modulo
        for i in range(n_stages):
            wait_oldest()
            if WGMMA:   # this thread's landed copies, before wgmma's (async proxy) reads
                fence_proxy_async()
            # one barrier per stage: stage i is visible to every warp, and every warp is done
            # with the buffer the copies issued next overwrite: stage i - 1's (mma.sync), or
            # stage i - 2's (wgmma: each warpgroup waited for that group after issuing i - 1)
            block_sync()
            ahead = i + AHEAD
            if ahead < n_stages:
                issue_stage(smem, xs, ws, sbase, ahead_buf, x16, xbase, xrow, w16, wbase, wrow,
                            ahead, room, tid)
            cp_async_commit()
            compute(acc, av, bv, smem, sbase, buf * A_STAGE, B_BASE + buf * B_STAGE, arow, brow,
                    tid)
            buf = buf + 1 if buf + 1 < STAGES else 0
            ahead_buf = ahead_buf + 1 if ahead_buf + 1 < STAGES else 0
        cp_async_wait_all()                              # no copy outlives the block
        if WGMMA:
            wgmma_wait_all()                             # acc holds every stage's products

    return run_ring


@functools.cache
def accumulator_origin(cfg: MmaConfig):
    """``origin(warp, wm_i) -> (row, col)``: the block-tile position of the warp's first
    accumulator tile; its (i, j) tile of :attr:`MmaConfig.frag_tiles` lies 16 i rows and 8 j
    columns further.  mma.sync: warp (wm_i, wn_i) owns tm m16 by tn n8 tiles; wgmma: warp q
    of warpgroup w owns rows 64 w + 16 q .. + 15 by all BN columns."""
    WM, TM, TN, WGMMA = cfg.wm, cfg.tm, cfg.tn, cfg.wgmma

    @inline_device_function
    def origin(warp, wm_i):
        if WGMMA:
            return 64 * (warp >> 2) + 16 * (warp & 3), 0
        return wm_i * (16 * TM), (warp // WM) * (8 * TN)
    return origin


def mma_kernel(cfg: MmaConfig):
    """The kernel for a tile shape (the K slice count is a launch argument)."""
    return _mma_kernel_for(dataclasses.replace(cfg, splits=1))


@kernel_factory
def _mma_kernel_for(cfg: MmaConfig):
    """Under the simulator the kernel builds and runs up to its first mma, which raises
    NotImplementedError (gpu/tensorcore.py); tests/test_layers_mma.py swaps in a warp-level
    emulation of the mma there to run the whole kernel on tiny shapes."""
    from numba import float32, int64, uint32

    WM, TM, TN, BK = cfg.wm, cfg.tm, cfg.tn, cfg.bk
    BM, BN, THREADS = cfg.bm, cfg.bn, cfg.threads
    run_ring = ring_function(cfg)
    XC, WC = cfg.x_chunks, cfg.w_chunks
    FTM, FTN = cfg.frag_tiles
    NACC, NAV, NBV = 4 * FTM * FTN, 4 * TM, 2 * TN        # accumulators, one k16 step's A, B
    WGMMA = cfg.wgmma
    FOLD = cfg.slices_in_block
    origin = accumulator_origin(cfg)
    ZERO = float32(0.0)
    ALIGN = None if SIMULATOR else 16                      # the simulator rejects alignment

    @inline_device_function
    def slice_products(acc, av, bv, smem, x16, w16, xrow, wrow, m0, n0, h, s, splits,
                       kc_total, k_total, m_total, n_total, heads, w_head_rows, w_off, arow,
                       brow, tid):
        """acc = the block tile's products over K slice s (whole SLICE_UNITs) from zero."""
        if WGMMA:
            u_begin, _ = divmod_u32(s * kc_total, splits)
            u_end, _ = divmod_u32((s + 1) * kc_total, splits)
        else:
            u_begin = s * kc_total // splits
            u_end = (s + 1) * kc_total // splits
        k_begin = SLICE_UNIT * u_begin                   # whole 64-element units
        k_end = min(SLICE_UNIT * u_end, k_total)
        for u in range(XC):
            row, kk, off = _w_stage_slot(tid + u * THREADS, BM, BK)
            xrow[u] = (m0 + row) * heads + h if m0 + row < m_total else -1
        for u in range(WC):
            row, kk, off = _w_stage_slot(tid + u * THREADS, BN, BK)
            wrow[u] = h * w_head_rows + w_off + n0 + row if n0 + row < n_total else -1
        for i in range(NACC):
            acc[i] = ZERO
        run_ring(acc, av, bv, smem, x16, xrow, w16, wrow, k_begin, k_end, arow, brow, tid)

    # inlined in numba's IR (as skinny.make_skinny_block): both kernels below compile as if
    # the body were their own (the plain kernel's PTX is what it was before the split)
    @device_function(inline="always")
    def block_tile(x16, w16, out, m_total, n_total, k_total, n_mtiles, splits, kc_total,
                   heads, w_head_rows, w_off):
        """out[(s * m_total + m) * heads + h, n] = slice s of sum_k x16[m * heads + h, k]
        w16[h * w_head_rows + w_off + n, k] (bf16 bits; out = y when splits == 1): for each
        head h = blockIdx.y one product, a plain linear when heads = 1 (w_head_rows = w_off =
        0).  Grid.x: M tile fastest, then K slice, then N tile.  ``slices_in_block``: no K
        slice in the grid; each block runs all ``splits`` and writes y.  Dynamic shared
        memory: ring_function's two rings.  Returns the block's (M tile, N tile)."""
        smem = cuda.shared.array(0, uint32, alignment=ALIGN)
        acc = cuda.local.array(NACC, float32)
        av = cuda.local.array(NAV, uint32)
        bv = cuda.local.array(NBV, uint32)
        xrow = cuda.local.array(XC, int64)   # row tables, then run_ring's cursors
        wrow = cuda.local.array(WC, int64)   # row tables, then run_ring's cursors
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        wm_i = warp % WM
        arow = wm_i * (16 * TM) + (lane >> 2)            # the lane's A row g in the block tile
        brow = (warp // WM) * (8 * TN) + (lane >> 2)     # the lane's weight row g
        bid, h = cuda.blockIdx.x, cuda.blockIdx.y
        if WGMMA:   # 32-bit divisions: a 64-bit one is a call, and a call serializes wgmma
            rest, mt_i = divmod_u32(bid, n_mtiles)
            n_i, s = divmod_u32(rest, 1 if FOLD else splits)
        else:
            mt_i = bid % n_mtiles
            rest = bid // n_mtiles
            s = 0 if FOLD else rest % splits
            n_i = rest if FOLD else rest // splits
        m0 = mt_i * BM
        n0 = n_i * BN
        if FOLD:    # every slice here, each from zero, added in slice order as sum_splits does
            total = cuda.local.array(NACC, float32)
            for s in range(splits):
                slice_products(acc, av, bv, smem, x16, w16, xrow, wrow, m0, n0, h, s, splits,
                               kc_total, k_total, m_total, n_total, heads, w_head_rows, w_off,
                               arow, brow, tid)
                for i in range(NACC):
                    total[i] = acc[i] if s == 0 else total[i] + acc[i]
                block_sync()   # every warp is done with the ring before the next prologue
            for i in range(NACC):
                acc[i] = total[i]
            s = 0
        else:
            slice_products(acc, av, bv, smem, x16, w16, xrow, wrow, m0, n0, h, s, splits,
                           kc_total, k_total, m_total, n_total, heads, w_head_rows, w_off,
                           arow, brow, tid)

        orow = s * m_total
        row0, col0 = origin(warp, wm_i)
        for i in range(FTM):
            for j in range(FTN):
                for e in range(4):
                    r, c = _c_position(lane, e)
                    row = m0 + row0 + 16 * i + r
                    col = n0 + col0 + 8 * j + c
                    if row < m_total and col < n_total:
                        store_nowrap_2d(out, (orow + row) * heads + h, col,
                                        acc[4 * (i * FTN + j) + e])
        return mt_i, n_i

    options = {"max_registers": cfg.max_registers} if cfg.max_registers else {}
    if not cfg.sums_in_last:
        @kernel(**options)
        def mma_linear_kernel(x16, w16, out, m_total, n_total, k_total, n_mtiles, splits,
                              kc_total, heads, w_head_rows, w_off):
            """:func:`block_tile` at every block."""
            block_tile(x16, w16, out, m_total, n_total, k_total, n_mtiles, splits, kc_total,
                       heads, w_head_rows, w_off)
        return mma_linear_kernel
    sum_when_last = make_sum_when_last(BM, BN, THREADS)

    @kernel(**options)
    def mma_linear_sums(x16, w16, out, m_total, n_total, k_total, n_mtiles, splits, kc_total,
                        heads, w_head_rows, w_off, y, counters):
        """:func:`block_tile` into the K slices' partial sums ``out``, then the last of an
        output tile's slice blocks adds its slices into ``y`` (``sums_in_last``)."""
        mt_i, n_i = block_tile(x16, w16, out, m_total, n_total, k_total, n_mtiles, splits,
                               kc_total, heads, w_head_rows, w_off)
        sum_when_last(out, y, counters, n_i * n_mtiles + mt_i, mt_i * BM, n_i * BN, splits,
                      m_total, n_total, heads, cuda.blockIdx.y)
    return mma_linear_sums


def make_sum_when_last(bm: int, bn: int, threads: int):
    """``sum_when_last(part, y, counters, tile, m0, n0, splits, m_total, n_total, heads, h)``,
    called by every thread of a K slice's block after it wrote its partial sums of output
    tile ``tile`` (rows m0 .. m0 + bm - 1, columns n0 .. n0 + bn - 1, head h) into ``part``
    [splits * m_total * heads, n]: the block fences them and counts itself in
    counters[tile]; the tile's last slice block adds the ``splits`` partial sums in slice
    order -- :func:`~kdtree_numba.layers.common.sum_splits`' expression, so its bits --
    into ``y`` [m_total * heads, n] and sets the counter back to 0 for the next call (or a
    CUDA graph's next replay): no sum launch."""
    @device_function(inline="always")
    def sum_when_last(part, y, counters, tile, m0, n0, splits, m_total, n_total, heads, h):
        t = cuda.threadIdx.x
        at = tile * heads + h
        if last_to_arrive(counters, at, splits):
            for i in range(t, bm * bn, threads):
                r = i // bn
                row = m0 + r
                col = n0 + i - r * bn
                if row < m_total and col < n_total:
                    total = load_l2_f32(part, (row * heads + h, col))
                    for s in range(1, splits):
                        total += load_l2_f32(part, ((s * m_total + row) * heads + h, col))
                    y[row * heads + h, col] = total
            if t == 0:
                counters[at] = 0
    return sum_when_last


@kernel
def _round_to_bf16_pairs(x, out):
    """out[i] = the bf16 pair (x[2i], x[2i + 1]) rounded to nearest even, x flat float32."""
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = pack_bf16x2(x[2 * i], x[2 * i + 1])


def round_to_bf16(xd, workspace, name, stream=0):
    """bf16 bits [M, K] (uint16, workspace buffer ``name``) of float32 xd [M, K], K even, by
    one launch: the kernels then stream x by cp.async like the weights (M K 6 bytes of
    traffic, small beside the weights)."""
    m, k = xd.shape
    x16 = workspace_buffer(workspace, name, (m, k), np.uint16, stream)
    round_into(xd, x16, stream)
    return x16


def round_into(xd, x16, stream=0):
    """x16[:M] = the bf16 bits of float32 xd [M, K] (x16 uint16 [>= M, K], C-contiguous)."""
    m, k = xd.shape
    pairs = x16.reshape(x16.shape[0] * k)[:m * k].view(np.uint32)
    grid, block = launch_1d(m * k // 2, 256)
    _round_to_bf16_pairs[grid, block, stream](xd.reshape(m * k), pairs)


def _launch(x16, wd, target, m, n, k, cfg: MmaConfig, splits, stream, heads=1, w_head_rows=0,
            w_off=0, sums=()):
    """One launch of :func:`mma_kernel` (cfg) over bf16 x16 rows: ``splits`` K slices into
    ``target`` [splits * M * heads, N] (or summed in the block into [M * heads, N]:
    ``cfg.slices_in_block``; ``cfg.sums_in_last``: ``sums`` = (y, counters), the last slice
    block of each tile adds them into y); heads > 1 as :func:`mma_head_products`
    describes."""
    n_mtiles = -(-m // cfg.bm)
    blocks = n_mtiles * (1 if cfg.slices_in_block else splits) * -(-n // cfg.bn)
    dispatcher = mma_kernel(cfg)
    args = (x16, wd, target, m, n, k, n_mtiles, splits, -(-k // SLICE_UNIT), heads,
            w_head_rows, w_off) + tuple(sums)
    allow_large_shared_memory(dispatcher, args, cfg.smem_bytes)
    dispatcher[(blocks, heads), cfg.threads, stream, cfg.smem_bytes](*args)


# M x N tiles from which a warpgroup tile's blocks add their own K slices (the same bits): the
# partial sums (8 S M N bytes) then never go through memory and there is no sum launch, but a
# block runs all of K.  Measured on every sliced Kimi-K2 shape at M = 128 / 256 / 512 (runs
# 200-201, docs/LAYERS.md): from 64 tiles the fold was faster every time (1.16-2.0x); at 17-34
# tiles slower (the blocks too few to stream the weights); at 56 it went either way
FOLD_MIN_TILES = 64
# ... by tiles of up to two warpgroups: folded, a thread holds two accumulator sets (a slice's
# and the sum: 179 registers at four warpgroups of 64 x 128, 92 unfolded), which 512 threads
# cannot have (64 K registers an SM; a cap of 128 spills 312 bytes: a bench variant only)
FOLD_MAX_THREADS = 256


def folds_slices(cfg: MmaConfig, m: int, n: int, splits: int) -> bool:
    """Whether :func:`mma_linear` has ``cfg``'s blocks add their own ``splits`` K slices at M
    = ``m``, N = ``n``: a warpgroup tile of at most :data:`FOLD_MAX_THREADS` threads whose M x N
    tiles number :data:`FOLD_MIN_TILES` or more."""
    a_rows, b_rows = (n, m) if cfg.swap_ab else (m, n)    # the tiles' A and B operands
    return (splits > 1 and cfg.wgmma and cfg.threads <= FOLD_MAX_THREADS
            and not (cfg.tma and cfg.bn > 128)        # TMA's 128 x 256: no registers for it
            and -(-a_rows // cfg.bm) * -(-b_rows // cfg.bn) >= FOLD_MIN_TILES)


def slice_plan(cfg: MmaConfig, m: int, n: int, k: int):
    """(splits, in_block, in_memory) of a linear on ``cfg``: its K slices (at most K's units),
    whether its blocks add them (cfg asks, or :func:`folds_slices`), and whether their partial
    sums go through memory instead (:func:`partial_sums`)."""
    splits = max(1, min(cfg.splits, -(-k // SLICE_UNIT)))
    in_block = cfg.slices_in_block or folds_slices(cfg, m, n, splits)
    return splits, in_block, splits > 1 and not in_block


def partial_sums(y, splits: int, in_memory: bool, workspace, stream):
    """Where a linear's kernel writes: y, or with ``in_memory`` the [splits * M, N] partial
    sums (workspace buffer "linear.mma_part") that :func:`add_splits` then adds into y."""
    if not in_memory:
        return y
    m, n = y.shape
    return workspace_buffer(workspace, "linear.mma_part", (splits, m, n), np.float32,
                            stream).reshape(splits * m, n)


def mma_linear(xd, wd, y, cfg: MmaConfig, stream=0, workspace=None):
    """Launch: y [M, N] = bf16(xd [M, K]) wd^T, wd the uint16 bf16 bits [N, K] (checked by
    linear()).  x is rounded to bf16 once (:func:`round_to_bf16`), so both operands stream by
    cp.async; K slices go to a workspace buffer and are added in order (by a sum launch, or
    with ``KDTREE_MMA_SUMS_IN_LAST`` / ``cfg.sums_in_last`` by each tile's last slice block),
    or where :func:`folds_slices` each block adds its slices itself (``slices_in_block``: the
    same bits, no partial sums in memory)."""
    (m, k), n = xd.shape, wd.shape[0]
    splits, in_block, in_memory = slice_plan(cfg, m, n, k)
    x16 = round_to_bf16(xd, workspace, "linear.mma_x16", stream)
    # the last slice block sums where asked and the partial sums go through memory
    last = in_memory and (cfg.sums_in_last or runtime.current().mma_sums_in_last)
    if (in_block, last) != (cfg.slices_in_block, cfg.sums_in_last):
        cfg = dataclasses.replace(cfg, slices_in_block=in_block, sums_in_last=last)
    target = partial_sums(y, splits, in_memory, workspace, stream)
    if last:
        tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
        counters = arrival_counters("linear.mma", tiles, stream)
        _launch(x16, wd, target, m, n, k, cfg, splits, stream, sums=(y, counters))
        return
    _launch(x16, wd, target, m, n, k, cfg, splits, stream)
    if in_memory:
        add_splits(target.reshape(splits, m, n), y, stream)


def mma_head_products(xd, heads, wd, w_head_rows, w_off, y, stream=0, workspace=None,
                      config=None):
    """One bf16 tensor-core product per head, in one launch (absorbed MLA's W_UK and W_UV):
    ``y[m, h] = bf16(xd[m, h]) w_h^T`` with ``w_h = wd[h * w_head_rows + w_off :][:N]``, for
    xd [M, heads, K] float32, wd the uint16 bf16 bits [rows, K], y [M, heads, N] float32 (all
    C-contiguous; K % 8 == 0).  The tile is :func:`unsliced_tile` (M), no K slices (K is a
    head's width, a few stages), so as in the linear a row's bits do not depend on M.
    ``config``: another tile (tests; its K slices are ignored)."""
    m, _, k = xd.shape
    n = y.shape[2]
    x16 = round_to_bf16(xd.reshape(m * heads, k), workspace, "heads.mma_x16", stream)
    cfg = unsliced_tile(m) if config is None else dataclasses.replace(config, sums_in_last=False)
    _launch(x16, wd, y.reshape(m * heads, n), m, n, k, cfg, 1, stream, heads, w_head_rows,
            w_off)

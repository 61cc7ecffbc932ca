"""The grouped W4A16 MoE on bf16 tensor cores: ``moe_ffn(..., method="mma")`` with int4-group
routed experts (:class:`~kdtree_numba.layers.workspace.Int4Experts`), the weights kept packed
from the checkpoint to the kernel.

Two launches cover the routed experts, as in layers/moe_mma.py (gate_up with the SwiGLU
epilogue writing ``act`` as bf16, then down into ``y_slot``), over the same device-built
grouping and, with ``KDTREE_MOE_WORK_LIST=1``, its work list; moe.py then runs the bf16 shared
expert through moe_mma.py's kernel (its rows of the same buffers) and the ordered combine.
What differs is the weight operand: each K stage stages, by ``cp.async`` through a ring of
``stages`` shared buffers beside bf16 x, the expert's packed words (a 32-weight row chunk is 16
bytes, a quarter of bf16's) and its group scales (loaded one stage ahead into registers and
stored to shared memory as float32 after the stage's products, which hide their latency), and
the warps unpack the words into bf16 B fragments in registers just before the ``mma``.

**The k order within a 32-weight chunk** (a *panel*: one 16-byte row chunk, one group of 32 or
part of a larger group).  The mma sums 16 k slots; the kernel gives lane (g, t) of a warp, in
both k16 steps of a panel, exactly the 8 weights of word t of weight row g (nibbles 0-7, k = 8t
.. 8t + 7): step s takes nibbles 4s, 4s + 1 as its ``b0`` and 4s + 2, 4s + 3 as ``b1``, and the
A fragment the same k of x: x chunk t of the panel row, read by one 16-byte shared load per row
(g and g + 8), words 2s and 2s + 1.  A k permutation applied to both operands leaves the
product the same, and a lane then unpacks a whole word of its own (one 32-bit shared load) with
no byte gather: byte i of the word is the bf16 pair of register i (``gpu/bits.py``:
``int4_pair{i}_bf16``: PRMT, LOP3, one bf16x2 FMA; exact).

**Dequantisation is the reference's, exactly**: B holds q (exact in bf16), the mma chain of a
group's panels starts from zero, and its fp32 result is multiplied by the group's scale and
added to the output's accumulator (``acc += s * sum_group x q``; the CUDA-core W4A16 kernels do
the same per 8 weights).  No bf16 rounding of ``q * scale`` (11 significant bits, not bf16's 8)
happens anywhere, so the only rounding of an operand is x's (and act's), as on the bf16 path:
the grouped MoE's bound holds as it is (docs/LAYERS.md, "W4A16 on tensor cores").  Groups are
whole panels (group size % 32 == 0: Kimi-K2's is 32) and K a multiple of the group size (the
format); a group may span stages (its partial chain lives in registers).

Batch invariance: every output is the same chain in the same order in every tile (panels in
K order, groups in order, no K slices), so a row's bits do not depend on its batch.
Design and status: docs/LAYERS.md, "W4A16 on tensor cores".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory
from kdtree_numba.gpu.bits import (bits_to_f32, int4_pair0_bf16, int4_pair1_bf16,
                                   int4_pair2_bf16, int4_pair3_bf16)
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (MAX_SHARED_BYTES, allow_large_shared_memory, block_sync,
                                     cp_async_commit, cp_async_wait_all, ld_shared_word,
                                     ld_shared_words2, ld_shared_words4)
from kdtree_numba.gpu.tensorcore import mma_bf16_m16n8k16
from kdtree_numba.layers.mma import (ELEM, WORD, array_base, copy_chunk, ring_wait,
                                     shared_base, w_stage_slot)
from kdtree_numba.layers.mma_plan import WarpTiles
from kdtree_numba.layers.moe_mma import expert_tile_io, routed_tile_bound

__all__ = ["Int4MmaConfig", "int4_mma_config", "int4_mma_kernel", "grouped_int4_mma",
           "int4_mma_group_ok", "PANEL_WEIGHTS"]

PANEL_WEIGHTS = 32        # weights of a panel: one 16-byte chunk of a packed row, two k16 steps

_w_stage_slot = inline_device_function(w_stage_slot)

if SIMULATOR:
    from kdtree_numba.gpu.memory import cp_async16
    W_ELEM = 1                  # the simulator's cursors count words

    def _copy_words(smem, scursor, arr, cursor, nbytes):
        """Simulator twin of the cp.async of 4 packed words at flat word ``cursor`` of the 2-d
        ``arr`` into smem[scursor:+4] (zeros when nbytes == 0)."""
        cp_async16(smem, scursor, arr, divmod(cursor, arr.shape[1]), nbytes)
else:
    W_ELEM = 4                  # bytes per packed word
    _copy_words = copy_chunk    # 16 bytes between two addresses, whatever they hold


def int4_mma_group_ok(group_size: int) -> bool:
    """Whether the kernel takes this group size: whole panels (a multiple of 32)."""
    return group_size > 0 and group_size % PANEL_WEIGHTS == 0


@dataclass(frozen=True)
class Int4MmaConfig(WarpTiles):
    """Tile shape: ``wm`` x ``wn`` warps of ``tm`` m16 by ``tn`` n8 tiles (BM = 16 wm tm,
    BN = 8 wn tn, tn even: gate and up halves), K stages of ``bk`` (whole panels of 32) in a
    ring of ``stages`` buffers of bf16 x [BM, bk], packed words [BN, bk / 8] and float32
    scales [BN, bk / 32] (one per panel and row).  Every thread stages whole 16-byte x and
    word chunks and as many scales as word chunks, each at one column of a stage.
    ``skip_dead_rows``: the x rows of a tile past its expert's tokens (15 of 16 at one token
    an expert: a verify's rows over Kimi-K2's 384 experts) are zeroed once in every ring
    buffer and never copied again, where the ring issues a zero-fill ``cp.async`` for each
    of them every stage: fewer copies to issue, the same bits (A row i reaches only C row
    i, and a dead row's C row is never stored; the zeros keep stale bits out anyway)."""
    wm: int = 1
    wn: int = 4
    tm: int = 1
    tn: int = 2
    bk: int = 256
    stages: int = 4
    skip_dead_rows: bool = False

    @property
    def panels(self) -> int:
        return self.bk // PANEL_WEIGHTS

    @property
    def stage_words(self) -> tuple:
        """uint32 words of one stage's x, packed weights and scales."""
        return self.bm * self.bk // 2, self.bn * self.bk // 8, self.bn * self.panels

    @property
    def smem_bytes(self) -> int:
        return 4 * self.stages * sum(self.stage_words)

    @property
    def x_chunks(self) -> int:
        return self.bm * self.bk // 8 // self.threads

    @property
    def w_chunks(self) -> int:
        """16-byte word chunks (= scales) each thread stages per stage."""
        return self.bn * self.panels // self.threads

    def __post_init__(self):
        if (min(self.wm, self.wn, self.tm, self.tn) < 1 or self.tn % 2 or self.bk <= 0
                or self.bk % PANEL_WEIGHTS or self.threads > 1024 or not 2 <= self.stages <= 6
                or self.smem_bytes > MAX_SHARED_BYTES
                or (self.bm * self.bk // 8) % self.threads or self.threads % (self.bk // 8)
                or (self.bn * self.panels) % self.threads or self.threads % self.panels):
            raise ValueError(f"bad Int4MmaConfig {self}: tn even, bk % 32, <= 1024 threads, "
                             f"2-6 stages, <= 227 KiB shared memory, whole chunks per "
                             f"thread, each thread's chunks at one column of a stage")


def int4_mma_config(m: int, top_k: int, n_experts: int) -> Int4MmaConfig:
    """The tile for both launches by the mean tokens per active expert, Mk / min(E, Mk)
    (moe_mma_config's measure): up to 16 (a verify's rows over Kimi-K2's 384 experts: 1-2
    each) 16 x 64 in 4 stages of 128.  Why stages of 128: at one or two tokens an expert the
    kernel streams weights, and what it needs is many bytes in flight per SM; a stage of 128
    is each weight row's 64 bytes (4 KiB of words, 4 KiB of x, 1 KiB of scales: 36 KiB a
    block in 4 stages), so 6 blocks share an SM where stages of 256 (72 KiB) left 3, with
    the same 3 stages of copies in flight per block: twice the bytes in flight per SM.  H100
    run 152 (tools/bench_layers.py --only int4) measured it the fastest of the four tiles
    in all four rows (33 and 65 rows, router and uniform routings: 0.37-0.52 of the bytes
    roof, stages of 256 0.24-0.42).  32 rows in 3 stages of 256; 48 / 64 rows in 4 of 128
    (not yet measured).  Every tile gives the same bits (module docstring).  The simulator:
    one warp, stages of 64."""
    if SIMULATOR:
        return Int4MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=64, stages=3)
    per = -(-m * top_k // max(1, min(n_experts, m * top_k)))
    tm = min(4, max(1, -(-per // 16)))
    if tm == 1:
        return Int4MmaConfig(bk=128, stages=4)
    if tm == 2:
        return Int4MmaConfig(tm=2, bk=256, stages=3)
    return Int4MmaConfig(tm=tm, bk=128, stages=4)


@kernel_factory
def int4_mma_kernel(cfg: Int4MmaConfig, gate_up: bool, work_list: bool = False,
                    group: int = 32):
    """The grouped W4A16 kernel for a tile shape and group size, over the full (expert, M
    tile, N tile) grid or the work list.  Under the simulator it runs up to its first mma
    (the tests emulate the warp's mma by patching ``mma_bf16_m16n8k16`` here)."""
    from numba import float32, int64, uint32

    if not int4_mma_group_ok(group):
        raise ValueError(f"the W4A16 tensor-core kernel takes group sizes that are multiples "
                         f"of {PANEL_WEIGHTS}, not {group}")
    WM, TM, TN, BK, STAGES = cfg.wm, cfg.tm, cfg.tn, cfg.bk, cfg.stages
    BM, BN, THREADS = cfg.bm, cfg.bn, cfg.threads
    P = cfg.panels
    PER_ROW = BK // 8                                      # x chunks per tile row and stage
    XC, WC = cfg.x_chunks, cfg.w_chunks
    NACC, NAV = 4 * TM * TN, 8 * TM                        # accumulators, A words
    COLS = BN // 2 if gate_up else BN
    A_STAGE, B_STAGE, S_STAGE = cfg.stage_words
    B_BASE = STAGES * A_STAGE
    S_BASE = B_BASE + STAGES * B_STAGE
    AHEAD = STAGES - 1
    X_STEP, W_STEP = ELEM * BK, W_ELEM * (BK // 8)         # cursor advances per stage
    GROUP = group
    ZERO = float32(0.0)
    ALIGN = None if SIMULATOR else 16
    SKIP_DEAD = cfg.skip_dead_rows
    weight_row, store_tile = expert_tile_io(TM, TN, gate_up)
    wait_oldest = ring_wait(STAGES - 2)                    # STAGES - 1 stages in flight

    @inline_device_function
    def issue(smem, sbase, buf, x16, xbase, xcur, xsm, w, wbase, wcur, wsm, step, room_x,
              room_w):
        """cp.async this thread's x and word chunks of stage ``step`` into ring buffer
        ``buf`` (zero fill past K and for rows -1, reading nothing)."""
        ok_x = step * BK < room_x
        for u in range(XC):
            ok = ok_x and xcur[u] >= 0
            if not SKIP_DEAD or xcur[u] >= 0:       # (skip_dead_rows: zeroed once)
                copy_chunk(smem, sbase + WORD * (buf * A_STAGE + xsm[u]), x16,
                           xcur[u] + step * X_STEP if ok else xbase, 16 if ok else 0)
        ok_w = step * BK < room_w
        for u in range(WC):
            ok = ok_w and wcur[u] >= 0
            _copy_words(smem, sbase + WORD * (B_BASE + buf * B_STAGE + 4 * wsm[u]), w,
                        wcur[u] + step * W_STEP if ok else wbase, 16 if ok else 0)

    @inline_device_function
    def load_scales(sraw, s2, wrow, step, kw, room_w):
        """This thread's scales of stage ``step`` (bf16 bits; 0 past K and for rows -1)."""
        ok_w = step * BK < room_w
        for u in range(WC):
            sraw[u] = uint32(0)
            if ok_w and wrow[u] >= 0:
                sraw[u] = uint32(s2[wrow[u], (step * BK + kw) // GROUP])

    @inline_device_function
    def store_scales(smem, sraw, wsm, buf):
        for u in range(WC):             # float32 bits: a bf16's are its upper half
            smem[S_BASE + buf * S_STAGE + wsm[u]] = sraw[u] << uint32(16)

    @inline_device_function
    def fold_group(acc, tmp, smem, s_at, ocol, t):
        """acc += tmp times its column's scale (C columns 2t, 2t + 1 of each n8 tile): the
        end of a group, whose scales (float32 bits) start at word ``s_at`` of the stage."""
        for j in range(TN):
            s = ld_shared_words2(smem, s_at + ocol + 8 * j + 2 * t, 0)
            s0 = bits_to_f32(s[0])
            s1 = bits_to_f32(s[1])
            for i in range(TM):
                o = 4 * (i * TN + j)
                acc[o] += tmp[o] * s0
                acc[o + 1] += tmp[o + 1] * s1
                acc[o + 2] += tmp[o + 2] * s0
                acc[o + 3] += tmp[o + 3] * s1

    @inline_device_function
    def compute(acc, tmp, av, smem, buf, k0, k_end, arow, brow, tid):
        """The stage's panels below K: per panel the A fragments of the warp's m16 tiles (two
        16-byte loads each), per n8 tile one packed word unpacked into both k16 steps' B
        fragments, 2 tm mma into the group's chain ``tmp``; at a group's end its scale."""
        lane = tid & 31
        t = lane & 3
        ocol = brow - (lane >> 2)                  # the warp's first n8 tile's first row
        for p in range(P):
            kp = k0 + PANEL_WEIGHTS * p
            if kp < k_end:
                for i in range(TM):
                    row = arow + 16 * i
                    at = buf * A_STAGE + (p * BM + row) * 16 + 4 * (t ^ ((row >> 1) & 3))
                    lo = ld_shared_words4(smem, at, 0)
                    hi = ld_shared_words4(smem, at, 8 * 16)      # row g + 8: same swizzle
                    for c in range(4):
                        av[8 * i + c] = lo[c]
                        av[8 * i + 4 + c] = hi[c]
                fresh = GROUP == PANEL_WEIGHTS or kp % GROUP == 0
                for j in range(TN):
                    word = ld_shared_word(smem, B_BASE + buf * B_STAGE
                                         + (p * BN + brow + 8 * j) * 4 + t, 0)[0]
                    shifted = word >> uint32(4)
                    b0 = int4_pair0_bf16(word, shifted)
                    b1 = int4_pair1_bf16(word, shifted)
                    b2 = int4_pair2_bf16(word, shifted)
                    b3 = int4_pair3_bf16(word, shifted)
                    for i in range(TM):
                        o = 4 * (i * TN + j)
                        c0, c1, c2, c3 = ZERO, ZERO, ZERO, ZERO
                        if not fresh:
                            c0, c1, c2, c3 = tmp[o], tmp[o + 1], tmp[o + 2], tmp[o + 3]
                        c0, c1, c2, c3 = mma_bf16_m16n8k16(
                            av[8 * i], av[8 * i + 4], av[8 * i + 1], av[8 * i + 5], b0, b1,
                            c0, c1, c2, c3)
                        tmp[o], tmp[o + 1], tmp[o + 2], tmp[o + 3] = mma_bf16_m16n8k16(
                            av[8 * i + 2], av[8 * i + 6], av[8 * i + 3], av[8 * i + 7], b2, b3,
                            c0, c1, c2, c3)
                if GROUP == PANEL_WEIGHTS or (kp + PANEL_WEIGHTS) % GROUP == 0:
                    fold_group(acc, tmp, smem, S_BASE + buf * S_STAGE + p * BN, ocol, t)

    @inline_device_function
    def run_ring(acc, tmp, av, smem, x16, xcur, xsm, w, s2, wcur, wsm, wrow, sraw, k_end,
                 arow, brow, tid):
        """acc = the block's W4A16 products over [0, k_end): the ring of ``STAGES`` buffers,
        ``STAGES - 1`` stages of copies in flight, one barrier per stage; a stage's scales
        are loaded when its copies are issued and stored after this stage's products."""
        n_stages = (k_end + BK - 1) // BK
        kk = 8 * (tid % PER_ROW)                  # the column of this thread's x chunks
        kw = PANEL_WEIGHTS * (tid % P)            # ... of its word chunks and scales
        room_x, room_w = k_end - kk, k_end - kw
        sbase, xbase, wbase = shared_base(smem), array_base(x16), array_base(w)
        for u in range(XC):
            if xcur[u] >= 0:
                xcur[u] = xbase + ELEM * (xcur[u] * x16.shape[1] + kk)
        for u in range(WC):
            wcur[u] = -1
            if wrow[u] >= 0:
                wcur[u] = wbase + W_ELEM * (wrow[u] * w.shape[1] + kw // 8)
        if SKIP_DEAD:     # a dead row's chunks in every buffer, once (the loop's first
            for u in range(XC):       # barrier orders these stores before any read)
                if xcur[u] < 0:
                    for b in range(STAGES):
                        for c in range(4):
                            smem[b * A_STAGE + xsm[u] + c] = uint32(0)
        for i in range(AHEAD):
            if i < n_stages:
                issue(smem, sbase, i, x16, xbase, xcur, xsm, w, wbase, wcur, wsm, i, room_x,
                      room_w)
                load_scales(sraw, s2, wrow, i, kw, room_w)
                store_scales(smem, sraw, wsm, i)
            cp_async_commit()
        buf = 0
        ahead_buf = AHEAD
        for i in range(n_stages):
            wait_oldest()
            # stage i (copies and scales) visible to every warp, every warp done with the
            # buffer the copies and scales issued next overwrite (stage i - 1's)
            block_sync()
            ahead = i + AHEAD
            if ahead < n_stages:
                issue(smem, sbase, ahead_buf, x16, xbase, xcur, xsm, w, wbase, wcur, wsm,
                      ahead, room_x, room_w)
                load_scales(sraw, s2, wrow, ahead, kw, room_w)
            cp_async_commit()
            compute(acc, tmp, av, smem, buf, i * BK, k_end, arow, brow, tid)
            if ahead < n_stages:
                store_scales(smem, sraw, wsm, ahead_buf)
            buf = buf + 1 if buf + 1 < STAGES else 0
            ahead_buf = ahead_buf + 1 if ahead_buf + 1 < STAGES else 0
        cp_async_wait_all()

    @kernel
    def grouped_int4_mma_kernel(x16, token_of_slot, offsets, active, n_active, tile_expert,
                                tile_row, n_tiles, w3, s3, out, max_active, n_out, k_in,
                                n_mtiles, n_ntiles):
        """gate_up: x16 = bf16(h) [M, D], w3 / s3 = gate_up's words [E, 2I, D/8] and scales
        [E, 2I, D/g], out = act as bf16 pairs [n_entries + M, >= I / 2] (uint32); down: x16 =
        act [n_entries + M, >= I] (bf16 bits), w3 / s3 = down's [E, D, I/8] / [E, D, I/g],
        out = y_slot [n_entries + M, D] float32.  Work list: ``max_active`` is its bound R and
        ``n_mtiles`` = R; else the tile arguments are placeholders."""
        bid = cuda.blockIdx.x
        mt_i = bid % n_mtiles
        rest = bid // n_mtiles
        nt = rest % n_ntiles
        a = rest // n_ntiles
        if work_list:
            if mt_i >= n_tiles[0]:
                return
            e = tile_expert[mt_i]
            m0 = tile_row[mt_i]
        else:
            if a >= n_active[0]:
                return
            e = active[a]
            m0 = mt_i * BM
        s_begin = offsets[e]
        count = offsets[e + 1] - s_begin
        col0 = nt * COLS
        if m0 >= count or col0 >= n_out:
            return
        w = w3[e]
        s2 = s3[e]

        smem = cuda.shared.array(0, uint32, alignment=ALIGN)
        acc = cuda.local.array(NACC, float32)
        tmp = cuda.local.array(NACC, float32)
        av = cuda.local.array(NAV, uint32)
        xcur = cuda.local.array(XC, int64)      # gathered x rows, then cursors
        xsm = cuda.local.array(XC, int64)       # their shared word offsets in a stage
        wcur = cuda.local.array(WC, int64)
        wsm = cuda.local.array(WC, int64)       # chunk u's (panel, tile row) slot
        wrow = cuda.local.array(WC, int64)      # its weight row (-1: none)
        sraw = cuda.local.array(WC, uint32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        wm_i = warp % WM
        wn_i = warp // WM
        arow = wm_i * (16 * TM) + (lane >> 2)
        brow = wn_i * (8 * TN) + (lane >> 2)
        for u in range(XC):            # the gathered x row of each staged chunk (fixed in K)
            row, kk, off = _w_stage_slot(tid + u * THREADS, BM, BK)
            xsm[u] = off
            xcur[u] = -1
            if m0 + row < count:
                xcur[u] = token_of_slot[s_begin + m0 + row] if gate_up else s_begin + m0 + row
        for u in range(WC):            # the weight row of each staged chunk
            c = tid + u * THREADS
            row = c // P
            wsm[u] = (c - row * P) * BN + row
            wrow[u] = weight_row(row, col0, n_out)
        for i in range(NACC):
            acc[i] = ZERO
        run_ring(acc, tmp, av, smem, x16, xcur, xsm, w, s2, wcur, wsm, wrow, sraw, k_in, arow,
                 brow, tid)

        store_tile(out, acc, lane, wm_i * (16 * TM), wn_i * (8 * TN), m0, col0, count, s_begin,
                   n_out)

    return grouped_int4_mma_kernel


def grouped_int4_mma(h16, lists, gate_up, down, act16, y_slot, max_active, cfg: Int4MmaConfig,
                     stream=0, tiles=None):
    """The two launches over the routed experts.  h16 = bf16(h) [M, D] (uint16); lists =
    (token_of_slot, offsets, active, n_active) of moe.py's grouping; ``tiles``: its work list
    (tile_expert, tile_row, n_tiles) of cfg.bm-row tiles, or None for the full grid; gate_up
    [E, 2I, D] and down [E, D, I] device Int4Experts; act16 [n_entries + M, >= I] uint16 and
    y_slot [n_entries + M, D] float32 (the routed slots' rows written; the shared expert's
    last M are moe_mma's).  Checks are moe_ffn's."""
    m = h16.shape[0]
    n_experts, two_i, d = gate_up.shape
    inter = two_i // 2
    n_entries = act16.shape[0] - m
    act_pairs = act16.view(np.uint32)
    # without a work list any int32 arrays stand for its three (never read)
    work = tiles or (lists[2], lists[2], lists[3])
    bound = routed_tile_bound(n_entries, n_experts, cfg.bm) if tiles else max_active
    for is_gate_up, x16, w, out, n_out, k_in in ((True, h16, gate_up, act_pairs, inter, d),
                                                 (False, act16, down, y_slot, d, inter)):
        n_ntiles = -(-n_out // (cfg.bn // 2 if is_gate_up else cfg.bn))
        n_mtiles = bound if tiles else -(-m // cfg.bm)
        blocks = n_mtiles * n_ntiles * (1 if tiles else max_active)
        if blocks == 0:
            continue
        dispatcher = int4_mma_kernel(cfg, is_gate_up, tiles is not None, w.group_size)
        args = (x16, *lists, *work, w.words, w.scale, out, bound, n_out, k_in, n_mtiles,
                n_ntiles)
        allow_large_shared_memory(dispatcher, args, cfg.smem_bytes)
        dispatcher[blocks, cfg.threads, stream, cfg.smem_bytes](*args)

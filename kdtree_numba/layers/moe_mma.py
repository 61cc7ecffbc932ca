"""The grouped MoE expert FFN on bf16 tensor cores behind ``moe_ffn(..., method="mma")``.

Two launches per layer cover every routed expert and the shared expert:

* gate_up: ``act[slot] = silu(gate_e x) * (up_e x)``, x the token's row of h gathered through
  the device-side grouping moe.py builds (``token_of_slot``, ``offsets``, ``active``);
* down: ``y_slot[slot] = down_e act[slot]``.

moe.py's ordered combine then adds ``shared + sum_j weight[m, j] y_slot[slot(m, j)]`` in j
order.  The shared expert is one more "expert" of both launches: its slots are rows
``n_entries + m`` of ``act`` / ``y_slot`` (every token, in token order).

Grid: (expert slot a, M tile, N tile), M tile fastest.  ``a < max_active`` is the a-th active
expert (blocks past ``n_active`` or past the expert's token count exit at once: the grid is
sized on the host from M, top_k and E only, no host read of the routing); ``a == max_active`` is
the shared expert.  Or, with the *work list* (``KDTREE_MOE_WORK_LIST=1``, read by
:func:`work_list_enabled`; off by default until a GPU measurement decides), (tile t, N tile), t
fastest: t < R is the t-th M tile of the device-built list moe.py's grouping writes
(``tile_expert``, ``tile_row``; blocks past its length ``n_tiles`` exit), t >= R the shared
expert's tiles, R = :func:`routed_tile_bound`.  At a verify's 65 tokens over 64 experts the full
grid launches 5 M tiles per expert for ~8 tokens each: 4 of 5 blocks exit at once, 16 k of 21 k
per launch; the list leaves ~1.8 k.
The GEMM core is mma.py's: its tile shape (MmaConfig, the linear's tiles by tokens per
expert), its K loop (``ring_function``: bf16 x and weights both by ``cp.async`` through a ring of
``stages`` shared buffers, fp32 accumulation) and fragment layout.  Differences: the x rows are
gathered (each thread's rows are fixed for the whole K loop, looked up once), and in the
gate_up launch the weight tile interleaves gate and up rows per warp: of a warp's ``tn`` n8
tiles (a warpgroup tile's: all BN / 8) the first half are gate rows and the second half the up
rows of the same intermediate columns, so the thread holding gate(row, col) also holds up(row,
col) and applies SwiGLU in the epilogue (its division by ``div.approx`` at every tile:
``common.silu_approx``).  h is rounded to bf16 once per layer and ``act`` is stored as bf16 (the
value the down GEMM multiplies either way), so both launches stream their x like their weights
(x loaded through registers each stage held decode to half the weight roof whatever the ring
depth).

No K slices: every output is one fp32 mma chain over K in k16 steps in panel order, the same
for every tile and stage depth (bk only groups the panels), so a token's row does not depend
on which other tokens share its batch or its tile (assuming the tensor core's per-row
accumulation ignores the other rows, as the ISA defines it).
Design, error bound and status: docs/LAYERS.md, "Grouped MoE on tensor cores".
"""
from __future__ import annotations

import functools

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, kernel, kernel_factory
from kdtree_numba.gpu.bits import divmod_u32
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import allow_large_shared_memory, store_nowrap_2d
from kdtree_numba.gpu.tensorcore import pack_bf16x2
from kdtree_numba.layers.common import silu_approx
from kdtree_numba.layers.mma import (MmaConfig, accumulator_origin, c_position, ring_function,
                                     unsliced_tile, round_to_bf16, w_stage_slot)

__all__ = ["moe_mma_config", "moe_mma_kernel", "moe_mma_grid", "grouped_experts_mma",
           "routed_tile_bound", "work_list_enabled", "expert_tile_io"]

_w_stage_slot = inline_device_function(w_stage_slot)
_c_position = inline_device_function(c_position)


def moe_mma_config(m: int, top_k: int, n_experts: int) -> MmaConfig:
    """The tile for both launches, by the mean tokens per active expert, M k / min(E, M k):
    16 x 64 in 3 stages of bk = 128 up to 16 tokens (256 bytes of each weight row a stage,
    as the linear's decode tile: one DRAM burst with cp.async's L2::256B prefetch), else
    the tile of products without K slices (:func:`unsliced_tile`); a gate_up block covers
    BN / 2 intermediate columns of gate and of up.  Every tile gives the same bits (the
    module docstring; tests/test_moe_mma.py)."""
    per = -(-m * top_k // max(1, min(n_experts, m * top_k)))
    if per <= 16:
        # 16 x 64: at one token a Kimi layer's gate_up is 9 experts x 32 tiles of 128 = 288
        # blocks for 132 SMs, so a third of the SMs run a third block while the rest idle;
        # 64-wide tiles double the blocks and halve the tail
        return MmaConfig(wm=1, wn=4, tm=1, tn=2, bk=128, stages=3)
    return unsliced_tile(per)


def work_list_enabled() -> bool:
    """Whether moe_ffn(method="mma") launches over the device-built work list of M tiles
    (``KDTREE_MOE_WORK_LIST=1``) instead of the full (expert, M tile) grid; read per call, so
    a benchmark can time both in one process."""
    return runtime.current().moe_work_list


def routed_tile_bound(n_entries: int, n_experts: int, tile_rows: int) -> int:
    """The most M tiles the routed experts can need: with A active experts holding c_a >= 1
    of N <= n_entries entries, sum_a ceil(c_a / BM) = A + sum_a floor((c_a - 1) / BM)
    <= A + floor((N - A) / BM), which grows with A and N: at A = min(E, n_entries) and
    N = n_entries it is the bound (a work list never outgrows its buffer)."""
    a = min(n_experts, n_entries)
    return a + (n_entries - a) // tile_rows


def moe_mma_grid(cfg: MmaConfig, gate_up: bool, m: int, max_active: int, has_shared: bool,
                 n_out: int, n_entries: int | None = None, n_experts: int | None = None):
    """(blocks, M tiles, N tiles) of a launch: n_out = the widest expert output (gate_up: the
    intermediate width, each block covering BN / 2 columns; down: D).  With the work list
    (``n_entries`` and ``n_experts`` given) the M tiles are the list's bound R plus the shared
    expert's ceil(M / BM)."""
    n_mtiles = -(-m // cfg.bm)
    n_ntiles = -(-n_out // (cfg.bn // 2 if gate_up else cfg.bn))
    if n_entries is not None:
        tiles = routed_tile_bound(n_entries, n_experts, cfg.bm) + n_mtiles * int(has_shared)
        return tiles * n_ntiles, tiles, n_ntiles
    return (max_active + int(has_shared)) * n_mtiles * n_ntiles, n_mtiles, n_ntiles


@functools.cache
def expert_tile_io(ftm: int, ftn: int, gate_up: bool):
    """``(weight_row, store_tile)`` of a grouped expert kernel whose threads hold ftm x ftn
    accumulator tiles in mma.sync's C layout (this module's kernel and moe_int4_mma.py's):

    * ``weight_row(row, col0, n_out)``: the expert's weight row of row ``row`` of a block's
      weight tile (-1: none).  gate_up: of each group of ftn n8 tiles (a warp's; wgmma: all
      BN) the first half are gate rows and the second half the up rows of the same
      intermediate columns, so the thread holding gate(row, c) holds up(row, c);
    * ``store_tile(out, acc, lane, row0, ocol, m0, col0, count, s_begin, n_out)``: the
      epilogue from the warp's first accumulator tile at (row0, ocol) of the block's tile:
      gate_up ``act[slot, c] = silu(gate) * up`` as bf16 pairs (``common.silu_approx``), down
      ``y_slot[slot, c]``; rows past ``count`` and columns past ``n_out`` not written."""
    HALF = ftn // 2

    @inline_device_function
    def weight_row(row, col0, n_out):
        if gate_up:
            q = row // (8 * ftn)
            j = (row - q * 8 * ftn) // 8
            col = col0 + q * (4 * ftn) + 8 * (j % HALF) + row % 8
            if col < n_out:
                return col if j < HALF else n_out + col
        elif col0 + row < n_out:
            return col0 + row
        return -1

    @inline_device_function
    def store_tile(out, acc, lane, row0, ocol, m0, col0, count, s_begin, n_out):
        for i in range(ftm):
            for j in range(HALF if gate_up else ftn):
                for h in range(2):     # accumulators 2h, 2h + 1: one row, columns c, c + 1
                    r, c = _c_position(lane, 2 * h)
                    row = m0 + row0 + 16 * i + r
                    o = 4 * (i * ftn + j) + 2 * h
                    if gate_up:        # c is even and n_out % 8 == 0: c + 1 < n_out too
                        col = col0 + (ocol >> 1) + 8 * j + c
                        ou = o + 4 * HALF
                        if row < count and col < n_out:
                            store_nowrap_2d(out, s_begin + row, col >> 1, pack_bf16x2(
                                silu_approx(acc[o]) * acc[ou],
                                silu_approx(acc[o + 1]) * acc[ou + 1]))
                    else:
                        col = col0 + ocol + 8 * j + c
                        if row < count and col < n_out:
                            store_nowrap_2d(out, s_begin + row, col, acc[o])
                        if row < count and col + 1 < n_out:
                            store_nowrap_2d(out, s_begin + row, col + 1, acc[o + 1])
    return weight_row, store_tile


@kernel_factory
def moe_mma_kernel(cfg: MmaConfig, gate_up: bool, work_list: bool = False):
    """The grouped kernel for a tile shape (needs an even count of n8 accumulator tiles;
    cfg.splits is ignored), over the full grid or the work list (module docstring).  Under
    the simulator it runs up to its first mma (tests/test_moe_mma.py emulates the warp's
    mma)."""
    from numba import float32, int64, uint32

    FTM, FTN = cfg.frag_tiles
    if FTN % 2:
        raise ValueError(f"moe_mma_kernel needs an even count of n8 accumulator tiles "
                         f"(gate and up halves), got {cfg}")
    WM, TM, TN, BK = cfg.wm, cfg.tm, cfg.tn, cfg.bk
    BM, BN, THREADS = cfg.bm, cfg.bn, cfg.threads
    run_ring = ring_function(cfg)
    origin = accumulator_origin(cfg)
    XC, WC = cfg.x_chunks, cfg.w_chunks
    NACC, NAV, NBV = 4 * FTM * FTN, 4 * TM, 2 * TN        # accumulators, one k16 step's A, B
    COLS = BN // 2 if gate_up else BN                      # output columns per block
    WGMMA = cfg.wgmma
    ZERO = float32(0.0)
    ALIGN = None if SIMULATOR else 16
    weight_row, store_tile = expert_tile_io(FTM, FTN, gate_up)

    @kernel
    def grouped_expert_mma(x16, token_of_slot, offsets, active, n_active, tile_expert,
                           tile_row, n_tiles, w3, sw, out, max_active, m_total, n_entries,
                           n_routed, n_shared, k_routed, k_shared, n_mtiles, n_ntiles):
        """gate_up: x16 = bf16(h) [M, D], w3 = gate_up [E, 2I, D], sw = shared gate_up
        [2Is, D], out = act as bf16 pairs [n_entries + M, >= I / 2] (uint32); down: x16 = act
        [n_entries + M, >= I] (bf16 bits), w3 = down [E, D, I], sw = shared down [D, Is],
        out = y_slot [n_entries + M, D] float32.  n_* / k_*: output and input widths of the
        routed and the shared experts.  Work list: ``max_active`` is its bound R and
        ``n_mtiles`` all M tiles (R + the shared expert's); else the tile arguments are
        placeholders."""
        bid = cuda.blockIdx.x
        if WGMMA:   # 32-bit divisions: a 64-bit one is a call, and a call serializes wgmma
            rest, mt_i = divmod_u32(bid, n_mtiles)
            a, nt = divmod_u32(rest, n_ntiles)
        else:
            mt_i = bid % n_mtiles
            rest = bid // n_mtiles
            nt = rest % n_ntiles
            a = rest // n_ntiles
        if work_list:      # mt_i: the list's tile, or past R the shared expert's
            routed = mt_i < max_active
            if routed:
                if mt_i >= n_tiles[0]:
                    return
                e = tile_expert[mt_i]
                m0 = tile_row[mt_i]
            else:
                e = 0
                m0 = (mt_i - max_active) * BM
        else:
            routed = a < max_active
            if routed:
                if a >= n_active[0]:
                    return
                e = active[a]
            else:
                e = 0
            m0 = mt_i * BM
        if routed:
            s_begin = offsets[e]
            count = offsets[e + 1] - s_begin
            w = w3[e]
            n_out = n_routed
            k_end = k_routed
        else:
            s_begin = n_entries
            count = m_total
            w = sw
            n_out = n_shared
            k_end = k_shared
        col0 = nt * COLS
        if m0 >= count or col0 >= n_out:
            return

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
        wn_i = warp // WM
        arow = wm_i * (16 * TM) + (lane >> 2)
        brow = wn_i * (8 * TN) + (lane >> 2)
        for u in range(XC):            # the gathered x row of each staged chunk (fixed in K)
            row, kk, off = _w_stage_slot(tid + u * THREADS, BM, BK)
            xrow[u] = -1
            if m0 + row < count:
                if not gate_up:
                    xrow[u] = s_begin + m0 + row
                elif routed:
                    xrow[u] = token_of_slot[s_begin + m0 + row]
                else:
                    xrow[u] = m0 + row
        for u in range(WC):            # the weight row of each staged chunk
            row, kk, off = _w_stage_slot(tid + u * THREADS, BN, BK)
            wrow[u] = weight_row(row, col0, n_out)
        for i in range(NACC):
            acc[i] = ZERO
        run_ring(acc, av, bv, smem, x16, xrow, w, wrow, 0, k_end, arow, brow, tid)

        row0, ocol = origin(warp, wm_i)
        store_tile(out, acc, lane, row0, ocol, m0, col0, count, s_begin, n_out)

    return grouped_expert_mma


def grouped_experts_mma(hd, lists, gud, dnd, shared, act16, y_slot, max_active, cfg: MmaConfig,
                        stream=0, workspace=None, tiles=None, h16=None):
    """The two launches.  hd [M, D] float32; lists = (token_of_slot, offsets, active,
    n_active) of moe.py's grouping; ``tiles``: its work list (tile_expert, tile_row, n_tiles)
    of cfg.bm-row tiles, or None for the full grid; gud [E, 2I, D] and dnd [E, D, I] uint16
    bf16 bits;
    shared = (sgu [2Is, D], sdn [D, Is]) or None; act16 [n_entries + M, max(I, Is)] uint16
    (bf16 bits) and y_slot [n_entries + M, D] float32 (the shared expert's rows last).  h is
    rounded to bf16 once, into a workspace buffer, as mma_linear does, unless ``h16`` gives
    it (the W4A16 path, whose shared expert runs here alone: ``max_active`` 0, gud and dnd
    its own weights as one expert).  Checks are moe_ffn's."""
    m, d = hd.shape
    n_experts, two_i, _ = gud.shape
    inter = two_i // 2
    n_entries = act16.shape[0] - m
    if shared is None:
        sgu, sdn, s_inter = gud[0], dnd[0], inter
    else:
        sgu, sdn = shared
        s_inter = sdn.shape[1]
    has_shared = shared is not None
    if h16 is None:
        h16 = round_to_bf16(hd, workspace, "moe.mma_h16", stream)
    act_pairs = act16.view(np.uint32)
    # without a work list any int32 arrays stand for its three (never read); with one the
    # kernel's max_active is the list's bound R
    work = tiles or (lists[2], lists[2], lists[3])
    bound = routed_tile_bound(n_entries, n_experts, cfg.bm) if tiles else max_active
    grid_list = (n_entries, n_experts) if tiles else ()
    for gate_up, x16, w3, sw, out, n_r, n_s, k_r, k_s in (
            (True, h16, gud, sgu, act_pairs, inter, s_inter, d, d),
            (False, act16, dnd, sdn, y_slot, d, d, inter, s_inter)):
        blocks, n_mtiles, n_ntiles = moe_mma_grid(cfg, gate_up, m, max_active, has_shared,
                                                  max(n_r, n_s), *grid_list)
        dispatcher = moe_mma_kernel(cfg, gate_up, tiles is not None)
        args = (x16, *lists, *work, w3, sw, out, bound, m, n_entries, n_r, n_s, k_r, k_s,
                n_mtiles, n_ntiles)
        allow_large_shared_memory(dispatcher, args, cfg.smem_bytes)
        dispatcher[blocks, cfg.threads, stream, cfg.smem_bytes](*args)

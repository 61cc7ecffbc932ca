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
sized on the host from M, top_k and E only, no host read of the routing); ``a == max_active``
is the shared expert.  The GEMM core is mma.py's: its tile shape (MmaConfig), shared-memory
layout and fragment helpers (x_stage_slot, w_stage_slot, panel_word, a_fragment, b_fragment,
c_position, copy_w16), x rounded to bf16 as it is staged, fp32 accumulation.  Differences: the
x rows are gathered (each thread's rows are fixed for the whole K loop, looked up once), and
in the gate_up launch the weight tile interleaves gate and up rows per warp: of a warp's ``tn``
n8 tiles the first half are gate rows and the second half the up rows of the same intermediate
columns, so the thread holding gate(row, col) also holds up(row, col) and applies SwiGLU in the
epilogue.  ``act`` is float32: the down launch rounds it to bf16 as it stages it (exactly the
value a bf16 store would have kept, one rounding either way) and reuses mma.py's float32 x
path; the price is 2 bytes more per activation, small beside the expert weights.

No K slices: every output is one fp32 mma chain over K in stages of bk = 32 whatever the tile,
so a token's row does not depend on which other tokens share its batch or its tile (assuming
the tensor core's per-row accumulation ignores the other rows, as the ISA defines it).
Design, error bound and status: docs/LAYERS.md, "Grouped MoE on tensor cores".
"""
from __future__ import annotations

import functools

from kdtree_numba.compat import SIMULATOR, cuda, kernel
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (STATIC_SHARED_BYTES, cp_async_commit, cp_async_wait_all,
                                     ld_cached_f32x4, store_nowrap_2d)
from kdtree_numba.layers.common import silu
from kdtree_numba.layers.mma import (MmaConfig, a_fragment, b_fragment, c_position,
                                     copy_w16, panel_word, stage_functions, w_stage_slot,
                                     x_stage_slot)

__all__ = ["moe_mma_config", "moe_mma_kernel", "moe_mma_grid", "grouped_experts_mma"]

_panel_word = inline_device_function(panel_word)
_x_stage_slot = inline_device_function(x_stage_slot)
_w_stage_slot = inline_device_function(w_stage_slot)
_a_fragment = inline_device_function(a_fragment)
_b_fragment = inline_device_function(b_fragment)
_c_position = inline_device_function(c_position)


def moe_mma_config(m: int, top_k: int, n_experts: int) -> MmaConfig:
    """The tile for both launches from the mean tokens per active expert (M k / min(E, M k)):
    BM = 16 up to 16 tokens, 32 up to 32, else 64; BN = 128 (64 intermediate columns of gate
    and up in the gate_up launch).  bk = 32 always (see the module docstring).  A first guess;
    run 43 timed the 16-row tile (docs/LAYERS.md), run 46 checked the three agree bitwise."""
    per = -(-m * top_k // max(1, min(n_experts, m * top_k)))
    if per <= 16:
        return MmaConfig(wm=1, wn=4, tm=1, tn=4, bk=32, stages=2)
    if per <= 32:
        return MmaConfig(wm=1, wn=4, tm=2, tn=4, bk=32, stages=2)
    return MmaConfig(wm=2, wn=2, tm=2, tn=8, bk=32, stages=2)


def moe_mma_grid(cfg: MmaConfig, gate_up: bool, m: int, max_active: int, has_shared: bool,
                 n_out: int):
    """(blocks, M tiles, N tiles) of a launch: n_out = the widest expert output (gate_up: the
    intermediate width, each block covering BN / 2 columns; down: D)."""
    n_mtiles = -(-m // cfg.bm)
    n_ntiles = -(-n_out // (cfg.bn // 2 if gate_up else cfg.bn))
    return (max_active + int(has_shared)) * n_mtiles * n_ntiles, n_mtiles, n_ntiles


@functools.cache
def moe_mma_kernel(cfg: MmaConfig, gate_up: bool):
    """The grouped kernel for a tile shape (needs tn even; cfg.splits is ignored).  Under the
    simulator it runs up to its first mma (tests/test_moe_mma.py emulates the warp's mma)."""
    from numba import float32, int32, uint32

    if cfg.tn % 2:
        raise ValueError(f"moe_mma_kernel needs an even tn (gate and up halves), got {cfg}")
    if 2 * cfg.stage_bytes > STATIC_SHARED_BYTES:
        raise ValueError(f"moe_mma_kernel's two static stages of {cfg} exceed 48 KiB")
    WM, TM, TN, BK = cfg.wm, cfg.tm, cfg.tn, cfg.bk
    BM, BN, THREADS = cfg.bm, cfg.bn, cfg.threads
    HALF_TN = TN // 2
    A_STAGE, B_STAGE = BM * BK // 2, BN * BK // 2
    XQ = BM * BK // 4 // THREADS
    WC = BN * BK // 8 // THREADS
    A_SIZE, B_SIZE = 2 * A_STAGE, 2 * B_STAGE
    NACC, NAV, NBV, NXR = 4 * TM * TN, 8 * TM, 4 * TN, 4 * XQ
    NXROW, NWROW = max(XQ, 1), max(WC, 1)
    COLS = BN // 2 if gate_up else BN                      # output columns per block
    ZERO = float32(0.0)
    ALIGN = None if SIMULATOR else 16

    @inline_device_function
    def issue_weights(bsm, at, w16, wrow, ks, k_end, tid):
        """cp.async this thread's weight chunks of stage ks (rows wrow[u], -1: zero fill)."""
        for u in range(WC):
            row, kk, off = _w_stage_slot(tid + u * THREADS, BN, BK)
            ok = wrow[u] >= 0 and ks + kk < k_end
            src_row = wrow[u] if wrow[u] >= 0 else 0
            src_k = ks + kk if ok else 0
            copy_w16(bsm, at + off, w16, src_row, src_k, 16 if ok else 0)

    @inline_device_function
    def load_x(xr, x, xrow, ks, k_end, tid):
        """This thread's x quads of stage ks (rows xrow[u], -1: zeros)."""
        for u in range(XQ):
            row, kk, off = _x_stage_slot(tid + u * THREADS, BM, BK)
            if xrow[u] >= 0 and ks + kk < k_end:
                v0, v1, v2, v3 = ld_cached_f32x4(x, xrow[u], ks + kk)
            else:
                v0 = v1 = v2 = v3 = ZERO
            xr[4 * u] = v0
            xr[4 * u + 1] = v1
            xr[4 * u + 2] = v2
            xr[4 * u + 3] = v3

    store_x, compute = stage_functions(cfg)

    @kernel
    def grouped_expert_mma(x, token_of_slot, offsets, active, n_active, w3, sw, out,
                           max_active, m_total, n_entries, n_routed, n_shared, k_routed,
                           k_shared, n_mtiles, n_ntiles):
        """gate_up: out = act [n_entries + M, >= I], x = h [M, D], w3 = gate_up [E, 2I, D],
        sw = shared gate_up [2Is, D]; down: out = y_slot [n_entries + M, D], x = act,
        w3 = down [E, D, I], sw = shared down [D, Is].  n_* / k_*: output and input widths
        of the routed and the shared experts."""
        bid = cuda.blockIdx.x
        mt_i = bid % n_mtiles
        rest = bid // n_mtiles
        nt = rest % n_ntiles
        a = rest // n_ntiles
        if a < max_active:
            if a >= n_active[0]:
                return
            e = active[a]
            s_begin = offsets[e]
            count = offsets[e + 1] - s_begin
            w = w3[e]
            n_out = n_routed
            k_end = k_routed
            routed = True
        else:
            s_begin = n_entries
            count = m_total
            w = sw
            n_out = n_shared
            k_end = k_shared
            routed = False
        m0 = mt_i * BM
        col0 = nt * COLS
        if m0 >= count or col0 >= n_out:
            return

        asm = cuda.shared.array(A_SIZE, uint32, alignment=ALIGN)
        bsm = cuda.shared.array(B_SIZE, uint32, alignment=ALIGN)
        acc = cuda.local.array(NACC, float32)
        av = cuda.local.array(NAV, uint32)
        bv = cuda.local.array(NBV, uint32)
        xr = cuda.local.array(NXR, float32)
        xrow = cuda.local.array(NXROW, int32)
        wrow = cuda.local.array(NWROW, int32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        t = lane & 3
        wm_i = warp % WM
        wn_i = warp // WM
        arow = wm_i * (16 * TM) + (lane >> 2)
        brow = wn_i * (8 * TN) + (lane >> 2)
        for u in range(XQ):            # the gathered x row of each staged quad (fixed in K)
            row, kk, off = _x_stage_slot(tid + u * THREADS, BM, BK)
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
            wrow[u] = -1
            if gate_up:                # warp q's tiles: tn / 2 of gate rows, then their up rows
                q = row // (8 * TN)
                j = (row - q * 8 * TN) // 8
                col = col0 + q * (4 * TN) + 8 * (j % HALF_TN) + row % 8
                if col < n_out:
                    wrow[u] = col if j < HALF_TN else n_out + col
            elif col0 + row < n_out:
                wrow[u] = col0 + row
        for i in range(NACC):
            acc[i] = ZERO

        issue_weights(bsm, 0, w, wrow, 0, k_end, tid)
        cp_async_commit()
        load_x(xr, x, xrow, 0, k_end, tid)
        store_x(asm, 0, xr, tid)
        cp_async_wait_all()
        cuda.syncthreads()
        buf = 0
        ks = 0
        while ks < k_end:
            nxt = ks + BK
            if nxt < k_end:
                issue_weights(bsm, (1 - buf) * B_STAGE, w, wrow, nxt, k_end, tid)
                cp_async_commit()
                load_x(xr, x, xrow, nxt, k_end, tid)
            compute(acc, av, bv, asm, bsm, buf * A_STAGE, buf * B_STAGE, arow, brow, t)
            if nxt < k_end:
                store_x(asm, (1 - buf) * A_STAGE, xr, tid)
            cp_async_wait_all()
            cuda.syncthreads()
            buf = 1 - buf
            ks = nxt

        for i in range(TM):
            for j in range(HALF_TN if gate_up else TN):
                for e4 in range(4):
                    r, c = _c_position(lane, e4)
                    row = m0 + wm_i * (16 * TM) + 16 * i + r
                    v = acc[4 * (i * TN + j) + e4]
                    if gate_up:
                        col = col0 + wn_i * (4 * TN) + 8 * j + c
                        v = silu(v) * acc[4 * (i * TN + j + HALF_TN) + e4]
                    else:
                        col = col0 + wn_i * (8 * TN) + 8 * j + c
                    if row < count and col < n_out:
                        store_nowrap_2d(out, s_begin + row, col, v)

    return grouped_expert_mma


def grouped_experts_mma(hd, lists, gud, dnd, shared, act, y_slot, max_active, cfg: MmaConfig,
                        stream=0):
    """The two launches.  hd [M, D] float32; lists = (token_of_slot, offsets, active,
    n_active) of moe.py's grouping; gud [E, 2I, D] and dnd [E, D, I] uint16 bf16 bits;
    shared = (sgu [2Is, D], sdn [D, Is]) or None; act [n_entries + M, max(I, Is)] and
    y_slot [n_entries + M, D] float32 (the shared expert's rows last).  Checks are moe_ffn's."""
    m, d = hd.shape
    n_experts, two_i, _ = gud.shape
    inter = two_i // 2
    n_entries = act.shape[0] - m
    if shared is None:
        sgu, sdn, s_inter = gud[0], dnd[0], inter
    else:
        sgu, sdn = shared
        s_inter = sdn.shape[1]
    has_shared = shared is not None
    for gate_up, x, w3, sw, out, n_r, n_s, k_r, k_s in (
            (True, hd, gud, sgu, act, inter, s_inter, d, d),
            (False, act, dnd, sdn, y_slot, d, d, inter, s_inter)):
        blocks, n_mtiles, n_ntiles = moe_mma_grid(cfg, gate_up, m, max_active, has_shared,
                                                  max(n_r, n_s))
        moe_mma_kernel(cfg, gate_up)[blocks, cfg.threads, stream](
            x, *lists, w3, sw, out, max_active, m, n_entries, n_r, n_s, k_r, k_s, n_mtiles,
            n_ntiles)

"""The MoE expert FFN on the GPU, ``moe_ffn`` (the routed experts' kernel shapes:
moe_shapes.py), and the routing of moe_route.py re-exported: ``router_logits``,
``route_from_logits``, ``moe_route``.

Twin: reference/layers/moe.py (the routing rules and the FFN are its docstring).  The experts
reuse the GEMM cores: skinny.py's accumulate loop (expert kernels below) and tiled.py's
generated kernels in their ``gate_up`` / ``down`` modes.  Design, tolerances and
measurements: docs/LAYERS.md.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory, to_device
from kdtree_numba.gpu.counters import arrival_counters
from kdtree_numba.gpu.memory import prefetch_l2_row
from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
from kdtree_numba.layers.common import CHUNK, pow2_ceil, silu, takes_tiled
from kdtree_numba.layers.linear import METHODS, linear, skinny_swiglu, swiglu_fuses
from kdtree_numba.layers.mma import round_to_bf16
from kdtree_numba.layers.moe_combine import (combine_tiles, combine_width, combining_rows,
                                             routed_first)
from kdtree_numba.layers.moe_lists import GROUP_IN_BLOCK_ENTRIES, grouping_rows
from kdtree_numba.layers.moe_int4_mma import (Int4MmaConfig, grouped_int4_mma, int4_mma_config,
                                              int4_mma_group_ok)
from kdtree_numba.layers.moe_route import moe_route, route_from_logits, router_logits
from kdtree_numba.layers.moe_mma import (grouped_experts_mma, moe_mma_config, routed_tile_bound,
                                         work_list_enabled)
from kdtree_numba.layers.moe_shapes import (expert_chunk_bound, expert_config,
                                            expert_tiled_configs, int4_skinny_configs,
                                            shared_expert_config, shared_in_experts)
from kdtree_numba.layers.skinny import (INT4_KINDS, RING_WORDS, SkinnyConfig, int4_chunks,
                                        int4_ring_ok, make_accumulate, make_skinny_block,
                                        skinny_kind)
from kdtree_numba.layers.tiled import tiled_kernel
from kdtree_numba.layers.workspace import (Int4Experts, Workspace, device_f32, device_weight,
                                           int4_load_kind, kernel_weight, launch_1d,
                                           load_kind_for, placeholder, result_array)
from reference.layers import is_dense

__all__ = ["router_logits", "route_from_logits", "moe_route", "moe_ffn", "expert_config",
           "expert_chunk_bound", "expert_tiled_configs"]

# ============================================================================ MoE FFN
# 1. group_by_expert (one block): counting sort of the M*k (token, expert) entries on the device:
#    per-expert offsets, the compact list of active experts, each entry's slot, each slot's token.
# 2. expert_gate_up: grid = (active expert, tile of R intermediate rows); the block streams R
#    gate rows and the R matching up rows of that expert once and applies them to all the
#    expert's tokens (MT at a time), writing act[slot] = silu(gate h) * (up h); with
#    KDTREE_MOE_CHUNK_GRID the grid is (active expert, tile, chunk), each MT-token chunk
#    (up to expert_chunk_bound of them) in a block of its own.
# 3. expert_down: same grid over D; y_slot[slot] = down_e act[slot].
# 4. shared expert: two linear() calls around a silu-mul kernel.
# 5. combine: out[m] = shared[m] + sum_j weight[m, j] y_slot[slot(m, j)], in j order.
# Entry order inside an expert (atomics) varies, results do not: every slot has its own sums.

@kernel_factory
def _group_kernel(n_experts: int, threads: int, tile_rows: int = 0, lanes: int = 0):
    """The grouping (one block).  ``tile_rows`` > 0 also writes the work list of the grouped
    tensor-core kernels (moe_mma.py): each active expert's ``ceil(count / tile_rows)`` M tiles
    in expert order, ``tile_expert[t]``, ``tile_row[t]`` (its first slot row), and their
    number ``n_tiles[0]``; with 0 those three arguments are placeholders, never touched.
    ``lanes`` (0: all the threads): the threads that sum and scan the per-expert counts, the
    first ``lanes`` of the block; the scan takes log2(lanes) rounds of two block barriers,
    where 1024 threads over the demo's 8 experts took 10 (``KDTREE_MOE_CHUNK_GRID``: lanes
    from E alone, _group_shape).  The lists do not depend on it: the same prefix sums."""
    lanes = lanes or threads
    narrow = lanes < threads           # (a constant: the full-width scan's code as it was)
    seg = -(-n_experts // lanes)

    @kernel
    def group_by_expert(idx_flat, top_k, offsets, active, n_active, slot_of_entry,
                        token_of_slot, tile_expert, tile_row, n_tiles):
        count = cuda.shared.array(n_experts, np.int32)
        start = cuda.shared.array(n_experts, np.int32)
        scan_c = cuda.shared.array(lanes, np.int32)
        scan_a = cuda.shared.array(lanes, np.int32)
        scan_t = cuda.shared.array(lanes, np.int32)
        t = cuda.threadIdx.x
        scans = not narrow or t < lanes
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
        mine_t = 0
        if scans:       # a thread past the lanes holds no experts: t * seg >= n_experts
            for e in range(t * seg, min(t * seg + seg, n_experts)):
                mine_c += count[e]
                mine_a += 1 if count[e] > 0 else 0
                if tile_rows > 0:
                    mine_t += (count[e] + tile_rows - 1) // tile_rows
            scan_c[t] = mine_c
            scan_a[t] = mine_a
            scan_t[t] = mine_t
        cuda.syncthreads()
        offset = 1
        while offset < lanes:          # Hillis-Steele inclusive scan of the three totals
            vc = 0
            va = 0
            vt = 0
            if scans:
                vc = scan_c[t] + (scan_c[t - offset] if t >= offset else 0)
                va = scan_a[t] + (scan_a[t - offset] if t >= offset else 0)
                vt = scan_t[t] + (scan_t[t - offset] if t >= offset else 0)
            cuda.syncthreads()
            if scans:
                scan_c[t] = vc
                scan_a[t] = va
                scan_t[t] = vt
            cuda.syncthreads()
            offset *= 2
        if scans:
            at_c = scan_c[t] - mine_c
            at_a = scan_a[t] - mine_a
            at_t = scan_t[t] - mine_t
            for e in range(t * seg, min(t * seg + seg, n_experts)):
                start[e] = at_c
                offsets[e] = at_c
                if count[e] > 0:
                    active[at_a] = e
                    at_a += 1
                if tile_rows > 0:
                    for r0 in range(0, count[e], tile_rows):
                        tile_expert[at_t] = e
                        tile_row[at_t] = r0
                        at_t += 1
                at_c += count[e]
        if t == lanes - 1:
            offsets[n_experts] = scan_c[t]
            n_active[0] = scan_a[t]
            if tile_rows > 0:
                n_tiles[0] = scan_t[t]
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


@kernel_factory
def _expert_kernel(cfg: SkinnyConfig, wkind: str, gate_up: bool, group: int = 0,
                   chunks: int = 1, shared=None, combine: int = 0, grouping: int = 0):
    """expert_gate_up (gate_up=True) or expert_down; cfg.rows = outputs per block.  Int4
    kinds (``group``: the weights' group size) read the expert's words and scales, the other
    kinds its rows (``s3`` is then a placeholder).  ``chunks``: blocks per (active expert, N
    tile), adjacent in the grid; block c of them takes the expert's mt-token chunks c,
    c + chunks, ... (1: today's grid, every chunk in one block one after another; the
    chunk grid, ``KDTREE_MOE_CHUNK_GRID``, passes :func:`expert_chunk_bound`).  Each output
    is one block's reduction over K whichever block holds its chunk: the same bits.
    ``cfg.span``: N tiles per block, one after another (the grid's tile count divided by
    it); ``cfg.prefetch``: a tile's weight rows asked into L2 at its start (and the next
    tile's, with a span), one bulk prefetch a row; ``cfg.max_registers``: a ptxas cap;
    ``cfg.stages`` / ``cfg.unpack`` (int4): skinny.make_accumulate's ring and unpacking, the
    ring in a shared array of the kernel's own.  ``shared``: (SkinnyConfig, load kind) of
    the shared expert's blocks after the routed ones (``KDTREE_SHARED_IN_EXPERTS``,
    moe_shapes.shared_in_experts): the launch's blocks from ``routed_blocks`` on run the skinny
    linear's block (skinny.make_skinny_block, its SwiGLU form in gate_up) over the shared
    expert's weight and every token, so the shared expert costs no launch of its own.
    ``combine`` (down only; ``KDTREE_COMBINE_IN_DOWN``): the combine tiles' width, whose last
    writer combines them (moe_combine.combining_rows), so the combine costs no launch of
    its own; 0: none.  ``grouping`` (gate_up only; ``KDTREE_GROUP_IN_EXPERTS``): E, each
    routed block grouping the entries itself (moe_lists.grouping_rows); 0: none."""
    mt, r_out, threads, span = cfg.mt, cfg.rows, cfg.threads, cfg.span
    shared_first = cfg.shared_first and shared is not None
    nr = 2 * r_out if gate_up else r_out           # weight rows streamed per block
    nacc, warps = mt * nr, threads // 32
    int4, prefetch = wkind in INT4_KINDS, cfg.prefetch
    # the ring (cfg.stages) only with kind "i4" (the host keeps it to rows int4_ring_ok takes)
    stages = cfg.stages if wkind == "i4" else 0
    ring_len = max(1, stages * nr * threads * RING_WORDS)
    ring_align = None if SIMULATOR else 16      # (the simulator rejects an alignment)
    accumulate = make_accumulate(mt, nr, threads, cfg.unroll, skinny_kind(wkind, cfg.f32_load),
                                 group, *((stages, cfg.unpack) if int4 else ()))
    block_reduce = make_block_reduce(nacc, threads)
    scr = block_reduce_scratch_shape(nacc, threads)
    red_shape = (warps + 1, nacc)

    # the one difference of the int4 kinds: the expert's scales ride in accumulate's scratch
    # argument (skinny.make_accumulate), where the float kinds take the shared scratch, and
    # the cp.async ring (cfg.stages) in a ninth
    if wkind in INT4_KINDS:
        @device_function
        def accumulate_expert(x, xrows, w3, s3, e, wrows, c1, acc, scratch, ring):
            accumulate(x, xrows, w3[e], wrows, 0, c1, acc, s3[e], ring)
    else:
        @device_function
        def accumulate_expert(x, xrows, w3, s3, e, wrows, c1, acc, scratch, ring):
            accumulate(x, xrows, w3[e], wrows, 0, c1, acc, scratch)

    @device_function
    def prefetch_tile(w3, s3, e, o0, n_out):
        """(cfg.prefetch) the weight rows (words and scales) of the tile at output o0 asked
        into L2, one thread a row."""
        for i in range(cuda.threadIdx.x, nr, threads):
            up = gate_up and i >= r_out
            row = min(o0 + (i - r_out if up else i), n_out - 1) + (n_out if up else 0)
            prefetch_l2_row(w3[e], row)
            if int4:
                prefetch_l2_row(s3[e], row)

    @device_function
    def run_tile(x, token_of_slot, w3, s3, e, out, n_out, c1, o0, c, s_begin, s_end, wrows,
                 xrows, acc, red, scratch, ring):
        """The block's N tile at output o0: every mt-chunk c, c + chunks, ... of expert e's
        slots [s_begin, s_end)."""
        t = cuda.threadIdx.x
        for r in range(r_out):
            wrows[r] = min(o0 + r, n_out - 1)
            if gate_up:
                wrows[r_out + r] = n_out + min(o0 + r, n_out - 1)
        for s0 in range(s_begin + c * mt, s_end, chunks * mt):   # none: the block exits
            for m in range(mt):
                if s0 + m < s_end:
                    xrows[m] = token_of_slot[s0 + m] if gate_up else s0 + m
                else:
                    xrows[m] = -1
            for i in range(nacc):
                acc[i] = np.float32(0.0)
            accumulate_expert(x, xrows, w3, s3, e, wrows, c1, acc, scratch, ring)
            block_reduce(acc, red, scratch)
            if t < mt * r_out:
                m = t // r_out
                r = t - m * r_out
                if s0 + m < s_end and o0 + r < n_out:
                    v = red[warps, m * nr + r]
                    if gate_up:
                        v = silu(v) * red[warps, m * nr + r_out + r]
                    out[s0 + m, o0 + r] = v
            cuda.syncthreads()     # red is reused by the next chunk of tokens

    @device_function(inline="always")    # (in numba's IR: skinny.make_skinny_block's note)
    def expert_block(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out, c1,
                     tiles, bid):
        """Block ``bid``'s share.  gate_up: out = act [slots, Im], x = h [M, D], w3 =
        gate_up [E, 2Im, D/..]; down: out = y_slot [slots, D], x = act (rows = slots), w3 =
        down [E, D, Im/..]; c1: the accumulate loop's chunks of a row; tiles: N tiles (of
        r_out outputs)."""
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        ring = cuda.shared.array(ring_len, np.uint32, alignment=ring_align)
        # block = (active slot a, N tile or span of tiles, chunk c), c fastest: a tile's
        # chunk blocks run side by side and read its weight rows from L2 after the first
        # (chunks 1: c = 0)
        at = bid // chunks
        c = bid - at * chunks
        spans = (tiles + span - 1) // span
        a = at // spans
        if a >= n_active[0]:
            return
        e = active[a]
        wrows = cuda.local.array(nr, np.int32)
        xrows = cuda.local.array(mt, np.int32)
        acc = cuda.local.array(nacc, np.float32)
        first = (at - a * spans) * span
        if prefetch:    # as soon as the expert is known: before its token lists are read
            prefetch_tile(w3, s3, e, first * r_out, n_out)
        s_begin, s_end = offsets[e], offsets[e + 1]
        if span == 1:
            run_tile(x, token_of_slot, w3, s3, e, out, n_out, c1, first * r_out, c, s_begin,
                     s_end, wrows, xrows, acc, red, scratch, ring)
        else:
            last = min(first + span, tiles)
            for tile in range(first, last):
                if prefetch and tile + 1 < last:      # the next tile's rows, one tile ahead
                    prefetch_tile(w3, s3, e, (tile + 1) * r_out, n_out)
                run_tile(x, token_of_slot, w3, s3, e, out, n_out, c1, tile * r_out, c,
                         s_begin, s_end, wrows, xrows, acc, red, scratch, ring)
    options = {"max_registers": cfg.max_registers} if cfg.max_registers else {}
    if combine:
        return kernel(combining_rows(expert_block, cfg, chunks, shared, combine), **options)
    if grouping:
        return kernel(grouping_rows(expert_block, cfg, shared, grouping,
                                    GROUP_IN_BLOCK_ENTRIES), **options)
    if shared is None:
        def expert_rows(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out, c1,
                        tiles):
            expert_block(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out, c1,
                         tiles, cuda.blockIdx.x)
        return kernel(expert_rows, **options)
    shared_block = make_skinny_block(*shared, gate_up)

    def expert_rows_and_shared(x, token_of_slot, offsets, active, n_active, w3, s3, out,
                               n_out, c1, tiles, routed_blocks, xs, s_w, s_out, m_total,
                               s_n_out, s_k8, s_mchunks):
        """The routed blocks, then the shared expert's (``cfg.shared_first``: the other way
        round): its x ``xs`` [M, K] (h, or its act in down), weight ``s_w``, output ``s_out``
        [1, M, s_n_out] (its act, or its y)."""
        bid = routed_first(cuda.blockIdx.x, routed_blocks, shared_first)
        if bid < routed_blocks:
            expert_block(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out, c1,
                         tiles, bid)
        else:
            shared_block(xs, s_w, s_out, m_total, s_n_out, s_k8, s_mchunks, 1,
                         bid - routed_blocks)
    return kernel(expert_rows_and_shared, **options)


@kernel
def _silu_mul(gu, act):
    """act[m, i] = silu(gu[m, i]) * gu[m, I + i]."""
    i = cuda.grid(1)
    inter = act.shape[1]
    if i < act.shape[0] * inter:
        m = i // inter
        c = i - m * inter
        act[m, c] = silu(gu[m, c]) * gu[m, inter + c]


@kernel_factory
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


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None, *,
            method: str = "auto", configs=None, out=None, stream=0, workspace=None):
    """See reference.moe_ffn.  Tokens are grouped by expert on the device.  ``method`` picks
    the routed experts' kernels: "skinny" (each active expert's weights streamed once per
    ``mt`` of its tokens), "tiled" (read once per BM of its tokens, register-blocked) or
    "auto": skinny up to SKINNY_MAX_M tokens, else tiled (a small expert at a
    verify's rows stays skinny: ``common.takes_tiled``).  The shared expert is two
    :func:`linear` calls of the same method (with "auto" they pick skinny or tiled by M the
    same way), or where both would stream and so do the routed experts, blocks of the routed
    experts' two launches (moe_shapes.shared_in_experts).  "mma" (opt-in, never picked by
    "auto"; bf16 weights only, layers/moe_mma.py): both GEMMs of every routed expert and of
    the shared expert on tensor cores, one launch each, SwiGLU in the gate_up epilogue.
    "tensor-cores": "mma" wherever it takes the weights, else "skinny" (linear's twin option:
    a choice by weights, never by M, and either kernel gives a row the same bits at every M).
    ``configs`` replaces the routed experts' tiled launches, ``[(TiledConfig, cmin, cmax)]``
    (expert_tiled_configs; benchmarks), or with "mma" the MmaConfig of both launches, or for
    int4 experts on the weight-streaming kernels their (gate_up, down) SkinnyConfigs.
    Expert weights float32 or bf16 (both tensors of one kind; the shared expert may differ),
    or both :class:`~kdtree_numba.layers.workspace.Int4Experts` (int4-group, W4A16: the
    weight-streaming kernels at every M, the nibbles unpacked and scaled in registers;
    "tiled" runs them too, the shared expert as asked; "mma" runs the W4A16 tensor-core
    kernels, layers/moe_int4_mma.py, and so does "tensor-cores" at every M unless
    ``KDTREE_INT4_MMA=0``: :func:`_int4_mma_picked`).
    The dense FFN: ``expert_idx`` and ``weight`` None, one expert, no shared expert
    (reference.is_dense).  With "mma" it runs as two :func:`linear` calls (K slices: the one
    expert's N tiles alone would leave most SMs idle at decode and verify sizes) around
    SwiGLU; with the other methods as the one-expert MoE, its routing (zeros, ones) filled on
    the device, the same bits as passing that routing.  With the lean round
    (``KDTREE_LEAN_ROUND``, on by default): where the weight-streaming kernels take it (the rows
    "skinny" or "auto" give them) as two skinny :func:`linear` calls around SwiGLU, the one
    expert's bits (the same core, its threads from K alone) in 2 launches (3 with
    ``KDTREE_FUSED_SWIGLU=0``) instead of 5 and its rows in parallel blocks, where one
    expert's block runs its rows' chunks one after another;
    tiled, that routing's grouping made once per M and the down GEMM writing the output (2
    launches where fill, group, gate_up, down and combine were 5), the same bits again."""
    hd = device_f32(h, "h", 2, stream)
    dense = is_dense(expert_idx, weight, gate_up, shared_gate_up)
    ws = workspace if workspace is not None else Workspace()
    if dense:
        idx = wt = None
    else:
        idx = to_device(expert_idx, stream=stream)
        wt = device_f32(weight, "weight", 2, stream)
    gud, kind = _expert_weight(gate_up, stream)
    dnd, kind_down = _expert_weight(down, stream)
    m, d = hd.shape
    n_experts, two_im, _ = gud.shape
    inter = two_im // 2
    top_k = 1 if dense else idx.shape[1] if len(idx.shape) == 2 else 0
    if (tuple(gud.shape[1:]) != (two_im, d) or tuple(dnd.shape) != (n_experts, d, inter)
            or kind != kind_down or not dense and (
                tuple(idx.shape) != (m, top_k) or tuple(wt.shape) != (m, top_k)
                or np.dtype(idx.dtype) != np.int32)):
        raise ValueError("moe_ffn wants h [M,D], expert_idx int32 / weight [M,k], gate_up "
                         "[E,2Im,D] and down [E,D,Im] of one dtype")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("pass both shared_gate_up and shared_down, or neither")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    y = result_array(out, (m, d), np.float32, stream)
    if m == 0:
        return y
    if kind == "i4" and _int4_mma_picked(method, hd, gud, dnd, shared_gate_up, shared_down,
                                          stream):
        if method == "mma" and not (configs is None or isinstance(configs, Int4MmaConfig)):
            raise TypeError("moe_ffn(method='mma') with int4 experts takes an Int4MmaConfig "
                            "as configs")
        if dense:
            idx, wt = _dense_routing(m, ws, stream)
        return _moe_ffn_int4_mma(hd, idx, wt, gud, dnd, shared_gate_up, shared_down, y,
                                 configs, stream, ws)
    if method == "tensor-cores":
        method = "mma" if _mma_takes_experts(hd, gud, dnd, kind, shared_gate_up,
                                              shared_down, stream) else "skinny"
    if dense and method == "mma":
        if configs is not None:
            raise ValueError("configs does not apply to the dense FFN under mma: its two "
                             "linears take mma_config's tiles and K slices")
        return _swiglu_linears(hd, gud[0], dnd[0], y, method, stream, ws, "moe.dense")
    # int4 experts have one kernel at every M: the weight-streaming core, which reads each
    # active expert's words once per mt of its tokens (docs/LAYERS.md, "W4A16 experts")
    tiled = kind != "i4" and (method == "tiled" or (method == "auto" and
                                                    takes_tiled(m, two_im * d)))
    lean = dense and runtime.current().lean_round      # (the dense FFN under mma returned)
    if lean and not tiled and kind != "i4":
        return _swiglu_linears(hd, gud[0], dnd[0], y, "skinny", stream, ws, "moe.dense")
    # the dense FFN left (tiled, int4): with KDTREE_LEAN_ROUND its constant routing's grouping
    # made once (_dense_lists), where the fill, the grouping and the combine were 3 launches
    if dense and not lean:
        idx, wt = _dense_routing(m, ws, stream)
    if method == "mma":
        return _moe_ffn_mma(hd, idx, wt, gud, dnd, kind, shared_gate_up, shared_down, y,
                            configs, stream, ws)
    n_entries = m * top_k
    act = ws.get("moe.act", (n_entries, inter), np.float32, stream)
    in_experts = False
    if lean:    # KDTREE_LEAN_ROUND: slot m is token m, so the down GEMM writes y itself
        y_slot, lists = y, _dense_lists(m)
    else:
        y_slot = ws.get("moe.y_slot", (n_entries, d), np.float32, stream)
        # KDTREE_GROUP_IN_EXPERTS: few entries are grouped by the gate_up launch's blocks
        in_experts = (runtime.current().group_in_experts and not tiled
                      and n_entries <= GROUP_IN_BLOCK_ENTRIES)
        slot_of_entry, lists, _ = _group_tokens(idx, n_experts, ws, stream,
                                                launch=not in_experts)
    shared = shared_y = None
    if shared_gate_up is not None:
        sgu, sdn, skind = _shared_weights(shared_gate_up, shared_down, d, stream)
        shared_y = ws.get("moe.shared_y", (m, d), np.float32, stream)
        if shared_in_experts(method, m, tiled, sgu, sdn):
            shared = (sgu, sdn, skind, ws.get("moe.shared_act", (m, sdn.shape[1]), np.float32,
                                              stream), shared_y)
    # KDTREE_COMBINE_IN_DOWN: the down launch's last writers combine (the shared expert's y
    # then comes from that launch too, or there is none)
    folds = (runtime.current().combine_in_down and not (tiled or lean)
             and (shared_y is None or shared is not None))
    if tiled:
        _experts_tiled(hd, lists, gud, dnd, kind, act, y_slot, min(n_entries, n_experts), m,
                       top_k, stream, configs)
    else:
        _experts_skinny(hd, lists, gud, dnd, kind, act, y_slot, min(n_entries, n_experts), m,
                        top_k, stream, int4_skinny_configs(kind, configs), shared,
                        (slot_of_entry, wt, y) if folds else None,
                        (idx, slot_of_entry) if in_experts else None)
    if lean or folds:
        return y
    if shared_y is not None and shared is None:
        # The shared expert sees every token: linear() ("auto": skinny up to SKINNY_MAX_M rows,
        # else tiled with K slices, which keep all SMs busy where one expert's tiles would not).
        _swiglu_linears(hd, sgu, sdn, shared_y, method, stream, ws, "moe.shared")
    return _combine(y_slot, slot_of_entry, wt, shared_y, y, stream)


def _expert_weight(w, stream):
    """(device weight, kind) of stacked expert weights: float32 / bf16 arrays as
    device_weight gives them, :class:`Int4Experts` as "i4" (both arrays on the device)."""
    if isinstance(w, Int4Experts):
        return w.on_device(stream), "i4"
    if type(w).__name__ == "Int4GroupWeight":
        raise TypeError("moe_ffn takes int4 experts as Int4Experts (workspace.int4_experts "
                        "keeps them packed), not an Int4GroupWeight")
    return device_weight(w, stream)


def _swiglu_linears(hd, gate_up, down, y, method: str, stream, ws, name: str):
    """y = down (silu(gate hd) * (up hd)) as two :func:`linear` calls of ``method`` around
    ``_silu_mul``: the shared expert, and the dense FFN under "mma".  ``gate_up`` [2I, D] and
    ``down`` [D, I] on the device; ``name`` prefixes the workspace buffers."""
    m = hd.shape[0]
    inter = down.shape[1]
    act = ws.get(name + "_act", (m, inter), np.float32, stream)
    if runtime.current().fused_swiglu and swiglu_fuses(method, m, gate_up):
        skinny_swiglu(hd, gate_up, out=act, stream=stream)     # the same bits, one launch
    else:
        gu = ws.get(name + "_gu", (m, 2 * inter), np.float32, stream)
        linear(hd, gate_up, out=gu, method=method, stream=stream, workspace=ws)
        grid, block = launch_1d(act.size, 256)
        _silu_mul[grid, block, stream](gu, act)
    return linear(act, down, out=y, method=method, stream=stream, workspace=ws)


@kernel
def _fill_dense_routing(idx, weight):
    """idx[m, 0] = 0, weight[m, 0] = 1: the dense FFN's routing, without a host upload."""
    m = cuda.grid(1)
    if m < idx.shape[0]:
        idx[m, 0] = 0
        weight[m, 0] = np.float32(1.0)


def _dense_routing(m: int, ws, stream):
    """(expert_idx zeros [m, 1] int32, weight ones [m, 1]) on the device, for the dense FFN's
    one-expert kernels."""
    idx = ws.get("moe.dense_idx", (m, 1), np.int32, stream)
    wt = ws.get("moe.dense_weight", (m, 1), np.float32, stream)
    grid, block = launch_1d(m, 256)
    _fill_dense_routing[grid, block, stream](idx, wt)
    return idx, wt


@functools.cache
def _dense_lists(m: int):
    """The grouping of the dense FFN's constant routing (every token to expert 0, weight 1),
    made once per M and kept for the process (a captured CUDA graph reads these addresses):
    token_of_slot = 0..M-1, offsets [0, M], active [0], n_active [1].  The expert kernels give
    every slot its own sums, so slot m holding token m (the group kernel's atomics order
    them as they come) changes no bit, and the combine it skips adds y_slot times 1 to 0.0,
    which changes none either: a sum that starts at +0.0 is never -0.0.  Made where the
    first call of a shape runs eagerly (an upload, as ``placeholder``), never in a capture."""
    return (to_device(np.arange(m, dtype=np.int32)), to_device(np.array([0, m], np.int32)),
            to_device(np.zeros(1, np.int32)), to_device(np.ones(1, np.int32)))


def _group_shape(n_entries: int, n_experts: int) -> tuple[int, int]:
    """(threads, scan lanes) of the grouping: 1024 threads scanning (32 in the simulator);
    with ``KDTREE_MOE_CHUNK_GRID`` the threads from the M k entries and E (a power of two,
    32 to 1024: every entry and expert a thread where they fit), the scan over pow2(E) of
    them.  Fewer threads change only the order of the atomics that number an expert's
    entries, which moves no output bit (every slot has its own sums, the combine goes in
    entry order); the lanes change nothing at all."""
    threads = 32 if SIMULATOR else 1024
    if not runtime.current().moe_chunk_grid:
        return threads, threads
    if not SIMULATOR:
        threads = min(threads, max(32, pow2_ceil(max(n_entries, n_experts))))
    return threads, min(threads, pow2_ceil(n_experts))


def _group_tokens(idx, n_experts: int, ws, stream, tile_rows: int = 0, launch: bool = True):
    """The device-side grouping of the M * k (token, expert) entries by expert: returns
    (slot_of_entry, (token_of_slot, offsets, active, n_active), tiles), the lists every
    expert kernel reads; ``tiles`` = (tile_expert, tile_row, n_tiles), the grouped tensor-core
    kernels' work list of ``tile_rows``-row M tiles (moe_mma.routed_tile_bound entries), or
    None when ``tile_rows`` is 0.  ``launch`` False: only the arrays (the gate_up launch
    fills them: moe_lists.py)."""
    n_entries = idx.shape[0] * idx.shape[1]
    offsets = ws.get("moe.offsets", (n_experts + 1,), np.int32, stream)
    active = ws.get("moe.active", (n_experts,), np.int32, stream)
    n_active = ws.get("moe.n_active", (1,), np.int32, stream)
    slot_of_entry = ws.get("moe.slot_of_entry", (n_entries,), np.int32, stream)
    token_of_slot = ws.get("moe.token_of_slot", (n_entries,), np.int32, stream)
    tiles = None
    if tile_rows:
        bound = max(1, routed_tile_bound(n_entries, n_experts, tile_rows))
        tiles = (ws.get("moe.tile_expert", (bound,), np.int32, stream),
                 ws.get("moe.tile_row", (bound,), np.int32, stream),
                 ws.get("moe.n_tiles", (1,), np.int32, stream))
    if not launch:
        return slot_of_entry, (token_of_slot, offsets, active, n_active), tiles
    threads, lanes = _group_shape(n_entries, n_experts)
    recipe = (n_experts, threads, tile_rows) + ((lanes,) if lanes < threads else ())
    # without a work list, any int32 arrays stand for its three (the kernel never reads them)
    _group_kernel(*recipe)[1, threads, stream](
        idx.reshape(n_entries), idx.shape[1], offsets, active, n_active, slot_of_entry,
        token_of_slot, *(tiles or (active, active, n_active)))
    return slot_of_entry, (token_of_slot, offsets, active, n_active), tiles


def _shared_weights(shared_gate_up, shared_down, d: int, stream):
    """(gate_up [2Is, D], down [D, Is], load kind) of the shared expert on the device."""
    sgu, skind = device_weight(shared_gate_up, stream)
    sdn, skind_down = device_weight(shared_down, stream)
    s_inter = sdn.shape[1]
    if tuple(sgu.shape) != (2 * s_inter, d) or tuple(sdn.shape) != (d, s_inter) \
            or skind != skind_down:
        raise ValueError("shared expert wants gate_up [2Is, D] and down [D, Is] of one dtype")
    return sgu, sdn, skind


def _combine(y_slot, slot_of_entry, wt, shared_y, y, stream):
    """y[m] = shared_y[m] (when given) + sum_j weight[m, j] y_slot[slot of (m, j)], in j order."""
    m, d = y.shape
    threads = 32 if SIMULATOR else 256
    # any float32 2-d array stands for shared_y without a shared expert: the kernel ignores it
    _combine_kernel(shared_y is not None)[(m, -(-d // threads)), threads, stream](
        y_slot, slot_of_entry, wt, y_slot if shared_y is None else shared_y, y)
    return y


def _mma_takes_experts(hd, gud, dnd, kind, shared_gate_up, shared_down, stream) -> bool:
    """Whether moe_ffn(method="mma") takes these weights (bf16 everywhere, widths % 8)."""
    d, inter = hd.shape[1], dnd.shape[2]
    if kind != "bf16" or inter % 8 or load_kind_for(kind, d, hd, gud, dnd) != "bf16":
        return False
    return _mma_takes_shared(d, shared_gate_up, shared_down, stream)


def _mma_takes_shared(d: int, shared_gate_up, shared_down, stream) -> bool:
    """Whether the grouped bf16 kernel takes the shared expert (none, or bf16, Is % 8)."""
    if shared_gate_up is not None:
        _, sdn, skind = _shared_weights(shared_gate_up, shared_down, d, stream)
        if skind != "bf16" or sdn.shape[1] % 8:
            return False
    return True


def _int4_mma_picked(method: str, hd, gu4, dn4, shared_gate_up, shared_down, stream) -> bool:
    """Whether int4 experts run on tensor cores (layers/moe_int4_mma.py): always under "mma"
    (ValueError where the kernels cannot take them), and under "tensor-cores" at every M, as
    bf16 experts do (``KDTREE_INT4_MMA=0`` keeps them on the CUDA-core W4A16 kernels there).
    Never by M under "auto": the kernel rounds its activations to bf16, so a verify's rows
    would leave a decode's by far more than rounding (kimi-k2-slice at budgets 16 and 32, run
    160: the replay drafter's tau 5.82 -> 1.97, tokens no longer AR's).  They take group
    sizes that are multiples of 32, D and I multiples of 32 with C-contiguous 16-byte aligned
    words and h, and a bf16 shared expert (Is % 8) or none."""
    m, d = hd.shape
    if method != "mma" and not (runtime.current().int4_mma and method == "tensor-cores"):
        return False
    takes = (int4_mma_group_ok(gu4.group_size) and int4_mma_group_ok(dn4.group_size)
             and int4_load_kind(d, hd, gu4) == "i4" and int4_load_kind(dn4.shape[2], hd, dn4)
             == "i4" and _mma_takes_shared(d, shared_gate_up, shared_down, stream))
    if method == "mma" and not takes:
        raise ValueError("moe_ffn(method='mma') takes bf16 experts, or int4 experts of group "
                         "sizes multiple of 32 (D, I multiples of 32, aligned arrays) with a "
                         "bf16 shared expert; use method 'auto', 'skinny' or 'tensor-cores'")
    return takes


def _grouped_buffers(hd, gate_up, top_k: int, shared_gate_up, shared_down, ws, stream):
    """(shared expert (gate_up, down) on the device or None, act16 [Mk + M, max(I, Is)] uint16,
    y_slot [Mk + M, D] float32) of the grouped tensor-core paths, the shared expert's rows
    last; ValueError for a shared expert that is not bf16."""
    m, d = hd.shape
    inter = gate_up.shape[1] // 2
    shared, s_inter = None, inter
    if shared_gate_up is not None:
        sgu, sdn, skind = _shared_weights(shared_gate_up, shared_down, d, stream)
        if skind != "bf16":
            raise ValueError("moe_ffn(method='mma') takes bf16 weights only")
        shared, s_inter = (sgu, sdn), sdn.shape[1]
    rows = m * top_k + m
    return (shared, ws.get("moe.mma_act16", (rows, max(inter, s_inter)), np.uint16, stream),
            ws.get("moe.mma_y_slot", (rows, d), np.float32, stream))


def _moe_ffn_int4_mma(hd, idx, wt, gu4, dn4, shared_gate_up, shared_down, y, config, stream,
                      ws):
    """The W4A16 experts on tensor cores: the grouping, the two launches of
    layers/moe_int4_mma.py over the routed experts, the bf16 shared expert through moe_mma's
    grouped kernel alone (its rows of the same act16 / y_slot; the tile of one expert of M
    tokens), then the ordered combine.  h is rounded to bf16 once for both.  ``config``: an
    Int4MmaConfig replacing int4_mma_config's tile, or anything else (the bf16 kernels'
    configs, which "auto" and "tensor-cores" may carry: ignored)."""
    m = hd.shape[0]
    n_experts, top_k = gu4.shape[0], idx.shape[1]
    n_entries = m * top_k
    shared, act16, y_slot = _grouped_buffers(hd, gu4, top_k, shared_gate_up, shared_down, ws,
                                             stream)
    cfg = config if isinstance(config, Int4MmaConfig) else int4_mma_config(m, top_k, n_experts)
    slot_of_entry, lists, tiles = _group_tokens(idx, n_experts, ws, stream,
                                                cfg.bm if work_list_enabled() else 0)
    h16 = round_to_bf16(hd, ws, "moe.mma_h16", stream)
    grouped_int4_mma(h16, lists, gu4, dn4, act16, y_slot, min(n_entries, n_experts), cfg,
                     stream, tiles)
    if shared is None:
        return _combine(y_slot, slot_of_entry, wt, None, y, stream)
    one = tuple(a.reshape(1, *a.shape) for a in shared)
    grouped_experts_mma(hd, lists, *one, shared, act16, y_slot, 0, moe_mma_config(m, 1, 1),
                        stream, ws, h16=h16)
    return _combine(y_slot, slot_of_entry, wt, y_slot[n_entries:], y, stream)


def _moe_ffn_mma(hd, idx, wt, gud, dnd, kind, shared_gate_up, shared_down, y, config, stream,
                 workspace):
    """method="mma" (layers/moe_mma.py): the grouping, one tensor-core launch for gate_up
    with SwiGLU and one for down, both covering every routed expert and the shared expert,
    then the ordered combine.  bf16 weights, D and the intermediate widths multiples of 8,
    C-contiguous 16-byte aligned arrays (ValueError otherwise).  ``config``: an MmaConfig
    replacing moe_mma_config's tile (tests, benchmarks), or None."""
    m, d = hd.shape
    n_experts, two_im, _ = gud.shape
    inter, top_k = two_im // 2, idx.shape[1]
    ws = workspace if workspace is not None else Workspace()
    n_entries = m * top_k
    shared, act16, y_slot = _grouped_buffers(hd, gud, top_k, shared_gate_up, shared_down, ws,
                                             stream)
    s_inter = inter if shared is None else shared[1].shape[1]
    if kind != "bf16" or any(load_kind_for(kind, k, *arrays) != "bf16" for k, arrays in (
            (d, (hd, gud, dnd, act16, y_slot) + (shared or ())), (inter, ()), (s_inter, ()))):
        raise ValueError("moe_ffn(method='mma') takes bf16 weights, D, I and Is multiples of "
                         "8 and C-contiguous 16-byte aligned arrays; use method='auto'")
    cfg = config or moe_mma_config(m, top_k, n_experts)
    slot_of_entry, lists, tiles = _group_tokens(idx, n_experts, ws, stream,
                                                cfg.bm if work_list_enabled() else 0)
    grouped_experts_mma(hd, lists, gud, dnd, shared, act16, y_slot, min(n_entries, n_experts),
                        cfg, stream, ws, tiles)
    shared_y = None if shared is None else y_slot[n_entries:]   # the shared expert's rows
    return _combine(y_slot, slot_of_entry, wt, shared_y, y, stream)


def _experts_skinny(hd, lists, gud, dnd, kind, act, y_slot, max_active, m, top_k, stream,
                    configs=None, shared=None, fold=None, grouping=None):
    """expert_gate_up then expert_down with the weight-streaming core (skinny_config shapes,
    or ``configs``: (gate_up, down) SkinnyConfigs); ``kind`` "i4": gud and dnd are device
    :class:`Int4Experts` (W4A16, the nibbles unpacked and scaled in registers).  ``shared``:
    (gate_up, down, load kind, act [M, Is], y [M, D]) of the shared expert, whose blocks
    then follow the routed ones in both launches (moe_shapes.shared_in_experts).  ``fold``:
    (slot_of_entry, weight, y) where the down launch combines into y in its tail
    (``KDTREE_COMBINE_IN_DOWN``, moe_combine.combining_rows).  ``grouping``: (expert_idx,
    slot_of_entry) where the gate_up launch groups the entries into ``lists`` itself
    (``KDTREE_GROUP_IN_EXPERTS``, moe_lists.grouping_rows)."""
    n_experts, d, inter = dnd.shape
    chunk_grid = runtime.current().moe_chunk_grid
    sgu, sdn, skind, s_act, s_y = shared or (None,) * 5
    for is_gate_up, x_in, w3, out_buf, n_out, k_in, s_x, s_w, s_out in (
            (True, hd, gud, act, inter, d, hd, sgu, s_act),
            (False, act, dnd, y_slot, d, inter, s_act, sdn, s_y)):
        cfg = (configs[0 if is_gate_up else 1] if configs else
               expert_config(m, top_k, n_experts, k_in, is_gate_up, kind == "i4"))
        tiles = -(-n_out // cfg.rows)
        # KDTREE_MOE_CHUNK_GRID: an expert's mt-token chunks in blocks of their own; one
        # chunk block asks for the one-chunk grid's kernel itself (the same recipe)
        chunks = expert_chunk_bound(m, top_k, n_experts, cfg.mt) if chunk_grid else 1
        if kind == "i4":
            load_kind = int4_load_kind(k_in, x_in, w3)
            weights, c1, group = (w3.words, w3.scale), int4_chunks(k_in), w3.group_size
            if cfg.stages and not int4_ring_ok(load_kind, k_in, group):
                cfg = dataclasses.replace(cfg, stages=0)     # plain loads: the same bits
        else:
            load_kind = load_kind_for(kind, k_in, x_in, w3)
            weights, c1, group = (kernel_weight(w3, load_kind), placeholder()), \
                -(-k_in // CHUNK), 0
        recipe = (cfg, load_kind, is_gate_up, group) + ((chunks,) if chunks > 1 else ())
        blocks = max_active * -(-tiles // cfg.span) * chunks
        args = (x_in, *lists, *weights, out_buf, n_out, c1, tiles)
        folds = fold is not None and not is_gate_up
        groups = grouping is not None and is_gate_up
        if shared is None and not (folds or groups):
            _expert_kernel(*recipe)[blocks, cfg.threads, stream](*args)
            continue
        s_cfg, s_blocks, s_args = None, 0, (blocks,) + (y_slot,) * 3 + (m, 0, 0, 1)
        if shared is not None:
            (s_rows, s_k), s_n = s_w.shape, s_out.shape[1]
            s_load = load_kind_for(skind, s_k, s_x, s_w)
            s_cfg = shared_expert_config(m, s_rows, s_k, skind, cfg.threads, is_gate_up)
            s_mchunks = -(-m // s_cfg.mt)
            s_blocks = s_mchunks * -(-s_n // s_cfg.rows)
            s_args = (blocks, s_x, kernel_weight(s_w, s_load), s_out.reshape(1, m, s_n), m,
                      s_n, -(-s_k // CHUNK), s_mchunks)
            recipe = (cfg, load_kind, is_gate_up, group, chunks, (s_cfg, s_load))
        if groups:
            idx, slot_of_entry = grouping
            if m * top_k > GROUP_IN_BLOCK_ENTRIES:      # the blocks' shared lists' size
                raise ValueError(f"the gate_up blocks group at most {GROUP_IN_BLOCK_ENTRIES} "
                                 f"entries, got {m * top_k}")
            _expert_kernel(cfg, load_kind, True, group, chunks,
                           None if shared is None else (s_cfg, s_load), grouping=n_experts)[
                blocks + s_blocks, cfg.threads, stream](
                idx.reshape(m * top_k), top_k, slot_of_entry, *args, *s_args)
            continue
        if not folds:
            _expert_kernel(*recipe)[blocks + s_blocks, cfg.threads, stream](*args, *s_args)
            continue
        slot_of_entry, wt, y = fold
        width = combine_width(cfg.rows, s_cfg.rows if s_cfg else 1)
        counters = arrival_counters("moe.combine", combine_tiles(d, width), stream)
        _expert_kernel(cfg, load_kind, False, group, chunks,
                       None if shared is None else (s_cfg, s_load), combine=width)[
            blocks + s_blocks, cfg.threads, stream](
            *args, *s_args, slot_of_entry, wt, y_slot if shared is None else s_y, y, counters)


def _experts_tiled(hd, lists, gud, dnd, kind, act, y_slot, max_active, m, top_k, stream,
                   launches=None):
    """gate_up then down with the tiled kernel: grid = (active expert, N tile), the tile's
    weights read once per BM of the expert's tokens; one launch per count class
    (expert_tiled_configs: one class by default)."""
    n_experts, d, inter = dnd.shape
    for mode, x_in, w3, out_buf, n_out, k_in in (
            ("gate_up", hd, gud, act, inter, d), ("down", act, dnd, y_slot, d, inter)):
        load_kind = load_kind_for(kind, k_in, x_in, w3)
        for cfg, cmin, cmax in launches or expert_tiled_configs(m):
            tiles = -(-n_out // (cfg.bn // 2 if mode == "gate_up" else cfg.bn))
            tiled_kernel(cfg, load_kind, mode)[max_active * tiles, cfg.threads, stream](
                x_in, *lists, kernel_weight(w3, load_kind), out_buf, n_out, k_in, tiles,
                cmin, cmax)

"""The routed experts' kernel shapes for layers/moe.py: the weight-streaming expert kernels'
(:func:`expert_config`, the chunk grid's :func:`expert_chunk_bound`; the shared expert's
blocks among them, :func:`shared_in_experts`) and the tiled ones'
(:func:`expert_tiled_configs`).  Host arithmetic on shapes alone: a CUDA graph captures the
launches they shape (no routing is read on the host)."""
from __future__ import annotations

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR
from kdtree_numba.layers.linear import swiglu_fuses
from kdtree_numba.layers.moe_mma import routed_tile_bound
from kdtree_numba.layers.skinny import (ROWS_UNROLL, SkinnyConfig, int4_threads, mt_for,
                                        skinny_config, skinny_threads, swiglu_config)
from kdtree_numba.layers.tiled import TiledConfig

__all__ = ["expert_config", "shared_expert_config", "expert_chunk_bound", "expert_tile",
           "expert_tiled_configs", "shared_in_experts", "int4_skinny_configs"]


def expert_config(m: int, top_k: int, n_experts: int, k_in: int, gate_up: bool,
                  int4: bool = False) -> SkinnyConfig:
    """Kernel shape for the expert GEMMs: mt ~ tokens per active expert; the most rows of
    ROWS_UNROLL (the grid, active experts x tiles, is large already).  ``rows`` counts outputs
    per block: a gate_up block streams 2*rows weight rows (gate and up).  ``int4``: the
    W4A16 kinds, whose chunk of 32 weights is one 16-byte load as a bf16 chunk of 8 is: the
    same rows, one chunk in flight per row (the unpacking's registers), threads from
    int4_threads."""
    mt = mt_for(max(1, -(-m * top_k // min(n_experts, m * top_k))))
    weight_rows, unroll = ROWS_UNROLL[mt][0]
    if SIMULATOR:   # no registers to spare there, but blocks cost: the most rows a block allows
        weight_rows = 32 // mt
    rows = weight_rows // 2 if gate_up else weight_rows
    if int4:   # a chunk is 4 words and a scale; unroll 2 took 168+ registers (ptxas, sm_90)
        return SkinnyConfig(mt=mt, rows=rows, threads=int4_threads(k_in), unroll=1)
    return SkinnyConfig(mt=mt, rows=rows, threads=skinny_threads(k_in), unroll=unroll)


def shared_expert_config(m: int, n_rows: int, k_in: int, wkind: str, threads: int,
                         swiglu: bool) -> SkinnyConfig:
    """The shared expert's blocks in the routed experts' launch (moe._expert_kernel's
    ``shared``): the shape linear() gives an [m, k_in] x [n_rows, k_in]^T product (with
    ``swiglu`` skinny_swiglu's, n_rows = 2I), at the launch's ``threads`` (the routed
    kernel's, from k_in alone), its rows (then x rows) halved until a block's accumulators
    fit them.  Rows and x rows move no bit; the threads do, so the shared expert's rows get
    the bits of a linear at ``threads`` (at every M: batch invariant)."""
    cfg = skinny_config(m, n_rows, k_in, wkind)
    if swiglu:
        cfg = swiglu_config(cfg)
    per_out = 2 if swiglu else 1
    rows, mt = cfg.rows, cfg.mt
    while rows > 1 and mt * rows * per_out > threads:
        rows //= 2
    while mt > 1 and mt * rows * per_out > threads:
        mt //= 2
    return SkinnyConfig(mt=mt, rows=rows, threads=threads, unroll=cfg.unroll,
                        f32_load=cfg.f32_load)


def expert_chunk_bound(m: int, top_k: int, n_experts: int, mt: int) -> int:
    """Blocks per (active expert, N tile) of the chunk grid (``KDTREE_MOE_CHUNK_GRID``):
    min(ceil(M / mt), ceil(2 R / A)), from the shapes alone (no routing read on the host, so
    a CUDA graph captures the launch).  A = min(E, M k) slots, R = moe_mma.routed_tile_bound
    the most mt-chunks any routing of the M k entries needs in all.  An expert holds at most
    M tokens (a token picks k distinct experts), so ceil(M / mt) blocks take every chunk of
    every expert at once; the second term caps the (slot, chunk) blocks at
    A * ceil(2R / A) < 2R + A where at most R can work, so the blocks that exit at once stay
    within about twice the most that work.  Where it binds (many experts, few tokens each:
    Kimi-K2 at a verify's rows, R = A, 2 blocks), an expert past 2 chunks runs the rest in
    its blocks' loop, ceil(chunks / 2) one after another where it ran all of them; so does a
    routing that repeats an expert in a row.  The demo pair (E 8, k 2) gets 3 at M = 9, 17
    and 33: every chunk in a block of its own.  Never below 1."""
    n_entries = m * top_k
    slots = max(1, min(n_experts, n_entries))
    need = routed_tile_bound(n_entries, n_experts, mt)
    return max(1, min(-(-m // mt), -(-2 * need // slots)))


def expert_tile() -> TiledConfig:
    """The expert GEMM tile: BM = 32 rows (4 warps along M, one 8-row group each) by BN = 256
    (32 lanes along N: 128 gate + 128 up outputs), so a warp with no live row skips its FMAs
    and one with 1-4 live rows does half of them."""
    return (TiledConfig(wm=1, wn=1, ly=1, tm=4, tn=8, bk=8) if SIMULATOR else
            TiledConfig(wm=4, wn=1, ly=1, tm=8, tn=8, bk=16))


def expert_tiled_configs(m: int):
    """[(TiledConfig, cmin, cmax)]: the launches of one tiled expert GEMM, each for the
    experts holding cmin <= count < cmax tokens (the others' blocks exit at once).  One launch
    of :func:`expert_tile` for every count: an expert's tokens go through it in chunks of BM.
    Plans with two size classes (a bigger tile for the popular experts) were slower on a
    router-picked Kimi-K2 batch: the popular experts' one pass over their weights did not pay
    for running the two classes one after the other (dev/cuda/layers.py keeps them)."""
    return [(expert_tile(), 1, 1 << 30)]


def shared_in_experts(method: str, m: int, tiled: bool, sgu, sdn) -> bool:
    """Whether the shared expert's blocks ride in the routed experts' two launches
    (``KDTREE_SHARED_IN_EXPERTS``, moe._expert_kernel's ``shared``): where the routed experts
    stream their weights and linear() would stream both of the shared expert's (so up to
    where linear turns tiled its rows keep one kernel at every M).  With bf16 or float32
    routed experts the launch runs at the threads linear() picks (both from K alone): the
    same bits; with int4 experts at theirs (int4_threads): other bits, within the bound."""
    return (runtime.current().shared_in_experts and not tiled
            and all(swiglu_fuses(method, m, w) for w in (sgu, sdn)))


def int4_skinny_configs(kind: str, configs):
    """``configs`` where it is the int4 weight-streaming kernels' (gate_up, down) pair of
    SkinnyConfigs (benchmarks' variants), else None (the shapes expert_config picks)."""
    if kind == "i4" and isinstance(configs, tuple) and len(configs) == 2 and all(
            isinstance(c, SkinnyConfig) for c in configs):
        return configs
    return None

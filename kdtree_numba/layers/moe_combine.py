"""The MoE's combine in the tail of the routed experts' down launch (``KDTREE_COMBINE_IN_DOWN``,
layers/moe.py): ``out[m] = shared_y[m] + sum_j weight[m, j] y_slot[slot(m, j)]``, in j order,
the arithmetic of moe.py's combine kernel (its launch of its own) in the same order: the same
bits.  In the down launch each block that finishes a combine tile (``C`` output columns of
every token) counts itself in that tile's arrival counter; the block that arrives last --
every routed (expert, chunk) block and shared-expert block that writes the tile's columns has
then fenced its writes -- combines the tile's columns and sets the counter back to 0 for the
next call (and the next replay of a CUDA graph): one launch fewer a MoE layer, the combine's
reads spread over the tiles' last blocks while the other blocks still stream weights.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.compat import cuda, device_function
from kdtree_numba.gpu.counters import last_to_arrive
from kdtree_numba.gpu.memory import load_l2_f32
from kdtree_numba.layers.skinny import SkinnyConfig, make_skinny_block

__all__ = ["combining_rows", "routed_first", "shared_block_or_none", "make_tile_combine",
           "combine_tiles", "combine_width"]


@device_function(inline="always")
def _combined(y_slot, slot_of_entry, weight, shared_y, has_shared, m, d):
    """One output: shared_y[m, d] (``has_shared``) + sum_j weight[m, j] y_slot[slot, d] over
    the entry's valid slots, in j order (moe._combine_kernel's expression).  y_slot and
    shared_y through L2: other blocks of the same launch wrote them."""
    top_k = weight.shape[1]
    total = load_l2_f32(shared_y, (m, d)) if has_shared else np.float32(0.0)
    for j in range(top_k):
        s = slot_of_entry[m * top_k + j]
        if s >= 0:
            total += weight[m, j] * load_l2_f32(y_slot, (s, d))
    return total


def combine_width(routed_rows: int, shared_rows: int = 1) -> int:
    """A combine tile's columns: a multiple of both blocks' outputs (powers of two)."""
    return max(routed_rows, shared_rows)


def combine_tiles(d: int, width: int) -> int:
    """Arrival counters of a down launch that combines in its tail: tiles of ``width``
    columns over D."""
    return -(-d // width)


def make_tile_combine(width: int, threads: int, has_shared: bool, routed_rows: int,
                      chunks: int, shared_rows: int):
    """``arrive(tile, n_active, s_mchunks, y_slot, slot_of_entry, weight, shared_y, out,
    counters)``, called by every thread of a down block after it wrote its outputs of combine
    tile ``tile`` (columns ``width`` tile .. + width - 1, ``width`` a multiple of the routed
    blocks' ``routed_rows`` outputs and, ``has_shared``, the shared expert's blocks'
    ``shared_rows``).  The tile's writers: each of the ``max(n_active, 1)`` active experts'
    ``chunks`` blocks per routed N tile in it (with no active expert, the blocks of slot 0
    arrive having written nothing, so the tile is still combined), and ``s_mchunks`` shared
    blocks per shared N tile in it.  The last of them to arrive writes out[:, tile columns]
    and resets counters[tile]."""
    per_shared = shared_rows if has_shared else 1

    @device_function(inline="always")
    def arrive(tile, n_active, s_mchunks, y_slot, slot_of_entry, weight, shared_y, out,
               counters):
        m_total, n_out = out.shape
        c0 = tile * width
        n_cols = min(c0 + width, n_out) - c0
        expected = max(n_active, 1) * chunks * ((n_cols + routed_rows - 1) // routed_rows)
        if has_shared:
            expected += s_mchunks * ((n_cols + per_shared - 1) // per_shared)
        t = cuda.threadIdx.x
        if last_to_arrive(counters, tile, expected):
            for i in range(t, m_total * n_cols, threads):
                m = i // n_cols
                d = c0 + i - m * n_cols
                out[m, d] = _combined(y_slot, slot_of_entry, weight, shared_y, has_shared, m, d)
            if t == 0:
                counters[tile] = 0
    return arrive


def combining_rows(expert_block, cfg: SkinnyConfig, chunks: int, shared, width: int):
    """The down launch's body under ``KDTREE_COMBINE_IN_DOWN`` (moe._expert_kernel's
    ``combine``, its ``expert_block`` a routed block's share): each routed block (and, with
    ``shared``, each shared-expert block after them, or before with ``cfg.shared_first``)
    does its work, then arrives at the combine tile of each N tile it wrote; the last writer
    of a tile combines it into ``y`` (:func:`make_tile_combine`).  Routed blocks
    past the active experts exit at once, as in the plain launch, but with no active expert
    slot 0's arrive, so that the shared expert's output (or zeros) still reaches ``y``."""
    r_out, span = cfg.rows, cfg.span
    has_shared = shared is not None
    shared_first = has_shared and cfg.shared_first
    s_rows = shared[0].rows if has_shared else 1
    arrive = make_tile_combine(width, cfg.threads, has_shared, r_out, chunks, s_rows)
    shared_block = shared_block_or_none(shared, False)

    def expert_rows_combined(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out,
                             c1, tiles, routed_blocks, xs, s_w, s_out, m_total, s_n_out, s_k8,
                             s_mchunks, slot_of_entry, weight, shared_y, y, counters):
        """_expert_kernel's arguments (the shared expert's: any arrays without one), then
        the combine's: ``shared_y`` [M, D] is s_out's matrix (any float32 matrix without a
        shared expert)."""
        bid = routed_first(cuda.blockIdx.x, routed_blocks, shared_first)
        n_act = n_active[0]
        if bid < routed_blocks:
            at = bid // chunks
            spans = (tiles + span - 1) // span
            a = at // spans
            if a >= max(n_act, 1):
                return
            expert_block(x, token_of_slot, offsets, active, n_active, w3, s3, out, n_out, c1,
                         tiles, bid)       # (writes nothing where a >= n_act)
            first = (at - a * spans) * span
            for tile in range(first, min(first + span, tiles)):
                arrive((tile * r_out) // width, n_act, s_mchunks, out, slot_of_entry, weight,
                       shared_y, y, counters)
        elif has_shared:
            sb = bid - routed_blocks
            shared_block(xs, s_w, s_out, m_total, s_n_out, s_k8, s_mchunks, 1, sb)
            arrive(((sb // s_mchunks) * s_rows) // width, n_act, s_mchunks, out,
                   slot_of_entry, weight, shared_y, y, counters)
    return expert_rows_combined


def shared_block_or_none(shared, gate_up: bool):
    """The shared expert's block of a routed launch (skinny.make_skinny_block over
    ``shared`` = its (SkinnyConfig, load kind)), or, with none, a block never called."""
    return make_skinny_block(*shared, gate_up) if shared is not None else _no_block


@device_function(inline="always")
def routed_first(bid, routed_blocks, shared_first):
    """The block's index in the routed-then-shared order: with ``shared_first`` the grid's
    first blocks are the shared expert's."""
    if not shared_first:
        return bid
    s_blocks = cuda.gridDim.x - routed_blocks
    return bid - s_blocks if bid >= s_blocks else routed_blocks + bid


@device_function(inline="always")
def _no_block(xs, s_w, s_out, m_total, s_n_out, s_k8, s_mchunks, splits, bid):
    """The shared expert's block where there is none (never called)."""

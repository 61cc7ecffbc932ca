"""The MoE's grouping made inside the routed experts' gate_up launch (``KDTREE_GROUP_IN_EXPERTS``,
layers/moe.py): where the M k (token, expert) entries are few (a decode's, a small verify's: up
to :data:`GROUP_IN_BLOCK_ENTRIES`), each routed block of the gate_up launch ranks them itself in
shared memory instead of reading the lists of a grouping launch (moe.py's counting sort):

* entry i of a valid expert e (0 <= e < E) takes slot ``#{valid j: e_j < e} + #{j < i: e_j == e}``
  and the slot's token is i // k (an invalid expert: slot -1, as the grouping kernel gives);
* the active experts in increasing order, ``offsets[e]`` / ``offsets[e + 1]`` the first and
  one past the last slot of each active expert (the only entries the expert kernels read).

The launch's first routed block also writes these lists to memory for the down launch and the
combine.  The slots of one expert come in entry order where the grouping kernel's atomics give
some order; every slot has its own sums and the combine adds an entry's slots in entry order,
so the outputs are the grouping launch's bits: one launch fewer a MoE layer.  The ranking is
O(n^2) in the entries, each thread an entry: cheap up to the bound, beside the weight stream.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.compat import cuda, device_function
from kdtree_numba.layers.moe_combine import routed_first, shared_block_or_none
from kdtree_numba.layers.skinny import SkinnyConfig

__all__ = ["GROUP_IN_BLOCK_ENTRIES", "make_block_lists", "grouping_rows"]

# The most M k entries the blocks rank themselves: a decode at top-8 (8) up to 8 tokens (64);
# past it the grouping launch's counting sort
GROUP_IN_BLOCK_ENTRIES = 64


def make_block_lists(n_experts: int, max_entries: int, threads: int):
    """``lists(idx_flat, top_k, slot, tok, off, act, n_act)``, called by every thread of a
    block (``threads`` of them): the grouping of the ``len(idx_flat) <= max_entries`` entries
    into the block's shared arrays -- ``slot`` [entry] (-1: an invalid expert), ``tok``
    [slot], ``act`` [active index], ``n_act[0]``, and ``off`` [E + 1] at each active expert e
    and e + 1 (module docstring); ends with a block barrier, the lists then readable by every
    thread."""
    @device_function(inline="always")
    def lists(idx_flat, top_k, slot, tok, off, act, n_act):
        t = cuda.threadIdx.x
        n = idx_flat.shape[0]
        first = cuda.shared.array(max_entries, np.int32)     # 1: the first entry of its expert
        e_of = cuda.shared.array(max_entries, np.int32)
        for i in range(t, n, threads):
            e = idx_flat[i]
            e_of[i] = e if 0 <= e < n_experts else -1
        cuda.syncthreads()
        for i in range(t, n, threads):
            e = e_of[i]
            below = 0
            before = 0
            for j in range(n):
                f = e_of[j]
                if f >= 0 and f < e:
                    below += 1
                elif f == e and j < i:
                    before += 1
            first[i] = 1 if e >= 0 and before == 0 else 0
            slot[i] = below + before if e >= 0 else -1
            if e >= 0:
                tok[below + before] = i // top_k
        cuda.syncthreads()
        for i in range(t, n, threads):
            e = e_of[i]
            if first[i] == 1:
                rank = 0           # active experts below e: the first entries of smaller ones
                count = 0
                after = 0          # entries of expert e + 1, which then writes off[e + 1]
                for j in range(n):
                    f = e_of[j]
                    if f >= 0 and f < e and first[j] == 1:
                        rank += 1
                    if f == e:
                        count += 1
                    if f == e + 1:
                        after += 1
                act[rank] = e
                start = slot[i]           # its expert's first slot (no entry of e before it)
                off[e] = start
                if after == 0:            # (one writer a word: no race for racecheck)
                    off[e + 1] = start + count
        if t == 0:
            distinct = 0
            for j in range(n):
                distinct += first[j]
            n_act[0] = distinct
        cuda.syncthreads()
    return lists


@device_function(inline="always")
def _write_lists(idx_flat, slot, tok, off, act, n_act, slot_of_entry, token_of_slot, offsets,
                 active, n_active, threads):
    """The block's lists into the arrays the down launch and the combine read."""
    t = cuda.threadIdx.x
    for i in range(t, idx_flat.shape[0], threads):
        s = slot[i]
        slot_of_entry[i] = s
        if s >= 0:
            token_of_slot[s] = tok[s]
    n = n_act[0]
    for a in range(t, n, threads):
        e = act[a]
        active[a] = e
        offsets[e] = off[e]
        if a == n - 1 or act[a + 1] != e + 1:      # else expert e + 1's start writes it
            offsets[e + 1] = off[e + 1]
    if t == 0:
        n_active[0] = n_act[0]


def grouping_rows(expert_block, cfg: SkinnyConfig, shared, n_experts: int, max_entries: int):
    """The gate_up launch's body under ``KDTREE_GROUP_IN_EXPERTS`` (moe._expert_kernel's
    ``grouping``, its ``expert_block`` a routed block's share): each routed block groups the
    entries in shared memory (:func:`make_block_lists`) and runs its share on those lists; the
    first routed block writes them out; with ``shared`` the shared expert's blocks follow (or
    lead, ``cfg.shared_first``) as in the plain launch."""
    threads = cfg.threads
    has_shared = shared is not None
    shared_first = has_shared and cfg.shared_first
    lists = make_block_lists(n_experts, max_entries, threads)
    shared_block = shared_block_or_none(shared, True)
    n_off = n_experts + 1          # (a shared array's shape must be a constant)

    def expert_rows_grouping(idx_flat, top_k, slot_of_entry, x, token_of_slot, offsets,
                             active, n_active, w3, s3, out, n_out, c1, tiles, routed_blocks,
                             xs, s_w, s_out, m_total, s_n_out, s_k8, s_mchunks):
        """The grouping's inputs and outputs, then _expert_kernel's arguments (the shared
        expert's: any arrays without one)."""
        bid = routed_first(cuda.blockIdx.x, routed_blocks, shared_first)
        if bid < routed_blocks:
            slot = cuda.shared.array(max_entries, np.int32)
            tok = cuda.shared.array(max_entries, np.int32)
            act = cuda.shared.array(max_entries, np.int32)
            off = cuda.shared.array(n_off, np.int32)
            n_act = cuda.shared.array(1, np.int32)
            lists(idx_flat, top_k, slot, tok, off, act, n_act)
            if bid == 0:
                _write_lists(idx_flat, slot, tok, off, act, n_act, slot_of_entry,
                             token_of_slot, offsets, active, n_active, threads)
            expert_block(x, tok, off, act, n_act, w3, s3, out, n_out, c1, tiles, bid)
        elif has_shared:
            shared_block(xs, s_w, s_out, m_total, s_n_out, s_k8, s_mchunks, 1,
                         bid - routed_blocks)
    return expert_rows_grouping

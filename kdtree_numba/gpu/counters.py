"""Arrival counters of the kernels whose last block to finish a tile completes it (the MoE's
combine in its down launch, layers/moe_combine.py; the bf16 GEMM's K slices added by their last
block, layers/mma.py, and its stream-K tiles cut between blocks, layers/mma_tma.py): int32
device arrays kept for the process, zeroed once when made, and set back to 0 by the block
that uses each counter last, so that the next launch -- or a CUDA graph's next replay --
counts from 0.

Why not a workspace buffer: the engine's ops make a fresh workspace per call, and a buffer
made inside a graph's capture cannot be zeroed by a host upload (the capture would record a
copy from host memory gone by the replay).  Here the zeroing is a kernel on the caller's
stream, captured where the first use is a capture (that graph then zeroes them before each
replay's use: harmless, they are 0 there).  Arrays are never freed (a captured graph may
read them); a larger request makes a larger array.  One array serves every launch of a kind:
launches run in stream order here (the legacy stream, or a capture's blocking stream:
kdtree_numba/gpu/pool.py), so two never count in it at once.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba import compat
from kdtree_numba.compat import cuda, device_function, kernel
from kdtree_numba.gpu.tma import context_key, group_sync_or

__all__ = ["arrival_counters", "last_to_arrive", "group_last_to_arrive", "made"]

_KEPT: dict = {}          # (context, name) -> [arrays, the largest last]


@kernel
def _zero(counters):
    i = cuda.grid(1)
    if i < counters.shape[0]:
        counters[i] = 0


def arrival_counters(name: str, n: int, stream=0):
    """At least ``n`` zeroed int32 counters for the kernels of kind ``name`` in this CUDA
    context (module docstring)."""
    key = (context_key(), name)
    kept = _KEPT.setdefault(key, [])
    if kept and kept[-1].shape[0] >= n:
        return kept[-1]
    size = max(64, 1 << (max(n, 1) - 1).bit_length())
    counters = compat.device_empty((size,), np.int32, stream)
    _zero[-(-size // 256), 256, stream](counters)
    kept.append(counters)
    return counters


def made(name: str) -> list:
    """Every counter array of kind ``name`` made so far (tests check they are back at 0)."""
    return [a for (_, kind), arrays in _KEPT.items() if kind == name for a in arrays]


@device_function(inline="always")
def last_to_arrive(counters, at, expected):
    """Called by every thread of a block that has written its share of counter ``at``'s work
    (``expected`` blocks write it): fences the block's writes and counts the block; True in
    every thread of the block that arrived last, which then reads the others' writes through
    L2 and, when done, sets counters[at] back to 0."""
    cuda.threadfence()          # every thread's writes reach L2 (fenced) ...
    cuda.syncthreads()          # ... before thread 0 counts the block
    last = 0
    if cuda.threadIdx.x == 0:
        last = int(cuda.atomic.add(counters, at, 1) == expected - 1)
    if cuda.syncthreads_or(last):       # every other writer's writes are in L2
        cuda.threadfence()
        return True
    return False


@device_function(inline="always")
def group_last_to_arrive(counters, at, amount, expected, bars, barrier, threads, leader):
    """:func:`last_to_arrive` for a group of ``threads`` threads (a consumer warpgroup) that
    synchronises on named barrier ``barrier`` (gpu/tma.py's ``group_sync_or``; ``bars`` the
    block's mbarrier array, which the simulator's twin keys it by) while the rest of its
    block runs on; the group adds ``amount`` of counter ``at``'s ``expected`` (its share of
    the work: the groups need not be counted one by one) and the thread with ``leader`` set
    counts it."""
    cuda.threadfence()
    group_sync_or(bars, barrier, threads, 0)
    last = 0
    if leader:
        last = int(cuda.atomic.add(counters, at, amount) + amount == expected)
    if group_sync_or(bars, barrier, threads, last):
        cuda.threadfence()
        return True
    return False

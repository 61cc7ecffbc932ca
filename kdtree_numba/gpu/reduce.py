"""Reductions across threads: block reductions, shared-memory tree reductions, lane-group
reductions, and the barrier helpers they rest on.

Each exists because a kernel family needs a fixed summation order (results are bit-exact
across runs and batch sizes, docs/LAYERS.md) and numba offers no block or warp reduction.  On
the GPU the warp steps are xor shuffles; the simulator has no shuffles, so there the factories
below build twins that exchange through shared memory fenced by syncthreads (every thread of
the block must call them), or sum in lane order where that is the faster equivalent.

Two tree reductions over a shared array exist and stay apart because they generate different
code: ``tree_reduce`` ends each level with a block barrier, ``block_max_f32`` drops to a warp
barrier once a level fits in a warp (``span_barrier``).
"""
from __future__ import annotations

import functools

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.warp import FULL_MASK, WARP, syncwarp

__all__ = ["block_reduce_scratch_shape", "make_block_reduce", "tree_reduce", "span_barrier",
           "stage_barrier", "block_max_f32", "make_row_group_reducers", "make_reduce_scatter"]

_ZERO = np.float32(0.0)


# ----------------------------------------------------------------------------- block reduction
# A warp "reduce-scatter" butterfly: at each of the 5 xor steps a lane keeps half of its values
# and receives the partner's copy of that half, so NACC values need NACC-1 shuffles in all
# (not 5*NACC).  Then one shared-memory pass sums the warps, in warp order.

def block_reduce_scratch_shape(nacc, threads):
    """Shared scratch for the simulator's reductions (a 1x1 dummy on the GPU, never used)."""
    return (max(nacc, 1), threads) if SIMULATOR else (1, 1)


def _make_halving_step(mask, half):
    if SIMULATOR:
        def step(acc, lane, scratch):
            t = cuda.threadIdx.x
            upper = (lane & mask) != 0
            for i in range(half):
                scratch[i, t] = acc[i] if upper else acc[i + half]
            cuda.syncthreads()
            for i in range(half):
                keep = acc[i + half] if upper else acc[i]
                acc[i] = keep + scratch[i, t ^ mask]
            cuda.syncthreads()
    else:
        def step(acc, lane, scratch):
            upper = (lane & mask) != 0
            for i in range(half):
                send = acc[i] if upper else acc[i + half]
                keep = acc[i + half] if upper else acc[i]
                acc[i] = keep + cuda.shfl_xor_sync(0xFFFFFFFF, send, mask)
    return device_function(step)


def _make_allreduce_step(mask):
    if SIMULATOR:
        def step(acc, lane, scratch):
            t = cuda.threadIdx.x
            scratch[0, t] = acc[0]
            cuda.syncthreads()
            acc[0] = acc[0] + scratch[0, t ^ mask]
            cuda.syncthreads()
    else:
        def step(acc, lane, scratch):
            acc[0] = acc[0] + cuda.shfl_xor_sync(0xFFFFFFFF, acc[0], mask)
    return device_function(step)


@functools.cache
def make_block_reduce(nacc: int, threads: int, butterfly: bool = not SIMULATOR):
    """``block_reduce(acc, red, scratch)``: afterwards ``red[WARPS, i]`` = block sum of acc[i].

    ``red`` is a shared [WARPS+1, NACC] float32 array, ``scratch`` a shared
    ``block_reduce_scratch_shape(nacc, threads)`` array; ``nacc`` a power of two <= 32*threads.
    On the GPU (``butterfly``) the summation tree depends only on ``threads``, never on which
    value is which.  The simulator sums lanes in order instead (2 barriers rather than 12:
    barriers are what is slow there); tests run the butterfly in the simulator too, with
    emulated shuffles.
    """
    warps = threads // 32
    if not butterfly:
        @device_function
        def block_reduce_in_order(acc, red, scratch):
            t = cuda.threadIdx.x
            for i in range(nacc):
                scratch[i, t] = acc[i]
            cuda.syncthreads()
            for i in range(t, nacc, threads):
                total = scratch[i, 0]
                for lane in range(1, threads):
                    total += scratch[i, lane]
                red[warps, i] = total
            cuda.syncthreads()
        return block_reduce_in_order

    steps, have, halvings = [], nacc, 0
    for mask in (16, 8, 4, 2, 1):
        if have > 1:
            steps.append(_make_halving_step(mask, have // 2))
            have //= 2
            halvings += 1
        else:
            steps.append(_make_allreduce_step(mask))
    keep, shift = have, 5 - halvings          # lane l ends with values [(l>>shift)*keep, +keep)
    writer_mask = (1 << shift) - 1
    s0, s1, s2, s3, s4 = steps

    @device_function
    def block_reduce(acc, red, scratch):
        t = cuda.threadIdx.x
        lane = t & 31
        s0(acc, lane, scratch)
        s1(acc, lane, scratch)
        s2(acc, lane, scratch)
        s3(acc, lane, scratch)
        s4(acc, lane, scratch)
        if (lane & writer_mask) == 0:
            base = (lane >> shift) * keep
            for i in range(keep):
                red[t >> 5, base + i] = acc[i]
        cuda.syncthreads()
        for i in range(t, nacc, threads):
            total = red[0, i]
            for wp in range(1, warps):
                total += red[wp, i]
            red[warps, i] = total
        cuda.syncthreads()
    return block_reduce


# ----------------------------------------------------------------------------- shared-memory trees

@device_function
def tree_reduce(buf, t, threads, take_max):
    """buf[0] = max or sum of buf[0:threads] (threads a power of two); ends synchronised."""
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if t < stride:
            if take_max:
                buf[t] = max(buf[t], buf[t + stride])
            else:
                buf[t] = buf[t] + buf[t + stride]
        cuda.syncthreads()
        stride //= 2


@device_function
def span_barrier(span):
    """Barrier after a step whose reads and writes lie within ``span`` consecutive threads'
    data: a warp barrier when span <= WARP, else a block barrier.  span 0 means 'the block'."""
    if span == 0 or span > WARP:
        cuda.syncthreads()
    else:
        syncwarp()


@device_function
def stage_barrier(stride, next_stride):
    """Barrier between two bitonic stages.  With pairs p -> (lo, lo + stride) and pair p handled
    by thread p mod threads, a warp's WARP consecutive pairs stay inside one aligned 2*WARP
    segment when stride <= WARP, so two such stages in a row only synchronise the warp;
    next_stride 0 ends the network."""
    if next_stride == 0:
        cuda.syncthreads()
    else:
        span_barrier(max(stride, next_stride))


# Level ``stride`` is written by threads < stride and read at the next level by threads <
# stride / 2: a warp barrier suffices once stride <= WARP.  Ends with a block barrier so the
# scratch array can be reused.
@device_function
def block_max_f32(red, value, t, threads):
    """The max of ``value`` over the block's ``threads`` threads (a power of two), via the
    shared array ``red``; every thread gets it."""
    red[t] = value
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if t < stride:
            red[t] = max(red[t], red[t + stride])
        span_barrier(stride)
        stride //= 2
    cuda.syncthreads()
    result = red[0]
    cuda.syncthreads()
    return result


# ----------------------------------------------------------------------------- lane groups

def make_row_group_reducers(tpr: int, rpw: int, scratch_off: int):
    """(max, sum) over the ``tpr`` lanes lane % rpw + rpw*k of a warp that share one row.

    On the GPU: xor shuffles.  In the simulator (no warp intrinsics): a shared-memory scratch of
    one float per thread, fenced by syncthreads, so every thread must call it.
    """
    if SIMULATOR:
        def gather(x, smem, tid, use_max):
            cuda.syncthreads()
            smem[scratch_off + tid] = x
            cuda.syncthreads()
            first = scratch_off + tid - tid % 32 + tid % rpw
            r = smem[first]
            for k in range(1, tpr):
                v = smem[first + rpw * k]
                r = max(r, v) if use_max else r + v
            return r

        # device functions even here: the simulator points ``cuda`` at its fake module only in
        # the globals of the kernel's module and of device functions being called, and this
        # module is not the kernel's.
        @device_function
        def row_max(x, smem, tid):
            return gather(x, smem, tid, True)

        @device_function
        def row_sum(x, smem, tid):
            return gather(x, smem, tid, False)
        return row_max, row_sum

    steps = tpr.bit_length() - 1  # tpr is a power of two

    @device_function
    def row_max(x, smem, tid):
        for k in range(steps):
            x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, rpw << k))
        return x

    @device_function
    def row_sum(x, smem, tid):
        for k in range(steps):
            x += cuda.shfl_xor_sync(FULL_MASK, x, rpw << k)
        return x
    return row_max, row_sum


def make_reduce_scatter(values: int, k_lanes: int, scratch_off: int):
    """``reduce_scatter(sc, ks, own0, smem, tid)``: sum ``sc[0:values]`` over the ``k_lanes``
    lanes ``lane ^ m`` (m < k_lanes, ``ks = lane % k_lanes``) that hold partial sums of the same
    block; afterwards the lane holds ``values / k_lanes`` complete sums in ``sc[0:own]``: block
    entries ``own0 + x``, where ``own0`` (computed by the caller from ks) adds ``values / 2^(s+1)``
    for every halving step s whose distance bit ``2^s`` is set in ks (that lane keeps the upper
    half).

    GPU: log2(k_lanes) xor-shuffle halvings, each lane sending the half it gives away (the
    halving step of ``make_block_reduce``, force-inlined).  Simulator: a shared scratch of
    ``values`` floats per thread, fenced by syncthreads.
    """
    steps = k_lanes.bit_length() - 1
    own = values // k_lanes
    if SIMULATOR:
        @device_function   # as in make_row_group_reducers: so the simulator's cuda is seen
        def reduce_scatter(sc, ks, own0, smem, tid):
            base = scratch_off + tid * values
            for x in range(values):
                smem[base + x] = sc[x]
            cuda.syncthreads()
            first = scratch_off + (tid - ks) * values + own0
            for x in range(own):
                total = _ZERO
                for m in range(k_lanes):
                    total += smem[first + m * values + x]
                sc[x] = total
            cuda.syncthreads()
        return reduce_scatter

    def make_step(half, dist):
        @inline_device_function
        def step(sc, ks):
            upper = (ks & dist) != 0
            for i in range(half):
                send = sc[i] if upper else sc[i + half]
                keep = sc[i + half] if upper else sc[i]
                sc[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, dist)
        return step

    @inline_device_function
    def no_step(sc, ks):
        pass

    s1, s2, s3 = [make_step(values >> (k + 1), 1 << k) if k < steps else no_step
                  for k in range(3)]

    @inline_device_function
    def reduce_scatter(sc, ks, own0, smem, tid):
        s1(sc, ks)
        s2(sc, ks)
        s3(sc, ks)
    return reduce_scatter

"""Warp primitives (shuffles, ballot, any, syncwarp, ``redux``) with their simulator twins.

On the GPU these are numba's full-mask warp intrinsics, plus ``redux.sync`` as inline PTX
(sm_80+; numba exposes no redux).  The CUDA simulator has no warp intrinsics at all, so there
each simulated warp (``WARP`` = 4 threads, so that tiny simulator blocks hold several warps)
exchanges values through a Python barrier of its own lanes: the same kernel bodies then run in
both places, warp-divergent control flow included (a syncthreads-based stand-in would need
block-uniform calls).  Callers call every primitive with all lanes of the warp, as the
full-mask intrinsics require.

The simulator runs 4-lane warps (fast); ``KDTREE_SIM_WARP=32`` runs the GPU's warp width there,
to debug the index arithmetic of the real configuration with bounds-checked arrays.  Kernels
whose layout assumes 32 lanes (the GEMMs, attention) write 32 and emulate their shuffles with
shared memory in the simulator instead (``kdtree_numba.gpu.reduce``).
"""
from __future__ import annotations

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, device_function

__all__ = ["WARP", "FULL_MASK", "syncwarp", "shfl_xor", "shfl_xor4", "shfl_idx", "ballot", "warp_any",
           "warp_max_f32", "warp_sum_f64", "redux_max2", "ballot2", "shfl_idx_pairs"]

WARP = runtime.current().sim_warp if SIMULATOR else 32
FULL_MASK = 0xFFFFFFFF

if SIMULATOR:
    import threading
    import weakref

    _SIM_TIMEOUT_S = 600.0   # a deadlocked simulated warp fails loudly instead of hanging

    class _SimWarp:
        """One simulated warp: a barrier of its lanes and two slot arrays used alternately, so a
        lane may write call n+1's value while slower lanes still read call n's."""

        def __init__(self, lanes: int):
            self.barrier = threading.Barrier(lanes)
            self.slots = ([None] * lanes, [None] * lanes)
            self.phase = [0] * lanes

    _sim_lock = threading.Lock()
    _sim_warps = weakref.WeakKeyDictionary()   # block manager -> {warp index: _SimWarp}

    def _sim_warp():
        thread = threading.current_thread()
        w, lane = divmod(thread.thread_id, WARP)
        manager = thread._manager
        with _sim_lock:
            warps = _sim_warps.setdefault(manager, {})
            if w not in warps:
                total = int(np.prod(manager._block_dim))
                warps[w] = _SimWarp(min(WARP, total - w * WARP))
            return warps[w], lane

    def _exchange(value):
        warp, lane = _sim_warp()
        slots = warp.slots[warp.phase[lane]]
        warp.phase[lane] ^= 1
        slots[lane] = value
        warp.barrier.wait(_SIM_TIMEOUT_S)
        return slots, lane

    def syncwarp():
        _sim_warp()[0].barrier.wait(_SIM_TIMEOUT_S)

    def shfl_xor(value, offset):
        slots, lane = _exchange(value)
        return slots[lane ^ offset]

    def shfl_idx(value, src):
        return _exchange(value)[0][src]

    def ballot(predicate):
        return np.int64(sum(1 << i for i, p in enumerate(_exchange(bool(predicate))[0]) if p))

    def warp_any(predicate):
        return any(_exchange(bool(predicate))[0])
else:
    @device_function
    def syncwarp():
        cuda.syncwarp(FULL_MASK)

    @device_function
    def shfl_xor(value, offset):
        return cuda.shfl_xor_sync(FULL_MASK, value, offset)

    @device_function
    def shfl_idx(value, src):
        return cuda.shfl_sync(FULL_MASK, value, src)

    @device_function
    def ballot(predicate):
        # numba-cuda types ballot_sync as int32: lane 31's bit is the sign, and widening it
        # sign-extends (popc then counts 32 extra bits).  Return the mask as a non-negative int64.
        return np.int64(cuda.ballot_sync(FULL_MASK, predicate)) & np.int64(0xFFFFFFFF)

    @device_function
    def warp_any(predicate):
        return cuda.any_sync(FULL_MASK, predicate)


if SIMULATOR:
    def shfl_xor4(a, b, c, d, offset):
        """Four values from lane ``lane ^ offset``: one exchange in the simulator, where each
        costs a Python barrier (~10 ms), four shuffles on the GPU."""
        return shfl_xor((a, b, c, d), offset)
else:
    @device_function
    def shfl_xor4(a, b, c, d, offset):
        return (shfl_xor(a, offset), shfl_xor(b, offset), shfl_xor(c, offset),
                shfl_xor(d, offset))


@device_function
def warp_max_f32(value):
    offset = WARP // 2
    while offset > 0:
        value = max(value, shfl_xor(value, offset))
        offset //= 2
    return value


@device_function
def warp_sum_f64(value):
    """Butterfly sum; lanes may differ in the last bit (different orders): use one lane's."""
    offset = WARP // 2
    while offset > 0:
        value += shfl_xor(value, offset)
        offset //= 2
    return value


# ``redux_max_u32(v)``: the max of v over the warp's lanes in one instruction
# (``redux.sync.max.u32``, sm_80+; GPU only).  ``redux_max2``, ``ballot2`` and
# ``shfl_idx_pairs`` do two of their kind at once: one exchange (a Python barrier, ~10 ms) in the
# simulator, where the tree builder's tests would otherwise take minutes.
if SIMULATOR:
    def redux_max2(x, y):
        values = _exchange((int(x), int(y)))[0]
        return np.uint32(max(v[0] for v in values)), np.uint32(max(v[1] for v in values))

    def ballot2(p, q):
        values = _exchange((bool(p), bool(q)))[0]
        return (np.int64(sum(1 << i for i, v in enumerate(values) if v[0])),
                np.int64(sum(1 << i for i, v in enumerate(values) if v[1])))

    def shfl_idx_pairs(sa, ia, src_a, sc, ic, src_c):
        """(sa, ia) of lane src_a and (sc, ic) of lane src_c."""
        values = _exchange((sa, ia, sc, ic))[0]
        return values[src_a][0], values[src_a][1], values[src_c][2], values[src_c][3]
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    __all__ += ["redux_max_u32", "shfl_xor16_f32x4"]   # GPU only

    @intrinsic
    def redux_max_u32(typingctx, value):
        sig = types.uint32(types.uint32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            redux = ir.InlineAsm(fnty, "redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r",
                                 side_effect=True)
            return builder.call(redux, args)

        return sig, codegen

    @device_function
    def redux_max2(x, y):
        return redux_max_u32(x), redux_max_u32(y)

    @device_function
    def ballot2(p, q):
        return ballot(p), ballot(q)

    @device_function
    def shfl_idx_pairs(sa, ia, src_a, sc, ic, src_c):
        """(sa, ia) of lane src_a and (sc, ic) of lane src_c."""
        return (shfl_idx(sa, src_a), shfl_idx(ia, src_a), shfl_idx(sc, src_c),
                shfl_idx(ic, src_c))

    @device_function
    def shfl_xor16_f32x4(s0, s1, s2, s3, scratch):
        """Four values from the lane 16 away (the other half-warp); ``scratch`` is unused here,
        it is the shared array a simulator stand-in exchanges through (GPU only)."""
        return (cuda.shfl_xor_sync(0xFFFFFFFF, s0, 16), cuda.shfl_xor_sync(0xFFFFFFFF, s1, 16),
                cuda.shfl_xor_sync(0xFFFFFFFF, s2, 16), cuda.shfl_xor_sync(0xFFFFFFFF, s3, 16))

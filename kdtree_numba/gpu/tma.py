"""The Tensor Memory Accelerator (TMA) and shared-memory mbarriers (sm_90), for kernels whose
warps split into a producer that stages tiles and consumers that multiply them.

Why: the bf16 GEMM's cp.async staging kept every thread issuing copies and waiting on them
between its warpgroup mma (Nsight Compute, run 202: 40% of its stalls on cp.async's
scoreboards, the tensor pipe busy 44% of the time, docs/LAYERS.md).  A TMA copy moves a whole
2-D box global -> shared from one thread's instruction, applies wgmma's swizzle on the way,
zero-fills what lies past the tensor's edges, and reports its bytes to an mbarrier that the
consumers wait on: the consumers only multiply.

Device side (each has a plain-Python twin under the simulator, where the copies happen at
once and the barriers are condition variables):

* ``mbarrier_init(bars, i, count)`` then ``mbarrier_init_fence()`` and a block barrier: barrier
  i of the shared uint64 array ``bars`` expects ``count`` arrivals a phase.
* ``mbarrier_expect_tx(bars, i, nbytes)``: arrive, and expect ``nbytes`` more from copies.
* ``mbarrier_arrive(bars, i)``: arrive.
* ``mbarrier_wait(bars, i, parity)``: until the phase of that parity has completed (a fresh
  barrier is in phase 0, so waiting for parity 1 returns at once: the idiom of a ring whose
  producer first finds every slot free).
* ``tma_load_panel(smem, word, maps, slot, src, col, row, rows, bars, i, width)``: the box of
  ``rows`` rows x ``width`` bf16 (32: :data:`PANEL_ELEMS`, or 64) at (row, col) of the 2-D
  tensor that tensor map ``maps[slot]`` describes -> words ``smem[word:]`` in the 2 width-byte
  swizzle (at 64 bytes the layout of layers/mma.py's panels: 16-byte chunk c of row r at
  c ^ ((r >> 1) & 3); at 128, c ^ (r % 8)), its bytes reported to barrier i.  ``src`` is
  that tensor (only the simulator reads it).
* ``tensor_map_acquire(maps, slot)``: orders the map's bytes, written by an earlier kernel,
  before this thread's copies read it (once per thread that issues copies).
* ``group_sync_or(bars, barrier, threads, value)``: a barrier of ``threads`` threads (a
  consumer warpgroup: a multiple of 32) on hardware barrier ``barrier`` (1-15; 0 is
  syncthreads'), 1 in each of them if any passed a non-zero ``value``: what a warpgroup
  synchronises on while the producer's warp runs on (a block barrier would wait for it).

Host side: :func:`tensor_map` encodes a map for a C-contiguous [rows, K] uint16 (bf16 bits)
array by the driver (``cuTensorMapEncodeTiled``) into a slot of a device pool kept for the
process, written once per (address, shape, box) by a one-block kernel on the caller's stream
(so a CUDA-graph capture records the write; a map first written inside a capture is written
again by the next call outside one, before any graph could have replayed it).
"""
from __future__ import annotations

import threading

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, kernel
from kdtree_numba.gpu.llvm import inline_device_function

__all__ = ["PANEL_ELEMS", "mbarrier_init", "mbarrier_init_fence", "mbarrier_expect_tx",
           "mbarrier_arrive", "mbarrier_wait", "tma_load_panel", "tensor_map_acquire",
           "group_sync_or", "tensor_map", "TensorMapError", "context_key"]

PANEL_ELEMS = 32        # bf16 per box row: 64 bytes, the width of the 64-byte swizzle
_MAP_WORDS = 16         # a CUtensorMap: 128 opaque bytes, 64-byte aligned


class TensorMapError(RuntimeError):
    """The driver refused to encode a tensor map (the message names the tensor and box)."""


if SIMULATOR:
    class _SimBarrier:
        """One mbarrier: ``count`` arrivals and every expected byte complete a phase.

        The simulator runs a warp's lanes apart, where the GPU's wait together (the wgmma
        after a wait is warp-aligned): one lane may arrive for its warp while another has not
        yet seen the phase it waits for, and by then the barrier may be two phases on, its
        parity back to the one that lane waits on.  So a wait here is for the phase its
        thread's own sequence of waits means: the first phase of that parity after the one
        its last wait found (phase -1, before the first, counts as complete: a fresh
        barrier's parity-1 wait returns at once, as on the GPU)."""

        def __init__(self, count):
            self.count, self.pending, self.tx, self.phase = count, count, 0, 0
            self.cond = threading.Condition()
            self.after = {}             # thread -> the first phase its next wait may mean

        def _settle(self):
            if self.pending == 0 and self.tx == 0:
                self.phase += 1
                self.pending = self.count
                self.cond.notify_all()

        def arrive(self, tx=0):
            with self.cond:
                if self.pending == 0:
                    raise RuntimeError("mbarrier: more arrivals than its count in a phase")
                self.tx += tx
                self.pending -= 1
                self._settle()

        def complete_tx(self, nbytes):
            with self.cond:
                self.tx -= nbytes
                self._settle()

        def wait(self, parity):
            me = threading.get_ident()
            with self.cond:
                target = self.after.get(me, -1)
                if (target & 1) != parity:
                    target += 1
                self.after[me] = target + 1
                # phase q has completed once self.phase (completions) > q
                if not self.cond.wait_for(lambda: self.phase > target, timeout=120):
                    raise RuntimeError("mbarrier: no phase completed in 120 s (a deadlock)")

    _LOCK = threading.Lock()
    _BARRIERS: dict = {}        # (id(bars), i) -> _SimBarrier; bars is the block's array

    def _barrier(bars, i):
        with _LOCK:
            return _BARRIERS[(id(bars), int(i))]

    def mbarrier_init(bars, i, count):
        with _LOCK:
            _BARRIERS[(id(bars), int(i))] = _SimBarrier(int(count))

    def mbarrier_init_fence():
        pass

    def mbarrier_expect_tx(bars, i, nbytes):
        _barrier(bars, i).arrive(int(nbytes))

    def mbarrier_arrive(bars, i):
        _barrier(bars, i).arrive()

    def mbarrier_wait(bars, i, parity):
        _barrier(bars, i).wait(int(parity))

    def tensor_map_acquire(maps, slot):
        pass

    class _SimGroupBarrier:
        """A named barrier of ``threads`` threads whose every generation ORs their values."""

        def __init__(self, threads):
            self.threads, self.arrived, self.any, self.generation = threads, 0, 0, 0
            self.result = 0
            self.cond = threading.Condition()

        def sync_or(self, value):
            with self.cond:
                generation = self.generation
                self.any |= int(value != 0)
                self.arrived += 1
                if self.arrived == self.threads:
                    self.result, self.any, self.arrived = self.any, 0, 0
                    self.generation += 1
                    self.cond.notify_all()
                    return self.result
                # the next generation needs this thread's arrival: result is still this one's
                if not self.cond.wait_for(lambda: self.generation != generation, timeout=120):
                    raise RuntimeError("named barrier: not every thread came in 120 s")
                return self.result

    def group_sync_or(bars, barrier, threads, value):
        key = (id(bars), "group", int(barrier), int(threads))   # a block's bars: its own
        with _LOCK:
            group = _BARRIERS.setdefault(key, _SimGroupBarrier(int(threads)))
        return group.sync_or(value)

    def tensor_map_release():
        pass

    def tma_load_panel(smem, word, maps, slot, src, col, row, rows, bars, i, width):
        """The copy at once, then its bytes to the barrier: rows past src's rows and columns
        past its K read as zeros, as the hardware's out-of-bounds fill does; 16-byte chunk c
        of row r (2 width bytes) at c XOR the row's address bits 7 and up."""
        n_rows, k = src.shape
        chunks = width // 8
        for r in range(rows):
            for c in range(chunks):
                at = word + r * (width // 2) + 4 * (c ^ ((2 * width * r >> 7) & (chunks - 1)))
                for j in range(4):
                    kk = col + 8 * c + 2 * j
                    lo = int(src[row + r, kk]) if row + r < n_rows and kk < k else 0
                    hi = int(src[row + r, kk + 1]) if row + r < n_rows and kk + 1 < k else 0
                    smem[at + j] = np.uint32(lo | (hi << 16))
        _barrier(bars, i).complete_tx(rows * 2 * width)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kdtree_numba.gpu.llvm import asm_statement, element_pointer
    from kdtree_numba.gpu.memory import shared_address

    def _u32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.uint32)

    @intrinsic
    def _mbar_init(typingctx, addr, count):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)] * 2)
            builder.call(ir.InlineAsm(fnty, "mbarrier.init.shared::cta.b64 [$0], $1;",
                                      "r,r,~{memory}", side_effect=True),
                         [_u32(context, builder, args[0], sig.args[0]),
                          _u32(context, builder, args[1], sig.args[1])])
        return types.void(addr, count), codegen

    @intrinsic
    def _mbar_expect_tx(typingctx, addr, nbytes):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)] * 2)
            builder.call(ir.InlineAsm(
                fnty, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
                "r,r,~{memory}", side_effect=True),
                [_u32(context, builder, args[0], sig.args[0]),
                 _u32(context, builder, args[1], sig.args[1])])
        return types.void(addr, nbytes), codegen

    @intrinsic
    def _mbar_arrive(typingctx, addr):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
            builder.call(ir.InlineAsm(fnty, "mbarrier.arrive.shared::cta.b64 _, [$0];",
                                      "r,~{memory}", side_effect=True),
                         [_u32(context, builder, args[0], sig.args[0])])
        return types.void(addr), codegen

    @intrinsic
    def _mbar_try_wait(typingctx, addr, parity):
        """1 once the phase of ``parity`` has completed (the hardware may suspend the thread
        a while before answering 0), else 0."""
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 2)
            text = ("{\n\t.reg .pred %mbw_p;\n\t"
                    "mbarrier.try_wait.parity.shared::cta.b64 %mbw_p, [$1], $2;\n\t"
                    "selp.u32 $0, 1, 0, %mbw_p;\n\t}")
            return builder.call(ir.InlineAsm(fnty, text, "=r,r,r,~{memory}", side_effect=True),
                                [_u32(context, builder, args[0], sig.args[0]),
                                 _u32(context, builder, args[1], sig.args[1])])
        return types.uint32(addr, parity), codegen

    @intrinsic
    def _tma_load_2d(typingctx, dst, tmap, col, row, bar):
        """cp.async.bulk.tensor.2d: the box at (col, row) of the map at generic address
        ``tmap`` -> shared address ``dst``, complete_tx on the mbarrier at ``bar``."""
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, ir.IntType(64), i32, i32, i32])
            text = ("cp.async.bulk.tensor.2d.shared::cluster.global.tile"
                    ".mbarrier::complete_tx::bytes [$0], [$1, {$2, $3}], [$4];")
            builder.call(ir.InlineAsm(fnty, text, "r,l,r,r,r,~{memory}", side_effect=True),
                         [_u32(context, builder, args[0], sig.args[0]),
                          context.cast(builder, args[1], sig.args[1], types.int64),
                          _u32(context, builder, args[2], sig.args[2]),
                          _u32(context, builder, args[3], sig.args[3]),
                          _u32(context, builder, args[4], sig.args[4])])
        return types.void(dst, tmap, col, row, bar), codegen

    @intrinsic
    def _generic_address(typingctx, arr, idx):
        """The generic (flat) address of arr[idx]: what TMA takes for its tensor map."""
        def codegen(context, builder, sig, args):
            ptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return builder.ptrtoint(ptr, ir.IntType(64))
        return types.int64(arr, idx), codegen

    @intrinsic
    def _tensormap_acquire(typingctx, tmap):
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64)])
            builder.call(ir.InlineAsm(
                fnty, "fence.proxy.tensormap::generic.acquire.gpu [$0], 128;",
                "l,~{memory}", side_effect=True),
                [context.cast(builder, args[0], sig.args[0], types.int64)])
        return types.void(tmap), codegen

    @intrinsic
    def _bar_red_or(typingctx, barrier, threads, value):
        """barrier.red.or over ``threads`` threads on named barrier ``barrier``: 1 in each if
        any passed a non-zero value (a memory barrier among them too, like bar.sync).  The
        non-aligned form: inline asm is not marked convergent, so the compiler could in
        principle move it where a warp's lanes diverge (review of ff70aec)."""
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)] * 3)
            text = ("{\n\t.reg .pred %bro_q, %bro_p;\n\tsetp.ne.u32 %bro_q, $3, 0;\n\t"
                    "barrier.red.or.pred %bro_p, $1, $2, %bro_q;\n\t"
                    "selp.u32 $0, 1, 0, %bro_p;\n\t}")
            return builder.call(ir.InlineAsm(fnty, text, "=r,r,r,r,~{memory}",
                                             side_effect=True),
                                [_u32(context, builder, a, t) for a, t in zip(args, sig.args)])
        return types.uint32(barrier, threads, value), codegen

    # the barriers' initialisation visible to the async proxy (the TMA unit's complete_tx)
    # before the block barrier that follows it
    mbarrier_init_fence = asm_statement("fence.mbarrier_init.release.cluster;")
    tensor_map_release = asm_statement("fence.proxy.tensormap::generic.release.gpu;")

    @inline_device_function
    def mbarrier_init(bars, i, count):
        _mbar_init(shared_address(bars, i), count)

    @inline_device_function
    def mbarrier_expect_tx(bars, i, nbytes):
        _mbar_expect_tx(shared_address(bars, i), nbytes)

    @inline_device_function
    def mbarrier_arrive(bars, i):
        _mbar_arrive(shared_address(bars, i))

    @inline_device_function
    def mbarrier_wait(bars, i, parity):
        addr = shared_address(bars, i)
        while _mbar_try_wait(addr, parity) == 0:
            pass

    @inline_device_function
    def tensor_map_acquire(maps, slot):
        _tensormap_acquire(_generic_address(maps, (slot, 0)))

    @inline_device_function
    def group_sync_or(bars, barrier, threads, value):
        return _bar_red_or(barrier, threads, value)

    @inline_device_function
    def tma_load_panel(smem, word, maps, slot, src, col, row, rows, bars, i, width):
        _tma_load_2d(shared_address(smem, word), _generic_address(maps, (slot, 0)), col, row,
                     shared_address(bars, i))


# ------------------------------------------------------------------ host: the maps' pool

@kernel
def _write_map(maps, slot, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14,
               w15):
    """maps[slot] = the 16 words (kernel arguments, so a CUDA-graph capture keeps them)."""
    t = cuda.threadIdx.x
    if t == 0:
        maps[slot, 0], maps[slot, 1], maps[slot, 2], maps[slot, 3] = w0, w1, w2, w3
        maps[slot, 4], maps[slot, 5], maps[slot, 6], maps[slot, 7] = w4, w5, w6, w7
        maps[slot, 8], maps[slot, 9], maps[slot, 10], maps[slot, 11] = w8, w9, w10, w11
        maps[slot, 12], maps[slot, 13], maps[slot, 14], maps[slot, 15] = w12, w13, w14, w15
        # the generic proxy's stores released to the tensor-map proxy that TMA reads through
        # (the readers acquire: tensor_map_acquire; CUDA guide, "Usage of a Modified Tensor Map")
        tensor_map_release()


class _MapPool:
    """The process's tensor maps of one CUDA context: device arrays of [slots, 16] uint64
    (never freed: a captured graph may read them), a slot per (address, shape, box)."""

    SLOTS = 256

    def __init__(self):
        self.arrays: list = []
        self.slots: dict = {}       # key -> [array, slot, words, written outside a capture]
        self.used = 0

    def get(self, key, encode, stream):
        """(array, slot) of ``key``'s map, ``encode()`` giving its 16 words on first use;
        written by a kernel on ``stream`` until a call outside any capture has written it:
        each capture before that records the write too (a graph may replay before the one
        that recorded it first ever does, or that one may never)."""
        entry = self.slots.get(key)
        if entry is not None and entry[3]:
            return entry[0], entry[1]
        capturing = _capturing(stream)
        if entry is None:
            if not self.arrays or self.used == self.SLOTS:
                from kdtree_numba import compat
                self.arrays.append(compat.device_empty((self.SLOTS, _MAP_WORDS), np.uint64,
                                                       stream))
                self.used = 0
            entry = self.slots[key] = [self.arrays[-1], self.used, encode(), False]
            self.used += 1
        _write_map[1, 32, stream](entry[0], entry[1], *(np.uint64(w) for w in entry[2]))
        entry[3] = not capturing
        return entry[0], entry[1]


_POOLS: dict = {}


def _capturing(stream) -> bool:
    """Whether ``stream`` (a numba stream, or 0: the legacy stream, never captured here:
    kdtree_numba/graphs.py) is being captured into a CUDA graph."""
    if SIMULATOR or not stream:
        return False
    from cuda.bindings import driver
    handle = getattr(stream, "handle", stream)
    handle = getattr(handle, "value", handle)
    if not handle:          # numba's default-stream object: the legacy stream
        return False
    err, status = driver.cuStreamIsCapturing(driver.CUstream(int(handle)))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamIsCapturing failed: {err}")
    return status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


def _encode(address: int, rows: int, k: int, box_rows: int, swizzle: int) -> list:
    """The driver's 128-byte map of a [rows, k] bf16 tensor at ``address``, boxes of
    box_rows x swizzle / 2 in the 64- or 128-byte swizzle, out-of-bounds elements read as
    zeros."""
    from cuda.bindings import driver as d
    u64, u32 = d.cuuint64_t, d.cuuint32_t
    err, tmap = d.cuTensorMapEncodeTiled(
        d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, address,
        [u64(k), u64(rows)], [u64(2 * k)], [u32(swizzle // 2), u32(box_rows)],
        [u32(1), u32(1)], d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle == 128 else
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != d.CUresult.CUDA_SUCCESS:
        raise TensorMapError(f"cuTensorMapEncodeTiled refused a [{rows}, {k}] bf16 tensor at "
                             f"{address:#x} with boxes of {box_rows} x {swizzle // 2}: {err}")
    return [int(w) for w in tmap.opaque]


def context_key() -> int:
    """The current CUDA context's key in the process's kept device arrays (0: the
    simulator)."""
    return 0 if SIMULATOR else id(cuda.current_context())


def tensor_map(array, box_rows: int, stream=0, swizzle: int = 64, context=None):
    """(maps, slot): the device pool array holding, at row ``slot``, the tensor map of the
    C-contiguous 2-D uint16 (bf16 bits) device ``array`` for boxes of ``box_rows`` rows x
    ``swizzle`` bytes (64: :data:`PANEL_ELEMS` bf16; or 128), in that swizzle (the module
    docstring).  Under the simulator a zeroed placeholder (its copies read ``array``).
    ``context``: :func:`context_key`, where the caller has looked it up."""
    rows, k = (int(v) for v in array.shape)
    if np.dtype(array.dtype) != np.uint16 or not 1 <= box_rows <= 256 or swizzle not in (64,
                                                                                         128):
        raise ValueError(f"a tensor map takes uint16 bf16 bits, boxes of 1-256 rows and a "
                         f"64- or 128-byte swizzle, got {array.dtype}, {box_rows}, {swizzle}")
    if k % 8:
        raise ValueError(f"a tensor map's rows must be a multiple of 16 bytes, got K = {k}")
    if not getattr(array, "is_c_contiguous", lambda: True)():
        raise ValueError("a tensor map takes a C-contiguous array (its row stride is 2 K bytes)")
    from kdtree_numba.gpu.memory import device_address
    address = device_address(array)
    key = (address, rows, k, box_rows, swizzle)
    pool = _POOLS.setdefault(context_key() if context is None else context, _MapPool())
    if SIMULATOR:
        return pool.get(key, lambda: [0] * _MAP_WORDS, stream)
    return pool.get(key, lambda: _encode(address, rows, k, box_rows, swizzle), stream)

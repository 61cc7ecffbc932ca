"""Memory access that numba cannot express: 16-byte vector loads and stores, ``cp.async``,
shared/global addresses, and element stores without wraparound code.

numba emits only scalar loads and stores, and the kernels need 128-bit ones: the skinny GEMM
streams weights with 16-byte ``ld.global.nc`` loads, the tiled GEMM and attention's
mini-GEMMs read shared memory with LDS.128 (scalar shared loads would cap them at a third of
the FMA rate), and attention stages key tiles with ``cp.async`` (sm_80+: global -> shared
without registers, so the next tile is in flight while the current one is computed).

Several loads of four floats exist because they generate different code, and each kernel keeps
the one it was tuned with:

* ``ld_stream_f32x4`` / ``ld_stream_u32x4`` / ``ld_cached_f32x4`` (``a[row, col:col+4]``):
  inline PTX ``ld.global.nc.v4``; *stream* adds ``.L1::no_allocate`` (weights read once stay out
  of L1 so the activations stay there), *cached* goes through L1.
* ``ld_shared_f32x4`` (``a[off:off+4]`` of a 1-d shared array): inline PTX ``ld.shared.v4.f32``;
  ``ld_shared_words4(a, base, offset)`` the same for a uint32 array (``ld.shared.v4.b32``: the
  bf16 attention's operands; ``ld_shared_words2`` / ``ld_shared_word``: two words / one, the
  W4A16 tensor-core kernel's scales and packed weights), its address formed in 32 bits from
  the array's shared base, a per-lane word base and a constant word offset, which ptxas folds
  into the load (the bf16 attention kernel: its 64-bit index math was a third of its
  instructions).
* ``ldmatrix_x4(a, base, offset)`` / ``ldmatrix_x2``: ``ldmatrix.sync.aligned.m8n8.x4`` / ``.x2``
  ``.shared.b16`` from a uint32 shared array, the lane's row address formed as in
  ``ld_shared_words4``: a warp-collective load (lane i gives the address of row i % 8 of
  matrix i // 8 and receives word i % 4 of row i // 4 of every matrix), which delivers mma
  fragments in register order.  No simulator twin (the lanes exchange addresses): the bf16
  GEMM's simulator path reads the same words by its layout's formula (layers/mma.py).
  ``ldmatrix_x4_trans``: the same, transposed (``.trans``): an mma B operand from a row-major
  [k][n] tile (the bf16 attention kernel's values under ``ldsm_values``).
* ``load_global_invariant_f32x4`` (``a[row, 4q:4q+4]``): an LLVM ``<4 x float>`` load in the
  global address space marked ``invariant.load`` (NVVM makes it ``ld.global.nc.v4.f32``).
* ``load_f32x4`` / ``store_f32x4`` (``a[idx:idx+4]``, idx an int or a tuple whose last entry is
  the column): LLVM ``<4 x float>`` accesses with align 16 in the generic address space (NVVM
  turns them into ld/st.{shared,global}.v4.f32).
* ``cp_async_u32x4`` / ``cp_async_u16x2`` (with ``global_row_address``): cp.async of 16
  bytes of uint32 words / a 4-byte uint16 pair into a uint32 shared word, the global address
  a row's once plus a column's bytes: the int4 GEMV's per-thread ring (layers/skinny.py).
* ``load_l2_f32x4`` / ``load_l2_f32`` (same indexing as ``load_f32x4``; one element):
  ``ld.global.cg`` (cached in L2 only), never moved across a fence or barrier: what other
  blocks of the running kernel wrote and fenced (attention's in-kernel merge of its key
  splits, attention/tiles.py), which an L1 line filled earlier in the kernel could hide.

Callers guarantee 16-byte alignment: every offset and stride used with them is a multiple of 4
elements, and device allocations are 256-byte aligned.  Under the CUDA simulator each primitive
is a plain-Python twin that reads or writes the same elements; ``block_sync`` is the block
barrier a shared device function can call in both worlds.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.compat import SIMULATOR, device_function
from kdtree_numba.gpu.launch import STATIC_SHARED_BYTES, FastKernel, allow_dynamic_shared
from kdtree_numba.gpu.llvm import inline_device_function

__all__ = ["ld_stream_u32x4", "ld_stream_f32x4", "ld_cached_f32x4", "ld_shared_f32x4",
           "ld_shared_words4", "ld_shared_words2", "ld_shared_word", "ldmatrix_x4",
           "ldmatrix_x2", "ldmatrix_x4_trans",
           "load_global_invariant_f32x4", "load_f32x4",
           "store_f32x4", "store_nowrap_1d", "store_nowrap_2d", "cp_async16", "cp_async_commit",
           "cp_async_wait_all", "block_sync", "cp_async_wait_1", "cp_async_wait_2",
           "cp_async_wait_3", "cp_async_wait_4", "prefetch_l2_row",
           "cp_async_strided", "cp_async_u32x4", "cp_async_u16x2", "global_row_address",
           "allow_large_shared_memory", "MAX_SHARED_BYTES",
           "STATIC_SHARED_BYTES", "device_address", "load_l2_f32x4", "load_l2_f32"]

if SIMULATOR:
    _ZERO = np.float32(0.0)

    def _vload4_py(a, row, col):
        return (a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3])

    def _lds4_py(a, off):
        return (a[off], a[off + 1], a[off + 2], a[off + 3])

    def _put1_py(a, off, v):
        a[off] = v

    def _put2_py(a, row, col, v):
        a[row, col] = v

    ld_stream_u32x4 = ld_stream_f32x4 = ld_cached_f32x4 = device_function(_vload4_py)
    ld_shared_f32x4 = device_function(_lds4_py)

    def ld_shared_words4(a, base, offset):
        return _lds4_py(a, base + offset)

    def ld_shared_words2(a, base, offset):
        return (a[base + offset], a[base + offset + 1])

    def ld_shared_word(a, base, offset):
        return (a[base + offset],)

    def _ldmatrix_py(a, base, offset):
        raise NotImplementedError("ldmatrix is warp-collective: the simulator has no twin")
    ldmatrix_x4 = ldmatrix_x2 = ldmatrix_x4_trans = _ldmatrix_py
    store_nowrap_1d, store_nowrap_2d = device_function(_put1_py), device_function(_put2_py)

    def load_global_invariant_f32x4(array, row, q):
        j = 4 * q
        return array[row, j], array[row, j + 1], array[row, j + 2], array[row, j + 3]

    def load_f32x4(arr, idx):
        if isinstance(idx, tuple):
            head, k = idx[:-1], idx[-1]
            return (arr[head + (k,)], arr[head + (k + 1,)], arr[head + (k + 2,)],
                    arr[head + (k + 3,)])
        return arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3]

    load_l2_f32x4 = load_f32x4    # the simulator has no caches to bypass

    def load_l2_f32(arr, idx):
        return arr[idx]

    def store_f32x4(arr, idx, x0, x1, x2, x3):
        if isinstance(idx, tuple):
            head, k = idx[:-1], idx[-1]
            arr[head + (k,)], arr[head + (k + 1,)] = x0, x1
            arr[head + (k + 2,)], arr[head + (k + 3,)] = x2, x3
        else:
            arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3] = x0, x1, x2, x3

    def cp_async16(dst, dst_idx, src, src_idx, nbytes):
        x = load_f32x4(src, src_idx) if nbytes else (_ZERO, _ZERO, _ZERO, _ZERO)
        store_f32x4(dst, dst_idx, *x)

    def sim_copy_u16x8(dst, at, src, idx, nbytes):
        """Simulator twin of a 16-byte cp.async of 8 bf16 (uint16) ``src[idx : +8]`` (idx a
        tuple, the column last) into the uint32 words ``dst[at:at+4]``, element 2i in the low
        half of word i; zeros when nbytes == 0 (the bf16 GEMM's and attention's staging)."""
        head, k = idx[:-1], idx[-1]
        for i in range(4):
            word = np.uint32(0)
            if nbytes:
                word = np.uint32(src[head + (k + 2 * i,)]) | (
                    np.uint32(src[head + (k + 2 * i + 1,)]) << np.uint32(16))
            dst[at + i] = word

    def global_row_address(arr, row):
        """Simulator twin: no addresses there (the copies index ``src`` instead)."""
        return 0

    def cp_async_u32x4(dst, at, src, row, col, row_addr):
        """Simulator twin of a 16-byte cp.async of the uint32 words ``src[row, col:col+4]``
        into the uint32 shared ``dst[at:at+4]``."""
        for i in range(4):
            dst[at + i] = src[row, col + i]

    def cp_async_u16x2(dst, at, src, row, col, row_addr):
        """Simulator twin of a 4-byte cp.async of the uint16 pair ``src[row, col:col+2]``
        (col even) into the uint32 word ``dst[at]``, element col in the low half."""
        dst[at] = np.uint32(src[row, col]) | (np.uint32(src[row, col + 1]) << np.uint32(16))

    def _nothing():
        pass

    cp_async_commit = cp_async_wait_all = cp_async_wait_1 = cp_async_wait_2 = _nothing
    cp_async_wait_3 = cp_async_wait_4 = _nothing

    def prefetch_l2_row(arr, row):
        """Simulator twin of the L2 bulk prefetch of a row: a hint, nothing to do."""

    def block_sync():
        """The simulator runs a device function as plain Python, where ``cuda.syncthreads``
        does not exist: wait at the block's barrier through the simulated thread itself."""
        import threading
        threading.current_thread().syncthreads()
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from kdtree_numba.gpu.llvm import asm_statement, element_pointer, item_pointer

    def _make_vload4(elem, ptx_type, constraint, cache_op):
        """An intrinsic ``vload(a2d, row, col) -> 4-tuple``: one 16-byte ``ld.global.nc`` of
        ``a[row, col:col+4]``.  The caller guarantees 16-byte alignment."""
        @intrinsic
        def vload(typingctx, array, row, col):
            if not (isinstance(array, types.Array) and array.ndim == 2 and array.dtype == elem):
                return None
            ret = types.UniTuple(elem, 4)

            def codegen(context, builder, sig, args):
                ptr = item_pointer(context, builder, sig, args, 2)
                lty = context.get_value_type(elem)
                fnty = ir.FunctionType(ir.LiteralStructType([lty] * 4), [ptr.type])
                asm = ir.InlineAsm(
                    fnty, f"ld.global.nc{cache_op}.v4.{ptx_type} {{$0, $1, $2, $3}}, [$4];",
                    ",".join([f"={constraint}"] * 4) + ",l")
                res = builder.call(asm, [ptr])
                return context.make_tuple(builder, ret,
                                          [builder.extract_value(res, i) for i in range(4)])
            return ret(array, row, col), codegen
        return vload

    # Weights are streamed once: keep them out of L1 so the activations stay there.
    ld_stream_u32x4 = _make_vload4(types.uint32, "u32", "r", ".L1::no_allocate")
    ld_stream_f32x4 = _make_vload4(types.float32, "f32", "f", ".L1::no_allocate")
    ld_cached_f32x4 = _make_vload4(types.float32, "f32", "f", "")

    @intrinsic
    def ld_shared_f32x4(typingctx, array, off):
        """``a[off:off+4]`` of a 1-d float32 shared array as one ``ld.shared.v4`` (LDS.128;
        numba emits four scalar loads).  The caller guarantees 16-byte alignment."""
        if not (isinstance(array, types.Array) and array.ndim == 1
                and array.dtype == types.float32 and isinstance(off, types.Integer)):
            return None
        ret = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, args):
            ptr = item_pointer(context, builder, sig, args, 1)
            lty = context.get_value_type(types.float32)
            shared = builder.addrspacecast(ptr, ir.PointerType(lty, 3))   # cvta.to.shared
            addr = builder.ptrtoint(shared, ir.IntType(64))
            fnty = ir.FunctionType(ir.LiteralStructType([lty] * 4), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];",
                               "=f,=f,=f,=f,l")
            res = builder.call(asm, [addr])
            return context.make_tuple(builder, ret,
                                      [builder.extract_value(res, i) for i in range(4)])
        return ret(array, off), codegen

    def _shared_words_intrinsic(name, n, asm_text, doc):
        """An intrinsic ``name(a, base, offset)`` -> n uint32 from the inline PTX ``asm_text``
        (outputs $0..$n-1, the 32-bit shared address $n), the address ``shared base + 4 base +
        4 offset`` formed in 32 bits (shared addresses fit 32 bits).  Give the per-lane part
        as ``base`` and a compile-time constant as ``offset``: loads sharing a base then share
        its address register and ptxas folds each offset into the load's immediate.  Word
        offsets below 2^31; 16-byte aligned."""
        def load(typingctx, array, base, offset):
            if not (isinstance(array, types.Array) and array.ndim == 1
                    and array.dtype == types.uint32 and isinstance(base, types.Integer)
                    and isinstance(offset, types.Integer)):
                return None
            ret = types.UniTuple(types.uint32, n)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                ary = context.make_array(sig.args[0])(context, builder, value=args[0])
                shared = builder.addrspacecast(ary.data, ir.PointerType(i32, 3))

                def bytes32(v):
                    v = builder.trunc(v, i32) if v.type.width > 32 else v
                    return builder.shl(v, ir.Constant(i32, 2))
                start = builder.add(builder.ptrtoint(shared, i32), bytes32(args[1]))
                addr = builder.add(start, bytes32(args[2]))
                # one output is the value itself (LLVM takes no one-member struct there)
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * n) if n > 1 else i32,
                                       [i32])
                # side effect: kept in program order with the barriers and cp.async around it
                asm = ir.InlineAsm(fnty, asm_text, ",".join(["=r"] * n + ["r"]),
                                   side_effect=True)
                res = builder.call(asm, [addr])
                parts = [builder.extract_value(res, i) for i in range(n)] if n > 1 else [res]
                return context.make_tuple(builder, ret, parts)
            return ret(array, base, offset), codegen
        load.__name__ = load.__qualname__ = name
        load.__doc__ = doc
        return intrinsic(load)

    ld_shared_word = _shared_words_intrinsic(
        "ld_shared_word", 1, "ld.shared.b32 $0, [$1];",
        "``(a[base + offset],)`` of a 1-d uint32 shared array (a 1-tuple), one ``ld.shared``.")
    ld_shared_words2 = _shared_words_intrinsic(
        "ld_shared_words2", 2, "ld.shared.v2.b32 {$0, $1}, [$2];",
        "``a[base + offset : + 2]`` of a 1-d uint32 shared array (8-byte aligned) as one "
        "``ld.shared.v2.b32``.")
    ld_shared_words4 = _shared_words_intrinsic(
        "ld_shared_words4", 4, "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
        "``a[base + offset : + 4]`` of a 1-d uint32 shared array as one ``ld.shared.v4.b32``.")
    ldmatrix_x4 = _shared_words_intrinsic(
        "ldmatrix_x4", 4, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
        "Four 8 x 8 b16 matrices, this lane's row address ``a[base + offset]``; register m "
        "= word lane % 4 of row lane // 4 of matrix m (the module docstring).")
    ldmatrix_x4_trans = _shared_words_intrinsic(
        "ldmatrix_x4_trans", 4,
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        "``ldmatrix_x4`` transposed: register m = elements (row 2 (lane % 4), column lane // 4) "
        "(low half) and (row 2 (lane % 4) + 1, the same column) of matrix m, whose row r "
        "lane 8 m + r addresses: an m16n8k16 B operand from a row-major [k][n] tile.")
    ldmatrix_x2 = _shared_words_intrinsic(
        "ldmatrix_x2", 2, "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {$0, $1}, [$2];",
        "Two 8 x 8 b16 matrices (lanes 0-15 give the row addresses), as ``ldmatrix_x4``.")

    def _put_codegen(ndim):
        def codegen(context, builder, sig, args):
            ptr = item_pointer(context, builder, sig, args, ndim)
            value = context.cast(builder, args[-1], sig.args[-1], sig.args[0].dtype)
            builder.store(value, ptr)
            return context.get_dummy_value()
        return codegen

    # a[i] = v / a[i, j] = v without numba's negative-index wraparound code: the generated
    # kernels index with values known to be in range, and the wraparound selects cost
    # registers and instructions in their staging and epilogue code.
    @intrinsic
    def store_nowrap_1d(typingctx, array, i, value):
        if isinstance(array, types.Array) and array.ndim == 1 and isinstance(i, types.Integer):
            return types.void(array, i, value), _put_codegen(1)
        return None

    @intrinsic
    def store_nowrap_2d(typingctx, array, i, j, value):
        if (isinstance(array, types.Array) and array.ndim == 2 and isinstance(i, types.Integer)
                and isinstance(j, types.Integer)):
            return types.void(array, i, j, value), _put_codegen(2)
        return None

    @intrinsic
    def load_global_invariant_f32x4(typingctx, array, row, q):
        """The four float32 a[row, 4q : 4q+4] with one 16-byte load (``ld.global.nc.v4.f32``);
        the caller guarantees 16-byte alignment (row stride % 4 == 0 and an aligned base)."""
        sig = types.UniTuple(types.float32, 4)(array, row, q)

        def codegen(context, builder, sig, args):
            array_type, row_type, q_type = sig.args
            data, row_value, q_value = args
            ary = context.make_array(array_type)(context, builder, value=data)
            col = builder.mul(context.cast(builder, q_value, q_type, types.intp),
                              ir.Constant(ir.IntType(64), 4))
            ptr = cgutils.get_item_pointer(
                context, builder, array_type, ary,
                [context.cast(builder, row_value, row_type, types.intp), col])
            vector = ir.VectorType(ir.FloatType(), 4)
            global_ptr = builder.addrspacecast(ptr, ir.PointerType(ir.FloatType(), 1))
            loaded = builder.load(builder.bitcast(global_ptr, ir.PointerType(vector, 1)),
                                  align=16)
            loaded.set_metadata("invariant.load", builder.module.add_metadata([]))
            parts = [builder.extract_element(loaded, ir.Constant(ir.IntType(32), i))
                     for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    def _vec_pointer(context, builder, arrty, arr, idxty, idx):
        ptr = element_pointer(context, builder, arrty, arr, idxty, idx)
        return builder.bitcast(ptr, ir.VectorType(ir.FloatType(), 4).as_pointer())

    def _check_f32x4(arr, idx):
        ndim = len(idx) if isinstance(idx, types.BaseTuple) else 1
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == ndim):
            raise TypeError(f"vec4 access needs a float32 array of ndim {ndim}, got {arr}")

    @intrinsic
    def load_f32x4(typingctx, arr, idx):
        _check_f32x4(arr, idx)

        def codegen(context, builder, sig, args):
            vptr = _vec_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = builder.load(vptr, align=16)
            vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), e))
                    for e in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)
        return types.UniTuple(types.float32, 4)(arr, idx), codegen

    @intrinsic
    def store_f32x4(typingctx, arr, idx, x0, x1, x2, x3):
        _check_f32x4(arr, idx)

        def codegen(context, builder, sig, args):
            vptr = _vec_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
            for e in range(4):
                val = context.cast(builder, args[2 + e], sig.args[2 + e], types.float32)
                vec = builder.insert_element(vec, val, ir.Constant(ir.IntType(32), e))
            builder.store(vec, vptr, align=16)
        return types.void(arr, idx, x0, x1, x2, x3), codegen

    def _make_load_l2(n):
        """An intrinsic ``load(arr, idx)``: ``n`` (1 or 4) float32 from arr[idx] (idx an int or
        a tuple, the column last) by one ``ld.global.cg`` (module docstring).  A side effect
        with a memory clobber: LLVM must not hoist it above the fence, atomic and barrier
        that say the data is there."""
        @intrinsic
        def load(typingctx, arr, idx):
            _check_f32x4(arr, idx)      # a float32 array indexed by idx
            ret = types.UniTuple(types.float32, 4) if n == 4 else types.float32

            def codegen(context, builder, sig, args):
                ptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                      args[1])
                f32 = ir.FloatType()
                outs = ir.LiteralStructType([f32] * 4) if n == 4 else f32
                regs = "{$0, $1, $2, $3}" if n == 4 else "$0"
                vec = ".v4" if n == 4 else ""
                asm = (f"{{\n\t.reg .u64 %l2g;\n\tcvta.to.global.u64 %l2g, ${n};\n\t"
                       f"ld.global.cg{vec}.f32 {regs}, [%l2g];\n\t}}")
                fnty = ir.FunctionType(outs, [ptr.type])
                res = builder.call(ir.InlineAsm(fnty, asm, ",".join(["=f"] * n) +
                                                ",l,~{memory}", side_effect=True), [ptr])
                if n == 1:
                    return res
                return context.make_tuple(builder, ret,
                                          [builder.extract_value(res, i) for i in range(4)])
            return ret(arr, idx), codegen
        return load

    load_l2_f32x4 = _make_load_l2(4)
    load_l2_f32 = _make_load_l2(1)

    @intrinsic
    def cp_async16(typingctx, dst, dst_idx, src, src_idx, nbytes):
        """16 bytes src[src_idx:+4] -> shared dst[dst_idx:+4]; only ``nbytes`` (0 or 16) are
        read, the rest is zero-filled (so rows past the end become zeros, never garbage)."""
        _check_f32x4(dst, dst_idx)
        _check_f32x4(src, src_idx)

        def codegen(context, builder, sig, args):
            dptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            sptr = element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            n = context.cast(builder, args[4], sig.args[4], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [dptr.type, sptr.type, ir.IntType(32)])
            asm = ("{\n\t.reg .u64 %cpa_s64, %cpa_g;\n\t.reg .u32 %cpa_s;\n\t"
                   "cvta.to.shared.u64 %cpa_s64, $0;\n\tcvt.u32.u64 %cpa_s, %cpa_s64;\n\t"
                   "cvta.to.global.u64 %cpa_g, $1;\n\t"
                   "cp.async.cg.shared.global [%cpa_s], [%cpa_g], 16, $2;\n\t}")
            builder.call(ir.InlineAsm(fnty, asm, "l,l,r,~{memory}", side_effect=True),
                         [dptr, sptr, n])
        return types.void(dst, dst_idx, src, src_idx, nbytes), codegen

    def _address_intrinsic(space, bits):
        @intrinsic
        def address(typingctx, arr, idx):
            # any dtype: cp.async moves bytes (float32 tiles, bf16 weights as uint16 or uint32)
            ndim = len(idx) if isinstance(idx, types.BaseTuple) else 1
            if not (isinstance(arr, types.Array) and arr.ndim == ndim):
                raise TypeError(f"an address needs an array of ndim {ndim}, got {arr}")

            def codegen(context, builder, sig, args):
                ptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1],
                                      args[1])
                fnty = ir.FunctionType(ir.IntType(64), [ptr.type])
                addr = builder.call(ir.InlineAsm(fnty, f"cvta.to.{space}.u64 $0, $1;", "=l,l"),
                                    [ptr])
                if bits == 32:  # shared addresses fit 32 bits; keep int64 arithmetic cheap
                    addr = builder.zext(builder.trunc(addr, ir.IntType(32)), ir.IntType(64))
                return addr
            return types.int64(arr, idx), codegen
        return address

    # ``shared_address(smem, idx)`` / ``global_address(arr, idx)``: the element's address in
    # its state space, for cp_async16_raw.
    shared_address = _address_intrinsic("shared", 32)
    global_address = _address_intrinsic("global", 64)

    @intrinsic
    def cp_async16_raw(typingctx, saddr, gaddr, nbytes):
        """cp.async of 16 bytes from a global address to a shared one (both from the address
        intrinsics); ``nbytes`` (0 or 16) are read, the rest zero-filled.  ``L2::256B``: a
        miss fetches the aligned 256 bytes around it into L2, so the next 15 chunks of a
        weight row come from one DRAM burst (what the bf16 GEMM's 256-byte decode stages
        rely on)."""
        def codegen(context, builder, sig, args):
            s32 = builder.trunc(args[0], ir.IntType(32))
            n = context.cast(builder, args[2], sig.args[2], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64),
                                                   ir.IntType(32)])
            asm = "cp.async.cg.shared.global.L2::256B [$0], [$1], 16, $2;"
            builder.call(ir.InlineAsm(fnty, asm, "r,l,r,~{memory}", side_effect=True),
                         [s32, args[1], n])
        return types.void(saddr, gaddr, nbytes), codegen

    def _cp_async_word_intrinsic(nbytes, asm_text):
        """An intrinsic ``copy(dst, at, gaddr)``: cp.async of ``nbytes`` from the global
        address ``gaddr`` (global_address) to word ``at`` of the 1-d uint32 shared ``dst``,
        the shared address formed in 32 bits (as ``_shared_words_intrinsic``: no 64-bit
        generic pointer per copy, which held ~80 more registers in the int4 ring)."""
        @intrinsic
        def copy(typingctx, dst, at, gaddr):
            if not (isinstance(dst, types.Array) and dst.ndim == 1
                    and dst.dtype == types.uint32 and isinstance(at, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                ary = context.make_array(sig.args[0])(context, builder, value=args[0])
                shared = builder.addrspacecast(ary.data, ir.PointerType(i32, 3))
                word = args[1] if args[1].type.width == 32 else builder.trunc(args[1], i32)
                s32 = builder.add(builder.ptrtoint(shared, i32),
                                  builder.shl(word, ir.Constant(i32, 2)))
                fnty = ir.FunctionType(ir.VoidType(), [i32, ir.IntType(64)])
                builder.call(ir.InlineAsm(fnty, asm_text, "r,l,~{memory}", side_effect=True),
                             [s32, args[2]])
            return types.void(dst, at, gaddr), codegen
        return copy

    _cp_async16_word = _cp_async_word_intrinsic(
        16, "cp.async.cg.shared.global.L2::256B [$0], [$1], 16;")
    # sizes below 16 have no .cg
    _cp_async4_word = _cp_async_word_intrinsic(4, "cp.async.ca.shared.global [$0], [$1], 4;")

    @inline_device_function
    def global_row_address(arr, row):
        """The global address of ``arr[row, 0]`` (2-d), for cp_async_u32x4 / cp_async_u16x2:
        formed once a row, the copies add a column's bytes to it (a generic pointer and its
        cvta a copy held ~10 registers a row more in the int4 ring)."""
        return global_address(arr, (row, 0))

    @inline_device_function
    def cp_async_u32x4(dst, at, src, row, col, row_addr):
        """cp.async of the 16 bytes ``src[row, col:col+4]`` (uint32 words, 16-byte aligned;
        ``row_addr`` = global_row_address(src, row)) into the uint32 shared
        ``dst[at:at+4]``: in flight without a register."""
        _cp_async16_word(dst, at, row_addr + 4 * col)

    @inline_device_function
    def cp_async_u16x2(dst, at, src, row, col, row_addr):
        """cp.async of the 4 bytes ``src[row, col:col+2]`` (uint16, col even, 4-byte aligned;
        ``row_addr`` as for cp_async_u32x4) into the uint32 shared word ``dst[at]`` (element
        col in the low half)."""
        _cp_async4_word(dst, at, row_addr + 2 * col)

    @intrinsic
    def _prefetch_l2_bulk(typingctx, gaddr, nbytes):
        """``cp.async.bulk.prefetch.L2`` of ``nbytes`` (a multiple of 16) from the 16-byte
        aligned global address ``gaddr``: one instruction asks L2 for a whole range, and no
        register holds the bytes (sm_90; a hint, nothing to wait for)."""
        def codegen(context, builder, sig, args):
            n = context.cast(builder, args[1], sig.args[1], types.int32)
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)])
            asm = "cp.async.bulk.prefetch.L2.global [$0], $1;"
            builder.call(ir.InlineAsm(fnty, asm, "l,r,~{memory}", side_effect=True),
                         [args[0], n])
        return types.void(gaddr, nbytes), codegen

    @inline_device_function
    def prefetch_l2_row(arr, row):
        """Ask L2 for row ``row`` of the 2-d C-contiguous ``arr``: its whole 16-byte aligned
        part (the range rounded inward; nothing where that is empty)."""
        start = global_address(arr, (row, 0))
        end = start + arr.shape[1] * arr.itemsize
        first = (start + 15) & ~15
        last = end & ~15
        if last > first:
            _prefetch_l2_bulk(first, last - first)

    cp_async_commit = asm_statement("cp.async.commit_group;")
    cp_async_wait_all = asm_statement("cp.async.wait_group 0;")
    # all but the newest 1 / 2 / 3 / 4 groups landed: the waits of a 3- to 6-stage cp.async
    # ring (wait_group takes an immediate: one statement each)
    cp_async_wait_1 = asm_statement("cp.async.wait_group 1;")
    cp_async_wait_2 = asm_statement("cp.async.wait_group 2;")
    cp_async_wait_3 = asm_statement("cp.async.wait_group 3;")
    cp_async_wait_4 = asm_statement("cp.async.wait_group 4;")

    from numba import cuda as _cuda

    @inline_device_function
    def block_sync():
        """``cuda.syncthreads()`` for device functions shared between kernels (the simulator
        needs a twin there)."""
        _cuda.syncthreads()


def _cp_async_strided_fn():
    """``copy(smem, at, arr, idx, count, step4, nbytes)``: cp.async the float4s
    ``arr[idx + 4*step4*s]`` -> ``smem[at + 4*step4*s]`` for s < count (idx: a tuple whose last
    entry is the column).  On the GPU both addresses are formed once, then stepped by a
    constant, which ptxas folds into the LDGSTS immediate offsets."""
    if SIMULATOR:
        def copy(smem, at, arr, idx, count, step4, nbytes):
            for s in range(count):
                cp_async16(smem, at + 4 * step4 * s, arr,
                           idx[:-1] + (idx[-1] + 4 * step4 * s,), nbytes)
        return copy

    @inline_device_function
    def copy_gpu(smem, at, arr, idx, count, step4, nbytes):
        sa = shared_address(smem, at)
        ga = global_address(arr, idx)
        for s in range(count):
            cp_async16_raw(sa + 16 * step4 * s, ga + 16 * step4 * s, nbytes)
    return copy_gpu


cp_async_strided = _cp_async_strided_fn()


MAX_SHARED_BYTES = 232448      # sm_90's opt-in dynamic shared memory per block (227 KiB)


def allow_large_shared_memory(dispatcher, args, nbytes):
    """Opt the kernel that ``dispatcher`` compiles for ``args`` in to ``nbytes`` > 48 KiB of
    dynamic shared memory (a no-op in the simulator and at 48 KiB or less).

    numba-cuda 0.30 launches through cuda.core, which does not raise the per-function limit
    itself; without this such a launch fails with CUDA_ERROR_INVALID_VALUE.  A FastKernel
    (every kernel on a GPU unless ``KDTREE_FAST_LAUNCH=0``) does this at launch itself; both
    go through launch.allow_dynamic_shared, which only ever raises a function's limit.
    """
    if SIMULATOR or nbytes <= STATIC_SHARED_BYTES or isinstance(dispatcher, FastKernel):
        return
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    allow_dynamic_shared(dispatcher.compile(argtypes)._codelibrary.get_cufunc(), nbytes)


def device_address(array) -> int:
    """The device address of an array's first element (0 under the simulator: alignment
    checks then pass, and the simulator's loads do not care)."""
    return 0 if SIMULATOR else int(array.__cuda_array_interface__["data"][0])

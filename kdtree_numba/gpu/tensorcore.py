"""Tensor-core building blocks for numba kernels: TF32 conversion and the warp-wide
``mma.sync.aligned.m16n8k8`` TF32 product, bf16 packing and the ``m16n8k16`` bf16 product, as
inline-PTX intrinsics (numba exposes no mma).

They carry the tensor-core attention kernel (kdtree_numba/attention_mma.py; docs/ATTENTION.md,
"The tensor-core kernel"): 3xTF32 (x = hi + lo, hi*hi + hi*lo + lo*hi on tensor cores) keeps
the products fp32-accurate at a fraction of the FFMA time.  tests/test_tensorcore.py checks a 16 x 8 x 8
tile against NumPy on the GPU, and that the PTX assembles for sm_90 on any machine.

Fragment layout of ``mma_tf32_m16n8k8`` (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32):
lane = 4 * g + t (g = lane // 4, t = lane % 4) holds
  A (16 x 8, row-major): a0 = A[g, t], a1 = A[g + 8, t], a2 = A[g, t + 4], a3 = A[g + 8, t + 4]
  B (8 x 8, k x n):      b0 = B[t, g], b1 = B[t + 4, g]
  C, D (16 x 8):         c0 = C[g, 2t], c1 = C[g, 2t + 1], c2 = C[g + 8, 2t], c3 = C[g + 8, 2t + 1]
A and B are TF32 bit patterns (``to_tf32``), C and D float32.  All 32 lanes of the warp must
call it together (``.sync.aligned``).

Fragment layout of ``mma_bf16_m16n8k16`` (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
floating point type", .bf16; each .b32 register holds two bf16, the lower-numbered element in
the low 16 bits).  lane = 4 * g + t holds
  A (16 x 16, row-major): a0 = A[g, 2t:2t+2], a1 = A[g + 8, 2t:2t+2],
                          a2 = A[g, 2t+8:2t+10], a3 = A[g + 8, 2t+8:2t+10]
  B (16 x 8, k x n):      b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]
  C, D (16 x 8, f32):     as for m16n8k8: c0 = C[g, 2t], c1 = C[g, 2t + 1], c2 = C[g + 8, 2t],
                          c3 = C[g + 8, 2t + 1]
For ``y = x w^T`` (w [N, K] row-major) B[k, n] = w[n, k], so b0 and b1 are each two adjacent
elements of one weight row.  ``pack_bf16x2(lo, hi)`` rounds two float32 to bf16 (to nearest,
ties to even: ``cvt.rn.bf16x2.f32``) and packs them so (lo, hi) = (element 2t, 2t + 1).

``wgmma_bf16(n)``: the warpgroup's ``wgmma.mma_async ... m64n{n}k16`` bf16 product from shared
memory descriptors (sm_90a, the target numba-cuda gives launches on the H200), with its fences;
layers/mma.py's ``MmaConfig(wgmma=True)`` uses it.  ``wgmma_bf16_rs(n, trans_b)``: the same
product with A from registers (four bf16 pairs a thread: mma.sync's A fragment above for
rows 16 (warp % 4) .. + 15 of the 64) and B, with ``trans_b``, N-major in shared memory (the
attention kernel's P V: its probabilities in registers, its values as the key tile stores
them, attention/wgmma.py).

The CUDA simulator has no tensor cores: there ``to_tf32`` / ``tf32_value`` / ``pack_bf16x2``
are NumPy bit operations and the mma functions raise (wgmma calls ``sim_wgmma`` when a test
has installed an emulation there).
"""
from __future__ import annotations

import functools

import numpy as np

from kdtree_numba.compat import SIMULATOR, device_function

__all__ = ["to_tf32", "tf32_value", "split_tf32", "split_tf32_fast", "mma_tf32_m16n8k8",
           "pack_bf16x2", "mma_bf16_m16n8k16", "block_uniform_mma_bf16", "wgmma_bf16",
           "wgmma_bf16_rs", "wgmma_descriptor_128", "wgmma_descriptor_128_n", "wgmma_available",
           "wgmma_fence", "wgmma_commit", "wgmma_wait_1", "wgmma_wait_all",
           "fence_proxy_async",
           "WGMMA_SWIZZLE_64B"]

# Bits 62-63 of a wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor"): the
# swizzle mode; 2 = 64-byte swizzle, the layout of layers/mma.py's panels (rows of 64 bytes,
# 16-byte chunk c of row r at c ^ ((r >> 1) & 3): address bits 4-5 XOR bits 7-8).
WGMMA_SWIZZLE_64B = 2

# A descriptor's fixed fields for bf16 operands in 128-byte rows, 128-byte swizzled (16-byte
# chunk c of row r at c ^ (r % 8); swizzle mode 1 in bits 62-63; the address >> 4 in bits
# 0-13): K-major, the stride byte offset 1024 >> 4 (8 rows of 128 bytes to the next 8) and
# the leading byte offset 1 (unused); N-major the same with the leading byte offset the
# distance between 64-element atoms along N, a launch's choice
_DESC_128 = int(np.uint64((1 << 16) | ((1024 >> 4) << 32) | (1 << 62)).view(np.int64))
_DESC_128_N = int(np.uint64(((1024 >> 4) << 32) | (1 << 62)).view(np.int64))


@functools.cache
def wgmma_available() -> bool:
    """Whether the current GPU (looked up once) runs warpgroup mma: compute capability 9.0,
    whose launches numba-cuda compiles for sm_90a (tests/test_tensorcore.py guards that);
    never under the simulator, which has no tensor cores, nor without a CUDA driver (a
    machine that only compiles: tests/ptx_check.py)."""
    if SIMULATOR:
        return False
    from numba import cuda
    from numba.cuda.cudadrv.error import CudaSupportError
    try:
        return tuple(cuda.get_current_device().compute_capability) == (9, 0)
    except CudaSupportError:
        return False


def wgmma_descriptor_128(address):
    """The descriptor of a K-major bf16 operand in 128-byte rows, 128-byte swizzled, from
    shared byte ``address`` (TMA's 128-byte swizzle of a box 64 elements wide)."""
    return _DESC_128 | ((address & 0x3FFFF) >> 4)


def wgmma_descriptor_128_n(address, atom_bytes):
    """The descriptor of an N-major bf16 B operand (``wgmma_bf16_rs(n, trans_b=True)``): K
    rows of 64 N-elements (128 bytes, the same 128-byte swizzle), 8-row groups 1,024 bytes
    apart, the next 64 N-elements ``atom_bytes`` further -- a key tile's value columns, whose
    rows are keys, read as P V's B operand."""
    return _DESC_128_N | (((atom_bytes >> 4) & 0x3FFF) << 16) | ((address & 0x3FFFF) >> 4)

if SIMULATOR:
    def to_tf32(x):
        """float32 -> its TF32 bit pattern (round to nearest, ties away from zero, like
        ``cvt.rna.tf32.f32``), the low 13 mantissa bits zero."""
        bits = int(np.float32(x).view(np.uint32))
        if (bits >> 23) & 0xFF != 0xFF:          # inf and NaN pass through
            bits = (bits + 0x1000) & 0xFFFFE000
        return np.uint32(bits)

    def tf32_value(bits):
        return np.uint32(bits).view(np.float32)

    def split_tf32_fast(x):
        """float32 x -> (hi, lo) bit patterns for 3xTF32 in three integer/float operations:
        hi = x rounded to TF32 (half-ulp up in magnitude, low 13 bits cleared), lo = x - hi
        exactly, left at full precision (the tensor core reads only its top 19 bits)."""
        hi = (int(np.float32(x).view(np.uint32)) + 0x1000) & 0xFFFFE000
        lo = np.float32(x) - np.uint32(hi).view(np.float32)
        return np.uint32(hi), np.float32(lo).view(np.uint32)

    def mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        raise NotImplementedError("the CUDA simulator has no tensor cores (mma.sync)")

    def _bf16_rne(x):
        bits = int(np.float32(x).view(np.uint32))
        if (bits & 0x7FFFFFFF) > 0x7F800000:       # NaN: the canonical quiet NaN
            return 0x7FFF
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF

    def pack_bf16x2(lo, hi):
        """Two float32 -> one uint32 of two bf16 (round to nearest, ties to even), lo in the
        low half (like ``cvt.rn.bf16x2.f32``)."""
        return np.uint32(_bf16_rne(lo) | (_bf16_rne(hi) << 16))

    def mma_bf16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        raise NotImplementedError("the CUDA simulator has no tensor cores (mma.sync)")

    def wgmma_bf16(n: int):
        """The simulator's wgmma: ``sim_wgmma(n, acc, smem, desc_a, desc_b)`` when a test has
        installed an emulation there (tests/test_layers_mma.py), else it raises."""
        def wgmma(acc, smem, desc_a, desc_b):
            if sim_wgmma is None:
                raise NotImplementedError("the CUDA simulator has no tensor cores (wgmma)")
            sim_wgmma(n, acc, smem, desc_a, desc_b)
        return wgmma

    sim_wgmma = None

    def wgmma_bf16_rs(n: int, trans_b: bool = False):
        """The simulator's register-A wgmma: ``sim_wgmma_rs(n, trans_b, acc, smem, (a0, a1,
        a2, a3), desc_b)`` when a test has installed an emulation there, else it raises."""
        def wgmma(acc, smem, a0, a1, a2, a3, desc_b):
            if sim_wgmma_rs is None:
                raise NotImplementedError("the CUDA simulator has no tensor cores (wgmma)")
            sim_wgmma_rs(n, trans_b, acc, smem, (a0, a1, a2, a3), desc_b)
        return wgmma

    sim_wgmma_rs = None

    def _nothing():
        pass

    wgmma_fence = wgmma_commit = wgmma_wait_1 = wgmma_wait_all = fence_proxy_async = _nothing

    def block_uniform_mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``mma_bf16_m16n8k16`` for kernels whose every thread issues the same sequence of mma
        (the bf16 attention kernel): every lane leaves its registers in a table of its warp,
        waits at the block's barrier, takes the warp's product A B (products exact in float64)
        built from the table by the fragment layout above, adds its 4 outputs to c, rounds
        them to float32, and waits again before the table is reused.  The first lane past the
        barrier builds the product for the whole warp (each lane building the same product
        was most of a simulated bf16 attention); the next call's lanes clear it before their
        barrier, after every lane has read it.  Block barriers stand in for the warp's, which
        the simulator lacks."""
        me = threading.current_thread()
        tid, block = me.threadIdx.x, (me.blockIdx.x, me.blockIdx.y, me.blockIdx.z)
        lane, g, t = tid % 32, (tid % 32) // 4, tid % 4
        with _mma_lock:
            table = _mma_tables.setdefault(me._manager, {}).setdefault((block, tid // 32),
                                                                       [None] * 33)
        table[lane] = (a0, a1, a2, a3, b0, b1)
        table[32] = None        # slot 32: the product, built after the barrier
        me.syncthreads()
        with _mma_lock:
            if table[32] is None:
                table[32] = _warp_product(table)
            D = table[32]
        me.syncthreads()
        return (np.float32(D[g, 2 * t] + np.float64(c0)),
                np.float32(D[g, 2 * t + 1] + np.float64(c1)),
                np.float32(D[g + 8, 2 * t] + np.float64(c2)),
                np.float32(D[g + 8, 2 * t + 1] + np.float64(c3)))

    def _warp_product(table):
        """A B (float64) of the warp's m16n8k16 from its 32 lanes' registers (table[:32])."""
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for src in range(32):
            regs = table[src]
            sg, st = src // 4, src % 4
            for i, (row, col) in enumerate(((sg, 2 * st), (sg + 8, 2 * st), (sg, 2 * st + 8),
                                            (sg + 8, 2 * st + 8))):
                A[row, col], A[row, col + 1] = _bf16_pair(regs[i])
            for i, k in enumerate((2 * st, 2 * st + 8)):
                B[k, sg], B[k + 1, sg] = _bf16_pair(regs[4 + i])
        return A @ B

    def _bf16_pair(word):
        # gpu.bits.bf16_lo / bf16_hi are simulator device functions, and each call swaps the
        # simulator's cuda module: 384 calls per lane per mma made the tests several times slower
        word = int(word)
        return (np.uint32((word & 0xFFFF) << 16).view(np.float32),
                np.uint32(word & 0xFFFF0000).view(np.float32))

    import threading
    import weakref
    _mma_lock = threading.Lock()
    _mma_tables = weakref.WeakKeyDictionary()   # block manager -> {(block, warp): 32 lanes}
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def to_tf32(typingctx, x):
        """float32 -> its TF32 bit pattern (``cvt.rna.tf32.f32``: round to nearest, ties away
        from zero; the low 13 mantissa bits zero)."""
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "cvt.rna.tf32.f32 $0, $1;", "=r,f"), args)

        return sig, codegen

    @intrinsic
    def tf32_value(typingctx, bits):
        """A TF32 bit pattern -> the float32 it stands for (a bit cast)."""
        sig = types.float32(types.uint32)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen

    @intrinsic
    def split_tf32_fast(typingctx, x):
        """float32 x -> (hi, lo) bit patterns for 3xTF32 in three integer/float operations
        (``cvt.rna`` is several SASS instructions; the attention kernel splits every staged
        key and probability): hi = x rounded to TF32 (add half an ulp to the magnitude, clear
        the low 13 bits), lo = x - hi exactly (|lo| <= 2^-11 |x|), left at full precision:
        the tensor core reads only its top 19 bits, so lo loses <= 2^-10 |lo| <= 2^-21 |x|.
        Finite |x| below FLT_MAX (1 - 2^-12) only; above, hi overflows to inf."""
        sig = types.UniTuple(types.uint32, 2)(types.float32)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            bits = builder.bitcast(args[0], i32)
            hi = builder.and_(builder.add(bits, ir.Constant(i32, 0x1000)),
                              ir.Constant(i32, 0xFFFFE000))
            lo = builder.fsub(args[0], builder.bitcast(hi, ir.FloatType()))
            return context.make_tuple(builder, sig.return_type, [hi, builder.bitcast(lo, i32)])

        return sig, codegen

    def _warp_mma(name: str, ptx_op: str, doc: str):
        """An intrinsic ``name(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``
        issuing ``ptx_op``: D = A B + C on one warp's tensor cores, A and B as 32-bit
        registers (TF32 patterns, or two bf16), C and D float32 (the module docstring has the
        fragments).  Both shapes the kernels use take the same ten registers."""
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(*([types.uint32] * 6 + [types.float32] * 4))

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4),
                                       [ir.IntType(32)] * 6 + [f32] * 4)
                op = ir.InlineAsm(
                    fnty, f"{ptx_op} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, "
                    "{$10, $11, $12, $13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)
                result = builder.call(op, args)
                parts = [builder.extract_value(result, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, parts)

            return sig, codegen
        mma.__name__ = mma.__qualname__ = name
        mma.__doc__ = doc
        return intrinsic(mma)

    mma_tf32_m16n8k8 = _warp_mma(
        "mma_tf32_m16n8k8", "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        "D = A B + C on one warp's tensor cores; fragments as in the module docstring.")

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        """Two float32 -> one uint32 holding two bf16, lo in the low half (``cvt.rn.bf16x2.f32``:
        round to nearest, ties to even; its first source goes to the upper half)."""
        sig = types.uint32(types.float32, types.float32)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.FloatType(), ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f"),
                                args)

        return sig, codegen

    mma_bf16_m16n8k16 = _warp_mma(
        "mma_bf16_m16n8k16", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "D = A B + C, bf16 operands (two per uint32) and fp32 accumulators, on one warp's "
        "tensor cores; fragments as in the module docstring.")
    block_uniform_mma_bf16 = mma_bf16_m16n8k16   # the simulator's stand-in is the real one here

    from kdtree_numba.gpu.llvm import asm_statement

    def _emit_wgmma(context, builder, n, acc_type, acc, operands, operand_text, modifiers):
        """``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16`` on the n / 2 float32 of the
        local array ``acc`` (read, then written back): ``operands`` (value, constraint) are
        asm arguments m, m + 1, ... (m = n / 2), ``operand_text(m)`` their place in the
        instruction (A and B), ``modifiers`` what follows scale-d and the two scales (the
        transposes)."""
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        m = n // 2
        data = context.make_array(acc_type)(context, builder, acc).data
        ptrs = [builder.gep(data, [ir.Constant(i64, i)]) for i in range(m)]
        values = [v for v, _ in operands]
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * m),
                               [v.type for v in values] + [i32] + [f32] * m)
        regs = ", ".join(f"${i}" for i in range(m))
        text = ("{\n\t.reg .pred p;\n\t"
                f"setp.ne.b32 p, ${m + len(values)}, 0;\n\t"
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
                f"{{{regs}}}, {operand_text(m)}, p, 1, 1, {modifiers};\n\t}}")
        constraints = ",".join(["=f"] * m + [c for _, c in operands] + ["r"]
                               + [str(i) for i in range(m)])
        out = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True),
                           values + [ir.Constant(i32, 1)] + [builder.load(p) for p in ptrs])
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(out, i), p)

    @functools.cache
    def wgmma_bf16(n: int):
        """An intrinsic ``wgmma(acc, smem, desc_a, desc_b)``: ``wgmma.mma_async.sync.aligned.
        m64n{n}k16.f32.bf16.bf16``, D[64 x n] += A[64 x 16] B[n x 16]^T on one warpgroup (4
        consecutive warps, all 128 threads calling), A and B read by the tensor cores from
        shared memory through 64-bit matrix descriptors (both K-major), D in ``acc``, the
        thread's n / 2 float32 (a local array of constant indices, so registers): element i
        at row 16 (warp % 4) + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2t + (i & 1), i.e.
        mma.sync's C fragment of n8 tile i >> 2 (lane = 4g + t).  ``smem`` is not read here
        (the simulator's emulation reads it).  Asynchronous: ``wgmma_fence`` before, then
        ``wgmma_commit``, and ``wgmma_wait_all`` (or ``wgmma_wait_1`` for all but the last
        group) before ``acc`` or the operands' shared memory are touched; the target must be
        sm_90a (numba-cuda compiles H200 launches for it)."""
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma takes n = 8, 16, ..., 256, got {n}")

        @intrinsic
        def wgmma(typingctx, acc, smem, desc_a, desc_b):
            sig = types.void(acc, smem, desc_a, desc_b)

            def codegen(context, builder, sig, args):
                descs = [(context.cast(builder, args[k], sig.args[k], types.int64), "l")
                         for k in (2, 3)]
                _emit_wgmma(context, builder, n, sig.args[0], args[0], descs,
                            lambda i: f"${i}, ${i + 1}", "0, 0")
            return sig, codegen
        return wgmma

    @functools.cache
    def wgmma_bf16_rs(n: int, trans_b: bool = False):
        """An intrinsic ``wgmma(acc, smem, a0, a1, a2, a3, desc_b)``: ``wgmma.mma_async.sync.
        aligned.m64n{n}k16.f32.bf16.bf16`` with A from registers -- a0 .. a3, each two bf16
        (the lower k in the low half), lane (g, t) of warp w % 4 holding rows 16 w + g and
        + 8 at k 2t, 2t + 1 and 2t + 8, 2t + 9 as mma.sync's A fragment -- and B through a
        shared-memory descriptor, K-major or, with ``trans_b``, N-major; D as
        :func:`wgmma_bf16`'s.  Same fences and waits; a0 .. a3, like the accumulators, must not
        be written before the ``wgmma_wait_*`` that covers the product (the PTX ISA leaves
        it undefined)."""
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"wgmma takes n = 8, 16, ..., 256, got {n}")
        trans = int(bool(trans_b))

        @intrinsic
        def wgmma(typingctx, acc, smem, a0, a1, a2, a3, desc_b):
            sig = types.void(acc, smem, a0, a1, a2, a3, desc_b)

            def codegen(context, builder, sig, args):
                operands = [(context.cast(builder, args[k], sig.args[k], types.uint32), "r")
                            for k in (2, 3, 4, 5)]
                operands.append((context.cast(builder, args[6], sig.args[6], types.int64), "l"))
                _emit_wgmma(context, builder, n, sig.args[0], args[0], operands,
                            lambda i: f"{{${i}, ${i + 1}, ${i + 2}, ${i + 3}}}, ${i + 4}",
                            str(trans))
            return sig, codegen
        return wgmma

    wgmma_fence = asm_statement("wgmma.fence.sync.aligned;")
    wgmma_commit = asm_statement("wgmma.commit_group.sync.aligned;")
    wgmma_wait_all = asm_statement("wgmma.wait_group.sync.aligned 0;")
    # all but the newest commit group done: one stage's wgmma runs on while the loop goes on
    wgmma_wait_1 = asm_statement("wgmma.wait_group.sync.aligned 1;")
    # orders this thread's generic-proxy writes to shared memory (cp.async's) before the
    # async proxy's reads of it (wgmma's operands)
    fence_proxy_async = asm_statement("fence.proxy.async.shared::cta;")


@device_function
def split_tf32(x):
    """float32 x -> (hi, lo) TF32 bit patterns with hi + lo = x to ~2^-22 relative: the 3xTF32
    split (hi * hi + hi * lo + lo * hi recovers an fp32-accurate product)."""
    hi = to_tf32(x)
    return hi, to_tf32(x - tf32_value(hi))

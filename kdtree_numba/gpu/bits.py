"""Bit reinterpretation in device code: integer bits as float32, float64 as int64, bf16 widening.

numba has no bit cast between integer and float types in device code, and ``numba.cuda.bf16``
exists neither in the simulator nor as a vector load, so bfloat16 weights travel as integers
(uint16 bits, or uint32 words holding two) and are widened here: ``f32 = bits << 16``.  On the
GPU the casts are libdevice calls or LLVM bitcasts; under the simulator, NumPy views.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.compat import SIMULATOR, device_function

__all__ = ["bits_to_f32", "f32_bits", "f64_bits", "bf16_lo", "bf16_hi", "bf16_bits_to_f32",
           "pair_low_halves", "pair_high_halves", "divmod_u32", "int4_pair0_bf16",
           "int4_pair1_bf16", "int4_pair2_bf16", "int4_pair3_bf16"]

if SIMULATOR:
    def _bits_to_f32_py(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    bits_to_f32 = device_function(_bits_to_f32_py)

    def f64_bits(value):
        """The bits of a float64 as an int64."""
        return np.float64(value).view(np.int64)

    def f32_bits(value):
        """The bits of a float32 as an int32."""
        return np.float32(value).view(np.int32)

    def pair_low_halves(x, y):
        return np.uint32((int(x) & 0xFFFF) | ((int(y) & 0xFFFF) << 16))

    def pair_high_halves(x, y):
        return np.uint32((int(x) >> 16) | (int(y) & 0xFFFF0000))

    def divmod_u32(a, b):
        return divmod(int(a), int(b))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @device_function
    def bits_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits))

    @device_function
    def f32_bits(value):
        """The bits of a float32 as an int32."""
        return libdevice.float_as_int(np.float32(value))

    @intrinsic
    def divmod_u32(typingctx, a, b):
        """(a // b, a % b) of two non-negative integers below 2^32, as int64s, by 32-bit
        unsigned division: numba divides in 64 bits, which ptxas makes a subroutine call,
        and a call anywhere in a kernel serializes its wgmma (ptxas C7509)."""
        sig = types.UniTuple(types.int64, 2)(a, b)

        def codegen(context, builder, sig, args):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            x, y = (builder.trunc(context.cast(builder, v, t, types.int64), i32)
                    for v, t in zip(args, sig.args))
            q, r = builder.zext(builder.udiv(x, y), i64), builder.zext(builder.urem(x, y), i64)
            return context.make_tuple(builder, sig.return_type, [q, r])
        return sig, codegen

    @intrinsic
    def f64_bits(typingctx, value):
        """The bits of a float64 as an int64 (an LLVM bitcast)."""
        sig = types.int64(types.float64)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(64))

        return sig, codegen


@device_function
def bf16_lo(word):
    """The bf16 in the low half of a little-endian uint32 word (the even element)."""
    return bits_to_f32(np.uint32(word) << np.uint32(16))


@device_function
def bf16_hi(word):
    """The bf16 in the high half of a little-endian uint32 word (the odd element)."""
    return bits_to_f32(np.uint32(word) & np.uint32(0xFFFF0000))


@device_function
def bf16_bits_to_f32(bits16):
    """One bf16 given as its uint16 bits, widened to float32."""
    return bits_to_f32(np.uint32(bits16) << np.uint32(16))


if not SIMULATOR:
    def _asm_u32x2(name: str, asm: str, doc: str):
        """An intrinsic ``name(x, y) -> uint32`` of two uint32 running the PTX ``asm`` ($0 the
        result, $1 and $2 the operands)."""
        @intrinsic
        def pair(typingctx, x, y):
            sig = types.uint32(types.uint32, types.uint32)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                fnty = ir.FunctionType(i32, [i32, i32])
                return builder.call(ir.InlineAsm(fnty, asm, "=r,r,r"), args)
            return sig, codegen
        pair.__name__ = pair.__qualname__ = name
        pair.__doc__ = doc
        return pair

    def _prmt(name: str, selector: int, doc: str):
        return _asm_u32x2(name, f"prmt.b32 $0, $1, $2, {selector:#06x};", doc)

    # One PRMT each, where the shifts and masks they stand for compiled to up to three
    # instructions (the bf16 attention kernel builds 128 of these words per key tile).
    pair_low_halves = _prmt("pair_low_halves", 0x5410,
                            "(x & 0xFFFF) | (y << 16): the low bf16 of x, then the low of y.")
    pair_high_halves = _prmt("pair_high_halves", 0x7632,
                             "(x >> 16) | (y & 0xFFFF0000): the high bf16 of x, then of y.")


# ============================================================================ int4 nibbles
# Byte i of a word of int4 weights (two's complement nibbles, the even weight in the low one)
# -> one uint32 of two bf16 (the even weight in the low half), exactly q: a PRMT puts the low
# nibble at bits 0-3 and, from ``shifted`` = word >> 4, the high one at bits 16-19; a LOP3
# masks them and XORs 0x4308 into each half, which makes the bf16 128 + (q + 8) (bits 0x43xx
# are 128 + mantissa, and n ^ 8 = q + 8 for a two's complement nibble n); one bf16x2 FMA (x 1
# - 136) leaves q, exact (integers below 2^8).  Three instructions per two weights; the
# W4A16 tensor-core kernel (layers/moe_int4_mma.py) builds its B fragments with them.
_I4_MASK, _I4_MAGIC, _I4_LUT = 0x000F000F, 0x43084308, 0x6A   # LUT: (a & b) ^ c
_BF16X2_ONE, _BF16X2_M136 = 0x3F803F80, 0xC308C308


def _int4_pair_selector(i: int) -> int:
    """PRMT's selector for byte i: result bytes 0, 1 <- the word's byte i, bytes 2, 3 <- the
    shifted word's byte i (source bytes 4-7)."""
    return i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12)


if SIMULATOR:
    def _int4_pair_py(i):
        def pair(word, shifted):
            word = int(word)
            halves = []
            for n in ((word >> 8 * i) & 0xF, (word >> (8 * i + 4)) & 0xF):
                q = n - 16 if n >= 8 else n
                halves.append(int(np.float32(q).view(np.uint32)) >> 16)
            return np.uint32(halves[0] | (halves[1] << 16))
        return pair

    int4_pair0_bf16, int4_pair1_bf16, int4_pair2_bf16, int4_pair3_bf16 = (
        _int4_pair_py(i) for i in range(4))
else:
    def _int4_pair(i: int):
        asm = ("{\n\t.reg .b32 %i4p, %i4one, %i4off;\n\t"
               f"prmt.b32 %i4p, $1, $2, {_int4_pair_selector(i):#06x};\n\t"
               f"lop3.b32 %i4p, %i4p, {_I4_MASK:#010x}, {_I4_MAGIC:#010x}, {_I4_LUT:#04x};\n\t"
               f"mov.b32 %i4one, {_BF16X2_ONE:#010x};\n\t"
               f"mov.b32 %i4off, {_BF16X2_M136:#010x};\n\t"
               "fma.rn.bf16x2 $0, %i4p, %i4one, %i4off;\n\t}")
        return _asm_u32x2(f"int4_pair{i}_bf16", asm,
                          f"Byte {i} of an int4 word (``shifted`` = word >> 4) as two bf16 q "
                          f"(module comment above).")

    int4_pair0_bf16, int4_pair1_bf16, int4_pair2_bf16, int4_pair3_bf16 = (
        _int4_pair(i) for i in range(4))

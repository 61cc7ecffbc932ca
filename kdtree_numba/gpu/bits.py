"""Bit reinterpretation in device code: integer bits as float32, float64 as int64, bf16 widening.

numba has no bit cast between integer and float types in device code, and ``numba.cuda.bf16``
exists neither in the simulator nor as a vector load, so bfloat16 weights travel as integers
(uint16 bits, or uint32 words holding two) and are widened here: ``f32 = bits << 16``.  On the
GPU the casts are libdevice calls or LLVM bitcasts; under the simulator, NumPy views.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.compat import SIMULATOR, device_function

__all__ = ["bits_to_f32", "f64_bits", "bf16_lo", "bf16_hi", "bf16_bits_to_f32"]

if SIMULATOR:
    def _bits_to_f32_py(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    bits_to_f32 = device_function(_bits_to_f32_py)

    def f64_bits(value):
        """The bits of a float64 as an int64."""
        return np.float64(value).view(np.int64)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import libdevice
    from numba.cuda.extending import intrinsic

    @device_function
    def bits_to_f32(bits):
        return libdevice.int_as_float(np.int32(bits))

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

"""CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum KDTR uses.

The ``crc32c`` package uses the CPU's CRC instruction (about 12 GB/s here).  Where it is missing
(the H200 image does not ship it) numba computes the same value: on x86-64 with the SSE4.2
``crc32`` instruction (one 8-byte word per call, ~5 GB/s), elsewhere, or where that does not
compile, with a slice-by-8 table loop (~1.5 GB/s).  All are tied by a test;
crc32c(b"123456789") is 0xE3069283.
"""
from __future__ import annotations

import numpy as np

__all__ = ["crc32c", "BACKEND"]

_POLY = 0x82F63B78


def _tables() -> np.ndarray:
    t = np.zeros((8, 256), dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0, i] = c
    for k in range(1, 8):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t


def _make_hardware_fallback():
    """CRC32C with the SSE4.2 ``crc32`` instruction through numba (x86-64 only)."""
    import platform

    import numba
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ImportError("no SSE4.2 crc32 instruction on " + platform.machine())

    def _llvm_crc(name, width):
        @intrinsic
        def crc_step(typingctx, crc, value):
            def codegen(context, builder, sig, args):
                acc, item = ir.IntType(width if width == 64 else 32), ir.IntType(width)
                fn = cgutils.get_or_insert_function(builder.module,
                                                    ir.FunctionType(acc, [acc, item]), name)
                return builder.call(fn, args)
            state = types.uint64 if width == 64 else types.uint32
            return state(state, types.uint64 if width == 64 else types.uint8), codegen
        return crc_step

    crc_u64 = _llvm_crc("llvm.x86.sse42.crc32.64.64", 64)
    crc_u8 = _llvm_crc("llvm.x86.sse42.crc32.32.8", 8)

    @numba.njit(cache=False, nogil=True)
    def _update(crc, buf):  # buf: uint8[::1]; running (non-inverted) state, as _make_fallback
        n, i = buf.size, 0
        while i < n and (buf.ctypes.data + i) % 8 != 0:  # bytes up to an 8-byte boundary
            crc = crc_u8(crc, buf[i])
            i += 1
        words = (n - i) // 8
        if words:
            w = buf[i:i + 8 * words].view(np.uint64)
            wide = np.uint64(crc)
            for k in range(words):
                wide = crc_u64(wide, w[k])
            crc = np.uint32(wide)
            i += 8 * words
        while i < n:
            crc = crc_u8(crc, buf[i])
            i += 1
        return crc

    def crc32c_hardware(data, value: int = 0) -> int:
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        return int(_update(np.uint32(value ^ 0xFFFFFFFF), buf)) ^ 0xFFFFFFFF

    if crc32c_hardware(b"123456789") != 0xE3069283:  # compiles now; fails loudly if wrong
        raise ImportError("the SSE4.2 CRC32C path gave a wrong check value")
    return crc32c_hardware


def _make_fallback():
    import numba

    tables = _tables()

    @numba.njit(cache=False, nogil=True)
    def _update(crc, buf, t):  # buf: uint8[::1]; returns the running (non-inverted) state
        n = buf.size
        i = 0
        while i + 8 <= n:
            lo = crc ^ (np.uint32(buf[i]) | (np.uint32(buf[i + 1]) << 8)
                        | (np.uint32(buf[i + 2]) << 16) | (np.uint32(buf[i + 3]) << 24))
            crc = (t[7, lo & 0xFF] ^ t[6, (lo >> 8) & 0xFF] ^ t[5, (lo >> 16) & 0xFF]
                   ^ t[4, lo >> 24] ^ t[3, buf[i + 4]] ^ t[2, buf[i + 5]]
                   ^ t[1, buf[i + 6]] ^ t[0, buf[i + 7]])
            i += 8
        while i < n:
            crc = (crc >> 8) ^ t[0, (crc ^ buf[i]) & 0xFF]
            i += 1
        return crc

    def crc32c_fallback(data, value: int = 0) -> int:
        buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        state = np.uint32(value ^ 0xFFFFFFFF)
        return int(_update(state, buf, tables)) ^ 0xFFFFFFFF

    return crc32c_fallback


try:
    from crc32c import crc32c as _hw_crc32c

    def crc32c(data, value: int = 0) -> int:
        """CRC32C of ``data`` (any buffer), continuing from ``value`` (a previous result)."""
        return _hw_crc32c(memoryview(data).cast("B"), value=value)

    BACKEND = "crc32c"
except ImportError:  # pragma: no cover - exercised on machines without the package
    try:
        crc32c = _make_hardware_fallback()
        BACKEND = "numba-sse4.2"
    except Exception:  # not x86-64, or LLVM cannot select the instruction for this CPU target
        crc32c = _make_fallback()
        BACKEND = "numba-slice-by-8"

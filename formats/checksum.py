"""CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum KDTR uses.

The ``crc32c`` package uses the CPU's CRC instruction (about 12 GB/s here).  Where it is missing
(the H200 image does not ship it) a numba-compiled slice-by-8 loop computes the same value,
slower but with no extra dependency.  Both are tied by a test; crc32c(b"123456789") is 0xE3069283.
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
    crc32c = _make_fallback()
    BACKEND = "numba-slice-by-8"

"""The KDTR dtype table: one code per element type, shared by the reader, writer and converters.

Codes are part of the on-disk format (docs/FORMAT.md, section "Dtype codes"): never renumber.
bfloat16 and the float8 variants come from ml_dtypes, so NumPy can hold them.  ``int4`` is
packed two values per byte, low nibble first; NumPy sees it unpacked as int8 (see ``unpack_int4``).
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = ["DType", "BY_CODE", "BY_NAME", "INT4", "dtype_for", "pack_int4", "unpack_int4"]


@dataclass(frozen=True)
class DType:
    code: int
    name: str          # the name used in FORMAT.md, kdtr-dump and the HDF5 marker attribute
    numpy: np.dtype    # how NumPy holds one element (int4: int8, unpacked)
    storage: np.dtype  # how the bytes on disk are viewed (int4: uint8, packed)
    packed: bool = False

    def nbytes(self, count: int) -> int:
        """Bytes on disk for ``count`` elements (int4: two per byte)."""
        return count // 2 if self.packed else count * self.storage.itemsize


def _d(code, name, np_dtype, storage=None, packed=False):
    np_dtype = np.dtype(np_dtype)
    return DType(code, name, np_dtype, np.dtype(storage) if storage is not None else np_dtype,
                 packed)


_ALL = [
    _d(1, "bool", np.bool_),
    _d(2, "int8", np.int8), _d(3, "uint8", np.uint8),
    _d(4, "int16", "<i2"), _d(5, "uint16", "<u2"),
    _d(6, "int32", "<i4"), _d(7, "uint32", "<u4"),
    _d(8, "int64", "<i8"), _d(9, "uint64", "<u8"),
    _d(10, "float16", "<f2"), _d(11, "bfloat16", ml_dtypes.bfloat16),
    _d(12, "float32", "<f4"), _d(13, "float64", "<f8"),
    _d(14, "float8_e4m3fn", ml_dtypes.float8_e4m3fn), _d(15, "float8_e5m2", ml_dtypes.float8_e5m2),
    _d(16, "int4", np.int8, storage=np.uint8, packed=True),
    _d(17, "complex64", "<c8"), _d(18, "complex128", "<c16"),
]
BY_CODE: dict[int, DType] = {d.code: d for d in _ALL}
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
INT4 = BY_NAME["int4"]
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _ALL if not d.packed}


def dtype_for(dtype) -> DType:
    """The KDTR dtype for a NumPy dtype or a name (``"bfloat16"``, ``"int4"``, ``np.float32``)."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, str) and dtype in BY_NAME:
        return BY_NAME[dtype]
    try:
        key = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"unsupported dtype {dtype!r}") from e
    if key.byteorder == ">":
        key = key.newbyteorder("<")
    found = _BY_NUMPY.get(key)
    if found is None:
        raise TypeError(f"unsupported dtype {key} (KDTR stores: {', '.join(BY_NAME)})")
    return found


def pack_int4(values: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7], last dimension even -> uint8, two per byte, low nibble first."""
    v = np.asarray(values)
    if v.ndim == 0 or v.shape[-1] % 2:
        raise ValueError(f"int4 needs a last dimension that fills whole bytes (even); got shape {v.shape}")
    if v.size and (v.min() < -8 or v.max() > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    u = (v.astype(np.int16) & 0xF).astype(np.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of ``pack_int4``: uint8 bytes -> int8 values of the logical ``shape``."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    out = np.empty(p.size * 2, dtype=np.int8)
    lo = (p & 0xF).astype(np.int8)
    hi = (p >> 4).astype(np.int8)
    out[0::2] = np.where(lo > 7, lo - 16, lo)
    out[1::2] = np.where(hi > 7, hi - 16, hi)
    return out.reshape(shape)

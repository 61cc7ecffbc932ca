"""Attribute values <-> their value-pool bytes (docs/FORMAT.md, "Attribute table": values by kind).

``encode_attr`` turns a Python/NumPy value into (kind, bytes); ``decode_attr`` checks every
size and count against the bytes before it builds anything (K046, K050-K053, K055).  The writer,
the reader, ``AttributeManager`` (which stores what a reader will see) and the HDF5 mapping all
go through these two functions.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from . import layout as L
from .dtypes import BY_CODE, dtype_for
from .errors import KdtrError

__all__ = ["encode_attr", "decode_attr"]


def encode_attr(value: Any) -> tuple[int, bytes]:
    """A Python/NumPy attribute value -> (kind, value-pool bytes)."""
    if isinstance(value, (bool, np.bool_)):
        return L.ATTR_BOOL, bytes([1 if value else 0])
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if not -(1 << 63) <= v < (1 << 63):
            raise OverflowError(f"int attribute {v} does not fit in int64")
        return L.ATTR_INT, struct.pack("<q", v)
    if isinstance(value, (float, np.floating)):
        return L.ATTR_FLOAT, struct.pack("<d", float(value))
    if isinstance(value, str):
        return L.ATTR_STR, _utf8(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        enc = [_utf8(v) for v in value]
        return L.ATTR_STRLIST, (struct.pack(f"<I{len(enc)}I", len(enc), *map(len, enc))
                                + b"".join(enc))
    if isinstance(value, (list, tuple)) and not value:
        return L.ATTR_STRLIST, struct.pack("<I", 0)
    arr = np.asarray(value)
    if arr.dtype.kind in "OUSV" and arr.dtype.names is None and arr.dtype.kind != "V":
        raise TypeError(f"unsupported attribute value of type {type(value).__name__}")
    dt = dtype_for(arr.dtype)
    if arr.ndim > L.MAX_NDIM:
        raise ValueError(f"array attribute with {arr.ndim} dimensions (limit {L.MAX_NDIM})")
    data = np.ascontiguousarray(arr.astype(dt.storage, copy=False)).tobytes()
    head = struct.pack("<BB6x", dt.code, arr.ndim) + struct.pack(f"<{arr.ndim}Q", *arr.shape)
    return L.ATTR_ARRAY, head + data


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate has no UTF-8 form
        raise KdtrError("K055", f"{text!a} cannot be stored as UTF-8: {e.reason}") from None


def decode_attr(kind: int, raw: bytes, where: str) -> Any:
    """Value-pool bytes -> value; every size and count checked against ``raw`` first."""
    n = len(raw)
    if kind == L.ATTR_STR:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KdtrError("K055", str(e), where) from None
    if kind in (L.ATTR_INT, L.ATTR_FLOAT):
        if n != 8:
            raise KdtrError("K050", f"{L.ATTR_KIND_NAMES[kind]} value of {n} bytes (need 8)", where)
        return struct.unpack("<q" if kind == L.ATTR_INT else "<d", raw)[0]
    if kind == L.ATTR_BOOL:
        if n != 1:
            raise KdtrError("K050", f"bool value of {n} bytes (need 1)", where)
        if raw[0] > 1:
            raise KdtrError("K051", f"bool byte {raw[0]}", where)
        return bool(raw[0])
    if kind == L.ATTR_STRLIST:
        if n < 4:
            raise KdtrError("K050", f"string list of {n} bytes (need >= 4)", where)
        (count,) = struct.unpack_from("<I", raw)
        if 4 + 4 * count > n:
            raise KdtrError("K052", f"{count} strings need {4 + 4 * count} bytes of lengths, "
                                    f"value has {n}", where)
        lens = struct.unpack_from(f"<{count}I", raw, 4)
        if 4 + 4 * count + sum(lens) != n:
            raise KdtrError("K052", f"string lengths sum to {sum(lens)}, value holds "
                                    f"{n - 4 - 4 * count}", where)
        out, pos = [], 4 + 4 * count
        for ln in lens:
            try:
                out.append(raw[pos:pos + ln].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise KdtrError("K055", str(e), where) from None
            pos += ln
        return out
    if kind == L.ATTR_ARRAY:
        if n < L.ARRAY_ATTR_HEAD:
            raise KdtrError("K050", f"array value of {n} bytes", where)
        code, ndim = raw[0], raw[1]
        if any(raw[2:8]):
            raise KdtrError("K053", "reserved bytes of the array head are not zero", where)
        if code not in BY_CODE:
            raise KdtrError("K053", f"unknown dtype code {code}", where)
        if ndim > L.MAX_NDIM:
            raise KdtrError("K053", f"{ndim} dimensions (limit {L.MAX_NDIM})", where)
        head = L.ARRAY_ATTR_HEAD + 8 * ndim
        if head > n:
            raise KdtrError("K050", f"array value of {n} bytes cannot hold {ndim} dims", where)
        shape = struct.unpack_from(f"<{ndim}Q", raw, L.ARRAY_ATTR_HEAD)
        dt = BY_CODE[code]
        count = nonzero = 1
        for d in shape:  # bounded: the value is <= 64 KiB, so any real shape is small
            if d > L.MAX_DIM:
                raise KdtrError("K053", f"dimension {d} out of range", where)
            count *= d
            nonzero *= max(d, 1)
        if nonzero * BY_CODE[code].storage.itemsize > L.MAX_TENSOR_BYTES:
            raise KdtrError("K053", f"shape {shape} cannot be described (even empty)", where)
        if dt.packed:
            raise KdtrError("K053", "packed int4 is not allowed in attributes", where)
        if head + dt.nbytes(count) != n:
            raise KdtrError("K050", f"array {shape} of {dt.name} needs {head + dt.nbytes(count)} "
                                    f"bytes, value has {n}", where)
        arr = np.frombuffer(raw, dtype=dt.storage, count=count, offset=head).reshape(shape)
        if dt.name == "bool" and arr.size and arr.view(np.uint8).max() > 1:
            raise KdtrError("K051", "bool array attribute holds a byte other than 0/1", where)
        return arr.copy()
    raise KdtrError("K046", f"attribute kind {kind}", where)

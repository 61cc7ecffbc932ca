"""The KDTR <-> HDF5 mapping (docs/KDTR_DUMP.md, "HDF5 mapping"): the marker attributes, the
bit-pattern storage of dtypes HDF5 has no type for, which HDF5 types KDTR can hold, and the
attribute values both ways.  ``formats.hdf5`` walks trees and converts files with it; kdtr-dump
lists HDF5 files with it.  HDF5 input is untrusted: every value is checked as it is read.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5, h5a, h5p, h5s

from . import layout as L
from .attributes import decode_attr, encode_attr
from .dtypes import BY_NAME, dtype_for
from .errors import KdtrError
from .names import check_name

__all__ = ["MARK_DTYPE", "MARK_SHAPE", "MARK_ATTR_TYPES", "MARK_INDEX", "MARK_ALIGN", "MARKERS",
           "RESERVED_PREFIX", "BIT_PATTERNS", "Unreadable", "read_attrs", "write_attrs",
           "describe_h5_dtype", "unsupported_kind", "little_endian", "hdf5_errors",
           "creation_ordered", "decode_name", "scalar_str"]

MARK_DTYPE, MARK_SHAPE = "kdtr.dtype", "kdtr.shape"
MARK_ATTR_TYPES, MARK_INDEX, MARK_ALIGN = "kdtr.attr_types", "kdtr.index", "kdtr.align_log2"
MARKERS = {MARK_DTYPE, MARK_SHAPE, MARK_ATTR_TYPES, MARK_INDEX, MARK_ALIGN}
RESERVED_PREFIX = "kdtr."
# KDTR dtypes HDF5 has no type for: stored as bit patterns of this unsigned type.
BIT_PATTERNS = {"bfloat16": np.dtype("<u2"), "float8_e4m3fn": np.dtype("u1"),
         "float8_e5m2": np.dtype("u1"), "int4": np.dtype("u1")}
_NATURAL_SCALARS = {np.dtype("<i8"), np.dtype("<f8"), np.dtype(bool)}


# ----------------------------------------------------------------------------- helpers

def little_endian(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


@contextlib.contextmanager
def hdf5_errors(where: str | None):
    """Turn the HDF5 library's own exceptions into KdtrError (K002) naming the node."""
    try:
        yield
    except KdtrError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, SystemError,
            OverflowError, UnicodeError) as e:
        raise KdtrError("K002", f"unreadable HDF5 ({type(e).__name__}: {e})", where) from None


def creation_ordered(oid, what: str) -> bool:
    """Whether an object tracks the creation order of its links or of its attributes."""
    plist = oid.get_create_plist()
    try:
        flags = (plist.get_link_creation_order() if what == "links"
                 else plist.get_attr_creation_order())
        return bool(flags & h5p.CRT_ORDER_TRACKED)
    finally:
        plist.close()


def decode_name(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KdtrError("K039", str(e), where) from None



def scalar_str(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "strict")
    return value if isinstance(value, str) else None


# ----------------------------------------------------------------------------- attributes

@dataclass
class Unreadable:
    """An attribute ``read_attrs(strict=False)`` could not convert (shown by kdtr-dump)."""
    reason: str

    def __repr__(self) -> str:
        return f"<unsupported: {self.reason}>"


def _attr_names(oid, where: str) -> list[bytes]:
    raw: list[bytes] = []
    order = h5.INDEX_CRT_ORDER if creation_ordered(oid, "attrs") else h5.INDEX_NAME
    h5a.iterate(oid, lambda n, *_: raw.append(n), index_type=order)
    if len(raw) > L.MAX_ATTRS:
        raise KdtrError("K012", f"{len(raw)} attributes on one object", where)
    return raw


def _check_attr_type(aid, where: str) -> tuple[np.dtype, tuple[int, ...], str]:
    """The numpy dtype and shape of an HDF5 attribute and what it is: 'str' or 'numeric'."""
    if aid.get_space().get_simple_extent_type() == h5s.NULL:
        raise KdtrError("K004", "empty attribute (null dataspace) is not supported", where)
    dt, shape = aid.dtype, tuple(aid.shape)
    if len(shape) > L.MAX_NDIM:
        raise KdtrError("K053", f"{len(shape)} dimensions (limit {L.MAX_NDIM})", where)
    count = int(np.prod(shape, dtype=object))
    if h5py.check_string_dtype(dt) is not None:
        if count > L.MAX_ATTR_VALUE_BYTES:
            raise KdtrError("K049", f"{count} strings", where)
        return dt, shape, "str"
    kind = unsupported_kind(dt)
    if kind:
        raise KdtrError("K004", f"unsupported attribute type: {kind}", where)
    if count * dt.itemsize + L.ARRAY_ATTR_HEAD + 8 * len(shape) > L.MAX_ATTR_VALUE_BYTES:
        raise KdtrError("K049", f"{count * dt.itemsize} bytes > {L.MAX_ATTR_VALUE_BYTES}", where)
    return dt, shape, "numeric"


def unsupported_kind(dt: np.dtype) -> str | None:
    """Why KDTR cannot hold this h5py dtype (None: it can)."""
    if h5py.check_ref_dtype(dt) is not None:
        return "object reference"
    if h5py.check_vlen_dtype(dt) is not None:
        return "variable-length sequence" if h5py.check_string_dtype(dt) is None else "string"
    if h5py.check_string_dtype(dt) is not None:
        return "string"
    if h5py.check_enum_dtype(dt) is not None:
        return f"enum ({dt})"
    if dt.subdtype is not None:
        return f"array type ({dt})"
    if dt.names is not None:
        return "compound"
    if dt.kind not in "biufc":
        return {"O": "object", "V": "opaque"}.get(dt.kind, str(dt))
    try:
        dtype_for(little_endian(dt))
    except TypeError:
        return str(dt)
    return None


def describe_h5_dtype(dt: np.dtype) -> str:
    """A short name for listings: the KDTR name where there is one, else what HDF5 holds."""
    why = unsupported_kind(dt)
    return dtype_for(little_endian(dt)).name if why is None else why


def _natural_value(value: Any, dt: np.dtype, shape: tuple, kind: str, where: str) -> Any:
    if kind == "str":
        try:
            if not shape:
                text = scalar_str(value.item() if isinstance(value, np.generic) else value)
                if text is None:
                    raise KdtrError("K055", "string attribute did not read as text", where)
                return _no_surrogates(text, where)
            if len(shape) != 1:
                raise KdtrError("K053", f"string array of shape {list(shape)}: only 1-d lists "
                                        "of strings are supported", where)
            return [_no_surrogates(scalar_str(v.item() if isinstance(v, np.generic) else v),
                                   where) for v in np.asarray(value).tolist()]
        except UnicodeDecodeError as e:
            raise KdtrError("K055", str(e), where) from None
    arr = np.asarray(value)
    arr = arr.astype(little_endian(arr.dtype), copy=False)
    if arr.ndim == 0 and arr.dtype in _NATURAL_SCALARS:
        return arr.item()
    return np.array(arr, order="C")  # a copy that keeps 0-d arrays 0-d


def _no_surrogates(text: Any, where: str) -> str:
    if not isinstance(text, str):
        raise KdtrError("K055", "string attribute did not read as text", where)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KdtrError("K055", str(e), where) from None
    return text


def _marked_value(value: Any, kind: str, stored_as: str, where: str) -> Any:
    """Undo a ``kdtr.attr_types`` entry."""
    arr = None if kind == "str" else np.asarray(value)
    if stored_as in BIT_PATTERNS and stored_as != "int4":
        if arr is None or arr.dtype != BIT_PATTERNS[stored_as]:
            raise KdtrError("K053", f"{stored_as} attribute must be stored as "
                                    f"{BIT_PATTERNS[stored_as]}", where)
        return np.array(arr, order="C").view(BY_NAME[stored_as].numpy)
    if stored_as == "array":
        if arr is None or arr.ndim != 0 or arr.dtype not in _NATURAL_SCALARS:
            raise KdtrError("K053", "'array' marks 0-d int64/float64/bool values only", where)
        return arr.copy()
    if stored_as in ("str", "str-list"):
        if arr is None or arr.dtype != np.uint8 or arr.ndim != 1:
            raise KdtrError("K053", f"{stored_as} attribute must be stored as 1-d uint8", where)
        code = L.ATTR_STR if stored_as == "str" else L.ATTR_STRLIST
        return decode_attr(code, arr.tobytes(), where)
    raise KdtrError("K046", f"unknown kdtr.attr_types entry {stored_as!a}", where)


def _attr_types(obj, where: str) -> dict[str, str]:
    if MARK_ATTR_TYPES not in obj.attrs:
        return {}
    raw = obj.attrs[MARK_ATTR_TYPES]
    arr = np.asarray(raw)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.dtype.kind not in "OSU":
        raise KdtrError("K053", f"{MARK_ATTR_TYPES} must be an (n, 2) string array", where)
    out: dict[str, str] = {}
    for name, stored_as in arr.tolist():
        name, stored_as = scalar_str(name), scalar_str(stored_as)
        if name is None or stored_as is None:
            raise KdtrError("K053", f"{MARK_ATTR_TYPES} holds a non-string", where)
        if name in out:
            raise KdtrError("K054", f"{name!a} listed twice in {MARK_ATTR_TYPES}", where)
        out[name] = stored_as
    return out


def read_attrs(obj, where: str, strict: bool = True) -> dict[str, Any]:
    """The attributes of an h5py object as KDTR values, in creation order, markers removed.
    ``strict=False`` (listings) keeps going: names KDTR would refuse are shown as they are and
    an ``Unreadable`` stands in for each value that cannot convert."""
    with hdf5_errors(where):
        oid = obj.id
        names = _attr_names(oid, where)
        try:
            types = _attr_types(obj, where)
        except KdtrError:
            if strict:
                raise
            types = {}
    out: dict[str, Any] = {}
    for raw in names:
        name = raw.decode("utf-8", "backslashreplace")
        if name in MARKERS:
            continue
        at = f"{where} (attribute {name!a})"
        try:
            with hdf5_errors(at):
                out[name] = _read_attr(obj, raw, at, types.get(name), strict)
        except KdtrError as e:
            if strict:
                raise
            out[name] = Unreadable(e.detail)
    if strict and set(types) - set(out):
        raise KdtrError("K053", f"{MARK_ATTR_TYPES} names missing attributes "
                                f"{sorted(set(types) - set(out))!a}", where)
    return out


def _read_attr(obj, raw: bytes, at: str, stored_as: str | None, strict: bool) -> Any:
    name = decode_name(raw, at)
    if strict:   # a listing shows the value whatever the name
        check_name(name, at)
    if name.startswith(RESERVED_PREFIX):
        raise KdtrError("K046", f"unknown marker attribute {name!a} (names starting with "
                                f"{RESERVED_PREFIX!r} are reserved)", at)
    dt, shape, kind = _check_attr_type(h5a.open(obj.id, raw), at)
    value = obj.attrs[name]
    if stored_as is not None:
        return _marked_value(value, kind, stored_as, at)
    value = _natural_value(value, dt, shape, kind, at)
    if kind == "str":   # sizes of numeric values were checked before reading
        size = len(encode_attr(value)[1])
        if size > L.MAX_ATTR_VALUE_BYTES:
            raise KdtrError("K049", f"{size} bytes > {L.MAX_ATTR_VALUE_BYTES}", at)
    return value


def write_attrs(obj, attrs: dict[str, Any], where: str) -> None:
    """Write KDTR attribute values onto an h5py object (see the module docstring)."""
    types: list[tuple[str, str]] = []
    for name, value in attrs.items():
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(f"attribute {name!r} at {where!r}: names starting with "
                             f"{RESERVED_PREFIX!r} are reserved by the HDF5 mapping")
        if isinstance(value, bool):
            obj.attrs.create(name, np.bool_(value))
        elif isinstance(value, int):
            obj.attrs.create(name, np.int64(value))
        elif isinstance(value, float):
            obj.attrs.create(name, np.float64(value))
        elif isinstance(value, str):
            if "\0" in value:   # HDF5 strings are C strings
                obj.attrs.create(name, np.frombuffer(value.encode("utf-8"), np.uint8))
                types.append((name, "str"))
            else:
                obj.attrs.create(name, value, dtype=h5py.string_dtype())
        elif isinstance(value, list):
            if any("\0" in s for s in value):
                _, raw = encode_attr(value)
                obj.attrs.create(name, np.frombuffer(raw, np.uint8))
                types.append((name, "str-list"))
            else:
                obj.attrs.create(name, np.array(value, dtype=object).reshape(len(value)),
                                 dtype=h5py.string_dtype())
        else:
            arr = np.asarray(value)
            dt = dtype_for(arr.dtype)
            if dt.name in BIT_PATTERNS:
                obj.attrs.create(name, np.array(arr, order="C").view(BIT_PATTERNS[dt.name]))
                types.append((name, dt.name))
            else:
                obj.attrs.create(name, arr)
                if arr.ndim == 0 and arr.dtype in _NATURAL_SCALARS:
                    types.append((name, "array"))
    if types:
        obj.attrs.create(MARK_ATTR_TYPES, np.array(types, dtype=object),
                         dtype=h5py.string_dtype())

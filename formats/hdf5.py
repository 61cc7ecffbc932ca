"""KDTR <-> HDF5, lossless both ways.  HDF5 input is untrusted: it is walked and checked first.

    from formats.hdf5 import to_hdf5, from_hdf5
    to_hdf5("w.kdtr", "w.h5")           # KDTR -> HDF5 -> KDTR gives back the same bytes
    from_hdf5("w.h5", "w.kdtr")

Mapping (docs/KDTR_DUMP.md, "HDF5 mapping"):
- every group and dataset is created with ``track_order=True`` and read back in creation order
  (name order for files that do not track it);
- bfloat16 / float8 datasets are stored as their bit patterns (uint16 / uint8) with the marker
  attribute ``kdtr.dtype``; int4 as its packed uint8 bytes with ``kdtr.dtype = "int4"`` and the
  logical shape in ``kdtr.shape``;
- attributes: str -> variable-length UTF-8 string, int -> int64 scalar, float -> float64
  scalar, bool -> HDF5 bool enum, list of str -> 1-d string array, arrays -> arrays.  Where the
  natural HDF5 form would read back as something else (a 0-d int64/float64/bool array would come
  back as int/float/bool, a bf16/fp8 array cannot be stored at all, a string holding NUL cannot
  be a C string) the object gets one extra attribute ``kdtr.attr_types``: an (n, 2) string
  array of (attribute name, stored-as) pairs;
- ``kdtr.index`` (per node) records the KDTR node order when it is not the depth-first order of
  the tree, and ``kdtr.align_log2`` (root) a non-default alignment, so that the KDTR bytes come
  back identical.  Attribute names starting with ``kdtr.`` are reserved.

Import refuses (``KdtrError``) what KDTR cannot hold or what could hurt a converter: names
KDTR rejects (K039-K042), soft/external/user-defined links and committed datatypes (K024), an
object reachable twice: hard-link cycles or shared objects (K022), compound, vlen, reference,
opaque, enum, array and string datasets (K004), raw data kept outside the file: external storage
or virtual datasets (K034), shapes and sizes beyond KDTR's limits (K028-K030), bool bytes other
than 0/1 (K051), bad markers (K026, K027, K031, K032, K046, K053).  Errors the HDF5 library
raises while reading are re-raised as K002 ("unreadable HDF5: ...").
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import h5py
import numpy as np
from h5py import h5, h5a, h5d, h5l, h5o, h5p, h5s

from . import kdtr
from . import layout as L
from .dtypes import BY_NAME, DType, dtype_for, unpack_int4
from .kdtr import KdtrError, check_name

__all__ = ["to_hdf5", "from_hdf5", "open_hdf5", "walk", "H5Node", "read_attrs", "write_attrs",
           "iter_blocks", "MARK_DTYPE", "MARK_SHAPE", "MARK_ATTR_TYPES", "MARK_INDEX", "MARK_ALIGN"]

MARK_DTYPE, MARK_SHAPE = "kdtr.dtype", "kdtr.shape"
MARK_ATTR_TYPES, MARK_INDEX, MARK_ALIGN = "kdtr.attr_types", "kdtr.index", "kdtr.align_log2"
_MARKERS = {MARK_DTYPE, MARK_SHAPE, MARK_ATTR_TYPES, MARK_INDEX, MARK_ALIGN}
RESERVED_PREFIX = "kdtr."
# KDTR dtypes HDF5 has no type for: stored as bit patterns of this unsigned type.
_BITS = {"bfloat16": np.dtype("<u2"), "float8_e4m3fn": np.dtype("u1"),
         "float8_e5m2": np.dtype("u1"), "int4": np.dtype("u1")}
_NATURAL_SCALARS = {np.dtype("<i8"), np.dtype("<f8"), np.dtype(bool)}
BLOCK_BYTES = 64 << 20      # converters move at most this much per h5py call
SPILL_BYTES = 1 << 30       # larger HDF5 datasets are staged in a temporary file, not in RAM
Progress = Callable[[int, int], None]


# ----------------------------------------------------------------------------- helpers

def iter_blocks(shape: tuple[int, ...], max_elems: int) -> Iterator[tuple]:
    """Index tuples (ints and step-1 slices) that tile an array of ``shape`` in C order, each
    block holding at most ``max_elems`` elements.  Empty arrays yield nothing; 0-d yields ()."""
    if not shape:
        yield ()
        return
    if 0 in shape:
        return
    axis, inner = len(shape) - 1, 1
    while axis > 0 and inner * shape[axis] <= max_elems:
        inner *= shape[axis]
        axis -= 1
    if inner * shape[axis] <= max_elems:   # the whole array fits
        yield tuple(slice(0, n) for n in shape)
        return
    step = max(1, max_elems // inner)
    tail = tuple(slice(0, n) for n in shape[axis + 1:])
    for lead in np.ndindex(*shape[:axis]):
        for start in range(0, shape[axis], step):
            yield lead + (slice(start, min(start + step, shape[axis])),) + tail


def _le(dt: np.dtype) -> np.dtype:
    return dt.newbyteorder("<") if dt.byteorder == ">" else dt


@contextlib.contextmanager
def _h5_errors(where: str | None):
    """Turn the HDF5 library's own exceptions into KdtrError (K002) naming the node."""
    try:
        yield
    except KdtrError:
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError, SystemError,
            OverflowError, UnicodeError) as e:
        raise KdtrError("K002", f"unreadable HDF5 ({type(e).__name__}: {e})", where) from None


def open_hdf5(path: str | os.PathLike) -> h5py.File:
    """Open an HDF5 file read-only, refusing what is not a regular file (K058) and turning
    "not HDF5" or a damaged superblock into K002."""
    path = os.fspath(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise KdtrError("K058", f"{path!a} is not a regular file")
    try:
        return h5py.File(path, "r", locking=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise KdtrError("K002", f"not a readable HDF5 file ({e})") from None


def _creation_ordered(oid, what: str) -> bool:
    """Whether an object tracks the creation order of its links or of its attributes."""
    plist = oid.get_create_plist()
    try:
        flags = (plist.get_link_creation_order() if what == "links"
                 else plist.get_attr_creation_order())
        return bool(flags & h5p.CRT_ORDER_TRACKED)
    finally:
        plist.close()


def _decode_name(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KdtrError("K039", str(e), where) from None


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


def _scalar_str(value: Any) -> str | None:
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
    order = h5.INDEX_CRT_ORDER if _creation_ordered(oid, "attrs") else h5.INDEX_NAME
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
    kind = _unsupported_kind(dt)
    if kind:
        raise KdtrError("K004", f"unsupported attribute type: {kind}", where)
    if count * dt.itemsize + L.ARRAY_ATTR_HEAD + 8 * len(shape) > L.MAX_ATTR_VALUE_BYTES:
        raise KdtrError("K049", f"{count * dt.itemsize} bytes > {L.MAX_ATTR_VALUE_BYTES}", where)
    return dt, shape, "numeric"


def _unsupported_kind(dt: np.dtype) -> str | None:
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
        dtype_for(_le(dt))
    except TypeError:
        return str(dt)
    return None


def describe_h5_dtype(dt: np.dtype) -> str:
    """A short name for listings: the KDTR name where there is one, else what HDF5 holds."""
    why = _unsupported_kind(dt)
    return dtype_for(_le(dt)).name if why is None else why


def _natural_value(value: Any, dt: np.dtype, shape: tuple, kind: str, where: str) -> Any:
    if kind == "str":
        try:
            if not shape:
                text = _scalar_str(value.item() if isinstance(value, np.generic) else value)
                if text is None:
                    raise KdtrError("K055", "string attribute did not read as text", where)
                return _no_surrogates(text, where)
            if len(shape) != 1:
                raise KdtrError("K053", f"string array of shape {list(shape)}: only 1-d lists "
                                        "of strings are supported", where)
            return [_no_surrogates(_scalar_str(v.item() if isinstance(v, np.generic) else v),
                                   where) for v in np.asarray(value).tolist()]
        except UnicodeDecodeError as e:
            raise KdtrError("K055", str(e), where) from None
    arr = np.asarray(value)
    arr = arr.astype(_le(arr.dtype), copy=False)
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
    if stored_as in _BITS and stored_as != "int4":
        if arr is None or arr.dtype != _BITS[stored_as]:
            raise KdtrError("K053", f"{stored_as} attribute must be stored as "
                                    f"{_BITS[stored_as]}", where)
        return np.array(arr, order="C").view(BY_NAME[stored_as].numpy)
    if stored_as == "array":
        if arr is None or arr.ndim != 0 or arr.dtype not in _NATURAL_SCALARS:
            raise KdtrError("K053", "'array' marks 0-d int64/float64/bool values only", where)
        return arr.copy()
    if stored_as in ("str", "str-list"):
        if arr is None or arr.dtype != np.uint8 or arr.ndim != 1:
            raise KdtrError("K053", f"{stored_as} attribute must be stored as 1-d uint8", where)
        code = L.ATTR_STR if stored_as == "str" else L.ATTR_STRLIST
        return kdtr._decode_attr(code, arr.tobytes(), where)
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
        name, stored_as = _scalar_str(name), _scalar_str(stored_as)
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
    with _h5_errors(where):
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
        if name in _MARKERS:
            continue
        at = f"{where} (attribute {name!a})"
        try:
            with _h5_errors(at):
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
    name = _decode_name(raw, at)
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
        size = len(kdtr._encode_attr(value)[1])
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
                _, raw = kdtr._encode_attr(value)
                obj.attrs.create(name, np.frombuffer(raw, np.uint8))
                types.append((name, "str-list"))
            else:
                obj.attrs.create(name, np.array(value, dtype=object).reshape(len(value)),
                                 dtype=h5py.string_dtype())
        else:
            arr = np.asarray(value)
            dt = dtype_for(arr.dtype)
            if dt.name in _BITS:
                obj.attrs.create(name, np.array(arr, order="C").view(_BITS[dt.name]))
                types.append((name, dt.name))
            else:
                obj.attrs.create(name, arr)
                if arr.ndim == 0 and arr.dtype in _NATURAL_SCALARS:
                    types.append((name, "array"))
    if types:
        obj.attrs.create(MARK_ATTR_TYPES, np.array(types, dtype=object),
                         dtype=h5py.string_dtype())


# ----------------------------------------------------------------------------- the tree walk

@dataclass
class H5Node:
    """One link of an HDF5 tree as ``walk`` sees it.

    kind: "group", "dataset", or (listings only) "soft-link", "external-link", "user-link",
    "datatype", "hard-link" (an object already seen under ``target``).  For datasets ``dtype``
    is the KDTR dtype (None where KDTR has none: ``problem`` says why), ``shape`` the logical
    shape, ``stored_shape``/``stored_dtype`` what HDF5 holds, ``nbytes`` the stored bytes."""
    path: str
    kind: str
    obj: Any = None
    target: str | None = None
    dtype: DType | None = None
    type_name: str | None = None
    shape: tuple | None = None
    stored_shape: tuple | None = None
    stored_dtype: np.dtype | None = None
    nbytes: int | None = None
    num_attrs: int = 0
    index: int | None = None
    problem: KdtrError | None = None


_LINK_KINDS = {h5l.TYPE_SOFT: "soft-link", h5l.TYPE_EXTERNAL: "external-link"}


def _link_target(gid, raw: bytes) -> str:
    try:
        val = gid.links.get_val(raw)
    except Exception:  # noqa: BLE001 - a listing shows what it can
        return "?"
    if isinstance(val, tuple):
        return ":".join(v.decode("utf-8", "backslashreplace") for v in val)
    return val.decode("utf-8", "backslashreplace")


def walk(f: h5py.File, *, strict: bool = True) -> Iterator[H5Node]:
    """Every link below the root, depth first, each group's members in creation order (name
    order where the file does not track it).  Links are never followed.  ``strict`` raises the
    first ``KdtrError`` (conversion); otherwise problems are attached to the nodes (listing)."""
    seen: dict[tuple, str] = {}
    with _h5_errors("/"):
        root = f["/"]  # File.id is the file, not its root group (whose plist has the orders)
        root_info = h5o.get_info(root.id)
        seen[(root_info.fileno, root_info.addr)] = "/"
    stack: list[tuple[Any, bytes, str, int]] = []
    _push_members(root.id, "/", 1, stack, strict)
    count = 0
    while stack:
        gid, raw, path, depth = stack.pop()
        count += 1
        if count >= L.MAX_NODES and strict:
            raise KdtrError("K012", f"more than {L.MAX_NODES - 1} objects")
        with _h5_errors(path):
            node = _visit(gid, raw, path, seen, strict)
        yield node
        if node.kind == "group" and node.obj is not None:   # listings descend despite bad names
            _push_members(node.obj.id, path, depth + 1, stack, strict)


def _push_members(gid, path: str, depth: int, stack: list, strict: bool) -> None:
    with _h5_errors(path):
        order = h5.INDEX_CRT_ORDER if _creation_ordered(gid, "links") else h5.INDEX_NAME
        members: list[tuple[bytes, int]] = []
        gid.links.iterate(lambda n, info: members.append((n, info.type)), idx_type=order,
                          info=True)
    if depth > L.MAX_DEPTH and members:
        if strict:
            raise KdtrError("K042", f"depth {depth} > {L.MAX_DEPTH}", path[:200])
        return
    for raw, _ in reversed(members):
        name = raw.decode("utf-8", "backslashreplace")
        stack.append((gid, raw, _join(path, name), depth))


def _visit(gid, raw: bytes, path: str, seen: dict, strict: bool) -> H5Node:
    def fail(err: KdtrError, node: H5Node) -> H5Node:
        if strict:
            raise err
        node.problem = err
        return node

    name = raw.decode("utf-8", "backslashreplace")
    info = gid.links.get_info(raw)
    if info.type != h5l.TYPE_HARD:
        kind = _LINK_KINDS.get(info.type, "user-link")
        node = H5Node(path, kind, target=_link_target(gid, raw))
        return fail(KdtrError("K024", f"{kind} to {node.target!a}: links are not followed "
                                      "(KDTR has no links)", path), node)
    try:
        check_name(_decode_name(raw, path), path)
        if len(path.encode("utf-8")) - 1 > L.MAX_PATH_BYTES:
            raise KdtrError("K042", f"{len(path.encode())} bytes", path[:200])
    except KdtrError as e:
        if strict:
            raise
        problem = e
    else:
        problem = None
    oinfo = h5o.get_info(gid, raw)
    key = (oinfo.fileno, oinfo.addr)
    if key in seen:
        node = H5Node(path, "hard-link", target=seen[key])
        return fail(KdtrError("K022", f"object already reached as {seen[key]!a} (a hard-link "
                                      "cycle or a shared object)", path), node)
    seen[key] = path
    obj_type = oinfo.type
    if obj_type == h5o.TYPE_GROUP:
        node = H5Node(path, "group", obj=h5py.Group(h5o.open(gid, raw)),
                      num_attrs=oinfo.num_attrs)
        if strict and oinfo.rc > 1:
            raise KdtrError("K022", f"group has {oinfo.rc} hard links", path)
        _check_group_markers(node)
    elif obj_type == h5o.TYPE_DATASET:
        node = H5Node(path, "dataset", obj=h5py.Dataset(h5o.open(gid, raw)),
                      num_attrs=oinfo.num_attrs)
        if strict and oinfo.rc > 1:
            raise KdtrError("K022", f"dataset has {oinfo.rc} hard links (its data would be "
                                    "copied once per link)", path)
        try:
            _dataset_info(node)
        except KdtrError as e:
            return fail(e, node)
    else:
        node = H5Node(path, "datatype" if obj_type == h5o.TYPE_NAMED_DATATYPE else "object",
                      num_attrs=oinfo.num_attrs)
        return fail(KdtrError("K024", f"a committed datatype ({name!a}) is not a group or "
                                      "dataset", path), node)
    if node.obj is not None and MARK_INDEX in node.obj.attrs:
        value = node.obj.attrs[MARK_INDEX]
        if not (np.ndim(value) == 0 and np.asarray(value).dtype.kind in "iu"):
            return fail(KdtrError("K022", f"{MARK_INDEX} must be an integer", path), node)
        node.index = int(value)
    if problem is not None:
        node.problem = problem
    return node


def _check_group_markers(node: H5Node) -> None:
    for mark in (MARK_DTYPE, MARK_SHAPE):
        if mark in node.obj.attrs:
            raise KdtrError("K026", f"a group carries the dataset marker {mark!a}", node.path)


def _dataset_info(node: H5Node) -> None:
    """Fill in dtype/shape/size of a dataset node, raising KdtrError for what KDTR cannot hold."""
    ds, path = node.obj, node.path
    did = ds.id
    if did.get_space().get_simple_extent_type() == h5s.NULL:
        node.type_name = "empty (null dataspace)"
        raise KdtrError("K004", "a dataset with a null dataspace (h5py.Empty) has no shape",
                        path)
    dt = ds.dtype
    node.stored_dtype = dt
    stored = tuple(int(d) for d in did.shape)
    node.stored_shape = stored
    why = _unsupported_kind(dt)
    node.type_name = describe_h5_dtype(dt)
    if why is None:
        node.nbytes = int(np.prod(stored, dtype=object)) * dt.itemsize
    if len(stored) > L.MAX_NDIM:
        raise KdtrError("K028", f"{len(stored)} dimensions (limit {L.MAX_NDIM})", path)
    if any(d > L.MAX_DIM for d in stored):
        raise KdtrError("K029", f"shape {list(stored)} (each dimension <= 2**48)", path)
    if why is not None:
        raise KdtrError("K004", f"unsupported dataset type: {why}", path)
    plist = did.get_create_plist()
    try:
        external = plist.get_external_count()
        layout = plist.get_layout()
    finally:
        plist.close()
    if external or layout == h5d.VIRTUAL:
        raise KdtrError("K034", "the dataset's data lives outside this file ("
                                + ("external storage" if external else "virtual dataset")
                                + "); refusing to read other files", path)
    dtype, shape = _apply_dtype_markers(ds, _le(dt), stored, path)
    node.type_name = dtype.name
    nonzero = int(np.prod([max(d, 1) for d in stored], dtype=object)) * dt.itemsize
    if nonzero > L.MAX_TENSOR_BYTES:   # zero dimensions count as 1, as KDTR's K030 does
        raise KdtrError("K030", f"shape {list(stored)} of {dt} exceeds 2**62 bytes (zero "
                                "dimensions count as 1)", path)
    node.dtype, node.shape = dtype, shape   # set last: a dtype means "readable as KDTR"


def _apply_dtype_markers(ds, stored_dt: np.dtype, stored: tuple, path: str):
    attrs = ds.attrs
    has_dtype, has_shape = MARK_DTYPE in attrs, MARK_SHAPE in attrs
    if not has_dtype:
        if has_shape:
            raise KdtrError("K031", f"{MARK_SHAPE} without {MARK_DTYPE} = 'int4'", path)
        return dtype_for(stored_dt), stored
    name = _scalar_str(np.asarray(attrs[MARK_DTYPE]).item()) if np.ndim(attrs[MARK_DTYPE]) == 0 \
        else None
    if name not in BY_NAME:
        raise KdtrError("K027", f"{MARK_DTYPE} = {name!a} is not a KDTR dtype name", path)
    dt = BY_NAME[name]
    expected = _BITS.get(name, dt.storage)
    if stored_dt != expected:
        raise KdtrError("K031", f"{MARK_DTYPE} says {name} but the data is stored as "
                                f"{stored_dt} (expected {expected})", path)
    if not dt.packed:
        if has_shape:
            raise KdtrError("K031", f"{MARK_SHAPE} on a {name} dataset", path)
        return dt, stored
    if not has_shape:
        raise KdtrError("K032", f"int4 dataset without {MARK_SHAPE}", path)
    shape_arr = np.asarray(attrs[MARK_SHAPE])
    if shape_arr.ndim != 1 or shape_arr.dtype.kind not in "iu" or shape_arr.size > L.MAX_NDIM:
        raise KdtrError("K032", f"{MARK_SHAPE} must be a 1-d integer array of <= "
                                f"{L.MAX_NDIM} dims", path)
    shape = tuple(int(d) for d in shape_arr.tolist())
    if not shape or shape[-1] % 2 or any(not 0 <= d <= L.MAX_DIM for d in shape):
        raise KdtrError("K032", f"int4 shape {list(shape)}", path)
    if shape[:-1] + (shape[-1] // 2,) != stored:
        raise KdtrError("K031", f"int4 shape {list(shape)} does not match the packed bytes "
                                f"of shape {list(stored)}", path)
    return dt, shape


# ----------------------------------------------------------------------------- KDTR -> HDF5

def _kdtr_align_log2(path: str) -> int:
    return int(np.fromfile(path, dtype=L.PREAMBLE_DTYPE, count=1)[0]["align_log2"])


def _kdtr_node_order(src: kdtr.File) -> list[str]:
    """Paths in KDTR node-table order (the order the writer received them)."""
    return list(src.node_table().paths[1:])


def _preorder(group) -> list[str]:
    """Paths depth first, each group's members in insertion order (what ``walk`` yields)."""
    out: list[str] = []
    todo: list = [iter(group.values())]
    while todo:
        child = next(todo[-1], None)
        if child is None:
            todo.pop()
            continue
        out.append(child.name)
        if isinstance(child, kdtr.Group):
            todo.append(iter(child.values()))
    return out


def _h5_stored(ds: kdtr.Dataset) -> np.ndarray:
    """The stored elements of a KDTR dataset as HDF5 will hold them (zero-copy)."""
    raw = ds.packed()
    name = ds.kdtr_dtype
    return raw.view(_BITS[name]) if name in _BITS and name != "int4" else raw


def _write_blocks(dst: h5py.Dataset, src: np.ndarray, tick: Callable[[int], None]) -> None:
    if src.ndim == 0:
        dst[()] = src
        tick(src.nbytes)
        return
    max_elems = max(1, BLOCK_BYTES // max(1, src.itemsize))
    for sel in iter_blocks(src.shape, max_elems):
        block = src[sel]
        dst[sel] = block
        tick(block.nbytes)


def to_hdf5(kdtr_path: str | os.PathLike, h5_path: str | os.PathLike,
            progress: Progress | None = None) -> None:
    """Convert a KDTR file to HDF5 (see the module docstring), dataset by dataset.
    ``progress(done_bytes, total_bytes)`` is called as data is written.  The HDF5 file is
    written under a temporary name and renamed into place when complete."""
    kdtr_path, h5_path = os.fspath(kdtr_path), os.fspath(h5_path)
    with kdtr.File(kdtr_path) as src:
        order = _kdtr_node_order(src)
        needs_index = order != _preorder(src)
        align = _kdtr_align_log2(kdtr_path)
        nodes = [src[p] for p in order]
        total = sum(n.storage_nbytes for n in nodes if isinstance(n, kdtr.Dataset))
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        with _atomic_h5(h5_path) as out:
            root = out["/"]
            write_attrs(root, dict(src.attrs), "/")
            if align != L.DEFAULT_ALIGN_LOG2:
                root.attrs.create(MARK_ALIGN, np.int64(align))
            for i, node in enumerate(nodes, start=1):
                if isinstance(node, kdtr.Group):
                    obj = out.create_group(node.name, track_order=True)
                else:
                    obj = _create_h5_dataset(out, node.name, BY_NAME[node.kdtr_dtype],
                                             node.shape)
                    _write_blocks(obj, _h5_stored(node), tick)
                write_attrs(obj, dict(node.attrs), node.name)
                if needs_index:
                    obj.attrs.create(MARK_INDEX, np.int64(i))
        if progress is not None and total == 0:
            progress(0, 0)


def _create_h5_dataset(parent, path: str, dt: DType, shape: tuple) -> h5py.Dataset:
    stored_shape = shape[:-1] + (shape[-1] // 2,) if dt.packed else shape
    ds = parent.create_dataset(path, shape=stored_shape, dtype=_BITS.get(dt.name, dt.storage),
                               track_order=True)
    if dt.name in _BITS:
        ds.attrs.create(MARK_DTYPE, dt.name, dtype=h5py.string_dtype())
    if dt.packed:
        ds.attrs.create(MARK_SHAPE, np.array(shape, dtype=np.int64))
    return ds


@contextlib.contextmanager
def _atomic_h5(path: str):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".h5.tmp",
                               dir=directory)
    os.close(fd)
    try:
        with h5py.File(tmp, "w", track_order=True) as out:
            yield out
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class H5TreeWriter:
    """Write a tree node by node into a new HDF5 file with the KDTR mapping (used by
    ``to_hdf5``'s callers that do not start from KDTR, e.g. safetensors -> HDF5)."""

    def __init__(self, path: str | os.PathLike):
        self._ctx = _atomic_h5(os.fspath(path))
        self.file = self._ctx.__enter__()

    def set_attrs(self, path: str, attrs: dict[str, Any]) -> None:
        write_attrs(self.file[path], attrs, path)

    def dataset(self, path: str, dt: DType, shape: tuple, stored: np.ndarray,
                tick: Callable[[int], None] = lambda n: None) -> None:
        ds = _create_h5_dataset(self.file, path, dt, tuple(shape))
        _write_blocks(ds, stored, tick)

    def __enter__(self) -> "H5TreeWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


# ----------------------------------------------------------------------------- HDF5 -> KDTR

def read_dataset(node: H5Node, tick: Callable[[int], None] = lambda n: None,
                 spill_dir: str | None = None) -> np.ndarray:
    """The stored elements of a checked dataset node, little-endian, read block by block
    (datasets over ``SPILL_BYTES`` go to a temporary memory-mapped file in ``spill_dir``)."""
    ds, dt = node.obj, _le(node.stored_dtype)
    shape = node.stored_shape
    if node.nbytes > SPILL_BYTES and spill_dir is not None:
        fd, tmp = tempfile.mkstemp(suffix=".kdtr-spill", dir=spill_dir)
        os.close(fd)
        try:
            out = np.memmap(tmp, dtype=dt, mode="w+", shape=shape)
        finally:
            os.unlink(tmp)  # the mapping keeps the space until it is dropped
    else:
        out = np.empty(shape, dtype=dt)
    with _h5_errors(node.path):
        if not shape:
            ds.read_direct(out)
            tick(out.nbytes)
        else:
            max_elems = max(1, BLOCK_BYTES // max(1, dt.itemsize))
            for sel in iter_blocks(shape, max_elems):
                ds.read_direct(out, sel, sel)
                tick(int(np.prod([s.stop - s.start for s in sel])) * dt.itemsize)
    if node.dtype.name == "bool" and out.size and out.view(np.uint8).max() > 1:
        raise KdtrError("K051", "a bool dataset holds a byte other than 0 or 1", node.path)
    return out


def decode_stored(stored: np.ndarray, dt: DType, shape: tuple) -> np.ndarray:
    """Stored HDF5 elements -> what the KDTR writer takes (bit patterns viewed, int4 unpacked)."""
    if dt.packed:
        return unpack_int4(stored, shape)
    if dt.name in _BITS:
        return stored.view(dt.numpy)
    return stored


def _kdtr_order(nodes: list[H5Node]) -> list[H5Node]:
    indexed = [n for n in nodes if n.index is not None]
    if not indexed:
        return nodes
    if len(indexed) != len(nodes):
        missing = next(n for n in nodes if n.index is None)
        raise KdtrError("K022", f"{MARK_INDEX} is on some nodes but not on this one",
                        missing.path)
    if sorted(n.index for n in nodes) != list(range(1, len(nodes) + 1)):
        raise KdtrError("K022", f"{MARK_INDEX} values are not a permutation of 1..{len(nodes)}")
    by_path = {n.path: n for n in nodes}
    for n in nodes:
        parent = n.path.rsplit("/", 1)[0] or "/"
        if parent != "/" and by_path[parent].index > n.index:
            raise KdtrError("K022", f"{MARK_INDEX} {n.index} comes before its parent's "
                                    f"{by_path[parent].index}", n.path)
    return sorted(nodes, key=lambda n: n.index)


def from_hdf5(h5_path: str | os.PathLike, kdtr_path: str | os.PathLike,
              progress: Progress | None = None, align_log2: int | None = None) -> None:
    """Convert an (untrusted) HDF5 file to KDTR.  The tree is walked and checked before any
    data is read; then datasets are copied one at a time.  ``align_log2`` defaults to the value
    recorded by ``to_hdf5`` (``kdtr.align_log2``), else KDTR's default.  Raises ``KdtrError``."""
    h5_path, kdtr_path = os.fspath(h5_path), os.fspath(kdtr_path)
    with open_hdf5(h5_path) as f:
        nodes = _kdtr_order(list(walk(f, strict=True)))
        root_attrs = read_attrs(f["/"], "/")
        if align_log2 is None:
            align_log2 = _recorded_align(f)
        total = sum(n.nbytes for n in nodes if n.kind == "dataset")
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        spill = os.path.dirname(os.path.abspath(kdtr_path))
        with kdtr.File(kdtr_path, "w", align_log2=align_log2) as out:
            _set_attrs(out, root_attrs, "/")
            for node in nodes:
                if node.kind == "group":
                    obj = out.create_group(node.path)
                else:
                    stored = read_dataset(node, tick, spill)
                    obj = out.create_dataset(node.path, dtype=node.dtype.name,
                                             data=decode_stored(stored, node.dtype, node.shape))
                    del stored
                _set_attrs(obj, read_attrs(node.obj, node.path), node.path)
        if progress is not None and total == 0:
            progress(0, 0)


def _recorded_align(f: h5py.File) -> int:
    if MARK_ALIGN not in f.attrs:
        return L.DEFAULT_ALIGN_LOG2
    with _h5_errors("/"):
        value = np.asarray(f.attrs[MARK_ALIGN])
    if value.ndim or value.dtype.kind not in "iu" or not (
            L.MIN_ALIGN_LOG2 <= int(value) <= L.MAX_ALIGN_LOG2):
        raise KdtrError("K011", f"{MARK_ALIGN} must be an integer in "
                                f"[{L.MIN_ALIGN_LOG2}, {L.MAX_ALIGN_LOG2}]", "/")
    return int(value)


def _set_attrs(obj, attrs: dict[str, Any], where: str) -> None:
    for name, value in attrs.items():
        obj.attrs[name] = value

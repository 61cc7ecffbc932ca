"""KDTR: a binary tensor container with the h5py API (groups, datasets, attributes).

    from formats import kdtr
    with kdtr.File("w.kdtr", "w") as f:
        f.create_dataset("layers/0/attn/kv_a_proj", data=w)    # intermediate groups made
        f["embed"] = table
        f["layers"].attrs["count"] = 61
    with kdtr.File("w.kdtr") as f:
        w = f["layers/0/attn/kv_a_proj"][...]                  # zero-copy view of the mmap

The byte layout and every rejection rule are in docs/FORMAT.md (codes in ``formats.layout``).
Opening validates the whole header (structure, names, attributes, data ranges) before handing
out anything; ``verify()`` also checks every tensor's CRC32C and padding.  A malformed or hostile
file raises ``KdtrError`` (a ``ValueError``) naming the rule and the node, and nothing read from
the file can drive an unbounded allocation or loop.  Writes stream each dataset to a temporary
file next to the target and rename it into place on close, so an exception mid-write leaves any
earlier file at that path untouched.
"""
from __future__ import annotations

import os
import re
import struct
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np

from . import layout as L
from .dtypes import BY_CODE, DType, dtype_for, pack_int4, unpack_int4

__all__ = ["File", "Group", "Dataset", "AttributeManager", "NodeTable", "KdtrError", "pack_int4",
           "unpack_int4"]


class KdtrError(ValueError):
    """A malformed or hostile KDTR (or HDF5) input.  ``code`` is the rule in docs/FORMAT.md."""

    def __init__(self, code: str, detail: str, node: str | None = None):
        self.code, self.rule, self.detail, self.node = code, L.RULES[code], detail, node
        where = f" at {node!a}" if node is not None else ""
        super().__init__(f"{code} {self.rule}{where}: {detail}")

    def __reduce__(self):  # copy and process pools rebuild exceptions from this
        return type(self), (self.code, self.detail, self.node)


_BAD_NAME_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f/]")


def check_name(name: str, where: str) -> None:
    """The name rules of FORMAT.md (shared by reader and writer, so we never write what we reject)."""
    if not isinstance(name, str):
        raise TypeError(f"names are str, got {type(name).__name__}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: not storable as strict UTF-8
        raise KdtrError("K039", f"name {name!a} is not valid UTF-8: {e.reason}", where) from None
    if name in ("", ".", "..") or _BAD_NAME_CHARS.search(name):
        raise KdtrError("K040", f"name {name!a} is empty, '.', '..', or holds '/' or a "
                                f"control character", where)
    if len(raw) > L.MAX_NAME_BYTES:
        raise KdtrError("K041", f"{len(raw)} bytes > {L.MAX_NAME_BYTES}", where)


def _split(path: str) -> list[str]:
    return [p for p in path.strip("/").split("/")] if path.strip("/") else []


# ----------------------------------------------------------------------------- attributes

def _encode_attr(value: Any) -> tuple[int, bytes]:
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


def _decode_attr(kind: int, raw: bytes, where: str) -> Any:
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


class AttributeManager(Mapping):
    """``obj.attrs``: str, int, float, bool, NumPy arrays and lists of str, in insertion order."""

    def __init__(self, file: "File", index: int):
        self._file, self._index = file, index

    def _dict(self) -> dict:
        return self._file._attrs_of(self._index)

    def __getitem__(self, name: str) -> Any:
        value = self._dict()[name]
        return value.copy() if isinstance(value, (np.ndarray, list)) else value

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._dict()))

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, name: object) -> bool:
        return name in self._dict()

    def __setitem__(self, name: str, value: Any) -> None:
        self._file._require_writable()
        where = self._file._paths[self._index]
        check_name(name, where)
        kind, raw = _encode_attr(value)
        if len(raw) > L.MAX_ATTR_VALUE_BYTES:
            raise ValueError(f"attribute {name!r} at {where!r}: value of {len(raw)} bytes "
                             f"exceeds the {L.MAX_ATTR_VALUE_BYTES}-byte limit; store it as a dataset")
        self._dict()[name] = _decode_attr(kind, raw, where)  # what a reader will see

    def __delitem__(self, name: str) -> None:
        self._file._require_writable()
        del self._dict()[name]

    def create(self, name: str, data: Any) -> None:
        self[name] = data

    def __repr__(self) -> str:
        return f"<KDTR attributes of {self._file._paths[self._index]!r} ({len(self)} items)>"


# ----------------------------------------------------------------------------- nodes

class _Node:
    __slots__ = ("_file", "_index")

    def __init__(self, file: "File", index: int):
        self._file, self._index = file, index

    @property
    def name(self) -> str:
        """The absolute path, as h5py gives it (``/layers/0``)."""
        return self._file._paths[self._index]

    @property
    def file(self) -> "File":
        return self._file

    @property
    def parent(self) -> "Group":
        p = self._file._parents[self._index]
        return self._file._node(0 if p == L.NO_PARENT else p)

    @property
    def attrs(self) -> AttributeManager:
        return AttributeManager(self._file, self._index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Node) and other._file is self._file and other._index == self._index

    def __hash__(self) -> int:
        return hash((id(self._file), self._index))


class Group(_Node):
    """A group: a mapping of names to groups and datasets, in insertion order."""

    def _members(self) -> dict[str, int]:
        return self._file._children[self._index]

    def keys(self):
        return list(self._members())

    def values(self):
        return [self._file._node(i) for i in self._members().values()]

    def items(self):
        return [(k, self._file._node(i)) for k, i in self._members().items()]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._members()))

    def __len__(self) -> int:
        return len(self._members())

    def _lookup(self, path: str) -> int | None:
        index = 0 if path.startswith("/") else self._index
        for part in _split(path):
            children = self._file._children[index]
            if children is None or part not in children:
                return None
            index = children[part]
        return index

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and self._lookup(path) is not None

    def __getitem__(self, path: str) -> "Group | Dataset":
        index = self._lookup(path)
        if index is None:
            raise KeyError(f"{path!r} not found in {self.name!r}")
        return self._file._node(index)

    def get(self, path: str, default=None):
        index = self._lookup(path)
        return default if index is None else self._file._node(index)

    def visit(self, fn: Callable[[str], Any]) -> Any:
        """Call ``fn(relative_path)`` for every member below this group, depth first with the
        members of each group in lexicographic (byte) order, as h5py does; a non-None return stops."""
        return self._walk(lambda rel, _index: fn(rel))

    def visititems(self, fn: Callable[[str, "Group | Dataset"], Any]) -> Any:
        return self._walk(lambda rel, index: fn(rel, self._file._node(index)))

    def _walk(self, fn: Callable[[str, int], Any]) -> Any:
        # Sorting str keys orders them by code point, which is UTF-8 byte order; names are
        # unique, so the node index in each pair is never compared.
        children_of = self._file._children
        stack = sorted(self._members().items(), reverse=True)
        while stack:  # explicit stack: depth is bounded by the file, not by Python's recursion
            rel, index = stack.pop()
            result = fn(rel, index)
            if result is not None:
                return result
            children = children_of[index]
            if children:
                stack.extend((f"{rel}/{k}", i) for k, i in sorted(children.items(), reverse=True))
        return None

    # writing
    def create_group(self, path: str) -> "Group":
        self._file._require_writable()
        parent, last = self._make_parents(path)
        if last in self._file._children[parent]:
            raise ValueError(f"{path!r} already exists in {self.name!r}")
        return self._file._node(self._file._add_node(parent, last, L.KIND_GROUP))

    def require_group(self, path: str) -> "Group":
        index = self._lookup(path)
        if index is None:
            return self.create_group(path)
        if self._file._children[index] is None:
            raise TypeError(f"{path!r} exists and is a dataset, not a group")
        return self._file._node(index)

    def create_dataset(self, path: str, shape=None, dtype=None, data=None) -> "Dataset":
        """Write a dataset now (streamed to the temporary file).  ``data`` is converted to
        ``dtype`` when both are given; without ``data``, ``shape`` (and ``dtype``, default
        float32) make a zero-filled dataset.  ``dtype="int4"`` packs int8 values in [-8, 7]."""
        self._file._require_writable()
        if data is None:
            if shape is None:
                raise TypeError("create_dataset needs data or a shape")
            dt = dtype_for(dtype if dtype is not None else np.float32)
            array = None
            shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        else:
            array = np.asarray(data)
            dt = dtype_for(dtype if dtype is not None else array.dtype)
            if shape is not None and tuple(shape) != array.shape:
                raise ValueError(f"shape {tuple(shape)} does not match data of shape {array.shape}")
            shape = array.shape
        parent, last = self._make_parents(path)
        if last in self._file._children[parent]:
            raise ValueError(f"{path!r} already exists in {self.name!r}")
        return self._file._node(self._file._write_dataset(parent, last, dt, shape, array))

    def __setitem__(self, path: str, data) -> None:
        self.create_dataset(path, data=data)

    def _make_parents(self, path: str) -> tuple[int, str]:
        parts = _split(path)
        if not parts:
            raise ValueError(f"invalid path {path!r}")
        index = 0 if path.startswith("/") else self._index
        for part in parts[:-1]:
            children = self._file._children[index]
            if part in children:
                index = children[part]
                if self._file._children[index] is None:
                    raise TypeError(f"{part!r} in {path!r} is a dataset, not a group")
            else:
                index = self._file._add_node(index, part, L.KIND_GROUP)
        return index, parts[-1]

    def __repr__(self) -> str:
        return f"<KDTR group {self.name!r} ({len(self)} members)>"


class Dataset(_Node):
    """A dataset.  ``ds[...]`` and basic slices are zero-copy, read-only views of the file's
    memory map and stay valid after the file is closed; int4 datasets read back unpacked."""

    @property
    def _meta(self):
        return self._file._datasets[self._index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self._meta.shape

    @property
    def dtype(self) -> np.dtype:
        return self._meta.dtype.numpy

    @property
    def kdtr_dtype(self) -> str:
        """The KDTR dtype name (``bfloat16``, ``int4``, ...)."""
        return self._meta.dtype.name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the array NumPy hands out (int4: unpacked, one byte per value)."""
        return self.size * self.dtype.itemsize

    @property
    def storage_nbytes(self) -> int:
        """Bytes on disk (int4: packed, two values per byte)."""
        return self._meta.size

    @property
    def offset(self) -> int:
        """Absolute file offset of the first byte."""
        return self._file._data_offset + self._meta.offset

    @property
    def checksum(self) -> int:
        return self._meta.crc

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d dataset")
        return self.shape[0]

    def packed(self) -> np.ndarray:
        """The raw stored elements: for int4, the packed uint8 bytes (``[..., last // 2]``)."""
        m = self._meta
        raw = self._file._raw(m.offset, m.size)
        if m.dtype.packed:
            shape = m.shape[:-1] + (m.shape[-1] // 2,) if m.shape else ()
            return raw.view(np.uint8).reshape(shape)
        return raw.view(m.dtype.storage).reshape(m.shape)

    def __getitem__(self, key) -> np.ndarray:
        m = self._meta
        if m.dtype.packed:
            return unpack_int4(self.packed(), m.shape)[key]
        return self.packed()[key]

    def __array__(self, dtype=None, copy=None):
        arr = self[...]
        return arr if dtype is None else arr.astype(dtype)

    def read_direct(self, dest: np.ndarray, source_sel=np.s_[...], dest_sel=np.s_[...]) -> None:
        dest[dest_sel] = self[source_sel]

    def astype(self, dtype) -> np.ndarray:
        return self[...].astype(dtype)

    def __repr__(self) -> str:
        return f"<KDTR dataset {self.name!r}: shape {self.shape}, {self.kdtr_dtype}>"


class _DatasetMeta:
    __slots__ = ("dtype", "shape", "offset", "size", "crc")

    def __init__(self, dtype: DType, shape: tuple[int, ...], offset: int, size: int, crc: int):
        self.dtype, self.shape, self.offset, self.size, self.crc = dtype, shape, offset, size, crc


class NodeTable:
    """Every node of a file opened for reading, column-wise, in node-table order (the order
    the writer received them; node 0 is the root "/"): what a tool that lists or converts a
    whole file needs without building a Group or Dataset object per member, which costs
    several seconds at 100,000 tensors.  All of it was validated when the file was opened.

    ``paths[i]`` (absolute, as h5py names them); ``is_group[i]``; ``children[i]``: member name -> node index (a group's, in
    insertion order; None for a dataset); ``dtype[i]``: the KDTR dtype name (None for a group);
    ``shape[i]``; ``nbytes[i]`` and ``offset[i]`` (absolute file offset of the packed data; 0
    for a group); ``attr_count[i]``."""

    __slots__ = ("paths", "is_group", "children", "dtype", "shape", "nbytes", "offset",
                 "attr_count")

    def __init__(self, file: "File"):
        nodes = file._datasets._nodes
        kinds, codes, ndims = (nodes[c].tolist() for c in ("kind", "dtype", "ndim"))
        dims = nodes["dims"].tolist()
        groups = [k == L.KIND_GROUP for k in kinds]
        self.paths = tuple(file._paths)
        self.is_group = groups
        self.children = file._children
        self.dtype = [None if g else BY_CODE[c].name for g, c in zip(groups, codes)]
        self.shape = [None if g else tuple(d[:n]) for g, d, n in zip(groups, dims, ndims)]
        self.nbytes = [0 if g else size for g, size in zip(groups, nodes["data_size"].tolist())]
        base = file._data_offset
        self.offset = [0 if g else base + off
                       for g, off in zip(groups, nodes["data_offset"].tolist())]
        self.attr_count = nodes["attr_count"].tolist()

    def __len__(self) -> int:
        return len(self.paths)


# ----------------------------------------------------------------------------- the file

class File(Group):
    """A KDTR file.  ``mode``: "r" (read, the default), "w" (create or replace, atomically),
    "x" (create, fail if it exists).  ``align_log2`` (write modes) sets the data alignment
    (default 12 = 4096 bytes)."""

    def __init__(self, path: str | os.PathLike, mode: str = "r", *,
                 align_log2: int = L.DEFAULT_ALIGN_LOG2):
        self._path = os.fspath(path)
        self._mode = mode
        self._closed = True  # until fully opened: __del__ must not clean up a half-built File
        self._names: list[str] = [""]
        self._paths: list[str] = ["/"]
        self._parents: list[int] = [L.NO_PARENT]
        self._children: list[dict[str, int] | None] = [{}]
        self._datasets: dict[int, _DatasetMeta] = {}
        self._attrs: list[dict[str, Any]] = [{}]
        self._nodes_cache: dict[int, _Node] = {}
        if mode == "r":
            from ._reader import read_into
            read_into(self, self._path)
        elif mode in ("w", "x"):
            if not MIN_ALIGN <= align_log2 <= MAX_ALIGN:
                raise ValueError(f"align_log2 must lie in [{MIN_ALIGN}, {MAX_ALIGN}]")
            if mode == "x" and os.path.exists(self._path):
                raise FileExistsError(self._path)
            self._align_log2 = align_log2
            self._data_offset = L.align_up(L.PREAMBLE_SIZE, align_log2)
            directory = os.path.dirname(os.path.abspath(self._path))
            fd, self._tmp_path = tempfile.mkstemp(
                prefix="." + os.path.basename(self._path) + ".", suffix=".kdtr.tmp", dir=directory)
            self._out = os.fdopen(fd, "w+b")
            self._out.write(b"\0" * self._data_offset)
            self._cursor = 0  # bytes written into the data section so far
        else:
            raise ValueError(f"mode must be 'r', 'w' or 'x', not {mode!r}")
        super().__init__(self, 0)
        self._closed = False

    # ---- h5py-style housekeeping
    @property
    def filename(self) -> str:
        return self._path

    @property
    def align_log2(self) -> int:
        """Tensors start on multiples of ``2 ** align_log2`` bytes."""
        return self._align_log2

    @property
    def mode(self) -> str:
        return "r" if self._mode == "r" else "r+"

    def __enter__(self) -> "File":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._mode != "r":
            self._abort()
        else:
            self.close()

    def __bool__(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Finish the file.  Writing: header, fsync, rename into place.  Reading: drop our
        reference to the memory map (arrays already handed out keep it alive)."""
        if self._closed:
            return
        if self._mode != "r":
            try:
                from ._writer import finish
                finish(self)
            except BaseException:
                self._abort()
                raise
        self._map_array = None
        self._closed = True

    def _abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._out.close()
        finally:
            if os.path.exists(self._tmp_path):
                os.unlink(self._tmp_path)

    def __del__(self):
        if getattr(self, "_mode", "r") != "r" and not getattr(self, "_closed", True):
            self._abort()  # never leave a half-written temporary file behind

    def node_table(self) -> NodeTable:
        """The whole node table at once (see :class:`NodeTable`); mode "r" only."""
        if self._mode != "r":
            raise ValueError("node_table() reads a file opened with mode 'r'")
        if self._closed:
            raise ValueError("the file is closed")
        return NodeTable(self)

    def verify(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Check every tensor's CRC32C, its bool bytes and the padding between tensors.
        Returns the number of bytes checked; raises ``KdtrError`` (K051, K056, K057) naming the
        first bad node.  ``progress(done_bytes, total_bytes)`` is called as it goes."""
        from ._reader import verify
        return verify(self, progress)

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._mode
        return f"<KDTR file {self._path!r} ({state}, {len(self._paths)} nodes)>"

    # ---- node table shared by reader and writer
    def _node(self, index: int) -> Group | Dataset:
        node = self._nodes_cache.get(index)
        if node is None:
            if index == 0:
                return self
            cls = Group if self._children[index] is not None else Dataset
            node = self._nodes_cache[index] = cls(self, index)
        return node

    def _attrs_of(self, index: int) -> dict[str, Any]:
        return self._attrs[index]

    def _require_writable(self) -> None:
        if self._mode == "r":
            raise PermissionError(f"{self._path!r} is open read-only")
        if self._closed:
            raise ValueError("the file is closed")

    def _add_node(self, parent: int, name: str, kind: int) -> int:
        parent_path = self._paths[parent]
        path = (parent_path.rstrip("/") + "/" + name)
        check_name(name, path)
        if len(path.encode("utf-8")) - 1 > L.MAX_PATH_BYTES or path.count("/") > L.MAX_DEPTH:
            raise KdtrError("K042", f"path of {len(path.encode()) - 1} bytes, depth "
                                    f"{path.count('/')}", path)
        if len(self._paths) >= L.MAX_NODES:
            raise ValueError(f"a KDTR file holds at most {L.MAX_NODES} nodes")
        index = len(self._paths)
        self._names.append(name)
        self._paths.append(path)
        self._parents.append(parent)
        self._children.append({} if kind == L.KIND_GROUP else None)
        self._attrs.append({})
        self._children[parent][name] = index
        return index

    def _write_dataset(self, parent: int, name: str, dt: DType, shape, array) -> int:
        from ._writer import write_dataset
        return write_dataset(self, parent, name, dt, shape, array)

    def _raw(self, offset: int, size: int) -> np.ndarray:
        """``size`` bytes of the data section as a uint8 array (a zero-copy view when reading)."""
        if self._mode == "r":
            if self._closed:
                raise ValueError("the file is closed; arrays read before close() stay valid")
            return self._map_array[self._data_offset + offset:self._data_offset + offset + size]
        if self._closed:
            raise ValueError("the file is closed; reopen it to read")
        self._out.flush()
        with open(self._tmp_path, "rb") as fh:
            fh.seek(self._data_offset + offset)
            return np.frombuffer(fh.read(size), dtype=np.uint8)


MIN_ALIGN, MAX_ALIGN = L.MIN_ALIGN_LOG2, L.MAX_ALIGN_LOG2

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

This module is the h5py-style object model; the byte work is below it: ``formats.reader``
(validation, memory map), ``formats.writer`` (streaming, header, rename), and what all three
share, ``formats.errors`` (``KdtrError``), ``formats.names`` (``check_name``) and
``formats.attributes`` (the attribute value codec).
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import numpy as np

from . import layout as L
from . import reader, writer
from .attributes import decode_attr, encode_attr
from .dtypes import BY_CODE, DType, dtype_for, pack_int4, unpack_int4
from .errors import KdtrError, about_file
from .layout import DatasetMeta
from .names import check_name, split_path
from .paths import output_directory

__all__ = ["File", "Group", "Dataset", "AttributeManager", "NodeTable", "KdtrError", "check_name",
           "pack_int4", "unpack_int4"]


# ----------------------------------------------------------------------------- attributes

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
        kind, raw = encode_attr(value)
        if len(raw) > L.MAX_ATTR_VALUE_BYTES:
            raise ValueError(f"attribute {name!r} at {where!r}: value of {len(raw)} bytes "
                             f"exceeds the {L.MAX_ATTR_VALUE_BYTES}-byte limit; store it as a dataset")
        self._dict()[name] = decode_attr(kind, raw, where)  # what a reader will see

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
        for part in split_path(path):
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

    def create_dataset(self, path: str, shape=None, dtype=None, data=None, *,
                       packed=None) -> "Dataset":
        """Write a dataset now (streamed to the temporary file).  ``data`` is converted to
        ``dtype`` when both are given; without ``data``, ``shape`` (and ``dtype``, default
        float32) make a zero-filled dataset.  ``dtype="int4"`` packs int8 values in [-8, 7].
        ``packed``: an int4 dataset's stored bytes as they are (uint8 ``[..., last // 2]``, as
        ``Dataset.packed()`` gives them), with ``shape`` the logical shape: written without
        being unpacked (an importer that already holds packed nibbles never widens them)."""
        self._file._require_writable()
        if packed is not None:
            if data is not None or shape is None or dtype_for(dtype or "int4").name != "int4":
                raise TypeError("create_dataset(packed=...) takes the logical shape, "
                                "dtype='int4' and no data")
            shape = tuple(int(s) for s in shape)
            parent, last = self._make_parents(path)
            if last in self._file._children[parent]:
                raise ValueError(f"{path!r} already exists in {self.name!r}")
            return self._file._node(writer.write_dataset(self._file, parent, last,
                                                         dtype_for("int4"), shape, packed,
                                                         packed=True))
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
        parts = split_path(path)
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

    def read_direct(self, dest: np.ndarray, source_sel=np.s_[...], dest_sel=np.s_[...], *,
                    verify: bool = False) -> None:
        """``dest[dest_sel] = self[source_sel]`` (h5py's signature).  ``verify=True`` checks
        the tensor's CRC32C on the bytes as they are copied (whole dataset only: both
        selections ``...``; ``dest`` of the dataset's shape, any dtype it casts to) and raises
        ``KdtrError`` K056 naming the file and the dataset on a mismatch (``dest`` then holds
        unchecked data)."""
        if not verify:
            dest[dest_sel] = self[source_sel]
            return
        if source_sel is not Ellipsis or dest_sel is not Ellipsis:
            raise ValueError("read_direct(verify=True) copies the whole dataset: leave "
                             "source_sel and dest_sel at ...")
        reader.copy_dataset(self._file, self._index, dest)

    def read(self, dtype=None, *, verify: bool = True) -> np.ndarray:
        """A new, writable, C-ordered copy of the whole dataset (int4 unpacked to int8;
        ``dtype`` casts while copying), its CRC32C checked on the bytes copied unless
        ``verify=False``: a damaged tensor raises ``KdtrError`` K056 naming the file and the
        dataset.  The check costs little: the bytes are checksummed in 256 KiB chunks right after
        they are copied, while still in cache (docs/BENCHMARKS.md, "Bundle load verification")."""
        out = np.empty(self.shape, self.dtype if dtype is None else np.dtype(dtype))
        if verify:
            reader.copy_dataset(self._file, self._index, out)
        else:
            np.copyto(out, self[...], casting="unsafe")
        return out

    def verify(self) -> int:
        """Check this dataset's CRC32C (and bool bytes) in place, without copying; returns the
        bytes checked or raises ``KdtrError`` (K056, K051) naming the file and the dataset."""
        return reader.verify_dataset(self._file, self._index)

    def astype(self, dtype) -> np.ndarray:
        return self[...].astype(dtype)

    def __repr__(self) -> str:
        return f"<KDTR dataset {self.name!r}: shape {self.shape}, {self.kdtr_dtype}>"


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
        self._datasets: dict[int, DatasetMeta] = {}
        self._attrs: list[dict[str, Any]] = [{}]
        self._nodes_cache: dict[int, _Node] = {}
        if mode == "r":
            with about_file(self._path):
                reader.read_into(self, self._path)
        elif mode in ("w", "x"):
            if not MIN_ALIGN <= align_log2 <= MAX_ALIGN:
                raise ValueError(f"align_log2 must lie in [{MIN_ALIGN}, {MAX_ALIGN}]")
            if mode == "x" and os.path.exists(self._path):
                raise FileExistsError(self._path)
            self._align_log2 = align_log2
            self._data_offset = L.align_up(L.PREAMBLE_SIZE, align_log2)
            directory = output_directory(self._path)
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
                writer.finish(self)
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
        except OSError:
            pass   # flushing the rest fails as the write did (a full disk); the file goes anyway
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
        with about_file(self._path):
            return reader.verify(self, progress)

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
        return writer.write_dataset(self, parent, name, dt, shape, array)

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

"""The files kdtr-dump reads, behind one tree view: a ``Source`` (KDTR, HDF5 or safetensors)
lists ``Entry`` nodes and hands out a ``Tensor`` per readable dataset, whose ``blocks`` and
``read`` give the stored elements and decoded selections whatever the format.
"""
from __future__ import annotations

import math
import os
import stat
from typing import Any, Iterator

import numpy as np

from .. import kdtr
from .. import layout as L
from ..dtypes import BY_NAME, DType, unpack_int4
from ..errors import KdtrError, about_file
from .output import display_array

# The inspector and the differ read it from this module at call time, so that one assignment
# (a test's monkeypatch) changes every chunked read, as it did when kdtr-dump was one module.
STATS_CHUNK_BYTES = 16 << 20        # float64 working set per step of --stats and diff
UNREADABLE_CODES = {"K001", "K002", "K004", "K007", "K008", "K058"}  # not this format / too new
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class Tensor:
    """Data access for one dataset, whatever the format: ``blocks`` yields the stored elements
    (flat, packed for int4) in C order, ``read(key)`` a decoded selection."""

    def __init__(self, dtype: DType, shape: tuple, stored, h5: bool = False,
                 where: tuple[str, str] | None = None):
        self.dtype, self.shape, self._stored, self._h5 = dtype, tuple(shape), stored, h5
        self._where = where   # (file, dataset path): what an HDF5 read error names
        self.stored_shape = (self.shape[:-1] + (self.shape[-1] // 2,)
                             if dtype.packed else self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def _stored_dtype(self) -> np.dtype:
        from ..hdf5_mapping import BIT_PATTERNS
        return (BIT_PATTERNS.get(self.dtype.name, self.dtype.storage) if self._h5
                else self.dtype.storage)

    def _as_kdtr(self, raw: np.ndarray) -> np.ndarray:
        """Stored elements (as HDF5 or the mmap hold them) viewed as the KDTR storage dtype."""
        raw = np.asarray(raw)
        if raw.dtype.byteorder == ">":
            raw = raw.astype(raw.dtype.newbyteorder("<"))
        if self._h5 and not self.dtype.packed and raw.dtype != self.dtype.storage:
            raw = np.array(raw, order="C").view(self.dtype.storage)
        return raw

    def blocks(self, max_elems: int) -> Iterator[np.ndarray]:
        """Flat decoded-ready blocks of stored elements (int4: packed bytes)."""
        if not self._h5:
            flat = self._stored.reshape(-1)
            for start in range(0, flat.size, max_elems):
                yield flat[start:start + max_elems]
            return
        from ..hdf5 import iter_blocks
        if self.stored_shape == ():
            yield self._as_kdtr(self._h5_read(())).reshape(-1)
            return
        for sel in iter_blocks(self.stored_shape, max_elems):
            yield self._as_kdtr(self._h5_read(sel)).reshape(-1)

    def values(self, max_elems: int) -> Iterator[np.ndarray]:
        """Flat blocks of values: floats as float64, ints as int64/uint64, bool, complex128."""
        for raw in self.blocks(max_elems):
            yield widen(raw, self.dtype)

    def _select(self, sel: tuple) -> np.ndarray:
        """Basic selection on the stored array (ints and slices with any step)."""
        if not self._h5:
            return self._stored[tuple(_numpy_slice(k) for k in sel)]
        h5sel, post = [], []
        for k in sel:
            if isinstance(k, int):
                h5sel.append(k)
                continue
            lo, hi, p = _bounds(k)
            if hi <= lo:
                return np.empty(result_shape(sel), self._stored_dtype())
            if k.step > 0:
                h5sel.append(slice(lo, hi, k.step))
                post.append(slice(None))
            else:
                h5sel.append(slice(lo, hi))
                post.append(p)
        return self._as_kdtr(self._h5_read(tuple(h5sel)))[tuple(post)]

    def _h5_read(self, sel: tuple) -> np.ndarray:
        """An HDF5 read; the library's errors (damaged data) become KdtrError naming the
        file and the dataset."""
        from ..hdf5_mapping import hdf5_errors
        file, path = self._where or (None, None)
        try:
            with hdf5_errors(path):
                return self._stored[sel]
        except KdtrError as e:
            if file is not None:
                e.set_file(file)
            raise

    def read(self, key: tuple, normalized: bool = False) -> np.ndarray:
        """``key`` (ints, slices, Ellipsis) applied to the logical array; bf16/fp8 come back
        as float32, int4 as int8.  ``normalized``: ``key`` is already ``normalize_key``'s
        output (whose slices follow ``range``, not numpy, conventions)."""
        if not normalized:
            key = normalize_key(key, self.shape)
        if not self.dtype.packed:
            return display_array(self._as_kdtr(self._select(key)), self.dtype)
        last = key[-1]
        if isinstance(last, int):
            lo, hi, post = last, last + 1, 0
        else:
            lo, hi, post = _bounds(last)
        if hi <= lo:
            return np.empty(result_shape(key), np.int8)
        packed = self._as_kdtr(self._select(key[:-1] + (slice(lo // 2, (hi + 1) // 2, 1),)))
        values = unpack_int4(packed, packed.shape[:-1] + (packed.shape[-1] * 2,))
        return values[..., lo - 2 * (lo // 2):hi - 2 * (lo // 2)][..., post]


def _numpy_slice(k):
    """A ``slice.indices`` result for numpy: stop -1 with a negative step means 'past the
    start', which numpy would read as 'the last element'."""
    if isinstance(k, slice):
        if not range(k.start, k.stop, k.step):
            return slice(0, 0, 1)        # start may be -1 here: numpy would read "last"
        if k.step < 0 and k.stop < 0:
            return slice(k.start, None, k.step)
    return k


def _bounds(s: slice) -> tuple[int, int, slice]:
    """A normalised slice -> the step-1 range [lo, hi) holding its elements, and the slice
    that picks them out of that range in order."""
    start, stop, step = s.start, s.stop, s.step
    count = len(range(start, stop, step))
    if count == 0:
        return 0, 0, slice(None)
    if step > 0:
        return start, start + (count - 1) * step + 1, slice(None, None, step)
    return start + (count - 1) * step, start + 1, slice(None, None, step)


def result_shape(sel: tuple) -> tuple:
    """The shape a ``normalize_key`` selection gives (an int index drops its axis)."""
    return tuple(len(range(k.start, k.stop, k.step)) for k in sel if isinstance(k, slice))


def normalize_key(key: tuple, shape: tuple) -> tuple:
    """Expand Ellipsis, pad with ':' and make every int and slice concrete for ``shape``:
    ints non-negative, slices as ``slice.indices`` gives them (``range`` semantics)."""
    key = tuple(key)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("at most one '...' in a selection")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1:]
    if len(key) > len(shape):
        raise IndexError(f"{len(key)} indices for a {len(shape)}-d dataset")
    key = key + (slice(None),) * (len(shape) - len(key))
    out = []
    for k, n in zip(key, shape):
        if isinstance(k, (int, np.integer)):
            if not -n <= k < n:
                raise IndexError(f"index {k} out of range for a dimension of {n}")
            out.append(int(k) % n)
        else:
            out.append(slice(*k.indices(n)))
    return tuple(out)


def widen(raw: np.ndarray, dt: DType) -> np.ndarray:
    """Stored elements -> values in a wide type (float64, int64/uint64, bool, complex128)."""
    if dt.packed:
        return unpack_int4(raw, (raw.size * 2,)).astype(np.int64)
    kind = dt.numpy.kind
    if kind == "b":
        return raw.astype(bool, copy=False)
    if kind == "i":
        return raw.astype(np.int64, copy=False)
    if kind == "u":
        return raw.astype(np.uint64, copy=False)
    if kind == "c":
        return raw.astype(np.complex128, copy=False)
    return raw.astype(np.float64)   # f16/bf16/fp8/f32/f64 are exact in float64


class Entry:
    """One node of any format, as the inspector shows it.  ``attrs`` and ``tensor`` (data
    access; None for groups, links and types KDTR cannot hold) are loaded on demand through
    the source, so that listing 100,000 datasets touches no data and no attribute."""
    __slots__ = ("path", "kind", "dtype", "shape", "nbytes", "attr_count", "offset", "target",
                 "source", "handle", "decodable")

    def __init__(self, path: str, kind: str, dtype: str | None = None,
                 shape: tuple | None = None, nbytes: int | None = None, attr_count: int = 0,
                 offset: int | None = None, target: str | None = None,
                 source: "Source | None" = None, handle: Any = None, decodable: bool = False):
        self.path, self.kind, self.dtype, self.shape = path, kind, dtype, shape
        self.nbytes, self.attr_count, self.offset, self.target = nbytes, attr_count, offset, target
        self.source, self.handle, self.decodable = source, handle, decodable

    @property
    def attrs(self) -> dict:
        return self.source.attrs_of(self) if self.attr_count else {}

    @property
    def tensor(self) -> "Tensor | None":
        return self.source.tensor_of(self) if self.decodable else None

    @property
    def rel(self) -> str:
        return self.path.lstrip("/")


class Source:
    format = ""
    version = ""

    def __init__(self, path: str):
        self.path = path

    def entries(self) -> list[Entry]:
        raise NotImplementedError

    def attrs_of(self, e: Entry) -> dict:
        raise NotImplementedError

    def tensor_of(self, e: Entry) -> Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class KdtrSource(Source):
    format = "kdtr"

    def __init__(self, path: str):
        super().__init__(path)
        self.file = kdtr.File(path)
        pre = np.fromfile(path, dtype=L.PREAMBLE_DTYPE, count=1)[0]
        self.version = f"{int(pre['major'])}.{int(pre['minor'])}"

    def entries(self) -> list[Entry]:
        """Depth first, each group's members in insertion order, from ``File.node_table()``
        (column-wise: building 100,000 entries one ``Dataset`` property at a time costs
        several seconds)."""
        t = self.file.node_table()
        out: list[Entry] = []
        stack = [0]
        while stack:
            i = stack.pop()
            if t.is_group[i]:
                out.append(Entry(t.paths[i], "group", None, None, None, t.attr_count[i], None,
                                 None, self))
                stack.extend(reversed(list(t.children[i].values())))
                continue
            out.append(Entry(t.paths[i], "dataset", t.dtype[i], t.shape[i], t.nbytes[i],
                             t.attr_count[i], t.offset[i], None, self, None, True))
        return out

    def attrs_of(self, e: Entry) -> dict:
        return dict(self.file[e.path].attrs)

    def tensor_of(self, e: Entry) -> Tensor:
        return Tensor(BY_NAME[e.dtype], e.shape, self.file[e.path].packed())

    def verify(self, progress) -> str:
        checked = self.file.verify(progress)
        n = sum(1 for e in self.entries() if e.kind == "dataset")
        return f"{n} datasets, {checked} bytes: CRC32C, padding and bool bytes checked"

    def close(self) -> None:
        self.file.close()


class Hdf5Source(Source):
    format = "hdf5"

    def __init__(self, path: str):
        from ..hdf5 import open_hdf5
        super().__init__(path)
        self.file = open_hdf5(path)
        plist = self.file.id.get_create_plist()
        self.version = f"superblock {plist.get_version()[0]}"

    def entries(self) -> list[Entry]:
        with about_file(self.path):
            return self._entries()

    def _entries(self) -> list[Entry]:
        from h5py import h5o
        from ..hdf5 import H5Node, walk
        root = self.file["/"]
        root_node = H5Node("/", "group", obj=root, num_attrs=h5o.get_info(root.id).num_attrs)
        out = [Entry("/", "group", attr_count=_h5_attr_count(root_node), source=self,
                     handle=root_node)]
        for node in walk(self.file, strict=False):
            out.append(Entry(node.path, node.kind, node.type_name,
                             node.shape if node.shape is not None else node.stored_shape,
                             node.nbytes, _h5_attr_count(node),
                             target=node.target, source=self, handle=node,
                             decodable=node.kind == "dataset" and node.dtype is not None))
        return out

    def attrs_of(self, e: Entry) -> dict:
        from ..hdf5 import read_attrs
        with about_file(self.path):
            return read_attrs(e.handle.obj, e.path, strict=False)

    def tensor_of(self, e: Entry) -> Tensor:
        n = e.handle
        return Tensor(n.dtype, n.shape, n.obj, h5=True, where=(self.path, e.path))

    def verify(self, progress) -> str:
        with about_file(self.path):
            return self._verify(progress)

    def _verify(self, progress) -> str:
        entries = [e for e in self.entries() if e.kind == "dataset"]
        total = sum(e.nbytes or 0 for e in entries if e.decodable)
        done, skipped = 0, 0
        for e in entries:
            if not e.decodable:
                skipped += 1
                continue
            try:
                for block in e.tensor.blocks(STATS_CHUNK_BYTES // 8):
                    done += block.nbytes
                    progress(done, total)
            except KdtrError:
                raise
            except Exception as exc:  # noqa: BLE001 - HDF5 reports damage as many types
                raise KdtrError("K017", f"HDF5 could not read the data ({type(exc).__name__}: "
                                        f"{exc})", e.path) from None
        return (f"{len(entries) - skipped} datasets, {done} bytes read "
                f"({skipped} of a type KDTR cannot hold skipped; HDF5 checks fletcher32 "
                "checksums where the file has them)")

    def close(self) -> None:
        self.file.close()


def _h5_attr_count(node) -> int:
    """Attributes of an HDF5 object, not counting the KDTR mapping's markers."""
    from ..hdf5_mapping import MARKERS
    if node.obj is None:
        return 0
    return node.num_attrs - sum(1 for m in MARKERS if m in node.obj.attrs)


class SafetensorsSource(Source):
    format = "safetensors"
    version = "-"

    def __init__(self, path: str):
        from ..safetensors_io import SafetensorsFile
        super().__init__(path)
        self.file = SafetensorsFile(path)

    def entries(self) -> list[Entry]:
        out = [Entry("/", "group", attr_count=len(self.file.metadata), source=self)]
        for t in self.file.tensors:
            out.append(Entry("/" + t.name, "dataset", t.dtype.name, t.shape, t.nbytes,
                             offset=self.file.data_start + t.begin, source=self, handle=t,
                             decodable=True))
        return out

    def attrs_of(self, e: Entry) -> dict:
        return dict(self.file.metadata) if e.path == "/" else {}

    def tensor_of(self, e: Entry) -> Tensor:
        t = e.handle
        return Tensor(t.dtype, t.shape, self.file.stored(t.name))

    def verify(self, progress) -> str:
        for t in self.file.tensors:
            self.file.array(t.name)   # bool bytes
        return (f"{len(self.file.tensors)} tensors: header, ranges and bool bytes checked "
                "(safetensors has no checksums)")


def detect_format(path: str) -> str:
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise KdtrError("K058", "a directory" if stat.S_ISDIR(st.st_mode) else
                        "a FIFO, device or socket", file=path)
    with open(path, "rb") as fh:
        head = fh.read(16)
    if head[:8] == L.MAGIC:
        return "kdtr"
    if head[:8] == HDF5_SIGNATURE:
        return "hdf5"
    if len(head) >= 9 and head[8:9] == b"{" or path.endswith(".safetensors"):
        return "safetensors"
    import h5py
    if st.st_size >= 512 and h5py.is_hdf5(path):   # HDF5 with a user block
        return "hdf5"
    return "kdtr"   # let the KDTR reader name what it is (GGUF, text-mode damage, ...)


def open_source(path: str) -> Source:
    """The file at ``path`` as a Source; every ``KdtrError`` it raises names ``path``."""
    fmt = detect_format(path)
    with about_file(path):
        return {"kdtr": KdtrSource, "hdf5": Hdf5Source,
                "safetensors": SafetensorsSource}[fmt](path)

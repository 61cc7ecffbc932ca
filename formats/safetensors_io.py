"""Read .safetensors files (input only) without the safetensors package, hardened.

Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data buffer.
The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data buffer) plus an optional ``"__metadata__"`` of str -> str.

Everything is checked before any tensor is handed out (``KdtrError``, codes of
``formats.layout`` chosen as the closest rule):
    file shorter than 8 bytes            K001    header length over 100 MB       K013
    header past the end of the file      K017    not UTF-8 / not a JSON object    K039 / K002
    duplicate JSON key (any level)       K043    NaN/Infinity literals            K002
    malformed tensor entry               K024    unknown dtype name               K027
    more than 8 dims / dim out of range  K028 / K029   shape x dtype overflow     K030
    offsets not [begin <= end] ints      K034    end - begin != shape x dtype     K031
    overlapping ranges                   K035    hole between ranges (or before)  K036
    data past the end of the file        K017    bytes after the last range       K018
    metadata not a str -> str object     K046    more than 1e6 tensors            K012
    not a regular file                   K058
Tensors are zero-copy, read-only views of a memory map that stay valid after ``close()``.
"""
from __future__ import annotations

import json
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from . import kdtr
from . import layout as L
from .dtypes import BY_NAME, DType
from .errors import KdtrError, about_file
from .names import check_name
from .progress import Progress, ticker

__all__ = ["SafetensorsFile", "TensorInfo", "MAX_HEADER_BYTES", "ST_DTYPES",
           "safetensors_to_kdtr", "safetensors_to_hdf5", "tensor_path"]

MAX_HEADER_BYTES = 100_000_000
# safetensors dtype names -> KDTR dtypes.  F8_E4M3 is the "fn" variant (finite, NaN = 0x7f/0xff).
ST_DTYPES: dict[str, DType] = {
    "BOOL": BY_NAME["bool"], "U8": BY_NAME["uint8"], "I8": BY_NAME["int8"],
    "I16": BY_NAME["int16"], "U16": BY_NAME["uint16"], "I32": BY_NAME["int32"],
    "U32": BY_NAME["uint32"], "I64": BY_NAME["int64"], "U64": BY_NAME["uint64"],
    "F16": BY_NAME["float16"], "BF16": BY_NAME["bfloat16"], "F32": BY_NAME["float32"],
    "F64": BY_NAME["float64"], "F8_E4M3": BY_NAME["float8_e4m3fn"],
    "F8_E5M2": BY_NAME["float8_e5m2"], "C64": BY_NAME["complex64"],
}
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int      # offsets relative to the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise KdtrError("K043", f"duplicate JSON key {key!a} in the safetensors header")
        out[key] = value
    return out


def _no_constants(name: str):
    raise KdtrError("K002", f"JSON literal {name} is not allowed in a safetensors header")


def _parse_header(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KdtrError("K039", f"safetensors header is not UTF-8: {e}") from None
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        if isinstance(e, KdtrError):
            raise
        raise KdtrError("K002", f"safetensors header is not valid JSON ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise KdtrError("K002", "safetensors header is not a JSON object")
    return header


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _tensor_info(name: str, entry: Any) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise KdtrError("K024", f"tensor entry must hold exactly dtype, shape, data_offsets; "
                                f"got {keys!a}", name)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in ST_DTYPES:
        raise KdtrError("K027", f"dtype {dtype_name!a} (supported: {', '.join(ST_DTYPES)})", name)
    dt = ST_DTYPES[dtype_name]
    if not isinstance(shape, list):
        raise KdtrError("K029", "shape is not a list", name)
    if len(shape) > L.MAX_NDIM:
        raise KdtrError("K028", f"{len(shape)} dimensions (limit {L.MAX_NDIM})", name)
    if not all(_is_uint(d) and d <= L.MAX_DIM for d in shape):
        raise KdtrError("K029", f"shape {shape!a} (non-negative integers <= 2**48)", name)
    count = nonzero = 1
    for d in shape:   # Python ints: no overflow; each factor <= 2**48 and at most 8 of them
        count *= d
        nonzero *= max(d, 1)
    nbytes = dt.nbytes(count)
    if dt.nbytes(nonzero) > L.MAX_TENSOR_BYTES:   # zero dims count as 1, as KDTR's K030 does
        raise KdtrError("K030", f"shape {shape} of {dtype_name} exceeds 2**62 bytes (zero "
                                "dimensions count as 1)", name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_uint, offsets))
            or offsets[0] > offsets[1]):
        raise KdtrError("K034", f"data_offsets {offsets!a} (need [begin, end], "
                                "0 <= begin <= end)", name)
    if offsets[1] - offsets[0] != nbytes:
        raise KdtrError("K031", f"data_offsets span {offsets[1] - offsets[0]} bytes, shape "
                                f"{shape} of {dtype_name} needs {nbytes}", name)
    return TensorInfo(name, dt, tuple(shape), offsets[0], offsets[1])


def _check_ranges(infos: list[TensorInfo], data_size: int) -> None:
    """Ranges must tile [0, data_size) exactly: no overlap, no hole, nothing after."""
    pos = 0
    for t in infos:   # sorted by (begin, end)
        if t.begin < pos:
            raise KdtrError("K035", f"bytes [{t.begin}, {t.end}) overlap the previous tensor, "
                                    f"which ends at {pos}", t.name)
        if t.begin > pos:
            raise KdtrError("K036", f"bytes [{pos}, {t.begin}) before this tensor belong to "
                                    "no tensor", t.name)
        pos = t.end
    if pos > data_size:
        raise KdtrError("K017", f"tensors need {pos} data bytes, the file holds {data_size}")
    if pos < data_size:
        raise KdtrError("K018", f"{data_size - pos} bytes after the last tensor")


class SafetensorsFile:
    """A validated, memory-mapped .safetensors file.

    ``metadata``: the ``__metadata__`` strings; ``tensors``: ``TensorInfo`` in data order;
    ``data_start``: file offset of the data buffer (tensor offsets are relative to it);
    ``array(name)``: a read-only zero-copy view (bf16/fp8 as ml_dtypes arrays)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with about_file(self.path):
            self._open()

    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KdtrError("K058", "a directory" if stat.S_ISDIR(st.st_mode) else
                                "a FIFO, device or socket")
            size = st.st_size
            if size < 8:
                raise KdtrError("K001", f"{size} bytes; a safetensors file starts with an "
                                        "8-byte header length")
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            if n > MAX_HEADER_BYTES:
                raise KdtrError("K013", f"header length {n} > {MAX_HEADER_BYTES}")
            if 8 + n > size:
                raise KdtrError("K017", f"header of {n} bytes needs a file of at least "
                                        f"{8 + n} bytes, it has {size}")
            header = _parse_header(os.pread(fd, n, 8))
            self.data_start = 8 + n
            self.metadata = self._metadata(header.pop("__metadata__", {}))
            if len(header) > L.MAX_NODES:
                raise KdtrError("K012", f"{len(header)} tensors (limit {L.MAX_NODES})")
            infos = [_tensor_info(name, entry) for name, entry in header.items()]
            infos.sort(key=lambda t: (t.begin, t.end))
            _check_ranges(infos, size - self.data_start)
            self.tensors: list[TensorInfo] = infos
            self._by_name = {t.name: t for t in infos}
            self._map = (mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None)
        finally:
            os.close(fd)
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)

    @staticmethod
    def _metadata(meta: Any) -> dict[str, str]:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise KdtrError("K046", "__metadata__ must be an object of string values")
        return dict(meta)

    def keys(self) -> list[str]:
        return [t.name for t in self.tensors]

    def info(self, name: str) -> TensorInfo:
        return self._by_name[name]

    def stored(self, name: str) -> np.ndarray:
        """The tensor's elements as stored (uint8 view reinterpreted, no copy)."""
        t = self._by_name[name]
        start = self.data_start + t.begin
        raw = self._buffer[start:start + t.nbytes]
        return raw.view(t.dtype.storage).reshape(t.shape)

    def array(self, name: str) -> np.ndarray:
        arr = self.stored(name)
        if arr.dtype == np.bool_ and arr.size and arr.view(np.uint8).max() > 1:
            raise KdtrError("K051", "a BOOL tensor holds a byte other than 0 or 1", name,
                            self.path)
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.tensors)

    def close(self) -> None:
        self._buffer = None  # views already handed out keep the map alive

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensor_path(name: str, split_dots: bool) -> str:
    """The KDTR/HDF5 path of a safetensors tensor name: as is ('/' separates groups), or with
    every '.' turned into '/' (``split_dots``: ``model.layers.0.w`` -> ``model/layers/0/w``).
    Every component must be a valid KDTR name (K040/K041: no empty, '.', '..' or control
    characters, so a leading '/' or '//' is refused rather than silently dropped)."""
    path = name.replace(".", "/") if split_dots else name
    for part in path.split("/"):
        check_name(part, name)
    return path


def tree_order(st: SafetensorsFile, split_dots: bool) -> list[tuple[TensorInfo, str]]:
    """(tensor, path) depth first, groups in order of first appearance in the data.  Writing in
    this order makes the KDTR node order the tree's depth-first order, which is what HDF5 ->
    KDTR reproduces, so both routes give the same bytes."""
    root: dict = {}
    for t in st.tensors:
        path = tensor_path(t.name, split_dots)
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise KdtrError("K043", f"{path!a} needs {part!a} as a group, but it is a "
                                        "tensor", t.name)
            node = child
        if parts[-1] in node:
            raise KdtrError("K043", f"path {path!a} is used twice", t.name)
        node[parts[-1]] = (t, path)
    out: list[tuple[TensorInfo, str]] = []
    todo = [iter(root.values())]
    while todo:
        item = next(todo[-1], None)
        if item is None:
            todo.pop()
        elif isinstance(item, dict):
            todo.append(iter(item.values()))
        else:
            out.append(item)
    return out


def safetensors_to_kdtr(src: str | os.PathLike, dst: str | os.PathLike, *,
                        split_dots: bool = False,
                        progress: Progress | None = None) -> None:
    """Convert a .safetensors file to KDTR: tensors in data order, ``__metadata__`` as root
    attributes.  Each tensor is streamed from the memory map into the KDTR writer."""
    with SafetensorsFile(src) as st, about_file(st.path):
        tick = ticker(sum(t.nbytes for t in st.tensors), progress)
        order = tree_order(st, split_dots)
        with kdtr.File(dst, "w") as out:
            for key, value in st.metadata.items():
                out.attrs[key] = value
            for t, path in order:
                out.create_dataset(path, data=st.array(t.name))
                tick(t.nbytes)
        if not st.tensors and progress is not None:
            progress(0, 0)


def safetensors_to_hdf5(src: str | os.PathLike, dst: str | os.PathLike, *,
                        split_dots: bool = False,
                        progress: Progress | None = None) -> None:
    """Convert a .safetensors file to HDF5 with the KDTR mapping (``formats.hdf5``)."""
    from .hdf5 import H5TreeWriter
    from .hdf5_mapping import BIT_PATTERNS

    with SafetensorsFile(src) as st, about_file(st.path):
        tick = ticker(sum(t.nbytes for t in st.tensors), progress)
        order = tree_order(st, split_dots)
        with H5TreeWriter(dst) as out:
            out.set_attrs("/", dict(st.metadata))
            for t, path in order:
                stored = st.array(t.name)
                if t.dtype.name in BIT_PATTERNS:
                    stored = stored.view(BIT_PATTERNS[t.dtype.name])
                _make_groups(out.file, path)
                out.dataset(path, t.dtype, t.shape, stored, tick)
        if not st.tensors and progress is not None:
            progress(0, 0)


def _make_groups(f, path: str) -> None:
    node = f
    for part in path.split("/")[:-1]:
        node = node[part] if part in node else node.create_group(part, track_order=True)

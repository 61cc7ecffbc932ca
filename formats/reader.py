"""KDTR reader: validate the preamble and the whole header before handing anything out.

Checks run in the order of docs/FORMAT.md ("Validation order"), each raising ``KdtrError`` with
its rule code.  Every count and size read from the file is bounded (``formats.layout`` limits)
before it sizes an allocation or a loop.  Table checks are vectorised so that opening a file of
100,000 tensors stays well under half a second.
"""
from __future__ import annotations

import mmap
import os
import stat
from typing import Callable

import numpy as np

from . import layout as L
from .attributes import decode_attr
from .checksum import crc32c
from .dtypes import BY_CODE, unpack_int4
from .errors import KdtrError
from .layout import DatasetMeta
from .names import check_name

_OTHER_FORMATS = [
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (convert it with kdtr-dump convert)"),
    (b"GGUF", "a GGUF file"),
    (b"PK\x03\x04", "a zip archive (a PyTorch checkpoint?)"),
    (b"\x80\x02", "a pickle stream (never loaded)"),
    (b"\x80\x03", "a pickle stream (never loaded)"),
    (b"\x80\x04", "a pickle stream (never loaded)"),
    (b"\x80\x05", "a pickle stream (never loaded)"),
    (b"\x93NUMPY", "a NumPy .npy file"),
]


def _sniff_magic(head: bytes) -> None:
    if head[:8] == L.MAGIC:
        return
    text_mode_variants = (b"\x09KDTR\r\n\x1a", b"\x89KDTR\n\x1a", b"\x89KDTR\r\r\n\x1a",
                          b"\xef\xbf\xbdKDTR", b"\xc2\x89KDTR")
    if any(head.startswith(v) for v in text_mode_variants) or head[1:5] == b"KDTR":
        raise KdtrError("K003", f"first bytes {head[:10]!r}; the file went through a text-mode "
                                "transfer (CR/LF or 8-bit damage); transfer it in binary mode")
    for magic, what in _OTHER_FORMATS:
        if head.startswith(magic):
            raise KdtrError("K004", f"this is {what}, not KDTR")
    n = int.from_bytes(head[:8], "little")
    if 2 <= n < (1 << 32) and head[8:9] == b"{":
        raise KdtrError("K004", "this is a safetensors file, not KDTR (convert it with "
                                "kdtr-dump convert)")
    raise KdtrError("K002", f"first bytes {head[:8]!r}")


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def read_into(file, path: str) -> None:
    """Parse ``path`` into ``file``'s node tables (see ``kdtr.File``)."""
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (forever);
        # it changes nothing for a regular file.  O_NOCTTY: a terminal never becomes ours.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except IsADirectoryError:
        raise KdtrError("K058", "a directory, not a file", file=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device could block or never end
            raise KdtrError("K058", "a FIFO, device or socket, not a file", file=path)
        size = st.st_size
        if size < L.PREAMBLE_SIZE:
            raise KdtrError("K001", f"{size} bytes")
        head = os.pread(fd, L.PREAMBLE_SIZE, 0)
        if len(head) < L.PREAMBLE_SIZE:
            raise KdtrError("K001", f"read {len(head)} bytes")
        _sniff_magic(head)
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    whole = np.frombuffer(mm, dtype=np.uint8)
    pre = np.frombuffer(head, L.PREAMBLE_DTYPE, 1)[0]
    _check_preamble(head, pre, size)
    p = {k: int(pre[k]) for k in ("align_log2", "node_count", "attr_count", "data_offset",
                                   "data_size", "header_offset", "header_size", "values_size",
                                   "strings_size")}
    header = whole[p["header_offset"]:p["header_offset"] + p["header_size"]]
    if crc32c(header) != int(pre["header_crc"]):
        raise KdtrError("K019", "the header bytes do not match the checksum in the preamble")
    data_end = p["data_offset"] + p["data_size"]
    if whole[L.PREAMBLE_SIZE:p["data_offset"]].any() or whole[data_end:p["header_offset"]].any():
        raise KdtrError("K020", "bytes between the preamble and the data, or between the data and "
                                "the header, are not zero")
    n, m = p["node_count"], p["attr_count"]
    # A copy (128 bytes a node): a view would pin the whole memory map for as long as the
    # File lives (File refers to itself, so until the cycle collector runs), even after close().
    nodes = np.frombuffer(header, L.NODE_DTYPE, n, 0).copy()
    attrs = np.frombuffer(header, L.ATTR_DTYPE, m, n * L.NODE_SIZE)
    vstart = n * L.NODE_SIZE + m * L.ATTR_SIZE
    values = header[vstart:vstart + p["values_size"]]
    strings = header[vstart + p["values_size"]:].tobytes()

    _check_nodes(nodes, p)
    _check_data_ranges(nodes, p)
    _check_string_pool(nodes, attrs, p)
    _build_tree(file, nodes, strings)
    _check_attr_tables(nodes, attrs, values, p)
    _decode_attrs(file, nodes, attrs, values, strings)

    file._map_array = whole
    file._data_offset = p["data_offset"]
    file._align_log2 = p["align_log2"]
    file._datasets = _LazyDatasets(nodes)


def _check_preamble(head: bytes, pre, size: int) -> None:
    bom = int(pre["bom"])
    if bom != L.BOM:
        if bom == int.from_bytes(L.BOM.to_bytes(4, "little"), "big"):
            raise KdtrError("K005", "the file was written big-endian; KDTR is little-endian only")
        raise KdtrError("K006", f"0x{bom:08x}")
    # The major version is checked before the checksum: a future major version may lay the
    # rest of the preamble out differently, and deserves "too new", not "corrupt".
    if int(pre["major"]) != L.VERSION_MAJOR:
        raise KdtrError("K007", f"version {int(pre['major'])}.{int(pre['minor'])}; this reader "
                                f"reads {L.VERSION_MAJOR}.x")
    if crc32c(head[:L.PREAMBLE_SIZE - 4]) != int(pre["preamble_crc"]):
        raise KdtrError("K010", "the preamble bytes do not match their checksum")
    if int(pre["reserved0"]) or any(bytes(pre["reserved1"])):
        raise KdtrError("K009", "reserved preamble fields must be zero")
    unknown = int(pre["features_required"]) & ~L.KNOWN_REQUIRED_FEATURES
    if unknown:
        raise KdtrError("K008", f"bits 0x{unknown:x} (this reader knows 0x{L.KNOWN_REQUIRED_FEATURES:x})")
    a = int(pre["align_log2"])
    if not L.MIN_ALIGN_LOG2 <= a <= L.MAX_ALIGN_LOG2:
        raise KdtrError("K011", f"align_log2 {a} outside [{L.MIN_ALIGN_LOG2}, {L.MAX_ALIGN_LOG2}]")
    n, m = int(pre["node_count"]), int(pre["attr_count"])
    if not 1 <= n <= L.MAX_NODES or m > L.MAX_ATTRS:
        raise KdtrError("K012", f"{n} nodes (allowed 1..{L.MAX_NODES}), {m} attributes "
                                f"(allowed 0..{L.MAX_ATTRS})")
    hsize, vsize, ssize = int(pre["header_size"]), int(pre["values_size"]), int(pre["strings_size"])
    if hsize > L.MAX_HEADER_BYTES:
        raise KdtrError("K013", f"{hsize} bytes > {L.MAX_HEADER_BYTES}")
    if vsize % 8 or hsize != n * L.NODE_SIZE + m * L.ATTR_SIZE + vsize + ssize:
        raise KdtrError("K014", f"header_size {hsize} != {n}*{L.NODE_SIZE} + {m}*{L.ATTR_SIZE} + "
                                f"values {vsize} + strings {ssize} (values must be a multiple "
                                "of 8)")
    doff, dsize, hoff = int(pre["data_offset"]), int(pre["data_size"]), int(pre["header_offset"])
    if doff != L.align_up(L.PREAMBLE_SIZE, a):
        raise KdtrError("K015", f"data_offset {doff}, expected {L.align_up(L.PREAMBLE_SIZE, a)}")
    if hoff != L.align_up(doff + dsize, 3):
        raise KdtrError("K016", f"header_offset {hoff}, expected {L.align_up(doff + dsize, 3)} "
                                f"(data_size {dsize})")
    if size < hoff + hsize:
        raise KdtrError("K017", f"file has {size} bytes, its header ends at {hoff + hsize}")
    if size > hoff + hsize:
        raise KdtrError("K018", f"{size - hoff - hsize} bytes after the header")


def _check_nodes(nodes: np.ndarray, p: dict) -> None:
    n = nodes.size
    root = nodes[0]
    if int(root["parent"]) != L.NO_PARENT or int(root["kind"]) != L.KIND_GROUP or int(root["name_len"]):
        raise KdtrError("K021", "node 0 must be a group with no parent and an empty name", "/")
    idx = np.arange(n, dtype=np.int64)
    kinds = nodes["kind"]
    bad = _first(kinds > L.KIND_DATASET)
    if bad is not None:
        raise KdtrError("K024", f"kind {int(kinds[bad])} of node {bad}", f"node #{bad}")
    parents = nodes["parent"].astype(np.int64)
    bad = _first(parents[1:] >= idx[1:])
    if bad is not None:
        raise KdtrError("K022", f"node {bad + 1} names parent {int(parents[bad + 1])}; a parent "
                                "must come before its children", f"node #{bad + 1}")
    bad = _first(kinds[parents[1:]] != L.KIND_GROUP)
    if bad is not None:
        raise KdtrError("K023", f"node {bad + 1}'s parent {int(parents[bad + 1])} is a dataset",
                        f"node #{bad + 1}")
    reserved = ((nodes["reserved0"] != 0) | (nodes["reserved1"] != 0) | (nodes["reserved2"] != 0)
                | nodes["reserved3"].any(axis=1))
    bad = _first(reserved)
    if bad is not None:
        raise KdtrError("K025", f"node {bad}", f"node #{bad}")
    is_group = kinds == L.KIND_GROUP
    carries = ((nodes["dtype"] != 0) | (nodes["ndim"] != 0) | nodes["dims"].any(axis=1)
               | (nodes["data_offset"] != 0) | (nodes["data_size"] != 0) | (nodes["data_crc"] != 0))
    bad = _first(is_group & carries)
    if bad is not None:
        raise KdtrError("K026", f"group node {bad} has a dtype, shape or data range",
                        f"node #{bad}")
    ds = np.flatnonzero(~is_group)
    if not ds.size:
        return
    codes = nodes["dtype"][ds]
    known = np.isin(codes, np.array(sorted(BY_CODE), dtype=np.uint8))
    bad = _first(~known)
    if bad is not None:
        raise KdtrError("K027", f"dtype code {int(codes[bad])}", f"node #{ds[bad]}")
    ndim = nodes["ndim"][ds].astype(np.int64)
    bad = _first(ndim > L.MAX_NDIM)
    if bad is not None:
        raise KdtrError("K028", f"{int(ndim[bad])} dimensions (limit {L.MAX_NDIM})", f"node #{ds[bad]}")
    dims = nodes["dims"][ds]
    unused = np.arange(L.MAX_NDIM)[None, :] >= ndim[:, None]
    bad = _first(((dims > L.MAX_DIM) | (unused & (dims != 0))).any(axis=1))
    if bad is not None:
        raise KdtrError("K029", f"dims {dims[bad][:ndim[bad]].tolist()} (each <= 2**48, unused "
                                "slots zero)", f"node #{ds[bad]}")
    # Size arithmetic: an estimate in float64 screens out overflow, exact ints confirm.  Zero
    # dims count as 1 and int4 as a byte: NumPy must be able to describe every accepted shape,
    # empty or not (it rejects an empty shape whose non-zero dims overflow), unpacked or not.
    used = np.where(unused | (dims == 0), 1, dims).astype(np.float64)
    itemsize = np.array([BY_CODE[int(c)].storage.itemsize for c in range(256) if c in BY_CODE])
    item = np.zeros(256, np.float64)
    item[sorted(BY_CODE)] = itemsize
    est = used.prod(axis=1) * item[codes]
    for k in np.flatnonzero(est > float(L.MAX_TENSOR_BYTES) * 0.5).tolist():
        shape = [int(d) for d in dims[k][:ndim[k]]]
        exact = int(np.prod([max(d, 1) for d in shape], dtype=object)) * int(item[codes[k]])
        if exact > L.MAX_TENSOR_BYTES:
            raise KdtrError("K030", f"shape {shape} of {BY_CODE[int(codes[k])].name} needs {exact} "
                                    "bytes", f"node #{ds[k]}")
    count = np.where(unused, 1, dims).astype(np.uint64).prod(axis=1)  # known to fit now
    int4 = codes == 16
    if int4.any():
        last = dims[np.arange(ds.size), np.maximum(ndim - 1, 0)]
        bad = _first(int4 & ((ndim == 0) | (last % 2 == 1)))
        if bad is not None:
            raise KdtrError("K032", f"shape {dims[bad][:ndim[bad]].tolist()}", f"node #{ds[bad]}")
    expected = np.where(int4, count // np.uint64(2), count * item[codes].astype(np.uint64))
    bad = _first(nodes["data_size"][ds] != expected)
    if bad is not None:
        raise KdtrError("K031", f"data_size {int(nodes['data_size'][ds[bad]])}, shape and dtype "
                                f"need {int(expected[bad])}", f"node #{ds[bad]}")


def _check_data_ranges(nodes: np.ndarray, p: dict) -> None:
    ds = np.flatnonzero(nodes["kind"] == L.KIND_DATASET)
    if not ds.size:
        if p["data_size"]:
            raise KdtrError("K037", f"data_size {p['data_size']} but no datasets")
        return
    off = nodes["data_offset"][ds]
    size = nodes["data_size"][ds]
    mask = np.uint64((1 << p["align_log2"]) - 1)
    bad = _first(off & mask != 0)
    if bad is not None:
        raise KdtrError("K033", f"offset {int(off[bad])} is not a multiple of "
                                f"{1 << p['align_log2']}", f"node #{ds[bad]}")
    limit = np.uint64(p["data_size"])
    bad = _first((off > limit) | (size > limit - np.minimum(off, limit)))
    if bad is not None:
        raise KdtrError("K034", f"bytes [{int(off[bad])}, {int(off[bad]) + int(size[bad])}) "
                                f"outside the data section of {p['data_size']} bytes",
                        f"node #{ds[bad]}")
    end = off + size
    prev_end = np.concatenate([np.zeros(1, np.uint64), end[:-1]])
    bad = _first(off < prev_end)
    if bad is not None:
        raise KdtrError("K035", f"offset {int(off[bad])} < end {int(prev_end[bad])} of the "
                                "previous tensor (tensors are stored in node order)",
                        f"node #{ds[bad]}")
    canonical = (prev_end + mask) & ~mask
    bad = _first(off != canonical)
    if bad is not None:
        raise KdtrError("K036", f"offset {int(off[bad])}, the previous tensor ends at "
                                f"{int(prev_end[bad])}", f"node #{ds[bad]}")
    if int(end[-1]) != p["data_size"]:
        raise KdtrError("K037", f"data_size {p['data_size']}, the last tensor ends at "
                                f"{int(end[-1])}")


def _check_string_pool(nodes: np.ndarray, attrs: np.ndarray, p: dict) -> None:
    lens = np.concatenate([nodes["name_len"], attrs["name_len"]]).astype(np.int64)
    offs = np.concatenate([nodes["name_offset"], attrs["name_offset"]]).astype(np.int64)
    expected = np.concatenate([[0], np.cumsum(lens)[:-1]])
    bad = _first(offs != expected)
    if bad is not None or int(lens.sum()) != p["strings_size"]:
        where = None if bad is None else (f"node #{bad}" if bad < nodes.size
                                          else f"attribute #{bad - nodes.size}")
        raise KdtrError("K038", "names must follow each other in table order and fill the pool "
                                "exactly", where)


def _build_tree(file, nodes: np.ndarray, strings: bytes) -> None:
    """Names, paths, parents and child maps.  When every node name is printable ASCII (the
    usual case) the per-name checks run once over the whole pool; otherwise, or on any
    violation, the per-node loop below runs and reports the exact rule and node."""
    if not _build_tree_ascii(file, nodes, strings):
        _build_tree_checked(file, nodes, strings)


def _build_tree_ascii(file, nodes: np.ndarray, strings: bytes) -> bool:
    n = nodes.size
    offs, lens = nodes["name_offset"][1:].tolist(), nodes["name_len"][1:]
    end = offs[-1] + int(lens[-1]) if n > 1 else 0
    pool = np.frombuffer(strings, np.uint8, end)
    # K040/K041 screened for every name at once: no control character, DEL, byte >= 0x80 or
    # '/', none empty or too long.  '.', '..', depth, length and duplicates are checked below.
    if ((pool < 0x20) | (pool >= 0x7F) | (pool == 0x2F)).any() or (
            n > 1 and (lens.min() == 0 or lens.max() > L.MAX_NAME_BYTES)):
        return False
    text = strings[:end].decode("ascii")
    names = [""] + [text[o:o + m] for o, m in zip(offs, lens.tolist())]
    parents, kinds = nodes["parent"].tolist(), nodes["kind"].tolist()
    paths, depth, path_bytes = ["/"] + [""] * (n - 1), [0] * n, [0] * n
    children: list = [None] * n
    children[0] = {}
    for i in range(1, n):
        name, parent = names[i], parents[i]
        depth[i], path_bytes[i] = depth[parent] + 1, path_bytes[parent] + 1 + len(name)
        siblings = children[parent]
        if (name in (".", "..") or name in siblings or depth[i] > L.MAX_DEPTH
                or path_bytes[i] - 1 > L.MAX_PATH_BYTES):
            return False
        siblings[name] = i
        paths[i] = (paths[parent] if parent else "") + "/" + name
        if kinds[i] == L.KIND_GROUP:
            children[i] = {}
    file._names, file._paths, file._parents, file._children = names, paths, parents, children
    return True


def _build_tree_checked(file, nodes: np.ndarray, strings: bytes) -> None:
    n = nodes.size
    offs = nodes["name_offset"].tolist()
    lens = nodes["name_len"].tolist()
    parents = nodes["parent"].tolist()
    kinds = nodes["kind"].tolist()
    names = [""] * n
    paths = ["/"] + [""] * (n - 1)
    depth = [0] * n
    children: list = [None] * n
    children[0] = {}
    for i in range(1, n):
        raw = strings[offs[i]:offs[i] + lens[i]]
        parent = parents[i]
        where = paths[parent].rstrip("/") + "/" + repr(raw)[2:-1]
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KdtrError("K039", str(e), where) from None
        path = paths[parent].rstrip("/") + "/" + name
        check_name(name, path)
        depth[i] = depth[parent] + 1
        if depth[i] > L.MAX_DEPTH or len(path.encode("utf-8")) - 1 > L.MAX_PATH_BYTES:
            raise KdtrError("K042", f"depth {depth[i]}, {len(path.encode()) - 1} bytes", path[:200])
        siblings = children[parent]
        if name in siblings:
            raise KdtrError("K043", f"{name!a} appears twice", path)
        siblings[name] = i
        names[i], paths[i] = name, path
        if kinds[i] == L.KIND_GROUP:
            children[i] = {}
    file._names, file._paths, file._parents, file._children = names, paths, parents, children


def _check_attr_tables(nodes: np.ndarray, attrs: np.ndarray, values: np.ndarray, p: dict) -> None:
    counts = nodes["attr_count"].astype(np.int64)
    first = nodes["attr_first"].astype(np.int64)
    expected = np.concatenate([[0], np.cumsum(counts)[:-1]])
    bad = _first(first != expected)
    if bad is not None or int(counts.sum()) != attrs.size:
        raise KdtrError("K044", "each node's attributes must follow the previous node's and the "
                                "ranges must cover the table exactly",
                        None if bad is None else f"node #{bad}")
    if not attrs.size:
        if p["values_size"]:
            raise KdtrError("K048", f"values_size {p['values_size']} with no attributes")
        return
    owners = np.repeat(np.arange(nodes.size), counts)
    bad = _first(attrs["owner"] != owners)
    if bad is not None:
        raise KdtrError("K045", f"attribute {bad} names owner {int(attrs['owner'][bad])}, its "
                                f"range belongs to node {int(owners[bad])}",
                        f"node #{int(owners[bad])}")
    bad = _first((attrs["kind"] < L.ATTR_STR) | (attrs["kind"] > L.ATTR_STRLIST))
    if bad is not None:
        raise KdtrError("K046", f"kind {int(attrs['kind'][bad])}", f"node #{int(owners[bad])}")
    bad = _first((attrs["reserved0"] != 0) | (attrs["reserved1"] != 0))
    if bad is not None:
        raise KdtrError("K047", f"attribute {bad}", f"node #{int(owners[bad])}")
    vsize = attrs["value_size"].astype(np.int64)
    bad = _first(vsize > L.MAX_ATTR_VALUE_BYTES)
    if bad is not None:
        raise KdtrError("K049", f"{int(vsize[bad])} bytes > {L.MAX_ATTR_VALUE_BYTES}",
                        f"node #{int(owners[bad])}")
    voff = attrs["value_offset"]
    prev_end = np.concatenate([[0], (voff[:-1].astype(np.float64) + vsize[:-1])])
    canonical = (np.ceil(prev_end / 8) * 8)
    last_end = float(voff[-1]) + float(vsize[-1])
    bad = _first(voff.astype(np.float64) != canonical)
    if bad is not None or (int(np.ceil(last_end / 8) * 8) != p["values_size"]):
        raise KdtrError("K048", "values must follow each other in table order, each at the next "
                                "multiple of 8, and fill the pool exactly",
                        None if bad is None else f"node #{int(owners[bad])}")
    used = np.zeros(values.size, bool)
    for o, s in zip(voff.tolist(), vsize.tolist()):
        used[o:o + s] = True
    if values[~used].any():
        raise KdtrError("K048", "padding bytes in the value pool are not zero")


def _decode_attrs(file, nodes: np.ndarray, attrs: np.ndarray, values: np.ndarray,
                  strings: bytes) -> None:
    file._attrs = [{} for _ in range(nodes.size)] if attrs.size else _EmptyAttrs(nodes.size)
    raw_values = values.tobytes()
    for j, (owner, noff, nlen, kind, vsize, voff) in enumerate(zip(
            attrs["owner"].tolist(), attrs["name_offset"].tolist(), attrs["name_len"].tolist(),
            attrs["kind"].tolist(), attrs["value_size"].tolist(), attrs["value_offset"].tolist())):
        node_path = file._paths[owner]
        try:
            name = strings[noff:noff + nlen].decode("utf-8")
        except UnicodeDecodeError as e:
            raise KdtrError("K039", f"attribute name: {e}", node_path) from None
        where = f"{node_path} (attribute {name!a})"
        check_name(name, where)
        target = file._attrs[owner]
        if name in target:
            raise KdtrError("K054", f"{name!a} appears twice", node_path)
        target[name] = decode_attr(kind, raw_values[voff:voff + vsize], where)


class _EmptyAttrs(list):
    """Attribute dicts for a file without attributes, made only for the nodes asked for."""

    def __init__(self, n: int):
        super().__init__([None] * n)

    def __getitem__(self, i):
        d = super().__getitem__(i)
        if d is None:
            d = {}
            self[i] = d
        return d


class _LazyDatasets(dict):
    """Dataset metadata built from the node table on first access (keeps open() cheap)."""

    def __init__(self, nodes: np.ndarray):
        super().__init__()
        self._nodes = nodes
        # Column views, made once: indexing a structured row (np.void) field by field costs
        # ~20 us a dataset, a column element well under 1 us.
        self._columns = tuple(nodes[k] for k in ("kind", "dtype", "ndim", "dims", "data_offset",
                                                 "data_size", "data_crc"))

    def __missing__(self, index: int):
        kind, dtype, ndim, dims, offset, size, crc = self._columns
        if kind[index] != L.KIND_DATASET:
            raise KeyError(index)
        meta = DatasetMeta(BY_CODE[int(dtype[index])], tuple(dims[index, :ndim[index]].tolist()),
                            int(offset[index]), int(size[index]), int(crc[index]))
        self[index] = meta
        return meta

    def get(self, index, default=None):
        try:
            return self[index]
        except KeyError:
            return default


def verify(file, progress: Callable[[int, int], None] | None = None) -> int:
    """Every tensor's CRC32C, bool bytes and the padding between tensors (``File.verify``)."""
    if file._mode != "r":
        raise ValueError("verify() reads a file opened with mode 'r'; close and reopen it")
    if file._closed:
        raise ValueError("the file is closed")
    nodes = file._datasets._nodes
    ds = np.flatnonzero(nodes["kind"] == L.KIND_DATASET)
    total = int(nodes["data_size"][ds].sum()) if ds.size else 0
    data = file._map_array[file._data_offset:file._data_offset + (int(
        nodes["data_offset"][ds[-1]] + nodes["data_size"][ds[-1]]) if ds.size else 0)]
    done, prev_end, chunk = 0, 0, 64 << 20
    for i in ds.tolist():
        off, size = int(nodes["data_offset"][i]), int(nodes["data_size"][i])
        if data[prev_end:off].any():
            raise KdtrError("K057", f"bytes [{prev_end}, {off}) of the data section",
                            file._paths[i])
        crc = 0
        for start in range(off, off + size, chunk):
            piece = data[start:min(start + chunk, off + size)]
            crc = crc32c(piece, crc)
            done += piece.size
            if progress is not None:
                progress(done, total)
        if crc != int(nodes["data_crc"][i]):
            raise KdtrError("K056", f"stored 0x{int(nodes['data_crc'][i]):08x}, computed "
                                    f"0x{crc:08x}", file._paths[i])
        if int(nodes["dtype"][i]) == 1 and size and data[off:off + size].max() > 1:
            raise KdtrError("K051", "a bool tensor holds a byte other than 0 or 1", file._paths[i])
        prev_end = off + size
    return total


# ----------------------------------------------------------------------------- verified reads

# Bytes per step of a verified copy: the chunk is copied, then checksummed while it is still in
# the L2 cache.  256 KiB fits any server core's L2 with room for the source; 64 KiB pays the
# per-call overhead, 4 MiB and up spill (docs/BENCHMARKS.md, "Bundle load verification").
COPY_CHUNK = 256 << 10


def _mismatch(file, index: int, stored: int, computed: int, what: str) -> KdtrError:
    return KdtrError("K056", f"stored 0x{stored:08x}, computed 0x{computed:08x} {what}",
                     file._paths[index], file._path)


def verify_dataset(file, index: int) -> int:
    """Check one dataset's CRC32C (and bool bytes) on the bytes in place; returns its size."""
    m = file._datasets[index]
    raw = file._raw(m.offset, m.size)
    crc = 0
    for start in range(0, m.size, COPY_CHUNK):
        crc = crc32c(raw[start:start + COPY_CHUNK], crc)
    if crc != m.crc:
        raise _mismatch(file, index, m.crc, crc, "(the tensor's bytes are damaged)")
    if m.dtype.name == "bool" and m.size and raw.max() > 1:
        raise KdtrError("K051", "a bool tensor holds a byte other than 0 or 1",
                        file._paths[index], file._path)
    return m.size


def copy_dataset(file, index: int, dest: np.ndarray) -> None:
    """Copy dataset ``index`` into ``dest`` (its shape; any dtype NumPy can cast to, int4 as
    unpacked values) checking the CRC32C of the bytes as they are copied, ``COPY_CHUNK`` at a
    time.  On a mismatch ``dest`` holds unchecked data and ``KdtrError`` K056 names the file
    and the dataset."""
    m = file._datasets[index]
    if dest.shape != m.shape:
        raise ValueError(f"destination shape {dest.shape} != dataset shape {m.shape}")
    if m.dtype.packed:  # int4: check the packed bytes, then unpack (rare; read twice)
        verify_dataset(file, index)
        packed = file._raw(m.offset, m.size).reshape(m.shape[:-1] + (m.shape[-1] // 2,))
        np.copyto(dest, unpack_int4(packed, m.shape), casting="unsafe")
        return
    src = file._raw(m.offset, m.size).view(m.dtype.storage)
    item = m.dtype.storage.itemsize
    same = dest.dtype == m.dtype.storage
    crc, is_bool = 0, m.dtype.name == "bool"
    if dest.flags.c_contiguous:
        flat = dest.reshape(-1)
        step = max(1, COPY_CHUNK // item)
        for s in range(0, src.size, step):
            piece, out = src[s:s + step], flat[s:s + step]
            np.copyto(out, piece, casting="unsafe")
            # Checksum what the caller received where it is byte-identical to the file
            # (hot in cache after the copy); a cast destination: the source chunk.
            checked = out.view(np.uint8) if same else piece.view(np.uint8)
            crc = crc32c(checked, crc)
            if is_bool and checked.size and checked.max() > 1:
                raise KdtrError("K051", "a bool tensor holds a byte other than 0 or 1",
                                file._paths[index], file._path)
    else:  # a strided destination: whole rows along the first axis at a time
        rows = src.reshape(m.shape) if m.shape else src.reshape(())
        if not m.shape:
            np.copyto(dest, rows, casting="unsafe")
            crc = crc32c(src.view(np.uint8))
        else:
            row_bytes = max(1, m.size // max(1, m.shape[0]))
            step = max(1, COPY_CHUNK // row_bytes)
            for s in range(0, m.shape[0], step):
                piece = rows[s:s + step]
                np.copyto(dest[s:s + step], piece, casting="unsafe")
                crc = crc32c(piece.reshape(-1).view(np.uint8), crc)
        if is_bool and m.size and src.view(np.uint8).max() > 1:
            raise KdtrError("K051", "a bool tensor holds a byte other than 0 or 1",
                            file._paths[index], file._path)
    if crc != m.crc:
        raise _mismatch(file, index, m.crc, crc, "(the tensor's bytes are damaged; the copy "
                        "is not usable)")

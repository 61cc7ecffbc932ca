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

The mapping rules themselves (markers, bit patterns, attribute values) are in
``formats.hdf5_mapping``; this module walks HDF5 trees and converts files.
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
from h5py import h5, h5d, h5l, h5o, h5s

from . import kdtr
from . import layout as L
from .dtypes import BY_NAME, DType, dtype_for, unpack_int4
from .checksum import crc32c
from .errors import KdtrError, about_file
from .hdf5_mapping import (BIT_PATTERNS, MARK_ALIGN, MARK_ATTR_TYPES, MARK_DTYPE, MARK_INDEX,
                           MARK_SHAPE, MARKERS, RESERVED_PREFIX, Unreadable, creation_ordered,
                           decode_name, describe_h5_dtype, hdf5_errors, little_endian, read_attrs,
                           scalar_str, unsupported_kind, write_attrs)
from .names import check_name
from .paths import output_directory
from .progress import Progress, ticker

__all__ = ["to_hdf5", "from_hdf5", "open_hdf5", "walk", "H5Node", "read_attrs", "write_attrs",
           "iter_blocks", "MARK_DTYPE", "MARK_SHAPE", "MARK_ATTR_TYPES", "MARK_INDEX", "MARK_ALIGN",
           "MARKERS", "RESERVED_PREFIX", "BIT_PATTERNS", "Unreadable", "describe_h5_dtype"]

BLOCK_BYTES = 64 << 20      # converters move at most this much per h5py call
SPILL_BYTES = 1 << 30       # larger HDF5 datasets are staged in a temporary file, not in RAM


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




def open_hdf5(path: str | os.PathLike) -> h5py.File:
    """Open an HDF5 file read-only, refusing what is not a regular file (K058) and turning
    "not HDF5" or a damaged superblock into K002."""
    path = os.fspath(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise KdtrError("K058", "a directory" if stat.S_ISDIR(st.st_mode) else
                        "a FIFO, device or socket", file=path)
    try:
        return h5py.File(path, "r", locking=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise KdtrError("K002", f"not a readable HDF5 file ({e})", file=path) from None



def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name




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
    with hdf5_errors("/"):
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
        with hdf5_errors(path):
            node = _visit(gid, raw, path, seen, strict)
        yield node
        if node.kind == "group" and node.obj is not None:   # listings descend despite bad names
            _push_members(node.obj.id, path, depth + 1, stack, strict)


def _push_members(gid, path: str, depth: int, stack: list, strict: bool) -> None:
    with hdf5_errors(path):
        order = h5.INDEX_CRT_ORDER if creation_ordered(gid, "links") else h5.INDEX_NAME
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
        check_name(decode_name(raw, path), path)
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
    why = unsupported_kind(dt)
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
    dtype, shape = _apply_dtype_markers(ds, little_endian(dt), stored, path)
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
    name = scalar_str(np.asarray(attrs[MARK_DTYPE]).item()) if np.ndim(attrs[MARK_DTYPE]) == 0 \
        else None
    if name not in BY_NAME:
        raise KdtrError("K027", f"{MARK_DTYPE} = {name!a} is not a KDTR dtype name", path)
    dt = BY_NAME[name]
    expected = BIT_PATTERNS.get(name, dt.storage)
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
    return raw.view(BIT_PATTERNS[name]) if name in BIT_PATTERNS and name != "int4" else raw


def _write_blocks(dst: h5py.Dataset, src: np.ndarray, tick: Callable[[int], None],
                  checksum: bool = True) -> int:
    """Copy ``src`` (C-contiguous) into ``dst`` block by block; returns the CRC32C of the bytes
    copied (the blocks tile ``src`` in C order, so their running checksum is the tensor's), or
    0 with ``checksum=False``."""
    if src.ndim == 0:
        dst[()] = src
        tick(src.nbytes)
        return crc32c(src.reshape(1).view(np.uint8)) if checksum else 0
    crc = 0
    max_elems = max(1, BLOCK_BYTES // max(1, src.itemsize))
    for sel in iter_blocks(src.shape, max_elems):
        block = src[sel]
        dst[sel] = block
        if checksum:   # the block is still in cache from the write
            crc = crc32c(block.reshape(-1).view(np.uint8), crc)
        tick(block.nbytes)
    return crc


def to_hdf5(kdtr_path: str | os.PathLike, h5_path: str | os.PathLike,
            progress: Progress | None = None, *, verify: bool = True) -> None:
    """Convert a KDTR file to HDF5 (see the module docstring), dataset by dataset.
    ``progress(done_bytes, total_bytes)`` is called as data is written.  The HDF5 file is
    written under a temporary name and renamed into place when complete.  ``verify``: each
    tensor's CRC32C is checked on the bytes copied; a mismatch raises ``KdtrError`` K056
    naming the file and the tensor, and leaves no output (nor temporary) file."""
    kdtr_path, h5_path = os.fspath(kdtr_path), os.fspath(h5_path)
    with kdtr.File(kdtr_path) as src, about_file(kdtr_path):
        order = _kdtr_node_order(src)
        needs_index = order != _preorder(src)
        align = _kdtr_align_log2(kdtr_path)
        nodes = [src[p] for p in order]
        total = sum(n.storage_nbytes for n in nodes if isinstance(n, kdtr.Dataset))
        tick = ticker(total, progress)

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
                    crc = _write_blocks(obj, _h5_stored(node), tick)
                    if verify and crc != node.checksum:
                        raise KdtrError("K056", f"stored 0x{node.checksum:08x}, computed "
                                                f"0x{crc:08x}; nothing was written",
                                        node.name, kdtr_path)
                write_attrs(obj, dict(node.attrs), node.name)
                if needs_index:
                    obj.attrs.create(MARK_INDEX, np.int64(i))
        if progress is not None and total == 0:
            progress(0, 0)


def _create_h5_dataset(parent, path: str, dt: DType, shape: tuple) -> h5py.Dataset:
    stored_shape = shape[:-1] + (shape[-1] // 2,) if dt.packed else shape
    ds = parent.create_dataset(path, shape=stored_shape,
                               dtype=BIT_PATTERNS.get(dt.name, dt.storage), track_order=True)
    if dt.name in BIT_PATTERNS:
        ds.attrs.create(MARK_DTYPE, dt.name, dtype=h5py.string_dtype())
    if dt.packed:
        ds.attrs.create(MARK_SHAPE, np.array(shape, dtype=np.int64))
    return ds


@contextlib.contextmanager
def _atomic_h5(path: str):
    directory = output_directory(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".h5.tmp",
                               dir=directory)
    os.close(fd)
    try:
        out = h5py.File(tmp, "w", track_order=True)
        try:
            yield out
        except BaseException:
            # Closing flushes what is cached; after a failed write (a full disk) that fails
            # too, and its error would hide the first one.  The file is removed below.
            with contextlib.suppress(Exception):
                out.close()
            raise
        out.close()
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
        _write_blocks(ds, stored, tick, checksum=False)

    def __enter__(self) -> "H5TreeWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


# ----------------------------------------------------------------------------- HDF5 -> KDTR

def read_dataset(node: H5Node, tick: Callable[[int], None] = lambda n: None,
                 spill_dir: str | None = None) -> np.ndarray:
    """The stored elements of a checked dataset node, little-endian, read block by block
    (datasets over ``SPILL_BYTES`` go to a temporary memory-mapped file in ``spill_dir``)."""
    ds, dt = node.obj, little_endian(node.stored_dtype)
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
    with hdf5_errors(node.path):
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
    if dt.name in BIT_PATTERNS:
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
    with open_hdf5(h5_path) as f, about_file(h5_path):
        nodes = _kdtr_order(list(walk(f, strict=True)))
        root_attrs = read_attrs(f["/"], "/")
        if align_log2 is None:
            align_log2 = _recorded_align(f)
        total = sum(n.nbytes for n in nodes if n.kind == "dataset")
        tick = ticker(total, progress)

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
    with hdf5_errors("/"):
        value = np.asarray(f.attrs[MARK_ALIGN])
    if value.ndim or value.dtype.kind not in "iu" or not (
            L.MIN_ALIGN_LOG2 <= int(value) <= L.MAX_ALIGN_LOG2):
        raise KdtrError("K011", f"{MARK_ALIGN} must be an integer in "
                                f"[{L.MIN_ALIGN_LOG2}, {L.MAX_ALIGN_LOG2}]", "/")
    return int(value)


def _set_attrs(obj, attrs: dict[str, Any], where: str) -> None:
    for name, value in attrs.items():
        obj.attrs[name] = value

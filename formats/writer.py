"""KDTR writer: stream datasets into a temporary file, then write the header and rename.

The layout is preamble | data | header (docs/FORMAT.md): putting the header last lets each
dataset go to disk when it is created, so a terabyte conversion holds one tensor at a time.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from . import layout as L
from .attributes import encode_attr
from .checksum import crc32c
from .dtypes import DType, pack_int4
from .layout import DatasetMeta

_CHUNK = 64 << 20


def _check_shape(dt: DType, shape: tuple[int, ...], where: str) -> int:
    if len(shape) > L.MAX_NDIM:
        raise ValueError(f"{where!r}: {len(shape)} dimensions (KDTR allows {L.MAX_NDIM})")
    count = nonzero = 1
    for d in shape:
        if not 0 <= d <= L.MAX_DIM:
            raise ValueError(f"{where!r}: dimension {d} outside [0, 2**48]")
        count *= d
        nonzero *= max(d, 1)
    if nonzero * dt.storage.itemsize > L.MAX_TENSOR_BYTES:  # the reader's K030
        raise ValueError(f"{where!r}: shape {shape} exceeds the tensor size limit "
                         "(zero dims count as 1)")
    if dt.packed and (not shape or shape[-1] % 2):
        raise ValueError(f"{where!r}: int4 needs a last dimension that fills whole bytes (even); "
                         f"got shape {shape}")
    if dt.nbytes(count) > L.MAX_TENSOR_BYTES:
        raise ValueError(f"{where!r}: {dt.nbytes(count)} bytes exceeds the tensor size limit")
    return count


def _stored_bytes(dt: DType, array: np.ndarray) -> np.ndarray:
    """``array`` as the little-endian element bytes KDTR stores (int4 packed)."""
    if dt.packed:
        if array.dtype.kind not in "iub":
            raise TypeError(f"int4 data must be integers, got {array.dtype}")
        return pack_int4(array)
    if array.dtype != dt.storage:
        if dt.name == "bool" and array.dtype.kind not in "b":
            raise TypeError(f"bool datasets take bool data, got {array.dtype}")
        array = array.astype(dt.storage)
    return array


def _write_chunks(file, array: np.ndarray) -> int:
    """Write ``array``'s bytes in C order, chunk by chunk; returns their CRC32C."""
    crc = 0
    out = file._out
    if array.ndim == 0 or array.flags.c_contiguous:
        flat = array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)
        for start in range(0, flat.size, _CHUNK):
            piece = flat[start:start + _CHUNK]
            out.write(memoryview(piece))
            crc = crc32c(piece, crc)
        return crc
    rows_per_chunk = max(1, _CHUNK // max(1, array[0].nbytes))
    for start in range(0, array.shape[0], rows_per_chunk):
        piece = np.ascontiguousarray(array[start:start + rows_per_chunk]).reshape(-1).view(np.uint8)
        out.write(memoryview(piece))
        crc = crc32c(piece, crc)
    return crc


def write_dataset(file, parent: int, name: str, dt: DType, shape, array, *,
                  packed: bool = False) -> int:
    """Stream one dataset; ``packed``: ``array`` is already int4's stored bytes (uint8
    ``[..., shape[-1] // 2]``), written as it is."""
    where = file._paths[parent].rstrip("/") + "/" + name
    shape = tuple(int(s) for s in shape)
    count = _check_shape(dt, shape, where)
    if packed:
        array = np.asarray(array)
        want = shape[:-1] + (shape[-1] // 2,)
        if not dt.packed or array.dtype != np.uint8 or array.shape != want:
            raise ValueError(f"{where!r}: packed int4 bytes must be uint8 of shape {want}, "
                             f"got {array.dtype} {array.shape}")
        stored = array
    else:
        stored = None if array is None else _stored_bytes(dt, array)
    index = file._add_node(parent, name, L.KIND_DATASET)
    offset = L.align_up(file._cursor, file._align_log2)
    file._out.write(b"\0" * (offset - file._cursor))
    size = dt.nbytes(count)
    if stored is None:
        stored = np.zeros(size, np.uint8) if size <= _CHUNK else None
        if stored is None:  # a huge zero dataset: stream zeros without allocating it
            crc, zeros = 0, np.zeros(_CHUNK, np.uint8)
            for start in range(0, size, _CHUNK):
                piece = zeros[:min(_CHUNK, size - start)]
                file._out.write(memoryview(piece))
                crc = crc32c(piece, crc)
    if stored is not None:
        crc = _write_chunks(file, stored)
    file._cursor = offset + size
    file._datasets[index] = DatasetMeta(dt, shape, offset, size, crc)
    return index


def _align8(x: int) -> int:
    return (x + 7) & ~7


def finish(file) -> None:
    """Write the header and the preamble, fsync, and rename the temporary file into place."""
    n = len(file._paths)
    nodes = np.zeros(n, L.NODE_DTYPE)
    strings: list[bytes] = []
    string_pos = 0
    attr_rows: list[tuple[int, bytes, int, bytes]] = []  # owner, name, kind, value
    for i in range(n):
        name = file._names[i].encode("utf-8")
        nodes[i]["parent"] = file._parents[i]
        nodes[i]["name_offset"], nodes[i]["name_len"] = string_pos, len(name)
        strings.append(name)
        string_pos += len(name)
        nodes[i]["attr_first"] = len(attr_rows)
        nodes[i]["attr_count"] = len(file._attrs[i])
        for key, value in file._attrs[i].items():
            kind, raw = encode_attr(value)
            attr_rows.append((i, key.encode("utf-8"), kind, raw))
        meta = file._datasets.get(i)
        if meta is None:
            nodes[i]["kind"] = L.KIND_GROUP
            continue
        nodes[i]["kind"] = L.KIND_DATASET
        nodes[i]["dtype"], nodes[i]["ndim"] = meta.dtype.code, len(meta.shape)
        nodes[i]["dims"][:len(meta.shape)] = meta.shape
        nodes[i]["data_offset"], nodes[i]["data_size"] = meta.offset, meta.size
        nodes[i]["data_crc"] = meta.crc
    if len(attr_rows) > L.MAX_ATTRS:
        raise ValueError(f"a KDTR file holds at most {L.MAX_ATTRS} attributes")
    attrs = np.zeros(len(attr_rows), L.ATTR_DTYPE)
    values = bytearray()
    for j, (owner, name, kind, raw) in enumerate(attr_rows):
        values.extend(b"\0" * (_align8(len(values)) - len(values)))
        attrs[j]["owner"], attrs[j]["kind"] = owner, kind
        attrs[j]["name_offset"], attrs[j]["name_len"] = string_pos, len(name)
        attrs[j]["value_offset"], attrs[j]["value_size"] = len(values), len(raw)
        strings.append(name)
        string_pos += len(name)
        values.extend(raw)
    values.extend(b"\0" * (_align8(len(values)) - len(values)))
    string_pool = b"".join(strings)
    header = nodes.tobytes() + attrs.tobytes() + bytes(values) + string_pool
    if len(header) > L.MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header)} bytes exceeds the {L.MAX_HEADER_BYTES}-byte limit")

    data_size = file._cursor
    header_offset = _align8(file._data_offset + data_size)
    out = file._out
    out.write(b"\0" * (header_offset - file._data_offset - data_size))
    out.write(header)

    pre = np.zeros(1, L.PREAMBLE_DTYPE)
    pre["magic"] = np.frombuffer(L.MAGIC, "V8")[0]
    pre["bom"], pre["major"], pre["minor"] = L.BOM, L.VERSION_MAJOR, L.VERSION_MINOR
    pre["align_log2"], pre["node_count"], pre["attr_count"] = file._align_log2, n, len(attr_rows)
    pre["data_offset"], pre["data_size"] = file._data_offset, data_size
    pre["header_offset"], pre["header_size"] = header_offset, len(header)
    pre["values_size"], pre["strings_size"] = len(values), len(string_pool)
    pre["header_crc"] = crc32c(header)
    raw = bytearray(pre.tobytes())
    struct.pack_into("<I", raw, L.PREAMBLE_SIZE - 4, crc32c(bytes(raw[:L.PREAMBLE_SIZE - 4])))
    out.seek(0)
    out.write(raw)
    out.flush()
    os.fsync(out.fileno())
    out.close()
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file._tmp_path, 0o666 & ~umask)  # mkstemp made it 0600; give it a normal file's mode
    if file._mode == "x":  # link(2) refuses an existing target: no race with another creator
        try:
            os.link(file._tmp_path, file._path)
        except FileExistsError:
            raise FileExistsError(f"{file._path!r} was created by someone else while writing") from None
        os.unlink(file._tmp_path)
    else:
        os.replace(file._tmp_path, file._path)
    try:  # make the rename itself durable
        dir_fd = os.open(os.path.dirname(os.path.abspath(file._path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass

"""Craft KDTR files that break exactly one rule of docs/FORMAT.md.

``decode(raw)`` splits a valid file into editable parts: the preamble record, the node and
attribute tables (NumPy record arrays of ``formats.layout``'s dtypes), the value and string pools
and the data section.  A test edits one field and calls ``encode()``, which lays the parts out
canonically again, recomputes the derived preamble fields and both checksums, and then applies
explicit preamble overrides.  So every rule that is not itself about a checksum or a derived
field is reached past the checks that come before it in the validation order.

The physical layout (where the data and the header lie) always follows the real parts and the
real ``align_log2``; overrides only change what the preamble *says*, so an override such as
``align_log2=40`` never makes the encoder write a terabyte of padding.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from formats import kdtr
from formats import layout as L
from formats.checksum import crc32c

__all__ = ["Crafted", "decode", "base_file", "base_bytes", "write_base", "pack_array_value",
           "pack_strlist_value", "refresh_crcs"]


@dataclass
class Crafted:
    pre: np.ndarray           # one PREAMBLE_DTYPE record (shape (1,))
    nodes: np.ndarray         # NODE_DTYPE records
    attrs: np.ndarray         # ATTR_DTYPE records
    values: bytearray         # the value pool
    strings: bytearray        # the string pool
    data: bytearray           # the data section (data_size bytes)
    trailing: bytes = field(default=b"")

    # ---- reading the parts
    def index_of(self, path: str) -> int:
        """Node index of an absolute path such as ``/g/w`` (``/`` is the root)."""
        for i in range(len(self.nodes)):
            if self.path_of(i) == path:
                return i
        raise KeyError(path)

    def node_name(self, i: int) -> bytes:
        o, n = int(self.nodes[i]["name_offset"]), int(self.nodes[i]["name_len"])
        return bytes(self.strings[o:o + n])

    def path_of(self, i: int) -> str:
        parts = []
        while i != 0:
            parts.append(self.node_name(i).decode("utf-8", "replace"))
            i = int(self.nodes[i]["parent"])
        return "/" + "/".join(reversed(parts))

    def attr_name(self, j: int) -> bytes:
        o, n = int(self.attrs[j]["name_offset"]), int(self.attrs[j]["name_len"])
        return bytes(self.strings[o:o + n])

    def attr_value(self, j: int) -> bytes:
        o, n = int(self.attrs[j]["value_offset"]), int(self.attrs[j]["value_size"])
        return bytes(self.values[o:o + n])

    def attr_index(self, path: str, name: str) -> int:
        """Attribute-table index of attribute ``name`` of the node at ``path``."""
        i = self.index_of(path)
        first, count = int(self.nodes[i]["attr_first"]), int(self.nodes[i]["attr_count"])
        for j in range(first, first + count):
            if self.attr_name(j) == name.encode():
                return j
        raise KeyError((path, name))

    def tensor(self, i: int) -> bytes:
        o, n = int(self.nodes[i]["data_offset"]), int(self.nodes[i]["data_size"])
        return bytes(self.data[o:o + n])

    # ---- canonical rewrites of one part
    def set_names(self, node_names=None, attr_names=None) -> None:
        """Rebuild the string pool from names (bytes) in table order; offsets and lengths follow."""
        nn = node_names if node_names is not None else [
            self.node_name(i) for i in range(len(self.nodes))]
        an = attr_names if attr_names is not None else [
            self.attr_name(j) for j in range(len(self.attrs))]
        pool, pos = bytearray(), 0
        for table, names in ((self.nodes, nn), (self.attrs, an)):
            for k, name in enumerate(names):
                table[k]["name_offset"], table[k]["name_len"] = pos, len(name)
                pool += name
                pos += len(name)
        self.strings = pool

    def rename_node(self, i: int, name: bytes) -> None:
        names = [self.node_name(k) for k in range(len(self.nodes))]
        names[i] = name
        self.set_names(node_names=names)

    def rename_attr(self, j: int, name: bytes) -> None:
        names = [self.attr_name(k) for k in range(len(self.attrs))]
        names[j] = name
        self.set_names(attr_names=names)

    def set_values(self, values: list[bytes]) -> None:
        """Rebuild the value pool canonically (8-byte steps, zero padding) from raw values."""
        pool = bytearray()
        for j, v in enumerate(values):
            pool += b"\0" * (-len(pool) % 8)
            self.attrs[j]["value_offset"], self.attrs[j]["value_size"] = len(pool), len(v)
            pool += v
        pool += b"\0" * (-len(pool) % 8)
        self.values = pool

    def set_attr_value(self, j: int, raw: bytes, kind: int | None = None) -> None:
        values = [self.attr_value(k) for k in range(len(self.attrs))]
        values[j] = raw
        if kind is not None:
            self.attrs[j]["kind"] = kind
        self.set_values(values)

    def set_tensor(self, i: int, raw: bytes, fix_crc: bool = True) -> None:
        """Overwrite node ``i``'s tensor bytes in place (same size); its data_crc follows."""
        o, n = int(self.nodes[i]["data_offset"]), int(self.nodes[i]["data_size"])
        assert len(raw) == n, (len(raw), n)
        self.data[o:o + n] = raw
        if fix_crc:
            self.nodes[i]["data_crc"] = crc32c(bytes(raw))

    def append_group(self, parent: int, name: bytes) -> int:
        """Append a group node (no attributes) at the end of the node table."""
        names = [self.node_name(k) for k in range(len(self.nodes))] + [name]
        row = np.zeros(1, L.NODE_DTYPE)
        row["parent"] = parent
        row["kind"] = L.KIND_GROUP
        row["attr_first"] = len(self.attrs)
        self.nodes = np.concatenate([self.nodes, row])
        self.set_names(node_names=names)
        return len(self.nodes) - 1

    # ---- writing
    @property
    def align_log2(self) -> int:
        return int(self.pre[0]["align_log2"])

    def header(self) -> bytes:
        return (self.nodes.tobytes() + self.attrs.tobytes() + bytes(self.values)
                + bytes(self.strings))

    def encode(self, *, sync: bool = True, fix_crc: bool = True, **overrides) -> bytes:
        """The file's bytes.  ``sync``: set counts, sizes and offsets from the parts.
        ``fix_crc``: recompute header_crc and preamble_crc (after the overrides, unless they name
        one).  ``overrides``: preamble fields set last, e.g. ``major=2``."""
        pre = self.pre.copy()
        header = self.header()
        doff = L.align_up(L.PREAMBLE_SIZE, self.align_log2)
        hoff = L.align_up(doff + len(self.data), 3)
        if sync:
            pre["node_count"], pre["attr_count"] = len(self.nodes), len(self.attrs)
            pre["data_offset"], pre["data_size"] = doff, len(self.data)
            pre["header_offset"], pre["header_size"] = hoff, len(header)
            pre["values_size"], pre["strings_size"] = len(self.values), len(self.strings)
        if fix_crc:
            pre["header_crc"] = crc32c(header)
        for name, value in overrides.items():
            if name == "reserved1":
                value = np.frombuffer(bytes(value), "V24")[0]
            pre[name] = value
        raw = bytearray(pre.tobytes())
        if fix_crc and "preamble_crc" not in overrides:
            crc = crc32c(bytes(raw[:L.PREAMBLE_SIZE - 4]))
            struct.pack_into("<I", raw, L.PREAMBLE_SIZE - 4, crc)
        out = raw + b"\0" * (doff - L.PREAMBLE_SIZE) + self.data
        out += b"\0" * (hoff - len(out))
        return bytes(out + header + self.trailing)


def decode(raw: bytes) -> Crafted:
    """Split the bytes of a valid KDTR file into editable parts (copies)."""
    pre = np.frombuffer(raw, L.PREAMBLE_DTYPE, 1).copy()
    p = pre[0]
    n, m = int(p["node_count"]), int(p["attr_count"])
    hoff, doff = int(p["header_offset"]), int(p["data_offset"])
    nodes = np.frombuffer(raw, L.NODE_DTYPE, n, hoff).copy()
    attrs = np.frombuffer(raw, L.ATTR_DTYPE, m, hoff + n * L.NODE_SIZE).copy()
    vstart = hoff + n * L.NODE_SIZE + m * L.ATTR_SIZE
    vsize, ssize = int(p["values_size"]), int(p["strings_size"])
    return Crafted(pre=pre, nodes=nodes, attrs=attrs,
                   values=bytearray(raw[vstart:vstart + vsize]),
                   strings=bytearray(raw[vstart + vsize:vstart + vsize + ssize]),
                   data=bytearray(raw[doff:doff + int(p["data_size"])]))


def pack_array_value(code: int, shape, payload: bytes, reserved: bytes = b"\0" * 6) -> bytes:
    """An array attribute value: dtype code, ndim, 6 reserved bytes, dims, element bytes."""
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    return struct.pack("<BB", code, len(shape)) + reserved + dims + payload


def pack_strlist_value(strings: list[bytes], count: int | None = None, lengths=None) -> bytes:
    count = len(strings) if count is None else count
    lengths = [len(s) for s in strings] if lengths is None else lengths
    return struct.pack(f"<I{len(lengths)}I", count, *lengths) + b"".join(strings)


# ----------------------------------------------------------------------------- the base file

BASE_ALIGN_LOG2 = 8  # 256: a gap after the preamble (K020) and between tensors (K057)


def write_base(path, align_log2: int = BASE_ALIGN_LOG2) -> None:
    """A small valid file touching every structure a rule talks about:

    /            attrs title (str), n (int)
    /g           attrs flag (bool), arr (int32 array), names (str list), x (float),
                 mask (bool array)
    /g/w         float32 (2, 3), attr unit (str)
    /g/b         bool (3,)  -- 3 bytes, so padding follows it
    /g/q         int4 (2, 4)
    /s           float64 scalar
    /e           float32 (0,)
    /h           group
    /h/z         uint8 (5,)  -- ends off the 8-byte grid, so padding precedes the header
    """
    with kdtr.File(path, "w", align_log2=align_log2) as f:
        f.attrs["title"] = "kdtr"
        f.attrs["n"] = 5
        g = f.create_group("g")
        g.attrs["flag"] = True
        g.attrs["arr"] = np.array([1, 2, 3], np.int32)
        g.attrs["names"] = ["a", "bc"]
        g.attrs["x"] = 1.5
        g.attrs["mask"] = np.array([True, False])
        w = g.create_dataset("w", data=np.arange(6, dtype=np.float32).reshape(2, 3))
        w.attrs["unit"] = "m"
        g["b"] = np.array([True, False, True])
        g.create_dataset("q", data=np.array([[-8, 7, 0, 1], [2, -3, 4, -5]], np.int8), dtype="int4")
        f["s"] = np.float64(2.5)
        f["e"] = np.zeros(0, np.float32)
        f.create_group("h")
        f["h/z"] = np.arange(5, dtype=np.uint8)


_BASE_CACHE: dict[int, bytes] = {}


def base_bytes(tmp_dir, align_log2: int = BASE_ALIGN_LOG2) -> bytes:
    """The bytes of ``write_base`` (written once per alignment and process)."""
    if align_log2 not in _BASE_CACHE:
        import os
        path = os.path.join(tmp_dir, f"base{align_log2}.kdtr")
        write_base(path, align_log2)
        with open(path, "rb") as fh:
            _BASE_CACHE[align_log2] = fh.read()
    return _BASE_CACHE[align_log2]


def base_file(tmp_dir, align_log2: int = BASE_ALIGN_LOG2) -> Crafted:
    return decode(base_bytes(tmp_dir, align_log2))


def refresh_crcs(raw: bytes) -> bytes:
    """``raw`` with header_crc and preamble_crc recomputed from whatever the (possibly damaged)
    preamble says, so a mutation is judged by the rules behind the checksums."""
    if len(raw) < L.PREAMBLE_SIZE:
        return raw
    b = bytearray(raw)
    hoff, hsize = struct.unpack_from("<QQ", b, 64)
    if hoff + hsize <= len(b):
        struct.pack_into("<I", b, 96, crc32c(bytes(b[hoff:hoff + hsize])))
    struct.pack_into("<I", b, L.PREAMBLE_SIZE - 4, crc32c(bytes(b[:L.PREAMBLE_SIZE - 4])))
    return bytes(b)

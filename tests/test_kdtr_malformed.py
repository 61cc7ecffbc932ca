"""One crafted malformed file (or more) per KDTR rejection rule, K001..K058.

Each file breaks exactly one rule: ``kdtr_craft`` re-encodes the edited tables with correct
counts, offsets and checksums, so the rule under test (not a checksum rule) is the first one the
reader meets in the validation order of docs/FORMAT.md.  Each case asserts ``KdtrError`` with
exactly its code and, where the rule is about a node, that the message names that node.
Every case opens under tracemalloc: no file, however large its counts, may drive an allocation
over 50 MB.
"""
from __future__ import annotations

import copy
import os
import struct
import threading
import time
import tracemalloc
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import kdtr_craft as K
from formats import kdtr
from formats import layout as L
from formats.kdtr import KdtrError

PEAK_LIMIT = 50 << 20


@dataclass(frozen=True)
class Case:
    code: str
    variant: str
    build: Callable  # (Crafted of the base file, tmp_path) -> bytes or a Path
    node: str | None = None  # text the message must contain (the node it names)
    stage: str = "open"  # "open" or "verify"

    @property
    def id(self) -> str:
        return f"{self.code}-{self.variant}"


CASES: list[Case] = []


def case(code: str, variant: str, node: str | None = None, stage: str = "open"):
    def register(fn):
        CASES.append(Case(code, variant, fn, node, stage))
        return fn
    return register


def edit(c: K.Crafted, **overrides) -> bytes:
    return c.encode(**overrides)


def node_field(path: str, field: str, value, index: int | None = None):
    """A builder that sets one node field (``dims`` element ``index``) and re-encodes."""
    def build(c, tmp):
        i = c.index_of(path)
        if index is None:
            c.nodes[i][field] = value
        else:
            c.nodes[i][field][index] = value
        return c.encode()
    return build


def attr_field(path: str, name: str, field: str, value):
    def build(c, tmp):
        c.attrs[c.attr_index(path, name)][field] = value
        return c.encode()
    return build


def attr_value(path: str, name: str, raw: bytes, kind: int | None = None):
    def build(c, tmp):
        c.set_attr_value(c.attr_index(path, name), raw, kind)
        return c.encode()
    return build


def rename(path: str, name: bytes):
    def build(c, tmp):
        c.rename_node(c.index_of(path), name)
        return c.encode()
    return build


def rename_attr(path: str, attr: str, name: bytes):
    def build(c, tmp):
        c.rename_attr(c.attr_index(path, attr), name)
        return c.encode()
    return build


def whole(transform):
    """A builder that transforms the bytes of the valid base file."""
    return lambda c, tmp: transform(c.encode())


def register_all(code, variants, node=None, stage="open"):
    for variant, build in variants.items():
        CASES.append(Case(code, variant, build, node, stage))


# ----------------------------------------------------------------------------- K058, K001-K004

register_all("K058", {
    "directory": lambda c, tmp: tmp,
    "char-device": lambda c, tmp: Path(os.devnull),
})
register_all("K001", {
    "empty": lambda c, tmp: b"",
    "one-byte": lambda c, tmp: b"\x89",
    "127-bytes-of-a-valid-file": whole(lambda raw: raw[:127]),
    "gguf-stub": lambda c, tmp: b"GGUF\x03\x00\x00\x00",
})
register_all("K003", {  # text-mode damage applied to the whole valid file
    "high-bit-stripped": whole(lambda raw: bytes(b & 0x7F for b in raw)),
    "crlf-to-lf": whole(lambda raw: raw.replace(b"\r\n", b"\n")),
    "lf-to-crlf": whole(lambda raw: raw.replace(b"\n", b"\r\n")),
    "cr-to-lf": whole(lambda raw: raw.replace(b"\r", b"\n")),
    "latin1-reencoded-as-utf8": whole(lambda raw: raw.decode("latin-1").encode("utf-8")),
    "utf8-replacement-char": whole(lambda raw: raw.decode("utf-8", "replace").encode("utf-8")),
})


def _hdf5(c, tmp):
    import h5py
    p = tmp / "model.h5"
    with h5py.File(p, "w") as f:
        f["w"] = np.arange(64, dtype=np.float32)
    return p


def _safetensors(c, tmp):
    from safetensors.numpy import save_file
    p = tmp / "model.safetensors"
    save_file({"w": np.arange(64, dtype=np.float32)}, str(p))
    return p


def _gguf(c, tmp):  # magic, version 3, tensor count, kv count, one string kv
    key, val = b"general.architecture", b"deepseek2"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(val)) + val
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv + b"\0" * 128


def _zip(c, tmp):  # what torch.save writes
    p = tmp / "model.pt"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("archive/data.pkl", b"\0" * 200)
    return p


def _npy(c, tmp):
    p = tmp / "w.npy"
    np.save(p, np.arange(64, dtype=np.float32), allow_pickle=False)
    return p


def _pickle(protocol: int):
    # A hand-made pickle of one str: PROTO n, BINUNICODE len data, STOP (no pickle module).
    text = b"x" * 200
    stream = b"\x80" + bytes([protocol]) + b"X" + struct.pack("<I", len(text)) + text + b"."
    return lambda c, tmp: stream


register_all("K004", {
    "hdf5": _hdf5, "safetensors": _safetensors, "gguf": _gguf, "zip-torch": _zip, "npy": _npy,
    "pickle-protocol-2": _pickle(2), "pickle-protocol-3": _pickle(3),
    "pickle-protocol-4": _pickle(4), "pickle-protocol-5": _pickle(5),
})
register_all("K002", {
    "zeros": lambda c, tmp: b"\0" * 256,
    "text": lambda c, tmp: b"hello, world\n" * 20,
    "random": lambda c, tmp: np.random.default_rng(7).bytes(300),
    "png": lambda c, tmp: b"\x89PNG\r\n\x1a\n" + b"\0" * 200,
    "one-letter-off": whole(lambda raw: raw[:4] + b"X" + raw[5:]),
})

# ----------------------------------------------------------------------------- preamble

register_all("K005", {
    "bom-swapped": lambda c, tmp: edit(c, bom=0x0D0C0B0A),
    # a big-endian writer: every numeric field byte-swapped (the magic is raw bytes)
    "whole-preamble-big-endian": lambda c, tmp: (
        c.pre.astype(L.PREAMBLE_DTYPE.newbyteorder(">")).tobytes() + c.encode()[128:]),
})
register_all("K006", {
    "bom-zero": lambda c, tmp: edit(c, bom=0),
    "bom-off-by-one": lambda c, tmp: edit(c, bom=L.BOM + 1),
})
register_all("K007", {
    "major-2": lambda c, tmp: edit(c, major=2),
    "major-0": lambda c, tmp: edit(c, major=0),
    # checked before the checksum: a future major version may lay the preamble out differently
    "major-2-bad-crc": lambda c, tmp: edit(c, major=2, fix_crc=False),
})
register_all("K010", {
    "reserved-byte-unfixed": lambda c, tmp: edit(c, reserved0=1, fix_crc=False),
    "align-unfixed": lambda c, tmp: edit(c, align_log2=2, fix_crc=False),
    "crc-field": lambda c, tmp: edit(c, preamble_crc=0),
    "crc-off-by-one-bit": whole(lambda raw: raw[:124] + bytes([raw[124] ^ 1]) + raw[125:]),
})
register_all("K009", {
    "reserved0": lambda c, tmp: edit(c, reserved0=1),
    "reserved1-last-byte": lambda c, tmp: edit(c, reserved1=b"\0" * 23 + b"\x01"),
})
register_all("K008", {
    "bit0": lambda c, tmp: edit(c, features_required=1),
    "bit63": lambda c, tmp: edit(c, features_required=1 << 63),
})
register_all("K011", {
    "align-2": lambda c, tmp: edit(c, align_log2=2),
    "align-17": lambda c, tmp: edit(c, align_log2=17),
    "align-max-u32": lambda c, tmp: edit(c, align_log2=0xFFFFFFFF),
})
register_all("K012", {
    "no-nodes": lambda c, tmp: edit(c, node_count=0),
    "nodes-over-limit": lambda c, tmp: edit(c, node_count=L.MAX_NODES + 1),
    "nodes-max-u32": lambda c, tmp: edit(c, node_count=0xFFFFFFFF),
    "attrs-over-limit": lambda c, tmp: edit(c, attr_count=L.MAX_ATTRS + 1),
    "attrs-max-u32": lambda c, tmp: edit(c, attr_count=0xFFFFFFFF),
})
register_all("K013", {
    "one-over": lambda c, tmp: edit(c, header_size=L.MAX_HEADER_BYTES + 1),
    "max-u64": lambda c, tmp: edit(c, header_size=2**64 - 1),
})
register_all("K014", {
    "header-size-plus-8": lambda c, tmp: edit(c, header_size=len(c.header()) + 8),
    "values-not-multiple-of-8": lambda c, tmp: edit(
        c, values_size=len(c.values) - 4, strings_size=len(c.strings) + 4),
    "max-counts-tiny-header": lambda c, tmp: edit(c, node_count=L.MAX_NODES,
                                                   attr_count=L.MAX_ATTRS),
    "strings-size-huge": lambda c, tmp: edit(c, strings_size=2**64 - 1),
})
def _data_offset(c: K.Crafted) -> int:
    doff = int(c.pre[0]["data_offset"])
    assert doff > L.PREAMBLE_SIZE  # the base file has padding before its data
    return doff


def _header_offset(c: K.Crafted) -> int:
    hoff = int(c.pre[0]["header_offset"])
    assert hoff > _data_offset(c) + len(c.data)  # ... and between its data and its header
    return hoff


register_all("K015", {
    "zero": lambda c, tmp: edit(c, data_offset=0),
    "plus-8": lambda c, tmp: edit(c, data_offset=256 + 8),
    "near-2-64": lambda c, tmp: edit(c, data_offset=2**64 - 256),
})
register_all("K016", {
    "plus-8": lambda c, tmp: edit(c, header_offset=_header_offset(c) + 8),
    "zero": lambda c, tmp: edit(c, header_offset=0),
    "data-size-max-u64": lambda c, tmp: edit(c, data_size=2**64 - 1),
})


def _huge_consistent_header(c, tmp):
    # Counts at their limits and a header_size that adds up (256,000,000 bytes): only the file
    # length gives it away, and nothing may be allocated from these counts before that.
    return edit(c, node_count=L.MAX_NODES, attr_count=L.MAX_ATTRS,
                header_size=L.MAX_NODES * 128 + L.MAX_ATTRS * 32, values_size=0, strings_size=0)


register_all("K017", {
    "minus-1-byte": whole(lambda raw: raw[:-1]),
    "preamble-only": whole(lambda raw: raw[:128]),
    "half": whole(lambda raw: raw[:len(raw) // 2]),
    "huge-counts-consistent": _huge_consistent_header,
})
register_all("K018", {
    "one-byte": whole(lambda raw: raw + b"\0"),
    "polyglot-second-file": whole(lambda raw: raw + raw),
})


def _flip(raw: bytes, pos: int) -> bytes:
    return raw[:pos] + bytes([raw[pos] ^ 0x01]) + raw[pos + 1:]


register_all("K019", {
    "header-byte-flipped": whole(lambda raw: _flip(raw, len(raw) - 1)),
    "node-table-byte-flipped": lambda c, tmp: _flip(c.encode(), _header_offset(c) + 200),
    "crc-field": lambda c, tmp: edit(c, header_crc=0),
})
register_all("K020", {
    "between-preamble-and-data": lambda c, tmp: _flip(c.encode(), _data_offset(c) - 1),
    "between-data-and-header": lambda c, tmp: _flip(c.encode(), _header_offset(c) - 1),
})

# ----------------------------------------------------------------------------- node table

register_all("K021", {
    "root-parent-0": node_field("/", "parent", 0),
    "root-is-dataset": node_field("/", "kind", L.KIND_DATASET),
    "root-has-name-len": node_field("/", "name_len", 1),
}, node="/")
register_all("K024", {"kind-2": node_field("/h", "kind", 2)}, node="node #7")
register_all("K024", {"kind-255": node_field("/g/w", "kind", 255)}, node="node #2")
register_all("K022", {
    "parent-self": node_field("/g/w", "parent", 2),
    "parent-later": node_field("/g/w", "parent", 8),
    "second-root": node_field("/g/w", "parent", L.NO_PARENT),
    "parent-max-minus-1": node_field("/g/w", "parent", 0xFFFFFFFE),
}, node="node #2")


@case("K022", "cycle-attempt", node="node #1")
def _cycle(c, tmp):
    c.nodes[1]["parent"], c.nodes[2]["parent"] = 2, 1  # /g under /g/w under /g
    return c.encode()


register_all("K023", {"parent-is-dataset": node_field("/g/b", "parent", 2)}, node="node #3")
register_all("K025", {
    f"reserved{k}": node_field("/g/w", f"reserved{k}", 1) for k in range(3)
} | {"reserved3": node_field("/g/w", "reserved3", 1, index=1)}, node="node #2")
register_all("K026", {
    "dtype": node_field("/h", "dtype", 12),
    "ndim": node_field("/h", "ndim", 1),
    "dims": node_field("/h", "dims", 1, index=7),
    "data-offset": node_field("/h", "data_offset", 256),
    "data-size": node_field("/h", "data_size", 8),
    "data-crc": node_field("/h", "data_crc", 1),
}, node="node #7")
register_all("K026", {"root-dtype": node_field("/", "dtype", 1)}, node="node #0")
register_all("K027", {
    "code-0": node_field("/g/w", "dtype", 0),
    "code-19": node_field("/g/w", "dtype", 19),
    "code-255": node_field("/g/w", "dtype", 255),
}, node="node #2")
register_all("K028", {
    "ndim-9": node_field("/g/w", "ndim", 9),
    "ndim-255": node_field("/g/w", "ndim", 255),
}, node="node #2")
register_all("K029", {
    "dim-2-48-plus-1": node_field("/g/w", "dims", 2**48 + 1, index=0),
    "dim-max-u64": node_field("/g/w", "dims", 2**64 - 1, index=1),
    "slot-past-ndim": node_field("/g/w", "dims", 1, index=5),
}, node="node #2")


def _shape(path: str, dims, dtype: int | None = None, data_size: int | None = None):
    def build(c, tmp):
        i = c.index_of(path)
        c.nodes[i]["ndim"] = len(dims)
        c.nodes[i]["dims"] = list(dims) + [0] * (8 - len(dims))
        if dtype is not None:
            c.nodes[i]["dtype"] = dtype
        if data_size is not None:
            c.nodes[i]["data_size"] = data_size
        return c.encode()
    return build


register_all("K030", {  # size arithmetic overflow: each dim within 2^48, the product far beyond
    "8-dims-of-2-48-float32": _shape("/g/w", [2**48] * 8),
    "8-dims-of-2-48-minus-1": _shape("/g/w", [2**48 - 1] * 8),
    "complex128-2-48-squared": _shape("/g/w", [2**48, 2**48], dtype=18),
    "2-62-bytes-plus-2-32": _shape("/g/w", [2**30, 2**30 + 1]),  # float32
}, node="node #2")
register_all("K030", {"int4-8-dims": _shape("/g/q", [2**48] * 8)}, node="node #4")
# NumPy cannot describe this empty shape either (its non-zero dims alone overflow int64), so
# reading it can only fail; it must be rejected when the file is opened.
register_all("K030", {"empty-with-huge-dims": _shape("/e", [0, 2**48, 2**48, 2**48])},
             node="node #6")
register_all("K032", {
    "int4-odd-last-dim": _shape("/g/q", [2, 3]),
    "int4-scalar": _shape("/g/q", []),
}, node="node #4")
register_all("K031", {
    "size-plus-1": node_field("/g/w", "data_size", 25),
    "size-zero": node_field("/g/w", "data_size", 0),
    "size-max-u64": node_field("/g/w", "data_size", 2**64 - 1),
    "shape-grown": _shape("/g/w", [3, 3]),
    # exactly 2^62 bytes is within K030's limit, so the size mismatch is what fails
    "exactly-2-62-bytes": _shape("/g/w", [2**30, 2**30]),
}, node="node #2")
register_all("K031", {"int4-unpacked-size": node_field("/g/q", "data_size", 8)}, node="node #4")
register_all("K031", {"scalar-size-16": node_field("/s", "data_size", 16)}, node="node #5")
register_all("K033", {
    "plus-8": node_field("/g/b", "data_offset", 256 + 8),
    "odd": node_field("/g/b", "data_offset", 257),
}, node="node #3")
register_all("K034", {
    # offset + size wraps 2^64: a naive "offset + size <= data_size" in uint64 would pass
    "offset-wraps-2-64": node_field("/h/z", "data_offset", 2**64 - 256),
    "offset-past-end": node_field("/h/z", "data_offset", 1280),
    "size-past-end": _shape("/h/z", [6], data_size=6),
    "size-far-past-end": _shape("/h/z", [5000], data_size=5000),
}, node="node #8")
register_all("K035", {
    "overlaps-previous": node_field("/g/b", "data_offset", 0),
}, node="node #3")


@case("K036", "hole-before-last", node="node #8")
def _hole(c, tmp):
    i = c.index_of("/h/z")
    off = int(c.nodes[i]["data_offset"])
    c.data[off:off] = b"\0" * 256
    c.nodes[i]["data_offset"] = off + 256
    return c.encode()


@case("K037", "bytes-after-last-tensor")
def _data_too_long(c, tmp):
    c.data += b"\0" * 8
    return c.encode()


def _groups_only(tmp) -> K.Crafted:
    p = tmp / "groups.kdtr"
    with kdtr.File(p, "w", align_log2=3) as f:
        f.create_group("a/b")
    return K.decode(p.read_bytes())


@case("K037", "data-without-datasets")
def _data_without_datasets(c, tmp):
    g = _groups_only(tmp)
    g.data += b"\0" * 8
    return g.encode()


# ----------------------------------------------------------------------------- names and strings

@case("K038", "name-offset-shifted", node="node #2")
def _name_shift(c, tmp):
    c.nodes[2]["name_offset"] += 1
    return c.encode()


@case("K038", "root-name-offset", node="node #0")
def _root_offset(c, tmp):
    c.nodes[0]["name_offset"] = 1
    return c.encode()


@case("K038", "attr-name-offset", node="attribute #1")
def _attr_name_shift(c, tmp):
    c.attrs[1]["name_offset"] += 1
    return c.encode()


@case("K038", "pool-longer-than-names")
def _pool_long(c, tmp):
    c.strings += b"x"
    return c.encode()


register_all("K039", {
    "0xff": rename("/g/w", b"\xff"),
    "overlong-slash": rename("/g/w", b"a\xc0\xaf"),
    "surrogate": rename("/g/w", b"\xed\xa0\x80"),
    "truncated-sequence": rename("/g/w", b"w\xe2\x82"),
}, node="/g/")
register_all("K039", {"attribute-name": rename_attr("/g/w", "unit", b"\xfe")}, node="/g/w")
register_all("K040", {
    "dot": rename("/g/w", b"."),
    "dotdot": rename("/g/w", b".."),
    "slash": rename("/g/w", b"a/b"),
    "nul": rename("/g/w", b"a\0b"),
    "newline": rename("/g/w", b"x\n"),
    "del": rename("/g/w", b"\x7f"),
    "c1-nel": rename("/g/w", "\u0085".encode()),
    "escape-sequence": rename("/g/w", b"\x1b[2J"),
    "empty": rename("/g/w", b""),
}, node="/g/")
register_all("K040", {
    "attribute-dotdot": rename_attr("/g", "flag", b".."),
    "attribute-empty": rename_attr("/g", "flag", b""),
    "attribute-control": rename_attr("/g", "flag", b"a\tb"),
}, node="/g (attribute ")
register_all("K041", {
    "256-bytes": rename("/g/w", b"x" * 256),
    "86-euro-signs": rename("/g/w", "\u20ac".encode() * 86),  # 86 characters, 258 bytes
}, node="/g/")
register_all("K041", {"attribute-256-bytes": rename_attr("/", "n", b"n" * 256)},
             node="/ (attribute 'nnn")


def _chain(tmp, names: list[str], extra: bytes) -> bytes:
    """A valid file with a chain of groups, plus one more crafted group below its end."""
    p = tmp / "chain.kdtr"
    with kdtr.File(p, "w", align_log2=3) as f:
        f.create_group("/".join(names))
    c = K.decode(p.read_bytes())
    c.append_group(len(c.nodes) - 1, extra)
    return c.encode()


register_all("K042", {"depth-65": lambda c, tmp: _chain(tmp, ["d"] * 64, b"d")}, node="/d/d/d")
register_all("K042", {"path-4098-bytes": lambda c, tmp: _chain(tmp, ["p" * 255] * 16, b"xy")},
             node="/ppp")
register_all("K043", {"sibling-dataset": rename("/g/b", b"w")}, node="/g/w")
register_all("K043", {"top-level": rename("/h", b"s")}, node="/s")

# ----------------------------------------------------------------------------- attribute table

register_all("K044", {
    "first-shifted": node_field("/g", "attr_first", 3),
    "count-short": node_field("/", "attr_count", 1),
}, node="node #1")
register_all("K044", {
    "count-past-table": node_field("/h/z", "attr_count", 1),
    "count-max-u32": node_field("/h/z", "attr_count", 0xFFFFFFFF),
})
register_all("K045", {"owner": attr_field("/", "n", "owner", 1)}, node="node #0")
register_all("K046", {
    "kind-0": attr_field("/g", "x", "kind", 0),
    "kind-7": attr_field("/g", "x", "kind", 7),
    "kind-255": attr_field("/g", "x", "kind", 255),
}, node="node #1")
register_all("K047", {
    "reserved0": attr_field("/g", "x", "reserved0", 1),
    "reserved1": attr_field("/g", "x", "reserved1", 1 << 63),
}, node="node #1")
register_all("K049", {
    "65537": attr_field("/g", "names", "value_size", 65537),
    "max-u32": attr_field("/g", "names", "value_size", 0xFFFFFFFF),
}, node="node #1")


@case("K048", "offset-plus-8", node="node #1")
def _value_shift(c, tmp):
    c.attrs[c.attr_index("/g", "x")]["value_offset"] += 8
    return c.encode()


@case("K048", "pool-longer-than-values")
def _pool_extra(c, tmp):
    c.values += b"\0" * 8
    return c.encode()


@case("K048", "padding-not-zero")
def _pool_padding(c, tmp):
    assert c.attr_value(0) == b"kdtr" and int(c.attrs[1]["value_offset"]) == 8
    c.values[5] = 1
    return c.encode()


@case("K048", "values-without-attributes")
def _values_without_attrs(c, tmp):
    g = _groups_only(tmp)
    g.values += b"\0" * 8
    return g.encode()


def register_values(code: str, variants: dict) -> None:
    """Cases that replace one attribute value: ``{variant: (node path, attribute, raw value)}``.
    The message must name the node and the attribute."""
    for variant, (path, name, raw) in variants.items():
        CASES.append(Case(code, variant, attr_value(path, name, raw),
                          node=f"{path} (attribute '{name}')"))


register_values("K050", {
    "int-4-bytes": ("/", "n", b"\0" * 4),
    "float-9-bytes": ("/g", "x", b"\0" * 9),
    "bool-2-bytes": ("/g", "flag", b"\x01\x00"),
    "bool-empty": ("/g", "flag", b""),
    "array-shorter-than-head": ("/g", "arr", b"\x06\x01\0\0\0"),
    "array-dims-past-value": ("/g", "arr", K.pack_array_value(6, [3, 1], b"")[:16]),
    "array-payload-short": ("/g", "arr", K.pack_array_value(6, [4], b"\0" * 12)),
    "array-payload-long": ("/g", "arr", K.pack_array_value(6, [2], b"\0" * 12)),
    "strlist-3-bytes": ("/g", "names", b"\0\0\0"),
})
register_values("K051", {
    "bool-attr-2": ("/g", "flag", b"\x02"),
    "bool-attr-ff": ("/g", "flag", b"\xff"),
    "bool-array-attr": ("/g", "mask", K.pack_array_value(1, [2], b"\x01\x02")),
})


@case("K051", "bool-tensor", node="/g/b", stage="verify")
def _bool_tensor(c, tmp):
    c.set_tensor(c.index_of("/g/b"), b"\x01\x00\x02")
    return c.encode()


register_values("K052", {
    "count-max-u32": ("/g", "names", struct.pack("<II", 0xFFFFFFFF, 1) + b"a"),
    "lengths-exceed": ("/g", "names", K.pack_strlist_value([b"abc"], 2, [1, 5])),
    "lengths-short": ("/g", "names", K.pack_strlist_value([b"abc"], 2, [1, 1])),
})
register_values("K053", {
    "dtype-0": ("/g", "arr", K.pack_array_value(0, [3], b"\0" * 12)),
    "dtype-int4": ("/g", "arr", K.pack_array_value(16, [4], b"\0" * 2)),
    "dtype-99": ("/g", "arr", K.pack_array_value(99, [3], b"\0" * 12)),
    "ndim-9": ("/g", "arr", K.pack_array_value(6, [1] * 9, b"\0" * 4)),
    "dim-over-2-48": ("/g", "arr", K.pack_array_value(6, [2**48 + 1], b"")),
    "reserved-byte": ("/g", "arr", K.pack_array_value(6, [3], b"\0" * 12,
                                                      reserved=b"\0" * 5 + b"\x01")),
    # each dim within 2^48 and zero elements, yet NumPy cannot describe the shape
    "empty-with-huge-dims": ("/g", "arr", K.pack_array_value(6, [0] + [2**48] * 3, b"")),
})
register_all("K054", {"duplicate": rename_attr("/g", "x", b"flag")}, node="/g")
register_values("K055", {
    "str": ("/", "title", b"k\xffdtr"),
    "str-surrogate": ("/", "title", b"\xed\xb2\x80"),
    "strlist-item": ("/g", "names", K.pack_strlist_value([b"a", b"\xc3("])),
})

# ----------------------------------------------------------------------------- verify()


@case("K056", "tensor-byte-flipped", node="/g/w", stage="verify")
def _tensor_flip(c, tmp):
    c.data[5] ^= 0x40
    return c.encode()


@case("K056", "crc-field", node="/h/z", stage="verify")
def _tensor_crc(c, tmp):
    c.nodes[c.index_of("/h/z")]["data_crc"] ^= 1
    return c.encode()


@case("K057", "gap-after-tensor", node="/g/b", stage="verify")
def _gap(c, tmp):
    c.data[100] = 7  # between /g/w [0, 24) and /g/b at 256
    return c.encode()


# ----------------------------------------------------------------------------- the tests

def _materialize(case: Case, tmp_path: Path) -> Path:
    made = case.build(K.base_file(tmp_path), tmp_path)
    if isinstance(made, Path):
        return made
    path = tmp_path / "case.kdtr"
    path.write_bytes(made)
    return path


def _open_and_check(path: Path, stage: str) -> None:
    if stage == "verify":
        with kdtr.File(path) as f:  # opening must pass: the rule belongs to verify()
            f.verify()
    else:
        kdtr.File(path).close()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rejected_with_its_code(case: Case, tmp_path: Path):
    path = _materialize(case, tmp_path)
    tracemalloc.start()
    try:
        with pytest.raises(KdtrError) as info:
            _open_and_check(path, case.stage)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = info.value
    assert err.code == case.code, f"expected {case.code}, got: {err}"
    assert str(err).startswith(case.code)
    assert err.rule == L.RULES[case.code]
    if case.node is not None:
        assert err.node is not None and case.node in str(err), str(err)
    assert peak < PEAK_LIMIT, f"peak {peak / 2**20:.1f} MiB while rejecting"


def test_every_rule_has_a_case():
    covered = {c.code for c in CASES}
    assert covered == set(L.RULES), sorted(set(L.RULES) ^ covered)


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_kdtr_error_is_a_value_error(tmp_path):
    (tmp_path / "short").write_bytes(b"\x89KDTR")
    with pytest.raises(ValueError) as info:
        kdtr.File(tmp_path / "short")
    assert isinstance(info.value, KdtrError) and info.value.code == "K001"
    assert issubclass(KdtrError, ValueError)


def test_kdtr_error_survives_copy():
    """copy and process pools rebuild an exception from ``__reduce__``; the code, rule and node
    must come through (a worker's KdtrError would otherwise turn into a TypeError)."""
    err = KdtrError("K031", "data_size 25, shape and dtype need 24", "node #2")
    again = copy.copy(err)
    assert type(again) is KdtrError and str(again) == str(err)
    assert (again.code, again.rule, again.detail, again.node) == (err.code, err.rule, err.detail,
                                                                  err.node)


def test_fifo_is_rejected_without_blocking(tmp_path):
    """Opening a FIFO for reading blocks until a writer appears; the reader must not wait."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def unblock():  # rescue a blocked reader so that a regression fails instead of hanging
        time.sleep(2.0)
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass  # no reader waiting: the good case
    rescuer = threading.Thread(target=unblock, daemon=True)
    rescuer.start()
    t0 = time.monotonic()
    with pytest.raises(KdtrError) as info:
        kdtr.File(fifo)
    elapsed = time.monotonic() - t0
    assert info.value.code == "K058"
    assert elapsed < 1.0, f"open() blocked on a FIFO for {elapsed:.1f} s"


# ----------------------------------------------------------------------------- controls

def test_base_file_is_valid_and_round_trips_through_craft(tmp_path):
    raw = K.base_bytes(tmp_path)
    assert K.decode(raw).encode() == raw
    p = tmp_path / "base.kdtr"
    p.write_bytes(raw)
    with kdtr.File(p) as f:
        assert f.verify() == 24 + 3 + 4 + 8 + 0 + 5
        assert f["g/b"][...].tolist() == [True, False, True]


@pytest.mark.parametrize("overrides", [
    {"features_optional": 1 << 40},   # unknown optional bits are ignored
    {"minor": 0xFFFF},                 # any minor version of major 1
], ids=["optional-feature", "minor-version"])
def test_tolerated_preamble_values(tmp_path, overrides):
    p = tmp_path / "ok.kdtr"
    p.write_bytes(K.base_file(tmp_path).encode(**overrides))
    with kdtr.File(p) as f:
        f.verify()
        assert f["h/z"][...].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("names,extra", [
    (["d"] * 63, b"d"),                 # depth 64: the limit itself
    (["p" * 255] * 15 + ["p" * 254], b"x"),  # path of exactly 4096 bytes
], ids=["depth-64", "path-4096-bytes"])
def test_limits_themselves_are_accepted(tmp_path, names, extra):
    p = tmp_path / "limit.kdtr"
    p.write_bytes(_chain(tmp_path, names, extra))
    with kdtr.File(p) as f:
        seen = []
        f.visit(seen.append)
        assert len(seen) == len(names) + 1
        assert len(seen[-1].encode()) == sum(len(n) + 1 for n in names) + len(extra)


def test_name_of_255_bytes_is_accepted(tmp_path):
    c = K.base_file(tmp_path)
    c.rename_node(c.index_of("/g/w"), "\u20ac".encode() * 85)  # 255 bytes
    p = tmp_path / "ok.kdtr"
    p.write_bytes(c.encode())
    with kdtr.File(p) as f:
        assert f["g/" + "\u20ac" * 85].shape == (2, 3)

"""KDTR v1 on-disk layout: constants, record layouts, limits and the rejection rules.

This module is the machine-readable twin of docs/FORMAT.md; ``tests/test_kdtr_format_doc.py``
checks that every rule code here is documented there and the other way round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .dtypes import DType

MAGIC = b"\x89KDTR\r\n\x1a"          # high bit, CRLF and ^Z catch text-mode damage (as PNG does)
BOM = 0x0A0B0C0D                        # reads 0x0D0C0B0A on a big-endian writer's file
VERSION_MAJOR, VERSION_MINOR = 1, 0
PREAMBLE_SIZE = 128
NODE_SIZE = 128
ATTR_SIZE = 32
NO_PARENT = 0xFFFFFFFF
DEFAULT_ALIGN_LOG2 = 12                 # 4096: page-aligned tensors mmap zero-copy
MIN_ALIGN_LOG2, MAX_ALIGN_LOG2 = 3, 16

# Feature bits.  v1 defines none; a reader rejects any unknown *required* bit and ignores
# unknown *optional* bits.
KNOWN_REQUIRED_FEATURES = 0
KNOWN_OPTIONAL_FEATURES = 0

KIND_GROUP, KIND_DATASET = 0, 1

ATTR_STR, ATTR_INT, ATTR_FLOAT, ATTR_BOOL, ATTR_ARRAY, ATTR_STRLIST = 1, 2, 3, 4, 5, 6
ATTR_KIND_NAMES = {ATTR_STR: "str", ATTR_INT: "int", ATTR_FLOAT: "float", ATTR_BOOL: "bool",
                   ATTR_ARRAY: "array", ATTR_STRLIST: "str-list"}

# Limits, enforced before anything is allocated from a count or size read from the file.
MAX_HEADER_BYTES = 256 << 20
MAX_NODES = 1_000_000
MAX_ATTRS = 4_000_000
MAX_NDIM = 8
MAX_DIM = 1 << 48
MAX_TENSOR_BYTES = 1 << 62
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_DEPTH = 64
MAX_ATTR_VALUE_BYTES = 64 << 10

PREAMBLE_DTYPE = np.dtype([
    ("magic", "V8"), ("bom", "<u4"), ("major", "<u2"), ("minor", "<u2"),
    ("features_required", "<u8"), ("features_optional", "<u8"),
    ("align_log2", "<u4"), ("node_count", "<u4"), ("attr_count", "<u4"), ("reserved0", "<u4"),
    ("data_offset", "<u8"), ("data_size", "<u8"),
    ("header_offset", "<u8"), ("header_size", "<u8"),
    ("values_size", "<u8"), ("strings_size", "<u8"),
    ("header_crc", "<u4"), ("reserved1", "V24"), ("preamble_crc", "<u4"),
])
NODE_DTYPE = np.dtype([
    ("parent", "<u4"), ("name_offset", "<u4"), ("name_len", "<u2"),
    ("kind", "u1"), ("dtype", "u1"), ("ndim", "u1"), ("reserved0", "u1"), ("reserved1", "<u2"),
    ("attr_first", "<u4"), ("attr_count", "<u4"),
    ("data_offset", "<u8"), ("data_size", "<u8"), ("data_crc", "<u4"), ("reserved2", "<u4"),
    ("dims", "<u8", (MAX_NDIM,)), ("reserved3", "<u8", (2,)),
])
ATTR_DTYPE = np.dtype([
    ("owner", "<u4"), ("name_offset", "<u4"), ("name_len", "<u2"), ("kind", "u1"),
    ("reserved0", "u1"), ("value_size", "<u4"), ("value_offset", "<u8"), ("reserved1", "<u8"),
])
ARRAY_ATTR_HEAD = 8  # u8 dtype, u8 ndim, 6 zero bytes; then ndim u64 dims; then the bytes
assert PREAMBLE_DTYPE.itemsize == PREAMBLE_SIZE
assert NODE_DTYPE.itemsize == NODE_SIZE
assert ATTR_DTYPE.itemsize == ATTR_SIZE


class DatasetMeta:
    """The data fields of one dataset node, decoded: what the writer records as it streams a
    dataset and the reader builds (lazily) from a ``NODE_DTYPE`` row.  ``offset`` is relative
    to the data section, ``size`` the stored (packed) bytes, ``crc`` their CRC32C."""
    __slots__ = ("dtype", "shape", "offset", "size", "crc")

    def __init__(self, dtype: DType, shape: tuple[int, ...], offset: int, size: int, crc: int):
        self.dtype, self.shape, self.offset, self.size, self.crc = dtype, shape, offset, size, crc


# One code per rejection rule.  Codes are stable: never reuse or renumber.
RULES: dict[str, str] = {
    "K001": "file shorter than the 128-byte preamble",
    "K002": "not a KDTR file (wrong magic)",
    "K003": "magic damaged by a text-mode transfer",
    "K004": "a file of another format",
    "K005": "big-endian byte-order mark",
    "K006": "invalid byte-order mark",
    "K007": "unsupported major version",
    "K008": "unknown required feature bit",
    "K009": "preamble reserved bytes are not zero",
    "K010": "preamble checksum mismatch",
    "K011": "alignment out of range",
    "K012": "node or attribute count out of range",
    "K013": "header larger than the limit",
    "K014": "header size inconsistent with its tables and pools",
    "K015": "data section offset is not the canonical one",
    "K016": "header offset is not the canonical one",
    "K017": "file truncated",
    "K018": "trailing bytes after the header",
    "K019": "header checksum mismatch",
    "K020": "non-zero padding outside the data section",
    "K021": "invalid root node",
    "K022": "invalid parent reference",
    "K023": "parent is not a group",
    "K024": "unknown node kind",
    "K025": "node reserved fields are not zero",
    "K026": "group node carries dataset fields",
    "K027": "unknown dtype code",
    "K028": "too many dimensions",
    "K029": "dimension out of range",
    "K030": "tensor size overflows",
    "K031": "data size does not match shape and dtype",
    "K032": "packed int4 with an odd or missing last dimension",
    "K033": "misaligned data offset",
    "K034": "data range outside the data section",
    "K035": "overlapping data ranges",
    "K036": "hole between data ranges",
    "K037": "data section size does not match its tensors",
    "K038": "string pool layout invalid",
    "K039": "name is not valid UTF-8",
    "K040": "invalid name",
    "K041": "name too long",
    "K042": "path too long or too deep",
    "K043": "duplicate name in a group",
    "K044": "attribute ranges do not tile the attribute table",
    "K045": "attribute owner mismatch",
    "K046": "unknown attribute kind",
    "K047": "attribute reserved fields are not zero",
    "K048": "value pool layout invalid",
    "K049": "attribute value larger than the limit",
    "K050": "attribute value size wrong for its kind",
    "K051": "bool byte other than 0 or 1",
    "K052": "string-list counts exceed its bytes",
    "K053": "invalid array attribute",
    "K054": "duplicate attribute name",
    "K055": "attribute string is not valid UTF-8",
    "K056": "tensor checksum mismatch",
    "K057": "non-zero padding between tensors",
    "K058": "not a regular file",
}


def align_up(x: int, log2: int) -> int:
    a = 1 << log2
    return (x + a - 1) & ~(a - 1)

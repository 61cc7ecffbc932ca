"""int4-group: symmetric 4-bit weights with one bf16 scale per group of inputs (W4A16).

The one module that knows this weight format (docs/FORMAT.md, "Weight formats: int4-group"):
the packed layout, packing and unpacking, the conversion from compressed-tensors' offset-8
int32 words, the float64 reference dequantiser, shape validation and the KDTR round trip.
It lives in the formats layer because both ``kdtr-dump`` (formats/dump) and the model
(kdtree_numba/bundle.py, reference/layers) use it.

A weight of logical shape ``[..., n]`` (the input dimension last: ``[out, in]`` per matrix,
``[E, out, in]`` for stacked experts) with group size ``g`` is

* ``packed``: uint8 ``[..., n / 2]``, KDTR's int4 bytes: two values a byte, the even column in
  the low nibble, each value ``q`` in [-8, 7] as a two's complement nibble;
* ``scale``: bfloat16 ``[..., n / g]``, one scale per ``g`` consecutive inputs of a row;
* ``w[..., j] = q[..., j] * scale[..., j // g]`` (exact in float32 and float64: a 4-bit
  integer times an 8-bit significand).

``g`` is even (a group never splits a byte), at least 2, at most ``MAX_GROUP_SIZE`` and divides
``n``.  In a KDTR file the weight is a group holding two datasets::

    <name>            group   attrs weight.format = "int4-group", weight.group_size = g
    <name>/packed     int4      [..., n]        (the bytes above; CRC-checked like any tensor)
    <name>/scale      bfloat16  [..., n / g]

compressed-tensors' ``pack-quantized`` layout (int32 words of 8 values, the first in the
lowest bits, each stored as ``q + 8``) is the same nibble order once the words are viewed as
little-endian bytes; ``q + 8`` and ``q``'s two's complement nibble differ in the top bit only,
so the conversion is ``byte ^ 0x88`` (:func:`packed_from_offset8_words`).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from .dtypes import pack_int4, unpack_int4

__all__ = ["FORMAT", "ATTR_FORMAT", "ATTR_GROUP_SIZE", "PACKED", "SCALE", "MAX_GROUP_SIZE",
           "Int4GroupWeight", "WeightFormatError", "check_group_size", "check_layout",
           "packed_from_offset8_words", "is_weight_group", "StoredLayout", "stored_layout",
           "read_weight", "write_weight", "describe", "dequantized_blocks"]

FORMAT = "int4-group"
ATTR_FORMAT = "weight.format"
ATTR_GROUP_SIZE = "weight.group_size"
PACKED, SCALE = "packed", "scale"
# Real checkpoints use 32 (Kimi-K2) to 128 (GPTQ); a group of a whole 64K-wide row is already
# per-channel.  The cap keeps a hostile value from meaning anything.
MAX_GROUP_SIZE = 1 << 16
SCALE_DTYPE = np.dtype(ml_dtypes.bfloat16)


class WeightFormatError(ValueError):
    """A weight whose layout breaks the int4-group rules (shapes, group size, dtypes, members);
    the message names the weight."""


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_group_size(group_size, where: str = "weight") -> int:
    """``group_size`` as an int, or :class:`WeightFormatError`: an even integer in
    [2, MAX_GROUP_SIZE] (not a bool, not a float)."""
    if not _is_int(group_size):
        raise WeightFormatError(f"{where}: group_size {group_size!r} is not an integer")
    g = int(group_size)
    if not 2 <= g <= MAX_GROUP_SIZE or g % 2:
        raise WeightFormatError(f"{where}: group_size {g} must be even and in "
                                f"[2, {MAX_GROUP_SIZE}]")
    return g


def check_layout(shape, scale_shape, group_size, where: str = "weight") -> int:
    """Validate an int4-group layout: logical ``shape`` ``[..., n]``, ``scale_shape``
    ``[..., n / g]``, ``group_size`` g.  Returns g as an int; a problem raises
    :class:`WeightFormatError` naming ``where`` and the field at fault."""
    g = check_group_size(group_size, where)
    shape, scale_shape = tuple(int(d) for d in shape), tuple(int(d) for d in scale_shape)
    if not shape:
        raise WeightFormatError(f"{where}: a 0-d weight has no input dimension to group")
    n = shape[-1]
    if n % g:
        raise WeightFormatError(f"{where}: input dimension {n} (shape {shape}) is not a "
                                f"multiple of group_size {g}")
    want = shape[:-1] + (n // g,)
    if scale_shape != want:
        raise WeightFormatError(f"{where}: scale shape {scale_shape} does not match a {shape} "
                                f"weight in groups of {g} (expected {want})")
    return g


@dataclasses.dataclass(frozen=True, eq=False)
class Int4GroupWeight:
    """An int4-group weight (layout: the module docstring).  ``packed`` and ``scale`` may be
    read-only views of a memory map; nothing here writes into them.  ``w[e]`` (integer or
    slice indices on the leading axes only) is the sub-weight, e.g. one expert of a stacked
    ``[E, out, in]``; :meth:`dequantize` gives the float64 values (the reference)."""
    packed: np.ndarray
    scale: np.ndarray
    group_size: int

    def __post_init__(self):
        packed, scale = np.asarray(self.packed), np.asarray(self.scale)
        if packed.dtype != np.uint8:
            raise WeightFormatError(f"packed bytes must be uint8, got {packed.dtype}")
        if scale.dtype != SCALE_DTYPE:
            raise WeightFormatError(f"scales must be bfloat16, got {scale.dtype}")
        if packed.ndim == 0:
            raise WeightFormatError("packed bytes must have at least one dimension")
        g = check_layout(packed.shape[:-1] + (2 * packed.shape[-1],), scale.shape,
                         self.group_size)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "group_size", g)

    # ---- shape
    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``[..., n]`` (as the dense weight it stands for)."""
        return self.packed.shape[:-1] + (2 * self.packed.shape[-1],)

    @property
    def ndim(self) -> int:
        return self.packed.ndim

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed values plus the scales."""
        return int(self.packed.nbytes + self.scale.nbytes)

    @property
    def bits_per_weight(self) -> float:
        """4 bits plus the scale's 16 shared by a group: 4.5 at g = 32."""
        return 4.0 + 16.0 / self.group_size

    def __getitem__(self, key) -> "Int4GroupWeight":
        key = key if isinstance(key, tuple) else (key,)
        if len(key) >= self.ndim or any(k is Ellipsis or k is None for k in key) or \
                not all(_is_int(k) or isinstance(k, slice) for k in key):
            raise IndexError(f"an int4-group weight of shape {self.shape} is indexed on its "
                             f"{self.ndim - 1} leading axes only (ints and slices), got {key!r}")
        return Int4GroupWeight(self.packed[key], self.scale[key], self.group_size)

    def __array__(self, dtype=None, copy=None):
        # never an implicit (object or unpacked) array: the caller says what it wants
        raise TypeError("an int4-group weight is not an array: use dequantize() (float64) "
                        "or its packed / scale members")

    # ---- packing
    @classmethod
    def from_values(cls, q, scale, group_size: int) -> "Int4GroupWeight":
        """Pack int values ``q`` in [-8, 7] (logical shape) with their bf16 ``scale``."""
        return cls(pack_int4(np.asarray(q)), np.asarray(scale, SCALE_DTYPE), group_size)

    @classmethod
    def quantize(cls, w, group_size: int) -> "Int4GroupWeight":
        """Symmetric round-to-nearest of a float weight ``[..., n]``: per group ``s =
        bf16(absmax / 7)``, ``q = clip(rint(w / s), -8, 7)`` (an all-zero group: s = 0, q = 0).
        For tests and random bundles; real checkpoints come quantised (kdtr-import-hf)."""
        w = np.asarray(w, np.float64)
        g = check_group_size(group_size, "weight")
        check_layout(w.shape, w.shape[:-1] + (w.shape[-1] // g,), g)
        groups = w.reshape(w.shape[:-1] + (w.shape[-1] // g, g))
        scale = (np.abs(groups).max(axis=-1) / 7.0).astype(SCALE_DTYPE)
        s64 = scale.astype(np.float64)[..., None]
        q = np.where(s64 > 0, np.rint(groups / np.where(s64 > 0, s64, 1.0)), 0.0)
        return cls.from_values(np.clip(q, -8, 7).astype(np.int8).reshape(w.shape), scale, g)

    def values(self) -> np.ndarray:
        """The int8 values q [-8, 7] of the logical shape (unpacked: one byte each)."""
        return unpack_int4(self.packed, self.shape)

    def dequantize(self, dtype=np.float64) -> np.ndarray:
        """``q * scale`` of the logical shape: the reference values (float64; float32 holds
        them exactly too)."""
        g = self.group_size
        q = self.values().reshape(self.shape[:-1] + (self.shape[-1] // g, g))
        w = q.astype(dtype) * self.scale.astype(dtype)[..., None]
        return w.reshape(self.shape)


def packed_from_offset8_words(words, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """compressed-tensors ``weight_packed`` (int32 ``[rows, ceil(n / 8)]``, 8 values a word,
    the first in the lowest bits, each as ``q + 8``) -> KDTR int4 bytes uint8 ``[rows, n / 2]``
    (``out``, when given, is filled: a stacked tensor's slice, so no temporary is made).
    ``n``: the logical input dimension (even); padding nibbles past it are dropped."""
    words = np.asarray(words)
    if words.dtype.kind not in "iu" or words.dtype.itemsize != 4 or words.ndim != 2:
        raise WeightFormatError(f"packed words must be 2-D int32, got {words.dtype} "
                                f"{words.shape}")
    if n % 2 or words.shape[1] != -(-n // 8):
        raise WeightFormatError(f"packed words {words.shape} do not hold {n} 4-bit values a "
                                f"row (expected {-(-n // 8)} int32 words)")
    if sys.byteorder != "little" or words.dtype.byteorder == ">":
        words = words.astype("<i4")       # the nibble order is that of little-endian bytes
    raw = words.view(np.uint8)[:, :n // 2]
    if out is None:
        out = np.empty(raw.shape, np.uint8)
    return np.bitwise_xor(raw, np.uint8(0x88), out=out)


# ----------------------------------------------------------------------------- KDTR round trip

def is_weight_group(node) -> bool:
    """Whether a KDTR (or h5py) node is a group that stores a weight format."""
    return not hasattr(node, "shape") and ATTR_FORMAT in node.attrs


@dataclasses.dataclass(frozen=True)
class StoredLayout:
    """A stored int4-group weight's logical ``shape``, ``group_size`` and bytes on disk."""
    shape: tuple
    group_size: int
    nbytes: int


def stored_layout(group, where: str | None = None) -> StoredLayout:
    """Validate a stored weight's attributes, members, dtypes and shapes without reading its
    data; :class:`WeightFormatError` naming ``where`` (default: the group's path)."""
    packed, scale, g = _members(group, where or group.name)
    return StoredLayout(tuple(packed.shape), g,
                        int(packed.storage_nbytes + scale.storage_nbytes))


def _members(group, where: str):
    fmt = group.attrs.get(ATTR_FORMAT)
    if not isinstance(fmt, str) or fmt != FORMAT:   # a hostile file may hold an array here
        raise WeightFormatError(f"{where}: {ATTR_FORMAT} {fmt!r}; this version reads "
                                f"{FORMAT!r}")
    names = set(group.keys())
    if names != {PACKED, SCALE}:
        raise WeightFormatError(f"{where}: an {FORMAT} weight holds exactly {PACKED!r} and "
                                f"{SCALE!r}, found {sorted(names)}")
    packed, scale = group[PACKED], group[SCALE]
    for ds, want in ((packed, "int4"), (scale, "bfloat16")):
        if not hasattr(ds, "shape") or getattr(ds, "kdtr_dtype", None) != want:
            raise WeightFormatError(f"{where}/{ds.name.rsplit('/', 1)[-1]}: must be a "
                                    f"{want} dataset")
    g = check_layout(packed.shape, scale.shape, group.attrs.get(ATTR_GROUP_SIZE), where)
    return packed, scale, g


def read_weight(group, *, verify: bool = True, where: str | None = None) -> Int4GroupWeight:
    """The weight stored in a KDTR group (layout and attributes validated first).  ``verify``:
    CRC32C-check both datasets and return copies; else read-only views of the map."""
    where = where or group.name
    packed, scale, g = _members(group, where)
    if verify:
        packed.verify()
        return Int4GroupWeight(np.array(packed.packed()), scale.read(verify=True), g)
    return Int4GroupWeight(packed.packed(), scale[...], g)


def write_weight(parent, name: str, weight: Int4GroupWeight):
    """Store ``weight`` under ``parent/name`` (a group with its attributes and two datasets;
    the packed bytes are written as they are)."""
    group = parent.create_group(name)
    group.attrs[ATTR_FORMAT] = FORMAT
    group.attrs[ATTR_GROUP_SIZE] = int(weight.group_size)
    group.create_dataset(PACKED, shape=weight.shape, dtype="int4", packed=weight.packed)
    group.create_dataset(SCALE, data=weight.scale)
    return group


def describe(group, where: str | None = None) -> dict:
    """What an inspector shows of a stored int4-group weight without dequantising it: format,
    group size, logical shape, effective bits per weight, bytes, and the scales' statistics
    (min, max, mean over float64; zero and non-finite counts)."""
    packed, scale, g = _members(group, where or group.name)
    s = np.asarray(scale[...], np.float64)
    finite = s[np.isfinite(s)]
    return {"format": FORMAT, "group_size": g, "shape": list(packed.shape),
            "bits_per_weight": 4.0 + 16.0 / g,
            "nbytes": int(packed.storage_nbytes + scale.storage_nbytes),
            "scale": {"count": int(s.size),
                      "min": float(finite.min()) if finite.size else None,
                      "max": float(finite.max()) if finite.size else None,
                      "mean": float(finite.mean()) if finite.size else None,
                      "zero": int((s == 0).sum()), "nonfinite": int(s.size - finite.size)}}


def dequantized_blocks(group, max_elems: int) -> Iterator[np.ndarray]:
    """Flat float64 blocks of the dequantised values, about ``max_elems`` at a time, in C
    order (whole rows of the last axis), for statistics over weights larger than memory."""
    packed, scale, g = _members(group, group.name)
    n = packed.shape[-1]
    rows = math.prod(packed.shape[:-1])
    p = packed.packed().reshape(rows, n // 2)
    s = np.asarray(scale[...]).reshape(rows, n // g)
    step = max(1, max_elems // max(n, 1))
    for r in range(0, rows, step):
        yield Int4GroupWeight(p[r:r + step], s[r:r + step], g).dequantize().reshape(-1)

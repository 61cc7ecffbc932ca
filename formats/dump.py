"""kdtr-dump: inspect, verify, diff and convert KDTR, HDF5 and safetensors files.

    kdtr-dump FILE [-a] [--stats] [--summary] [--json] [-f GLOB]... [--offsets]
    kdtr-dump FILE -d PATH [--slice "0:4,:8"]
    kdtr-dump FILE --verify
    kdtr-dump diff A B [--atol X] [--rtol Y] [--json]
    kdtr-dump convert SRC DST [--split-dots]
    kdtr-dump --sample OUT

Exit codes: 0 success (diff: same), 1 diff: files differ, 2 error (unreadable or missing file,
bad arguments), 3 --verify: the file is corrupt.  User documentation: docs/KDTR_DUMP.md.
Every string that comes from a file goes through ``escape`` before it reaches the terminal.
"""
from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import math
import os
import re
import stat
import sys
from typing import Any, Callable, Iterator

import numpy as np

from . import kdtr
from . import layout as L
from .dtypes import BY_NAME, DType, unpack_int4
from .kdtr import KdtrError

SCHEMA_VERSION = 1
STATS_CHUNK_BYTES = 16 << 20        # float64 working set per step of --stats and diff
PREVIEW_EDGE = 3                    # numpy edgeitems for -d previews
PREVIEW_FULL = 1000                 # previews up to this many elements print whole
EXIT_OK, EXIT_DIFFER, EXIT_ERROR, EXIT_CORRUPT = 0, 1, 2, 3
UNREADABLE_CODES = {"K001", "K002", "K004", "K007", "K008", "K058"}  # not this format / too new
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


# ----------------------------------------------------------------------------- escaping

def escape(text: Any, backslash: bool = True) -> str:
    """``text`` made safe for a terminal: every non-printable character (C0, DEL, C1
    controls, ANSI escapes, newlines) and every format/bidi/separator character (U+202E,
    U+2066, U+200B, U+FEFF, tag characters, ...) become repr-style escapes (``\\x1b``,
    ``\\u202e``), and a backslash is doubled so that escapes stay unambiguous.  Printable
    text, including non-ASCII letters, is kept.  ``backslash=False`` leaves backslashes alone:
    for error messages whose file-derived parts are already ``ascii()``-quoted."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and ("\\" not in s or not backslash):
        return s
    out = []
    for ch in s:
        if ch == "\\" and backslash:
            out.append("\\\\")
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


# ----------------------------------------------------------------------------- sources

class Tensor:
    """Data access for one dataset, whatever the format: ``blocks`` yields the stored elements
    (flat, packed for int4) in C order, ``read(key)`` a decoded selection."""

    def __init__(self, dtype: DType, shape: tuple, stored, h5: bool = False):
        self.dtype, self.shape, self._stored, self._h5 = dtype, tuple(shape), stored, h5
        self.stored_shape = (self.shape[:-1] + (self.shape[-1] // 2,)
                             if dtype.packed else self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def _stored_dtype(self) -> np.dtype:
        from .hdf5_mapping import BIT_PATTERNS
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
        from .hdf5 import iter_blocks
        if self.stored_shape == ():
            yield self._as_kdtr(self._stored[()]).reshape(-1)
            return
        for sel in iter_blocks(self.stored_shape, max_elems):
            yield self._as_kdtr(self._stored[sel]).reshape(-1)

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
                return np.empty(_result_shape(sel), self._stored_dtype())
            if k.step > 0:
                h5sel.append(slice(lo, hi, k.step))
                post.append(slice(None))
            else:
                h5sel.append(slice(lo, hi))
                post.append(p)
        return self._as_kdtr(self._stored[tuple(h5sel)])[tuple(post)]

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
            return np.empty(_result_shape(key), np.int8)
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


def _result_shape(sel: tuple) -> tuple:
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


_LOW_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def display_array(raw: np.ndarray, dt: DType) -> np.ndarray:
    if dt.name in _LOW_FLOATS:
        return np.asarray(raw).astype(np.float32)
    return np.asarray(raw)


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
        from .hdf5 import open_hdf5
        super().__init__(path)
        self.file = open_hdf5(path)
        plist = self.file.id.get_create_plist()
        self.version = f"superblock {plist.get_version()[0]}"

    def entries(self) -> list[Entry]:
        from h5py import h5o
        from .hdf5 import H5Node, walk
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
        from .hdf5 import read_attrs
        return read_attrs(e.handle.obj, e.path, strict=False)

    def tensor_of(self, e: Entry) -> Tensor:
        n = e.handle
        return Tensor(n.dtype, n.shape, n.obj, h5=True)

    def verify(self, progress) -> str:
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
    from .hdf5_mapping import MARKERS
    if node.obj is None:
        return 0
    return node.num_attrs - sum(1 for m in MARKERS if m in node.obj.attrs)


class SafetensorsSource(Source):
    format = "safetensors"
    version = "-"

    def __init__(self, path: str):
        from .safetensors_io import SafetensorsFile
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
        raise KdtrError("K058", f"{path!a} is not a regular file")
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
    fmt = detect_format(path)
    return {"kdtr": KdtrSource, "hdf5": Hdf5Source, "safetensors": SafetensorsSource}[fmt](path)


# ----------------------------------------------------------------------------- formatting

def fmt_shape(shape: tuple | None) -> str:
    return "" if shape is None else "[" + ", ".join(str(d) for d in shape) + "]"


def fmt_value(value: Any, width: int = 100) -> str:
    """One-line display of an attribute value (arrays abbreviated), escaped."""
    if isinstance(value, str):
        return '"' + escape(value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join('"' + escape(v) + '"' for v in value) + "]"
    if isinstance(value, np.ndarray):
        shown = value.astype(np.float32) if value.dtype.name in _LOW_FLOATS else value
        text = np.array2string(shown, threshold=16, edgeitems=3, max_line_width=10 ** 6,
                               separator=", ")
        text = " ".join(text.split())
        if len(text) > width:
            text = text[:width - 3] + "..."
        return f"{_dtype_name(value.dtype)}{fmt_shape(value.shape)} {text}"
    return escape(repr(value))


def _dtype_name(dt: np.dtype) -> str:
    from .dtypes import dtype_for
    try:
        return dtype_for(dt).name
    except TypeError:
        return str(dt)


def json_value(value: Any) -> Any:
    """An attribute value as JSON: arrays as (nested) lists, bf16/fp8 as floats, complex as
    [re, im], non-finite floats as the strings "nan", "inf", "-inf"."""
    if isinstance(value, np.ndarray):
        dt = value.dtype
        if dt.kind == "c":
            value = np.stack([value.real, value.imag], axis=-1).astype(np.float64)
        elif dt.kind not in "biu":
            value = value.astype(np.float64)
        return _json_list(value.tolist())
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, list):
        return [json_value(v) for v in value]
    return repr(value)


def _json_list(v: Any) -> Any:
    if isinstance(v, list):
        return [_json_list(x) for x in v]
    return json_float(v) if isinstance(v, float) else v


def json_float(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def table(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Rows of cells -> aligned lines (columns in ``right`` right-aligned)."""
    if not rows:
        return []
    widths = [max(map(len, column)) for column in zip(*rows)]
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*r).rstrip() for r in rows]


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ----------------------------------------------------------------------------- progress

class ProgressBar:
    """A byte progress bar on stderr: tqdm where installed, else a \\r counter."""

    def __init__(self, desc: str, enabled: bool):
        self.enabled, self.desc, self._bar, self._last = enabled, desc, None, -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                 desc=self.desc, file=sys.stderr, leave=False)
            except ImportError:
                self._bar = False
        if self._bar:
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            return
        pct = 100 if total == 0 else int(100 * done / total)
        if pct != self._last:
            self._last = pct
            sys.stderr.write(f"\r{self.desc}: {pct:3d}% ({human_bytes(done)})")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        elif self._bar is False:
            sys.stderr.write("\n")
        self._bar = None


def progress_enabled(args) -> bool:
    return bool(getattr(args, "progress", False)) or sys.stderr.isatty()


# ----------------------------------------------------------------------------- statistics

def tensor_stats(t: Tensor, tick: Callable[[int], None] = lambda n: None) -> dict:
    """min, max, absmax over non-NaN values; mean, std (population) over finite values;
    NaN/Inf/zero counts.  float64 accumulation, Chan's parallel combination per chunk, at most
    ``STATS_CHUNK_BYTES`` of float64 at a time.  Complex: statistics of |z|."""
    n_max = max(1, STATS_CHUNK_BYTES // 8)
    count = nan = inf = zero = 0
    lo, hi = math.inf, -math.inf
    n_fin, mean, m2 = 0, 0.0, 0.0
    for raw in t.blocks(n_max if not t.dtype.packed else max(1, n_max // 2)):
        tick(raw.nbytes)
        v = widen(raw, t.dtype)
        if v.dtype.kind == "c":
            v = np.abs(v)
        v = v.astype(np.float64, copy=False)
        count += v.size
        isnan = np.isnan(v)
        finite = np.isfinite(v)
        nan += int(isnan.sum())
        inf += int(v.size - finite.sum() - isnan.sum())
        zero += int((v == 0).sum())
        keep = v[~isnan] if nan else v
        if keep.size:
            lo, hi = min(lo, float(keep.min())), max(hi, float(keep.max()))
        f = v[finite] if finite.size != int(finite.sum()) else v
        if f.size:
            b_mean = float(f.mean())
            b_m2 = float(np.square(f - b_mean).sum())
            total = n_fin + f.size
            delta = b_mean - mean
            mean += delta * f.size / total
            m2 += b_m2 + delta * delta * n_fin * f.size / total
            n_fin = total
    have = lo <= hi
    return {"count": count,
            "min": lo if have else None, "max": hi if have else None,
            "mean": mean if n_fin else None,
            "std": math.sqrt(m2 / n_fin) if n_fin else None,
            "absmax": max(abs(lo), abs(hi)) if have else None,
            "nan": nan, "inf": inf, "zero": zero}


def _fmt_stat(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.6g}"


# ----------------------------------------------------------------------------- summary

_NUMBER = re.compile(r"^\d+$")


def collapse(path: str) -> str:
    """``layers/12/attn/kv_a_proj`` -> ``layers/#/attn/kv_a_proj``."""
    return "/".join("#" if _NUMBER.match(p) else p for p in path.split("/"))


def summarize(entries: list[Entry]) -> dict:
    datasets = [e for e in entries if e.kind == "dataset"]
    total_bytes = sum(e.nbytes or 0 for e in datasets)
    params = sum(math.prod(e.shape) for e in datasets if e.shape is not None)
    by_dtype: dict[str, list[int]] = {}
    by_top: dict[str, int] = {}
    patterns: dict[str, dict] = {}
    for e in datasets:
        n = math.prod(e.shape) if e.shape is not None else 0
        d = by_dtype.setdefault(e.dtype or "?", [0, 0, 0])
        d[0] += 1
        d[1] += n
        d[2] += e.nbytes or 0
        top = e.rel.split("/", 1)[0]
        by_top[top] = by_top.get(top, 0) + (e.nbytes or 0)
        p = patterns.setdefault(collapse(e.rel), {"count": 0, "dtypes": [], "shapes": [],
                                                  "parameters": 0, "nbytes": 0})
        p["count"] += 1
        p["parameters"] += n
        p["nbytes"] += e.nbytes or 0
        if e.dtype not in p["dtypes"]:
            p["dtypes"].append(e.dtype)
        if list(e.shape or ()) not in p["shapes"]:
            p["shapes"].append(list(e.shape or ()))
    share = (lambda b: round(100.0 * b / total_bytes, 2) if total_bytes else 0.0)
    return {
        "groups": sum(1 for e in entries if e.kind == "group" and e.path != "/"),
        "datasets": len(datasets), "parameters": params, "nbytes": total_bytes,
        "by_dtype": [{"dtype": k, "datasets": v[0], "parameters": v[1], "nbytes": v[2],
                      "share": share(v[2])} for k, v in by_dtype.items()],
        "by_top_level": [{"name": k, "nbytes": v, "share": share(v)} for k, v in by_top.items()],
        "patterns": [{"pattern": k, "count": v["count"],
                      "dtype": v["dtypes"][0] if len(v["dtypes"]) == 1 else "mixed",
                      "shape": v["shapes"][0] if len(v["shapes"]) == 1 else "mixed",
                      "parameters": v["parameters"], "nbytes": v["nbytes"]}
                     for k, v in patterns.items()],
    }


def print_summary(s: dict, out: list[str]) -> None:
    out.append(f"groups: {s['groups']:,}   datasets: {s['datasets']:,}   "
               f"parameters: {s['parameters']:,}   bytes: {s['nbytes']:,} "
               f"({human_bytes(s['nbytes'])})")
    out.append("")
    out.append("by dtype:")
    rows = [["DTYPE", "DATASETS", "PARAMETERS", "BYTES", "SHARE"]]
    rows += [[escape(d["dtype"]), f"{d['datasets']:,}", f"{d['parameters']:,}",
              f"{d['nbytes']:,}", f"{d['share']:.1f}%"] for d in s["by_dtype"]]
    out += ["  " + line for line in table(rows, right={1, 2, 3, 4})]
    out.append("")
    out.append("by top-level entry:")
    rows = [["NAME", "BYTES", "SHARE"]]
    rows += [[escape(d["name"]), f"{d['nbytes']:,}", f"{d['share']:.1f}%"]
             for d in s["by_top_level"]]
    out += ["  " + line for line in table(rows, right={1, 2})]
    out.append("")
    out.append("datasets, numbered path components collapsed to #:")
    rows = [["PATTERN", "COUNT", "DTYPE", "SHAPE", "BYTES"]]
    for p in s["patterns"]:
        shape = p["shape"] if p["shape"] == "mixed" else fmt_shape(p["shape"])
        rows.append([escape(p["pattern"]), f"x{p['count']}", escape(p["dtype"]), shape,
                     f"{p['nbytes']:,}"])
    out += ["  " + line for line in table(rows, right={1, 4})]


# ----------------------------------------------------------------------------- inspect

def parse_slice(text: str) -> tuple:
    """``"0:4,:8"`` -> (slice(0, 4), slice(None, 8)); ``...`` and negative ints allowed."""
    key = []
    for part in text.split(","):
        part = part.strip()
        if part == "...":
            key.append(Ellipsis)
        elif ":" in part:
            bits = part.split(":")
            if len(bits) > 3:
                raise ValueError(f"bad slice {part!r}")
            nums = [int(b) if b.strip() else None for b in bits]
            if len(nums) == 3 and nums[2] == 0:
                raise ValueError("slice step cannot be zero")
            key.append(slice(*nums))
        elif part:
            key.append(int(part))
        else:
            key.append(slice(None))
    return tuple(key)


def preview(e: Entry, slice_text: str | None) -> list[str]:
    """Values of a dataset (or of a selection) as numpy prints them.  Only what is shown is
    read: large selections are summarised to their first and last entries along each axis."""
    t = e.tensor
    key = normalize_key(parse_slice(slice_text) if slice_text else (), t.shape)
    shape = _result_shape(key)
    head = f"{escape(e.path)}: {escape(e.dtype)} {fmt_shape(e.shape)}"
    if slice_text:
        head += f", selection [{escape(slice_text)}] -> {fmt_shape(shape)}"
    edge = 3 if len(shape) <= 3 else 2 if len(shape) <= 5 else 1
    full = math.prod(shape) <= PREVIEW_FULL
    arr = t.read(key, normalized=True) if full else _corners(t, key, edge)
    opts = dict(edgeitems=edge, linewidth=120, threshold=PREVIEW_FULL if full else 0,
                floatmode="unique")
    if e.dtype in _LOW_FLOATS and arr.size:
        opts["formatter"] = {"float_kind": _shortest_formatter(arr, BY_NAME[e.dtype].numpy)}
    with np.printoptions(**opts):
        body = np.array2string(arr, separator=" ")
    return [head] + [escape(line) for line in body.splitlines()]


def _shortest(x: float, dtype: np.dtype) -> str:
    """The shortest decimal that reads back as the same ``dtype`` value (bf16: 3-4 digits)."""
    if not math.isfinite(x):
        return str(x)
    target = np.array(x, dtype).tobytes()
    for digits in range(1, 10):
        text = f"{x:.{digits}g}"
        if np.array(float(text), dtype).tobytes() == target:
            return text
    return repr(x)


def _shortest_formatter(arr: np.ndarray, dtype: np.dtype) -> Callable[[Any], str]:
    texts = {float(v): _shortest(float(v), dtype) for v in np.unique(arr.reshape(-1))}
    width = max(map(len, texts.values()))
    return lambda v: texts.get(float(v), _shortest(float(v), dtype)).rjust(width)


def _part(k: slice, a: int, b: int) -> slice:
    """Elements a..b-1 of the normalised slice ``k`` (range semantics, like ``k``)."""
    return slice(k.start + a * k.step, k.start + b * k.step, k.step)


def _corners(t: Tensor, key: tuple, edge: int) -> np.ndarray:
    """The first and last ``edge`` entries of the selection ``key`` along every long axis,
    placed in an array of 2*edge+1 per such axis so that numpy's summarised print (threshold
    0) shows exactly them with '...' for the (unread) middle."""
    parts, out_shape = [], []
    for k in key:
        if isinstance(k, int):
            parts.append([(k, None)])
            continue
        m = len(range(k.start, k.stop, k.step))
        if m > 2 * edge:
            parts.append([(_part(k, 0, edge), slice(0, edge)),
                          (_part(k, m - edge, m), slice(edge + 1, 2 * edge + 1))])
            out_shape.append(2 * edge + 1)
        else:
            parts.append([(_part(k, 0, m), slice(0, m))])
            out_shape.append(m)
    out = None
    for combo in itertools.product(*parts):
        block = t.read(tuple(src for src, _ in combo), normalized=True)
        if out is None:
            out = np.zeros(out_shape, dtype=block.dtype)
        out[tuple(dst for _, dst in combo if dst is not None)] = block
    return out


def inspect(args, out: list[str]) -> int:
    if args.verify:
        return verify(args, out)
    with open_source(args.file) as src:
        entries = src.entries()
        if args.dataset:
            return show_dataset(entries, args, out)
        if args.filter:
            pats = [p.lstrip("/") for p in args.filter]
            entries = [e for e in entries
                       if any(fnmatch.fnmatchcase(e.rel, p) for p in pats)]
        stats = {}
        if args.stats:
            stats = compute_stats(entries, args)
        if args.json:
            doc = {"schema_version": SCHEMA_VERSION, "format": src.format, "file": args.file,
                   "version": src.version, "nodes": [json_node(e, stats) for e in entries]}
            if args.summary:
                doc["summary"] = summarize(entries)
            out.append(json.dumps(doc, ensure_ascii=True, allow_nan=False))
            return EXIT_OK
        out.append(f"{escape(args.file)}: {src.format} {src.version}")
        if args.summary:
            print_summary(summarize(entries), out)
            return EXIT_OK
        listing(entries, args, stats, out)
    return EXIT_OK


def json_node(e: Entry, stats: dict) -> dict:
    node = {"path": e.path, "kind": e.kind, "dtype": e.dtype,
            "shape": None if e.shape is None else list(e.shape), "nbytes": e.nbytes,
            "attrs": {k: json_value(v) for k, v in e.attrs.items()}}
    if e.target is not None:
        node["target"] = e.target
    if e.path in stats:
        node["stats"] = {k: json_float(v) if isinstance(v, float) else v
                         for k, v in stats[e.path].items()}
    return node


def listing(entries: list[Entry], args, stats: dict, out: list[str]) -> None:
    head = ["PATH", "KIND", "DTYPE", "SHAPE", "BYTES", "ATTRS"]
    if args.offsets:
        head.append("OFFSET")
    if stats:
        head += ["MIN", "MAX", "MEAN", "STD", "ABSMAX", "NAN", "INF", "ZERO"]
    rows = [head]
    attr_lines: dict[int, list[str]] = {}
    for e in entries:
        kind = e.kind if e.target is None else f"{e.kind} -> {escape(e.target)}"
        row = [escape(e.path), kind, escape(e.dtype or ""), fmt_shape(e.shape),
               "" if e.nbytes is None else str(e.nbytes), str(e.attr_count)]
        if args.offsets:
            row.append("" if e.offset is None else str(e.offset))
        if stats:
            s = stats.get(e.path)
            row += ([_fmt_stat(s[k]) for k in ("min", "max", "mean", "std", "absmax", "nan",
                                               "inf", "zero")] if s else [""] * 8)
        rows.append(row)
        if args.attrs and e.attr_count:
            attr_lines[len(rows) - 1] = [f"    @{escape(k)} = {fmt_value(v)}"
                                         for k, v in e.attrs.items()]
    right = {4, 5} | ({6} if args.offsets else set())
    if stats:
        start = 7 if args.offsets else 6
        right |= set(range(start, start + 8))
    for i, line in enumerate(table(rows, right)):
        out.append(line)
        out.extend(attr_lines.get(i, ()))


def compute_stats(entries: list[Entry], args) -> dict:
    todo = [e for e in entries if e.decodable]
    total = sum(e.nbytes or 0 for e in todo)
    bar = ProgressBar("stats", progress_enabled(args))
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        bar(done[0], total)

    try:
        return {e.path: tensor_stats(e.tensor, tick) for e in todo}
    finally:
        bar.close()


def show_dataset(entries: list[Entry], args, out: list[str]) -> int:
    want = "/" + args.dataset.strip("/")
    match = next((e for e in entries if e.path == want), None)
    if match is None:
        raise LookupError(f"no dataset {escape(want)!s} in {escape(args.file)}")
    if match.tensor is None:
        raise LookupError(f"{escape(want)} is a {match.kind}"
                          + (f" of type {escape(match.dtype)}" if match.dtype else "")
                          + ", not a dataset whose values can be shown")
    try:
        out.extend(preview(match, args.slice))
    except (IndexError, ValueError) as e:
        raise LookupError(f"bad --slice {escape(args.slice)}: {e}") from None
    return EXIT_OK


def verify(args, out: list[str]) -> int:
    """Exit 0 intact, 3 corrupt (a file of the format that fails a check), 2 unreadable
    (missing, not a regular file, not a format we read, a newer major version)."""
    bar = ProgressBar("verify", progress_enabled(args))
    try:
        with open_source(args.file) as src:
            what = src.verify(bar)
    except KdtrError as e:
        if e.code in UNREADABLE_CODES:
            raise
        out.append(f"CORRUPT {escape(args.file)}: {escape(str(e), backslash=False)}")
        return EXIT_CORRUPT
    finally:
        bar.close()
    out.append(f"OK {escape(args.file)} ({src.format}): {what}")
    return EXIT_OK


# ----------------------------------------------------------------------------- diff

def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind not in "biu"))
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _rechunk(blocks: Iterator[np.ndarray], n: int) -> Iterator[np.ndarray]:
    pending: list[np.ndarray] = []
    have = 0
    for b in blocks:
        pending.append(b)
        have += b.size
        while have >= n:
            joined = np.concatenate(pending) if len(pending) > 1 else pending[0]
            yield joined[:n]
            rest = joined[n:]
            pending, have = ([rest] if rest.size else []), rest.size
    if have:
        yield np.concatenate(pending) if len(pending) > 1 else pending[0]


def compare_tensors(a: Tensor, b: Tensor, atol: float, rtol: float) -> dict:
    """Element-wise comparison in C order: ``|a - b| <= atol + rtol * |b|`` (b is the second
    file), NaN equal to NaN in the same place, equal infinities equal.  max_rel is
    ``|a - b| / |b|`` (inf where b == 0 != a)."""
    n = max(1, STATS_CHUNK_BYTES // 16)
    count = mismatched = nan_mismatch = 0
    max_abs = max_rel = 0.0
    for va, vb in zip(_rechunk(a.values(n), n), _rechunk(b.values(n), n)):
        count += va.size
        if va.dtype.kind in "iub" and vb.dtype.kind in "iub" and va.dtype == vb.dtype:
            if va.dtype.kind == "b":
                va, vb = va.astype(np.int64), vb.astype(np.int64)
            neq = va != vb
            if not neq.any():
                continue
            fa, fb = va[neq].astype(np.float64), vb[neq].astype(np.float64)
            diff = np.abs(fa - fb)
            bad = diff > atol + rtol * np.abs(fb)
            mismatched += int(bad.sum())
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float(_rel(diff, fb).max()))
            continue
        fa = va.astype(np.complex128 if "c" in va.dtype.kind + vb.dtype.kind else np.float64)
        fb = vb.astype(fa.dtype)
        nan_a, nan_b = np.isnan(fa), np.isnan(fb)
        both_nan = nan_a & nan_b
        one_nan = nan_a ^ nan_b
        nan_mismatch += int(one_nan.sum())
        ok = ~(nan_a | nan_b)
        fa, fb = fa[ok], fb[ok]
        same = fa == fb          # covers equal infinities
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.where(same, 0.0, np.abs(fa - fb))
            diff = np.where(np.isnan(diff), math.inf, diff)   # inf - inf of opposite signs
            bad = (diff > atol + rtol * np.abs(fb)) | (~same & (np.isinf(fa) | np.isinf(fb)))
        mismatched += int(bad.sum()) + int(one_nan.sum())
        del both_nan
        if diff.size:
            max_abs = max(max_abs, float(diff.max()))
            max_rel = max(max_rel, float(_rel(diff, np.abs(fb)).max()))
    return {"count": count, "mismatched": mismatched, "nan_mismatch": nan_mismatch,
            "max_abs": max_abs, "max_rel": max_rel}


def _rel(diff: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| / |b|; where b is 0 (or infinite): 0 if a equals b, else inf."""
    b = np.abs(b)
    usable = (b > 0) & np.isfinite(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(usable, diff / np.where(usable, b, 1),
                        np.where(diff > 0, math.inf, 0.0))


def diff(args, out: list[str]) -> int:
    with open_source(args.a) as sa, open_source(args.b) as sb:
        ea = {e.path: e for e in sa.entries()}
        eb = {e.path: e for e in sb.entries()}
        diffs: list[dict] = []
        tensors: list[dict] = []
        for path, a in ea.items():
            b = eb.get(path)
            if b is None:
                diffs.append({"path": path, "what": "missing", "a": a.kind, "b": None})
                continue
            if a.kind != b.kind:
                diffs.append({"path": path, "what": "kind", "a": a.kind, "b": b.kind})
                continue
            _diff_attrs(path, a.attrs, b.attrs, diffs)
            if a.kind != "dataset":
                continue
            if a.dtype != b.dtype:
                diffs.append({"path": path, "what": "dtype", "a": a.dtype, "b": b.dtype})
            if a.shape != b.shape:
                diffs.append({"path": path, "what": "shape", "a": list(a.shape or ()),
                              "b": list(b.shape or ())})
                continue
            if a.tensor is None or b.tensor is None:
                diffs.append({"path": path, "what": "unreadable", "a": a.dtype, "b": b.dtype})
                continue
            r = compare_tensors(a.tensor, b.tensor, args.atol, args.rtol)
            r["path"] = path
            tensors.append(r)
            if r["mismatched"]:
                diffs.append({"path": path, "what": "values", "a": None, "b": None,
                              "mismatched": r["mismatched"], "count": r["count"],
                              "max_abs": r["max_abs"], "max_rel": r["max_rel"]})
        for path, b in eb.items():
            if path not in ea:
                diffs.append({"path": path, "what": "extra", "a": None, "b": b.kind})
    same = not diffs
    if args.json:
        doc = {"schema_version": SCHEMA_VERSION, "a": args.a, "b": args.b, "atol": args.atol,
               "rtol": args.rtol, "same": same,
               "differences": [{k: json_value(v) for k, v in d.items()} for d in diffs],
               "tensors": [{k: json_value(v) for k, v in t.items()} for t in tensors]}
        out.append(json.dumps(doc, ensure_ascii=True, allow_nan=False))
    else:
        _print_diff(args, diffs, tensors, out)
    return EXIT_OK if same else EXIT_DIFFER


def _diff_attrs(path: str, a: dict, b: dict, diffs: list[dict]) -> None:
    for k, va in a.items():
        if k not in b:
            diffs.append({"path": path, "what": "attr-missing", "attr": k, "a": va, "b": None})
        elif not _values_equal(va, b[k]):
            diffs.append({"path": path, "what": "attr", "attr": k, "a": va, "b": b[k]})
    for k, vb in b.items():
        if k not in a:
            diffs.append({"path": path, "what": "attr-extra", "attr": k, "a": None, "b": vb})


def _print_diff(args, diffs: list[dict], tensors: list[dict], out: list[str]) -> None:
    out.append(f"A: {escape(args.a)}")
    out.append(f"B: {escape(args.b)}")
    for d in diffs:
        p, w = escape(d["path"]), d["what"]
        if w == "missing":
            out.append(f"only in A: {p} ({d['a']})")
        elif w == "extra":
            out.append(f"only in B: {p} ({d['b']})")
        elif w in ("kind", "dtype", "unreadable"):
            out.append(f"{w} differs: {p}: {escape(d['a'])} vs {escape(d['b'])}")
        elif w == "shape":
            out.append(f"shape differs: {p}: {fmt_shape(d['a'])} vs {fmt_shape(d['b'])}")
        elif w == "values":
            out.append(f"values differ: {p}: {d['mismatched']} of {d['count']} elements "
                       f"outside atol={args.atol:g} rtol={args.rtol:g}; max abs "
                       f"{d['max_abs']:.6g}, max rel {d['max_rel']:.6g}")
        elif w == "attr-missing":
            out.append(f"attribute only in A: {p} @{escape(d['attr'])}")
        elif w == "attr-extra":
            out.append(f"attribute only in B: {p} @{escape(d['attr'])}")
        else:
            out.append(f"attribute differs: {p} @{escape(d['attr'])}: {fmt_value(d['a'])} "
                       f"vs {fmt_value(d['b'])}")
    close = [t for t in tensors if not t["mismatched"] and t["max_abs"] > 0]
    for t in close:
        out.append(f"within tolerance: {escape(t['path'])}: max abs {t['max_abs']:.6g}, "
                   f"max rel {t['max_rel']:.6g}")
    n_val = sum(1 for d in diffs if d["what"] == "values")
    out.append(f"{len(tensors)} datasets compared, {n_val} with values outside tolerance, "
               f"{len(diffs)} differences in all: "
               + ("files are the same" if not diffs else "files differ"))


# ----------------------------------------------------------------------------- convert

_H5_EXT = (".h5", ".hdf5", ".he5", ".hdf")


def convert(args, out: list[str]) -> int:
    from .hdf5 import from_hdf5, to_hdf5
    from .safetensors_io import safetensors_to_hdf5, safetensors_to_kdtr
    src_fmt = detect_format(args.src)
    dst = args.dst.lower()
    dst_fmt = "hdf5" if dst.endswith(_H5_EXT) else "kdtr" if dst.endswith(".kdtr") else None
    if dst_fmt is None:
        raise LookupError(f"DST must end in .kdtr or one of {', '.join(_H5_EXT)} "
                          "(safetensors is read, never written)")
    if src_fmt == dst_fmt:
        raise LookupError(f"{escape(args.src)} is already {src_fmt}")
    if os.path.exists(args.dst) and os.path.samefile(args.src, args.dst):
        raise LookupError("SRC and DST are the same file")
    bar = ProgressBar("convert", progress_enabled(args))
    try:
        if src_fmt == "kdtr":
            to_hdf5(args.src, args.dst, progress=bar)
        elif src_fmt == "hdf5":
            from_hdf5(args.src, args.dst, progress=bar)
        elif dst_fmt == "kdtr":
            safetensors_to_kdtr(args.src, args.dst, split_dots=args.split_dots, progress=bar)
        else:
            safetensors_to_hdf5(args.src, args.dst, split_dots=args.split_dots, progress=bar)
    finally:
        bar.close()
    with open_source(args.dst) as check:
        entries = check.entries()
    n = sum(1 for e in entries if e.kind == "dataset")
    size = sum(e.nbytes or 0 for e in entries if e.kind == "dataset")
    out.append(f"wrote {escape(args.dst)} ({dst_fmt}): {n} datasets, {size:,} bytes of data "
               f"from {escape(args.src)} ({src_fmt})")
    return EXIT_OK


# ----------------------------------------------------------------------------- CLI

def _inspect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdtr-dump", description="Inspect a .kdtr, .h5 or .safetensors file. Other "
        "commands: 'kdtr-dump diff A B', 'kdtr-dump convert SRC DST' (see --help of each).")
    p.add_argument("file", nargs="?", help="the file to inspect")
    p.add_argument("-a", "--attrs", action="store_true", help="show attribute values")
    p.add_argument("--stats", action="store_true",
                   help="min/max/mean/std/absmax and NaN/Inf/zero counts per dataset")
    p.add_argument("-d", "--dataset", metavar="PATH", help="print the values of one dataset")
    p.add_argument("--slice", metavar="SEL", help='with -d: a selection like "0:4,:8"')
    p.add_argument("-f", "--filter", action="append", metavar="GLOB",
                   help="only paths matching GLOB (fnmatch; repeatable)")
    p.add_argument("--summary", action="store_true",
                   help="counts, parameters, bytes per dtype and per top-level entry, "
                        "numbered components collapsed")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    p.add_argument("--offsets", action="store_true", help="show file offsets of datasets")
    p.add_argument("--verify", action="store_true",
                   help="check every checksum; exit 0 intact, 3 corrupt, 2 unreadable")
    p.add_argument("--progress", action="store_true",
                   help="progress bar on stderr even when it is not a terminal")
    p.add_argument("--sample", metavar="OUT", help="write the sample model to OUT and exit")
    return p


def _diff_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdtr-dump diff", description="Compare two files "
                                "(any of .kdtr, .h5, .safetensors). Exit 0 same, 1 differ, "
                                "2 error.")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--rtol", type=float, default=0.0,
                   help="relative tolerance, times |B| (default 0)")
    p.add_argument("--json", action="store_true")
    return p


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdtr-dump convert", description="Convert between .kdtr "
                                "and .h5; .safetensors as input. DST's extension picks the "
                                "output format.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--split-dots", action="store_true",
                   help="safetensors input: turn '.' in tensor names into '/' (groups)")
    p.add_argument("--progress", action="store_true",
                   help="progress bar on stderr even when it is not a terminal")
    return p


def _run(argv: list[str], out: list[str]) -> int:
    if argv and argv[0] == "diff":
        return diff(_diff_parser().parse_args(argv[1:]), out)
    if argv and argv[0] == "convert":
        return convert(_convert_parser().parse_args(argv[1:]), out)
    parser = _inspect_parser()
    args = parser.parse_args(argv)
    if args.sample:
        from .sample import write_sample
        write_sample(args.sample)
        out.append(f"wrote {escape(args.sample)}")
        return EXIT_OK
    if not args.file:
        parser.error("a FILE is needed (or --sample OUT)")
    if args.slice and not args.dataset:
        parser.error("--slice goes with -d PATH")
    return inspect(args, out)


def main(argv: list[str] | None = None) -> int:
    """The ``kdtr-dump`` entry point; returns the exit code (and prints nothing else)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    out: list[str] = []
    try:
        code = _run(argv, out)
    except SystemExit as e:   # argparse: --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    except KdtrError as e:
        _emit(out)
        return _fail(str(e))
    except FileNotFoundError as e:
        _emit(out)
        return _fail(f"{e.filename}: no such file")
    except (OSError, LookupError, ValueError) as e:
        _emit(out)
        return _fail(f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    _emit(out)
    return code


def _fail(message: str) -> int:
    sys.stderr.write(f"kdtr-dump: error: {escape(message, backslash=False)}\n")
    return EXIT_ERROR


def _emit(lines: list[str]) -> None:
    if not lines:
        return
    text = "\n".join(lines) + "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:   # `kdtr-dump big.kdtr | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
    except UnicodeEncodeError:
        sys.stdout.write(text.encode("ascii", "backslashreplace").decode("ascii"))


if __name__ == "__main__":
    sys.exit(main())

"""kdtr-dump FILE: the listing, ``--summary``, ``--stats``, ``-d PATH`` previews and
``--verify`` (docs/KDTR_DUMP.md, "Listing" to "Integrity").
"""
from __future__ import annotations

import fnmatch
import itertools
import json
import math
import re
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from ..console import UsageError
from ..dtypes import BY_NAME
from ..errors import KdtrError
from ..int4_group import (ATTR_FORMAT, Int4GroupWeight, WeightFormatError, describe,
                          dequantized_blocks, read_weight, stored_layout)
from ..progress import ProgressBar, human_bytes, ticker
from . import sources
from .output import (EXIT_CORRUPT, EXIT_OK, LOW_FLOATS, SCHEMA_VERSION, escape, fmt_shape,
                     fmt_value, json_float, json_value, table)
from .sources import (UNREADABLE_CODES, Entry, KdtrSource, Tensor, normalize_key,
                      open_source, result_shape, widen)

PREVIEW_EDGE = 3                    # numpy edgeitems for -d previews
PREVIEW_FULL = 1000                 # previews up to this many elements print whole


# ----------------------------------------------------------------------------- statistics

def tensor_stats(t: Tensor, tick: Callable[[int], None] = lambda n: None) -> dict:
    """min, max, absmax over non-NaN values; mean, std (population) over finite values;
    NaN/Inf/zero counts.  float64 accumulation, Chan's parallel combination per chunk, at most
    ``STATS_CHUNK_BYTES`` of float64 at a time.  Complex: statistics of |z|."""
    n_max = max(1, sources.STATS_CHUNK_BYTES // 8)
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


# ----------------------------------------------------------------------------- weight formats

def weight_formats(entries: list[Entry]) -> dict[str, dict]:
    """path -> what formats/int4_group.py's ``describe`` says of every KDTR group that stores
    a weight format (``weight.format`` attribute); a malformed one -> ``{"error": ...}``."""
    out = {}
    for e in entries:
        if e.kind != "group" or not e.attr_count or not isinstance(e.source, KdtrSource) \
                or ATTR_FORMAT not in e.attrs:
            continue
        try:
            out[e.path] = describe(e.source.file[e.path], e.path)
        except WeightFormatError as err:
            out[e.path] = {"error": str(err)}
    return out


def format_line(d: dict) -> str:
    """One listing line for a stored weight format."""
    if "error" in d:
        return f"    weight format: MALFORMED: {escape(d['error'])}"
    s = d["scale"]
    return (f"    {d['format']}: group {d['group_size']}, {d['bits_per_weight']:.2f} bits/weight, "
            f"weight {fmt_shape(d['shape'])}, {d['nbytes']:,} bytes; bf16 scales min "
            f"{_fmt_stat(s['min'])} max {_fmt_stat(s['max'])} mean {_fmt_stat(s['mean'])}, "
            f"{s['zero']} zero, {s['nonfinite']} non-finite")


class _Dequantized:
    """A stored weight format's dequantised values (float64) as ``tensor_stats`` and
    ``preview`` read a dataset: ``--stats`` and ``-d`` of an int4-group weight show ``q *
    scale``."""
    dtype = BY_NAME["float64"]

    def __init__(self, group):
        self.group = group
        self.shape = stored_layout(group).shape

    def blocks(self, max_elems: int):
        return dequantized_blocks(self.group, max_elems)

    def read(self, key: tuple, normalized: bool = False) -> np.ndarray:
        """The selection ``key`` of the values: the selected rows are dequantised whole, then
        the last axis is selected."""
        if not normalized:
            key = normalize_key(key, self.shape)
        w = read_weight(self.group, verify=False)
        packed, scale = w.packed, w.scale
        for axis in reversed(range(len(key) - 1)):   # from the back: an int drops its axis
            idx = _indices(key[axis])
            packed, scale = np.take(packed, idx, axis=axis), np.take(scale, idx, axis=axis)
        values = Int4GroupWeight(packed, scale, w.group_size).dequantize()
        return np.take(values, _indices(key[-1]), axis=-1)


def _indices(k):
    """A ``normalize_key`` entry (an int, or a slice with ``range`` semantics) for np.take."""
    return k if isinstance(k, int) else np.arange(k.start, k.stop, k.step)


def _weight_view(e: Entry):
    """``-d`` of a stored weight format: a stand-in for the entry whose tensor is the
    dequantised values, or None when ``e`` is no such group."""
    if e.kind != "group" or not e.attr_count or not isinstance(e.source, KdtrSource) \
            or ATTR_FORMAT not in e.attrs:
        return None
    try:
        tensor = _Dequantized(e.source.file[e.path])
    except WeightFormatError as err:
        raise UsageError(f"-d {escape(e.path)}: {escape(str(err))}") from None
    return SimpleNamespace(path=e.path, dtype=f"{e.attrs[ATTR_FORMAT]} dequantised, float64",
                           shape=tensor.shape, tensor=tensor)


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
    shape = result_shape(key)
    head = f"{escape(e.path)}: {escape(e.dtype)} {fmt_shape(e.shape)}"
    if slice_text:
        head += f", selection [{escape(slice_text)}] -> {fmt_shape(shape)}"
    edge = 3 if len(shape) <= 3 else 2 if len(shape) <= 5 else 1
    full = math.prod(shape) <= PREVIEW_FULL
    arr = t.read(key, normalized=True) if full else _corners(t, key, edge)
    opts = dict(edgeitems=edge, linewidth=120, threshold=PREVIEW_FULL if full else 0,
                floatmode="unique")
    if e.dtype in LOW_FLOATS and arr.size:
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
        formats = weight_formats(entries)
        if args.stats:
            stats = compute_stats(entries, args, formats)
        if args.json:
            doc = {"schema_version": SCHEMA_VERSION, "format": src.format, "file": args.file,
                   "version": src.version,
                   "nodes": [json_node(e, stats, formats.get(e.path)) for e in entries]}
            if args.summary:
                doc["summary"] = summarize(entries)
            out.append(json.dumps(doc, ensure_ascii=True, allow_nan=False))
            return EXIT_OK
        out.append(f"{escape(args.file)}: {src.format} {src.version}")
        if args.summary:
            print_summary(summarize(entries), out)
            return EXIT_OK
        listing(entries, args, stats, out, formats)
    return EXIT_OK


def json_node(e: Entry, stats: dict, weight_format: dict | None = None) -> dict:
    node = {"path": e.path, "kind": e.kind, "dtype": e.dtype,
            "shape": None if e.shape is None else list(e.shape), "nbytes": e.nbytes,
            "attrs": {k: json_value(v) for k, v in e.attrs.items()}}
    if e.target is not None:
        node["target"] = e.target
    if weight_format is not None:
        node["weight_format"] = {k: json_float(v) if isinstance(v, float) else v
                                 for k, v in weight_format.items()}
        if "scale" in weight_format:
            node["weight_format"]["scale"] = {
                k: json_float(v) if isinstance(v, float) else v
                for k, v in weight_format["scale"].items()}
    if e.path in stats:
        node["stats"] = {k: json_float(v) if isinstance(v, float) else v
                         for k, v in stats[e.path].items()}
    return node


def listing(entries: list[Entry], args, stats: dict, out: list[str],
            formats: dict | None = None) -> None:
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
        wf = (formats or {}).get(e.path, {})
        if "format" in wf:   # a stored weight reads like the tensor it stands for
            row[2:5] = [wf["format"], fmt_shape(wf["shape"]), str(wf["nbytes"])]
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
        if formats and e.path in formats:
            attr_lines.setdefault(len(rows) - 1, []).append(format_line(formats[e.path]))
    right = {4, 5} | ({6} if args.offsets else set())
    if stats:
        start = 7 if args.offsets else 6
        right |= set(range(start, start + 8))
    for i, line in enumerate(table(rows, right)):
        out.append(line)
        out.extend(attr_lines.get(i, ()))


def compute_stats(entries: list[Entry], args, formats: dict | None = None) -> dict:
    todo = [e for e in entries if e.decodable]
    formats = formats or {}
    weights = [e for e in entries if e.path in formats and "error" not in formats[e.path]]
    total = sum(e.nbytes or 0 for e in todo)
    bar = ProgressBar("stats", force=args.progress)
    tick = ticker(total, bar)
    try:
        stats = {e.path: tensor_stats(e.tensor, tick) for e in todo}
        for e in weights:   # a stored weight format: statistics of its dequantised values
            # (not ticked: its datasets' bytes, read again here, are counted above)
            stats[e.path] = tensor_stats(_Dequantized(e.source.file[e.path]))
        return stats
    finally:
        bar.close()


def show_dataset(entries: list[Entry], args, out: list[str]) -> int:
    want = "/" + args.dataset.strip("/")
    match = next((e for e in entries if e.path == want), None)
    if match is None:
        raise UsageError(f"-d {escape(want)}: no such dataset in {escape(args.file)}")
    match = _weight_view(match) or match
    if match.tensor is None:
        raise UsageError(f"-d {escape(want)}: a {match.kind}"
                         + (f" of type {escape(match.dtype)}" if match.dtype else "")
                         + f" in {escape(args.file)}, not a dataset whose values can be shown")
    try:
        out.extend(preview(match, args.slice))
    except (IndexError, ValueError) as e:
        raise UsageError(f"--slice {escape(args.slice)}: {e} (a selection like "
                         f"\"0:4,:8\" for {escape(args.dataset)} of shape "
                         f"{fmt_shape(match.shape)})") from None
    return EXIT_OK


def verify(args, out: list[str]) -> int:
    """Exit 0 intact, 3 corrupt (a file of the format that fails a check), 2 unreadable
    (missing, not a regular file, not a format we read, a newer major version)."""
    bar = ProgressBar("verify", force=args.progress)
    try:
        with open_source(args.file) as src:
            what = src.verify(bar)
    except KdtrError as e:
        if e.code in UNREADABLE_CODES:
            raise
        out.append(f"CORRUPT {escape(args.file)}: "
                   f"{escape(e.describe(with_file=False), backslash=False)}")
        return EXIT_CORRUPT
    finally:
        bar.close()
    out.append(f"OK {escape(args.file)} ({src.format}): {what}")
    return EXIT_OK


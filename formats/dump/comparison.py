"""kdtr-dump diff A B: a tolerant comparison of two files of any of the formats
(docs/KDTR_DUMP.md, "Comparing files").
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterator

import numpy as np

from . import sources
from ..console import UsageError
from .output import (EXIT_DIFFER, EXIT_OK, SCHEMA_VERSION, escape, fmt_shape, fmt_value,
                     json_value)
from .sources import Tensor, open_source


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


def check_tolerances(atol: float, rtol: float) -> None:
    """``--atol`` and ``--rtol`` must be finite and >= 0: a NaN tolerance would make every
    comparison false (two files "the same" whatever they hold), an infinite one accept every
    finite difference, a negative one refuse equal values (``UsageError`` naming the option)."""
    for option, value in (("--atol", atol), ("--rtol", rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{option} {value:g}: must be a finite number >= 0")


def compare_tensors(a: Tensor, b: Tensor, atol: float, rtol: float) -> dict:
    """Element-wise comparison in C order: ``|a - b| <= atol + rtol * |b|`` (b is the second
    file), NaN equal to NaN in the same place, equal infinities equal.  max_rel is
    ``|a - b| / |b|`` (inf where b == 0 != a).  The tolerances: see ``check_tolerances``."""
    check_tolerances(atol, rtol)
    n = max(1, sources.STATS_CHUNK_BYTES // 16)
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
    check_tolerances(args.atol, args.rtol)   # before a file is opened
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

"""How kdtr-dump writes: terminal-safe escaping, shapes, attribute values, JSON values,
aligned tables, the JSON schema version and the exit codes (docs/KDTR_DUMP.md, "Terminal
safety", "Machine-readable output", "Exit codes").
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..console import escape
from ..dtypes import DType, dtype_for

SCHEMA_VERSION = 1
EXIT_OK, EXIT_DIFFER, EXIT_ERROR, EXIT_CORRUPT = 0, 1, 2, 3


# ----------------------------------------------------------------------------- escaping
# ``escape`` lives in formats.console (every console script's error line uses it); kdtr-dump
# reaches it from here.

LOW_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def display_array(raw: np.ndarray, dt: DType) -> np.ndarray:
    if dt.name in LOW_FLOATS:
        return np.asarray(raw).astype(np.float32)
    return np.asarray(raw)


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
        shown = value.astype(np.float32) if value.dtype.name in LOW_FLOATS else value
        text = np.array2string(shown, threshold=16, edgeitems=3, max_line_width=10 ** 6,
                               separator=", ")
        text = " ".join(text.split())
        if len(text) > width:
            text = text[:width - 3] + "..."
        return f"{_dtype_name(value.dtype)}{fmt_shape(value.shape)} {text}"
    return escape(repr(value))


def _dtype_name(dt: np.dtype) -> str:
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


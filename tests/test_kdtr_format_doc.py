"""docs/FORMAT.md and its machine-readable twin (formats.layout, formats.dtypes) agree.

The markdown tables are parsed: error codes, the preamble / node / attribute record layouts
(offset and size of every field, in order), the dtype codes and the limits.
"""
from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from formats import layout as L
from formats.dtypes import BY_CODE

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def _sections() -> dict[str, str]:
    text = FORMAT_MD.read_text(encoding="utf-8")
    parts = re.split(r"^## +(.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def _table(section_title: str, first_header: str) -> list[list[str]]:
    """The rows (cells stripped) of the table in ``section_title`` whose first header cell is
    ``first_header``."""
    body = next(b for t, b in _sections().items() if t.startswith(section_title))
    rows, inside = [], False
    for line in body.splitlines():
        if not line.startswith("|"):
            if inside:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not inside:
            inside = cells[0] == first_header
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the |---|---| separator
        rows.append(cells)
    assert rows, f"no table starting with {first_header!r} in section {section_title!r}"
    return rows


# ----------------------------------------------------------------------------- error codes

def test_error_code_table_matches_rules():
    rows = _table("Validation order", "code")
    codes = [r[0] for r in rows]
    assert len(codes) == len(set(codes)), "a code is listed twice"
    assert all(re.fullmatch(r"K\d{3}", c) for c in codes), codes
    assert set(codes) == set(L.RULES), sorted(set(codes) ^ set(L.RULES))
    assert all(r[1] for r in rows), "a code without a rule text"


def test_codes_are_contiguous_and_never_reused():
    numbers = sorted(int(c[1:]) for c in L.RULES)
    assert numbers == list(range(1, len(numbers) + 1))


# ----------------------------------------------------------------------------- record layouts

DOC_FIELD_NAMES = {  # FORMAT.md's wording -> the dtype's field name (others are spelled alike)
    "byte-order mark": "bom", "major version": "major", "minor version": "minor",
    "required features": "features_required", "optional features": "features_optional",
}


def _doc_layout(section: str) -> list[tuple[int, int, str]]:
    rows = _table(section, "offset")
    return [(int(r[0]), int(r[1]), DOC_FIELD_NAMES.get(r[2], r[2])) for r in rows]


def _dtype_layout(dtype: np.dtype) -> list[tuple[int, int, str]]:
    out = []
    for name in dtype.names:
        sub, off = dtype.fields[name][:2]
        out.append((off, sub.itemsize, name))
    return sorted(out)


@pytest.mark.parametrize("section,dtype,size", [
    ("Preamble", L.PREAMBLE_DTYPE, L.PREAMBLE_SIZE),
    ("Node table", L.NODE_DTYPE, L.NODE_SIZE),
    ("Attribute table", L.ATTR_DTYPE, L.ATTR_SIZE),
], ids=["preamble", "node", "attribute"])
def test_record_tables_match_dtypes(section, dtype, size):
    doc = _doc_layout(section)
    code = _dtype_layout(dtype)
    assert [(o, s) for o, s, _ in doc] == [(o, s) for o, s, _ in code]
    for (_, _, doc_name), (off, _, name) in zip(doc, code):
        if doc_name == "reserved":
            assert re.fullmatch(r"reserved\d*", name), (off, name)
        else:
            assert doc_name == name, (off, doc_name, name)
    # the fields tile the record exactly
    ends = [o + s for o, s, _ in doc]
    assert [o for o, _, _ in doc] == [0] + ends[:-1] and ends[-1] == size == dtype.itemsize


def test_preamble_constants_match_the_text():
    rows = {r[2]: r[3] for r in _table("Preamble", "offset")}
    magic = re.search(r"`([0-9A-F ]+)`", rows["magic"]).group(1)
    assert bytes.fromhex(magic) == L.MAGIC
    assert f"0x{L.BOM:08X}" in rows["byte-order mark"]
    assert rows["major version"] == str(L.VERSION_MAJOR)
    assert rows["align_log2"].startswith(f"{L.MIN_ALIGN_LOG2}..{L.MAX_ALIGN_LOG2}")
    assert f"writers default to {L.DEFAULT_ALIGN_LOG2}" in rows["align_log2"]
    assert rows["node_count"].startswith(f"1..{L.MAX_NODES:,}")
    assert rows["attr_count"].startswith(f"0..{L.MAX_ATTRS:,}")


# ----------------------------------------------------------------------------- dtypes

def test_dtype_table_matches_by_code():
    rows = _table("Dtype codes", "code")
    doc = {int(r[0]): (r[1], Fraction(r[2])) for r in rows}
    assert set(doc) == set(BY_CODE)
    for code, dt in BY_CODE.items():
        name, itemsize = doc[code]
        assert name == dt.name, code
        assert itemsize == Fraction(dt.nbytes(2), 2), (code, itemsize)  # int4: 1/2


# ----------------------------------------------------------------------------- limits

def _quantity(text: str) -> int:
    text = text.strip().replace(",", "")
    m = re.fullmatch(r"2\^(\d+)(?: bytes)?", text)
    if m:
        return 1 << int(m.group(1))
    m = re.fullmatch(r"(\d+) (MiB|KiB|bytes)", text)
    if m:
        return int(m.group(1)) << {"MiB": 20, "KiB": 10, "bytes": 0}[m.group(2)]
    return int(text)


def test_limits_table_matches_layout():
    rows = {r[0]: r[1] for r in _table("Limits", "what")}
    nodes, attrs = rows["nodes / attributes"].split("/")
    name, path, depth = rows["name / path / depth"].split("/")
    assert _quantity(rows["header section"]) == L.MAX_HEADER_BYTES
    assert (_quantity(nodes), _quantity(attrs)) == (L.MAX_NODES, L.MAX_ATTRS)
    assert _quantity(rows["ndim"]) == L.MAX_NDIM
    assert _quantity(rows["one dimension"]) == L.MAX_DIM
    assert _quantity(rows["one tensor"]) == L.MAX_TENSOR_BYTES
    assert (_quantity(name), _quantity(path), _quantity(depth)) == (
        L.MAX_NAME_BYTES, L.MAX_PATH_BYTES, L.MAX_DEPTH)
    assert _quantity(rows["one attribute value"]) == L.MAX_ATTR_VALUE_BYTES

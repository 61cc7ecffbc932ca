"""The kdtr-dump CLI (formats/dump/), driven through ``main(argv)`` and once as the installed
console script.  Values are checked against numpy and against the files read directly."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

from formats import dump, kdtr
from formats.hdf5 import to_hdf5
from formats.sample import SAMPLE_CONFIG

SAMPLE = "tests/vectors/sample_model.kdtr"


@pytest.fixture(scope="module")
def no_fsync():
    """Durability is not under test; fsync costs ~6 ms a file here (Hypothesis writes many)."""
    import os
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        yield


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = dump.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(out: str, path: str) -> list[str]:
    """The listing row of ``path`` split on runs of 2+ spaces."""
    for line in out.splitlines():
        if line.split("  ", 1)[0] == path:
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"{path} not listed in:\n{out}")


# ----------------------------------------------------------------------------- listing

def test_sample_file_is_what_write_sample_writes(tmp_path, capsys):
    code, out, _ = run(capsys, "--sample", tmp_path / "s.kdtr")
    assert code == 0 and "wrote" in out
    assert (tmp_path / "s.kdtr").read_bytes() == open(SAMPLE, "rb").read()
    assert 100_000 <= (tmp_path / "s.kdtr").stat().st_size <= 300_000


def test_listing_shows_every_node(capsys):
    code, out, _ = run(capsys, SAMPLE)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{SAMPLE}: kdtr 1.0"
    assert lines[1].split() == ["PATH", "KIND", "DTYPE", "SHAPE", "BYTES", "ATTRS"]
    with kdtr.File(SAMPLE) as f:
        paths = ["/"]
        f.visit(lambda p: paths.append("/" + p))
        assert len(lines) == 2 + len(paths)
        assert sorted(line.split()[0] for line in lines[2:]) == sorted(paths)
        ds = f["layers/0/attn/kv_a_proj"]
        assert row(out, "/layers/0/attn/kv_a_proj") == [
            "/layers/0/attn/kv_a_proj", "dataset", "bfloat16", "[20, 64]",
            str(ds.storage_nbytes), "0"]
    assert row(out, "/") == ["/", "group", str(len(SAMPLE_CONFIG) + 1)]
    assert row(out, "/layers/1")[-1] == "1"


def test_attrs_filter_and_offsets(capsys):
    code, out, _ = run(capsys, SAMPLE, "-a", "-f", "/", "-f", "layers/*/mlp/router", "--offsets")
    assert code == 0
    assert '    @model_type = "deepseek_v3"' in out
    assert '    @architectures = ["DeepseekV3ForCausalLM"]' in out
    assert "    @rms_norm_eps = 1e-06" in out and "    @norm_topk_prob = True" in out
    assert '    @scoring = "sigmoid"' in out
    with kdtr.File(SAMPLE) as f:
        assert row(out, "/layers/1/mlp/router")[-1] == str(f["layers/1/mlp/router"].offset)
    listed = [line.split()[0] for line in out.splitlines()[2:] if not line.startswith(" ")]
    assert listed == ["/", "/layers/1/mlp/router"]


def test_hdf5_listing_matches_kdtr_listing(tmp_path, capsys):
    to_hdf5(SAMPLE, tmp_path / "s.h5")
    _, kd, _ = run(capsys, SAMPLE, "-a")
    code, h5, _ = run(capsys, tmp_path / "s.h5", "-a")
    assert code == 0
    assert h5.splitlines()[1:] == kd.splitlines()[1:]     # markers hidden, same order


def test_json_schema_and_values(tmp_path, capsys):
    p = tmp_path / "j.kdtr"
    with kdtr.File(p, "w") as f:
        f.attrs["bf"] = np.array([1.5, -2.0], ml_dtypes.bfloat16)
        f.attrs["nan"] = float("nan")
        f.attrs["names"] = ["a", "b"]
        f.attrs["z"] = np.array([[1 + 2j]], np.complex64)
        f.attrs["n"] = 7
        d = f.create_dataset("g/w", data=np.arange(6, dtype=np.float32).reshape(2, 3))
        d.attrs["on"] = True
        f.create_dataset("g/q", data=np.array([[1, -8]], np.int8), dtype="int4")
    code, out, _ = run(capsys, p, "--json", "--stats")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"schema_version", "format", "file", "version", "nodes"}
    assert (doc["schema_version"], doc["format"], doc["version"]) == (1, "kdtr", "1.0")
    nodes = {n["path"]: n for n in doc["nodes"]}
    assert list(nodes) == ["/", "/g", "/g/w", "/g/q"]
    assert nodes["/"]["attrs"] == {"bf": [1.5, -2.0], "nan": "nan", "names": ["a", "b"],
                                   "z": [[[1.0, 2.0]]], "n": 7}
    assert nodes["/g"] == {"path": "/g", "kind": "group", "dtype": None, "shape": None,
                           "nbytes": None, "attrs": {}}
    w = nodes["/g/w"]
    assert {k: w[k] for k in ("kind", "dtype", "shape", "nbytes", "attrs")} == {
        "kind": "dataset", "dtype": "float32", "shape": [2, 3], "nbytes": 24,
        "attrs": {"on": True}}
    assert w["stats"] == {"count": 6, "min": 0.0, "max": 5.0, "mean": 2.5,
                          "std": pytest.approx(np.arange(6).std()), "absmax": 5.0,
                          "nan": 0, "inf": 0, "zero": 1}
    assert nodes["/g/q"]["nbytes"] == 1 and nodes["/g/q"]["stats"]["min"] == -8.0


# ----------------------------------------------------------------------------- statistics

def numpy_stats(values: np.ndarray) -> dict:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    keep, fin = v[~np.isnan(v)], v[np.isfinite(v)]
    return {"count": v.size, "min": keep.min() if keep.size else None,
            "max": keep.max() if keep.size else None,
            "mean": fin.mean() if fin.size else None, "std": fin.std() if fin.size else None,
            "absmax": np.abs(keep).max() if keep.size else None,
            "nan": int(np.isnan(v).sum()), "inf": int(np.isinf(v).sum()),
            "zero": int((v == 0).sum())}


def stats_file(path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    f32 = (rng.standard_normal((37, 11)) * 3 + 100).astype(np.float32)
    f32[0, :3] = [np.nan, np.inf, -np.inf]
    f32[5, 5] = 0
    data = {"f32": f32,
            "bf16": rng.standard_normal((9, 40)).astype(ml_dtypes.bfloat16),
            "fp8": rng.standard_normal(50).astype(ml_dtypes.float8_e4m3fn),
            "u8": rng.integers(0, 255, 300).astype(np.uint8),
            "i64": rng.integers(-10 ** 6, 10 ** 6, 77),
            "flags": rng.random(31) > 0.5,
            "scalar": np.array(-2.5, np.float64),
            "empty": np.zeros((0, 4), np.float32),
            "allnan": np.full(5, np.nan, np.float16)}
    i4 = rng.integers(-8, 8, (13, 6)).astype(np.int8)
    with kdtr.File(path, "w") as f:
        for name, arr in data.items():
            f[name] = arr
        f.create_dataset("i4", data=i4, dtype="int4")
    data["i4"] = i4
    return data


@pytest.mark.parametrize("fmt", ["kdtr", "h5"])
def test_stats_match_numpy_in_small_chunks(tmp_path, capsys, monkeypatch, fmt):
    monkeypatch.setattr(dump.sources, "STATS_CHUNK_BYTES", 96)  # 12 float64 per chunk: many chunks
    data = stats_file(tmp_path / "s.kdtr")
    target = tmp_path / "s.kdtr"
    if fmt == "h5":
        to_hdf5(target, tmp_path / "s.h5")
        target = tmp_path / "s.h5"
    code, out, _ = run(capsys, target, "--stats", "--json")
    assert code == 0
    got = {n["path"]: n["stats"] for n in json.loads(out)["nodes"] if "stats" in n}
    assert set(got) == {"/" + k for k in data}
    for name, arr in data.items():
        want = numpy_stats(arr.astype(np.float64))
        for key, value in want.items():
            g = got["/" + name][key]
            if value is None:
                assert g is None, (name, key)
            elif key in ("mean", "std"):
                assert g == pytest.approx(value, rel=1e-12, abs=1e-12), (name, key)
            else:
                assert g == (value if math.isfinite(value) else
                             ("inf" if value > 0 else "-inf")), (name, key)


def test_stats_table(capsys):
    code, out, _ = run(capsys, SAMPLE, "--stats", "-f", "norm")
    assert code == 0
    with kdtr.File(SAMPLE) as f:
        want = numpy_stats(f["norm"][...])
    r = row(out, "/norm")
    assert r[6:] == [f"{want[k]:.6g}" for k in ("min", "max", "mean", "std", "absmax")] + \
        ["0", "0", "0"]


def test_progress_goes_to_stderr_only(capsys):
    code, out, err = run(capsys, SAMPLE, "--stats", "--json", "--progress")
    assert code == 0 and err and json.loads(out)
    code, out, err = run(capsys, SAMPLE, "--stats", "--json")
    assert err == ""          # not a terminal, no --progress: no bar


# ----------------------------------------------------------------------------- summary

def test_summary_collapses_numbered_components(capsys):
    code, out, _ = run(capsys, SAMPLE, "--summary")
    assert code == 0
    lines = out.splitlines()
    assert re.search(r"^  layers/#/attn/kv_a_proj\s+x2\s+bfloat16\s+\[20, 64\]\s+5,120$",
                     out, re.M), out
    assert re.search(r"^  layers/#/mlp/experts/#/gate_proj\s+x4\s+bfloat16\s+\[16, 64\]\s+"
                     r"8,192$", out, re.M), out
    assert lines[1].startswith("groups: 13   datasets: 41   parameters: 83,108")
    code, out, _ = run(capsys, SAMPLE, "--summary", "--json")
    s = json.loads(out)["summary"]
    with kdtr.File(SAMPLE) as f:
        sizes = {}
        f.visititems(lambda p, o: sizes.__setitem__(p, o.storage_nbytes)
                     if isinstance(o, kdtr.Dataset) else None)
    assert s["datasets"] == len(sizes) and s["nbytes"] == sum(sizes.values())
    top = {d["name"]: d["nbytes"] for d in s["by_top_level"]}
    assert top["layers"] == sum(v for k, v in sizes.items() if k.startswith("layers/"))
    assert sum(d["share"] for d in s["by_dtype"]) == pytest.approx(100, abs=0.02)


def test_summary_mixed_dtype_and_shape(tmp_path, capsys):
    with kdtr.File(tmp_path / "m.kdtr", "w") as f:
        f["blocks/0/w"] = np.zeros(2, np.float32)
        f["blocks/1/w"] = np.zeros(3, ml_dtypes.bfloat16)
        f["blocks/2/w"] = np.zeros(3, ml_dtypes.bfloat16)
    code, out, _ = run(capsys, tmp_path / "m.kdtr", "--summary", "--json")
    (pattern,) = json.loads(out)["summary"]["patterns"]
    assert pattern == {"pattern": "blocks/#/w", "count": 3, "dtype": "mixed", "shape": "mixed",
                       "parameters": 8, "nbytes": 20}


# ----------------------------------------------------------------------------- previews

def test_preview_with_slice_decodes_bf16(capsys):
    code, out, _ = run(capsys, SAMPLE, "-d", "layers/0/attn/q_a_proj", "--slice", "0:2,::-20")
    assert code == 0
    with kdtr.File(SAMPLE) as f:
        want = f["layers/0/attn/q_a_proj"][0:2, ::-20].astype(np.float32)
    head, *body = out.splitlines()
    assert head.endswith("-> [2, 4]")
    got = np.array([numbers(line) for line in body]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.astype(np.float32), want)   # shortest bf16 decimals
    assert max(len(t) for line in body for t in re.findall(r"[-\d.e]+", line)) <= 8


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?", line)]


def test_preview_of_a_large_dataset_shows_corners(capsys):
    code, out, _ = run(capsys, SAMPLE, "-d", "embed")
    assert code == 0
    with kdtr.File(SAMPLE) as f:
        e = f["embed"][...].astype(np.float32)
    body = out.splitlines()[1:]
    assert len(body) == 7 and body[3].strip() == "..."       # 3 rows, ..., 3 rows
    for line, r in zip(body[:3] + body[4:], [0, 1, 2, -3, -2, -1]):
        assert line.split().count("...") == 1
        shown = np.array(numbers(line)).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(shown, np.r_[e[r, :3], e[r, -3:]])


slices = st.one_of(st.integers(-6, 5), st.builds(
    slice, st.none() | st.integers(-7, 7), st.none() | st.integers(-7, 7),
    st.none() | st.sampled_from([1, 2, 3, -1, -2])))


@given(st.lists(slices, max_size=2), st.sampled_from(["int4", "bfloat16", "int16"]))
def test_tensor_read_matches_numpy(tmp_path_factory, no_fsync, key, dtype_name):
    """Selections on KDTR views and on HDF5 datasets (int4 packed, negative steps) agree with
    numpy indexing of the decoded array."""
    d = tmp_path_factory.mktemp("read")
    values = (np.arange(36).reshape(6, 6) % 16 - 8).astype(np.int8)
    arr = values if dtype_name == "int4" else values.astype(
        {"bfloat16": ml_dtypes.bfloat16, "int16": np.int16}[dtype_name])
    with kdtr.File(d / "t.kdtr", "w") as f:
        f.create_dataset("t", data=arr, dtype=dtype_name)
    to_hdf5(d / "t.kdtr", d / "t.h5")
    try:
        want = arr[tuple(key)]
    except IndexError:
        want = None
    for path in (d / "t.kdtr", d / "t.h5"):
        with dump.open_source(str(path)) as src:
            entry = next(e for e in src.entries() if e.path == "/t")
            if want is None:
                with pytest.raises(IndexError):
                    entry.tensor.read(tuple(key))
                continue
            got = entry.tensor.read(tuple(key))
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype))


@given(st.lists(slices, max_size=3), st.sampled_from(["int16", "int4"]))
def test_summarised_preview_matches_numpy_print(tmp_path_factory, no_fsync, key, dtype_name):
    """With PREVIEW_FULL lowered, previews read only the corners; what they print must be
    what numpy prints for the whole selection."""
    d = tmp_path_factory.mktemp("corners")
    values = (np.arange(9 * 8 * 10).reshape(9, 8, 10) % 15 - 7).astype(np.int8)
    with kdtr.File(d / "t.kdtr", "w") as f:
        f.create_dataset("t", data=values if dtype_name == "int4" else values.astype(np.int16),
                         dtype=dtype_name)
    to_hdf5(d / "t.kdtr", d / "t.h5")
    try:
        want = values[tuple(key)]
    except IndexError:
        return
    text = ",".join(":".join("" if v is None else str(v) for v in (k.start, k.stop, k.step))
                    if isinstance(k, slice) else str(k) for k in key)
    edge = 3 if want.ndim <= 3 else 2
    with np.printoptions(threshold=10, edgeitems=edge):
        expected = numbers(np.array2string(want, separator=" "))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dump.inspection, "PREVIEW_FULL", 10)
        for path in (d / "t.kdtr", d / "t.h5"):
            with dump.open_source(str(path)) as src:
                entry = next(e for e in src.entries() if e.path == "/t")
                lines = dump.preview(entry, text or None)
            assert numbers("\n".join(lines[1:])) == expected, (path, text)


# ----------------------------------------------------------------------------- diff

def diff_files(tmp_path, change):
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    base = {"w": np.array([1.0, np.nan, 3.0, -np.inf], np.float32),
            "g/i": np.arange(4, dtype=np.int32)}
    with kdtr.File(a, "w") as f:
        for k, v in base.items():
            f[k] = v
        f.attrs["eps"] = 1e-6
    other = {k: v.copy() for k, v in base.items()}
    attrs = {"eps": 1e-6}
    change(other, attrs)
    with kdtr.File(b, "w") as f:
        for k, v in other.items():
            f[k] = v
        for k, v in attrs.items():
            f.attrs[k] = v
    return a, b


def test_diff_same_files_and_nan_in_the_same_place(tmp_path, capsys):
    a, b = diff_files(tmp_path, lambda d, at: None)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "files are the same" in out


def test_diff_values_and_tolerance(tmp_path, capsys):
    def nudge(d, at):
        d["w"][0] = 1.001
    a, b = diff_files(tmp_path, nudge)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    assert re.search(r"values differ: /w: 1 of 4 elements .* max abs 0\.001\d*, max rel "
                     r"0\.000999", out), out
    code, out, _ = run(capsys, "diff", a, b, "--atol", "0.01")
    assert code == 0 and "within tolerance: /w" in out
    code, out, _ = run(capsys, "diff", a, b, "--rtol", "0.002")
    assert code == 0
    code, out, _ = run(capsys, "diff", a, b, "--rtol", "0.0005", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["same"] is False and doc["schema_version"] == 1
    (t,) = [t for t in doc["tensors"] if t["path"] == "/w"]
    assert t["mismatched"] == 1 and t["max_abs"] == pytest.approx(0.001, rel=1e-4)


@pytest.mark.parametrize("change,what", [
    (lambda d, at: d.__setitem__("w", np.array([1.0, 2.0, 3.0, -np.inf], np.float32)),
     "values"),                                                   # NaN vs a number
    (lambda d, at: d.__setitem__("w", d["w"].astype(np.float64)), "dtype"),
    (lambda d, at: d.__setitem__("w", d["w"][:3]), "shape"),
    (lambda d, at: d.pop("g/i"), "missing"),
    (lambda d, at: d.__setitem__("extra", np.zeros(1)), "extra"),
    (lambda d, at: at.__setitem__("eps", 1e-5), "attr"),
    (lambda d, at: at.pop("eps"), "attr-missing"),
])
def test_diff_reports_each_kind_of_difference(tmp_path, capsys, change, what):
    a, b = diff_files(tmp_path, change)
    code, out, _ = run(capsys, "diff", a, b, "--json")
    assert code == 1
    assert what in [d["what"] for d in json.loads(out)["differences"]]
    code, text, _ = run(capsys, "diff", a, b)
    assert code == 1 and "files differ" in text


def test_diff_across_formats_and_errors(tmp_path, capsys):
    to_hdf5(SAMPLE, tmp_path / "s.h5")
    code, out, _ = run(capsys, "diff", SAMPLE, tmp_path / "s.h5")
    assert code == 0
    code, out, err = run(capsys, "diff", SAMPLE, tmp_path / "missing.kdtr")
    assert code == 2 and out == "" and err.startswith("kdtr-dump: error:")


# ----------------------------------------------------------------------------- verify

def test_verify_exit_codes(tmp_path, capsys):
    code, out, _ = run(capsys, SAMPLE, "--verify")
    assert code == 0 and out.startswith("OK ")
    damaged = tmp_path / "flip.kdtr"
    raw = bytearray(open(SAMPLE, "rb").read())
    with kdtr.File(SAMPLE) as f:
        raw[f["layers/1/attn/o_proj"].offset + 5] ^= 0x01
    damaged.write_bytes(bytes(raw))
    code, out, _ = run(capsys, damaged, "--verify")
    assert code == 3 and "K056" in out and "/layers/1/attn/o_proj" in out
    header = tmp_path / "header.kdtr"
    raw = bytearray(open(SAMPLE, "rb").read())
    raw[-3] ^= 0xFF                      # the string pool, inside the checksummed header
    header.write_bytes(bytes(raw))
    code, out, _ = run(capsys, header, "--verify")
    assert code == 3 and "K019" in out
    garbage = tmp_path / "garbage.kdtr"
    garbage.write_bytes(b"\x00garbage" * 64)
    code, out, err = run(capsys, garbage, "--verify")
    assert code == 2 and "K002" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, tmp_path / "nope.kdtr", "--verify")
    assert code == 2 and "no such file" in err


# ----------------------------------------------------------------------------- escaping

def test_escape_function():
    assert dump.escape("layers/0/w") == "layers/0/w"
    assert dump.escape("a\x1b[31mb") == "a\\x1b[31mb"
    assert dump.escape("x\ny\r\t\x00\x7f\x9b") == "x\\x0ay\\x0d\\x09\\x00\\x7f\\x9b"
    assert dump.escape("\u202eevil\u2066\u200b\ufeff") == "\\u202eevil\\u2066\\u200b\\ufeff"
    assert dump.escape("tag\U000e0041") == "tag\\U000e0041"
    assert dump.escape("back\\slash") == "back\\\\slash"
    assert dump.escape("Käse 层") == "Käse 层"


HOSTILE_NAMES = ["\x1b[31mred", "\u202eevil", "line\nbreak", "bell\x07", "\x9b2J"]


def assert_clean(text: str) -> None:
    bad = [c for c in text if c != "\n" and not c.isprintable()]
    assert bad == [], bad


def test_hostile_names_are_escaped_everywhere(tmp_path, capsys):
    k = tmp_path / "h.kdtr"
    with kdtr.File(k, "w") as f:              # KDTR refuses control characters in names
        d = f.create_dataset("\u202eevil", data=np.zeros(2, np.float32))
        d.attrs["note"] = "\x1b[31mred\nline"
        d.attrs["list"] = ["\x1b]0;title\x07"]
    h = tmp_path / "h.h5"
    with h5py.File(h, "w", track_order=True) as f:     # HDF5 takes anything
        g = f.create_group("\x1b[31mgroup")
        for name in HOSTILE_NAMES:
            g.create_dataset(name, data=np.ones(3, np.float32)).attrs["\x1b[0m"] = "\u202ex"
        f["soft\x1b"] = h5py.SoftLink("/\x1b[31mgroup\n")
    for target in (k, h):
        for flags in ([], ["-a"], ["--stats"], ["--summary"], ["--verify"]):
            code, out, err = run(capsys, target, *flags)
            assert code in (0, 3), (flags, err)
            assert_clean(out)
            assert_clean(err)
        code, out, _ = run(capsys, target, "--json", "--stats")
        assert code == 0 and out.isascii()
        doc = json.loads(out)
        assert_clean(out)
        paths = {n["path"] for n in doc["nodes"]}
        if target == h:
            assert {"/\x1b[31mgroup/" + n for n in HOSTILE_NAMES} <= paths
            assert "/soft\x1b" in paths
    code, out, _ = run(capsys, k, "-a")
    assert "/\\u202eevil" in out and '@note = "\\x1b[31mred\\x0aline"' in out
    code, out, _ = run(capsys, "diff", k, h)
    assert code == 1
    assert_clean(out)


# ----------------------------------------------------------------------------- errors, convert

@pytest.mark.parametrize("argv", [["missing.kdtr"], ["setup.cfg"], ["diff", "setup.cfg", "x"],
                                  [SAMPLE, "-d", "no/such"], [SAMPLE, "-d", "embed", "--slice",
                                                                "0:1:0"],
                                  [SAMPLE, "-d", "layers"], ["convert", SAMPLE, "out.txt"]])
def test_errors_exit_2_with_one_line(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("kdtr-dump: error:") and len(err.splitlines()) == 1
    assert "Traceback" not in err


def test_usage_errors_and_help(capsys):
    assert run(capsys)[0] == 2
    assert run(capsys, "--help")[0] == 0
    assert run(capsys, "diff", "--help")[0] == 0


def test_convert_round_trip_and_safetensors(tmp_path, capsys):
    code, out, _ = run(capsys, "convert", SAMPLE, tmp_path / "s.h5")
    assert code == 0 and "41 datasets" in out
    code, out, _ = run(capsys, "convert", tmp_path / "s.h5", tmp_path / "s.kdtr")
    assert code == 0
    assert (tmp_path / "s.kdtr").read_bytes() == open(SAMPLE, "rb").read()
    from safetensors.numpy import save_file
    save_file({"model.layers.0.w": np.ones((2, 2), np.float32),
               "model.layers.1.w": np.zeros((2, 2), np.float32)},
              str(tmp_path / "m.safetensors"), metadata={"source": "test"})
    code, out, _ = run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "m.kdtr",
                       "--split-dots")
    assert code == 0
    with kdtr.File(tmp_path / "m.kdtr") as f:
        assert f.attrs["source"] == "test"
        np.testing.assert_array_equal(f["model/layers/0/w"][...], np.ones((2, 2)))
    code, out, _ = run(capsys, tmp_path / "m.safetensors", "--summary")
    assert code == 0 and "model.layers.0.w" in out
    code, out, _ = run(capsys, "convert", tmp_path / "m.safetensors", tmp_path / "m.h5")
    assert code == 0
    code, _, err = run(capsys, "convert", SAMPLE, tmp_path / "again.kdtr")
    assert code == 2 and "already kdtr" in err


def test_installed_console_script(tmp_path):
    exe = shutil.which("kdtr-dump")
    if exe is None:
        pytest.skip("kdtr-dump is not installed (pip install -e .)")
    done = subprocess.run([exe, SAMPLE, "--summary"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "layers/#/attn/kv_a_proj" in done.stdout
    done = subprocess.run([exe, "diff", SAMPLE, str(tmp_path / "missing.kdtr")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "formats.dump", SAMPLE, "--verify"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("OK ")


@pytest.mark.slow
def test_listing_100k_datasets_is_fast(tmp_path, capsys, no_fsync):
    """The brief's bar: 100,000 tensors listed in a couple of seconds (CPU time measured, so
    a busy machine does not fail it; the bound leaves room for slower CPUs)."""
    import time
    path = tmp_path / "many.kdtr"
    with kdtr.File(path, "w", align_log2=3) as f:
        z = np.zeros(2, np.float32)
        for layer in range(1000):
            g = f.create_group(f"layers/{layer}")
            for e in range(100):
                g[f"w{e}"] = z
    for flags in ([], ["--summary"], ["--json"]):
        start = time.process_time()
        code = dump.main([str(path), *flags])
        spent = time.process_time() - start
        out = capsys.readouterr().out
        assert code == 0 and spent < 6.0, (flags, spent)
    assert '"path": "/layers/999/w99"' in out

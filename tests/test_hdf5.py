"""KDTR <-> HDF5 converters and the safetensors reader (formats/hdf5.py, formats/safetensors_io.py).

Properties: KDTR -> HDF5 -> KDTR gives back the same bytes for random trees (every dtype, 0-d
and empty datasets, attributes of every kind, any node order and alignment); the HDF5 side
holds what docs/KDTR_DUMP.md promises (bit patterns + markers); HDF5 -> KDTR -> HDF5 keeps
foreign files' values and types; hostile HDF5 and safetensors inputs raise KdtrError with the
documented rule code; the safetensors reader agrees with the safetensors package.
"""
from __future__ import annotations

import json
import os
import struct

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st
from h5py import h5s

from formats import hdf5 as H
from formats import kdtr
from formats.dtypes import BY_NAME, pack_int4
from formats.kdtr import KdtrError
from formats.safetensors_io import SafetensorsFile, safetensors_to_hdf5, safetensors_to_kdtr

DTYPE_NAMES = list(BY_NAME)


# ----------------------------------------------------------------------------- strategies

names = st.text(st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="/"),
                min_size=1, max_size=6).filter(lambda s: s not in (".", "..")
                                               and not s.startswith("kdtr."))


def array_of(draw, dtype_name: str, shape: tuple) -> np.ndarray:
    """Random contents; floats from random bit patterns (NaNs and infinities included)."""
    dt = BY_NAME[dtype_name]
    count = int(np.prod(shape, dtype=np.int64))
    if dtype_name == "bool":
        return np.array(draw(st.lists(st.booleans(), min_size=count, max_size=count)),
                        dtype=bool).reshape(shape)
    if dt.packed:
        return np.array(draw(st.lists(st.integers(-8, 7), min_size=count, max_size=count)),
                        dtype=np.int8).reshape(shape)
    nbytes = count * dt.storage.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return np.frombuffer(raw, dtype=dt.storage).reshape(shape).copy()


@st.composite
def shapes(draw, dtype_name: str):
    dims = draw(st.lists(st.integers(0, 3), max_size=3))
    if dtype_name == "int4":
        dims = dims or [2]
        dims[-1] = 2 * draw(st.integers(0, 2))
    return tuple(dims)


@st.composite
def attr_values(draw):
    kind = draw(st.sampled_from(["str", "int", "float", "bool", "strlist", "array"]))
    if kind == "str":
        return draw(st.text(max_size=8))           # NUL and controls included
    if kind == "int":
        return draw(st.integers(-(1 << 63), (1 << 63) - 1))
    if kind == "float":
        return draw(st.floats(allow_nan=True, allow_infinity=True))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "strlist":
        return draw(st.lists(st.text(max_size=5), max_size=3))
    name = draw(st.sampled_from([n for n in DTYPE_NAMES if n != "int4"]))
    return array_of(draw, name, draw(shapes(name)))


@st.composite
def trees(draw):
    """A list of write operations in the order a writer would issue them."""
    ops, groups, used = [], ["/"], set()
    for _ in range(draw(st.integers(0, 8))):
        parent = draw(st.sampled_from(groups))
        name = draw(names)
        path = parent.rstrip("/") + "/" + name
        if path in used:
            continue
        used.add(path)
        attrs = draw(st.dictionaries(names, attr_values(), max_size=3))
        if draw(st.booleans()):
            groups.append(path)
            ops.append(("group", path, None, attrs))
        else:
            dtype_name = draw(st.sampled_from(DTYPE_NAMES))
            ops.append(("dataset", path, (dtype_name, array_of(draw, dtype_name,
                                                               draw(shapes(dtype_name)))), attrs))
    root_attrs = draw(st.dictionaries(names, attr_values(), max_size=3))
    return ops, root_attrs, draw(st.sampled_from([3, 6, 12]))


def write_tree(path, ops, root_attrs, align_log2=12) -> None:
    with kdtr.File(path, "w", align_log2=align_log2) as f:
        for key, value in root_attrs.items():
            f.attrs[key] = value
        for kind, p, payload, attrs in ops:
            if kind == "group":
                obj = f.create_group(p)
            else:
                obj = f.create_dataset(p, data=payload[1], dtype=payload[0])
            for key, value in attrs.items():
                obj.attrs[key] = value


def same_value(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- round trips

@pytest.fixture(scope="module")
def no_fsync():
    """Durability is not under test here; fsync costs ~6 ms a file on this disk."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", lambda fd: None)
        yield


@given(trees())
def test_kdtr_hdf5_kdtr_round_trip_is_byte_identical(tmp_path_factory, no_fsync, tree):
    ops, root_attrs, align = tree
    d = tmp_path_factory.mktemp("rt")
    src, mid, back = d / "a.kdtr", d / "a.h5", d / "b.kdtr"
    write_tree(src, ops, root_attrs, align)
    H.to_hdf5(src, mid)
    H.from_hdf5(mid, back)
    assert back.read_bytes() == src.read_bytes()
    # and the HDF5 file holds the values the way the mapping promises
    with h5py.File(mid, "r") as h:
        assert same_attrs(H.read_attrs(h["/"], "/"), root_attrs)
        for kind, p, payload, attrs in ops:
            assert same_attrs(H.read_attrs(h[p], p), attrs)
            if kind == "group":
                assert isinstance(h[p], h5py.Group)
                continue
            dtype_name, arr = payload
            stored = h[p][()]
            if dtype_name == "int4":
                assert h[p].attrs["kdtr.dtype"] == "int4"
                assert list(h[p].attrs["kdtr.shape"]) == list(arr.shape)
                assert np.asarray(stored).tobytes() == pack_int4(arr).tobytes()
            elif dtype_name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                assert h[p].attrs["kdtr.dtype"] == dtype_name
                assert np.asarray(stored).dtype.kind == "u"
                assert np.asarray(stored).tobytes() == arr.tobytes()
            else:
                assert "kdtr.dtype" not in h[p].attrs
                assert np.asarray(stored).astype(arr.dtype).tobytes() == arr.tobytes()


def same_attrs(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(same_value(want[k], got[k]) for k in want)


def test_round_trip_preserves_non_depth_first_node_order(tmp_path):
    ops = [("group", "/a", None, {}), ("group", "/b", None, {}),
           ("dataset", "/a/x", ("float32", np.arange(3, dtype=np.float32)), {}),
           ("dataset", "/b/y", ("bfloat16", np.ones(2, ml_dtypes.bfloat16)), {"k": 1}),
           ("dataset", "/a/z", ("int4", np.array([1, -2], np.int8)), {})]
    write_tree(tmp_path / "a.kdtr", ops, {})
    H.to_hdf5(tmp_path / "a.kdtr", tmp_path / "a.h5")
    with h5py.File(tmp_path / "a.h5") as h:
        assert h["a/z"].attrs["kdtr.index"] == 5      # the KDTR order is recorded
        assert list(h["a"]) == ["x", "z"]             # creation order kept per group
    H.from_hdf5(tmp_path / "a.h5", tmp_path / "b.kdtr")
    assert (tmp_path / "b.kdtr").read_bytes() == (tmp_path / "a.kdtr").read_bytes()


def test_depth_first_files_get_no_order_markers(tmp_path):
    H.to_hdf5("tests/vectors/sample_model.kdtr", tmp_path / "s.h5")
    with h5py.File(tmp_path / "s.h5") as h:
        found = []
        h.visititems(lambda n, o: found.append(n) if "kdtr.index" in o.attrs else None)
        assert found == []
        assert "kdtr.align_log2" not in h.attrs


def test_blocked_and_spilled_copies_keep_values(tmp_path, monkeypatch):
    """Force the multi-block write/read paths and the temporary-file staging."""
    monkeypatch.setattr(H, "BLOCK_BYTES", 64)
    monkeypatch.setattr(H, "SPILL_BYTES", 0)
    rng = np.random.default_rng(1)
    big = rng.standard_normal((7, 5, 3)).astype(np.float32)
    i4 = rng.integers(-8, 8, size=(5, 10)).astype(np.int8)
    with kdtr.File(tmp_path / "a.kdtr", "w") as f:
        f["big"] = big
        f.create_dataset("i4", data=i4, dtype="int4")
        f["flat"] = np.arange(1000, dtype=np.int16)
    seen = []
    H.to_hdf5(tmp_path / "a.kdtr", tmp_path / "a.h5", progress=lambda d, t: seen.append((d, t)))
    total = big.nbytes + i4.size // 2 + 2000
    assert seen[-1] == (total, total) and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
    assert len(seen) > 10
    back = []
    H.from_hdf5(tmp_path / "a.h5", tmp_path / "b.kdtr", progress=lambda d, t: back.append(d))
    assert back[-1] == total
    assert (tmp_path / "b.kdtr").read_bytes() == (tmp_path / "a.kdtr").read_bytes()
    with kdtr.File(tmp_path / "b.kdtr") as f:
        np.testing.assert_array_equal(f["i4"][...], i4)


def test_foreign_hdf5_round_trip_keeps_types(tmp_path):
    """A file h5py wrote without track_order or markers: HDF5 -> KDTR -> HDF5."""
    p = tmp_path / "foreign.h5"
    with h5py.File(p, "w") as f:
        g = f.create_group("model")
        d = g.create_dataset("w", data=np.arange(6, dtype=">f4").reshape(2, 3))  # big-endian
        d.attrs["eps"] = np.float32(1e-6)           # scalar float32: stays float32
        d.attrs["name"] = np.bytes_(b"dense")      # fixed-length string -> str
        d.attrs["n"] = 3
        f.attrs["tags"] = np.array([b"a", b"bc"])   # fixed-length strings -> list of str
        f.create_dataset("flags", data=np.array([True, False]))
        f.create_dataset("z", data=np.zeros((0, 2), np.complex64))
    H.from_hdf5(p, tmp_path / "f.kdtr")
    with kdtr.File(tmp_path / "f.kdtr") as k:
        assert k.keys() == ["flags", "model", "z"]          # name order: not tracked
        np.testing.assert_array_equal(k["model/w"][...], np.arange(6).reshape(2, 3))
        a = k["model/w"].attrs
        assert a["eps"].dtype == np.float32 and a["eps"].shape == () and a["name"] == "dense"
        assert a["n"] == 3 and type(a["n"]) is int
        assert k.attrs["tags"] == ["a", "bc"]
        assert k["flags"].dtype == bool and k["z"].dtype == np.complex64
    H.to_hdf5(tmp_path / "f.kdtr", tmp_path / "g.h5")
    with h5py.File(tmp_path / "g.h5") as g:
        assert g["model/w"].attrs["eps"].dtype == np.float32
        assert g["model/w"].dtype == np.dtype("<f4")


def test_reserved_attribute_names_are_refused_on_export(tmp_path):
    with kdtr.File(tmp_path / "a.kdtr", "w") as f:
        f.attrs["kdtr.dtype"] = "x"
    with pytest.raises(ValueError, match="reserved"):
        H.to_hdf5(tmp_path / "a.kdtr", tmp_path / "a.h5")
    assert not (tmp_path / "a.h5").exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


# ----------------------------------------------------------------------------- hostile HDF5

def _bad_bool(f):
    d = f.create_dataset("b", shape=(3,), dtype=bool)
    d.id.write(h5s.ALL, h5s.ALL, np.array([0, 1, 2], np.uint8), mtype=d.id.get_type())


def _int4_marker(f, shape):
    d = f.create_dataset("d", data=np.zeros(2, np.uint8))
    d.attrs["kdtr.dtype"] = "int4"
    d.attrs["kdtr.shape"] = np.array(shape)


HOSTILE = {
    "soft link": ("K024", lambda f: (f.create_dataset("d", data=[1]),
                                     f.__setitem__("s", h5py.SoftLink("/d")))),
    "external link": ("K024", lambda f: f.__setitem__("s", h5py.ExternalLink("/etc/passwd",
                                                                           "/x"))),
    "group named ..": ("K040", lambda f: f.create_group("..")),
    "escape in a name": ("K040", lambda f: f.create_dataset("a\x1b[31m", data=[1])),
    "name not UTF-8": ("K039", lambda f: f.create_group(b"\xff\xfe")),
    "compound dataset": ("K004", lambda f: f.create_dataset(
        "c", data=np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]))),
    "vlen string dataset": ("K004", lambda f: f.create_dataset(
        "v", data=np.array(["a"], dtype=h5py.string_dtype()))),
    "vlen int dataset": ("K004", lambda f: f.create_dataset("v", (2,),
                                                            dtype=h5py.vlen_dtype(np.int32))),
    "object references": ("K004", lambda f: f.create_dataset(
        "r", data=np.array([f.ref], dtype=h5py.ref_dtype))),
    "enum": ("K004", lambda f: f.create_dataset(
        "e", (2,), dtype=h5py.enum_dtype({"A": 0, "B": 1}, basetype="i1"))),
    "opaque": ("K004", lambda f: f.create_dataset("o", data=np.void(b"abcd"))),
    "null dataspace": ("K004", lambda f: f.create_dataset("e", data=h5py.Empty("f4"))),
    "committed datatype": ("K024", lambda f: f.__setitem__("t", np.dtype("f4"))),
    "shared dataset": ("K022", lambda f: (f.create_dataset("d", data=[1]),
                                          f.__setitem__("d2", f["d"]))),
    "hard-link cycle": ("K022", lambda f: (f.create_group("a"),
                                           f["a"].__setitem__("loop", f["a"]))),
    "external raw data": ("K034", lambda f: f.create_dataset(
        "x", shape=(4,), dtype="u1", external=[("/etc/hostname", 0, 4)])),
    "9 dimensions": ("K028", lambda f: f.create_dataset("d", shape=(1,) * 9, dtype="f4")),
    "dimension over 2**48": ("K029", lambda f: f.create_dataset(
        "d", shape=(2 ** 49,), dtype="u1", chunks=(1024,))),
    "empty but over 2**62 bytes": ("K030", lambda f: f.create_dataset(
        "d", shape=(0, 2 ** 40, 2 ** 40), maxshape=(None, 2 ** 40, 2 ** 40), dtype="f8",
        chunks=(1, 16, 16))),
    "bool byte 2": ("K051", _bad_bool),
    "compound attribute": ("K004", lambda f: f.attrs.create(
        "c", np.zeros(1, dtype=[("a", "i4")]))),
    "reference attribute": ("K004", lambda f: f.attrs.create("r", f.ref)),
    "empty attribute": ("K004", lambda f: f.attrs.create("e", h5py.Empty("f4"))),
    "attribute name with /": ("K040", lambda f: f.attrs.create("a/b", 1)),
    "attribute not UTF-8": ("K055", lambda f: f.attrs.create("s", np.bytes_(b"\xff\xfe"))),
    "2-d string attribute": ("K053", lambda f: f.attrs.create(
        "s", np.array([["a", "b"]], dtype=object), dtype=h5py.string_dtype())),
    "attribute over 64 KiB": ("K049", lambda f: f.attrs.create("big", np.zeros(70000, np.uint8))),
    "string attribute over 64 KiB": ("K049", lambda f: f.attrs.create(
        "big", "x" * 70000, dtype=h5py.string_dtype())),
    "marker contradicts data": ("K031", lambda f: f.create_dataset(
        "d", data=np.zeros(2, np.float32)).attrs.create("kdtr.dtype", "bfloat16")),
    "unknown dtype marker": ("K027", lambda f: f.create_dataset(
        "d", data=np.zeros(2, np.uint16)).attrs.create("kdtr.dtype", "bfloat17")),
    "int4 odd shape": ("K032", lambda f: _int4_marker(f, [3])),
    "int4 shape not matching": ("K031", lambda f: _int4_marker(f, [6])),
    "marker on a group": ("K026", lambda f: f.create_group("g").attrs.create("kdtr.dtype",
                                                                             "int4")),
    "unknown kdtr. attribute": ("K046", lambda f: f.attrs.create("kdtr.zzz", 1)),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_hdf5_is_refused(tmp_path, case):
    code, build = HOSTILE[case]
    src = tmp_path / "in.h5"
    with h5py.File(src, "w", track_order=True) as f:
        build(f)
    with pytest.raises(KdtrError) as err:
        H.from_hdf5(src, tmp_path / "out.kdtr")
    assert err.value.code == code, str(err.value)
    assert not (tmp_path / "out.kdtr").exists()


def test_hdf5_library_errors_become_kdtr_errors(tmp_path):
    src = tmp_path / "gz.h5"
    with h5py.File(src, "w") as f:
        d = f.create_dataset("d", data=np.random.default_rng(0).standard_normal(4096),
                             chunks=(4096,), compression="gzip")
        info = d.id.get_chunk_info(0)
    with open(src, "r+b") as fh:      # damage the compressed chunk
        fh.seek(info.byte_offset + 16)
        fh.write(b"\xff" * 64)
    with pytest.raises(KdtrError) as err:
        H.from_hdf5(src, tmp_path / "out.kdtr")
    assert err.value.code == "K002" and "unreadable HDF5" in str(err.value)
    # a truncated file and a file that is not HDF5 at all
    whole = tmp_path / "whole.h5"
    with h5py.File(whole, "w") as f:
        f["d"] = np.arange(10000.0)
    (tmp_path / "half.h5").write_bytes(whole.read_bytes()[:20000])
    (tmp_path / "text.h5").write_bytes(b"not hdf5 " * 100)
    for name in ("half.h5", "text.h5"):
        with pytest.raises(KdtrError) as err:
            H.from_hdf5(tmp_path / name, tmp_path / "out.kdtr")
        assert err.value.code == "K002"
    with pytest.raises(KdtrError) as err:
        H.from_hdf5(tmp_path, tmp_path / "out.kdtr")      # a directory
    assert err.value.code == "K058"


def test_listing_walk_reports_problems_instead_of_raising(tmp_path):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w", track_order=True) as f:
        f.create_dataset("ok", data=np.ones(2, np.float32))
        f["s"] = h5py.SoftLink("/ok")
        f.create_dataset("c", data=np.zeros(2, dtype=[("a", "i4")]))
    with H.open_hdf5(src) as f:
        nodes = {n.path: n for n in H.walk(f, strict=False)}
    assert nodes["/ok"].problem is None and nodes["/ok"].dtype.name == "float32"
    assert nodes["/s"].kind == "soft-link" and nodes["/s"].target == "/ok"
    assert nodes["/c"].problem.code == "K004" and nodes["/c"].type_name == "compound"


def test_iter_blocks_tiles_in_c_order():
    for shape, cap in [((7, 5, 3), 4), ((7, 5, 3), 15), ((10,), 3), ((2, 3), 100), ((), 1),
                       ((4, 0, 2), 3)]:
        seen = np.zeros(shape, np.int64)
        order = []
        for sel in H.iter_blocks(shape, cap):
            block = seen[sel]
            assert block.size <= cap
            seen[sel] += 1
            order.append(np.ravel_multi_index([s.start if isinstance(s, slice) else s
                                               for s in sel], shape) if shape else 0)
        assert (seen == 1).all()
        assert order == sorted(order)


# ----------------------------------------------------------------------------- safetensors

def _st_tensors():
    rng = np.random.default_rng(3)
    return {"model.embed.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
            "model.layers.0.w": rng.standard_normal((3, 4)).astype(np.float32),
            "model.layers.0.fp8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
            "model.layers.1.fp8b": rng.standard_normal(5).astype(ml_dtypes.float8_e5m2),
            "ids": np.arange(5, dtype=np.int64), "mask": np.array([True, False]),
            "scalar": np.array(2.5, np.float16), "empty": np.zeros((0, 3), np.int32),
            "c": np.array([1 + 2j], np.complex64), "u": np.arange(3, dtype=np.uint16)}


def test_safetensors_reader_matches_the_safetensors_package(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.numpy import load_file, save_file
    tensors = _st_tensors()
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "np", "note": "x"})
    reference = {name: view for name, view in safetensors.deserialize(path.read_bytes())}
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "np", "note": "x"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, want in tensors.items():
            got = f.array(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes() == bytes(reference[name]["data"])
            assert not got.flags.writeable
        offsets = [(f.info(n).begin, f.info(n).end) for n in f.keys()]
        assert offsets == sorted(offsets)
    native = {k: v for k, v in tensors.items()   # the numpy loader has no bf16/fp8
              if v.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}
    save_file(native, str(tmp_path / "n.safetensors"))
    loaded = load_file(str(tmp_path / "n.safetensors"))
    with SafetensorsFile(tmp_path / "n.safetensors") as f:
        assert sorted(loaded) == sorted(native)
        for name, want in loaded.items():
            assert f.array(name).dtype == want.dtype
            np.testing.assert_array_equal(f.array(name), want)


def test_safetensors_conversions(tmp_path):
    from safetensors.numpy import save_file
    tensors = _st_tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    safetensors_to_kdtr(tmp_path / "m.safetensors", tmp_path / "m.kdtr", split_dots=True)
    safetensors_to_hdf5(tmp_path / "m.safetensors", tmp_path / "m.h5", split_dots=True)
    H.from_hdf5(tmp_path / "m.h5", tmp_path / "m2.kdtr")
    assert (tmp_path / "m2.kdtr").read_bytes() == (tmp_path / "m.kdtr").read_bytes()
    with kdtr.File(tmp_path / "m.kdtr") as k:
        assert k.attrs["k"] == "v"
        for name, want in tensors.items():
            got = k[name.replace(".", "/")]
            assert got.kdtr_dtype == BY_NAME[str(want.dtype)].name
            assert got[...].tobytes() == want.tobytes()
    safetensors_to_kdtr(tmp_path / "m.safetensors", tmp_path / "flat.kdtr")
    with kdtr.File(tmp_path / "flat.kdtr") as k:
        assert "model.embed.weight" in k.keys()


def _st_file(path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)


def _entry(dtype, shape, a, b):
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


HOSTILE_ST = {
    "overlap": ("K035", {"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, 12),
    "hole": ("K036", {"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, 12),
    "hole at start": ("K036", {"a": _entry("F32", [1], 4, 8)}, 8),
    "trailing bytes": ("K018", {"a": _entry("F32", [1], 0, 4)}, 9),
    "truncated data": ("K017", {"a": _entry("F32", [4], 0, 16)}, 8),
    "size mismatch": ("K031", {"a": _entry("F32", [3], 0, 8)}, 8),
    "unknown dtype": ("K027", {"a": _entry("F4", [2], 0, 1)}, 1),
    "overflowing shape": ("K030", {"a": _entry("F64", [2 ** 40, 2 ** 40], 0, 8)}, 8),
    "empty but overflowing": ("K030", {"a": _entry("F64", [0, 2 ** 40, 2 ** 40], 0, 0)}, 0),
    "dimension too big": ("K029", {"a": _entry("U8", [2 ** 60], 0, 8)}, 8),
    "negative dimension": ("K029", {"a": _entry("U8", [-1], 0, 0)}, 0),
    "bool dimension": ("K029", {"a": _entry("U8", [True], 0, 1)}, 1),
    "9 dimensions": ("K028", {"a": _entry("U8", [1] * 9, 0, 1)}, 1),
    "reversed offsets": ("K034", {"a": _entry("U8", [0], 4, 0)}, 4),
    "extra key": ("K024", {"a": {**_entry("U8", [1], 0, 1), "x": 1}}, 1),
    "metadata not strings": ("K046", {"__metadata__": {"a": 1}}, 0),
    "not an object": ("K002", [1, 2], 0),
}


@pytest.mark.parametrize("case", list(HOSTILE_ST))
def test_hostile_safetensors_is_refused(tmp_path, case):
    code, header, data_size = HOSTILE_ST[case]
    _st_file(tmp_path / "x.safetensors", header, b"\0" * data_size)
    with pytest.raises(KdtrError) as err:
        SafetensorsFile(tmp_path / "x.safetensors")
    assert err.value.code == code, str(err.value)


def test_hostile_safetensors_header_framing(tmp_path):
    p = tmp_path / "x.safetensors"
    cases = [
        ("K043", lambda: _st_file(p, b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": '
                                     b'[0, 1]}, "a": {"dtype": "U8", "shape": [1], '
                                     b'"data_offsets": [0, 1]}}', b"\0")),
        ("K043", lambda: _st_file(p, b'{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], '
                                     b'"data_offsets": [0, 1]}}', b"\0")),
        ("K013", lambda: _st_file(p, b"{}", length=(1 << 62))),
        ("K013", lambda: _st_file(p, b"{}", length=100_000_001)),
        ("K017", lambda: _st_file(p, b"{}", length=1000)),
        ("K001", lambda: p.write_bytes(b"\1\0\0")),
        ("K002", lambda: _st_file(p, b"{not json}")),
        ("K002", lambda: _st_file(p, b'{"a": NaN}')),
        ("K039", lambda: _st_file(p, b'{"\xff": 1}')),
        ("K002", lambda: _st_file(p, b"[" * 100_000 + b"]" * 100_000)),
    ]
    for code, make in cases:
        make()
        with pytest.raises(KdtrError) as err:
            SafetensorsFile(p)
        assert err.value.code == code, str(err.value)


def test_safetensors_names_must_be_kdtr_paths(tmp_path):
    from safetensors.numpy import save_file
    save_file({"/a": np.zeros(1, np.float32)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(KdtrError) as err:
        safetensors_to_kdtr(tmp_path / "x.safetensors", tmp_path / "x.kdtr")
    assert err.value.code == "K040"
    save_file({"a.b": np.zeros(1, np.float32), "a": np.zeros(1, np.float32)},
              str(tmp_path / "y.safetensors"))
    with pytest.raises(KdtrError) as err:
        safetensors_to_kdtr(tmp_path / "y.safetensors", tmp_path / "y.kdtr", split_dots=True)
    assert err.value.code == "K043"

"""The KDTR Python API: round trips, h5py semantics, zero-copy reads, atomic writes, checksums.

The round-trip property draws random trees of groups, datasets (every dtype of
``formats.dtypes``, 0-d, empty and ~1 MB arrays, random bit patterns so floats compare bitwise,
NaN payloads included) and attributes of every kind, writes them, reads them back and compares
keys (insertion order), values (bitwise) and attribute types.  The visit order is checked
against h5py on an equivalent HDF5 file, an independent implementation of the same contract.
"""
from __future__ import annotations

import gc
import math
import mmap
import os
import struct
import sys

import h5py
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

from formats import checksum, kdtr
from formats.dtypes import BY_CODE, BY_NAME, pack_int4, unpack_int4
from formats.kdtr import KdtrError

# ----------------------------------------------------------------------------- strategies

# Names mix ASCII (both cases, digits, '.', '-', ' ') with multi-byte UTF-8 so that byte order,
# not code-point or case order, is what visit() sorting is tested on.
NAME_CHARS = list("abcABZ019_-. ~") + ["\u00e9", "\u00df", "\u0100", "\u4e16", "\U0001f600"]
NAMES = st.text(st.sampled_from(NAME_CHARS), min_size=1, max_size=6).filter(
    lambda s: s not in (".", ".."))
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=16)  # any encodable str
ARRAY_ATTR_DTYPES = [dt.name for dt in BY_CODE.values() if not dt.packed]


def make_array(dtype_name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bit patterns of ``dtype_name`` (floats include NaN payloads, infs, subnormals)."""
    dt = BY_NAME[dtype_name]
    rng = np.random.default_rng(seed)
    count = math.prod(shape)
    if dt.name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dt.packed:
        return rng.integers(-8, 8, shape).astype(np.int8)
    return np.frombuffer(rng.bytes(count * dt.storage.itemsize), dt.storage).reshape(shape)


@st.composite
def dataset_specs(draw):
    name = draw(st.sampled_from(list(BY_NAME)))
    dt = BY_NAME[name]
    if draw(st.integers(0, 11)) == 0:  # now and then a ~1 MB tensor
        shape = (2, (1 << 19) // max(1, dt.storage.itemsize))
    else:
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    if dt.packed:  # int4: at least one dim, the last one even
        shape = (shape or (1,))[:-1] + ((shape or (1,))[-1] * 2,)
    return name, shape, draw(st.integers(0, 2**32 - 1))


@st.composite
def attr_values(draw):
    kind = draw(st.sampled_from(["str", "int", "float", "bool", "array", "strlist", "empty"]))
    if kind == "str":
        return draw(TEXT)
    if kind == "int":
        extremes = st.sampled_from([-(2**63), 2**63 - 1])
        return draw(st.one_of(st.integers(-(2**63), 2**63 - 1), extremes))
    if kind == "float":
        return draw(st.one_of(st.floats(), st.sampled_from([math.nan, -math.inf, math.inf, -0.0])))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "array":
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        return make_array(draw(st.sampled_from(ARRAY_ATTR_DTYPES)), shape, draw(st.integers(0, 99)))
    if kind == "strlist":
        return draw(st.lists(TEXT, min_size=1, max_size=4))
    return []


@st.composite
def attr_dicts(draw):
    names = draw(st.lists(NAMES, max_size=3, unique=True))
    return {n: draw(attr_values()) for n in names}


@st.composite
def trees(draw):
    """A list of nodes (path, kind, spec, attrs) in creation order; parents come first."""
    groups = [""]
    nodes = []
    taken: set[str] = set()
    for _ in range(draw(st.integers(0, 8))):
        parent = draw(st.sampled_from(groups))
        path = (parent + "/" if parent else "") + draw(NAMES)
        if path in taken:
            continue
        taken.add(path)
        if draw(st.booleans()):
            groups.append(path)
            nodes.append((path, "group", None, draw(attr_dicts())))
        else:
            nodes.append((path, "dataset", draw(dataset_specs()), draw(attr_dicts())))
    return draw(attr_dicts()), nodes


# ----------------------------------------------------------------------------- helpers

def write_tree(path, root_attrs, nodes) -> None:
    with kdtr.File(path, "w") as f:
        for k, v in root_attrs.items():
            f.attrs[k] = v
        for p, kind, spec, attrs in nodes:
            if kind == "group":
                obj = f.create_group(p)
            else:
                name, shape, seed = spec
                obj = f.create_dataset(p, data=make_array(name, shape, seed), dtype=name)
            for k, v in attrs.items():
                obj.attrs[k] = v


def write_h5_oracle(path, nodes) -> None:
    with h5py.File(path, "w", track_order=True) as f:
        for p, kind, _, _ in nodes:
            if kind == "group":
                f.create_group(p, track_order=True)
            else:
                f.create_dataset(p, data=np.zeros(1, np.uint8))


def same_value(a, b) -> bool:
    """Equality with the same Python type; floats and arrays compared bit for bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def assert_attrs(obj, expected: dict) -> None:
    assert list(obj.attrs) == list(expected)
    for k, v in expected.items():
        got = obj.attrs[k]
        assert same_value(got, v), (obj.name, k, got, v)


# ----------------------------------------------------------------------------- round trips

@given(trees())
def test_round_trip(tmp_path_factory, tree):
    root_attrs, nodes = tree
    d = tmp_path_factory.mktemp("rt")
    write_tree(d / "a.kdtr", root_attrs, nodes)
    write_tree(d / "b.kdtr", root_attrs, nodes)
    assert (d / "a.kdtr").read_bytes() == (d / "b.kdtr").read_bytes()  # deterministic bytes

    with kdtr.File(d / "a.kdtr") as f:
        f.verify()
        assert_attrs(f, root_attrs)
        for p, kind, spec, attrs in nodes:
            obj = f[p]
            assert obj.name == "/" + p
            assert_attrs(obj, attrs)
            if kind == "group":
                assert isinstance(obj, kdtr.Group)
                continue
            assert isinstance(obj, kdtr.Dataset)
            name, shape, seed = spec
            want = make_array(name, shape, seed)
            got = obj[...]
            assert obj.kdtr_dtype == name and obj.shape == shape == got.shape
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        # members of every group in insertion order
        children: dict[str, list[str]] = {"": []}
        for p, kind, _, _ in nodes:
            parent, _, leaf = p.rpartition("/")
            children[parent].append(leaf)
            if kind == "group":
                children[p] = []
        for g, members in children.items():
            assert (f[g] if g else f).keys() == members

        # visit order: h5py on an equivalent HDF5 file is the oracle
        write_h5_oracle(d / "o.h5", nodes)
        with h5py.File(d / "o.h5", "r") as h:
            oracle: list[str] = []
            h.visit(oracle.append)
            oracle_items: list[str] = []
            h.visititems(lambda name, obj: oracle_items.append(name))
        names: list[str] = []
        assert f.visit(names.append) is None
        assert names == oracle
        items: list[tuple[str, object]] = []
        f.visititems(lambda name, obj: items.append((name, obj)))
        assert [n for n, _ in items] == oracle_items
        assert all(obj == f[n] for n, obj in items)
        if names:  # a non-None return stops the walk and is returned
            stop_at = len(names) // 2
            seen: list[str] = []

            def stop(name):
                seen.append(name)
                return ("stopped", name) if len(seen) == stop_at + 1 else None
            assert f.visit(stop) == ("stopped", names[stop_at])
            assert seen == names[:stop_at + 1]


@pytest.mark.parametrize("dtype_name", list(BY_NAME))
def test_every_dtype_round_trips(tmp_path, dtype_name):
    """Each dtype for certain (the property above draws them at random): scalar, empty, 2-D,
    as a dataset and (all but int4) as an array attribute, bit for bit."""
    packed = BY_NAME[dtype_name].packed
    shapes = [(2,), (0, 2), (3, 4)] if packed else [(), (0, 3), (3, 4)]
    arrays = {f"a{k}": make_array(dtype_name, s, k) for k, s in enumerate(shapes)}
    p = tmp_path / "dt.kdtr"
    with kdtr.File(p, "w") as f:
        for name, a in arrays.items():
            ds = f.create_dataset(name, data=a, dtype=dtype_name)
            if not packed:
                ds.attrs["same"] = a
    with kdtr.File(p) as f:
        assert f.verify() == sum(BY_NAME[dtype_name].nbytes(a.size) for a in arrays.values())
        for name, a in arrays.items():
            got = f[name][...]
            assert f[name].kdtr_dtype == dtype_name
            assert got.shape == a.shape and got.dtype == a.dtype and got.tobytes() == a.tobytes()
            if not packed:
                assert same_value(f[name].attrs["same"], a)


# ----------------------------------------------------------------------------- h5py-style access

@pytest.fixture
def small(tmp_path):
    p = tmp_path / "small.kdtr"
    with kdtr.File(p, "w") as f:
        f.create_dataset("a/b/c", data=np.arange(12, dtype=np.float32).reshape(3, 4))
        f["top"] = np.int64(7)
        f["a"].attrs["k"] = 1
    return p


def test_lookup_semantics(small):
    with kdtr.File(small) as f:
        assert "a" in f and "a/b" in f and "a/b/c" in f and "/a/b/c" in f
        assert "a/x" not in f and "a/b/c/d" not in f and 3 not in f
        assert f.get("nope") is None and f.get("nope", 5) == 5
        assert f.get("a/b/c").shape == (3, 4)
        with pytest.raises(KeyError):
            f["nope"]
        with pytest.raises(KeyError):
            f["top/below"]  # below a dataset
        b = f["a/b"]
        assert b["c"] == f["a/b/c"] and b["/top"] == f["top"]  # absolute from a subgroup
        assert b.name == "/a/b" and b.parent == f["a"] and f["a"].parent == f
        assert f["/"] == f and f.keys() == ["a", "top"] and list(f) == ["a", "top"]
        assert len(f) == 2 and f["top"][()] == 7 and f["top"].shape == ()
        assert f["a"].attrs["k"] == 1 and "k" in f["a"].attrs


def test_write_side_semantics(tmp_path):
    with kdtr.File(tmp_path / "w.kdtr", "w") as f:
        c = f.create_group("x/y/z")  # intermediate groups are made
        assert c.name == "/x/y/z" and isinstance(f["x/y"], kdtr.Group)
        assert f.require_group("x/y") == f["x/y"]
        assert f.require_group("x/new").name == "/x/new"
        f["x/d"] = np.zeros(2)
        with pytest.raises(ValueError):
            f.create_group("x/y")
        with pytest.raises(ValueError):
            f.create_dataset("x/d", data=np.ones(2))
        with pytest.raises(ValueError):
            f["x"] = np.ones(1)
        with pytest.raises(TypeError):
            f.create_dataset("x/d/e", data=np.ones(1))  # a dataset where a group is needed
        with pytest.raises(TypeError):
            f.create_group("x/d/e")
        with pytest.raises(TypeError):
            f.require_group("x/d")
        with pytest.raises(TypeError):
            f.create_dataset("s", data=np.array(["text"]))  # no string datasets
        with pytest.raises(ValueError):
            f.create_dataset("nine", data=np.zeros((1,) * 9))
        with pytest.raises(OverflowError):
            f.attrs["big"] = 2**63
        with pytest.raises(ValueError):
            f.attrs["huge"] = np.zeros(70_000, np.uint8)  # over 64 KiB
    with kdtr.File(tmp_path / "w.kdtr") as f:
        seen = []
        f.visit(seen.append)
        assert seen == ["x", "x/d", "x/new", "x/y", "x/y/z"]
        with pytest.raises(PermissionError):
            f.create_group("q")


BAD_NAMES = [(".", "K040"), ("..", "K040"), ("a\x00b", "K040"), ("tab\t", "K040"),
             ("\x7f", "K040"), ("\u0085", "K040"), ("\x1b[31m", "K040"),
             ("x" * 256, "K041"), ("\u20ac" * 86, "K041")]


@pytest.mark.parametrize("name,code", BAD_NAMES, ids=[c + "-" + repr(n)[1:8] for n, c in BAD_NAMES])
def test_invalid_names_rejected_when_written(tmp_path, name, code):
    with kdtr.File(tmp_path / "n.kdtr", "w") as f:
        for write in (lambda: f.create_group(name), lambda: f.create_dataset(name, data=np.ones(1)),
                      lambda: f.create_group("ok/" + name + "/deeper"),
                      lambda: f.attrs.__setitem__(name, 1)):
            with pytest.raises(KdtrError) as info:
                write()
            assert info.value.code == code
        assert f.keys() in ([], ["ok"])
    with kdtr.File(tmp_path / "n.kdtr") as f:  # nothing invalid reached the file
        assert len(f.attrs) == 0


def test_empty_path_components_rejected(tmp_path):
    with kdtr.File(tmp_path / "n.kdtr", "w") as f:
        with pytest.raises(KdtrError) as info:
            f.create_group("a//b")
        assert info.value.code == "K040"
        with pytest.raises(ValueError):
            f.create_group("/")


def test_names_that_are_not_utf8_rejected_when_written(tmp_path):
    """A lone surrogate passes the character checks but cannot be stored as UTF-8 (K039)."""
    with kdtr.File(tmp_path / "n.kdtr", "w") as f:
        for write in (lambda: f.create_group("a\ud800"), lambda: f.attrs.__setitem__("b\udfff", 1)):
            with pytest.raises(KdtrError) as info:
                write()
            assert info.value.code == "K039"
        f["fine"] = np.ones(1)  # and the file is still written
    with kdtr.File(tmp_path / "n.kdtr") as f:
        assert f.keys() == ["fine"] and len(f.attrs) == 0


def test_path_limits_when_written(tmp_path):
    with kdtr.File(tmp_path / "deep.kdtr", "w") as f:
        f.create_group("/".join(["d"] * 64))
        with pytest.raises(KdtrError) as info:
            f.create_group("/".join(["d"] * 65))
        assert info.value.code == "K042"
        with pytest.raises(KdtrError) as info:
            f.create_group("/".join(["p" * 255] * 17))
        assert info.value.code == "K042"
    with kdtr.File(tmp_path / "deep.kdtr") as f:
        assert "/".join(["d"] * 64) in f


# ----------------------------------------------------------------------------- zero copy, close

def _base_of(arr: np.ndarray):
    """The object that finally owns an array's memory (through views and memoryviews)."""
    while True:
        if isinstance(arr, np.ndarray) and arr.base is not None:
            arr = arr.base
        elif isinstance(arr, memoryview):
            arr = arr.obj
        else:
            return arr


def test_zero_copy_reads(small):
    with kdtr.File(small) as f:
        ds = f["a/b/c"]
        whole, part = ds[...], ds[1:, ::2]
        assert np.shares_memory(whole, part)
        assert np.shares_memory(whole, f["a/b/c"][...])
        assert not whole.flags.writeable and not part.flags.writeable
        assert isinstance(_base_of(part), mmap.mmap)
        with pytest.raises(ValueError):
            whole[0, 0] = 1
        np.testing.assert_array_equal(part, np.arange(12, dtype=np.float32).reshape(3, 4)[1:, ::2])


def test_arrays_stay_valid_after_close(small):
    f = kdtr.File(small)
    ds = f["a/b/c"]
    arr = ds[...]
    f.close()
    f.close()  # idempotent
    np.testing.assert_array_equal(arr, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert not f
    with pytest.raises(ValueError):
        ds[...]
    with pytest.raises(ValueError):
        f.verify()


# ----------------------------------------------------------------------------- atomic writes

def test_exception_inside_write_keeps_the_earlier_file(tmp_path):
    p = tmp_path / "keep.kdtr"
    with kdtr.File(p, "w") as f:
        f["v"] = np.arange(3)
    before = p.read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        with kdtr.File(p, "w") as f:
            f["v"] = np.arange(1000)
            f["w"] = np.ones(5)
            raise RuntimeError("boom")
    with pytest.raises(TypeError):
        with kdtr.File(p, "w") as f:
            f["v"] = np.ones(4)
            f["bad"] = np.array([object()])  # fails inside the writer
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.kdtr"]  # no temporary file left behind


def test_failed_open_for_writing_leaves_nothing_behind(tmp_path):
    """A constructor that refuses (bad alignment, mode "x" on an existing file, unknown mode)
    must not leave a temporary file, nor make ``__del__`` raise on the half-built object."""
    existing = tmp_path / "e.kdtr"
    existing.write_bytes(b"keep")
    caught = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        with pytest.raises(ValueError):
            kdtr.File(tmp_path / "a.kdtr", "w", align_log2=2)
        with pytest.raises(FileExistsError):
            kdtr.File(existing, "x")
        with pytest.raises(ValueError):
            kdtr.File(tmp_path / "b.kdtr", "a")
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert [str(u.exc_value) for u in caught] == []
    assert sorted(os.listdir(tmp_path)) == ["e.kdtr"] and existing.read_bytes() == b"keep"


def test_mode_x(tmp_path):
    p = tmp_path / "x.kdtr"
    with kdtr.File(p, "x") as f:
        f["v"] = np.ones(2)
    before = p.read_bytes()
    with pytest.raises(FileExistsError):
        kdtr.File(p, "x")
    assert p.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["x.kdtr"]
    with pytest.raises(ValueError):
        kdtr.File(p, "a")


# ----------------------------------------------------------------------------- checksums

def test_crc32c_check_value():
    assert checksum.crc32c(b"123456789") == 0xE3069283
    assert checksum.crc32c(b"") == 0


def _hardware_fallback():
    try:
        return checksum._make_hardware_fallback()
    except Exception as e:  # not x86-64 or no SSE4.2: the table fallback serves there
        pytest.skip(f"no SSE4.2 CRC32C path here: {e}")


@pytest.mark.parametrize("make", [checksum._make_fallback, _hardware_fallback],
                         ids=["slice-by-8", "sse4.2"])
def test_crc32c_fallback_matches_the_crc32c_package(make):
    hw = pytest.importorskip("crc32c")
    fallback = make()
    assert fallback(b"123456789") == 0xE3069283
    rng = np.random.default_rng(3)
    for n in [0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096 + 5, 1 << 20]:
        data = rng.bytes(n)
        assert fallback(data) == hw.crc32c(data), n
        cut = int(rng.integers(0, n + 1))
        chained = fallback(data[cut:], fallback(data[:cut]))
        assert chained == hw.crc32c(data[cut:], hw.crc32c(data[:cut])) == hw.crc32c(data), n
    arr = rng.standard_normal((5, 7))  # any buffer, not only bytes
    assert fallback(arr) == hw.crc32c(arr.tobytes())
    big = np.frombuffer(rng.bytes(4096), np.uint8)
    for start in range(9):  # every start alignment of the 8-byte word loop
        assert fallback(big[start:]) == hw.crc32c(big[start:].tobytes()), start


# ----------------------------------------------------------------------------- dtypes and layout

def test_int4_packing_layout():
    packed = pack_int4(np.array([[1, -1, -8, 7]], np.int8))
    assert packed.tolist() == [[0xF1, 0x78]]  # even index in the low nibble, two's complement
    assert unpack_int4(packed, (1, 4)).tolist() == [[1, -1, -8, 7]]
    with pytest.raises(ValueError):
        pack_int4(np.zeros(3, np.int8))
    with pytest.raises(ValueError):
        pack_int4(np.array([8, 0]))


@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 2**32 - 1))
def test_int4_round_trip(dims, seed):
    shape = tuple(dims[:-1]) + (2 * dims[-1],)
    values = np.random.default_rng(seed).integers(-8, 8, shape).astype(np.int8)
    packed = pack_int4(values)
    assert packed.dtype == np.uint8 and packed.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_array_equal(unpack_int4(packed, shape), values)


def test_int4_dataset_stores_packed_bytes(tmp_path):
    values = np.array([[1, -1, -8, 7], [0, 2, 3, -4]], np.int8)
    with kdtr.File(tmp_path / "q.kdtr", "w") as f:
        f.create_dataset("q", data=values, dtype="int4")
    with kdtr.File(tmp_path / "q.kdtr") as f:
        q = f["q"]
        assert q.kdtr_dtype == "int4" and q.shape == (2, 4) and q.storage_nbytes == 4
        assert q.packed().tolist() == [[0xF1, 0x78], [0x20, 0xC3]]
        np.testing.assert_array_equal(q[...], values)
        np.testing.assert_array_equal(q[1, 1:3], values[1, 1:3])


@pytest.mark.parametrize("align_log2", [3, 12, 16])
def test_alignment(tmp_path, align_log2):
    p = tmp_path / "al.kdtr"
    with kdtr.File(p, "w", align_log2=align_log2) as f:
        for i, n in enumerate([1, 3, 0, 17, 8]):
            f[f"d{i}"] = np.arange(n, dtype=np.uint8)
    with kdtr.File(p) as f:
        offsets = [f[f"d{i}"].offset for i in range(5)]
        assert all(o % (1 << align_log2) == 0 for o in offsets)
        assert offsets[0] == max(128, 1 << align_log2)  # the data section starts right there
        for i, n in enumerate([1, 3, 0, 17, 8]):
            np.testing.assert_array_equal(f[f"d{i}"][...], np.arange(n, dtype=np.uint8))
            assert f[f"d{i}"][...].ctypes.data % (1 << min(align_log2, 12)) == 0


def test_eight_dims_and_scalars(tmp_path):
    shape = (2, 1, 3, 1, 2, 1, 2, 1)
    a = np.arange(math.prod(shape), dtype=np.int16).reshape(shape)
    with kdtr.File(tmp_path / "d.kdtr", "w") as f:
        f["eight"] = a
        f["scalar"] = np.float32(1.5)
        f["bf16_scalar"] = np.array(-2.0, ml_dtypes.bfloat16)
    with kdtr.File(tmp_path / "d.kdtr") as f:
        np.testing.assert_array_equal(f["eight"][...], a)
        assert f["scalar"].shape == () and f["scalar"][...].shape == () and f["scalar"][()] == 1.5
        assert f["bf16_scalar"][()] == -2.0 and f["bf16_scalar"].dtype == ml_dtypes.bfloat16


def test_big_endian_input_stored_little_endian(tmp_path):
    big = np.array([1, 256, -2], dtype=">i4")
    bigf = np.array([1.5, -0.0, np.inf], dtype=">f8")
    with kdtr.File(tmp_path / "be.kdtr", "w") as f:
        f["i"] = big
        f["f"] = bigf
    with kdtr.File(tmp_path / "be.kdtr") as f:
        assert f["i"].dtype == np.dtype("<i4") and f["f"].dtype == np.dtype("<f8")
        assert f["i"].packed().tobytes() == big.astype("<i4").tobytes()
        np.testing.assert_array_equal(f["i"][...], big)
        assert f["f"][...].tobytes() == bigf.astype("<f8").tobytes()


def test_non_contiguous_input_stored_in_c_order(tmp_path):
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    views = {"transposed": base.T, "strided": base[::2, ::-3], "fortran": np.asfortranarray(base)}
    with kdtr.File(tmp_path / "nc.kdtr", "w") as f:
        for name, v in views.items():
            f[name] = v
    with kdtr.File(tmp_path / "nc.kdtr") as f:
        for name, v in views.items():
            got = f[name][...]
            assert got.flags.c_contiguous and got.shape == v.shape
            assert got.tobytes() == np.ascontiguousarray(v).tobytes()
            assert f[name].checksum == checksum.crc32c(np.ascontiguousarray(v).tobytes())


def test_node_table_lists_every_node_in_writer_order(tmp_path):
    """File.node_table(): the columns kdtr-dump and the HDF5 bridge read, against the h5py-style
    API of the same file."""
    path = tmp_path / "t.kdtr"
    with kdtr.File(path, "w") as f:
        f.create_dataset("b/x", data=np.arange(6, dtype=np.int16).reshape(2, 3))
        f.create_group("a").attrs["k"] = 1
        f["b"].attrs["n"] = 2
        f.create_dataset("a/y", data=np.float32(1.5))
    with kdtr.File(path) as f:
        t = f.node_table()
        assert t.paths == ("/", "/b", "/b/x", "/a", "/a/y")
        assert t.is_group == [True, True, False, True, False]
        assert t.children[0] == {"b": 1, "a": 3} and t.children[2] is None
        for i, p in enumerate(t.paths):
            if t.is_group[i]:
                assert (t.dtype[i], t.shape[i], t.nbytes[i]) == (None, None, 0)
                continue
            node = f[p]
            assert (t.dtype[i], t.shape[i], t.nbytes[i]) == (node.kdtr_dtype, node.shape,
                                                             node.nbytes)
            raw = np.fromfile(path, np.uint8, count=t.nbytes[i], offset=t.offset[i])
            assert raw.tobytes() == node.packed().tobytes()
        assert t.attr_count == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="mode 'r'"):
        kdtr.File(tmp_path / "w.kdtr", "w").node_table()

"""Verified reads (issue 16): ``Dataset.read``, ``Dataset.read_direct(verify=True)`` and
``Dataset.verify`` check a tensor's CRC32C on the bytes they copy; ``to_hdf5`` checks what it
converts.  A flipped bit anywhere in a tensor is caught, naming the file and the dataset; clean
data passes and lands in the destination unchanged."""
from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from formats import kdtr, reader
from formats.errors import KdtrError
from formats.hdf5 import to_hdf5

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(16)

# name -> (array written, dtype argument of create_dataset)
TENSORS = {
    "f32": (RNG.standard_normal((37, 129)).astype(np.float32), None),
    "bf16": (RNG.standard_normal((64, 300)).astype(BF16), None),
    "f16": (RNG.standard_normal(1001).astype(np.float16), None),
    "i64": (RNG.integers(-10**12, 10**12, (5, 7, 3)), None),
    "bool": (RNG.integers(0, 2, 77).astype(bool), None),
    "c64": ((RNG.standard_normal(33) + 1j * RNG.standard_normal(33)).astype(np.complex64), None),
    "int4": (RNG.integers(-8, 8, (6, 10)).astype(np.int8), "int4"),
    "scalar": (np.float64(2.5), None),
    "empty": (np.zeros((0, 4), np.float32), None),
}


def _write(path: Path, tensors=TENSORS) -> Path:
    with kdtr.File(path, "w") as f:
        for name, (a, dt) in tensors.items():
            f.create_dataset(f"g/{name}", data=a, dtype=dt)
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("verified") / "clean.kdtr")


def _flipped(clean: Path, tmp_path: Path, name: str, byte: int, bit: int = 0) -> Path:
    with kdtr.File(clean) as f:
        ds = f[f"g/{name}"]
        assert 0 <= byte < ds.storage_nbytes
        offset = ds.offset + byte
    raw = bytearray(clean.read_bytes())
    raw[offset] ^= 1 << bit
    out = tmp_path / "flip.kdtr"
    out.write_bytes(bytes(raw))
    return out


# ----------------------------------------------------------------------------- clean data

@pytest.mark.parametrize("name", list(TENSORS))
def test_read_returns_an_exact_writable_copy(clean, name):
    a, _ = TENSORS[name]
    with kdtr.File(clean) as f:
        got = f[f"g/{name}"].read()
        assert f[f"g/{name}"].verify() == f[f"g/{name}"].storage_nbytes
    assert got.flags.writeable and got.flags.c_contiguous
    assert got.shape == np.shape(a) and got.dtype == np.asarray(a).dtype
    np.testing.assert_array_equal(got.view(np.uint8) if got.ndim else got,
                                  np.ascontiguousarray(a).view(np.uint8) if got.ndim else a)


@pytest.mark.parametrize("name", [n for n in TENSORS if TENSORS[n][1] is None])
def test_read_direct_verify_into_contiguous_strided_and_cast_destinations(clean, name):
    a = np.asarray(TENSORS[name][0])
    with kdtr.File(clean) as f:
        ds = f[f"g/{name}"]
        same = np.full(a.shape, 0, a.dtype)
        ds.read_direct(same, verify=True)
        np.testing.assert_array_equal(same, a)
        if a.ndim >= 2:   # a transposed (strided) destination
            strided = np.zeros(a.shape[::-1], a.dtype).T
            ds.read_direct(strided, verify=True)
            np.testing.assert_array_equal(strided, a)
        if a.dtype.kind == "f" or a.dtype == BF16:   # cast while copying
            wide = np.zeros(a.shape, np.float64)
            ds.read_direct(wide, verify=True)
            np.testing.assert_array_equal(wide, a.astype(np.float64))
            np.testing.assert_array_equal(ds.read(np.float32), a.astype(np.float32))


def test_small_chunks_give_the_same_result(clean, monkeypatch):
    monkeypatch.setattr(reader, "COPY_CHUNK", 24)   # many chunks, none aligned to an element
    with kdtr.File(clean) as f:
        for name, (a, dt) in TENSORS.items():
            if dt is None:
                np.testing.assert_array_equal(f[f"g/{name}"].read(), a)


def test_read_direct_verify_refuses_a_selection_and_a_wrong_shape(clean):
    with kdtr.File(clean) as f:
        ds = f["g/f32"]
        with pytest.raises(ValueError, match="whole dataset"):
            ds.read_direct(np.zeros((2, 129), np.float32), np.s_[:2], verify=True)
        with pytest.raises(ValueError, match="shape"):
            ds.read_direct(np.zeros((37, 128), np.float32), verify=True)
        part = np.zeros((2, 129), np.float32)
        ds.read_direct(part, np.s_[:2])                 # h5py's form still works
        np.testing.assert_array_equal(part, TENSORS["f32"][0][:2])


def test_reads_work_while_writing(tmp_path):
    with kdtr.File(tmp_path / "w.kdtr", "w") as f:
        ds = f.create_dataset("x", data=np.arange(10, dtype=np.float32))
        np.testing.assert_array_equal(ds.read(), np.arange(10))
        assert ds.verify() == 40


# ----------------------------------------------------------------------------- damage

def _positions(name: str) -> list[int]:
    n = np.asarray(TENSORS[name][0]).nbytes if TENSORS[name][1] is None else \
        TENSORS[name][0].size // 2
    return sorted({0, 1, n // 2, n - 2, n - 1})


FLIPS = [(name, byte) for name in ("f32", "bf16", "i64", "c64", "int4", "f16")
         for byte in _positions(name)] + [("scalar", 0), ("scalar", 7), ("bool", 3)]


@pytest.mark.parametrize("name,byte", FLIPS, ids=[f"{n}@{b}" for n, b in FLIPS])
def test_a_flipped_bit_is_caught_by_every_verified_read(clean, tmp_path, name, byte):
    bad = _flipped(clean, tmp_path, name, byte, bit=byte % 8)
    with kdtr.File(bad) as f:
        ds = f[f"g/{name}"]
        calls = [ds.read, ds.verify, lambda: ds.read_direct(np.empty(ds.shape, ds.dtype),
                                                            verify=True)]
        for call in calls:
            with pytest.raises(KdtrError) as info:
                call()
            err = info.value
            assert err.code in ("K056", "K051"), str(err)
            assert err.node == f"/g/{name}" and err.file == os.fspath(bad)
            assert f"/g/{name}" in str(err) and "flip.kdtr" in str(err)
            assert str(err).startswith(err.code)
        ds.read(verify=False)                            # opting out reads it as it is
        for other in TENSORS:                            # the other tensors are fine
            if other != name:
                f[f"g/{other}"].read()


def test_flip_in_a_strided_or_cast_copy(clean, tmp_path):
    bad = _flipped(clean, tmp_path, "f32", 4 * 129 * 20 + 3)
    with kdtr.File(bad) as f:
        ds = f["g/f32"]
        with pytest.raises(KdtrError, match="K056.*/g/f32"):
            ds.read_direct(np.zeros((129, 37), np.float32).T, verify=True)
        with pytest.raises(KdtrError, match="K056.*/g/f32"):
            ds.read(np.float64)


@settings(max_examples=60, deadline=None)
@given(byte=st.integers(0, 64 * 300 * 2 - 1), bit=st.integers(0, 7),
       chunk=st.sampled_from([64, 1000, 4096, 256 << 10]))
def test_any_single_bit_flip_in_a_tensor_is_caught(tmp_path_factory, byte, bit, chunk):
    base = tmp_path_factory.getbasetemp() / "hyp_clean.kdtr"
    if not base.exists():
        _write(base, {"bf16": TENSORS["bf16"]})
    raw = bytearray(base.read_bytes())
    with kdtr.File(base) as f:
        raw[f["g/bf16"].offset + byte] ^= 1 << bit
    bad = tmp_path_factory.getbasetemp() / "hyp_bad.kdtr"
    bad.write_bytes(bytes(raw))
    saved, reader.COPY_CHUNK = reader.COPY_CHUNK, chunk
    try:
        with kdtr.File(bad) as f:
            with pytest.raises(KdtrError, match="K056"):
                f["g/bf16"].read()
    finally:
        reader.COPY_CHUNK = saved


def test_bool_bytes_other_than_0_or_1_are_caught(clean, tmp_path):
    bad = tmp_path / "bool.kdtr"
    raw = bytearray(clean.read_bytes())
    with kdtr.File(clean) as f:
        raw[f["g/bool"].offset + 5] = 2
    bad.write_bytes(bytes(raw))
    with kdtr.File(bad) as f:
        with pytest.raises(KdtrError) as info:
            f["g/bool"].read()
        assert info.value.code in ("K051", "K056")


# ----------------------------------------------------------------------------- converting, writing

def test_to_hdf5_refuses_a_damaged_tensor_and_leaves_nothing(clean, tmp_path):
    bad = _flipped(clean, tmp_path, "bf16", 1234)
    out = tmp_path / "out" / "x.h5"
    out.parent.mkdir()
    with pytest.raises(KdtrError) as info:
        to_hdf5(bad, out)
    assert info.value.code == "K056" and info.value.node == "/g/bf16"
    assert "flip.kdtr" in str(info.value)
    assert list(out.parent.iterdir()) == []              # no output, no temporary file
    to_hdf5(bad, out, verify=False)                       # opting out converts it as it is
    assert out.exists()
    to_hdf5(clean, tmp_path / "clean.h5")


@pytest.mark.parametrize("target", ["kdtr", "h5"])
def test_writing_into_a_missing_folder_names_the_folder(tmp_path, target):
    path = tmp_path / "nodir" / f"x.{target}"
    with pytest.raises(FileNotFoundError) as info:
        if target == "kdtr":
            kdtr.File(path, "w")
        else:
            to_hdf5("tests/vectors/sample_model.kdtr", path)
    assert info.value.filename == os.fspath(tmp_path / "nodir")
    assert ".tmp" not in str(info.value)


def test_kdtr_error_file_survives_copy_and_is_set_once():
    import copy
    err = KdtrError("K056", "stored 0x1, computed 0x2", "/w", "a.kdtr")
    again = copy.copy(err)
    assert str(again) == str(err) and again.file == "a.kdtr"
    assert err.set_file("b.kdtr").file == "a.kdtr"        # the innermost file wins
    assert str(err).startswith("K056") and "'a.kdtr'" in str(err)
    assert "a.kdtr" not in err.describe(with_file=False)

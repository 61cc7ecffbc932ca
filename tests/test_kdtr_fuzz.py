"""Mutation fuzzing of the KDTR reader: only ``KdtrError`` escapes, quickly, in bounded memory.

A few valid seed files are mutated (bit flips, byte writes, inserts, deletes, truncations,
splices of two files, duplicated chunks, and structured writes of 0 / all-ones / random /
boundary values into preamble, node and attribute fields), half of them with the checksums
recomputed afterwards: with stale checksums most mutations stop at K010/K019, with fresh ones
they reach the structural rules.  Every mutant is opened, and where it opens, every dataset,
attribute, ``visit``/``visititems`` and ``verify()`` are exercised too.  Deterministic (one
``random.Random`` seed), so a failure names a reproducible mutant, which is also saved.
"""
from __future__ import annotations

import collections
import faulthandler
import random
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kdtr_craft as K
from formats import kdtr
from formats import layout as L
from formats.kdtr import KdtrError

N_MUTANTS = 2000
SEED = 20240607
PER_FILE_LIMIT_S = 1.0
PEAK_LIMIT = 64 << 20
HANG_LIMIT_S = 180

BOUNDARY = [1, 2, 7, 8, 255, 256, 0x7FFF, 0xFFFF, 2**31, 2**32 - 1, 2**32, 2**48, 2**48 + 1,
            2**62, 2**63, 2**64 - 8]


# ----------------------------------------------------------------------------- seeds

def _attr_rich(path):
    with kdtr.File(path, "w", align_log2=4) as f:
        f.attrs["s"] = "h\u00e9llo \u4e16\u754c \U0001f600"
        f.attrs["i"] = -(2**63)
        f.attrs["f"] = float("nan")
        f.attrs["b"] = False
        f.attrs["l"] = ["x", "", "\u00fc"]
        f.attrs["el"] = []
        f.attrs["a0"] = np.array(3.5, ml_dtypes.bfloat16)
        f.attrs["a2"] = np.arange(6, dtype=np.complex64).reshape(2, 3)
        f.attrs["fp8"] = np.array([0.5, -2.0], ml_dtypes.float8_e4m3fn)
        f.attrs["bools"] = np.array([[True], [False]])
        d = f.create_dataset("d", data=np.ones(3, np.int16))
        d.attrs["u64"] = np.array([2**64 - 1], np.uint64)


def _all_dtypes(path):
    from formats.dtypes import BY_CODE
    rng = np.random.default_rng(1)
    with kdtr.File(path, "w", align_log2=3) as f:
        for code, dt in BY_CODE.items():
            g = f.require_group(f"t{code % 3}")
            if dt.name == "int4":
                values = rng.integers(-8, 8, (2, 4)).astype(np.int8)
                g.create_dataset(dt.name, data=values, dtype="int4")
            elif dt.name == "bool":
                g[dt.name] = rng.random(5) < 0.5
                g["bool0"] = np.bool_(True)
            else:
                g[dt.name] = rng.standard_normal(3).astype(dt.numpy)
        f["empty"] = np.zeros((0, 4), np.float64)
        f["scalar"] = np.int32(-7)


def _groups_only(path):
    with kdtr.File(path, "w") as f:
        f.create_group("a/b/c")
        f.create_group("a/d")


SEED_WRITERS = {
    "base-align8": lambda p: K.write_base(p, 8),
    "base-align3": lambda p: K.write_base(p, 3),
    "attr-rich": _attr_rich,
    "all-dtypes": _all_dtypes,
    "groups-only": _groups_only,
}


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("seeds")
    out = {}
    for name, write in SEED_WRITERS.items():
        p = d / f"{name}.kdtr"
        write(p)
        out[name] = p.read_bytes()
    return out


# ----------------------------------------------------------------------------- mutations

def _field_slots(raw: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every scalar field of the preamble, node and attribute records."""
    pre = np.frombuffer(raw, L.PREAMBLE_DTYPE, 1)[0]
    hoff, n, m = int(pre["header_offset"]), int(pre["node_count"]), int(pre["attr_count"])
    slots = []
    for base, count, dtype in ((0, 1, L.PREAMBLE_DTYPE), (hoff, n, L.NODE_DTYPE),
                               (hoff + n * L.NODE_SIZE, m, L.ATTR_DTYPE)):
        for k in range(count):
            for name in dtype.names:
                sub, off = dtype.fields[name][:2]
                if sub.subdtype is not None:  # dims: 8 x u8 etc.
                    item, shape = sub.subdtype
                    for e in range(int(np.prod(shape))):
                        at = base + k * dtype.itemsize + off + e * item.itemsize
                        slots.append((at, item.itemsize))
                elif sub.kind == "V":
                    slots.append((base + k * dtype.itemsize + off, min(sub.itemsize, 8)))
                else:
                    slots.append((base + k * dtype.itemsize + off, sub.itemsize))
    return slots


def _set_field(rng: random.Random, raw: bytearray, slots) -> str:
    off, size = rng.choice(slots)
    mask = (1 << (8 * size)) - 1
    old = int.from_bytes(raw[off:off + size], "little")
    how = rng.choice(["zero", "ones", "random", "plus1", "minus1", "boundary", "boundary"])
    value = {"zero": 0, "ones": mask, "random": rng.getrandbits(8 * size),
             "plus1": old + 1, "minus1": old - 1,
             "boundary": rng.choice(BOUNDARY) + rng.choice([-1, 0, 0, 1])}[how] & mask
    raw[off:off + size] = value.to_bytes(size, "little")
    return f"field@{off}/{size}={how}:{value:#x}"


def _mutate_once(rng: random.Random, raw: bytearray, other: bytes, slots) -> str:
    n = len(raw)
    op = rng.choice(["flip", "flip", "byte", "insert", "delete", "truncate", "splice", "dup",
                     "field", "field", "field", "field"])
    if op == "flip" and n:
        pos = rng.randrange(n)
        raw[pos] ^= 1 << rng.randrange(8)
        return f"flip@{pos}"
    if op == "byte" and n:
        pos = rng.randrange(n)
        raw[pos] = rng.choice([0, 0xFF, rng.randrange(256)])
        return f"byte@{pos}"
    if op == "insert":
        pos, k = rng.randrange(n + 1), rng.choice([1, 1, 4, 8, 64, 300])
        raw[pos:pos] = rng.randbytes(k) if rng.random() < 0.5 else b"\0" * k
        return f"insert@{pos}+{k}"
    if op == "delete" and n:
        pos = rng.randrange(n)
        k = rng.choice([1, 1, 4, 8, 64, 300])
        del raw[pos:pos + k]
        return f"delete@{pos}-{k}"
    if op == "truncate":
        cut = rng.randrange(n + 1) if rng.random() < 0.7 else max(0, n - rng.randrange(1, 9))
        del raw[cut:]
        return f"truncate@{cut}"
    if op == "splice":
        a, b = rng.randrange(n + 1), rng.randrange(len(other) + 1)
        raw[a:] = other[b:]
        return f"splice@{a}:{b}"
    if op == "dup" and n:
        a = rng.randrange(n)
        chunk = raw[a:a + rng.choice([8, 32, 128])]
        pos = rng.randrange(n + 1)
        raw[pos:pos] = chunk
        return f"dup@{a}->{pos}"
    return _set_field(rng, raw, slots)


def mutants(seeds: dict[str, bytes], count: int, seed: int):
    """Yield (description, bytes): ``count`` mutants, deterministic for ``seed``."""
    rng = random.Random(seed)
    names = sorted(seeds)
    slots = {name: _field_slots(seeds[name]) for name in names}
    for k in range(count):
        name = rng.choice(names)
        raw = bytearray(seeds[name])
        other = seeds[rng.choice(names)]
        n_steps = rng.choice([1, 1, 1, 2, 3])
        steps = [_mutate_once(rng, raw, other, slots[name]) for _ in range(n_steps)]
        fixed = rng.random() < 0.5
        data = K.refresh_crcs(bytes(raw)) if fixed else bytes(raw)
        yield f"#{k} {name} {'+'.join(steps)}{' crc-fixed' if fixed else ''}", data


# ----------------------------------------------------------------------------- exercising a file

def exercise(path: Path) -> None:
    """Everything a user can read from a file; only KdtrError may escape (checked by caller)."""
    with kdtr.File(path) as f:
        seen = []
        f.visititems(lambda name, obj: seen.append((name, obj)))
        names = []
        f.visit(names.append)
        assert names == [n for n, _ in seen]
        for node in [f] + [obj for _, obj in seen]:
            for key in node.attrs:
                value = node.attrs[key]
                if isinstance(value, np.ndarray):
                    value.tobytes()
            if isinstance(node, kdtr.Dataset):
                arr = node[...]
                assert arr.shape == node.shape and arr.dtype == node.dtype
                arr.tobytes()
                node.packed()
            else:
                list(node.keys())
        f.verify()


def test_mutants_raise_only_kdtr_error(seeds, tmp_path):
    for name, raw in seeds.items():  # the seeds themselves are valid
        p = tmp_path / f"{name}.kdtr"
        p.write_bytes(raw)
        exercise(p)

    # Mutants are made and written before tracing starts, so the traced loop measures the
    # reader alone (tracemalloc roughly doubles the cost of every Python allocation).  Each
    # has its own name: a file an earlier mutant may still have mapped is never truncated.
    cases = []
    for k, (desc, data) in enumerate(mutants(seeds, N_MUTANTS, SEED)):
        path = tmp_path / f"mutant{k}.kdtr"
        path.write_bytes(data)
        cases.append((desc, path))
    codes = collections.Counter()
    slowest = (0.0, "")
    # A reader that loops forever on some mutant must fail CI, not hang it.
    faulthandler.dump_traceback_later(HANG_LIMIT_S, exit=True)
    tracemalloc.start()
    try:
        for desc, path in cases:
            t0 = time.perf_counter()
            try:
                exercise(path)
                codes["opened"] += 1
            except KdtrError as e:
                codes[e.code] += 1
            except BaseException as e:
                raise AssertionError(
                    f"{desc}: {type(e).__name__}: {e} (mutant kept at {path})") from e
            dt = time.perf_counter() - t0
            if dt > slowest[0]:
                slowest = (dt, desc)
            path.unlink()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        faulthandler.cancel_dump_traceback_later()

    assert slowest[0] < PER_FILE_LIMIT_S, f"slowest mutant took {slowest[0]:.2f} s: {slowest[1]}"
    assert peak < PEAK_LIMIT, f"peak traced memory {peak / 2**20:.1f} MiB"
    # The fuzz must reach deep into the reader, not stop at the checksums: with fresh CRCs the
    # structural rules fire, and some mutants (data bytes, optional fields) still open.
    assert sum(codes.values()) == N_MUTANTS
    assert codes["opened"] > 0
    structural = set(codes) - {"opened", "K001", "K002", "K003", "K010", "K017", "K018", "K019"}
    assert len(structural) >= 25, dict(codes)


def test_mutants_are_deterministic(seeds):
    first = [d for _, d in zip(range(50), mutants(seeds, 50, SEED))]
    again = [d for _, d in zip(range(50), mutants(seeds, 50, SEED))]
    assert first == again
    assert len({data for _, data in first}) > 40  # and actually different from each other


def test_refresh_crcs_makes_a_valid_file_stay_valid(seeds, tmp_path):
    for name, raw in seeds.items():
        assert K.refresh_crcs(raw) == raw, name
    damaged = bytearray(seeds["base-align8"])
    damaged[44] = 1  # reserved0: with fresh checksums the reserved-field rule fires
    p = tmp_path / "r.kdtr"
    p.write_bytes(K.refresh_crcs(bytes(damaged)))
    with pytest.raises(KdtrError) as info:
        kdtr.File(p)
    assert info.value.code == "K009"

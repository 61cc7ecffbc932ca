#!/usr/bin/env python3
"""Benchmark the KDTR container against safetensors and HDF5 (h5py) on this machine's CPU.

Measures, on the same model-like mix of tensors (a few 64-256 MiB, many 1-16 MiB, many tiny;
fp32 and bf16) written in all three formats:
  * write time (each writer's file is fsynced, as KDTR's writer does itself);
  * open + read every tensor, page cache cold and warm, with the same consumer for all
    (``np.copyto`` of every byte into one preallocated buffer), in GB/s (1e9 bytes/s); warm
    timings are the best of ``--repeats`` runs (the least disturbed on a shared machine);
  * the same warm with a page-touch consumer (one byte per 4 KiB page), where zero-copy shows;
  * open and list a KDTR file of 100,000 tiny tensors (goal < 0.5 s), h5py for reference;
  * ``verify()`` throughput with the ``crc32c`` package, and CRC32C of the same bytes with the
    numba fallback(s) used where that package is missing (goal >= 2 GB/s);
  * bundle load verification (issue 16): every tensor of the medium model bundle (and of a
    multi-GiB bf16 file) copied out with ``Dataset.read``/``read_direct``, without and with
    CRC32C verification (median of >= 5 runs), beside memcpy and raw CRC32C roofs;
  * peak memory while reading tensor by tensor, one subprocess per reader: anonymous memory
    (RssAnon) against the tensor being held, plus RssFile, VmHWM and ru_maxrss.
Every measurement is printed in a markdown table beside its roof (memcpy, sequential disk read,
raw CRC32C speed) and its goal.

    python3 tools/bench_kdtr.py                   # 1 GiB, 100,000 tiny tensors (~3 min here)
    python3 tools/bench_kdtr.py --quick           # 64 MiB, 10,000 tiny tensors (smoke test)
    python3 tools/bench_kdtr.py --json out.json --workdir /mnt/nvme
    python3 tools/bench_kdtr.py --load-verify      # bundle load without / with CRC32C checks

"Cold" drops the page cache with ``echo 1 > /proc/sys/vm/drop_caches`` (root) and otherwise
with ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file; the method used is reported.  In a VM
the host may still cache the disk image, so "cold" means "not in this kernel's page cache".
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import h5py
import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from formats import checksum, kdtr  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
H5_DTYPE_ATTR = "kdtr.dtype"  # HDF5 has no bf16: bit patterns as uint16 + this marker
PAGE = 4096
ANON_SLACK = 8 * MiB          # interpreter bookkeeping allowed beyond the tensor asked for


# ----------------------------------------------------------------------------- the data

def _shaped(rng, nbytes: int, dtype: np.dtype, cols: int) -> np.ndarray:
    """About ``nbytes`` of N(0, 0.02) values as a (rows, cols) matrix of ``dtype``."""
    cols = max(1, min(cols, nbytes // dtype.itemsize))
    rows = max(1, nbytes // (cols * dtype.itemsize))
    values = rng.standard_normal((rows, cols), dtype=np.float32)
    values *= 0.02
    return values if dtype == F32 else values.astype(dtype)


def model_like_tensors(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A checkpoint-like mix totalling ~``total_bytes``: three big tensors (1/4, 1/8, 1/16 of
    the total), 1-16 MiB projection matrices filling most of the rest, and ~2000 tiny vectors
    per GiB (norms, biases, scales; 8 B - 16 KiB).  fp32 and bf16 mixed.  Returned in the
    order safetensors lays tensors out (itemsize descending, then name), which all three
    writers then follow, so every format reads its file front to back."""
    rng = np.random.default_rng(seed)
    out = {
        "model/embed_tokens/weight": _shaped(rng, total_bytes // 4, F32, 4096),
        "lm_head/weight": _shaped(rng, total_bytes // 8, BF16, 4096),
        "model/layers/000/mlp/experts_fused/weight": _shaped(rng, total_bytes // 16, F32, 4096),
    }
    n_tiny = max(200, min(4000, int(2000 * total_bytes / GiB)))
    tiny_kinds = ["input_norm", "post_norm", "q_norm", "kv_norm", "bias", "scale"]
    for i in range(n_tiny):
        n = int(rng.integers(4, 4097))
        dtype = F32 if rng.random() < 0.5 else BF16
        out[f"model/layers/{i // len(tiny_kinds):03d}/{tiny_kinds[i % len(tiny_kinds)]}/weight"] = (
            (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(dtype))
    budget = total_bytes - sum(a.nbytes for a in out.values())
    proj_kinds = ["q_proj", "kv_a_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    i = 0
    while budget >= MiB:
        nbytes = min(budget, int(rng.integers(1, 17)) * MiB - int(rng.integers(0, 64)) * 1024)
        dtype = F32 if rng.random() < 0.5 else BF16
        a = _shaped(rng, nbytes, dtype, 2048)
        out[f"model/layers/{i // len(proj_kinds):03d}/{proj_kinds[i % len(proj_kinds)]}/weight"] = a
        budget -= a.nbytes
        i += 1
    order = sorted(out, key=lambda k: (-out[k].dtype.itemsize, k))
    return {k: out[k] for k in order}


def tiny_tensors(count: int, seed: int = 1) -> dict[str, np.ndarray]:
    """``count`` fp32 vectors of 1-64 elements under 1000-member groups (test-vector-like)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 65, count)
    pool = rng.standard_normal(int(lengths.sum()), dtype=np.float32)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return {f"blocks/{i // 1000:03d}/t{i % 1000:03d}": pool[s:s + n]
            for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist()))}


# ----------------------------------------------------------------------------- writers

def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_kdtr(path: str, tensors: dict[str, np.ndarray]) -> None:
    with kdtr.File(path, "w") as f:  # close() fsyncs and renames
        for name, a in tensors.items():
            f.create_dataset(name, data=a)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, path)
    _fsync_path(path)


def write_h5(path: str, tensors: dict[str, np.ndarray]) -> None:
    with h5py.File(path, "w") as f:  # contiguous (no chunks), no compression
        groups: dict[str, h5py.Group] = {}
        for name, a in tensors.items():
            parent, leaf = name.rsplit("/", 1)
            group = groups.get(parent) or groups.setdefault(parent, f.require_group(parent))
            if a.dtype == BF16:
                group.create_dataset(leaf, data=a.view(np.uint16)).attrs[H5_DTYPE_ATTR] = "bfloat16"
            else:
                group.create_dataset(leaf, data=a)
    _fsync_path(path)


WRITERS = {"kdtr": (write_kdtr, ".kdtr"), "safetensors": (write_safetensors, ".safetensors"),
           "hdf5": (write_h5, ".h5")}


# ----------------------------------------------------------------------------- readers
# Each yields the tensors of ``names`` in order, one at a time, and keeps no reference to a
# tensor once it has handed it out (so the memory probe sees one tensor held at a time).

def read_kdtr(path: str, names: list[str]) -> Iterator[np.ndarray]:
    with kdtr.File(path) as f:
        for name in names:
            yield f[name][...]


def read_st_load_file(path: str, names: list[str]) -> Iterator[np.ndarray]:
    tensors = load_file(path)
    for name in names:
        yield tensors.pop(name)


def read_st_safe_open(path: str, names: list[str]) -> Iterator[np.ndarray]:
    with safe_open(path, framework="np") as f:
        for name in names:
            yield f.get_tensor(name)


def _h5_array(ds) -> np.ndarray:
    a = ds[...]
    if a.dtype == np.uint16 and ds.attrs.get(H5_DTYPE_ATTR) == "bfloat16":
        a = a.view(BF16)
    return a


def read_h5(path: str, names: list[str]) -> Iterator[np.ndarray]:
    with h5py.File(path, "r") as f:
        for name in names:
            yield _h5_array(f[name])


READERS: dict[str, tuple[Callable, str]] = {  # label -> (reader, which file)
    "KDTR f[name][...]": (read_kdtr, "kdtr"),
    "safetensors load_file": (read_st_load_file, "safetensors"),
    "safetensors safe_open": (read_st_safe_open, "safetensors"),
    "h5py ds[...]": (read_h5, "hdf5"),
}


# ----------------------------------------------------------------------------- consumers

def _bytes_of(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


class CopyConsumer:
    """Copies every byte into one preallocated (and pre-faulted) buffer: the same work for all
    readers, and every page of the tensor is really read."""

    def __init__(self, max_nbytes: int):
        self.scratch = np.ones(max(1, max_nbytes), np.uint8)

    def __call__(self, a: np.ndarray) -> None:
        flat = _bytes_of(a)
        np.copyto(self.scratch[:flat.size], flat)


def touch_pages(a: np.ndarray) -> int:
    """Reads one byte per 4 KiB page: faults every page in, allocates nothing."""
    return int(_bytes_of(a)[::PAGE].sum())


# ----------------------------------------------------------------------------- page cache

def drop_page_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns the method that was used.  Pages that are
    still memory-mapped are not evicted, so unreachable ``kdtr.File`` objects (a File refers to
    itself, so only the cycle collector frees it and its map) are collected first."""
    gc.collect()
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "echo 1 > /proc/sys/vm/drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(POSIX_FADV_DONTNEED)"


# ----------------------------------------------------------------------------- timing

def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_pass(reader: Callable, path: str, names: list[str], consume: Callable) -> float:
    """Seconds to open ``path`` and hand every tensor to ``consume``."""
    t0 = time.perf_counter()
    for a in reader(path, names):
        consume(a)
        del a
    return time.perf_counter() - t0


def check_roundtrip(reader: Callable, path: str, tensors: dict[str, np.ndarray]) -> None:
    names = list(tensors)
    for name, a in zip(names, reader(path, names)):
        ref = tensors[name]
        if a.dtype != ref.dtype or a.shape != ref.shape or not np.array_equal(
                _bytes_of(a), _bytes_of(ref)):
            raise AssertionError(f"{reader.__name__} read {name!r} back wrong")
        del a


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs: on a shared machine the least-disturbed one."""
    return min(timed(fn) for _ in range(repeats))


def best_wall_and_cpu(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(fastest wall time, fastest CPU time of this process) over ``repeats`` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


# ----------------------------------------------------------------------------- memory probe

def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def memory_child(label: str, path: str, manifest: str) -> dict:
    """Run in a fresh interpreter: read every tensor with ``label``'s reader, touching each
    page, and watch RssAnon after each tensor against the bytes of the tensor held."""
    names = json.loads(Path(manifest).read_text())
    reader = READERS[label][0]
    gc.collect()
    base = proc_status()
    peak_anon = peak_file = 0
    worst_excess, worst_name = -(1 << 62), None
    for name, a in zip(names, reader(path, names)):
        touch_pages(a)
        s = proc_status()
        excess = s["RssAnon"] - base["RssAnon"] - a.nbytes
        if excess > worst_excess:
            worst_excess, worst_name = excess, name
        peak_anon, peak_file = max(peak_anon, s["RssAnon"]), max(peak_file, s["RssFile"])
        del a
    end = proc_status()
    return {"base": base, "peak_anon_growth": peak_anon - base["RssAnon"],
            "peak_file_growth": peak_file - base["RssFile"],
            "anon_excess_over_held_tensor": worst_excess, "worst_at": worst_name,
            "VmHWM": end["VmHWM"], "VmHWM_growth": end["VmHWM"] - base["VmHWM"],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


# Linux keeps a process's ru_maxrss across execve, and a forked child starts from its parent's
# high-water mark: a child started straight from this (big) process would report our peak, not
# its own.  A small launcher process in between gives the probe a clean ru_maxrss.
_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def measure_memory(label: str, path: str, manifest: str) -> dict:
    cmd = [sys.executable, "-S", "-c", _LAUNCHER,
           sys.executable, __file__, "--memory-child", label, path, manifest]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report

class Table:
    def __init__(self):
        self.rows: list[dict] = []

    def add(self, measurement: str, value: float | None, unit: str, text: str | None = None, *,
            roof: str = "", goal: str = "", ok: bool | None = None) -> None:
        shown = text if text is not None else f"{value:.3g} {unit}".strip()
        self.rows.append({"measurement": measurement, "value": value, "unit": unit,
                          "shown": shown, "roof": roof, "goal": goal,
                          "verdict": "" if ok is None else ("pass" if ok else "FAIL")})

    def markdown(self) -> str:
        lines = ["| measurement | value | roof | goal | verdict |", "|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['measurement']} | {r['shown']} | {r['roof'] or '-'} | "
                         f"{r['goal'] or '-'} | {r['verdict'] or '-'} |")
        return "\n".join(lines)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def machine_description(workdir: str) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor() or "?")
    mem = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal"))
    fs = max((ln.split() for ln in open("/proc/mounts")
              if os.path.realpath(workdir).startswith(ln.split()[1])), key=lambda f: len(f[1]))
    return (f"{cpu}, {os.cpu_count()} cores, {mem / (1 << 20):.0f} GiB RAM, {fs[2]} on {fs[0]}, "
            f"Linux {platform.release()}, Python {platform.python_version()}, "
            f"NumPy {np.__version__}, h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}), "
            f"safetensors {safetensors.__version__}, CRC32C backend {checksum.BACKEND}")


# ----------------------------------------------------------------------------- benchmarks

def bench_roofs(paths: dict[str, str], table: Table, repeats: int) -> dict[str, float]:
    """memcpy, cold sequential read and raw CRC32C speeds: what the readers are held against."""
    src, dst = np.ones(256 * MiB, np.uint8), np.zeros(256 * MiB, np.uint8)
    memcpy = gbps(src.nbytes, best_time(lambda: np.copyto(dst, src), repeats))
    crc = gbps(src.nbytes, best_time(lambda: checksum.crc32c(src), repeats))
    path = paths["kdtr"]
    buf = bytearray(64 * MiB)
    drop_page_cache([path])

    def read_sequentially():
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    disk = gbps(os.path.getsize(path), timed(read_sequentially))
    table.add("roof: memcpy, 1 thread (np.copyto 256 MiB)", memcpy, "GB/s")
    table.add("roof: sequential read, cold (64 MiB readinto)", disk, "GB/s")
    table.add(f"roof: raw CRC32C ({checksum.BACKEND}), in memory", crc, "GB/s")
    return {"memcpy": memcpy, "disk": disk, "crc": crc}


def write_roof(workdir: str) -> float:
    """GB/s of a sequential 256 MiB write + fsync: what the writers are held against."""
    path, chunk = os.path.join(workdir, "roof.bin"), np.ones(64 * MiB, np.uint8)

    def write():
        with open(path, "wb", buffering=0) as fh:
            for _ in range(4):
                fh.write(memoryview(chunk))
            os.fsync(fh.fileno())
    seconds = timed(write)
    os.unlink(path)
    return gbps(4 * chunk.nbytes, seconds)


def bench_writes(tensors: dict[str, np.ndarray], workdir: str, table: Table) -> dict:
    total = sum(a.nbytes for a in tensors.values())
    roof = write_roof(workdir)
    table.add("roof: sequential write + fsync (256 MiB)", roof, "GB/s")
    paths = {}
    for fmt, (writer, ext) in WRITERS.items():
        paths[fmt] = os.path.join(workdir, "mix" + ext)
        seconds = timed(lambda: writer(paths[fmt], tensors))
        table.add(f"write {fmt} + fsync ({os.path.getsize(paths[fmt]) / MiB:.0f} MiB file)",
                  gbps(total, seconds), "GB/s", roof=f"{roof:.3g} GB/s disk")
    return paths


def bench_reads(tensors: dict, paths: dict, table: Table, roofs: dict, repeats: int,
                cold: bool) -> str:
    names, total = list(tensors), sum(a.nbytes for a in tensors.values())
    copy = CopyConsumer(max(a.nbytes for a in tensors.values()))
    method = "skipped"
    for label, (reader, fmt) in READERS.items():
        check_roundtrip(reader, paths[fmt], tensors)
        if cold:
            method = drop_page_cache([paths[fmt]])
            t = read_pass(reader, paths[fmt], names, copy)
            table.add(f"read cold, {label}, copy consumer", gbps(total, t), "GB/s",
                      roof=f"{roofs['disk']:.3g} GB/s disk")
        else:
            read_pass(reader, paths[fmt], names, copy)  # warm the page cache (the cold pass did)
        t = best_time(lambda: read_pass(reader, paths[fmt], names, copy), repeats)
        table.add(f"read warm, {label}, copy consumer", gbps(total, t), "GB/s",
                  roof=f"{roofs['memcpy']:.3g} GB/s memcpy")
        t = best_time(lambda: read_pass(reader, paths[fmt], names, touch_pages), repeats)
        table.add(f"read warm, {label}, page-touch consumer", gbps(total, t), "GB/s")
    return method


def _verify_warm(path: str, repeats: int) -> tuple[int, float]:
    with kdtr.File(path) as f:
        total = f.verify()
        return total, best_time(f.verify, repeats)


# The CRC32C implementations used where the crc32c package is missing (the H200 image):
# (label, factory in formats.checksum); a factory this checkout lacks is skipped.
FALLBACKS = [("numba fallback", "_make_fallback"),
             ("numba hardware fallback", "_make_hardware_fallback")]


def _crc_fallback_warm(path: str, make_fallback: Callable, repeats: int) -> float:
    """Seconds for a fallback CRC32C to checksum every tensor's bytes (from the same map)."""
    fallback = make_fallback()
    fallback(np.zeros(64, np.uint8))  # compile outside the timing
    with kdtr.File(path) as f:
        datasets: list = []
        f.visititems(lambda _n, obj: datasets.append(obj)
                     if isinstance(obj, kdtr.Dataset) else None)

        def checksum_all():
            for ds in datasets:
                if fallback(_bytes_of(ds.packed())) != ds.checksum:
                    raise AssertionError(f"numba CRC32C disagrees on {ds.name}")
        return best_time(checksum_all, repeats)


def _verify_cold(path: str) -> float:
    drop_page_cache([path])
    with kdtr.File(path) as f:
        return timed(f.verify)


def bench_verify(path: str, table: Table, roofs: dict, repeats: int) -> None:
    # Each step in its own function: a File still referenced would keep its pages mapped,
    # and mapped pages survive drop_caches.
    total, t = _verify_warm(path, repeats)
    table.add(f"verify() warm, {checksum.BACKEND} package", gbps(total, t), "GB/s",
              roof=f"{roofs['crc']:.3g} GB/s raw CRC", goal=">= 2 GB/s", ok=gbps(total, t) >= 2)
    for label, factory in FALLBACKS:
        if hasattr(checksum, factory):
            t = _crc_fallback_warm(path, getattr(checksum, factory), repeats)
            table.add(f"CRC32C of every tensor warm, {label} `{factory}()` (same bytes)",
                      gbps(total, t), "GB/s", goal=">= 2 GB/s", ok=gbps(total, t) >= 2)
    table.add(f"verify() cold, {checksum.BACKEND} package", gbps(total, _verify_cold(path)), "GB/s",
              roof=f"{roofs['disk']:.3g} GB/s disk")


def _list_all(opener: Callable, path: str) -> int:
    """Open ``path`` and list every path in it (groups and datasets), as ``h5ls -r`` does."""
    names: list[str] = []
    with opener(path, "r") as f:
        f.visit(names.append)
    return len(names)


def _open_close(opener: Callable, path: str) -> None:
    opener(path, "r").close()


def bench_open(count: int, workdir: str, table: Table, repeats: int) -> None:
    tensors = tiny_tensors(count)
    kpath, hpath = os.path.join(workdir, "tiny.kdtr"), os.path.join(workdir, "tiny.h5")
    t_kw, t_hw = timed(lambda: write_kdtr(kpath, tensors)), timed(lambda: write_h5(hpath, tensors))
    table.add(f"write {count:,} tiny tensors: KDTR ({os.path.getsize(kpath) / MiB:.0f} MiB) / "
              f"h5py ({os.path.getsize(hpath) / MiB:.0f} MiB)", None, "",
              f"{t_kw:.2f} s / {t_hw:.2f} s")
    n_paths = count + len({name.rsplit("/", 1)[0] for name in tensors}) + 1  # + groups
    if _list_all(kdtr.File, kpath) != n_paths:
        raise AssertionError(f"KDTR did not list {n_paths} paths")
    repeats = max(repeats, 5)  # each run is short; more of them ride out other work on the cores
    t, cpu = best_wall_and_cpu(lambda: _open_close(kdtr.File, kpath), repeats)
    table.add(f"open KDTR, {count:,} tiny tensors, warm", t, "s", f"{t:.3g} s (CPU {cpu:.3g} s)",
              goal="< 0.5 s", ok=t < 0.5)
    t, cpu = best_wall_and_cpu(lambda: _list_all(kdtr.File, kpath), repeats)
    table.add(f"open + list all {n_paths:,} paths, KDTR, warm", t, "s",
              f"{t:.3g} s (CPU {cpu:.3g} s)", goal="< 0.5 s", ok=t < 0.5)
    t = best_time(lambda: _open_close(h5py.File, hpath), repeats)
    table.add(f"open h5py, {count:,} tiny tensors, warm", t, "s")
    listed = [0]
    t = timed(lambda: listed.__setitem__(0, _list_all(h5py.File, hpath)))  # slow: timed once
    if listed[0] != n_paths:
        raise AssertionError(f"h5py listed {listed[0]} paths, not {n_paths}")
    table.add(f"open + list all {n_paths:,} paths, h5py, warm (1 run)", t, "s")
    drop_page_cache([kpath, hpath])
    table.add(f"open + list all {n_paths:,} paths, KDTR, cold",
              timed(lambda: _list_all(kdtr.File, kpath)), "s")
    table.add(f"open + list all {n_paths:,} paths, h5py, cold",
              timed(lambda: _list_all(h5py.File, hpath)), "s")

    def read_all():
        with kdtr.File(kpath) as f:
            for name in tensors:
                f[name][...]
    t = timed(read_all)  # one run: it is slow, and per-tensor cost is all it shows
    table.add(f"open + read all {count:,} tiny tensors, KDTR, warm (1 run)", t, "s",
              f"{t:.3g} s ({t / count * 1e6:.1f} us/tensor)")


def bench_memory(tensors: dict, paths: dict, workdir: str, table: Table) -> dict:
    manifest = os.path.join(workdir, "names.json")
    Path(manifest).write_text(json.dumps(list(tensors)))
    largest = max(a.nbytes for a in tensors.values())
    results = {}
    for label, (_reader, fmt) in READERS.items():
        r = results[label] = measure_memory(label, paths[fmt], manifest)
        is_kdtr = fmt == "kdtr"
        table.add(f"memory, {label}: RssAnon beyond the tensor held (worst)",
                  r["anon_excess_over_held_tensor"] / MiB, "MiB",
                  goal=f"<= {ANON_SLACK // MiB} MiB" if is_kdtr else "",
                  ok=r["anon_excess_over_held_tensor"] <= ANON_SLACK if is_kdtr else None)
        maxrss_growth = r["ru_maxrss"] - r["base"]["VmHWM"]
        table.add(f"memory, {label}: peak RssAnon / RssFile / VmHWM / ru_maxrss growth", None, "",
                  f"{r['peak_anon_growth'] / MiB:.0f} / {r['peak_file_growth'] / MiB:.0f} / "
                  f"{r['VmHWM_growth'] / MiB:.0f} / {maxrss_growth / MiB:.0f} MiB "
                  f"(largest tensor {largest / MiB:.0f} MiB)")
    return results


# ----------------------------------------------------------------------------- issue 16

def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` runs (load verification: typical, not best-case, cost)."""
    return float(np.median([timed(fn) for _ in range(repeats)]))


def write_big_bf16(path: str, gib: float) -> None:
    """``gib`` GiB of bf16 tensors of 64 MiB ([8192, 4096]), each its own bytes."""
    rng = np.random.default_rng(16)
    block = rng.integers(0, 1 << 16, size=(8192, 4096), dtype=np.uint16)
    with kdtr.File(path, "w") as f:
        for i in range(max(1, round(gib * GiB / block.nbytes))):
            block[0, :4] = i   # distinct contents (and checksums) per tensor
            f.create_dataset(f"layers/{i}/w", data=block.view(BF16))


def _datasets(f: kdtr.File) -> list:
    t = f.node_table()
    return [f[p] for p, g in zip(t.paths, t.is_group) if not g]


def bench_load_verify(workdir: str, table: Table, repeats: int, big_gib: float,
                      cold: bool = True) -> None:
    """What checking every tensor's CRC32C costs when a bundle is loaded (issue 16): every
    tensor copied out of the (warm) file with ``Dataset.read`` / ``read_direct``, without and
    with ``verify=True``, median of ``repeats`` with the page cache warm (and once each cold);
    beside it the memcpy and CRC32C roofs."""
    from formats import reader
    from kdtree_numba.bundle import make_random_bundle
    src, dst = np.ones(GiB, np.uint8), np.zeros(GiB, np.uint8)   # past the L3 cache
    memcpy = gbps(src.nbytes, median_time(lambda: np.copyto(dst, src), repeats))
    crc = gbps(src.nbytes // 4, median_time(lambda: checksum.crc32c(src[:GiB // 4]), repeats))
    del src, dst
    table.add("roof: memcpy RAM -> RAM, 1 thread (np.copyto 1 GiB, median)", memcpy, "GB/s")
    table.add(f"roof: raw CRC32C ({checksum.BACKEND}), in memory", crc, "GB/s")
    cases = [("medium bundle", os.path.join(workdir, "medium.kdtr"), None)]
    if big_gib > 0:
        free = shutil.disk_usage(workdir).free
        if free > 1.5 * big_gib * GiB:
            cases.append((f"{big_gib:g} GiB file", os.path.join(workdir, "big.kdtr"), big_gib))
        else:
            table.add(f"{big_gib:g} GiB file", None, "", f"skipped: {free / GiB:.1f} GiB free "
                      f"in {workdir}")
    for label, path, gib in cases:
        if gib is None:
            make_random_bundle(path, "medium", 0, "bfloat16")
        else:
            write_big_bf16(path, gib)
        with kdtr.File(path) as f:
            dss = _datasets(f)
            total = sum(d.storage_nbytes for d in dss)
            head = (f"{label} ({len(dss)} tensors, {total / MiB:,.0f} MiB bf16, "
                    f"chunk {reader.COPY_CHUNK >> 10} KiB)")
            f.verify()   # pages warm, and a check that the file is sound
            roof = f"{memcpy:.3g} GB/s memcpy"

            def fresh(verify: bool) -> None:
                for d in dss:
                    d.read(verify=verify)

            dest = [np.zeros(d.shape, d.dtype) for d in dss]   # pages faulted in up front

            def into(verify: bool) -> None:
                for d, o in zip(dss, dest):
                    d.read_direct(o, verify=verify)

            for what, fn in (("read() into new arrays", fresh),
                             ("read_direct() into preallocated arrays", into)):
                plain = median_time(lambda: fn(False), repeats)
                checked = median_time(lambda: fn(True), repeats)
                table.add(f"{head}: {what}, without verification", gbps(total, plain), "GB/s",
                          f"{plain:.3f} s, {gbps(total, plain):.3g} GB/s", roof=roof)
                table.add(f"{head}: {what}, with CRC32C verification", gbps(total, checked),
                          "GB/s", f"{checked:.3f} s, {gbps(total, checked):.3g} GB/s "
                          f"(+{(checked / plain - 1) * 100:.0f}% time)", roof=roof)
            del dest
            t = median_time(f.verify, repeats)
            table.add(f"{head}: File.verify() alone (CRC32C in place, no copy)",
                      gbps(total, t), "GB/s", f"{t:.3f} s, {gbps(total, t):.3g} GB/s",
                      roof=f"{crc:.3g} GB/s raw CRC")
            del dss
        if cold:
            method, cold_times = "", {}
            for verify in (False, True):
                method, cold_times[verify] = _cold_read(path, verify)
            plain, checked = cold_times[False], cold_times[True]
            table.add(f"{head}: read() into new arrays, page cache cold ({method}), without "
                      "/ with verification (1 run each)", gbps(total, checked), "GB/s",
                      f"{plain:.2f} s / {checked:.2f} s ({gbps(total, plain):.3g} / "
                      f"{gbps(total, checked):.3g} GB/s)")
        os.unlink(path)


def _cold_read(path: str, verify: bool) -> tuple[str, float]:
    """(drop method, seconds) to open ``path`` with a cold page cache and read() every tensor.
    Its own function: a File or view still alive would keep pages mapped through the drop."""
    gc.collect()
    os.sync()
    fd = os.open(path, os.O_RDONLY)   # this file only: the machine's other work keeps its cache
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    method = "posix_fadvise(POSIX_FADV_DONTNEED)"
    t0 = time.perf_counter()
    with kdtr.File(path) as f:
        for d in _datasets(f):
            d.read(verify=verify)
    return method, time.perf_counter() - t0


# ----------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, help="size of the tensor mix in GiB (default 1)")
    p.add_argument("--tiny-count", type=int,
                   help="tensors in the open test (default 100,000)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: defaults become 64 MiB and 10,000 tiny tensors")
    p.add_argument("--repeats", type=int, default=3, help="warm timings: best of this many")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache reads")
    p.add_argument("--workdir", help="where temporary files go (a fresh subfolder, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temporary files")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--load-verify", action="store_true",
                   help="only the bundle load verification section (issue 16): the medium "
                        "bundle and a --big-gib file, copied without / with CRC32C checks")
    p.add_argument("--big-gib", type=float,
                   help="size of the big bf16 file of that section (default 3.5 with "
                        "--load-verify, 0 = none in the full run)")
    p.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.big_gib is None:
        args.big_gib = 3.5 if args.load_verify else 0.0
    size_gib, tiny_count = (1 / 16, 10_000) if args.quick else (1.0, 100_000)
    args.size_gib = size_gib if args.size_gib is None else args.size_gib
    args.tiny_count = tiny_count if args.tiny_count is None else args.tiny_count
    return args


def run(args) -> dict:
    workdir = tempfile.mkdtemp(prefix="bench_kdtr_", dir=args.workdir or "/tmp")
    table, started = Table(), time.perf_counter()
    table.add("machine", None, "", machine_description(workdir))
    load_before = os.getloadavg()
    try:
        if args.load_verify:
            bench_load_verify(workdir, table, max(args.repeats, 5), args.big_gib,
                              not args.no_cold)
            table.add("load average (1 min) at start / end (other work sharing the cores)",
                      None, "", f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on "
                      f"{os.cpu_count()} cores")
            return _result(args, table, started, "-", {})
        tensors = model_like_tensors(int(args.size_gib * GiB))
        total = sum(a.nbytes for a in tensors.values())
        sizes = sorted(a.nbytes for a in tensors.values())
        table.add("tensor mix", None, "",
                  f"{len(tensors):,} tensors, {total / MiB:.0f} MiB: "
                  f"{sum(s >= 64 * MiB for s in sizes)} >= 64 MiB, "
                  f"{sum(MiB <= s < 64 * MiB for s in sizes)} of 1-16 MiB, "
                  f"{sum(s < MiB for s in sizes)} < 1 MiB; "
                  f"{sum(a.dtype == BF16 for a in tensors.values())} bf16, rest fp32")
        paths = bench_writes(tensors, workdir, table)
        roofs = bench_roofs(paths, table, args.repeats)
        method = bench_reads(tensors, paths, table, roofs, args.repeats, not args.no_cold)
        bench_verify(paths["kdtr"], table, roofs, args.repeats)
        memory = bench_memory(tensors, paths, workdir, table)
        del tensors
        gc.collect()
        bench_open(args.tiny_count, workdir, table, args.repeats)
        bench_load_verify(workdir, table, max(args.repeats, 5), args.big_gib, not args.no_cold)
        table.add("load average (1 min) at start / end (other work sharing the cores)", None, "",
                  f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return _result(args, table, started, method, memory)


def _result(args, table: Table, started: float, method: str, memory: dict) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "cold_method": method, "seconds": time.perf_counter() - started,
            "rows": table.rows, "memory": memory, "markdown": table.markdown()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(*args.memory_child)))
        return 0
    result = run(args)
    print(result["markdown"])
    if args.load_verify:
        print(f"\npage cache warm; GB/s = 1e9 bytes/s; median of {max(args.repeats, 5)}; "
              f"total {result['seconds']:.0f} s")
    else:
        print(f"\ncold = {result['cold_method']}; GB/s = 1e9 bytes/s; warm = best of "
              f"{args.repeats} (load verification: median of {max(args.repeats, 5)}); "
              f"total {result['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

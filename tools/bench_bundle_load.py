"""What checking a bundle's CRC32C checksums costs when a model loads (issue 16).

    python3 tools/bench_bundle_load.py [--sizes tiny small medium] [--repeats 5] [--json PATH]

For each size a deterministic random bundle (``kdtr-make-model``'s, float32) is written to a
temporary folder, then loaded with the page cache warm (the file was just written), best of
``--repeats`` runs:

* ``copy``: every tensor copied out of the memory map with no check (``read_bundle(...,
  verify=False)`` plus a copy): what any loader that reads every byte pays anyway;
* ``copy + CRC32C``: ``read_bundle(...)`` (each tensor's CRC32C checked on the bytes as they
  are copied, ``formats.kdtr.Dataset.read``);
* ``Model.load`` on the reference backend, ``verify=True`` (what ``kdtree-run --model`` does)
  and ``verify=False`` (``--no-verify``: the weights stay mapped, so nothing is read until the
  first forward touches it).

The extra cost of verification is ``copy + CRC32C`` minus ``copy``.  CPU only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from formats.checksum import BACKEND as CRC_BACKEND  # noqa: E402
from kdtree_numba.bundle import make_random_bundle, read_bundle  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def plain_copy(path):
    _, weights = read_bundle(path, verify=False)
    return {name: np.array(w) for name, w in weights.items()}


def measure(size: str, folder: str, repeats: int) -> dict:
    path = os.path.join(folder, f"{size}.kdtr")
    make_random_bundle(path, size)
    nbytes = os.path.getsize(path)
    row = {"size": size, "bytes": nbytes}
    row["copy_s"] = best(lambda: plain_copy(path), repeats)
    row["copy_crc_s"] = best(lambda: read_bundle(path), repeats)
    row["load_verify_s"] = best(lambda: Model.load(path, "reference"), repeats)
    row["load_no_verify_s"] = best(lambda: Model.load(path, "reference", verify=False), repeats)
    os.unlink(path)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small", "medium"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    print(f"CRC32C backend: {CRC_BACKEND}; {os.cpu_count()} CPU(s); page cache warm; "
          f"best of {args.repeats}")
    print("| bundle | size | copy | copy + CRC32C | extra | Model.load (verify) | "
          "Model.load (--no-verify) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            r = measure(size, folder, args.repeats)
            rows.append(r)
            extra = r["copy_crc_s"] - r["copy_s"]
            gbps = r["bytes"] / r["copy_crc_s"] / 1e9
            print(f"| {size} | {r['bytes'] / 2**20:.1f} MiB | {r['copy_s'] * 1e3:.1f} ms | "
                  f"{r['copy_crc_s'] * 1e3:.1f} ms ({gbps:.2f} GB/s) | "
                  f"{extra * 1e3:+.1f} ms ({extra / r['copy_s'] * 100:+.0f}%) | "
                  f"{r['load_verify_s'] * 1e3:.1f} ms | {r['load_no_verify_s'] * 1e3:.1f} ms |",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

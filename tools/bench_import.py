"""Peak host memory of ``kdtr-import-hf`` against the largest tensor it writes.

    python3 tools/bench_import.py [--size medium] [--experts 64] [--dtype auto] [--json PATH]

The issue's memory contract: the importer streams tensor by tensor (a Kimi-K2 checkpoint is
about a terabyte), so its peak host memory stays near the largest tensor.  This script writes a
deterministic random checkpoint of a ``kdtree_numba.bundle`` size (float32 safetensors, as
transformers saves it; ``--experts`` widens the MoE so the stacked expert tensors dominate),
then imports it in a fresh interpreter that samples its own anonymous memory (``RssAnon`` in
/proc/self/status, every 2 ms, from a second thread) while ``import_hf`` runs.  Mapped file
pages (the memory-mapped shards and output) are page cache, not allocations, so they are
reported apart (``RssFile``).  Prints a table with the roof (the largest output tensor) beside
the measurement.  CPU only; no GPU needed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from formats import kdtr  # noqa: E402
from kdtree_numba.bundle import random_weights, size_config  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint  # noqa: E402

MIB = 1 << 20

# Runs in a fresh interpreter: the importer must not inherit the parent's allocations.
CHILD = r"""
import json, os, sys, threading, time
sys.path[:0] = [sys.argv[3], os.path.join(sys.argv[3], "tools")]
from kdtree_numba.hf_import import import_hf
from bench_kdtr import proc_status as status   # RssAnon, RssFile, VmHWM, ... in bytes

base = status()
peak = dict(base)
error = []
def run():
    try:
        import_hf(sys.argv[1], sys.argv[2], dtype=sys.argv[4], quiet=True)
    except BaseException as exc:   # reported by the parent
        error.append(repr(exc))
worker = threading.Thread(target=run)
t0 = time.perf_counter()
worker.start()
while worker.is_alive():
    now = status()
    peak = {k: max(peak[k], now[k]) for k in peak}
    time.sleep(0.002)
seconds = time.perf_counter() - t0
print(json.dumps(dict(base=base, peak=peak, seconds=seconds, error=error)))
"""


def largest_tensor(path) -> tuple[str, int]:
    sizes = {}
    with kdtr.File(path) as f:
        f.visititems(lambda name, node: sizes.__setitem__(name, node.nbytes)
                     if isinstance(node, kdtr.Dataset) else None)
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", help="kdtree_numba.bundle size")
    parser.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    cfg = size_config(args.size, n_routed_experts=args.experts)
    with tempfile.TemporaryDirectory(prefix="bench_import_") as tmp:
        hf_dir, out = os.path.join(tmp, "hf"), os.path.join(tmp, "bundle.kdtr")
        t0 = time.perf_counter()
        export_hf_checkpoint(cfg, dict(random_weights(cfg, seed=0)), hf_dir)
        ckpt_bytes = sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors"))
        print(f"[{time.perf_counter() - t0:.1f} s] wrote a {ckpt_bytes / MIB:.0f} MiB "
              f"{args.size} checkpoint ({args.experts} experts/layer); importing ...",
              file=sys.stderr)
        done = subprocess.run([sys.executable, "-c", CHILD, hf_dir, out, str(ROOT), args.dtype],
                              capture_output=True, text=True, check=True)
        child = json.loads(done.stdout.strip().splitlines()[-1])
        if child["error"]:
            raise SystemExit(f"import failed: {child['error']}")
        name, biggest = largest_tensor(out)
        bundle_bytes = os.path.getsize(out)

    growth = child["peak"]["RssAnon"] - child["base"]["RssAnon"]
    row = dict(size=args.size, experts=args.experts, dtype=args.dtype,
               checkpoint_mib=ckpt_bytes / MIB, bundle_mib=bundle_bytes / MIB,
               largest_tensor=name, largest_tensor_mib=biggest / MIB,
               peak_anon_growth_mib=growth / MIB, peak_over_largest=growth / biggest,
               peak_file_mib=child["peak"]["RssFile"] / MIB, seconds=child["seconds"],
               mib_per_s=ckpt_bytes / MIB / child["seconds"])
    print(f"kdtr-import-hf peak memory ({args.size}, {args.experts} experts/layer, "
          f"--dtype {args.dtype})\n")
    print("| checkpoint | bundle | largest output tensor (the roof) | peak anonymous memory "
          "growth | peak / largest | goal | mapped file pages (page cache) | time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {row['checkpoint_mib']:.0f} MiB | {row['bundle_mib']:.0f} MiB | {name} "
          f"{row['largest_tensor_mib']:.1f} MiB | {row['peak_anon_growth_mib']:.1f} MiB | "
          f"{row['peak_over_largest']:.2f}x | near the largest tensor | "
          f"{row['peak_file_mib']:.0f} MiB | {row['seconds']:.1f} s "
          f"({row['mib_per_s']:.0f} MiB/s) |")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

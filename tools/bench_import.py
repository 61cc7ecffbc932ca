"""Peak host memory of ``kdtr-import-hf`` against the largest tensor it writes.

    python3 tools/bench_import.py [--size medium] [--experts 64] [--moe-intermediate IM]
                                  [--dtype auto] [--int4-group G] [--json PATH]

The issue's memory contract: the importer streams tensor by tensor (a Kimi-K2 checkpoint is
about a terabyte), so its peak host memory stays near the largest tensor.  This script writes a
deterministic random checkpoint of a ``kdtree_numba.bundle`` size (float32 safetensors, as
transformers saves it; ``--experts`` widens the MoE so the stacked expert tensors dominate),
then imports it in a fresh interpreter that samples its own anonymous memory (``RssAnon`` in
/proc/self/status, every 2 ms, from a second thread) while ``import_hf`` runs.  Mapped file
pages (the memory-mapped shards and output) are page cache, not allocations, so they are
reported apart (``RssFile``).  Prints a table with the roof (the largest output tensor) beside
the measurement, and the import rate in output bytes a second.  ``--int4-group G`` writes the
routed experts as a compressed-tensors ``pack-quantized`` checkpoint instead (Kimi-K2's layout:
random int32 words, bf16 scales per G inputs, ``weight_shape``; the rest bf16), which the
importer keeps int4 (docs/ENGINE.md, "HF import"); an int4-group weight counts as one output
tensor (its packed bytes plus its scales).  CPU only; no GPU needed.
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

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from formats import kdtr  # noqa: E402
from formats.int4_group import is_weight_group, stored_layout  # noqa: E402
from kdtree_numba.bundle import QUANTIZABLE, random_weights, size_config  # noqa: E402
from kdtree_numba.config import weight_shapes  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint, hf_source_names  # noqa: E402

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
    """The largest output tensor by bytes on disk; an int4-group weight is one tensor."""
    sizes, groups = {}, set()

    def visit(name, node):
        if is_weight_group(node):
            groups.add(name)
            sizes[name] = stored_layout(node).nbytes
        elif isinstance(node, kdtr.Dataset) and name.rsplit("/", 1)[0] not in groups:
            sizes[name] = node.storage_nbytes
    with kdtr.File(path) as f:
        f.visititems(visit)
    name = max(sizes, key=sizes.get)
    return name, sizes[name]


def export_int4_checkpoint(cfg, hf_dir: str, group_size: int, seed: int = 0) -> None:
    """A pack-quantized checkpoint of ``cfg``: routed experts as random int32 words (every
    nibble is a valid value) with bf16 scales; every other tensor bf16."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    shapes = weight_shapes(cfg)
    dense = {n: s for n, s in shapes.items() if not n.endswith(QUANTIZABLE)}
    tensors = {hf_source_names(cfg, name): w.astype(ml_dtypes.bfloat16)
               for name, w in random_weights(cfg, seed, dense)}
    for name in shapes.keys() - dense.keys():          # no float expert is ever made
        E, rows, cols = shapes[name]
        prefix = name.rsplit("/", 1)[0].replace("/", ".")
        projs = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        for e in range(E):
            for proj in projs:
                module, r = f"{prefix}.{e}.{proj}", rows // len(projs)
                tensors[module + ".weight_packed"] = rng.integers(
                    0, 1 << 32, (r, cols // 8), dtype=np.uint32).view(np.int32)
                tensors[module + ".weight_scale"] = rng.uniform(
                    0.01, 0.1, (r, cols // group_size)).astype(ml_dtypes.bfloat16)
                tensors[module + ".weight_shape"] = np.array([r, cols], np.int64)
    os.makedirs(hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    scheme = {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
        "group_size": group_size, "dynamic": False, "actorder": None}}
    config = dict(cfg.to_hf_dict(), quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": scheme}, "ignore": ["lm_head", "re:.*self_attn.*"]})
    with open(os.path.join(hf_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", help="kdtree_numba.bundle size")
    parser.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--moe-intermediate", type=int, default=0, metavar="IM",
                        help="each routed expert's intermediate size (0: the size's own)")
    parser.add_argument("--int4-group", type=int, default=0, metavar="G",
                        help="routed experts as a compressed-tensors pack-quantized "
                        "checkpoint with group size G (0: float32 checkpoint)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    cfg = size_config(args.size, n_routed_experts=args.experts,
                      **({"moe_intermediate_size": args.moe_intermediate}
                         if args.moe_intermediate else {}))
    with tempfile.TemporaryDirectory(prefix="bench_import_") as tmp:
        hf_dir, out = os.path.join(tmp, "hf"), os.path.join(tmp, "bundle.kdtr")
        t0 = time.perf_counter()
        if args.int4_group:
            export_int4_checkpoint(cfg, hf_dir, args.int4_group)
        else:
            export_hf_checkpoint(cfg, dict(random_weights(cfg, seed=0)), hf_dir)
        ckpt_bytes = sum(p.stat().st_size for p in Path(hf_dir).glob("*.safetensors"))
        kind = f"int4-group {args.int4_group}" if args.int4_group else "float32"
        print(f"[{time.perf_counter() - t0:.1f} s] wrote a {ckpt_bytes / MIB:.0f} MiB "
              f"{args.size} {kind} checkpoint ({args.experts} experts/layer); importing ...",
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
               int4_group=args.int4_group,
               checkpoint_mib=ckpt_bytes / MIB, bundle_mib=bundle_bytes / MIB,
               largest_tensor=name, largest_tensor_mib=biggest / MIB,
               peak_anon_growth_mib=growth / MIB, peak_over_largest=growth / biggest,
               peak_file_mib=child["peak"]["RssFile"] / MIB, seconds=child["seconds"],
               mib_per_s=ckpt_bytes / MIB / child["seconds"],
               out_mib_per_s=bundle_bytes / MIB / child["seconds"])
    print(f"kdtr-import-hf peak memory ({args.size}, {args.experts} experts/layer, "
          f"--dtype {args.dtype}{', ' + kind if args.int4_group else ''})\n")
    print("| checkpoint | bundle | largest output tensor (the roof) | peak anonymous memory "
          "growth | peak / largest | goal | mapped file pages (page cache) | time | output "
          "rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {row['checkpoint_mib']:.0f} MiB | {row['bundle_mib']:.0f} MiB | {name} "
          f"{row['largest_tensor_mib']:.1f} MiB | {row['peak_anon_growth_mib']:.1f} MiB | "
          f"{row['peak_over_largest']:.2f}x | near the largest tensor | "
          f"{row['peak_file_mib']:.0f} MiB | {row['seconds']:.1f} s "
          f"({row['mib_per_s']:.0f} MiB/s) | {row['out_mib_per_s']:.0f} MiB/s |")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

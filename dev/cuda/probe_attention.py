#!/usr/bin/env python3
"""Time the attention kernel per key and per block slot, across batch sizes and split counts.

    python3 dev/cuda/probe_attention.py [--variant NAME] [--json PATH]

A diagnostic beside tools/bench_attention.py (whose inputs and timer it uses): for each shape,
the split count (chosen, or forced through ``keys_per_split``), the blocks and waves on this
GPU, the time, TFLOP/s, and microseconds per key per block slot (time / waves / keys per
block), which separates the kernel's own rate from wave quantisation and split merges.
``--variant`` takes the package's kernels and dev/cuda/attention.py's layouts (default: the
kernel ``mla_attention`` picks).  Needs a GPU and CuPy.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as B  # noqa: E402
from attention import register  # noqa: E402  (dev/cuda/attention.py: the other layouts)

# (bs, n, prefix, keys_per_split or None for the plan's choice)
CASES = [(64, 1, 4096, None), (64, 1, 4096, 4112), (64, 1, 4096, 1040), (64, 1, 4096, 1376),
         (128, 1, 4096, 4112), (132, 1, 4096, 4112), (64, 1, 8192, None),
         (16, 65, 4096, None), (2, 65, 4096, None), (1, 65, 4096, None)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", help="a kernel of kdtree_numba.attention.VARIANTS "
                        "(default: the one mla_attention picks)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    register()
    import cupy as cp
    from kdtree_numba import attention as A
    from kdtree_numba.attention import mla
    rng = np.random.default_rng(0)
    sms = mla._sm_count()
    print(f"kernel: {A.resolve_variant(args.variant, B.R, B.DR)}")
    print("| bs | n | P | splits | blocks | waves | ms | TFLOP/s | us per key per block slot |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for bs, n, prefix, keys_per_split in CASES:
        sets = B.make_inputs(cp, rng, bs, n, prefix)
        out = A.to_device(cp.empty((bs, n, B.H, B.R), cp.float32))
        plan = A.MlaAttentionPlan(bs, n, B.H, B.R, B.DR, prefix + n, max_keys=prefix + n,
                                  keys_per_split=keys_per_split, variant=args.variant)

        def run(a, plan=plan):
            plan(a["q_abs"], a["q_pe"], a["ckv"], a["kpe"], a["prefix_len"], a["visible"],
                 B.TAU, out=out)

        ms = B.time_ms(cp, run, sets, 10)
        _, flops, _ = B.roof_ms(bs, n, prefix)
        blocks = plan.grid[0] * plan.grid[1] * plan.grid[2]
        waves = math.ceil(blocks / sms)
        per_key = 1e3 * ms / waves / min(plan.chunk, prefix + n)
        print(f"| {bs} | {n} | {prefix} | {plan.splits} | {blocks} | {waves} | {ms:.3f} "
              f"| {flops / ms / 1e9:.1f} | {per_key:.4f} |", flush=True)
        rows.append(dict(bs=bs, n=n, prefix=prefix, splits=plan.splits, blocks=blocks,
                         waves=waves, ms=ms, tflops=flops / ms / 1e9, us_per_key=per_key))
        del sets
    if args.json:
        args.json.write_text(json.dumps({"probe": "attention", "variant": plan.variant,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

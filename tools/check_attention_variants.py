#!/usr/bin/env python3
"""Run every attention variant once, each in its own process, against the float64 reference.

    python3 tools/check_attention_variants.py [--variants tf32x3,pipe16x2] [--bs 3] [--n 9]
        [--prefixes 0,5,200] [--heads 64] [--r 512] [--dr 64] [--tree DIR]

Why a process per variant: a kernel that faults (CUDA_ERROR_ILLEGAL_ADDRESS) leaves its CUDA
context unusable, so in one process (tests/test_attention_gpu.py's ``check()``) the first
faulting variant fails every test after it.  Here each variant prints one line: its maximum
error beside ``fp32_error_bound``, or the error that ended its process.  ``--tree DIR``
imports ``kdtree_numba`` and ``reference`` from another tree (``git archive C kdtree_numba
reference | tar -x -C DIR``), and each line names the package directory its child imported,
so a bisect cannot test this checkout by mistake (the script's own directory and its parent
come first on ``sys.path`` otherwise: session 19's bisect fell into that).  Session 20
bisected the FFMA variant pipe16x2's fault at Kimi widths on the H200 with it (an early
return from commit 3fe0585; docs/GPU_RESULTS.md, runs 87-88).
Kimi widths by default (a GPU); ``--heads 2 --r 64 --dr 16`` is small enough for the CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``, FFMA variants only).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(spec: dict) -> str:
    """One variant, in this process: 'max error E (bound B)' or raises."""
    sys.path.insert(0, spec["tree"])       # before any import of the package
    import numpy as np

    from kdtree_numba import attention as kernels
    from reference import attention as ref
    from reference.attention import tree_visible

    rng = np.random.default_rng(spec["seed"])
    prefixes = np.asarray(spec["prefixes"], np.int32)
    bs, n, heads, r, dr = len(prefixes), spec["n"], spec["heads"], spec["r"], spec["dr"]
    slots = int(prefixes.max()) + n + 3
    visible = np.stack([tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
                        for _ in range(bs)])
    prob = dict(q_abs=rng.standard_normal((bs, n, heads, r)).astype(np.float32) * 0.1,
                q_pe=rng.standard_normal((bs, n, heads, dr)).astype(np.float32) * 0.1,
                ckv=rng.standard_normal((bs, slots, r)).astype(np.float32),
                kpe=rng.standard_normal((bs, slots, dr)).astype(np.float32),
                prefix_len=prefixes, visible=visible, tau=0.13)
    got = np.asarray(kernels.mla_attention(**prob, variant=spec["variant"]).copy_to_host())
    err = float(np.abs(got - ref.mla_attention(**prob, out_dtype=np.float64)).max())
    return (f"max error {err:.2e} (bound {ref.fp32_error_bound(**prob):.2e}) "
            f"[{Path(kernels.__file__).parents[1]}]")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":       # the child process
        print(run_one(json.loads(sys.argv[2])))
        return 0
    from kdtree_numba.attention import VARIANTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--bs", type=int, default=None, help="requests (default: len(prefixes))")
    ap.add_argument("--n", type=int, default=9, help="new tokens per request (a random tree)")
    ap.add_argument("--prefixes", default="0,5,200")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--r", type=int, default=512)
    ap.add_argument("--dr", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    ap.add_argument("--tree", default=str(ROOT),
                    help="directory holding the kdtree_numba and reference to check "
                         "(default: this checkout)")
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    if not (tree / "kdtree_numba" / "attention").is_dir():
        ap.error(f"--tree {args.tree}: no kdtree_numba/attention package there")
    prefixes = [int(p) for p in args.prefixes.split(",")]
    if args.bs is not None:
        prefixes = (prefixes * args.bs)[:args.bs]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    failed = 0
    for variant in variants:
        spec = dict(variant=variant, prefixes=prefixes, n=args.n, heads=args.heads, r=args.r,
                    dr=args.dr, seed=args.seed, tree=str(tree))
        try:       # the child puts spec["tree"] first on sys.path itself (run_one)
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                  capture_output=True, text=True, timeout=args.timeout)
            ok = proc.returncode == 0
            lines = (proc.stdout if ok else proc.stderr).strip().splitlines()
            verdict = lines[-1] if lines else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            ok, verdict = False, f"timed out after {args.timeout:.0f} s"
        failed += not ok
        print(f"{variant:10s} {'ok  ' if ok else 'FAIL'} {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

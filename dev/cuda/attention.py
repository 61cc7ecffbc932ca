#!/usr/bin/env python3
"""The attention kernels that lost: validate each against the float64 reference, benchmark them.

    python3 dev/cuda/attention.py check [--variants tf32x3,pipe16,...] [--bs 3] [--n 9]
        [--prefixes 0,5,200] [--heads 64] [--r 512] [--dr 64] [--tree DIR]
    python3 dev/cuda/attention.py check --bf16 [--variants bf16,fragq,...] [the same options]
    python3 dev/cuda/attention.py bench [tools/bench_attention.py's arguments]

The package ships two kernels (``kdtree_numba.attention.VARIANTS``): the 3xTF32 tensor-core
``tf32x3`` and the FFMA layout ``pipe16x2`` where tensor cores cannot run.  :data:`LAYOUTS`
holds the others, which compile from the same kernel bodies (ffma.py, mma.py) and compute the
same function; :func:`register` adds them to the package's ``VARIANTS`` for this process, so
``mla_attention(variant=...)`` and tools/bench_attention.py take them by name.
docs/ATTENTION.md describes the layouts; docs/HISTORY.md what their measurements decided.

``check`` runs every variant (default: the package's and these) once, each in its own process:
a kernel that faults (CUDA_ERROR_ILLEGAL_ADDRESS) leaves its CUDA context unusable, so in one
process the first faulting variant would fail every check after it.  Each variant prints one
line: its maximum error beside ``fp32_error_bound``, or the error that ended its process.
``--tree DIR`` imports ``kdtree_numba`` and ``reference`` from another tree (``git archive C
kdtree_numba reference | tar -x -C DIR``), and each line names the package directory its child
imported, so a bisect cannot test this checkout by mistake.  Kimi widths by default (a GPU);
``--heads 2 --r 64 --dr 16`` is small enough for the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, FFMA layouts only).

``check --bf16`` runs the bf16 cache's kernel in each of its layouts (``plan.BF16_LAYOUTS``:
the package's ``bf16`` and :data:`BF16_LAYOUTS`) over the same problem with the cache rounded
to bf16: each line gives its maximum error beside ``bf16_error_bound`` and whether its output
has the ``bf16`` layout's bits (every layout must: they differ only in how operands move).
``bench`` times them (tools/bench_attention.py's bf16 table, a row per layout and key tile).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# Layouts of the FFMA kernel body (each stages 64 query-heads per block and gives each lane an
# 8 x 4 -- wide16: 4 x 4 -- score block) and one of the tensor-core kernel:
# pipe16:    256 threads, two stages of 16-key tiles; a warp scores an 8 x 16 block over all
#            columns, 8 lanes split them, and the softmax runs in registers (one barrier less).
# tile32:    256 threads, one stage of 32-key tiles (all cp.async issued at once, then waited
#            on), 16 x 16 warp blocks, 4 lanes split the columns: half the tiles, load exposed.
# wide16:    512 threads (16 warps: twice the latency hiding) at <= 128 registers each, two
#            stages of 16-key tiles, 4 x 16 outputs per thread; more instructions per FMA.  Its
#            simulator layout is pipe16x2's (they differ only in the GPU thread count).
# tf32x3acc: tf32x3 with short mma chains added in fp32 registers (MmaTileConfig.fp32_sums):
#            the FFMA kernels' accuracy, at more time.
LAYOUTS = {
    "tf32x3acc": dict(threads=256, keys=16, stages=2, tensor_cores=True, fp32_sums=True),
    "pipe16": dict(threads=256, keys=16, stages=2, lane_rows=8, k_lanes=8, row_lanes=1,
                   key_lanes=4, k_warps=1),
    "tile32": dict(threads=256, keys=32, stages=1, lane_rows=8, k_lanes=4, row_lanes=2,
                   key_lanes=4, k_warps=1),
    "wide16": dict(threads=512, keys=16, stages=2, lane_rows=4, k_lanes=4, row_lanes=2,
                   key_lanes=4, k_warps=2),
}

# Layouts of the bf16 cache's kernel (Bf16TileConfig switches; issue 38: decode at 29% of HBM),
# each the package's layout (the P V operands by ldmatrix.trans, ldsm_values: the faster
# verify since run 167, docs/ATTENTION.md) with switches changed.  Each moves the same
# operands into the same mma sequence, so each gives the package's bits
# (tests/test_attention_bf16.py checks it in the simulator, ``check --bf16`` on a GPU):
# fragq:   the query tile in A-fragment order: one 128-bit load is an mma's A operand (the row
#          layout interleaves two loads into it: 240 register moves a tile and warp at sm_90);
# lean:    whole key tiles staged without the per-chunk clamp and size select;
# s3:      three key buffers, two tiles in flight (cp.async.wait_group 1);
# permute: ldsm_values off, the P V operands paired by byte permutes (the package's until
#          run 167);
# all:     every switch on: fragq, lean and s3 (run 167's "fast" was the three without ldsm).
# (vxch, the score exchange in 128-bit accesses, left: other bits on the real GPU, run 167.)
BF16_LAYOUTS = {
    "fragq": dict(frag_queries=True),
    "lean": dict(lean_staging=True),
    "s3": dict(stages=3),
    "permute": dict(ldsm_values=False),
    "all": dict(frag_queries=True, lean_staging=True, stages=3),
}


def register() -> dict:
    """Add :data:`LAYOUTS` to the package's VARIANTS and :data:`BF16_LAYOUTS` to its bf16
    layouts (this process only); returns VARIANTS."""
    from kdtree_numba.attention import plan
    for name, layout in LAYOUTS.items():
        plan.VARIANTS.setdefault(name, layout)
    for name, fields in BF16_LAYOUTS.items():
        plan.BF16_LAYOUTS.setdefault(name, fields)
    return plan.VARIANTS


def run_one(spec: dict) -> str:
    """One variant, in this process: 'max error E (bound B)' or raises."""
    sys.path.insert(0, spec["tree"])       # before any import of the package
    import numpy as np

    from kdtree_numba import attention as kernels
    from reference import attention as ref
    from reference.attention import tree_visible
    register()
    layout = spec.get("bf16_layout")

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
    if layout is not None:
        return _run_bf16(kernels, ref, prob, layout)
    got = np.asarray(kernels.mla_attention(**prob, variant=spec["variant"]).copy_to_host())
    err = float(np.abs(got - ref.mla_attention(**prob, out_dtype=np.float64)).max())
    return (f"max error {err:.2e} (bound {ref.fp32_error_bound(**prob):.2e}) "
            f"[{Path(kernels.__file__).parents[1]}]")


def _run_bf16(kernels, ref, prob, layout: str) -> str:
    """The bf16 kernel in ``layout`` and in the package's layout on ``prob`` with its cache
    rounded to bf16 bits: the error against the reference and whether the bits agree."""
    import numpy as np

    from kdtree_numba.attention import plan as plans

    def bits(x):        # float32 -> bf16 bits, to nearest even (finite values)
        b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    prob = dict(prob, ckv=bits(prob["ckv"]), kpe=bits(prob["kpe"]))
    bs, n, heads, r = prob["q_abs"].shape
    outs = {}
    for name in dict.fromkeys((layout, plans.BF16_VARIANT)):
        plans.BF16_LAYOUT = name
        plan = kernels.MlaAttentionPlan(bs, n, heads, r, prob["q_pe"].shape[-1],
                                        prob["ckv"].shape[1], bf16_cache=True)
        outs[name] = np.asarray(plan(**prob).copy_to_host())
    got = outs[layout]
    err = float(np.abs(got - ref.mla_attention(**prob, out_dtype=np.float64)).max())
    same = got.tobytes() == outs[plans.BF16_VARIANT].tobytes()
    if not same:
        raise AssertionError(f"layout {layout!r} differs from {plans.BF16_VARIANT!r}'s bits "
                             f"(max error {err:.2e})")
    return (f"max error {err:.2e} (bound {ref.bf16_error_bound(**prob):.2e}), the "
            f"{plans.BF16_VARIANT!r} layout's bits [{Path(kernels.__file__).parents[1]}]")


def bench(argv: list[str]) -> int:
    """tools/bench_attention.py with :data:`LAYOUTS` registered (default: every variant)."""
    sys.path.insert(0, str(ROOT / "tools"))
    register()
    import bench_attention
    return bench_attention.main(argv)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":       # the child process
        print(run_one(json.loads(sys.argv[2])))
        return 0
    if sys.argv[1:2] == ["bench"]:
        return bench(sys.argv[2:])
    if sys.argv[1:2] == ["check"]:
        del sys.argv[1]
    VARIANTS = register()
    bf16 = "--bf16" in sys.argv[1:]
    if bf16:
        sys.argv.remove("--bf16")
        from kdtree_numba.attention import plan as plans
        VARIANTS = plans.BF16_LAYOUTS
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
                    dr=args.dr, seed=args.seed, tree=str(tree),
                    bf16_layout=variant if bf16 else None)
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

#!/usr/bin/env python3
"""Benchmark the numba absorbed-MLA attention against its fp32 roof and a CuPy composition.

    python3 tools/bench_attention.py [--json PATH] [--reps N] [--variants a,b,...]

Three shapes at Kimi-K2 widths (H=64, r=512, dr=64, tau=0.130861): DDTree verify bs=16 n=65
with prefix 4096 and 16384, and decode bs=64 n=1 prefix 4096.  Every kernel in
``kdtree_numba.attention.VARIANTS`` (the 3xTF32 tensor-core ones and the FFMA tile layouts)
is timed on every shape (CUDA events after warm-up, median of --reps), beside the roof
max(bytes / 4.1 TB/s, FLOPs / 51 TFLOP/s), the CuPy composition (batched fp32 matmul + masked
softmax + matmul, TF32 off) and the goals: within 1.5x of the roof and faster than CuPy.  The
last lines name the fastest variant per shape and the one with the best worst-case ours/roof.
The max |difference| from the CuPy result shows each kernel's accuracy.  A variant that fails
is reported, not fatal.

Then the bf16 cache (``--bf16-keys``, default 32,16: the bf16 kernel's key tiles; and
``--bf16-layouts``, default every name in ``plan.BF16_LAYOUTS``: the package's ``bf16``, and
under ``dev/cuda/attention.py bench`` its candidates too, which give the same bits; on an
sm_90 GPU also ``wgmma`` and ``wgmma s3``, attention/wgmma.py's warpgroup kernel with two key
stages and with three, which is the same error bound, not the same bits): the same
shapes with the cache rounded to bf16, beside their own roof max(bytes / 4.1 TB/s, FLOPs /
660 TFLOP/s: mma.sync bf16 on the H200), the share of HBM bandwidth they reach (issue 15's goal:
decode bs 64 prefix 4096 >= 60%), and their max |difference| from the CuPy composition over the
rounded operands (queries rounded, cache widened), which must stay under
``reference.attention.bf16_error_bound``'s weight term (2^-7 max|v|).
FLOPs count every (query-head, key slot) pair: 2 * (r + dr) for the score and 2 * r for P V.
Needs a GPU and CuPy; finishes in about a minute on an H200.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["CUPY_TF32"] = "0"  # the baseline must be true fp32, like the kernel

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HBM_BYTES_PER_S = 4.1e12
FP32_FLOPS = 51e12
# --bf16-layouts: attention/wgmma.py's kernel (sm_90a) with two key stages, and with three
WGMMA_LAYOUTS = {"wgmma": {}, "wgmma s3": {"stages": 3}}
BF16_MMA_FLOPS = 660e12     # dense bf16 mma.sync on the H200 (wgmma's 989 needs sm_90a)
GOAL_ROOF_FACTOR = 1.5
H, R, DR, TAU = 64, 512, 64, 0.130861
L2_BYTES = 60e6
# (name, bs, n, prefix, then the first H200 run's (2026-11-29) CuPy and kernel times in ms,
# printed beside this run's for reference)
SHAPES = [("verify bs16 n65 P4096", 16, 65, 4096, 20.30, 24.54),
          ("verify bs16 n65 P16384", 16, 65, 16384, 76.68, 92.16),
          ("decode bs64 n1 P4096", 64, 1, 4096, 2.39, 1.95)]


def roof_ms(bs, n, prefix):
    keys = prefix + n
    flops = bs * n * H * keys * 2 * ((R + DR) + R)
    nbytes = 4 * (bs * keys * (R + DR) + 2 * bs * n * H * R + bs * n * H * DR)
    return 1e3 * max(nbytes / HBM_BYTES_PER_S, flops / FP32_FLOPS), flops, nbytes


def bf16_roof_ms(bs, n, prefix):
    """The bf16 cache's roof: its keys are 2 bytes a value; queries and output stay float32."""
    keys = prefix + n
    flops = bs * n * H * keys * 2 * ((R + DR) + R)
    nbytes = 2 * bs * keys * (R + DR) + 4 * (2 * bs * n * H * R + bs * n * H * DR)
    return 1e3 * max(nbytes / HBM_BYTES_PER_S, flops / BF16_MMA_FLOPS), flops, nbytes


def tree_masks(rng, bs, n):
    vis = np.zeros((bs, n, n), bool)
    for b in range(bs):
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        for i in range(n):
            if i:
                vis[b, i, :i] = vis[b, parents[i], :i]
            vis[b, i, i] = True
    return vis


def make_inputs(cp, rng, bs, n, prefix):
    """Device inputs; several copies when one set would sit in the 60 MB L2."""
    max_len = prefix + n
    one = 4 * (bs * max_len * (R + DR) + bs * n * H * (R + DR))
    copies = max(1, int(np.ceil(2 * L2_BYTES / one)))
    gen = cp.random.default_rng(int(rng.integers(2**31)))
    scale = 1.0 / (TAU * np.sqrt(R + DR))
    sets = []
    for _ in range(copies):
        sets.append(dict(
            q_abs=gen.standard_normal((bs, n, H, R), dtype=cp.float32) * np.float32(scale),
            q_pe=gen.standard_normal((bs, n, H, DR), dtype=cp.float32) * np.float32(scale),
            ckv=gen.standard_normal((bs, max_len, R), dtype=cp.float32),
            kpe=gen.standard_normal((bs, max_len, DR), dtype=cp.float32),
            prefix_len=cp.full((bs,), prefix, cp.int32),
            visible=cp.asarray(tree_masks(rng, bs, n))))
    return sets


def cupy_composition(cp, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, prefix):
    """The obvious fp32 composition: full score matrix, masked softmax, then P V."""
    bs, n = q_abs.shape[:2]
    keys = prefix + n
    q = q_abs.reshape(bs, n * H, R)
    s = cp.matmul(q, ckv[:, :keys].transpose(0, 2, 1))
    s += cp.matmul(q_pe.reshape(bs, n * H, DR), kpe[:, :keys].transpose(0, 2, 1))
    s *= np.float32(tau)
    s = s.reshape(bs, n, H, keys)
    s[..., prefix:] = cp.where(visible[:, :, None, :], s[..., prefix:], -cp.inf)
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return cp.matmul(s.reshape(bs, n * H, keys), ckv[:, :keys]).reshape(bs, n, H, R)


def time_ms(cp, fn, sets, reps, inner=4):
    """Median over reps of (time of ``inner`` back-to-back calls) / inner.

    Back-to-back calls keep the GPU queue full, so host launch latency (~50 us for numba)
    does not count; each call takes the next input set (rotation past the L2).
    """
    for k in range(2):
        fn(sets[k % len(sets)])
    cp.cuda.Device().synchronize()
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for k in range(reps):
        start.record()
        for j in range(inner):
            fn(sets[(k * inner + j) % len(sets)])
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / inner)
    return statistics.median(times)


def run_shape(cp, kernels, rng, name, bs, n, prefix, prev_cupy, prev_ours, reps, variants):
    """Time every variant and the CuPy composition on one shape; one result row per variant."""
    sets = make_inputs(cp, rng, bs, n, prefix)
    out = cp.empty((bs, n, H, R), cp.float32)
    out_view = kernels.to_device(out)

    def theirs(a):
        return cupy_composition(cp, a["q_abs"], a["q_pe"], a["ckv"], a["kpe"], a["prefix_len"],
                                a["visible"], TAU, prefix)

    check = theirs(sets[0])
    t_cupy = time_ms(cp, theirs, sets, max(3, reps // 3), inner=2)
    roof, flops, nbytes = roof_ms(bs, n, prefix)
    rows = []
    for variant in variants:
        row = dict(shape=name, variant=variant, bs=bs, n=n, prefix=prefix, roof_ms=roof,
                   cupy_ms=t_cupy, cupy_ms_prev=prev_cupy, ms_prev=prev_ours,
                   flops=flops, bytes=nbytes)
        try:
            plan = kernels.MlaAttentionPlan(bs, n, H, R, DR, prefix + n, max_keys=prefix + n,
                                            variant=variant)

            def ours(a, plan=plan):
                plan(a["q_abs"], a["q_pe"], a["ckv"], a["kpe"], a["prefix_len"], a["visible"],
                     TAU, out=out_view)

            out.fill(cp.nan)
            ours(sets[0])
            max_diff = float(cp.abs(out - check).max())  # NaN if a row was never written
            t_ours = time_ms(cp, ours, sets, reps)
            row.update(splits=plan.splits, ms=t_ours, tflops=flops / t_ours / 1e9,
                       vs_roof=t_ours / roof, max_abs_diff_vs_cupy=max_diff,
                       goal_roof=t_ours <= GOAL_ROOF_FACTOR * roof, goal_cupy=t_ours < t_cupy,
                       ok=bool(max_diff < 1e-3))
        except Exception as exc:  # report and go on: the other variants still get measured
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        rows.append(row)
    del check
    return rows


def run_shape_bf16(cp, kernels, rng, name, bs, n, prefix, reps, keys_list, layouts=None):
    """The bf16 kernel on one shape, one row per (layout, key-tile size)."""
    from kdtree_numba.attention import plan as plans
    from kdtree_numba.backends import bf16_bits
    sets = [dict(a, ckv=bf16_bits(cp, a["ckv"]), kpe=bf16_bits(cp, a["kpe"]))
            for a in make_inputs(cp, rng, bs, n, prefix)]
    a = sets[0]

    def widen(bits):
        return (bits.astype(cp.uint32) << 16).view(cp.float32)

    def rounded(x):
        return widen(bf16_bits(cp, x))

    check = cupy_composition(cp, rounded(a["q_abs"]), rounded(a["q_pe"]), widen(a["ckv"]),
                             widen(a["kpe"]), a["prefix_len"], a["visible"], TAU, prefix)
    tolerance = 2.0 ** -7 * float(cp.abs(widen(a["ckv"])).max()) + 1e-4
    out = cp.empty((bs, n, H, R), cp.float32)
    out_view = kernels.to_device(out)
    roof, flops, nbytes = bf16_roof_ms(bs, n, prefix)
    rows, default_keys, default_layout = [], plans.BF16_KEYS, plans.BF16_LAYOUT
    for layout, keys in [(x, k) for x in layouts or plans.BF16_LAYOUTS for k in keys_list]:
        row = dict(shape=name, variant=f"{layout} k{keys}", bs=bs, n=n, prefix=prefix,
                   roof_ms=roof, flops=flops, bytes=nbytes, tolerance=tolerance)
        # the warpgroup kernel (KDTREE_ATTENTION_WGMMA=1) with its layout's fields
        wgmma = layout in WGMMA_LAYOUTS
        if wgmma:
            plans.BF16_LAYOUTS[layout] = WGMMA_LAYOUTS[layout]
        plans.BF16_KEYS, plans.BF16_LAYOUT = keys, layout
        os.environ["KDTREE_ATTENTION_WGMMA"] = "1" if wgmma else "0"
        try:
            plan = kernels.MlaAttentionPlan(bs, n, H, R, DR, prefix + n, max_keys=prefix + n,
                                            bf16_cache=True)
            if plan.cfg.wgmma != wgmma:
                raise RuntimeError("the plan did not take the kernel this row names")

            def ours(a, plan=plan):
                plan(a["q_abs"], a["q_pe"], a["ckv"], a["kpe"], a["prefix_len"], a["visible"],
                     TAU, out=out_view)

            out.fill(cp.nan)
            ours(a)
            max_diff = float(cp.abs(out - check).max())
            t = time_ms(cp, ours, sets, reps)
            row.update(splits=plan.splits, rows=plan.cfg.rows, ms=t, tflops=flops / t / 1e9,
                       vs_roof=t / roof, hbm_share=nbytes / (t * 1e-3) / HBM_BYTES_PER_S,
                       max_abs_diff=max_diff, ok=bool(max_diff <= tolerance))
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            plans.BF16_KEYS, plans.BF16_LAYOUT = default_keys, default_layout
            os.environ.pop("KDTREE_ATTENTION_WGMMA", None)
            if wgmma:
                del plans.BF16_LAYOUTS[layout]
        rows.append(row)
    return rows


def print_bf16_table(rows):
    print("\n| shape | bf16 kernel | splits x rows | ms | TFLOP/s | roof ms | ours/roof "
          f"| share of HBM ({HBM_BYTES_PER_S / 1e12:.2f} TB/s) | max diff (tolerance) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" not in r:
            print(f"| {r['shape']} | {r['variant']} | FAILED: {r['error']} ||||||")
            continue
        print(f"| {r['shape']} | {r['variant']} | {r['splits']} x {r['rows']} | {r['ms']:.3f} "
              f"| {r['tflops']:.0f} | {r['roof_ms']:.3f} | {r['vs_roof']:.2f} "
              f"| {100 * r['hbm_share']:.0f}% | {r['max_abs_diff']:.1e} "
              f"({r['tolerance']:.1e}){'' if r['ok'] else ' FAIL'} |")


def print_table(rows):
    print("| shape | variant | splits | ours ms (prev) | TFLOP/s | roof ms | ours/roof "
          "| CuPy ms (prev) | max diff vs CuPy | <= 1.5x roof | beats CuPy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" not in r:
            print(f"| {r['shape']} | {r['variant']} | FAILED: {r['error']} |||||||||")
            continue
        print(f"| {r['shape']} | {r['variant']} | {r['splits']} | {r['ms']:.2f} "
              f"({r['ms_prev']}) | {r['tflops']:.1f} | {r['roof_ms']:.2f} | {r['vs_roof']:.2f} "
              f"| {r['cupy_ms']:.2f} ({r['cupy_ms_prev']}) | {r['max_abs_diff_vs_cupy']:.1e} "
              f"| {'yes' if r['goal_roof'] else 'NO'} | {'yes' if r['goal_cupy'] else 'NO'} |")


def summarize(rows, variants):
    """Fastest correct variant per shape, and the variant with the best worst-case ours/roof."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    best = {}
    for shape in shapes:
        good = [r for r in rows if r["shape"] == shape and r.get("ok")]
        best[shape] = min(good, key=lambda r: r["ms"])["variant"] if good else None
    worst = {}
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        if len(mine) == len(shapes) and all(r.get("ok") for r in mine):
            worst[v] = max(r["vs_roof"] for r in mine)
    default = min(worst, key=worst.get) if worst else None
    return best, default, worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", help="comma-separated subset of VARIANTS (default: all; "
                        "'none' times only the bf16 cache)")
    parser.add_argument("--bf16-keys", default="32,16",
                        help="key tiles of the bf16 cache's kernel to time ('' for none)")
    parser.add_argument("--bf16-layouts", default=None,
                        help="comma-separated names of plan.BF16_LAYOUTS to time (default: "
                        "all; dev/cuda/attention.py bench adds its candidates)")
    args = parser.parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("bench_attention: needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    from kdtree_numba import attention as kernels
    from kdtree_numba import compat
    if not compat.gpu_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    import card_roofs
    print(f"# {card_roofs.describe(card_roofs.apply(sys.modules[__name__]))}")
    variants = args.variants.split(",") if args.variants else list(kernels.VARIANTS)
    if variants == ["none"]:
        variants = []
    bf16_keys = [int(k) for k in args.bf16_keys.split(",") if k]
    from kdtree_numba.attention import plan as plans
    from kdtree_numba.gpu.tensorcore import wgmma_available
    bf16_layouts = args.bf16_layouts.split(",") if args.bf16_layouts else list(
        plans.BF16_LAYOUTS) + list(WGMMA_LAYOUTS) * wgmma_available()
    unknown = [x for x in bf16_layouts if x not in plans.BF16_LAYOUTS and x not in WGMMA_LAYOUTS]
    if unknown:
        parser.error(f"unknown bf16 layout {unknown[0]!r}; have {', '.join(plans.BF16_LAYOUTS)}"
                     " (dev/cuda/attention.py bench registers the candidates)")
    rng = np.random.default_rng(0)
    rows, bf16_rows = [], []
    for shape in SHAPES:
        if variants:
            rows += run_shape(cp, kernels, rng, *shape, reps=args.reps, variants=variants)
            cp.get_default_memory_pool().free_all_blocks()
        if bf16_keys:
            bf16_rows += run_shape_bf16(cp, kernels, rng, *shape[:4], reps=args.reps,
                                        keys_list=bf16_keys, layouts=bf16_layouts)
            cp.get_default_memory_pool().free_all_blocks()
    print_table(rows)
    best, default, worst = summarize(rows, variants)
    print(f"\nroof = max(bytes / {HBM_BYTES_PER_S / 1e12} TB/s, FLOPs / "
          f"{FP32_FLOPS / 1e12:.0f} TFLOP/s); goal: ours <= {GOAL_ROOF_FACTOR}x roof and "
          "faster than the CuPy fp32 composition.")
    print("fastest variant per shape: " + "; ".join(f"{k}: {v}" for k, v in best.items()))
    print("worst ours/roof per variant: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
    print(f"DEFAULT_VARIANT now {kernels.DEFAULT_VARIANT!r}; best worst-case: {default!r}")
    if bf16_rows:
        print_bf16_table(bf16_rows)
        print(f"\nbf16 roof = max(bytes / {HBM_BYTES_PER_S / 1e12} TB/s, FLOPs / "
              f"{BF16_MMA_FLOPS / 1e12:.0f} TFLOP/s); goal: decode bs64 n1 P4096 >= 60% of HBM.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bench": "attention", "results": rows,
                                         "bf16_results": bf16_rows,
                                         "fastest_per_shape": best,
                                         "recommended_default": default}, indent=2))
    failed = [r for r in rows + bf16_rows if not r.get("ok")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

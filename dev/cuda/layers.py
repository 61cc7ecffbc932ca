#!/usr/bin/env python3
"""The GEMM tiles and MoE launch plans that lost: validate them against the defaults, time them.

    python3 dev/cuda/layers.py check       # GPU: every plan here gives the default's bits
    python3 dev/cuda/layers.py bench [--only linear,variants,moe,sweep,rows]
        [--sweep-shapes 7168x1536]
        [--sweep-dtypes bf16,f32] [--sweep-grid] [tools/bench_layers.py's other arguments]

The package ships one heuristic per kernel (``tiled_config``, ``mma_config``,
``expert_tiled_configs``, ``skinny_config``); what they were picked against lives here:

* :data:`TILED_ALTERNATIVES`: other shapes of the tiled linear at M = 65 (72-row tiles);
* :func:`mma_alternatives`: other tiles of the bf16 tensor-core linear;
* :func:`expert_alternatives`: other launch plans of the tiled routed experts;
* :func:`linear_variants`: the skinny kernel's float32 load variants and neighbouring shapes
  (the "variants" section of tools/bench_layers.py), and :func:`bench_sweep` (section
  "sweep"): alternative SkinnyConfigs at M = 1; :func:`bench_rows` (section "rows", only
  when asked for): the x rows a skinny block takes (``mt``) at the demo pair's shapes and a
  verify's rows.

Every plan keeps the default's K slices and summation order, so each gives bitwise the
default's result and only speed differs: ``check`` asserts that on the GPU.  ``bench`` runs
tools/bench_layers.py with these plugged into its ``ALTERNATIVES`` and ``EXTRA_SECTIONS``.
What the measurements decided: docs/HISTORY.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kdtree_numba.layers import (  # noqa: E402
    ROWS_UNROLL, SkinnyConfig, TiledConfig, expert_tiled_configs, skinny_config, skinny_threads,
    tiled_config)
from kdtree_numba.layers.mma_plan import WARP_TILE, WGMMA_TILE, MmaConfig, mma_splits  # noqa: E402

# Alternatives to tiled_config(65, ...): the tiles are 72 rows each, same K slices, same sums.
TILED_ALTERNATIVES = {
    "bk16": dict(bk=16),                                     # half the barriers, +regs
    "uncapped": dict(max_registers=0),                       # ~200 registers: 3 blocks/SM
    "6warps-ly1": dict(wm=6, ly=1, tm=12, max_registers=168),    # 72 x 256 tiles
    "9warps-tm8": dict(wm=9, ly=1, tm=8, max_registers=112),     # 64 accumulators
}


def mma_alternatives(m: int, n: int, k: int) -> dict:
    """Other tiles beside mma_config's pick (name -> MmaConfig; past 80 rows both warpgroup
    and warp mma, whichever the GPU picked).  Every one keeps mma_splits' K slices (whole
    units of SLICE_UNIT at any bk), so each gives bitwise the default's result."""
    if m <= 16:       # the default is 16 x 128 in 3 stages of 128
        shapes = {"bk64-4stage": dict(wm=1, wn=4, tm=1, tn=4, stages=4),
                  "bk128-2stage": dict(wm=1, wn=4, tm=1, tn=4, bk=128, stages=2)}
    elif m <= 80:
        mt16 = -(-m // 16)
        shapes = {"64x128": dict(wm=2, wn=2, tm=2, tn=8, stages=3),
                  f"{16 * mt16}x64": dict(wm=1, wn=4, tm=mt16, tn=2, stages=3)}
        if mt16 == 5:   # narrower N, more ldmatrix bytes per mma
            shapes.update({"80x64-4stage": dict(wm=1, wn=4, tm=5, tn=2, stages=4),
                           "80x96": dict(wm=1, wn=4, tm=5, tn=3, stages=3)})
    else:
        shapes = {"128x128": dict(wm=4, wn=2, tm=2, tn=8, stages=3),
                  "64x128-4stage": dict(wm=2, wn=2, tm=2, tn=8, stages=4),
                  "32x128": dict(wm=1, wn=4, tm=2, tn=4, stages=4),
                  "mma.sync-64x128": dataclasses.asdict(WARP_TILE),
                  # warpgroup mma: 2 warpgroups of 64 x 128 (96 registers) or one; at 64 x
                  # 256 NVVM leaves the 128 accumulators in local memory.  3 stages keep
                  # one in flight beside the products (4: two)
                  "wgmma-128x128-3stage": dict(dataclasses.asdict(WGMMA_TILE), stages=3),
                  "wgmma-64x128": dict(wm=1, wn=4, tm=4, tn=4, stages=4, wgmma=True)}
    out = {}
    for name, shape in shapes.items():
        cfg = MmaConfig(**dict(shape, splits=1))
        out[name] = dataclasses.replace(cfg, splits=mma_splits(n, k))
    return out


def expert_alternatives(m: int) -> dict:
    """Other launch plans for the routed experts at m tokens, ``[(TiledConfig, cmin, cmax)]``
    each (every plan sums each output the same way: the results are bit-identical)."""
    small = expert_tiled_configs(m)[0][0]              # the package's one expert tile
    big = dataclasses.replace(tiled_config(max(m, 17), 0, 0), splits=1)
    small16 = dataclasses.replace(small, wm=max(1, small.wm // 2), max_registers=168)  # BM/2
    wide = TiledConfig(wm=1, wn=3, ly=2, tm=12, tn=8, bk=8, max_registers=168)   # 24 x 384
    return {
        "two-class": [(small, 1, small.bm + 1), (big, small.bm + 1, 1 << 30)],
        "two-class-bm16": [(small16, 1, small16.bm + 1), (big, small16.bm + 1, 1 << 30)],
        "small-bk8": [(dataclasses.replace(small, bk=8), 1, 1 << 30)],
        "big-24x384": [(small, 1, 17), (wide, 17, 1 << 30)],
    }


# Which linear variants run where (the compiles cost ~1-4 s each): the float32 load variants
# at M = 1, tile alternatives at M = 65 for the vocabulary (both dtypes) and 7168->1536 (fp32:
# the bf16 kernels are the same code).
VARIANT_PLAN = {(7168, 163840): {1: "loads+rows+plain", 65: ("f32", "bf16")},
                (7168, 1536): {1: "loads+rows", 65: ("f32",)},
                (2048, 7168): {1: "loads"}}


def plain_config(n: int, k: int) -> SkinnyConfig:
    """The first M = 1 float32 kernel: the most rows giving 2 blocks per SM, plain streaming
    loads."""
    rows, unroll = ROWS_UNROLL[1][-1]
    for cand in ROWS_UNROLL[1]:
        if -(-n // cand[0]) >= 2 * 132:
            rows, unroll = cand
            break
    return SkinnyConfig(1, rows, skinny_threads(k), unroll, f32_load="stream")


def linear_variants(layers, m, n, k):
    """(name, config, weights dtype) alternatives to linear()'s default at this shape."""
    plan, out = VARIANT_PLAN.get((k, n), {}).get(m), []
    if plan and m == 1:           # float32 streaming: the load variants, a neighbouring shape
        base = skinny_config(1, n, k, "f32")
        out += [("stream", dataclasses.replace(base, f32_load="stream"), "f32"),
                ("cached", dataclasses.replace(base, f32_load="cached"), "f32")]
        if "plain" in plan:
            out.append(("stream, first config", plain_config(n, k), "f32"))
        if "rows" in plan:
            rows, unroll = (8, 2) if base.rows == 8 else (base.rows * 2, base.unroll)
            out.append((f"xchg rows={rows} unroll={unroll}",
                        dataclasses.replace(base, rows=rows, unroll=unroll), "f32"))
    elif plan:
        base = tiled_config(m, n, k)
        for dtype in plan:
            for name, change in TILED_ALTERNATIVES.items():
                out.append((name, dataclasses.replace(base, **change), dtype))
            if base.splits > 8:
                out.append((f"splits={base.splits // 2}",
                            dataclasses.replace(base, splits=base.splits // 2), dtype))
    return out


# ---------------------------------------------------------------------------- the skinny sweep
SWEEP_SHAPES = ((7168, 1536), (7168, 576))
SWEEP = [(4, 2, 128, 1), (2, 4, 128, 1), (1, 4, 256, 1), (8, 1, 128, 1), (4, 1, 256, 1),
         (4, 4, 64, 1), (2, 2, 128, 2), (1, 4, 128, 4)]
SWEEP_COLUMNS = ["K", "N", "M", "weights", "config", "us", "cublas_f32_us", "vs_cublas",
                 "roof_frac", "host_bound"]


def sweep_grid(k):
    """Every (rows, unroll) x float32 load kind at the batch-invariant thread count of k."""
    return [SkinnyConfig(1, rows, skinny_threads(k), unroll, 1, load)
            for rows in (1, 2, 4) for unroll in (1, 2, 4, 8)
            for load in ("xchg", "stream", "cached")]


def bench_sweep(bench, ctx, results, deadline, shapes=SWEEP_SHAPES, dtypes=("bf16", "f32"),
                grid=False):
    """Alternative (rows, unroll, threads, splits) for M = 1 at two shapes; ``grid``: every
    (rows, unroll, float32 load) at the thread count linear() would use."""
    cp, cuda, layers, timer = ctx["cp"], ctx["cuda"], ctx["layers"], ctx["timer"]
    nb = cuda.as_cuda_array
    for k, n in shapes:
        for dtype in dtypes:
            esize = 2 if dtype == "bf16" else 4
            ws = [cp.random.standard_normal((n, k), dtype=cp.float32)
                  for _ in range(bench.copies_for(n * k * esize, cap=16))]
            x_cp, y_cp = (cp.random.standard_normal((1, k), dtype=cp.float32),
                          cp.empty((1, n), cp.float32))
            # cuBLAS fp32 SGEMM on the same shape, timed beside the sweep (it drifts by run)
            t_cublas = timer([lambda w=w: cp.matmul(x_cp, w.T, out=y_cp) for w in ws],
                             trials=5)[0] if dtype == "f32" else None
            if dtype == "bf16":
                ws = [(w.view(cp.uint32) >> 16).astype(cp.uint16) for w in ws]
            ws = [nb(w) for w in ws]
            x, y = nb(x_cp), nb(y_cp)
            space = layers.Workspace()     # split-K buffers allocated once, not per call
            configs = sweep_grid(k) if grid else \
                [SkinnyConfig(1, rows, threads, unroll, splits)
                 for rows, unroll, threads, splits in SWEEP]
            for cfg in configs:
                if time.perf_counter() > deadline:
                    return
                t, hb = timer([lambda w=w, c=cfg: layers.linear(x, w, out=y, config=c,
                                                                workspace=space)
                               for w in ws], trials=5)
                nbytes = n * k * esize
                results.append(dict(section="sweep", K=k, N=n, M=1, weights=dtype,
                                    config=str(cfg), us=t * 1e6,
                                    cublas_f32_us=t_cublas and t_cublas * 1e6,
                                    vs_cublas=t_cublas and t_cublas / t,
                                    roof_frac=nbytes / bench.HBM_BYTES_PER_S / t,
                                    host_bound=hb))
                bench.print_row(results[-1])


# ---------------------------------------------------------------------------- x rows a block
# The demo pair's linears (docs/DEMO.md: D 256, q/kv latents 128, 8 heads, the router's 8 fp32
# outputs, the dense FFN 768, the vocabulary 8,192) at a decode's and a verify's rows: at 17
# rows mt_for gives 16-row chunks (16 + 1), a block streaming its weight rows against 16 x
# rows, and run 153 put those launches at 4.4-10.7 us against 2.8 at one row.
ROWS_SHAPES = ((256, 8, "f32"), (256, 256, "bf16"), (128, 256, "bf16"), (256, 512, "bf16"),
               (256, 1536, "bf16"), (768, 256, "bf16"), (256, 8192, "bf16"))
ROWS_MS = (1, 9, 17, 33)
ROWS_COLUMNS = ["K", "N", "M", "weights", "mt", "config", "us", "vs_default", "host_bound"]


def bench_rows(bench, ctx, results, deadline, ms=ROWS_MS):
    """linear() at ROWS_SHAPES x ``ms`` rows with every x-rows-a-block ``mt`` up to mt_for's
    (the same bits: skinny_config), the weights in L2 as in a round."""
    cp, cuda, layers, timer = ctx["cp"], ctx["cuda"], ctx["layers"], ctx["timer"]
    nb = cuda.as_cuda_array
    rng = np.random.default_rng(5)
    for k, n, dtype in ROWS_SHAPES:
        w = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
        if dtype == "bf16":
            w = (w.view(cp.uint32) >> 16).astype(cp.uint16)
        w = nb(w)
        for m in ms:
            x = nb(cp.asarray(rng.standard_normal((m, k)).astype(np.float32)))
            y, space = nb(cp.empty((m, n), cp.float32)), layers.Workspace()
            default = skinny_config(m, n, k, dtype)
            t_default = None
            for mt in sorted((v for v in (16, 8, 4, 2, 1) if v <= default.mt), reverse=True):
                if time.perf_counter() > deadline:
                    return
                cfg = skinny_config(m, n, k, dtype, mt=mt)
                t, hb = timer([lambda c=cfg: layers.linear(x, w, out=y, config=c,
                                                           workspace=space)], trials=5)
                t_default = t if cfg == default else t_default
                results.append(dict(section="rows", K=k, N=n, M=m, weights=dtype, mt=mt,
                                    config=str(cfg), us=t * 1e6,
                                    vs_default=t_default / t if t_default else None,
                                    host_bound=hb))
                bench.print_row(results[-1])


def bench(argv: list[str]) -> int:
    """tools/bench_layers.py with the alternatives above and the sweep."""
    ap = argparse.ArgumentParser(description="dev/cuda/layers.py bench")
    ap.add_argument("--only", default="linear,variants,moe,sweep")
    ap.add_argument("--sweep-shapes", help="K x N pairs for the sweep, e.g. 7168x1536")
    ap.add_argument("--sweep-dtypes", default="bf16,f32")
    ap.add_argument("--rows-ms", default=",".join(map(str, ROWS_MS)),
                    help="the rows section's M values (a prefill's: 128)")
    ap.add_argument("--sweep-grid", action="store_true",
                    help="sweep every (rows, unroll, f32 load) at linear()'s thread count")
    args, rest = ap.parse_known_args(argv)
    import bench_layers
    shapes = SWEEP_SHAPES if not args.sweep_shapes else tuple(
        tuple(int(v) for v in pair.split("x")) for pair in args.sweep_shapes.split(","))
    bench_layers.ALTERNATIVES.update(
        linear=linear_variants, mma=lambda layers, m, n, k: mma_alternatives(m, n, k),
        moe=lambda layers, m: expert_alternatives(m))
    bench_layers.COLUMNS["sweep"] = SWEEP_COLUMNS
    bench_layers.COLUMNS["rows"] = ROWS_COLUMNS
    bench_layers.EXTRA_SECTIONS["rows"] = functools.partial(
        bench_rows, bench_layers, ms=tuple(int(m) for m in args.rows_ms.split(",")))
    bench_layers.EXTRA_SECTIONS["sweep"] = functools.partial(
        bench_sweep, bench_layers, shapes=shapes, dtypes=tuple(args.sweep_dtypes.split(",")),
        grid=args.sweep_grid)
    return bench_layers.main(["--only", args.only] + rest)


# ---------------------------------------------------------------------------- GPU checks
def check() -> int:
    """On a GPU: every plan here gives the default's bits (the same K slices, the same sums)."""
    from kdtree_numba import layers
    from kdtree_numba.compat import gpu_available
    if not gpu_available():
        print("dev/cuda/layers.py check: needs a CUDA GPU", file=sys.stderr)
        return 2
    rng = np.random.default_rng(12)
    failed = []

    def same(name, got, want):
        ok = np.array_equal(np.asarray(got.copy_to_host()), np.asarray(want.copy_to_host()))
        print(f"{name:40s} {'ok' if ok else 'DIFFERS'}", flush=True)
        if not ok:
            failed.append(name)

    def bf16(a):
        return (a.view(np.uint32) >> 16).astype(np.uint16)

    k, n = 7168, 1536
    x = rng.standard_normal((65, k)).astype(np.float32)
    w32 = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    for w, kind in ((w32, "f32"), (bf16(w32), "bf16")):
        want = layers.linear(x, w)
        base = tiled_config(65, n, k)
        for name, change in TILED_ALTERNATIVES.items():
            same(f"tiled {kind} {name}", layers.linear(x, w, config=dataclasses.replace(
                base, **change)), want)
    n, k = 1000, 2048
    w16 = bf16((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    for m in (1, 65, 200):
        want = layers.linear(x[:m, :k].copy(), w16, method="mma")
        for name, cfg in mma_alternatives(m, n, k).items():
            same(f"mma M={m} {name}", layers.linear(x[:m, :k].copy(), w16, method="mma",
                                                    config=cfg), want)
    d, inter, n_experts, top_k, m = 7168, 256, 384, 8, 65
    h = rng.standard_normal((m, d)).astype(np.float32)
    others = np.setdiff1d(np.arange(n_experts), [5, 200])     # two popular experts
    idx = np.sort(np.stack([np.concatenate([[5, 200], rng.choice(others, top_k - 2, False)])
                            for _ in range(m)]), axis=1).astype(np.int32)
    wts = rng.random((m, top_k)).astype(np.float32)
    experts = [bf16((rng.standard_normal(s) * 0.02).astype(np.float32)) for s in
               ((n_experts, 2 * inter, d), (n_experts, d, inter))]
    want = layers.moe_ffn(h, idx, wts, *experts)
    for name, plan in expert_alternatives(m).items():
        same(f"moe M={m} {name}", layers.moe_ffn(h, idx, wts, *experts, configs=plan), want)
    print("all bitwise equal" if not failed else f"{len(failed)} differ: {failed}")
    return 1 if failed else 0


def main() -> int:
    if sys.argv[1:2] == ["check"]:
        return check()
    if sys.argv[1:2] == ["bench"]:
        return bench(sys.argv[2:])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

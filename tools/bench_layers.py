#!/usr/bin/env python3
"""Benchmark of the non-attention kernels on the GPU (H200), each against its physical roof.

    python3 tools/bench_layers.py [--json PATH] [--only linear,moe,norm,rope]
    python3 tools/bench_layers.py --only mma      (the bf16 tensor-core linear, < 5 min)
    python3 tools/bench_layers.py --only moe_mma  (the grouped MoE on tensor cores, < 90 s)
    python3 tools/bench_layers.py --only int4     (the W4A16 MoE vs bf16 experts, < 6 min)
    python3 tools/bench_layers.py --only moe_chunk (the MoE chunk grid at the demo's widths)

* linear, M = 1, 8 (skinny kernel) and 65 (tiled kernel: the DDTree verify width) at
  7168->1536, 7168->576, 2048->7168, 7168->163840, weights fp32 and bf16, against CuPy matmul
  (cuBLAS SGEMM on fp32 weights: for a bf16 row that is the same matrix widened to fp32, i.e.
  cuBLAS reads twice the bytes) and against the roof max(weight bytes / 4.1 TB/s,
  2 M N K / 51 TFLOP/s).  Goals: >= 0.9x cuBLAS for M <= 16, >= 0.8x at M = 65.
* MoE routing + expert FFN, M = 1 and 65, E = 384, k = 8, D = 7168, Im = Is = 2048, bf16 experts
  (Kimi-K2): weight bytes actually read (chosen experts + shared + fp32 router) vs the roof. At
  M = 65: the tiled experts (auto), the skinny ones, and a uniform routing (every token 8 random
  experts: ~280 experts, memory-bound) beside the router-picked one (a few popular experts: ~50,
  more compute per byte).
* RMSNorm (D = 7168) and RoPE (64 heads x 64) in GB/s against the HBM roof.
* mma (only when asked for: ``--only mma``): linear(method="mma") (bf16 weights, x rounded to
  bf16, tensor cores) at M = 1, 65, 512 (``--mma-ms``) on every bf16 product Kimi-K2 runs
  (MMA_SHAPES: lm_head, q_a + kv_a, q_b, o_proj, the dense FFN's two, the shared expert's two),
  beside linear's default method on the same bf16 weights and cuBLAS bf16
  (CuPy, x in bf16 too), against the bf16 roofs max(weight bytes / 4.1 TB/s,
  2 M N K / 989 TFLOP/s dense bf16).
* moe_mma (only when asked for: ``--only moe_mma``): moe_ffn(method="mma") (grouped experts on
  tensor cores, shared expert in the same launches) beside moe_ffn's default on the same
  router-picked routing, Kimi-K2 (MOE_SHAPE), M = 1, 9, 33, 65, 257, against the roofs
  max(bytes of the distinct experts touched + shared / 4.1 TB/s, 2 * 3 I D (M k + M) / 989
  TFLOP/s); also a uniform routing (every token 8 random experts) at M = 65 and 257.  Each
  "mma" row is timed twice: the full (expert, M tile) grid and the work list
  (KDTREE_MOE_WORK_LIST=1, "mma work list").

* int4 (only when asked for: ``--only int4``): the W4A16 MoE (int4-group routed experts, group
  32, Kimi-K2's MOE_SHAPE, a bf16 shared expert, moe_ffn's default method): M = 1 (one
  token's INT4 expert GEMV, 8 routed + 1 shared; goal >= 0.75 of its HBM roof), M = 33 and
  65 (the grouped W4A16 kernel over a verify's rows, router-picked and uniform routings; goal
  >= 0.6 of the roof), each against max(bytes of the distinct experts read + shared / HBM
  rate, 2 * 3 I D (M k + M) / 51 TFLOP/s); then the same M = 1 call with the 384 experts in
  bf16 (33.8 GB, allocated after the int4 ones are freed): "vs_bf16" is how much faster int4
  is (goal >= 2.3x; the bytes roof's ratio 2.77x).  At M = 33 and 65 also the W4A16
  tensor-core kernels (moe_ffn(method="mma"), layers/moe_int4_mma.py; goal >= 0.6 of the same
  bytes roof, the FLOP roof at 989 TFLOP/s): "mma" (int4_mma_config's tile, full grid), "mma
  work list" (KDTREE_MOE_WORK_LIST=1) and "mma <tile>" (INT4_MMA_TILES, work list on).  At
  M = 1 also the decode GEMV's variants, "gemv <variant>" (INT4_GEMV_VARIANTS: a cp.async
  ring, the magic-number unpacking, L2 bulk prefetch, N tiles a block, chunks in flight, rows,
  threads), and "mma" / "mma work list"
  / "mma <tile> skip dead" (INT4_MMA_DECODE_TILES) on the same call, "shared expert
  apart" (KDTREE_SHARED_IN_EXPERTS=0: the shared expert in launches of its own, not in the
  routed experts') and "combine in down" (KDTREE_COMBINE_IN_DOWN=1: the combine in the down
  launch's tail), for int4 and for bf16 experts.  < 6 min (each variant's kernels compile
  on first use).
* moe_chunk (only when asked for: ``--only moe_chunk``): moe_ffn(method="skinny") at the demo
  pair's MoE widths (DEMO_MOE: bf16 experts, no shared expert) at M = 1, 9, 17, 33, a spread
  and a popular routing (expert 3 in every row), with ``KDTREE_MOE_CHUNK_GRID`` off and on,
  alternately (the grouping, gate_up, down and the combine: the switch's whole effect; the
  weights stay in L2, as in the demo's rounds).  < 30 s.

The tiles and plans that lost to the defaults, the skinny kernel's sweep, and the "variants"
section that times them: ``python3 dev/cuda/layers.py bench`` (it runs this script with them).

Timing: CUDA events around ``reps`` back-to-back calls, queued behind a sleeping "spacer" kernel
so that host launch overhead is hidden (the GPU time is measured, as a CUDA graph would see
it); inputs rotate over enough copies to exceed 3x the L2 (60 MB); median of 7 trials.  A row
marked "host-bound" means the spacer ran out before the calls were queued.  < 3 min on an H200
(first compiles included: each generated kernel takes ~1-4 s).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kdtree_numba.compat import cuda, kernel  # noqa: E402

HBM_BYTES_PER_S = 4.1e12      # measured by a numba read-reduce on the H200 (notes/numba-cuda.md)
FP32_FLOP_PER_S = 51e12       # cuBLAS SGEMM 8192^3 on the H200 (notes/numba-cuda.md)
BF16_FLOP_PER_S = 989e12      # H200 dense bf16 tensor-core peak (data sheet; cuBLAS got 835)
L2_BYTES = 60e6
BUDGET_S = 170.0              # stop starting new sections after this
LINEAR_SHAPES = [(7168, 163840), (7168, 1536), (7168, 576), (2048, 7168)]   # (K, N)
LINEAR_MS = (1, 8, 65)
GOALS = {1: 0.9, 8: 0.9, 65: 0.8}   # x cuBLAS
MOE_SHAPE = dict(n_experts=384, top_k=8, d=7168, inter=2048)                  # Kimi-K2
MOE_MS = (1, 65)
HIDDEN, ROPE_HEADS, ROPE_DIM, NOPE_DIM = 7168, 64, 64, 128
NORM_MS, ROPE_MS = (1, 65, 1025), (65, 1025)
# (K, N): every bf16 product Kimi-K2 runs (issue 38's goal rows: >= 0.9x cuBLAS at M = 1, 65
# and 512 on each)
MMA_SHAPES = [(7168, 163840),       # lm_head
              (7168, 2112),         # q_a + kv_a (one product)
              (1536, 12288),        # q_b
              (8192, 7168),         # o_proj
              (7168, 36864),        # the dense FFN's gate_up
              (18432, 7168),        # the dense FFN's down
              (7168, 4096),         # the shared expert's gate_up
              (2048, 7168)]         # the shared expert's down
MMA_MS = (1, 65, 512)               # --mma-ms adds 8, 33, 4096
MMA_BUDGET_S = 240.0          # the mma section stops starting rows after this
MOE_MMA_MS = (1, 9, 33, 65, 257)
MOE_MMA_BUDGET_S = 80.0
INT4_MS = (1, 33, 65)
INT4_MMA_MS = (33, 65)          # the W4A16 tensor-core rows (moe_ffn(method="mma"))
# the other tiles they time (work list on), beside int4_mma_config's (16 x 64 in 4 stages of
# 128 since run 152, where it beat 16x64 4x256, 16x128 3x256 and 16x64 3x512 in every row):
# the old default (the reference to run 152), stages of 64 (12 blocks an SM), 5 and 6 stages
# of 128 (more bytes in flight a block), 128 columns (half the x re-reads per weight byte),
# 2 and 8 warps along N, and the dead x rows of a tile (15 of 16 at a token an expert)
# zeroed once instead of zero-filled by a cp.async every stage.  Stages of 64 first, with 128
# columns and with more stages: the fastest at 33 rows in run 164 (851 us against the picked
# 4 x 128's 981), where 128 columns came second (908)
INT4_MMA_TILES = (("16x64 4x64", dict(bk=64)), ("16x128 4x64", dict(tn=4, bk=64)),
                  ("16x64 6x64", dict(bk=64, stages=6)),
                  ("16x128 6x64", dict(tn=4, bk=64, stages=6)),
                  ("16x64 4x256", dict(bk=256)),
                  ("16x64 5x128", dict(bk=128, stages=5)),
                  ("16x64 6x128", dict(bk=128, stages=6)),
                  ("16x128 4x128", dict(tn=4, bk=128)),
                  ("16x32 4x128 2 warps", dict(wn=2, bk=128)),
                  ("16x128 4x128 8 warps", dict(wn=8, bk=128)),
                  ("16x64 4x128 skip dead", dict(bk=128, skip_dead_rows=True)),
                  ("16x128 4x128 skip dead", dict(tn=4, bk=128, skip_dead_rows=True)),
                  ("16x64 6x128 skip dead", dict(bk=128, stages=6, skip_dead_rows=True)),
                  # 32 rows: at 65 router-picked rows an expert takes up to ~40 and the
                  # 16-row tile streams ~1.27x the distinct experts' weights (session 51's
                  # count, reference routing at bench_layers' widths; 1.02x at 32 rows)
                  ("32x64 4x64", dict(tm=2, bk=64)), ("32x64 4x128", dict(tm=2, bk=128)))
# the M = 1 decode GEMV's variants (moe_ffn's int4 weight-streaming kernels, configs = the
# (gate_up, down) SkinnyConfigs of expert_config's pick with these fields replaced; layers/
# skinny.py SkinnyConfig, layers/moe.py _expert_kernel): one bulk L2 prefetch per weight row
# at a tile's start (bytes in flight that hold no register), 4 N tiles a block (the grid in
# about one wave of resident blocks, the routing reads paid once, and with the prefetch the
# next tile's rows streaming while this one computes), two chunks in flight a row (unroll
# 2, capped at 168 registers: no spill; the magic unpack's fit 144, the denormal one's spills
# 44-52 bytes there), twice the rows (196 registers; 168 / 178 with the magic unpack), twice
# or half the threads (more warps a block; or 7 chunks a thread: longer loops).  All but the
# thread counts and the magic-number unpacking give the default's bits.  Then "mma" and "mma work
# list": the W4A16 tensor-core kernels at M = 1 (int4_mma_config's tile, then
# INT4_MMA_DECODE_TILES; x rounded to bf16, the grouped bound).
# Run 164 left the magic-number default fastest, at ~59% of the roof: a thread keeps one chunk
# a row in flight and then computes it (3.5 / 2 trips a block: one HBM round trip a trip,
# nothing in flight while the FMAs run), and that unpacking costs ~3.4 instructions a weight
# (~60% of the issue slots at the roof).  Run 167 made the denormal unpacking
# (SkinnyConfig.unpack: the nibbles read as float32 denormals, ~2.5 instructions a weight,
# 144 / 136 registers) the default, the faster (docs/BENCHMARKS.md, "W4A16 int4 experts").
# "magic": the magic-number unpacking, the default until then (other bits, within the bound;
# 128 registers).  "magic ring 2": with a per-thread cp.async ring in shared memory
# (SkinnyConfig.stages), the next chunk in flight while this one is computed, in no register
# (magic's bits).  "ring 2": the ring around the default, capped at 128 registers.
# "ring 2 rows/2": the same with half the rows a block (twice the
# blocks, each half as long: shorter kernel tails; down at 96 registers, 21 blocks an SM).
INT4_GEMV_VARIANTS = (
    ("gemv magic", dict(unpack="magic"), dict(unpack="magic")),
    ("gemv magic ring 2", dict(stages=2, unpack="magic"), dict(stages=2, unpack="magic")),
    ("gemv ring 2", dict(stages=2, max_registers=128), dict(stages=2, max_registers=128)),
    ("gemv ring 2 rows/2", dict(rows=2, stages=2), dict(rows=4, stages=2)),
    ("gemv prefetch", dict(prefetch=True), dict(prefetch=True)),
    ("gemv span 4", dict(span=4), dict(span=4)),
    ("gemv prefetch span 4", dict(prefetch=True, span=4), dict(prefetch=True, span=4)),
    ("gemv prefetch span 2", dict(prefetch=True, span=2), dict(prefetch=True, span=2)),
    ("gemv unroll 2", dict(unroll=2, max_registers=168), dict(unroll=2, max_registers=168)),
    ("gemv unroll 2 prefetch", dict(unroll=2, max_registers=168, prefetch=True),
     dict(unroll=2, max_registers=168, prefetch=True)),
    ("gemv rows x2 prefetch", dict(rows=8, prefetch=True), dict(rows=16, prefetch=True)),
    ("gemv threads x2", dict(threads=128), dict(threads=64)),
    ("gemv threads x2 prefetch", dict(threads=128, prefetch=True),
     dict(threads=64, prefetch=True)),
    ("gemv 32 threads prefetch", dict(threads=32, prefetch=True), dict(prefetch=True)),
    ("gemv threads x2 prefetch span 4", dict(threads=128, prefetch=True, span=4),
     dict(threads=64, prefetch=True, span=4)),
    # the shared expert's blocks first in the grid (they are the launches' heavier blocks:
    # apart, its down ran at 70% of its roof against the routed 88%, run 190)
    ("gemv shared first", dict(shared_first=True), dict(shared_first=True)),
    ("gemv shared first down", dict(), dict(shared_first=True)))
# at M = 1 the tensor-core tile has 15 dead x rows of 16: its skip_dead_rows tiles there too
INT4_MMA_DECODE_TILES = tuple(t for t in INT4_MMA_TILES if "skip dead" in t[0])
INT4_GROUP = 32                # Kimi-K2's checkpoints
INT4_BUDGET_S = 400.0         # (the variants' first compiles: ~2-4 s a kernel)
DEMO_MOE = dict(n_experts=8, top_k=2, d=256, inter=128)        # docs/DEMO.md: the target's MoE
MOE_CHUNK_MS = (1, 9, 17, 33)


# ============================================================================ timing

@kernel
def spacer(n_sleeps):
    """Keeps the GPU busy ~n_sleeps microseconds while the host queues the timed calls."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        for _ in range(n_sleeps):
            cuda.nanosleep(1000)


class GpuTimer:
    """Median GPU time per call of a list of callables (one per rotated input copy)."""

    def __init__(self, cp):
        self.cp = cp
        self.spacer = spacer
        spacer[1, 32](10)                      # compile
        self.ms_per_sleep = self._elapsed_ms(lambda: spacer[1, 32](2000)) / 2000

    def _elapsed_ms(self, fn):
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)

    def __call__(self, calls, trials=7, min_ms=2.0):
        for call in calls:                     # warm-up (and compile)
            call()
        self.cp.cuda.Device().synchronize()
        one = max(self._elapsed_ms(calls[0]), 1e-3)
        reps = int(min(max(min_ms / one, 3), 60))
        host_ms = 0.15 * reps                  # first guess: 150 us of host time per call
        samples = []                           # (ms per call, host-bound?)
        for _ in range(trials):
            sleeps = int(max(2.0 * host_ms, 1.0) / max(self.ms_per_sleep, 1e-5))
            start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
            t0 = time.perf_counter()
            self.spacer[1, 32](sleeps)
            start.record()
            for r in range(reps):
                calls[r % len(calls)]()
            end.record()
            host = (time.perf_counter() - t0) * 1e3
            end.synchronize()
            samples.append((self.cp.cuda.get_elapsed_time(start, end) / reps,
                            host > sleeps * self.ms_per_sleep))
            host_ms = max(host_ms, host)
        clean = [t for t, bound in samples if not bound]
        host_bound = not clean                 # only when no trial hid the launches
        return statistics.median(clean or [t for t, _ in samples]) * 1e-3, host_bound


def report_failure(results, section, what, exc):
    print(f"\n{section} {what} FAILED: {type(exc).__name__}: {exc}", flush=True)
    results.append(dict(section=section, error=f"{what}: {type(exc).__name__}: {exc}"))
    _last_section[0] = None      # the next row starts a fresh table


def copies_for(nbytes: float, cap: int = 8) -> int:
    """Input copies so that one rotation streams >= 3x L2 (no copy is served from L2)."""
    return int(min(max(math.ceil(3 * L2_BYTES / max(nbytes, 1)), 1), cap))


# ============================================================================ sections

def roofs(m, n, k, wbytes):
    """(roof seconds, what bounds it): weight bytes at the HBM rate or FMAs at cuBLAS's."""
    t_mem, t_fma = wbytes / HBM_BYTES_PER_S, 2.0 * m * n * k / FP32_FLOP_PER_S
    return (t_mem, "hbm") if t_mem >= t_fma else (t_fma, "fma")


def linear_row(section, variant, k, n, m, dtype, t, t_cublas, cfg, host_bound):
    wbytes = n * k * (4 if dtype == "f32" else 2)
    roof, bound = roofs(m, n, k, wbytes)
    goal = GOALS.get(m)
    return dict(section=section, K=k, N=n, M=m, weights=dtype, variant=variant, us=t * 1e6,
                cublas_f32_us=t_cublas * 1e6, vs_cublas=t_cublas / t, roof_us=roof * 1e6,
                bound=bound, roof_frac=roof / t, gbps=wbytes / t / 1e9,
                tflops=2.0 * m * n * k / t / 1e12,
                goal=f"vs_cublas>={goal}" if goal and variant == "default" else "-",
                goal_met=(t_cublas / t >= goal) if goal and variant == "default" else None,
                config=str(cfg), host_bound=host_bound)


def default_config(layers, m, n, k, dtype):
    if m <= layers.SKINNY_MAX_M:
        return layers.skinny_config(m, n, k, dtype)
    return layers.tiled_config(m, n, k)


# Alternatives timed beside the defaults.  This script measures what the package ships, so
# none here: dev/cuda/layers.py fills these with the plans that lost (and adds its sweep to
# EXTRA_SECTIONS), then runs main().
ALTERNATIVES = {
    "linear": lambda layers, m, n, k: [],   # [(name, config, weights dtype)], section "variants"
    "mma": lambda layers, m, n, k: {},      # {name: MmaConfig} at M = 1, 65, 512, K = 7168
    "moe": lambda layers, m: {},            # {name: [(TiledConfig, cmin, cmax)]} past skinny
}
EXTRA_SECTIONS = {}   # name -> fn(ctx, results, deadline), run last while time remains


def bench_linear(ctx, results, sections, deadline):
    cp, layers, timer = ctx["cp"], ctx["layers"], ctx["timer"]
    rng = np.random.default_rng(0)
    for k, n in LINEAR_SHAPES:
        f32_bytes = 4.0 * n * k
        n_copies = copies_for(f32_bytes / 2, cap=16)
        w32 = [cp.random.standard_normal((n, k), dtype=cp.float32) * cp.float32(0.02)
               for _ in range(copies_for(f32_bytes, cap=16))]
        w16 = [(w.view(cp.uint32) >> 16).astype(cp.uint16) for w in
               (w32 * n_copies)[:n_copies]]                     # bf16 bits (truncated)
        nb = ctx["cuda"].as_cuda_array
        by_dtype = {"f32": [nb(w) for w in w32], "bf16": [nb(w) for w in w16]}
        for m in LINEAR_MS:
            x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            y = cp.empty((m, n), cp.float32)
            x_nb, y_nb = nb(x), nb(y)
            ws = layers.Workspace()        # the K-slice buffers, allocated once (as in a step)
            t_cublas, hb_c = timer([lambda w=w: cp.matmul(x, w.T, out=y) for w in w32])
            t_bf16_cublas = bf16_cublas_time(cp, timer, x, w16, n)
            for dtype, ws_nb in by_dtype.items():
                t, hb = timer([lambda w=w: layers.linear(x_nb, w, out=y_nb, workspace=ws)
                               for w in ws_nb])
                row = linear_row("linear", "default", k, n, m, dtype, t, t_cublas,
                                 default_config(layers, m, n, k, dtype), hb or hb_c)
                row["cublas_bf16_us"] = None if t_bf16_cublas is None else t_bf16_cublas * 1e6
                results.append(row)
                print_row(row)
            if "variants" not in sections:
                continue
            for name, cfg, dtype in ALTERNATIVES["linear"](layers, m, n, k):
                if time.perf_counter() > deadline:
                    break
                try:
                    t, hb = timer([lambda w=w, c=cfg: layers.linear(x_nb, w, out=y_nb,
                                                                    config=c, workspace=ws)
                                   for w in by_dtype[dtype]], trials=5)
                except Exception as exc:   # noqa: BLE001 -- a variant failing must not end the run
                    report_failure(results, "variants", f"{k}->{n} M={m} {dtype} {name}", exc)
                    continue
                results.append(linear_row("variants", name, k, n, m, dtype, t, t_cublas, cfg,
                                          hb or hb_c))
                print_row(results[-1])
        del w32, w16, by_dtype
        cp.get_default_memory_pool().free_all_blocks()


def bf16_cublas_time(cp, timer, x, w16, n):
    """CuPy bf16 x bf16 matmul (x rounded to bf16 too), if this CuPy supports it."""
    try:
        import ml_dtypes
        xb = x.astype(cp.float32).view(cp.uint32) >> 16
        xb = xb.astype(cp.uint16).view(ml_dtypes.bfloat16)
        wb = [w.view(ml_dtypes.bfloat16) for w in w16]
        yb = cp.empty((x.shape[0], n), ml_dtypes.bfloat16)
        t, _ = timer([lambda w=w: cp.matmul(xb, w.T, out=yb) for w in wb], trials=3)
        return t
    except Exception:   # noqa: BLE001 -- optional baseline; absent in some CuPy builds
        return None


def bench_mma(ctx, results, deadline, ms=MMA_MS, shapes=MMA_SHAPES):
    """linear(method="mma") beside the default method and cuBLAS bf16, against the bf16 roofs.
    The default method is skipped where it would take > ~50 ms a call (M = 4096 lm_head)."""
    cp = ctx["cp"]
    nb = ctx["cuda"].as_cuda_array
    rng = np.random.default_rng(3)
    for k, n in shapes:
        wbytes = 2.0 * n * k
        w16 = [(cp.random.standard_normal((n, k), dtype=cp.float32) * cp.float32(0.02))
               .view(cp.uint32) >> 16 for _ in range(copies_for(wbytes, cap=16))]
        w16 = [w.astype(cp.uint16) for w in w16]
        w_nb = [nb(w) for w in w16]
        for m in ms:
            if time.perf_counter() > deadline:
                print(f"\n(mma: time budget, stopped before {k}->{n} M={m})")
                return
            try:
                mma_row(ctx, results, rng, k, n, m, w16, w_nb, wbytes, deadline)
            except Exception as exc:   # noqa: BLE001 -- one shape failing must not end the run
                report_failure(results, "mma", f"{k}->{n} M={m}", exc)
        del w16, w_nb
        cp.get_default_memory_pool().free_all_blocks()


def mma_row(ctx, results, rng, k, n, m, w16, w_nb, wbytes, deadline):
    cp, layers, timer = ctx["cp"], ctx["layers"], ctx["timer"]
    nb = ctx["cuda"].as_cuda_array
    x = cp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    y = cp.empty((m, n), cp.float32)
    x_nb, y_nb = nb(x), nb(y)
    ws = layers.Workspace()
    t_blas = bf16_cublas_time(cp, timer, x, w16, n)
    slow_default = 2.0 * m * n * k / 30e12 > 0.05          # the FMA kernels at ~30 TFLOP/s
    t_def = None if slow_default else timer(
        [lambda w=w: layers.linear(x_nb, w, out=y_nb, workspace=ws) for w in w_nb])[0]
    t_mem, t_tc = wbytes / HBM_BYTES_PER_S, 2.0 * m * n * k / BF16_FLOP_PER_S
    roof, bound = (t_mem, "hbm") if t_mem >= t_tc else (t_tc, "tensor")
    default = layers.mma_config(m, n, k)
    plans = [("default", default)]
    if default.splits > 1 and m > 1 and not default.tma:
        # the K slices added in the block whatever the tiles (mma_linear folds them only for
        # warpgroup tiles from FOLD_MIN_TILES M x N tiles; below, and on mma.sync's tiles up
        # to 80 rows, they go through memory: at M = 65 the 80-row tile folded takes 255
        # registers, 72 bytes spilled, ptxas)
        plans.append(("slices in block", dataclasses.replace(default, slices_in_block=True,
                                                             sums_in_last=False)))
    if default.splits > 1 and not default.tma:
        # the partial sums added by each tile's last slice block (the default up to
        # SUMS_IN_LAST_MAX_M rows), or by a sum launch (the default past them); where
        # mma_linear folds the slices neither changes anything
        plans.append(("sum launch", dataclasses.replace(default, sums_in_last=False))
                     if default.sums_in_last else
                     ("sums in last", dataclasses.replace(default, sums_in_last=True)))
    if default.wgmma and m >= 256:
        # four warpgroups of 64 x 128 (BM 256): a third fewer staged bytes a FLOP than the
        # default's two, where run 202's Nsight Compute found the kernel bound by its staging;
        # folded only with its registers capped (mma_linear's FOLD_MAX_THREADS)
        wide = dataclasses.replace(default, wm=4, wn=4, tm=4, tn=4, slices_in_block=False,
                                   sums_in_last=False)
        plans.append(("wgmma 256 x 128", wide))
        if default.splits > 1:
            plans.append(("wgmma 256 x 128 folded, 128 registers",
                          dataclasses.replace(wide, slices_in_block=True, max_registers=128)))
    from kdtree_numba.layers.mma_plan import wgmma_available
    from kdtree_numba.layers.mma_tma import (TMA_TILE, WIDE_FOLDING, WIDE_TILES, planned,
                                             swapped_tile)
    if wgmma_available() and m <= 256:
        # the weights as wgmma's A operand, x's rows as its B (n = M rounded up to 8), TMA
        # staging: what cuBLAS does at a verify's rows (run 202: 64 x 72 tiles at M = 65);
        # at one row a tensor-core GEMV whose weights stream through an 8-stage ring
        for wgs in (1, 2):
            swapped = swapped_tile(m, wgs, default.splits)
            plans.append((f"tma swapped {64 * wgs} x {swapped.bn}", swapped))
            plans.append((f"tma swapped {64 * wgs} x {swapped.bn}, 64-byte swizzle",
                          dataclasses.replace(swapped, swizzle=64)))
    if m >= 65 and wgmma_available():
        # TMA staging from a producer warp, a persistent grid (issue 38, KDTREE_MMA_TMA; at
        # 65 rows two warpgroups of 64 where mma.sync's tile is 80 rows): the launcher's
        # fold, and (past 80 rows) the slices forced into the block
        tma = dataclasses.replace(TMA_TILE, splits=default.splits)
        plans.append(("tma 128 x 128", tma))
        # 32-wide panels in the 64-byte swizzle (the cp.async kernel's): 1.4-1.5x slower at
        # M = 512 on the large products (run 204)
        plans.append(("tma 128 x 128, 64-byte swizzle", dataclasses.replace(tma, swizzle=64)))
    if default.wgmma and not default.tma and m > 80:
        plans.append(("cp.async wgmma 128 x 128", dataclasses.replace(
            default, tma=False, swizzle=64)))
        if default.splits > 1:
            plans.append(("tma 128 x 128 folded", dataclasses.replace(tma,
                                                                      slices_in_block=True)))
    if wgmma_available() and m > 80:
        # wider tiles, fewer bytes staged from L2 a FLOP (unfolded: slices through memory)
        plans += [(name, dataclasses.replace(wide, splits=default.splits))
                  for name, wide in WIDE_TILES.items()]
    if wgmma_available() and default.splits > 1:
        # stream-K (KDTREE_MMA_STREAM_K): the last waves' slices shared out over the grid, on
        # the TMA tile this M takes (the swapped one up to 80 rows)
        base = (default if default.tma else
                swapped_tile(m, 1, default.splits) if m <= 80 else
                dataclasses.replace(TMA_TILE, splits=default.splits))
        if base.bn <= 128 and base.holds_two_accumulator_sets:
            plans += [(f"tma stream-K, {waves} wave{'s' * (waves > 1)} shared",
                       dataclasses.replace(base, stream_k=waves, slices_in_block=False))
                      for waves in (1, 2)]
        if m > 80:      # cuBLAS's tile height with the slices added in the block
            wide = dataclasses.replace(WIDE_FOLDING, splits=default.splits)
            plans += [("tma 192 x 128 folded, 152 registers",
                       dataclasses.replace(wide, slices_in_block=True)),
                      ("tma 192 x 128 stream-K, 152 registers",
                       dataclasses.replace(wide, stream_k=1))]
    if m in (1, 65, 512) and k == 7168:
        plans += list(ALTERNATIVES["mma"](layers, m, n, k).items())
    for name, cfg in plans:
        if name != "default" and time.perf_counter() > deadline:
            break
        # under KDTREE_MMA_TMA=1 linear() sends a cp.async warpgroup tile to the TMA kernel:
        # a named cp.async variant runs with the switch off; the default row runs as the
        # switch says and names the tile that ran (run 205's rows had named the cp.async one)
        cp_async = name != "default" and cfg.wgmma and not cfg.tma
        with switch_off("KDTREE_MMA_TMA", cp_async):
            t, hb = timer([lambda w=w, c=cfg: layers.linear(x_nb, w, out=y_nb, method="mma",
                                                            config=c, workspace=ws)
                           for w in w_nb], trials=7 if name == "default" else 3)
            ran = planned(cfg) or cfg
        row = dict(section="mma", K=k, N=n, M=m, variant=name, us=t * 1e6,
                   default_us=t_def and t_def * 1e6, vs_default=t_def and t_def / t,
                   cublas_bf16_us=t_blas and t_blas * 1e6, vs_cublas_bf16=t_blas and t_blas / t,
                   roof_us=roof * 1e6, bound=bound, roof_frac=roof / t, gbps=wbytes / t / 1e9,
                   tflops=2.0 * m * n * k / t / 1e12, config=str(ran), host_bound=hb)
        results.append(row)
        print_row(row)


@contextlib.contextmanager
def switch_off(name: str, off: bool):
    """The environment switch ``name`` set to 0 inside the block where ``off`` (restored)."""
    if not off:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def bench_moe(ctx, results, deadline):
    cp, cuda, layers, timer = ctx["cp"], ctx["cuda"], ctx["layers"], ctx["timer"]
    n_experts, top_k, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d", "inter"))
    case = dict(top_k=top_k, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.827, scoring="sigmoid")
    rng = np.random.default_rng(1)
    # 34 GB of experts; the value does not change the timing, so a constant fill is enough.
    gate_up = cp.full((n_experts, 2 * inter, d), 0x3C00, cp.uint16)     # bf16 0.0078
    down = cp.full((n_experts, d, inter), 0x3C00, cp.uint16)
    shared_gu = cp.full((2 * inter, d), 0x3C00, cp.uint16)
    shared_dn = cp.full((d, inter), 0x3C00, cp.uint16)
    gates = [cp.asarray((rng.standard_normal((n_experts, d)) * 0.02).astype(np.float32))
             for _ in range(copies_for(n_experts * d * 4, cap=16))]   # the gate is 11 MB
    bias = cp.asarray((rng.standard_normal(n_experts) * 0.3).astype(np.float32))
    nb = cuda.as_cuda_array
    weights = tuple(map(nb, (gate_up, down, shared_gu, shared_dn)))
    gates_nb, bias_nb = [nb(g) for g in gates], nb(bias)
    expert_bytes_each = 3 * inter * d * 2
    for m in MOE_MS:
        h = nb(cp.asarray(rng.standard_normal((m, d)).astype(np.float32)))
        idx, w = nb(cp.empty((m, top_k), cp.int32)), nb(cp.empty((m, top_k), cp.float32))
        out = nb(cp.empty((m, d), cp.float32))
        ws = layers.Workspace()

        def route(gate=gates_nb[0]):
            layers.moe_route(h, gate, bias_nb, out=(idx, w), workspace=ws, **case)

        def ffn(index=idx, **kw):
            layers.moe_ffn(h, index, w, *weights, out=out, workspace=ws, **kw)

        def step():
            route()
            ffn()

        route()
        n_used = len(np.unique(idx.copy_to_host()))
        uniform = nb(cp.asarray(np.sort(np.stack([rng.choice(n_experts, top_k, replace=False)
                                                  for _ in range(m)]), axis=1).astype(np.int32)))
        n_uniform = len(np.unique(uniform.copy_to_host()))
        t_route, hb1 = timer([lambda g=g: route(g) for g in gates_nb])
        rows = [("route", "-", t_route, 0, n_experts * d * 4, hb1)]
        t_ffn, hb2 = timer([ffn], trials=5)
        rows.append(("expert_ffn", "default", t_ffn, n_used, (n_used + 1) * expert_bytes_each,
                     hb2))
        t_step, hb3 = timer([step], trials=5)
        rows.append(("route+ffn", "default", t_step, n_used,
                     (n_used + 1) * expert_bytes_each + n_experts * d * 4, hb3))
        for name, kw, index, used in moe_variants(layers, m, uniform, n_uniform, n_used, idx):
            if time.perf_counter() > deadline:
                break
            try:
                t, hb = timer([lambda kw=kw, index=index: ffn(index, **kw)], trials=5)
            except Exception as exc:   # noqa: BLE001 -- a variant failing must not end the run
                report_failure(results, "moe", f"M={m} {name}", exc)
                continue
            rows.append(("expert_ffn", name, t, used, (used + 1) * expert_bytes_each, hb))
        for part, variant, t, used, nbytes, hb in rows:
            entries = m * top_k if part != "route" else 0
            fma_s = 2.0 * 3 * inter * d * (entries + m) / FP32_FLOP_PER_S if entries else 0.0
            roof = max(nbytes / HBM_BYTES_PER_S, fma_s)
            results.append(dict(section="moe", part=part, M=m, variant=variant,
                                experts_read=used + 1 if part != "route" else 0,
                                us=t * 1e6, weight_bytes=nbytes,
                                roof_us=roof * 1e6, roof_frac=roof / t, gbps=nbytes / t / 1e9,
                                host_bound=hb))
            print_row(results[-1])
    del gate_up, down
    cp.get_default_memory_pool().free_all_blocks()


def moe_variants(layers, m, uniform, n_uniform, n_used, idx):
    """(name, moe_ffn keywords, expert_idx, experts used) beside the default at this M."""
    out = []
    if m > layers.SKINNY_MAX_M:
        out.append(("uniform routing", {}, uniform, n_uniform))
        out.append(("skinny", dict(method="skinny"), idx, n_used))
        for name, plan in ALTERNATIVES["moe"](layers, m).items():
            out.append((name, dict(configs=plan), idx, n_used))
        out.append(("uniform routing, skinny", dict(method="skinny"), uniform, n_uniform))
    return out


@contextlib.contextmanager
def environment(**values):
    """The process environment with ``values`` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_moe_chunk(ctx, results, deadline):
    """moe_ffn(method="skinny") at DEMO_MOE with the chunk grid off and on (module docstring):
    the two timed alternately, three rounds of 3 trials each, the median of each's trials."""
    cp, layers, timer, nb = ctx["cp"], ctx["layers"], ctx["timer"], ctx["cuda"].as_cuda_array
    n_experts, top_k, d, inter = (DEMO_MOE[k] for k in ("n_experts", "top_k", "d", "inter"))
    rng = np.random.default_rng(11)
    gate_up = nb(cp.full((n_experts, 2 * inter, d), 0x3C00, cp.uint16))     # bf16 0.0078
    down = nb(cp.full((n_experts, d, inter), 0x3C00, cp.uint16))
    for m in MOE_CHUNK_MS:
        h = nb(cp.asarray(rng.standard_normal((m, d)).astype(np.float32)))
        w = nb(cp.asarray(rng.uniform(0.1, 1.0, (m, top_k)).astype(np.float32)))
        spread = np.sort(np.stack([rng.choice(n_experts, top_k, replace=False)
                                   for _ in range(m)]), axis=1)
        popular = np.sort(np.stack([[3, e] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], m)]),
                          axis=1)
        out, ws = nb(cp.empty((m, d), cp.float32)), layers.Workspace()
        for routing, idx in (("spread", spread), ("popular", popular)):
            if time.perf_counter() > deadline:
                print(f"\n(moe_chunk: time budget, stopped before M={m} {routing})")
                return
            index = nb(cp.asarray(idx.astype(np.int32)))
            samples = {"0": [], "1": []}
            for _ in range(3):
                for grid in ("0", "1"):
                    with environment(KDTREE_MOE_CHUNK_GRID=grid):
                        t, hb = timer([lambda: layers.moe_ffn(h, index, w, gate_up, down,
                                                              out=out, workspace=ws,
                                                              method="skinny")], trials=3)
                    samples[grid].append((t, hb))
            t_off = statistics.median(t for t, _ in samples["0"])
            for grid, name in (("0", "one-chunk grid"), ("1", "chunk grid")):
                t = statistics.median(t for t, _ in samples[grid])
                results.append(dict(section="moe_chunk", M=m, routing=routing, variant=name,
                                    us=t * 1e6, vs_default=t_off / t,
                                    host_bound=any(hb for _, hb in samples[grid])))
                print_row(results[-1])


def bench_moe_mma(ctx, results, deadline):
    """moe_ffn(method="mma") beside the default method, router-picked and uniform routings."""
    cp, cuda = ctx["cp"], ctx["cuda"]
    n_experts, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "d", "inter"))
    rng = np.random.default_rng(3)
    nb = cuda.as_cuda_array
    weights = tuple(nb(cp.full(shape, 0x3C00, cp.uint16)) for shape in (   # bf16 0.0078
        (n_experts, 2 * inter, d), (n_experts, d, inter), (2 * inter, d), (d, inter)))
    gate = nb(cp.asarray((rng.standard_normal((n_experts, d)) * 0.02).astype(np.float32)))
    bias = nb(cp.asarray((rng.standard_normal(n_experts) * 0.3).astype(np.float32)))
    try:
        _moe_mma_rows(ctx, results, weights, gate, bias, rng, deadline)
    finally:
        del weights
        cp.get_default_memory_pool().free_all_blocks()


def _verify_inputs(ctx, rng, m, gate, bias):
    """(h, router-picked idx and weights, a uniform routing, out, workspace) of an M-row MoE
    call at MOE_SHAPE, on the device."""
    cp, layers, nb = ctx["cp"], ctx["layers"], ctx["cuda"].as_cuda_array
    n_experts, top_k, d = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d"))
    h = nb(cp.asarray(rng.standard_normal((m, d)).astype(np.float32)))
    idx, w = layers.moe_route(h, gate, bias, top_k=top_k, routed_scaling_factor=2.827)
    uniform = nb(cp.asarray(np.sort(np.stack([rng.choice(n_experts, top_k, replace=False)
                                              for _ in range(m)]), axis=1).astype(np.int32)))
    return h, idx, w, uniform, nb(cp.empty((m, d), cp.float32)), layers.Workspace()


def _moe_mma_rows(ctx, results, weights, gate, bias, rng, deadline):
    """The rows of bench_moe_mma (the caller frees the weights, whatever happens here)."""
    layers, timer = ctx["layers"], ctx["timer"]
    n_experts, top_k, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d", "inter"))
    expert_bytes = 3 * inter * d * 2
    for m in MOE_MMA_MS:
        h, idx, w, uniform, out, ws = _verify_inputs(ctx, rng, m, gate, bias)
        for routing, index in (("router", idx), ("uniform", uniform)):
            if routing == "uniform" and m < 65:
                continue
            t_default = None
            used = len(np.unique(index.copy_to_host()))
            # "mma work list": KDTREE_MOE_WORK_LIST=1 (read per call), the grid of M tiles
            # the grouping lists instead of every expert slot times ceil(M / BM)
            for variant, kw, work_list in (("default", {}, "0"), ("mma", dict(method="mma"), "0"),
                                           ("mma work list", dict(method="mma"), "1")):
                if time.perf_counter() > deadline:
                    print(f"\n(moe_mma: time budget, stopped before M={m})")
                    return
                try:
                    with environment(KDTREE_MOE_WORK_LIST=work_list):
                        t, hb = timer([lambda kw=kw, index=index: layers.moe_ffn(
                            h, index, w, *weights, out=out, workspace=ws, **kw)], trials=5)
                except Exception as exc:   # noqa: BLE001 -- report and go on
                    report_failure(results, "moe_mma", f"M={m} {routing} {variant}", exc)
                    continue
                if variant == "default":
                    t_default = t
                nbytes = (used + 1) * expert_bytes
                flop_s = 2.0 * 3 * inter * d * (m * top_k + m) / BF16_FLOP_PER_S
                roof = max(nbytes / HBM_BYTES_PER_S, flop_s)
                row = dict(section="moe_mma", M=m, routing=routing, variant=variant,
                           experts_read=used + 1, us=t * 1e6,
                           vs_default=t_default / t if t_default else None,
                           weight_bytes=nbytes, roof_us=roof * 1e6, roof_frac=roof / t,
                           bound="bytes" if nbytes / HBM_BYTES_PER_S >= flop_s else "flops",
                           gbps=nbytes / t / 1e9,
                           tflops=2.0 * 3 * inter * d * (m * top_k + m) / t / 1e12,
                           config=str(layers.moe_mma_config(m, top_k, n_experts))
                           if variant != "default" else "", host_bound=hb)
                results.append(row)
                print_row(row)


def bench_int4(ctx, results, deadline, ms=INT4_MS):
    """The W4A16 MoE rows (module docstring, "int4"), then M = 1 with bf16 experts."""
    from kdtree_numba.device_weights import random_int4_experts
    from kdtree_numba.layers.workspace import Int4Experts
    cp, nb = ctx["cp"], ctx["cuda"].as_cuda_array
    n_experts, top_k, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d", "inter"))
    rng = np.random.default_rng(4)
    experts = []
    for shape, std, seed in (((n_experts, 2 * inter, d), 0.014, 1),
                             ((n_experts, d, inter), 0.026, 3)):
        drawn = random_int4_experts(cp, shape, std, seed, INT4_GROUP)   # 9.5 GB, packed
        experts.append(Int4Experts(nb(drawn.words), nb(drawn.scale), drawn.group_size))
        del drawn          # the numba views keep the arrays; dropping them frees them
    shared = tuple(nb(cp.full(shape, 0x3C00, cp.uint16)) for shape in ((2 * inter, d),
                                                                       (d, inter)))
    gate = nb(cp.asarray((rng.standard_normal((n_experts, d)) * 0.02).astype(np.float32)))
    bias = nb(cp.asarray((rng.standard_normal(n_experts) * 0.3).astype(np.float32)))
    decode = []
    try:
        decode = _int4_rows(ctx, results, experts, shared, gate, bias, rng, deadline, ms)
    finally:
        del experts
        cp.get_default_memory_pool().free_all_blocks()
    if decode:         # (past the deadline too: the 2.3x goal's row)
        _bf16_decode_row(ctx, results, shared, decode)


def _int4_rows(ctx, results, experts, shared, gate, bias, rng, deadline, ms):
    """bench_int4's int4 rows; returns the M = 1 call's (h, idx, w, its row) for the bf16
    comparison, or []."""
    layers, timer = ctx["layers"], ctx["timer"]
    n_experts, top_k, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d", "inter"))
    each, shared_bytes = 3 * inter * d * (0.5 + 2 / INT4_GROUP), 3 * inter * d * 2
    decode = []
    for m in ms:
        h, idx, w, uniform, out, ws = _verify_inputs(ctx, rng, m, gate, bias)
        for routing, index in (("router", idx), ("uniform", uniform)):
            if (routing == "uniform" and m == 1) or time.perf_counter() > deadline:
                continue
            try:
                t, hb = timer([lambda index=index: layers.moe_ffn(
                    h, index, w, *experts, *shared, out=out, workspace=ws)], trials=5)
            except Exception as exc:   # noqa: BLE001 -- report and go on
                report_failure(results, "int4", f"M={m} {routing}", exc)
                continue
            used = len(np.unique(index.copy_to_host()))
            row = _moe_roof_row("int4", m, routing, used, used * each + shared_bytes, t, hb)
            results.append(row)
            print_row(row)
            if m == 1:
                decode = (h, idx, w, row)
                _int4_gemv_rows(ctx, results, experts, shared, (h, index, w, out, ws),
                                used * each + shared_bytes, used, deadline)
            if m in INT4_MMA_MS:
                _int4_mma_rows(ctx, results, experts, shared, (h, index, w, out, ws), m,
                               routing, used * each + shared_bytes, used, deadline)
    return decode


def _int4_gemv_rows(ctx, results, experts, shared, call, nbytes, used, deadline):
    """The M = 1 call's GEMV variants (INT4_GEMV_VARIANTS), then the W4A16 tensor-core
    kernels on it; each beside the same bytes roof."""
    import dataclasses
    from kdtree_numba.layers.moe_shapes import expert_config
    layers, timer = ctx["layers"], ctx["timer"]
    h, index, w, out, ws = call
    n_experts, top_k, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "top_k", "d", "inter"))
    picked = (expert_config(1, top_k, n_experts, d, True, True),
              expert_config(1, top_k, n_experts, inter, False, True))
    for variant, gate_up_kw, down_kw in INT4_GEMV_VARIANTS:
        if time.perf_counter() > deadline:
            return
        if not re.search(ctx["int4_variants"], variant):
            continue
        pair = (dataclasses.replace(picked[0], **gate_up_kw),
                dataclasses.replace(picked[1], **down_kw))
        try:
            t, hb = timer([lambda pair=pair: layers.moe_ffn(
                h, index, w, *experts, *shared, configs=pair, out=out, workspace=ws)],
                trials=5)
        except Exception as exc:   # noqa: BLE001 -- report and go on
            report_failure(results, "int4", f"M=1 {variant}", exc)
            continue
        row = _moe_roof_row(variant, 1, "router", used, nbytes, t, hb)
        row["config"] = str(pair)
        results.append(row)
        print_row(row)
    _decode_switch_rows(ctx, results, experts, shared, call, nbytes, used)
    _int4_mma_rows(ctx, results, experts, shared, call, 1, "router", nbytes, used, deadline,
                   tiles=INT4_MMA_DECODE_TILES)


def _int4_mma_rows(ctx, results, experts, shared, call, m, routing, nbytes, used, deadline,
                   tiles=INT4_MMA_TILES):
    """The W4A16 tensor-core kernels (moe_ffn(method="mma"), layers/moe_int4_mma.py) on the
    same call: int4_mma_config's tile over the full grid and over the work list, then the
    other tiles of INT4_MMA_TILES; each beside the same bytes roof (tensor-core FLOPs)."""
    from kdtree_numba.layers.moe_int4_mma import Int4MmaConfig, int4_mma_config
    layers, timer = ctx["layers"], ctx["timer"]
    h, index, w, out, ws = call
    n_experts, top_k = MOE_SHAPE["n_experts"], MOE_SHAPE["top_k"]
    picked = int4_mma_config(m, top_k, n_experts)
    variants = [("mma", picked, "0"), ("mma work list", picked, "1")] + [
        (f"mma {name}", Int4MmaConfig(**kw), "1") for name, kw in tiles]
    for variant, cfg, work_list in variants:
        if time.perf_counter() > deadline:
            return
        if not re.search(ctx["int4_variants"], variant):
            continue
        try:
            with environment(KDTREE_MOE_WORK_LIST=work_list):
                t, hb = timer([lambda cfg=cfg: layers.moe_ffn(
                    h, index, w, *experts, *shared, method="mma", configs=cfg, out=out,
                    workspace=ws)], trials=5)
        except Exception as exc:   # noqa: BLE001 -- report and go on
            report_failure(results, "int4", f"M={m} {routing} {variant}", exc)
            continue
        row = _moe_roof_row(variant, m, routing, used, nbytes, t, hb, BF16_FLOP_PER_S)
        row["config"] = str(cfg)
        results.append(row)
        print_row(row)


def _moe_roof_row(variant, m, routing, used, nbytes, t, host_bound, flop_rate=None):
    """A row of the int4 section: bytes of the distinct experts read (+ shared) and the FMAs
    of M tokens' k + 1 experts on CUDA cores (``flop_rate``: or another unit's), the larger
    being the roof."""
    top_k, d, inter = (MOE_SHAPE[k] for k in ("top_k", "d", "inter"))
    flop_s = 2.0 * 3 * inter * d * (m * top_k + m) / (flop_rate or FP32_FLOP_PER_S)
    roof = max(nbytes / HBM_BYTES_PER_S, flop_s)
    return dict(section="int4", M=m, routing=routing, variant=variant, experts_read=used + 1,
                us=t * 1e6, weight_bytes=nbytes, roof_us=roof * 1e6, roof_frac=roof / t,
                bound="bytes" if nbytes / HBM_BYTES_PER_S >= flop_s else "flops",
                gbps=nbytes / t / 1e9, host_bound=host_bound)


# the M = 1 call under other switches (_switch_row): (row name, environment)
DECODE_SWITCHES = (("shared expert apart", dict(KDTREE_SHARED_IN_EXPERTS="0")),
                   ("combine in down", dict(KDTREE_COMBINE_IN_DOWN="1")),
                   ("grouping in gate_up", dict(KDTREE_GROUP_IN_EXPERTS="1")),
                   ("grouping in gate_up, combine in down",
                    dict(KDTREE_GROUP_IN_EXPERTS="1", KDTREE_COMBINE_IN_DOWN="1")))


def _decode_switch_rows(ctx, results, experts, shared, call, nbytes, used, kind="int4"):
    """The M = 1 call under each of DECODE_SWITCHES: KDTREE_SHARED_IN_EXPERTS=0 (the shared
    expert in launches of its own: 7 where the default's, its blocks in the routed experts'
    two launches, are 4), KDTREE_COMBINE_IN_DOWN=1 (the combine in the down launch's tail:
    3), KDTREE_GROUP_IN_EXPERTS=1 (the grouping in the gate_up launch's blocks: 3), both (2);
    returns the first's row (the shared expert apart)."""
    rows = [_switch_row(ctx, results, experts, shared, call, nbytes, used, kind, name, env)
            for name, env in DECODE_SWITCHES]
    return rows[0]


def _switch_row(ctx, results, experts, shared, call, nbytes, used, kind, name, env):
    """The M = 1 call with the environment ``env``, beside the same bytes roof; ``kind``
    names the experts' dtype in the row."""
    layers, timer = ctx["layers"], ctx["timer"]
    h, index, w, out, ws = call
    try:
        with environment(**env):
            t, hb = timer([lambda: layers.moe_ffn(h, index, w, *experts, *shared, out=out,
                                                  workspace=ws)], trials=5)
    except Exception as exc:   # noqa: BLE001 -- report and go on
        report_failure(results, "int4", f"M=1 {kind} {name}", exc)
        return None
    variant = name if kind == "int4" else f"{kind}, {name}"
    row = _moe_roof_row(variant, 1, "router", used, nbytes, t, hb)
    results.append(row)
    print_row(row)
    return row


def _bf16_decode_row(ctx, results, shared, decode):
    """The M = 1 call of bench_int4 with the 384 experts in bf16 (33.8 GB, a constant fill:
    the values do not change the time); sets the int4 row's ``vs_bf16``: this call's time
    over the int4 call's, and the same on each M = 1 variant's row (the GEMV variants, the
    tensor-core kernels), then prints them, fastest first."""
    cp, layers, timer, nb = ctx["cp"], ctx["layers"], ctx["timer"], ctx["cuda"].as_cuda_array
    n_experts, d, inter = (MOE_SHAPE[k] for k in ("n_experts", "d", "inter"))
    h, idx, w, int4_row = decode
    experts = tuple(nb(cp.full(shape, 0x3C00, cp.uint16)) for shape in (
        (n_experts, 2 * inter, d), (n_experts, d, inter)))
    try:
        out, ws = nb(cp.empty((1, d), cp.float32)), layers.Workspace()
        t, hb = timer([lambda: layers.moe_ffn(h, idx, w, *experts, *shared, out=out,
                                              workspace=ws)], trials=5)
        used = int4_row["experts_read"] - 1
        nbytes = (used + 1) * 3 * inter * d * 2
        row = _moe_roof_row("bf16", 1, "router", used, nbytes, t, hb)
        int4_row["vs_bf16"] = t / (int4_row["us"] * 1e-6)
        results.append(row)
        print_row(row)
        apart = _decode_switch_rows(ctx, results, experts, shared, (h, idx, w, out, ws),
                                    nbytes, used, kind="bf16")
        if apart is not None:
            print(f"\nwith the shared expert apart on both sides: int4 "
                  f"{_apart_int4_us(results):.1f} us, bf16 {apart['us']:.1f} us", flush=True)
        print(f"\nint4 vs bf16 experts, one MoE layer's decode (M = 1): "
              f"{int4_row['vs_bf16']:.2f}x faster (bytes roof "
              f"{row['weight_bytes'] / int4_row['weight_bytes']:.2f}x)", flush=True)
        decode_rows = [r for r in results if r.get("section") == "int4" and r.get("M") == 1
                       and "us" in r and not r["variant"].startswith("bf16")]
        for r in sorted(decode_rows, key=lambda r: r["us"]):
            r["vs_bf16"] = t / (r["us"] * 1e-6)
            print(f"  {r['variant']}: {r['us']:.1f} us, {r['roof_frac']:.2f} of the roof, "
                  f"{r['vs_bf16']:.2f}x bf16", flush=True)
    except Exception as exc:   # noqa: BLE001 -- report and go on
        report_failure(results, "int4", "M=1 bf16 experts", exc)
    finally:
        experts = None
        cp.get_default_memory_pool().free_all_blocks()


def _apart_int4_us(results) -> float:
    """The int4 M = 1 "shared expert apart" row's time (nan where it did not run)."""
    return next((r["us"] for r in results if r.get("section") == "int4" and r.get("M") == 1
                 and r.get("variant") == "shared expert apart" and "us" in r), float("nan"))


def bench_norm_rope(ctx, results):
    cp, cuda, layers, timer = ctx["cp"], ctx["cuda"], ctx["layers"], ctx["timer"]
    nb = cuda.as_cuda_array
    rng = np.random.default_rng(2)
    d = HIDDEN
    weight = nb(cp.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32)))
    for m in NORM_MS:
        nbytes = 2 * m * d * 4 + d * 4
        xs = [nb(cp.random.standard_normal((m, d), dtype=cp.float32))
              for _ in range(copies_for(nbytes, cap=64))]
        y = nb(cp.empty((m, d), cp.float32))
        t, hb = timer([lambda x=x: layers.rmsnorm(x, weight, 1e-6, out=y) for x in xs])
        results.append(dict(section="rmsnorm", M=m, D=d, us=t * 1e6, bytes=nbytes,
                            gbps=nbytes / t / 1e9, roof_us=nbytes / HBM_BYTES_PER_S * 1e6,
                            roof_frac=nbytes / HBM_BYTES_PER_S / t, host_bound=hb))
        print_row(results[-1])
    spec = layers.RopeSpec(theta=50000.0, head_dim=ROPE_DIM, interleave=True,
                           yarn=layers.YarnScaling(32.0, 4096, 1.0, 1.0, 1.0, 1.0))
    for m in ROPE_MS:
        nbytes = 2 * m * ROPE_HEADS * ROPE_DIM * 4 + m * 8
        qs = [cp.random.standard_normal((m, ROPE_HEADS, NOPE_DIM + ROPE_DIM), dtype=cp.float32)
              for _ in range(copies_for(nbytes, cap=64))]
        views = [nb(q[:, :, NOPE_DIM:]) for q in qs]
        pos = nb(cp.asarray(rng.integers(0, 100_000, m)))
        y = nb(cp.empty((m, ROPE_HEADS, ROPE_DIM), cp.float32))
        t, hb = timer([lambda v=v: layers.rope(v, pos, spec, out=y) for v in views])
        results.append(dict(section="rope", M=m, heads=ROPE_HEADS, us=t * 1e6, bytes=nbytes,
                            gbps=nbytes / t / 1e9, roof_us=nbytes / HBM_BYTES_PER_S * 1e6,
                            roof_frac=nbytes / HBM_BYTES_PER_S / t, host_bound=hb))
        print_row(results[-1])


# ============================================================================ output

COLUMNS = {
    "linear": ["K", "N", "M", "weights", "us", "cublas_f32_us", "vs_cublas", "cublas_bf16_us",
               "roof_us", "bound", "roof_frac", "gbps", "tflops", "goal", "goal_met", "config",
               "host_bound"],
    "variants": ["K", "N", "M", "weights", "variant", "us", "vs_cublas", "roof_frac", "gbps",
                 "tflops", "config", "host_bound"],
    "moe": ["part", "M", "variant", "experts_read", "us", "weight_bytes", "roof_us",
            "roof_frac", "gbps", "host_bound"],
    "moe_mma": ["M", "routing", "variant", "experts_read", "us", "vs_default", "weight_bytes",
                "roof_us", "bound", "roof_frac", "gbps", "tflops", "config", "host_bound"],
    "moe_chunk": ["M", "routing", "variant", "us", "vs_default", "host_bound"],
    "int4": ["M", "routing", "variant", "experts_read", "us", "weight_bytes", "roof_us",
             "bound", "roof_frac", "gbps", "vs_bf16", "config", "host_bound"],
    "rmsnorm": ["M", "D", "us", "bytes", "gbps", "roof_us", "roof_frac", "host_bound"],
    "rope": ["M", "heads", "us", "bytes", "gbps", "roof_us", "roof_frac", "host_bound"],
    "mma": ["K", "N", "M", "variant", "us", "default_us", "vs_default", "cublas_bf16_us",
            "vs_cublas_bf16", "roof_us", "bound", "roof_frac", "gbps", "tflops", "config",
            "host_bound"],
}
_last_section = [None]


def fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def print_row(row):
    """Print a table row; a new table header whenever the section changes (sections
    interleave shape by shape, and rows are printed as they come so a crash loses nothing)."""
    cols = COLUMNS[row["section"]]
    if _last_section[0] != row["section"]:
        _last_section[0] = row["section"]
        print(f"\n### {row['section']}\n\n| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
    print("| " + " | ".join(fmt(row.get(c)) for c in cols) + " |", flush=True)


def summary(results):
    results = [r for r in results if "error" not in r]
    lin = [r for r in results if r["section"] == "linear"]
    for label, rows in (("skinny linear (>= 0.9x cuBLAS, M <= 16)", [r for r in lin
                                                                     if r["M"] <= 16]),
                        ("tiled linear (>= 0.8x cuBLAS, M = 65)", [r for r in lin
                                                                   if r["M"] > 16])):
        if rows:
            met = sum(bool(r["goal_met"]) for r in rows)
            worst = min(rows, key=lambda r: r["vs_cublas"])
            print(f"\n{label}: {met}/{len(rows)} met; worst {worst['vs_cublas']:.2f}x at "
                  f"{worst['K']}->{worst['N']} M={worst['M']} {worst['weights']}")
    best = {}                     # fastest of default + variants per (K, N, M, weights)
    for r in lin + [r for r in results if r["section"] == "variants"]:
        key = (r["K"], r["N"], r["M"], r["weights"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    picks = [r for r in best.values() if r["variant"] != "default"]
    if picks:
        print("\nvariants faster than the default (pick defaults from these):")
        for r in sorted(picks, key=lambda r: (r["M"], r["K"], r["N"], r["weights"])):
            default = next((d["us"] for d in lin if (d["K"], d["N"], d["M"], d["weights"])
                            == (r["K"], r["N"], r["M"], r["weights"])), float("nan"))
            print(f"  {r['K']}->{r['N']} M={r['M']} {r['weights']}: {r['variant']} "
                  f"{r['us']:.1f} us vs default {default:.1f} us ({r['config']})")
    for r in results:
        if r["section"] == "mma" and r["variant"] == "default":
            print(f"mma {r['K']}->{r['N']} M={r['M']}: {r['us']:.1f} us, {r['roof_frac']:.2f} "
                  f"of the {r['bound']} roof, "
                  + (f"{r['vs_cublas_bf16']:.2f}x cuBLAS bf16" if r["vs_cublas_bf16"] else
                     "no cuBLAS bf16"))
        if r["section"] == "moe_mma" and r["variant"] != "default":
            print(f"moe_mma M={r['M']} {r['routing']} {r['variant']}: {r['us']:.0f} us, "
                  f"{r['roof_frac']:.2f} of the {r['bound']} roof, "
                  f"{fmt(r['vs_default'])}x the default moe_ffn")
        if r["section"] == "int4":
            print(f"int4 M={r['M']} {r['routing']} {r['variant']}: {r['us']:.0f} us, "
                  f"{r['roof_frac']:.2f} of the {r['bound']} roof ({r['experts_read']} "
                  f"experts)" + (f", {r['vs_bf16']:.2f}x bf16" if r.get("vs_bf16") else ""))
        if r["section"] == "moe" and r["part"] == "expert_ffn":
            print(f"moe expert_ffn M={r['M']} {r['variant']}: {r['roof_frac']:.2f} of roof "
                  f"({r['us']:.0f} us, {r['experts_read']} experts)")
    mma = [r for r in results if r["section"] == "mma" and r["variant"] == "default"
           and r.get("vs_cublas_bf16")]
    if mma:
        worst = min(mma, key=lambda r: r["vs_cublas_bf16"])
        print(f"mma worst row: {worst['K']}->{worst['N']} M={worst['M']} at "
              f"{worst['vs_cublas_bf16']:.2f}x cuBLAS bf16 (issue 38's goal: >= 0.9x on every "
              f"row)")
    mma_best(results)


def mma_best(results):
    """The fastest mma plan of each (shape, M) where a variant beat the default (what to pick
    in mma_config), and the worst row if every row took its fastest plan."""
    best = {}
    for r in results:
        if r["section"] == "mma" and "error" not in r and r.get("vs_cublas_bf16"):
            key = (r["K"], r["N"], r["M"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    if not best:
        return
    print("\nmma: the fastest plan where a variant beat the default")
    for (k, n, m), r in sorted(best.items(), key=lambda item: (item[0][2], item[0][:2])):
        if r["variant"] != "default":
            print(f"  {k}->{n} M={m}: {r['variant']} {r['us']:.1f} us = {r['vs_default']:.2f}x "
                  f"the default, {r['vs_cublas_bf16']:.2f}x cuBLAS bf16")
    worst = min(best.values(), key=lambda r: r["vs_cublas_bf16"])
    print(f"mma worst row on each row's fastest plan: {worst['K']}->{worst['N']} M={worst['M']}"
          f" {worst['variant']} at {worst['vs_cublas_bf16']:.2f}x cuBLAS bf16")


def mma_shapes(text: str) -> list:
    """``--mma-shapes``: "K->N" pairs, or every product of :data:`MMA_SHAPES` for ""."""
    if not text:
        return MMA_SHAPES
    shapes = []
    for item in text.split(","):
        k, sep, n = item.partition("->")
        if not sep or not k.strip().isdigit() or not n.strip().isdigit():
            raise SystemExit(f"--mma-shapes takes K->N pairs such as 2048->7168, got {item!r}")
        shapes.append((int(k), int(n)))
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--int4-ms", default=",".join(map(str, INT4_MS)),
                        help="the int4 section's rows (M), comma-separated; M = 1 adds the "
                             "GEMV variants and the bf16 comparison (default: %(default)s)")
    parser.add_argument("--int4-variants", default="",
                        help="a regular expression: only the M = 1 GEMV variants and "
                             "tensor-core tiles whose names it matches (default: all)")
    parser.add_argument("--mma-ms", default=",".join(map(str, MMA_MS)),
                        help="the mma section's rows (M), comma-separated, on each of its "
                             "shapes (default: %(default)s)")
    parser.add_argument("--mma-shapes", default="",
                        help="the mma section's products as K->N, comma-separated (default: "
                             "every Kimi-K2 product: " + ", ".join(f"{k}->{n}" for k, n in
                                                                   MMA_SHAPES) + ")")
    parser.add_argument("--mma-budget", type=float, default=MMA_BUDGET_S,
                        help="seconds after which the mma section starts no new row "
                             "(default: %(default)s)")
    parser.add_argument("--only", default="linear,moe,norm,rope",
                        help="comma-separated sections (default: all but mma, moe_mma, "
                             "int4, moe_chunk)")
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    t_start = time.perf_counter()
    import cupy as cp
    from kdtree_numba import layers
    import card_roofs
    print(f"# {card_roofs.describe(card_roofs.apply(sys.modules[__name__]))}")
    ctx = dict(cp=cp, cuda=cuda, layers=layers, timer=GpuTimer(cp),
               int4_variants=args.int4_variants)
    print(f"# bench_layers on {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
          f"roof {HBM_BYTES_PER_S / 1e12:.1f} TB/s; times are GPU time per call (us)")
    results = []
    # variant timings stop early so that every section gets its turn
    plan = [("linear", lambda: bench_linear(ctx, results, sections, t_start + 95)),
            ("moe", lambda: bench_moe(ctx, results, t_start + 150)),
            ("norm", lambda: bench_norm_rope(ctx, results)),
            ("mma", lambda: bench_mma(ctx, results, time.perf_counter() + args.mma_budget,
                                      tuple(int(m) for m in args.mma_ms.split(",")),
                                      mma_shapes(args.mma_shapes))),
            ("moe_mma", lambda: bench_moe_mma(ctx, results,
                                              time.perf_counter() + MOE_MMA_BUDGET_S)),
            ("int4", lambda: bench_int4(ctx, results, time.perf_counter() + INT4_BUDGET_S,
                                        tuple(int(m) for m in args.int4_ms.split(",")))),
            ("moe_chunk", lambda: bench_moe_chunk(ctx, results, time.perf_counter() + 60))]
    for name, fn in plan:
        if name not in sections and not (name == "norm" and "rope" in sections) \
                and not (name == "linear" and "variants" in sections):
            continue
        if time.perf_counter() - t_start > BUDGET_S:
            print(f"\n(skipped {name}: time budget)")
            continue
        try:
            fn()
        except Exception as exc:   # noqa: BLE001 -- one shot on the device: report and go on
            import traceback
            traceback.print_exc()
            print(f"\n{name} FAILED: {type(exc).__name__}: {exc}", flush=True)
            results.append(dict(section=name, error=f"{type(exc).__name__}: {exc}"))
    for name, fn in EXTRA_SECTIONS.items():
        if name not in sections or time.perf_counter() - t_start >= BUDGET_S - 40:
            continue
        try:
            fn(ctx, results, t_start + BUDGET_S)
        except Exception as exc:   # noqa: BLE001
            print(f"\n{name} FAILED: {type(exc).__name__}: {exc}", flush=True)
    summary(results)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Benchmark the DDTree numba kernels on a GPU against their roofs and goals (docs/DDTREE.md).

    python3 tools/bench_ddtree.py [--json PATH] [--quick]
    python3 tools/bench_ddtree.py --demo      (top-K at a demo round's shape only, < 60 s)

* top-K log-probs, bs=64, L=15, V=163840: device time vs the HBM roof (logits bytes / bandwidth,
  with the bandwidth measured here by a CuPy device copy, and the nominal 4.1 TB/s); goal:
  >= 60% of the measured roof.  The default configuration (warps, vec, parts: see
  ``kdtree_numba.ddtree.topk_config``) at k = 64/256/1024, a few alternatives at k = 64, and a
  small batch (bs=4, where the default splits every row over several blocks).
* ``--demo``: top-K at the shape of the demo pair's round (one request: the drafter's L = 15
  rows of V = 8,192 logits, k = 8 / 16 / 32, the logits in L2 as the round leaves them),
  the default configuration beside other parts / warps / vec: run 153 timed the round's
  one top-K launch at 17 us, a tenth of a decode step.
* build_tree, bs=64, L=15, budgets 64/256/1024: device time vs the reference's host heap on the
  same batch; goals: <= 50 us at budget 64, >= 100x faster than the heap at every budget.
* accept_greedy + compact_kv, bs=64, 61 layers x latent width 576 as bf16 bit patterns (uint16)
  in one stacked cache [61, bs, max_len, 576]: device time of each and of both; the roof is the
  bytes actually moved (accepted non-identity rows, read + write) at the measured bandwidth.

Device times: CUDA events around direct launches of the configured kernels (outputs
preallocated), after a warm-up, median of many runs.  A ~0.3 ms sleeping kernel is queued
before each timed run, so the host's launch overhead (25-60 us per numba launch, gone under a
CUDA graph) is hidden and the events time the device only.  L2 is flushed (a 256 MB write)
before each timed run of a kernel whose working set would fit in it.
Prints a markdown table; ``--json PATH`` also writes the rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kdtree_numba import compat  # noqa: E402  (numpy fix before numba compiles)
from kdtree_numba import ddtree as gpu  # noqa: E402
from kdtree_numba.ddtree import accept as gpu_accept, arrays as gpu_arrays  # noqa: E402
from kdtree_numba.ddtree import build as gpu_build, compact as gpu_compact  # noqa: E402
from kdtree_numba.ddtree import topk as gpu_topk  # noqa: E402
from reference import ddtree as ref  # noqa: E402

cuda = compat.cuda
NOMINAL_BW = 4.1e12
BS, L, VOCAB = 64, 15, 163840
BUDGETS = (64, 256, 1024)
N_LAYERS, LATENT = 61, 576   # DeepSeek-V3 / Kimi-K2: kv_lora_rank 512 + rope 64


class Timer:
    """CUDA-event timing of a launch function on one numba stream."""

    def __init__(self, flush_bytes: int = 256 << 20):
        self.stream = cuda.stream()
        self.flush = cuda.device_array(flush_bytes // 4, np.float32)

    def _flush_l2(self):
        _fill[(self.flush.size + 255) // 256, 256, self.stream](self.flush, 1.0)

    def median_us(self, launch, runs: int, flush: bool) -> float:
        for _ in range(3):
            launch(self.stream)
        times = []
        for _ in range(runs):
            if flush:
                self._flush_l2()
            _sleep[1, 1, self.stream](300)   # the device waits here while the host queues
            start, stop = cuda.event(), cuda.event()
            start.record(self.stream)
            launch(self.stream)
            stop.record(self.stream)
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        return statistics.median(times)


@compat.kernel
def _fill(buf, value):
    i = cuda.grid(1)
    if i < buf.size:
        buf[i] = value


@compat.kernel
def _sleep(microseconds):
    for _ in range(microseconds):
        cuda.nanosleep(1000)


def measure_bandwidth() -> float:
    """Read+write bytes per second of a 1 GiB CuPy device copy (median of 20)."""
    import cupy as cp
    n = 1 << 28
    src, dst = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    times = []
    for i in range(23):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        cp.copyto(dst, src)
        stop.record()
        stop.synchronize()
        if i >= 3:
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    return 2 * n * 4 / statistics.median(times)


def row(kernel, shape, measured_us, roof_or_goal, ratio, verdict, **extra):
    return dict(kernel=kernel, shape=shape, measured_us=round(measured_us, 2),
                target=roof_or_goal, ratio=ratio, verdict=verdict, **extra)


# (bs, k, warps, vec, parts); None = the default (topk_config: 4 warps, vec 4).  The variants
# are the knobs worth one GPU run: at k = 64 fewer loads in flight per lane (vec 2) or more
# (vec 8, 96 registers), other warps per block (2, 8), two blocks per row (+ the merge
# kernel); at bs = 4 (where the default splits each row over 8 blocks) 1 and 4 blocks per row.
TOPK_CASES = [(BS, 64, None, None, None), (BS, 256, None, None, None),
              (BS, 1024, None, None, None), (4, 64, None, None, None)]
TOPK_VARIANTS = [(BS, 64, 4, 4, None), (BS, 64, 1, 8, None), (BS, 64, 2, 4, None),
                 (BS, 64, 8, 4, None), (BS, 64, 4, 8, None), (BS, 64, 2, 8, 2),
                 (4, 64, None, None, 1), (4, 64, None, None, 4)]


def bench_topk(timer: Timer, bandwidth: float, quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    logits = cuda.to_device((rng.standard_normal((BS * L, VOCAB), np.float32) * 3))
    rows = []
    for bs, k, warps, vec, parts in TOPK_CASES + ([] if quick else TOPK_VARIANTS):
        n_rows = bs * L
        config = gpu.topk_config(k, n_rows, VOCAB, warps, vec, parts)
        data = logits[:n_rows]
        nbytes = n_rows * VOCAB * 4
        roof_us = nbytes / bandwidth * 1e6
        lp = cuda.device_array((n_rows, k), np.float32)
        ids = cuda.device_array((n_rows, k), np.int32)

        def launch(stream, k=k, lp=lp, ids=ids, config=config, data=data):
            gpu_topk._launch_topk(data, k, lp, ids, config, stream)

        # bs=64 reads 629 MB (> L2); the small batch (39 MB) is flushed from L2 each run.
        us = timer.median_us(launch, 10 if quick else 30, flush=nbytes < (200 << 20))
        frac = roof_us / us
        w, v, kl, p = config
        rows.append(row(f"topk_logprobs k={k} (warps={w}, vec={v}, parts={p})"
                        + (" default" if (warps, vec, parts) == (None, None, None) else ""),
                        f"{bs}x{L}x{VOCAB} f32", us,
                        f"roof {roof_us:.0f} us @ measured BW; goal >= 60%",
                        f"{100 * frac:.0f}% roof ({100 * nbytes / NOMINAL_BW * 1e6 / us:.0f}%"
                        f" of 4.1 TB/s)", "ok" if frac >= 0.6 else "BELOW GOAL",
                        roof_us=roof_us, fraction_of_roof=frac,
                        gbps=nbytes / us * 1e-3))
    return rows


DEMO_L, DEMO_VOCAB = 15, 8192
DEMO_KS = (8, 16, 32)
DEMO_CONFIGS = [(None, None, None)] + [(w, v, p) for p in (1, 2, 4, 8) for w, v in
                                       ((2, 8), (4, 4), (1, 8), (4, 2))]


def bench_topk_demo(timer: Timer) -> list[dict]:
    """Top-K at the demo round's shape (module docstring): every DEMO_CONFIGS that
    topk_config accepts, no L2 flush."""
    rng = np.random.default_rng(1)
    data = cuda.to_device(rng.standard_normal((DEMO_L, DEMO_VOCAB), np.float32) * 3)
    rows = []
    for k in DEMO_KS:
        lp = cuda.device_array((DEMO_L, k), np.float32)
        ids = cuda.device_array((DEMO_L, k), np.int32)
        default = gpu.topk_config(k, DEMO_L, DEMO_VOCAB)
        seen = set()
        for warps, vec, parts in DEMO_CONFIGS:
            try:
                config = gpu.topk_config(k, DEMO_L, DEMO_VOCAB, warps, vec, parts)
            except ValueError:
                continue
            if config in seen:
                continue
            seen.add(config)

            def launch(stream, k=k, config=config):
                gpu_topk._launch_topk(data, k, lp, ids, config, stream)

            us = timer.median_us(launch, 30, flush=False)
            w, v, _, p = config
            rows.append(row(f"topk_logprobs k={k} (warps={w}, vec={v}, parts={p})"
                            + (" default" if config == default else ""),
                            f"1x{DEMO_L}x{DEMO_VOCAB} f32", us, "a demo round's top-K",
                            "-", "-"))
    return rows


def bench_build(timer: Timer, quick: bool) -> list[dict]:
    rows = []
    for budget in BUDGETS:
        logits = (np.random.default_rng(budget).standard_normal((BS, L, 2 * budget),
                                                                np.float32) * 3)
        lp, ids = ref.topk_logprobs(logits, budget)
        host = []
        for _ in range(3):
            t0 = time.perf_counter()
            ref.build_tree(lp, ids, budget)
            host.append((time.perf_counter() - t0) * 1e6)
        host_us = statistics.median(host)
        d_lp, d_ids = cuda.to_device(lp), cuda.to_device(ids)
        out = [cuda.device_array(BS, np.int32)] + [
            cuda.device_array((BS, budget + 1), np.int32) for _ in range(4)] + [
            cuda.device_array((BS, budget + 1), np.float64)]
        for threads in (None,) if quick or budget != 64 else (None, 32):
            threads, bcap = gpu.build_config(budget, threads)
            kern = gpu_build._build_kernel(threads, bcap)

            def launch(stream, kern=kern, budget=budget, out=out, threads=threads, d_lp=d_lp,
                       d_ids=d_ids):
                kern[BS, threads, stream](d_lp, d_ids, budget, *out)

            us = timer.median_us(launch, 50, flush=False)
            speedup = host_us / us
            ok = speedup >= 100 and (budget != 64 or us <= 50)
            goal = ("<= 50 us and >= 100x heap" if budget == 64 else ">= 100x heap")
            rows.append(row(f"build_tree B={budget} (threads={threads})", f"{BS}x{L}, K={budget}",
                            us, f"{goal}; heap {host_us / 1e3:.1f} ms", f"{speedup:.0f}x heap",
                            "ok" if ok else "BELOW GOAL", host_us=host_us, speedup=speedup,
                            us_per_pop=us / budget))
    return rows


def bench_accept_compact(timer: Timer, bandwidth: float) -> list[dict]:
    budget, n_layers, width, past = 64, N_LAYERS, LATENT, 128
    max_len = past + budget + 1
    logits = np.random.default_rng(1).standard_normal((BS, L, 4096), np.float32) * 3
    lp, ids = ref.topk_logprobs(logits, budget)
    tree = ref.build_tree(lp, ids, budget)
    rng = np.random.default_rng(2)
    target = rng.integers(0, 4096, size=(BS, budget + 1)).astype(np.int32)
    for b in range(BS):   # follow some child at each node with probability 0.8: deep walks
        for c in range(1, int(tree.n_nodes[b]) + 1):
            if rng.random() < 0.8:
                target[b, tree.parent[b, c]] = tree.token[b, c]
    acc_idx, acc_len, _ = ref.accept_greedy(tree, target)
    moved = sum(int(acc_len[b]) - next((k for k in range(acc_len[b]) if acc_idx[b, k] != k),
                                       int(acc_len[b])) for b in range(BS))
    d_tree = gpu_arrays.tree_on_device(tree, 0)
    d_target = cuda.to_device(target)
    acc_out = (cuda.device_array((BS, L + 1), np.int32), cuda.device_array(BS, np.int32),
               cuda.device_array(BS, np.int32))
    accept = gpu_accept._accept_kernel(L)
    stack = cuda.device_array((n_layers, BS, max_len, width), np.uint16)   # bf16 bit patterns
    words = gpu_compact._as_words(stack)
    compact = gpu_compact._compact_kernel(L + 1, words.dtype.type)
    d_past = cuda.to_device(np.full(BS, past, np.int32))
    d_acc, d_len = cuda.to_device(acc_idx), cuda.to_device(acc_len)
    threads = gpu.compact_threads(words.shape[3])
    grid = (n_layers * BS, (words.shape[3] + threads - 1) // threads)

    def launch_accept(stream):
        accept[BS, 256, stream](d_tree.n_nodes, d_tree.token, d_tree.parent, d_target, *acc_out)

    def launch_compact(stream):
        compact[grid, threads, stream](words, d_past, d_acc, d_len)

    def launch_both(stream):
        launch_accept(stream)
        compact[grid, threads, stream](words, d_past, acc_out[0], acc_out[1])

    moved_bytes = 2 * moved * n_layers * width * 2
    roof_us = moved_bytes / bandwidth * 1e6
    mean_len = float(acc_len.mean())
    shape = f"bs={BS}, B={budget}, {n_layers}x{width} bf16, mean acc_len {mean_len:.2f}"
    rows = []
    for name, launch in (("accept_greedy", launch_accept),
                         (f"compact_kv (1 launch, {n_layers}-layer stack)", launch_compact),
                         ("accept_greedy + compact_kv", launch_both)):
        us = timer.median_us(launch, 50, flush=True)
        target_txt = (f"bytes roof {roof_us:.1f} us ({moved} rows x {n_layers} layers)"
                      if "compact" in name else "no stated goal")
        rows.append(row(name, shape, us, target_txt, "", "info", roof_us=roof_us))
    # The public API with a list of 61 per-layer arrays: one launch each, host dispatch counted.
    layers = [stack[i] for i in range(n_layers)]
    gpu.compact_kv(layers, d_past, d_acc, d_len)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        gpu.compact_kv(layers, d_past, d_acc, d_len)
    cuda.synchronize()
    wall = (time.perf_counter() - t0) / 5 * 1e6
    rows.append(row(f"compact_kv public API, list of {n_layers} layers (host wall)", shape,
                    wall, f"{n_layers} launches: pass a 4-D stack instead", "", "info"))
    return rows


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"\nDDTree kernels on {meta['device']} (HBM measured {meta['bandwidth_tbs']:.2f} TB/s "
          f"by a CuPy copy; nominal 4.1 TB/s)\n")
    print("| kernel | shape | device us | roof / goal | result | verdict |")
    print("|---|---|---:|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['shape']} | {r['measured_us']:.1f} | {r['target']} | "
              f"{r['ratio']} | {r['verdict']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="fewer runs and configurations")
    parser.add_argument("--demo", action="store_true",
                        help="only top-K at the demo pair's round shape")
    args = parser.parse_args(argv)
    if not compat.gpu_available():
        print("bench_ddtree: no CUDA GPU here", file=sys.stderr)
        return 2
    bandwidth = measure_bandwidth()
    timer = Timer()
    name = getattr(cuda.get_current_device(), "name", "GPU")
    meta = dict(device=name.decode() if isinstance(name, bytes) else str(name),
                bandwidth_tbs=bandwidth / 1e12)
    rows = []
    parts = [lambda: bench_topk_demo(timer)] if args.demo else [
        lambda: bench_topk(timer, bandwidth, args.quick), lambda: bench_build(timer, args.quick),
        lambda: bench_accept_compact(timer, bandwidth)]
    for part in parts:
        t0 = time.perf_counter()
        rows += part()
        print(f"[{time.perf_counter() - t0:.0f} s] {rows[-1]['kernel']} ...", file=sys.stderr,
              flush=True)
    print_table(rows, meta)
    if args.json:
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

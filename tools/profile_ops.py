"""Where a forward's GPU time goes: each op of one forward replayed alone in a CUDA graph.

    python3 tools/profile_ops.py [--size kimi-slice|kimi-k2-slice] [--gemm tensor-cores]
                                 [--n 1,33,128]
                                 [--prefix 128] [--replays 20] [--kv-cache float32]
                                 [--prefill] [--host]

tools/bench_engine.py gives a step's time beside its weight roof; this says which ops make the
gap.  One forward of n tokens (n = 1: an AR decode; n > 1: a chain verify of n nodes, or with
``--prefill`` a prompt's prefill as the engine runs it: causal attention, the last token's
logits) runs eagerly after a prefill of ``--prefix`` random tokens, with every op of ``backend.ops``
wrapped.  Each op call is then captured alone in a CUDA graph (kdtree_numba/graphs.py) with
the arguments it had and replayed ``--replays`` times between two CUDA events: its time is the
GPU's plus one graph launch, as inside the engine's replayed forward.  The table groups the
calls by op and by weight shape, with the weight-bytes roof beside ``linear`` (its weight) and
``moe_ffn`` (the experts the call's routing reads, plus the shared expert; ``kimi-k2-slice``'s
int4 experts at their packed bytes), and ends with the
whole forward replayed as the engine replays it (inputs written, outputs copied) and run
eagerly (wall time, host launches inside: how a one-off shape such as a prompt's prefill
runs).  The replayed forward's difference from the sum of the ops is the CuPy glue between
them (slices made contiguous, residual adds, the KV-cache write) and the forward's own
copies.  GPU only.

``--host`` instead says where an eager forward's *host* time goes: its wall time, then cProfile
around three eager forwards of each n, the functions with the most own and cumulative time, and who calls the
CUDA driver (numba's ``safe_cuda_api_call``), per forward.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from engine_roof import HBM_BYTES_PER_S  # noqa: E402
from probe_batch_invariance import Recorder, build_model, eager_forwards  # noqa: E402

from kdtree_numba.graphs import GraphCache  # noqa: E402
from kdtree_numba.model import ForwardBatch, causal_mask  # noqa: E402


def gpu_us(launch, replays: int) -> float:
    """Mean microseconds of ``launch()`` over ``replays`` back-to-back calls (CUDA events on
    the legacy stream, which the graphs' blocking stream is ordered with)."""
    import cupy
    launch()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.Device().synchronize()
    start.record()
    for _ in range(replays):
        launch()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / replays


def weight_bytes(name, args, to_host=np.asarray) -> int | None:
    """Bytes of weights the call must read: linear's weight; moe_ffn's experts that its
    routing selects (indices read through ``to_host``, the backend's) plus the shared expert;
    else None."""
    if name == "linear":
        return int(args[1].nbytes)
    if name == "moe_ffn":
        gate_up, down = args[3], args[4]
        per_expert = (gate_up.nbytes + down.nbytes) // gate_up.shape[0]
        if args[1] is None:             # the dense FFN: its one expert
            return int(per_expert)
        total = len(np.unique(np.asarray(to_host(args[1])))) * per_expert
        if len(args) > 6 and args[5] is not None:
            total += args[5].nbytes + args[6].nbytes
        return int(total)
    return None


def shape_label(name, args) -> str:
    if name == "linear":
        n, k = args[1].shape
        return f"{k}->{n}"
    if name == "moe_ffn":
        if args[1] is None or args[1].shape[1] == 1:
            return "dense"
        return f"top-{args[1].shape[1]}"
    return ""


def _forward(model, n: int, prefix: int, seed: int = 0, prefill: bool = False):
    """``forward()``: a forward of n random tokens after a prefill of ``prefix`` random tokens
    (run here); ``prefill``: as the engine's prefill runs it (causal attention, the last
    token's logits only), else as a chain verify (every row's logits)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.config.vocab_size, (1, prefix + n))
    positions = np.arange(prefix + n)[None]
    cache = model.new_cache(1, prefix + n + 16)
    model.forward(ForwardBatch(
        tokens[:, :prefix], positions[:, :prefix], causal_mask(prefix)), cache)
    cache.advance([prefix])
    extra = dict(causal=True, prefill=True, logit_rows=np.array([n - 1])) if prefill else {}
    batch = ForwardBatch(tokens[:, prefix:], positions[:, prefix:], causal_mask(n), **extra)
    return functools.partial(model.forward, batch, cache)


def profile(model, n: int, prefix: int, replays: int, seed: int = 0, prefill: bool = False):
    """(rows per op call: name, label, us, weight bytes; the whole forward's us, eager and
    replayed)."""
    forward = _forward(model, n, prefix, seed, prefill)
    recorder = Recorder(model.backend,
                        entry=lambda name, fn, a, kw, out: (name, fn, a, kw))  # to replay it
    try:
        with eager_forwards(model):
            calls = recorder.run(forward)
    finally:
        recorder.close()
    single = GraphCache(model.backend)
    rows = []
    for i, (name, fn, a, kw) in enumerate(calls):
        key = ("op", i)
        for _ in range(2):       # seen (the recorded forward compiled it), then captured
            single.call(key, lambda: fn(*a, **kw), [], [])
        label, nbytes = shape_label(name, a), weight_bytes(name, a, model.backend.to_host)
        try:
            us = gpu_us(lambda: single.replay(key), replays)
        except KeyError:                         # capture failed: eager (host time inside)
            us = gpu_us(lambda: fn(*a, **kw), replays)
            name += " (eager)"
        rows.append((name, label, us, nbytes))
    whole = {"eager": eager_us(model, forward)}
    if model.graphs is not None:
        for _ in range(2):       # the engine's path: eager, then captured
            forward()
        whole["replayed"] = gpu_us(forward, replays)
    return rows, whole


def eager_us(model, forward, repeats: int = 3) -> float:
    """Wall microseconds of the forward run eagerly (no graph, host launches inside, as a
    one-off shape such as a prompt's prefill runs), synchronised at both ends."""
    import time

    import cupy
    with eager_forwards(model):
        forward()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            forward()
        cupy.cuda.Device().synchronize()
        return (time.perf_counter() - start) / repeats * 1e6


def host_profile(model, n: int, prefix: int, repeats: int = 3, top: int = 25) -> None:
    """Print cProfile's view of ``repeats`` eager forwards of ``n`` tokens (module docstring)."""
    import cProfile
    import io
    import pstats

    forward = _forward(model, n, prefix)
    eager_ms = eager_us(model, forward) / 1e3
    print(f"\neager forward of {n} token(s) after {prefix}: {eager_ms:.2f} ms "
          "wall (no profiler)")
    with eager_forwards(model):
        forward()                                  # compiled and loaded before profiling
        model.backend.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(repeats):
            forward()
        model.backend.synchronize()
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    print(f"\n## host profile: {repeats} eager forwards of {n} token(s) after {prefix}\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    stats.print_callers("safe_cuda_api_call")
    print("```\n" + out.getvalue() + "```")


def print_table(rows, whole, title: str) -> None:
    groups = collections.OrderedDict()
    for name, label, us, nbytes in rows:
        g = groups.setdefault((name, label), [0, 0.0, 0])
        g[0] += 1
        g[1] += us
        g[2] += nbytes or 0
    total = sum(g[1] for g in groups.values())
    print(f"\n## {title}\n")
    print("| op | weight shape | calls | us | share | weight bytes roof us | us / roof |")
    print("|---|---|---|---|---|---|---|")
    for (name, label), (calls, us, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        roof = nbytes / HBM_BYTES_PER_S * 1e6 if nbytes else None
        print(f"| {name} | {label or '-'} | {calls} | {us:.1f} | {us / total:.1%} | "
              + (f"{roof:.1f} | {us / roof:.2f}x |" if roof else "- | - |"))
    roof_all = sum(nb or 0 for *_, nb in rows) / HBM_BYTES_PER_S * 1e6
    print(f"| **sum of ops** | | {len(rows)} | {total:.1f} | 100% | {roof_all:.1f} | "
          f"{total / roof_all:.2f}x |")
    for how, us in whole.items():
        print(f"| **whole forward, {how}** | | | {us:.1f} | | {roof_all:.1f} | "
              f"{us / roof_all:.2f}x |")
    if "replayed" in whole:
        replayed = whole["replayed"]
        print(f"\nglue and copies outside the ops: {replayed - total:.1f} us "
              f"({(replayed - total) / replayed:.1%} of the replayed forward)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="kimi-slice")
    p.add_argument("--gemm", default="tensor-cores")
    p.add_argument("--n", default="1,33,128", help="comma-separated forward widths")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--prefill", action="store_true",
                   help="each forward as the engine's prefill: causal attention, the last "
                        "token's logits only (default: a chain verify, every row's logits)")
    p.add_argument("--kv-cache", default="float32", choices=("float32", "bfloat16"),
                   help="the latent cache's dtype (kimi-slice and the other on-device sizes)")
    p.add_argument("--host", action="store_true",
                   help="profile the eager forward's host time instead (module docstring)")
    args = p.parse_args(argv)
    model = build_model(args.size, args.gemm, "numba", kv_cache=args.kv_cache)
    for n in (int(v) for v in args.n.split(",")):
        if args.host:
            host_profile(model, n, args.prefix)
            continue
        rows, whole = profile(model, n, args.prefix, args.replays, prefill=args.prefill)
        what = "prefill" if args.prefill else "forward"
        print_table(rows, whole, f"{args.size}, gemm={args.gemm}, {args.kv_cache} cache, "
                                 f"{what} of {n} token(s) after {args.prefix}")


if __name__ == "__main__":
    main()

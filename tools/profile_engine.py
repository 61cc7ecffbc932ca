"""Where the host time of generation goes: cProfile of warmed-up ``generate()`` calls.

    python3 tools/profile_engine.py [--size small|medium|kimi-slice|demo] [--gemm cuda-cores]
                                    [--method ar|ddtree] [--tokens 32] [--budget 32]
                                    [--prompt-len 32] [--top 45]
    python3 tools/profile_engine.py --size demo --method ddtree --tokens 1 --prompt-len 128

The engine on the GPU is host-bound (docs/BENCHMARKS.md, "Engine"): this prints the functions
that take the host's time, by own time and by cumulative time, plus the wall time of one
forward with and without a device synchronisation, so a change to the per-op overhead can be
measured directly.  The DDTree method uses a replay drafter (no drafter forwards), so its
profile is the target's verify forward and the tree kernels; ``--size demo`` runs the shipped
pair instead (kdtree_numba/demo: the target and its DFlash drafter, whose rounds run as device
programs on a GPU), on the first held-out prompt cut or repeated to ``--prompt-len`` tokens.
``--tokens 1`` profiles a generation's prefill alone (the prompt's forward, its first token,
the drafter's first commit): issue 36's prefill took 2.6-2.9 ms a prompt of the demo pair's
~22 ms at budget 16, against ~1 ms of kernels.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import ForwardBatch, causal_mask  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small",
                   help="small, medium, kimi-slice, or demo (the shipped pair)")
    p.add_argument("--method", default="ar", choices=("ar", "ddtree"))
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--backend", default="numba", help="reference: check the script anywhere")
    p.add_argument("--gemm", default="cuda-cores", help="make_backend's gemm setting")
    p.add_argument("--prompt-len", type=int, default=32)
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_engine import DEVICE_SIZES
    from kdtree_numba.drafter import ReplayDrafter
    from probe_batch_invariance import build_model  # small / medium, or drawn on the device
    if args.size == "demo":
        model, prompt, kw = _demo_pair(args)
    else:
        model = build_model(args.size, args.gemm, args.backend)
        prompt = np.random.default_rng(0).integers(0, model.config.vocab_size,
                                                   args.prompt_len).tolist()
        kw = {}
    cfg, be = model.config, model.backend
    if args.method == "ddtree" and not kw:
        ar = generate(model, [prompt], args.tokens + 16)
        future = prompt + ar.tokens[0] + [0] * 16
        kw = dict(method="ddtree", budget=args.budget,
                  drafter=ReplayDrafter(be, cfg.vocab_size, [future], 0.9,
                                        on_device=args.size in DEVICE_SIZES))
    t0 = time.perf_counter()
    generate(model, [prompt], args.tokens, **kw)            # compiles, captures, warms up
    generate(model, [prompt], args.tokens, **kw)
    print(f"# warm-up (compiles) {time.perf_counter() - t0:.1f} s")

    # one decode-shaped forward, eager and replayed from a CUDA graph: host time to enqueue
    # vs time to finish
    graphs = model.graphs
    for label, use in (("eager", None), ("CUDA graph", graphs)):
        if label != "eager" and use is None:
            continue
        model.graphs = use
        cache = model.new_cache(1, 64)
        tok, pos, vis = np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32), causal_mask(1)
        for _ in range(3):                  # the first call compiles, the second captures
            model.forward(ForwardBatch(tok, pos, vis), cache)
        be.synchronize()
        n = 20
        t0 = time.perf_counter()
        for _ in range(n):
            model.forward(ForwardBatch(tok, pos, vis), cache)
        t_enqueue = (time.perf_counter() - t0) / n
        be.synchronize()
        t_all = (time.perf_counter() - t0) / n
        print(f"# one decode forward, {label}: {1e3 * t_enqueue:.3f} ms to enqueue, "
              f"{1e3 * t_all:.3f} ms to finish (mean of {n})")
    model.graphs = graphs

    prof = cProfile.Profile()
    prof.enable()
    res = generate(model, [prompt], args.tokens, **kw)
    prof.disable()
    st = res.stats
    print(f"# profiled generate(): {st.new_tokens} tokens, {st.rounds} rounds, "
          f"{st.tokens_per_s:.1f} tok/s (under cProfile)")
    t0 = time.perf_counter()
    res = generate(model, [prompt], args.tokens, **kw)
    wall = time.perf_counter() - t0
    phases = res.stats.time
    print(f"# the same generate() without the profiler: {1e3 * wall:.1f} ms wall, "
          f"{res.stats.rounds} rounds; device phases (ms): "
          + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in phases.items())
          + f"; wall minus the phases: {1e3 * (wall - sum(phases.values())):.1f} ms")
    if graphs is not None:
        print(f"# CUDA graphs: {graphs.captures} captured, {graphs.replays} replays, "
              f"{graphs.failures} failed captures")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
        text = s.getvalue()
        print(f"\n## by {key}\n" + text[text.find("   ncalls"):])


def _demo_pair(args):
    """(the shipped target, the first held-out prompt at ``--prompt-len`` tokens, generate's
    DDTree keywords with the shipped DFlash drafter, or none for AR)."""
    import json

    from kdtree_numba import demo
    from kdtree_numba.backends import make_backend
    from kdtree_numba.drafter import load_drafter
    from kdtree_numba.model import Model
    from kdtree_numba.text import load_codec
    model = Model.load(demo.TARGET, make_backend(args.backend, gemm=args.gemm))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "heldout_prompts.jsonl")
    with open(path, encoding="utf-8") as f:
        text = json.loads(f.readline())["text"]
    ids = load_codec(demo.TARGET).encode(text)
    prompt = (ids * (args.prompt_len // len(ids) + 1))[:args.prompt_len]
    kw = {}
    if args.method == "ddtree":
        kw = dict(method="ddtree", budget=args.budget,
                  drafter=load_drafter(str(demo.DRAFTER), model))
    return model, prompt, kw


if __name__ == "__main__":
    main()

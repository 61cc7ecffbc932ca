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
~22 ms at budget 16, against ~1 ms of kernels.  ``--repeats N`` profiles N generations (a
prefill's ~2 ms is too short for cProfile's clock alone; the tables then hold N calls' sums).

``--pieces`` then times the engine's pieces on the host clock over N more generations, no
profiler (wrappers of ``time.perf_counter``: ~1 us each): the mean host wall a generation of
the prefill (``engine._prefill``, ``Model.prefill``, the drafter's commit), the wait for the
first tokens (``engine._commit_first``), the device rounds' start, launches and reads, so
what the device waits for between a prefill and the first round reads off directly:

    python3 tools/profile_engine.py --size demo --method ddtree --tokens 2 --budget 16 \
        --repeats 300 --pieces
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
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
    p.add_argument("--repeats", type=int, default=1,
                   help="generations profiled (and timed), each on the same prompt")
    p.add_argument("--pieces", action="store_true",
                   help="then the host wall of the engine's pieces a generation (mean)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")

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

    n = args.repeats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        res = generate(model, [prompt], args.tokens, **kw)
    prof.disable()
    st = res.stats
    print(f"# profiled generate(), {n} call(s): {st.new_tokens} tokens, {st.rounds} rounds, "
          f"{st.tokens_per_s:.1f} tok/s (under cProfile; the last call)")
    phases, t0 = {}, time.perf_counter()
    for _ in range(n):
        res = generate(model, [prompt], args.tokens, **kw)
        for k, v in res.stats.time.items():
            phases[k] = phases.get(k, 0.0) + v / n
    wall = (time.perf_counter() - t0) / n
    print(f"# the same generate() without the profiler (mean of {n}): {1e3 * wall:.2f} ms "
          f"wall, {res.stats.rounds} rounds; device phases (ms): "
          + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in phases.items())
          + f"; wall minus the phases: {1e3 * (wall - sum(phases.values())):.2f} ms")
    if graphs is not None:
        print(f"# CUDA graphs: {graphs.captures} captured, {graphs.replays} replays, "
              f"{graphs.failures} failed captures")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
        text = s.getvalue()
        print(f"\n## by {key}\n" + text[text.find("   ncalls"):])
    if args.pieces:
        _print_pieces(model, prompt, args.tokens, kw, n)


def _pieces(drafter):
    """(owner, attribute, label) of the engine's pieces :func:`_print_pieces` times."""
    from kdtree_numba import engine
    from kdtree_numba.backends import Backend
    from kdtree_numba.device_round import DeviceRounds
    from kdtree_numba.model import Model
    out = [(engine, "_prefill", "engine._prefill: the prompt's forward, choice, commit"),
           (engine, "_commit_first", "engine._commit_first: the first tokens' read waited"),
           (Model, "prefill", "Model.prefill"), (Model, "forward", "Model.forward"),
           (Model, "choose", "Model.choose"), (Model, "device_step", "Model.device_step"),
           (Model, "cache_for_generation", "Model.cache_for_generation"),
           (Backend, "read_later", "Backend.read_later"), (Backend, "asarray", "Backend.asarray"),
           (DeviceRounds, "for_generation", "DeviceRounds.for_generation"),
           (DeviceRounds, "launch", "DeviceRounds.launch"),
           (DeviceRounds, "collect", "DeviceRounds.collect: a launch's read waited")]
    if drafter is not None:
        kind = type(drafter)
        out += [(kind, "start", f"{kind.__name__}.start"),
                (kind, "on_commit", f"{kind.__name__}.on_commit")]
    return out


def _print_pieces(model, prompt, tokens: int, kw: dict, n: int) -> None:
    """The mean host wall a generation of each of :func:`_pieces` (nested pieces overlap:
    ``Model.prefill`` is inside ``engine._prefill``), over ``n`` generations."""
    spent, calls, saved = {}, {}, []

    def timed(owner, name, label):
        real = inspect.getattr_static(owner, name)     # a classmethod as itself
        saved.append((owner, name, real if name in vars(owner) else None))
        inner = real.__func__ if isinstance(real, classmethod) else real

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
                calls[label] = calls.get(label, 0) + 1
        setattr(owner, name, classmethod(wrapper) if isinstance(real, classmethod) else wrapper)
    for owner, name, label in _pieces(kw.get("drafter")):
        timed(owner, name, label)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            generate(model, [prompt], tokens, **kw)
        wall = (time.perf_counter() - t0) / n
    finally:
        for owner, name, real in reversed(saved):
            if real is None:            # inherited: the base's again
                delattr(owner, name)
            else:
                setattr(owner, name, real)
    print(f"\n## the engine's pieces: host wall a generate() (mean of {n}: {1e6 * wall:.0f} us "
          f"in all), calls a generate()")
    for label, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{1e6 * s / n:9.1f} us  {calls[label] / n:6.1f}  {label}")


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

"""Which tensor-core op makes a CUDA-graph replay disagree with the eager run (issue 15).

    python3 tools/probe_graph_tensor_cores.py [--variants linear,moe-dense,moe-routed,moe]
                                              [--budget 32] [--new-tokens 24] [--eager-check]

Each variant is a kimi-slice model (random bf16 weights on the device, tools/bench_engine.py)
on the numba backend with some ops switched to bf16 tensor cores: ``linear`` (every
projection and the lm_head, what ``make_backend(gemm="tensor-cores")`` does), ``moe-dense``
(the dense layer's FFN through ``moe_ffn(method="tensor-cores")``), ``moe-routed`` (the
routed layers' experts), ``moe`` (both), ``all`` (linear and both).  For each, AR then
replay-DDTree at ``--budget``, with CUDA graphs on (``KDTREE_CUDA_GRAPHS=0`` turns them
off): its row says whether DDTree's tokens equal AR's.  Both come from the same model, so
anything but "True" means a replayed forward computed other numbers than the run it
replaced.  Run 49 (docs/GPU_RESULTS.md): linear, moe-dense and moe-routed True; moe False
(also with graphs on and the kernel disk cache off); every variant True without graphs.

``--eager-check`` says which graph is wrong: per variant (``none`` = all on CUDA cores is a
baseline), one model generates AR and replay-DDTree tokens eagerly (``model.graphs = None``)
and then with CUDA graphs, and prints whether each graph run's tokens equal the eager AR's
(and where they first differ).  Not run on a GPU yet.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_engine  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.device_weights import random_model  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402

VARIANTS = ("none", "linear", "moe-dense", "moe-routed", "moe", "all")


def backend_for(variant: str, base: str = "numba"):
    """The ``base`` backend with ``variant``'s ops on tensor cores (``none``: as it is)."""
    be = make_backend(base)
    if variant == "none":
        return be
    if variant in ("linear", "all"):
        be.ops.linear = functools.partial(be.ops.linear, method="tensor-cores")
    dense_on = variant in ("moe-dense", "moe", "all")
    routed_on = variant in ("moe-routed", "moe", "all")
    plain = be.ops.moe_ffn

    def moe_ffn(h, idx, weight, gate_up, down, *rest, **kw):
        on = dense_on if gate_up.shape[0] == 1 else routed_on    # the dense FFN: one expert
        return plain(h, idx, weight, gate_up, down, *rest,
                     method="tensor-cores" if on else "auto", **kw)
    be.ops.moe_ffn = moe_ffn
    be.gemm = f"tensor-cores:{variant}"
    return be


def first_difference(a, b):
    """(request, position) of the first token where two batches of sequences differ, or None."""
    for r, (x, y) in enumerate(zip(a, b)):
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return r, i
        if len(x) != len(y):
            return r, min(len(x), len(y))
    return None


def eager_check(variant: str, size: str, budget: int, new_tokens: int, prompt_len: int,
                base: str = "numba", seed: int = 0) -> dict:
    """AR and replay-DDTree tokens of one model, eagerly and then with its CUDA graphs, each
    compared with the eager AR's: {run: first difference or None} (None everywhere: the
    graphs replay what the eager runs computed)."""
    cfg = bench_engine.DEVICE_SIZES[size]()
    model = random_model(cfg, backend_for(variant, base), seed=seed)
    graphs, model.graphs = model.graphs, None
    prompts = np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, prompt_len)).tolist()

    def ddtree(reference):
        future = [p + t + [0] * (bench_engine.BLOCK_LEN + 2)
                  for p, t in zip(prompts, reference)]
        drafter = bench_engine.ReplayDrafter(model.backend, cfg.vocab_size, future, 0.9,
                                             on_device=model.backend.on_gpu)
        return generate(model, prompts, new_tokens, method="ddtree", drafter=drafter,
                        budget=budget).tokens

    ar_eager = generate(model, prompts, new_tokens).tokens
    out = {"ddtree eager": first_difference(ddtree(ar_eager), ar_eager)}
    if graphs is not None:
        model.graphs = graphs
        generate(model, prompts, new_tokens)           # the keys seen once: captured next
        out["ar graphs"] = first_difference(generate(model, prompts, new_tokens).tokens,
                                            ar_eager)
        ddtree(ar_eager)
        out["ddtree graphs"] = first_difference(ddtree(ar_eager), ar_eager)
    bench_engine.fresh_graphs(model)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="linear,moe-dense,moe-routed,moe")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--time-limit", type=float, default=500.0)
    p.add_argument("--eager-check", action="store_true",
                   help="compare graph runs with eager runs of the same model (no timing)")
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        p.error(f"variants: {', '.join(VARIANTS)}")
    args = argparse.Namespace(seed=0, dtype="bfloat16", prompt_len=None, budgets=[a.budget],
                              batches=[1], new_tokens=a.new_tokens, agreement=0.9,
                              no_replay=False, expert_count="uniform", json=None, gemm=[])
    if a.eager_check:
        for variant in variants:
            found = eager_check(variant, "kimi-slice", a.budget, a.new_tokens,
                                bench_engine.DEVICE_PROMPT_LEN)
            print(f"{variant}: " + "; ".join(
                f"{run} {'= eager AR' if d is None else f'differs at request {d[0]} token {d[1]}'}"
                for run, d in found.items()), flush=True)
        return 0
    budget = bench_engine.Budget(a.time_limit)
    for variant in variants:
        print(f"## {variant}", flush=True)
        bench_engine.bench_device_model("kimi-slice", args, budget, [], backend_for(variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())

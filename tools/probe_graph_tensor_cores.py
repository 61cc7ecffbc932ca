"""Which tensor-core op makes a CUDA-graph replay disagree with the eager run (issue 15).

    python3 tools/probe_graph_tensor_cores.py [--variants linear,moe-dense,moe-routed,moe]
                                              [--budget 32] [--new-tokens 24]

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
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_engine  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402

VARIANTS = ("linear", "moe-dense", "moe-routed", "moe", "all")


def backend_for(variant: str):
    """The numba backend with ``variant``'s ops on tensor cores."""
    be = make_backend("numba")
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS[:4]))
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--time-limit", type=float, default=500.0)
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        p.error(f"variants: {', '.join(VARIANTS)}")
    args = argparse.Namespace(seed=0, dtype="bfloat16", prompt_len=None, budgets=[a.budget],
                              batches=[1], new_tokens=a.new_tokens, agreement=0.9,
                              no_replay=False, expert_count="uniform", json=None, gemm=[])
    budget = bench_engine.Budget(a.time_limit)
    for variant in variants:
        print(f"## {variant}", flush=True)
        bench_engine.bench_device_model("kimi-slice", args, budget, [], backend_for(variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())

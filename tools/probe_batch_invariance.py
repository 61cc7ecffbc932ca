"""Which op makes a token's numbers depend on how many tokens share its forward (issue 15).

    python3 tools/probe_batch_invariance.py [--size kimi-slice] [--gemm cuda-cores,tensor-cores]
                                            [--n 33] [--prefix 128] [--batch 1]
                                            [--tree-nodes 65]

DDTree's tokens equal AR's only if every op gives a token's row the same bits whether it runs
alone (an AR decode, M = 1) or inside a verify of n nodes (M = n): "batch invariance"
(docs/ENGINE.md).  This probe runs one model twice from the same prefill of ``--prefix``
random tokens per request (``--batch`` of them): (A) the next n tokens one decode at a time,
(B) the same n tokens as one chain-shaped verify forward (each token sees the ones before
it) -- or, with ``--tree-nodes``, as the path of a larger tree at scattered node slots, the
way a DDTree verify holds the path it accepts -- against a cache of twice the capacity (DDTree's cache holds the tree too), and records
every op's output (the numba or reference ops of ``backend.ops``, in call order).  For each op call it
prints whether the rows of B equal A's row by row, bit for bit, and the largest difference;
the first call that differs while everything before it agreed is the op to fix.  Forwards run
eagerly but with the split plan CUDA graphs use (the cache's capacity, kdtree_numba/model.py),
so the numbers are the engine's.  ``--gemm`` takes the backend's settings
(``make_backend(gemm=...)``, numba only); ``--size`` is a device size of
tools/bench_engine.py (random bf16 weights) or a bundle size (``small``, ..., float32
weights, any backend).

Why it exists: with the experts on bf16 tensor cores, kimi-slice's DDTree tokens left AR's
after a few rounds (runs 45-49).  It looked like a CUDA-graph bug; this probe (run 51) showed
instead that the float32 GEMMs (skinny up to 16 rows, tiled above) and attention's key splits
(planned by the number of tokens) give a verify's rows other last bits than a decode's, and
rounding the next op's input to bf16 grows those into ~1e-3.  ``gemm="tensor-cores"`` is now
batch invariant end to end (docs/ENGINE.md, "Tensor cores").
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_engine  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_numba.attention import PendingMerge  # noqa: E402
from kdtree_numba.backends import GEMM_CHOICES, make_backend, map_arrays  # noqa: E402
from kdtree_numba.bundle import SIZES, random_weights, size_config  # noqa: E402
from kdtree_numba.device_weights import random_model  # noqa: E402
from kdtree_numba.model import ForwardBatch, Model  # noqa: E402


def build_model(size: str, gemm: str, backend: str, seed: int = 0,
                attention_variant: str | None = None, kv_cache: str = "float32"):
    """A model of ``size`` (module docstring) on ``backend`` with the ``gemm`` setting, its
    attention forced to ``attention_variant`` when given; ``kv_cache``: the latent cache's
    dtype (the on-device sizes only)."""
    be = make_backend(backend, gemm=gemm)
    if attention_variant is not None:      # a tile layout of kdtree_numba/attention/plan.py
        be.ops.mla_attention = functools.partial(be.ops.mla_attention,
                                                 variant=attention_variant)
    if size in bench_engine.DEVICE_SIZES:
        return random_model(bench_engine.DEVICE_SIZES[size](), be, seed=seed,
                            kv_cache=kv_cache,
                            experts=bench_engine.DEVICE_EXPERTS.get(size, "same"))
    return Model(size_config(size), dict(random_weights(size_config(size), seed)), be)


class Recorder:
    """Wraps every op of a backend until :meth:`close`: inside :meth:`run` each call appends
    ``entry(name, fn, args, kwargs, out)``, by default (op name, its outputs as host arrays);
    tools/profile_ops.py keeps the call itself to replay it."""

    def __init__(self, backend, entry=None):
        self.calls = None
        self._host = backend.to_host
        self._entry = entry or self._host_outputs
        self._ops = backend.ops
        self._plain = dict(vars(backend.ops))
        for name, fn in self._plain.items():
            setattr(backend.ops, name, self._wrap(name, fn))

    def close(self) -> None:
        for name, fn in self._plain.items():
            setattr(self._ops, name, fn)

    def _host_outputs(self, name, fn, args, kwargs, out):
        if isinstance(out, PendingMerge):   # KDTREE_MERGE_IN_UV: u as apply_uv merges it
            out = out.materialize()
        leaves = []
        map_arrays(lambda a: leaves.append(np.array(self._host(a))), out,
                   lambda v: hasattr(v, "shape") and hasattr(v, "dtype"))
        return name, leaves

    def _wrap(self, name, fn):
        def recorded(*args, **kwargs):
            out = fn(*args, **kwargs)
            if self.calls is not None:
                self.calls.append(self._entry(name, fn, args, kwargs, out))
            return out
        return recorded

    def run(self, fn):
        self.calls = []
        try:
            fn()
            return self.calls
        finally:
            self.calls = None


@contextlib.contextmanager
def eager_forwards(model):
    """Inside the block the model's forwards run eagerly, never through a CUDA graph, but with
    the graphs' split plan (the cache's capacity), so they give a replay's numbers."""
    graphs = model.graphs
    if graphs is not None:
        graphs.call = lambda *a, **k: None
    try:
        yield
    finally:
        if graphs is not None:
            del graphs.call


def rows(a: np.ndarray, bs: int, n: int):
    """a as [bs, n, -1] when its leading axes hold a forward's bs x n token rows, else None."""
    if a.ndim >= 1 and a.shape[0] == bs * n:
        return a.reshape(bs, n, -1)
    if a.ndim >= 2 and tuple(a.shape[:2]) == (bs, n):
        return a.reshape(bs, n, -1)
    return None


def compare(decodes: list, verify: list, bs: int, n: int, index=None,
            nodes: int | None = None) -> list[dict]:
    """Per op call of the verify forward (``nodes`` rows per request, default n): does the
    row of (request b, token j) -- verify row ``index[j]`` (default j) -- equal decode j's row
    of request b, bit for bit?"""
    size = n if nodes is None else nodes
    index = np.arange(n) if index is None else np.asarray(index)
    report = []
    for i, (name, leaves) in enumerate(verify):
        entry = {"call": i, "op": name, "equal": True, "max_abs": 0.0, "rows_differ": 0,
                 "skipped": False}
        for k, leaf in enumerate(leaves):
            b = rows(leaf, bs, size)
            a = [rows(d[i][1][k], bs, 1) if i < len(d) and d[i][0] == name else None
                 for d in decodes]
            if b is None or any(r is None or r.shape[2] != b.shape[2] for r in a):
                entry["skipped"] = True
                continue
            b = b[:, index]
            a = np.concatenate(a, axis=1)
            differ = [a[r, j].tobytes() != b[r, j].tobytes() for r in range(bs)
                      for j in range(n)]
            if any(differ):
                entry["equal"] = False
                entry["rows_differ"] = max(entry["rows_differ"], int(sum(differ)))
                if np.issubdtype(a.dtype, np.floating):
                    entry["max_abs"] = max(entry["max_abs"], float(np.nanmax(
                        np.abs(a.astype(np.float64) - b.astype(np.float64)))))
        report.append(entry)
    return report


def scattered_tree(n: int, nodes: int, rng):
    """A tree of ``nodes`` nodes holding a path of n nodes (the one a verify accepts, root to
    depth n - 1) at random increasing node indices, the root at 0; every other node is a leaf
    under an earlier path node.  (parents, the path's node indices)."""
    chain = np.sort(rng.choice(np.arange(1, nodes), n - 1, replace=False)) if n > 1 else []
    chain = np.concatenate([[0], chain]).astype(int)
    parents = [-1] * nodes
    for j in range(1, n):
        parents[chain[j]] = int(chain[j - 1])
    on_path = set(chain.tolist())
    for i in range(1, nodes):
        if i not in on_path:
            parents[i] = int(rng.choice(chain[chain < i]))
    return parents, chain


def probe(model, n: int, prefix: int, seed: int = 0, batch: int = 1,
          tree_nodes: int | None = None) -> list[dict]:
    """compare() of n decodes against one verify of the same n tokens, for ``batch`` requests
    of random tokens: a chain of n nodes, or (``tree_nodes`` > n) a tree of that many nodes
    with the n tokens on a path at scattered node slots (scattered_tree), as a DDTree verify
    holds the path it accepts."""
    from reference.attention import tree_visible
    cfg = model.config
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, prefix + n))
    positions = np.tile(np.arange(prefix + n), (batch, 1))
    nodes = n if tree_nodes is None else max(n, int(tree_nodes))
    parents, chain = scattered_tree(n, nodes, rng)     # nodes == n: the chain itself
    tree_tokens = rng.integers(0, cfg.vocab_size, (batch, nodes))
    tree_tokens[:, chain] = tokens[:, prefix:]
    tree_vis = tree_visible(parents)
    tree_pos = prefix + tree_vis.sum(-1) - 1           # depth of each node

    def causal(k):
        return np.broadcast_to(np.tril(np.ones((k, k), bool)), (batch, k, k))
    recorder = Recorder(model.backend)
    try:
        with eager_forwards(model):
            # the verify's cache twice the decodes' capacity, as DDTree's exceeds AR's
            caches = [model.new_cache(batch, k * (prefix + nodes) + 16) for k in (1, 2)]
            for cache in caches:
                model.forward(ForwardBatch(
                    tokens[:, :prefix], positions[:, :prefix], causal(prefix)), cache)
                cache.advance([prefix] * batch)
            decodes = []
            for p in range(prefix, prefix + n):
                decodes.append(recorder.run(lambda: model.forward(ForwardBatch(
                    tokens[:, p:p + 1], positions[:, p:p + 1], causal(1)), caches[0])))
                caches[0].advance([1] * batch)
            verify = recorder.run(lambda: model.forward(ForwardBatch(
                tree_tokens, np.tile(tree_pos, (batch, 1)),
                np.broadcast_to(tree_vis, (batch, nodes, nodes))), caches[1]))
    finally:
        recorder.close()
    if len({len(d) for d in decodes} | {len(verify)}) != 1:
        raise RuntimeError("the decode and verify forwards called different ops: "
                           f"{[len(d) for d in decodes]} vs {len(verify)}")
    return compare(decodes, verify, batch, n, chain, nodes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="kimi-slice",
                   choices=sorted(bench_engine.DEVICE_SIZES) + sorted(SIZES))
    p.add_argument("--gemm", default="cuda-cores",
                   help=f"comma-separated settings, of: {', '.join(GEMM_CHOICES)}")
    p.add_argument("--backend", default="numba")
    p.add_argument("--n", type=int, default=33, help="verify rows (a chain of n tokens)")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="requests, each a chain of n tokens")
    p.add_argument("--attention-variant", default=None,
                   help="attention's tile layout (numba: tf32x3, pipe16x2, ...; default: its own)")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="verify a tree of this many nodes with the n tokens on a scattered "
                        "path (default: a chain of n)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    settings = a.gemm.split(",")
    if any(g not in GEMM_CHOICES for g in settings):
        p.error(f"--gemm: {', '.join(GEMM_CHOICES)}")
    for gemm in settings:
        model = build_model(a.size, gemm, a.backend, a.seed, a.attention_variant)
        report = probe(model, a.n, a.prefix, a.seed, a.batch, a.tree_nodes)
        shape = f"a tree of {a.tree_nodes} nodes" if a.tree_nodes else "a chain"
        print_report(report, f"# {a.size}, {a.backend}, gemm {gemm}, batch {a.batch}: {a.n} "
                             f"decodes vs one verify ({shape}) of them after {a.prefix} "
                             "tokens")
        bench_engine.fresh_graphs(model)
        del model
    return 0


def first_difference(report: list[dict]):
    """The first op call whose rows differ, or None (batch invariant)."""
    return next((e for e in report if not e["equal"]), None)


def print_report(report: list[dict], title: str) -> None:
    print(title)
    print("| call | op | rows equal | rows differing | max abs diff |")
    print("|---|---|---|---|---|")
    first = first_difference(report)
    for e in report:
        state = "skipped" if e["skipped"] and e["equal"] else ("yes" if e["equal"] else "NO")
        print(f"| {e['call']} | {e['op']} | {state} | {e['rows_differ']} | {e['max_abs']:.3g} |")
    print("first op that differs: " + ("none (batch invariant)" if first is None
                                         else f"call {first['call']} ({first['op']})"),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())

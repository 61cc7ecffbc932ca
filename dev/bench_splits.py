"""The bf16 tensor-core linear's K slices at Kimi-K2's shapes: us per call for 1 to 64 slices.

    python3 dev/bench_splits.py [--m 1,33,65] [--shapes q_b,o_proj] [--calls 5]
                                  [--replays 10] [--json PATH]

``mma_splits(N, K)`` (kdtree_numba/layers/mma_plan.py) picks a linear's K slices from its
weight's shape alone (so a row's bits do not depend on M); this sweep is what the rule is
checked against (tests/test_layers_mma.py holds its fastest picks).  Each (shape, M, slices)
runs ``--calls`` linears captured in one CUDA graph (kdtree_numba/graphs.py), replayed
``--replays`` times between CUDA events: its time per call is the GPU's inside a replayed
forward, launches included (the x rounding, the GEMM and the slice sum where the tile does not
add its own slices).  The table marks the rule's pick and the fastest, and sets the
weight-streaming roof (bytes / 4.1 TB/s) beside them.  GPU only (a CUDA device, CuPy).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), ROOT]      # engine_roof, profile_ops, card_roofs

from engine_roof import HBM_BYTES_PER_S  # noqa: E402

from kdtree_numba.layers.mma_plan import SLICE_UNIT, mma_config  # noqa: E402

# (N, K) of the projections a Kimi-K2 layer runs through linear() on tensor cores
SHAPES = {"qkv_a": (2112, 7168), "q_b": (12288, 1536), "o_proj": (7168, 8192),
          "dense_gate_up": (36864, 7168), "dense_down": (7168, 18432)}
SLICES = (1, 2, 4, 8, 16, 32, 64)


def candidates(k: int, pick: int) -> list[int]:
    """Slice counts worth timing: the powers of two up to 64 that leave each slice at least
    one 64-element unit, and the rule's pick."""
    units = -(-k // SLICE_UNIT)
    return sorted({s for s in SLICES if s <= units} | {pick})


def roof_us(n: int, k: int) -> float:
    """Microseconds to stream the bf16 weight once at the HBM roof."""
    return n * k * 2 / HBM_BYTES_PER_S * 1e6


def table_row(name: str, n: int, k: int, m: int, times: dict, pick: int) -> str:
    """One markdown row: the time of each slice count of SLICES (blank where not timed, the
    fastest in bold, the pick starred), then the pick, the fastest, their ratio and the roof."""
    fastest = min(times, key=times.get)
    cells = []
    for s in SLICES:
        if s not in times:
            cells.append("")
            continue
        text = f"{times[s]:.1f}" + ("*" if s == pick else "")
        cells.append(f"**{text}**" if s == fastest else text)
    return (f"| {name} {k} -> {n} | {m} | " + " | ".join(cells)
            + f" | {pick} | {fastest} | {times[pick] / times[fastest]:.2f}x"
            + f" | {roof_us(n, k):.1f} |")


def table_header() -> str:
    cols = " | ".join(str(s) for s in SLICES)
    return (f"| shape | M | {cols} | pick | fastest | pick / fastest | weight roof us |\n"
            + "|---" * (len(SLICES) + 6) + "|")


def sweep(shapes: dict, ms: list[int], calls: int, replays: int, out=print) -> list[dict]:
    """Time every (shape, M, slice count); print the table as it goes; return the rows."""
    import cupy as cp
    from profile_ops import gpu_us

    from kdtree_numba.backends import bf16_bits, make_backend
    from kdtree_numba.graphs import GraphCache

    backend = make_backend("numba", gemm="tensor-cores")
    graphs = GraphCache(backend)
    rng = cp.random.default_rng(0)          # drawn on the device: 264 M weights at most
    rows = []
    out(table_header())
    for name, (n, k) in shapes.items():
        w16 = bf16_bits(cp, rng.standard_normal((n, k), dtype=cp.float32) * 0.02)
        for m in ms:
            x = rng.standard_normal((m, k), dtype=cp.float32)
            y = cp.zeros((m, n), cp.float32)
            base = mma_config(m, n, k)
            times = {}
            for s in candidates(k, base.splits):
                cfg = dataclasses.replace(base, splits=s)
                key = ("splits", name, m, s)

                def body(cfg=cfg):
                    for _ in range(calls):
                        backend.ops.linear(x, w16, out=y, config=cfg)
                for _ in range(2):              # eager, then the capture
                    graphs.call(key, body, [], [])
                times[s] = gpu_us(lambda key=key: graphs.replay(key), replays) / calls
            out(table_row(name, n, k, m, times, base.splits))
            rows.append({"shape": name, "n": n, "k": k, "m": m, "pick": base.splits,
                         "us": {str(s): t for s, t in times.items()},
                         "roof_us": roof_us(n, k)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,33,65", help="comma-separated row counts")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--calls", type=int, default=5, help="linears per captured graph")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    import card_roofs
    print(f"# {card_roofs.describe(card_roofs.apply(sys.modules[__name__]))}")
    rows = sweep(shapes, [int(v) for v in args.m.split(",")], args.calls, args.replays)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

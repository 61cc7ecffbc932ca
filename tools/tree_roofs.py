"""Where a DDTree verify stops paying on a wide MoE: each budget's verify bytes against a decode's.

    python3 tools/tree_roofs.py [--size kimi-k2|kimi-k2-slice|kimi-slice]
                                [--budgets 1,2,4,8,16,32,64] [--tau 8:4.6,32:5.8] [--json PATH]

At batch 1 a decode and a tree verify of ``b + 1`` rows both stream their weights from HBM
(tools/engine_roof.py), and a verify reads more: each MoE layer the **distinct** routed
experts its rows chose, ``E (1 - (1 - k/E)^n)`` for n rows under uniform routing (Kimi-K2, E =
384, k = 8: 8 experts for one token, ~66 for 9 rows, ~192 for 33).  A round commits tau
tokens for one verify (plus a draft), so with the verify at its bytes roof and the draft free
the tree beats AR only while

    tau(b) > verify bytes(b + 1 rows) / decode bytes          (the *break-even tau*)

This prints that ratio per budget, with the distinct experts a layer and the bytes; given
measured ``--tau`` per budget, the best speedup the roofs allow, tau / ratio (a bound: the
draft, the launches and the host are not in it).  Sizes: ``kimi-k2`` (Kimi-K2 as it ships:
61 layers, the first dense, 384 experts int4-group at group 32, the rest bf16),
``kimi-k2-slice`` (its first 4 layers: the bf16 lm_head is then a large share of every
forward, so the slice's ratios are kinder than the model's) or ``kimi-slice`` (64 bf16
experts; a model whose forward is launch-bound, as the demo pair's, has no bytes roof to
speak of).  Real routing is not uniform and a
tree's rows share prefixes, so their experts overlap more than uniform routing says: the
counted experts (engine_roof.RoutingCounter, tools/bench_engine.py's verify rows) are the
measurement; this is the model that says where to look.  No GPU needed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_roof import engine_itemsize, forward_bytes, moe_layers, uniform_distinct  # noqa: E402
from kdtree_numba.device_weights import kimi_k2_slice_config, kimi_slice_config  # noqa: E402

INT4_GROUP32_BYTES = 0.5 + 2 / 32       # packed nibbles and a bf16 scale per 32 weights
SIZES = {
    "kimi-k2": lambda: kimi_k2_slice_config(num_hidden_layers=61),
    "kimi-k2-slice": kimi_k2_slice_config,
    "kimi-slice": kimi_slice_config,
}
EXPERT_BYTES = {"kimi-k2": INT4_GROUP32_BYTES, "kimi-k2-slice": INT4_GROUP32_BYTES}


def breakeven_rows(cfg, budgets, itemsize) -> list[dict]:
    """Per budget b: the verify's rows (b + 1), distinct experts a MoE layer (uniform
    routing), its weight bytes, and those over a decode's (the break-even tau)."""
    decode = forward_bytes(cfg, 1, uniform_distinct(cfg, 1), itemsize)
    rows = []
    for b in budgets:
        n = int(b) + 1
        distinct = uniform_distinct(cfg, n)
        verify = forward_bytes(cfg, n, distinct, itemsize)
        rows.append(dict(budget=int(b), rows=n,
                         experts=distinct[0] if moe_layers(cfg) else 0.0,
                         verify_gb=verify / 1e9, decode_gb=decode / 1e9,
                         breakeven_tau=verify / decode))
    return rows


def parse_tau(text: str | None) -> dict[int, float]:
    """``"8:4.6,32:5.8"`` -> {8: 4.6, 32: 5.8}."""
    out: dict[int, float] = {}
    for item in (text or "").split(","):
        if item.strip():
            b, _, t = item.partition(":")
            try:
                out[int(b)] = float(t)
            except ValueError:
                raise SystemExit(f"tree_roofs: --tau wants BUDGET:TAU pairs, got {item!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="kimi-k2")
    p.add_argument("--budgets", default="1,2,3,4,6,8,16,32,64")
    p.add_argument("--tau", metavar="B:T,...", help="measured tau per budget: adds the bound "
                   "on the speedup, tau / break-even")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"tree_roofs: --budgets wants integers, got {args.budgets!r}")
    if not budgets or min(budgets) < 1:
        raise SystemExit("tree_roofs: --budgets wants integers >= 1")
    taus = parse_tau(args.tau)
    cfg, name = SIZES[args.size](), args.size
    itemsize = engine_itemsize(2, EXPERT_BYTES.get(args.size))
    rows = breakeven_rows(cfg, budgets, itemsize)
    print(f"{name}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} routed experts "
          f"(top {cfg.num_experts_per_tok}); a decode reads {rows[0]['decode_gb']:.2f} GB")
    print("\n| budget | verify rows | distinct experts a layer | verify GB | break-even tau |"
          + (" tau | speedup bound |" if taus else ""))
    print("|---|---|---|---|---|" + ("---|---|" if taus else ""))
    for r in rows:
        line = (f"| {r['budget']} | {r['rows']} | {r['experts']:.1f} | {r['verify_gb']:.2f} | "
                f"{r['breakeven_tau']:.2f} |")
        if taus:
            t = taus.get(r["budget"])
            r["tau"] = t
            r["speedup_bound"] = None if t is None else t / r["breakeven_tau"]
            line += " - | - |" if t is None else f" {t:.2f} | {t / r['breakeven_tau']:.2f}x |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=name, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

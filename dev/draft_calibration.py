"""Is the drafter calibrated for the tree?  (issue 37: the draft temperature)

For DDTree rounds of the demo pair on held-out prompts, every node whose parent lies on the
round's accepted path was *tried*: the target's sample (or argmax) at the parent either is its
token (accepted) or not.  A calibrated drafter's probability q of that node (exp of its lp,
the node's score minus its parent's) equals its acceptance rate.  Prints, per depth and per q
bin, the nodes tried, their mean q and the share accepted; a share below q means the drafter
is overconfident there (a draft temperature t_d > 1 would flatten it), above q underconfident.

    PYTHONPATH=$PWD python3 dev/draft_calibration.py [--temperature 1] [--budget 16]
        [--prompts 8] [--max-new-tokens 64] [--draft-temperature 1]

The CPU's float32 path (kdtree_numba/cpu.py) by default; ``--backend numba`` on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench_demo import PROMPT_FILE, read_prompts  # noqa: E402
from kdtree_numba import demo  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.drafter import load_drafter  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402

BINS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.7, 0.9, 1.0001)


def tried_nodes(rounds) -> np.ndarray:
    """[n, 3]: depth, q, accepted, for every node whose parent was on the accepted path."""
    out = []
    for n_nodes, parent, depth, score, acc in rounds:
        path = set(acc[acc >= 0].tolist())
        for c in range(1, int(n_nodes) + 1):
            p = int(parent[c])
            if p in path:
                q = float(np.exp(score[c] - score[p]))
                out.append((int(depth[c]), q, float(c in path)))
    return np.array(out)


def report(nodes: np.ndarray) -> None:
    print("| depth | tried | mean q | accepted | accepted / q |")
    print("|---|---|---|---|---|")
    for d in sorted(set(nodes[:, 0].astype(int))):
        sel = nodes[nodes[:, 0] == d]
        if len(sel) < 20:
            continue
        q, a = sel[:, 1].mean(), sel[:, 2].mean()
        print(f"| {d} | {len(sel)} | {q:.3f} | {a:.3f} | {a / q:.2f} |")
    print("\n| q bin | tried | mean q | accepted |")
    print("|---|---|---|---|")
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = nodes[(nodes[:, 1] >= lo) & (nodes[:, 1] < hi)]
        if len(sel):
            print(f"| [{lo:.2f}, {min(hi, 1):.2f}) | {len(sel)} | {sel[:, 1].mean():.3f} | "
                  f"{sel[:, 2].mean():.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-temperature", type=float, default=None)
    p.add_argument("--backend", choices=["reference", "numba"], default="reference")
    args = p.parse_args()
    be = make_backend(args.backend, precision="float32" if args.backend == "reference"
                      else "float64")
    model = Model.load(str(demo.TARGET), be)
    drafter = load_drafter(demo.DEFAULT_DRAFTER, model, 15, 0)
    prompts = read_prompts(PROMPT_FILE, args.prompts, load_codec(str(demo.TARGET)))
    rounds = []

    def keep(tree, acc_idx, acc_len):          # request 0, copied to the host
        h = be.to_host
        rounds.append((int(h(tree.n_nodes)[0]), h(tree.parent)[0], h(tree.depth)[0],
                       h(tree.score)[0], h(acc_idx)[0]))
    taus = []
    for rec in prompts:
        res = generate(model, [rec["ids"]], args.max_new_tokens, method="ddtree",
                       drafter=drafter, budget=args.budget, temperature=args.temperature,
                       seed=0, on_round=keep, draft_temperature=args.draft_temperature)
        taus.append(res.stats.mean_tau)
    print(f"T = {args.temperature:g}, budget {args.budget}, t_d "
          f"{args.draft_temperature or 'default'}, {len(prompts)} prompts x "
          f"{args.max_new_tokens}: {len(rounds)} rounds, tau {np.mean(taus):.2f}\n")
    report(tried_nodes(rounds))


if __name__ == "__main__":
    main()

"""Would a prompt-lookup path in the drafter's marginals raise DDTree's tau?  (issue 36)

The demo target's greedy code repeats itself (parameter lists, docstring sections, similar
lines): the continuation of the longest earlier match of the context's last n tokens (prompt
lookup) is often right for several tokens.  This mixes that path into the DFlash drafter's
per-depth distributions, p'_d = (1 - w) p_d + w [token = lookup_d], so the tree builder (its
contract unchanged) spends nodes on the lookup path where the drafter does not already, and
measures tau (exact at T = 0: every row gives AR's tokens) against the plain drafter.

    PYTHONPATH=$PWD python3 dev/lookup_mix.py [--prompts 16] [--budgets 16,32]
        [--weights 0.3,0.5,0.8] [--max-ngram 8] [--min-ngram 2]

The CPU's float32 path; a host lookup (the experiment's, not a device drafter).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

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
from reference.ddtree import lookup_path  # noqa: E402


def lookup(seq: list[int], L: int, max_n: int, min_n: int) -> list[int]:
    """The lookup path after seq's last token (reference.ddtree.lookup_path), unpadded."""
    path = lookup_path(np.array([seq], np.int32), np.array([len(seq) - 1], np.int32), L,
                       max_n, min_n)[0]
    return path[path >= 0].tolist()


class LookupMix:
    """The DFlash drafter with the lookup path mixed into its marginals (module docstring)."""

    def __init__(self, inner, weight: float, max_n: int, min_n: int):
        self.inner, self.w, self.max_n, self.min_n = inner, weight, max_n, min_n
        self.name, self.block_len = "lookup-mix", inner.block_len
        self.needs = dataclasses.replace(inner.needs, tokens=True)
        self.hist: list[list[int]] = []
        self.hits = self.rounds = 0

    @property
    def vocab_size(self):
        return self.inner.vocab_size

    def start(self, batch, max_len):
        self.inner.start(batch, max_len)
        self.hist = [[] for _ in range(batch)]

    def on_commit(self, commit):
        self.inner.on_commit(commit)
        toks, counts = np.asarray(commit.tokens), np.asarray(commit.counts_host)
        for b, h in enumerate(self.hist):
            h.extend(toks[b, :counts[b]].tolist())

    def propose(self, ctx):
        logits = np.array(self.inner.propose(ctx), np.float64)
        roots = np.asarray(ctx.roots)
        for b, h in enumerate(self.hist):
            path = lookup(h + [int(roots[b])], logits.shape[1], self.max_n, self.min_n)
            self.rounds += 1
            self.hits += bool(path)
            for d, t in enumerate(path):
                row = logits[b, d]
                p = np.exp(row - row.max())
                p *= (1 - self.w) / p.sum()
                p[t] += self.w
                logits[b, d] = np.log(np.maximum(p, 1e-30))
        return logits.astype(np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32")
    p.add_argument("--weights", default="0.3,0.5,0.8")
    p.add_argument("--max-ngram", type=int, default=8)
    p.add_argument("--min-ngram", type=int, default=2)
    args = p.parse_args()
    be = make_backend("reference", precision="float32")
    model = Model.load(str(demo.TARGET), be)
    dflash = load_drafter(demo.DEFAULT_DRAFTER, model, 15, 0)
    prompts = read_prompts(PROMPT_FILE, args.prompts, load_codec(str(demo.TARGET)))
    ids = [rec["ids"] for rec in prompts]
    ar = generate(model, ids, args.max_new_tokens).tokens
    print(f"{len(ids)} prompts x {args.max_new_tokens} tokens, T = 0\n")
    print("| drafter | budget | tau | rounds | lookup hits | = AR | s |")
    print("|---|---|---|---|---|---|---|")
    rows = [("chain", "chain", 0.0)] + [("ddtree", b, w) for b in args.budgets.split(",")
                                         for w in [0.0] + [float(x) for x in
                                                            args.weights.split(",")]]
    for method, budget, w in rows:
        drafter = dflash if w == 0 else LookupMix(dflash, w, args.max_ngram, args.min_ngram)
        t0, taus, rounds, same = time.time(), [], 0, 0
        for rec, want in zip(ids, ar):
            res = generate(model, [rec], args.max_new_tokens, method=method, drafter=drafter,
                           budget=16 if method == "chain" else int(budget))
            taus.append(res.stats.mean_tau)
            rounds += res.stats.rounds
            same += res.tokens[0] == want
        name = "DFlash" if w == 0 else f"DFlash + lookup w {w:g}"
        hits = f"{drafter.hits / max(1, drafter.rounds):.0%}" if w else "-"
        print(f"| {name} | {budget} | {np.mean(taus):.2f} | {rounds} | {hits} | "
              f"{same}/{len(ids)} | {time.time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()

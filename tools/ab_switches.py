"""Interleaved A/B of runtime switches on one pair, in one process: which variant is faster.

    python3 tools/ab_switches.py --variants "base;no-epilogue=KDTREE_ROUND_EPILOGUE=0" \
        [--budgets 0,16] [--prompts 16] [--repeats 2] [--max-new-tokens 128] [--json PATH]

A switch that changes no token (docs/ENGINE.md's per-call switches: kdtree_numba/runtime.py
reads them at each ``generate`` call) is best timed against the default on the same prompts,
in the same process, one after the other: two ``bench_demo`` runs land on a lent machine's
changing load and host and each pays its own warm-up.  Here every prompt runs under every
variant in turn (the order rotated from prompt to prompt), after one untimed pass of each
variant over every prompt, twice (compiles; a CUDA graph is captured on its key's second
call, and a prompt alone in its cache bucket is that key's only call of a pass; ``--budget
auto``'s policy left as warmed), ``--repeats`` times (every variant's graphs are its own
and the graph cache holds a limited number per kind, prefills 16: a row that captured
inside its timed runs is flagged, its time not comparable; time fewer variants at once); a
variant's tokens/s is its timed tokens over its summed wall time (prefill included, as
bench_demo's), and every variant must give the first variant's tokens (a switch that
changed one is reported, not averaged away).  Beside each rate against the first variant,
its spread: the lowest and highest of the passes' own rates (each pass every prompt once),
and on how many prompts the variant's summed time was below the first variant's (a paired
count: a gain that holds on most prompts, or one that a few outliers made).

``--variants``: ``;``-separated ``name[=VAR=VALUE[,VAR=VALUE...]]`` (a bare name: the
environment as it is); ``--budgets``: 0 is AR, other values DDTree budgets (``auto``
allowed).  Runs on the numba backend (a GPU, or the simulator for a check of the tool).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kdtree_numba import compat  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402
from bench_layers import environment  # noqa: E402
from round_timeline import pair_arguments  # noqa: E402


WARM_PASSES = 2


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``name[=VAR=VALUE[,VAR=VALUE...]]`` items, ``;``-separated -> [(name, {VAR: VALUE})];
    SystemExit naming the item that is not of that form."""
    out = []
    for item in (t.strip() for t in text.split(";") if t.strip()):
        name, _, rest = item.partition("=")
        env = {}
        for pair in (p for p in rest.split(",") if p):
            var, eq, value = pair.partition("=")
            if not eq or not var.startswith(("KDTREE_", "NUMBA_")):
                sys.exit(f"ab_switches: {item!r}: expected NAME=VAR=VALUE[,VAR=VALUE], VAR "
                         f"a KDTREE_ or NUMBA_ variable")
            env[var] = value
        if not name or name in (n for n, _ in out):
            sys.exit(f"ab_switches: {item!r}: every variant needs a name of its own")
        out.append((name, env))
    if len(out) < 2:
        sys.exit("ab_switches: give at least two variants")
    return out


def run_ab(model, drafter, prompts, variants, budgets, tokens: int, repeats: int,
           sync=lambda: None, clock=time.perf_counter) -> list[dict]:
    """The interleaved passes (module docstring); one row per (budget, variant): tokens,
    seconds, tok/s, speed against the first variant, ``same_tokens`` (every timed run
    gave the first variant's tokens on its prompt), and the rounds a prompt took and ran past
    its end (``stats.rounds_dropped``; AR's launches of K steps count as rounds); the spread:
    ``vs_first_passes`` (each pass's rate against the first variant's in that pass) and
    ``faster_prompts`` (the prompts on which its summed time was below the first variant's)."""
    rows = []
    for budget in budgets:
        kw = dict(method="ar") if budget == 0 else dict(
            method="ddtree", drafter=drafter, budget=budget)
        for name, values in variants:                      # untimed: compiles, captures
            with environment(**values):
                for _ in range(WARM_PASSES):
                    for ids in prompts:
                        generate(model, [ids], tokens, **kw)
        spent = {name: dict(tokens=0, seconds=0.0, captures=0, rounds=0, dropped=0)
                 for name, _ in variants}
        outputs: dict = {}                  # (variant, prompt) -> every timed run's tokens
        by_pass: dict = {}                  # (variant, pass) -> [tokens, seconds]
        by_prompt: dict = {}                # (variant, prompt) -> seconds
        for rep in range(repeats):
            for i, ids in enumerate(prompts):
                turn = (i + rep) % len(variants)
                for name, values in variants[turn:] + variants[:turn]:
                    with environment(**values):
                        sync()
                        t0 = clock()
                        res = generate(model, [ids], tokens, **kw)
                        sync()
                        seconds = clock() - t0
                    out = [int(t) for t in res.tokens[0]]
                    outputs.setdefault((name, i), []).append(out)
                    got = spent[name]
                    got["tokens"] += len(out)
                    got["seconds"] += seconds
                    got["captures"] += res.stats.graph_captures or 0
                    got["rounds"] += res.stats.rounds
                    got["dropped"] += res.stats.rounds_dropped
                    part = by_pass.setdefault((name, rep), [0, 0.0])
                    part[0], part[1] = part[0] + len(out), part[1] + seconds
                    by_prompt[(name, i)] = by_prompt.get((name, i), 0.0) + seconds
        first = variants[0][0]
        base, runs = spent[first], repeats * len(prompts)

        def rate(name, rep):
            n, seconds = by_pass[(name, rep)]
            return n / seconds
        for name, _ in variants:
            n, seconds = spent[name]["tokens"], spent[name]["seconds"]
            same = all(out == outputs[(first, i)][0]
                       for i in range(len(prompts)) for out in outputs[(name, i)])
            rows.append(dict(budget=budget if budget != 0 else "ar", variant=name,
                             tokens=n, seconds=seconds, tok_s=n / seconds,
                             vs_first=(n / seconds) / (base["tokens"] / base["seconds"]),
                             same_tokens=same, timed_captures=spent[name]["captures"],
                             rounds_per_prompt=spent[name]["rounds"] / runs,
                             dropped_per_prompt=spent[name]["dropped"] / runs,
                             vs_first_passes=[rate(name, rep) / rate(first, rep)
                                              for rep in range(repeats)],
                             faster_prompts=None if name == first else sum(
                                 by_prompt[(name, i)] < by_prompt[(first, i)]
                                 for i in range(len(prompts)))))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(p, prompts=16, tokens=128)
    p.set_defaults(budgets="0,16")
    p.add_argument("--variants", required=True,
                   help="';'-separated name[=VAR=VALUE[,VAR=VALUE...]] (module docstring)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    budgets = [b if b == "auto" else int(b) for b in args.budgets.split(",")]
    from bench_demo import make_drafter, read_prompts
    backend = make_backend("numba")
    model = Model.load(args.model, backend)
    codec = load_codec(args.model)
    prompts = [r["ids"] for r in read_prompts(args.prompt_file, args.prompts, codec)]
    drafter = make_drafter(args.drafter, model, 15, 0) if any(budgets) else None
    rows = run_ab(model, drafter, prompts, variants, budgets, args.max_new_tokens,
                  args.repeats, sync=backend.synchronize)
    card = "simulator" if compat.SIMULATOR else \
        backend.xp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"ab_switches on {card}: {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{args.repeats} interleaved passes, end to end (prefill included)\n")
    print("| budget | variant | tokens | s | tok/s | vs first | its passes | faster on | same "
          "tokens | rounds a prompt (run past its end) | graph captures while timed |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        passes = r["vs_first_passes"]
        faster = "-" if r["faster_prompts"] is None else f"{r['faster_prompts']}/{len(prompts)}"
        print(f"| {r['budget']} | {r['variant']} | {r['tokens']} | {r['seconds']:.3f} | "
              f"{r['tok_s']:.1f} | {r['vs_first']:.3f}x | {min(passes):.3f}-{max(passes):.3f}x | "
              f"{faster} | {'yes' if r['same_tokens'] else 'NO'} | "
              f"{r['rounds_per_prompt']:.1f} ({r['dropped_per_prompt']:.2f}) | "
              f"{r['timed_captures']} |")
    if any(r["timed_captures"] for r in rows):
        print("\nab_switches: CUDA graphs were captured inside the timed runs (each variant keeps "
              "graphs of its own and the graph cache evicts past its limits per kind: "
              "kdtree_numba/graphs.py): those rows are not comparable; time fewer variants "
              "or prompts at a time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(card=card, variants=variants, rows=rows), f, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

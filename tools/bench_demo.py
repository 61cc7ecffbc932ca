"""The demo pair's measurement (issue 14, "Measure"): AR, chain and DDTree on held-out code.

    python3 tools/bench_demo.py [--prompts N] [--max-new-tokens 128] [--backend auto]
        [--precision float32]
        [--drafter SPEC] [--budgets 8,16,32,64,128] [--temperature 0,1] [--seed 0]
        [--model BUNDLE] [--prompt-file tools/data/heldout_prompts.jsonl]
        [--agreement-stride 1] [--time-limit S] [--interleave] [--[no-]warmup] [--json PATH]
        [--plot PATH.png]

Target: ``--model`` (default the shipped demo target, kdtree_numba/demo), on ``--backend``; the
reference backend runs its float32 CPU path (kdtree_numba/cpu.py) unless ``--precision
float64``.  Prompts: the first
``--prompts`` held-out prompts (default all 128 on a GPU, 16 on the CPU), each encoded as
``[bos] + encode(text)`` (docs/DEMO.md, "Prompt set").  Drafter (``--drafter``, default
``kdtree_numba.demo.DEFAULT_DRAFTER``): a DFlash drafter bundle (tools/train_drafter.py), any
drafter bundle ``kdtree-run`` takes, ``oracle:A`` (NoisyOracleDrafter: the target's own greedy
future at agreement A, for the harness; it runs the target L times a round, so its speed
means nothing), or ``random-dflash[:SEED]`` (an untrained DFlash drafter for this target, made
in memory: tau ~ 1, the cost of drafting and verifying without the gain).

For each temperature, batch 1, every prompt: AR, then the chain (the drafter's greedy chain,
L nodes), then DDTree at each budget.  A row is one method over all prompts: mean tau over all
rounds (tokens committed per round: accepted nodes + the bonus; AR: 1), tokens/s = all new
tokens over all ``generate`` seconds (prefill included, as ``GenerationStats``), speedup =
that over AR's at the same temperature, rounds per prompt, ms per round in the draft and the
verify phases, and how many prompts gave exactly AR's tokens.  At T = 0 every method must give
AR's tokens (losslessness): a prompt that does not is a MISMATCH line on stderr, a MISMATCH
cell in the table, and exit status 1 (after the table and the JSON are written).  At T > 0
the engine draws each position's token with the same uniform for every method, so the tokens
agree too, up to a float rounding flipping a draw (~1e-7 a token); counted, not fatal.

The goal columns (DDTree rows; the issue judges them at T = 0): tau >= 5 at budget 32; tau
>= 1.25x the chain's; tokens/s >= 2.5x AR on the numba backend, 2x on the reference backend.

Drafter agreement (second table): the drafter's top-1 agreement with the target's greedy
continuation per block position, measured offline from the T = 0 AR continuation c_1..c_N of
every prompt.  For each anchor j (every ``--agreement-stride``-th of 1..N-1) the drafter gets
the verified prefix, prompt + c_1..c_j with root c_j (a DFlash drafter: the target's features
of prompt + c_1..c_{j-1} as its context, from one capturing prefill of the whole sequence; a
history drafter: the sequence itself), proposes [L, V], and row d's argmax is compared with
c_{j+d}.  ``chain tau`` is the mean of 1 + the leading matches over anchors with all L
depths known: what the chain would commit per round from those anchors.

Timing: on a GPU each configuration runs once on the first prompt before it is timed (numba
compiles each kernel on its first call and the CUDA graphs capture on the second; ``auto``
first runs every candidate budget of ``AutoBudget`` that way;
``--no-warmup`` skips it, ``--warmup`` forces it on the CPU).  ``--time-limit`` (seconds, 0:
none) skips a configuration that would not fit, judged by the last one's time; SIGTERM and
SIGINT stop after the current prompt; either way the table holds what was measured.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

# before numba is imported: its occupancy warnings would bury the table
os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")

import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from kdtree_numba import compat, demo, plots  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.budget import AutoBudget  # noqa: E402
from kdtree_numba.bundle import (DFLASH_BLOCK_SIZE, DFlashSpec, default_target_layer_ids,  # noqa: E402
                                 dflash_config, dflash_shapes, random_weights)
from kdtree_numba.dflash import DFlashDrafter  # noqa: E402
from kdtree_numba.drafter import NoisyOracleDrafter, load_drafter, parse_oracle_spec  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402

PROMPT_FILE = os.path.join(ROOT, "tools", "data", "heldout_prompts.jsonl")
TAU_GOAL, TAU_GOAL_BUDGET, CHAIN_GOAL = 5.0, 32, 1.25
SPEED_GOAL = {"numba": 2.5, "reference": 2.0}
ORACLE_BLOCK_LEN = DFLASH_BLOCK_SIZE - 1     # the DFlash drafter's depth, so trees compare


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _budgets(text: str) -> list:
    """Integers and ``auto`` (kdtree_numba/budget.py: each round's budget measured and chosen)."""
    return ["auto" if x.strip().lower() == "auto" else int(x) for x in text.split(",")
            if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=None,
                   help="the first N held-out prompts (default: 128 on a GPU, 16 on the CPU)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--backend", choices=["auto", "reference", "numba"], default="auto")
    p.add_argument("--precision", choices=["float32", "float64"], default="float32",
                   help="the reference backend's: float32 is the CPU path (kdtree_numba/cpu.py), "
                   "float64 the exact reference")
    p.add_argument("--drafter", default=demo.DEFAULT_DRAFTER,
                   help="a drafter bundle (DFlash), oracle:A, or random-dflash[:SEED]")
    p.add_argument("--block-len", type=int, default=ORACLE_BLOCK_LEN,
                   help="depth of an oracle or model drafter (a DFlash bundle has its own)")
    p.add_argument("--budgets", type=_budgets, default=[8, 16, 32, 64, 128],
                   help="DDTree budgets, comma-separated; 'auto' adds a row of --budget auto")
    p.add_argument("--temperature", type=_floats, default=[0.0, 1.0],
                   help="temperatures, comma-separated")
    p.add_argument("--seed", type=int, default=0, help="sampling and oracle seed")
    p.add_argument("--model", default=str(demo.TARGET), help="target bundle")
    p.add_argument("--prompt-file", default=PROMPT_FILE,
                   help="JSON lines with a 'text' field (docs/DEMO.md, 'Prompt set')")
    p.add_argument("--agreement-stride", type=int, default=1,
                   help="measure the drafter's agreement at every S-th anchor (0: not at all)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds for the whole run; 0: no limit")
    p.add_argument("--interleave", action="store_true",
                   help="run every configuration on each prompt in turn (a shared machine's "
                   "changing load then weighs on every row alike) instead of one "
                   "configuration over all prompts at a time")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run each configuration once before timing it (default: on a GPU)")
    p.add_argument("--json", metavar="PATH", help="write everything measured as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="tau and speedup against the budget")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or (args.prompts is not None and args.prompts < 1):
        p.error("--prompts and --max-new-tokens must be >= 1")
    if not args.budgets or min((b for b in args.budgets if b != "auto"), default=1) < 1:
        p.error("--budgets: one or more integers >= 1 or auto")
    if not args.temperature or min(args.temperature) < 0:
        p.error("--temperature: one or more numbers >= 0")
    if args.plot:
        try:
            plots.require_matplotlib()
        except ImportError:
            p.error(f"--plot needs matplotlib: {plots.PLOT_EXTRA_HINT}")
    return args


# ----------------------------------------------------------------------------- inputs

def read_prompts(path: str, n: int, codec) -> list[dict]:
    """The first ``n`` prompts of ``path``, each with its ``ids`` (``[bos] + encode(text)``)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and len(out) < n:
                rec = json.loads(line)
                rec["ids"] = codec.encode(rec["text"])
                if "n_tokens" in rec and rec["n_tokens"] != len(rec["ids"]):
                    print(f"bench_demo: warning: prompt {rec.get('id')} encodes to "
                          f"{len(rec['ids'])} tokens, the file says {rec['n_tokens']}",
                          file=sys.stderr)
                out.append(rec)
    return out


def random_dflash(model: Model, seed: int) -> DFlashDrafter:
    """An untrained DFlash drafter for ``model`` (the shape tools/train_drafter.py trains:
    dflash_config, features of default_target_layer_ids, B = 8), in memory."""
    cfg = model.config
    draft = dflash_config(cfg)
    ids = default_target_layer_ids(cfg.num_hidden_layers)
    weights = dict(random_weights(draft, seed, dflash_shapes(draft, len(ids))))
    spec = DFlashSpec(ids, DFLASH_BLOCK_SIZE, cfg.hidden_size, cfg.vocab_size,
                      cfg.num_hidden_layers)
    return DFlashDrafter(model, draft, weights, spec, name=f"random-dflash:{seed}")


def make_drafter(spec: str, model: Model, block_len: int, seed: int):
    if spec == "random-dflash" or spec.startswith("random-dflash:"):
        return random_dflash(model, int(spec.partition(":")[2] or 0))
    agreement = parse_oracle_spec(spec)
    if agreement is not None:
        return NoisyOracleDrafter(model, block_len, agreement, seed)
    return load_drafter(spec, model, block_len, seed)


# ----------------------------------------------------------------------------- measuring

class Stop:
    """SIGTERM/SIGINT and --time-limit: stop cleanly, keep what was measured."""

    def __init__(self, limit: float):
        self.t0, self.limit, self.signalled, self.skipped = time.perf_counter(), limit, False, []
        self.previous = {sig: signal.signal(sig, self._on_signal)
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self) -> None:
        """Give the signals back (main() may run inside another program, e.g. a test)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.signalled = True

    def allows(self, name: str, estimate: float) -> bool:
        spent = time.perf_counter() - self.t0
        if self.signalled or (self.limit and spent + estimate > self.limit):
            self.skipped.append(name)
            return False
        return True


def run_config(model, drafter, prompts, method, budget, temperature, args, warmup,
               stop: Stop | None = None) -> list[dict]:
    """Every prompt through one configuration: one record per prompt (stops early after a
    signal)."""
    kw = dict(method=method, drafter=drafter if method != "ar" else None,
              budget=budget or 32, temperature=temperature, seed=args.seed)
    if warmup:
        # auto visits the candidates its measurements lead it to, so its own warm-up can
        # miss some, whose first round then compiles inside the timed run (run 90 on the
        # H200: 7.3 of auto's 9.5 s in one prompt's tree build); each one runs first
        for b in AutoBudget().candidates if budget == "auto" else ():
            generate(model, [prompts[0]["ids"]], args.max_new_tokens, **dict(kw, budget=b))
        generate(model, [prompts[0]["ids"]], args.max_new_tokens, **kw)
    out = []
    for rec in prompts:
        res = generate(model, [rec["ids"]], args.max_new_tokens, **kw)
        s = res.stats
        out.append(dict(id=rec.get("id"), tokens=res.tokens[0], seconds=s.seconds,
                        new_tokens=s.new_tokens, rounds=s.rounds,
                        tau=[a for r in s.tau for a in r], time=dict(s.time)))
        if stop is not None and stop.signalled:
            break
    return out


def interleaved(model, drafter, prompts, configs, t, args, warmup, stop: Stop, runs) -> list:
    """``--interleave``: prompt by prompt, every configuration in turn, so that a load that
    changes during the run (a shared machine) weighs on every row alike.  Stops after the
    prompt in flight at a signal (``--time-limit`` is not applied)."""
    for i, rec in enumerate(prompts):
        for method, budget in configs:
            got = run_config(model, drafter, [rec], method, budget, t, args, warmup and i == 0)
            runs.setdefault((method, budget, t), []).extend(got)
        if stop.signalled:
            break
    rows = []
    for method, budget in configs:
        got = runs[(method, budget, t)]
        row = summarise(method, budget, t, got, runs.get(("ar", None, t), []))
        rows.append(row)
        name = f"{method}{'' if budget is None else f' B={budget}'} T={t:g}"
        print(f"  {name}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s "
              f"({row['speedup']:.2f}x AR), identical {row['identical']}/{row['compared']}",
              file=sys.stderr)
    return rows


def summarise(method, budget, temperature, runs, ar_runs) -> dict:
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["new_tokens"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    taus = [a for r in runs for a in r["tau"]]
    ar_by_id = {r["id"]: r for r in ar_runs}
    diffs = []
    for r in runs:
        want = ar_by_id[r["id"]]["tokens"] if r["id"] in ar_by_id else None
        if want is not None and r["tokens"] != want:
            first = next((i for i, (a, b) in enumerate(zip(r["tokens"], want)) if a != b),
                         min(len(r["tokens"]), len(want)))
            diffs.append(dict(id=r["id"], first=first))
    compared = sum(1 for r in runs if r["id"] in ar_by_id)
    split = {k: sum(r["time"][k] for r in runs) for k in runs[0]["time"]}
    tps = tokens / seconds if seconds > 0 else 0.0
    ar_tps = (sum(r["new_tokens"] for r in ar_runs) /
              max(sum(r["seconds"] for r in ar_runs), 1e-12)) if ar_runs else 0.0
    return dict(method=method, budget=budget, temperature=temperature, prompts=len(runs),
                tau=float(np.mean(taus)) if taus else 1.0, tokens_per_s=tps,
                speedup=tps / ar_tps if ar_tps else float("nan"),
                rounds_per_prompt=rounds / len(runs), seconds=seconds, new_tokens=tokens,
                draft_ms_per_round=1e3 * split.get("draft", 0.0) / max(rounds, 1),
                verify_ms_per_round=1e3 * (split.get("verify", 0.0) + split.get("decode", 0.0))
                / max(rounds, 1),
                identical=compared - len(diffs), compared=compared, mismatches=diffs,
                time=split)


def drafter_agreement(model, drafter, prompts, continuations, stride: int) -> dict | None:
    """Top-1 agreement of the drafter's rows with the target's greedy continuation, per
    depth (module docstring).  None for a drafter that needs the target's hidden state."""
    if getattr(drafter, "needs_target_hidden", False):
        return None
    be, L = model.backend, drafter.block_len
    hits, counts, chain = np.zeros(L), np.zeros(L), []
    features = getattr(drafter, "feature_layers", None)
    for rec, cont in zip(prompts, continuations):
        seq = np.asarray(list(rec["ids"]) + list(cont), np.int64)
        P, N = len(rec["ids"]), len(cont)
        anchors = list(range(1, N, stride))
        if not anchors:
            continue
        drafter.start(1, P + N + L + 2)
        if features:
            cache = model.new_cache(1, P + N + 1)
            feats = model.prefill(cache, [seq[:P + N - 1]], capture_layers=features)[-1]
            have = 0
        for j in anchors:
            root = P + j - 1                      # c_j's position; c_{j+d} is seq[root + d]
            if features:
                drafter.extend_context(feats[:, have:root], root - have)
                have = root
                logits = drafter.propose(np.array([seq[root]], np.int32))
            else:
                logits = drafter.propose([seq[:root + 1]])
            top = np.asarray(be.to_host(logits))[0].argmax(axis=-1)
            known = min(L, N - j)
            ok = top[:known] == seq[root + 1:root + 1 + known]
            hits[:known] += ok
            counts[:known] += 1
            if known == L:
                chain.append(1 + (int(np.argmin(ok)) if not ok.all() else L))
    top1 = [float(h / c) if c else None for h, c in zip(hits, counts)]
    return dict(top1=top1, anchors=[int(c) for c in counts],
                chain_tau=float(np.mean(chain)) if chain else None, stride=stride)


# ----------------------------------------------------------------------------- reporting

def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def table(rows: list[dict], backend: str) -> str:
    goal = SPEED_GOAL.get(backend, 2.0)
    head = ["method", "budget", "T", "tau", "tokens/s", "speedup vs AR", "rounds/prompt",
            "ms/round draft / verify", "identical to AR", f"tau >= {TAU_GOAL:g} at B "
            f"{TAU_GOAL_BUDGET}", f"tau >= {CHAIN_GOAL}x chain", f"tok/s >= {goal:g}x AR"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        chain = next((c for c in rows if c["method"] == "chain"
                      and c["temperature"] == r["temperature"]), None)
        same = f"{r['identical']}/{r['compared']}"
        if r["identical"] != r["compared"]:
            same = f"**MISMATCH** {same}" if r["temperature"] == 0 else f"{same} (T > 0)"
        g1 = g2 = g3 = ""
        if r["method"] == "ddtree":
            if r["budget"] == TAU_GOAL_BUDGET:
                g1 = f"{_yes(r['tau'] >= TAU_GOAL)} ({r['tau']:.2f})"
            if chain:
                ratio = r["tau"] / chain["tau"]
                g2 = f"{_yes(ratio >= CHAIN_GOAL)} ({ratio:.2f}x)"
            g3 = f"{_yes(r['speedup'] >= goal)} ({r['speedup']:.2f}x)"
        split = "-" if r["method"] == "ar" else \
            f"{r['draft_ms_per_round']:.1f} / {r['verify_ms_per_round']:.1f}"
        cells = [r["method"], str(r["budget"] or "-"), f"{r['temperature']:g}",
                 f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                 f"{r['rounds_per_prompt']:.1f}", split, same, g1, g2, g3]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement_table(agree: dict | None, drafter_name: str) -> str:
    if agree is None:
        return f"drafter {drafter_name}: agreement not measured (a drafter that needs the " \
               f"target's hidden state, or --agreement-stride 0)"
    depths = range(1, len(agree["top1"]) + 1)
    lines = ["| drafter | " + " | ".join(f"top-1 d{d}" for d in depths) + " | chain tau |",
             "|" + "---|" * (len(agree["top1"]) + 2)]
    cells = [f"{t:.3f}" if t is not None else "-" for t in agree["top1"]]
    chain = f"{agree['chain_tau']:.2f}" if agree["chain_tau"] is not None else "-"
    lines.append(f"| {drafter_name} | " + " | ".join(cells) + f" | {chain} |")
    every = "every position" if agree["stride"] == 1 else \
        f"every {agree['stride']}th position"
    lines.append(f"\n(anchors per depth: {agree['anchors']}; {every} of the T = 0 AR "
                 f"continuations)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    name = args.backend if args.backend != "auto" else \
        ("numba" if compat.gpu_available() else "reference")
    model = Model.load(args.model, make_backend(
        name, precision=args.precision if name == "reference" else "float64"))
    be = model.backend
    codec = load_codec(args.model)
    if codec is None:
        sys.exit(f"bench_demo: {args.model} has no tokenizer; the held-out prompts are text")
    n = args.prompts or (128 if be.on_gpu else 16)
    prompts = read_prompts(args.prompt_file, n, codec)
    limit = model.config.max_position_embeddings
    too_long = [r.get("id") for r in prompts if len(r["ids"]) + args.max_new_tokens > limit]
    if too_long:
        sys.exit(f"bench_demo: prompts {too_long} + --max-new-tokens {args.max_new_tokens} "
                 f"exceed the model's context of {limit}")
    drafter = make_drafter(args.drafter, model, args.block_len, args.seed)
    warmup = be.on_gpu if args.warmup is None else args.warmup
    stop = Stop(args.time_limit)
    try:
        return measure(args, model, drafter, prompts, warmup, stop)
    finally:
        stop.close()


def measure(args, model, drafter, prompts, warmup, stop: Stop) -> int:
    be = model.backend
    configs = [("ar", None), ("chain", None)] + [("ddtree", b) for b in args.budgets]
    print(f"bench_demo: {len(prompts)} prompts x {args.max_new_tokens} new tokens, backend "
          f"{be.name} ({be.precision if be.name == 'reference' else 'float32'}), drafter "
          f"{drafter.name} (L = {drafter.block_len}), temperatures {args.temperature}, "
          f"warm-up {'on' if warmup else 'off'}"
          f"{', interleaved' if args.interleave else ''}", file=sys.stderr)
    rows, runs, last = [], {}, 0.0
    for t in args.temperature:
        if args.interleave:
            rows += interleaved(model, drafter, prompts, configs, t, args, warmup, stop, runs)
            continue
        for method, budget in configs:
            name = f"{method}{'' if budget is None else f' B={budget}'} T={t:g}"
            if not stop.allows(name, last):
                continue
            t0 = time.perf_counter()
            got = run_config(model, drafter, prompts, method, budget, t, args, warmup, stop)
            last = time.perf_counter() - t0
            runs[(method, budget, t)] = got
            row = summarise(method, budget, t, got, runs.get(("ar", None, t), []))
            rows.append(row)
            print(f"  {name}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s "
                  f"({row['speedup']:.2f}x AR), identical {row['identical']}/"
                  f"{row['compared']} ({last:.1f} s)", file=sys.stderr)
    agree = None
    greedy = runs.get(("ar", None, 0.0))
    if args.agreement_stride > 0 and not stop.signalled:
        if greedy is None:        # no T = 0 in the list: the greedy continuations alone
            greedy = run_config(model, None, prompts, "ar", None, 0.0, args, False)
        done = {r["id"] for r in greedy}
        agree = drafter_agreement(model, drafter, [p for p in prompts if p.get("id") in done],
                                  [r["tokens"] for r in greedy], args.agreement_stride)
    report = table(rows, be.name)
    print(f"\nbackend {be.name} ({be.precision if be.name == 'reference' else 'float32'}), "
          f"drafter {drafter.name}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, batch 1\n")
    print(report)
    print()
    print(agreement_table(agree, drafter.name))
    if stop.skipped:
        print(f"\nnot measured (time limit or signal): {', '.join(stop.skipped)}")
    bad = [(r, m) for r in rows if r["temperature"] == 0 for m in r["mismatches"]]
    for r, m in bad:
        print(f"bench_demo: MISMATCH: {r['method']} budget {r['budget']} T = 0, prompt "
              f"{m['id']}: tokens differ from AR's from new token {m['first']}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=dict(vars(args), backend=be.name, drafter=drafter.name,
                                         block_len=drafter.block_len,
                                         prompts=len(prompts), warmup=warmup),
                           rows=rows, agreement=agree, skipped=stop.skipped,
                           per_prompt={f"{m}:{b}:{t:g}": [
                               {k: v for k, v in r.items() if k != "time"} for r in got]
                               for (m, b, t), got in runs.items()}), f)
    if args.plot:
        plots.plot_budget_curves(     # the curves are over the fixed budgets
            args.plot, [r for r in rows if r["budget"] != "auto"], SPEED_GOAL.get(be.name),
            TAU_GOAL,
            f"{be.name} backend, drafter {drafter.name}, {len(prompts)} held-out prompts x "
            f"{args.max_new_tokens} tokens, batch 1")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

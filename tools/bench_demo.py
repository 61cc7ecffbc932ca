"""The demo pair's measurement (issue 14, "Measure"; issue 36): AR, chain and DDTree on held-out
code, beside the peers a user would try first.

    python3 tools/bench_demo.py [--prompts N] [--max-new-tokens 128] [--backend auto]
        [--precision float32]
        [--drafter SPEC] [--budgets 8,16,32,64,128] [--temperature 0,1]
        [--draft-temperature default] [--draft-vocab default] [--seed 0]
        [--model BUNDLE] [--prompt-file tools/data/heldout_prompts.jsonl]
        [--agreement-stride 1] [--time-limit S] [--interleave] [--[no-]warmup] [--[no-]peers]
        [--peer-prompts N] [--hf-dtype float32] [--json PATH] [--plot PATH.png]

Target: ``--model`` (default the shipped demo target, kdtree_numba/demo), on ``--backend``: the
reference backend runs its float32 CPU path (kdtree_numba/cpu.py) unless ``--precision
float64``.  Prompts: the first
``--prompts`` lines of ``--prompt-file`` (default all 128 held-out prompts on a GPU, 16 on the
CPU), JSON objects with a ``text`` (an ``id`` is optional: rows compare prompts by their
position, and print the ``id`` where there is one), each encoded as ``[bos] + encode(text)``
(docs/DEMO.md, "Prompt set").  Drafter (``--drafter``, default
``kdtree_numba.demo.DEFAULT_DRAFTER``): a DFlash drafter bundle (tools/train_drafter.py), any
drafter bundle ``kdtree-run`` takes, ``oracle:A`` (NoisyOracleDrafter: the target's own greedy
future at agreement A, for the harness; it runs the target L times a round, so its speed
means nothing), or ``random-dflash[:SEED]`` (an untrained DFlash drafter for this target, made
in memory: tau ~ 1, the cost of drafting and verifying without the gain).

For each temperature, batch 1, every prompt: AR, then the chain (the drafter's greedy chain,
L nodes), then DDTree at each budget (``auto``: kdtree_numba/budget.py) and each
``--draft-temperature`` (comma-separated: numbers > 0 and ``default``, the engine's policy;
one DDTree row per pair, t_d shown beside the budget; docs/ENGINE.md, "Draft
temperature") and each ``--draft-vocab`` (comma-separated: N, the DFlash drafter's N most
frequent tokens, ``full`` or ``default``; one drafter each, the first also drafts the chain
and the agreement; docs/ENGINE.md, "Draft vocabulary"); at T = 0 then the
peers (``--no-peers`` skips them; tools/bench_demo_peers.py): transformers' ``generate()``
greedy and with ``prompt_lookup_num_tokens=10``, on the target exported by
tools/bundle_to_hf.py, in ``--hf-dtype`` (default float32, the export's dtype) on the same
device (cuda when the engine runs on the GPU, else cpu), in this process, on the first
``--peer-prompts`` prompts (default all; their speedup is over AR's rate on the same
prompts; they also stop at ``--time-limit``, keeping the prompts done).  A row is one
method over all prompts: mean tau over all rounds (tokens committed per round: accepted nodes
+ the bonus; AR: 1), tokens/s = all new tokens over all ``generate`` seconds (end to end:
prefill included, as ``GenerationStats``), speedup = that over AR's at the same temperature,
rounds per prompt, and how many prompts gave exactly AR's tokens.  At T = 0 every method must
give AR's tokens (losslessness): a prompt that does not is a MISMATCH line on stderr, a
MISMATCH cell in the table, and exit status 1 (after the tables and the JSON are written).  At
T > 0 the engine draws each position's token with the same uniform for every method, so the
tokens agree too, up to a float rounding flipping a draw (~1e-7 a token); counted, not fatal.
The peers' agreement with AR's tokens is reported, never judged (another implementation's
float32 forward can flip a near-tie argmax).

The goal columns (DDTree rows; the issue judges them at T = 0): tau >= 5 at budget 32; tau
>= 1.25x the chain's; tokens/s >= 2.5x AR on the numba backend, 2x on the reference backend.

Per round (second table; tools/bench_demo_timing.py defines each): the wall time of the
rounds on the host clock (from the prefill's read to generate's return, over the rounds),
split into ``wait`` (the host blocked in the device's reads) and ``host`` (the rest: the
host's own work); the device phases from the engine's CUDA events (their sum is the device
timeline, idle gaps included, so it is not the busy time); the GPU's idle share (1 - NVML's
busy share sampled over the row; GPU only); the prefill per prompt; and the first-call work
still inside the timed prompts (kernels numba made and their seconds; CUDA graphs captured),
which should read 0.

Timing: by default on a GPU (``--warmup`` forces it on the CPU, ``--no-warmup`` skips it),
before a row is timed its warm-up runs what the row will run for the first time: every
distinct prompt length prefilled into a scratch KV cache of each capacity bucket the row will
use, and a full ``generate`` (twice) on the shortest and the longest prompt of each bucket
(``auto``: each candidate pinned in auto's cache, then auto; the timed ``auto`` row keeps one
AutoBudget of its own across its prompts as a serving loop would, fresh at the row's start,
never the one the warm-up's ``budget="auto"`` calls trained: budget.kept_auto_budget); the peers
warm up on the shortest and longest prompt.  The warm-up's seconds (and the part numba spent
making kernels) are a column and a line of their own, never in a row's timing.
``--time-limit`` (seconds, 0: none) skips a configuration that would not fit, judged by the
last one's time; SIGTERM and SIGINT stop after the current prompt; either way the tables hold
what was measured.

Drafter agreement (last table): the drafter's top-1 agreement with the target's greedy
continuation per block position, measured offline from the T = 0 AR continuation c_1..c_N of
every prompt.  For each anchor j (every ``--agreement-stride``-th of 1..N-1) the drafter gets
the verified prefix, prompt + c_1..c_j with root c_j (a DFlash drafter: the target's features
of prompt + c_1..c_{j-1} as its context, from one capturing prefill of the whole sequence; a
history drafter: the sequence itself), proposes [L, V], and row d's argmax is compared with
c_{j+d}.  ``chain tau`` is the mean of 1 + the leading matches over anchors with all L
depths known: what the chain would commit per round from those anchors.

``--json PATH`` keeps everything: the settings, every row (its timing facts included), the
peers' versions, dtype and device, and per prompt its tokens, seconds, rounds, tau, phase
times, host split, budgets and graph captures.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

# before numba is imported: its occupancy warnings would bury the table
os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")

import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from kdtree_numba import compat, demo, plots  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.budget import AutoBudget  # noqa: E402
from kdtree_numba.bundle import (DFLASH_BLOCK_SIZE, DFlashSpec, default_target_layer_ids,  # noqa: E402
                                 dflash_config, dflash_shapes, random_weights)
from kdtree_numba.dflash import DFlashDrafter  # noqa: E402
from kdtree_numba.drafter import NoisyOracleDrafter, load_drafter, parse_oracle_spec  # noqa: E402
from kdtree_numba.drafting import Commit, DraftContext  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import ForwardBatch, Model, causal_mask  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402

import bench_demo_peers as peers  # noqa: E402
from bench_demo_timing import Meters, warm_up  # noqa: E402

PROMPT_FILE = os.path.join(ROOT, "tools", "data", "heldout_prompts.jsonl")
TAU_GOAL, TAU_GOAL_BUDGET, CHAIN_GOAL = 5.0, 32, 1.25
SPEED_GOAL = {"numba": 2.5, "reference": 2.0}
ORACLE_BLOCK_LEN = DFLASH_BLOCK_SIZE - 1     # the DFlash drafter's depth, so trees compare
PEER_METHODS = tuple(name for name, _ in peers.PEERS)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _budgets(text: str) -> list:
    """Integers and ``auto`` (kdtree_numba/budget.py: each round's budget measured and chosen)."""
    return ["auto" if x.strip().lower() == "auto" else int(x) for x in text.split(",")
            if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _draft_temperatures(text: str) -> list:
    """Numbers and ``default`` (None: generate's own policy)."""
    return [None if x.strip().lower() == "default" else float(x) for x in text.split(",")
            if x.strip()]


def _draft_vocabs(text: str) -> list:
    """Integers >= 1, ``full`` (0: the whole vocabulary) and ``default`` (None: the drafter's
    own policy)."""
    words = {"default": None, "full": 0}
    return [words[x.strip().lower()] if x.strip().lower() in words else int(x)
            for x in text.split(",") if x.strip()]


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
    p.add_argument("--draft-temperature", type=_draft_temperatures, default=[None],
                   help="DDTree's draft temperatures t_d (its trees from the drafter's logits "
                   "/ t_d), comma-separated numbers > 0 or 'default'")
    p.add_argument("--draft-vocab", type=_draft_vocabs, default=[None],
                   help="the DFlash drafter's draft vocabularies (its N most frequent tokens), "
                   "comma-separated integers >= 1, 'full' or 'default'")
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
                   help="run what each configuration will run for the first time before "
                        "timing it (default: on a GPU)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="time transformers' generate() and its prompt lookup at T = 0 too")
    p.add_argument("--peer-prompts", type=int, default=0,
                   help="time the peers on the first N prompts only (0: all); their "
                        "speedup is over AR on the same prompts")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the peers' dtype (the export is float32: the bf16 weights exactly)")
    p.add_argument("--json", metavar="PATH", help="write everything measured as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="tau and speedup against the budget")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or (args.prompts is not None and args.prompts < 1):
        p.error("--prompts and --max-new-tokens must be >= 1")
    if args.peer_prompts < 0:
        p.error("--peer-prompts must be >= 0")
    if not args.budgets or min((b for b in args.budgets if b != "auto"), default=1) < 1:
        p.error("--budgets: one or more integers >= 1 or auto")
    if not args.temperature or min(args.temperature) < 0:
        p.error("--temperature: one or more numbers >= 0")
    if not args.draft_temperature or not all(
            t is None or (np.isfinite(t) and t > 0) for t in args.draft_temperature):
        p.error("--draft-temperature: one or more finite numbers > 0 or 'default'")
    if not args.draft_vocab or any(n is not None and n < 0 for n in args.draft_vocab):
        p.error("--draft-vocab: one or more integers >= 1, 'full' or 'default'")
    if args.plot:
        try:
            plots.require_matplotlib()
        except ImportError:
            p.error(f"--plot needs matplotlib: {plots.PLOT_EXTRA_HINT}")
    return args


# ----------------------------------------------------------------------------- inputs

def read_prompts(path: str, n: int, codec) -> list[dict]:
    """The first ``n`` prompts of ``path`` (JSON lines; each needs ``text``, an ``id`` is
    optional), each with its ``ids`` (``[bos] + encode(text)``), its position ``key`` (what
    the rows compare by) and its ``label`` (the ``id``, else the position)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or len(out) >= n:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"bench_demo: {path}:{lineno}: not JSON ({e.msg})")
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise SystemExit(f"bench_demo: {path}:{lineno}: a prompt needs a \"text\" "
                                 f"string")
            rec["key"] = len(out)
            rec["label"] = rec.get("id", rec["key"])
            rec["ids"] = codec.encode(rec["text"])
            if "n_tokens" in rec and rec["n_tokens"] != len(rec["ids"]):
                print(f"bench_demo: warning: prompt {rec['label']} encodes to "
                      f"{len(rec['ids'])} tokens, the file says {rec['n_tokens']}",
                      file=sys.stderr)
            out.append(rec)
    if not out:
        raise SystemExit(f"bench_demo: {path}: no prompts")
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


def make_drafter(spec: str, model: Model, block_len: int, seed: int, draft_vocab=None):
    if spec == "random-dflash" or spec.startswith("random-dflash:"):
        return random_dflash(model, int(spec.partition(":")[2] or 0))
    agreement = parse_oracle_spec(spec)
    if agreement is not None:
        return NoisyOracleDrafter(model, block_len, agreement, seed)
    return load_drafter(spec, model, block_len, seed, draft_vocab=draft_vocab)


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

    def expired(self) -> bool:
        """A signal came, or the time limit has passed."""
        return self.signalled or bool(self.limit and
                                      time.perf_counter() - self.t0 > self.limit)

    def allows(self, name: str, estimate: float) -> bool:
        spent = time.perf_counter() - self.t0
        if self.signalled or (self.limit and spent + estimate > self.limit):
            self.skipped.append(name)
            return False
        return True


def run_config(model, drafter, prompts, method, budget, temperature, args, warmup,
               stop: Stop | None = None, meters: Meters | None = None, draft_temp=None):
    """Every prompt through one configuration, after its warm-up (``warmup``: what the timed
    prompts will run for the first time, tools/bench_demo_timing.py).  Returns one record
    per prompt (stopping early after a signal) and the row's timing facts: the warm-up's
    seconds and what compiled in it, and inside the timed prompts the kernels numba made,
    their seconds, and the GPU's busy share."""
    meters = meters or Meters(model.backend)
    kw = dict(method=method, drafter=drafter if method != "ar" else None,
              budget=budget or 32, temperature=temperature, seed=args.seed,
              draft_temperature=draft_temp)
    if budget == "auto":
        # one policy across the row's timed prompts, as a serving loop keeps it: what its
        # rounds measured carries over (budget="auto" alone climbs afresh in every generate,
        # a third of a 128-token generation spent probing); fresh at the row's start
        kw["budget"] = AutoBudget()
    warm = None
    if warmup:
        with meters.first.counting():
            warm = warm_up(model, drafter, prompts, method, budget, temperature,
                           args.max_new_tokens, args.seed, meters.warm, draft_temp)
        warm.update(compile_seconds=meters.first.seconds, kernels=meters.first.kernels)
    out = []
    with meters.first.counting(), meters.busy.sampling():
        for rec in prompts:
            with meters.clock.timing():
                res = generate(model, [rec["ids"]], args.max_new_tokens,
                               progress=meters.clock.progress, **kw)
            s = res.stats
            out.append(dict(key=rec["key"], id=rec["label"], tokens=res.tokens[0],
                            seconds=s.seconds, new_tokens=s.new_tokens, rounds=s.rounds,
                            rounds_dropped=s.rounds_dropped,
                            tau=[a for r in s.tau for a in r], time=dict(s.time),
                            host=dict(meters.clock.last), budgets=list(s.budgets),
                            graph_captures=s.graph_captures,
                            lookup=None if s.prompt_lookup is None else s.prompt_lookup.weight))
            if stop is not None and stop.signalled:
                break
    timing = dict(warmup=warm, compile_seconds=meters.first.seconds,
                  kernels=meters.first.kernels, gpu_busy=meters.busy.share,
                  gpu_busy_samples=meters.busy.samples)
    return out, timing


def interleaved(model, drafters, prompts, configs, t, args, warmup, stop: Stop,
                meters: Meters) -> dict:
    """``--interleave``: prompt by prompt, every configuration in turn (each warmed up on the
    first), so that a load that changes during the run (a shared machine) weighs on every row
    alike.  {(method, budget, t_d, draft vocab): (records, timing)} as run_config's (the
    drafter of ``drafters``' draft vocabulary), the timings of the first
    prompt's call (its warm-up) with the compile counts summed over the prompts.
    ``--time-limit`` is not applied; a signal stops after the prompt in flight."""
    done: dict = {}
    for i, rec in enumerate(prompts):
        for config in configs:
            method, budget, td, nv = config
            got, timing = run_config(model, drafters[nv], [rec], method, budget, t, args,
                                     warmup and i == 0, None, meters, td)
            if config not in done:
                done[config] = (got, timing)
                continue
            records, first = done[config]
            records.extend(got)
            for key in ("compile_seconds", "kernels"):     # None where nothing counts them
                if first[key] is not None and timing[key] is not None:
                    first[key] += timing[key]
        if stop.signalled:
            break
    return done


def compare(runs, ar_runs) -> tuple[int, list[dict]]:
    """(prompts compared with AR's, the ones whose tokens differ: key, id, first new token
    that differs), matching prompts by their position in the prompt file."""
    ar_by_key = {r["key"]: r["tokens"] for r in ar_runs}
    diffs = []
    for r in runs:
        want = ar_by_key.get(r["key"])
        if want is not None and r["tokens"] != want:
            first = next((i for i, (a, b) in enumerate(zip(r["tokens"], want)) if a != b),
                         min(len(r["tokens"]), len(want)))
            diffs.append(dict(key=r["key"], id=r["id"], first=first))
    return sum(1 for r in runs if r["key"] in ar_by_key), diffs


def _rate(runs) -> float:
    seconds = sum(r["seconds"] for r in runs)
    return sum(r["new_tokens"] for r in runs) / seconds if seconds > 0 else 0.0


def summarise(method, budget, temperature, runs, ar_runs, timing=None, draft_temp=None,
              draft_vocab=None) -> dict:
    """One row: speed, tau and losslessness over ``runs``, and per round the host clock's
    wall / wait / host split and the device phases (ms; tools/bench_demo_timing.py)."""
    timing = timing or {}
    tokens, rounds = sum(r["new_tokens"] for r in runs), sum(r["rounds"] for r in runs)
    taus = [a for r in runs for a in r["tau"]]
    compared, diffs = compare(runs, ar_runs)
    split = {k: sum(r["time"][k] for r in runs) for k in runs[0]["time"]}
    host = {k: sum(r["host"][k] for r in runs) for k in ("prefill", "rounds", "wait", "host")}
    per_round = {k: 1e3 * v / max(rounds, 1) for k, v in split.items() if k != "prefill"}
    tps, ar_tps = _rate(runs), _rate(ar_runs) if ar_runs else 0.0
    captures = [r["graph_captures"] for r in runs if r["graph_captures"] is not None]
    warm = timing.get("warmup")
    busy = timing.get("gpu_busy")
    return dict(method=method, budget=budget, temperature=temperature,
                draft_temperature=draft_temp, draft_vocab=draft_vocab, prompts=len(runs),
                tau=float(np.mean(taus)) if taus else 1.0, tokens_per_s=tps,
                speedup=tps / ar_tps if ar_tps else float("nan"),
                rounds_per_prompt=rounds / len(runs), seconds=sum(r["seconds"] for r in runs),
                # device rounds run past a prompt's end (their tokens dropped), per prompt
                dropped_per_prompt=sum(r["rounds_dropped"] for r in runs) / len(runs),
                new_tokens=tokens,
                draft_ms_per_round=per_round.get("draft", 0.0),
                verify_ms_per_round=per_round.get("verify", 0.0) + per_round.get("decode", 0.0),
                device_ms_per_round=per_round,
                wall_ms_per_round=1e3 * host["rounds"] / max(rounds, 1),
                wait_ms_per_round=1e3 * host["wait"] / max(rounds, 1),
                host_ms_per_round=1e3 * host["host"] / max(rounds, 1),
                prefill_ms_per_prompt=1e3 * host["prefill"] / len(runs),
                gpu_idle_share=None if busy is None else 1.0 - busy,
                warmup_seconds=warm["seconds"] if warm else None,
                warmup_compile_seconds=warm.get("compile_seconds") if warm else None,
                timed_compile_seconds=timing.get("compile_seconds"),
                timed_kernels=timing.get("kernels"),
                timed_graph_captures=sum(captures) if captures else None,
                prompt_lookup=runs[0].get("lookup"),
                identical=compared - len(diffs), compared=compared, mismatches=diffs,
                time=split, timing=timing)


def drafter_agreement(model, drafter, prompts, continuations, stride: int) -> dict:
    """Top-1 agreement of the drafter's rows with the target's greedy continuation, per
    depth (module docstring).  Any drafter: it is fed through its protocol (kdtree_numba/
    drafting.py) what the target verified up to each anchor, from one prefill of the whole
    sequence that returns whatever the drafter ``needs``."""
    be, L, needs = model.backend, drafter.block_len, drafter.needs
    hits, counts, chain = np.zeros(L), np.zeros(L), []
    for rec, cont in zip(prompts, continuations):
        seq = np.asarray(list(rec["ids"]) + list(cont), np.int64)
        P, N = len(rec["ids"]), len(cont)
        anchors = list(range(1, N, stride))
        if not anchors:
            continue
        drafter.start(1, P + N + L + 2)
        cache = model.new_cache(1, P + N + 1)
        out = model.prefill(cache, [seq[:P + N - 1]], capture_layers=needs.feature_layers)
        parts = out if isinstance(out, tuple) else (out,)
        feats = parts[-1] if needs.feature_layers else None
        hidden = None
        if needs.hidden:              # every row's final hidden state, from a full forward
            full = model.new_cache(1, P + N)
            hidden = model.forward(ForwardBatch(
                seq[None, :P + N - 1], np.arange(P + N - 1)[None], causal_mask(P + N - 1),
                return_hidden=True), full)[1]
        have = 0
        for j in anchors:
            root = P + j - 1                      # c_j's position; c_{j+d} is seq[root + d]
            n = root - have                       # tokens verified since the last anchor
            drafter.on_commit(Commit(
                counts=be.asarray(np.array([n], np.int32)),
                next_roots=be.asarray(np.array([seq[root]], np.int32)),
                counts_host=np.array([n], np.int64),
                tokens=be.asarray(seq[None, have:root + 1].astype(np.int32)),
                hidden=hidden[:, root - 1] if hidden is not None else None,
                features=feats[:, have:root] if feats is not None else None))
            have = root
            logits = drafter.propose(DraftContext(
                roots=be.asarray(np.array([seq[root]], np.int32)),
                positions=be.asarray(np.array([root], np.int32))))
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


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _budget_cell(r: dict) -> str:
    """The budget, and the draft temperature, vocabulary and prompt lookup a row ran with
    (none: the defaults; the lookup from KDTREE_PROMPT_LOOKUP)."""
    td, nv, lw = r.get("draft_temperature"), r.get("draft_vocab"), r.get("prompt_lookup")
    return str(r["budget"] or "-") + ("" if td is None else f" (t_d {td:g})") + (
        "" if nv is None else f" (V_d {nv or 'full'})") + (
        "" if lw is None else f" (lookup {lw:g})")


def _same_cell(r: dict) -> str:
    same = f"{r['identical']}/{r['compared']}"
    if r["identical"] == r["compared"]:
        return same
    if r["method"] in PEER_METHODS:        # another implementation: reported, not judged
        return f"{same} (differs)"
    return f"**MISMATCH** {same}" if r["temperature"] == 0 else f"{same} (T > 0)"


def table(rows: list[dict], backend: str) -> str:
    """The summary: speed, tau, losslessness, the issue's goal columns, and each row's
    warm-up seconds (outside its timing) beside it."""
    goal = SPEED_GOAL.get(backend, 2.0)
    head = ["method", "budget", "T", "tau", "tokens/s", "speedup vs AR", "rounds/prompt",
            "identical to AR", f"tau >= {TAU_GOAL:g} at B {TAU_GOAL_BUDGET}",
            f"tau >= {CHAIN_GOAL}x chain", f"tok/s >= {goal:g}x AR", "warm-up s (untimed)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        chain = next((c for c in rows if c["method"] == "chain"
                      and c["temperature"] == r["temperature"]), None)
        g1 = g2 = g3 = ""
        if r["method"] == "ddtree":
            if r["budget"] == TAU_GOAL_BUDGET:
                g1 = f"{_yes(r['tau'] >= TAU_GOAL)} ({r['tau']:.2f})"
            if chain:
                ratio = r["tau"] / chain["tau"]
                g2 = f"{_yes(ratio >= CHAIN_GOAL)} ({ratio:.2f}x)"
            g3 = f"{_yes(r['speedup'] >= goal)} ({r['speedup']:.2f}x)"
        peer = r["method"] in PEER_METHODS
        cells = [r["method"], _budget_cell(r), f"{r['temperature']:g}",
                 "-" if peer else f"{r['tau']:.2f}", f"{r['tokens_per_s']:.1f}",
                 f"{r['speedup']:.2f}x", "-" if peer else f"{r['rounds_per_prompt']:.1f}",
                 _same_cell(r), g1, g2, g3,
                 "-" if r["warmup_seconds"] is None else f"{r['warmup_seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def round_table(rows: list[dict]) -> str:
    """Per round (an AR step, a chain or DDTree round), ms: the host clock's wall time, the
    part spent blocked in device reads and the host's own work; the device phases (CUDA
    events, idle gaps included); the GPU's idle share (NVML); the prefill per prompt; and
    the first-call work that still ran inside the timed prompts (should be 0)."""
    head = ["method", "budget", "T", "wall", "wait", "host", "device: draft / tree / verify / "
            "accept / compact (AR: decode)", "GPU idle", "prefill ms/prompt",
            "inside timing: kernels made (s) / graph captures"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["method"] in PEER_METHODS:
            continue
        d = r["device_ms_per_round"]
        dev = f"{d.get('decode', 0.0):.2f}" if r["method"] == "ar" else " / ".join(
            f"{d.get(k, 0.0):.2f}" for k in ("draft", "tree_build", "verify", "accept",
                                             "compaction"))
        idle = "-" if r["gpu_idle_share"] is None else f"{100 * r['gpu_idle_share']:.0f}%"
        made = "-" if r["timed_kernels"] is None else \
            f"{r['timed_kernels']} ({r['timed_compile_seconds']:.2f})"
        caps = "-" if r["timed_graph_captures"] is None else str(r["timed_graph_captures"])
        cells = [r["method"], _budget_cell(r), f"{r['temperature']:g}",
                 _ms(r["wall_ms_per_round"]), _ms(r["wait_ms_per_round"]),
                 _ms(r["host_ms_per_round"]), dev, idle, _ms(r["prefill_ms_per_prompt"]),
                 f"{made} / {caps}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compile_line(rows: list[dict]) -> str:
    """The warm-ups' seconds (compiles, captures and their own generation, never in a row's
    timing) and the first-call work inside the timed rows, the engine's and the peers'
    apart."""
    engine = [r for r in rows if r["method"] not in PEER_METHODS]
    peer = [r for r in rows if r["method"] in PEER_METHODS]
    warm = [r for r in engine if r["warmup_seconds"] is not None]
    if not warm:
        text = "engine warm-up: off (its rows' times include first calls: compiles, captures)"
    else:
        text = f"engine warm-up: {sum(r['warmup_seconds'] for r in warm):.1f} s untimed"
        made = [r["warmup_compile_seconds"] for r in warm
                if r["warmup_compile_seconds"] is not None]
        if made:
            text += f", of which numba made kernels for {sum(made):.1f} s"
        inside = [r["timed_compile_seconds"] for r in engine
                  if r["timed_compile_seconds"] is not None]
        caps = [r["timed_graph_captures"] for r in engine
                if r["timed_graph_captures"] is not None]
        text += "; inside the timed rows: " + (
            f"{sum(inside):.2f} s of kernel making" if inside else "kernel making not counted")
        text += f", {sum(caps)} graph captures" if caps else ", no CUDA graphs"
    if peer:
        text += f"\npeers' warm-up: {sum(r['warmup_seconds'] for r in peer):.1f} s untimed"
    return text


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
    too_long = [r["label"] for r in prompts if len(r["ids"]) + args.max_new_tokens > limit]
    if too_long:
        sys.exit(f"bench_demo: prompts {too_long} + --max-new-tokens {args.max_new_tokens} "
                 f"exceed the model's context of {limit}")
    drafters = {n: make_drafter(args.drafter, model, args.block_len, args.seed, n)
                for n in args.draft_vocab}
    warmup = be.on_gpu if args.warmup is None else args.warmup
    stop = Stop(args.time_limit)
    try:
        return measure(args, model, drafters, prompts, warmup, stop)
    finally:
        stop.close()


def measure_peers(args, model, prompts, ar_runs, meters: Meters, stop: Stop, runs: dict,
                  rows: list) -> dict:
    """transformers' generate() and its prompt lookup on the exported target, at T = 0 beside
    the engine's rows (tools/bench_demo_peers.py); returns what they ran with.  A peer that
    cannot run is one stderr line and ``failed`` in the JSON: the engine's rows, measured
    already, are still printed and written."""
    why = peers.available()
    if why is not None:
        print(f"bench_demo: peers not measured: {why}", file=sys.stderr)
        return dict(skipped=why)
    prompts = prompts[:args.peer_prompts or len(prompts)]
    info: dict = {}
    try:
        _time_peers(args, model, prompts, ar_runs, meters, stop, runs, rows, info)
    except Exception as e:       # transformers' failure must not lose the engine's rows
        info["failed"] = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"bench_demo: peers failed: {info['failed']}", file=sys.stderr)
    return info


def _time_peers(args, model, prompts, ar_runs, meters, stop, runs, rows, info) -> None:
    ends = [min(range(len(prompts)), key=lambda i: len(prompts[i]["ids"])),
            max(range(len(prompts)), key=lambda i: len(prompts[i]["ids"]))]
    with tempfile.TemporaryDirectory() as tmp:
        info["export"] = peers.export_target(args.model, tmp)
        peer = peers.HFPeer(tmp, args.hf_dtype, peers.peer_device(model.backend.on_gpu))
    info.update(peer.info)
    print(f"bench_demo: peers: {info['export']}; transformers {info['transformers']}, "
          f"{info['dtype']} on {info['device']}, attention {info['attention']}",
          file=sys.stderr)
    try:
        for name, extra in peers.PEERS:
            if not stop.allows(f"{name} T=0", 0.0):
                continue
            got, timing = peers.time_peer(peer, prompts, args.max_new_tokens, extra,
                                          sorted(set(ends)), meters.busy, stop)
            runs[(name, None, 0.0, None, None)] = got
            if len(got) < len(prompts):
                stop.skipped.append(f"{name}: prompts after the first {len(got)}")
            row = peer_row(name, got, ar_runs, timing)
            rows.append(row)
            print(f"  {name} T=0: {row['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x AR), "
                  f"identical {row['identical']}/{row['compared']}", file=sys.stderr)
    finally:
        peer.close()


def peer_row(name, runs, ar_runs, timing) -> dict:
    """A peer's row: summarise's fields that a peer has (no tau, rounds or split); its
    speedup is over AR's rate on the same prompts (``--peer-prompts`` may time fewer)."""
    keys = {r["key"] for r in runs}
    ar_runs = [r for r in ar_runs if r["key"] in keys]
    compared, diffs = compare(runs, ar_runs)
    tps, ar_tps = _rate(runs), _rate(ar_runs) if ar_runs else 0.0
    busy = timing.get("gpu_busy")
    return dict(method=name, budget=None, temperature=0.0, prompts=len(runs), tau=None,
                tokens_per_s=tps, speedup=tps / ar_tps if ar_tps else float("nan"),
                rounds_per_prompt=None, seconds=sum(r["seconds"] for r in runs),
                new_tokens=sum(r["new_tokens"] for r in runs),
                gpu_idle_share=None if busy is None else 1.0 - busy,
                warmup_seconds=timing["warmup"]["seconds"], warmup_compile_seconds=None,
                timed_compile_seconds=None, timed_kernels=None, timed_graph_captures=None,
                identical=compared - len(diffs), compared=compared, mismatches=diffs,
                timing=timing)


def measure(args, model, drafters, prompts, warmup, stop: Stop) -> int:
    be = model.backend
    meters = Meters(be)
    first = args.draft_vocab[0]       # its drafter drafts the chain and the agreement
    drafter = drafters[first]
    configs = [("ar", None, None, first), ("chain", None, None, first)] + [
        ("ddtree", b, td, nv) for nv in args.draft_vocab for td in args.draft_temperature
        for b in args.budgets]
    print(f"bench_demo: {len(prompts)} prompts x {args.max_new_tokens} new tokens, backend "
          f"{be.name} ({be.precision if be.name == 'reference' else 'float32'}), drafter "
          f"{drafter.name} (L = {drafter.block_len}), temperatures "
          f"{args.temperature}, warm-up {'on' if warmup else 'off'}", file=sys.stderr)
    rows, runs, last, peer_info = [], {}, 0.0, None
    for t in args.temperature:
        done = interleaved(model, drafters, prompts, configs, t, args, warmup, stop, meters) \
            if args.interleave else {}
        for method, budget, td, nv in configs:
            vd = "" if nv is None or method == "ar" else f" V_d={nv or 'full'}"
            name = f"{method}{'' if budget is None else f' B={budget}'}" \
                f"{'' if td is None else f' t_d={td:g}'}{vd} T={t:g}"
            if args.interleave:
                got, timing = done[(method, budget, td, nv)]
                last = sum(r["seconds"] for r in got)
            elif not stop.allows(name, last):
                continue
            else:
                t0 = time.perf_counter()
                got, timing = run_config(model, drafters[nv], prompts, method, budget, t,
                                         args, warmup, stop, meters, td)
                last = time.perf_counter() - t0
            runs[(method, budget, t, td, nv)] = got
            row = summarise(method, budget, t, got, runs.get(("ar", None, t, None, first), []),
                            timing, td, None if method == "ar" else nv)
            rows.append(row)
            warm = "" if row["warmup_seconds"] is None else \
                f", warm-up {row['warmup_seconds']:.1f} s apart"
            print(f"  {name}: tau {row['tau']:.2f}, {row['tokens_per_s']:.1f} tok/s "
                  f"({row['speedup']:.2f}x AR), identical {row['identical']}/"
                  f"{row['compared']} ({last:.1f} s{warm})", file=sys.stderr)
        ar0 = ("ar", None, 0.0, None, first)
        if t == 0 and args.peers and ar0 in runs and not stop.signalled:
            peer_info = measure_peers(args, model, prompts, runs[ar0], meters, stop, runs,
                                      rows)
    agree = None
    greedy = runs.get(("ar", None, 0.0, None, first))
    if args.agreement_stride > 0 and not stop.signalled:
        if greedy is None:        # no T = 0 in the list: the greedy continuations alone
            greedy, _ = run_config(model, None, prompts, "ar", None, 0.0, args, False)
        done = {r["key"] for r in greedy}
        agree = drafter_agreement(model, drafter, [p for p in prompts if p["key"] in done],
                                  [r["tokens"] for r in greedy], args.agreement_stride)
    print(f"\nbackend {be.name} ({be.precision if be.name == 'reference' else 'float32'}), "
          f"drafter {drafter.name}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} new tokens, batch 1, end to end (prefill included)\n")
    print(table(rows, be.name))
    print(f"\n{compile_line(rows)}\n\nper round, ms (docstring: wall = wait + host on the "
          f"host clock; device phases from CUDA events, idle gaps included):\n")
    print(round_table(rows))
    if peer_info and "device" in peer_info:
        print(f"\npeers: transformers {peer_info['transformers']} generate(), "
              f"{peer_info['dtype']} on {peer_info['device']}, greedy; identical = their "
              f"tokens equal the engine's AR tokens (reported, not judged)")
    print()
    print(agreement_table(agree, drafter.name))
    if stop.skipped:
        print(f"\nnot measured (time limit or signal): {', '.join(stop.skipped)}")
    bad = [(r, m) for r in rows if r["temperature"] == 0 and r["method"] not in PEER_METHODS
           for m in r["mismatches"]]
    for r, m in bad:
        print(f"bench_demo: MISMATCH: {r['method']} budget {r['budget']} T = 0, prompt "
              f"{m['id']}: tokens differ from AR's from new token {m['first']}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=dict(vars(args), backend=be.name, drafter=drafter.name,
                                         block_len=drafter.block_len,
                                         prompts=len(prompts), warmup=warmup),
                           rows=rows, agreement=agree, skipped=stop.skipped, peers=peer_info,
                           per_prompt={f"{m}:{b}:{t:g}" + ("" if td is None else f":{td:g}")
                                       + ("" if nv is None else f":V{nv}"): got
                                       for (m, b, t, td, nv), got in runs.items()}), f)
    if args.plot:
        first_td = args.draft_temperature[0]    # the curves: fixed budgets at the first t_d
        plots.plot_budget_curves(args.plot, [
            r for r in rows if r["budget"] != "auto" and r["method"] not in PEER_METHODS
            and (r["method"] != "ddtree" or (r["draft_temperature"], r["draft_vocab"]) ==
                 (first_td, first))],
            SPEED_GOAL.get(be.name), TAU_GOAL,
            f"{be.name} backend, drafter {drafter.name}, {len(prompts)} held-out prompts x "
            f"{args.max_new_tokens} tokens, batch 1")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

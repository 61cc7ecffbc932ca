"""End-to-end generation speed of the engine on the GPU: AR and DDTree against transformers.

    python3 tools/bench_engine.py [--sizes small,medium] [--budgets 8,32,128]
                                  [--new-tokens 64] [--time-limit 150] [--json PATH] [--no-hf]

For each size a deterministic random target (bundle.py's ``small`` / ``medium``) is exported as
an HF checkpoint, imported back with kdtr-import-hf (the path a real checkpoint takes) and run,
in this order (the most important rows first, so a time limit cuts the least useful ones):

1. ``ar``: the numba backend, greedy, batch 1;
2. ``ddtree/model`` for each budget: DDTree with a ModelDrafter (a one-layer random drafter of
   the same vocab, L = 8): the real cost of drafting, but an untrained drafter, so tau ~ 1;
3. ``hf``: transformers' ``generate()`` (float32, eager attention, greedy) on the same weights;
4. ``ddtree/replay`` for each budget (``--no-replay`` skips): a drafter that replays the
   target's own greedy future (known from the AR run) at ``--agreement`` per position, for
   free: what the tree machinery delivers when the drafter is good.  An upper bound, so
   labelled.

Then the next size, if time remains.  ``--time-limit`` (seconds, whole run) is checked before
every measurement against what the same kind of measurement took last (the first one of a kind
always runs); the run stops cleanly, and SIGTERM/SIGINT stop it too, printing the summary table
of every row measured so far (and the JSON, rewritten after every row).

Timing: wall clock of whole ``generate`` calls after a warm-up call identical to the measured
one (which pays numba's first-call compilation and the CUDA-graph captures); the per-round
split (draft / tree / verify / accept / compact) comes from the engine's CUDA-event markers,
which add no sync (docs/ENGINE.md).  Roof:
weight-streaming bound of batch-1 decode, bytes of the weights one token touches (attention,
dense FFNs, router, top-k + shared experts, one embedding row, lm_head) over the 4.1 TB/s HBM
rate measured on the H200.  Goal: AR >= transformers; DDTree > AR.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import warnings

# before numba is imported: its occupancy warnings would bury the table
os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdtree_numba.bundle import drafter_config, random_weights, size_config  # noqa: E402
from kdtree_numba.drafter import ModelDrafter  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint, import_hf  # noqa: E402
from kdtree_numba.config import weight_shapes  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402

HBM_BYTES_PER_S = 4.1e12
BLOCK_LEN = 8


class ReplayDrafter:
    """Drafts the target's known greedy future (bench only): row d peaks at the true token
    at depth d + 1 with probability ``agreement``, else at a wrong one.  Costs only the host
    construction and one upload of [bs, L, V] logits."""

    def __init__(self, backend, vocab: int, futures: list[list[int]], agreement: float,
                 block_len: int = BLOCK_LEN, seed: int = 0):
        self.backend, self.vocab_size, self.block_len = backend, vocab, block_len
        self.futures, self.agreement, self.seed = futures, agreement, seed
        self.name = f"replay:{agreement:g}"

    def start(self, batch, max_len):
        self.rng = np.random.default_rng(self.seed)

    def propose(self, histories):
        bs, L, V = len(histories), self.block_len, self.vocab_size
        logits = np.zeros((bs, L, V), np.float32)
        for b, h in enumerate(histories):
            full = self.futures[b]
            for d in range(L):
                p = len(h) + d
                true = full[p] if p < len(full) else 0
                tok = true if self.rng.random() < self.agreement else (true + 1 + d) % V
                logits[b, d, tok] = 12.0
                logits[b, d, (tok + 7) % V] = 6.0     # a runner-up, so trees are not chains
        return self.backend.asarray(logits)


def bytes_per_token(cfg) -> float:
    """Weight bytes (float32) one decoded token reads: everything but the unused experts."""
    shapes = weight_shapes(cfg)
    total = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        if name == "model/embed_tokens":
            n = shape[1]                                  # one row
        elif "/experts/" in name:
            n = n // shape[0] * cfg.num_experts_per_tok   # top-k experts only
        total += n
    return 4.0 * total


def time_generate(model, prompt, n_new, **kw):
    # warm-up: the very same call, so the measured one compiles nothing and captures no CUDA
    # graph (an 8-token warm-up left some drafter shapes to the measured call: the slow first
    # model-drafter rows of runs 12-15)
    generate(model, [prompt], n_new, **kw)
    return generate(model, [prompt], n_new, **kw)


class Budget:
    """The run's time limit: a measurement of a kind starts only if the time left exceeds what
    the last one of that kind took (with 20% slack); the first of a kind always starts."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.last: dict[str, float] = {}

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, kind: str) -> bool:
        return self.left() > 1.2 * self.last.get(kind, 0.0) and self.left() > 0

    def run(self, kind: str, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.last[kind] = time.perf_counter() - t0


def hf_generate(hf_dir, prompt, n_new):
    import torch
    import transformers
    transformers.utils.logging.set_verbosity_error()
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float32).to("cuda").eval()
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return out[0, len(prompt):].tolist(), seconds


def row(size, method, res, roof, **extra):
    st = res.stats
    per_round = {k: 1e3 * v / max(st.rounds, 1) for k, v in st.time.items()
                 if k != "prefill" and v > 0}
    return dict(size=size, method=method, budget=st.budget, tokens=st.new_tokens,
                seconds=st.seconds, tokens_per_s=st.tokens_per_s,
                decode_tokens_per_s=st.decode_tokens_per_s, tau=st.mean_tau,
                rounds=st.rounds, ms_per_round=per_round, roof_tokens_per_s=roof,
                graph_captures=st.graph_captures, graph_replays=st.graph_replays, **extra)


def bench_size(size, args, budget: Budget, out_rows):
    if not budget.allows("ar"):     # a size starts only if its AR row can still finish
        print(f"# time limit: skipping size {size}", file=sys.stderr)
        return
    cfg = size_config(size)
    weights = dict(random_weights(cfg, 0))
    tmp = tempfile.mkdtemp(prefix=f"bench-{size}-")
    hf_dir, bundle = os.path.join(tmp, "hf"), os.path.join(tmp, "model.kdtr")
    t0 = time.perf_counter()
    export_hf_checkpoint(cfg, weights, hf_dir)
    import_hf(hf_dir, bundle, quiet=True)
    print(f"# {size}: exported + imported in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    del weights
    model = Model.load(bundle, "numba")
    dcfg = drafter_config(cfg)
    drafter_model = Model(dcfg, dict(random_weights(dcfg, 1)), model.backend)
    roof = HBM_BYTES_PER_S / bytes_per_token(cfg)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    n_new = args.new_tokens

    ar = budget.run("ar", lambda: time_generate(model, prompt, n_new))
    ar_row = row(size, "ar", ar, roof)
    ctx = dict(ar=ar_row, hf_tps=None, out_rows=out_rows, json_path=args.json)
    finish_row(ar_row, **ctx)
    future = prompt + ar.tokens[0] + [0] * (BLOCK_LEN + 2)

    def ddtree_rows(kind):
        for b in args.budgets:
            if not budget.allows(kind):
                print(f"# {size}: time limit: skipping ddtree/{kind} from budget {b}",
                      file=sys.stderr)
                return
            drafter = (ModelDrafter(drafter_model, BLOCK_LEN) if kind == "model" else
                       ReplayDrafter(model.backend, cfg.vocab_size, [future], args.agreement))
            res = budget.run(kind, lambda: time_generate(model, prompt, n_new, method="ddtree",
                                                         drafter=drafter, budget=b))
            finish_row(row(size, f"ddtree/{kind}", res, roof,
                           same_tokens_as_ar=res.tokens == ar.tokens), **ctx)

    ddtree_rows("model")
    if not args.no_hf and not budget.allows("hf"):
        print(f"# {size}: time limit: skipping transformers", file=sys.stderr)
    elif not args.no_hf:
        try:
            hf_tokens, hf_s = budget.run("hf", lambda: hf_generate(hf_dir, prompt, n_new))
            ctx["hf_tps"] = n_new / hf_s
            finish_row(dict(size=size, method="hf", budget=None, tokens=n_new, seconds=hf_s,
                            tokens_per_s=ctx["hf_tps"], tau=None, rounds=n_new,
                            ms_per_round={}, roof_tokens_per_s=roof,
                            same_tokens_as_ar=hf_tokens == ar.tokens[0]), **ctx)
        except Exception as e:  # the bench must finish even if transformers cannot run
            print(f"# {size}: transformers baseline failed: {e!r}", file=sys.stderr)
    if not args.no_replay:
        ddtree_rows("replay")


def finish_row(r, ar, hf_tps, out_rows, json_path):
    """Add the ratios, print the row and rewrite the JSON: a timeout keeps what was measured."""
    r["vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
    r["vs_hf"] = r["tokens_per_s"] / hf_tps if hf_tps else None
    out_rows.append(r)
    print_rows([r])
    write_json(out_rows, json_path)


def write_json(out_rows, json_path):
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": out_rows, "hbm_bytes_per_s": HBM_BYTES_PER_S}, fh, indent=1)


def summarise(out_rows, json_path):
    """The final table: every row measured, vs-HF ratios filled in once HF was measured."""
    hf = {r["size"]: r["tokens_per_s"] for r in out_rows if r["method"] == "hf"}
    for r in out_rows:
        r["vs_hf"] = r["tokens_per_s"] / hf[r["size"]] if r["size"] in hf else None
    write_json(out_rows, json_path)
    print(f"\n## Summary ({len(out_rows)} rows)\n")
    print_header()
    print_rows(out_rows)


def print_header():
    print("| size | method | budget | tok/s | roof tok/s | goal | tau | ms/round: draft / tree "
          "/ verify / accept / compact | vs AR | vs HF | tokens = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


def print_rows(rows):
    for r in rows:
        m = r["ms_per_round"]
        split = " / ".join(f"{m.get(k, 0):.2f}" for k in
                           ("draft", "tree_build", "verify", "accept", "compaction"))
        if r["method"] == "ar":
            split = f"decode {m.get('decode', 0):.2f}"
        goal = {"ar": ">= HF", "hf": "-"}.get(r["method"], "> AR")
        if r["method"] == "hf":
            split = "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        vs_hf = f"{r['vs_hf']:.2f}x" if r.get("vs_hf") else "-"
        same = r.get("same_tokens_as_ar", "-")
        print(f"| {r['size']} | {r['method']} | {r['budget'] or '-'} | {r['tokens_per_s']:.1f} |"
              f" {r['roof_tokens_per_s']:.0f} | {goal} | {tau} | {split} | {r['vs_ar']:.2f}x |"
              f" {vs_hf} | {same} |", flush=True)


class _Stop(BaseException):
    """SIGTERM (e.g. from ``timeout``): stop measuring, still print what was measured.  Not an
    Exception, so the transformers step's ``except Exception`` cannot swallow it."""


def _stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--budgets", default="8,32,128")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--agreement", type=float, default=0.9, help="replay drafter agreement")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-replay", action="store_true", help="skip the replay-drafter rows")
    p.add_argument("--time-limit", type=float, default=150.0,
                   help="seconds for the whole run (checked before each measurement)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    from kdtree_numba import compat
    if not compat.gpu_available():
        print("bench_engine: needs a CUDA GPU (the numba backend on CuPy)", file=sys.stderr)
        return 2
    try:
        from numba.core.errors import NumbaPerformanceWarning
        warnings.simplefilter("ignore", NumbaPerformanceWarning)
    except ImportError:
        pass
    budget = Budget(args.time_limit)
    rows: list = []
    print(f"Engine tokens/s, batch 1, greedy, {args.new_tokens} new tokens after a "
          f"{args.prompt_len}-token prompt; roof = weight bytes per token / 4.1 TB/s; "
          f"time limit {args.time_limit:.0f} s.")
    print_header()
    signal.signal(signal.SIGTERM, _stop)
    try:
        for size in args.sizes.split(","):
            bench_size(size, args, budget, rows)
    except (_Stop, KeyboardInterrupt) as e:
        print(f"# stopped ({e!r}): summary of what was measured", file=sys.stderr)
    finally:
        summarise(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end generation speed of the engine on the GPU: AR and DDTree against transformers.

    python3 tools/bench_engine.py [--sizes small,medium] [--budgets 8,32,128]
                                  [--new-tokens 64] [--time-limit 150] [--json PATH] [--no-hf]
    python3 tools/bench_engine.py --sizes kimi-slice [--batches 1,8,32] [--time-limit 540]
                                  [--expert-count counted|uniform]
    python3 tools/bench_engine.py --sizes kimi-k2-slice [--batches 1,8,32] [--no-layer]

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
dense FFNs, router, top-k + shared experts, one embedding row, lm_head) over the HBM
rate measured on the card that runs it (tools/card_roofs.py).  Goal: AR >= transformers; DDTree > AR.

``kimi-slice`` (kdtree_numba/device_weights.py: Kimi-K2's widths, 4 layers, 64 routed experts,
23.5 GB of bf16 weights drawn by CuPy on the GPU in seconds; no HF export, no transformers
baseline, no model drafter): for each ``--batches`` entry (default 1), AR, then DDTree with the
replay drafter at each budget (default 8, 32, 64, 128, 256), a 128-token prompt per request.
A budget ``auto`` (``--budgets 8,32,64,auto``) adds a row whose rounds each pick their budget
among the list's integers (kdtree_numba/budget.py); its warm-up first runs each of them as a
fixed budget, then auto, and its JSON row keeps the budgets chosen, the policy's estimates and
``auto_policy``: "fresh per generate".  Every call, the timed one included, gets a fresh
policy that climbs from its start, as kdtree-run's one ``--budget auto`` call does (the
harder case for a short generation: ``generate(budget="auto")`` would keep one across calls,
budget.kept_auto_budget, and a server's later calls start from what it measured).
Each row has its own roofs (tools/engine_roof.py): every forward's roof is the larger of the
bytes of weights it reads (attention, dense FFN, router, shared expert, lm_head, one embedding
row per distinct token id, and in each MoE layer only the distinct routed experts its tokens
chose) over the card's measured HBM rate and its matrix FLOPs over 51 TFLOP/s (fp32 FMA; it binds only for wide
verifies); the row prints its mean decode or verify time per round beside the mean roof of
those forwards, and its tok/s beside tokens / the sum of every forward's roof (prefill
included, as in the measured tok/s).  The distinct experts are counted from the routing of an
untimed eager re-run of the same generation (``--expert-count counted``, the default) or set to
the uniform-routing expectation E (1 - (1 - k/E)^n) (``uniform``).

``--gemm`` (device sizes): ``auto`` (the default) is kdtree-run's rule
(``backends.auto_gemm``): both Kimi slices on bf16 tensor cores, where their rows have been
measured (kimi-k2-slice's int4 experts then on the W4A16 tensor-core kernel at every M);
``cuda-cores,tensor-cores`` measures both, one model each.

``kimi-k2-slice`` (issue 39): Kimi-K2 as it ships, the same widths with all 384 routed experts
(top-8) in int4-group (W4A16, group 32; drawn as packed words on the device,
device_weights.random_int4_experts: 9.5 GB a MoE layer, never a bf16 copy), the rest bf16;
default budgets 8, 16, 32, 64.  Its rows are kimi-slice's, the experts' bytes priced at 0.5625
a weight (the roofs' ``engine_itemsize``), so each verify's distinct experts (~116 of 384 at
17 nodes under uniform routing) stand beside its bytes roof.  After its rows, with the model
freed, one MoE layer's decode (M = 1, route + 8 routed + the shared expert) with its experts
in int4 and then in bf16 (33.8 GB; tools/bench_layers.py's "int4" section; ``--no-layer``
skips it), kept in the JSON as ``moe_layer_rows``.  Between rows the CUDA
graphs are dropped (a verify graph holds GBs of activations at these widths); each row's
warm-up call captures its own.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
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

from kdtree_numba.backends import GEMM_CHOICES, auto_gemm, make_backend  # noqa: E402
from kdtree_numba.budget import DEFAULT_CANDIDATES, AutoBudget  # noqa: E402
from kdtree_numba.cli_checks import budget_value  # noqa: E402
from kdtree_numba.bundle import (SIZES, drafter_config, random_weights,  # noqa: E402
                                 size_config)
from kdtree_numba.device_weights import (kimi_k2_slice_config, kimi_slice_config,  # noqa: E402
                                         random_model)
from kdtree_numba.drafter import ModelDrafter, ReplayDrafter  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint, import_hf  # noqa: E402
from kdtree_numba.config import weight_shapes  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from engine_roof import (FLOPS_PER_S, HBM_BYTES_PER_S, TENSOR_FLOPS_PER_S,  # noqa: E402
                         RoutingCounter,
                         engine_itemsize, forward_bytes, forward_flops, moe_layers,
                         roof_seconds, uniform_records)

BLOCK_LEN = 8
# sizes whose random weights are drawn on the GPU (kdtree_numba/device_weights.py): no HF
# export, no transformers baseline, no model drafter; their defaults
DEVICE_SIZES = {"kimi-slice": kimi_slice_config, "kimi-k2-slice": kimi_k2_slice_config}
DEVICE_BUDGETS, DEVICE_PROMPT_LEN = "8,32,64,128,256", 128
# kimi-k2-slice: Kimi-K2 as it ships, its 384 routed experts int4-group (group 32, W4A16)
DEVICE_EXPERTS = {"kimi-k2-slice": "int4"}
SIZE_BUDGETS = {"kimi-k2-slice": "8,16,32,64"}
INT4_GROUP = 32
HOST_BUDGETS, HOST_PROMPT_LEN = "8,32,128", 32


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
    return time_generate_batch(model, [prompt], n_new, **kw)


MAX_WARMUPS = 3


def time_generate_batch(model, prompts, n_new, **kw):
    """The steady state: the very same call repeated until one, after the first, captures no
    CUDA graph (at most MAX_WARMUPS + 1 calls), and that call is the measurement.  A graph is captured on its
    key's second sight (kdtree_numba/graphs.py), so the second call still captured the
    prefill and every once-per-call shape: a second-call measurement (runs up to 74) paid
    ~15 ms of capture for the prefill and ~1 ms in some rounds.  (An 8-token warm-up once left
    drafter shapes to the measured call: the slow first model-drafter rows of runs 12-15.)
    The row's ``graph_captures`` says what the measured call captured: 0 but when the warm-ups
    ran out.  It counts the target's graphs only: a model drafter's own are not checked."""
    if isinstance(kw.get("budget"), AutoBudget):
        warm_auto(model, prompts, n_new, kw)
    generate(model, prompts, n_new, **per_call(kw))
    for _ in range(MAX_WARMUPS):
        res = generate(model, prompts, n_new, **per_call(kw))
        if not res.stats.graph_captures:
            break
    return res


def per_call(kw):
    """generate()'s keywords for one call: an AutoBudget given is a template, copied unused
    for each call, so every measured generate climbs from the start as kdtree-run's
    ``--budget auto`` does (a policy carried over from the warm-ups would start trained)."""
    policy = kw.get("budget")
    return dict(kw, budget=copy.deepcopy(policy)) if isinstance(policy, AutoBudget) else kw


class ReplayedBudgets(AutoBudget):
    """The budgets a measured ``--budget auto`` generation chose, round by round: the eager
    re-run that counts the routing must verify the trees the timed run verified, not those a
    policy of its own (timing its own rounds) would pick."""

    def __init__(self, budgets):
        super().__init__(sorted(set(budgets)))
        self.sequence = list(budgets)

    def next_budget(self) -> int:
        return self.sequence[self.round]


def warm_auto(model, prompts, n_new, kw):
    """Before an auto row's warm-ups: every candidate budget as a fixed budget, to its steady
    state (each compiles its shapes and captures its verify graph), since the measured climb
    may first visit a budget its warm-ups did not (run 90, the demo pair: one compile inside
    the timed run cost 7.3 s)."""
    for b in kw["budget"].candidates:
        time_generate_batch(model, prompts, n_new, **dict(kw, budget=b))


class Budget:
    """The run's time limit: a measurement of a kind starts only if the time left exceeds what
    the last one of that kind took (with 20% slack); the first of a kind always starts."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.last: dict[str, float] = {}

    def left(self) -> float:
        return self.end - time.perf_counter()

    def allows(self, kind: str, guess: float = 0.0) -> bool:
        """``guess``: seconds to assume for a kind not measured yet (e.g. the same method at
        a smaller batch)."""
        return self.left() > 1.2 * self.last.get(kind, guess) and self.left() > 0

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
                prefill_ms=1e3 * st.time.get("prefill", 0.0),
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
    prompt_len = args.prompt_len or HOST_PROMPT_LEN
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()
    n_new = args.new_tokens

    ar = budget.run("ar", lambda: time_generate(model, prompt, n_new))
    ar_row = row(size, "ar", ar, roof)
    ctx = dict(ar=ar_row, hf_tps=None, out_rows=out_rows, json_path=args.json)
    finish_row(ar_row, **ctx)
    future = prompt + ar.tokens[0] + [0] * (BLOCK_LEN + 2)

    def ddtree_rows(kind):
        budgets = args.budgets or _budgets(HOST_BUDGETS)
        for b in budgets:
            b = auto_policy(budgets) if b == "auto" else b
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


# ----------------------------------------------------------------------------- device sizes

def fresh_graphs(model):
    """Drop the model's CUDA graphs and generation cache, and CuPy's cached blocks: at Kimi's
    widths a verify graph holds GBs of activations (docs/ENGINE.md, "Known limits"), so each
    row captures its own (its warm-up call does) instead of keeping every row's."""
    if model.graphs is not None:
        model.graphs = model.new_graphs()
    model.generation_cache = None
    gc.collect()        # a GraphCache sits in a reference cycle (its pool's allocator)
    model.backend.free_deferred()
    if model.backend.on_gpu:
        model.backend.xp.get_default_memory_pool().free_all_blocks()


def roof_fields(cfg, records, itemsize, tokens, flops_per_s=FLOPS_PER_S):
    """A row's roof columns from its forwards' records (prefill first, then one per AR step or
    DDTree round): each step's roof (its own tokens and distinct experts), and the tokens per
    second if every forward, prefill included, ran at its roof."""
    pairs = [roof_seconds(cfg, r, itemsize, flops_per_s) for r in records]
    secs = [max(p) for p in pairs]
    steps, step_secs = records[1:], secs[1:]
    experts = [e for r in steps for e in r.experts]

    def mean_ms(values):
        return 1e3 * float(np.mean(values)) if steps else 0.0
    return dict(roof_tokens_per_s=tokens / sum(secs),
                step_roof_ms=mean_ms(step_secs),
                step_bytes_roof_ms=mean_ms([p[0] for p in pairs[1:]]),
                step_flops_roof_ms=mean_ms([p[1] for p in pairs[1:]]),
                step_roof_ms_range=[1e3 * min(step_secs), 1e3 * max(step_secs)]
                if steps else None,
                step_rows=steps[0].rows if steps else 0,
                distinct_experts=float(np.mean(experts)) if experts else 0.0,
                distinct_experts_range=[min(experts), max(experts)] if experts else None,
                distinct_tokens=float(np.mean([r.tokens for r in steps])) if steps else 0.0,
                prefill_roof_ms=1e3 * secs[0], step_roofs_ms=[1e3 * t for t in step_secs])


def device_row(size, cfg, model, prompts, n_new, args, itemsize, budget_nodes=None,
               drafter=None):
    """One kimi-slice row: the timed generate (after its warm-up), then the roofs of its
    forwards, with the experts counted from an untimed eager re-run of the same generation
    (RoutingCounter), or for uniform routing (``--expert-count uniform``)."""
    kw = {} if drafter is None else dict(method="ddtree", drafter=drafter, budget=budget_nodes)
    auto = isinstance(budget_nodes, AutoBudget)
    fresh_graphs(model)
    res = time_generate_batch(model, prompts, n_new, **kw)
    bs = len(prompts)
    extra = dict(batch=bs, expert_count=args.expert_count)
    if auto:
        extra["budgets_chosen"] = dict(sorted(collections.Counter(res.stats.budgets).items()))
        extra["budget_auto"] = res.stats.budget_auto
        extra["auto_policy"] = "fresh per generate"        # per_call: never a kept one
    if args.expert_count == "counted":
        fresh_graphs(model)     # the eager re-run needs none of the timed call's graphs
        again_kw = dict(kw, budget=ReplayedBudgets(res.stats.budgets)) if auto else kw
        with RoutingCounter(model) as counter:
            again = generate(model, prompts, n_new, **again_kw)
        records = counter.records()
        extra["routing_run_same_tokens"] = again.tokens == res.tokens
        tokens = again.stats.new_tokens
        if len(records) != 1 + again.stats.rounds:
            print(f"# {size}: {len(records)} forwards counted for {again.stats.rounds} "
                  f"rounds", file=sys.stderr)
    else:
        widths = [1] * res.stats.rounds if drafter is None else \
            [b + 1 for b in res.stats.budgets]
        records = uniform_records(cfg, bs * max(len(p) for p in prompts),
                                  [bs * w for w in widths])
        tokens = res.stats.new_tokens
    tensor = model.backend.gemm.startswith("tensor-cores")
    fields = roof_fields(cfg, records, itemsize, tokens,
                         TENSOR_FLOPS_PER_S if tensor else FLOPS_PER_S)
    extra["gemm"] = model.backend.gemm + (" + bf16 cache" if model.kv_cache == "bfloat16"
                                          else "")
    step = "decode" if drafter is None else "verify"
    extra["step_ms"] = 1e3 * res.stats.time[step] / max(res.stats.rounds, 1)
    method = "ar" if drafter is None else "ddtree/replay"
    r = row(size, method, res, fields.pop("roof_tokens_per_s"), **extra, **fields)
    return res, r


def bench_device_size(size, args, budget: Budget, out_rows, backend="numba"):
    """A size built on the device (DEVICE_SIZES): per ``--gemm`` setting (a model of the same
    weights on ``make_backend(backend, gemm=...)``) and per batch, AR then replay DDTree at
    each budget, each row with its roofs.  ``backend``: "numba" (the GPU); the tests run tiny
    configs through "reference"."""
    for gemm in args.gemm:
        if gemm == "auto":       # kdtree-run's rule, from the size's width and experts
            gemm = auto_gemm(DEVICE_SIZES[size]().hidden_size,
                             DEVICE_EXPERTS.get(size) == "int4")[0] if backend == "numba" \
                else "cuda-cores"
        if not budget.allows(f"model/{gemm}", 0.0):
            print(f"# {size}: time limit: skipping gemm {gemm}", file=sys.stderr)
            return
        be = make_backend(backend, gemm=gemm)
        bench_device_model(size, args, budget, out_rows, be)
    if DEVICE_EXPERTS.get(size) == "int4" and backend == "numba" \
            and not getattr(args, "no_layer", False):
        if budget.allows("moe-layer", budget.last.get("moe-layer", 0.0)):
            budget.run("moe-layer", lambda: moe_layer_rows())
        else:
            print(f"# {size}: time limit: skipping the MoE layer's int4 vs bf16 row",
                  file=sys.stderr)


LAYER_ROWS: list = []      # the MoE layer rows (tools/bench_layers.py's "int4" section)


def moe_layer_rows():
    """One Kimi-K2 MoE layer's decode (M = 1: route, then 8 routed experts + the shared one)
    with its 384 experts in int4 and then in bf16 (33.8 GB, after the model and the int4
    experts are freed): tools/bench_layers.py's "int4" section at M = 1, its rows printed
    and kept in the JSON ("moe_layer_rows")."""
    import cupy
    import bench_layers
    import card_roofs
    from kdtree_numba import layers
    from kdtree_numba.compat import cuda
    card_roofs.apply(bench_layers)
    ctx = dict(cp=cupy, cuda=cuda, layers=layers, timer=bench_layers.GpuTimer(cupy))
    print("\n# one MoE layer (Kimi-K2: 384 experts, top-8, bf16 shared), decode M = 1: "
          "int4-group experts vs bf16 experts")
    rows: list = []
    bench_layers.bench_int4(ctx, rows, time.perf_counter() + 120, ms=(1,))
    LAYER_ROWS.extend(rows)


def bench_device_model(size, args, budget: Budget, out_rows, backend):
    """bench_device_size's rows for one model of ``size`` on ``backend`` (a Backend: its
    ``gemm`` names the rows), its weights dropped at the end."""
    cfg = DEVICE_SIZES[size]()
    experts = DEVICE_EXPERTS.get(size, "same")
    t0 = time.perf_counter()
    model = random_model(cfg, backend, seed=args.seed, dtype=args.dtype,
                         kv_cache=args.kv_cache, experts=experts)
    model.backend.synchronize()
    n_params = sum(int(np.prod(s)) for s in weight_shapes(cfg).values())
    stored = 2 if args.dtype == "bfloat16" else 4
    itemsize = engine_itemsize(stored, 0.5 + 2 / INT4_GROUP if experts == "int4" else None)
    k, E, n_moe = cfg.num_experts_per_tok, cfg.n_routed_experts, len(moe_layers(cfg))
    one = forward_bytes(cfg, 1, [k] * n_moe, itemsize)
    every = forward_bytes(cfg, cfg.vocab_size, [E] * n_moe, itemsize)
    prompt_len = args.prompt_len or DEVICE_PROMPT_LEN
    gemm = model.backend.gemm
    rate = TENSOR_FLOPS_PER_S if gemm.startswith("tensor-cores") else FLOPS_PER_S
    print(f"\n# {size}, GEMMs on {gemm}, {args.kv_cache} latent cache: "
          f"{n_params / 1e9:.2f} B parameters ({args.dtype}"
          f"{', int4-group routed experts' if experts == 'int4' else ''}) "
          f"drawn on the device in {time.perf_counter() - t0:.1f} s; the engine holds "
          f"{every / 1e9:.2f} GB; one token reads {one / 1e9:.2f} GB: AR roof "
          f"{HBM_BYTES_PER_S / one:.0f} tok/s at batch 1 ({HBM_BYTES_PER_S / 1e12:.2f} TB/s; its "
          f"{forward_flops(cfg, 1) / 1e9:.1f} GFLOP take "
          f"{1e3 * forward_flops(cfg, 1) / rate:.3f} ms at {rate / 1e12:.0f} TFLOP/s).  A "
          f"forward's roof: max(weight bytes it reads / "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s, its FLOPs / "
          f"{rate / 1e12:.0f} TFLOP/s).  Greedy, {args.new_tokens} new tokens after a "
          f"{prompt_len}-token prompt per request; CUDA graphs "
          f"{'on' if model.graphs is not None else 'off'}; experts per step: "
          f"{args.expert_count}"
          f"{' (routing of an eager re-run)' if args.expert_count == 'counted' else ''}.")
    rng = np.random.default_rng(0)
    budgets = args.budgets or _budgets(SIZE_BUDGETS.get(size, DEVICE_BUDGETS))
    previous = None
    try:
        for bs in args.batches:
            prompts = rng.integers(0, cfg.vocab_size, (bs, prompt_len)).tolist()
            guess = budget.last.get(f"ar/{previous}", 0.0)
            if not budget.allows(f"ar/{bs}", guess):
                print(f"# {size}: time limit: skipping batch {bs}", file=sys.stderr)
                return
            ar, ar_row = budget.run(f"ar/{bs}", lambda: device_row(
                size, cfg, model, prompts, args.new_tokens, args, itemsize))
            ctx = dict(ar=ar_row, hf_tps=None, out_rows=out_rows, json_path=args.json)
            finish_row(ar_row, **ctx)
            futures = [p + t + [0] * (BLOCK_LEN + 2) for p, t in zip(prompts, ar.tokens)]
            for b in budgets if not args.no_replay else ():
                b = auto_policy(budgets) if b == "auto" else b
                kind = f"replay/{bs}"
                if not budget.allows(kind, budget.last.get(f"replay/{previous}", 0.0)):
                    print(f"# {size}: time limit: skipping batch {bs} from budget {b}",
                          file=sys.stderr)
                    break
                drafter = ReplayDrafter(model.backend, cfg.vocab_size, futures,
                                        args.agreement, on_device=True)
                res, r = budget.run(kind, lambda: device_row(
                    size, cfg, model, prompts, args.new_tokens, args, itemsize, b, drafter))
                r["same_tokens_as_ar"] = res.tokens == ar.tokens
                finish_row(r, **ctx)
            previous = bs
    finally:
        fresh_graphs(model)
        del model           # the next --gemm setting builds its own copy of the weights
        gc.collect()
        if backend.on_gpu:
            backend.xp.get_default_memory_pool().free_all_blocks()


# ----------------------------------------------------------------------------- output

def finish_row(r, ar, hf_tps, out_rows, json_path):
    """Add the ratios, print the row and rewrite the JSON: a timeout keeps what was measured."""
    r["vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
    # after the prefill (which a one-off prompt shape runs eagerly: tools/profile_ops.py)
    r["decode_vs_ar"] = (r["decode_tokens_per_s"] / ar["decode_tokens_per_s"]
                         if ar.get("decode_tokens_per_s") else None)
    r["vs_hf"] = r["tokens_per_s"] / hf_tps if hf_tps else None
    out_rows.append(r)
    print_rows([r], header_once=True)
    write_json(out_rows, json_path)


def write_json(out_rows, json_path):
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": out_rows, "hbm_bytes_per_s": HBM_BYTES_PER_S,
                       "moe_layer_rows": LAYER_ROWS}, fh, indent=1, default=str)


def summarise(out_rows, json_path):
    """The final tables: every row measured, vs-HF ratios filled in once HF was measured."""
    hf = {r["size"]: r["tokens_per_s"] for r in out_rows if r["method"] == "hf"}
    for r in out_rows:
        r["vs_hf"] = r["tokens_per_s"] / hf[r["size"]] if r["size"] in hf else None
    write_json(out_rows, json_path)
    print(f"\n## Summary ({len(out_rows)} rows)")
    for device in (False, True):
        group = [r for r in out_rows if _is_device_row(r) == device]
        if group:
            print()
            print_header(device)
            print_rows(group)


def _is_device_row(r) -> bool:
    return "step_roof_ms" in r


def print_header(device: bool = False):
    if device:
        print("| size | gemm | batch | method | budget | tok/s | roof tok/s | prefill ms (its "
              "roof) | tau | ms/round: draft / "
              "tree / verify / accept / compact | step ms (decode or verify) | its roof ms "
              "(bytes / FLOPs) | "
              "step / roof | distinct experts per MoE layer (min-max) of step tokens | vs AR | "
              "vs AR after the prefill | tokens = AR |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
              flush=True)
        return
    print("| size | method | budget | tok/s | roof tok/s | goal | tau | ms/round: draft / tree "
          "/ verify / accept / compact | vs AR | vs HF | tokens = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


_SHOWN: set = set()     # the live tables whose header is printed


def print_rows(rows, header_once: bool = False):
    for r in rows:
        m = r["ms_per_round"]
        split = " / ".join(f"{m.get(k, 0):.2f}" for k in
                           ("draft", "tree_build", "verify", "accept", "compaction"))
        if r["method"] == "ar":
            split = f"decode {m.get('decode', 0):.2f}"
        if r["method"] == "hf":
            split = "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        same = r.get("same_tokens_as_ar", "-")
        device = _is_device_row(r)
        if header_once and device not in _SHOWN:
            _SHOWN.add(device)
            print_header(device)
        if device:
            lo, hi = r["distinct_experts_range"] or (0, 0)
            after = f"{r['decode_vs_ar']:.2f}x" if r.get("decode_vs_ar") else "-"
            print(f"| {r['size']} | {r.get('gemm', 'cuda-cores')} | {r['batch']} | "
                  f"{r['method']} | {r['budget'] or '-'} | "
                  f"{r['tokens_per_s']:.1f} | {r['roof_tokens_per_s']:.0f} | "
                  f"{r.get('prefill_ms', 0):.1f} ({r.get('prefill_roof_ms', 0):.1f}) | {tau} | "
                  f"{split} | "
                  f"{r['step_ms']:.2f} | {r['step_roof_ms']:.3f} ({r['step_bytes_roof_ms']:.3f}"
                  f" / {r['step_flops_roof_ms']:.3f}) | "
                  f"{r['step_ms'] / r['step_roof_ms']:.1f}x | {r['distinct_experts']:.1f} "
                  f"({lo:.0f}-{hi:.0f}) of {r['step_rows']} | {r['vs_ar']:.2f}x | {after} | "
                  f"{same} |", flush=True)
            continue
        goal = {"ar": ">= HF", "hf": "-"}.get(r["method"], "> AR")
        vs_hf = f"{r['vs_hf']:.2f}x" if r.get("vs_hf") else "-"
        print(f"| {r['size']} | {r['method']} | {r['budget'] or '-'} | {r['tokens_per_s']:.1f} |"
              f" {r['roof_tokens_per_s']:.0f} | {goal} | {tau} | {split} | {r['vs_ar']:.2f}x |"
              f" {vs_hf} | {same} |", flush=True)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def auto_policy(budgets) -> AutoBudget:
    """An ``auto`` row's policy template: it chooses among the run's fixed budgets (AutoBudget's
    own candidates when there are none), so its rows sit beside the ones it picks from."""
    return AutoBudget([b for b in budgets if b != "auto"] or DEFAULT_CANDIDATES)


def _budgets(text: str) -> list:
    """``--budgets``: integers and ``auto`` (kimi-slice: a row choosing each round's budget
    among the list's integers, or AutoBudget's own candidates when there are none)."""
    out = [budget_value(v) for v in text.split(",")]     # kdtree-run's --budget parsing
    for v in out:
        if v != "auto" and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"a budget is an integer >= 1 or 'auto', got {v!r}")
    return out


class _Stop(BaseException):
    """SIGTERM (e.g. from ``timeout``): stop measuring, still print what was measured.  Not an
    Exception, so the transformers step's ``except Exception`` cannot swallow it."""


def _stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium",
                   help=f"small, medium (HF export + import) and {', '.join(DEVICE_SIZES)} "
                        f"(random weights drawn on the GPU)")
    p.add_argument("--budgets", help=f"DDTree budgets (default {HOST_BUDGETS}; "
                                     f"{DEVICE_BUDGETS} for kimi-slice, "
                                     f"{SIZE_BUDGETS['kimi-k2-slice']} for kimi-k2-slice); "
                                     f"'auto' adds a row whose every round picks among the "
                                     f"list's integers (kdtree-run's --budget auto)")
    p.add_argument("--batches", default="1",
                   help=f"requests per generate ({', '.join(DEVICE_SIZES)} only; small and "
                        f"medium run batch 1)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int,
                   help=f"prompt tokens per request (default {HOST_PROMPT_LEN}; "
                        f"{DEVICE_PROMPT_LEN} for {', '.join(DEVICE_SIZES)})")
    p.add_argument("--expert-count", choices=("counted", "uniform"), default="counted",
                   help="distinct experts behind each step's roof: counted from the routing "
                        "of an untimed eager re-run, or expected under uniform routing")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help=f"weights of {', '.join(DEVICE_SIZES)}")
    p.add_argument("--seed", type=int, default=0, help=f"{', '.join(DEVICE_SIZES)} weights")
    p.add_argument("--kv-cache", choices=("float32", "bfloat16"), default="float32",
                   help=f"{', '.join(DEVICE_SIZES)}: the latent cache's dtype (Model kv_cache)")
    p.add_argument("--gemm", default="auto",
                   help=f"{', '.join(DEVICE_SIZES)}: comma-separated make_backend gemm "
                        f"settings, each a model of its own ({', '.join(GEMM_CHOICES)}; auto: "
                        f"kdtree-run's rule, tensor cores for kimi-slice and kimi-k2-slice)")
    p.add_argument("--agreement", type=float, default=0.9, help="replay drafter agreement")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-replay", action="store_true", help="skip the replay-drafter rows")
    p.add_argument("--no-layer", action="store_true",
                   help="kimi-k2-slice: skip the one-MoE-layer int4 vs bf16 experts rows")
    p.add_argument("--time-limit", type=float, default=150.0,
                   help="seconds for the whole run (checked before each measurement)")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)
    import engine_roof
    import card_roofs
    print(f"# {card_roofs.describe(card_roofs.apply(engine_roof, sys.modules[__name__]))}")
    try:
        args.budgets = _budgets(args.budgets) if args.budgets else None
    except ValueError as e:
        p.error(f"--budgets: {e}")
    args.batches = _ints(args.batches)
    args.gemm = args.gemm.split(",")
    if any(g not in ("auto", *GEMM_CHOICES) for g in args.gemm):
        p.error(f"--gemm takes auto, {', '.join(GEMM_CHOICES)}")
    sizes = args.sizes.split(",")
    unknown = [z for z in sizes if z not in DEVICE_SIZES and z not in SIZES]
    if unknown:
        p.error(f"unknown size {unknown[0]!r}")
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
    print(f"Engine tokens/s, greedy, {args.new_tokens} new tokens; roof = weight bytes a "
          f"forward reads / {HBM_BYTES_PER_S / 1e12:.2f} TB/s (measured on this card); time limit {args.time_limit:.0f} s.")
    if any(z not in DEVICE_SIZES for z in sizes):
        print(f"small/medium: batch 1, a {args.prompt_len or HOST_PROMPT_LEN}-token prompt, "
              f"roof = float32 bytes one token reads.")
    signal.signal(signal.SIGTERM, _stop)
    try:
        for size in sizes:
            if size in DEVICE_SIZES:
                bench_device_size(size, args, budget, rows)
            else:
                bench_size(size, args, budget, rows)
    except (_Stop, KeyboardInterrupt) as e:
        print(f"# stopped ({e!r}): summary of what was measured", file=sys.stderr)
    finally:
        summarise(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Console entry points: ``kdtree-run``, ``kdtr-make-model`` (``kdtr-import-hf`` is in
hf_import.py).

``kdtree-run`` with no ``--model`` runs the shipped demo target (kdtree_numba/demo: a trained
8.75 M-parameter DeepSeek-V3-architecture code model with its tokenizer), so it takes text and
gives text anywhere; with ``--method ddtree`` and no ``--drafter`` that model drafts with
``kdtree_numba.demo.DEFAULT_DRAFTER``, the trained DFlash drafter shipped beside it.  With no
prompt it uses the built-in text prompt ``def fibonacci(n):`` on a model with a tokenizer, the
ids ``1,2,3,4`` on one without.  On a GPU it says whether the kernels load from the disk cache
(kdtree_numba/kernel_cache.py) or compile now, with a line every 5 s until the first token; a
cold cache is first filled in parallel from a kernel manifest while the bundles load
(``--precompile``; kdtree_numba/precompile.py), and each GPU run records its kernels for the
next.  Stdout carries only the output (streamed text, text blocks, token ids or one JSON
object: kdtree_numba/cli_output.py), notices, progress and stats go to stderr.

Bad input is one line on stderr and exit 2, checked before any work starts
(kdtree_numba/cli_checks.py; ``formats.console.run_console``: ``--debug`` or
``KDTREE_DEBUG=1`` shows the traceback).  Bundles are CRC32C-checked as they load
(``--no-verify`` skips it and says so).  Loading, writing and generating show a progress line
on a terminal (never in ``--json`` mode or when stderr is piped, unless ``--progress``).
``--plot PATH.png`` draws the run's acceptance lengths and one round's tree afterwards
(kdtree_numba/plots.py; matplotlib, the ``plot`` extra).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

import numpy as np

from formats.console import (ArgumentParser, UsageError, add_debug_flag, refuse_existing,
                             run_console, writing)
from formats.errors import KdtrError
from formats.progress import ProgressBar
from kdtree_numba import demo, kernel_cache, kernel_recipes, plots, precompile
from kdtree_numba import cpu
from kdtree_numba import runtime
from kdtree_numba.backends import GEMM_CHOICES, PRECISIONS
from kdtree_numba.bundle import (SIZES, BundleError, check_output_path, dflash_shapes,
                                 make_random_bundle, read_dflash_spec)
from kdtree_numba.cli_checks import (DEFAULT_PROMPT, DEFAULT_TEXT_PROMPT, budget_value,
                                     bundle_problem, gemm_choice,
                                     check_against_model, check_options, encode_prompts,
                                     open_backend, plan_drafter, plan_model, read_prompts)
from kdtree_numba.cli_output import TextStream, json_result, print_result, same_terminal
from kdtree_numba.config import weight_shapes
from kdtree_numba.drafter import (ORACLE_FORM, BlockDrafter, DFlashDrafter, ModelDrafter,
                                  NoisyOracleDrafter)
from kdtree_numba.device_round import device_rounds_possible
from kdtree_numba.engine import generate
from kdtree_numba.kvcache import CACHE_DTYPES
from kdtree_numba.model import Model

__all__ = ["run_main", "make_model_main", "default_model", "DEFAULT_BLOCK_LEN"]

DEFAULT_SEED = 0
DEFAULT_BLOCK_LEN = 8
# on a GPU (the CPU path's is cpu.DEFAULT_BUDGET): the demo pair's best fixed budget on the
# H100 with device rounds since small weights stay on the skinny kernel past 16 verify rows
# (run 147: 2.03x AR against 1.93x at 8 and 1.95x at 32; docs/BENCHMARKS.md, "Demo pair")
DEFAULT_BUDGET = 16


def _log(prog: str, msg: str) -> None:
    print(f"{prog}: {msg}", file=sys.stderr, flush=True)


def default_model(backend="auto", verify: bool = True):
    """kdtree-run's model without ``--model``: the shipped demo target (kdtree_numba/demo)."""
    return Model.load(demo.TARGET, backend, verify=verify)



class _HelpFormatter(argparse.HelpFormatter):
    """Every option's default in ``--help`` (argparse's ArgumentDefaultsHelpFormatter, minus
    the noise of flags and of options whose help already says what happens without them)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or "default" in text):
            return text
        return f"{text} (default: %(default)s)"


def _progress_bar(args, desc: str, total=None, unit: str = "B") -> ProgressBar:
    """A progress line on a terminal; silent when stderr is piped or in --json mode, unless
    --progress asks for it."""
    bar = ProgressBar(desc, total, unit, force=args.progress)
    if getattr(args, "json", False) and not args.progress:
        bar.enabled = False
    return bar


def _lookup_weight(text: str):
    """``--prompt-lookup``'s value: off (False) or a weight in (0, 1) (on: runtime.LOOKUP_ON)."""
    try:
        return runtime.parse_lookup_weight(text) or False
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run_parser() -> ArgumentParser:
    ids = ",".join(map(str, DEFAULT_PROMPT))
    text = repr(DEFAULT_TEXT_PROMPT)
    p = ArgumentParser(
        prog="kdtree-run", formatter_class=_HelpFormatter,
        description="Generate with a DeepSeek-V3/Kimi-K2-architecture model bundle: "
        "autoregressive (ar) or DDTree speculative decoding (ddtree).",
        epilog=f"Without --model: the shipped demo target, a trained 8.75 M-parameter code "
        f"model with its tokenizer. Without a prompt: the built-in text prompt {text} on a "
        f"model with a tokenizer, the ids {ids} on one without. Text prompts give text on "
        f"stdout (streamed as rounds commit when there is one prompt), id prompts give id "
        f"lines, --json one object with both; notices, progress and stats go to stderr. Bad "
        f"input: one line on stderr, exit 2.")
    p.add_argument("--model", metavar="BUNDLE",
                   help="model bundle (.kdtr) (default: the shipped demo target)")
    p.add_argument("--drafter", metavar="SPEC",
                   help=f"drafter for --method ddtree or chain: a bundle (.kdtr) with the "
                   f"target's "
                   f"vocabulary, or {ORACLE_FORM} (a test/demo drafter that peeks at the "
                   f"target) (default: the shipped DFlash drafter, kdtree_numba/demo/"
                   f"{demo.DRAFTER.name}, for the default model; ignored by --method ar)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", action="append",
                     help=f"a text prompt (needs a model with a tokenizer); repeat it for a "
                     f"batch (default: {text})")
    src.add_argument("--prompt-text-file", metavar="FILE", action="append",
                     help="a file whose whole text is one prompt; repeat it for a batch")
    src.add_argument("--prompt-ids", metavar="IDS",
                     help=f"one prompt: token ids separated by commas (default on a model "
                     f"without a tokenizer: {ids})")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="file with one prompt per line (token ids, commas or spaces)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="new tokens per prompt (prompt + N must fit the model's context)")
    p.add_argument("--method", choices=["ar", "chain", "ddtree"], default="ar",
                   help="ar: one token per forward; ddtree: draft a tree, verify it at once; "
                   "chain: verify the drafter's greedy chain (no tree)")
    p.add_argument("--budget", type=budget_value, default=None, metavar="B",
                   help=f"DDTree tree nodes verified per round, or 'auto': each round's budget "
                   f"chosen from the measured cost and acceptance of the rounds so far "
                   f"(candidates 2 to 256) (default: {DEFAULT_BUDGET} on a GPU, "
                   f"{cpu.DEFAULT_BUDGET} on the CPU at any temperature: one verify fills "
                   f"one {cpu.ROWS}-row GEMM block there; the best measured at T = 0 and, "
                   f"its tree kept to depth {cpu.SAMPLED_DEPTH}, at T = 1)")
    p.add_argument("--block-len", type=int, default=None, metavar="L",
                   help=f"drafter steps per round, the tree's maximum depth (default: "
                   f"{DEFAULT_BLOCK_LEN}; a block drafter bundle drafts its own number)")
    p.add_argument("--backend", choices=["auto", "reference", "numba"], default="auto",
                   help="reference: NumPy, anywhere; numba: the CUDA kernels (a GPU); auto: "
                   "numba on a GPU, else reference")
    p.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="the reference backend's arithmetic: float32 is the CPU path (BLAS, "
                   "batch invariant, so DDTree stays lossless against AR; docs/ENGINE.md, "
                   "'The CPU path'), float64 the exact reference (slow) (default: float32)")
    p.add_argument("--gemm", choices=["auto", *GEMM_CHOICES], default="auto",
                   help="numba only: tensor-cores runs the projections, the experts and the "
                   "lm_head with bf16 weights on bf16 tensor cores (inputs rounded to bf16), "
                   "every op batch invariant, so DDTree's greedy tokens equal AR's whenever the "
                   "accepted path is the tree's first nodes; cuda-cores: float32 on CUDA cores "
                   "(docs/ENGINE.md, 'Tensor cores'); auto: tensor-cores for a target with "
                   "int4-group experts or a hidden size of 4096 or more, else cuda-cores")
    p.add_argument("--kv-cache", choices=list(CACHE_DTYPES), default="float32",
                   help="what the target's latent cache stores: bfloat16 halves its bytes "
                   "(attention then rounds its queries and weights to bf16 and runs on bf16 "
                   "tensor cores: tokens may differ from float32's at near-ties; "
                   "docs/ATTENTION.md, 'The bf16 cache')")
    p.add_argument("--device-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="ddtree/chain with a DFlash drafter: run each round as one device "
                   "program (one CUDA graph), enqueued before the last round is read; the same "
                   "tokens (default: on a GPU, where it pays; docs/ENGINE.md, 'Device "
                   "rounds'; KDTREE_DEVICE_ROUNDS=0/1 too); --no-device-rounds: the "
                   "host-driven round")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="T > 0: sample only from the smallest set of most likely tokens whose "
                   "probability is >= P, renormalised (1: off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="T > 0: sample only from the K most likely tokens, renormalised "
                   "(0: off); with --top-p, top-k applies first")
    p.add_argument("--draft-temperature", type=float, default=None, metavar="TD",
                   help="ddtree: build each round's tree from the drafter's logits / TD (> 1 "
                   "spreads the budget over more candidates per depth); the tree's shape only, "
                   "never the tokens (default: 1; docs/ENGINE.md, 'Draft temperature')")
    p.add_argument("--prompt-lookup", type=_lookup_weight, default=None, metavar="W",
                   help="ddtree: mix the tokens that followed the context's last few tokens "
                   "where they occurred before into each round's draft, at weight W in (0, 1) "
                   "(on: 0.8; off); the tree's shape only, never the tokens (default: "
                   "KDTREE_PROMPT_LOOKUP's; unset: on, except on the exact float64 reference; "
                   "docs/ENGINE.md, 'Prompt lookup')")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="ddtree/chain with a DFlash drafter: its lm_head ranks only the N most "
                   "frequent tokens of its bundle's ranking (tools/draft_vocab.py), the rest "
                   "never drafted; the tree's tokens only, never the tokens committed (default: "
                   "the whole vocabulary, except on the CPU path at T > 0: the "
                   f"{cpu.SAMPLED_DRAFT_VOCAB} most frequent where the bundle ranks them; 0: "
                   "the whole vocabulary; docs/ENGINE.md, 'Draft vocabulary')")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampling seed")
    p.add_argument("--eos", type=int, default=None, metavar="ID",
                   help="stop token id (default: none; every prompt gets N new tokens)")
    p.add_argument("--json", action="store_true",
                   help="print text, tokens and stats as one JSON object")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr even when it is not a terminal, or with "
                   "--json (never while text streams to the same terminal)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check the bundles' tensor checksums (CRC32C) while loading")
    p.add_argument("--plot", metavar="PATH.png",
                   help="draw the run's acceptance-length histogram and one round's tree "
                   "(--method ddtree or chain; needs matplotlib: the plot extra)")
    p.add_argument("--precompile", choices=["auto", "always", "off"], default="auto",
                   help="numba on a GPU: compile the kernels the run needs in parallel, one "
                   "process per core, into the kernel disk cache before it starts (auto: when "
                   "the cache is cold and a kernel manifest lists this model's kernels; "
                   "docs/ENGINE.md, 'First run on a GPU')")
    p.add_argument("--record-kernels", metavar="FILE.json",
                   help="numba backend: add the kernels this run compiled or loaded to the "
                   "kernel manifest FILE.json (kdtree-precompile reads it; a GPU run also "
                   "records into the cache folder's manifest.json by itself)")
    add_debug_flag(p)
    return p


def _start_precompile(prog: str, args, key: str) -> threading.Thread | None:
    """``--precompile``: the kernels compile in worker processes while this one loads the
    bundles (kdtree_numba/precompile.py); the caller joins the thread before generating."""
    if args.precompile == "off":
        return None

    def work():
        try:
            precompile.warm_up(key, lambda msg: _log(prog, msg),
                               force=args.precompile == "always")
        except (precompile.ManifestError, OSError) as e:
            _log(prog, f"warning: no parallel precompile ({e}); the kernels compile in this "
                 f"process")
    thread = threading.Thread(target=work, name="precompile", daemon=True)
    thread.start()
    return thread


def _record_kernels(prog: str, args, key: str, on_gpu: bool, warn) -> None:
    """After a numba run: this machine's manifest learns the run's kernels (a GPU only: the
    simulator's kernels are made for its narrower warps), and ``--record-kernels`` gets them."""
    try:
        if on_gpu:
            precompile.record(key)
            precompile.mark_warm(key)      # this run made (or loaded) every kernel it needs
        if args.record_kernels:
            n, left_out = precompile.record(key, args.record_kernels)
            _log(prog, f"--record-kernels: {n} new kernel entries in {args.record_kernels}")
            for line in left_out:
                warn(f"--record-kernels: no recipe, left out (compiles in the run): {line}")
    except (precompile.ManifestError, OSError) as e:
        warn(f"kernels not recorded: {e}")


def _backend_words(backend, args, target) -> str:
    """The backend as kdtree-run names it: the GPU's with its GEMM setting (and why, where
    ``--gemm auto`` chose it), the CPU path that it is one and how to get the exact reference
    instead."""
    if backend.name != "reference":
        why = f", --gemm auto: {gemm_choice(backend.name, target)[1]}" if args.gemm == "auto" \
            else ""
        return f"{backend.name} (gemm {backend.gemm}{why})"
    if backend.precision == "float64":
        return "reference (float64, the exact NumPy reference)"
    threads = cpu.blas_threads()
    budget = f", budget {args.budget}" if args.method == "ddtree" else ""
    return (f"reference, the float32 CPU path (batch-invariant BLAS, "
            f"{threads if threads else 'its own'} BLAS thread(s){budget}; --precision float64 "
            f"for the exact reference)")


def _load_model(args, target, backend):
    if target.default:
        _log("kdtree-run", f"no --model: using {demo.describe()}, {target.path}")
    bar = _progress_bar(args, f"load {target.path}")
    try:
        return Model.load(target.path, backend, verify=not args.no_verify, progress=bar,
                          kv_cache=args.kv_cache)
    except (BundleError, KdtrError, OSError) as e:
        raise bundle_problem(target.option, target.path, e) from e
    finally:
        bar.close()


def _load_drafter(args, plan, model, backend):
    if plan is None:
        return None
    if plan.kind == "oracle":
        if args.drafter is None and demo.DEFAULT_DRAFTER_PEEKS:
            _log("kdtree-run", f"no --drafter: the default model drafts with "
                 f"oracle:{plan.agreement:g}, a test drafter that runs the target itself and "
                 f"so peeks at its greedy future: tau and speed are an upper bound, not a "
                 f"result (a drafter trained against the target replaces it)")
        else:
            _log("kdtree-run", f"drafter oracle:{plan.agreement:g}: a test/demo drafter that "
                 f"runs the target itself; its speed means nothing")
        return NoisyOracleDrafter(model, plan.block_len, plan.agreement, args.seed)
    bar = _progress_bar(args, f"load {plan.path}")
    try:
        if plan.kind == "block":
            return BlockDrafter.load(plan.path, backend, verify=not args.no_verify,
                                     progress=bar)
        if plan.kind == "dflash":
            return DFlashDrafter.load(plan.path, model, verify=not args.no_verify,
                                      progress=bar, draft_vocab=args.draft_vocab)
        return ModelDrafter.load(plan.path, backend, plan.block_len,
                                 verify=not args.no_verify, progress=bar)
    except (BundleError, KdtrError, OSError) as e:
        raise bundle_problem("--drafter", plan.path, e) from e
    finally:
        bar.close()


class _FirstToken(threading.Event):
    """Set when generation reports its first progress (the prefill's tokens are committed)."""

    def wrap(self, progress):
        def report(done, total):
            self.set()
            if progress is not None:
                progress(done, total)
        return report


def _compile_notice(prog: str, on_gpu: bool, beat: bool = True,
                    every: float = 5.0) -> _FirstToken:
    """On a GPU: say whether the kernels come from the disk cache or compile now (numba
    compiles each on its first launch: ~25 s of a cold first run on the H200), and while they
    compile, a line every ``every`` seconds until the first token, so a first run never looks
    hung.  Returns the event generation sets."""
    first = _FirstToken()
    if not on_gpu:
        return first
    where = kernel_cache.cache_dir()
    if where is None:
        _log(prog, "kernel cache off: the numba kernels compile in this process (about 30 s on "
             "an H200); the timings below include that")
    elif kernel_cache.cache_is_warm():
        _log(prog, f"kernels from the cache {where}")
    else:
        _log(prog, f"compiling the GPU kernels (the first run of this version on this machine, "
             f"about 30 s on an H200; kept in {where} for the next run)")
    if not beat:
        return first
    t0 = time.perf_counter()

    def heartbeat():
        while not first.wait(every):
            _log(prog, f"... compiling kernels and prefilling, {time.perf_counter() - t0:.0f} s")
    threading.Thread(target=heartbeat, name="compile-notice", daemon=True).start()
    return first


def _run(argv: list[str]) -> int:
    prog = "kdtree-run"
    args = _run_parser().parse_args(argv)

    def warn(msg):
        _log(prog, f"warning: {msg}")
    check_options(args)
    if args.temperature == 0 and (args.top_p < 1 or args.top_k > 0):
        warn("--top-p and --top-k shape sampling; at --temperature 0 (greedy) they change "
             "nothing")
    if args.draft_temperature is not None and args.method != "ddtree":
        warn(f"--draft-temperature shapes DDTree's trees; --method {args.method} ignores it")
    if args.prompt_lookup is not None and args.method != "ddtree":
        warn(f"--prompt-lookup shapes DDTree's trees; --method {args.method} ignores it")
    if args.draft_vocab and args.method == "ar":
        warn("--draft-vocab shapes a drafter's proposals; --method ar ignores it")
    source = read_prompts(args)
    target = plan_model(args)
    backend = open_backend(args.backend, args.gemm, args.precision, target)
    args.budget_defaulted = args.budget is None
    if args.budget is None:
        args.budget = DEFAULT_BUDGET if backend.name == "numba" else cpu.DEFAULT_BUDGET
    cfg, codec = target.config, target.codec
    prompts, where = encode_prompts(source, target)
    as_text = source.is_text or (source.ids is None and codec is not None)
    plan = plan_drafter(args, cfg, DEFAULT_BLOCK_LEN, warn)
    check_against_model(args, prompts, where, cfg, plan, backend, warn)
    files = [f for f in (args.model, plan and plan.path) if f]
    if args.no_verify and files:
        _log(prog, f"--no-verify: the tensor checksums of {' and '.join(files)} are not "
             f"checked; a damaged bundle loads without a word")
    if args.record_kernels and backend.name != "numba":
        raise UsageError("--record-kernels needs --backend numba (the reference backend "
                         "compiles no kernels)")
    # --budget auto's rounds visit other budgets than the default's: kernels of their own
    run = "auto" if args.method == "ddtree" and args.budget == "auto" else None
    key = precompile.profile(cfg, plan and plan.kind, plan and plan.config, run) \
        if backend.name == "numba" else None
    warming = _start_precompile(prog, args, key) if backend.name == "numba" and \
        backend.on_gpu else None
    t0 = time.perf_counter()
    model = _load_model(args, target, backend)
    drafter = _load_drafter(args, plan, model, backend)
    if warming is not None:
        warming.join()
    if args.device_rounds:
        why = ("needs --method ddtree or chain" if args.method == "ar" else
               "cannot run with --plot (it copies each round's tree)" if args.plot else
               f"needs a device-only drafter (the DFlash drafter), not {drafter.name}"
               if not device_rounds_possible(drafter) else None)
        if why:
            raise UsageError(f"--device-rounds {why}")
    _log(prog, f"backend {_backend_words(model.backend, args, target)}, {len(prompts)} "
         f"prompt(s), method {args.method}, loaded in {time.perf_counter() - t0:.2f} s; "
         f"generating...")
    stream = TextStream(codec) if as_text and len(prompts) == 1 and not args.json else None
    bar = _progress_bar(args, "generate", len(prompts) * args.max_new_tokens, "tok")
    # no heartbeat lines where the prompt is echoed and the text streams: they would cut it
    first_token = _compile_notice(prog, model.backend.on_gpu,
                                  beat=not (stream is not None and same_terminal()))
    if stream is not None and same_terminal():
        bar.enabled = False     # a \r line on the terminal the text streams to would garble it
        # the prompt, on stderr: the terminal shows prompt + continuation, while stdout (a
        # pipe, a file) holds the continuation alone
        sys.stderr.write(source.texts[0] if source.is_text else DEFAULT_TEXT_PROMPT)
        sys.stderr.flush()
    # --plot only: the rounds' trees are copied on the device, one is read afterwards
    recorder = plots.RoundRecorder(model.backend) if args.plot else None
    # the simulator types no arguments: its launches are noted while --record-kernels asks
    noting = kernel_recipes.recording_launches() if args.record_kernels and \
        not model.backend.on_gpu else contextlib.nullcontext()
    try:
        with noting:
            result = generate(model, prompts, args.max_new_tokens, method=args.method,
                              drafter=drafter, budget=args.budget,
                              temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, eos=args.eos,
                              draft_temperature=args.draft_temperature,
                              prompt_lookup=args.prompt_lookup,
                              progress=first_token.wrap(bar), stream=stream,
                              on_round=recorder,
                              device_rounds=args.device_rounds)
    finally:
        first_token.set()
        bar.close()
    if key is not None:
        _record_kernels(prog, args, key, model.backend.on_gpu, warn)
    stats = result.stats
    if args.json:
        print(json_result(result.tokens, codec, stats))
    elif stream is not None:
        stream.close()
    else:
        print_result(result.tokens, where, codec, as_text)
    if stats.budget_auto:
        per = stats.budget_auto["per_budget"]
        _log(prog, f"--budget auto: best {stats.budget_auto['best']}; rounds, tau and round "
             f"time per budget: " + ", ".join(
                 f"{b}: {r['rounds']} x {r['tau']:.2f} in " + (
                     f"{r['round_ms']:.1f} ms" if r['round_ms'] is not None
                     else "(no steady round)")
                 for b, r in per.items()))
    split = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stats.time.items() if v > 0)
    tau = f", mean tau {stats.mean_tau:.2f}" if args.method != "ar" else ""
    graphs = "" if stats.graph_replays is None else \
        f"; CUDA graphs: {stats.graph_captures} captured, {stats.graph_replays} replays"
    _log(prog, f"{stats.new_tokens} tokens in {stats.seconds:.3f} s "
         f"({stats.tokens_per_s:.1f} tok/s), {stats.rounds} rounds{tau}; {split}{graphs}")
    if recorder is not None:
        _write_plot(args, recorder, result, codec, drafter)
    return 0


def _write_plot(args, recorder, result, codec, drafter) -> None:
    """``--plot``: the histogram of every round's acceptance and request 0's round of median
    acceptance drawn as a tree (kdtree_numba/plots.py)."""
    stats = result.stats
    rt = recorder.pick(stats.tau, result.tokens[0])
    label = (lambda t: codec.decode([t])) if codec is not None else str
    what = "DDTree" if args.method == "ddtree" else "chain"
    budget = f", budget {stats.budget}" if args.method == "ddtree" else ""
    kind, _, where = drafter.name.partition(":")
    name = f"{kind}:{os.path.basename(where)}" if os.sep in where else drafter.name
    title = (f"{what}{budget}, drafter {name}, T = {args.temperature:g}: "
             f"{stats.rounds} rounds, {stats.new_tokens} tokens, mean tau "
             f"{stats.mean_tau:.2f}")
    plots.plot_run(args.plot, stats.tau, rt, label, title)
    drawn = "no round to draw" if rt is None else \
        f"round {rt.index + 1} ({rt.how}) of request 1 as a tree"
    _log("kdtree-run", f"--plot: wrote {args.plot}: the acceptance-length histogram and "
         f"{drawn}")


def run_main(argv=None) -> int:
    """The ``kdtree-run`` entry point; returns the exit code (0, 2 for bad input)."""
    return run_console("kdtree-run", _run, argv)


def _make_model(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="kdtr-make-model", formatter_class=_HelpFormatter,
        description="Write a deterministic random model bundle (weights O(0.1-1), so routing "
        "and attention are not trivial). A drafter is written for a target of the same "
        "--size (same vocabulary): make both with one size.")
    p.add_argument("out", help="output bundle, a name ending in .kdtr")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny",
                   help="tiny: vocabulary 128, small: 1024, medium: 32000 (0.31 B parameters)")
    role = p.add_mutually_exclusive_group()
    role.add_argument("--drafter", action="store_true",
                      help="write the one-layer drafter for the target of that size")
    role.add_argument("--block-drafter", action="store_true",
                      help="write a BlockDrafter bundle for the target of that size")
    role.add_argument("--dflash-drafter", action="store_true",
                      help="write an untrained DFlash drafter bundle for the target of that "
                      "size")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weight dtype")
    p.add_argument("--progress", action="store_true",
                   help="progress line on stderr even when it is not a terminal")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_debug_flag(p)
    args = p.parse_args(argv)
    check_output_path(args.out)
    refuse_existing(args.out, args.force)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be an integer >= 0")
    role = ("dflash_drafter" if args.dflash_drafter else "block_drafter" if args.block_drafter
            else "drafter" if args.drafter else "target")
    t0 = time.perf_counter()
    bar = _progress_bar(args, f"write {args.out}")
    try:
        with writing(args.out):
            cfg = make_random_bundle(args.out, args.size, args.seed, args.dtype, role=role,
                                     progress=bar)
    finally:
        bar.close()
    shapes = weight_shapes(cfg) if role != "dflash_drafter" else \
        dflash_shapes(cfg, len(read_dflash_spec(args.out)[1].target_layer_ids))
    params = sum(int(np.prod(s)) for s in shapes.values())
    _log("kdtr-make-model", f"wrote {args.out} ({role}, {args.size}, {params / 1e6:.2f} M "
         f"parameters, {args.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


def make_model_main(argv=None) -> int:
    """The ``kdtr-make-model`` entry point; returns the exit code (0, 2 for bad input)."""
    return run_console("kdtr-make-model", _make_model, argv)


if __name__ == "__main__":
    sys.exit(run_main())

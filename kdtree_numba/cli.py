"""Console entry points: ``kdtree-run``, ``kdtr-make-model`` (``kdtr-import-hf`` is in
hf_import.py).

``kdtree-run`` with no ``--model`` runs a built-in tiny model (the ``tiny`` size of
kdtree_numba/bundle.py, seed 0, generated deterministically in memory), so it works anywhere;
with ``--method ddtree`` and no ``--drafter`` that built-in model drafts with
``oracle:0.8`` (NoisyOracleDrafter: a test/demo drafter that peeks at the target; see
drafter.py).  With no prompt it uses the built-in prompt ``1,2,3,4``.  Tokens go to stdout (one
line per prompt, or one JSON object with ``--json``), notices and stats to stderr.

Bad input is one line on stderr and exit 2, checked before any work starts
(kdtree_numba/cli_checks.py; ``formats.console.run_console``: ``--debug`` or
``KDTREE_DEBUG=1`` shows the traceback).  Bundles are CRC32C-checked as they load
(``--no-verify`` skips it and says so).  Loading, writing and generating show a progress line
on a terminal (never in ``--json`` mode or when stderr is piped, unless ``--progress``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from formats.console import UsageError, add_debug_flag, run_console
from formats.errors import KdtrError
from formats.progress import ProgressBar
from kdtree_numba.bundle import (SIZES, BundleError, check_output_path, dflash_shapes,
                                 make_random_bundle, random_weights, read_dflash_spec,
                                 size_config)
from kdtree_numba.cli_checks import (BUILTIN_SIZE, DEFAULT_PROMPT, bundle_problem,
                                     check_against_model, check_options, open_backend,
                                     plan_drafter, read_prompts, target_config)
from kdtree_numba.config import weight_shapes
from kdtree_numba.drafter import (ORACLE_FORM, BlockDrafter, DFlashDrafter, ModelDrafter,
                                  NoisyOracleDrafter)
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

__all__ = ["run_main", "make_model_main", "default_model", "DEFAULT_BLOCK_LEN"]

DEFAULT_SEED = 0
DEFAULT_BLOCK_LEN = 8


def _log(prog: str, msg: str) -> None:
    print(f"{prog}: {msg}", file=sys.stderr, flush=True)


def default_model(backend="auto"):
    """The built-in tiny model (deterministic: size tiny, seed 0), built in memory."""
    cfg = size_config(BUILTIN_SIZE)
    return Model(cfg, dict(random_weights(cfg, DEFAULT_SEED)), backend)


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


def _run_parser() -> argparse.ArgumentParser:
    prompt = ",".join(map(str, DEFAULT_PROMPT))
    p = argparse.ArgumentParser(
        prog="kdtree-run", formatter_class=_HelpFormatter,
        description="Generate with a DeepSeek-V3/Kimi-K2-architecture model bundle: "
        "autoregressive (ar) or DDTree speculative decoding (ddtree).",
        epilog=f"Without --model: a built-in tiny model (random weights, seed 0). Without "
        f"--prompt-ids or --prompt-file: the built-in prompt {prompt}. Tokens go to stdout, "
        f"notices, progress and stats to stderr. Bad input: one line on stderr, exit 2.")
    p.add_argument("--model", metavar="BUNDLE",
                   help="model bundle (.kdtr) (default: the built-in tiny model)")
    p.add_argument("--drafter", metavar="SPEC",
                   help=f"drafter for --method ddtree or chain: a bundle (.kdtr) with the "
                   f"target's "
                   f"vocabulary, or {ORACLE_FORM} (a test/demo drafter that peeks at the "
                   f"target) (default: oracle:0.8 for the built-in model; ignored by --method "
                   f"ar)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", metavar="IDS",
                     help=f"one prompt: token ids separated by commas (default: {prompt})")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="file with one prompt per line (token ids, commas or spaces)")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="new tokens per prompt (prompt + N must fit the model's context)")
    p.add_argument("--method", choices=["ar", "chain", "ddtree"], default="ar",
                   help="ar: one token per forward; ddtree: draft a tree, verify it at once; "
                   "chain: verify the drafter's greedy chain (no tree)")
    p.add_argument("--budget", type=int, default=32, metavar="B",
                   help="DDTree tree nodes verified per round")
    p.add_argument("--block-len", type=int, default=None, metavar="L",
                   help=f"drafter steps per round, the tree's maximum depth (default: "
                   f"{DEFAULT_BLOCK_LEN}; a block drafter bundle drafts its own number)")
    p.add_argument("--backend", choices=["auto", "reference", "numba"], default="auto",
                   help="reference: NumPy, anywhere; numba: the CUDA kernels (a GPU); auto: "
                   "numba on a GPU, else reference")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampling seed")
    p.add_argument("--eos", type=int, default=None, metavar="ID",
                   help="stop token id (default: none; every prompt gets N new tokens)")
    p.add_argument("--json", action="store_true",
                   help="print tokens and stats as one JSON object")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr even when it is not a terminal, or with "
                   "--json")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check the bundles' tensor checksums (CRC32C) while loading")
    add_debug_flag(p)
    return p


def _load_model(args, backend):
    prog = "kdtree-run"
    if not args.model:
        _log(prog, "no --model: using the built-in tiny model (random weights, seed 0)")
        return default_model(backend)
    bar = _progress_bar(args, f"load {args.model}")
    try:
        return Model.load(args.model, backend, verify=not args.no_verify, progress=bar)
    except (BundleError, KdtrError, OSError) as e:
        raise bundle_problem("--model", args.model, e) from e
    finally:
        bar.close()


def _load_drafter(args, plan, model, backend):
    if plan is None:
        return None
    if plan.kind == "oracle":
        _log("kdtree-run", f"drafter oracle:{plan.agreement:g}: a test/demo drafter that runs "
             f"the target itself; its speed means nothing")
        return NoisyOracleDrafter(model, plan.block_len, plan.agreement, args.seed)
    bar = _progress_bar(args, f"load {plan.path}")
    try:
        if plan.kind == "block":
            return BlockDrafter.load(plan.path, backend, verify=not args.no_verify,
                                     progress=bar)
        if plan.kind == "dflash":
            return DFlashDrafter.load(plan.path, model, verify=not args.no_verify,
                                      progress=bar)
        return ModelDrafter.load(plan.path, backend, plan.block_len,
                                 verify=not args.no_verify, progress=bar)
    except (BundleError, KdtrError, OSError) as e:
        raise bundle_problem("--drafter", plan.path, e) from e
    finally:
        bar.close()


def _run(argv: list[str]) -> int:
    prog = "kdtree-run"
    args = _run_parser().parse_args(argv)

    def warn(msg):
        _log(prog, f"warning: {msg}")
    check_options(args)
    prompts, where = read_prompts(args)
    backend = open_backend(args.backend)
    cfg = target_config(args)
    plan = plan_drafter(args, cfg, DEFAULT_BLOCK_LEN, warn)
    check_against_model(args, prompts, where, cfg, plan, backend, warn)
    files = [f for f in (args.model, plan and plan.path) if f]
    if args.no_verify and files:
        _log(prog, f"--no-verify: the tensor checksums of {' and '.join(files)} are not "
             f"checked; a damaged bundle loads without a word")
    t0 = time.perf_counter()
    model = _load_model(args, backend)
    drafter = _load_drafter(args, plan, model, backend)
    _log(prog, f"backend {model.backend.name}, {len(prompts)} prompt(s), method {args.method}, "
         f"loaded in {time.perf_counter() - t0:.2f} s; generating...")
    if model.backend.on_gpu:
        # numba compiles each kernel on its first call (~30 s in all on the H200, run 2): say
        # so, or a first run looks hung and its tokens/s mean nothing.
        _log(prog, "the numba kernels compile on first use in this process (about 30 s on "
             "an H200); the timings below include that")
    bar = _progress_bar(args, "generate", len(prompts) * args.max_new_tokens, "tok")
    try:
        result = generate(model, prompts, args.max_new_tokens, method=args.method,
                          drafter=drafter, budget=args.budget, temperature=args.temperature,
                          seed=args.seed, eos=args.eos, progress=bar)
    finally:
        bar.close()
    stats = result.stats
    if args.json:
        print(json.dumps({"tokens": result.tokens, "stats": stats.to_dict()}))
    else:
        for toks in result.tokens:
            print(",".join(str(t) for t in toks))
    split = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stats.time.items() if v > 0)
    tau = f", mean tau {stats.mean_tau:.2f}" if args.method != "ar" else ""
    graphs = "" if stats.graph_replays is None else \
        f"; CUDA graphs: {stats.graph_captures} captured, {stats.graph_replays} replays"
    _log(prog, f"{stats.new_tokens} tokens in {stats.seconds:.3f} s "
         f"({stats.tokens_per_s:.1f} tok/s), {stats.rounds} rounds{tau}; {split}{graphs}")
    return 0


def run_main(argv=None) -> int:
    """The ``kdtree-run`` entry point; returns the exit code (0, 2 for bad input)."""
    return run_console("kdtree-run", _run, argv)


def _make_model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
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
    add_debug_flag(p)
    args = p.parse_args(argv)
    check_output_path(args.out)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be an integer >= 0")
    role = ("dflash_drafter" if args.dflash_drafter else "block_drafter" if args.block_drafter
            else "drafter" if args.drafter else "target")
    t0 = time.perf_counter()
    bar = _progress_bar(args, f"write {args.out}")
    try:
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

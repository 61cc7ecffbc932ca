"""Console entry points: ``kdtree-run``, ``kdtr-make-model`` (``kdtr-import-hf`` is in
hf_import.py).

``kdtree-run`` with no ``--model`` runs a built-in tiny model (the ``tiny`` size of
kdtree_numba/bundle.py, seed 0, generated deterministically in memory), so it works anywhere;
with ``--method ddtree`` and no ``--drafter`` that built-in model drafts with
``oracle:0.8`` (NoisyOracleDrafter: a test/demo drafter that peeks at the target; see
drafter.py).  Tokens go to stdout (one line per prompt, or one JSON object with ``--json``),
progress and stats to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kdtree_numba.bundle import (SIZES, BundleError, make_random_bundle, random_weights,
                                 size_config)
from kdtree_numba.config import weight_shapes
from kdtree_numba.drafter import load_drafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

__all__ = ["run_main", "make_model_main", "default_model"]

DEFAULT_SEED = 0


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_model(backend="auto"):
    """The built-in tiny model (deterministic: size tiny, seed 0), built in memory."""
    cfg = size_config("tiny")
    return Model(cfg, dict(random_weights(cfg, DEFAULT_SEED)), backend)


def _parse_ids(text: str, where: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"kdtree-run: {where}: token ids must be integers: {text.strip()!r}")
    if not ids:
        raise SystemExit(f"kdtree-run: {where}: empty prompt")
    return ids


def _prompts(args) -> list[list[int]]:
    if args.prompt_ids is not None:
        return [_parse_ids(args.prompt_ids, "--prompt-ids")]
    with open(args.prompt_file) as fh:
        lines = [ln for ln in fh.read().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"kdtree-run: {args.prompt_file}: no prompts")
    return [_parse_ids(ln, f"{args.prompt_file}:{i + 1}") for i, ln in enumerate(lines)]


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdtree-run", description="Generate with a DeepSeek-V3/Kimi-K2-architecture model "
        "bundle: autoregressive or DDTree speculative decoding.")
    p.add_argument("--model", help="model bundle (.kdtr); default: a built-in tiny model")
    p.add_argument("--drafter", help="drafter bundle (.kdtr) or oracle[:AGREEMENT] "
                   "(test/demo drafter that peeks at the target)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt-ids", help="one prompt as comma-separated token ids")
    src.add_argument("--prompt-file", help="file with one prompt per line (token ids)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--method", choices=["ar", "ddtree"], default="ar")
    p.add_argument("--budget", type=int, default=32, help="DDTree node budget per round")
    p.add_argument("--block-len", type=int, default=8,
                   help="drafter depth L (ModelDrafter/oracle steps per round)")
    p.add_argument("--backend", choices=["auto", "reference", "numba"], default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos", type=int, default=None, help="stop token id")
    p.add_argument("--json", action="store_true", help="print tokens and stats as JSON")
    return p


def run_main(argv=None) -> int:
    args = _run_parser().parse_args(argv)
    prompts = _prompts(args) if (args.prompt_ids or args.prompt_file) else [[1, 2, 3, 4]]
    t0 = time.perf_counter()
    try:
        if args.model:
            model = Model.load(args.model, args.backend)
        else:
            model = default_model(args.backend)
            _log("kdtree-run: no --model: using the built-in tiny model (random weights, seed 0)")
        drafter = None
        if args.method == "ddtree":
            spec = args.drafter
            if spec is None:
                if args.model:
                    raise SystemExit("kdtree-run: --method ddtree needs --drafter BUNDLE "
                                     "(or oracle:AGREEMENT for a demo)")
                spec = "oracle:0.8"
            if spec.startswith("oracle"):
                _log(f"kdtree-run: drafter {spec}: a test/demo drafter that runs the target "
                     f"itself; its speed means nothing")
            drafter = load_drafter(spec, model, args.block_len, args.seed)
    except (BundleError, FileNotFoundError) as e:
        _log(f"kdtree-run: error: {e}")
        return 2
    _log(f"kdtree-run: backend {model.backend.name}, {len(prompts)} prompt(s), method "
         f"{args.method}, loaded in {time.perf_counter() - t0:.2f} s; generating...")
    if model.backend.on_gpu:
        # numba compiles each kernel on its first call (~30 s in all on the H200, run 2): say
        # so, or a first run looks hung and its tokens/s mean nothing.
        _log("kdtree-run: the numba kernels compile on first use in this process (about "
             "30 s on an H200); the timings below include that")
    result = generate(model, prompts, args.max_new_tokens, method=args.method, drafter=drafter,
                      budget=args.budget, temperature=args.temperature, seed=args.seed,
                      eos=args.eos)
    stats = result.stats
    if args.json:
        print(json.dumps({"tokens": result.tokens, "stats": stats.to_dict()}))
    else:
        for toks in result.tokens:
            print(",".join(str(t) for t in toks))
    split = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stats.time.items() if v > 0)
    tau = f", mean tau {stats.mean_tau:.2f}" if args.method == "ddtree" else ""
    graphs = "" if stats.graph_replays is None else \
        f"; CUDA graphs: {stats.graph_captures} captured, {stats.graph_replays} replays"
    _log(f"kdtree-run: {stats.new_tokens} tokens in {stats.seconds:.3f} s "
         f"({stats.tokens_per_s:.1f} tok/s), {stats.rounds} rounds{tau}; {split}{graphs}")
    return 0


def make_model_main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="kdtr-make-model", description="Write a deterministic random model bundle "
        "(weights O(0.1-1), so routing and attention are not trivial).")
    p.add_argument("out", help="output bundle (.kdtr)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--drafter", action="store_true",
                   help="write the one-layer drafter of that size instead of the target")
    p.add_argument("--block-drafter", action="store_true",
                   help="write a BlockDrafter bundle of that size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = p.parse_args(argv)
    role = "block_drafter" if args.block_drafter else "drafter" if args.drafter else "target"
    t0 = time.perf_counter()
    cfg = make_random_bundle(args.out, args.size, args.seed, args.dtype, role=role)
    params = sum(int(np.prod(s)) for s in weight_shapes(cfg).values())
    _log(f"kdtr-make-model: wrote {args.out} ({role}, {args.size}, {params / 1e6:.2f} M "
         f"parameters, {args.dtype}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run_main())

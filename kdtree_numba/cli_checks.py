"""What the console scripts check before any work starts (issue 16).

Every check raises ``formats.console.UsageError`` with one line that names the option, file
or value at fault and what would be right; ``formats.console.run_console`` prints it as
``PROG: error: MESSAGE`` and exits 2.  Checks that only cost time (a budget far above what a
round can verify quickly) return warning lines instead, with the expected cost.

The order in ``kdtree-run`` (kdtree_numba/cli.py): plain option values (:func:`check_options`),
the prompts as given (:func:`read_prompts`), the backend (:func:`open_backend`), the target
bundle's config and tokenizer (:func:`plan_model`, without reading weights), the prompts as
token ids (:func:`encode_prompts`: text needs the tokenizer), the drafter's config
(:func:`plan_drafter`), then everything that depends on the model
(:func:`check_against_model`).  Only then are weights read.
"""
from __future__ import annotations

import dataclasses
import math
import os

from formats.console import UsageError, escape, read_user_text
from formats.paths import output_directory
from kdtree_numba import compat, demo, plots
from kdtree_numba.backends import Backend, auto_gemm, make_backend
from kdtree_numba.budget import AutoBudget
from kdtree_numba.bundle import BundleError, DFlashSpec, read_bundle_config, stores_packed_weights
from kdtree_numba.config import ModelConfig, weight_shapes
from kdtree_numba.ddtree import MAX_GPU_BUDGET
from kdtree_numba.drafter import ORACLE_FORM, parse_oracle_spec
from kdtree_numba.text import TextCodec, load_codec

__all__ = ["budget_value", "DEFAULT_PROMPT", "DEFAULT_TEXT_PROMPT", "MAX_DEPTH", "DrafterPlan",
           "ModelPlan", "PromptSource", "check_options", "check_plot", "parse_ids", "read_prompts",
           "open_backend", "gemm_choice",
           "plan_model", "encode_prompts", "plan_drafter", "check_against_model",
           "reference_round_seconds", "bundle_problem"]

# kdtree-run's prompt when none is given (both shown in --help): text on a model with a
# tokenizer (the default one has), token ids on one without
DEFAULT_TEXT_PROMPT = demo.TEXT_PROMPT
DEFAULT_PROMPT = (1, 2, 3, 4)
MAX_DEPTH = 2 ** 15 - 1         # tree depths are int16 in the GPU builder
# Above this many seconds per DDTree round on the reference backend, kdtree-run warns.
SLOW_ROUND_S = 10.0


def budget_value(text: str):
    """``--budget`` as given: an int, ``"auto"``, or the text itself, which check_options
    refuses naming the value and both forms (argparse's type error would say only
    "invalid budget_value value")."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        return text


def check_options(args) -> None:
    """kdtree-run's numeric options, each on its own (nothing about the model yet)."""
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: must be an integer >= 0 "
                         f"(new tokens per prompt)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature {args.temperature:g}: must be a finite number >= 0 "
                         f"(0: greedy)")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UsageError(f"--top-p {args.top_p:g}: must lie in (0, 1] (the smallest set of "
                         f"most likely tokens holding that much probability; 1: off)")
    if getattr(args, "draft_vocab", None) is not None and args.draft_vocab < 0:
        raise UsageError(f"--draft-vocab {args.draft_vocab}: must be an integer >= 0 (the "
                         f"drafter ranks the N most frequent tokens; 0: all)")
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must be an integer >= 0 (the k most likely "
                         f"tokens; 0: off)")
    td = args.draft_temperature
    if td is not None and not (math.isfinite(td) and td > 0):
        raise UsageError(f"--draft-temperature {td:g}: must be a finite number > 0 (the tree "
                         f"is built from the drafter's logits / it; 1: as they are)")
    if isinstance(args.budget, str) and args.budget != "auto":
        raise UsageError(f"--budget {args.budget!r}: not an integer or auto (tree nodes "
                         f"verified per DDTree round)")
    if args.budget not in (None, "auto") and args.budget < 1:
        raise UsageError(f"--budget {args.budget}: must be an integer >= 1 (tree nodes "
                         f"verified per DDTree round) or auto")
    if args.block_len is not None and not 1 <= args.block_len <= MAX_DEPTH:
        raise UsageError(f"--block-len {args.block_len}: must be an integer in [1, "
                         f"{MAX_DEPTH}] (drafter steps per round, the tree's maximum depth)")
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be an integer >= 0")
    if getattr(args, "plot", None) is not None:
        check_plot(args.plot, args.method)


def check_plot(path: str, method: str) -> None:
    """``--plot PATH``: a ``.png`` name in an existing folder, a method with rounds to draw,
    and matplotlib installed (the ``plot`` extra), all before any work."""
    if method == "ar":
        raise UsageError(f"--plot {escape(path)}: draws the acceptance lengths and one "
                         f"round's tree of --method ddtree or chain; --method ar has no "
                         f"rounds to draw")
    if os.path.isdir(path):
        raise UsageError(f"--plot {escape(path)}: a folder; give a file name ending in .png")
    if os.path.splitext(path)[1].lower() != ".png":
        raise UsageError(f"--plot {escape(path)}: the picture is a PNG file; give a name "
                         f"ending in .png")
    try:
        output_directory(path)
    except OSError as e:
        raise UsageError(f"--plot {escape(path)}: {escape(e.filename)}: {e.strerror}") from None
    try:
        plots.require_matplotlib()
    except ImportError:
        raise UsageError(f"--plot needs matplotlib: {plots.PLOT_EXTRA_HINT}") from None


def parse_ids(text: str, where: str) -> list[int]:
    """Token ids separated by commas and/or spaces; ``where`` names their source."""
    ids = []
    for tok in text.replace(",", " ").split():
        try:
            ids.append(int(tok))
        except ValueError:
            raise UsageError(f"{where}: {tok!r} is not a token id (comma-separated integers, "
                             f"e.g. 1,2,3)") from None
    if not ids:
        raise UsageError(f"{where}: no token ids in {text!r} (give e.g. 1,2,3; leave "
                         f"--prompt-ids out for the built-in prompt)")
    return ids


@dataclasses.dataclass
class PromptSource:
    """The prompts as the command line gives them: ``ids`` (``--prompt-ids``,
    ``--prompt-file``) or ``texts`` (``--prompt``, ``--prompt-text-file``), or neither (the
    built-in prompt, text or ids depending on the model); ``where`` names each one."""
    ids: list[list[int]] | None = None
    texts: list[str] | None = None
    where: list[str] = dataclasses.field(default_factory=list)

    @property
    def is_text(self) -> bool:
        return self.texts is not None


def _text_label(option: str, text: str) -> str:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return f"{option} {escape(repr(shown), backslash=False)}"


def read_prompts(args) -> PromptSource:
    """The prompts as given: ``--prompt-ids``, each non-blank line of ``--prompt-file``,
    each ``--prompt``, each ``--prompt-text-file`` (a whole file is one prompt), or none."""
    if args.prompt_ids is not None:
        return PromptSource(ids=[parse_ids(args.prompt_ids, "--prompt-ids")],
                            where=["--prompt-ids"])
    if args.prompt:
        return PromptSource(texts=list(args.prompt),
                            where=[_text_label("--prompt", t) for t in args.prompt])
    if args.prompt_text_file:
        texts = [read_user_text(f, "--prompt-text-file") for f in args.prompt_text_file]
        return PromptSource(texts=texts,
                            where=[f"--prompt-text-file {escape(f)}"
                                   for f in args.prompt_text_file])
    if args.prompt_file is None:
        return PromptSource()
    text = read_user_text(args.prompt_file, "--prompt-file")
    prompts, where = [], []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            label = f"--prompt-file {args.prompt_file}:{i + 1}"
            prompts.append(parse_ids(line, label))
            where.append(label)
    if not prompts:
        raise UsageError(f"--prompt-file {args.prompt_file}: no prompts (one prompt per line, "
                         f"token ids separated by commas or spaces)")
    return PromptSource(ids=prompts, where=where)


def gemm_choice(backend: str, plan: "ModelPlan | None") -> tuple[str, str]:
    """``--gemm auto``'s choice on ``backend`` (a resolved name) for ``plan``'s target: (gemm,
    why); the rule is :func:`kdtree_numba.backends.auto_gemm`'s."""
    if backend != "numba":
        return "cuda-cores", "the reference backend's only one"
    if plan is None:
        return "cuda-cores", "no target planned"
    return auto_gemm(plan.config.hidden_size, plan.packed_experts)


def open_backend(name: str, gemm: str = "cuda-cores", precision: str | None = None,
                 plan: "ModelPlan | None" = None) -> Backend:
    """kdtree-run's backend: without a GPU the reference backend's float32 CPU path
    (kdtree_numba/cpu.py) unless ``--precision float64`` asks for the exact reference.
    ``gemm`` "auto" takes :func:`gemm_choice`'s choice for ``plan``'s target."""
    resolved = name if name != "auto" else ("numba" if compat.gpu_available() else "reference")
    if gemm == "auto":
        gemm = gemm_choice(resolved, plan)[0]
    if precision is not None and resolved != "reference":
        raise UsageError(f"--precision {precision}: the reference backend's choice (the numba "
                         f"backend computes in float32); drop it or use --backend reference")
    try:
        if resolved == "reference":
            return make_backend("reference", gemm=gemm, precision=precision or "float32")
        return make_backend(name, gemm=gemm)
    except compat.NoDeviceError:
        raise UsageError(f"--backend {name}: no CUDA GPU found here; use --backend reference "
                         f"(NumPy) or --backend auto (the GPU when there is one)") from None
    except ValueError:
        if gemm == "cuda-cores":
            raise
        raise UsageError(f"--gemm {gemm}: needs the numba backend on a GPU (--backend "
                         f"{name} is the float64 reference here); drop --gemm or use "
                         f"--backend numba on a GPU machine") from None


def bundle_problem(option: str, path: str, exc: Exception) -> UsageError:
    """A bundle's BundleError, KdtrError or OSError as one UsageError line naming ``option``:
    ``--drafter d.kdtr: ...``."""
    text = str(exc)
    if isinstance(exc, OSError):
        text = exc.strerror or text
    elif text.startswith(f"{path}: "):
        text = text[len(path) + 2:]
    return UsageError(f"{option} {path}: {text}")


def _existing_bundle(option: str, path: str, want: str) -> None:
    if os.path.isdir(path):
        raise UsageError(f"{option} {path}: a folder; {want}")
    if not os.path.exists(path):
        raise UsageError(f"{option} {path}: no such file; {want}")


@dataclasses.dataclass
class ModelPlan:
    """The target bundle before its weights are read: ``path`` (``--model``'s, or the shipped
    demo target's), ``option`` (how messages name it: ``--model`` or ``the default model``),
    its ``config``, its ``codec`` (None: the bundle has no tokenizer) and whether it stores
    packed (int4-group) experts."""
    path: str
    option: str
    config: ModelConfig
    codec: TextCodec | None
    packed_experts: bool = False

    @property
    def default(self) -> bool:
        return self.option != "--model"

    @property
    def label(self) -> str:
        return f"{self.option} {self.path}"


def plan_model(args) -> ModelPlan:
    """``--model``'s config and tokenizer, or the shipped demo target's (kdtree_numba/demo)
    when there is no ``--model``; a tokenizer that does not parse or whose ids run past the
    model's vocabulary is refused here, naming the bundle."""
    default = not args.model
    path = str(demo.TARGET) if default else args.model
    option = "the default model" if default else "--model"
    if not default:
        _existing_bundle("--model", path, "give a model bundle (.kdtr, e.g. from "
                         "kdtr-make-model or kdtr-import-hf)")
    try:
        config = read_bundle_config(path)[0]
        codec = load_codec(path, verify=not args.no_verify)
        packed = stores_packed_weights(path)
    except (BundleError, OSError) as e:
        raise bundle_problem(option, path, e) from e
    return ModelPlan(path, option, config, codec, packed)


def encode_prompts(source: PromptSource, model: ModelPlan) -> tuple[list[list[int]], list[str]]:
    """(prompts as token ids, where each came from): text prompts through the model's
    tokenizer (an error on a model without one), the built-in prompt as text or ids."""
    if source.ids is not None:
        return source.ids, source.where
    codec = model.codec
    if source.texts is None:
        if codec is None:
            return [list(DEFAULT_PROMPT)], ["the built-in prompt"]
        return [codec.encode(DEFAULT_TEXT_PROMPT)], ["the built-in prompt"]
    if codec is None:
        raise UsageError(f"{source.where[0]}: {model.label} has no tokenizer; use "
                         f"--prompt-ids or --prompt-file (token ids), or a bundle that carries "
                         f"one (kdtr-import-hf copies HF_DIR/tokenizer.json in)")
    prompts = [codec.encode(t) for t in source.texts]
    for p, label in zip(prompts, source.where):
        if not p:
            raise UsageError(f"{label}: no tokens (an empty text, and the model's tokenizer "
                             f"puts no token in front of a prompt); give some text")
    return prompts, source.where


@dataclasses.dataclass
class DrafterPlan:
    """What ``--drafter`` names: kind "oracle" (with ``agreement``), "model", "block" or
    "dflash" (a bundle at ``path`` with its ``config``); ``block_len`` the tree depth it
    drafts."""
    kind: str
    block_len: int
    path: str | None = None
    config: ModelConfig | None = None
    agreement: float | None = None


def plan_drafter(args, target: ModelConfig, default_block_len: int,
                 warn) -> DrafterPlan | None:
    """Check ``--drafter`` against the target (vocabulary, a block drafter's hidden size, a
    DFlash drafter's target) before any weight is read; None with ``--method ar`` (a given
    drafter is ignored, with a warning through ``warn``)."""
    spec = args.drafter
    if args.method == "ar":
        if spec is not None:
            warn(f"--drafter {spec} is ignored with --method {args.method} (drafters serve "
                 f"--method ddtree and chain)")
        return None
    block_len = default_block_len if args.block_len is None else args.block_len
    if spec is None:
        if args.model:
            raise UsageError(f"--method {args.method} with --model needs --drafter (a drafter "
                             f"bundle of the same vocabulary, or {ORACLE_FORM})")
        spec = demo.DEFAULT_DRAFTER   # the default model's drafter: chosen in demo/__init__.py
    try:
        agreement = parse_oracle_spec(spec)
    except ValueError as e:
        raise UsageError(f"--drafter {e}") from e
    if agreement is not None:
        return DrafterPlan("oracle", block_len, agreement=agreement)
    _existing_bundle("--drafter", spec, f"give a drafter bundle (.kdtr, e.g. from "
                     f"kdtr-make-model --drafter) or {ORACLE_FORM}")
    try:
        config, attrs = read_bundle_config(spec)
    except (BundleError, OSError) as e:
        raise bundle_problem("--drafter", spec, e) from e
    if config.vocab_size != target.vocab_size:
        raise UsageError(
            f"--drafter {spec}: vocabulary {config.vocab_size} does not match the target's "
            f"{target.vocab_size}; a drafter must share the target's vocabulary (for a "
            f"kdtr-make-model target of size S: kdtr-make-model DRAFTER.kdtr --size S "
            f"--drafter, --block-drafter or --dflash-drafter)")
    if attrs.get("kdtree.bundle") == "block_drafter":
        hidden = attrs.get("block.target_hidden_size")
        if hidden != target.hidden_size:
            raise UsageError(f"--drafter {spec}: a block drafter for a target of hidden size "
                             f"{hidden}, the target's is {target.hidden_size}")
        own = int(attrs.get("block.block_len", 7))
        if args.block_len is not None and args.block_len != own:
            warn(f"--block-len {args.block_len} is ignored: the block drafter {spec} drafts "
                 f"its own {own} positions")
        return DrafterPlan("block", own, spec, config)
    if attrs.get("kdtree.bundle") == "dflash_drafter":
        try:
            problem = DFlashSpec.from_attrs(attrs).target_problem(target)
        except BundleError as e:
            raise bundle_problem("--drafter", spec, e) from e
        if problem:
            raise UsageError(f"--drafter {spec}: {problem}")
        own = int(attrs["dflash.block_size"]) - 1
        if args.block_len is not None and args.block_len != own:
            warn(f"--block-len {args.block_len} is ignored: the DFlash drafter {spec} drafts "
                 f"its own {own} positions")
        return DrafterPlan("dflash", own, spec, config)
    return DrafterPlan("model", block_len, spec, config)


def active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token goes through (routed experts: the chosen ones only)."""
    total = 0
    for name, shape in weight_shapes(cfg).items():
        n = math.prod(shape)
        if "/mlp/experts/" in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n
    return total


def reference_round_seconds(cfg: ModelConfig, nodes: int) -> float:
    """Rough seconds of one DDTree verify forward over ``nodes`` tokens on the NumPy
    reference, fitted on the 2-core development machine (docs/ENGINE.md, "CLI"): per node
    15 us per head and layer (attention row by row) plus its matrix products at 20 GFLOP/s,
    and 2.5 ns per layer for each of the nodes^2 mask entries.  Measured against it: tiny at
    16,385 nodes 3.8 s (model 5.0), small at 4,097 4.2 s (2.9), medium at 1,025 15.7 s
    (14.3)."""
    per_node = (15e-6 * cfg.num_attention_heads * cfg.num_hidden_layers
                + 2.0 * active_parameters(cfg) / 20e9)
    return nodes * per_node + 2.5e-9 * cfg.num_hidden_layers * nodes * nodes


def _context_check(prompts, where, max_new: int, cfg: ModelConfig, role: str) -> None:
    context = cfg.max_position_embeddings
    for p, label in zip(prompts, where):
        if len(p) + max_new > context:
            room = context - len(p)
            fix = (f"use --max-new-tokens {room} or less" if room > 0
                   else "shorten the prompt")
            raise UsageError(
                f"--max-new-tokens {max_new}: {label} has {len(p)} tokens, and {len(p)} + "
                f"{max_new} = {len(p) + max_new} exceeds the {role}'s context of {context} "
                f"tokens (max_position_embeddings); {fix}")


def check_against_model(args, prompts, where, cfg: ModelConfig, drafter: DrafterPlan | None,
                        backend: Backend, warn) -> None:
    """Prompt ids and ``--eos`` against the vocabulary, prompt + new tokens against the
    context, the budget and block length against what the backend can build (errors) and what
    a round costs (warnings through ``warn``)."""
    V = cfg.vocab_size
    for p, label in zip(prompts, where):
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise UsageError(f"{label}: token id {bad[0]} is outside the model's vocabulary "
                             f"(ids 0 to {V - 1})")
    if args.eos is not None and not 0 <= args.eos < V:
        raise UsageError(f"--eos {args.eos}: outside the model's vocabulary (ids 0 to {V - 1})")
    _context_check(prompts, where, args.max_new_tokens, cfg, "model")
    if drafter is None:
        return
    L = drafter.block_len
    B = L if args.method == "chain" else (
        AutoBudget().max_budget if args.budget == "auto" else args.budget)
    _check_draft_vocab(getattr(args, "draft_vocab", None), args.method, B, V, drafter)
    if backend.name == "numba" and B > MAX_GPU_BUDGET:
        raise UsageError(f"--budget {B}: the GPU tree builder holds at most {MAX_GPU_BUDGET} "
                         f"nodes; use --budget {MAX_GPU_BUDGET} or less (or --backend "
                         f"reference)")
    # one forward per depth: wasted work (not said of the CPU's default budget, which is
    # chosen for the verify's cost: the user asked for neither number)
    if L > B and drafter.kind in ("model", "oracle") and not getattr(args, "budget_defaulted",
                                                                      False):
        warn(f"--block-len {L} is above --budget {B}: a tree of {B} nodes is at most {B} "
             f"deep, so the drafter's last {L - B} steps per round are wasted")
    if backend.name == "reference":
        nodes = B + 1
        seconds = reference_round_seconds(cfg, nodes)
        mask_gb = nodes * nodes / 1e9
        if B > MAX_GPU_BUDGET or seconds > SLOW_ROUND_S:
            warn(f"--budget {B}: each DDTree round verifies {nodes} tokens in one forward; "
                 f"on the NumPy reference that takes roughly {_duration(seconds)} per round "
                 f"(a 2-core estimate) and a {nodes} x {nodes} mask of {mask_gb:.1f} GB per "
                 f"prompt; budgets of 8 to 256 are the useful range")


def _check_draft_vocab(n, method: str, budget: int, vocab: int, drafter: DrafterPlan) -> None:
    """--draft-vocab N: a DFlash drafter's option (its bundle's token ranking), within the
    vocabulary, and at least the top-K a DDTree round takes (k = the budget)."""
    if not n:
        return
    if drafter.kind != "dflash":
        raise UsageError(f"--draft-vocab {n}: a DFlash drafter's option (it ranks only the N "
                         f"most frequent tokens of its bundle's ranking); this drafter is a "
                         f"{drafter.kind} drafter")
    if n > vocab:
        raise UsageError(f"--draft-vocab {n}: the vocabulary holds {vocab} tokens")
    if method == "ddtree" and min(budget, vocab) > n:
        raise UsageError(f"--draft-vocab {n}: a DDTree round of --budget {budget} takes each "
                         f"depth's top {min(budget, vocab)} tokens; give N >= that or a "
                         f"smaller budget")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"

"""The package's runtime switches: one :class:`RuntimeConfig`, read from the environment here
and nowhere else in ``kdtree_numba`` (tests/test_architecture.py checks it).

Two kinds of switch:

* **fixed at import** (:data:`FIXED_AT_IMPORT`): they decide how kernels are compiled and
  launched, so they are read once, when the package is first imported, and never change in
  that process: the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, numba's own switch), its warp
  width (``KDTREE_SIM_WARP``, default 4), numba's allocations from CuPy's pool
  (``KDTREE_NUMBA_POOL=0`` turns it off), the fast launch path (``KDTREE_FAST_LAUNCH=0``) and
  kernels compiled with source line info (``KDTREE_CUDA_LINEINFO=1``, for compute-sanitizer
  and Nsight Compute).
* **per call**: CUDA graphs (``KDTREE_CUDA_GRAPHS=0`` turns them off), the grouped MoE's device
  work list (``KDTREE_MOE_WORK_LIST=1``), int4 (W4A16) experts on tensor cores under
  ``"tensor-cores"`` at every M (layers/moe_int4_mma.py; ``KDTREE_INT4_MMA=0`` keeps them on
  the CUDA-core W4A16 kernels there), the
  weight-streaming MoE experts' chunk grid (an expert's mt-token chunks in blocks of their
  own, and the grouping's scan over the experts alone, on fewer threads: the same bits;
  ``KDTREE_MOE_CHUNK_GRID=0`` turns it off: docs/LAYERS.md, "MoE FFN"), DDTree
  rounds as device programs enqueued one ahead (kdtree_numba/device_round.py: by default where
  the backend runs on a GPU;
  ``KDTREE_DEVICE_ROUNDS=0`` turns them off, ``=1`` on everywhere), AR's decode steps run K a
  launch as one device program enqueued one ahead (kdtree_numba/device_ar.py, on the numba
  backend; ``KDTREE_AR_DEVICE_STEPS=K``, 1 to 64, ``on``: 4; ``0``: off, the host's loop of
  one step a launch; unset: :data:`AR_STEPS_ON` on a real GPU, off under the CUDA
  simulator), several device rounds a launch (``KDTREE_ROUNDS_PER_LAUNCH=R``, 1 to 16, ``on``:
  4; unset, 0 or 1: one round a launch; off: 0.95x on an H100 in run 169; the launch and the
  read paid once per R rounds, the same tokens), no device round run ahead for a request the
  rounds in flight look to leave at most m times their mean tokens a round short (on by
  default since runs 169-170, m = 2 since run 180: a round past a request's end saved, a
  read's wait paid where the guess is wrong; ``KDTREE_WAIT_NEAR_END=0`` turns it off, a
  number sets m, ``on`` is 2), the first device round enqueued before the prefill's first
  tokens are read, on their device copy (``KDTREE_EARLY_ROUND=0`` turns it off: the device
  runs the round behind the prefill while the host reads and commits; the same tokens),
  DDTree's prompt lookup
  (``KDTREE_PROMPT_LOOKUP``: a weight in (0, 1), ``on``: 0.8; off: none; unset: on the CPU
  path and the numba backend, off on the exact float64 reference: the
  tokens that followed the context's last n tokens where they occurred before, mixed into
  the drafter's distributions before the tree is built, the same tokens, fewer rounds:
  kdtree_numba/lookup.py), an MLA layer's norms and
  ropes fused into one launch each (kdtree_numba/layers/latents.py, read when a numba backend
  is made; ``KDTREE_FUSED_LATENTS=0`` turns it off), prefills padded to a few row counts on the
  GPU (``Model.prefill_width``; ``KDTREE_PAD_PREFILLS=0`` turns it off), a DDTree round's glue
  cut to fewer launches (index ranges and constants kept, copies the round does not need
  skipped, the dense FFN as two linears, the per-head products at fewer rows a block; the
  same bits; ``KDTREE_LEAN_ROUND=0`` turns it off: docs/ENGINE.md, "Device rounds"),
  fewer launches in the small forwards (``KDTREE_FEWER_LAUNCHES=1``, off: run 156 measured a
  round slower with it; attention's key splits merged by the block kernel's last block instead of a
  merge launch, kdtree_numba/attention/tiles.py, docs/ATTENTION.md, "Merging in the kernel";
  a captured layer's residual sum written into the features by its norm, no concatenation,
  kdtree_numba/model.py; the same bits: docs/ENGINE.md, "Fewer launches"),
  a device round's index arithmetic and commit in one launch each (``KDTREE_ROUND_EPILOGUE=0``
  turns it off: the verify's and the drafter's block's slots and positions
  made together at the round's start, and ``counts = acc_len * active``, both caches' lengths,
  the roots and the accepted rows' features in one kernel at its end,
  kdtree_numba/ddtree/commit.py, where both caches are dense and the drafter names its
  context cache, else the round's separate glue; and a numba forward's captured features
  written by the norms, as under ``KDTREE_FEWER_LAUNCHES``; the same bits: docs/ENGINE.md,
  "Device rounds"),
  attention's key splits merged by the next launch, apply_uv, as it stages its rows
  (``KDTREE_MERGE_IN_UV=1``, off until timed on the GPU: one launch fewer a layer where a
  call splits its keys; the same bits: kdtree_numba/attention/projections.py), the
  shared expert's and the dense FFN's SwiGLU in their gate_up linear's launch where it
  streams its weight (``KDTREE_FUSED_SWIGLU=0`` turns it off: one launch fewer an FFN; the
  same bits: kdtree_numba/layers/linear.py's ``skinny_swiglu``), attention's key splits
  fixed whatever the number of rows on every GEMM setting (``KDTREE_INVARIANT_ATTENTION=1``,
  off: 0.75x AR in run 189; ``batch_invariant`` as under ``gemm="tensor-cores"``, so the
  demo pair's verify rows get a decode's bits; other bits than the default's:
  kdtree_numba/attention/mla.py),
  the MoE's shared expert run by the routed experts' two launches where both stream their
  weights (``KDTREE_SHARED_IN_EXPERTS=0`` turns it off: 3 launches fewer a MoE layer, 2 with
  the fused SwiGLU, measured in docs/BENCHMARKS.md; bf16 and float32 experts the same bits,
  int4 experts the shared expert at their threads: kdtree_numba/layers/moe.py,
  ``moe_shapes.shared_in_experts``), the MoE's combine in the tail of its down launch where that
  launch streams the weights (``KDTREE_COMBINE_IN_DOWN=1``, off: timed slower on the GPU;
  one launch fewer a MoE layer, the same bits: kdtree_numba/layers/moe_combine.py), a small
  router's logits and its routing in one launch where linear() would stream the router's
  weight (``KDTREE_FUSED_ROUTER=1``, off: no gain timed; one launch fewer a MoE layer, the
  same bits: kdtree_numba/layers/moe_route.py), a few entries' grouping by expert made by
  the routed experts' gate_up blocks (``KDTREE_GROUP_IN_EXPERTS=1``, off until timed on the
  GPU: one launch fewer a MoE layer at a decode's and a small verify's rows; the same bits:
  kdtree_numba/layers/moe_lists.py), the bf16 tensor-core GEMM's K slices added by
  each output tile's last slice block at every M (``KDTREE_MMA_SUMS_IN_LAST=1``; the default
  at one row only, where it is faster: kdtree_numba/layers/mma_plan.py; the same bits), the
  bf16 GEMM past 80 rows staged by TMA with a producer warp over a persistent grid
  and its swapped tile at a verify's 65-80 rows and a decode's sliced products
  (``KDTREE_MMA_TMA=1``; off until the final tree runs on the GPU: its tiles passed the GPU
  tests and timed 1.3-1.5x faster at M = 512 in runs 203-204, but later host-side changes
  have not run there; the same bits: kdtree_numba/layers/mma_tma.py), and under it the
  sliced products' last waves shared out slice by slice over the persistent grid
  (``KDTREE_MMA_STREAM_K=1``, or ``2``: the last two waves; not yet run on the GPU; the
  same bits), a bf16 cache's attention on warpgroup tensor cores (``KDTREE_ATTENTION_WGMMA=1``:
  kdtree_numba/attention/wgmma.py; not yet run on the GPU; the same error bound, other bits),
  ``--budget auto``'s second policy (paired acceptance from nested trees and only rounds that
  replayed a CUDA graph timed, kdtree_numba/budget.py, room for a round graph per candidate
  in every cache pair, kdtree_numba/graphs.py; the default since run 156: within 4% of the
  best fixed budget where the first policy lost 13%; ``KDTREE_AUTO_V2=0`` turns it off), the
  on-disk kernel cache
  (``KDTREE_KERNEL_CACHE=0`` turns it off; ``KDTREE_KERNEL_CACHE_DIR`` moves it, default
  ``$XDG_CACHE_HOME/kdtree-numba`` or ``~/.cache/kdtree-numba``), and the CPU path's OpenBLAS
  threads (``OPENBLAS_NUM_THREADS``, read when a float32 reference backend is made:
  kdtree_numba/cpu.py; default 1).

An entry point builds the configuration once from its flags and the environment
(:func:`configure`); library code asks :func:`current`.  Where nothing was configured,
:func:`current` reads the per-call switches from the environment as it is at the call, so a
process (a benchmark, a test's ``monkeypatch.setenv``) may flip them between calls.
``formats/`` is a separate package and keeps its own one switch (``KDTREE_DEBUG``,
formats/console.py).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Mapping

__all__ = ["RuntimeConfig", "FIXED_AT_IMPORT", "current", "holding", "configure", "reset",
           "child_environment"]

FIXED_AT_IMPORT = ("simulator", "sim_warp", "numba_pool", "fast_launch", "lineinfo")
# every variable a RuntimeConfig is read from
VARIABLES = ("NUMBA_ENABLE_CUDASIM", "KDTREE_SIM_WARP", "KDTREE_NUMBA_POOL", "KDTREE_FAST_LAUNCH",
             "KDTREE_CUDA_LINEINFO", "KDTREE_CUDA_GRAPHS", "KDTREE_MOE_WORK_LIST",
             "KDTREE_MOE_CHUNK_GRID", "KDTREE_INT4_MMA", "KDTREE_DEVICE_ROUNDS",
             "KDTREE_AR_DEVICE_STEPS", "KDTREE_ROUNDS_PER_LAUNCH", "KDTREE_WAIT_NEAR_END",
             "KDTREE_EARLY_ROUND", "KDTREE_PROMPT_LOOKUP",
             "KDTREE_FUSED_LATENTS", "KDTREE_PAD_PREFILLS", "KDTREE_LEAN_ROUND", "KDTREE_AUTO_V2",
             "KDTREE_FEWER_LAUNCHES", "KDTREE_ROUND_EPILOGUE", "KDTREE_MERGE_IN_UV",
             "KDTREE_FUSED_SWIGLU", "KDTREE_INVARIANT_ATTENTION", "KDTREE_SHARED_IN_EXPERTS",
             "KDTREE_COMBINE_IN_DOWN", "KDTREE_FUSED_ROUTER", "KDTREE_MMA_SUMS_IN_LAST",
             "KDTREE_GROUP_IN_EXPERTS", "KDTREE_MMA_TMA", "KDTREE_MMA_STREAM_K",
             "KDTREE_ATTENTION_WGMMA", "KDTREE_KERNEL_CACHE",
             "KDTREE_KERNEL_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "OPENBLAS_NUM_THREADS")
_OFF = ("0", "off", "no", "false")


def _flag(environ: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    value = environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in _OFF


def _positive(environ: Mapping[str, str], name: str) -> int:
    """A positive whole number from ``name``; 0 where it is unset or is not one (OpenBLAS
    itself ignores such a value)."""
    value = environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 0


AR_STEPS_ON, AR_STEPS_MAX = 4, 64     # KDTREE_AR_DEVICE_STEPS=on's steps a launch; the most
ROUNDS_ON, ROUNDS_MAX = 4, 16         # KDTREE_ROUNDS_PER_LAUNCH=on's rounds a launch; the most


def _steps(environ: Mapping[str, str], name: str, unset: int, on: int = AR_STEPS_ON,
           most: int = AR_STEPS_MAX, what: str = "steps a launch") -> int:
    """A count (``what``: steps a launch, rounds a launch, waves) from ``name``: a whole
    number 0..``most`` (0: off), on/off words (on: ``on``); ``unset`` where it is unset or
    empty."""
    value = environ.get(name, "").strip().lower()
    if not value:
        return unset
    if value in _OFF:
        return 0
    if value in ("on", "yes", "true"):
        return on
    if not value.isdigit() or int(value) > most:
        raise ValueError(f"{name}={value!r}: expected {what}, 0 (off) to "
                         f"{most}, or on ({on})")
    return int(value)


def _word_or_number(text: str, on: float, valid, expected: str) -> float:
    """A switch that is also a number: an off word 0.0, an on word ``on``, else the number
    ``text`` holds where ``valid`` takes it; a ValueError naming ``expected`` otherwise."""
    value = text.strip().lower()
    if value in _OFF:
        return 0.0
    if value in ("on", "yes", "true"):
        return on
    try:
        number = float(value)
    except ValueError:
        number = float("nan")             # valid() takes no NaN
    if not valid(number):
        raise ValueError(f"expected {expected}, got {text!r}")
    return number


WAIT_ON, WAIT_MOST = 2.0, 8.0   # KDTREE_WAIT_NEAR_END=on's margin (run 180); the largest


def _margin(environ: Mapping[str, str], name: str) -> float:
    """Waiting near the end's margin from ``name``: unset, empty or an on word
    :data:`WAIT_ON`, an off word 0.0 (off), else a number 0..:data:`WAIT_MOST` (ValueError
    otherwise)."""
    value = environ.get(name, "")
    if not value.strip():
        return WAIT_ON
    try:
        return _word_or_number(value, WAIT_ON, lambda m: 0.0 <= m <= WAIT_MOST,
                               f"on, off or a margin 0 to {WAIT_MOST:g}")
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


LOOKUP_ON = 0.8        # KDTREE_PROMPT_LOOKUP=on's weight (kdtree_numba/lookup.py's ON)


def parse_lookup_weight(text: str) -> float:
    """DDTree's prompt-lookup weight from its text (``KDTREE_PROMPT_LOOKUP``, ``kdtree-run
    --prompt-lookup``): a number in (0, 1), on (:data:`LOOKUP_ON`) or an off word (0.0).
    ValueError otherwise."""
    return _word_or_number(text, LOOKUP_ON, lambda w: 0.0 < w < 1.0,
                           f"the lookup's weight in (0, 1), on ({LOOKUP_ON}) or off")


def _lookup_weight(environ: Mapping[str, str], name: str) -> float | None:
    """``name``'s lookup weight; None where it is unset or empty (the backend's default)."""
    value = environ.get(name, "")
    if not value.strip():
        return None
    try:
        return parse_lookup_weight(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _cache_dir(environ: Mapping[str, str]) -> str:
    explicit = environ.get("KDTREE_KERNEL_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "kdtree-numba")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Every runtime switch of the package (module docstring for each one's variable)."""
    simulator: bool = False
    sim_warp: int = 4
    numba_pool: bool = True
    fast_launch: bool = True
    lineinfo: bool = False
    cuda_graphs: bool = True
    moe_work_list: bool = False
    moe_chunk_grid: bool = True
    int4_mma: bool = True
    device_rounds: bool | None = None    # None: where the backend runs on a GPU
    # AR steps a device launch (kdtree_numba/device_ar.py); 0: off (unset: from_environment)
    ar_device_steps: int = AR_STEPS_ON
    rounds_per_launch: int = 1    # device rounds a launch (kdtree_numba/device_round.py)
    # no round ahead where those in flight look to end a request: their mean tokens times
    # this margin (0: off; device_round.plan_launch)
    wait_near_end: float = WAIT_ON
    early_round: bool = True      # the first device round before the prefill's read
    # DDTree's lookup weight (kdtree_numba/lookup.py); 0: off; None (unset): lookup.resolve's
    prompt_lookup: float | None = None
    fused_latents: bool = True
    pad_prefills: bool = True
    lean_round: bool = True
    auto_v2: bool = True        # --budget auto's second policy (issue 36)
    fewer_launches: bool = False  # fused launches in the small forwards (issue 36 item 3)
    round_epilogue: bool = True   # a device round's glue in two launches (issue 36 item 3)
    merge_in_uv: bool = False   # attention's key splits merged by apply_uv (issue 36 item 3)
    fused_swiglu: bool = True   # an FFN's SwiGLU in its gate_up linear (issue 36 item 3)
    # attention's key splits fixed whatever the rows (a verify's rows a decode's bits) on
    # every GEMM setting, not only tensor-cores' (issue 3 of round 3: T > 0 reproducible)
    invariant_attention: bool = False
    # the shared expert's blocks in the routed experts' launches where both stream their
    # weights (issue 39: a MoE layer's decode in 4 launches where it was 7)
    shared_in_experts: bool = True
    # the MoE's combine in its down launch's tail (issue 36 item 3, issue 39: one launch fewer
    # a MoE layer; timed slower, run 200-201)
    combine_in_down: bool = False
    # a few entries' grouping by expert in the gate_up launch's blocks (issue 39: one launch
    # fewer a MoE layer; off until timed on the GPU)
    group_in_experts: bool = False
    # a small router's logits and the routing in one launch (issue 36 item 3: one launch fewer
    # a MoE layer; no gain timed, run 201)
    fused_router: bool = False
    # the bf16 GEMM's K slices added by each tile's last slice block at every M, not a sum
    # launch (issue 38; mma_config does it at one row, where it is faster: runs 200-201)
    mma_sums_in_last: bool = False
    # the bf16 GEMM past 80 rows on TMA: a producer warp, two consumer warpgroups, a persistent
    # grid, 128-byte-swizzled panels (issue 38; the same bits; 1.3-1.5x the cp.async kernel at
    # M = 512 on every Kimi-K2 product, run 204: kdtree_numba/layers/mma_tma.py); with it, its
    # swapped tile at a verify's 65-80 rows and a decode's sliced products; opt-in until the
    # tree since run 204 has run on the GPU
    mma_tma: bool = False
    # with mma_tma, a sliced product's last waves of tiles (1: the partial one; 2: it and the
    # full one before) shared out K slice by K slice (the tiles cut between blocks completed
    # by their last block, in slice order: the same bits), so no SM idles through a partial
    # last wave and no slice goes through memory where the tiles are few (issue 38: at M =
    # 512, 7168 -> 2112's 68 tiles fill half of 132 SMs); 0 (off) until it has run on the GPU
    mma_stream_k: int = 0
    # a bf16 cache's attention on warpgroup tensor cores (attention/wgmma.py: 64-row blocks,
    # two warpgroups, wgmma from 128-byte-swizzled tiles; issue 38's decode and prefill
    # attention); off until it has run on the GPU
    attention_wgmma: bool = False
    kernel_cache: bool = True
    kernel_cache_dir: str = ""
    blas_threads: int = 0       # OPENBLAS_NUM_THREADS for the CPU path; 0: unset (cpu.py)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "RuntimeConfig":
        env = os.environ if environ is None else environ
        simulator = env.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
        sim_warp = 4
        if simulator:               # the simulator's warp width: nothing else reads it
            warp = env.get("KDTREE_SIM_WARP", "4").strip() or "4"
            try:
                sim_warp = int(warp)
            except ValueError:
                raise ValueError(f"KDTREE_SIM_WARP={warp!r}: expected a whole number of "
                                 f"lanes (a power of two, 1 to 32)") from None
            if sim_warp < 1 or sim_warp > 32 or sim_warp & (sim_warp - 1):
                raise ValueError(f"KDTREE_SIM_WARP={sim_warp}: expected a power of two, 1 to "
                                 f"32")
        return cls(simulator=simulator, sim_warp=sim_warp,
                   numba_pool=_flag(env, "KDTREE_NUMBA_POOL", True),
                   fast_launch=_flag(env, "KDTREE_FAST_LAUNCH", True),
                   lineinfo=_flag(env, "KDTREE_CUDA_LINEINFO", False),
                   cuda_graphs=_flag(env, "KDTREE_CUDA_GRAPHS", True),
                   moe_work_list=_flag(env, "KDTREE_MOE_WORK_LIST", False),
                   moe_chunk_grid=_flag(env, "KDTREE_MOE_CHUNK_GRID", True),
                   int4_mma=_flag(env, "KDTREE_INT4_MMA", True),
                   device_rounds=_flag(env, "KDTREE_DEVICE_ROUNDS", None),
                   # unset: on a real GPU (docs/ENGINE.md, "AR steps on the device"), not
                   # under the simulator, which runs each launch to its end (no host work to
                   # hide) and whose launch counter models the host loop's step
                   ar_device_steps=_steps(env, "KDTREE_AR_DEVICE_STEPS",
                                          0 if simulator else AR_STEPS_ON),
                   rounds_per_launch=max(1, _steps(env, "KDTREE_ROUNDS_PER_LAUNCH", 1,
                                                   ROUNDS_ON, ROUNDS_MAX, "rounds a launch")),
                   wait_near_end=_margin(env, "KDTREE_WAIT_NEAR_END"),
                   early_round=_flag(env, "KDTREE_EARLY_ROUND", True),
                   prompt_lookup=_lookup_weight(env, "KDTREE_PROMPT_LOOKUP"),
                   fused_latents=_flag(env, "KDTREE_FUSED_LATENTS", True),
                   pad_prefills=_flag(env, "KDTREE_PAD_PREFILLS", True),
                   lean_round=_flag(env, "KDTREE_LEAN_ROUND", True),
                   auto_v2=_flag(env, "KDTREE_AUTO_V2", True),
                   fewer_launches=_flag(env, "KDTREE_FEWER_LAUNCHES", False),
                   round_epilogue=_flag(env, "KDTREE_ROUND_EPILOGUE", True),
                   merge_in_uv=_flag(env, "KDTREE_MERGE_IN_UV", False),
                   fused_swiglu=_flag(env, "KDTREE_FUSED_SWIGLU", True),
                   invariant_attention=_flag(env, "KDTREE_INVARIANT_ATTENTION", False),
                   shared_in_experts=_flag(env, "KDTREE_SHARED_IN_EXPERTS", True),
                   combine_in_down=_flag(env, "KDTREE_COMBINE_IN_DOWN", False),
                   group_in_experts=_flag(env, "KDTREE_GROUP_IN_EXPERTS", False),
                   fused_router=_flag(env, "KDTREE_FUSED_ROUTER", False),
                   mma_sums_in_last=_flag(env, "KDTREE_MMA_SUMS_IN_LAST", False),
                   mma_tma=_flag(env, "KDTREE_MMA_TMA", False),
                   mma_stream_k=_steps(env, "KDTREE_MMA_STREAM_K", 0, 1, 2,
                                       "waves of tiles shared out"),
                   attention_wgmma=_flag(env, "KDTREE_ATTENTION_WGMMA", False),
                   kernel_cache=_flag(env, "KDTREE_KERNEL_CACHE", True),
                   kernel_cache_dir=_cache_dir(env),
                   blas_threads=_positive(env, "OPENBLAS_NUM_THREADS"))


_AT_IMPORT = RuntimeConfig.from_environment()
_configured: RuntimeConfig | None = None
_held: RuntimeConfig | None = None


def current() -> RuntimeConfig:
    """The configuration in force: the one :func:`configure` installed, else the one a
    :func:`holding` call holds, else the environment's per-call switches now beside the
    import-time ones."""
    if _configured is not None:
        return _configured
    if _held is not None:
        return _held
    # read per call (a benchmark or a test flips a switch between calls), but parsed once per
    # distinct environment: the MoE asks on every call
    return _from_values(tuple(os.environ.get(name) for name in VARIABLES))


@functools.lru_cache(maxsize=16)
def _from_values(values: tuple) -> RuntimeConfig:
    env = {name: value for name, value in zip(VARIABLES, values) if value is not None}
    # the simulator as at import, also for what an unset switch derives from it (AR's steps)
    env["NUMBA_ENABLE_CUDASIM"] = "1" if _AT_IMPORT.simulator else "0"
    now = RuntimeConfig.from_environment(env)
    return dataclasses.replace(now, **{f: getattr(_AT_IMPORT, f) for f in FIXED_AT_IMPORT})


def holding(fn):
    """Decorate ``fn`` (engine.generate) to run with the configuration in force at its call
    held for the whole call: the per-call switches read from the environment once, where
    each :func:`current` read ~20 variables (a DDTree round asks several times; run 151's
    host profile of a replayed round found a sixth of generate()'s host time there).  A
    switch flipped between calls still takes effect; one flipped inside the call does not.
    Inside a held call, a nested one keeps the outer one's; :func:`configure` wins always."""
    @functools.wraps(fn)
    def held_call(*args, **kwargs):
        global _held
        if _configured is not None or _held is not None:
            return fn(*args, **kwargs)
        _held = current()
        try:
            return fn(*args, **kwargs)
        finally:
            _held = None
    return held_call


def configure(**changes) -> RuntimeConfig:
    """Install the current configuration with ``changes`` (field names of RuntimeConfig) for the
    rest of the process, e.g. ``configure(cuda_graphs=False)`` from a command-line flag.  A
    switch fixed at import cannot change: asking for another value raises ValueError (set its
    environment variable before the package is imported instead)."""
    global _configured
    names = {f.name for f in dataclasses.fields(RuntimeConfig)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ValueError(f"unknown runtime switch(es) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(names))}")
    base = current()
    for name in FIXED_AT_IMPORT:
        if name in changes and changes[name] != getattr(base, name):
            raise ValueError(f"runtime switch {name} is fixed when kdtree_numba is imported "
                             f"({getattr(base, name)!r}); set its environment variable first")
    _configured = dataclasses.replace(base, **changes)
    return _configured


def reset() -> None:
    """Forget :func:`configure`: the environment decides again."""
    global _configured
    _configured = None


def quiet_numba_hints() -> None:
    """kdtree_numba/compat.py's job 6: numba's low-occupancy hint off unless the caller set
    ``NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS``.  Through the environment, as numba re-reads its
    NUMBA_* variables before each compile (a value set on its config module would not hold)."""
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")


def point_numba_cache(path: str) -> None:
    """numba's kernel cache into ``path`` (kdtree_numba/kernel_cache.py): through
    ``NUMBA_CACHE_DIR``, which numba re-reads with its other NUMBA_* variables before a compile
    once one of them changed, resetting a value set on its config module alone (as
    :func:`quiet_numba_hints`' variable did: runs 170-172), and on the config for now."""
    os.environ["NUMBA_CACHE_DIR"] = path
    from numba.cuda.core import config
    config.CACHE_DIR = path


def child_environment(**changes: str | None) -> dict:
    """This process's environment for a child process, with ``changes`` (None removes a
    variable): the precompile workers (kdtree_numba/precompile.py) get the kernel cache
    directory in force here and, where they must compile for real, no simulator switch."""
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env

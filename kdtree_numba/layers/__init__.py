"""The model's non-attention kernels on the GPU (numba.cuda).  Contract: ``reference.layers``.

Same functions, same names and semantics as the reference; kernel designs, tolerances and why
are in docs/LAYERS.md.  Inputs may be NumPy arrays (copied to the device), numba device arrays
or CuPy arrays (wrapped zero-copy); results are numba device arrays left on the device, and no
function synchronises with the host.  Every function takes ``stream=`` (a numba stream, e.g.
``cuda.external_stream(cupy_stream.ptr)`` inside a CUDA-graph capture) and ``workspace=`` (a
:class:`Workspace` whose buffers are reused, so a warmed-up call allocates nothing).

bfloat16 weights are ``ml_dtypes.bfloat16`` arrays (``uint16`` arrays are read as bf16 bit
patterns).  Kernels receive them as integers and widen in-kernel, ``f32 = bits << 16``, because
``numba.cuda.bf16`` exists neither in the simulator nor as a vector load.

Two properties hold by construction and are tested:
* batch invariance: a row's result does not depend on the other rows of the call -- every row
  has its own accumulators and a summation order fixed by the weight shape alone.  rmsnorm,
  rope, argmax: any M.  linear and moe_ffn run one of two kernels by M (``method="auto"``):
  weight streaming up to ``SKINNY_MAX_M`` rows, tiled above; each is batch invariant, and a
  row gets the same bits from any M on the same side, but the two sides sum in different
  orders (a row alone, M = 1, and the same row in a 65-row verify batch differ in the last
  bits; docs/LAYERS.md);
* a bf16 weight gives bit-identical results to the float32 weight holding the same values.

One module per kernel family, named as in reference/layers/: norm, rope, linear, embedding,
argmax, moe and common each have a reference twin of the same name; skinny, tiled and
gemm_source are the two GEMMs behind linear(), mma the bf16 tensor-core GEMM behind
``linear(method="mma")`` and ``method="tensor-cores"`` (twin: reference/layers/linear.py).

* ``norm``        -- rmsnorm, add_rmsnorm;
* ``rope``        -- rope (RopeSpec and YarnScaling are the reference's own classes);
* ``latents``     -- mla_latents, mla_q_split: an MLA layer's norms and ropes between its
  projections, one launch each (bitwise norm's and rope's);
* ``linear``      -- linear(): picks the skinny or the tiled GEMM and launches it;
* ``skinny``      -- the weight-streaming GEMM (SkinnyConfig, skinny_config);
* ``tiled``       -- the tiled GEMM (tiled_config, its K slices, the kernel factory);
* ``gemm_source`` -- the source generator of the tiled kernels, and their shape TiledConfig;
* ``mma``         -- the bf16 tensor-core GEMM (method="mma" or "tensor-cores", never
  "auto"): its kernels and launchers;
* ``mma_plan``    -- its plan: MmaConfig, the tile and K slices for M rows (mma_config), the
  warpgroup tile past 80 rows on sm_90, the error bound;
* ``embedding``, ``argmax``;
* ``moe``         -- moe_ffn, and the routing of ``moe_route`` re-exported;
* ``moe_route``   -- routing: router_logits, route_from_logits, moe_route;
* ``moe_mma``     -- the grouped expert GEMMs on tensor cores behind moe_ffn(method="mma");
* ``workspace``   -- Workspace and the host helpers for device arrays and dtypes;
* ``common``      -- constants (SKINNY_MAX_M, CHUNK, GPU_SMS) and helpers the modules share.

This package re-exports the functions ``linear``, ``rope``, ``embedding`` and ``argmax`` over
the submodules of the same names: ``kdtree_numba.layers.linear`` is the function, and so is
``import kdtree_numba.layers.linear as m``.  Reach a module's names with ``from
kdtree_numba.layers.linear import ...`` (what the modules here do).
"""
from __future__ import annotations

from kdtree_numba.layers.argmax import argmax
from kdtree_numba.layers.common import CHUNK, GPU_SMS, SKINNY_MAX_M  # noqa: F401
from kdtree_numba.layers.embedding import embedding
from kdtree_numba.layers.latents import mla_latents, mla_q_split
from kdtree_numba.layers.linear import linear
from kdtree_numba.layers.mma import (  # noqa: F401
    MmaConfig, mma_config, mma_error_coefficient, mma_splits)
from kdtree_numba.layers.moe import (  # noqa: F401
    expert_config, expert_tiled_configs, moe_ffn, moe_route,
    route_from_logits, router_logits)
from kdtree_numba.layers.moe_mma import moe_mma_config  # noqa: F401
from kdtree_numba.layers.norm import add_rmsnorm, rmsnorm
from kdtree_numba.layers.rope import RopeSpec, YarnScaling, rope
from kdtree_numba.layers.skinny import (  # noqa: F401
    ROWS_UNROLL, SkinnyConfig, skinny_config, skinny_threads)
from kdtree_numba.layers.tiled import (  # noqa: F401
    TiledConfig, tiled_config, tiled_depth, tiled_splits)
from kdtree_numba.layers.workspace import Workspace

__all__ = ["rmsnorm", "add_rmsnorm", "RopeSpec", "YarnScaling", "rope", "linear", "embedding",
           "argmax", "router_logits", "route_from_logits", "moe_route", "moe_ffn", "Workspace",
           "SkinnyConfig", "TiledConfig", "skinny_config", "tiled_config", "tiled_splits",
           "tiled_depth", "expert_tiled_configs", "SKINNY_MAX_M", "mla_latents", "mla_q_split"]

# Public too, though not in __all__ (the benchmarks and GPU tests use them): ROWS_UNROLL,
# skinny_threads, expert_config, CHUNK, GPU_SMS, MmaConfig, mma_config, mma_splits,
# mma_error_coefficient, moe_mma_config.  The tile plans that lost to the defaults are
# dev/cuda/layers.py's.

# The attention kernels live in kdtree_numba.attention; one namespace for the whole model.
from kdtree_numba.attention import *  # noqa: E402,F401,F403

"""Absorbed-MLA attention (prefill, decode, DDTree verify) as numba.cuda kernels.

The numba twin of ``reference.attention``: the contract (shapes, dtypes, masking, the empty-row
rule) is the docstring of reference/attention/mla.py (``mla_attention``) and
reference/attention/projections.py (``absorb_q``, ``apply_uv``); these functions compute the same
thing in float32 on the device.  docs/ATTENTION.md explains the kernel design (their speed:
docs/BENCHMARKS.md).  One module per part:

==============  ==============================================================================
module          holds
==============  ==============================================================================
tiles.py        what both block kernels share: constants, ``block_keys`` (a block's request,
                split and key range), ``masked_score``, the ``cp.async`` row-tile copier
plan.py         pure-Python planning: ``TileConfig`` / ``MmaTileConfig``, ``VARIANTS`` (the
                default ``"tf32x3"`` and the fallback ``"pipe16x2"``), ``resolve_variant``,
                ``tile_config``, ``choose_splits``, ``mma_rows``
ffma.py         the FFMA (CUDA-core) block kernel, one body for any ``TileConfig`` layout
mma.py          the 3xTF32 tensor-core block kernel (``"tf32x3"``; GPU only)
bf16.py         the block kernel of a bf16 latent cache (``ckv``, ``kpe`` as uint16 bits) on
                bf16 tensor cores; ``Bf16TileConfig`` (plan.py) shapes it
mla.py          ``mla_attention``: ``MlaAttentionPlan`` (plan -> block kernel -> merge), the
                merge kernel, launch plumbing and ``PlanCache``, the plans of one owner (a
                model) by problem shape
projections.py  ``absorb_q``, ``apply_uv`` (one small GEMM per head; on bf16 tensor cores
                given ``bf16_head_weights``)
==============  ==============================================================================

Imports run one way: tiles <- plan <- ffma, mma, bf16 <- mla; projections needs tiles and, for its
bf16 path, layers/mma.py (imported where it is called: kdtree_numba.layers re-exports this
package).  This package re-exports the public API that ``kdtree_numba.attention`` and
``kdtree_numba.attention_mma`` had as modules.
"""
from kdtree_numba.compat import to_device  # noqa: F401  (tests and tools stage inputs with it)

from kdtree_numba.attention.mla import (MERGE_THREADS, MlaAttentionPlan,  # noqa: F401
                                        PendingMerge,
                                        PlanCache, clear_plan_cache, mla_attention)
# build_kernel: the tensor-core kernel's builder, under its name in the old attention_mma module
from kdtree_numba.attention.mma import build_kernel
from kdtree_numba.attention.plan import (BLOCK_OVERHEAD_KEYS, DEFAULT_VARIANT,  # noqa: F401
                                         BF16_VARIANT, FALLBACK_VARIANT, FFMA_VARIANTS,
                                         Bf16TileConfig, bf16_fits,
                                         MERGE_BYTES_PER_KEY_TIME, MMA_ROWS, VARIANTS,
                                         MmaTileConfig, TileConfig, choose_splits,
                                         gpu_tile_config, mma_fits, mma_rows, resolve_variant,
                                         sim_tile_config, tile_config, uses_tensor_cores)
from kdtree_numba.attention.projections import (Bf16HeadWeights, absorb_q, apply_uv,
                                                 bf16_head_weights)
from kdtree_numba.attention.tiles import (MAX_SHARED_BYTES, NEG_INF, ONE,  # noqa: F401
                                          RESCALE_SLACK, ZERO, block_keys, masked_score)

__all__ = ["mla_attention", "absorb_q", "apply_uv", "MlaAttentionPlan", "TileConfig",
           "tile_config", "choose_splits", "resolve_variant", "VARIANTS", "DEFAULT_VARIANT",
           "FALLBACK_VARIANT", "FFMA_VARIANTS", "PlanCache", "clear_plan_cache",
           "MmaTileConfig", "mma_fits", "mma_rows", "MMA_ROWS", "build_kernel",
           "Bf16TileConfig", "bf16_fits", "BF16_VARIANT",
           "Bf16HeadWeights", "bf16_head_weights", "PendingMerge"]

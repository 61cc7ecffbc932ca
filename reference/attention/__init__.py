"""Absorbed-MLA attention for prefill, decode and DDTree verify: the NumPy reference.

This docstring and those of its modules are the contract; ``kdtree_numba.attention`` implements
the same functions on the GPU and points here.

Absorbed MLA (DeepSeek-V3 / Kimi-K2, see docs/ATTENTION.md) is multi-query attention with
one latent KV head: the cache holds, per token slot, the compressed latent ``ckv`` (r = 512) and
the rotated rope key ``kpe`` (dr = 64).  Each query head h carries ``q_abs = W_UK[h]^T q_nope``
(r wide, see :func:`absorb_q`) and its rotated ``q_pe`` (dr wide).

Then ``o = apply_uv(u, kv_b_proj, dv)`` gives the per-head value output [bs, n, H, dv] that
``o_proj`` consumes.  :func:`naive_mla_attention` is the un-absorbed per-head form (decompress
k = [W_UK c ; k_pe], v = W_UV c, standard softmax attention) used only as a test oracle.

This reference computes in float64 and returns float32 (u, q_abs, o); ``out_dtype=np.float64``
keeps the float64 result for oracle tests.  :func:`fp32_error_bound` states how far a float32
implementation (the numba twin) may differ from it.

One module per part, named as in the numba twin where it has one:

==============  ==============================================================================
module          contract of
==============  ==============================================================================
mla.py          ``mla_attention`` (the table of arguments), ``paged_mla_attention`` (over a
                paged cache: reference/paged.py), ``naive_mla_attention``,
                ``fp32_error_bound``, ``visible_slots``, ``check_causal``
projections.py  ``split_kv_b_proj``, ``absorb_q``, ``apply_uv``
mask.py         ``tree_visible``
==============  ==============================================================================
"""
from __future__ import annotations

from .mask import tree_visible
from .mla import (UNIT_ROUNDOFF_BF16, UNIT_ROUNDOFF_F32, bf16_error_bound,  # noqa: F401
                  bf16_operands, bf16_round, bf16_widen, check_causal, fp32_error_bound,
                  mla_attention, naive_mla_attention, paged_mla_attention, visible_slots)
from .projections import absorb_q, apply_uv, split_kv_b_proj

__all__ = ["mla_attention", "paged_mla_attention", "absorb_q", "apply_uv",
           "naive_mla_attention", "split_kv_b_proj",
           "visible_slots", "tree_visible", "fp32_error_bound", "bf16_error_bound",
           "bf16_operands", "bf16_round", "bf16_widen", "check_causal"]

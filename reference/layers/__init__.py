"""The model's non-attention kernels (DeepSeek-V3 / Kimi-K2): the NumPy reference.

This docstring and those of its modules are the contract; ``kdtree_numba.layers`` implements the
same functions on the GPU and points here.  Math, Hugging Face conventions, kernel designs,
tolerances and the test-vector layout: docs/LAYERS.md.

Conventions.  Activations are float32.  Weights are float32 or bfloat16 (``ml_dtypes.bfloat16``
arrays: stored bf16, every product accumulated in float32 on the GPU, float64 here), or here
int4-group (``formats.int4_group.Int4GroupWeight``: dequantised exactly in float64 first,
``common.as_float64``).  Weights
use the Hugging Face layout ``[out, in]`` with ``y = x W^T``.  This reference computes in
float64 and returns float32 (int32 for indices).

==============================================  ===============================================
function                                        returns
==============================================  ===============================================
rmsnorm(x [M,D], weight [D], eps)               [M,D]  ``weight * x / sqrt(mean(x^2) + eps)``
add_rmsnorm(x, delta [M,D], weight, eps)        (s = x + delta in float32, rmsnorm(s, ...))
rope(x [M,H,dr], positions [M], spec)           [M,H,dr] rotated, halves layout (rope.py)
mla_latents(x [M,q+r+dr], q_norm, kv_norm,      (rmsnorm(x[:, :q]), rmsnorm(x[:, q:q+r]),
            positions, spec, eps, q_lora, rank)  rope(x[:, q+r:])): an MLA layer's latents
mla_q_split(q [M,H,dn+dr], positions, spec, dn) (q[..., :dn], rope(q[..., dn:])) (latents.py)
RopeSpec.softmax_scale(qk_head_dim)             tau = qk_head_dim^-0.5 * m(factor, mscale_all_dim)^2
linear(x [M,K], w [N,K])                        [M,N]  ``x w^T``
embedding(ids [M], table [V,D])                 [M,D]  ``table[ids]`` as float32
argmax(logits [M,V])                            [M] int32, first maximum (ties: smaller index)
router_logits(h [M,D], gate_w [E,D])            [M,E]  ``h gate_w^T`` (float64 here)
route_from_logits(logits [M,E], bias, ...)      (expert_idx [M,k] int32 ascending, weight [M,k])
moe_route(h, gate_w, bias, ...)                 route_from_logits(router_logits(h, gate_w), ...)
moe_ffn(h, expert_idx, weight, gate_up, down,   [M,D]  ``sum_j weight[m,j] FFN_{idx[m,j]}(h[m])
        shared_gate_up, shared_down)                   + FFN_shared(h[m])``
moe_ffn(h, None, None, gate_up [1,2I,D],        [M,D]  the dense FFN ``FFN_0(h[m])`` (is_dense)
        down [1,D,I])
==============================================  ===============================================

The rules behind the table live with the code: the RoPE layout and YaRN in rope.py, routing and
the MoE FFN in moe.py.  One module per kernel family (the numba twin mirrors the names): norm.py
(rmsnorm), rope.py, latents.py (the two composed, as an MLA layer needs them), linear.py,
embedding.py, argmax.py, moe.py; common.py holds ``as_float64``.

This namespace also re-exports ``reference.attention`` (one namespace for the whole model).
"""
from __future__ import annotations

from .argmax import argmax
from .common import as_float64
from .embedding import embedding
from .latents import mla_latents, mla_q_split
from .linear import linear
from .moe import (check_routing_args, is_dense, moe_ffn, moe_route, route_from_logits,
                  router_logits, silu)
from .norm import add_rmsnorm, rmsnorm
from .rope import RopeSpec, YarnScaling, rope, rotate, yarn_mscale

__all__ = ["rmsnorm", "add_rmsnorm", "YarnScaling", "RopeSpec", "yarn_mscale", "rope", "rotate",
           "linear", "embedding", "argmax", "router_logits", "route_from_logits", "moe_route", "moe_ffn",
           "silu", "as_float64", "check_routing_args", "is_dense", "mla_latents", "mla_q_split"]

# The attention references live in reference/attention/; one namespace for the whole model.
# reference.attention imports nothing from reference.layers, so this makes no import circle.
from ..attention import *  # noqa: E402,F401,F403

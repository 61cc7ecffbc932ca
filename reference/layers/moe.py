"""MoE routing and the expert FFN: the NumPy reference.  This docstring is the contract of
``router_logits``, ``route_from_logits``, ``moe_route`` and ``moe_ffn``.

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.

Routing (per token, ``scoring="sigmoid"``, DeepSeek-V3/Kimi-K2 ``noaux_tc``): ``s = sigmoid(l)``;
selection key ``s + bias`` (bias only selects); with ``n_group > 1`` a group's score is the sum of
its two largest keys, the ``topk_group`` best groups are kept and every other expert's key becomes
``-inf`` (not 0); the ``top_k`` largest keys are chosen.  ``scoring="softmax"`` (DeepSeek-V2):
``s = softmax(l)``, a group's score is its largest key.  Ties, at both steps: the lower index wins.
Weights come from the *unbiased* ``s``: ``w = s / (sum_selected s + 1e-20)`` if
``norm_topk_prob``, then ``w *= routed_scaling_factor`` (always; for a DeepSeek-V2 checkpoint with
``norm_topk_prob`` true pass ``routed_scaling_factor=1``, as V2 skips the factor then).
``expert_idx`` rows are sorted ascending by expert index and ``weight`` follows that order.

MoE FFN.  Expert weights are HF-fused: ``gate_up [E, 2*Im, D]`` (gate rows first, then up rows)
and ``down [E, D, Im]``; the shared expert ``shared_gate_up [2*Is, D]``, ``shared_down [D, Is]``
(both None when the model has none).  ``FFN(h) = down (silu(gate h) * (up h))``.
A dense FFN (DeepSeek-V3's first layers) is one expert every token takes with weight 1:
``expert_idx`` and ``weight`` both None, ``gate_up [1, 2I, D]``, ``down [1, D, I]``, no shared
expert (:func:`is_dense`).  It equals the explicit routing (zeros [M, 1], ones [M, 1]); the
numba twin runs it as two projections where that is faster.
"""
from __future__ import annotations

import numpy as np

from .common import as_float64

__all__ = ["router_logits", "route_from_logits", "moe_route", "moe_ffn", "silu",
           "check_routing_args", "is_dense"]


def silu(v):
    return v / (1.0 + np.exp(-v))


# ----------------------------------------------------------------------------- MoE routing

def router_logits(h, gate_w) -> np.ndarray:
    """``h [M, D] @ gate_w [E, D]^T`` in float64 (the router runs in fp32 or better, never bf16)."""
    return as_float64(h) @ as_float64(gate_w).T


def _first_k_by_key(keys: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest keys (ties: lower index first), in that rank order."""
    order = np.lexsort((np.arange(keys.shape[-1]), -keys))  # primary: key desc, then index asc
    return order[:k]


def check_routing_args(E, top_k, n_group, topk_group, scoring):
    """Raise ValueError unless the routing keywords fit ``E`` experts (both twins call it)."""
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, E={E}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group={n_group} must divide E={E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    if n_group > 1 and topk_group * (E // n_group) < top_k:
        raise ValueError("the kept groups hold fewer than top_k experts")
    if scoring == "sigmoid" and n_group > 1 and E // n_group < 2:
        raise ValueError("sigmoid group scores sum the top 2 keys: need >= 2 experts per group")


def route_from_logits(logits, bias=None, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                      norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                      scoring: str = "sigmoid"):
    """Route each token from its router logits [M, E]; rules in the module docstring.

    Returns ``(expert_idx [M, top_k] int32 ascending, weight [M, top_k] float32)``.
    """
    logits = as_float64(logits)
    M, E = logits.shape
    check_routing_args(E, top_k, n_group, topk_group, scoring)
    if scoring == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    keys = scores + (0.0 if bias is None else as_float64(bias)[None, :])
    group_size = E // n_group
    idx = np.empty((M, top_k), np.int32)
    weight = np.empty((M, top_k), np.float32)
    for m in range(M):
        key = keys[m].copy()
        if n_group > 1:
            grouped = key.reshape(n_group, group_size)
            if scoring == "sigmoid":
                group_score = np.sort(grouped, axis=1)[:, -2:].sum(axis=1)
            else:
                group_score = grouped.max(axis=1)
            kept = np.zeros(n_group, bool)
            kept[_first_k_by_key(group_score, topk_group)] = True
            key[~np.repeat(kept, group_size)] = -np.inf
        chosen = np.sort(_first_k_by_key(key, top_k))
        w = scores[m, chosen]
        if norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        idx[m] = chosen
        weight[m] = (w * routed_scaling_factor).astype(np.float32)
    return idx, weight


def moe_route(h, gate_w, bias=None, **routing):
    """Router logits then :func:`route_from_logits` (keywords as there)."""
    return route_from_logits(router_logits(h, gate_w), bias, **routing)


# ----------------------------------------------------------------------------- MoE FFN

def _ffn(h64: np.ndarray, gate_up64: np.ndarray, down64: np.ndarray) -> np.ndarray:
    """SwiGLU FFN of rows h64 [T, D] with a fused gate_up [2I, D] and down [D, I], float64."""
    inter = gate_up64.shape[0] // 2
    gu = h64 @ gate_up64.T
    return (silu(gu[:, :inter]) * gu[:, inter:]) @ down64.T


def is_dense(expert_idx, weight, gate_up, shared_gate_up=None) -> bool:
    """Whether a moe_ffn call is a dense FFN (``expert_idx`` and ``weight`` None); ValueError
    for a half-given routing, or a dense call with several experts or a shared expert (both
    twins call it)."""
    if (expert_idx is None) != (weight is None):
        raise ValueError("pass both expert_idx and weight, or neither (a dense FFN)")
    if expert_idx is not None:
        return False
    if len(gate_up.shape) != 3 or gate_up.shape[0] != 1 or shared_gate_up is not None:
        raise ValueError("a dense FFN (expert_idx and weight None) takes one expert, "
                         "gate_up [1, 2I, D] and down [1, D, I], and no shared expert")
    return True


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None):
    """``out[m] = sum_j weight[m,j] FFN_{expert_idx[m,j]}(h[m]) + FFN_shared(h[m])`` [M, D] f32;
    a dense FFN with ``expert_idx`` and ``weight`` None (:func:`is_dense`).

    Computed expert by expert (each expert's weights widened once, for all its tokens).
    """
    if is_dense(expert_idx, weight, gate_up, shared_gate_up):
        m = np.shape(h)[0]
        expert_idx, weight = np.zeros((m, 1), np.int32), np.ones((m, 1), np.float32)
    h64 = as_float64(h)
    expert_idx = np.asarray(expert_idx)
    weight = as_float64(weight)
    M, D = h64.shape
    E, two_im, d_in = gate_up.shape
    if d_in != D or down.shape != (E, D, two_im // 2) or expert_idx.shape != weight.shape \
            or expert_idx.shape[0] != M:
        raise ValueError("moe_ffn shapes disagree: h [M,D], expert_idx/weight [M,k], "
                         "gate_up [E,2Im,D], down [E,D,Im]")
    if expert_idx.size and (expert_idx.min() < 0 or expert_idx.max() >= E):
        raise ValueError(f"expert index out of range [0, {E})")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("pass both shared_gate_up and shared_down, or neither")
    out = np.zeros((M, D), np.float64)
    for e in np.unique(expert_idx):
        tokens, slots = np.nonzero(expert_idx == e)
        y = _ffn(h64[tokens], as_float64(gate_up[e]), as_float64(down[e]))
        np.add.at(out, tokens, weight[tokens, slots][:, None] * y)
    if shared_gate_up is not None:
        out += _ffn(h64, as_float64(shared_gate_up), as_float64(shared_down))
    return out.astype(np.float32)


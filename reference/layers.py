"""The model's non-attention kernels (DeepSeek-V3 / Kimi-K2): the NumPy reference.

This docstring is the contract; ``kdtree_numba.layers`` implements the same functions on the
GPU and points here.  Math and Hugging Face conventions: shared/notes/mla-moe.md.  Kernel
designs, tolerances and the test-vector layout: docs/LAYERS.md.

Conventions.  Activations are float32.  Weights are float32 or bfloat16 (``ml_dtypes.bfloat16``
arrays: stored bf16, every product accumulated in float32 on the GPU, float64 here).  Weights
use the Hugging Face layout ``[out, in]`` with ``y = x W^T``.  This reference computes in
float64 and returns float32 (int32 for indices).

==============================================  ===============================================
function                                        returns
==============================================  ===============================================
rmsnorm(x [M,D], weight [D], eps)               [M,D]  ``weight * x / sqrt(mean(x^2) + eps)``
rope(x [M,H,dr], positions [M], spec)           [M,H,dr] rotated, halves layout (see below)
RopeSpec.softmax_scale(qk_head_dim)             tau = qk_head_dim^-0.5 * m(factor, mscale_all_dim)^2
linear(x [M,K], w [N,K])                        [M,N]  ``x w^T``
embedding(ids [M], table [V,D])                 [M,D]  ``table[ids]`` as float32
argmax(logits [M,V])                            [M] int32, first maximum (ties: smaller index)
router_logits(h [M,D], gate_w [E,D])            [M,E]  ``h gate_w^T`` (float64 here)
route_from_logits(logits [M,E], bias, ...)      (expert_idx [M,k] int32 ascending, weight [M,k])
moe_route(h, gate_w, bias, ...)                 route_from_logits(router_logits(h, gate_w), ...)
moe_ffn(h, expert_idx, weight, gate_up, down,   [M,D]  ``sum_j weight[m,j] FFN_{idx[m,j]}(h[m])
        shared_gate_up, shared_down)                   + FFN_shared(h[m])``
==============================================  ===============================================

RoPE.  ``theta_i = inv_freq_i = base^(-2i/dr)`` for i < dr/2 (YaRN-corrected when
``spec.yarn``), angle ``p * theta_i`` in float64, cos/sin multiplied by the YaRN amplitude
``m(factor, mscale) / m(factor, mscale_all_dim)``.  Pair i is ``(x[2i], x[2i+1])`` when
``spec.interleave`` (the real DeepSeek/Kimi checkpoints) and ``(x[i], x[i + dr/2])`` otherwise
(NeoX halves); either way the rotated pair is written to ``(out[i], out[i + dr/2])``:
``out[i] = a cos - b sin, out[i + dr/2] = b cos + a sin``.  The interleaved output is thus
de-interleaved, exactly as HF ``apply_rotary_pos_emb_interleave`` (permute, then rotate_half).

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["rmsnorm", "YarnScaling", "RopeSpec", "yarn_mscale", "rope", "linear", "embedding",
           "argmax", "router_logits", "route_from_logits", "moe_route", "moe_ffn", "silu",
           "as_float64"]


def as_float64(a) -> np.ndarray:
    """float32 / bfloat16 / float64 array -> float64 (bf16 widens exactly)."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    return a.astype(np.float64)


# ----------------------------------------------------------------------------- RMSNorm

def rmsnorm(x, weight, eps: float) -> np.ndarray:
    """``y = weight * x / sqrt(mean(x^2, axis=-1) + eps)``; x [M, D] float32, weight [D]."""
    x64, w64 = as_float64(x), as_float64(weight)
    if x64.ndim != 2 or w64.shape != (x64.shape[1],):
        raise ValueError(f"rmsnorm wants x [M, D] and weight [D], got {x64.shape}, {w64.shape}")
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + eps)
    return (w64 * (x64 * inv)).astype(np.float32)


# ----------------------------------------------------------------------------- RoPE

def yarn_mscale(scale: float, mscale: float) -> float:
    """``m(s, mu) = 1 + 0.1 mu ln(s)`` for s > 1, else 1 (DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """The ``rope_scaling`` entries of a YaRN config (HF names)."""
    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of the ``head_dim`` (= qk_rope_head_dim, dr) rope channels."""
    theta: float
    head_dim: int
    interleave: bool = True
    yarn: YarnScaling | None = None

    def __post_init__(self):
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"rope head_dim must be even and positive, got {self.head_dim}")

    def inv_freq(self) -> np.ndarray:
        """float64 [dr/2]: ``base^(-2i/dr)``, blended toward ``/factor`` by the YaRN ramp."""
        dr = self.head_dim
        theta = self.theta ** (-np.arange(0, dr, 2, dtype=np.float64) / dr)
        if self.yarn is None:
            return theta
        y = self.yarn

        def correction(rotations):  # the channel whose wavelength fits `rotations` times in L0
            return dr * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) \
                / (2 * math.log(self.theta))

        low = max(math.floor(correction(y.beta_fast)), 0)
        high = min(math.ceil(correction(y.beta_slow)), dr - 1)
        if low == high:
            high += 0.001  # as HF/DeepSeek: avoid a zero-width ramp
        ramp = np.clip((np.arange(dr // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return theta / y.factor * ramp + theta * (1.0 - ramp)

    def amplitude(self) -> float:
        """The factor on cos and sin: ``m(factor, mscale) / m(factor, mscale_all_dim)``."""
        if self.yarn is None:
            return 1.0
        y = self.yarn
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """Attention tau: ``qk_head_dim^-0.5``, times ``m(factor, mscale_all_dim)^2`` with YaRN.

        DeepSeek-V3 (qk_head_dim 192, factor 40) gives 0.135234; Kimi-K2 (factor 32) 0.130861.
        """
        tau = float(qk_head_dim) ** -0.5
        if self.yarn is not None:
            tau *= yarn_mscale(self.yarn.factor, self.yarn.mscale_all_dim) ** 2
        return tau

    @classmethod
    def from_hf_config(cls, config: dict) -> "RopeSpec":
        """From an HF config dict (``config.json``): ``rope_theta``, ``qk_rope_head_dim``,
        ``rope_interleave`` (DeepseekV3Config's default: true) and ``rope_scaling`` (or the
        transformers 5 ``rope_parameters``) with type/rope_type ``yarn`` or ``default``."""
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        theta = config.get("rope_theta", scaling.get("rope_theta", 10000.0))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        yarn = None
        if kind == "yarn":
            # HF reads missing beta_* as 32 / 1, missing mscale_all_dim as 0 (no tau factor).
            yarn = YarnScaling(
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(
                    scaling.get("original_max_position_embeddings", 4096)),
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0),
                mscale=float(scaling.get("mscale") or 1.0),
                mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))
        elif kind not in ("default", None):
            raise ValueError(f"rope type {kind!r} is not supported (yarn or default)")
        return cls(theta=float(theta), head_dim=int(config["qk_rope_head_dim"]),
                   interleave=bool(config.get("rope_interleave", True)), yarn=yarn)


def rope(x, positions, spec: RopeSpec) -> np.ndarray:
    """Rotate ``x [M, H, dr]`` float32 at integer ``positions [M]``; returns [M, H, dr] float32.

    The layout rules are in the module docstring; the output is always in halves layout.
    """
    x64 = as_float64(x)
    pos = np.asarray(positions)
    M, H, dr = x64.shape
    if dr != spec.head_dim or pos.shape != (M,):
        raise ValueError(f"rope wants x [M, H, {spec.head_dim}] and positions [M], "
                         f"got {x64.shape}, {pos.shape}")
    angle = pos.astype(np.float64)[:, None] * spec.inv_freq()[None, :]     # [M, dr/2]
    cos = (np.cos(angle) * spec.amplitude())[:, None, :]
    sin = (np.sin(angle) * spec.amplitude())[:, None, :]
    if spec.interleave:
        a, b = x64[..., 0::2], x64[..., 1::2]
    else:
        a, b = x64[..., : dr // 2], x64[..., dr // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(np.float32)


# ----------------------------------------------------------------------------- dense ops

def linear(x, w) -> np.ndarray:
    """``y [M, N] = x [M, K] @ w [N, K]^T`` (float64 accumulation, float32 result)."""
    x64, w64 = as_float64(x), as_float64(w)
    if x64.ndim != 2 or w64.ndim != 2 or x64.shape[1] != w64.shape[1]:
        raise ValueError(f"linear wants x [M, K], w [N, K]; got {x64.shape}, {w64.shape}")
    return (x64 @ w64.T).astype(np.float32)


def embedding(ids, table) -> np.ndarray:
    """``table[ids]`` as float32: ids [M] integer in [0, V), table [V, D] float32/bf16."""
    ids = np.asarray(ids)
    table = np.asarray(table)
    if ids.ndim != 1 or table.ndim != 2:
        raise ValueError(f"embedding wants ids [M], table [V, D]; got {ids.shape}, {table.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"token id out of range [0, {table.shape[0]})")
    return table[ids].astype(np.float32)


def argmax(logits) -> np.ndarray:
    """Index of each row's maximum, int32 [M]; ties (and -0.0 vs 0.0) go to the smaller index,
    a NaN counts as larger than any number (as ``np.argmax``: the first NaN wins)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax wants logits [M, V] with V > 0, got {logits.shape}")
    return np.argmax(logits, axis=1).astype(np.int32)


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


def _check_routing_args(E, top_k, n_group, topk_group, scoring):
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
    _check_routing_args(E, top_k, n_group, topk_group, scoring)
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


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None):
    """``out[m] = sum_j weight[m,j] FFN_{expert_idx[m,j]}(h[m]) + FFN_shared(h[m])`` [M, D] f32.

    Computed expert by expert (each expert's weights widened once, for all its tokens).
    """
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


# The attention references live in reference/attention.py; one namespace for the whole model.
try:
    from .attention import *  # noqa: E402,F401,F403
except ImportError:  # pragma: no cover - the attention module is optional here
    pass

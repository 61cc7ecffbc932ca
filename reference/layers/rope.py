"""Rotary embeddings with YaRN: the NumPy reference.  This docstring is the contract of ``rope``
and ``RopeSpec``.

Conventions (float32 activations, float32/bf16 weights ``[out, in]``, float64 inside) and
the table of every function: reference/layers/__init__.py.

RoPE.  ``theta_i = inv_freq_i = base^(-2i/dr)`` for i < dr/2 (YaRN-corrected when
``spec.yarn``), angle ``p * theta_i`` in float64, cos/sin multiplied by the YaRN amplitude
``m(factor, mscale) / m(factor, mscale_all_dim)``.  Pair i is ``(x[2i], x[2i+1])`` when
``spec.interleave`` (the real DeepSeek/Kimi checkpoints) and ``(x[i], x[i + dr/2])`` otherwise
(NeoX halves); either way the rotated pair is written to ``(out[i], out[i + dr/2])``:
``out[i] = a cos - b sin, out[i + dr/2] = b cos + a sin``.  The interleaved output is thus
de-interleaved, exactly as HF ``apply_rotary_pos_emb_interleave`` (permute, then rotate_half).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .common import as_float64

__all__ = ["YarnScaling", "RopeSpec", "yarn_mscale", "rope", "rotate"]


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
    return rotate(x, positions, spec, np.float64).astype(np.float32)


def rotate(x, positions, spec: RopeSpec, dtype) -> np.ndarray:
    """:func:`rope` computed in ``dtype``: angles, cos and sin in float64, rounded to
    ``dtype`` for the products (float64: the reference; float32: kdtree_numba/cpu.py's)."""
    x64 = as_float64(x) if dtype == np.float64 else np.asarray(x, dtype)
    pos = np.asarray(positions)
    M, H, dr = x64.shape
    if dr != spec.head_dim or pos.shape != (M,):
        raise ValueError(f"rope wants x [M, H, {spec.head_dim}] and positions [M], "
                         f"got {x64.shape}, {pos.shape}")
    angle = pos.astype(np.float64)[:, None] * spec.inv_freq()[None, :]     # [M, dr/2]
    cos = (np.cos(angle) * spec.amplitude()).astype(dtype)[:, None, :]
    sin = (np.sin(angle) * spec.amplitude()).astype(dtype)[:, None, :]
    if spec.interleave:
        a, b = x64[..., 0::2], x64[..., 1::2]
    else:
        a, b = x64[..., : dr // 2], x64[..., dr // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

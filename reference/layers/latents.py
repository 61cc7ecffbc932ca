"""What an MLA layer makes of its down-projections before attention: the NumPy reference.

An MLA layer projects its normed input once through ``q_a`` and ``kv_a`` stacked (``qkv_a``:
``x = h [q_a ; kv_a]^T``, ``[M, q_lora + r + dr]``; without a q LoRA only ``kv_a``, ``[M, r +
dr]``) and then needs three things of ``x``: the normed query latent ``q_a = rmsnorm(x[:,
:q_lora])`` (the input of ``q_b``), the normed KV latent ``c = rmsnorm(x[:, q_lora:q_lora +
r])`` and the rotated rope key ``k_pe = rope(x[:, q_lora + r:])`` (what the cache stores).
After ``q_b`` the query splits into its no-rope part (``absorb_q``'s input) and its rope part,
rotated.  :func:`mla_latents` and :func:`mla_q_split` are exactly those compositions of
``rmsnorm`` and ``rope`` (norm.py, rope.py): the numba twins (kdtree_numba/layers/latents.py)
do each in one launch where the parts took four and two, which is most of a small model's
forward on a GPU (each launch a few microseconds of a decode step's few hundred).
"""
from __future__ import annotations

import numpy as np

from .norm import rmsnorm
from .rope import RopeSpec, rope

__all__ = ["mla_latents", "mla_q_split"]


def mla_latents(x, q_norm, kv_norm, positions, spec: RopeSpec, eps: float, *, q_lora: int,
                rank: int):
    """``(q_a, c, k_pe)`` of ``x [M, q_lora + rank + dr]`` float32 (module docstring):
    ``q_a = rmsnorm(x[:, :q_lora], q_norm)`` [M, q_lora] (None where ``q_lora == 0``: a model
    without a q LoRA, ``q_norm`` None too), ``c = rmsnorm(x[:, q_lora:q_lora + rank],
    kv_norm)`` [M, rank] and ``k_pe = rope(x[:, q_lora + rank:], positions)`` [M, 1, dr]
    (``dr = spec.head_dim``), all float32; ``eps`` the two norms' epsilon."""
    x = np.asarray(x)
    m = x.shape[0] if x.ndim == 2 else -1
    if x.ndim != 2 or x.shape[1] != q_lora + rank + spec.head_dim or (q_lora == 0) != \
            (q_norm is None):
        raise ValueError(f"mla_latents wants x [M, {q_lora} + {rank} + {spec.head_dim}] and a "
                         f"q norm exactly when q_lora > 0, got x {x.shape}, q_lora {q_lora}, "
                         f"q norm {'none' if q_norm is None else 'given'}")
    q_a = rmsnorm(x[:, :q_lora], q_norm, eps) if q_lora else None
    c = rmsnorm(x[:, q_lora:q_lora + rank], kv_norm, eps)
    k_pe = rope(x[:, q_lora + rank:].reshape(m, 1, spec.head_dim), positions, spec)
    return q_a, c, k_pe


def mla_q_split(q, positions, spec: RopeSpec, *, dn: int):
    """``(q_nope, q_pe)`` of the query ``q [M, H, dn + dr]`` float32: its first ``dn``
    columns per head as they are ([M, H, dn], contiguous) and the last ``dr = spec.head_dim``
    rotated (``rope``, [M, H, dr])."""
    q = np.asarray(q)
    if q.ndim != 3 or q.shape[2] != dn + spec.head_dim:
        raise ValueError(f"mla_q_split wants q [M, H, {dn} + {spec.head_dim}], got {q.shape}")
    return np.ascontiguousarray(q[:, :, :dn], dtype=np.float32), rope(q[:, :, dn:], positions,
                                                                      spec)

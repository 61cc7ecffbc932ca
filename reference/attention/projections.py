"""The per-head projections around absorbed-MLA attention: the NumPy reference.

``absorb_q`` folds each head's W_UK into its query (``q_abs = W_UK[h]^T q_nope``, r wide), so
attention runs on the cached latents directly; ``apply_uv`` applies W_UV to the attention output
``u`` (``o = W_UV[h] u``, dv wide), which ``o_proj`` consumes.  Both read W_UK and W_UV from HF's
``kv_b_proj`` (layout: :func:`split_kv_b_proj`).

The family's overview (absorbed MLA, float64 inside, float32 results):
reference/attention/__init__.py.
"""
from __future__ import annotations

import numpy as np

__all__ = ["split_kv_b_proj", "absorb_q", "apply_uv"]


def split_kv_b_proj(kv_b_proj: np.ndarray, n_heads: int, dn: int):
    """``kv_b_proj [H*(dn+dv), r]`` -> ``(W_UK [H, dn, r], W_UV [H, dv, r])``.

    Head h owns rows ``[h*(dn+dv), (h+1)*(dn+dv))``; its first dn rows are W_UK (they make the
    no-rope key part), the last dv rows W_UV (they make the value), as in HF ``kv_b_proj``.
    """
    rows, r = kv_b_proj.shape
    if rows % n_heads or rows // n_heads <= dn:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={n_heads}, dn={dn}")
    per_head = kv_b_proj.reshape(n_heads, rows // n_heads, r)
    return per_head[:, :dn, :], per_head[:, dn:, :]


def absorb_q(q_nope: np.ndarray, kv_b_proj: np.ndarray, out_dtype=np.float32) -> np.ndarray:
    """``q_abs[b,i,h,:] = W_UK[h]^T q_nope[b,i,h,:]``: [bs, n, H, dn] -> [bs, n, H, r] float32."""
    n_heads, dn = q_nope.shape[-2], q_nope.shape[-1]
    w_uk, _ = split_kv_b_proj(np.asarray(kv_b_proj, np.float64), n_heads, dn)
    q_abs = np.einsum("...hd,hdr->...hr", np.asarray(q_nope, np.float64), w_uk)
    return q_abs.astype(out_dtype)


def apply_uv(u: np.ndarray, kv_b_proj: np.ndarray, dv: int, out_dtype=np.float32) -> np.ndarray:
    """``o[b,i,h,:] = W_UV[h] u[b,i,h,:]``: [bs, n, H, r] -> [bs, n, H, dv] float32.

    ``dv`` (v_head_dim) is needed because kv_b_proj's rows only give dn + dv.
    """
    n_heads = u.shape[-2]
    per_head = kv_b_proj.shape[0] // n_heads
    _, w_uv = split_kv_b_proj(np.asarray(kv_b_proj, np.float64), n_heads, per_head - dv)
    o = np.einsum("...hr,hvr->...hv", np.asarray(u, np.float64), w_uv)
    return o.astype(out_dtype)

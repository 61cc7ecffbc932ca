"""Absorbed-MLA attention: the NumPy reference.  This docstring is the contract of
``mla_attention``; :func:`naive_mla_attention` is its un-absorbed oracle and
:func:`fp32_error_bound` the tolerance of a float32 implementation.

The family's overview (absorbed MLA, float64 inside, float32 results):
reference/attention/__init__.py.

``mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, causal=False) -> u``

=============  ======================  =========================================================
argument       shape                   meaning
=============  ======================  =========================================================
q_abs          [bs, n, H, r]  float32  absorbed queries of the n new tokens of each request
q_pe           [bs, n, H, dr] float32  rope part of the queries (RoPE already applied)
ckv            [bs, max_len, r]        latent cache; slots [0, P_b) are the cached prefix, slots
                                       [P_b, P_b + n) hold the n new latents (already written)
kpe            [bs, max_len, dr]       rope keys, same slots (RoPE already applied)
prefix_len     [bs] int                P_b; needs P_b + n <= max_len
visible        [bs, n, n] bool         visible[b, i, j]: new query i may see new key j
tau            float                   softmax scale (includes the YaRN factor)
causal         bool                    a promise: ``visible[b, i, j]`` is false for j > i
u (returned)   [bs, n, H, r]  float32  softmax-weighted sum of the visible ckv rows
=============  ======================  =========================================================

Query i of request b sees every cached slot t < P_b, plus slot P_b + j wherever
``visible[b, i, j]``.  Its score against slot t is ``tau * (q_abs . ckv[t] + q_pe . kpe[t])``,
and ``u = sum_t softmax(score)_t * ckv[t]`` over the visible slots only.  The same mask serves
all H heads of a query.

* ``visible`` = lower-triangular (causal) is prefill, ``n = 1`` is decode, and a DDTree
  ancestor mask (``visible[i, j]`` iff j is i or an ancestor of i) is tree verification.
* A query that sees no slot at all (``P_b = 0`` and its ``visible`` row all false; e.g. a padding
  row of an empty request) gets ``u = 0``: an empty softmax is defined as contributing nothing.
  Padding rows of a real verify should see their own slot (diagonal-only), never nothing.
* ``causal=True`` changes nothing in the result: it promises that no query sees a new key
  after its own (prefill's causal mask; a DDTree mask, whose parents precede their children),
  so an implementation may stop each query's keys at slot ``P_b + i``.  The reference checks
  the promise and raises ValueError when a mask breaks it.
* A **bf16 cache**: ``ckv`` and ``kpe`` may both be uint16 arrays of bf16 bit patterns (the
  engine's ``--kv-cache bfloat16``).  Then the keys and values are those bf16 values and the
  queries are rounded to bf16 too (to nearest, ties to even: the tensor cores' operands), and
  the function is computed exactly on those operands (:func:`bf16_operands`).  An
  implementation may also round each softmax weight to bf16 (relative error <= 2^-8) as long as
  it normalises by the sum of the rounded weights, so that ``u`` stays a convex combination of
  the value rows: :func:`bf16_error_bound` is its tolerance.
* A **paged cache** (reference/paged.py): :func:`paged_mla_attention` takes the pools
  ``ckv_pages [n_pages, P, r]`` and ``kpe_pages [n_pages, P, dr]`` and a page table
  (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) in place of ``ckv`` and ``kpe``; request
  b's slot t is its page table's slot t, and the result is this function's on those slots
  (bit for bit: the same slots in the same order, the same float64 math).  The table must
  cover ``P_b + n`` slots of each request.
* Positions enter attention only through RoPE, which is applied to ``q_pe`` and ``kpe`` before
  this function, so the kernel itself never needs positions: a tree node's output equals plain
  causal attention over the prefix plus its root-to-node path (tested in tests/test_attention.py).
"""
from __future__ import annotations

import numpy as np

from ..paged import check_page_table, gather_pages
from .projections import split_kv_b_proj

__all__ = ["mla_attention", "paged_mla_attention", "naive_mla_attention", "visible_slots",
           "fp32_error_bound", "bf16_error_bound", "bf16_operands", "bf16_round", "bf16_widen",
           "check_causal", "UNIT_ROUNDOFF_F32", "UNIT_ROUNDOFF_BF16"]

UNIT_ROUNDOFF_F32 = 2.0 ** -24
UNIT_ROUNDOFF_BF16 = 2.0 ** -8    # 8 significant bits, round to nearest


def bf16_widen(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> their float64 values (exact)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bit patterns must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_round(x) -> np.ndarray:
    """float32 values -> the nearest bf16 values (ties to even), as float64.  Finite inputs."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bf16_widen(bits)


def bf16_operands(q_abs, q_pe, ckv, kpe):
    """float64 (q_abs, q_pe, ckv, kpe) of a call: for a bf16 cache (ckv and kpe uint16) the
    cache's values and the queries rounded to bf16; for a float32 cache the inputs as they are.
    A cache with one array of each kind is a TypeError."""
    bf16 = [np.asarray(a).dtype == np.uint16 for a in (ckv, kpe)]
    if bf16[0] != bf16[1]:
        raise TypeError(f"ckv and kpe must both be bf16 bits (uint16) or both floats, got "
                        f"{np.asarray(ckv).dtype} and {np.asarray(kpe).dtype}")
    if bf16[0]:
        return bf16_round(q_abs), bf16_round(q_pe), bf16_widen(ckv), bf16_widen(kpe)
    return tuple(np.asarray(a, np.float64) for a in (q_abs, q_pe, ckv, kpe))


def visible_slots(prefix_len: int, visible_row: np.ndarray) -> np.ndarray:
    """Cache slots one query sees: ``[0, P)`` then ``P + j`` for each true ``visible_row[j]``."""
    new = prefix_len + np.flatnonzero(np.asarray(visible_row, bool))
    return np.concatenate([np.arange(prefix_len), new]).astype(np.int64)


def _softmax_weighted(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``softmax(scores, -1) @ values`` in float64; zero rows for an empty key set."""
    if scores.shape[-1] == 0:
        return np.zeros(scores.shape[:-1] + values.shape[-1:], np.float64)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (p @ values) / p.sum(axis=-1, keepdims=True)


def _check_shapes(q_abs, q_pe, ckv, kpe, prefix_len, visible):
    bs, n, _, r = q_abs.shape
    dr = q_pe.shape[-1]
    if q_pe.shape[:3] != q_abs.shape[:3] or ckv.shape[::2] != (bs, r) \
            or kpe.shape != ckv.shape[:2] + (dr,) or visible.shape != (bs, n, n) \
            or np.shape(prefix_len) != (bs,):
        raise ValueError("mla_attention shapes disagree: q_abs %s q_pe %s ckv %s kpe %s "
                         "prefix_len %s visible %s" % (q_abs.shape, q_pe.shape, ckv.shape,
                                                       kpe.shape, np.shape(prefix_len),
                                                       visible.shape))
    p = np.asarray(prefix_len)
    if np.any(p < 0) or np.any(p + n > ckv.shape[1]):
        raise ValueError(f"prefix_len + n must lie in [n, max_len={ckv.shape[1]}]: {p}")


def check_causal(visible, causal: bool) -> None:
    """ValueError when ``causal`` promises what ``visible`` [bs, n, n] breaks: a query that
    sees a new key after its own."""
    if not causal:
        return
    after_own = np.argwhere(np.triu(np.asarray(visible, bool), 1))
    if len(after_own):
        b, i, j = after_own[0]
        raise ValueError(f"causal=True, but query {i} of request {b} sees new key {j} > {i}")


def mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau,
                  out_dtype=np.float32, causal=False) -> np.ndarray:
    """Absorbed-MLA attention with a prefix and an n x n new-token mask (contract: module doc)."""
    q_abs, q_pe, ckv, kpe = bf16_operands(q_abs, q_pe, ckv, kpe)
    visible = np.asarray(visible, bool)
    _check_shapes(q_abs, q_pe, ckv, kpe, prefix_len, visible)
    check_causal(visible, causal)
    bs, n, n_heads, r = q_abs.shape
    u = np.zeros((bs, n, n_heads, r), np.float64)
    for b in range(bs):
        prefix = int(prefix_len[b])
        for i in range(n):
            slots = visible_slots(prefix, visible[b, i])
            scores = tau * (q_abs[b, i] @ ckv[b, slots].T + q_pe[b, i] @ kpe[b, slots].T)
            u[b, i] = _softmax_weighted(scores, ckv[b, slots])
    return u.astype(out_dtype)


def paged_mla_attention(q_abs, q_pe, ckv_pages, kpe_pages, kv_indptr, kv_indices,
                        kv_last_page_len, prefix_len, visible, tau, out_dtype=np.float32,
                        causal=False) -> np.ndarray:
    """:func:`mla_attention` over a paged cache (module doc): each request's slots are gathered
    through the page table into a dense cache, which :func:`mla_attention` then reads."""
    kv_len = check_page_table(np.shape(ckv_pages)[0], np.shape(ckv_pages)[1], kv_indptr,
                              kv_indices, kv_last_page_len)
    n = np.shape(q_abs)[1]
    if kv_len.shape != np.shape(prefix_len) or np.any(np.asarray(prefix_len) + n > kv_len):
        raise ValueError(f"the page table covers {kv_len.tolist()} slots; prefix_len + n "
                         f"needs {(np.asarray(prefix_len) + n).tolist()}")
    table = (kv_indptr, kv_indices, kv_last_page_len)
    return mla_attention(q_abs, q_pe, gather_pages(ckv_pages, *table),
                         gather_pages(kpe_pages, *table), prefix_len, visible, tau,
                         out_dtype=out_dtype, causal=causal)


def naive_mla_attention(q_nope, q_pe, ckv, kpe, kv_b_proj, prefix_len, visible, tau,
                        dv: int, out_dtype=np.float32) -> np.ndarray:
    """Oracle: MLA without absorption, head by head, in float64 -> o [bs, n, H, dv] float32.

    Decompresses each visible slot t into a per-head key ``[W_UK[h] c_t ; kpe_t]`` and value
    ``W_UV[h] c_t``, then runs ordinary softmax attention.  Equal to
    ``apply_uv(mla_attention(absorb_q(q_nope, kv_b_proj), ...), kv_b_proj, dv)`` up to rounding.
    """
    q_nope, q_pe, ckv, kpe = (np.asarray(a, np.float64) for a in (q_nope, q_pe, ckv, kpe))
    visible = np.asarray(visible, bool)
    bs, n, n_heads, dn = q_nope.shape
    w_uk, w_uv = split_kv_b_proj(np.asarray(kv_b_proj, np.float64), n_heads, dn)
    if w_uv.shape[1] != dv:
        raise ValueError(f"kv_b_proj gives dv={w_uv.shape[1]}, caller says {dv}")
    o = np.zeros((bs, n, n_heads, dv), np.float64)
    for b in range(bs):
        prefix = int(prefix_len[b])
        for i in range(n):
            slots = visible_slots(prefix, visible[b, i])
            c = ckv[b, slots]
            for h in range(n_heads):
                keys = np.concatenate([c @ w_uk[h].T, kpe[b, slots]], axis=1)
                query = np.concatenate([q_nope[b, i, h], q_pe[b, i, h]])
                o[b, i, h] = _softmax_weighted(tau * (keys @ query), c @ w_uv[h].T)
    return o.astype(out_dtype)


def fp32_error_bound(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, safety=4.0) -> float:
    """Absolute tolerance for a float32 ``mla_attention`` against this float64 reference.

    With u = 2^-24 and D = r + dr, a float32 score carries an error of about
    ``tau * sqrt(D) * u * |q| |k|`` (a dot product of D terms; sqrt(D) is the statistical
    growth of rounding errors, Higham ch. 3.5; |q| |k| bounds sum |q_d k_d| by Cauchy-Schwarz).
    A relative error e on every softmax weight moves the convex combination u by at most
    2 e max|v|; exp adds ~2u relative, and summing L weighted values ~sqrt(L) u max|v|.
    Returns ``safety * max|v| * (2 * score_err + 4u + sqrt(L) u)`` over the visible slots.
    """
    q_abs, q_pe, ckv, kpe = (np.asarray(a, np.float64) for a in (q_abs, q_pe, ckv, kpe))
    n = q_abs.shape[1]
    d = q_abs.shape[-1] + q_pe.shape[-1]
    q_norm = np.sqrt((q_abs ** 2).sum(-1) + (q_pe ** 2).sum(-1)).max(initial=0.0)
    worst = 0.0
    for b in range(q_abs.shape[0]):
        keys = int(prefix_len[b]) + n
        k_norm = np.sqrt((ckv[b, :keys] ** 2).sum(-1) + (kpe[b, :keys] ** 2).sum(-1))
        v_max = np.abs(ckv[b, :keys]).max(initial=0.0)
        score_err = abs(tau) * np.sqrt(d) * UNIT_ROUNDOFF_F32 * q_norm * k_norm.max(initial=0.0)
        err = v_max * (2 * score_err + (4 + np.sqrt(keys)) * UNIT_ROUNDOFF_F32)
        worst = max(worst, err)
    return float(safety * worst) + 1e-30


def bf16_error_bound(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, safety=4.0) -> float:
    """Absolute tolerance for ``mla_attention`` over a bf16 cache (ckv, kpe uint16) against
    this reference: the rounding of every softmax weight to bf16 plus a float32 computation.

    With weights w_i = p_i / sum p and rounded ones p_i (1 + d_i), |d_i| <= 2^-8, normalised by
    their own sum, the output moves by ``sum_i w_i d_i (v_i - u) / (1 + sum_i w_i d_i)``, at
    most ``2^-8 * 2 max|v| / (1 - 2^-8)`` in every element: a worst case, not a statistical
    estimate.  Added: :func:`fp32_error_bound` of the rounded operands (scores and sums in
    float32, with its ``safety``)."""
    q_abs, q_pe, ckv64, kpe64 = bf16_operands(q_abs, q_pe, ckv, kpe)
    n = q_abs.shape[1]
    v_max = max((np.abs(ckv64[b, :int(prefix_len[b]) + n]).max(initial=0.0)
                 for b in range(q_abs.shape[0])), default=0.0)
    weights = 2 * UNIT_ROUNDOFF_BF16 / (1 - UNIT_ROUNDOFF_BF16) * v_max
    return float(weights) + fp32_error_bound(q_abs, q_pe, ckv64, kpe64, prefix_len, visible,
                                             tau, safety)

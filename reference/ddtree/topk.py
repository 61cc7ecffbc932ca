"""DDTree top-K: the NumPy reference.  This docstring is the contract of ``topk_logprobs``.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

``topk_logprobs(logits, k) -> (lp, ids)``
    logits [bs, L, V] float32 (finite) -> lp [bs, L, k] float32, ids [bs, L, k] int32.
    Per row: the k tokens with the largest logits, ordered by raw float32 logit descending,
    ties by smaller token id (a strict total order, so ``ids`` is exact); ``lp = logit - lse``
    with ``lse = logsumexp(row)``.  Here lse is float64 (max + log of the float64 sum of
    exp(x - max)) and ``lp = float32(float64(logit) - lse)``.  The GPU twin sums float32 exps in
    float64, so its lse differs by < 1e-6; compare lp with ``|d| <= LP_ATOL + LP_RTOL*|lp|``
    and ids exactly.  lp is non-increasing along k.
"""
from __future__ import annotations

import numpy as np

from .checks import check_topk_args

__all__ = ["topk_logprobs", "LP_ATOL", "LP_RTOL"]

# lp tolerance between the twins (the GPU's lse carries < ~4e-7 relative error from float32
# exp terms; both sides then round x - lse to float32: one ulp <= 2**-23 |lp| each).
LP_ATOL = 1e-6
LP_RTOL = 2.0 ** -22


def _row_topk(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of a float32 row, by value desc then index asc."""
    kth = np.partition(row, row.size - k)[row.size - k]   # the k-th largest value
    cand = np.flatnonzero(row >= kth)                       # >= k indices, ties included
    order = np.lexsort((cand, -row[cand]))                   # value desc, then id asc
    return cand[order[:k]]


def topk_logprobs(logits, k: int):
    """Top-k normalised log-probs per row (contract: module docstring)."""
    bs, n_rows, _, k = check_topk_args(logits, k)
    logits = np.asarray(logits)
    if not np.isfinite(logits).all():
        raise ValueError("logits must be finite")
    lp = np.empty((bs, n_rows, k), np.float32)
    ids = np.empty((bs, n_rows, k), np.int32)
    for b in range(bs):
        for d in range(n_rows):
            row64 = logits[b, d].astype(np.float64)
            top = row64.max()
            lse = top + np.log(np.exp(row64 - top).sum())
            idx = _row_topk(logits[b, d], k)
            ids[b, d] = idx
            lp[b, d] = (row64[idx] - lse).astype(np.float32)
    return lp, ids

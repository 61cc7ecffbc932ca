"""DDTree KV compaction: the NumPy reference.  This docstring is the contract of ``compact_kv``.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

``compact_kv(caches, past_len, acc_idx, acc_len) -> None``
    caches: a list of arrays of any dtype, each [bs, max_len, width] or a stack
    [n, bs, max_len, width]; past_len [bs] int.  Tree slot i of request b lives in cache row
    past_len[b] + i.  In place, for k < acc_len[b]: row ``past + acc_idx[k]`` moves to row
    ``past + k`` (all moved rows are read before any is written: acc is increasing with
    acc[k] >= k, so a parallel row copy would read rows already overwritten).  Rows past
    ``past + acc_len`` are left as they are.  Needs ``past + acc_idx[acc_len-1] < max_len``
    (ValueError here).
"""
from __future__ import annotations

import numpy as np

from .checks import check_accepted, check_compact_args

__all__ = ["compact_kv"]


def compact_kv(caches, past_len, acc_idx, acc_len) -> None:
    """Move accepted tree rows to the front of the tree block, in place (contract: module doc)."""
    caches, bs, _ = check_compact_args(caches, past_len, acc_idx, acc_len)
    acc_idx, acc_len, past_len = (np.asarray(a) for a in (acc_idx, acc_len, past_len))
    for b in range(bs):
        m, past = int(acc_len[b]), int(past_len[b])
        check_accepted(acc_idx[b], m, b)
        src = past + acc_idx[b, :m].astype(np.int64)
        for cache in caches:
            max_len = cache.shape[-2]
            if past < 0 or src[-1] >= max_len:
                raise ValueError(f"request {b}: rows past_len + acc_idx up to {src[-1]} lie "
                                 f"outside the cache (max_len {max_len})")
            rows = cache[..., b, src, :].copy()        # gather every row first, then scatter
            cache[..., b, past:past + m, :] = rows

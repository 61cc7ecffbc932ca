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

``compact_kv_paged(caches, kv_indptr, kv_indices, kv_last_page_len, past_len, acc_idx, acc_len)``
    The same moves in paged pools (reference/paged.py): caches are pools [n_pages, P, width]
    or stacks [n, n_pages, P, width], and request b's row t is its page table's slot t.  Needs
    ``past + acc_idx[acc_len-1] < kv_len[b]`` (the table covers the tree block).
"""
from __future__ import annotations

import numpy as np

from ..paged import check_page_table, page_slots
from .checks import cache_list, check_accepted, check_array, check_compact_args, \
    check_per_request

__all__ = ["compact_kv", "compact_kv_paged"]


def compact_kv(caches, past_len, acc_idx, acc_len) -> None:
    """Move accepted tree rows to the front of the tree block, in place (contract: module doc)."""
    caches, bs, _ = check_compact_args(caches, past_len, acc_idx, acc_len)
    acc_idx, acc_len, past_len = (np.asarray(a) for a in (acc_idx, acc_len, past_len))
    for b in range(bs):
        m, past = int(acc_len[b]), int(past_len[b])
        check_accepted(acc_idx[b], m, b)
        src = past + acc_idx[b, :m].astype(np.int64)
        # a path of slots 0, 1, .., m - 1 (the root alone; the first child each time) is
        # where it belongs already: no row moves (at T = 1 on the CPU path most rounds)
        moved = bool(acc_idx[b, m - 1] != m - 1)
        for cache in caches:
            max_len = cache.shape[-2]
            if past < 0 or src[-1] >= max_len:
                raise ValueError(f"request {b}: rows past_len + acc_idx up to {src[-1]} lie "
                                 f"outside the cache (max_len {max_len})")
            if moved:
                rows = cache[..., b, src, :].copy()    # gather every row first, then scatter
                cache[..., b, past:past + m, :] = rows


def compact_kv_paged(caches, kv_indptr, kv_indices, kv_last_page_len, past_len, acc_idx,
                     acc_len) -> None:
    """:func:`compact_kv` in paged pools, in place (contract: module doc)."""
    check_array("acc_idx", acc_idx, 2, "iu")
    bs = int(acc_idx.shape[0])
    check_per_request("acc_len", acc_len, bs)
    check_per_request("past_len", past_len, bs)
    caches = cache_list(caches)
    acc_idx, acc_len, past_len = (np.asarray(a) for a in (acc_idx, acc_len, past_len))
    for cache in caches:
        if cache.ndim not in (3, 4):
            raise ValueError(f"a paged cache must be [n_pages, P, width] or a stack of them, "
                             f"got shape {cache.shape}")
        kv_len = check_page_table(cache.shape[-3], cache.shape[-2], kv_indptr, kv_indices,
                                  kv_last_page_len)
        if kv_len.shape != (bs,):
            raise ValueError(f"the page table has {kv_len.shape[0]} requests, acc_idx {bs}")
        for b in range(bs):
            m, past = int(acc_len[b]), int(past_len[b])
            check_accepted(acc_idx[b], m, b)
            src = past + acc_idx[b, :m].astype(np.int64)
            if past < 0 or src[-1] >= kv_len[b]:
                raise ValueError(f"request {b}: rows past_len + acc_idx up to {src[-1]} lie "
                                 f"outside its {kv_len[b]} paged slots")
            page, offset = page_slots(kv_indptr, kv_indices, cache.shape[-2], b, src)
            rows = cache[..., page, offset, :].copy()     # gather every row first, then scatter
            page, offset = page_slots(kv_indptr, kv_indices, cache.shape[-2], b,
                                      past + np.arange(m))
            cache[..., page, offset, :] = rows

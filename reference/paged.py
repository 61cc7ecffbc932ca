"""The paged KV layout: the NumPy reference.  This docstring is the contract of a page table;
``reference.attention.paged_mla_attention`` and ``reference.ddtree.compact_kv_paged`` take one.

The model is FlashInfer's paged-MLA contract (``flashinfer.mla.BatchMLAPagedAttentionWrapper``
with its ``kv_indptr`` / ``kv_indices`` CSR page table, and the ``kv_last_page_len`` of its
paged-KV wrappers):

=================  =====================  ====================================================
array              shape                  meaning
=================  =====================  ====================================================
pages              [n_pages, P, width]    the pool: ``P`` (page_size >= 1) token slots a page,
                   (or [n, n_pages, P,    any dtype (a stack of n layers: the same table for
                   width])                every layer)
kv_indptr          [bs + 1] int           request b's pages are
                                          ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``;
                                          ``kv_indptr[0] = 0``, non-decreasing
kv_indices         [kv_indptr[bs]] int    page ids in ``[0, n_pages)``, in slot order; no page
                                          belongs to two requests
kv_last_page_len   [bs] int               slots used in request b's last page, in [1, P]
                                          (0 for a request with no page)
=================  =====================  ====================================================

Request b holds ``kv_len[b] = (kv_indptr[b + 1] - kv_indptr[b] - 1) * P + kv_last_page_len[b]``
slots (FlashInfer's MLA ``plan`` takes this ``kv_len_arr``), and its slot t < kv_len[b] lives at
``pages[kv_indices[kv_indptr[b] + t // P], t % P]``.  With P = 1 and one page per slot this is
FlashInfer's page-size-1 MLA layout; a dense ``[bs, max_len, width]`` cache is the table with
``P = max_len`` and page b for request b.

The slots a table covers are the ones an operation may touch: attention needs
``prefix_len[b] + n <= kv_len[b]`` (the cached prefix and the n new tokens), compaction
``past_len[b] + acc_idx[b, acc_len[b] - 1] < kv_len[b]`` (ValueError otherwise).
"""
from __future__ import annotations

import numpy as np

__all__ = ["check_page_table", "kv_lengths", "page_slots", "gather_pages"]


def kv_lengths(kv_indptr, kv_last_page_len, page_size: int) -> np.ndarray:
    """kv_len [bs] int64 of a page table (module doc)."""
    indptr = np.asarray(kv_indptr, np.int64)
    count = np.diff(indptr)
    last = np.asarray(kv_last_page_len, np.int64)
    return np.where(count > 0, (count - 1) * int(page_size) + last, 0)


def check_page_table(n_pages: int, page_size: int, kv_indptr, kv_indices,
                     kv_last_page_len) -> np.ndarray:
    """ValueError unless the arrays are a page table (module doc) of a pool of ``n_pages``
    pages of ``page_size`` slots; returns kv_len [bs] int64."""
    indptr, indices, last = (np.asarray(a) for a in (kv_indptr, kv_indices, kv_last_page_len))
    for name, a in (("kv_indptr", indptr), ("kv_indices", indices),
                    ("kv_last_page_len", last)):
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array, got {a.dtype} {a.shape}")
    bs = last.shape[0]
    count = np.diff(indptr.astype(np.int64))
    if indptr.shape != (bs + 1,) or indptr[0] != 0 or np.any(count < 0) \
            or indices.shape != (int(indptr[-1]),):
        raise ValueError(f"kv_indptr {indptr.tolist()} must be [bs + 1 = {bs + 1}], start at 0, "
                         f"not decrease and end at len(kv_indices) = {indices.shape[0]}")
    if np.any(indices < 0) or np.any(indices >= n_pages) \
            or np.unique(indices).size != indices.size:
        raise ValueError(f"kv_indices must be distinct page ids in [0, {n_pages}): "
                         f"{indices.tolist()}")
    if np.any(np.where(count > 0, (last < 1) | (last > page_size), last != 0)):
        raise ValueError(f"kv_last_page_len {last.tolist()} must lie in [1, {page_size}] "
                         f"(0 for a request without pages)")
    return kv_lengths(indptr, last, page_size)


def page_slots(kv_indptr, kv_indices, page_size: int, b: int, slots) -> tuple:
    """(page ids, offsets) of request b's token ``slots`` (an int array): the index of those
    slots in a pool [n_pages, P, width] (module doc).  No bounds check."""
    slots = np.asarray(slots, np.int64)
    start = int(np.asarray(kv_indptr)[b])
    pages = np.asarray(kv_indices, np.int64)[start + slots // int(page_size)]
    return pages, slots % int(page_size)


def gather_pages(pages, kv_indptr, kv_indices, kv_last_page_len) -> np.ndarray:
    """The dense copy [..., bs, max(kv_len), width] of a paged pool [..., n_pages, P, width]:
    request b's slots ``[0, kv_len[b])`` in order, zeros after them."""
    pages = np.asarray(pages)
    n_pages, page_size = pages.shape[-3], pages.shape[-2]
    kv_len = check_page_table(n_pages, page_size, kv_indptr, kv_indices, kv_last_page_len)
    bs = kv_len.shape[0]
    dense = np.zeros(pages.shape[:-3] + (bs, int(kv_len.max(initial=0)), pages.shape[-1]),
                     pages.dtype)
    for b in range(bs):
        where = page_slots(kv_indptr, kv_indices, page_size, b, np.arange(kv_len[b]))
        dense[..., b, :kv_len[b], :] = pages[..., where[0], where[1], :]
    return dense

"""Where a KV cache's token slots live: its layout (docs/ARCHITECTURE.md, "Adding a KV layout").

A :class:`~kdtree_numba.kvcache.KVCache` keeps the lengths and the commits; its layout owns the
storage's shape and the map from (request b, token slot t) to a place in it, and is the one
place where the cache writes, the model's attention, DDTree compaction, the CUDA graphs' keys
and cache reuse learn that map:

* :class:`DenseLayout` (``"dense"``, the GPU layout): ``[n_layers, bs, max_len, width]``, slot t
  of request b at ``[:, b, t]``.  The numba kernels get exactly these arrays.
* :class:`PagedLayout` (``"paged:P"``): pools ``[n_layers, n_pages, P, width]`` and a page
  table per request in FlashInfer's paged-MLA form (the contract: reference/paged.py).  Pages
  are taken from a free list as requests grow (:meth:`KVLayout.reserve`, before a forward
  writes past a request's pages) and go back to it on truncate; a request holds its pages until
  then.  Reference backend only: the numba backend has no paged kernels yet and refuses it.

A layout is built for one cache (``make_layout(spec, batch, max_len)``): a paged one holds that
cache's page lists.  Every method below runs on the host; ``storage_rows``, ``attend`` and
``compact`` only launch device work, and no method reads the device.
"""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from kdtree_numba import runtime

__all__ = ["KVLayout", "DenseLayout", "PagedLayout", "PageTable", "CacheFullError",
           "make_layout", "layout_spec", "device_address"]


class CacheFullError(RuntimeError):
    """A forward would write past the cache's capacity (the message names request and lengths)."""


@dataclasses.dataclass(frozen=True)
class PageTable:
    """A forward's page table on the device (int32; reference/paged.py): ``kv_indptr`` [bs + 1],
    ``kv_indices`` [pages in use], ``kv_last_page_len`` [bs]; it covers each request's
    ``lengths + n`` slots exactly (the host lengths: upper bounds while they are pending)."""
    kv_indptr: object
    kv_indices: object
    kv_last_page_len: object


def device_address(a) -> int:
    """The address of an array's first byte (device or host): what a CUDA graph that reads
    it depends on."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


class KVLayout:
    """The interface a layout implements (docs/ARCHITECTURE.md, "Adding a KV layout").
    ``spec``: its name, as ``Model(kv_layout=...)`` takes it; ``batch``, ``max_len``: the
    cache's requests and the most slots one request may hold."""
    spec = ""

    def __init__(self, batch: int, max_len: int):
        self.batch, self.max_len = int(batch), int(max_len)
        self.table: PageTable | None = None     # the last reserve's, where the layout has one

    def check_backend(self, backend) -> None:
        """Raise where ``backend`` cannot run this layout's ops."""

    def shape(self, n_layers: int, width: int) -> tuple:
        """The shape of one cache array (``c``: width r, ``k_pe``: width dr)."""
        raise NotImplementedError

    @property
    def slots(self) -> int:
        """Token slots one layer's storage holds (``KVCache.bytes_per_token``)."""
        raise NotImplementedError

    def reserve(self, backend, lengths: np.ndarray, n: int) -> PageTable | None:
        """Host work before a forward writes n slots after ``lengths`` (host int64 [bs], upper
        bounds while the cache's lengths are pending): a paged layout takes the pages they
        need and uploads the table.  Raises CacheFullError where the storage cannot hold
        them (the cache has already checked ``lengths + n <= max_len``)."""
        return None

    def storage_rows(self, batch, rows, table):
        """Where request ``batch[b]``'s slots ``rows[b, j]`` ([bs, 1], [bs, n] device int64)
        live in one layer's array viewed as ``[slots, width]``: [bs, n] int64, device work
        only (a CUDA graph captures it).  ``table``: a paged layout's page table.  Every cache
        write goes there: one scatter (kvcache.LatentStore.put) or the fused latents kernel
        (kdtree_numba/layers/latents.py)."""
        raise NotImplementedError

    def attend(self, ops, ckv, kpe, q_abs, q_pe, slots, visible, tau, *, prefill=False,
               causal=False, plans=None):
        """``mla_attention`` (contract: reference/attention/mla.py) over one layer's arrays."""
        raise NotImplementedError

    def compact(self, ops, arrays, lengths, acc_idx, acc_len) -> None:
        """``compact_kv`` of the accepted tree rows in ``arrays`` (every layer's stack)."""
        raise NotImplementedError

    def truncate(self, lengths: np.ndarray) -> None:
        """Requests now hold ``lengths`` (host int64) committed slots; the rest is scratch."""

    def key(self, arrays) -> tuple:
        """The layout's part of a CUDA graph's key: what a graph that reads or writes the cache
        depends on besides its inputs (the arrays' addresses and shapes, the spec)."""
        return (self.spec,) + tuple((device_address(a), tuple(a.shape)) for a in arrays)

    def reusable(self, spec: str, batch: int, max_len: int) -> bool:
        """Whether an emptied cache of this layout serves a new generation of ``batch``
        requests and ``max_len`` slots (Model.reuse_cache): its graphs then replay."""
        return spec == self.spec and batch == self.batch and max_len == self.max_len


class DenseLayout(KVLayout):
    """``[n_layers, bs, max_len, width]``: request b's slot t at ``[:, b, t]``."""
    spec = "dense"

    def shape(self, n_layers: int, width: int) -> tuple:
        return (n_layers, self.batch, self.max_len, width)

    @property
    def slots(self) -> int:
        return self.batch * self.max_len

    def storage_rows(self, batch, rows, table):
        return batch * self.max_len + rows

    def attend(self, ops, ckv, kpe, q_abs, q_pe, slots, visible, tau, *, prefill=False,
               causal=False, plans=None):
        # a device prefix (no per-layer upload); max_keys keeps the split plan a host lengths
        # array would give, so the numbers do not change
        return ops.mla_attention(q_abs, q_pe, ckv, kpe, slots.prefix, visible, tau,
                                 max_keys=slots.max_keys, prefill=prefill, causal=causal,
                                 plans=plans)

    def compact(self, ops, arrays, lengths, acc_idx, acc_len) -> None:
        # int64 past lengths: the compaction kernel's specialisation the engine has always
        # launched (the cache's device lengths are int32); KDTREE_LEAN_ROUND passes the int32
        # lengths as they are (the same rows; no copy, one specialisation more to compile)
        past = lengths if runtime.current().lean_round and lengths.dtype == np.int32 \
            else lengths.astype(np.int64)
        ops.compact_kv(arrays, past, acc_idx, acc_len)


class PagedLayout(KVLayout):
    """Pools ``[n_layers, n_pages, page_size, width]`` and a page table per request
    (reference/paged.py).  ``n_pages``: the pool (default: ``batch * ceil(max_len /
    page_size)``, every request at ``max_len``); a smaller pool is shared, first come first
    served, and a forward that finds no free page raises CacheFullError."""

    def __init__(self, batch: int, max_len: int, page_size: int, n_pages: int | None = None):
        super().__init__(batch, max_len)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.spec = f"paged:{self.page_size}"
        self.n_pages = batch * -(-self.max_len // self.page_size) if n_pages is None \
            else int(n_pages)
        if self.n_pages < 1:
            raise ValueError(f"n_pages must be >= 1, got {n_pages}")
        self.pages: list[list[int]] = [[] for _ in range(batch)]   # request b's, in slot order
        self.free = list(range(self.n_pages))                       # a heap: lowest id first

    def check_backend(self, backend) -> None:
        if backend.name != "reference":
            raise NotImplementedError(
                f"the {self.spec} KV layout runs on the reference backend only: the numba "
                f"backend has no paged-KV kernels yet (docs/ENGINE.md, \"The KV cache\")")

    def shape(self, n_layers: int, width: int) -> tuple:
        return (n_layers, self.n_pages, self.page_size, width)

    @property
    def slots(self) -> int:
        return self.n_pages * self.page_size

    def reserve(self, backend, lengths: np.ndarray, n: int) -> PageTable:
        P = self.page_size
        need = -(-(np.asarray(lengths, np.int64) + n) // P)
        short = int(sum(max(0, int(k) - len(held)) for k, held in zip(need, self.pages)))
        if short > len(self.free):
            raise CacheFullError(f"KV page pool full: {n} more slots after lengths "
                                 f"{np.asarray(lengths).tolist()} need {short} free pages of "
                                 f"{P} slots, {len(self.free)} of {self.n_pages} are free")
        for k, held in zip(need, self.pages):
            while len(held) < k:
                held.append(heapq.heappop(self.free))
        indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
        indices = np.array([p for k, held in zip(need, self.pages) for p in held[:k]], np.int32)
        last = (np.asarray(lengths, np.int64) + n - (need - 1) * P) * (need > 0)
        self.table = PageTable(*(backend.asarray(a.astype(np.int32))
                                 for a in (indptr, indices, last)))
        return self.table

    def storage_rows(self, batch, rows, table):
        P = self.page_size
        return table.kv_indices[table.kv_indptr[batch] + rows // P].astype(np.int64) * P + \
            rows % P

    def attend(self, ops, ckv, kpe, q_abs, q_pe, slots, visible, tau, *, prefill=False,
               causal=False, plans=None):
        t = slots.table
        return ops.paged_mla_attention(q_abs, q_pe, ckv, kpe, t.kv_indptr, t.kv_indices,
                                       t.kv_last_page_len, slots.prefix, visible, tau,
                                       causal=causal)

    def compact(self, ops, arrays, lengths, acc_idx, acc_len) -> None:
        t = self.table
        if t is None:
            raise RuntimeError("paged compaction needs the page table of the forward that "
                               "wrote the tree (none since the last truncate)")
        ops.compact_kv_paged(arrays, t.kv_indptr, t.kv_indices, t.kv_last_page_len, lengths,
                             acc_idx, acc_len)

    def truncate(self, lengths: np.ndarray) -> None:
        for held, length in zip(self.pages, np.asarray(lengths, np.int64)):
            keep = -(-int(length) // self.page_size)
            for page in held[keep:]:
                heapq.heappush(self.free, page)
            del held[keep:]
        self.table = None            # it may name pages that are free now


def layout_spec(spec: str) -> str:
    """``spec`` checked: "dense" or "paged:P" with an integer page size P >= 1 (ValueError)."""
    kind, _, size = str(spec).partition(":")
    if kind == "dense" and not size:
        return "dense"
    if kind == "paged" and size.isdigit() and int(size) >= 1:
        return f"paged:{int(size)}"
    raise ValueError(f"KV layout must be 'dense' or 'paged:P' (P >= 1 slots a page), "
                     f"got {spec!r}")


def make_layout(spec: str, batch: int, max_len: int) -> KVLayout:
    """A new layout of ``spec`` (:func:`layout_spec`) for a cache of ``batch`` requests of up to
    ``max_len`` slots."""
    spec = layout_spec(spec)
    if spec == "dense":
        return DenseLayout(batch, max_len)
    return PagedLayout(batch, max_len, int(spec.partition(":")[2]))

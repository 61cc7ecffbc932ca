"""The batched latent KV cache of an MLA model.

Per layer the cache holds only what absorbed MLA attends to (docs/ATTENTION.md): the
normalised latent ``c`` (kv_lora_rank r) and the rotated rope key ``k_pe`` (dr) of every token.
All layers live in two stacked arrays, ``c [n_layers, bs, max_len, r]`` and
``k_pe [n_layers, bs, max_len, dr]`` (``backend.xp``), so a DDTree compaction moves the
accepted rows of every layer with one ``compact_kv`` call.  They hold float32 (the default) or,
with ``dtype="bfloat16"``, bf16 bit patterns (uint16): half the bytes, and attention then runs
its bf16 kernel (reference/attention/mla.py, "A bf16 cache"); :meth:`write` rounds the new
latents to bf16 (to nearest, ties to even).

Lengths are ragged: ``lengths[b]`` (host int64) counts request b's committed tokens, which sit in
slots ``[0, lengths[b])``.  A forward over n new tokens writes their latents to
``[lengths[b], lengths[b] + n)`` without committing them; the caller then commits with
:meth:`advance` (prefill/decode: the real tokens) or :meth:`commit_tree` (DDTree: compact the
accepted tree rows, then advance).  Slots past ``lengths[b]`` are scratch.  Nothing is ever
written past ``max_len``: a write that would not fit raises :class:`CacheFullError`.

The lengths live on the host, so no cache operation reads the device: a forward uploads them
once (:meth:`write_slots`, an asynchronous copy) and every layer reuses that upload.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kdtree_numba.backends import bf16_bits

__all__ = ["KVCache", "CacheFullError", "WriteSlots", "CACHE_DTYPES"]

CACHE_DTYPES = ("float32", "bfloat16")   # what the latents are stored as


class CacheFullError(RuntimeError):
    """A forward would write past the cache's capacity (the message names request and lengths)."""


@dataclasses.dataclass(frozen=True)
class WriteSlots:
    """Where one forward's n new tokens go, uploaded once and used by every layer:
    ``batch`` [bs, 1] and ``rows`` [bs, n] (device index arrays of the new slots),
    ``prefix`` [bs] int32 (device copy of the lengths: attention's prefix) and ``max_keys``
    (host int, ``max(lengths) + n``: the attention kernels' split-plan hint)."""
    batch: object
    rows: object
    prefix: object
    max_keys: int


class KVCache:
    def __init__(self, backend, n_layers: int, batch: int, max_len: int, kv_lora_rank: int,
                 rope_dim: int, dtype: str = "float32"):
        if min(n_layers, batch, max_len, kv_lora_rank, rope_dim) < 1:
            raise ValueError("KVCache sizes must all be >= 1")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
        self.backend = backend
        self.dtype = dtype
        xp = backend.xp
        self.max_len = int(max_len)
        store = np.uint16 if dtype == "bfloat16" else np.float32
        self.c = xp.zeros((n_layers, batch, max_len, kv_lora_rank), store)
        self.k_pe = xp.zeros((n_layers, batch, max_len, rope_dim), store)
        self.lengths = np.zeros(batch, np.int64)

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.c.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache arrays (c and k_pe of every layer)."""
        return int(self.c.nbytes + self.k_pe.nbytes)

    def bytes_per_token(self) -> int:
        return self.nbytes // (self.batch * self.max_len)

    def check_room(self, n_new: int) -> None:
        """Raise unless every request can take ``n_new`` more slots after its length."""
        over = np.flatnonzero(self.lengths + n_new > self.max_len)
        if over.size:
            b = int(over[0])
            raise CacheFullError(
                f"KV cache full: request {b} holds {int(self.lengths[b])} tokens and needs "
                f"{n_new} more slots, but max_len is {self.max_len} "
                f"({over.size} request(s) over capacity); allocate a larger cache")

    def slot_inputs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Host ``(rows [bs, n] int64, prefix [bs] int32)`` of n new tokens per request: the
        cache rows they go to and the committed lengths before them (raises
        :class:`CacheFullError` first).  :meth:`write_slots` uploads them; a CUDA graph writes
        them into its static buffers and builds its slots with :meth:`device_slots`."""
        self.check_room(n)
        return self.lengths[:, None] + np.arange(n)[None, :], self.lengths.astype(np.int32)

    def write_slots(self, n: int) -> WriteSlots:
        """The slots of n new tokens per request (raises :class:`CacheFullError` first)."""
        rows, prefix = self.slot_inputs(n)
        put = self.backend.asarray
        return WriteSlots(batch=put(np.arange(self.batch)[:, None]), rows=put(rows),
                          prefix=put(prefix), max_keys=int(self.lengths.max()) + n)

    def device_slots(self, rows, prefix) -> WriteSlots:
        """The slots of :meth:`slot_inputs` already on the device (a CUDA graph's static
        buffers), made with device work only, so that a graph can capture it; attention's
        split plan covers the whole capacity (``max_keys = max_len``), so one graph serves
        every length."""
        return WriteSlots(batch=self.backend.xp.arange(self.batch, dtype=np.int64)[:, None],
                          rows=rows, prefix=prefix, max_keys=self.max_len)

    def write(self, layer: int, c_new, k_pe_new, slots: WriteSlots | None = None) -> None:
        """Latents of n new tokens per request, [bs, n, r] and [bs, n, dr] (float32; rounded to
        bf16 for a bf16 cache), into ``[lengths[b], lengths[b] + n)`` of ``layer`` (not
        committed).  ``slots``: this
        forward's :meth:`write_slots` (made here if not given)."""
        if slots is None:
            slots = self.write_slots(c_new.shape[1])
        if self.dtype == "bfloat16":
            xp = self.backend.xp
            c_new, k_pe_new = bf16_bits(xp, c_new), bf16_bits(xp, k_pe_new)
        self.c[layer][slots.batch, slots.rows] = c_new
        self.k_pe[layer][slots.batch, slots.rows] = k_pe_new

    def advance(self, counts) -> None:
        """Commit ``counts[b]`` (scalar or [bs]) newly written tokens per request."""
        counts = np.broadcast_to(np.asarray(counts, np.int64), self.lengths.shape)
        if np.any(counts < 0) or np.any(self.lengths + counts > self.max_len):
            raise CacheFullError(f"cannot advance lengths {self.lengths.tolist()} by "
                                 f"{counts.tolist()} within max_len {self.max_len}")
        self.lengths += counts

    def truncate(self, lengths) -> None:
        """Roll requests back to shorter lengths (the slots past them become scratch)."""
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != self.lengths.shape or np.any(lengths < 0) \
                or np.any(lengths > self.lengths):
            raise ValueError(f"truncate to {lengths.tolist()} from {self.lengths.tolist()}: "
                             f"lengths may only shrink")
        self.lengths = lengths.copy()

    def compact_tree(self, ops, acc_idx, acc_len, lengths=None) -> None:
        """After a verify forward over a tree written at ``[lengths, lengths + B + 1)``: move
        the accepted rows (``acc_idx[b, :acc_len[b]]``, device arrays on a GPU) to the front of
        the tree block with ``ops.compact_kv``, every layer in one call.  Launches only: the
        lengths do not change until :meth:`advance`.  ``lengths``: a device copy of them
        (a CUDA graph's input), else they are uploaded."""
        if lengths is None:
            lengths = self.backend.asarray(self.lengths)
        ops.compact_kv([self.c, self.k_pe], lengths, acc_idx, acc_len)

    def buffer_key(self) -> tuple:
        """Addresses and shapes of the cache arrays: the key of a CUDA graph that reads or
        writes them (the same buffers, reused by another cache object, replay correctly)."""
        def address(a):
            iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
            return int(iface["data"][0])
        return tuple((address(a), tuple(a.shape)) for a in (self.c, self.k_pe))

    def commit_tree(self, ops, acc_idx, acc_len, accepted, active=None) -> None:
        """:meth:`compact_tree`, then commit ``accepted[b]`` rows per request (host ints: the
        acc_len the caller already read; reading it here would cost a sync).  Requests with
        ``active[b]`` false do not grow."""
        self.compact_tree(ops, acc_idx, acc_len)
        grow = np.asarray(accepted, np.int64)
        if active is not None:
            grow = np.where(np.asarray(active, bool), grow, 0)
        self.advance(grow)

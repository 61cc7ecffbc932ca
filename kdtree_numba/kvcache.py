"""The batched latent KV cache of an MLA model.

Per layer the cache holds only what absorbed MLA attends to (shared/notes/mla-moe.md): the
normalised latent ``c`` (kv_lora_rank r) and the rotated rope key ``k_pe`` (dr) of every token.
All layers live in two stacked arrays, ``c [n_layers, bs, max_len, r]`` and
``k_pe [n_layers, bs, max_len, dr]`` (float32, ``backend.xp``), so a DDTree compaction moves the
accepted rows of every layer with one ``compact_kv`` call.

Lengths are ragged: ``lengths[b]`` (host int64) counts request b's committed tokens, which sit in
slots ``[0, lengths[b])``.  A forward over n new tokens writes their latents to
``[lengths[b], lengths[b] + n)`` without committing them; the caller then commits with
:meth:`advance` (prefill/decode: the real tokens) or :meth:`commit_tree` (DDTree: compact the
accepted tree rows, then advance).  Slots past ``lengths[b]`` are scratch.  Nothing is ever
written past ``max_len``: a write that would not fit raises :class:`CacheFullError`.
"""
from __future__ import annotations

import numpy as np

__all__ = ["KVCache", "CacheFullError"]


class CacheFullError(RuntimeError):
    """A forward would write past the cache's capacity (the message names request and lengths)."""


class KVCache:
    def __init__(self, backend, n_layers: int, batch: int, max_len: int, kv_lora_rank: int,
                 rope_dim: int):
        if min(n_layers, batch, max_len, kv_lora_rank, rope_dim) < 1:
            raise ValueError("KVCache sizes must all be >= 1")
        self.backend = backend
        xp = backend.xp
        self.max_len = int(max_len)
        self.c = xp.zeros((n_layers, batch, max_len, kv_lora_rank), np.float32)
        self.k_pe = xp.zeros((n_layers, batch, max_len, rope_dim), np.float32)
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

    def write(self, layer: int, c_new, k_pe_new) -> None:
        """Latents of n new tokens per request, [bs, n, r] and [bs, n, dr], into
        ``[lengths[b], lengths[b] + n)`` of ``layer`` (not committed)."""
        bs, n = c_new.shape[:2]
        self.check_room(n)
        rows = self.backend.asarray(self.lengths[:, None] + np.arange(n)[None, :])
        batch = self.backend.asarray(np.arange(bs)[:, None])
        self.c[layer][batch, rows] = c_new
        self.k_pe[layer][batch, rows] = k_pe_new

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

    def commit_tree(self, ops, acc_idx, acc_len, active=None) -> None:
        """After a verify forward over a tree written at ``[lengths, lengths + B + 1)``: move
        the accepted rows (``acc_idx[b, :acc_len[b]]``, host or device) to the front with
        ``ops.compact_kv`` and commit them.  Requests with ``active[b]`` false do not grow."""
        past = self.backend.asarray(self.lengths)
        ops.compact_kv([self.c, self.k_pe], past, acc_idx, acc_len)
        grow = np.asarray(self.backend.to_host(acc_len), np.int64)
        if active is not None:
            grow = np.where(np.asarray(active, bool), grow, 0)
        self.advance(grow)

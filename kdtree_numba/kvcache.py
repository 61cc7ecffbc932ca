"""The batched latent KV cache of an MLA model.

Per layer the cache holds only what absorbed MLA attends to (docs/ATTENTION.md): the
normalised latent ``c`` (kv_lora_rank r) and the rotated rope key ``k_pe`` (dr) of every token.
All layers live in two stacked arrays, ``c [n_layers, bs, max_len, r]`` and
``k_pe [n_layers, bs, max_len, dr]`` (``backend.xp``), so a DDTree compaction moves the
accepted rows of every layer with one ``compact_kv`` call.  They hold float32 (the default) or,
with ``dtype="bfloat16"``, bf16 bit patterns (uint16): half the bytes, and attention then runs
its bf16 kernel (reference/attention/mla.py, "A bf16 cache"); :meth:`write` rounds the new
latents to bf16 (to nearest, ties to even).

Where a slot lives is the cache's layout (kdtree_numba/kvlayout.py): ``"dense"`` (the arrays
above, the GPU layout) or ``"paged:P"`` (pools ``[n_layers, n_pages, P, width]`` and a page
table per request; reference backend only).  Writes, attention (:meth:`KVCache.attend`),
compaction, the graph keys (:meth:`KVCache.buffer_key`) and cache reuse go through it.

Lengths are ragged: request b's committed tokens sit in slots ``[0, length_b)``.  A forward over
n new tokens writes their latents to ``[length_b, length_b + n)`` without committing them; the
caller then commits with :meth:`advance` (prefill/decode: the real tokens) or
:meth:`commit_tree` (DDTree: compact the accepted tree rows, then advance).  Slots past
``length_b`` are scratch.  Nothing is ever written past ``max_len``: a write that would not fit
raises :class:`CacheFullError`.

The lengths live twice.  ``device_lengths`` (int32 [bs], on the device) is authoritative for
device work: the write slots, attention's prefix and compaction read it, so a forward uploads
nothing for them and every layer reuses it.  ``lengths`` (host int64 [bs]) is its mirror for
the host's bookkeeping (positions, capacity checks).  Host commits (:meth:`advance` of host
ints, :meth:`truncate`) set both with one small upload.  A commit of *device* counts (the
acceptance of a round still on the device) is a device add: the host reads nothing, and
``lengths`` holds an upper bound (``pending``) until :meth:`confirm_lengths` gives it the read
values; capacity checks use that bound, so they stay safe.  No cache operation reads the device.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.backends import bf16_bits
from kdtree_numba.kvlayout import (CacheFullError, KVLayout, PageTable, device_address,
                                   make_layout)

__all__ = ["KVCache", "CacheFullError", "WriteSlots", "LatentStore", "CACHE_DTYPES"]

CACHE_DTYPES = ("float32", "bfloat16")   # what the latents are stored as


@dataclasses.dataclass(frozen=True)
class WriteSlots:
    """Where one forward's n new tokens go, made once and used by every layer:
    ``batch`` [bs, 1] and ``rows`` [bs, n] (device index arrays: request b's new token slots
    ``lengths_b + j``), ``storage`` [bs, n] (where the layout keeps them: rows of a layer's
    array viewed as ``[slots, width]``, KVLayout.storage_rows), ``prefix`` [bs] int32 (the
    device lengths: attention's prefix), ``max_keys`` (host int >= ``max(lengths) + n``: the
    attention kernels' split-plan hint) and ``table`` (a paged layout's page table, else
    None).  With the lean round (``KDTREE_LEAN_ROUND``) a dense cache's slots leave ``rows``
    None (no forward reads them; :meth:`KVCache.positions` gives a context's positions): one
    launch a forward, the storage rows, where the rows and the layout's storage rows took
    three.  ``positions`` [bs, n] int32: the tokens' positions where their maker computed them
    with the slots (a device round's drafter block, ``KDTREE_ROUND_EPILOGUE``: position =
    slot in a drafter's context), else None."""
    batch: object
    rows: object
    storage: object
    prefix: object
    max_keys: int
    table: PageTable | None = None
    positions: object = None


@dataclasses.dataclass(frozen=True)
class LatentStore:
    """One layer's cache as a fused latents kernel writes it (kdtree_numba/layers/latents.py):
    ``c`` [slots, r] and ``k_pe`` [slots, dr] (float32, or uint16 bf16 bits for a bf16 cache)
    and the ``rows`` [M] of the forward's M new tokens there; ``xp`` the arrays' module."""
    c: object
    k_pe: object
    rows: object
    xp: object = np

    def put(self, c, k_pe) -> None:
        """``c`` [M, r] and ``k_pe`` [M, dr] (float32) at the rows, each one scatter; rounded
        to bf16 (to nearest, ties to even) for a store of bits: every cache write, the parts'
        of ``mla_latents(into=)`` and :meth:`KVCache.write`, and the fused kernel's rounding."""
        for store, values in ((self.c, c), (self.k_pe, k_pe)):
            store[self.rows] = bf16_bits(self.xp, values) if store.dtype == np.uint16 \
                else values


class KVCache:
    def __init__(self, backend, n_layers: int, batch: int, max_len: int, kv_lora_rank: int,
                 rope_dim: int, dtype: str = "float32", layout: str | KVLayout = "dense"):
        """``layout``: a spec ("dense", "paged:P": kvlayout.layout_spec) or a KVLayout built
        for ``batch`` and ``max_len`` (e.g. a PagedLayout with a smaller pool)."""
        if min(n_layers, batch, max_len, kv_lora_rank, rope_dim) < 1:
            raise ValueError("KVCache sizes must all be >= 1")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
        if not isinstance(layout, KVLayout):
            layout = make_layout(layout, batch, max_len)
        if (layout.batch, layout.max_len) != (batch, max_len):
            raise ValueError(f"the layout is for {layout.batch} requests of {layout.max_len} "
                             f"slots, the cache for {batch} of {max_len}")
        layout.check_backend(backend)
        self.backend = backend
        self.dtype = dtype
        self.layout = layout
        xp = backend.xp
        self.max_len = int(max_len)
        store = np.uint16 if dtype == "bfloat16" else np.float32
        self.c = xp.zeros(layout.shape(n_layers, kv_lora_rank), store)
        self.k_pe = xp.zeros(layout.shape(n_layers, rope_dim), store)
        self.lengths = np.zeros(batch, np.int64)     # host mirror (an upper bound if pending)
        self.device_lengths = backend.asarray(np.zeros(batch, np.int32))
        self.pending = False
        self._floor = self.lengths.copy()   # what the lengths are at least (exact unless pending)
        # device programs built over this cache (kdtree_numba/device_round.py), which hold its
        # buffers' addresses in their CUDA graphs: they live as long as the cache
        self.programs: dict = {}
        self._written = 0                   # slots per request the last reserve made room for
        # device_slots' index ranges, made once: on the GPU each arange was a launch of its
        # own in every forward (a DDTree round makes three forwards' slots)
        self._requests = xp.arange(batch, dtype=np.int64)[:, None]
        self._steps = xp.arange(self.max_len, dtype=np.int64)[None, :]
        # a dense layout's storage rows of every slot, b max_len + j (KDTREE_LEAN_ROUND: a
        # forward's storage rows are then one add, where the layout's took two more launches)
        self._storage = self._requests * self.max_len + self._steps \
            if layout.spec == "dense" else None
        self._positions = xp.arange(self.max_len, dtype=np.int32)[None, :]

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
        return self.nbytes // self.layout.slots

    def check_room(self, n_new: int) -> None:
        """Raise unless every request can take ``n_new`` more slots after its length (its
        upper bound while pending)."""
        over = np.flatnonzero(self.lengths + n_new > self.max_len)
        if over.size:
            b = int(over[0])
            bound = " at most" if self.pending else ""
            raise CacheFullError(
                f"KV cache full: request {b} holds{bound} {int(self.lengths[b])} tokens and "
                f"needs {n_new} more slots, but max_len is {self.max_len} "
                f"({over.size} request(s) over capacity); allocate a larger cache")

    def reserve(self, n: int) -> PageTable | None:
        """The host's part of a forward over n new tokens per request: the capacity check
        (:class:`CacheFullError` before anything is written) and the layout's
        (KVLayout.reserve: a paged layout's pages and table, returned)."""
        self.check_room(n)
        self._written = int(n)
        return self.layout.reserve(self.backend, self.lengths, n)

    def slot_inputs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Host ``(rows [bs, n] int64, prefix [bs] int32)`` of n new tokens per request, from
        the host lengths (RuntimeError while they are pending; raises
        :class:`CacheFullError` first).  The model itself makes its slots on the device
        (:meth:`write_slots`, :meth:`device_slots`)."""
        if self.pending:
            raise RuntimeError("the cache's host lengths are pending (advanced by device "
                               "counts): confirm_lengths first")
        self.reserve(n)
        return self.lengths[:, None] + np.arange(n)[None, :], self.lengths.astype(np.int32)

    def write_slots(self, n: int) -> WriteSlots:
        """The slots of n new tokens per request (:meth:`reserve`, then :meth:`device_slots`
        of the device lengths); ``max_keys`` from the host lengths."""
        table = self.reserve(n)
        slots = self.device_slots(self.device_lengths, n, table)
        return dataclasses.replace(slots, max_keys=int(self.lengths.max()) + n)

    def device_slots(self, lengths, n: int, table: PageTable | None = None) -> WriteSlots:
        """The slots of n new tokens after device ``lengths`` [bs] int32 (the cache's, or a
        CUDA graph's static copy of them), made with device work only, so that a graph can
        capture it; ``table``: the layout's (default: its last :meth:`reserve`'s).
        Attention's split plan covers the whole capacity (``max_keys = max_len``), so one graph
        serves every length."""
        table = self.layout.table if table is None else table
        batch = self._requests
        if self.dense and runtime.current().lean_round:     # the same integers
            return self.slots_at(lengths, lengths[:, None] + self._storage[:, :n])
        rows = lengths[:, None] + self._steps[:, :n]
        storage = self.layout.storage_rows(batch, rows, table)
        return WriteSlots(batch=batch, rows=rows, storage=storage, prefix=lengths,
                          max_keys=self.max_len, table=table)

    @property
    def dense(self) -> bool:
        """Whether the layout is dense: a slot's storage row is ``b max_len + slot``."""
        return self._storage is not None

    def slots_at(self, lengths, storage, positions=None) -> WriteSlots:
        """A dense cache's slots (:meth:`device_slots`, lean: no ``rows``) of the device
        ``storage`` rows [bs, n] int64 after device ``lengths`` [bs] int32, made by the
        caller (a device round's ``round_slots``, ``KDTREE_ROUND_EPILOGUE``), with their
        ``positions`` where it made them too."""
        return WriteSlots(batch=self._requests, rows=None, storage=storage, prefix=lengths,
                          max_keys=self.max_len, table=self.layout.table, positions=positions)

    def positions(self, lengths, n: int):
        """The positions [bs n] int32 of n new tokens per request after device ``lengths``
        [bs] int32 (position = slot): one launch, from an int32 range made with the cache."""
        return (lengths[:, None] + self._positions[:, :n]).reshape(-1)

    def write(self, layer: int, c_new, k_pe_new, slots: WriteSlots | None = None) -> None:
        """Latents of n new tokens per request, [bs, n, r] and [bs, n, dr] (float32; rounded to
        bf16 for a bf16 cache), into slots ``[lengths[b], lengths[b] + n)`` of ``layer`` (not
        committed).  ``slots``: this forward's :meth:`write_slots` (made here if not given)."""
        if slots is None:
            slots = self.write_slots(c_new.shape[1])
        m = c_new.shape[0] * c_new.shape[1]
        self.latent_store(layer, slots).put(c_new.reshape(m, -1), k_pe_new.reshape(m, -1))

    def latent_store(self, layer: int, slots: WriteSlots) -> LatentStore:
        """Layer ``layer``'s arrays and the rows of ``slots`` there (``mla_latents(...,
        into=)`` writes the latents straight into the cache; :meth:`write` through it)."""
        c, k_pe = self.c[layer], self.k_pe[layer]
        return LatentStore(c.reshape(-1, c.shape[-1]), k_pe.reshape(-1, k_pe.shape[-1]),
                           slots.storage.reshape(-1), self.backend.xp)

    def attend(self, ops, layer: int, q_abs, q_pe, slots: WriteSlots, visible, tau, *,
               prefill: bool = False, causal: bool = False, plans=None):
        """``mla_attention`` of one layer over this cache (the layout's: KVLayout.attend) for
        the n new tokens of :meth:`write_slots` ``slots``, already written; ``plans``: the
        caller's attention plans (a model's PlanCache)."""
        return self.layout.attend(ops, self.c[layer], self.k_pe[layer], q_abs, q_pe, slots,
                                  visible, tau, prefill=prefill, causal=causal, plans=plans)

    def advance(self, counts, *, device: bool | None = None, upper=None) -> None:
        """Commit ``counts[b]`` newly written tokens per request.

        Host counts (an int or [bs] ints): both lengths, with one small upload.  Device counts
        ([bs] ints on the device; ``device=True`` says so where device arrays are NumPy: the
        reference backend, the simulator; None: arrays with ``__cuda_array_interface__``): a
        device add to ``device_lengths``, never read; ``lengths`` grows by ``upper`` (host ints
        bounding the counts; default: the slots the last forward wrote, which no commit
        exceeds) and is ``pending`` until :meth:`confirm_lengths`."""
        if device is None:
            device = hasattr(counts, "__cuda_array_interface__")
        shape = self.lengths.shape
        grow = self._written if device and upper is None else (upper if device else counts)
        grow = np.broadcast_to(np.asarray(grow, np.int64), shape)
        if np.any(grow < 0) or np.any(self.lengths + grow > self.max_len):
            raise CacheFullError(f"cannot advance lengths {self.lengths.tolist()} by "
                                 f"{grow.tolist()} within max_len {self.max_len}")
        self.lengths = self.lengths + grow
        if device:
            # asarray: no copy for a device array (a host one forced by device=True goes up)
            self.add_on_device(self.backend.asarray(counts))
            self.pending = True
            self._written = 0
        elif self.pending:       # the host knows the counts, not the lengths: add them there
            self._floor = self._floor + grow
            self.add_on_device(self.backend.asarray(grow.astype(np.int32)))
        else:
            self._floor = self.lengths.copy()
            self._set_device(self.lengths)

    def add_on_device(self, counts) -> None:
        """``device_lengths += counts`` ([bs] device ints) in place: device work only, no host
        bookkeeping, so a CUDA graph can capture it (a device round program, whose host side
        keeps the mirror with :meth:`expect_device_growth`).  The buffer itself never changes:
        graphs captured against it stay valid."""
        xp = self.backend.xp
        xp.add(self.device_lengths, counts.astype(np.int32, copy=False), out=self.device_lengths)

    def expect_device_growth(self, floor, upper) -> None:
        """The host side of device commits made elsewhere (:meth:`add_on_device` in a device
        round program): the lengths are at least ``floor`` (host ints, the last read ones) and
        at most ``upper``; pending until :meth:`confirm_lengths`."""
        floor, upper = np.asarray(floor, np.int64), np.asarray(upper, np.int64)
        if np.any(floor > upper) or np.any(upper > self.max_len):
            raise CacheFullError(f"device commits may take the lengths to {upper.tolist()}, "
                                 f"past max_len {self.max_len}")
        self._floor, self.lengths, self.pending = floor.copy(), upper.copy(), True

    def _set_device(self, lengths) -> None:
        """``device_lengths`` set from host ints, written into the same buffer (one upload)."""
        self.backend.upload_into(self.device_lengths, lengths)

    def confirm_lengths(self, lengths) -> None:
        """The host learns the lengths its device counts made (host ints [bs], e.g. from the
        round's read): ``lengths`` takes them, no longer pending.  Nothing is uploaded (the
        device lengths already hold them); values outside what the commits allow are a
        ValueError."""
        self._set_host(lengths, self._floor, "confirmed lengths {} must lie between {} and {}")

    def truncate(self, lengths) -> None:
        """Roll requests back to shorter lengths (the slots past them become scratch; a paged
        layout frees its pages past them).  Sets both lengths (one upload), pending or not:
        while pending, ``lengths`` may not exceed the upper bound."""
        lengths = self._set_host(lengths, np.zeros_like(self.lengths),
                                 "truncate to {0} from {2}: lengths may only shrink")
        self._set_device(lengths)
        self.layout.truncate(lengths)

    def _set_host(self, lengths, low, message: str) -> np.ndarray:
        """The host lengths set to ``lengths`` in ``[low, lengths]`` (ValueError ``message``
        formatted with them, the low and the high end otherwise), exact again."""
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != self.lengths.shape or np.any(lengths < low) \
                or np.any(lengths > self.lengths):
            raise ValueError(message.format(lengths.tolist(), low.tolist(),
                                            self.lengths.tolist()))
        self.lengths = lengths.copy()
        self._floor = lengths.copy()
        self.pending = False
        return lengths

    def compact_tree(self, ops, acc_idx, acc_len, lengths=None) -> None:
        """After a verify forward over a tree written at ``[lengths, lengths + B + 1)``: move
        the accepted rows (``acc_idx[b, :acc_len[b]]``, device arrays on a GPU) to the front of
        the tree block (KVLayout.compact: ``compact_kv``, every layer in one call).  Launches
        only: the lengths do not change until :meth:`advance`.  ``lengths``: a CUDA graph's
        copy of ``device_lengths`` (the default)."""
        lengths = self.device_lengths if lengths is None else lengths
        self.layout.compact(ops, [self.c, self.k_pe], lengths, acc_idx, acc_len)

    def buffer_key(self) -> tuple:
        """The key of a CUDA graph that reads or writes the cache (KVLayout.key: the layout
        and its arrays' addresses and shapes, the device lengths' among them; the same
        buffers, reused by another cache object, replay correctly)."""
        key = self.layout.key((self.c, self.k_pe, self.device_lengths))
        # the lean slots' storage rows (KDTREE_LEAN_ROUND), which a captured forward reads
        return key if self._storage is None else key + (device_address(self._storage),)

    def commit_tree(self, ops, acc_idx, acc_len, accepted, active=None) -> None:
        """:meth:`compact_tree`, then commit ``accepted[b]`` rows per request (host ints: the
        acc_len the caller already read; reading it here would cost a sync).  Requests with
        ``active[b]`` false do not grow."""
        self.compact_tree(ops, acc_idx, acc_len)
        grow = np.asarray(accepted, np.int64)
        if active is not None:
            grow = np.where(np.asarray(active, bool), grow, 0)
        self.advance(grow)

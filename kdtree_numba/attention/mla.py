"""Absorbed-MLA attention on the device: plan -> block kernel -> merge of the key splits.

:func:`mla_attention` is the numba twin of ``reference.attention.mla_attention`` (contract:
reference/attention/mla.py; float32 on the device).  One :class:`MlaAttentionPlan` per problem
shape holds the decisions of plan.py (tile layout, split count), the block kernel for that
layout (ffma.py or the tensor-core kernel of mma.py for a float32 cache, bf16.py for a bf16
one), the merge kernel below and the buffers of
the partial outputs; :func:`mla_attention` keeps one plan per shape in its caller's
:class:`PlanCache` (a model owns one).  docs/ATTENTION.md has the design and the measured speed.

Long prefixes are split across blocks (flash-decoding): each split writes its unnormalised
partial output and (reference max, sum); :func:`_merge_kernel` combines them, or with
``fused_merge`` (``KDTREE_FEWER_LAUNCHES=1``) the block kernel's last block of each row tile
does (tiles.merge_when_last: one launch a call instead of two, the same bits).  With one split
the block kernel normalises and writes ``u`` directly.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, to_device, SIMULATOR  # noqa: I001

import collections
import dataclasses
from functools import lru_cache

import numpy as np

from kdtree_numba import compat, runtime
from kdtree_numba.attention.bf16 import build_kernel as build_bf16_kernel
from kdtree_numba.attention.ffma import build_kernel as build_ffma_kernel
from kdtree_numba.attention.mma import build_kernel as build_mma_kernel
from kdtree_numba.attention.wgmma import build_kernel as build_wgmma_kernel
from kdtree_numba.attention.plan import (BF16_VARIANT, INVARIANT_SPLIT_KEYS, Bf16TileConfig,
                                         MmaTileConfig, bf16_tile_config,
                                         choose_splits, mma_rows, resolve_variant,
                                         tile_config, wgmma_attention_fits)
from kdtree_numba.attention.tiles import (merge_smem_floats, request_keys, split_merge,
                                          splits_with_keys)
from kdtree_numba.gpu.memory import allow_large_shared_memory
from kdtree_numba.gpu.tensorcore import wgmma_available
from reference.attention import check_causal

__all__ = ["mla_attention", "MlaAttentionPlan", "PendingMerge", "PlanCache", "clear_plan_cache"]


@kernel_factory
def _attention_kernel(cfg):
    """Build the block kernel for one configuration (constants are closed over): the FFMA
    kernel of ffma.py for a TileConfig, the tensor-core one of mma.py for an MmaTileConfig,
    the bf16 one of bf16.py for a Bf16TileConfig (wgmma.py's warpgroup kernel for one with
    ``wgmma``)."""
    if isinstance(cfg, Bf16TileConfig):
        return build_wgmma_kernel(cfg) if cfg.wgmma else build_bf16_kernel(cfg)
    if isinstance(cfg, MmaTileConfig):
        return build_mma_kernel(cfg)
    return build_ffma_kernel(cfg)


MERGE_THREADS = 128


@kernel_factory
def _merge_kernel(r: int):
    """out[b, row] = sum_s w_s O_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), over the
    splits that hold keys of request b (tiles.splits_with_keys: the others wrote nothing);
    tiles.split_merge's arithmetic, which the in-kernel merge repeats in the same order."""
    DV4 = r // 4
    merge_quad = split_merge()

    @kernel
    def merge_splits(part_o, part_ml, prefix_len, n, heads, causal, chunk, all_splits, out):
        row, b = cuda.blockIdx.x, cuda.blockIdx.y
        keys = request_keys(prefix_len[b], n, causal, row, heads)
        splits = splits_with_keys(keys, chunk, all_splits)
        for quad in range(cuda.threadIdx.x, DV4, cuda.blockDim.x):
            merge_quad(part_o, part_ml, out, b, row, quad, splits)

    return merge_splits


@kernel
def _zero_counters(part_ml, at):
    """part_ml[:, at, :, 0] = 0: the arrival counters of the in-kernel merge (the plan's first
    call; inside a CUDA graph's capture, each replay's: MlaAttentionPlan)."""
    b = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, part_ml.shape[2], cuda.blockDim.x):
        part_ml[b, at, i, 0] = 0


# ---------------------------------------------------------------------------------------------
# Launch plumbing
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _sm_count() -> int:
    if SIMULATOR:
        return 4
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


class MlaAttentionPlan:
    """Buffers, split count and configured kernels for one problem shape; call it to run.

    Reuse one plan per shape in a decode loop: it allocates nothing per call, so its launches
    can also be captured in a CUDA graph.  ``max_keys`` bounds ``prefix_len + n`` and only sets
    the split count (default: ``max_len``); ``keys_per_split`` forces a split size (tests);
    ``variant`` picks a tile layout from :data:`VARIANTS` (None: :func:`resolve_variant`).
    ``batch_invariant``: splits of a fixed :data:`INVARIANT_SPLIT_KEYS` keys (unless
    ``keys_per_split`` forces another size) instead of the modelled best count, so that a row
    sums its keys in the same splits, tiles and merge order whatever n, bs and max_keys (>=
    prefix + n: an underestimate hands the last split the rest): a decode and a verify of any
    size, against caches of any capacity, give a token the same bits when its keys sit at the
    same slots (within a split, keys are grouped by slot).  The price is more partial outputs
    at large n and long prefixes (docs/ATTENTION.md, "Batch invariance").
    ``prefill``: the call computes a prompt's rows, whose bits no decode or verify row must
    share; with ``batch_invariant`` each row then takes its keys in one split, which still
    depends on nothing but the request's own keys (a prompt gets the same bits alone or in a
    batch, against any capacity) but writes no partial outputs, which at thousands of prompt
    tokens cost more than the splits save.  Without ``batch_invariant`` it changes nothing.
    ``rows``: query-heads per tensor-core block (16, 32, 64; None: :func:`~kdtree_numba.
    attention.plan.mma_rows` picks the most that fill the GPU); the bits do not depend on it.
    ``bf16_cache``: ckv and kpe hold bf16 bit patterns (uint16); the plan runs the bf16
    kernel (bf16.py; ``variant`` must then be None or ``"bf16"``, the plan's variant).
    ``fused_merge`` (``KDTREE_FEWER_LAUNCHES``): with more than one split, the block kernel's
    last block of each row tile merges them (tiles.merge_when_last) where a second launch did:
    the same bits.  Its arrival counters are ``part_ml[:, splits, tile, 0]`` (float32 counts,
    so the kernel's argument types stay those of the plain one), set to zero by one small
    launch on the plan's first call and back to zero by each call's merging blocks.  A plan
    first called inside a CUDA graph's capture records that launch in the graph, so each
    replay starts from zeros, whatever another graph wrote meanwhile into the memory its pool
    shares (kdtree_numba/graphs.py): one launch a replay per such plan, where the merge kernel
    took one per call.
    """

    def __init__(self, bs, n, heads, r, dr, max_len, *, max_keys=None, keys_per_split=None,
                 variant=None, batch_invariant=False, prefill=False, rows=None,
                 bf16_cache=False, fused_merge=False, stream=0):
        compat.require_kernels()
        self.shape = (bs, n, heads, r, dr, max_len)
        self.bf16_cache = bool(bf16_cache)
        if self.bf16_cache:
            if variant not in (None, BF16_VARIANT):
                raise ValueError(f"a bf16 cache runs the {BF16_VARIANT!r} kernel, not variant "
                                 f"{variant!r} (the float32 cache's layouts)")
            variant = BF16_VARIANT
            self.cfg = bf16_tile_config(r, dr)
            wgmma = (runtime.current().attention_wgmma and rows in (None, 64)
                     and wgmma_attention_fits(r, dr, 64, self.cfg.keys)
                     and (SIMULATOR or wgmma_available()))
            if wgmma:   # KDTREE_ATTENTION_WGMMA: the warpgroup kernel's 64-row blocks
                self.cfg = dataclasses.replace(self.cfg, wgmma=True, frag_queries=False)
                rows = 64
        else:
            variant = resolve_variant(variant, r, dr)
            self.cfg = tile_config(r, dr, variant)
            wgmma = False
        self.variant = variant
        self.stream = stream
        self.n_rows = n * heads
        row_tiles = -(-self.n_rows // self.cfg.rows)
        max_keys = max_len if max_keys is None else min(int(max_keys), max_len)
        if keys_per_split is None and batch_invariant:
            # every tile layout computes a row alone (its own scores, softmax and outputs), so
            # only the key partition can tie a row's sums to the call: fix it (a prefill's:
            # all its keys in one split)
            keys = max(1, max_keys) if prefill else INVARIANT_SPLIT_KEYS
            keys_per_split = -(-keys // self.cfg.keys) * self.cfg.keys
        if keys_per_split is None:
            splits = choose_splits(row_tiles * bs, max_keys, self.cfg.keys, _sm_count(),
                                   4 * self.cfg.rows * (r + 2))
            tiles = -(-max(1, max_keys) // self.cfg.keys)
            keys_per_split = -(-tiles // splits) * self.cfg.keys
        self.chunk = int(keys_per_split)
        self.splits = max(1, -(-max_keys // self.chunk))
        if isinstance(self.cfg, (MmaTileConfig, Bf16TileConfig)):
            if rows is None:
                rows = mma_rows(self.n_rows, self.splits, bs, _sm_count())
            self.cfg = dataclasses.replace(self.cfg, rows=rows, threads=4 * rows).validate()
            row_tiles = -(-self.n_rows // self.cfg.rows)
        elif rows is not None:
            raise ValueError(f"rows= picks a tensor-core block shape; variant {variant!r} "
                             f"has a fixed one")
        self.grid = (row_tiles, self.splits, bs)
        # the in-kernel merge takes a tile's rows in groups that fit the block's shared
        # memory; a split count too large for even one row (millions of keys) keeps the
        # merge kernel
        # (not in the warpgroup kernel: the merge's IEEE division would serialize its wgmma)
        self.fused_merge = (bool(fused_merge) and self.splits > 1
                            and not wgmma
                            and merge_smem_floats(1, self.splits) <= self.cfg.smem_bytes() // 4)
        self.counters_zeroed = not self.fused_merge
        if self.fused_merge:
            self.cfg = dataclasses.replace(self.cfg, fused_merge=True)
        self.attn = _attention_kernel(self.cfg)
        self.attn_causal = None     # the causal=True build, made on first use
        self.no_out = None          # the u stand-in of a deferred merge's calls
        self.merge = _merge_kernel(r) if self.splits > 1 and not self.fused_merge else None
        if self.splits > 1:
            self.part_o = compat.device_empty((bs, self.splits, self.n_rows, r), np.float32,
                                              stream)
            # with the fused merge, one more "split": the row tiles' arrival counters
            self.part_ml = compat.device_empty(
                (bs, self.splits + self.fused_merge, self.n_rows, 2), np.float32, stream)
        else:  # unused by the kernel, but typed arguments must exist
            self.part_o = compat.device_empty((1, 1, 1, 4), np.float32, stream)
            self.part_ml = compat.device_empty((1, 1, 1, 2), np.float32, stream)

    def __call__(self, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=None, stream=None,
                 causal=False, defer_merge=False):
        """Run on the plan's stream, or on ``stream`` if given (a CUDA-graph capture's).
        ``causal``: the caller promises that no query sees a new key after its own (contract:
        reference/attention/mla.py); each block then stops at its last query's keys, which
        halves a long prefill's work and changes no bit.  A host ``visible`` is checked.
        ``defer_merge``: where the splits need a merge launch and no ``out`` is given, return
        a :class:`PendingMerge` for the consumer to merge (``KDTREE_MERGE_IN_UV``)."""
        bs, n, heads, r, dr, max_len = self.shape
        _check_shapes(self.shape, q_abs, q_pe, ckv, kpe, prefix_len, visible, self.bf16_cache)
        if not compat.is_device_array(visible):
            check_causal(visible, causal)
        st = self.stream if stream is None else stream
        q_abs3 = to_device(q_abs, st).reshape(bs, self.n_rows, r)
        q_pe3 = to_device(q_pe, st).reshape(bs, self.n_rows, dr)
        ckv_d, kpe_d = to_device(ckv, st), to_device(kpe, st)
        prefix_d = to_device(_as_int32(prefix_len), st)
        visible_d = to_device(_as_bool(visible), st)
        deferred = defer_merge and out is None and self.merge is not None
        if deferred:       # the kernel writes no u with several splits: a typed stand-in
            if self.no_out is None:
                self.no_out = compat.device_empty((1, 1, r), np.float32, st)
            out3 = self.no_out
        else:
            if out is None:
                out = compat.device_empty((bs, n, heads, r), np.float32, st)
            out3 = out.reshape(bs, self.n_rows, r)
        direct = self.splits == 1
        args = (q_abs3, q_pe3, ckv_d, kpe_d, prefix_d, visible_d, np.float32(tau), np.int64(n),
                np.int64(heads), np.int64(self.chunk), direct, out3, self.part_o, self.part_ml)
        nbytes = self.cfg.smem_bytes()
        # causal is compiled in: as a runtime flag it made every call's tensor-core kernel
        # spill 32 bytes instead of 8; this way only causal calls pay that
        if causal and self.attn_causal is None:
            self.attn_causal = _attention_kernel(dataclasses.replace(self.cfg, causal=True))
        attn = self.attn_causal if causal else self.attn
        allow_large_shared_memory(attn, args, nbytes)
        if not self.counters_zeroed:
            _zero_counters[bs, 32, st](self.part_ml, np.int64(self.splits))
            self.counters_zeroed = True
        attn[self.grid, self.cfg.threads, st, nbytes](*args)
        if deferred:
            return PendingMerge(self, prefix_d, bool(causal))
        if self.merge is not None:
            self.launch_merge(prefix_d, causal, out, st)
        return out

    def launch_merge(self, prefix_d, causal, out, stream):
        """The merge kernel over the partial outputs of the last call into ``out``."""
        bs, n, heads, r = self.shape[:4]
        self.merge[(self.n_rows, bs), min(MERGE_THREADS, r // 4), stream](
            self.part_o, self.part_ml, prefix_d, np.int64(n), np.int64(heads), bool(causal),
            np.int64(self.chunk), np.int64(self.splits), out.reshape(bs, self.n_rows, r))


class PendingMerge:
    """Attention's output before its key splits are merged: what a plan's call returns with
    ``defer_merge`` (``KDTREE_MERGE_IN_UV``: a model's PlanCache asks for it) where it has a
    merge launch to make.  Its one consumer, ``apply_uv`` (projections.py), merges each row as
    it stages it (tiles.merged_value: the merge kernel's bits) and so saves the merge's launch,
    or calls :meth:`materialize` where its kernel cannot.  The partial outputs live in the
    plan's buffers until its next call: consume a PendingMerge before calling the plan again
    (the model's attention does, in the next statement).  A plain class, not a dataclass: the
    backend's result conversion (backends.map_arrays) passes it through untouched."""

    __slots__ = ("plan", "prefix", "causal", "shape")

    def __init__(self, plan, prefix, causal):
        self.plan, self.prefix, self.causal = plan, prefix, causal
        self.shape = plan.shape[:4]           # u's: (bs, n, heads, r)

    def materialize(self, out=None, stream=0):
        """u [bs, n, H, r] float32 on the device (into ``out``): the merge kernel's launch."""
        if out is None:
            out = compat.device_empty(self.shape, np.float32, stream)
        self.plan.launch_merge(self.prefix, self.causal, out, stream)
        return out


def _as_int32(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.int32)


def _as_bool(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.bool_)


def _check_shapes(shape, q_abs, q_pe, ckv, kpe, prefix_len, visible, bf16_cache):
    bs, n, heads, r, dr, max_len = shape
    want = {"q_abs": (bs, n, heads, r), "q_pe": (bs, n, heads, dr), "ckv": (bs, max_len, r),
            "kpe": (bs, max_len, dr), "prefix_len": (bs,), "visible": (bs, n, n)}
    got = {"q_abs": q_abs, "q_pe": q_pe, "ckv": ckv, "kpe": kpe, "prefix_len": prefix_len,
           "visible": visible}
    for name, arr in got.items():
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]}")
    for name in ("q_abs", "q_pe", "ckv", "kpe"):
        want_dtype = np.uint16 if bf16_cache and name in ("ckv", "kpe") else np.float32
        if np.dtype(got[name].dtype) != want_dtype:
            cache = "a bf16 cache's" if bf16_cache else "a float32 cache's"
            raise TypeError(f"{name} must be {np.dtype(want_dtype)} ({cache} plan: queries "
                            f"float32, ckv and kpe both float32 or both bf16 bits as uint16), "
                            f"got {got[name].dtype}")
    if np.dtype(visible.dtype) not in (np.dtype(np.bool_), np.dtype(np.uint8)):
        raise TypeError(f"visible must be bool or uint8, got {visible.dtype}")
    if not compat.is_device_array(prefix_len):
        p = np.asarray(prefix_len)
        if np.any(p < 0) or np.any(p + n > max_len):
            raise ValueError(f"prefix_len + n must lie in [n, max_len={max_len}]: {p}")


class PlanCache:
    """The attention plans of one owner (a model; FlashInfer's plan()/run()), one per problem
    key, the least recently used dropped past ``capacity``.  A plan holds scratch between
    calls, so a CUDA graph that launched a plan must keep its scratch alive: the model starts a
    fresh cache before each capture (Model.new_graphs), whose plans are then made inside it
    and their scratch recorded with the graph (kdtree_numba/graphs.py)."""

    def __init__(self, capacity: int = 16, defer_merge: bool | None = False):
        self.capacity = int(capacity)
        # whether its plans' calls leave the merge to apply_uv (PendingMerge); None: as
        # KDTREE_MERGE_IN_UV says at each call (a model's cache: its attention output has
        # one reader, the model's apply_uv)
        self.defer_merge = defer_merge
        self._plans: "collections.OrderedDict" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, shape, max_keys, keys_per_split, variant, batch_invariant, prefill, rows,
             bf16_cache, fused_merge=False) -> "MlaAttentionPlan":
        # the switches a plan reads when it is made (a process may flip them between calls)
        key = (shape, max_keys, keys_per_split, variant, batch_invariant, prefill, rows,
               bf16_cache, fused_merge, bf16_cache and runtime.current().attention_wgmma)
        plan = self._plans.get(key)
        if plan is None:
            plan = MlaAttentionPlan(*shape, max_keys=max_keys, keys_per_split=keys_per_split,
                                    variant=variant, batch_invariant=batch_invariant,
                                    prefill=prefill, rows=rows, bf16_cache=bf16_cache,
                                    fused_merge=fused_merge)
            self._plans[key] = plan
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan


# the plans of callers that bring no cache of their own (tests, benchmarks, single calls)
_UNOWNED = PlanCache()


def clear_plan_cache() -> None:
    """Forget the plans of callers without a :class:`PlanCache` of their own (a test that
    patches a planning constant; a model's plans are its own)."""
    _UNOWNED._plans.clear()


def mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, out=None, max_keys=None,
                  keys_per_split=None, variant=None, batch_invariant=False, prefill=False,
                  rows=None, causal=False, fused_merge=None, plans: PlanCache | None = None,
                  stream=0):
    """Absorbed-MLA attention on the device; contract in reference/attention/mla.py.

    Inputs may be NumPy, numba device or CuPy arrays (float32; ``visible`` bool or uint8;
    ``prefix_len`` integer); ``ckv`` and ``kpe`` may instead both be bf16 bit patterns (uint16:
    a bf16 cache), which runs the bf16 kernel (bf16.py; the contract's bf16 paragraph).
    Returns a numba device array u [bs, n, H, r] float32 (or ``out``).
    A host ``prefix_len`` sets the split count from its maximum; for a device one pass
    ``max_keys`` (>= max(prefix_len) + n) or the cache length ``max_len`` is assumed.
    ``variant`` picks a kernel (:data:`VARIANTS`; all compute the same function; None: the
    tensor-core one where it runs, see :func:`resolve_variant`).  ``batch_invariant`` (also
    set by ``KDTREE_INVARIANT_ATTENTION=1``): a row's bits do not depend on n; ``prefill``: a
    prompt's call, planned for speed under ``batch_invariant`` (both: see
    :class:`MlaAttentionPlan`).  ``rows``: the tensor-core
    block's query-heads (None: picked to fill the GPU; tests and benchmarks force one).
    ``causal``: no query sees a new key after its own (see :class:`MlaAttentionPlan`).
    ``fused_merge``: the key splits merged in the block kernel (see :class:`MlaAttentionPlan`;
    None: ``KDTREE_FEWER_LAUNCHES``, kdtree_numba/runtime.py).
    ``plans``: the caller's :class:`PlanCache` (a model's; default: one for callers without);
    one made with ``defer_merge`` gets a :class:`PendingMerge` where a merge launch was due.
    """
    bs, n, heads, r = q_abs.shape
    shape = (bs, n, heads, r, q_pe.shape[-1], ckv.shape[1])
    if max_keys is None and not compat.is_device_array(prefix_len):
        max_keys = int(np.max(prefix_len)) + n if bs else n
    bf16_cache = np.dtype(ckv.dtype) == np.uint16
    now = runtime.current()
    # KDTREE_INVARIANT_ATTENTION: the fixed key splits on every GEMM setting
    invariant = bool(batch_invariant) or now.invariant_attention
    if fused_merge is None:
        fused_merge = now.fewer_launches
    cache = _UNOWNED if plans is None else plans
    plan = cache.plan(
        shape, max_keys, keys_per_split, variant, invariant, invariant and bool(prefill), rows,
        bf16_cache, bool(fused_merge))
    return plan(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=out, stream=stream,
                causal=causal, defer_merge=now.merge_in_uv
                if cache.defer_merge is None else cache.defer_merge)

"""CUDA graphs of repeated device work: each key captured once, then replayed with one launch.

Why: a forward on the GPU is ~90 numba kernel launches plus CuPy glue, and each numba launch
costs tens of microseconds of Python (argument typing, context checks, array wrapping).  The
small config's decode forward took 42 ms of host time for well under a millisecond of GPU work
(tools/profile_engine.py, docs/BENCHMARKS.md).  A replayed graph costs one launch plus the
uploads of the call's inputs.

How (:class:`GraphCache`, owned by a :class:`~kdtree_numba.model.Model` on the GPU, which
decides what is captured and under which key: its forwards and the device-only steps of a
decoding round, kdtree_numba/steps.py):

* **When**: a key is captured the *second* time it is seen.  The first call runs eagerly,
  which compiles and loads every kernel it needs (loading a module is not allowed while
  capturing), and one-off shapes such as a prefill never pay for a capture.
* **Inputs**: the graph reads static device buffers; a replay first writes the call's inputs
  (host or device arrays) into them, stream-ordered, without waiting for the device.  The
  key must name everything else the captured work depends on (a forward's: batch, n,
  whether hidden states are returned, the KV cache's buffers).
* **Outputs** are copied out after each replay, so callers may keep them across calls (a
  drafter keeps its L rows); the copy is one small device-to-device kernel.  A caller that
  uses them before the key's next replay may *borrow* them instead (``call(..., borrow=
  True)``, no copies on the host's path: a DDTree round's tree, verify logits and
  acceptance, which the round consumes before its one read, kdtree_numba/steps.py).  What it
  borrows are copies the graph itself makes as its last nodes, into memory of their own: the
  arrays the captured work returns live in the graphs' pool, where a later capture may have
  placed its scratch in blocks an earlier one freed, so another graph's replay could
  overwrite them (a borrowed tree did, on the H200, before the copies).
* **Memory**: everything the captured work allocates lives as long as its graph: CuPy glue
  and the ops' own arrays (compat.device_empty takes CuPy blocks where CuPy is installed)
  allocate from a pool private to the graphs, numba's own allocations are recorded while
  capturing (the memory manager's ``memalloc`` is wrapped), and the owner's ``before_capture``
  hook drops what would otherwise outlive the capture (the model rebuilds attention's plans
  inside it, so their scratch is recorded too).  With numba's own allocator its frees are
  deferred while capturing (a ``cuMemFree`` can synchronise, which would break the capture);
  with the CuPy-pool plugin (kdtree_numba/gpu/pool.py, the default where CuPy is installed)
  numba's allocations inside a capture come from the graphs' pool, like CuPy's, and a free
  makes no driver call.
* **Streams**: captured on a blocking stream of its own (:meth:`Backend.on_stream` routes numba
  kernels and CuPy glue there).  A blocking stream is ordered with the legacy default stream,
  on which everything else runs, in both directions, so replays need no events; and an op that
  still went to the legacy stream while capturing fails the capture instead of escaping it.
* **Failure**: a capture that fails is reported once (``RuntimeWarning``) and that key runs
  eagerly from then on; ``KDTREE_CUDA_GRAPHS=0`` turns graphs off.

Tokens are the same with or without graphs up to the split plan: a replayed forward sums
attention over the cache's capacity split, an eager call without graphs over the current
prefix's, which can change the last bits of a float32 sum (see tests/test_engine_gpu.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import warnings

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.backends import map_arrays
from kdtree_numba.compat import cuda as numba_cuda    # numba.cuda, after compat's numpy fix

__all__ = ["GraphCache", "graphs_enabled", "max_graphs", "evicted"]

# captured graphs kept per model and kind (a key's first entry), the least recently used of
# the kind dropped: a kind of its own for the prefills (one graph per padded prompt length,
# model.prefill_rows, and cache; each holding its activations) keeps them from pushing out
# the graphs every round replays; 16 hold the held-out prompts' 7 lengths in the 2-3 cache
# capacities they need
MAX_GRAPHS = {"prefill": 16}
MAX_GRAPHS_OF_A_KIND = 24
# auto's second policy (KDTREE_AUTO_V2, the default; issue 36): a device round's graph per
# budget and per (target cache, drafter cache) pair, so --budget auto's 8 candidates in the 4 generation caches a model keeps
# (model.GENERATION_CACHES), each beside its drafter cache of the same capacity bucket or the
# next, need up to 64: with 24, auto's warm-up captures were evicted and its timed rows
# recaptured them (run 150: 12 captures, each after an eager round of ~200 launches from
# Python).  Captures draw on one pool whose freed blocks later captures reuse (GraphCache), so
# a graph holds little memory of its own beyond its outputs and recorded allocations.
MAX_GRAPHS_AUTO_V2 = {"round": 64}
MAX_SEEN = 256         # keys remembered while waiting for their second call


def max_graphs(kind) -> int:
    """The captured graphs of ``kind`` (a key's first entry) a GraphCache keeps now."""
    if runtime.current().auto_v2 and kind in MAX_GRAPHS_AUTO_V2:
        return MAX_GRAPHS_AUTO_V2[kind]
    return MAX_GRAPHS.get(kind, MAX_GRAPHS_OF_A_KIND)


def evicted(keys, kind) -> list:
    """Of ``keys`` (held graphs' keys, least recently used first), those of ``kind`` to drop:
    all but the last :func:`max_graphs` of it."""
    same_kind = [k for k in keys if k[0] == kind]
    return same_kind[:-max_graphs(kind)]


def graphs_enabled() -> bool:
    """Whether CUDA graphs are on (``KDTREE_CUDA_GRAPHS=0`` turns them off)."""
    return runtime.current().cuda_graphs


@dataclasses.dataclass
class _Graph:
    graph: object
    inputs: tuple                  # the static buffers the graph reads
    outputs: object                # what it writes (arrays, tuples/dataclasses of arrays)
    keep: list                     # numba allocations made while capturing
    owned: bool = False            # outputs copied in the graph to memory of their own


def _own_memory(nbytes):
    """CuPy allocator of memory no pool hands out again while the arrays on it live: a
    borrowable graph's outputs."""
    import cupy
    return cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.Memory(nbytes), 0)


def _write(dst, src) -> None:
    """Copy a host or device array into the CuPy buffer ``dst`` (same number of elements),
    converting the dtype; stream-ordered, no host wait (a small host array goes up through
    the driver's staging buffer; tests/test_engine_gpu.py checks that such a replay does
    not wait for the work queued before it).  A device array of dst's dtype and C order
    goes by one cudaMemcpyAsync: a few microseconds of host time where CuPy's elementwise
    copy takes ~10-20, and a DDTree round writes a dozen inputs between its read and its
    verify's launch."""
    import cupy
    if hasattr(src, "__cuda_array_interface__"):
        src = cupy.asarray(src)
        if src.dtype == dst.dtype and src.size == dst.size and src.flags.c_contiguous:
            runtime = cupy.cuda.runtime
            runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                runtime.memcpyDeviceToDevice,
                                cupy.cuda.get_current_stream().ptr)
        else:
            dst[...] = src.reshape(dst.shape)
    else:
        dst.set(np.ascontiguousarray(np.asarray(src), dtype=dst.dtype).reshape(dst.shape))


@contextlib.contextmanager
def _recording_numba_allocations(keep: list):
    """Keep every device allocation numba makes inside the block alive (in ``keep``), and hold
    numba's own frees back until the block ends (a no-op for device memory under the CuPy-pool
    plugin, whose frees make no driver call)."""
    manager = numba_cuda.current_context().memory_manager
    original = manager.memalloc

    def memalloc(size):
        pointer = original(size)
        keep.append(pointer)
        return pointer

    manager.memalloc = memalloc
    try:
        with numba_cuda.defer_cleanup():
            yield
    finally:
        del manager.memalloc           # the class's method again


# the per-call switches (RuntimeConfig fields) whose settings run other kernels or plans in a
# captured graph, and the mark each setting adds to a graph's key (None: none, the default's)
_GRAPH_SWITCHES = (("lean_round", "full_glue", None), ("moe_chunk_grid", "one_chunk_grid", None),
                   ("fewer_launches", None, "fewer_launches"),
                   ("round_epilogue", "no_round_epilogue", None),
                   ("merge_in_uv", None, "merge_in_uv"), ("fused_swiglu", "unfused_swiglu", None),
                   ("invariant_attention", None, "invariant_attention"),
                   ("moe_work_list", None, "moe_work_list"), ("int4_mma", "no_int4_mma", None),
                   ("shared_in_experts", "shared_expert_apart", None),
                   ("combine_in_down", None, "combine_in_down"),
                   ("fused_router", None, "fused_router"),
                   ("group_in_experts", None, "group_in_experts"),
                   ("mma_sums_in_last", None, "mma_sums_in_last"),
                   ("mma_tma", None, "mma_tma"), ("mma_stream_k", None, "mma_stream_k"),
                   ("attention_wgmma", None, "attention_wgmma"))


def _mark(value, off, on):
    """A switch's mark in a graph key: ``off`` or ``on``, and for a number its value."""
    if not value:
        return off
    return on if value is True else f"{on}={value}"


class GraphCache:
    """Captured device work, by key (module docstring): :meth:`call` replays a key's graph or
    says to run eagerly.  ``before_capture`` (no arguments) runs before each capture begins.
    ``captures``, ``replays`` and ``failures`` count what happened."""

    def __init__(self, backend, before_capture=None):
        import cupy
        self.backend = backend
        self.before_capture = before_capture
        self.stream = cupy.cuda.Stream()             # blocking: see the module docstring
        # The captured work's glue memory.  Blocks a capture freed are still written by its
        # graph, so they may go only to later captures, never back to the driver: on an
        # out-of-memory a CuPy pool frees its free blocks (free_all_blocks), so this pool's
        # allocator holds every allocation as long as the graphs live.
        self._held: list = []

        def hold(nbytes):          # CuPy's own _malloc, plus the reference kept
            memory = cupy.cuda.memory.Memory(nbytes)
            self._held.append(memory)
            return cupy.cuda.memory.MemoryPointer(memory, 0)
        self.pool = cupy.cuda.MemoryPool(hold)
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: dict = {}
        self._failed: set = set()
        self.captures = self.replays = self.failures = 0

    def kinds(self) -> collections.Counter:
        """How many graphs of each kind (a key's first entry: "forward", "tree", ...) are
        held now."""
        return collections.Counter(key[0] for key in self._graphs)

    @staticmethod
    def stored_key(key) -> tuple:
        """The key a graph of ``key`` is held under now: the lean round's glue
        (``KDTREE_LEAN_ROUND``) is other work than the full glue's, the MoE's chunk grid
        (``KDTREE_MOE_CHUNK_GRID``) other launches than the one-chunk grid's, the fused
        launches (``KDTREE_FEWER_LAUNCHES``, ``KDTREE_ROUND_EPILOGUE``,
        ``KDTREE_MERGE_IN_UV``, ``KDTREE_FUSED_SWIGLU``) other kernels than the separate
        ones, the MoE's work list and int4 tensor-core path (``KDTREE_MOE_WORK_LIST``,
        ``KDTREE_INT4_MMA``) and the shared expert in the routed experts' launches
        (``KDTREE_SHARED_IN_EXPERTS``) other kernels, and attention's fixed splits
        (``KDTREE_INVARIANT_ATTENTION``) other plans, so
        never a graph of the other one (the same bits or not, a process that flips a switch
        to time it must run what it asked for).  A switch away from its default adds its
        mark; under the defaults the key is ``key`` itself."""
        now = runtime.current()
        marks = (_mark(getattr(now, field), off, on) for field, off, on in _GRAPH_SWITCHES)
        return key + tuple(m for m in marks if m is not None)

    def holds(self, key) -> bool:
        """Whether a call of ``key`` now would replay a captured graph."""
        return self.stored_key(key) in self._graphs

    def call(self, key, fn, inputs, specs, borrow: bool = False, before_capture=None):
        """``fn(*device_inputs)`` through a graph when ``key`` has one or gets one now (its
        second call), else ``None``: the caller then runs it eagerly.  ``inputs`` (host or
        device arrays) are written into static buffers of ``specs`` ((shape, dtype) each, in
        order) before each replay; the outputs (arrays, tuples or dataclasses of them) are
        copied out, or with ``borrow`` returned as the graph's own buffers, which the key's
        next replay overwrites (each copy is a CuPy call on the host's path between replays:
        a DDTree round made ~14).  A key captured by a borrowing call copies its outputs
        into memory of its own as its last nodes (module docstring); a borrowing call on a
        key captured without them gets copies.  ``key`` must name everything else ``fn``
        depends on: ``fn`` itself is only run while capturing.  ``before_capture``: a hook of
        this key's own, run after the cache's before the capture begins (the work of another
        model recorded in it: a device round's drafter, whose attention plans must be made
        inside the capture too)."""
        import cupy
        key = self.stored_key(key)
        if cupy.cuda.get_current_stream().ptr != 0:
            # replays are ordered with the caller's work by the legacy stream's implicit
            # synchronisation: a caller on another stream runs eagerly
            return None
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._failed:
                return None
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < 2:
                return None
            entry = self._capture(key, fn, specs, own_outputs=borrow,
                                  before_capture=before_capture)
            if entry is None:
                return None
        self._graphs.move_to_end(key)
        for buf, src in zip(entry.inputs, inputs):
            _write(buf, src)
        entry.graph.launch(self.stream)
        self.replays += 1
        if borrow and entry.owned:
            return entry.outputs
        return map_arrays(lambda a: a.copy(), entry.outputs)   # legacy stream: after it

    def replay(self, key) -> None:
        """Launch ``key``'s captured graph as it stands: no input writes, no output copies
        (tools/profile_ops.py times single ops this way).  KeyError when it has none.  Its
        output arrays are the graph's own buffers, which a later capture may share: read
        outputs through :meth:`call`, never after a bare replay."""
        self._graphs[key].graph.launch(self.stream)

    def _capture(self, key, fn, specs, own_outputs: bool = False, before_capture=None):
        import cupy
        static = tuple(cupy.zeros(shape, dtype) for shape, dtype in specs)
        keep: list = []
        for hook in (self.before_capture, before_capture):
            if hook is not None:
                hook()
        graph, outputs, error = None, None, None
        with _recording_numba_allocations(keep), cupy.cuda.using_allocator(self.pool.malloc), \
                self.backend.on_stream(self.stream):
            self.stream.begin_capture()
            try:
                outputs = fn(*static)
                if own_outputs:
                    with cupy.cuda.using_allocator(_own_memory):
                        outputs = map_arrays(lambda a: a.copy(), outputs)
            except Exception as e:     # the capture must be ended whatever happened
                error = e
            try:
                graph = self.stream.end_capture()
            except Exception as e:
                error = error or e
        if error is not None:
            self.failures += 1
            self._failed.add(key)
            warnings.warn(f"CUDA graph capture of {key[0]} {key[1:3]} failed, running it "
                          f"eagerly: {error!r}", RuntimeWarning, stacklevel=4)
            return None
        entry = _Graph(graph, static, outputs, keep, owned=own_outputs)
        self._graphs[key] = entry
        self._seen.pop(key, None)
        self.captures += 1
        for old in evicted(self._graphs, key[0]):
            del self._graphs[old]
        return entry

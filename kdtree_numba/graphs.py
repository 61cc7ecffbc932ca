"""CUDA graphs of the model's forward: each shape captured once, then replayed with one launch.

Why: a forward on the GPU is ~90 numba kernel launches plus CuPy glue, and each numba launch
costs tens of microseconds of Python (argument typing, context checks, array wrapping).  The
small config's decode forward took 42 ms of host time for well under a millisecond of GPU work
(tools/profile_engine.py, docs/BENCHMARKS.md).  A replayed graph costs one launch plus the
uploads of the call's inputs.

How (:class:`ForwardGraphs`, owned by a :class:`~kdtree_numba.model.Model` on the GPU):

* **When**: a key (batch, new tokens n, whether hidden states are returned, the KV cache's
  buffers) is captured the *second* time it is seen.  The first call runs eagerly, which
  compiles and loads every kernel it needs (loading a module is not allowed while capturing),
  and one-off shapes such as a prefill never pay for a capture.
* **Inputs**: the graph reads static device buffers (tokens, positions, visible mask, the new
  slots' rows and the prefix lengths); a replay first writes the call's inputs into them.
  Attention's split plan is sized for the whole cache (``max_keys = max_len``), so one graph
  serves every prefix length.
* **Outputs** are copied out after each replay, so callers may keep them across calls (a
  drafter keeps its L rows); the copy is one small device-to-device kernel.
* **Memory**: everything the captured forward allocates lives as long as its graph: CuPy glue
  allocates from a pool private to the graphs, numba's allocations are recorded while
  capturing (the memory manager's ``memalloc`` is wrapped) and attention plans are rebuilt
  inside the capture so their scratch is recorded too.  numba's frees are deferred while
  capturing (a free can synchronise, which would break the capture).
* **Streams**: captured on a blocking stream of its own (:meth:`Backend.on_stream` routes numba
  kernels and CuPy glue there).  A blocking stream is ordered with the legacy default stream,
  on which everything else runs, in both directions, so replays need no events; and an op that
  still went to the legacy stream while capturing fails the capture instead of escaping it.
* **Failure**: a capture that fails is reported once (``RuntimeWarning``) and that key runs
  eagerly from then on; ``KDTREE_CUDA_GRAPHS=0`` turns graphs off.

Tokens are the same with or without graphs up to the split plan: a replay sums attention over
the cache's capacity split, an eager call over the current prefix's, which can change the last
bits of a float32 sum (see tests/test_engine_gpu.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import warnings

import numpy as np

from kdtree_numba.kvcache import WriteSlots

__all__ = ["ForwardGraphs", "ForwardInputs", "graphs_enabled"]

MAX_GRAPHS = 16        # captured shapes kept per model (least recently used dropped)
MAX_SEEN = 256         # keys remembered while waiting for their second call


def graphs_enabled() -> bool:
    """Whether CUDA graphs are on (``KDTREE_CUDA_GRAPHS=0`` turns them off)."""
    return os.environ.get("KDTREE_CUDA_GRAPHS", "1") != "0"


@dataclasses.dataclass
class ForwardInputs:
    """One forward's inputs on the device: tokens [bs, n] int32, positions [bs * n] int32,
    visible [bs, n, n] bool and the cache slots (kvcache.WriteSlots)."""
    tokens: object
    positions: object
    visible: object
    slots: object


@dataclasses.dataclass
class _Graph:
    graph: object
    inputs: ForwardInputs          # the static buffers the graph reads
    outputs: tuple                 # the buffers it writes (logits[, hidden])
    keep: list                     # numba allocations made while capturing


def _write(dst, src) -> None:
    """Copy a host or device array into the CuPy buffer ``dst`` (same number of elements),
    converting the dtype; stream-ordered, no host wait."""
    import cupy
    if hasattr(src, "__cuda_array_interface__"):
        dst[...] = cupy.asarray(src).reshape(dst.shape)
    else:
        dst.set(np.ascontiguousarray(np.asarray(src), dtype=dst.dtype).reshape(dst.shape))


@contextlib.contextmanager
def _recording_numba_allocations(keep: list):
    """Keep every device allocation numba makes inside the block alive (in ``keep``), and hold
    numba's frees back until the block ends."""
    from numba import cuda as numba_cuda
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


class ForwardGraphs:
    """The captured forwards of one model (module docstring).  ``captures``, ``replays`` and
    ``failures`` count what happened."""

    def __init__(self, backend):
        import cupy
        self.backend = backend
        self.stream = cupy.cuda.Stream()             # blocking: see the module docstring
        self.pool = cupy.cuda.MemoryPool()           # the captured forwards' glue memory
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self._seen: dict = {}
        self._failed: set = set()
        self.captures = self.replays = self.failures = 0

    def forward(self, model, tokens, positions, cache, visible, return_hidden: bool):
        """The forward of ``model`` (Model.forward's contract) through a graph when its key
        has one or gets one now; ``None`` when this call must run eagerly."""
        bs, n = tokens.shape
        key = (bs, n, bool(return_hidden), cache.c.data.ptr, cache.k_pe.data.ptr,
               tuple(cache.c.shape), tuple(cache.k_pe.shape))
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._failed:
                return None
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] < 2:
                return None
            cache.check_room(n)
            entry = self._capture(model, key, cache, return_hidden)
            if entry is None:
                return None
        self._graphs.move_to_end(key)
        cache.check_room(n)
        static = entry.inputs
        _write(static.tokens, tokens)
        _write(static.positions, positions)
        _write(static.visible, visible)
        _write(static.slots.rows, cache.lengths[:, None] + np.arange(n)[None, :])
        _write(static.slots.prefix, cache.lengths)
        entry.graph.launch(self.stream)
        self.replays += 1
        out = tuple(o.copy() for o in entry.outputs)       # on the legacy stream: after it
        return out if return_hidden else out[0]

    def _capture(self, model, key, cache, return_hidden):
        import cupy
        from kdtree_numba import attention
        bs, n = key[0], key[1]
        xp = cupy
        static = ForwardInputs(
            tokens=xp.zeros((bs, n), np.int32), positions=xp.zeros(bs * n, np.int32),
            visible=xp.zeros((bs, n, n), bool),
            slots=WriteSlots(batch=xp.asarray(np.arange(bs)[:, None]),
                             rows=xp.zeros((bs, n), np.int64), prefix=xp.zeros(bs, np.int32),
                             max_keys=cache.max_len))
        keep: list = []
        # attention plans hold scratch between calls; rebuilt here, theirs is recorded too
        attention._cached_plan.cache_clear()
        graph, outputs, error = None, None, None
        with _recording_numba_allocations(keep), cupy.cuda.using_allocator(self.pool.malloc), \
                self.backend.on_stream(self.stream):
            self.stream.begin_capture()
            try:
                outputs = model._compute(static, cache, return_hidden, None)
            except Exception as e:     # the capture must be ended whatever happened
                error = e
            try:
                graph = self.stream.end_capture()
            except Exception as e:
                error = error or e
        if error is not None:
            self.failures += 1
            self._failed.add(key)
            warnings.warn(f"CUDA graph capture of a forward (batch {bs}, {n} tokens) failed, "
                          f"running it eagerly: {error!r}", RuntimeWarning, stacklevel=3)
            return None
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        entry = _Graph(graph, static, outputs, keep)
        self._graphs[key] = entry
        self._seen.pop(key, None)
        self.captures += 1
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return entry

"""The two backends one model definition runs on.

A backend is an array module ``xp`` for glue (residual adds, reshapes, slices, cache writes)
plus an ``ops`` namespace holding every kernel the model and the engine call, by the names of
``reference.layers``, ``reference.attention`` and ``reference.ddtree``:

* ``reference``: ``xp`` = NumPy, ``ops`` = the NumPy references (float64 inside, float32 out).
* ``numba``: ``ops`` = the numba.cuda twins in ``kdtree_numba``.  On a GPU ``xp`` = CuPy: inputs
  are CuPy arrays (the kernels wrap them zero-copy) and every numba device array a kernel returns
  is wrapped zero-copy with ``cupy.asarray``, so results stay on the device.  Under the CUDA
  simulator ``xp`` = NumPy and results are copied back to the host (CuPy cannot run there).

``make_backend("auto")`` is ``numba`` on a machine with a real GPU, else ``reference`` (the
simulator is ~1e4x too slow to be an automatic choice; ask for ``"numba"`` explicitly).

Host synchronisation (docs/ENGINE.md, "Sync points"): on the GPU the only calls here that make the
host wait for the device are :meth:`Backend.to_host` and :meth:`Backend.read_later` (every
device-to-host read the engine makes goes through one of them, and both count it in ``reads``)
and :meth:`Backend.synchronize` (counted in ``syncs``).  Uploads (``asarray`` of host data) are
CuPy's pinned, asynchronous copies.  Phase timing uses markers (:meth:`Backend.mark`: a CUDA
event on the GPU) that are read only once the device has passed them, so timing adds no wait.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import dataclasses
import inspect
import time

import numpy as np

from kdtree_numba import compat, cpu, runtime
from kdtree_numba import attention as numba_attention
from kdtree_numba import ddtree as numba_ddtree
from kdtree_numba import layers as numba_layers
from kdtree_numba.compat import cuda as numba_cuda    # numba.cuda, after compat's numpy fix
from reference import attention as reference_attention
from reference import ddtree as reference_ddtree
from reference import layers as reference_layers
from reference.layers.common import as_float64

__all__ = ["Backend", "make_backend", "BACKEND_NAMES", "GEMM_CHOICES", "PRECISIONS",
           "map_arrays", "bf16_bits", "auto_gemm", "TENSOR_CORE_HIDDEN"]

BACKEND_NAMES = ("auto", "reference", "numba")
GEMM_CHOICES = ("cuda-cores", "tensor-cores")
# gemm "auto" (kdtree-run's and bench_engine's default): bf16 tensor cores from this hidden
# size on (Kimi-K2 / DeepSeek-V3's 7168: where a forward streams GBs of weights, and where
# kimi-slice's rows were measured on them), or for packed int4 experts at any width (their
# verify on CUDA cores re-reads each expert per chunk of rows: kimi-k2-slice's 9-node verify
# 9.0 ms against 3.8 on tensor cores, runs 159-161)
TENSOR_CORE_HIDDEN = 4096


def auto_gemm(hidden_size: int, packed_experts: bool) -> tuple[str, str]:
    """gemm "auto"'s choice on the numba backend for a target of ``hidden_size`` that stores
    int4-group experts or not: (gemm, why)."""
    if packed_experts:
        return "tensor-cores", "int4-group experts"
    if hidden_size >= TENSOR_CORE_HIDDEN:
        return "tensor-cores", f"hidden size {hidden_size}"
    return "cuda-cores", f"hidden size {hidden_size}"
PRECISIONS = ("float64", "float32")    # the reference backend's: the contract, the CPU path

# Every op the model and engine use; both backends must provide exactly these.
LAYER_OPS = ("rmsnorm", "add_rmsnorm", "rope", "linear", "embedding", "argmax", "moe_route",
             "moe_ffn", "mla_latents", "mla_q_split")
ATTENTION_OPS = ("mla_attention", "absorb_q", "apply_uv")
DDTREE_OPS = ("topk_logprobs", "build_tree", "compile_tree", "accept_greedy", "sample_targets",
              "accept_sampled", "compact_kv", "round_slots", "commit_round", "lookup_path",
              "mix_lookup", "record_tokens")
# the paged KV layout's ops (kdtree_numba/kvlayout.py): the reference's; the numba backend has
# no paged kernels yet and refuses them (docs/ENGINE.md, "The KV cache")
PAGED_OPS = ("paged_mla_attention", "compact_kv_paged")
OP_NAMES = LAYER_OPS + ATTENTION_OPS + DDTREE_OPS + PAGED_OPS


def bf16_bits(xp, x):
    """uint16 bf16 bit patterns of the finite float32 array ``x``, rounded to nearest, ties to
    even (in ``xp``: NumPy or CuPy, on the device for CuPy): how bf16 weights and a bf16 KV
    cache are stored.  On CuPy one fused kernel: a bf16 cache rounds every layer's new
    latents with it, and the expression's six array operations were six launches each."""
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if xp is not np:
        return _bf16_bits_kernel()(u)
    half = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    return ((u + half) >> np.uint32(16)).astype(np.uint16)


@functools.lru_cache(maxsize=1)
def _bf16_bits_kernel():
    import cupy
    return cupy.ElementwiseKernel("uint32 u", "uint16 bits",
                                  "bits = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16",
                                  "kdtree_bf16_bits")


@dataclasses.dataclass
class Backend:
    """``name``: "reference" or "numba"; ``xp``: array module; ``ops``: the kernels.

    ``reads`` / ``syncs`` count the device-to-host reads (:meth:`to_host`,
    :meth:`read_later`) and the full
    synchronisations (:meth:`synchronize`) made so far: tests assert the engine's sync budget
    with them."""
    name: str
    xp: object
    ops: Ops
    on_gpu: bool
    gemm: str = "cuda-cores"          # make_backend's choice for bf16 projections and experts
    precision: str = "float64"        # the reference backend's (kdtree_numba/cpu.py: float32)
    reads: int = 0
    syncs: int = 0
    _free_events: list = dataclasses.field(default_factory=list, repr=False)
    # the stream every numba op is launched on (None: each op's default, the legacy stream);
    # shared with the op wrappers, set by :meth:`on_stream`
    _launch: "LaunchSettings" = dataclasses.field(
        default_factory=lambda: LaunchSettings(), repr=False)     # noqa: F821 (below)

    @property
    def cpu_path(self) -> bool:
        """The reference backend in float32: the CPU path (kdtree_numba/cpu.py), where a
        drafter's ops, its block and a sampled tree's depth are cut to what a CPU pays for."""
        return self.name == "reference" and self.precision == "float32"

    @property
    def prefill_ops(self) -> "Ops":
        """The ops a prompt's forward runs (``ForwardBatch.prefill``): on the CPU path
        ``cpu.prefill_ops`` (its rows' bits need match no decode's), elsewhere :attr:`ops`."""
        return cpu.prefill_ops(self.ops) if self.cpu_path else self.ops

    def asarray(self, a, dtype=None):
        """A host (or device) array as an ``xp`` array, on the device for a GPU backend.

        On the GPU a bfloat16 (ml_dtypes) array travels as its uint16 bit pattern: CuPy has no
        bfloat16, and the numba kernels (linear, moe_ffn, rmsnorm, embedding) read uint16
        weights as bf16 bits (kdtree_numba/layers/workspace.py)."""
        # the kind first: a dtype's name is built anew on every access (a DDTree round's host
        # path made ~100 such checks)
        if self.on_gpu and getattr(getattr(a, "dtype", None), "kind", None) == "V" \
                and np.dtype(a.dtype).name == "bfloat16":
            return self.xp.asarray(np.ascontiguousarray(a).view(np.uint16))
        return self.xp.asarray(a) if dtype is None else self.xp.asarray(a, dtype=dtype)

    def upload_into(self, dst, host) -> None:
        """The host array ``host`` written into the device array ``dst`` in place (one
        stream-ordered copy on the GPU: no temporary device array, no copy kernel)."""
        values = np.ascontiguousarray(np.asarray(host), dtype=dst.dtype).reshape(dst.shape)
        if hasattr(dst, "set"):       # CuPy's host-to-device copy into the buffer
            dst.set(values)
        else:
            dst[...] = values

    def weight(self, a, dtype=None):
        """A model weight as this backend keeps it (``dtype``: widened to it first, as the
        model's float32-only weights are).  The reference computes in float64, so it widens a
        floating weight once here rather than in every call (the values are the same: bf16 and
        float32 widen exactly); every other backend takes it as :meth:`asarray`.

        On the GPU ``a`` may already be a device array in the form :meth:`asarray` gives a
        host weight (bf16 as uint16 bits; kdtree_numba/device_weights.py builds random weights
        so): it is kept on the device, bf16 bits widened there when ``dtype`` asks."""
        if self.on_gpu and hasattr(a, "__cuda_array_interface__"):
            a = self.xp.ascontiguousarray(a)
            if dtype is None or np.dtype(a.dtype) == np.dtype(dtype):
                return a
            if a.dtype == np.uint16 and np.dtype(dtype) == np.float32:   # bf16 bits
                return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return a.astype(dtype)
        a = np.ascontiguousarray(a, dtype=dtype)
        if self.name == "reference" and np.dtype(a.dtype).name in ("bfloat16", "float16",
                                                                   "float32", "float64"):
            # widened once here, not in every call
            return as_float64(a) if self.precision == "float64" else \
                np.ascontiguousarray(a.astype(np.float32))
        return self.asarray(a)

    def to_host(self, a) -> np.ndarray:
        """A NumPy copy of ``a``: THE device-to-host read (it waits for the device; counted)."""
        self.reads += 1
        if self.on_gpu:
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def read_later(self, a):
        """Start the device-to-host read of ``a`` and return ``wait()``, which waits for that
        copy alone and returns the NumPy array (counted in ``reads`` now).  On the GPU the copy
        goes to pinned memory on the legacy stream, behind the work that made ``a``, and an
        event marks its end: work enqueued after this call (the AR loop's next step) does not
        delay ``wait()``.  Elsewhere the read happens here."""
        self.reads += 1
        if not self.on_gpu:
            host = np.array(a)
            return lambda: host
        cp = self.xp
        a = cp.ascontiguousarray(a)
        pinned = cp.cuda.alloc_pinned_memory(max(a.nbytes, 1))
        host = np.frombuffer(pinned, a.dtype, a.size).reshape(a.shape)   # keeps pinned alive
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, a.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, 0)
        done = cp.cuda.Event(block=False, disable_timing=True)
        done.record(cp.cuda.Stream.null)   # the copy's stream, whatever stream is current

        def wait(_source=a):               # holds the copy's source until it is waited for
            done.synchronize()
            return host
        return wait

    def synchronize(self) -> None:
        """Wait until the device has drained (counted in ``syncs``)."""
        self.syncs += 1
        if self.on_gpu:
            self.xp.cuda.Device().synchronize()

    # ---- markers: timing without waiting
    def mark(self):
        """A point in the device's work stream: a recorded CUDA event on the GPU (taken from a
        small pool, see :meth:`recycle`), ``time.perf_counter()`` on the host, where every op
        has finished when it returns."""
        if not self.on_gpu:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else self.xp.cuda.Event()
        event.record()
        return event

    def passed(self, marker) -> bool:
        """Whether the device has reached ``marker`` (a query, never a wait)."""
        return True if not self.on_gpu else bool(marker.done)

    def seconds_between(self, start, end) -> float:
        """Seconds from marker ``start`` to marker ``end``; both must have :meth:`passed`."""
        if not self.on_gpu:
            return end - start
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3

    def recycle(self, marker) -> None:
        """Return a marker that is no longer needed to the pool."""
        if self.on_gpu:
            self._free_events.append(marker)

    @contextlib.contextmanager
    def on_stream(self, stream):
        """Enqueue every op of the block on ``stream`` (a CuPy stream): numba kernels through
        their ``stream=`` argument, CuPy glue as CuPy's current stream.  This is how a CUDA
        graph captures a forward (kdtree_numba/graphs.py).  GPU numba backend only."""
        if not (self.on_gpu and self.name == "numba"):
            raise RuntimeError("on_stream needs the numba backend on a GPU")
        previous = self._launch.stream
        self._launch.stream = numba_cuda.external_stream(stream.ptr)
        try:
            with stream:
                yield
        finally:
            self._launch.stream = previous

    # ---- numba's frees
    @contextlib.contextmanager
    def deferred_frees(self):
        """Run a block with numba's device frees held back, then free them.

        numba frees its kernel outputs with ``cuMemFree`` (which can wait for the device) in
        batches of ~10 as they die, so a model step could stall dozens of times.  Inside this
        block they are queued; on exit (the engine wraps one round, whose last device operation
        is its one read, so the device is idle by then; an AR step's block ends while the next
        step runs, so there a cuMemFree may wait for it) the queue is freed at once.  Peak
        memory grows by what the block allocates and drops (numba cannot reclaim it on an
        out-of-memory error meanwhile).  A no-op off the GPU, and for device
        memory under the CuPy-pool plugin (kdtree_numba/gpu/pool.py), where a free returns the
        block to the pool without a driver call: nothing is left to hold back."""
        if not (self.on_gpu and self.name == "numba"):
            yield
            return
        with numba_cuda.defer_cleanup():
            yield
        self.free_deferred()

    def free_deferred(self) -> None:
        """Free numba's queued device allocations now (numba-cuda 0.30: the memory manager's
        pending list; skipped if that internal ever moves, numba then frees as usual)."""
        if not (self.on_gpu and self.name == "numba"):
            return
        manager = getattr(numba_cuda.current_context(), "memory_manager", None)
        pending = getattr(manager, "deallocations", None)
        if pending is not None and len(pending):
            pending.clear()


class Ops:
    """The kernels the model and the engine call: one attribute per op, named as in
    ``reference.layers``, ``reference.attention`` and ``reference.ddtree`` (:data:`OP_NAMES`).
    :class:`ReferenceOps` binds the NumPy references, :class:`NumbaOps` the numba twins; each
    names every op in its ``__init__``, so a reader (or go-to-definition) finds the function an
    ``ops.linear`` call runs."""

    def replaced(self, **ops) -> "Ops":
        """A copy with some ops swapped (a profiler's or a counter's wrappers)."""
        unknown = sorted(set(ops) - set(OP_NAMES))
        if unknown:
            raise ValueError(f"no op named {', '.join(unknown)}; ops: {', '.join(OP_NAMES)}")
        other = copy.copy(self)
        for name, fn in ops.items():
            setattr(other, name, fn)
        return other


class LatentsByParts:
    """``mla_latents`` and ``mla_q_split`` (reference/layers/latents.py) made of the ops' own
    ``rmsnorm`` and ``rope`` and the copies of ``glue`` (the backend's array module), as the
    model ran them before the fused kernels: the reference backends' ops, and the numba
    backend's with ``KDTREE_FUSED_LATENTS=0`` (the same bits as the fused ones).  Methods,
    not closures, so an :meth:`Ops.replaced` copy's norms and ropes are the ones they call.
    ``into`` (a kvcache.LatentStore): c and k_pe go to its rows instead (bf16 bits for a bf16
    store) and come back as None, as the fused op does."""
    glue = np

    def mla_latents(self, x, q_norm, kv_norm, positions, spec, eps, *, q_lora, rank,
                    into=None):
        xp = self.glue
        q_a = self.rmsnorm(x[:, :q_lora], q_norm, eps) if q_lora else None
        c = self.rmsnorm(x[:, q_lora:q_lora + rank], kv_norm, eps)
        k_pe = self.rope(xp.ascontiguousarray(x[:, q_lora + rank:]).reshape(
            x.shape[0], 1, spec.head_dim), positions, spec)
        if into is None:
            return q_a, c, k_pe
        into.put(c, k_pe.reshape(x.shape[0], -1))
        return q_a, None, None

    def mla_q_split(self, q, positions, spec, *, dn):
        return self.glue.ascontiguousarray(q[:, :, :dn]), self.rope(q[:, :, dn:], positions,
                                                                    spec)


def _reference_mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, max_keys=None,
                             prefill=False, causal=False, plans=None):
    """``reference.attention.mla_attention``; ``max_keys``, ``prefill`` and ``plans`` (the numba
    twin's split-plan hints and plan cache) do not change the result, so they are ignored."""
    return reference_attention.mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau,
                                             causal=causal)


class ReferenceOps(LatentsByParts, Ops):
    """The NumPy references (float64 inside, float32 out): the contracts (``mla_latents``
    and ``mla_q_split`` their composition, :class:`LatentsByParts`; rl.mla_latents is the same
    one, without a cache to write into)."""

    def __init__(self):
        rl, ra, rd = reference_layers, reference_attention, reference_ddtree
        self.rmsnorm, self.add_rmsnorm, self.rope = rl.rmsnorm, rl.add_rmsnorm, rl.rope
        self.linear, self.embedding, self.argmax = rl.linear, rl.embedding, rl.argmax
        self.moe_route, self.moe_ffn = rl.moe_route, rl.moe_ffn
        self.mla_attention = _reference_mla_attention
        self.absorb_q, self.apply_uv = ra.absorb_q, ra.apply_uv
        self.topk_logprobs, self.build_tree = rd.topk_logprobs, rd.build_tree
        self.compile_tree, self.accept_greedy = rd.compile_tree, rd.accept_greedy
        self.sample_targets, self.accept_sampled = rd.sample_targets, rd.accept_sampled
        self.compact_kv = rd.compact_kv
        self.round_slots, self.commit_round = rd.round_slots, rd.commit_round
        self.lookup_path, self.mix_lookup = rd.lookup_path, rd.mix_lookup
        self.record_tokens = rd.record_tokens
        self.paged_mla_attention = ra.paged_mla_attention
        self.compact_kv_paged = rd.compact_kv_paged


class CpuFloat32Ops(ReferenceOps):
    """The reference's functions in float32 through BLAS, batch invariant (kdtree_numba/cpu.py:
    the CPU path), and its vectorised top-K; the reference's own for the rest (embedding,
    argmax, the other DDTree kernels: integer or float64 work that is batch invariant
    already)."""

    def __init__(self):
        super().__init__()
        self.rmsnorm, self.add_rmsnorm, self.rope = cpu.rmsnorm, cpu.add_rmsnorm, cpu.rope
        self.linear, self.moe_route, self.moe_ffn = cpu.linear, cpu.moe_route, cpu.moe_ffn
        self.absorb_q, self.apply_uv = cpu.absorb_q, cpu.apply_uv
        self.mla_attention = cpu.mla_attention
        self.topk_logprobs = cpu.topk_logprobs       # the reference's ids, fewer passes


def _no_paged_kernel(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{name}: the numba backend has no paged-KV kernels yet; the paged KV layout runs "
            f"on the reference backend (docs/ENGINE.md, \"The KV cache\")")
    refuse.__name__ = name
    return refuse


def map_arrays(fn, x, is_array=None):
    """``fn`` applied to every array in ``x``: an array, a tuple or a dataclass of them (a
    DraftTree, a VerifyInput), anything else returned as is.  Arrays are what ``is_array``
    accepts (default: device arrays, i.e. objects with ``__cuda_array_interface__``)."""
    if is_array is None:
        def is_array(v):
            return hasattr(v, "__cuda_array_interface__")
    if is_array(x):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(map_arrays(fn, v, is_array) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: map_arrays(fn, getattr(x, f.name), is_array)
                                         for f in dataclasses.fields(x)})
    return x


def _numba_to_cupy(x):
    """A zero-copy CuPy view of a numba device array that keeps it alive.

    Not ``cupy.asarray``: an array numba allocated with ``stream=s`` exports ``s`` in its
    ``__cuda_array_interface__``, and CuPy then synchronises ``s``, a host wait (and an error
    inside a CUDA-graph capture, whose ops all run on ``s``)."""
    import cupy
    shape, strides = tuple(x.shape), tuple(x.strides)
    if x.size == 0 or min(strides, default=0) < 0:
        return cupy.asarray(x)
    span = compat.byte_span(shape, strides, x.dtype.itemsize)
    mem = cupy.cuda.UnownedMemory(x.device_ctypes_pointer.value, span, x,
                                  cupy.cuda.Device().id)
    return cupy.ndarray(shape, x.dtype, cupy.cuda.MemoryPointer(mem, 0), strides)


def _device_result_converter(on_gpu: bool):
    """What a numba device array returned by a kernel becomes: CuPy view or host copy."""
    if on_gpu:
        import cupy

        def is_numba_device(x):
            return numba_cuda.is_cuda_array(x) and not isinstance(x, cupy.ndarray)
        return is_numba_device, _numba_to_cupy

    def is_sim_device(x):
        return numba_cuda.devicearray.is_cuda_ndarray(x)
    return is_sim_device, lambda x: x.copy_to_host()


def _wrapper(fn, convert, launch, on_gpu: bool):
    """``fn`` with its device results converted and ``launch.stream``, when set, passed as the
    ``stream=`` every numba op takes (Backend.on_stream).  On a GPU the op runs with numba's
    context attached (``require_context``): numba asks the driver for the current context
    once per op instead of in each of its array calls (slices, views) inside."""
    if "stream" not in inspect.signature(fn).parameters:
        raise TypeError(f"numba op {fn.__name__} takes no stream= argument")
    op = numba_cuda.require_context(fn) if on_gpu else fn

    def wrapped(*args, **kwargs):
        if launch.stream is not None:
            kwargs.setdefault("stream", launch.stream)
        return convert(op(*args, **kwargs))
    wrapped.__name__ = getattr(fn, "__name__", "op")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    wrapped.__wrapped__ = fn
    return wrapped


class NumbaOps(LatentsByParts, Ops):
    """The numba.cuda twins, each wrapped (:func:`_wrapper`): its device results converted
    (CuPy views on a GPU, host copies under the simulator) and the backend's launch stream
    passed.  ``gemm="tensor-cores"``: bf16 weights on tensor cores, everything else on kernels
    whose summation order does not depend on M, and attention's keys split in fixed chunks:
    every op is then batch invariant, which the rounding of x to bf16 needs (a last-bit
    difference upstream flips a bf16 rounding and grows to ~1e-3)."""

    def __init__(self, on_gpu: bool, launch, gemm: str, xp, fused_latents: bool = False):
        is_device, to_xp = _device_result_converter(on_gpu)

        def convert(x):
            return map_arrays(to_xp, x, is_device)

        def wrap(fn):
            return _wrapper(fn, convert, launch, on_gpu)
        nl, na, nd = numba_layers, numba_attention, numba_ddtree
        self.rmsnorm, self.add_rmsnorm = wrap(nl.rmsnorm), wrap(nl.add_rmsnorm)
        self.rope, self.linear = wrap(nl.rope), wrap(nl.linear)
        self.embedding, self.argmax = wrap(nl.embedding), wrap(nl.argmax)
        self.moe_route, self.moe_ffn = wrap(nl.moe_route), wrap(nl.moe_ffn)
        self.mla_attention = wrap(na.mla_attention)
        self.absorb_q, self.apply_uv = wrap(na.absorb_q), wrap(na.apply_uv)
        # one launch each, or (LatentsByParts) the norms, ropes and copies they replace
        self.glue = xp
        if fused_latents:                           # runtime.py: KDTREE_FUSED_LATENTS
            self.mla_latents, self.mla_q_split = wrap(nl.mla_latents), wrap(nl.mla_q_split)
        self.topk_logprobs, self.build_tree = wrap(nd.topk_logprobs), wrap(nd.build_tree)
        self.compile_tree, self.accept_greedy = wrap(nd.compile_tree), wrap(nd.accept_greedy)
        self.sample_targets = wrap(nd.sample_targets)
        self.accept_sampled = wrap(nd.accept_sampled)
        self.compact_kv = wrap(nd.compact_kv)
        self.round_slots, self.commit_round = wrap(nd.round_slots), wrap(nd.commit_round)
        self.lookup_path, self.mix_lookup = wrap(nd.lookup_path), wrap(nd.mix_lookup)
        self.record_tokens = wrap(nd.record_tokens)
        # no paged-KV kernels yet: the paged layout runs on the reference backend
        self.paged_mla_attention = _no_paged_kernel("paged_mla_attention")
        self.compact_kv_paged = _no_paged_kernel("compact_kv_paged")
        if gemm == "tensor-cores":
            self.linear = functools.partial(self.linear, method="tensor-cores")
            self.moe_route = functools.partial(self.moe_route, method="tensor-cores")
            self.moe_ffn = functools.partial(self.moe_ffn, method="tensor-cores")
            self.mla_attention = functools.partial(self.mla_attention, batch_invariant=True)
            heads = _Bf16Heads(launch, on_gpu)
            self.absorb_q = heads.passing_bf16(self.absorb_q, absorb=True)
            self.apply_uv = heads.passing_bf16(self.apply_uv, absorb=False)


@dataclasses.dataclass
class LaunchSettings:
    """What the numba ops launch on (Backend.on_stream sets it): a stream, or None (the
    default)."""
    stream: object = None


class _Bf16Heads:
    """absorb_q / apply_uv on bf16 tensor cores (the "tensor-cores" setting): each float32
    ``kv_b_proj`` the ops see is turned once into its :class:`~kdtree_numba.attention.
    Bf16HeadWeights` (on first use, which the model makes eagerly: a CUDA graph captures a
    shape on its second call) and kept with a reference to the weight, so the id that keys it
    cannot be reused while the entry lives (the backend keeps both copies: 16.8 MB of bf16
    per Kimi layer beside the float32 weight).  Widths the kernel cannot take keep the float32
    weight (the CUDA-core kernels), like linear's fallback.  A first use inside a CUDA-graph
    capture raises (the conversion would only be recorded, never run): the capture then fails
    and that key runs eagerly, which converts the weight."""

    def __init__(self, launch: "LaunchSettings", on_gpu: bool):
        self.launch = launch
        self.on_gpu = on_gpu
        self.made: dict[int, tuple] = {}

    def weights(self, kv_b_proj, heads: int, dn: int):
        hit = self.made.get(id(kv_b_proj))
        if hit is None or hit[0] is not kv_b_proj:
            if self.on_gpu:
                import cupy
                if cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr):
                    raise RuntimeError("a kv_b_proj's first use is inside a CUDA-graph "
                                       "capture: its bf16 copy would never be written; run "
                                       "one eager forward first")
            try:
                made = numba_attention.bf16_head_weights(kv_b_proj, heads, dn,
                                                         stream=self.launch.stream or 0)
            except ValueError:      # widths it cannot take: the float32 kernels (or their
                made = kv_b_proj    # own error for a kv_b_proj that fits no head layout)
            hit = self.made[id(kv_b_proj)] = (kv_b_proj, made)
        return hit[1]

    def passing_bf16(self, op, absorb: bool):
        def with_bf16(x, kv_b_proj, *args, **kwargs):
            heads = x.shape[-2]
            if absorb:
                dn = x.shape[-1]
            else:                                   # apply_uv(u, kv_b_proj, dv)
                dv = args[0] if args else kwargs["dv"]
                dn = kv_b_proj.shape[0] // heads - dv
            return op(x, self.weights(kv_b_proj, heads, dn), *args, **kwargs)
        with_bf16.__name__ = op.__name__
        with_bf16.__doc__ = op.__doc__
        with_bf16.__wrapped__ = op
        return with_bf16


def make_backend(name: str = "auto", *, gemm: str = "cuda-cores",
                 precision: str = "float64") -> Backend:
    """``"auto"`` | ``"reference"`` | ``"numba"`` (see the module docstring).

    ``precision`` (reference only): "float64" (the contract, the tests' oracle) or "float32"
    (kdtree_numba/cpu.py: the same functions in float32 through BLAS, batch invariant, so
    DDTree's greedy tokens equal AR's; the CPU path kdtree-run takes without a GPU).

    ``gemm`` (numba only): "cuda-cores" (the default: every projection and expert in float32
    on CUDA cores) or "tensor-cores" (every projection, expert and the lm_head with bf16
    weights on bf16 tensor cores, their inputs rounded to bf16: ``method="tensor-cores"`` of
    linear, moe_route and moe_ffn, absorb_q and apply_uv on kv_b_proj's bf16 blocks
    (``_Bf16Heads``); attention with ``batch_invariant=True``).  Under
    "tensor-cores" every op is batch invariant, so a verify computes each token's bits as a
    decode does as long as its keys sit at the same cache slots (a chain, or an accepted path
    that is the tree's first nodes), and DDTree's greedy tokens then equal AR's exactly; a
    path at scattered tree slots can differ in attention's last bits (docs/ENGINE.md, "Tensor
    cores").  Under "cuda-cores" the GEMMs switch kernels at 16 rows and attention plans its
    key splits by the number of tokens: a verify agrees with a decode to rounding (~1e-6), so
    DDTree's tokens equal AR's except at near-ties.  The two settings round differently, so
    their tokens can differ from each other (docs/ENGINE.md, "Tensor cores")."""
    if isinstance(name, Backend):
        return name
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if gemm not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {GEMM_CHOICES}, got {gemm!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if name == "auto":
        name = "numba" if compat.gpu_available() else "reference"
    if name == "reference":
        if gemm != "cuda-cores":
            raise ValueError("gemm='tensor-cores' needs the numba backend (the reference "
                             "computes in float64)")
        ops = ReferenceOps()
        if precision == "float32":
            ops = CpuFloat32Ops()
            cpu.blas_threads()      # spinning BLAS threads on shared cores: cpu.py
        return Backend("reference", np, ops, on_gpu=False, precision=precision)
    if precision != "float64":
        raise ValueError("precision='float32' is the reference backend's CPU path (the numba "
                         "backend computes in float32 already)")
    compat.require_kernels()
    on_gpu = compat.gpu_available()
    if on_gpu:
        import cupy as xp
    else:
        xp = np
    launch = LaunchSettings()
    ops = NumbaOps(on_gpu, launch, gemm, xp, runtime.current().fused_latents)
    return Backend("numba", xp, ops, on_gpu=on_gpu, _launch=launch, gemm=gemm)

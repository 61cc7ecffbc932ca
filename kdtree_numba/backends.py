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
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import numpy as np

from kdtree_numba import compat

__all__ = ["Backend", "make_backend", "BACKEND_NAMES"]

BACKEND_NAMES = ("auto", "reference", "numba")

# Every op the model and engine use; both backends must provide exactly these.
LAYER_OPS = ("rmsnorm", "rope", "linear", "embedding", "argmax", "moe_route", "moe_ffn")
ATTENTION_OPS = ("mla_attention", "absorb_q", "apply_uv")
DDTREE_OPS = ("topk_logprobs", "build_tree", "compile_tree", "accept_greedy", "sample_targets",
              "accept_sampled", "compact_kv")


@dataclasses.dataclass
class Backend:
    """``name``: "reference" or "numba"; ``xp``: array module; ``ops``: the kernels."""
    name: str
    xp: object
    ops: SimpleNamespace
    on_gpu: bool

    def asarray(self, a, dtype=None):
        """A host (or device) array as an ``xp`` array, on the device for a GPU backend.

        On the GPU a bfloat16 (ml_dtypes) array travels as its uint16 bit pattern: CuPy has no
        bfloat16, and the numba kernels (linear, moe_ffn, rmsnorm, embedding) read uint16
        weights as bf16 bits (kdtree_numba/layers.py)."""
        if self.on_gpu and getattr(a, "dtype", None) is not None \
                and np.dtype(a.dtype).name == "bfloat16":
            return self.xp.asarray(np.ascontiguousarray(a).view(np.uint16))
        return self.xp.asarray(a) if dtype is None else self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        if self.on_gpu:
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def synchronize(self) -> None:
        if self.on_gpu:
            self.xp.cuda.Device().synchronize()

    def clock(self) -> float:
        """Wall time after the device has drained: honest per-phase timings."""
        self.synchronize()
        return time.perf_counter()


def _reference_ops() -> SimpleNamespace:
    from reference import attention, ddtree, layers
    ops = {name: getattr(layers, name) for name in LAYER_OPS}
    ops.update({name: getattr(attention, name) for name in ATTENTION_OPS})
    ops.update({name: getattr(ddtree, name) for name in DDTREE_OPS})
    return SimpleNamespace(**ops)


def _device_result_converter(on_gpu: bool):
    """What a numba device array returned by a kernel becomes: CuPy view or host copy."""
    from numba import cuda as numba_cuda
    if on_gpu:
        import cupy

        def is_numba_device(x):
            return numba_cuda.is_cuda_array(x) and not isinstance(x, cupy.ndarray)
        return is_numba_device, cupy.asarray

    def is_sim_device(x):
        return numba_cuda.devicearray.is_cuda_ndarray(x)
    return is_sim_device, lambda x: x.copy_to_host()


def _wrapper(fn, convert):
    def wrapped(*args, **kwargs):
        return convert(fn(*args, **kwargs))
    wrapped.__name__ = getattr(fn, "__name__", "op")
    wrapped.__doc__ = getattr(fn, "__doc__", None)
    wrapped.__wrapped__ = fn
    return wrapped


def _numba_ops(on_gpu: bool) -> SimpleNamespace:
    from kdtree_numba import attention, ddtree, layers
    is_device, to_xp = _device_result_converter(on_gpu)

    def convert(x):
        if is_device(x):
            return to_xp(x)
        if isinstance(x, tuple):
            return tuple(convert(v) for v in x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: convert(getattr(x, f.name))
                                             for f in dataclasses.fields(x)})
        return x

    ops = {name: _wrapper(getattr(layers, name), convert) for name in LAYER_OPS}
    ops.update({name: _wrapper(getattr(attention, name), convert) for name in ATTENTION_OPS})
    ops.update({name: _wrapper(getattr(ddtree, name), convert) for name in DDTREE_OPS})
    return SimpleNamespace(**ops)


def make_backend(name: str = "auto") -> Backend:
    """``"auto"`` | ``"reference"`` | ``"numba"`` (see the module docstring)."""
    if isinstance(name, Backend):
        return name
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = "numba" if compat.gpu_available() else "reference"
    if name == "reference":
        return Backend("reference", np, _reference_ops(), on_gpu=False)
    compat.require_kernels()
    on_gpu = compat.gpu_available()
    if on_gpu:
        import cupy as xp
    else:
        xp = np
    return Backend("numba", xp, _numba_ops(on_gpu), on_gpu=on_gpu)

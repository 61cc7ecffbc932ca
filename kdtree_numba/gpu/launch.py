"""Kernel launches without numba's per-call host work: :class:`FastKernel`.

Why: numba's ``kernel[grid, block, stream, shared](*args)`` types every argument (a
``types.Array`` built per device array), runs the launch-configuration machinery, turns each
array into a numba device array again (a CuPy array through ``as_cuda_array``: a driver call to
check its pointer) and asks the driver for the current context several times.  An eager
kimi-slice forward makes ~120 launches, and their host time was ten times the forward's GPU time
(tools/profile_ops.py --host shows it).  A first-seen shape (every prompt's prefill) runs
eagerly, so this host time is latency users see.

How: the first launch with a new *argument signature* (per array: its class, dtype, rank and
contiguity; per scalar: its Python type) goes through numba as before, which compiles, loads
and launches the kernel.  The compiled kernel is then kept under that signature with one
packer per argument, and later launches with the same signature write the kernel's
parameters directly and call cuda.core's ``launch``, as numba itself does at the end of its
path.  The packers lay out an array argument as numba's kernels take it (meminfo, parent,
size, itemsize, data pointer, shape, strides) from the array's own attributes, for numba
device arrays and CuPy arrays alike; scalars become the ctypes value of the type numba
compiled for.  What this path cannot pack (host arrays, which numba copies to the device and
back; records; tuples; a debug or cooperative kernel) keeps numba's path for that signature.

The signature is as fine as numba's typing or finer: numba types a CuPy array through DLPack
(dtype, rank, and a C/F/A layout from CuPy's contiguity) and a numba array from its
``_numba_type_`` (dtype, rank, C/F contiguity, broadcast axes), and the signature holds those
very facts; a Python int is int64 to numba unless it needs uint64, and the signature says which.
tests/test_launch.py checks that equal signatures mean equal numba types over every stride
pattern of small numba arrays.

Streams: a launch goes on the stream it names, like numba's.  Numba's path also makes that
stream wait for CuPy's current stream when an argument is a CuPy array (through DLPack); here
every launch with CuPy arguments on a stream other than CuPy's current one takes numba's path,
so that ordering is kept.  (The ops here launch on CuPy's current stream: the legacy stream,
or the one ``Backend.on_stream`` makes current for a capture.)

Dynamic shared memory past 48 KiB: cuda.core does not raise the per-function limit, so a
launch asking for more first raises ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` of the
compiled kernel (:func:`allow_dynamic_shared`: per compiled function, only ever upwards, so
two signatures sharing one compiled kernel cannot lower each other's limit).

Only a real GPU uses this (kdtree_numba/compat.py wraps each kernel there); the CUDA simulator
keeps numba's dispatcher.  One device per process, as everywhere in this package: a compiled
kernel is loaded once, on the device current at its first launch, and launches expect a
current CUDA context (the backend's ops attach numba's; any CuPy or numba call before makes
one current).
"""
from __future__ import annotations

import ctypes
import operator

import numpy as np

__all__ = ["FastKernel", "STATIC_SHARED_BYTES", "allow_dynamic_shared"]

STATIC_SHARED_BYTES = 48 * 1024   # a block's dynamic shared memory without the opt-in

_NUMBA_PATH = object()            # a signature this path cannot pack: numba launches it


def _cupy_ndarray():
    try:
        import cupy
    except Exception:             # not installed, or broken: numba arrays only
        return None
    return cupy.ndarray


class _Runtime:
    """What the packers need from numba-cuda, cuda.core and CuPy, imported once (on the first
    launch, so importing a kernel module stays cheap)."""

    def __init__(self):
        from cuda.core import LaunchConfig, launch
        from numba.cuda import types
        from numba.cuda.cudadrv import driver
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        self.LaunchConfig, self.launch = LaunchConfig, launch
        self.types, self.driver, self.DeviceNDArray = types, driver, DeviceNDArray
        self.cupy_ndarray = _cupy_ndarray()
        self.configs: dict = {}   # (grid, block, shared) -> LaunchConfig
        self.streams: dict = {}   # stream handle -> cuda.core stream
        self.shared_ok: dict = {}  # (function handle, device) -> dynamic shared bytes allowed
        if self.cupy_ndarray is not None:
            import cupy
            self.current_stream = cupy.cuda.get_current_stream


_RT: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RT
    if _RT is None:
        _RT = _Runtime()
    return _RT


_INT64, _UINT64 = range(-2 ** 63, 2 ** 63), range(2 ** 64)


def _signature(args, rt: _Runtime):
    """The argument signature (module docstring), or None when an argument is neither a
    device array this path packs nor a scalar."""
    key = []
    for a in args:
        t = type(a)
        if t is int:                    # numba: int64, else uint64, else it refuses it
            if a in _INT64:
                key.append((int, 64))
            elif a in _UINT64:
                key.append((int, "u64"))
            else:
                return None
        elif t is rt.cupy_ndarray:
            f = a.flags
            key.append((t, a.dtype.char, a.ndim, f.c_contiguous, f.f_contiguous))
        elif isinstance(a, rt.DeviceNDArray):
            # what _numba_type_ reads (dtype, rank, C/F contiguity, broadcast axes), without
            # building the type: each op makes its arrays anew, so numba's cache misses
            f = a.flags
            key.append((rt.DeviceNDArray, a.dtype, a.ndim, f["C_CONTIGUOUS"], f["F_CONTIGUOUS"],
                        a.size != 0 and 0 in a.strides))
        elif t is float or t is bool or isinstance(a, np.generic):   # numpy scalars too
            key.append(t)
        else:
            return None
    return tuple(key)


def _pack_cupy(a, params):
    params += (0, 0, a.size, a.itemsize, a.data.ptr, *a.shape, *a.strides)


def _pack_numba(a, params):
    params += (0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value or 0,
               *a.shape, *a.strides)


def _scalar_packer(ty, rt: _Runtime):
    """A packer for a scalar of numba type ``ty``, as numba's ``_prepare_args`` packs it, or
    None for a type this path leaves to numba."""
    types = rt.types
    if isinstance(ty, types.Integer):
        convert = getattr(ctypes, f"c_{ty}")
    elif ty == types.float32:
        convert = ctypes.c_float
    elif ty == types.float64:
        convert = ctypes.c_double
    elif ty == types.boolean:
        return lambda v, params: params.append(v)
    else:
        return None
    return lambda v, params: params.append(convert(v))


def _shared_key(cufunc) -> tuple:
    return int(cufunc.handle), cufunc.device.id


def allow_dynamic_shared(cufunc, nbytes: int, key=None) -> None:
    """Let the compiled function ``cufunc`` (numba's, of a ``_Kernel``) launch with ``nbytes``
    of dynamic shared memory: its limit raised past 48 KiB when needed, never lowered.
    ``key``: its :func:`_shared_key`, when the caller keeps it (every launch asks)."""
    if nbytes <= STATIC_SHARED_BYTES:
        return
    rt = _RT or _runtime()
    key = key or _shared_key(cufunc)
    if nbytes <= rt.shared_ok.get(key, STATIC_SHARED_BYTES):
        return
    attr = rt.driver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    rt.driver.driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    rt.shared_ok[key] = nbytes


class _Compiled:
    """One compiled kernel under one argument signature: its function, packers, and whether
    an argument is a CuPy array (the stream check of the module docstring)."""
    __slots__ = ("cufunc", "function", "shared_key", "packers", "has_cupy")

    def __init__(self, cufunc, packers, has_cupy: bool):
        self.cufunc, self.function, self.shared_key = cufunc, cufunc.kernel, _shared_key(cufunc)
        self.packers, self.has_cupy = packers, has_cupy


class FastKernel:
    """A numba kernel (``dispatcher``) launched as ``k[grid, block, stream, shared](*args)``
    through the fast path of the module docstring; every other attribute is the dispatcher's.
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._compiled: dict = {}

    def __getitem__(self, config):
        if not isinstance(config, tuple) or not 2 <= len(config) <= 4:
            raise ValueError("launch as kernel[grid, block] or kernel[grid, block, stream, "
                             f"shared], got kernel[{config!r}]")
        return _Launch(self, *config)

    def __call__(self, *args, **kwargs):
        raise ValueError("a kernel needs a launch configuration: kernel[grid, block](...)")

    def __getattr__(self, name):
        if name == "dispatcher":       # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.dispatcher, name)

    def __repr__(self):
        return f"FastKernel({self.dispatcher!r})"

    def _through_numba(self, args, signature, grid, block, stream, shared, rt: _Runtime):
        """Launch through numba (compiling what it must), then keep the compiled kernel
        under ``signature`` when every argument can be packed."""
        big = shared > STATIC_SHARED_BYTES
        argtypes = tuple(self.dispatcher.typeof_pyval(a) for a in args) \
            if big or signature is not None else None
        if big:     # numba would launch before anything could raise the limit: compile first
            allow_dynamic_shared(self.dispatcher.compile(argtypes)._codelibrary.get_cufunc(),
                                 shared)
        self.dispatcher[grid, block, stream, shared](*args)
        if signature is None:
            return
        kernel = self.dispatcher.overloads.get(argtypes)
        if (kernel is None or kernel.debug or kernel.cooperative
                or getattr(kernel, "launch_config_sensitive", False)
                or self.dispatcher.targetoptions.get("extensions")):
            self._compiled[signature] = _NUMBA_PATH
            return
        packers = []
        for a, ty in zip(args, kernel.argument_types):
            if isinstance(ty, rt.types.Array):
                packers.append(_pack_cupy if type(a) is rt.cupy_ndarray else _pack_numba)
            else:
                packer = _scalar_packer(ty, rt)
                if packer is None:
                    self._compiled[signature] = _NUMBA_PATH
                    return
                packers.append(packer)
        self._compiled[signature] = _Compiled(kernel._codelibrary.get_cufunc(), tuple(packers),
                                              _pack_cupy in packers)


class _Launch:
    __slots__ = ("kernel", "grid", "block", "stream", "shared")

    def __init__(self, kernel: FastKernel, grid, block, stream=0, shared=0):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.stream, self.shared = stream, shared

    def __call__(self, *args):
        rt = _RT or _runtime()
        kernel, shared = self.kernel, self.shared
        signature = _signature(args, rt)
        compiled = kernel._compiled.get(signature) if signature is not None else None
        stream = _core_stream(self.stream, rt)
        if compiled is None or compiled is _NUMBA_PATH or (
                compiled.has_cupy and int(stream.handle) != rt.current_stream().ptr):
            kernel._through_numba(args, signature if compiled is None else None, self.grid,
                                  self.block, self.stream, shared, rt)
            return
        params: list = []
        for pack, a in zip(compiled.packers, args):
            pack(a, params)
        if shared > STATIC_SHARED_BYTES:
            allow_dynamic_shared(compiled.cufunc, shared, compiled.shared_key)
        rt.launch(stream, _launch_config(self.grid, self.block, shared, rt), compiled.function,
                  *params)


def _launch_config(grid, block, shared, rt: _Runtime):
    key = (grid, block, shared)
    config = rt.configs.get(key)
    if config is None:
        if len(rt.configs) > 4096:       # grids follow the shapes: keep the cache bounded
            rt.configs.clear()
        config = rt.configs[key] = rt.LaunchConfig(grid=_dim3(grid), block=_dim3(block),
                                                   shmem_size=int(shared))
    return config


def _dim3(d) -> tuple:
    """A grid or block as numba takes it (an int, or 1 to 3 ints) padded to three."""
    d = (d,) if not isinstance(d, tuple) else d
    if not 1 <= len(d) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, got {d!r}")
    return tuple(operator.index(v) for v in d) + (1,) * (3 - len(d))


def _core_stream(stream, rt: _Runtime):
    """numba's stream argument as the cuda.core stream numba itself would launch on
    (``driver._to_core_stream``): 0 and numba streams cached by handle (the wrappers own
    nothing, so a reused handle is the same stream), cuda.core streams as they are."""
    if not stream:
        handle = 0
    elif isinstance(stream, rt.driver.Stream):
        handle = int(stream.handle)
    else:
        return rt.driver._to_core_stream(stream)
    core = rt.streams.get(handle)
    if core is None:
        if len(rt.streams) > 1024:
            rt.streams.clear()
        core = rt.streams[handle] = rt.driver._to_core_stream(stream)
    return core

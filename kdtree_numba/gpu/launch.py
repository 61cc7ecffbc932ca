"""Kernel launches without numba's per-call host work: :class:`FastKernel`.

Why: numba's ``kernel[grid, block, stream, shared](*args)`` types every argument (a
``types.Array`` built per device array), runs the launch-configuration machinery, turns each
array into a numba device array again (a CuPy array through ``as_cuda_array``: a driver call
to check its pointer) and asks the driver for the current context several times.  An eager
kimi-slice forward makes ~120 launches and spent ~30 ms of host time on 2.7 ms of GPU work
(tools/profile_ops.py --host, docs/GPU_RESULTS.md run 69).  A first-seen shape (every prompt's
prefill) runs eagerly, so this host time is latency users see.

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

The signature is as fine as numba's typing or finer: numba types a CuPy array from its
``__cuda_array_interface__`` (dtype, rank, and a layout read from the strides) and a numba
array from its ``_numba_type_`` (dtype, rank, C/F/A contiguity), so two arrays with one
signature here always get the same numba type.  Python ints are taken as numba types them,
int64 (the kernels here never receive one past 2^63).

Dynamic shared memory past 48 KiB: cuda.core does not raise the per-function limit, so a
launch asking for more sets ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` on the compiled
kernel first (once per kernel and size).

Only a real GPU uses this (kdtree_numba/compat.py wraps each kernel there); the CUDA simulator
keeps numba's dispatcher.  One device per process, as everywhere in this package: a compiled
kernel is loaded once, on the device current at its first launch.
"""
from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["FastKernel", "STATIC_SHARED_BYTES"]

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


_RT: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RT
    if _RT is None:
        _RT = _Runtime()
    return _RT


def _signature(args, rt: _Runtime):
    """The argument signature (module docstring), or None when an argument is neither a
    device array this path packs nor a scalar."""
    key = []
    for a in args:
        t = type(a)
        if t is rt.cupy_ndarray:
            f = a.flags
            key.append((t, a.dtype.char, a.ndim, f.c_contiguous, f.f_contiguous))
        elif isinstance(a, rt.DeviceNDArray):
            # what _numba_type_ reads (dtype, rank, C/F contiguity, broadcast axes), without
            # building the type: each op makes its arrays anew, so numba's cache misses
            f = a.flags
            key.append((rt.DeviceNDArray, a.dtype, a.ndim, f["C_CONTIGUOUS"], f["F_CONTIGUOUS"],
                        a.size != 0 and 0 in a.strides))
        elif t in (int, float, bool) or isinstance(a, np.generic):   # numpy scalars too
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


class _Compiled:
    """One compiled kernel under one argument signature: its cuda.core kernel and packers."""
    __slots__ = ("function", "handle", "device", "packers", "shared_ok")

    def __init__(self, cufunc, packers):
        self.function = cufunc.kernel
        self.handle, self.device = cufunc.handle, cufunc.device.id
        self.packers = packers
        self.shared_ok = STATIC_SHARED_BYTES   # dynamic shared bytes allowed so far

    def allow_shared(self, nbytes: int, rt: _Runtime) -> None:
        attr = rt.driver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        rt.driver.driver.cuKernelSetAttribute(attr, nbytes, self.handle, self.device)
        self.shared_ok = nbytes


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
        return getattr(self.dispatcher, name)

    def __repr__(self):
        return f"FastKernel({self.dispatcher!r})"

    def _through_numba(self, args, signature, grid, block, stream, shared, rt: _Runtime):
        """Launch through numba (compiling what it must), then keep the compiled kernel
        under ``signature`` when every argument can be packed."""
        if shared > STATIC_SHARED_BYTES:
            # numba would launch before anything could raise the limit: compile first
            argtypes = tuple(self.dispatcher.typeof_pyval(a) for a in args)
            cufunc = self.dispatcher.compile(argtypes)._codelibrary.get_cufunc()
            _Compiled(cufunc, ()).allow_shared(shared, rt)
        self.dispatcher[grid, block, stream, shared](*args)
        if signature is None:
            return
        argtypes = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        kernel = self.dispatcher.overloads.get(argtypes)
        if kernel is None or kernel.debug or kernel.cooperative:
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
        compiled = _Compiled(kernel._codelibrary.get_cufunc(), tuple(packers))
        if shared > STATIC_SHARED_BYTES:
            compiled.shared_ok = shared
        self._compiled[signature] = compiled


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
        if compiled is None or compiled is _NUMBA_PATH:
            kernel._through_numba(args, signature if compiled is None else None, self.grid,
                                  self.block, self.stream, shared, rt)
            return
        params: list = []
        for pack, a in zip(compiled.packers, args):
            pack(a, params)
        if shared > compiled.shared_ok:
            compiled.allow_shared(shared, rt)
        rt.launch(_core_stream(self.stream, rt), _launch_config(self.grid, self.block, shared, rt),
                  compiled.function, *params)


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
    d = (d,) if not isinstance(d, tuple) else d
    if not 1 <= len(d) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, got {d!r}")
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def _core_stream(stream, rt: _Runtime):
    """numba's stream argument (0, or a numba stream) as the cuda.core stream numba itself
    would launch on (``driver._to_core_stream``), cached by handle."""
    handle = int(stream) if stream else 0
    core = rt.streams.get(handle)
    if core is None:
        core = rt.streams[handle] = rt.driver._to_core_stream(stream)
    return core

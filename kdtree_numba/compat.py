"""The one place that knows how numba.cuda runs here.  Every kernel module imports it first.

Six jobs (docs/ARCHITECTURE.md, "Where code runs"):

1. numba-cuda 0.30.4 calls ``np.row_stack`` while compiling, and numpy >= 2.5 removed it.
   The H200 image ships numpy 2.5, so without the alias below every first kernel compile
   dies with ``AttributeError``.  The simulator never compiles, so only a GPU run shows it.
2. Tell the three places code can run apart: a real GPU, the CUDA simulator
   (``NUMBA_ENABLE_CUDASIM=1``, what CI uses), or neither.
3. Keep compilation out of import time: ``kernel`` never takes an eager signature, so importing
   a kernel module on a machine without a GPU cannot raise ``CudaSupportError``; and it drops
   the ``jit`` options that the simulator rejects with ``TypeError``.
4. Where CuPy is installed (the GPU extra), serve numba's device allocations from CuPy's
   memory pool (kdtree_numba/gpu/pool.py: driver allocations and frees made an eager forward
   host-bound); ``KDTREE_NUMBA_POOL=0`` opts out.
5. On a GPU, launch kernels without numba's per-call typing and array wrapping
   (kdtree_numba/gpu/launch.py; ``KDTREE_FAST_LAUNCH=0`` opts out), and wrap CuPy arrays as
   numba arrays without a driver call (:func:`to_device`).
6. Keep numba's low-occupancy hint (a NumbaPerformanceWarning for each grid under 128 blocks)
   off the console: batch-1 decode grids are that small by design, and a first ``kdtree-run``
   printed a screen of them.  ``NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=1`` brings it back.
"""
from __future__ import annotations

import functools
import math

import numpy as np

if not hasattr(np, "row_stack"):  # numpy >= 2.5; numba-cuda 0.30.4 still calls it
    np.row_stack = np.vstack

from kdtree_numba import runtime  # noqa: E402

runtime.quiet_numba_hints()    # job 6, before numba reads its environment

from numba import cuda  # noqa: E402  (after the numpy fix, on purpose)

from kdtree_numba.kernel_recipes import kernel_factory, register  # noqa: E402

__all__ = ["cuda", "SIMULATOR", "gpu_available", "kernels_runnable", "require_kernels",
           "kernel", "kernel_factory", "device_function", "to_device", "device_empty",
           "is_device_array",
           "NoDeviceError"]

SIMULATOR: bool = runtime.current().simulator


def _install_cupy_pool():
    """Job 4: numba's device allocations from CuPy's pool, where CuPy imports (a broken CuPy
    keeps numba's own allocator rather than failing every allocation).  CuPy's array class
    when installed, else None."""
    if SIMULATOR or not runtime.current().numba_pool:
        return None
    try:
        import cupy
    except Exception:          # not installed, or broken
        return None
    from kdtree_numba.gpu.pool import CupyPoolMemoryManager
    cuda.set_memory_manager(CupyPoolMemoryManager)
    return cupy


# CuPy where numba allocates from its pool: to_device and device_empty then build numba arrays
# over CuPy memory directly (job 5)
_CUPY = _install_cupy_pool()

# KDTREE_CUDA_LINEINFO=1 compiles every kernel with source line info, so compute-sanitizer and
# ncu name the Python line of a fault (code generation is otherwise unchanged).
LINEINFO: bool = runtime.current().lineinfo

# jit options the simulator rejects with TypeError (lineinfo, register caps, launch bounds).
_SIM_UNSUPPORTED = ("lineinfo", "max_registers", "launch_bounds", "cache")


class NoDeviceError(RuntimeError):
    """A numba kernel was called on a machine with neither a GPU nor the CUDA simulator."""


@functools.cache
def gpu_available() -> bool:
    """True only for a real CUDA device (never under the simulator)."""
    if SIMULATOR:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver install is "no GPU", not a crash at import
        return False


def kernels_runnable() -> bool:
    """True where numba kernels can be launched: a GPU or the simulator."""
    return SIMULATOR or gpu_available()


def require_kernels() -> None:
    if not kernels_runnable():
        raise NoDeviceError(
            "numba.cuda kernels need a CUDA GPU; none was found. Use the NumPy reference "
            "(backend='reference') or set NUMBA_ENABLE_CUDASIM=1 before importing numba "
            "to run the kernels under the CUDA simulator (slow, tiny shapes only).")


def _filter_options(options: dict) -> dict:
    if SIMULATOR:
        return {k: v for k, v in options.items() if k not in _SIM_UNSUPPORTED}
    return options


def block_size_options(threads: int) -> dict:
    """``kernel`` options for a kernel launched with ``threads`` per block: launch bounds past
    256 threads, so ptxas keeps to 65536 / threads registers (a launch with more would fail).
    Not below: for 256 threads they only made ptxas spill (the attention kernels)."""
    return {"launch_bounds": (threads,)} if threads > 256 else {}


def kernel(fn=None, **options):
    """``cuda.jit`` for a kernel, always lazily compiled (no signature, nothing at import).
    Kernels (not device functions) go to the disk cache of kdtree_numba/kernel_cache.py, so a
    second process loads what the first compiled."""
    options.setdefault("fastmath", False)  # the tree builder's bit-exactness depends on it
    if LINEINFO:
        options.setdefault("lineinfo", True)
    if fn is None:
        return lambda f: _jit(f, options)
    return _jit(fn, options)


def _jit(fn, options: dict):
    options = _filter_options(options)
    if options.get("device"):
        return cuda.jit(**options)(fn)
    # no GPU, nothing will compile: no cache directory made, no source hashed at import
    if SIMULATOR or not gpu_available():
        made = cuda.jit(**options)(fn)
    else:
        made = _fast_launches(_cached_jit(fn, options))
    # filed with its recipe, so kdtree_numba/precompile.py can make it in another process
    register(made, fn)
    return made


def _cached_jit(fn, options: dict):
    """A GPU kernel's dispatcher, on the disk cache unless the caller chose ``cache``."""
    if "cache" in options:
        return cuda.jit(**options)(fn)
    from kdtree_numba.kernel_cache import cache_dir, stable_cache_for
    if cache_dir() is None:
        return cuda.jit(**options)(fn)
    try:
        dispatcher = cuda.jit(cache=True, **options)(fn)
    except RuntimeError:      # numba found no file to key this function on: compile per process
        return cuda.jit(**options)(fn)
    return stable_cache_for(dispatcher)


def _fast_launches(dispatcher):
    """Job 5: the kernel launched through kdtree_numba/gpu/launch.py (``KDTREE_FAST_LAUNCH=0``:
    numba's own launch path)."""
    if not runtime.current().fast_launch:
        return dispatcher
    from kdtree_numba.gpu.launch import FastKernel
    return FastKernel(dispatcher)


def device_function(fn=None, **options):
    """``cuda.jit(device=True)``, inlined where the compiler sees fit."""
    options["device"] = True
    return kernel(fn, **options)


def is_device_array(x) -> bool:
    """A numba device array or any object exposing ``__cuda_array_interface__`` (CuPy)."""
    return cuda.is_cuda_array(x) if not SIMULATOR else cuda.devicearray.is_cuda_ndarray(x)


def _host_c_contiguous(x) -> np.ndarray:
    """``x`` as a C-contiguous host array with canonical strides.  numpy calls an array with
    length-1 axes contiguous whatever their strides (``a[None]`` has stride 0 there) and
    ``ascontiguousarray`` keeps them; numba's device-array ``reshape`` then refuses the
    result ("operation requires copying")."""
    a = np.ascontiguousarray(x)
    if a.size and _c_strides(a.shape, a.itemsize) != a.strides:
        a = a.copy(order="C")
    return a


def to_device(x, stream=0):
    """A numba device view of ``x`` without a host round trip for device inputs.

    NumPy arrays are copied to the device; numba device arrays pass through; CuPy arrays (or any
    ``__cuda_array_interface__`` object) are wrapped zero-copy.
    """
    require_kernels()
    if SIMULATOR:
        if cuda.devicearray.is_cuda_ndarray(x):
            return x
        return cuda.to_device(_host_c_contiguous(x), stream=stream)
    if cuda.devicearray.is_cuda_ndarray(x):
        return x
    if _CUPY is not None and type(x) is _CUPY.ndarray and min(x.strides, default=0) >= 0:
        # a C-contiguous CuPy array may carry any stride on a length-1 axis (numpy's relaxed
        # rule); numba would call that array non-contiguous (and its kernels would fall back
        # to scalar loads), so it gets the canonical strides, as its array interface gives
        strides = _c_strides(x.shape, x.itemsize) if x.flags.c_contiguous else x.strides
        return _numba_array(x.shape, strides, x.dtype, x.data.ptr, owner=x)
    if cuda.is_cuda_array(x):
        # sync=False: rely on stream order; the default syncs the producing stream, which is
        # illegal inside a CUDA-graph capture and a needless host wait everywhere else.
        return cuda.as_cuda_array(x, sync=False)
    return cuda.to_device(_host_c_contiguous(x), stream=stream)


def device_empty(shape, dtype, stream=0):
    """An uninitialised C-contiguous numba device array.  Where numba allocates from CuPy's
    pool (job 4), the block is taken from CuPy directly: the same memory, without numba's
    allocation bookkeeping (job 5)."""
    require_kernels()
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if _CUPY is None:
        return cuda.device_array(shape, dtype=dtype, stream=stream)
    dtype = np.dtype(dtype)
    strides = _c_strides(shape, dtype.itemsize)
    block = _CUPY.cuda.alloc(max(1, math.prod(shape)) * dtype.itemsize)
    return _numba_array(shape, strides, dtype, block.ptr, owner=block, stream=stream)


def byte_span(shape, strides, itemsize: int) -> int:
    """Bytes from a non-empty array's first element to the end of its last (strides >= 0)."""
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


def _c_strides(shape, itemsize: int) -> tuple:
    """The C-contiguous strides of ``shape`` (numba's canonical ones)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def _numba_array(shape, strides, dtype, pointer: int, owner, stream=0):
    """A numba device array over device memory ``pointer`` that ``owner`` keeps alive, bound
    to ``stream`` (its default for copies, as ``cuda.device_array(stream=)`` binds it).
    ``cuda.as_cuda_array`` would also ask the driver which context owns the pointer: CuPy's
    memory is in the one context numba shares with it.  Strides must be non-negative."""
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    dtype = np.dtype(dtype)
    span = byte_span(shape, strides, dtype.itemsize) if all(shape) else 0
    memory = driver.MemoryPointer(_context(), driver.binding.CUdeviceptr(pointer), span,
                                  owner=owner)
    return DeviceNDArray(shape, strides, dtype, stream=stream, gpu_data=memory)


@functools.cache
def _context():
    """numba's context on this process's one device (the primary context, CuPy's too).
    Cached for the process: after ``cuda.close()`` numba makes a new one, and arrays built
    here would name the old (harmless for views over CuPy memory, which numba never frees);
    nothing here closes contexts."""
    return cuda.current_context()

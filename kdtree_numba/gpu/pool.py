"""numba's device allocations served by CuPy's memory pool: an External Memory Management
plugin (numba's NBEP 7), installed by kdtree_numba/compat.py on a GPU machine with CuPy.

Why: numba allocates every device array with ``cuMemAlloc`` and frees it with ``cuMemFree``,
which waits for the whole device.  An eager forward (a prompt's prefill, any shape that is
not a replayed CUDA graph) makes ~120 such arrays; in a profile of kimi-slice's eager
forward the allocation calls and the frees' device waits were most of its host time, over
ten times its GPU work.  CuPy's pool hands out and takes back blocks without driver calls.

The safety argument, and its limit: CuPy files a block under the stream that was CuPy's
current stream when it was allocated, not the stream numba launched on, and hands a freed
block to later work on that stream, trusting stream order to run it after the block's last
reader.  Here every kernel and all glue run on the legacy default stream, or inside a graph
capture on a blocking stream (ordered with the legacy stream both ways) whose allocations come
from the graphs' own pool (kdtree_numba/graphs.py), so the order holds.  Code that launches
numba kernels on two non-blocking streams at once must not rely on this plugin: set
``KDTREE_NUMBA_POOL=0``.

With the plugin installed, compat.device_empty (every op's outputs and scratch) takes its
blocks from CuPy directly rather than through this class, the same memory without numba's
allocation bookkeeping; what numba itself allocates (``cuda.to_device`` of host arrays, its
own ``device_array``) still comes here.

``KDTREE_NUMBA_POOL=0`` keeps numba's own allocator (and numba's allocations everywhere).  The plugin takes effect only for a
CUDA context created after the import of kdtree_numba (numba's rule for EMM plugins).
"""
from __future__ import annotations

import ctypes

from numba.cuda.cudadrv.driver import (GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo,
                                      MemoryPointer)

__all__ = ["CupyPoolMemoryManager"]


class CupyPoolMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Device memory from CuPy's current allocator (its default pool, or the pool a graph
    capture installs); host (pinned, mapped) memory stays numba's."""

    def initialize(self):
        pass

    def memalloc(self, size):
        import cupy
        block = cupy.cuda.alloc(size)
        held = [block]                  # the finalizer drops it: the block goes back to the pool
        return MemoryPointer(self.context, ctypes.c_void_p(block.ptr), size,
                             finalizer=held.clear)

    def get_memory_info(self):
        import cupy
        free, total = cupy.cuda.runtime.memGetInfo()
        return MemoryInfo(free=free, total=total)

    def reset(self):
        import cupy
        super().reset()
        cupy.get_default_memory_pool().free_all_blocks()

    @property
    def interface_version(self):
        return 1

"""kdtree_numba/gpu/pool.py: numba's device allocations from CuPy's memory pool.

Anywhere (a subprocess without the simulator): numba-cuda 0.30 accepts the plugin.  On the GPU
(marker ``gpu``): importing kdtree_numba installed it, numba device arrays are carved from
CuPy's pool and go back to it when dropped, without a driver free."""
from __future__ import annotations

import gc

import numpy as np
import pytest


PLUGIN_SCRIPT = ("from numba import cuda\n"
                 "from kdtree_numba.gpu.pool import CupyPoolMemoryManager\n"
                 "cuda.set_memory_manager(CupyPoolMemoryManager)\n"
                 "print('version', CupyPoolMemoryManager(context=None).interface_version)\n")


@pytest.mark.compile_check(PLUGIN_SCRIPT, timeout=120)
def test_plugin_speaks_numbas_emm_interface():
    """numba accepts the plugin (set_memory_manager checks its interface version); run
    without the simulator, which replaces numba's driver module."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PLUGIN_SCRIPT, timeout=120)
    assert out.split()[-2:] == ["version", "1"]


@pytest.mark.gpu
def test_gpu_numba_arrays_come_from_cupys_pool():
    import cupy

    from kdtree_numba import compat
    from kdtree_numba.gpu.pool import CupyPoolMemoryManager
    cuda = compat.cuda
    assert isinstance(cuda.current_context().memory_manager, CupyPoolMemoryManager)
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    a = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
    assert pool.used_bytes() >= before + a.nbytes
    np.testing.assert_array_equal(a.copy_to_host()[:5], np.arange(5, dtype=np.float32))
    del a
    gc.collect()
    assert pool.used_bytes() == before         # back in the pool, not freed to the driver

"""tests/sim_scheduler.py: the simulator's launcher, event-driven, keeps the simulator's rules.

Barriers order the block's shared-memory writes before its reads, threads that returned do
not hold a barrier up, ``syncthreads_count`` counts, blocks run one after another, and a
thread's exception fails the launch (and does not hang the others at their barrier).
"""
from __future__ import annotations

import numpy as np
import pytest

from kdtree_numba import compat
from kdtree_numba.compat import cuda, kernel   # the simulator swaps `cuda` in a kernel's globals


@pytest.fixture
def sim():
    if not compat.SIMULATOR:
        pytest.skip("the simulator's scheduler (NUMBA_ENABLE_CUDASIM=1)")
    import os

    import sim_scheduler
    if os.environ.get("KDTREE_SIM_POLLING") != "1":
        assert sim_scheduler.installed()


def test_barriers_order_shared_memory_and_early_returns_do_not_block(sim):
    @kernel
    def rotate_then_sum(x, out, counts):
        buf = cuda.shared.array(16, np.float32)
        t = cuda.threadIdx.x
        if t >= 12:                      # 4 threads leave before any barrier
            return
        buf[t] = x[cuda.blockIdx.x, t]
        cuda.syncthreads()
        v = buf[(t + 1) % 12]            # another thread's write: needs the barrier
        cuda.syncthreads()
        buf[t] = v
        counts[cuda.blockIdx.x, t] = cuda.syncthreads_count(v > 0)
        if t == 0:
            s = np.float32(0)
            for i in range(12):
                s += buf[i] * (i + 1)
            out[cuda.blockIdx.x] = s

    x = np.arange(3 * 16, dtype=np.float32).reshape(3, 16) - 20
    out = np.zeros(3, np.float32)
    counts = np.full((3, 16), -1, np.int32)
    rotate_then_sum[3, 16](x, out, counts)
    rotated = np.roll(x[:, :12], -1, axis=1)
    assert out.tolist() == (rotated * np.arange(1, 13)).sum(axis=1).tolist()
    assert counts[:, :12].tolist() == [[int((r > 0).sum())] * 12 for r in rotated]
    assert (counts[:, 12:] == -1).all()


def test_a_failing_thread_fails_the_launch(sim):
    @kernel
    def fail_in_one(x):
        t = cuda.threadIdx.x
        cuda.syncthreads()
        if t == 5:
            raise ValueError("thread five")
        cuda.syncthreads()               # the others wait here until aborted
        x[t] = 1

    x = np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="thread five"):
        fail_in_one[1, 8](x)
    ok = np.zeros(8, np.int32)           # the simulator still runs the next launch

    @kernel
    def ones(y):
        cuda.syncthreads()
        y[cuda.threadIdx.x] = 1

    ones[1, 8](ok)
    assert ok.tolist() == [1] * 8


def test_shared_arrays_are_one_per_call_site_and_block(sim):
    """The call-site key of cuda.shared.array (sim_scheduler's cheaper lookup): two sites are
    two arrays, one site is one array for every thread of a block (a thread reads what
    another wrote) and a fresh one for the next block; dynamic shared memory is the launch's."""
    import os

    import sim_scheduler
    from numba import float32
    from numba.cuda.simulator import kernelapi
    if os.environ.get("KDTREE_SIM_POLLING") != "1":
        assert kernelapi.FakeCUDAShared.array is sim_scheduler._shared_array

    @kernel
    def two_sites(out):
        a = cuda.shared.array(4, np.int32)
        b = cuda.shared.array(4, np.int32)
        dyn = cuda.shared.array(0, float32)
        t = cuda.threadIdx.x
        a[t] = t + 10 * cuda.blockIdx.x
        b[t] = -1
        dyn[t] = t
        cuda.syncthreads()
        out[cuda.blockIdx.x, t, 0] = a[(t + 1) % 4]     # another thread's write, not b's
        out[cuda.blockIdx.x, t, 1] = dyn[(t + 2) % 4]

    out = np.zeros((2, 4, 2), np.int32)
    two_sites[2, 4, 0, 16](out)
    assert out[..., 0].tolist() == [[(t + 1) % 4 + 10 * b for t in range(4)] for b in range(2)]
    assert out[..., 1].tolist() == [[(t + 2) % 4 for t in range(4)]] * 2

"""An event-driven scheduler for numba-cuda's CUDA simulator, installed by conftest.py.

The simulator runs every thread of a block as a Python thread and releases a
``syncthreads`` once all live threads of the block wait there.  numba-cuda 0.30's
``BlockManager.run`` finds that moment by polling: the launching thread loops over every
thread's flags and ``is_alive()`` without ever sleeping, so it holds the GIL about as often
as the simulated threads themselves, and profiles of the kernel tests showed it taking over
half of their time.  This module replaces that loop with a condition variable: a thread that
reaches ``syncthreads`` or ends counts itself under a lock, and the launcher sleeps until the
count says all live threads wait (or one failed).

The semantics are the simulator's own: the same ``BlockThread`` objects (the package's warp
and tensor-core emulations reach ``thread._manager``, ``thread_id``, ``syncthreads()``), one
block at a time, a barrier released once every live thread waits at it, a failing thread
aborting the others and its exception raised by the launch.  tests/test_sim_scheduler.py
checks those; nothing is patched where the simulator's internals are not the ones expected.

It also gives ``cuda.shared.array`` a cheaper way to its call site.  The simulator keys a
block's static shared arrays by the (file, line) that asks for one, and finds it with
``traceback.extract_stack``, which walks the whole stack and reads every frame's source line
(a ``stat`` of each file per frame), on every thread and every call: a large share of a
simulated kernel's time in the launch-heavy tests.  The caller's frame gives the same key
(``FrameSummary``'s filename and line are the frame's ``co_filename`` and ``f_lineno``), so
the same array comes back for the same site; dynamic shared memory (shape 0) and an
``alignment`` go to the simulator's own method as before.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

_ORIGINAL = {}


def install() -> bool:
    """Patch the simulator (idempotent); False where its internals are not the expected ones
    (another numba-cuda version): then it is left alone and polls as before."""
    try:
        from numba.cuda.simulator import kernel as sim
    except ImportError:
        return False
    if _ORIGINAL:
        return True
    manager, thread = sim.BlockManager, sim.BlockThread
    if not all(callable(getattr(cls, name, None)) for cls, name in
               ((manager, "run"), (thread, "run"), (thread, "syncthreads"))):
        return False
    _ORIGINAL.update(manager_run=manager.run, thread_run=thread.run,
                     syncthreads=thread.syncthreads)
    manager.run, thread.run, thread.syncthreads = _manager_run, _thread_run, _syncthreads
    from numba.cuda.simulator import kernelapi
    shared = getattr(kernelapi, "FakeCUDAShared", None)
    if shared is not None and callable(getattr(shared, "array", None)):
        _ORIGINAL["shared_array"] = shared.array
        shared.array = _shared_array
    return True


def _shared_array(self, shape, dtype, alignment=None):
    """FakeCUDAShared.array keyed by the caller's frame (module docstring); the simulator's
    own method for dynamic shared memory, an alignment (it raises) or an unexpected state."""
    allocations = getattr(self, "_allocations", None)
    if shape == 0 or alignment is not None or not isinstance(allocations, dict):
        return _ORIGINAL["shared_array"](self, shape, dtype, alignment)
    from numba.core import types
    from numba.np import numpy_support
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    res = allocations.get(caller)
    if res is None:
        res = allocations[caller] = np.empty(shape, dtype)
    return res


def installed() -> bool:
    return bool(_ORIGINAL)


def _thread_run(self):
    try:
        _ORIGINAL["thread_run"](self)   # stores an exception in self.exception
    finally:
        m = self._manager
        with m._cond:
            m._live -= 1
            if self.exception is not None:
                m._failed = True
            if m._failed or m._blocked == m._live:
                m._cond.notify()


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    m = self._manager
    with m._cond:
        self.syncthreads_blocked = True
        m._blocked += 1
        if m._blocked == m._live:
            m._cond.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _manager_run(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    def target():
        self._f(*args)

    self._cond = threading.Condition()
    self._blocked, self._failed = 0, False
    threads = [BlockThread(target, self, grid_point, block_point, self._debug)
               for block_point in np.ndindex(*self._block_dim)]
    self._live = len(threads)
    for t in threads:
        t.start()
    with self._cond:
        while True:
            while not (self._failed or self._blocked == self._live):
                self._cond.wait()
            if self._failed or self._live == 0:
                break
            for t in threads:               # every live thread waits: release the barrier
                if t.syncthreads_blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            self._blocked = 0
        if self._failed:
            # as the simulator does: abort the others (they raise at their barrier), do not
            # join them, raise the failure
            for t in threads:
                t.abort = True
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
    for t in threads:
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])

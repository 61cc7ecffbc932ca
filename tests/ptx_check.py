"""Run a compile-for-Hopper script in a fresh interpreter without the CUDA simulator.

The sm_90 checks (PTX from numba's NVVM, then ptxas through nvJitLink) need the real CUDA
target, which the simulator replaces for the whole process, hence the subprocess.  A script
exits with 77 when NVVM or nvJitLink is missing on the machine: the test is skipped then.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The head of a script that compiles for sm_90 and assembles with ptxas (nvJitLink): exit 77
# without NVVM or nvJitLink, the compute capability pinned to 9.0 (device functions look it
# up while compiling; no GPU is needed), and ``ptxas(ptx, max_registers=0, arch="sm_90")`` ->
# its log (arch "sm_90a" for wgmma, the target numba-cuda gives H200 launches).
HOPPER_PRELUDE = r"""
import re, sys, types
try:
    from numba import cuda, types as T
    import numba.cuda.dispatcher as dispatcher
    from cuda.bindings import nvjitlink as nj
    cuda.compile_ptx(lambda x: None, (T.float32[::1],), cc=(9, 0))
except Exception as error:
    print("nvvm/nvjitlink unavailable:", error)
    sys.exit(77)
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))

def ptxas(ptx, max_registers=0, arch="sm_90"):
    opts = [f"-arch={arch}", "-O3", "-verbose"] + (
        [f"-maxrregcount={max_registers}"] if max_registers else [])
    h = nj.create(len(opts), opts)
    nj.add_data(h, nj.InputType.PTX, ptx.encode(), len(ptx), "k.ptx")
    nj.complete(h)
    log = bytearray(nj.get_info_log_size(h)); nj.get_info_log(h, log); nj.destroy(h)
    return log.decode()
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


_running: set = set()     # background processes, killed by stop_background


def _run(script: str, timeout: float) -> subprocess.CompletedProcess:
    args = [sys.executable, "-c", script]
    with subprocess.Popen(args, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        _running.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            _running.discard(proc)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


# --- compiles in the background -----------------------------------------------------------
# A compile check spends its time in NVVM, in its own process, while the rest of the suite
# runs the simulator in one Python process, one core's worth (the GIL).  conftest.py starts
# the checks of the collected tests marked ``compile_check`` on one background thread at the
# start of the session (one subprocess at a time: the second core CI has) and runs those tests
# last, where they only collect their results.  Started checks keep their own timeout.
_executor = None
_futures: dict = {}


def start_in_background(checks) -> None:
    """checks: (script, timeout) pairs, run one after another in that order."""
    global _executor
    from concurrent.futures import ThreadPoolExecutor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-check")
    for script, timeout in checks:
        if script not in _futures:
            _futures[script] = _executor.submit(_run, script, timeout)


def stop_background() -> None:
    """Drop the checks not started yet and kill the running one (a session that ends before
    their tests, as with -x, need not wait for NVVM)."""
    global _executor
    if _executor is not None:
        _executor.shutdown(wait=False, cancel_futures=True)
        _executor = None
        for proc in list(_running):
            proc.kill()


def completed(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The finished process of ``script`` (its background run if one was started, waited for;
    otherwise run now): a TimeoutExpired raises here either way."""
    future = _futures.pop(script, None)
    if future is not None and not future.cancelled():
        return future.result()
    return _run(script, timeout)


def run_without_simulator(script: str, timeout: float = 600) -> str:
    """Run ``script`` with ``python -c`` from the repository root; return its stdout."""
    done = completed(script, timeout)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout

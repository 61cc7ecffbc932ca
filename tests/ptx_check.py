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


def run_without_simulator(script: str, timeout: float = 600) -> str:
    """Run ``script`` with ``python -c`` from the repository root; return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout

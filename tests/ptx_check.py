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

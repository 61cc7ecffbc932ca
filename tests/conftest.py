"""Shared test setup: Hypothesis profiles, the ``gpu`` marker, the simulator switch.

CI runs the suite with ``NUMBA_ENABLE_CUDASIM=1`` so numba kernels execute in the CUDA simulator
(semantics only, tiny shapes).  Tests marked ``gpu`` need a real device and are skipped otherwise;
they run on the lent H200 with ``HYPOTHESIS_PROFILE=gpu python -m pytest -m gpu``.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from kdtree_numba import compat

# ci: bounded and derandomized, so a red CI is reproducible and CI time is predictable.
settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The simulator's launcher polls its threads without sleeping (over half of a kernel test's
# time): tests/sim_scheduler.py makes it wait on a condition instead, same semantics.
# KDTREE_SIM_POLLING=1 keeps numba-cuda's own loop (to compare, or to rule the patch out).
if compat.SIMULATOR and os.environ.get("KDTREE_SIM_POLLING") != "1":
    import sim_scheduler
    sim_scheduler.install()


def pytest_collection_modifyitems(config, items):
    # Tests marked ``compile_check(script, timeout=...)`` run last: their scripts compile in
    # the background meanwhile (tests/ptx_check.py), started once collection is final.
    checks = [item for item in items if item.get_closest_marker("compile_check")]
    if checks:
        items[:] = [item for item in items if not item.get_closest_marker("compile_check")] \
            + checks
    if compat.gpu_available():
        return
    why = ("no CUDA GPU here (simulator)" if compat.SIMULATOR else "no CUDA GPU here")
    skip_gpu = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    import ptx_check
    checks = []
    for item in session.items:
        mark = item.get_closest_marker("compile_check")
        if mark is not None and not item.get_closest_marker("skip"):
            checks.append((mark.args[0], mark.kwargs.get("timeout", 600)))
    if checks and not session.config.option.collectonly:
        ptx_check.start_in_background(checks)


def pytest_sessionfinish(session):
    import ptx_check
    ptx_check.stop_background()


@pytest.fixture
def needs_kernels():
    """Skip a numba-kernel test where neither a GPU nor the simulator can run it."""
    if not compat.kernels_runnable():
        pytest.skip("numba kernels need a GPU or NUMBA_ENABLE_CUDASIM=1")

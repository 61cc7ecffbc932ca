"""kdtree_numba/runtime.py: the package's switches read from the environment in one place,
the import-time ones fixed, the per-call ones following the environment until an entry point
configures them."""
from __future__ import annotations

import pytest

from kdtree_numba import graphs, runtime
from kdtree_numba.layers import moe_mma


def test_from_environment_reads_every_switch():
    env = {"NUMBA_ENABLE_CUDASIM": "1", "KDTREE_SIM_WARP": "8", "KDTREE_NUMBA_POOL": "0",
           "KDTREE_FAST_LAUNCH": "off", "KDTREE_CUDA_LINEINFO": "1", "KDTREE_CUDA_GRAPHS": "0",
           "KDTREE_MOE_WORK_LIST": "1", "KDTREE_DEVICE_ROUNDS": "1", "KDTREE_KERNEL_CACHE": "no",
           "KDTREE_KERNEL_CACHE_DIR": "/tmp/kc", "KDTREE_PAD_PREFILLS": "0",
           "KDTREE_LEAN_ROUND": "0", "KDTREE_FUSED_LATENTS": "off", "KDTREE_MOE_CHUNK_GRID": "0",
           "KDTREE_AUTO_V2": "0", "KDTREE_INT4_MMA": "0", "KDTREE_FEWER_LAUNCHES": "1",
           "KDTREE_ROUND_EPILOGUE": "0", "KDTREE_AR_DEVICE_STEPS": "7",
           "KDTREE_ROUNDS_PER_LAUNCH": "5"}
    assert runtime.RuntimeConfig.from_environment(env) == runtime.RuntimeConfig(
        simulator=True, sim_warp=8, numba_pool=False, fast_launch=False, lineinfo=True,
        cuda_graphs=False, moe_work_list=True, device_rounds=True, kernel_cache=False,
        kernel_cache_dir="/tmp/kc", pad_prefills=False, lean_round=False, fused_latents=False,
        moe_chunk_grid=False, auto_v2=False, int4_mma=False, fewer_launches=True,
        round_epilogue=False, ar_device_steps=7, rounds_per_launch=5)
    default = runtime.RuntimeConfig.from_environment({"XDG_CACHE_HOME": "/x"})
    assert default.cuda_graphs and not default.moe_work_list and default.kernel_cache
    assert default.int4_mma             # under "tensor-cores" (runs 152, 157, 161)
    assert default.pad_prefills and default.lean_round and default.fused_latents
    assert default.moe_chunk_grid
    assert default.auto_v2 and not default.fewer_launches
    assert default.round_epilogue       # run 167: 1.023x a DDTree round, the same tokens
    assert default.rounds_per_launch == 1
    for value, want in (("0", 1), ("off", 1), ("on", runtime.ROUNDS_ON), ("16", 16)):
        assert runtime.RuntimeConfig.from_environment(
            {"KDTREE_ROUNDS_PER_LAUNCH": value}).rounds_per_launch == want, value
    assert default.kernel_cache_dir == "/x/kdtree-numba" and default.sim_warp == 4
    assert default.early_round and default.wait_near_end == runtime.WAIT_ON == 2.0


def test_waiting_near_the_end_takes_a_margin_or_a_word():
    """KDTREE_WAIT_NEAR_END: on words and unset WAIT_ON (run 180: a margin of 2), off words
    0.0, a number 0..WAIT_MOST its margin; anything else a ValueError naming the variable."""
    for value, want in (("", 2.0), ("on", 2.0), ("1", 1.0), ("0", 0.0), ("off", 0.0),
                        ("1.5", 1.5), ("8", 8.0)):
        assert runtime.RuntimeConfig.from_environment(
            {"KDTREE_WAIT_NEAR_END": value}).wait_near_end == want, value
    for value in ("-1", "9", "soon"):
        with pytest.raises(ValueError, match="KDTREE_WAIT_NEAR_END"):
            runtime.RuntimeConfig.from_environment({"KDTREE_WAIT_NEAR_END": value})


def test_stream_k_takes_waves_or_a_word(monkeypatch):
    """KDTREE_MMA_STREAM_K: unset and off words 0, on 1, 1 or 2 waves; anything else a
    ValueError naming the variable; graph keys tell 1 from 2."""
    for value, want in (("", 0), ("0", 0), ("off", 0), ("on", 1), ("1", 1), ("2", 2)):
        assert runtime.RuntimeConfig.from_environment(
            {"KDTREE_MMA_STREAM_K": value}).mma_stream_k == want, value
    for value in ("3", "-1", "all"):
        with pytest.raises(ValueError, match="KDTREE_MMA_STREAM_K"):
            runtime.RuntimeConfig.from_environment({"KDTREE_MMA_STREAM_K": value})
    keys = set()
    for value in ("0", "1", "2"):
        monkeypatch.setenv("KDTREE_MMA_STREAM_K", value)
        keys.add(graphs.GraphCache.stored_key(("forward", 3)))
    assert len(keys) == 3 and ("forward", 3) in keys


def test_ar_device_steps_default_on_a_gpu_and_off_under_the_simulator():
    """KDTREE_AR_DEVICE_STEPS unset (or empty): 4 steps a launch where no simulator runs (a
    real GPU; run 167: 1.487x on a host-bound AR), the host loop under the simulator; any
    value given decides on both, 0 (or an off word) is off."""
    gpu, sim = {}, {"NUMBA_ENABLE_CUDASIM": "1"}
    for env, unset in ((gpu, runtime.AR_STEPS_ON), (sim, 0)):
        assert runtime.RuntimeConfig.from_environment(env).ar_device_steps == unset
        for value, want in (("", unset), (" ", unset), ("0", 0), ("off", 0), ("on", 4),
                            ("1", 1), ("64", 64)):
            got = runtime.RuntimeConfig.from_environment(
                dict(env, KDTREE_AR_DEVICE_STEPS=value)).ar_device_steps
            assert got == want, (env, value)
    assert runtime.RuntimeConfig().ar_device_steps == runtime.AR_STEPS_ON == 4


@pytest.mark.parametrize("warp", ["three", "0", "6", "64"])
def test_a_bad_simulator_warp_is_a_clear_error_under_the_simulator_alone(warp):
    with pytest.raises(ValueError, match="KDTREE_SIM_WARP"):
        runtime.RuntimeConfig.from_environment({"KDTREE_SIM_WARP": warp,
                                                "NUMBA_ENABLE_CUDASIM": "1"})
    # elsewhere nothing reads it: a GPU machine's import does not fail on it
    assert runtime.RuntimeConfig.from_environment({"KDTREE_SIM_WARP": warp}).sim_warp == 4


def test_per_call_switches_follow_the_environment_until_configured(monkeypatch):
    monkeypatch.setenv("KDTREE_CUDA_GRAPHS", "0")
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")
    monkeypatch.setenv("KDTREE_MOE_CHUNK_GRID", "0")
    assert not graphs.graphs_enabled() and moe_mma.work_list_enabled()
    assert not runtime.current().moe_chunk_grid
    try:
        runtime.configure(cuda_graphs=True, moe_work_list=False, moe_chunk_grid=True)
        assert graphs.graphs_enabled() and not moe_mma.work_list_enabled()   # the entry point
        assert runtime.current().moe_chunk_grid
    finally:
        runtime.reset()
    assert not graphs.graphs_enabled() and not runtime.current().moe_chunk_grid


def test_import_time_switches_cannot_change(monkeypatch):
    fixed = runtime.current().simulator
    monkeypatch.delenv("KDTREE_AR_DEVICE_STEPS", raising=False)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0" if fixed else "1")
    assert runtime.current().simulator == fixed          # read once, at import
    # and what an unset switch derives from it: AR's steps a launch as the import's simulator
    assert runtime.current().ar_device_steps == (0 if fixed else runtime.AR_STEPS_ON)
    with pytest.raises(ValueError, match="fixed when kdtree_numba is imported"):
        runtime.configure(simulator=not fixed)
    with pytest.raises(ValueError, match="unknown runtime switch"):
        runtime.configure(graphs=False)
    runtime.reset()


def test_graph_keys_name_the_switches_that_change_a_graphs_launches(monkeypatch):
    """A graph captured under one setting of the lean round or the MoE chunk grid is never
    replayed under the other (graphs.GraphCache.stored_key)."""
    key = ("forward", 17)
    keys = set()
    for lean in ("1", "0"):
        for chunk in ("0", "1"):
            monkeypatch.setenv("KDTREE_LEAN_ROUND", lean)
            monkeypatch.setenv("KDTREE_MOE_CHUNK_GRID", chunk)
            stored = graphs.GraphCache.stored_key(key)
            assert stored[:2] == key
            keys.add(stored)
    assert len(keys) == 4
    monkeypatch.delenv("KDTREE_LEAN_ROUND")
    monkeypatch.delenv("KDTREE_MOE_CHUNK_GRID")
    assert graphs.GraphCache.stored_key(key) == key       # the defaults: the key itself


def test_a_held_call_reads_the_switches_once(monkeypatch):
    """runtime.holding (engine.generate): the switches in force at the call hold for the
    whole call, a nested held call keeps them, the next call reads the environment again,
    and configure() wins over a held call."""
    runtime.reset()
    seen = []

    @runtime.holding
    def call(flip_to=None, nested=False):
        seen.append(runtime.current().cuda_graphs)
        if flip_to is not None:
            monkeypatch.setenv("KDTREE_CUDA_GRAPHS", flip_to)
            seen.append(runtime.current().cuda_graphs)
        if nested:
            call()

    monkeypatch.setenv("KDTREE_CUDA_GRAPHS", "1")
    call(flip_to="0", nested=True)
    assert seen == [True, True, True]            # the flip waits for the next call
    assert not runtime.current().cuda_graphs      # outside a call: the environment now
    seen.clear()
    call()
    assert seen == [False]
    try:
        runtime.configure(cuda_graphs=True)
        seen.clear()
        call()
        assert seen == [True]
    finally:
        runtime.reset()

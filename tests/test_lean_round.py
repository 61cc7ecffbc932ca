"""The lean round (runtime.lean_round, on by default; ``KDTREE_LEAN_ROUND=0`` turns it off): a
DDTree round's glue cut to fewer launches with the same bits.  In the CUDA simulator, on a tiny
pair with the demo pair's structure, the launches of one device round and of one AR step are
counted by site (tests/launch_counter.py) with the switch off and on: the same tokens, the same
cache contents and logits bit for bit, and exactly the launches the switch removes fewer; and
so with ``KDTREE_FEWER_LAUNCHES=1`` on top (its attention merges).  The
GPU twins run the demo pair with CUDA graphs (docs/ENGINE.md, "Device rounds")."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import launch_counter
from kdtree_numba import compat

sim_only = pytest.mark.skipif(not compat.SIMULATOR, reason="the launch counter wraps the "
                              "CUDA simulator")

# the sites of one device round whose launches the switch removes (+) or adds (-), for
# ``forwards`` forwards (the verify, the block forward, the context injection), and for
# ``dense`` dense FFN calls at a skinny kernel's rows (two linears around SwiGLU, moe_ffn)


def expected_cut(forwards: int, drafter: bool, dense: int) -> collections.Counter:
    cut = collections.Counter({
        "kvlayout.DenseLayout.storage_rows: multiply": forwards,
        "kvlayout.DenseLayout.storage_rows: add": forwards,
        # a dense FFN: the one expert's routing fill, grouping, gate_up, down and combine
        # against two skinny linears, SwiGLU in the first's launch (KDTREE_FUSED_SWIGLU)
        "layers.moe._dense_routing: kernel moe._fill_dense_routing": dense,
        "layers.moe._group_tokens: kernel moe.group_by_expert": dense,
        "layers.moe._experts_skinny: kernel moe.expert_rows": 2 * dense,
        "layers.moe._combine: kernel moe.combine": dense,
        "layers.linear._linear_skinny: kernel skinny.skinny_linear": -2 * dense,
    })
    if drafter:
        cut.update({"device_round.DeviceRounds._round: copy": 1,
                    "kvlayout.DenseLayout.compact: astype": 1,
                    "steps.gather_phase.<locals>.run: arange": 1,
                    "steps.gather_phase.<locals>.run: astype": 1,
                    "dflash.DFlashDrafter.draft: concatenate": 2,
                    "dflash.DFlashDrafter.draft: setitem": -1,
                    # the context's positions: one int32 add for the rows' add and astype
                    "dflash.context_phase.<locals>.run: astype": 1,
                    "kvcache.KVCache.positions: add": -1})
    return cut


def _difference(before, after) -> collections.Counter:
    keys = set(before) | set(after)
    return collections.Counter({k: before.get(k, 0) - after.get(k, 0) for k in keys
                                if before.get(k, 0) != after.get(k, 0)})


def _run(monkeypatch, lean: bool, fewer: bool = False):
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "1" if lean else "0")
    monkeypatch.setenv("KDTREE_FEWER_LAUNCHES", "1" if fewer else "0")
    monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", "0")     # its own cut: test_round_epilogue.py
    return launch_counter.rounds_and_bits()


@sim_only
@pytest.mark.slow   # ~30 s; its GPU twin (test_gpu_lean_rounds_give_the_default_rounds_tokens)
#                     and the counts of test_round_epilogue.py run the lean round
def test_the_lean_round_gives_the_same_bits_with_fewer_launches(monkeypatch, needs_kernels):
    with launch_counter.installed():
        off = _run(monkeypatch, False)
        on = _run(monkeypatch, True)
    launch_counter.same_results(off, on)
    # a round: three forwards' slots, three dense FFNs (the target's, the drafter's two),
    # and the round's own glue; an AR step: one forward's slots, one dense FFN (5 launches
    # -> 2: two linears, SwiGLU in the first's launch)
    assert _difference(off[0], on[0]) == expected_cut(3, True, 3)
    assert _difference(off[1], on[1]) == expected_cut(1, False, 1)
    assert sum(off[0].values()) - sum(on[0].values()) == 11 + 3 * 3


@sim_only
@pytest.mark.slow   # ~25 s: the switch is opt-in (run 156 measured it slower); its kernels'
#                     bits are tests/test_fewer_launches.py's, in CI
def test_fewer_launches_on_the_lean_round_give_the_same_bits(monkeypatch, needs_kernels):
    with launch_counter.installed():
        on = _run(monkeypatch, True)
        fewer = _run(monkeypatch, True, fewer=True)
    launch_counter.same_results(on, fewer)
    # KDTREE_FEWER_LAUNCHES (tests/test_fewer_launches.py): the round's two attention plans
    # with more than one key split, each called by both layers, merge their splits in the
    # block kernel; each plan's arrival counters are zeroed by one launch on its first call
    # (inside a CUDA graph's capture: once per replay).  The verify's captured layers (0 and
    # 1) write their residual sums into the features, no concatenation.  The AR step's plan
    # has one split, and it captures no layers.
    assert _difference(on[0], fewer[0]) == collections.Counter({
        "attention.mla.MlaAttentionPlan.launch_merge: kernel mla.merge_splits": 4,
        "attention.mla.MlaAttentionPlan.__call__: kernel mla._zero_counters": -2,
        "model.Model._compute: concatenate": 2})
    assert _difference(on[1], fewer[1]) == collections.Counter()


@sim_only
@pytest.mark.parametrize("m", [1, 5, pytest.param(130, marks=pytest.mark.slow)])   # 14 s
def test_the_dense_ffn_without_its_routing_gives_the_same_bits(monkeypatch, m, needs_kernels):
    """moe_ffn's dense path (no routing given): tiled (past SMALL_WEIGHT_MAX_M rows for a
    small weight, lowered here to 128 so that 130 rows take it) with the constant grouping
    made once, the one-expert MoE's bits in two launches where it took five; skinny, the two
    linears, SwiGLU in the first's launch (two launches, where it took five)."""
    from kdtree_numba.layers import common, moe_ffn
    monkeypatch.setattr(common, "SMALL_WEIGHT_MAX_M", 128)
    rng = np.random.default_rng(m)
    h = rng.standard_normal((m, 16)).astype(np.float32)
    gate_up = rng.standard_normal((1, 24, 16)).astype(np.float32)
    down = rng.standard_normal((1, 16, 12)).astype(np.float32)
    out = {}
    with launch_counter.installed() as counter:
        for lean in (False, True):
            monkeypatch.setenv("KDTREE_LEAN_ROUND", "1" if lean else "0")
            with counter.window() as got:
                out[lean] = np.array(moe_ffn(h, None, None, gate_up, down).copy_to_host())
            want = 2 if lean else 5
            assert sum(got.values()) == want, got
    np.testing.assert_array_equal(out[True].view(np.uint32), out[False].view(np.uint32))


def test_a_graph_of_the_full_glue_is_never_replayed_by_the_lean_round(monkeypatch):
    """The two glues are other work: a key held under one is not held under the other, so
    flipping the switch in a process captures anew (GraphCache.stored_key)."""
    switch_keys_apart(monkeypatch, "KDTREE_LEAN_ROUND")


def switch_keys_apart(monkeypatch, variable):
    """A graph key held with ``variable`` on is not held with it off, and the other way."""
    from kdtree_numba.graphs import GraphCache
    graphs = object.__new__(GraphCache)         # no device: only the keyed dictionary
    key = ("round", 16, 4)
    for value, other in (("1", "0"), ("0", "1")):
        monkeypatch.setenv(variable, value)
        graphs._graphs = {GraphCache.stored_key(key): None}
        assert graphs.holds(key)
        monkeypatch.setenv(variable, other)
        assert not graphs.holds(key)


# ----------------------------------------------------------------------------- the GPU

def demo_pair():
    """(the demo target on the numba backend, its DFlash drafter)."""
    from kdtree_numba import demo
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    model = Model.load(demo.TARGET, "numba")
    return model, DFlashDrafter.load(demo.DRAFTER, model)


def demo_runs(monkeypatch, model, drafter, variable, values, budget, temperature):
    """[(result, committed)] of generate() on 4 held-out prompts, 64 tokens, DDTree device
    rounds at ``budget`` (CUDA graphs on the GPU), once with ``variable`` set to each of
    ``values`` (None: unset, the default); committed: every request's committed slots (past
    them: scratch) of the target's and the drafter's caches."""
    from kdtree_numba.engine import generate
    from test_demo_pair import heldout_ids
    kw = dict(method="ddtree", drafter=drafter, budget=budget, temperature=temperature,
              seed=5, device_rounds=True)
    runs = []
    for value in values:
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
        res = generate(model, heldout_ids(4), 64, **kw)
        committed = [a[:, b, :int(n)].get() for cache in (model.generation_cache,
                                                         drafter.cache)
                     for a in (cache.c, cache.k_pe) for b, n in enumerate(cache.lengths)]
        runs.append((res, committed))
    return runs


def assert_same_rounds(runs):
    """runs (demo_runs of a switch off, on, on): the same tokens and acceptances, the caches'
    committed bits the same, the last run replaying graphs.  (How many graphs a run captures
    depends on which keys the run before it called once, so no count is asserted: the keying
    is test_a_graph_of_the_full_glue_is_never_replayed_by_the_lean_round's.)"""
    (off, off_caches), (on, on_caches), (again, _) = runs
    assert on.tokens == off.tokens == again.tokens and on.stats.tau == off.stats.tau
    for a, b in zip(on_caches, off_caches):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    assert again.stats.graph_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_lean_rounds_give_the_default_rounds_tokens(monkeypatch, temperature):
    """The demo pair on the GPU with CUDA graphs, device rounds at budgets 8 and 16, the
    switch off and on: the same tokens and acceptances (AR's at T = 0), the drafter's
    context and the target's cache the same bits."""
    switch_keeps_the_rounds(monkeypatch, "KDTREE_LEAN_ROUND", temperature)


def switch_keeps_the_rounds(monkeypatch, variable, temperature):
    """The demo pair's device rounds at budgets 8 and 16 with ``variable`` off, on, on:
    assert_same_rounds, and at T = 0 AR's tokens (AR run with the switch on)."""
    from kdtree_numba.engine import generate
    from test_demo_pair import heldout_ids
    model, drafter = demo_pair()
    for budget in (8, 16):
        runs = demo_runs(monkeypatch, model, drafter, variable, ("0", "1", "1"), budget,
                         temperature)
        assert_same_rounds(runs)
        if temperature == 0:
            assert runs[1][0].tokens == generate(model, heldout_ids(4), 64).tokens


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 9, 17, 33, 68, 200])
def test_gpu_dense_ffn_without_its_routing_gives_the_same_bits(monkeypatch, m):
    """The demo's dense FFN widths (D 256, I 768) at an AR step's, verify's and block's rows:
    the lean path's two launches give the one-expert MoE's bits."""
    import cupy
    from kdtree_numba.layers import moe_ffn
    rng = np.random.default_rng(m)
    h = cupy.asarray(rng.standard_normal((m, 256)).astype(np.float32))
    gate_up = cupy.asarray(rng.standard_normal((1, 1536, 256)).astype(np.float32) * 0.05)
    down = cupy.asarray(rng.standard_normal((1, 256, 768)).astype(np.float32) * 0.05)
    out = {}
    for lean in ("0", "1"):
        monkeypatch.setenv("KDTREE_LEAN_ROUND", lean)
        out[lean] = cupy.asnumpy(cupy.asarray(moe_ffn(h, None, None, gate_up, down)))
    np.testing.assert_array_equal(out["1"].view(np.uint32), out["0"].view(np.uint32))

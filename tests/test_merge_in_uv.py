"""``KDTREE_MERGE_IN_UV=1`` (runtime.merge_in_uv, off until timed on the GPU): attention's key
splits merged by apply_uv as it stages its rows (projections._merged_uv_kernel) instead of by a
merge launch; the same bits.

The kernel pair against the merge kernel then apply_uv: bit for bit, with causal and tree
masks, requests whose keys end before the last split (fewer splits merged), splits past a
request's keys (never written: the partial buffers start as NaN) and the calls the fused
kernel leaves to the merge launch (the tiled kernel, bf16 head weights); and against the
float64 reference.  The engine under the switch: the same tokens, logits and caches, one
merge launch fewer per layer whose call splits its keys (the launch counter).  The GPU twin
runs the demo pair with CUDA graphs."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import launch_counter
from kdtree_numba import compat
from reference import attention as ref
from test_fewer_launches import _problem

sim_only = pytest.mark.skipif(not compat.SIMULATOR, reason="the launch counter wraps the "
                              "CUDA simulator")


def _plan_and_weights(prob, chunk, dn, dv, seed=3):
    from kdtree_numba.attention import MlaAttentionPlan
    bs, n, heads, r = prob["q_abs"].shape
    plan = MlaAttentionPlan(bs, n, heads, r, prob["q_pe"].shape[-1], prob["ckv"].shape[1],
                            keys_per_split=chunk, variant="pipe16x2")
    plan.part_o.copy_to_device(np.full(plan.part_o.shape, np.nan, np.float32))
    plan.part_ml.copy_to_device(np.full(plan.part_ml.shape, np.nan, np.float32))
    kv_b = np.random.default_rng(seed).standard_normal((heads * (dn + dv), r))
    return plan, kv_b.astype(np.float32)


def _attend(plan, prob, causal, defer):
    args = [prob[k] for k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible", "tau")]
    return plan(*args, causal=causal, defer_merge=defer)


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
def test_apply_uv_merging_the_splits_gives_the_merge_kernels_bits(needs_kernels, causal):
    from kdtree_numba.attention import PendingMerge, apply_uv
    rng = np.random.default_rng(5)
    r, dr, dn, dv, heads, n = 8, 4, 4, 6, 2, 3
    chunk, cap = 16, 64              # 4 splits; request 1's keys fill one, request 2's two
    prob = _problem(rng, 3, n, heads, r, dr, cap, [37, 1, 14], "causal" if causal else "tree")
    plan, kv_b = _plan_and_weights(prob, chunk, dn, dv)
    assert plan.splits == 4 and plan.merge is not None
    pending = _attend(plan, prob, causal, defer=True)
    assert isinstance(pending, PendingMerge)
    fused = np.array(apply_uv(pending, kv_b, dv).copy_to_host())
    u = _attend(plan, prob, causal, defer=False)
    want = np.array(apply_uv(u, kv_b, dv).copy_to_host())
    np.testing.assert_array_equal(fused.view(np.uint32), want.view(np.uint32))
    u64 = ref.mla_attention(**prob, out_dtype=np.float64)
    oracle = ref.apply_uv(u64, kv_b.astype(np.float64), dv, out_dtype=np.float64)
    bound = ref.fp32_error_bound(**prob) * np.abs(kv_b).sum(axis=1).max() + 1e-5
    np.testing.assert_allclose(fused, oracle, rtol=0, atol=bound)


def test_what_the_fused_kernel_leaves_is_merged_by_the_launch(needs_kernels):
    """kernel_kind="tiled" (and so bf16 head weights, a prefill's many rows over large head
    weights) materialises the merge: the tiled apply_uv of the merged u, bit for bit."""
    from kdtree_numba.attention import apply_uv
    rng = np.random.default_rng(6)
    prob = _problem(rng, 2, 2, 2, 8, 4, 48, [20, 30], "causal")
    plan, kv_b = _plan_and_weights(prob, 16, 4, 4)
    left = np.array(apply_uv(_attend(plan, prob, True, True), kv_b, 4,
                             kernel_kind="tiled").copy_to_host())
    want = np.array(apply_uv(_attend(plan, prob, True, False), kv_b, 4,
                             kernel_kind="tiled").copy_to_host())
    np.testing.assert_array_equal(left.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="kernel_kind"):
        apply_uv(_attend(plan, prob, True, True), kv_b, 4, kernel_kind="fused")


def test_a_plan_without_a_merge_returns_u(needs_kernels):
    """One split (the kernel writes u itself) or a caller's ``out``: never a PendingMerge."""
    rng = np.random.default_rng(7)
    prob = _problem(rng, 1, 2, 2, 8, 4, 32, [9], "causal")
    plan, _ = _plan_and_weights(prob, 32, 4, 4)
    assert plan.splits == 1
    assert compat.is_device_array(_attend(plan, prob, True, True))
    plan, _ = _plan_and_weights(prob, 8, 4, 4)
    out = compat.device_empty((1, 2, 2, 8), np.float32)
    args = [prob[k] for k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible", "tau")]
    assert plan(*args, causal=True, out=out, defer_merge=True) is out


def _run(monkeypatch, merge_in_uv: bool):
    monkeypatch.setenv("KDTREE_MERGE_IN_UV", "1" if merge_in_uv else "0")
    return launch_counter.rounds_and_bits()


@sim_only
@pytest.mark.slow   # ~40 s: the switch is opt-in; its kernels' bits are the tests above, in CI
def test_the_engine_merging_in_apply_uv_gives_the_same_bits(monkeypatch, needs_kernels):
    with launch_counter.installed():
        off = _run(monkeypatch, False)
        on = _run(monkeypatch, True)
    launch_counter.same_results(off, on)
    # tests/test_lean_round.py's pair: the round's two attention plans with more than one key
    # split, each called by both layers (4 merges), now merge in apply_uv; the AR step's plan
    # has one split
    merges = "attention.mla.MlaAttentionPlan.launch_merge: kernel mla.merge_splits"
    heads = "attention.projections._run_head_gemm: kernel projections.head_stream"
    fused = "attention.projections._merged_apply_uv: kernel projections.merged_uv"
    assert off[0][merges] == 4
    cut = collections.Counter({merges: 4, heads: 4, fused: -4})
    diff = collections.Counter({k: off[0].get(k, 0) - on[0].get(k, 0)
                                for k in set(off[0]) | set(on[0])})
    assert +diff == +cut and -diff == -cut
    assert on[1] == off[1]


# ----------------------------------------------------------------------------- the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_merging_in_apply_uv_keeps_the_rounds(monkeypatch, temperature):
    """The demo pair on the GPU with CUDA graphs, device rounds at budgets 8 and 16, the
    switch off, on, on: the same tokens and acceptances (AR's at T = 0), the caches' bits."""
    from test_lean_round import switch_keeps_the_rounds
    switch_keeps_the_rounds(monkeypatch, "KDTREE_MERGE_IN_UV", temperature)

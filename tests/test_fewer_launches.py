"""``KDTREE_FEWER_LAUNCHES=1`` (runtime.fewer_launches, off by default until a GPU run
validates it): fewer launches in the small forwards with the same bits.

Attention's key splits merged by the block kernel's last block of each row tile
(tiles.merge_when_last) instead of a merge launch: the outputs equal the merge kernel's bit
for bit, on the FFMA kernel and the bf16 one, with causal and tree masks, rows whose keys end
before the last split, splits past a request's keys (never written, never read: the partial
buffers start as NaN), and over repeated calls (the arrival counters go back to zero).  The
tensor-core (tf32x3) kernel runs only on a GPU: tests/test_attention_gpu.py's twin."""
from __future__ import annotations

import numpy as np
import pytest

from reference import attention as ref
from reference.attention import tree_visible


def _problem(rng, bs, n, heads, r, dr, cap, prefix, kind, bf16=False):
    if kind == "tree":
        visible = np.stack([tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
                            for _ in range(bs)])
    else:
        visible = np.broadcast_to(np.tril(np.ones((n, n), bool)), (bs, n, n)).copy()
    ckv = rng.standard_normal((bs, cap, r)).astype(np.float32)
    kpe = rng.standard_normal((bs, cap, dr)).astype(np.float32)
    if bf16:
        from test_attention_bf16 import bf16_bits
        ckv, kpe = bf16_bits(ckv), bf16_bits(kpe)
    return dict(q_abs=rng.standard_normal((bs, n, heads, r)).astype(np.float32),
                q_pe=rng.standard_normal((bs, n, heads, dr)).astype(np.float32),
                ckv=ckv, kpe=kpe, prefix_len=np.array(prefix, np.int32), visible=visible,
                tau=0.35)


def _both_plans(prob, chunk, variant=None):
    """(plan merging by launch, plan merging in the kernel) of one shape, their partial
    buffers poisoned with NaN."""
    from kdtree_numba.attention import MlaAttentionPlan
    bs, n, heads, r = prob["q_abs"].shape
    shape = (bs, n, heads, r, prob["q_pe"].shape[-1], prob["ckv"].shape[1])
    bf16 = prob["ckv"].dtype == np.uint16
    plans = [MlaAttentionPlan(*shape, keys_per_split=chunk, variant=variant, bf16_cache=bf16,
                              fused_merge=fused) for fused in (False, True)]
    for plan in plans:
        plan.part_o.copy_to_device(np.full(plan.part_o.shape, np.nan, np.float32))
        ml = np.full(plan.part_ml.shape, np.nan, np.float32)
        plan.part_ml.copy_to_device(ml)
    assert plans[0].merge is not None and plans[1].merge is None and plans[1].fused_merge
    return plans


def _call(plan, prob, causal):
    args = [prob[k] for k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible", "tau")]
    return plan(*args, causal=causal).copy_to_host()


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
def test_the_kernels_last_block_merges_the_splits_with_the_merge_kernels_bits(needs_kernels,
                                                                               causal):
    from kdtree_numba.attention import tile_config
    rng = np.random.default_rng(11)
    heads, r, dr = 2, 8, 4
    rows = tile_config(r, dr, "pipe16x2").rows
    n = rows // heads + 3            # two row tiles, the second ragged
    chunk, cap = 16, 64              # 4 splits; request 1's keys fill one, request 2's two
    prob = _problem(rng, 3, n, heads, r, dr, cap, [37, 1, 14],
                    "causal" if causal else "tree")
    separate, fused = _both_plans(prob, chunk, "pipe16x2")
    assert separate.splits == fused.splits == 4
    want = _call(separate, prob, causal)
    np.testing.assert_allclose(want, ref.mla_attention(**prob, out_dtype=np.float64), rtol=0,
                               atol=ref.fp32_error_bound(**prob))
    for _ in range(2):               # the counters went back to zero: a second call agrees
        got = _call(fused, prob, causal)
        assert got.tobytes() == want.tobytes()
        counters = fused.part_ml.copy_to_host()[:, fused.splits, :, 0]
        tiles = fused.grid[0]
        assert (counters[:, :tiles] == 0).all()
    # request 1 has keys in split 0 only: the others ran nothing and wrote nothing
    assert np.isnan(fused.part_ml.copy_to_host()[1, 1:fused.splits]).all()


def test_the_bf16_kernels_last_block_merges_with_the_merge_kernels_bits(needs_kernels):
    rng = np.random.default_rng(12)
    prob = _problem(rng, 2, 3, 1, 16, 8, 32, [20, 3], "tree", bf16=True)
    separate, fused = _both_plans(prob, 16)
    assert separate.splits == 2          # request 0's keys in both, request 1's in one
    want = _call(separate, prob, False)
    assert _call(fused, prob, False).tobytes() == want.tobytes()
    assert (fused.part_ml.copy_to_host()[:, 2, 0, 0] == 0).all()


def test_the_switch_picks_the_fused_plan_and_keys_graphs_apart(monkeypatch, needs_kernels):
    """mla_attention follows KDTREE_FEWER_LAUNCHES (a plan of each kind, cached apart), and a
    CUDA graph captured under one setting is not replayed under the other
    (GraphCache.stored_key)."""
    from kdtree_numba.attention import PlanCache, mla_attention
    from kdtree_numba.graphs import GraphCache
    rng = np.random.default_rng(13)
    prob = _problem(rng, 1, 1, 1, 8, 4, 40, [30], "causal")
    plans, out = PlanCache(), {}
    for value in ("0", "1"):
        monkeypatch.setenv("KDTREE_FEWER_LAUNCHES", value)
        out[value] = mla_attention(**prob, keys_per_split=16, plans=plans).copy_to_host()
    assert [p.fused_merge for p in plans._plans.values()] == [False, True]
    assert out["0"].tobytes() == out["1"].tobytes()
    graphs = object.__new__(GraphCache)         # no device: only the keyed dictionary
    graphs._graphs = {GraphCache.stored_key(("round", 16, 4)): None}
    assert graphs.holds(("round", 16, 4))
    monkeypatch.setenv("KDTREE_FEWER_LAUNCHES", "0")
    assert not graphs.holds(("round", 16, 4))

"""Padded prefills (kdtree_numba/model.py: ``prefill_rows``, ``Model.prefill_width``): where
the forwards replay CUDA graphs a prompt runs as the next of a few row counts, so one graph
serves many prompt lengths.  The padding rows come after every real token and a causal mask
hides them from it, so a real row's logits, hidden state, features and cache entries are
those of the unpadded prefill (on the reference backend bit for bit: it computes rows apart),
and generation gives the same tokens, AR and DFlash DDTree alike.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kdtree_numba import compat
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.engine import generate
from kdtree_numba.kvcache import CacheFullError
from kdtree_numba.model import Model, prefill_rows
from test_dflash import target_and_drafter


def test_prefill_rows_bounds_the_padding_and_the_graphs():
    lengths = np.arange(1, 5001)
    rows = np.array([prefill_rows(n) for n in lengths])
    assert np.all(rows >= lengths)
    assert np.all(np.diff(rows) >= 0)
    small = lengths <= 64
    # up to 64 tokens: a power of two from 16 (a launch-bound forward: padding costs nothing)
    assert set(rows[small].tolist()) == {16, 32, 64}
    assert np.all(rows[small] < np.maximum(2 * lengths[small], 17))
    # beyond: less than 64 rows or 1/8 of the prompt's work wasted
    waste = rows[~small] - lengths[~small]
    assert np.all(waste < np.maximum(64, lengths[~small] / 8))
    assert np.all(rows[~small] % 64 == 0)
    # the held-out prompts' 29..339 tokens: 7 graphs
    assert len({prefill_rows(n) for n in range(29, 340)}) == 7
    assert prefill_rows(4096) == 4096 and prefill_rows(4097) == 4608


@contextlib.contextmanager
def padding(model, on: bool):
    before = model.pad_prefills
    model.pad_prefills = on
    try:
        yield model
    finally:
        model.pad_prefills = before


def test_a_padded_prefill_gives_the_unpadded_rows_and_cache():
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17], [1]]
    out = {}
    for on in (False, True):
        with padding(target, on):
            cache = target.new_cache(3, 64)
            assert target.prefill_width(cache, 17) == (32 if on else 17)
            out[on] = (target.prefill(cache, prompts, return_hidden=True,
                                      capture_layers=drafter.feature_layers), cache)
    (logits0, hidden0, feats0), cache0 = out[False]
    (logits1, hidden1, feats1), cache1 = out[True]
    np.testing.assert_array_equal(logits1, logits0)
    np.testing.assert_array_equal(hidden1, hidden0)
    assert feats0.shape[1] == 17 and feats1.shape[1] == 32
    for b, p in enumerate(prompts):
        n = len(p)
        np.testing.assert_array_equal(feats1[b, :n], feats0[b, :n])
        np.testing.assert_array_equal(cache1.c[:, b, :n], cache0.c[:, b, :n])
        np.testing.assert_array_equal(cache1.k_pe[:, b, :n], cache0.k_pe[:, b, :n])
    assert cache1.lengths.tolist() == cache0.lengths.tolist() == [3, 17, 1]


def test_padding_stops_at_the_caches_room_and_a_full_cache_still_refuses():
    target, _ = target_and_drafter()
    with padding(target, True):
        cache = target.new_cache(1, 24)
        assert target.prefill_width(cache, 17) == 24          # 32 would not fit
        target.prefill(cache, [list(range(1, 18))])
        assert cache.lengths.tolist() == [17]
        with pytest.raises(CacheFullError, match="needs 8 more slots"):
            target.prefill(cache, [list(range(1, 9))])
        assert cache.lengths.tolist() == [17]               # nothing committed


@pytest.mark.parametrize("method, budget", [("ar", None), ("ddtree", 5), ("chain", 32)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_with_padded_prefills_gives_the_same_tokens(method, budget, temperature):
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    kw = dict(temperature=temperature, seed=4)
    if method != "ar":
        kw.update(method=method, drafter=drafter, budget=budget)
    with padding(target, False):
        want = generate(target, prompts, 10, **kw).tokens
    with padding(target, True):
        got = generate(target, prompts, 10, **kw)
    assert got.tokens == want
    if method != "ar":      # the drafter's context holds the real tokens' features only
        assert drafter.context_lengths.tolist() == target.generation_cache.lengths.tolist()


@pytest.mark.gpu
def test_gpu_padded_prefills_share_graphs_and_keep_ddtree_equal_to_ar():
    """The demo pair on the GPU with padded prefills: the held-out prompts' first logits
    within float rounding of the unpadded prefill's (another row count may take another GEMM
    kernel), DDTree (device rounds) = AR token for token, and prompts of different lengths in
    one padded length share one prefill graph: captured on the second, replayed after."""
    from kdtree_numba import demo
    from kdtree_numba.dflash import DFlashDrafter
    from test_demo_pair import heldout_ids
    model = Model.load(demo.TARGET, "numba")
    drafter = DFlashDrafter.load(demo.DRAFTER, model)
    prompts = [p for p in heldout_ids(40) if 65 <= len(p) <= 128][:4]
    assert len(prompts) == 4 and len({len(p) for p in prompts}) > 1
    first = {}
    for on in (False, True):
        with padding(model, on):
            first[on] = [np.asarray(model.backend.to_host(
                model.prefill(model.new_cache(1, 512), [p])), np.float32) for p in prompts]
    for a, b in zip(first[False], first[True]):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-3 * float(np.abs(a).max()))
    with padding(model, True):
        model.graphs = model.new_graphs()
        for p in prompts:
            ar = generate(model, [p], 48)
            dd = generate(model, [p], 48, method="ddtree", drafter=drafter, budget=16)
            assert dd.tokens == ar.tokens
        # AR's and DDTree's prefill (with the drafter's features) at 128 rows: two graphs,
        # each captured on its second prompt
        assert model.graphs.kinds()["prefill"] == 2


@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba backend runs here only in the CUDA "
                    "simulator")
def test_numba_padded_prefill_gives_the_unpadded_rows_in_simulator(needs_kernels):
    """The numba kernels over padding rows (the causal prefill plan, the MoE grouping of the
    padding tokens): the real rows' logits and cache entries are the unpadded prefill's."""
    # one MoE layer (grouped routing, a shared expert) at tests/launch_counter.py's
    # SMALL_TARGET widths: the simulated blocks scale with the widths, the padding rows not
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=0, vocab_size=16,
                      hidden_size=8, intermediate_size=8, moe_intermediate_size=8,
                      kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=1,
                      n_routed_experts=4, n_group=2, topk_group=1)
    model = Model(cfg, dict(random_weights(cfg, 3)), make_backend("numba"))
    prompts = [[5, 6, 7, 8, 9]]
    out = {}
    for on in (False, True):
        with padding(model, on):
            cache = model.new_cache(1, 24)
            logits = model.prefill(cache, prompts)
            out[on] = (np.asarray(logits), np.asarray(cache.c), np.asarray(cache.k_pe))
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=0, atol=1e-5)
    for b, p in enumerate(prompts):
        n = len(p)
        for i in (1, 2):
            np.testing.assert_allclose(out[True][i][:, b, :n], out[False][i][:, b, :n],
                                       rtol=0, atol=1e-5)

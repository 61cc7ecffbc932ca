"""Top-p and top-k (reference/ddtree/sampling.py): the rule on hand-made rows, the checks, the
numba kernel against the reference (simulator here, `gpu`-marked twin on the GPU), and the
engine's methods agreeing token for token under one seed (issue 37, item 2).  The
distributions themselves: tests/test_sampling_distribution.py."""
from __future__ import annotations

import numpy as np
import pytest

import reference.ddtree as ref
from reference.ddtree import Sampling, inverse_cdf_sample, kept_weights


def probs(row, **kw):
    w = kept_weights(np.float32(row), Sampling(**kw))
    return w / w.sum()


def test_top_k_keeps_the_k_largest_and_breaks_ties_by_id():
    row = [1.0, 3.0, 2.0, 3.0, 0.0]
    assert np.flatnonzero(probs(row, temperature=1.0, top_k=1)).tolist() == [1]
    assert np.flatnonzero(probs(row, temperature=1.0, top_k=2)).tolist() == [1, 3]
    assert np.flatnonzero(probs(row, temperature=1.0, top_k=3)).tolist() == [1, 2, 3]
    np.testing.assert_array_equal(probs(row, temperature=1.0, top_k=5),
                                  probs(row, temperature=1.0))          # k >= V: all


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    row = np.log(np.float32([0.1, 0.4, 0.2, 0.3]))       # ranks: 1 (.4), 3 (.3), 2 (.2), 0 (.1)
    for p, kept in [(0.3, [1]), (0.4, [1]), (0.41, [1, 3]), (0.7, [1, 3]), (0.71, [1, 2, 3]),
                    (0.95, [0, 1, 2, 3])]:
        got = probs(row, temperature=1.0, top_p=p)
        assert np.flatnonzero(got).tolist() == kept, p
        np.testing.assert_allclose(got.sum(), 1.0)
    # renormalised: the kept tokens keep their ratios
    got = probs(row, temperature=1.0, top_p=0.7)
    np.testing.assert_allclose(got[[1, 3]], np.array([0.4, 0.3]) / 0.7, rtol=1e-6)


def test_top_k_applies_before_top_p():
    row = np.log(np.float32([0.1, 0.4, 0.2, 0.3]))
    # top-2 leaves {1: .4/.7, 3: .3/.7}; p = 0.6 of that needs both (0.571 < 0.6)
    assert np.flatnonzero(probs(row, temperature=1.0, top_k=2, top_p=0.6)).tolist() == [1, 3]
    assert np.flatnonzero(probs(row, temperature=1.0, top_k=2, top_p=0.5)).tolist() == [1]


def test_without_truncation_the_rule_is_the_plain_temperature_draw():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(50).astype(np.float32)
    for u in rng.random(20):
        x = row.astype(np.float64)
        cdf = np.cumsum(np.exp((x - x.max()) / 0.8))
        want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert inverse_cdf_sample(row, Sampling(0.8), u) == want == inverse_cdf_sample(row, 0.8,
                                                                                       u)


@pytest.mark.parametrize("kw, error, words", [
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=1.0, top_p=0.0), ValueError, "top_p"),
    (dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
    (dict(temperature=1.0, top_k=-1), ValueError, "top_k"),
    (dict(temperature=1.0, top_k=2.5), TypeError, "top_k"),
    (dict(temperature="1"), TypeError, "temperature"),
])
def test_bad_sampling_is_refused(kw, error, words):
    with pytest.raises(error, match=words):
        Sampling(**kw)


def test_sample_targets_refuses_greedy_sampling():
    tree = ref.build_tree(*ref.topk_logprobs(np.zeros((1, 2, 3), np.float32), 2), 3)
    with pytest.raises(ValueError, match="accept_greedy"):
        ref.sample_targets(tree, np.zeros((1, 4, 3), np.float32), Sampling(0.0, top_k=2),
                           np.zeros((1, 4)))


def _case(seed, vocab=12, budget=2):
    rng = np.random.default_rng(seed)
    tree = ref.build_tree(*ref.topk_logprobs(rng.standard_normal((1, 2, vocab))
                                             .astype(np.float32), 2), budget)
    logits = (rng.standard_normal((1, budget + 1, vocab)) * 2).astype(np.float32)
    logits[0, 0, 3] = logits[0, 0, 5]                  # a tie across the cut
    return tree, logits, rng.random((1, budget + 1))


def test_numba_truncated_sampling_matches_the_reference(needs_kernels):
    """One top-p + top-k case under the simulator (~10 s: the kernel's bisection takes ~40
    block barriers a slot); the sweep is the slow test below."""
    from kdtree_numba import ddtree as gpu
    tree, logits, u = _case(0, budget=1)
    s = Sampling(1.0, top_p=0.6, top_k=4)
    np.testing.assert_array_equal(gpu.sample_targets(tree, logits, s, u),
                                  ref.sample_targets(tree, logits, s, u))


SWEEP = [Sampling(0.7, top_p=0.9), Sampling(1.0, top_k=3), Sampling(1.0, top_p=0.5, top_k=4),
         Sampling(2.0, top_k=1), Sampling(1.0, top_p=0.01), Sampling(1.0, top_k=50)]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("sampling", SWEEP, ids=str)
def test_numba_truncated_sampling_sweep(needs_kernels, seed, sampling):
    from kdtree_numba import ddtree as gpu
    tree, logits, u = _case(seed)
    np.testing.assert_array_equal(gpu.sample_targets(tree, logits, sampling, u),
                                  ref.sample_targets(tree, logits, sampling, u))
    for want, got in zip(ref.accept_sampled(tree, logits, sampling, u),
                         gpu.accept_sampled(tree, logits, sampling, u)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", SWEEP + [Sampling(1.0, top_p=0.95, top_k=40)], ids=str)
def test_numba_truncated_sampling_on_the_gpu_at_a_real_vocabulary(sampling):
    """On the GPU: 8,192 and 163,840 tokens, 33 slots, against the reference."""
    from kdtree_numba import ddtree as gpu
    for vocab in (8192, 163840):
        tree, logits, u = _case(vocab, vocab=vocab, budget=32)
        np.testing.assert_array_equal(gpu.sample_targets(tree, logits, sampling, u),
                                      ref.sample_targets(tree, logits, sampling, u))


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_truncated_speculation_equals_ar_for_one_seed(method):
    """Every method draws position p with U_b[p] from the same truncated distribution: the
    same tokens as AR under one seed, with top-p and top-k."""
    from kdtree_numba.bundle import random_weights, size_config
    from kdtree_numba.drafter import NoisyOracleDrafter
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    cfg = size_config("tiny", num_hidden_layers=2)
    model = Model(cfg, dict(random_weights(cfg, 1)), "reference")
    prompts = [[7, 7, 7], [1, 2, 3, 4]]
    kw = dict(temperature=0.9, top_p=0.8, top_k=20, seed=4)
    ar = generate(model, prompts, 10, **kw)
    spec = generate(model, prompts, 10, method=method, budget=6,
                    drafter=NoisyOracleDrafter(model, 3, 0.9, seed=2, sharpness=1.5), **kw)
    assert spec.tokens == ar.tokens
    assert generate(model, prompts, 10, **dict(kw, top_k=0)).tokens != ar.tokens

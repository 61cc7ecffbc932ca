"""The reference backend's float32 mode (kdtree_numba/cpu.py, issue 37 item 4): batch
invariance (a row's bits do not depend on the rows computed with it), agreement with the
float64 reference, and DDTree = AR at T = 0 on that path (the demo pair included)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kdtree_numba import cpu, demo
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import ForwardBatch, Model, causal_mask
from reference.attention import tree_visible

# every GEMM shape of the demo pair (K, N), and a few of the tiny test models
SHAPES = [(256, 128), (256, 288), (128, 512), (256, 256), (256, 1536), (128, 256), (256, 8192),
          (256, 8), (32, 128), (64, 16), (768, 256)]


@pytest.mark.parametrize("k, n", SHAPES)
def test_blocked_matmul_rows_do_not_depend_on_the_batch(k, n):
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal((40, k)).astype(np.float32)
    wt = np.ascontiguousarray(rng.standard_normal((n, k)).astype(np.float32)).T
    alone = np.stack([cpu.blocked_matmul(x[i:i + 1], wt)[0] for i in range(40)])
    for m in (2, 7, 9, 17, 33, 40):
        np.testing.assert_array_equal(cpu.blocked_matmul(x[:m], wt), alone[:m])
    # and the rows are the product (float32 rounding of a K-term dot product)
    np.testing.assert_allclose(alone, x.astype(np.float64) @ wt.astype(np.float64),
                               rtol=1e-4, atol=1e-4 * np.sqrt(k))


@functools.lru_cache(maxsize=None)
def tiny(precision: str) -> Model:
    cfg = size_config("tiny", num_hidden_layers=2)
    return Model(cfg, dict(random_weights(cfg, 7)), make_backend("reference",
                                                                 precision=precision))


def test_float32_path_agrees_with_the_float64_reference():
    ids = [3, 17, 99, 4, 60, 2, 2, 31]
    want, got = tiny("float64").score(ids), tiny("float32").score(ids)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_a_tree_verify_gives_each_node_the_bits_of_its_decode():
    """Verify a tree of 6 nodes over a prefix; then decode each root-to-node path token by
    token: every node's logits equal its decode's bit for bit (attention's keys sit at
    scattered tree slots in the verify, contiguous slots in the decode)."""
    model = tiny("float32")
    prefix = [5, 9, 2, 77, 13]
    parents = [-1, 0, 0, 1, 2, 3]
    tokens = [40, 41, 42, 43, 44, 45]
    depth = [0, 1, 1, 2, 2, 3]
    cache = model.new_cache(1, 32)
    model.prefill(cache, [prefix[:-1]])
    verify = model.forward(ForwardBatch(
        np.array([tokens]), np.array([[len(prefix) - 1 + d for d in depth]]),
        tree_visible(parents)[None]), cache)[0]
    for node in range(len(tokens)):
        path, j = [], node
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        c = model.new_cache(1, 32)
        model.prefill(c, [prefix[:-1]])
        for j in path:
            logits = model.decode(c, np.array([tokens[j]]))
            c.advance(np.ones(1, np.int64))
        np.testing.assert_array_equal(logits[0], verify[node])


def test_a_causal_block_equals_its_decodes():
    model = tiny("float32")
    ids = np.array([[7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]])
    cache = model.new_cache(1, 16)
    block = model.forward(ForwardBatch(
        ids, np.arange(ids.shape[1])[None], causal_mask(ids.shape[1])), cache)
    c = model.new_cache(1, 16)
    for i in range(ids.shape[1]):
        np.testing.assert_array_equal(model.decode(c, ids[:, i])[0], block[0, i])
        c.advance(np.ones(1, np.int64))


@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_greedy_speculation_equals_ar_on_the_float32_path(method):
    model = tiny("float32")
    prompts = [[7, 7, 7], [1, 2, 3, 4, 5]]
    ar = generate(model, prompts, 12)
    drafter = NoisyOracleDrafter(model, 3, agreement=0.7, seed=1, sharpness=1.5)
    spec = generate(model, prompts, 12, method=method, drafter=drafter, budget=8)
    assert spec.tokens == ar.tokens
    assert spec.stats.mean_tau > 1


def test_the_demo_pair_is_lossless_on_the_float32_path():
    be = make_backend("reference", precision="float32")
    model = Model.load(demo.TARGET, be)
    codec_ids = [0, 563, 1098, 4, 2630, 340]      # a code-like prompt of the demo vocabulary
    ar = generate(model, [codec_ids], 24)
    dd = generate(model, [codec_ids], 24, method="ddtree",
                  drafter=DFlashDrafter.load(demo.DRAFTER, model), budget=8)
    assert dd.tokens == ar.tokens


def test_blas_threads_sets_a_count():
    got = cpu.blas_threads(1)
    assert got in (1, None)          # None: this NumPy's BLAS is not OpenBLAS


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        make_backend("reference", precision="float16")
    with pytest.raises(ValueError, match="reference backend's CPU path"):
        make_backend("numba", precision="float32")

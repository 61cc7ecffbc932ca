"""The reference backend's float32 mode (kdtree_numba/cpu.py, issue 37 item 4): batch
invariance (a row's bits do not depend on the rows computed with it), agreement with the
float64 reference, and DDTree = AR at T = 0 on that path (the demo pair included)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kdtree_numba import cpu, demo
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import (DFlashSpec, dflash_config, dflash_shapes, random_weights,
                                 size_config)
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import ForwardBatch, Model, causal_mask
from kdtree_numba.steps import tree_depth
from reference import attention as ref_attention
from reference import layers as ref_layers
from reference.attention import tree_visible

# every GEMM shape of the demo pair (K, N), and a few of the tiny test models
SHAPES = [(256, 128), (256, 288), (128, 512), (256, 256), (256, 1536), (128, 256), (256, 8192),
          (256, 8), (32, 128), (64, 16), (768, 256)]


@pytest.mark.parametrize("rows", [cpu.ROWS, cpu.PREFILL_ROWS])
@pytest.mark.parametrize("k, n", SHAPES)
def test_blocked_matmul_rows_do_not_depend_on_the_batch(k, n, rows):
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal((70, k)).astype(np.float32)
    wt = np.ascontiguousarray(rng.standard_normal((n, k)).astype(np.float32)).T
    alone = np.stack([cpu.blocked_matmul(x[i:i + 1], wt, rows)[0] for i in range(40)])
    for m in (2, 7, 9, 17, 33, 40):
        np.testing.assert_array_equal(cpu.blocked_matmul(x[:m], wt, rows), alone[:m])
    # a row's bits do not depend on its place in a block either
    np.testing.assert_array_equal(cpu.blocked_matmul(x, wt, rows)[30:70:3],
                                  cpu.blocked_matmul(x[30:70:3], wt, rows))
    # and the rows are the product (float32 rounding of a K-term dot product)
    np.testing.assert_allclose(alone, x[:40].astype(np.float64) @ wt.astype(np.float64),
                               rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_invariant_block_halves_where_a_place_gets_other_bits(monkeypatch):
    """A BLAS whose micro-kernel gives places 6 and up of a block other bits (as OpenBLAS's
    Haswell kernel does on a Zen 2) gets 4-row blocks; the rows then keep their bits."""
    matmul = np.matmul

    def placed(a, b):
        y = matmul(a, b)
        if y.ndim >= 2 and y.shape[-2] > 6:
            y[..., 6:, :] = np.nextafter(y[..., 6:, :], np.float32(np.inf))
        return y

    monkeypatch.setattr(cpu, "_BLOCKS", {})
    monkeypatch.setattr(np, "matmul", placed)
    wt = np.ones((24, 5), np.float32)
    assert cpu.invariant_block(16, wt) == 4
    assert cpu.invariant_block(4, wt) == 4 and cpu.invariant_block(1, wt) == 1
    x = np.random.default_rng(3).standard_normal((11, 24)).astype(np.float32)
    alone = np.concatenate([cpu.blocked_matmul(x[i:i + 1], wt, 16) for i in range(11)])
    np.testing.assert_array_equal(cpu.blocked_matmul(x, wt, 16), alone)


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


@pytest.mark.parametrize("p0", [0, 5, 61, 64, 70, 127, 130])
def test_tree_attention_gives_each_node_the_bits_of_its_decode(p0):
    """cpu.mla_attention on a tree's queries (a depth-3 tree of 9 nodes, and the demo's
    depth-2 shape) against each node's decode: its path's keys at contiguous slots after the
    prefix, one query.  Prefixes across the KEYS blocks: a node's list positions and its
    slots fall in different blocks; the bits are equal all the same."""
    rng = np.random.default_rng(p0)
    heads, r, dr, tau = 4, 32, 16, 0.2
    for parents in ([-1, 0, 0, 1, 1, 2, 4, 3, 6], [-1, 0, 0, 0, 1, 2, 1, 3]):
        n = len(parents)
        ckv = rng.standard_normal((1, p0 + n, r)).astype(np.float32)
        kpe = rng.standard_normal((1, p0 + n, dr)).astype(np.float32)
        q_abs = rng.standard_normal((1, n, heads, r)).astype(np.float32)
        q_pe = rng.standard_normal((1, n, heads, dr)).astype(np.float32)
        tree = cpu.mla_attention(q_abs, q_pe, ckv, kpe, np.array([p0]),
                                 tree_visible(parents)[None], tau, causal=True)
        for node in range(n):
            path, j = [], node
            while j >= 0:
                path.insert(0, j)
                j = parents[j]
            keys = list(range(p0)) + [p0 + j for j in path]
            alone = cpu.mla_attention(q_abs[:, node:node + 1], q_pe[:, node:node + 1],
                                      ckv[:, keys], kpe[:, keys], np.array([len(keys) - 1]),
                                      np.ones((1, 1, 1), bool), tau)
            np.testing.assert_array_equal(alone[0, 0], tree[0, node])
    want = ref_attention.mla_attention(q_abs, q_pe, ckv, kpe, np.array([p0]),
                                       tree_visible(parents)[None], tau)
    np.testing.assert_allclose(tree, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_a_prompt_gets_the_same_bits_alone_or_in_a_batch():
    """A prefill's rows (cpu.prefill_ops: PREFILL_ROWS blocks) need match no decode's, but a
    prompt's logits and cache are the same bits alone as beside a longer one; and they
    agree with the float64 reference to float32 rounding."""
    model = tiny("float32")
    prompts = [[5, 9, 2, 77, 13], list(range(3, 70))]
    both = model.new_cache(2, 80)
    pair = model.prefill(both, prompts)
    for i, prompt in enumerate(prompts):    # the second starts mid-block in the pair's rows
        alone = model.new_cache(1, 80)
        first = model.prefill(alone, [prompt])
        np.testing.assert_array_equal(np.asarray(pair)[i], np.asarray(first)[0])
        np.testing.assert_array_equal(both.c[-1][i, :len(prompt)],
                                      alone.c[-1][0, :len(prompt)])
    want = tiny("float64").score(prompts[1])[-1]
    np.testing.assert_allclose(np.asarray(pair)[1], want, rtol=0,
                               atol=2e-5 * np.abs(want).max())


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


def test_a_sampled_tree_on_the_float32_path_is_capped_in_depth():
    """steps.tree_depth: cpu.SAMPLED_DEPTH on the float32 CPU path at T > 0, None at T = 0 and
    on the float64 reference.  generate's DDTree trees there stay within it at T = 1 (and
    reach it) though the drafter returns its whole block of 3 rows; at T = 0 the same drafter's
    trees go deeper, and the chain keeps its block at T = 1."""
    f32, f64 = tiny("float32"), tiny("float64")
    assert tree_depth(f32.backend, 1.0) == cpu.SAMPLED_DEPTH == 2
    assert tree_depth(f32.backend, 0.0) is None and tree_depth(f64.backend, 1.0) is None

    def deepest(method, temperature):
        drafter = NoisyOracleDrafter(f32, 3, agreement=0.9, seed=1, sharpness=1.5)
        seen = []
        generate(f32, [[7, 7, 7], [1, 2, 3, 4, 5]], 16, method=method, drafter=drafter,
                 budget=6, temperature=temperature, seed=3,
                 on_round=lambda tree, idx, n: seen.append(int(np.max(tree.depth))))
        return max(seen)
    assert deepest("ddtree", 1.0) == 2
    assert deepest("ddtree", 0.0) == 3
    assert deepest("chain", 1.0) == 3


def test_the_demo_pair_is_lossless_on_the_float32_path():
    be = make_backend("reference", precision="float32")
    model = Model.load(demo.TARGET, be)
    codec_ids = [0, 563, 1098, 4, 2630, 340]      # a code-like prompt of the demo vocabulary
    ar = generate(model, [codec_ids], 24)
    dd = generate(model, [codec_ids], 24, method="ddtree",
                  drafter=DFlashDrafter.load(demo.DRAFTER, model), budget=8)
    assert dd.tokens == ar.tokens


def test_dense_attention_agrees_with_the_reference():
    """cpu.dense_mla_attention (a drafter's, not batch invariant) against the float64
    reference: ragged prefixes, a mask over the new keys."""
    rng = np.random.default_rng(5)
    bs, n, heads, r, dr, cap = 2, 5, 3, 16, 8, 40
    q_abs = rng.standard_normal((bs, n, heads, r)).astype(np.float32)
    q_pe = rng.standard_normal((bs, n, heads, dr)).astype(np.float32)
    ckv = rng.standard_normal((bs, cap, r)).astype(np.float32)
    kpe = rng.standard_normal((bs, cap, dr)).astype(np.float32)
    prefix = np.array([7, 30])
    visible = np.stack([tree_visible([-1, 0, 0, 1, 2]), np.ones((n, n), bool)])
    want = ref_attention.mla_attention(q_abs, q_pe, ckv, kpe, prefix, visible, 0.3)
    got = cpu.dense_mla_attention(q_abs, q_pe, ckv, kpe, prefix, visible, 0.3)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # a mask that breaks causal=True is refused by both attentions, naming the query
    trees = np.stack([visible[0], visible[0]])
    late = trees.copy()
    late[1, 2, 4] = True
    for attend in (cpu.dense_mla_attention, cpu.mla_attention):
        attend(q_abs, q_pe, ckv, kpe, prefix, trees, 0.3, causal=True)        # trees: fine
        with pytest.raises(ValueError, match="query 2 of request 1 sees new key 4"):
            attend(q_abs, q_pe, ckv, kpe, prefix, late, 0.3, causal=True)


def test_drafter_ops_agree_with_the_reference():
    """cpu.drafter_ops: linear and the dense FFN as weight-side GEMMs on the weights as
    stored, to float32 rounding of the float64 reference, for 1 to 17 rows (padding to the
    8-row blocks and past them), a weight of the demo lm_head's shape included; repeated
    calls give the same bits."""
    rng = np.random.default_rng(6)
    ops = cpu.drafter_ops(make_backend("reference", precision="float32").ops)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    gate_up = rng.standard_normal((1, 32, 24)).astype(np.float32)
    down = rng.standard_normal((1, 24, 16)).astype(np.float32)
    big = rng.standard_normal((8192, 256)).astype(np.float32)
    for m in (1, 2, 3, 8, 9, 17):
        x = rng.standard_normal((m, 24)).astype(np.float32)
        want = ref_layers.linear(x, w)
        got = ops.linear(x, w)
        assert got.shape == (m, 40) and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(ops.linear(x, w), got)
        want = ref_layers.moe_ffn(x, None, None, gate_up, down)
        np.testing.assert_allclose(ops.moe_ffn(x, None, None, gate_up, down), want, rtol=0,
                                   atol=1e-5 * np.abs(want).max())
        x256 = rng.standard_normal((m, 256)).astype(np.float32)
        want = ref_layers.linear(x256, big)
        np.testing.assert_allclose(ops.linear(x256, big), want, rtol=0,
                                   atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="linear wants"):
        ops.linear(x, w.T)


def test_drafter_gemv_rows_on_bf16_bits_give_the_float32_bits():
    """cpu.Bf16Bits: a weight whose values are all bf16 is read as its uint16 bits by the
    drafter's 1-3-row GEMVs, giving the bits of the same weight read as float32 (the same
    values, the same sums), linear and the dense FFN alike; a weight with a value bf16
    cannot hold is not narrowed, nor is a copy of a narrowed one (another array)."""
    rng = np.random.default_rng(9)

    def bf16_exact(shape):
        w = rng.standard_normal(shape).astype(np.float32)
        return (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    w, gate_up, down = bf16_exact((40, 24)), bf16_exact((1, 32, 24)), bf16_exact((1, 24, 16))
    odd = rng.standard_normal((40, 24)).astype(np.float32)
    bits = cpu.Bf16Bits()
    bits.add(w, gate_up, down, odd)
    assert bits.of(w).dtype == np.uint16 and bits.of(w).shape == w.shape
    assert bits.of(odd) is None and bits.of(w.copy()) is None
    np.testing.assert_array_equal(bits.of(gate_up).view(np.uint16).astype(np.uint32) << 16,
                                  gate_up.view(np.uint32))
    base = make_backend("reference", precision="float32").ops
    plain, narrow = cpu.drafter_ops(base), cpu.drafter_ops(base, bits)
    for m in (1, 2, 3, 8):
        x = rng.standard_normal((m, 24)).astype(np.float32)
        got = narrow.linear(x, w)
        np.testing.assert_array_equal(got, plain.linear(x, w))
        want = ref_layers.linear(x, w)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        np.testing.assert_array_equal(narrow.moe_ffn(x, None, None, gate_up, down),
                                      plain.moe_ffn(x, None, None, gate_up, down))
        np.testing.assert_array_equal(narrow.linear(x, odd), plain.linear(x, odd))
        if m <= cpu.GEMV_ROWS:     # the GEMV reads the bits, not the float32 weight beside them
            np.testing.assert_array_equal(
                cpu.weight_side_matmul(x, np.zeros_like(w), bits.of(w)), got)


def _dflash_on(precision: str, block_size: int) -> DFlashDrafter:
    tcfg = size_config("tiny", num_hidden_layers=2, vocab_size=64, rope_scaling=None)
    dcfg = dflash_config(tcfg, num_hidden_layers=1, intermediate_size=32)
    spec = DFlashSpec((1, 0), block_size, tcfg.hidden_size, tcfg.vocab_size, 2)
    target = Model(tcfg, dict(random_weights(tcfg, 3)),
                   make_backend("reference", precision=precision))
    return DFlashDrafter(target, dcfg, dict(random_weights(dcfg, 4, dflash_shapes(dcfg, 2))),
                         spec)


def test_a_cpu_path_drafter_forwards_the_rows_its_depth_needs():
    """On the float32 CPU path a proposal of depth d forwards the block's first d + 1 rows:
    its logits are those of a block-(d + 1) drafter on the float64 reference; without a
    depth, the whole block's.  Off that path the block stays whole.  (The context grows by
    a commit's rows that enter it alone on the CPU path: the same context.)"""
    rng = np.random.default_rng(8)
    feats = rng.standard_normal((2, 6, 2 * 64)).astype(np.float32)
    more = rng.standard_normal((2, 5, 2 * 64)).astype(np.float32)
    roots = np.array([5, 17])

    def propose(precision, block_size, depth):
        drafter = _dflash_on(precision, block_size)
        drafter.start(2, 32)
        drafter.extend_context(feats, np.array([6, 4]))
        # a round's commit: 5 rows, of which 1 and 2 enter (the CPU path injects 2 rows)
        drafter.extend_context(more, np.array([1, 2]))
        assert drafter.context_lengths.tolist() == [7, 6]
        return np.asarray(drafter.draft(roots, depth), np.float64), drafter.trim_block
    for depth, block in ((2, 3), (None, 6)):
        got, trims = propose("float32", 6, depth)
        want, whole = propose("float64", block, depth)
        assert trims and not whole
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    full, _ = propose("float64", 6, 2)          # the whole block's rows 1..2 differ
    assert np.abs(full - propose("float64", 3, 2)[0]).max() > 1e-3


def test_blas_threads_sets_a_count():
    got = cpu.blas_threads(1)
    assert got in (1, None)          # None: this NumPy's BLAS is not OpenBLAS


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision must be one of"):
        make_backend("reference", precision="float16")
    with pytest.raises(ValueError, match="reference backend's CPU path"):
        make_backend("numba", precision="float32")

"""kdtree_numba.layers at real DeepSeek-V3 / Kimi-K2 shapes on a real GPU (marked ``gpu``).

D = 7168, E = 384 (Kimi) / 256 (DeepSeek-V3), k = 8, Im = 2048, V = 163840.  Large weights are
made on the device with CuPy; the float64 reference runs on the host over what it needs (a
random subset of output rows for the vocabulary-sized products, the experts actually chosen).
Run: ``HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -m gpu tests/test_layers_gpu.py``.
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import reference.layers as ref

pytestmark = pytest.mark.gpu
EPS32 = 2.0 ** -24
D, V, IM = 7168, 163840, 2048
LINEAR_SHAPES = [(7168, 1536), (7168, 576), (2048, 7168), (7168, 163840)]   # (K, N)


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def layers():
    import kdtree_numba.layers as layers
    return layers


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def device_normal(cp, shape, scale, seed, bf16):
    """float32 N(0, scale) on the device, or its bf16 rounding as uint16 bits (RNE)."""
    rs = cp.random.RandomState(seed)
    a = rs.standard_normal(shape, dtype=cp.float32) * cp.float32(scale)
    if not bf16:
        return a
    bits = a.view(cp.uint32)
    bits = (bits + cp.uint32(0x7FFF) + ((bits >> 16) & cp.uint32(1))) >> 16
    return bits.astype(cp.uint16)


def widen(cp, w):
    """Device weight (float32, or uint16 bf16 bits) -> float32 with the same values."""
    if w.dtype == cp.uint16:
        return (w.astype(cp.uint32) << 16).view(cp.float32)
    return w


def rows_to_host(cp, w, rows):
    return cp.asnumpy(widen(cp, w[cp.asarray(rows)]))


def dot_bound(x, w_rows, depth):
    return (depth + 2) * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(w_rows.astype(np.float64)).T)


# ============================================================================ linear

@pytest.fixture(scope="module")
def weights(cp):
    cache = {}

    def get(k, n, bf16):
        key = (k, n, bf16)
        if key not in cache:
            cache.clear()   # one at a time: the vocabulary matrix is 4.7 GB in fp32
            cp.get_default_memory_pool().free_all_blocks()
            cache[key] = device_normal(cp, (n, k), 0.02, seed=k + n, bf16=bf16)
        return cache[key]
    return get


@pytest.mark.parametrize("k, n", LINEAR_SHAPES, ids=[f"{k}to{n}" for k, n in LINEAR_SHAPES])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_linear_real_shapes(cp, layers, weights, k, n, bf16):
    w = weights(k, n, bf16)
    rng = np.random.default_rng(k * 7 + n)
    x = rng.standard_normal((65, k)).astype(np.float32)
    check = np.sort(rng.choice(n, min(n, 512), replace=False))
    w_rows = rows_to_host(cp, w, check)
    # the tiled path (M = 65) sums at most K/8 + 12 deep too: >= 8 K slices (tiled_splits)
    assert layers.tiled_depth(k, layers.tiled_config(65, n, k).splits) <= k // 8 + 12
    for m in (1, 8, 16, 65):
        got = host(layers.linear(x[:m], w))
        want = ref.linear(x[:m], w_rows)
        err = np.abs(got[:, check] - want)
        assert np.all(err <= dot_bound(x[:m], w_rows, k // 8 + 12)), (m, err.max())
        assert np.isfinite(got).all()
    # batch invariance, bit for bit, within each path: skinny (M <= 16) rows equal 1-row calls;
    # tiled (M >= 17) rows of the 65-row call equal those of a 17-row call.  Across the two
    # paths the summation orders differ (docs/LAYERS.md).
    skinny = host(layers.linear(x[:16], w))
    for i in (0, 15):
        assert np.array_equal(host(layers.linear(x[i:i + 1], w)), skinny[i:i + 1]), i
    full = host(layers.linear(x, w))
    assert np.array_equal(host(layers.linear(x[48:], w)), full[48:])
    if bf16:   # the bf16 path equals the fp32 path on the same values, bit for bit
        for m in (8, 65):
            assert np.array_equal(host(layers.linear(x[:m], widen(cp, w))),
                                  host(layers.linear(x[:m], w))), m


def test_skinny_f32_load_variants_bit_identical(cp, layers):
    """float32 weights: the xchg loads (two dense half-warp loads + a real xor-16 shuffle; the
    simulator cannot run shuffles), plain streaming and L1-cached loads give the same bits.
    K = 7176: 897 chunks for 128 threads, so the last pass has lanes past the end."""
    k, n = 7176, 512
    w = device_normal(cp, (n, k), 0.02, seed=11, bf16=False)
    x = np.random.default_rng(11).standard_normal((16, k)).astype(np.float32)
    for m in (1, 8):
        base = layers.skinny_config(m, n, k, "f32")
        runs = [host(layers.linear(x[:m], w, config=dataclasses.replace(base, f32_load=v)))
                for v in ("xchg", "stream", "cached")]
        assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2]), m
        w_rows = rows_to_host(cp, w, np.arange(n))
        assert np.all(np.abs(runs[0] - ref.linear(x[:m], w_rows))
                      <= dot_bound(x[:m], w_rows, k // 8 + 12)), m


def test_linear_tiled_prefill(cp, layers, weights):
    k, n = 7168, 1536
    w = weights(k, n, True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1100, k)).astype(np.float32)          # > SKINNY_MAX_M
    got = host(layers.linear(x, w))
    check = np.sort(rng.choice(n, 256, replace=False))
    w_rows = rows_to_host(cp, w, check)
    assert np.all(np.abs(got[:, check] - ref.linear(x, w_rows)) <= dot_bound(x, w_rows, k))


def test_linear_takes_cupy_arrays_and_split_k(cp, layers, weights):
    w = weights(7168, 576, True)
    x = cp.asarray(np.random.default_rng(1).standard_normal((4, 7168)).astype(np.float32))
    plain = host(layers.linear(x, w))
    cfg = layers.SkinnyConfig(mt=4, rows=2, threads=128, unroll=2, splits=4)
    split = host(layers.linear(x, w, config=cfg))
    w_rows = rows_to_host(cp, w, np.arange(576))
    bound = dot_bound(cp.asnumpy(x), w_rows, 7168 // 8 + 12)
    assert np.all(np.abs(plain - split) <= 2 * bound)


# ============================================================================ small ops

def test_rmsnorm_hidden_size(layers):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((65, D)) * 4).astype(np.float32)
    for w in (rng.uniform(0.5, 1.5, D).astype(np.float32),
              rng.uniform(0.5, 1.5, D).astype(ml_dtypes.bfloat16)):
        np.testing.assert_allclose(host(layers.rmsnorm(x, w, 1e-6)), ref.rmsnorm(x, w, 1e-6),
                                   rtol=1e-5)


def test_rope_kimi_heads(layers):
    rng = np.random.default_rng(3)
    spec = ref.RopeSpec.from_hf_config({
        "rope_theta": 50000.0, "qk_rope_head_dim": 64,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096}})
    q = rng.standard_normal((65, 64, 192)).astype(np.float32)
    positions = rng.integers(0, 250_000, 65)
    np.testing.assert_allclose(host(layers.rope(q[:, :, 128:], positions, spec)),
                               ref.rope(q[:, :, 128:], positions, spec), rtol=1e-6, atol=1e-6)
    k_pe = rng.standard_normal((65, 1, 64)).astype(np.float32)
    np.testing.assert_allclose(host(layers.rope(k_pe, positions, spec)),
                               ref.rope(k_pe, positions, spec), rtol=1e-6, atol=1e-6)


def test_argmax_vocab(layers):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((65, V)).astype(np.float32)
    logits[0, [77, 5000, 163_839]] = 50.0
    logits[1, [163_000, 12]] = np.nan
    logits[2] = -np.inf
    assert np.array_equal(host(layers.argmax(logits)), ref.argmax(logits))


def test_embedding_vocab_bf16(cp, layers):
    table = device_normal(cp, (V, D), 1.0, seed=5, bf16=True)
    ids = np.random.default_rng(5).integers(0, V, 65).astype(np.int32)
    got = host(layers.embedding(ids, table))
    assert np.array_equal(got, rows_to_host(cp, table, ids))


# ============================================================================ routing

ROUTERS = {
    "deepseek_v3": (256, dict(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                              routed_scaling_factor=2.5, scoring="sigmoid")),
    "kimi_k2": (384, dict(top_k=8, n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=2.827, scoring="sigmoid")),
    "deepseek_v2_softmax": (160, dict(top_k=6, n_group=8, topk_group=3, norm_topk_prob=False,
                                      routed_scaling_factor=16.0, scoring="softmax")),
}


def decision_margins(logits, bias, n_group, topk_group, top_k, scoring, **_):
    """Per token, the smallest float64 gap that decided the routing (k-th vs next key, and
    topk_group-th vs next group score): fp32 rounding (~1e-7) can only flip tokens whose
    margin is that small."""
    lg = logits.astype(np.float64)
    if scoring == "sigmoid":
        scores = 1 / (1 + np.exp(-lg))
    else:
        z = np.exp(lg - lg.max(1, keepdims=True))
        scores = z / z.sum(1, keepdims=True)
    keys = scores + (0.0 if bias is None else bias.astype(np.float64))
    margins = []
    for row in keys:
        margin = np.inf
        if n_group > 1:
            groups = row.reshape(n_group, -1)
            gs = np.sort(groups, 1)[:, -2:].sum(1) if scoring == "sigmoid" else groups.max(1)
            order = np.argsort(-gs, kind="stable")
            if topk_group < n_group:
                margin = gs[order[topk_group - 1]] - gs[order[topk_group]]
            row = np.where(np.isin(np.arange(n_group), order[:topk_group])[:, None], groups,
                           -np.inf).ravel()
        srt = np.sort(row)[::-1]
        margins.append(min(margin, srt[top_k - 1] - srt[top_k]))
    return np.array(margins)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_real_shapes(layers, name):
    n_experts, case = ROUTERS[name]
    rng = np.random.default_rng(6)
    h = rng.standard_normal((65, D)).astype(np.float32)
    gate = (rng.standard_normal((n_experts, D)) * 0.02).astype(np.float32)
    bias = None if case["scoring"] == "softmax" else \
        (rng.standard_normal(n_experts) * 0.3).astype(np.float32)
    logits = host(layers.router_logits(h, gate))
    want_logits = ref.router_logits(h, gate)
    assert np.all(np.abs(logits - want_logits) <= (D // 8 + 12) * EPS32 *
                  (np.abs(h.astype(np.float64)) @ np.abs(gate.astype(np.float64)).T))
    idx, w = layers.route_from_logits(logits, bias, **case)
    idx, w = host(idx), host(w)
    want_idx, want_w = ref.route_from_logits(logits, bias, **case)   # same fp32 logits
    assert np.all(np.diff(idx, axis=1) > 0)
    clear = decision_margins(logits, bias, **case) > 1e-5
    assert clear.mean() > 0.9
    assert np.array_equal(idx[clear], want_idx[clear])
    np.testing.assert_allclose(w[clear], want_w[clear], rtol=1e-5)
    idx2, _ = layers.moe_route(h, gate, bias, **case)         # linear + select, one call
    assert np.array_equal(host(idx2), idx)


# ============================================================================ MoE FFN

def make_experts(cp, n_experts, inter, used, seed):
    """bf16 expert weights on the device; only the experts in `used` get values (the others
    are never read, and 34 GB of random numbers would only cost time)."""
    gate_up = cp.zeros((n_experts, 2 * inter, D), cp.uint16)
    down = cp.zeros((n_experts, D, inter), cp.uint16)
    for e in sorted(set(used)):
        gate_up[e] = device_normal(cp, (2 * inter, D), 0.02, seed + e, True)
        down[e] = device_normal(cp, (D, inter), 0.02, seed + 1000 + e, True)
    shared_gu = device_normal(cp, (2 * inter, D), 0.02, seed - 1, True)
    shared_dn = device_normal(cp, (D, inter), 0.02, seed - 2, True)
    return gate_up, down, shared_gu, shared_dn


def reference_moe(cp, h, idx, w, gate_up, down, shared_gu, shared_dn):
    """ref.moe_ffn over the chosen experts only (copied to the host, renumbered)."""
    used = np.unique(idx)
    remap = np.zeros(gate_up.shape[0], np.int32)
    remap[used] = np.arange(used.size)

    def bf16(a):
        return cp.asnumpy(a).view(ml_dtypes.bfloat16)
    return ref.moe_ffn(h, remap[idx], w, bf16(gate_up[cp.asarray(used)]),
                       bf16(down[cp.asarray(used)]), bf16(shared_gu), bf16(shared_dn))


@pytest.mark.parametrize("m, inter, popular", [(3, IM, False), (65, 256, False),
                                                (65, 256, True)],
                         ids=["kimi-M3", "M65-Im256", "M65-popular-experts"])
def test_moe_ffn_kimi_shapes(cp, layers, m, inter, popular):
    """M = 3: the skinny expert path; M = 65: the tiled one (auto), and the skinny one asked
    for.  ``popular``: every token also picks experts 5 and 200, so those hold 65 tokens
    (the tiled path's tile then takes them in three chunks of 32)."""
    rng = np.random.default_rng(m)
    n_experts, top_k = 384, 8
    h = rng.standard_normal((m, D)).astype(np.float32)
    others = np.setdiff1d(np.arange(n_experts), [5, 200])
    idx = np.sort(np.stack([np.concatenate([[5, 200], rng.choice(others, top_k - 2, False)])
                            if popular else rng.choice(n_experts, top_k, replace=False)
                            for _ in range(m)]), axis=1).astype(np.int32)
    w = rng.uniform(0.05, 0.5, (m, top_k)).astype(np.float32)
    weights = make_experts(cp, n_experts, inter, idx.ravel(), seed=100 * m)
    got = host(layers.moe_ffn(h, idx, w, *weights))
    want = reference_moe(cp, h, idx, w, *weights)
    # fp32 GEMMs at K = 7168 / Im: relative ~1e-6 of the magnitudes; the outputs are O(1e-2)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    if m > layers.SKINNY_MAX_M:
        skinny = host(layers.moe_ffn(h, idx, w, *weights, method="skinny"))
        np.testing.assert_allclose(skinny, want, rtol=1e-4, atol=1e-4 * scale)
    # batch invariance within the path: M = 3 -> a 1-row call; M = 65 -> a 17-row call
    rows = 1 if m <= layers.SKINNY_MAX_M else layers.SKINNY_MAX_M + 1
    part = host(layers.moe_ffn(h[m - rows:], idx[m - rows:], w[m - rows:], *weights))
    assert np.array_equal(part[-1], got[m - 1])


@pytest.mark.parametrize("m", [4, 65], ids=["skinny", "tiled"])
def test_moe_step_replays_from_a_cuda_graph(cp, layers, m):
    """route + expert FFN with a workspace and preallocated outputs: warm up once, capture on a
    CuPy stream, replay; the replay must equal the eager result (no allocation, no host sync).
    M = 65 runs the tiled experts, the shared-expert token list and the split-K router."""
    from numba import cuda
    rng = np.random.default_rng(8)
    n_experts, inter = 64, 256
    h = cp.asarray(rng.standard_normal((m, D)).astype(np.float32))
    gate = cp.asarray((rng.standard_normal((n_experts, D)) * 0.02).astype(np.float32))
    bias = cp.asarray((rng.standard_normal(n_experts) * 0.3).astype(np.float32))
    weights = make_experts(cp, n_experts, inter, range(n_experts), seed=9)
    case = dict(top_k=8, n_group=8, topk_group=4, norm_topk_prob=True,
                routed_scaling_factor=2.5, scoring="sigmoid")
    ws = layers.Workspace()
    idx, w = cp.zeros((m, 8), cp.int32), cp.zeros((m, 8), cp.float32)
    out = cp.zeros((m, D), cp.float32)
    # Wrap every CuPy array once, outside the capture: importing a CuPy array into numba
    # synchronises on the stream it exports, which a capture forbids.
    nb = cuda.as_cuda_array
    h_, gate_, bias_, idx_, w_, out_ = map(nb, (h, gate, bias, idx, w, out))
    weights_ = tuple(map(nb, weights))
    stream = cp.cuda.Stream(non_blocking=True)
    nstream = cuda.external_stream(stream.ptr)

    def step():
        layers.moe_route(h_, gate_, bias_, out=(idx_, w_), stream=nstream, workspace=ws, **case)
        layers.moe_ffn(h_, idx_, w_, *weights_, out=out_, stream=nstream, workspace=ws)

    step()
    stream.synchronize()
    eager = cp.asnumpy(out)
    out.fill(0)
    cp.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert np.array_equal(cp.asnumpy(out), eager)


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, inter", [(256, 768), (D, 2048)], ids=["demo", "kimi-shared"])
def test_dense_ffn_as_skinny_linears_is_the_one_expert_bitwise(layers, d, inter, bf16,
                                                              monkeypatch):
    """With KDTREE_LEAN_ROUND the dense FFN on the weight-streaming kernels runs as two
    skinny linears around SwiGLU (3 launches, its rows in parallel blocks): bit for bit the
    one-expert MoE (the same core, threads from K alone), at a decode's and a tree verify's
    rows, at the demo model's widths and a Kimi-K2-wide expert's."""
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "1")
    rng = np.random.default_rng(40 + d)
    dtype = ml_dtypes.bfloat16 if bf16 else np.float32
    gu = (rng.standard_normal((1, 2 * inter, d)) / np.sqrt(d)).astype(dtype)
    dn = (rng.standard_normal((1, d, inter)) / np.sqrt(inter)).astype(dtype)
    for m in (1, 16, 17, 33):
        h = rng.standard_normal((m, d)).astype(np.float32)
        dense = host(layers.moe_ffn(h, None, None, gu, dn))
        one = host(layers.moe_ffn(h, np.zeros((m, 1), np.int32), np.ones((m, 1), np.float32),
                                  gu, dn))
        assert dense.tobytes() == one.tobytes(), m
        want = ref.moe_ffn(h[:2], None, None, gu, dn)
        np.testing.assert_allclose(dense[:2], want, rtol=1e-4, atol=1e-4)

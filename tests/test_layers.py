"""reference.layers against independent oracles, and kdtree_numba.layers against the reference.

The reference tests are pure NumPy (Hypothesis over shapes and values).  The kernel tests run
under the CUDA simulator in CI (tiny shapes: every launch costs ~0.1-0.5 s there) and on the GPU
in the GPU suite; real Kimi-K2 shapes are in test_layers_gpu.py.  Tolerances are stated where
used; "bit-identical" claims are exact comparisons.
"""
from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference.layers as ref
from kdtree_numba import compat
from kdtree_numba.compat import cuda, kernel, device_function   # the simulator swaps `cuda`

BF16 = ml_dtypes.bfloat16
EPS32 = 2.0 ** -24   # float32 unit roundoff


def fp32_dot_bound(x, w, depth):
    """Rigorous-style bound for an fp32 dot product summed with at most ``depth`` sequential
    additions per path: |err| <= (depth + 2) u sum_k |x_k w_k| (the +2: product and final
    rounding).  x [M, K], w [N, K] (float64 views of the exact inputs)."""
    return (depth + 2) * EPS32 * (np.abs(ref.as_float64(x)) @ np.abs(ref.as_float64(w)).T)


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


# ============================================================================ reference: RoPE
DEEPSEEK_V3 = {"rope_theta": 10000, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"}}
KIMI_K2 = {"rope_theta": 50000.0, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"}}


@pytest.mark.parametrize("config, published", [(DEEPSEEK_V3, 0.135234), (KIMI_K2, 0.130861)])
def test_yarn_softmax_scale_equals_published_value(config, published):
    spec = ref.RopeSpec.from_hf_config(config)
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert round(spec.softmax_scale(qk_head_dim), 6) == published
    assert spec.interleave and spec.amplitude() == 1.0   # mscale == mscale_all_dim
    assert ref.RopeSpec(theta=1e4, head_dim=64).softmax_scale(192) == 192 ** -0.5


def test_from_hf_config_reads_transformers5_rope_parameters_alike():
    v5 = {"qk_rope_head_dim": 64, "rope_interleave": False,
          "rope_parameters": dict(KIMI_K2["rope_scaling"], rope_type="yarn", rope_theta=5e4)}
    spec = ref.RopeSpec.from_hf_config(v5)
    assert spec.yarn == ref.RopeSpec.from_hf_config(KIMI_K2).yarn and spec.theta == 5e4
    assert not spec.interleave
    assert ref.RopeSpec.from_hf_config({"qk_rope_head_dim": 8, "rope_theta": 1e4}).yarn is None
    with pytest.raises(ValueError):
        ref.RopeSpec.from_hf_config({"qk_rope_head_dim": 8,
                                     "rope_scaling": {"type": "dynamic", "factor": 2}})


@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K2])
def test_yarn_inv_freq_equals_scalar_formula(config):
    """The notes' formula, channel by channel in plain Python floats."""
    spec = ref.RopeSpec.from_hf_config(config)
    y, dr, base = spec.yarn, spec.head_dim, spec.theta

    def corr(n):
        return dr * math.log(y.original_max_position_embeddings / (2 * math.pi * n)) \
            / (2 * math.log(base))
    low, high = max(math.floor(corr(y.beta_fast)), 0), min(math.ceil(corr(y.beta_slow)), dr - 1)
    high = high + 0.001 if low == high else high
    for i, got in enumerate(spec.inv_freq()):
        theta = base ** (-2 * i / dr)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        assert got == pytest.approx(theta / y.factor * ramp + theta * (1 - ramp), rel=1e-12)
    # first channels rotate fastest and keep their frequency; the last are divided by factor
    assert spec.inv_freq()[0] == 1.0
    assert spec.inv_freq()[-1] == pytest.approx(base ** (-(dr - 2) / dr) / y.factor, rel=1e-12)


def hf_rope(x, positions, spec):
    """HF's formula written independently: cos/sin of cat(freqs, freqs); interleaved inputs are
    permuted to [0, 2, 4, .., 1, 3, 5, ..] first; then q * cos + rotate_half(q) * sin."""
    x = x.astype(np.float64)
    dr = x.shape[-1]
    freqs = np.outer(positions.astype(np.float64), spec.inv_freq())
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    cos, sin = np.cos(emb) * spec.amplitude(), np.sin(emb) * spec.amplitude()
    if spec.interleave:
        x = x.reshape(*x.shape[:-1], dr // 2, 2).swapaxes(-1, -2).reshape(x.shape)
    rotated = np.concatenate([-x[..., dr // 2:], x[..., : dr // 2]], axis=-1)
    return (x * cos + rotated * sin).astype(np.float32)


@given(m=st.integers(1, 5), h=st.integers(1, 3), half=st.integers(1, 8),
       interleave=st.booleans(), yarn=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_rope_equals_hf_permute_then_rotate_half(m, h, half, interleave, yarn, seed):
    rng = np.random.default_rng(seed)
    spec = ref.RopeSpec(theta=float(rng.choice([1e4, 5e4])), head_dim=2 * half,
                        interleave=interleave,
                        yarn=ref.YarnScaling(32.0, 64, 1.0, 1.0, 1.0, 0.5) if yarn else None)
    x = rng.standard_normal((m, h, 2 * half)).astype(np.float32)
    positions = rng.integers(0, 200_000, m)
    np.testing.assert_allclose(ref.rope(x, positions, spec), hf_rope(x, positions, spec),
                               rtol=1e-6, atol=1e-6)


@given(p1=st.integers(0, 5000), p2=st.integers(0, 5000), shift=st.integers(0, 100_000),
       interleave=st.booleans())
def test_rope_scores_depend_only_on_relative_position(p1, p2, shift, interleave):
    rng = np.random.default_rng(p1 * 7919 + p2)
    spec = ref.RopeSpec.from_hf_config(dict(KIMI_K2, rope_interleave=interleave))
    q, k = rng.standard_normal((2, 1, 1, 64)).astype(np.float32)
    a = np.dot(ref.rope(q, np.array([p1]), spec).ravel(), ref.rope(k, np.array([p2]), spec).ravel())
    b = np.dot(ref.rope(q, np.array([p1 + shift]), spec).ravel(),
               ref.rope(k, np.array([p2 + shift]), spec).ravel())
    assert a == pytest.approx(b, rel=1e-4, abs=1e-4)


# ============================================================================ reference: dense
@given(m=st.integers(1, 4), d=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_rmsnorm_equals_row_loop_and_is_scale_invariant(m, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    got = ref.rmsnorm(x, w, 1e-6)
    for i in range(m):
        rms = math.sqrt(sum(float(v) ** 2 for v in x[i]) / d + 1e-6)
        np.testing.assert_allclose(got[i], w.astype(np.float64) * x[i] / rms, rtol=1e-6)
    np.testing.assert_allclose(ref.rmsnorm(8 * x, w, 0.0), ref.rmsnorm(x, w, 0.0), rtol=1e-6)


def test_add_rmsnorm_reference_is_the_float32_add_then_the_norm():
    rng = np.random.default_rng(13)
    x, delta = rng.standard_normal((2, 3, 9)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 9).astype(np.float32)
    s, y = ref.add_rmsnorm(x, delta, w, 1e-6)
    assert s.dtype == np.float32 and s.tobytes() == (x + delta).tobytes()
    assert y.tobytes() == ref.rmsnorm(x + delta, w, 1e-6).tobytes()


def test_argmax_reference_ties_and_nan():
    rows = np.array([[1, 3, 3, 2], [-np.inf, -np.inf, -np.inf, -np.inf], [0.0, -0.0, 0, -1],
                     [1, np.nan, 5, np.nan]], np.float32)
    assert ref.argmax(rows).tolist() == [1, 0, 0, 1]


def test_embedding_reference_rejects_out_of_range():
    with pytest.raises(ValueError):
        ref.embedding([0, 4], np.zeros((4, 2), np.float32))


# ============================================================================ reference: routing

def _beats(key, f, e):
    return key[f] > key[e] or (key[f] == key[e] and f < e)


def _unique_top(candidates, count, key):
    """The one subset of `candidates` of size `count` whose members all beat all the others:
    found by enumerating every subset (the brute-force oracle)."""
    found = [set(c) for c in itertools.combinations(candidates, count)
             if all(_beats(key, f, e) for f in c for e in set(candidates) - set(c))]
    assert len(found) == 1
    return found[0]


def brute_force_route(logits, bias, *, top_k, n_group, topk_group, norm_topk_prob,
                      routed_scaling_factor, scoring, fill=-np.inf):
    """One token, by enumeration; ``fill`` = value given to dropped groups' experts (the
    transformers 4.57 bug used 0.0)."""
    logits = np.asarray(logits, np.float64)
    E = logits.size
    s = sigmoid(logits) if scoring == "sigmoid" else np.exp(logits) / np.exp(logits).sum()
    key = s + (0.0 if bias is None else np.asarray(bias, np.float64))
    size = E // n_group
    groups = [list(range(g * size, (g + 1) * size)) for g in range(n_group)]
    if scoring == "sigmoid":
        gscore = [max(key[a] + key[b] for a, b in itertools.combinations(g, 2)) for g in groups]
    else:
        gscore = [max(key[a] for a in g) for g in groups]
    kept = _unique_top(range(n_group), topk_group, gscore) if n_group > 1 else {0}
    allowed = [e for g in sorted(kept) for e in groups[g]]
    if np.isfinite(fill):
        key = key.copy()
        key[[e for e in range(E) if e not in allowed]] = fill
        allowed = list(range(E))
    chosen = sorted(_unique_top(allowed, top_k, key))
    w = s[chosen]
    if norm_topk_prob:
        w = w / (w.sum() + 1e-20)
    return chosen, w * routed_scaling_factor


@st.composite
def routing_cases(draw):
    """Small E with many exact ties: logits and biases come from tiny value sets."""
    n_group = draw(st.sampled_from([1, 2, 4]))
    size = draw(st.integers(2, 4))
    E = n_group * size
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(4, topk_group * size)))
    logits = draw(st.lists(st.sampled_from([-1.5, -0.5, 0.25, 0.75, 2.0]), min_size=E,
                           max_size=E))
    bias = draw(st.one_of(st.none(), st.lists(st.sampled_from([-3.0, 0.0, 0.125, 0.5]),
                                              min_size=E, max_size=E)))
    return dict(logits=logits, bias=bias, top_k=top_k, n_group=n_group,
                topk_group=topk_group, norm_topk_prob=draw(st.booleans()),
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 2.827])),
                scoring=draw(st.sampled_from(["sigmoid", "softmax"])))


@settings(max_examples=300)
@given(case=routing_cases())
def test_route_equals_brute_force_enumeration(case):
    logits, bias = case.pop("logits"), case.pop("bias")
    idx, w = ref.route_from_logits(np.array([logits], np.float32),
                                   None if bias is None else np.array(bias, np.float32), **case)
    want_idx, want_w = brute_force_route(logits, bias, **case)
    assert idx[0].tolist() == want_idx
    np.testing.assert_allclose(w[0], want_w, rtol=1e-6)


def test_dropped_groups_are_minus_inf_not_zero():
    """All keys negative (bias -3): 0-filled dropped groups would outrank every kept expert."""
    logits = np.array([2.0, 1.0, 0.5, 0.4, -1.0, -2.0, -2.5, -3.0], np.float32)
    args = dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True,
                routed_scaling_factor=1.0, scoring="sigmoid")
    bias = np.full(8, -3.0, np.float32)
    idx, _ = ref.route_from_logits(logits[None], bias, **args)
    assert idx[0].tolist() == brute_force_route(logits, bias, **args)[0] == [0, 1, 2]
    assert brute_force_route(logits, bias, **args, fill=0.0)[0] == [4, 5, 6]   # the 4.57 bug


def test_weights_come_from_unbiased_scores():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    bias = np.array([10.0, 10.0, 0.0, 0.0], np.float32)   # selects experts 0, 1
    idx, w = ref.route_from_logits(logits, bias, top_k=2, norm_topk_prob=False,
                                   routed_scaling_factor=2.0)
    assert idx[0].tolist() == [0, 1]
    np.testing.assert_allclose(w[0], 2.0 * sigmoid(np.array([0.0, 1.0])), rtol=1e-7)


# ============================================================================ reference: MoE FFN

def per_token_moe(h, expert_idx, weight, gate_up, down, shared_gate_up, shared_down):
    """The obviously-right oracle: token by token, expert by expert, float64."""
    f64 = ref.as_float64
    out = np.zeros(h.shape, np.float64)
    im = gate_up.shape[1] // 2
    for m in range(h.shape[0]):
        x = f64(h[m])
        for j, e in enumerate(expert_idx[m]):
            g, u = f64(gate_up[e][:im]) @ x, f64(gate_up[e][im:]) @ x
            out[m] += float(weight[m, j]) * (f64(down[e]) @ (g / (1 + np.exp(-g)) * u))
        if shared_gate_up is not None:
            si = shared_gate_up.shape[0] // 2
            g, u = f64(shared_gate_up[:si]) @ x, f64(shared_gate_up[si:]) @ x
            out[m] += f64(shared_down) @ (g / (1 + np.exp(-g)) * u)
    return out


def moe_case(rng, m, d, n_experts, inter, top_k, dtype=np.float32, shared=True):
    h = rng.standard_normal((m, d)).astype(np.float32)
    gu = (rng.standard_normal((n_experts, 2 * inter, d)) * 0.3).astype(dtype)
    dn = (rng.standard_normal((n_experts, d, inter)) * 0.3).astype(dtype)
    sgu = (rng.standard_normal((2 * inter, d)) * 0.3).astype(dtype) if shared else None
    sdn = (rng.standard_normal((d, inter)) * 0.3).astype(dtype) if shared else None
    idx = np.sort(np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    w = rng.uniform(0.1, 1.0, (m, top_k)).astype(np.float32)
    return h, idx, w, gu, dn, sgu, sdn


@given(m=st.integers(1, 5), d=st.integers(1, 6), n_experts=st.integers(1, 5),
       inter=st.integers(1, 4), shared=st.booleans(), bf16=st.booleans(),
       seed=st.integers(0, 2 ** 16), data=st.data())
def test_moe_ffn_reference_equals_per_token_loop(m, d, n_experts, inter, shared, bf16, seed,
                                                 data):
    top_k = data.draw(st.integers(1, n_experts))
    rng = np.random.default_rng(seed)
    args = moe_case(rng, m, d, n_experts, inter, top_k, BF16 if bf16 else np.float32, shared)
    np.testing.assert_allclose(ref.moe_ffn(*args), per_token_moe(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bf16", [False, True])
def test_dense_ffn_reference_is_the_explicit_one_expert_routing(bf16):
    """moe_ffn(h, None, None, gate_up [1, 2I, D], down [1, D, I]) is the dense FFN: bitwise the
    call with expert_idx zeros and weight ones, and down (silu(gate h) * up h) by hand."""
    rng = np.random.default_rng(26)
    h, _, _, gu, dn, _, _ = moe_case(rng, 4, 6, 1, 3, 1, BF16 if bf16 else np.float32, False)
    dense = ref.moe_ffn(h, None, None, gu, dn)
    explicit = ref.moe_ffn(h, np.zeros((4, 1), np.int32), np.ones((4, 1), np.float32), gu, dn)
    assert dense.dtype == np.float32 and np.array_equal(dense, explicit)
    g, u = ref.as_float64(h) @ ref.as_float64(gu[0, :3]).T, ref.as_float64(h) @ \
        ref.as_float64(gu[0, 3:]).T
    by_hand = (g / (1 + np.exp(-g)) * u) @ ref.as_float64(dn[0]).T
    np.testing.assert_allclose(dense, by_hand, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("what", ["idx only", "weight only", "two experts", "shared"])
def test_dense_ffn_rejects_what_is_not_dense(what):
    """Both twins call reference.is_dense: a half-given routing, several experts or a shared
    expert with a None routing is a ValueError, not a silent guess."""
    rng = np.random.default_rng(27)
    h, idx, w, gu, dn, sgu, sdn = moe_case(rng, 2, 4, 2, 2, 1)
    args = {"idx only": (h, idx, None, gu[:1], dn[:1]),
            "weight only": (h, None, w, gu[:1], dn[:1]),
            "two experts": (h, None, None, gu, dn),
            "shared": (h, None, None, gu[:1], dn[:1], sgu, sdn)}[what]
    with pytest.raises(ValueError, match="neither|one expert"):
        ref.moe_ffn(*args)
    if compat.kernels_runnable():
        from kdtree_numba import layers
        with pytest.raises(ValueError, match="neither|one expert"):
            layers.moe_ffn(*args)


# ============================================================================ numba twin
# Everything below launches kernels (simulator in CI).  Imported lazily so that a machine with
# neither GPU nor simulator still runs the reference tests above.

def kernels():
    if not compat.kernels_runnable():
        pytest.skip("numba kernels need a GPU or NUMBA_ENABLE_CUDASIM=1")
    import kdtree_numba.layers as layers
    return layers


@pytest.fixture
def gpu_layers():
    return kernels()


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


LINEAR_SHAPES = [(1, 5, 64), (3, 9, 32), (5, 4, 16)]


@pytest.mark.parametrize("m, n, k", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_linear_skinny_matches_reference(gpu_layers, m, n, k, dtype):
    rng = np.random.default_rng(m * 100 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(dtype)
    got = host(gpu_layers.linear(x, w, method="skinny"))
    # depth: K/8 chunks of 8 sequential FMAs per thread at most, plus <= 10 tree levels
    assert np.all(np.abs(got - ref.linear(x, w)) <= fp32_dot_bound(x, w, k + 10))


def test_linear_split_k_and_odd_rows_match_reference(gpu_layers):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal((5, 64)).astype(BF16)
    cfg = gpu_layers.SkinnyConfig(mt=2, rows=2, threads=32, unroll=2, splits=2)
    got = host(gpu_layers.linear(x, w, method="skinny", config=cfg))
    assert np.all(np.abs(got - ref.linear(x, w)) <= fp32_dot_bound(x, w, 64 + 12))


@pytest.mark.parametrize("k", [64, 13], ids=["vector-loads", "scalar-loads"])
def test_linear_bf16_bit_identical_to_f32_of_same_values(gpu_layers, k):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, k)).astype(np.float32)
    wb = rng.standard_normal((6, k)).astype(BF16)
    for method in ("skinny", "tiled"):
        a = host(gpu_layers.linear(x, wb, method=method))
        b = host(gpu_layers.linear(x, wb.astype(np.float32), method=method))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), method


def test_linear_rows_are_batch_invariant(gpu_layers):
    """Row i of a 5-row call equals a 1-row call on row i, bit for bit."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    w = rng.standard_normal((4, 32)).astype(BF16)
    full = host(gpu_layers.linear(x, w))
    for i in (0, 4):
        assert np.array_equal(host(gpu_layers.linear(x[i:i + 1], w)), full[i:i + 1])


@pytest.mark.parametrize("m, n, k", [(9, 10, 13), (3, 7, 8)])
@pytest.mark.parametrize("method", ["tiled", "skinny"])
def test_linear_tiled_and_scalar_paths_match_reference(gpu_layers, m, n, k, method):
    """K = 13 takes the skinny kernel's scalar-load path; both shapes the tiled kernel."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = host(gpu_layers.linear(x, w, method=method))
    assert np.all(np.abs(got - ref.linear(x, w)) <= fp32_dot_bound(x, w, k + 10))


@settings(max_examples=5)
@given(m=st.integers(1, 6), n=st.integers(1, 6), k=st.integers(1, 48), bf16=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_linear_any_shape_matches_reference(m, n, k, bf16, seed):
    gpu_layers = kernels()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(BF16 if bf16 else np.float32)
    got = host(gpu_layers.linear(x, w))
    assert np.all(np.abs(got - ref.linear(x, w)) <= fp32_dot_bound(x, w, k + 10))


@pytest.mark.parametrize("cfg", [
    dict(wm=1, wn=1, ly=1, tm=4, tn=4, bk=8, splits=2),      # lanes all along N, one float4
    dict(wm=1, wn=1, ly=4, tm=4, tn=8, bk=16, splits=3)],     # 4 x 8 lanes, two float4 groups
    ids=["ly1-tn4-split2", "ly4-tn8-split3"])
def test_linear_tiled_layouts_and_splits_match_reference(gpu_layers, cfg):
    """Other tile layouts than the default: M tiles (m = 5 > BM = 4 for the first), an N
    tail, a partial last K stage (K = 40 is not a multiple of bk = 16) and K slices (the
    3-way split is uneven)."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((5, 40)).astype(np.float32)
    w = rng.standard_normal((6, 40)).astype(BF16)
    config = gpu_layers.TiledConfig(**cfg)
    got = host(gpu_layers.linear(x, w, config=config))
    depth = gpu_layers.tiled_depth(40, config.splits)
    assert depth <= 40 + 2
    assert np.all(np.abs(got - ref.linear(x, w)) <= fp32_dot_bound(x, w, depth))


def test_linear_tiled_rows_are_batch_invariant_and_auto_picks_it(gpu_layers, monkeypatch):
    """Above SKINNY_MAX_M rows ``auto`` runs the tiled kernel for a weight over
    SMALL_WEIGHT_ELEMENTS (here the bound is lowered: the simulator cannot afford millions),
    whose per-output summation order depends on the weight shape only: row i of a 17-row call
    equals row i of a 3-row tiled call (and of the whole 17-row call split differently into M
    tiles).  A small weight stays on the skinny kernel."""
    from kdtree_numba.layers import common
    rng = np.random.default_rng(32)
    x = rng.standard_normal((gpu_layers.SKINNY_MAX_M + 1, 24)).astype(np.float32)
    w = rng.standard_normal((5, 24)).astype(np.float32)
    assert np.array_equal(host(gpu_layers.linear(x, w)),
                          host(gpu_layers.linear(x, w, method="skinny")))
    monkeypatch.setattr(common, "SMALL_WEIGHT_ELEMENTS", w.size - 1)
    full = host(gpu_layers.linear(x, w))
    assert np.array_equal(full, host(gpu_layers.linear(x, w, method="tiled")))
    few = host(gpu_layers.linear(x[-3:], w, method="tiled"))
    assert np.array_equal(few, full[-3:])
    assert np.all(np.abs(full - ref.linear(x, w)) <= fp32_dot_bound(x, w, 24))


def test_skinny_f32_load_variants_are_bit_identical(gpu_layers):
    """f32_load = xchg (the default; warp-uniform loops, lanes past the end skip their FMAs),
    stream and cached read the same elements per lane in the same order.  K = 584: 73 chunks
    for 32 threads, so the unrolled loop runs once (2 x 32 chunks) and the guarded remainder
    once with lanes past the end."""
    k = 584
    rng = np.random.default_rng(k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    w = rng.standard_normal((5, k)).astype(np.float32)
    results = {}
    for load in ("xchg", "stream", "cached"):
        cfg = gpu_layers.SkinnyConfig(mt=4, rows=2, threads=32, unroll=2, f32_load=load)
        results[load] = host(gpu_layers.linear(x, w, config=cfg))
    assert np.array_equal(results["xchg"], results["stream"])
    assert np.array_equal(results["xchg"], results["cached"])
    assert np.all(np.abs(results["xchg"] - ref.linear(x, w)) <= fp32_dot_bound(x, w, k + 10))


def test_skinny_x_major_grid_gives_the_same_bits_and_is_picked_for_a_large_x(gpu_layers):
    """x_major orders the linear's blocks weight tile fastest (blocks sharing x rows together):
    only which block runs when changes, so the bits are the default order's, also with a
    partial last x chunk (M = 13, mt = 4), a partial weight tile (N = 7, rows = 2) and split-K.
    skinny_config picks it where x outgrows L2 and the weight (the float32 router at a long
    prefill)."""
    rng = np.random.default_rng(77)
    x = rng.standard_normal((13, 96)).astype(np.float32)
    w = rng.standard_normal((7, 96)).astype(np.float32)
    for splits in (1, 2):
        got = [host(gpu_layers.linear(x, w, config=gpu_layers.SkinnyConfig(
            mt=4, rows=2, threads=32, unroll=2, splits=splits, x_major=major)))
            for major in (False, True)]
        assert got[0].tobytes() == got[1].tobytes(), splits
        assert np.all(np.abs(got[1] - ref.linear(x, w)) <= fp32_dot_bound(x, w, 96 + 10))
    assert gpu_layers.skinny_config(4096, 64, 7168, "f32").x_major
    assert not gpu_layers.skinny_config(65, 64, 7168, "f32").x_major   # x fits L2 (run 123)
    assert not gpu_layers.skinny_config(16, 2112, 7168, "bf16").x_major


def test_x_rows_a_block_move_no_bit(gpu_layers):
    """``skinny_config(..., mt=)`` (dev/cuda/layers.py's "rows" sweep) changes only how many x
    rows a block takes: a row's sums are the same at mt 4, 2 and 1, for both weight kinds, with
    a partial last chunk (M = 7)."""
    rng = np.random.default_rng(19)
    x = rng.standard_normal((7, 64)).astype(np.float32)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    for kind, wd in (("f32", w), ("bf16", w.astype(BF16))):
        got = [host(gpu_layers.linear(x, wd, config=gpu_layers.skinny_config(7, 6, 64, kind,
                                                                             mt=mt)))
               for mt in (4, 2, 1)]
        assert got[0].tobytes() == got[1].tobytes() == got[2].tobytes(), kind
    with pytest.raises(ValueError, match="mt must be one of"):
        gpu_layers.skinny_config(7, 6, 64, "f32", mt=3)


def test_f32_exchange_load_gives_every_lane_its_chunk(gpu_layers):
    """The xchg loader itself, with the shuffle emulated through shared memory: lanes 0-15
    load the first halves of the warp's chunks, lanes 16-31 the second halves, and one xor-16
    exchange must give every lane with a chunk below c1 exactly w[n, 8j:8j+8] -- also in a
    warp whose span crosses c1 (second pass: chunks 35..66, c1 = 60)."""
    @device_function
    def exchange4(s0, s1, s2, s3, scratch):
        t = cuda.threadIdx.x
        scratch[0, t] = s0
        scratch[1, t] = s1
        scratch[2, t] = s2
        scratch[3, t] = s3
        cuda.syncthreads()
        p = t ^ 16
        r = (scratch[0, p], scratch[1, p], scratch[2, p], scratch[3, p])
        cuda.syncthreads()
        return r

    from kdtree_numba.layers.skinny import _make_load_w8_f32_xchg
    load = _make_load_w8_f32_xchg(exchange4)

    @kernel
    def run(w, first, c1, out):
        scratch = cuda.shared.array((4, 32), np.float32)
        t = cuda.threadIdx.x
        for it in range(2):
            v = load(w, 1, first + t + 32 * it, t, c1, scratch)
            for e in range(8):
                out[it, t, e] = v[e]

    w = np.arange(3 * 8 * 70, dtype=np.float32).reshape(3, 8 * 70)
    out = np.full((2, 32, 8), -1.0, np.float32)
    first, c1 = 3, 60
    run[1, 32](w, first, c1, out)
    for it in range(2):
        for lane in range(32):
            j = first + lane + 32 * it
            if j < c1:
                assert np.array_equal(out[it, lane], w[1, 8 * j:8 * j + 8]), (it, lane)


@pytest.mark.parametrize("nacc", [1, 4, 32, 64])
def test_butterfly_block_reduce_sums_every_value(gpu_layers, nacc):
    """The GPU reduction (warp reduce-scatter + warp pass), here with emulated shuffles in the
    simulator: integer-valued inputs make every order exact."""
    from kdtree_numba.gpu.reduce import block_reduce_scratch_shape, make_block_reduce
    threads = 64
    reduce_ = make_block_reduce(nacc, threads, butterfly=True)
    red_shape = (threads // 32 + 1, nacc)
    scr = block_reduce_scratch_shape(nacc, threads)

    @kernel
    def run(values, out):
        red = cuda.shared.array(red_shape, np.float32)
        scratch = cuda.shared.array(scr, np.float32)
        acc = cuda.local.array(nacc, np.float32)
        t = cuda.threadIdx.x
        for i in range(nacc):
            acc[i] = values[t, i]
        reduce_(acc, red, scratch)
        for i in range(t, nacc, threads):
            out[i] = red[threads // 32, i]

    values = np.random.default_rng(nacc).integers(-50, 50, (threads, nacc)).astype(np.float32)
    out = np.zeros(nacc, np.float32)
    run[1, threads](values, out)
    assert np.array_equal(out, values.sum(axis=0))


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_rmsnorm_matches_reference(gpu_layers, dtype):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 40)) * 3).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 40).astype(dtype)
    # fp32 sum of squares (<= D/threads + 10 sequential adds), sqrt, divide, two products
    np.testing.assert_allclose(host(gpu_layers.rmsnorm(x, w, 1e-6)), ref.rmsnorm(x, w, 1e-6),
                               rtol=1e-5)


def test_rmsnorm_register_and_loop_kernels_give_the_same_bits(gpu_layers):
    """The register kernel (a row of <= 32 values a thread) and the loop kernel (wider rows)
    add a thread's squares in the same order, so they agree bit for bit; widths on both sides
    of a multiple of the thread count, and the widest the register kernel takes."""
    from kdtree_numba.compat import to_device
    from kdtree_numba.layers.norm import MAX_PER_THREAD, norm_threads, _rmsnorm_kernel
    threads = norm_threads()
    rng = np.random.default_rng(4)
    for d in (1, threads - 1, threads + 3, MAX_PER_THREAD * threads):
        x = (rng.standard_normal((2, d)) * 3).astype(np.float32)
        w = rng.uniform(0.5, 1.5, d).astype(np.float32)
        got = host(gpu_layers.rmsnorm(x, w, 1e-6))
        np.testing.assert_allclose(got, ref.rmsnorm(x, w, 1e-6), rtol=1e-5)
        loop = to_device(np.zeros_like(x))
        xd = to_device(x)
        _rmsnorm_kernel(threads, False, 0)[2, threads](xd, xd, xd, to_device(w), loop,
                                                       np.float32(1e-6))
        assert np.array_equal(got, host(loop)), d


def test_add_rmsnorm_is_the_add_then_the_norm_bit_for_bit(gpu_layers):
    """add_rmsnorm(x, delta) = (x + delta, rmsnorm(x + delta)) with both outputs bitwise the
    separate float32 add and rmsnorm (so the model's numbers do not move), on the register
    kernel and the loop kernel (rows wider than MAX_PER_THREAD * threads), bf16 weights
    too; within the reference's tolerance; and in place (sum_out = x)."""
    from kdtree_numba.compat import to_device
    from kdtree_numba.layers.norm import MAX_PER_THREAD, norm_threads
    rng = np.random.default_rng(12)
    for d in (40, MAX_PER_THREAD * norm_threads() + 5):
        for dtype in (np.float32, BF16):
            x = (rng.standard_normal((3, d)) * 3).astype(np.float32)
            delta = (rng.standard_normal((3, d)) * 0.1).astype(np.float32)
            w = rng.uniform(0.5, 1.5, d).astype(dtype)
            s, y = gpu_layers.add_rmsnorm(x, delta, w, 1e-6)
            assert host(s).tobytes() == (x + delta).tobytes(), d
            assert host(y).tobytes() == host(gpu_layers.rmsnorm(x + delta, w, 1e-6)).tobytes()
            want_s, want_y = ref.add_rmsnorm(x, delta, w, 1e-6)
            assert np.array_equal(host(s), want_s)
            np.testing.assert_allclose(host(y), want_y, rtol=1e-5)
            xd = to_device(x)
            s_in_place, _ = gpu_layers.add_rmsnorm(xd, delta, w, 1e-6, sum_out=xd)
            assert host(xd).tobytes() == (x + delta).tobytes()


def test_add_rmsnorm_rejects_mismatched_shapes(gpu_layers):
    x = np.zeros((2, 8), np.float32)
    w = np.ones(8, np.float32)
    for twin in (ref, gpu_layers):
        with pytest.raises(ValueError, match="shape"):
            twin.add_rmsnorm(x, np.zeros((2, 7), np.float32), w, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        ref.add_rmsnorm(x, np.zeros((2, 8), np.float64), w, 1e-6)
    with pytest.raises(TypeError, match="float32"):
        gpu_layers.add_rmsnorm(x, np.zeros((2, 8), np.float64), w, 1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_matches_reference_on_a_strided_view(gpu_layers, interleave):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 2, 16 + 8)).astype(np.float32)   # [M, H, dn + dr]
    x = q[:, :, 16:]                                               # the rope part: a view
    positions = np.array([0, 7, 163_000], np.int64)
    spec = ref.RopeSpec(5e4, 8, interleave, ref.YarnScaling(32.0, 64, 1.0, 1.0, 1.0, 0.5))
    # angles, cos/sin and rotation in float64 on both sides: one float32 rounding apart
    np.testing.assert_allclose(host(gpu_layers.rope(x, positions, spec)),
                               ref.rope(x, positions, spec), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_embedding_matches_reference(gpu_layers, dtype):
    table = np.random.default_rng(2).standard_normal((10, 12)).astype(dtype)
    ids = np.array([3, 0, 9, 3], np.int32)
    assert np.array_equal(host(gpu_layers.embedding(ids, table)), ref.embedding(ids, table))
    bad = host(gpu_layers.embedding(np.array([10, -1, 2], np.int64), table))
    assert np.isnan(bad[:2]).all() and np.array_equal(bad[2], ref.embedding([2], table)[0])


def test_argmax_matches_numpy_with_ties_and_nan(gpu_layers):
    rows = np.random.default_rng(9).standard_normal((5, 70)).astype(np.float32)
    rows[0, [5, 40, 63]] = 9.0                 # tie across threads: smallest index wins
    rows[1] = -np.inf
    rows[2, [3, 50]] = np.nan                  # first NaN wins, as np.argmax
    rows[3, :] = 0.0
    rows[3, 33] = -0.0
    assert host(gpu_layers.argmax(rows)).tolist() == ref.argmax(rows).tolist()


def test_argmax_over_rows_wider_than_a_batch_of_loads(gpu_layers):
    """Rows of several load batches a thread (threads x _LOADS_IN_FLIGHT columns each), not a
    multiple of one: the winner in the last, partial batch (where loads are clamped to the
    row's last column), ties between batches and threads, NaN in a later batch."""
    from kdtree_numba.compat import SIMULATOR
    from kdtree_numba.layers.argmax import _LOADS_IN_FLIGHT
    threads = 32 if SIMULATOR else 1024            # as layers.argmax launches it
    width = 2 * threads * _LOADS_IN_FLIGHT + threads // 2 + 3
    rows = np.random.default_rng(12).standard_normal((5, width)).astype(np.float32)
    rows[0, width - 1] = 50.0                            # last column: the clamped slot
    rows[1, [7, width - 10, threads * _LOADS_IN_FLIGHT + 7]] = 60.0   # smallest index wins
    rows[2, [threads * _LOADS_IN_FLIGHT + 1, width - 2]] = np.nan      # first NaN wins
    rows[3, width - 1] = np.nan
    rows[4, :] = -np.inf
    got = host(gpu_layers.argmax(rows)).tolist()
    assert got == ref.argmax(rows).tolist() == [width - 1, 7, threads * _LOADS_IN_FLIGHT + 1,
                                                width - 1, 0]


ROUTING_CASES = [
    dict(top_k=3, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
         scoring="sigmoid"),
    dict(top_k=4, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
         scoring="sigmoid"),
    dict(top_k=3, n_group=2, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
         scoring="softmax"),
]


@pytest.mark.parametrize("case", ROUTING_CASES, ids=["v3-grouped", "kimi", "v2-softmax"])
def test_route_matches_reference_with_exact_ties(gpu_layers, case):
    """Logits/bias from small value sets: many exact ties (equal inputs give equal fp32 and
    float64 keys), no near-ties (distinct keys differ by >> fp32 rounding)."""
    rng = np.random.default_rng(len(str(case)))
    logits = rng.choice(np.float32([-1.5, -0.5, 0.25, 0.75, 2.0]), (3, 16))
    bias = rng.choice(np.float32([-3.0, 0.0, 0.125, 0.5]), 16)
    for b in (bias, None):
        idx, w = gpu_layers.route_from_logits(logits, b, **case)
        want_idx, want_w = ref.route_from_logits(logits, b, **case)
        assert np.array_equal(host(idx), want_idx)
        np.testing.assert_allclose(host(w), want_w, rtol=2e-6)   # fp32 sigmoid/softmax/divide


def test_moe_route_end_to_end(gpu_layers):
    """Router GEMM + selection; dyadic h and gate weights make the fp32 logits exact."""
    rng = np.random.default_rng(1)
    h = (rng.integers(-4, 5, (2, 16)) / 4).astype(np.float32)
    gate = (rng.integers(-4, 5, (8, 16)) / 8).astype(np.float32)
    gate[5] = gate[2]                                      # an exact tie between experts 2, 5
    bias = np.zeros(8, np.float32)
    case = dict(top_k=2, n_group=2, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, scoring="sigmoid")
    idx, w = gpu_layers.moe_route(h, gate, bias, **case)
    want_idx, want_w = ref.moe_route(h, gate, bias, **case)
    assert np.array_equal(host(idx), want_idx)
    np.testing.assert_allclose(host(w), want_w, rtol=2e-6)


def moe_tolerance(args):
    """|err| bound for moe_ffn: fp32 GEMMs (relative ~1e-6 of the absolute-value sums at
    these tiny K) propagated through silu*up and the weighted sum; 1e-5 of the magnitude of
    every term is a comfortable bound."""
    h, idx, w, gu, dn, sgu, sdn = args
    mag = per_token_moe(np.abs(h), idx, np.abs(w), np.abs(ref.as_float64(gu)),
                        np.abs(ref.as_float64(dn)),
                        None if sgu is None else np.abs(ref.as_float64(sgu)),
                        None if sdn is None else np.abs(ref.as_float64(sdn)))
    return 1e-5 * (np.abs(mag) + 1e-3)


@pytest.mark.parametrize("dtype, shared, d, inter",
                         [(BF16, True, 16, 8), (np.float32, False, 16, 8),
                          (BF16, True, 12, 6)],
                         ids=["bf16-shared", "f32-noshared", "bf16-scalar-loads"])
def test_moe_ffn_matches_reference(gpu_layers, dtype, shared, d, inter):
    rng = np.random.default_rng(21)
    args = list(moe_case(rng, 5, d, 8, inter, 2, dtype, shared))
    # expert 3 is picked by all 5 tokens: more than one MT-row chunk of its token list
    args[1] = np.array([[3, 5], [0, 3], [3, 7], [1, 3], [3, 6]], np.int32)
    got = host(gpu_layers.moe_ffn(*args))
    want = ref.moe_ffn(*args)
    assert np.all(np.abs(got - want) <= moe_tolerance(args))


def test_moe_ffn_tiled_matches_reference_and_is_batch_invariant(gpu_layers):
    """The tiled expert path (what auto runs above SKINNY_MAX_M tokens): expert 3 holds more
    tokens than the tile's BM, so its tokens run in two chunks.  A token alone gives its
    batch result bit for bit through the routed experts (its experts hold one token alone,
    expert 3 holds BM + 1 in the batch), and with the shared expert, whose linear() calls
    follow the explicit method="tiled" (with "auto" the lone token's would be skinny)."""
    layers = gpu_layers
    small = layers.expert_tiled_configs(64)[0][0]
    m = small.bm + 1
    rng = np.random.default_rng(25)
    args = list(moe_case(rng, m, 16, 8, 8, 2, BF16, True))
    args[1] = np.sort(np.stack([[3, e] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], m)]),
                      axis=1).astype(np.int32)
    got = host(layers.moe_ffn(*args, method="tiled"))
    assert np.all(np.abs(got - ref.moe_ffn(*args)) <= moe_tolerance(args))
    h, idx, w, gu, dn = args[:5]
    routed = host(layers.moe_ffn(h, idx, w, gu, dn, None, None, method="tiled"))
    one = host(layers.moe_ffn(h[m - 1:], idx[m - 1:], w[m - 1:], gu, dn, None, None,
                              method="tiled"))
    assert np.array_equal(one[0], routed[m - 1])
    one_shared = host(layers.moe_ffn(h[m - 1:], idx[m - 1:], w[m - 1:], *args[3:],
                                     method="tiled"))
    assert np.array_equal(one_shared[0], got[m - 1])


def test_dense_ffn_is_the_one_expert_case(gpu_layers):
    """How the model runs a dense layer: expert_idx zeros [M, 1], weight ones, no shared."""
    rng = np.random.default_rng(24)
    h = rng.standard_normal((3, 16)).astype(np.float32)
    gu = (rng.standard_normal((1, 24, 16)) * 0.3).astype(BF16)
    dn = (rng.standard_normal((1, 16, 12)) * 0.3).astype(BF16)
    args = (h, np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32), gu, dn, None, None)
    got = host(gpu_layers.moe_ffn(*args))
    assert np.all(np.abs(got - ref.moe_ffn(*args)) <= moe_tolerance(args))


@pytest.mark.parametrize("method", ["auto", "skinny", "tiled", "tensor-cores"])
def test_dense_ffn_without_routing_equals_the_explicit_routing(gpu_layers, method):
    """A dense call (expert_idx, weight None) off tensor cores fills the one-expert routing on
    the device: bitwise the explicit zeros / ones, within the tolerance of the reference
    ("tensor-cores" at I = 12, not a multiple of 8, falls back to "skinny" here)."""
    rng = np.random.default_rng(28)
    h, _, _, gu, dn, _, _ = moe_case(rng, 3, 16, 1, 12, 1, BF16, False)
    explicit = host(gpu_layers.moe_ffn(h, np.zeros((3, 1), np.int32),
                                       np.ones((3, 1), np.float32), gu, dn, method=method))
    dense = host(gpu_layers.moe_ffn(h, None, None, gu, dn, method=method))
    assert np.array_equal(dense, explicit)
    args = (h, np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32), gu, dn, None, None)
    assert np.all(np.abs(dense - ref.moe_ffn(h, None, None, gu, dn)) <= moe_tolerance(args))


def test_moe_ffn_rows_are_batch_invariant(gpu_layers):
    rng = np.random.default_rng(22)
    args = moe_case(rng, 3, 16, 4, 8, 2, BF16, True)
    full = host(gpu_layers.moe_ffn(*args))
    h, idx, w = args[:3]
    one = host(gpu_layers.moe_ffn(h[1:2], idx[1:2], w[1:2], *args[3:]))
    assert np.array_equal(one[0], full[1])


def test_workspace_reuses_buffers(gpu_layers):
    rng = np.random.default_rng(23)
    args = moe_case(rng, 2, 16, 4, 8, 2, BF16, False)
    ws = gpu_layers.Workspace()
    from kdtree_numba.layers.workspace import device_empty
    out = device_empty((2, 16), np.float32)
    first = host(gpu_layers.moe_ffn(*args, out=out, workspace=ws)).copy()
    n_buffers = len(ws._buffers)
    second = host(gpu_layers.moe_ffn(*args, out=out, workspace=ws))
    assert len(ws._buffers) == n_buffers and np.array_equal(first, second)


def test_vectors_reproduce(gpu_layers):
    """The committed KDTR vectors: the reference recomputes their outputs exactly, and the
    kernels within the tolerances above (a C++ port is checked the same way)."""
    from pathlib import Path
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "tools" / "vectors_layers.py"
    spec = importlib.util.spec_from_file_location("vectors_layers", path)
    vectors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vectors)
    files = sorted((Path(__file__).parent / "vectors").glob("layers_*.kdtr"))
    assert files, "tests/vectors/layers_*.kdtr missing: run python3 tools/make_vectors.py layers"
    for f in files:
        vectors.check_file(f, gpu_layers)


# ============================================================================ compile check
_COMPILE_CHECK = r'''
import dataclasses, re, sys
import numba.cuda.dispatcher as dispatcher
from numba import cuda, types as T
from cuda.bindings import nvjitlink as nj
import kdtree_numba.layers as L
from kdtree_numba.layers.moe import _expert_kernel
from kdtree_numba.layers.moe_shapes import shared_expert_config
from kdtree_numba.layers.skinny import skinny_linear_kernel
from kdtree_numba.layers.tiled import tiled_kernel

class _Sm90:                      # device functions ask the (absent) device for its cc
    compute_capability = (9, 0)
dispatcher.get_current_device = lambda: _Sm90()

def ptxas(ptx, max_registers=0):
    opts = ["-arch=sm_90", "-O3", "-verbose"]
    if max_registers:              # what numba passes for jit(max_registers=...)
        opts.append(f"-maxrregcount={max_registers}")
    h = nj.create(len(opts), opts)
    nj.add_data(h, nj.InputType.PTX, ptx.encode(), len(ptx), "k.ptx")
    nj.complete(h)
    log = bytearray(nj.get_info_log_size(h)); nj.get_info_log(h, log); nj.destroy(h)
    return log.decode()

f2, u2 = T.float32[:, ::1], T.uint32[:, ::1]
i1, i64 = T.int32[::1], T.int64
configs = set()
for k, n in [(7168, 1536), (7168, 576), (2048, 7168), (7168, 163840), (7168, 384)]:
    for m in (1, 2, 4, 8, 16):
        for kind in ("f32", "bf16"):
            configs.add(("linear", L.skinny_config(m, n, k, kind), kind))
    for m in (17, 65, 100, 1100):      # (splits is a launch argument: one kernel for all)
        for kind in ("f32", "bf16"):
            configs.add(("tiled", dataclasses.replace(L.tiled_config(m, n, k), splits=1), kind))
for m in (512, 4096):             # the float32 router past 16 rows (tensor-cores): x_major
    configs.add(("linear", L.skinny_config(m, 64, 7168, "f32"), "f32"))
for m in (1, 3, 16):
    for k_in, gate_up in ((7168, True), (2048, False)):
        configs.add(("expert", L.expert_config(m, 8, 384, k_in, gate_up), gate_up))
for m in (1, 65, 200, 4096):      # W4A16 (int4 experts, group 32): every mt the sizes pick
    for k_in, gate_up in ((7168, True), (2048, False)):
        configs.add(("int4_expert", L.expert_config(m, 8, 384, k_in, gate_up, True), gate_up))
for m in (1, 9, 65):              # KDTREE_SHARED_IN_EXPERTS: int4 experts, the shared bf16
    for k_in, gate_up, n in ((7168, True, 4096), (2048, False, 7168)):
        cfg = L.expert_config(m, 8, 384, k_in, gate_up, True)
        shared = (shared_expert_config(m, n, k_in, "bf16", cfg.threads, gate_up), "bf16")
        configs.add(("int4_shared", cfg, (gate_up, shared)))
for m in (1, 8):                  # KDTREE_GROUP_IN_EXPERTS: the gate_up launch groups
    cfg = L.expert_config(m, 8, 384, 7168, True, True)
    shared = (shared_expert_config(m, 4096, 7168, "bf16", cfg.threads, True), "bf16")
    configs.add(("int4_grouping", cfg, (True, shared)))
for m in (17, 65):
    for cfg, _, _ in L.expert_tiled_configs(m):
        for mode in ("gate_up", "down"):
            configs.add(("tiled_expert", cfg, mode))
bad = []
for what, cfg, extra in sorted(configs, key=str):
    # skinny: no spills, and 3 blocks of 128 threads per SM: 65536 / (3 * 128) = 170
    # registers, allocated in steps of 8; 144 is the step the float32 (rows 2, unroll 4)
    # kernel needs (138), which still leaves 3 blocks per SM, as 136 did
    limit, spill_limit = 144, 0
    if what == "linear":
        fn, sig = skinny_linear_kernel(cfg, extra), (f2, u2 if extra == "bf16" else f2,
                                                       T.float32[:, :, ::1], i64, i64, i64, i64, i64)
    elif what == "expert":
        fn = _expert_kernel(cfg, "bf16", extra)
        sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.float32[::1], f2, i64, i64, i64)
    elif what == "int4_expert":
        # the nibbles' unpacking holds more live values: <= 176 registers (168 measured at
        # mt 2: 6 blocks of 64 threads per SM), still no spill and no local memory
        limit = 176
        fn = _expert_kernel(cfg, "i4", extra, 32)
        sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2, i64, i64, i64)
    elif what == "int4_shared":
        limit = 176
        fn = _expert_kernel(cfg, "i4", extra[0], 32, 1, extra[1])
        sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2, i64, i64, i64,
               i64, f2, u2, T.float32[:, :, ::1], i64, i64, i64, i64)
    elif what == "int4_grouping":
        limit = 176
        fn = _expert_kernel(cfg, "i4", True, 32, 1, extra[1], grouping=384)
        sig = (i1, i64, i1, f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2,
               i64, i64, i64, i64, f2, u2, T.float32[:, :, ::1], i64, i64, i64, i64)
    elif extra in ("f32", "bf16"):
        fn = tiled_kernel(cfg, extra, "linear")
        sig = (f2, u2 if extra == "bf16" else f2, f2, i64, i64, i64, i64, i64, i64)
    else:
        fn = tiled_kernel(cfg, "bf16", extra)
        sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], f2, i64, i64, i64, i64, i64)
    if what.startswith("tiled"):
        # capped tiles (max_registers) may spill a few words, all outside the k loop (checked
        # in the SASS when the caps were chosen, docs/LAYERS.md); the accumulators never.
        limit, spill_limit = (cfg.max_registers or 255), (160 if cfg.max_registers else 0)
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=(9, 0))
    log = ptxas(ptx, cfg.max_registers if what.startswith("tiled") else 0)
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    print(what, cfg, extra, "regs", regs, "spills", spills, "local", local, flush=True)
    if local or spills > spill_limit or regs > limit:
        bad.append((what, cfg, extra, regs, spills, local))
print("BAD", bad)
sys.exit(1 if bad else 0)
'''


@pytest.mark.slow
def test_kernels_compile_to_registers_only(tmp_path):
    """Every skinny/expert/tiled configuration the heuristics pick at real shapes, compiled to
    PTX for sm_90 and assembled by ptxas (nvJitLink) on a CPU machine: no local memory in the
    PTX (accumulators in registers); skinny kernels no spills and <= 144 registers (3+ blocks
    of 128 threads per SM), the int4 (W4A16) expert kernels (with the
    shared expert's blocks too) <= 176; tiled kernels within their register cap and <= 160 bytes of
    spill.  A GPU run would not notice: it would just be slow."""
    import os
    import subprocess
    import sys
    if compat.gpu_available():
        pytest.skip("hardware-independent and ~3 min: run it on a CPU machine (-m slow)")
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    script = tmp_path / "compile_check.py"
    script.write_text(_COMPILE_CHECK)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=3000)
    if "nvvm" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (numba-cuda[cu13] extra)")
    bad = [line for line in proc.stdout.splitlines() if line.startswith("BAD")]
    assert proc.returncode == 0, (bad or [proc.stdout[-2000:]], proc.stderr[-3000:])


def test_a_small_weight_streams_up_to_a_prompts_rows():
    """``auto``'s rule (common.takes_tiled): a large weight goes tiled from SKINNY_MAX_M + 1
    rows; a small one (the demo target's every weight: its largest, the 8,192 x 256 lm_head,
    is SMALL_WEIGHT_ELEMENTS) streams up to SMALL_WEIGHT_MAX_M rows, a 512-row prefill's,
    where the tiled kernel's few blocks cost 2.5x (docs/GPU_RESULTS.md, run 183)."""
    from kdtree_numba.layers import common
    small, large = common.SMALL_WEIGHT_ELEMENTS, common.SMALL_WEIGHT_ELEMENTS + 1
    assert 8192 * 256 == small
    assert not common.takes_tiled(common.SKINNY_MAX_M, large)
    assert common.takes_tiled(common.SKINNY_MAX_M + 1, large)
    assert not common.takes_tiled(512, small) and common.SMALL_WEIGHT_MAX_M == 512
    assert common.takes_tiled(513, small)

"""Absorbed-MLA attention on a real GPU at Kimi-K2 widths (H=64, r=512, dr=64).

Run on the lent H200: ``HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -m gpu tests/test_attention_gpu.py``.
Every comparison is against the float64 reference with ``reference.attention.fp32_error_bound``
(derivation in its docstring).  To keep the tests sensitive to masking errors despite thousands
of prefix keys, queries are scaled so prefix scores are ~N(0, 1) and the new (tree) keys get a
+4 score boost through one rope channel: each visible new key then carries a few percent of the
softmax mass, far above the tolerance (~1e-3 of max|v|).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import attention as ref
from reference.attention import tree_visible

pytestmark = pytest.mark.gpu

H, R, DR = 64, 512, 64
KIMI_TAU = float(np.float32(0.130861))


def random_tree_visible(rng, n: int, tree_nodes: int | None = None) -> np.ndarray:
    """A random tree over the first ``tree_nodes`` rows, diagonal-only padding rows after."""
    m = n if tree_nodes is None else tree_nodes
    vis = np.eye(n, dtype=bool)
    vis[:m, :m] = tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, m)])
    return vis


def make_problem(rng, prefix, n, visible, heads=H, r=R, dr=DR, tau=KIMI_TAU, boost=4.0,
                 spare=3):
    prefix = np.asarray(prefix, np.int32)
    bs, d = len(prefix), r + dr
    max_len = int(prefix.max()) + n + spare
    scale = 1.0 / (tau * np.sqrt(d))                  # prefix scores ~ N(0, 1)
    q_abs = (rng.standard_normal((bs, n, heads, r)) * scale).astype(np.float32)
    q_pe = (rng.standard_normal((bs, n, heads, dr)) * scale).astype(np.float32)
    ckv = rng.standard_normal((bs, max_len, r)).astype(np.float32)
    kpe = rng.standard_normal((bs, max_len, dr)).astype(np.float32)
    q_pe[..., 0] = 1.0 / tau                          # rope channel 0 carries the boost:
    kpe[..., 0] = 0.0
    for b in range(bs):                               # new keys score +boost
        kpe[b, prefix[b]:prefix[b] + n, 0] = boost
    return dict(q_abs=q_abs, q_pe=q_pe, ckv=ckv, kpe=kpe, prefix_len=prefix,
                visible=np.asarray(visible, bool), tau=tau)


VARIANTS = ("tf32x3", "pipe16x2")  # the package's kernels (the rest: dev/cuda/attention.py)


def check(prob, variants=VARIANTS, **kwargs):
    """Each variant (and each kwargs set, e.g. a forced split size) against one reference;
    the tensor-core one where its tiles fit the widths."""
    from kdtree_numba import attention as kernels
    from kdtree_numba.attention import mma_fits
    assert set(VARIANTS) == set(kernels.VARIANTS)
    want = ref.mla_attention(**prob, out_dtype=np.float64)
    tol = ref.fp32_error_bound(**prob)
    r, dr = prob["q_abs"].shape[-1], prob["q_pe"].shape[-1]
    for variant in variants:
        if kernels.uses_tensor_cores(variant) and not mma_fits(r, dr):
            continue
        got = kernels.mla_attention(**prob, **kwargs, variant=variant).copy_to_host()
        err = np.abs(got - want)
        worst = np.unravel_index(np.argmax(err), err.shape)
        assert err.max() <= tol, \
            f"{variant}: max error {err.max():.3g} > {tol:.3g} at {worst}"
    return got


def test_verify_kimi_dims_bs16_n65_prefix4096_tree_masks():
    rng = np.random.default_rng(10)
    n = 65
    visible = np.stack([random_tree_visible(rng, n, int(rng.integers(1, n + 1)))
                        for _ in range(16)])
    check(make_problem(rng, [4096] * 16, n, visible))


def test_ragged_prefixes_including_zero_and_tile_non_multiples():
    rng = np.random.default_rng(11)
    prefixes = [0, 1, 31, 33, 95, 1000, 4095, 4097]
    n = 65
    visible = np.stack([random_tree_visible(rng, n, 40) for _ in prefixes])
    prob = make_problem(rng, prefixes, n, visible)
    check(prob)
    check(prob, keys_per_split=96)  # many splits + merge on the same inputs
    check(prob, keys_per_split=40)  # splits that are not a multiple of any tile size


def test_decode_bs64_prefix4096_uses_key_splits():
    from kdtree_numba import attention as kernels
    rng = np.random.default_rng(12)
    prefixes = 4096 + rng.integers(-40, 40, size=64)
    prob = make_problem(rng, prefixes, 1, np.ones((64, 1, 1), bool))
    for variant in VARIANTS:
        plan = kernels.MlaAttentionPlan(64, 1, H, R, DR, prob["ckv"].shape[1],
                                        max_keys=int(prefixes.max()) + 1, variant=variant)
        assert plan.splits > 1
    check(prob)


def test_scores_far_above_the_running_max_rescale_the_accumulator():
    """Scores that climb by ~120 over the prefix (more than ln(FLT_MAX) = 88, so a reference
    point that lagged behind would overflow), a late spike of +40, and ordinary scores: the
    kernel's lazy rescaling (reference moves only past an 8-nat slack) must stay exact."""
    rng = np.random.default_rng(17)
    prefixes, n = [4096, 4096, 1500], 9
    visible = np.stack([random_tree_visible(rng, n) for _ in prefixes])
    prob = make_problem(rng, prefixes, n, visible, boost=0.0)
    kpe = prob["kpe"]  # q_pe[..., 0] = 1/tau, so slot t's score gains exactly kpe[t, 0]
    kpe[0, :, 0] = np.linspace(0.0, 120.0, kpe.shape[1])
    kpe[1, 3000, 0] = 40.0
    check(prob)
    check(prob, keys_per_split=1000)


def test_single_long_request_is_split_across_the_gpu():
    rng = np.random.default_rng(13)
    check(make_problem(rng, [16384], 1, np.ones((1, 1, 1), bool)))
    check(make_problem(rng, [16383], 5, random_tree_visible(rng, 5)[None]))


def test_causal_prefill_padded_rows_and_rows_that_see_nothing():
    rng = np.random.default_rng(14)
    n = 33
    causal = np.tril(np.ones((n, n), bool))
    empty = np.zeros((n, n), bool)
    empty[20:, 20:] = np.eye(n - 20, dtype=bool)      # rows 0..19 see nothing at all
    prob = make_problem(rng, [0, 0, 700], n, np.stack([causal, empty, causal]))
    u = check(prob)
    assert np.all(u[1, :20] == 0.0)


@pytest.mark.parametrize("variant", ["tf32x3"])
def test_causal_gives_the_same_bits_at_kimi_dims(variant):
    """causal=True stops each block after its last query's keys (prefill, DDTree masks): a
    prefill of 300 tokens after prefixes 0 and 129 and a 65-node tree verify at ragged
    prefixes, in the default plan (several splits at the long prefix) and the batch-invariant
    one, have the bits of causal=False and stay within the fp32 bound."""
    from kdtree_numba import attention as kernels
    rng = np.random.default_rng(23)
    prefill = np.tril(np.ones((300, 300), bool))
    trees = np.stack([random_tree_visible(rng, 65, 50) for _ in range(3)])
    for prob in (make_problem(rng, [0, 129], 300, np.stack([prefill, prefill])),
                 make_problem(rng, [0, 200, 3000], 65, trees)):
        want = ref.mla_attention(**prob, out_dtype=np.float64)
        tol = ref.fp32_error_bound(**prob)
        for invariant in (False, True):
            full, causal = (kernels.mla_attention(**prob, variant=variant, causal=c,
                                                  batch_invariant=invariant).copy_to_host()
                            for c in (False, True))
            assert causal.tobytes() == full.tobytes(), (variant, invariant)
            assert np.abs(causal - want).max() <= tol
    # the flag really skips: a 300-token prefill in 128-key splits; the blocks of the first
    # 256 queries never reach split 2, so its partial rows stay as poisoned
    prob = make_problem(rng, [0], 300, prefill[None])
    plan = kernels.MlaAttentionPlan(1, 300, H, R, DR, prob["ckv"].shape[1], keys_per_split=128,
                                    variant=variant)
    assert plan.splits == 3
    args = [prob[k] for k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible", "tau")]
    full = plan(*args).copy_to_host()
    plan.part_ml.copy_to_device(np.full(plan.part_ml.shape, np.nan, np.float32))
    causal = plan(*args, causal=True).copy_to_host()
    assert causal.tobytes() == full.tobytes()
    part_ml = plan.part_ml.copy_to_host()
    assert np.isnan(part_ml[0, 2, :256 * H]).all() and not np.isnan(part_ml[0, 2, 256 * H:]).any()


def test_small_kimi_problem_for_the_sanitizers():
    """A few tiles at Kimi widths, every variant, one and several splits: small enough for
    ``compute-sanitizer --tool memcheck`` / ``--tool racecheck`` (run with ``-k sanitizers``).
    Prefixes 0 and 37 put zero-filled slots past kend in the first and last tiles."""
    rng = np.random.default_rng(18)
    n = 5
    visible = np.stack([random_tree_visible(rng, n), np.tril(np.ones((n, n), bool))])
    prob = make_problem(rng, [37, 0], n, visible, spare=0)
    check(prob)
    check(prob, keys_per_split=16)


def test_absorb_q_and_apply_uv_at_kimi_dims():
    from kdtree_numba import attention as kernels
    rng = np.random.default_rng(15)
    dn = dv = 128
    kv_b_proj = (rng.standard_normal((H * (dn + dv), R)) / np.sqrt(R)).astype(np.float32)
    q_nope = rng.standard_normal((4, 17, H, dn)).astype(np.float32)
    u = rng.standard_normal((4, 17, H, R)).astype(np.float32)
    # float32 dot products of K = 128 (absorb) or 512 (apply) terms, |terms| ~ 1/sqrt(512):
    # error ~ sqrt(K) * 2^-24 * sum|x y| < 1e-5; allow 1e-4.
    np.testing.assert_allclose(kernels.absorb_q(q_nope, kv_b_proj).copy_to_host(),
                               ref.absorb_q(q_nope, kv_b_proj), rtol=0, atol=1e-4)
    np.testing.assert_allclose(kernels.apply_uv(u, kv_b_proj, dv).copy_to_host(),
                               ref.apply_uv(u, kv_b_proj, dv), rtol=0, atol=1e-4)


@pytest.mark.parametrize("bs, n, dims", [(1, 1, "kimi"), (1, 5, "kimi"), (16, 1, "kimi"),
                                         (2, 8, "kimi"), (1, 33, "kimi"), (1, 64, "kimi"),
                                         (1, 1, "demo"), (1, 16, "demo"), (1, 17, "demo"),
                                         (1, 33, "demo"), (1, 128, "demo")])
def test_absorb_q_and_apply_uv_streaming_equals_tiled(bs, n, dims, monkeypatch):
    """Up to 64 rows "auto" streams the weights (one column per thread, x in shared
    memory), and at any M over small head weights (the demo's 128-row prefill); its bits
    equal the tiled kernel's, which M > 64 takes at Kimi-K2's widths: a decode's projections
    equal a verify's row for row (batch invariance), and both match the reference.  At
    Kimi-K2's widths 16 rows a block, at the demo model's with KDTREE_LEAN_ROUND one
    (stream_rows)."""
    from kdtree_numba import attention as kernels
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "1" if dims == "demo" else "0")
    rng = np.random.default_rng(16 + bs * n)
    heads, r, dn = (H, R, 128) if dims == "kimi" else (8, 128, 32)
    dv = dn
    kv_b_proj = (rng.standard_normal((heads * (dn + dv), r)) / np.sqrt(r)).astype(np.float32)
    q_nope = rng.standard_normal((bs, n, heads, dn)).astype(np.float32)
    u = rng.standard_normal((bs, n, heads, r)).astype(np.float32)
    out = {}
    for kind in ("stream", "tiled"):
        out[kind] = (kernels.absorb_q(q_nope, kv_b_proj, kernel_kind=kind).copy_to_host(),
                     kernels.apply_uv(u, kv_b_proj, dv, kernel_kind=kind).copy_to_host())
    np.testing.assert_allclose(out["stream"][0], ref.absorb_q(q_nope, kv_b_proj), rtol=0,
                               atol=1e-4)
    np.testing.assert_allclose(out["stream"][1], ref.apply_uv(u, kv_b_proj, dv), rtol=0,
                               atol=1e-4)
    assert out["stream"][0].tobytes() == out["tiled"][0].tobytes(), "absorb_q"
    assert out["stream"][1].tobytes() == out["tiled"][1].tobytes(), "apply_uv"


def test_bf16_head_products_at_kimi_dims_are_within_the_bound_and_batch_invariant():
    """absorb_q / apply_uv on bf16 tensor cores (Bf16HeadWeights, the "tensor-cores"
    setting) at H 64, dn = dv 128, r 512: every output within docs/LAYERS.md's bf16 bound
    (mma_error_coefficient(K) sum_k |x_k w_k|, K = dn or r: x and kv_b_proj rounded to bf16,
    the fp32 mma chain) of the float64 reference, and each row's bits the same at M = 1, 33,
    65 and 200 (decode, verifies, prefill): the tile never looks at the other rows."""
    from kdtree_numba import attention as kernels
    from kdtree_numba.layers import mma_error_coefficient
    rng = np.random.default_rng(18)
    dn = dv = 128
    kv_b_proj = (rng.standard_normal((H * (dn + dv), R)) / np.sqrt(R)).astype(np.float32)
    hw = kernels.bf16_head_weights(kv_b_proj, H, dn)
    q_nope = rng.standard_normal((1, 200, H, dn)).astype(np.float32)
    u = rng.standard_normal((1, 200, H, R)).astype(np.float32)
    want = (ref.absorb_q(q_nope, kv_b_proj, out_dtype=np.float64),
            ref.apply_uv(u, kv_b_proj, dv, out_dtype=np.float64))
    magnitude = (ref.absorb_q(np.abs(q_nope), np.abs(kv_b_proj), out_dtype=np.float64),
                 ref.apply_uv(np.abs(u), np.abs(kv_b_proj), dv, out_dtype=np.float64))
    full = None
    for m in (200, 65, 33, 1):
        got = (kernels.absorb_q(q_nope[:, :m], hw).copy_to_host(),
               kernels.apply_uv(u[:, :m], hw, dv).copy_to_host())
        for g, w, mag, k in zip(got, want, magnitude, (dn, R)):
            err = np.abs(g - w[:, :m])
            assert np.all(err <= mma_error_coefficient(k) * mag[:, :m]), (m, k, err.max())
        if full is None:
            full = got
        for g, f in zip(got, full):
            assert g.tobytes() == f[:, :m].tobytes(), f"rows at M = {m}"


@pytest.mark.parametrize("r, dr", [(64, 16), (128, 64)])
def test_narrow_latent_configuration(r, dr):
    """Non-Kimi widths run the same kernels with other tile layouts: (64, 16) the FFMA ones
    only (r + dr = 80 has no whole 32-column halves), (128, 64) also the tensor-core one
    (3-chunk score halves, 2 value column groups)."""
    rng = np.random.default_rng(16)
    n = 9
    visible = np.stack([random_tree_visible(rng, n) for _ in range(3)])
    check(make_problem(rng, [0, 77, 300], n, visible, heads=8, r=r, dr=dr, tau=0.2))
    check(make_problem(rng, [0, 77, 300], n, visible, heads=8, r=r, dr=dr, tau=0.2),
          keys_per_split=48)


def test_default_is_the_tensor_core_kernel_at_kimi_widths():
    from kdtree_numba import attention as kernels
    plan = kernels.MlaAttentionPlan(2, 3, H, R, DR, 100)
    assert plan.variant == "tf32x3"
    assert kernels.MlaAttentionPlan(2, 3, 8, 64, 16, 100).variant == kernels.FALLBACK_VARIANT


@settings(deadline=None)
@given(st.integers(1, 3), st.integers(1, 17), st.sampled_from([1, 2, 64]),
       st.lists(st.integers(0, 300), min_size=3, max_size=3), st.sampled_from([None, 64]),
       st.integers(0, 2**32 - 1), st.sampled_from(VARIANTS))
def test_random_shapes_masks_and_prefixes_match_reference(bs, n, heads, prefixes,
                                                          keys_per_split, seed, variant):
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 3, size=bs)
    visible = np.stack([
        np.tril(np.ones((n, n), bool)) if k == 0 else
        random_tree_visible(rng, n, int(rng.integers(1, n + 1))) if k == 1 else
        rng.random((n, n)) < 0.5 for k in kinds])
    check(make_problem(rng, prefixes[:bs], n, visible, heads=heads), variants=(variant,),
          keys_per_split=keys_per_split)


@pytest.mark.parametrize("variant", ["tf32x3"])
@pytest.mark.parametrize("bs,n,prefix,batch_invariant", [(1, 1, 129, True), (1, 1, 700, False),
                                                         (2, 5, 300, True), (1, 33, 171, True)])
def test_tensor_core_blocks_of_16_32_64_rows_give_the_same_bits(variant, bs, n, prefix,
                                                               batch_invariant):
    """The tensor-core block's row count (plan.mma_rows) only spreads the work: 16-, 32- and
    64-row blocks give every output the same bits (each warp computes its 16 rows the same
    way), and the plan's own pick is within the fp32 bound of the reference."""
    from kdtree_numba import attention as kernels
    from kdtree_numba.compat import cuda
    rng = np.random.default_rng(41 + n)
    visible = np.stack([random_tree_visible(rng, n) for _ in range(bs)])
    prob = make_problem(rng, [prefix] * bs, n, visible)
    got = {rows: kernels.mla_attention(**prob, variant=variant, rows=rows,
                                       batch_invariant=batch_invariant).copy_to_host()
           for rows in (64, 32, 16)}
    for rows in (32, 16):
        assert got[rows].tobytes() == got[64].tobytes(), f"{rows} rows"
    picked = kernels.MlaAttentionPlan(bs, n, H, R, DR, prob["ckv"].shape[1],
                                      max_keys=prefix + n, variant=variant,
                                      batch_invariant=batch_invariant)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    assert picked.cfg.rows == kernels.mma_rows(picked.n_rows, picked.splits, bs, sms)
    assert picked.cfg.rows < 64 and picked.grid[0] * picked.cfg.rows >= n * H
    check(prob, variants=(variant,), batch_invariant=batch_invariant)


@pytest.mark.parametrize("variant", ["tf32x3", "pipe16x2"])
def test_batch_invariant_plan_decode_equals_verify_at_kimi_dims(variant):
    """batch_invariant=True at Kimi-K2's widths: each token of a 33-token chain verify after
    300 keys, against a 512-slot cache, has the bits of its decode against a 384-slot cache
    (the engine's tensor-cores setting relies on it: DDTree's cache is the larger)."""
    from test_attention import chain_problem

    from kdtree_numba import attention as kernels
    verify, decodes = chain_problem(np.random.default_rng(33), n=33, prefix=300, heads=H, r=R,
                                    dr=DR, spare=179)
    big, small = verify["ckv"].shape[1], 384
    u = kernels.mla_attention(**verify, max_keys=big, variant=variant,
                              batch_invariant=True).copy_to_host()
    want = ref.mla_attention(**verify, out_dtype=np.float64)
    assert np.abs(u - want).max() <= ref.fp32_error_bound(**verify)
    for j, dec in enumerate(decodes):
        dec = dict(dec, ckv=dec["ckv"][:, :small], kpe=dec["kpe"][:, :small])
        alone = kernels.mla_attention(**dec, max_keys=small, variant=variant,
                                      batch_invariant=True).copy_to_host()
        assert alone[0, 0].tobytes() == u[0, j].tobytes(), f"token {j}"

"""The DFlash block drafter (kdtree_numba/dflash.py; its spec: docs/ENGINE.md, "DFlash block
drafter"), the target features it reads, its bundle, and the "chain" method.

* The block forward against an independent NumPy oracle written here from the spec (float64,
  naive MLA: k_nope and v decompressed per head with kv_b_proj), over a context built by
  several ``extend_context`` calls with ragged lengths: on the reference backend, and on the
  numba kernels under the CUDA simulator (the twins also against each other).
* Losslessness: DDTree and chain with a random DFlash drafter give the AR tokens (T = 0 and
  T > 0 with one seed), on the reference backend and on the numba kernels; after a generation
  the drafter's context is exactly the target's features of the verified prefix.
* The feature capture against transformers (a hook on every decoder layer), and the round's
  one-read sync budget.
* Bundles: round trips, writer and reader refusals, a drafter for another target refused at
  load naming the mismatch (API and CLI).
"""
from __future__ import annotations

import functools
import json
import re
import warnings

import numpy as np
import pytest

from kdtree_numba import compat
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import (BundleError, DFlashSpec, block_drafter_shapes,
                                 default_target_layer_ids, dflash_config, dflash_shapes,
                                 make_random_bundle, random_weights, read_dflash_bundle,
                                 read_dflash_spec, size_config, write_dflash_bundle)
from kdtree_numba.cli import make_model_main, run_main
from kdtree_numba.config import weight_shapes
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.drafter import BlockDrafter, ModelDrafter, NoisyOracleDrafter, load_drafter
from kdtree_numba.engine import generate
from kdtree_numba.model import ForwardBatch, Model, causal_mask
from reference import ddtree as ref_ddtree

LATENT_EPS = 1e-6     # kv_a_layernorm's eps in every DeepSeek-V3 layer


# ----------------------------------------------------------------------------- the oracle

def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _rope_halves(x, positions, theta):
    """NeoX-halves RoPE of x [N, ..., dr] at positions [N], no scaling: pair i is
    (x[i], x[i + dr/2]), angle p * theta^(-2i/dr)."""
    dr = x.shape[-1]
    inv = theta ** (-np.arange(0, dr, 2, dtype=np.float64) / dr)
    angle = np.asarray(positions, np.float64).reshape((-1,) + (1,) * (x.ndim - 2) + (1,)) * inv
    a, b = x[..., :dr // 2], x[..., dr // 2:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                           b * np.cos(angle) + a * np.sin(angle)], axis=-1)


def oracle_propose(target_weights, tcfg, weights, cfg, spec, context, root):
    """Logits [B - 1, V] of one request, from the spec: context [P, k D] are the features of
    the P context tokens (positions 0..P-1), root the token at position P."""
    W = {n: np.asarray(v, np.float64) for n, v in weights.items()}
    embed = np.asarray(target_weights["model/embed_tokens"], np.float64)
    head = embed if tcfg.tie_word_embeddings else np.asarray(target_weights["lm_head"],
                                                             np.float64)
    H, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim, cfg.kv_lora_rank)
    eps, B = cfg.rms_norm_eps, spec.block_size
    P = context.shape[0]
    f = _rms(np.asarray(context, np.float64) @ W["dflash/fc"].T, W["dflash/hidden_norm"], eps)
    block_pos = P + np.arange(B)
    x = np.vstack([embed[root][None], np.tile(W["dflash/mask_embedding"], (B - 1, 1))])
    scale = (dn + dr) ** -0.5
    for layer in range(cfg.num_hidden_layers):
        p = f"model/layers/{layer}/"
        kv_a = W[p + "self_attn/kv_a_proj_with_mqa"]
        kv_ctx = f @ kv_a.T
        c_ctx = _rms(kv_ctx[:, :r], W[p + "self_attn/kv_a_layernorm"], LATENT_EPS)
        kpe_ctx = _rope_halves(kv_ctx[:, r:], np.arange(P), cfg.rope_theta)
        h = _rms(x, W[p + "input_layernorm"], eps)
        q = (h @ W[p + "self_attn/q_proj"].T).reshape(B, H, dn + dr)
        q_nope, q_pe = q[..., :dn], _rope_halves(q[..., dn:], block_pos, cfg.rope_theta)
        kv_blk = h @ kv_a.T
        c = np.vstack([c_ctx, _rms(kv_blk[:, :r], W[p + "self_attn/kv_a_layernorm"],
                                   LATENT_EPS)])
        k_pe = np.vstack([kpe_ctx, _rope_halves(kv_blk[:, r:], block_pos, cfg.rope_theta)])
        kv_b = W[p + "self_attn/kv_b_proj"].reshape(H, dn + dv, r)
        heads = []
        for i in range(H):      # naive MLA: decompress this head's keys and values
            k = np.hstack([c @ kv_b[i, :dn].T, k_pe])
            v = c @ kv_b[i, dn:].T
            s = np.hstack([q_nope[:, i], q_pe[:, i]]) @ k.T * scale     # [B, P + B]: all
            s = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((s / s.sum(axis=1, keepdims=True)) @ v)
        x = x + np.hstack(heads) @ W[p + "self_attn/o_proj"].T
        h = _rms(x, W[p + "post_attention_layernorm"], eps)
        g, u = h @ W[p + "mlp/gate_proj"].T, h @ W[p + "mlp/up_proj"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "mlp/down_proj"].T
    return (_rms(x, W["model/norm"], eps) @ head.T)[1:]


# ----------------------------------------------------------------------------- fixtures

def pair(target_overrides: dict, drafter_overrides: dict, ids, block_size: int, seed: int = 0):
    """(target config, target weights, drafter config, drafter weights, spec)."""
    tcfg = size_config("tiny", **target_overrides)
    tw = dict(random_weights(tcfg, seed))
    dcfg = dflash_config(tcfg, **drafter_overrides)
    dw = dict(random_weights(dcfg, seed + 50, dflash_shapes(dcfg, len(ids))))
    spec = DFlashSpec(tuple(ids), block_size, tcfg.hidden_size, tcfg.vocab_size,
                      tcfg.num_hidden_layers)
    return tcfg, tw, dcfg, dw, spec


# the oracle case: a separate lm_head, 2 drafter layers of their own geometry, B 4
ORACLE_PAIR = (dict(vocab_size=96, hidden_size=48, num_hidden_layers=3, rope_scaling=None),
               dict(num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=24,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                    intermediate_size=64, rope_theta=500.0), (2, 0), 4)
# the simulator's: one drafter layer, V 64, D 32
SIM_PAIR = (dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, rope_scaling=None),
            dict(num_hidden_layers=1, num_attention_heads=2, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=32),
            (0, 1), 4)

# (m, lengths): three context extensions of a batch of two (a prefill, then two rounds; a
# request that grows by 0 is a finished one)
SCHEDULE = [(5, [5, 2]), (3, [3, 1]), (2, [0, 2])]


def run_schedule(drafter, k_width: int, propose_after=(0, 1, 2), seed: int = 3):
    """Drive ``drafter`` through SCHEDULE with random features and roots; returns, per
    proposal, (host logits [bs, B-1, V], contexts [per request: features so far], roots)."""
    rng = np.random.default_rng(seed)
    be = drafter.model.backend
    bs = len(SCHEDULE[0][1])
    drafter.start(bs, 64)
    contexts = [np.zeros((0, k_width), np.float32) for _ in range(bs)]
    out = []
    for step, (m, lengths) in enumerate(SCHEDULE):
        feats = rng.standard_normal((bs, m, k_width)).astype(np.float32)
        drafter.extend_context(be.asarray(feats), np.array(lengths))
        contexts = [np.vstack([c, feats[b, :lengths[b]]]) for b, c in enumerate(contexts)]
        assert drafter.context_lengths.tolist() == [len(c) for c in contexts]
        if step in propose_after:
            roots = rng.integers(0, drafter.vocab_size, bs)
            logits = np.asarray(be.to_host(drafter.draft(roots)), np.float64)
            # a round whose tree reaches depth 2 at most: the lm_head on those rows alone
            shallow = np.asarray(be.to_host(drafter.draft(roots, depth=2)), np.float64)
            np.testing.assert_allclose(shallow, logits[:, :2], rtol=1e-5,
                                       atol=1e-5 * np.abs(logits).max())
            out.append((logits, [c.copy() for c in contexts], roots))
    return out


def check_against_oracle(results, tw, tcfg, dw, dcfg, spec, rtol: float) -> float:
    worst = 0.0
    for logits, contexts, roots in results:
        assert logits.shape == (len(roots), spec.block_size - 1, dcfg.vocab_size)
        for b, root in enumerate(roots):
            want = oracle_propose(tw, tcfg, dw, dcfg, spec, contexts[b], int(root))
            scale = np.abs(want).max()
            assert scale > 1.0                           # the weights are not trivial
            err = np.abs(logits[b] - want).max() / scale
            worst = max(worst, err)
            assert err <= rtol, (b, err)
    return worst


# ----------------------------------------------------------------------------- the oracle tests

def test_propose_matches_the_oracle_on_the_reference_backend():
    tcfg, tw, dcfg, dw, spec = pair(*ORACLE_PAIR)
    target = Model(tcfg, tw, "reference")
    drafter = DFlashDrafter(target, dcfg, dw, spec)
    assert drafter.block_len == 3 and drafter.feature_layers == (2, 0)
    assert drafter.model.embed is target.embed and drafter.model.lm_head is target.lm_head
    results = run_schedule(drafter, 2 * tcfg.hidden_size)
    # float64 inside every reference op, float32 between them (measured ~1e-7)
    check_against_oracle(results, tw, tcfg, dw, dcfg, spec, rtol=1e-5)


def test_propose_matches_the_oracle_with_a_tied_bf16_target():
    """bf16 weights (the oracle gets the same rounded values) and a tied head."""
    import ml_dtypes
    tover, dover, ids, B = ORACLE_PAIR
    tcfg, tw, dcfg, dw, spec = pair(dict(tover, tie_word_embeddings=True), dover, ids, B, 1)
    tw = {n: v.astype(ml_dtypes.bfloat16) for n, v in tw.items()}
    dw = {n: v.astype(ml_dtypes.bfloat16) for n, v in dw.items()}
    drafter = DFlashDrafter(Model(tcfg, tw, "reference"), dcfg, dw, spec)
    results = run_schedule(drafter, 2 * tcfg.hidden_size, propose_after=(2,))
    check_against_oracle(results, tw, tcfg, dw, dcfg, spec, rtol=1e-5)


@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba twin runs here only in the CUDA "
                    "simulator")
@pytest.mark.slow   # 13-20 s; in CI the numba twin's tokens equal AR's (the equals_ar test
#                     below) and the reference twin meets the oracle; on a GPU, test_dflash whole
def test_propose_matches_the_oracle_on_the_numba_kernels_in_simulator(needs_kernels):
    """The numba kernels (float32) under the simulator: against the oracle and against the
    reference twin, over the same multi-round context (two block forwards, ~20 s)."""
    tcfg, tw, dcfg, dw, spec = pair(*SIM_PAIR)
    sim = DFlashDrafter(Model(tcfg, tw, make_backend("numba")), dcfg, dw, spec)
    ref = DFlashDrafter(Model(tcfg, tw, "reference"), dcfg, dw, spec)
    got = run_schedule(sim, 2 * tcfg.hidden_size, propose_after=(1, 2))
    check_against_oracle(got, tw, tcfg, dw, dcfg, spec, rtol=1e-5)
    want = run_schedule(ref, 2 * tcfg.hidden_size, propose_after=(1, 2))
    for (a, _, _), (b, _, _) in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    # the injected context itself: the twins' caches hold the same latents
    n = int(sim.cache.lengths.max())
    np.testing.assert_allclose(sim.cache.c[:, :, :n], ref.cache.c[:, :, :n], atol=1e-5)
    np.testing.assert_allclose(sim.cache.k_pe[:, :, :n], ref.cache.k_pe[:, :, :n], atol=1e-5)


# ----------------------------------------------------------------------------- losslessness

# a two-layer tiny target (dense + MoE, YaRN) and a drafter reading both layers
TARGET2 = dict(num_hidden_layers=2)
DRAFT2 = dict(num_hidden_layers=2, intermediate_size=64)


@functools.lru_cache(maxsize=None)
def parts2(vocab: int = 128, seed: int = 0):
    return pair(dict(TARGET2, vocab_size=vocab), DRAFT2, (1, 0), 5, seed)


@functools.lru_cache(maxsize=None)
def target_and_drafter(vocab: int = 128, seed: int = 0):
    tcfg, tw, dcfg, dw, spec = parts2(vocab, seed)
    target = Model(tcfg, tw, "reference")
    return target, DFlashDrafter(target, dcfg, dw, spec)


def counted(backend, fn):
    reads, syncs = backend.reads, backend.syncs
    out = fn()
    return out, backend.reads - reads, backend.syncs - syncs


@pytest.mark.parametrize("method, budget", [("ddtree", 1), ("ddtree", 5), ("ddtree", 16),
                                            ("chain", 32)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dflash_generation_equals_ar(method, budget, temperature):
    """Ragged batch, one request stopping at eos: the AR tokens, one read per round."""
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    ar = generate(target, prompts, 10, temperature=temperature, seed=4)
    eos = ar.tokens[2][3]
    want = generate(target, prompts, 10, temperature=temperature, seed=4, eos=eos).tokens
    res, reads, syncs = counted(target.backend, lambda: generate(
        target, prompts, 10, method=method, drafter=drafter, budget=budget,
        temperature=temperature, seed=4, eos=eos))
    assert res.tokens == want
    assert reads == 1 + res.stats.rounds and syncs == 1
    assert res.stats.block_len == 4
    assert res.stats.budget == (4 if method == "chain" else budget)


def test_context_is_the_targets_features_of_the_verified_prefix():
    """With V 8 a random drafter is often right, so rounds accept several nodes (bushy trees
    whose accepted paths skip slots): after generating, every request's context holds exactly
    the fused features of its verified tokens, as one prefill of them would give."""
    target, drafter = target_and_drafter(vocab=8, seed=2)
    prompts = [[3, 1, 4, 1, 5], [7, 2], [6, 5, 3, 5, 0, 1, 7]]
    res = generate(target, prompts, 24, method="ddtree", drafter=drafter, budget=16)
    lengths = drafter.context_lengths
    assert lengths.tolist() == target.generation_cache.lengths.tolist()
    assert res.tokens == generate(target, prompts, 24).tokens
    assert max(max(t) for t in res.stats.tau) >= 3          # multi-node acceptances happened
    _, _, dcfg, dw, spec = parts2(8, 2)
    fresh = DFlashDrafter(target, dcfg, dw, spec)
    for b, prompt in enumerate(prompts):
        seq = (list(prompt) + res.tokens[b])[:lengths[b]]
        fresh.start(1, 64)
        _, feats = target.prefill(target.new_cache(1, 64), [seq],
                                  capture_layers=drafter.feature_layers)
        fresh.extend_context(feats, [len(seq)])
        n = len(seq)
        np.testing.assert_allclose(drafter.cache.c[:, b, :n], fresh.cache.c[:, 0, :n],
                                   atol=2e-5)
        np.testing.assert_allclose(drafter.cache.k_pe[:, b, :n], fresh.cache.k_pe[:, 0, :n],
                                   atol=2e-5)


@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba backend runs here only in the CUDA "
                    "simulator")
@pytest.mark.parametrize("method", ["ddtree", "chain"])
def test_dflash_on_the_numba_kernels_equals_ar_in_simulator(method, needs_kernels):
    """Target and drafter both on the numba kernels (the prefill's and the verify's feature
    capture, the device gather of the accepted rows, the injection): the reference AR tokens,
    one read for prefill and one per round (two new tokens: one round, ~4 s on 2 cores)."""
    # test_engine's SIM_TINY widths (D 8, r 8, V 16): the simulated blocks scale with them
    target_over = dict(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=16,
                       hidden_size=8, intermediate_size=8, q_lora_rank=None,
                       kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                       num_attention_heads=1)
    tcfg, tw, dcfg, dw, spec = pair(target_over, dict(num_hidden_layers=1), (0,), 3)
    backend = make_backend("numba")
    target = Model(tcfg, tw, backend)
    drafter = DFlashDrafter(target, dcfg, dw, spec)
    prompts = [[3, 9, 4]]
    res, reads, syncs = counted(backend, lambda: generate(
        target, prompts, 2, method=method, drafter=drafter, budget=3))
    ref_target = Model(tcfg, tw, "reference")
    assert res.tokens == generate(ref_target, prompts, 2).tokens
    assert res.stats.rounds == 1 and reads == 2 and syncs == 1
    if method == "ddtree":     # the numba capture equals the reference's (one more forward)
        _, got = target.prefill(target.new_cache(1, 8), prompts, capture_layers=(0,))
        _, want = ref_target.prefill(ref_target.new_cache(1, 8), prompts, capture_layers=(0,))
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


# ----------------------------------------------------------------------------- the chain

def test_top1_budget_L_builds_the_greedy_chain():
    """The "chain" method's tree: top-K with k = 1 and budget L is one path of depth L whose
    tokens are the rows' argmaxes (reference, and the numba twin where it runs)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 40)).astype(np.float32)
    backends = ["reference"] + (["numba"] if compat.kernels_runnable() else [])
    for name in backends:
        ops = make_backend(name).ops
        lp, ids = ops.topk_logprobs(logits, 1)
        tree = ops.build_tree(lp, ids, 5)
        tree = ref_ddtree.DraftTree(*(np.asarray(getattr(tree, f)) for f in
                                      ("n_nodes", "token", "parent", "depth", "rank",
                                       "score")), max_depth=tree.max_depth)
        assert tree.n_nodes.tolist() == [5, 5, 5], name
        assert (tree.depth[:, 1:] == np.arange(1, 6)).all(), name
        assert (tree.parent[:, 1:] == np.arange(0, 5)).all(), name
        assert (tree.token[:, 1:] == logits.argmax(-1)).all(), name


@functools.lru_cache(maxsize=None)
def _small_drafter_model(seed: int = 0) -> Model:
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1, hidden_size=32,
                      intermediate_size=48)
    return Model(cfg, dict(random_weights(cfg, seed + 100)), "reference")


def _block_drafter() -> BlockDrafter:
    cfg = _small_drafter_model().config
    shapes = dict(weight_shapes(cfg), **block_drafter_shapes(cfg, 64))
    w = dict(random_weights(cfg, 200, shapes))
    return BlockDrafter(Model(cfg, w, "reference"), w["block/target_proj"],
                        w["block/mask_embedding"], block_len=4)


@pytest.mark.parametrize("kind", ["model", "oracle_perfect", "oracle_noisy", "block", "dflash"])
def test_chain_equals_ar_for_every_drafter_kind(kind):
    target, dflash = target_and_drafter()
    drafter = {"model": lambda: ModelDrafter(_small_drafter_model(), 4),
               "oracle_perfect": lambda: NoisyOracleDrafter(target, 4, 1.0),
               "oracle_noisy": lambda: NoisyOracleDrafter(target, 4, 0.5, seed=3),
               "block": _block_drafter, "dflash": lambda: dflash}[kind]()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    res = generate(target, prompts, 14, method="chain", drafter=drafter, budget=99)
    assert res.tokens == generate(target, prompts, 14).tokens
    assert all(1 <= t <= 5 for r in res.stats.tau for t in r)
    if kind == "oracle_perfect":      # the target's own chain: every round takes all L + 1
        assert all(t == 5 for r in res.stats.tau[:-1] for t in r)


# ----------------------------------------------------------------------------- features

def test_capture_layers_returns_each_layers_residual_stream():
    """Model-level checks of the capture: the order given, the prefill's padded rows, the
    last layer before the final norm (its rmsnorm is the return_hidden state)."""
    target, _ = target_and_drafter()
    D, L = target.config.hidden_size, target.config.num_hidden_layers
    ids = np.array([[4, 8, 15, 16, 23]])
    logits, hidden, feats = target.forward(ForwardBatch(
        ids, np.arange(5)[None], causal_mask(5), return_hidden=True, capture_layers=(1, 0, 1)),
        target.new_cache(1, 8))
    assert feats.shape == (1, 5, 3 * D) and feats.dtype == np.float32
    np.testing.assert_array_equal(feats[..., :D], feats[..., 2 * D:])
    from reference.layers import rmsnorm
    last = feats[0, :, :D]
    np.testing.assert_allclose(rmsnorm(last, target.final_norm, target.config.rms_norm_eps),
                               hidden[0], atol=1e-6)
    np.testing.assert_array_equal(logits, target.forward(ForwardBatch(
        ids, np.arange(5)[None], causal_mask(5)), target.new_cache(1, 8)))
    out = target.prefill(target.new_cache(2, 8), [[4, 8, 15], [16, 23, 42, 7, 1]],
                         capture_layers=(0,))
    assert out[1].shape == (2, 5, D)
    with pytest.raises(ValueError, match=f"layer {L} is not a decoder layer"):
        target.forward(ForwardBatch(
            ids, np.arange(5)[None], causal_mask(5), capture_layers=(L,)), target.new_cache(1, 8))


def test_capture_matches_transformers_layer_outputs(tmp_path):
    """The residual stream after each decoder layer against transformers' DeepseekV3 (hooks on
    every layer: its own output, before the final norm).  output_hidden_states index j + 1
    agrees for every layer but the last: transformers 5 replaces that entry with the final
    normed state (a trap for whoever reads features from it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kdtree_numba.hf_import import export_hf_checkpoint
    cfg = size_config("tiny")          # test_hf_parity's: q LoRA, YaRN, MoE, a dense layer
    weights = dict(random_weights(cfg, seed=7))
    export_hf_checkpoint(cfg, weights, tmp_path / "hf")
    transformers.utils.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
            tmp_path / "hf", attn_implementation="eager", dtype=torch.float32).eval()
    seq = np.array([3, 17, 99, 5, 64, 2, 1, 77, 8, 120, 33, 41])
    seen = {}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, j=j: seen.__setitem__(j, (out[0] if isinstance(out, tuple)
                                                         else out)[0].double().numpy()))
        for j, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hs = hf(torch.tensor(seq[None]), output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    ours = Model(cfg, weights, "reference")
    L, D, T = cfg.num_hidden_layers, cfg.hidden_size, seq.size
    order = (2, 0, 1)
    _, feats = ours.forward(ForwardBatch(
        seq[None], np.arange(T)[None], causal_mask(T), capture_layers=order), ours.new_cache(1, T))
    feats = feats[0]
    want = np.hstack([seen[j] for j in order])
    assert np.abs(feats - want).max() <= 1e-4 * np.abs(want).max()
    for j in range(L - 1):
        np.testing.assert_allclose(hs[j + 1][0].double().numpy(), seen[j], atol=1e-6)
    with torch.no_grad():
        normed = hf.model.norm(torch.tensor(seen[L - 1][None], dtype=torch.float32))[0]
    np.testing.assert_allclose(hs[L][0].numpy(), normed.numpy(), atol=1e-5)


# ----------------------------------------------------------------------------- bundles

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dflash_bundle_round_trip(tmp_path, dtype):
    tcfg, _, dcfg, dw, spec = pair(*ORACLE_PAIR)
    path = tmp_path / "d.kdtr"
    got_spec = write_dflash_bundle(path, dcfg, dw, target_layer_ids=[2, 0], block_size=4,
                                   target_hidden_size=48, target_vocab_size=96,
                                   target_num_layers=3, dtype=dtype)
    assert got_spec == spec
    cfg, weights, read_spec = read_dflash_bundle(path)
    assert cfg == dcfg and read_spec == spec and read_spec.target_layer_ids == (2, 0)
    assert set(weights) == set(dflash_shapes(dcfg, 2))
    assert "model/embed_tokens" not in weights and "lm_head" not in weights
    for name, w in dw.items():
        want = w.astype(dtype) if dtype == "float32" else w.astype(weights[name].dtype)
        np.testing.assert_array_equal(weights[name], want, err_msg=name)
    assert read_dflash_spec(path) == (dcfg, spec)


def test_make_random_dflash_bundle_spreads_the_feature_layers(tmp_path):
    assert default_target_layer_ids(6) == (1, 3, 5)
    assert default_target_layer_ids(3) == (0, 2) and default_target_layer_ids(1) == (0,)
    cfg = make_random_bundle(tmp_path / "d.kdtr", "tiny", role="dflash_drafter")
    _, spec = read_dflash_spec(tmp_path / "d.kdtr")
    assert spec == DFlashSpec((0, 2), 8, 64, 128, 3)
    assert cfg.num_hidden_layers == cfg.first_k_dense_replace == 2
    assert cfg.q_lora_rank is None and not cfg.rope_interleave and cfg.rope_scaling is None
    _, weights, _ = read_dflash_bundle(tmp_path / "d.kdtr")
    assert 0.5 <= weights["dflash/hidden_norm"].min() <= weights["dflash/hidden_norm"].max() <= 1.5


def test_dflash_writer_and_reader_refuse_bad_bundles(tmp_path):
    tcfg, tw, dcfg, dw, _ = pair(*ORACLE_PAIR)
    kw = dict(target_layer_ids=[2, 0], block_size=4, target_hidden_size=48,
              target_vocab_size=96, target_num_layers=3)
    path = tmp_path / "d.kdtr"
    with pytest.raises(BundleError, match="model/embed_tokens is not part of"):
        write_dflash_bundle(path, dcfg, dict(dw, **{"model/embed_tokens":
                                                    tw["model/embed_tokens"]}), **kw)
    with pytest.raises(BundleError, match="missing tensor dflash/fc"):
        write_dflash_bundle(path, dcfg, {n: v for n, v in dw.items() if n != "dflash/fc"},
                            **kw)
    with pytest.raises(BundleError, match="layer 3 is not a layer of its 3-layer target"):
        write_dflash_bundle(path, dcfg, dw, **dict(kw, target_layer_ids=[3]))
    with pytest.raises(BundleError, match="hidden_size 48 differs"):
        write_dflash_bundle(path, dcfg, dw, **dict(kw, target_hidden_size=64))
    with pytest.raises(BundleError, match="block_size 1"):
        write_dflash_bundle(path, dcfg, dw, **dict(kw, block_size=1))
    assert not path.exists()
    make_random_bundle(tmp_path / "m.kdtr", "tiny")
    with pytest.raises(BundleError, match="not a dflash_drafter"):
        read_dflash_bundle(tmp_path / "m.kdtr")
    make_random_bundle(path, "tiny", role="dflash_drafter")
    with pytest.raises(BundleError, match="missing tensor model/embed_tokens"):
        Model.load(path, "reference")


@pytest.fixture(scope="module")
def refusal_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    make_random_bundle(d / "tiny.kdtr", "tiny")       # the target: D 64, V 128, 3 layers
    make_random_bundle(d / "ok.kdtr", "tiny", role="dflash_drafter")
    make_random_bundle(d / "narrow.kdtr", "tiny", role="dflash_drafter", hidden_size=32)
    make_random_bundle(d / "vocab.kdtr", "tiny", role="dflash_drafter", vocab_size=100)
    make_random_bundle(d / "deep.kdtr", "tiny", role="dflash_drafter", num_hidden_layers=6)
    tcfg = size_config("tiny", num_hidden_layers=5)
    dcfg = dflash_config(tcfg)
    write_dflash_bundle(d / "five.kdtr", dcfg, random_weights(dcfg, 0, dflash_shapes(dcfg, 2)),
                        target_layer_ids=(0, 1), block_size=8, target_hidden_size=64,
                        target_vocab_size=128, target_num_layers=5)
    return d


# (bundle, what DFlashDrafter.load says, what kdtree-run says: its vocabulary check, common
# to every drafter, comes first)
REFUSALS = [("narrow", "hidden size 32; this target's is 64", None),
            ("vocab", "vocabulary of 100; this target's is 128",
             "vocabulary 100 does not match the target's 128"),
            ("deep", "target_layer_ids [1, 3, 5] read target layer 3, but this target has 3 "
                     "layers (0..2)", None),
            ("five", "a 5-layer target; this target has 3 layers", None)]


@pytest.mark.parametrize("name, words, _", REFUSALS)
def test_a_drafter_for_another_target_is_refused_at_load(refusal_files, name, words, _):
    target = Model.load(refusal_files / "tiny.kdtr", "reference")
    path = refusal_files / f"{name}.kdtr"
    with pytest.raises(BundleError) as e:
        DFlashDrafter.load(path, target)
    assert words in str(e.value) and str(path) in str(e.value)
    with pytest.raises(BundleError, match=re.escape(words)):
        load_drafter(str(path), target)
    config, weights, spec = read_dflash_bundle(path)
    with pytest.raises(BundleError, match=re.escape(words)):      # in memory too
        DFlashDrafter(target, config, weights, spec)


@pytest.mark.parametrize("name, words, cli_words", REFUSALS)
def test_kdtree_run_refuses_a_drafter_for_another_target(refusal_files, name, words,
                                                         cli_words, capsys, monkeypatch):
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)
    assert run_main(["--model", str(refusal_files / "tiny.kdtr"), "--drafter",
                     str(refusal_files / f"{name}.kdtr"), "--method", "chain"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-run: error: --drafter "), err
    assert (cli_words or words) in err[0]


def test_kdtree_run_with_a_dflash_drafter(refusal_files, tmp_path, capsys):
    """kdtr-make-model --dflash-drafter, then kdtree-run --drafter with chain and ddtree: the
    AR tokens, the drafter's own block size."""
    assert make_model_main([str(tmp_path / "d.kdtr"), "--dflash-drafter"]) == 0
    assert "dflash_drafter" in capsys.readouterr().err
    common = ["--model", str(refusal_files / "tiny.kdtr"), "--prompt-ids", "1,2,3",
              "--max-new-tokens", "9", "--backend", "reference"]
    assert run_main(common + ["--json"]) == 0
    ar = json.loads(capsys.readouterr().out)["tokens"]
    for method in ("chain", "ddtree"):
        assert run_main(common + ["--json", "--method", method, "--drafter",
                                  str(tmp_path / "d.kdtr"), "--block-len", "3"]) == 0
        captured = capsys.readouterr()
        out = json.loads(captured.out)
        assert out["tokens"] == ar and out["stats"]["block_len"] == 7
        assert out["stats"]["method"] == method
        assert "--block-len 3 is ignored" in captured.err


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_gpu_dflash_propose_matches_the_oracle():
    """The numba kernels on the H200 over the multi-round context; the third block forward is
    a CUDA-graph replay (captured on the second)."""
    tcfg, tw, dcfg, dw, spec = pair(*ORACLE_PAIR)
    drafter = DFlashDrafter(Model(tcfg, tw, "numba"), dcfg, dw, spec)
    got = run_schedule(drafter, 2 * tcfg.hidden_size)
    check_against_oracle(got, tw, tcfg, dw, dcfg, spec, rtol=1e-5)
    graphs = drafter.model.graphs
    if graphs is not None:
        assert graphs.failures == 0 and graphs.replays >= 1, graphs.kinds()


@pytest.mark.gpu
@pytest.mark.parametrize("device_rounds", [False, True])
@pytest.mark.parametrize("method", ["ddtree", "chain"])
def test_gpu_dflash_generation_equals_ar_and_replays(method, device_rounds):
    """The small target with a random DFlash drafter on the GPU: the AR tokens twice (the
    second call replays the first one's graphs: host-driven rounds the block forward, the
    context injection, the feature gather; device rounds the whole round), one read per
    round (device rounds: and per round enqueued for a request already finished)."""
    tcfg = size_config("small")
    tw = dict(random_weights(tcfg, 0))
    gpu = Model(tcfg, tw, "numba")
    dcfg = dflash_config(tcfg)
    ids = default_target_layer_ids(tcfg.num_hidden_layers)
    dw = dict(random_weights(dcfg, 5, dflash_shapes(dcfg, len(ids))))
    drafter = DFlashDrafter(gpu, dcfg, dw, DFlashSpec(ids, 8, tcfg.hidden_size,
                                                      tcfg.vocab_size, tcfg.num_hidden_layers))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = generate(gpu, prompts, 24).tokens
    for _ in range(2):
        res, reads, syncs = counted(gpu.backend, lambda: generate(
            gpu, prompts, 24, method=method, drafter=drafter, budget=16,
            device_rounds=device_rounds))
        assert res.tokens == want
        assert reads == 1 + res.stats.rounds + res.stats.rounds_dropped and syncs == 1
        assert (res.stats.time["round"] > 0) == device_rounds
    if gpu.graphs is not None:
        assert gpu.graphs.failures == 0 and drafter.model.graphs.failures == 0
        if device_rounds:
            assert gpu.graphs.kinds()["round"] == 1, gpu.graphs.kinds()
        else:
            assert gpu.graphs.kinds()["accepted_rows"] == 1, gpu.graphs.kinds()
            kinds = drafter.model.graphs.kinds()
            assert kinds["forward"] >= 1 and kinds["dflash_context"] >= 1, kinds

"""The DFlash drafter's torch module (tools/demo/dflash.py) against the spec (docs/DEMO.md,
"The DFlash drafter"), re-computed here in NumPy float64; the training mask against one block
at a time; the target's feature tap and greedy continuation; the export's names and bytes.

CPU only, a few seconds; skipped without torch (the ``train`` side of the project).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)

from demo import dflash  # noqa: E402

# A small drafter: 2 layers, 3 target layers fused, every size distinct so a transposed or
# mis-split tensor cannot pass.
CFG_SIZES = dict(num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=12,
                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, intermediate_size=40)
TARGET_HF = dict(model_type="deepseek_v3", vocab_size=50, hidden_size=24,
                 intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                 num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, first_k_dense_replace=1, rope_interleave=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                 rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True)
LATENT_EPS = 1e-6     # kv_a_layernorm's, whatever rms_norm_eps says (1e-5 here: both tested)
LAYER_IDS = (0, 2, 3)
B = 4


def _weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """O(0.3-1) weights under the bundle's names: attention far from uniform."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in dflash.bundle_names(cfg, len(LAYER_IDS)).items():
        if len(shape) == 1:
            out[name] = rng.uniform(0.5, 1.5, shape)
        else:
            out[name] = rng.standard_normal(shape) * (1.5 / np.sqrt(shape[1]))
    out["dflash/mask_embedding"] = rng.standard_normal(cfg["hidden_size"])
    return out


def _setup(seed: int = 0, tied: bool = True):
    cfg = dflash.drafter_config(dict(TARGET_HF, tie_word_embeddings=tied), **CFG_SIZES)
    rng = np.random.default_rng(seed + 1)
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    embed = rng.standard_normal((V, D))
    head = None if tied else rng.standard_normal((V, D)) * 0.3
    w = _weights(cfg, seed)
    model = dflash.DFlashDrafter(cfg, LAYER_IDS, B, torch.tensor(embed, dtype=torch.float32),
                                 None if head is None else torch.tensor(head, dtype=torch.float32))
    model.load_bundle_tensors({k: torch.tensor(v, dtype=torch.float32) for k, v in w.items()})
    return cfg, w, embed, head, model


# ----------------------------------------------------------------------------- the oracle

def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """NeoX halves: pair i = (x[i], x[i + dr/2]); x [..., M, dr] with pos [M]."""
    dr = x.shape[-1]
    ang = np.asarray(pos, np.float64)[:, None] * theta ** (-np.arange(0, dr, 2) / dr)[None, :]
    a, b = x[..., :dr // 2], x[..., dr // 2:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang),
                           b * np.cos(ang) + a * np.sin(ang)], axis=-1)


def oracle_propose(cfg, w, embed, head, features, root):
    """One round by the spec: context = features [P, k*D] at positions 0..P-1, the block
    [root, MASK x (B-1)] at P..P+B-1; logits [B-1, V] of slots 1..B-1."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    H, r = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    P = features.shape[0]
    f = _rms(features @ w["dflash/fc"].T, w["dflash/hidden_norm"], eps)
    x = np.stack([embed[root]] + [w["dflash/mask_embedding"]] * (B - 1))
    pos_ctx, pos_blk = np.arange(P), np.arange(P, P + B)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model/layers/{l}/"
        h = _rms(x, w[p + "input_layernorm"], eps)
        q = (h @ w[p + "self_attn/q_proj"].T).reshape(B, H, dn + dr)
        q_nope = q[..., :dn]
        q_pe = _rope(q[..., dn:].transpose(1, 0, 2), pos_blk, theta).transpose(1, 0, 2)
        lat = []
        for src, pos in ((f, pos_ctx), (h, pos_blk)):
            kv = src @ w[p + "self_attn/kv_a_proj_with_mqa"].T
            lat.append((_rms(kv[:, :r], w[p + "self_attn/kv_a_layernorm"], LATENT_EPS),
                        _rope(kv[:, r:], pos, theta)))
        c = np.concatenate([lat[0][0], lat[1][0]])
        k_pe = np.concatenate([lat[0][1], lat[1][1]])
        kvb = (c @ w[p + "self_attn/kv_b_proj"].T).reshape(-1, H, dn + dv)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]
        s = (np.einsum("ihd,jhd->hij", q_nope, k_nope)
             + np.einsum("ihd,jd->hij", q_pe, k_pe)) * (dn + dr) ** -0.5
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", s, v).reshape(B, H * dv)
        x = x + o @ w[p + "self_attn/o_proj"].T
        h2 = _rms(x, w[p + "post_attention_layernorm"], eps)
        g = h2 @ w[p + "mlp/gate_proj"].T
        x = x + ((g / (1 + np.exp(-g))) * (h2 @ w[p + "mlp/up_proj"].T)) @ w[p + "mlp/down_proj"].T
    return _rms(x, w["model/norm"], eps)[1:] @ (embed if head is None else head).T


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("tied", [True, False])
def test_block_logits_match_the_numpy_spec(tied):
    cfg, w, embed, head, model = _setup(tied=tied)
    rng = np.random.default_rng(7)
    for P in (1, 6):
        feats = rng.standard_normal((P, len(LAYER_IDS) * cfg["hidden_size"])) * 2.0
        root = int(rng.integers(cfg["vocab_size"]))
        want = oracle_propose(cfg, w, embed, head, feats, root)
        with torch.no_grad():
            got = model(torch.tensor(feats[None], dtype=torch.float32), torch.tensor([[root]]),
                        torch.tensor([[P]]))[0, 0].double().numpy()
        assert got.shape == (B - 1, cfg["vocab_size"])
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-5, (P, err)


def test_many_blocks_in_one_forward_equal_each_block_alone():
    cfg, _, _, _, model = _setup(seed=3)
    g = torch.Generator().manual_seed(0)
    T = 14
    feats = torch.randn(2, T, len(LAYER_IDS) * cfg["hidden_size"], generator=g)
    ids = torch.randint(0, cfg["vocab_size"], (2, T), generator=g)
    anchors = torch.tensor([[1, 5, 6, 10], [2, 3, 9, 10]])
    roots = ids.gather(1, anchors)
    with torch.no_grad():
        together = model(feats, roots, anchors)
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                alone = model(feats[b:b + 1, :a], roots[b:b + 1, i:i + 1], torch.tensor([[a]]))
                torch.testing.assert_close(together[b, i], alone[0, 0], atol=2e-5, rtol=1e-5)


def test_mask_anchor_and_label_helpers():
    from demo import distill
    m = dflash.block_mask(torch.tensor([[2, 5]]), 6, 3)
    assert m.shape == (1, 6, 12)
    assert m[0, 0, :6].tolist() == [True, True, False, False, False, False]
    assert m[0, 4, :6].tolist() == [True] * 5 + [False]
    assert m[0, 0, 6:].tolist() == [True] * 3 + [False] * 3
    anc = distill.random_anchors(16, 20, 32, 8, "cpu", torch.Generator().manual_seed(1))
    assert anc.min() >= 1 and anc.max() <= 32 - 8
    assert all(len(set(row.tolist())) == 20 for row in anc)
    greedy = torch.arange(100).view(2, 50)
    lab = distill.block_labels(greedy, torch.tensor([[3], [10]]), 4)
    assert lab.tolist() == [[[3, 4, 5]], [[60, 61, 62]]]       # g(a + k - 1), k = 1..3
    w = dflash.position_weights(8, 4.0)
    assert abs(w.sum().item() - 1) < 1e-6 and w[1] / w[0] == pytest.approx(np.exp(-0.25))
    assert dflash.expected_tau([0.5, 0.5]) == pytest.approx(1.75)


def _export_files(tmp_path):
    """drafter.safetensors + drafter_config.json as train_drafter writes them; checks the
    names, the bytes and the config on the way."""
    import export_drafter
    from safetensors.torch import save_file
    cfg, w, _, _, model = _setup()
    model.check_names()
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in model.bundle_tensors().items()}
    assert set(tensors) == set(w)
    assert "model/embed_tokens" not in tensors and "lm_head" not in tensors
    save_file(tensors, tmp_path / "drafter.safetensors")
    back = export_drafter.read_safetensors(str(tmp_path / "drafter.safetensors"))
    for k, t in tensors.items():
        np.testing.assert_array_equal(back[k], t.float().numpy())
    with open(tmp_path / "drafter_config.json", "w") as fh:
        json.dump({"format": export_drafter.FORMAT, "config": cfg,
                   "dflash": {"target_layer_ids": list(LAYER_IDS), "block_size": B,
                              "target_hidden_size": 24, "target_vocab_size": 50,
                              "target_num_layers": 4}}, fh)
    config, dspec = export_drafter.read_config(str(tmp_path / "drafter_config.json"))
    assert config.q_lora_rank is None and not config.rope_interleave
    assert config.first_k_dense_replace == config.num_hidden_layers == 2
    assert config.rope_theta == 500.0 and config.vocab_size == 50
    return config, tensors


def test_export_files_round_trip(tmp_path):
    _export_files(tmp_path)


def test_export_writes_the_engine_bundle(tmp_path):
    import export_drafter
    bundle = pytest.importorskip("kdtree_numba.bundle")
    if not hasattr(bundle, "write_dflash_bundle"):
        pytest.skip("kdtree_numba.bundle has no write_dflash_bundle in this tree")
    config, tensors = _export_files(tmp_path)
    export_drafter.write(str(tmp_path), str(tmp_path / "d.kdtr"))
    config2, weights, spec = bundle.read_dflash_bundle(str(tmp_path / "d.kdtr"))
    assert config2 == config and tuple(spec.target_layer_ids) == LAYER_IDS
    for k, t in tensors.items():
        np.testing.assert_array_equal(np.asarray(weights[k], np.float32), t.float().numpy())


def test_feature_tap_is_the_residual_stream_before_the_final_norm():
    pytest.importorskip("transformers")
    from demo import distill, target
    torch.manual_seed(0)
    hf = target.hf_config(target.TINY, vocab_size=40, seq_len=32)
    model = target.build_model(hf, "cpu").eval().requires_grad_(False)
    tap = distill.FeatureTap(model, (0, 1))
    ids = torch.randint(2, 40, (2, 16))
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    feats = tap.features()
    D = hf["hidden_size"]
    torch.testing.assert_close(feats[..., :D], hs[1])
    # transformers hands back the last layer's output normed; the tap does not
    last = feats[..., D:]
    assert not torch.allclose(last, hs[2], atol=1e-3)
    torch.testing.assert_close(model.model.norm(last), hs[2])
    # greedy continuation: each token is the argmax after the prefix it extends
    anchors = torch.tensor([3, 9])
    cont_ids = ids.clone()
    _, cont = distill.greedy_continuation(model, tap, cont_ids, anchors, 4, None)
    with torch.no_grad():
        full = model(input_ids=cont_ids).logits.argmax(-1)
    for b, a in enumerate(anchors.tolist()):
        assert cont[b].tolist() == full[b, a:a + 4].tolist()
        assert cont_ids[b, a + 1:a + 4].tolist() == cont[b, :3].tolist()
    _, greedy = distill.target_pass(model, tap, ids, None)
    assert greedy.tolist() == model(input_ids=ids).logits.argmax(-1).tolist()


@pytest.mark.parametrize("tied", [True, False])
def test_block_logits_match_the_engine_drafter_on_the_reference_backend(tied):
    """The same weights in the engine's DFlashDrafter (kdtree_numba/dflash.py): context
    injected with extend_context, one propose; skipped where the engine has no DFlash drafter."""
    engine = pytest.importorskip("kdtree_numba.dflash")
    from kdtree_numba.bundle import DFlashSpec, random_weights
    from kdtree_numba.config import ModelConfig
    from kdtree_numba.model import Model
    cfg, w, embed, head, model = _setup(seed=5, tied=tied)
    tcfg = ModelConfig.from_hf_dict(dict(TARGET_HF, tie_word_embeddings=tied))
    tw = dict(random_weights(tcfg, 11))
    tw["model/embed_tokens"] = embed.astype(np.float32)
    if head is not None:
        tw["lm_head"] = head.astype(np.float32)
    spec = DFlashSpec(LAYER_IDS, B, tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers)
    drafter = engine.DFlashDrafter(Model(tcfg, tw, "reference"), ModelConfig(**cfg),
                                   {k: v.astype(np.float32) for k, v in w.items()}, spec)
    rng = np.random.default_rng(9)
    P = 7
    feats = (rng.standard_normal((1, P, len(LAYER_IDS) * cfg["hidden_size"])) * 2.0)
    root = 4
    drafter.start(1, 32)
    drafter.extend_context(feats.astype(np.float32), [P])
    got = np.asarray(drafter.draft(np.array([root], np.int32)))[0]
    with torch.no_grad():
        ours = model(torch.tensor(feats, dtype=torch.float32), torch.tensor([[root]]),
                     torch.tensor([[P]]))[0, 0].double().numpy()
    want = oracle_propose(cfg, w, embed, head, feats[0], root)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() / scale < 1e-5
    assert np.abs(got - ours).max() / scale < 2e-5


# ------------------------------------------------------------------ sampled text (issue 37)

def _tiny_target(seed: int = 0):
    pytest.importorskip("transformers")
    from demo import target
    torch.manual_seed(seed)
    hf = target.hf_config(target.TINY, vocab_size=40, seq_len=48)
    return hf, target.build_model(hf, "cpu").eval().requires_grad_(False)


def test_sample_next_draws_from_the_temperature_scaled_softmax():
    from demo import distill
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    temps = torch.full((20000,), 0.5)
    temps[:10] = 0.0
    got = distill.sample_next(logits, temps, torch.Generator().manual_seed(3))
    assert got[:10].tolist() == [0] * 10                          # T = 0: the argmax
    freq = torch.bincount(got[10:], minlength=5).double() / got[10:].numel()
    want = (logits[0].double() / 0.5).softmax(-1)
    # 6 standard errors of a binomial frequency: a false alarm ~1e-9 per bin
    assert (freq - want).abs().max() < 6 * (want * (1 - want) / 19990).sqrt().max()
    probs = distill.target_probs(logits[:2], torch.tensor([0.0, 0.5]))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(probs[1].double(), want, rtol=1e-6, atol=1e-7)
    mix = distill.row_temperatures([(0.0, 0.4), (0.7, 0.3), (1.0, 0.3)], 10, "cpu")
    assert mix.tolist() == pytest.approx([0.0] * 4 + [0.7] * 3 + [1.0] * 3)


def test_sampled_windows_greedy_rows_are_the_greedy_windows():
    """Rows at T = 0 of a mixed call are exactly what greedy_windows makes from the same
    starts (the draws of the hot rows do not disturb them); hot rows keep the prefix and
    differ from greedy text somewhere."""
    from demo import distill
    _, model = _tiny_target()
    stream = torch.randint(2, 40, (400,))
    temps = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])
    mixed = distill.sampled_windows(model, stream, 24, temps, 6, None,
                                    torch.Generator().manual_seed(7))
    greedy = distill.greedy_windows(model, stream, 24, 5, 6, None,
                                    torch.Generator().manual_seed(7))
    assert mixed[[0, 2]].tolist() == greedy[[0, 2]].tolist()
    assert mixed[:, :6].tolist() == greedy[:, :6].tolist()
    assert (mixed[[1, 3, 4], 6:] != greedy[[1, 3, 4], 6:]).any()


def test_weighted_kl_is_the_cross_entropy_on_one_hot_targets_and_zero_at_the_target():
    torch.manual_seed(0)
    w = dflash.position_weights(5, 4.0)
    logits = torch.randn(3, 2, 4, 11)
    labels = torch.randint(0, 11, (3, 2, 4))
    onehot = torch.nn.functional.one_hot(labels, 11).float()
    torch.testing.assert_close(dflash.weighted_kl(logits, onehot, w),
                               dflash.weighted_ce(logits, labels, w))
    probs = logits.softmax(-1)
    assert abs(dflash.weighted_kl(logits, probs, w).item()) < 1e-6
    assert dflash.weighted_kl(torch.randn(3, 2, 4, 11), probs, w).item() > 0


def test_evaluate_sampled_chain_tau_against_a_direct_computation():
    """One anchor per row is possible (a = prefix = T - B): the chain's expected tau at T = 0
    is its run of drafted tokens equal to the target's greedy continuation; at T = 1 it is
    1 + sum_k prod_{i<=k} softmax(target logits)[d_i] along the drafted chain."""
    from demo import distill
    hf, model = _tiny_target(1)
    Bk, T, pre = 4, 20, 16
    cfg = dflash.drafter_config(hf, **CFG_SIZES)
    drafter = dflash.DFlashDrafter(cfg, (0, 1), Bk, model.model.embed_tokens.weight)
    drafter.init_weights(seed=2, std=0.3)
    tap = distill.FeatureTap(model, (0, 1))
    pool = torch.randint(2, 40, (6, T))
    pre_t = torch.full((6,), pre)
    temps = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    got = distill.evaluate_sampled(drafter, model, tap, pool, pre_t, temps, None, anchors=2)
    with torch.no_grad():
        model(input_ids=pool)
        feats = tap.features()
        anc = torch.full((6, 1), pre)
        draft = drafter(feats, pool[:, pre:pre + 1], anc)[:, 0].argmax(-1)     # [6, B-1]
        chain = pool.clone()
        chain[:, pre + 1:pre + Bk] = draft
        logits = model(input_ids=chain).logits[:, pre:pre + Bk - 1]
        tap.out.clear()
    greedy_run = (logits.argmax(-1) == draft).long().cumprod(-1).sum(-1)
    p1 = logits.softmax(-1).gather(-1, draft[..., None])[..., 0].double()
    want0 = (1 + greedy_run[:3].double()).mean().item()
    want1 = (1 + p1[3:].cumprod(-1).sum(-1)).mean().item()
    assert got["0"]["blocks"] == 6 and got["1"]["blocks"] == 6              # 3 rows x 2
    assert got["0"]["chain_tau"] == pytest.approx(want0, abs=1e-4)
    assert got["1"]["chain_tau"] == pytest.approx(want1, abs=1e-4)
    assert 1.0 < want1 < 4.0 and want0 != want1         # neither end of the range


def test_init_from_a_bundle_and_the_checkpoint_round_trip(tmp_path):
    """--init reads a drafter bundle (bf16) into the module; ckpt/ restores weights (to bf16),
    AdamW moments and step; a checkpoint of another drafter config is refused."""
    pytest.importorskip("kdtree_numba.bundle")
    import export_drafter
    import train_drafter
    cfg, w, _, _, model = _setup(seed=3)
    config, tensors = _export_files(tmp_path)
    export_drafter.write(str(tmp_path), str(tmp_path / "d.kdtr"))
    dspec = {"target_layer_ids": list(LAYER_IDS), "block_size": B, "target_hidden_size": 24,
             "target_vocab_size": 50, "target_num_layers": 4}
    fresh = _setup(seed=4)[4]
    train_drafter.load_init(fresh, str(tmp_path / "d.kdtr"), cfg, dspec, lambda m: None)
    for k, v in fresh.bundle_tensors().items():
        np.testing.assert_array_equal(v.numpy(), tensors[k].float().numpy())
    with pytest.raises(SystemExit, match="not this call's"):
        train_drafter.load_init(fresh, str(tmp_path / "d.kdtr"), cfg,
                                dict(dspec, block_size=8), lambda m: None)

    from demo import trainer
    opt = trainer.make_optimizer(model, 1e-3, 0.01, 0.95)
    model(torch.randn(1, 5, 3 * 24), torch.tensor([[1]]), torch.tensor([[5]])).square().mean() \
        .backward()
    opt.step()
    files = train_drafter.save_ckpt(str(tmp_path / "ckpt"), model, opt, cfg, dspec,
                                    {"step": 7}, {"seed": 0})
    assert files == ["ckpt/ckpt-00000.safetensors", "ckpt/state.json"]
    other = _setup(seed=5)[4]
    opt2 = trainer.make_optimizer(other, 1e-3, 0.01, 0.95)
    step = train_drafter.resume(str(tmp_path / "ckpt"), other, opt2, cfg, dspec, lambda m: None)
    assert step == 7
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        small = p.numel() < 4096                            # stored fp32, else bf16
        torch.testing.assert_close(q, p if small else p.to(torch.bfloat16).float(), rtol=0,
                                   atol=0)
        assert opt2.state[q]["step"].item() == opt.state[p]["step"].item()
    with pytest.raises(SystemExit, match="config differs"):
        train_drafter.resume(str(tmp_path / "ckpt"), other, opt2, cfg,
                             dict(dspec, block_size=8), lambda m: None)


@pytest.mark.slow
def test_tiny_sampled_run_end_to_end(tmp_path):
    """``train_drafter.py --tiny --sampled`` on the shipped pair (CPU, ~100 s on 2 shared
    cores): fine-tunes the shipped drafter and writes the bundle, the drafter's files, ckpt/
    and metrics.json with the before/after chain and DDTree (budget 7) tau at T = 0, 0.7, 1."""
    pytest.importorskip("transformers")
    import subprocess
    repo = os.path.dirname(TOOLS)
    export = tmp_path / "export"
    env = dict(os.environ, PYTHONPATH=repo)
    subprocess.run([sys.executable, os.path.join(TOOLS, "bundle_to_hf.py"),
                    os.path.join(repo, "kdtree_numba", "demo", "demo-target.kdtr"), str(export)],
                   check=True, env=env, capture_output=True)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, os.path.join(TOOLS, "train_drafter.py"), "--tiny",
                          "--sampled", "--target", str(export), "--out", str(out),
                          "--workers", "2", "--eval-budgets", "7", "--metrics", os.path.join(
                              repo, "docs", "gpu-runs",
                              "2026-12-01-run32-train_target-metrics.json")],
                         env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with open(out / "metrics.json") as fh:
        m = json.load(fh)
    ev = m["heldout"]["sampled"]
    assert set(ev["before"]) == set(ev["after"]) == {"chain", "tree_7"}
    assert set(ev["before"]["tree_7"]) == set(ev["after"]["chain"]) == {"0", "0.7", "1"}
    assert m["train"]["step"] > 0 and ev["init"].endswith("demo-drafter.kdtr")
    for t in ("0", "0.7", "1"):
        assert 1.0 <= ev["after"]["chain"][t]["chain_tau"] <= 16.0
        assert 1.0 <= ev["after"]["tree_7"][t]["tau"] <= 8.0             # at most 7 nodes
        assert m["tau"]["after"]["chain"][t] == ev["after"]["chain"][t]["chain_tau"]
        assert m["tau"]["before"]["tree_7"][t] == ev["before"]["tree_7"][t]["tau"]
    assert {"drafter.kdtr", "drafter.safetensors", "metrics.json"} <= set(os.listdir(out))
    assert sorted(os.listdir(out / "ckpt")) == ["ckpt-00000.safetensors", "state.json"]
    from kdtree_numba.bundle import read_dflash_bundle
    config, _, spec = read_dflash_bundle(str(out / "drafter.kdtr"))
    ref_config, _, ref_spec = read_dflash_bundle(os.path.join(repo, "kdtree_numba", "demo",
                                                              "demo-drafter.kdtr"))
    assert config == ref_config and spec == ref_spec


def _tree_setup(seed: int):
    from demo import distill
    hf, model = _tiny_target(seed)
    cfg = dflash.drafter_config(hf, **CFG_SIZES)
    drafter = dflash.DFlashDrafter(cfg, (0, 1), 5, model.model.embed_tokens.weight)
    drafter.init_weights(seed=seed + 1, std=0.3)
    return model, drafter, distill.FeatureTap(model, (0, 1))


def _tree_of(drafter, model, tap, pool, a, budget):
    from reference.ddtree.build import build_tree
    with torch.no_grad():
        model(input_ids=pool)
        feats = tap.features()
        logits = drafter(feats, pool[:, a:a + 1], torch.full((pool.shape[0], 1), a))[:, 0]
    top = logits.log_softmax(-1).topk(min(budget, logits.shape[-1]), dim=-1)
    return build_tree(top.values.numpy(), top.indices.int().numpy(), budget)


def test_evaluate_tree_at_t0_walks_the_greedy_continuation():
    """At T = 0 the walk's tau is 1 + the number of the target's greedy tokens (after x[..a],
    distill.greedy_continuation) that the tree holds as a path from its root."""
    from demo import distill
    model, drafter, tap = _tree_setup(3)
    T, a, budget = 24, 19, 6                                  # a = T - B: the one anchor
    pool = torch.randint(2, 40, (5, T))
    got = distill.evaluate_tree(drafter, model, tap, pool, torch.full((5,), a),
                                torch.zeros(5), None, budget=budget, anchors=1)
    tree = _tree_of(drafter, model, tap, pool, a, budget)
    _, cont = distill.greedy_continuation(model, tap, pool.clone(), torch.full((5,), a), 4, None)
    taus = []
    for r in range(5):
        node, n = 0, 0
        for c in cont[r].tolist():
            kids = [s for s in range(1, budget + 1) if tree.parent[r, s] == node
                    and tree.token[r, s] == c]
            if not kids:
                break
            node, n = kids[0], n + 1
        taus.append(1 + n)
    assert got["0"]["blocks"] == 5 and got["0"]["tau"] == pytest.approx(np.mean(taus))
    assert max(taus) > 1                                      # some walk went somewhere


def test_evaluate_tree_at_t_estimates_the_expected_accepted_length():
    """At T = 0.5 the mean of the walk's estimate over many walks matches the sum over tree
    nodes of P(the target samples the node's path), computed by full forwards, within 5
    standard errors.  Budget 48 over a vocabulary of 40: the whole first level and 8 nodes
    below it, so the walk always descends once and then meets children or not by its draw."""
    from demo import distill
    model, drafter, tap = _tree_setup(4)
    T, a, budget, temp = 24, 19, 48, 0.5
    pool = torch.randint(2, 40, (2, T))
    tree = _tree_of(drafter, model, tap, pool, a, budget)
    exact = []
    with torch.no_grad():
        for r in range(2):
            total = 1.0
            for s in range(1, budget + 1):
                path, node = [], s
                while node > 0:
                    path.insert(0, int(tree.token[r, node]))
                    node = int(tree.parent[r, node])
                prob = 1.0
                for i, tok in enumerate(path):
                    x = torch.tensor([pool[r, :a + 1].tolist() + path[:i]])
                    prob *= (model(input_ids=x).logits[0, -1] / temp).softmax(-1)[tok].item()
                total += prob
            exact.append(total)
    runs = [distill.evaluate_tree(drafter, model, tap, pool, torch.full((2,), a),
                                  torch.full((2,), temp), None, budget=budget, anchors=1,
                                  seed=k)["0.5"]["tau"] for k in range(60)]
    se = np.std(runs) / np.sqrt(len(runs))
    assert se > 0                                             # the draws matter
    assert abs(np.mean(runs) - np.mean(exact)) < 5 * se
    assert 2.0 < np.mean(exact) < 3.0

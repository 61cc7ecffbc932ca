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

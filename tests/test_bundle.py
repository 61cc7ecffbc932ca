"""Model bundles (config + weights in KDTR), ModelConfig from HF configs, and the HF importer
on hand-written safetensors checkpoints (FP8 block scales, MTP layer, kimi_k2): no torch needed.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from formats import kdtr
from kdtree_numba.bundle import (BundleError, make_random_bundle, random_weights, read_bundle,
                                 read_bundle_config, size_config, write_bundle)
from kdtree_numba.hf_import import dequantize_fp8, hf_state_dict, import_hf
from kdtree_numba.config import ModelConfig, weight_shapes
from kdtree_numba.model import Model

TINY1 = dict(num_hidden_layers=2)


@pytest.fixture(scope="module")
def tiny_cfg() -> ModelConfig:
    return size_config("tiny", **TINY1)


@pytest.fixture(scope="module")
def tiny_weights(tiny_cfg) -> dict:
    return dict(random_weights(tiny_cfg, 0))


def copy_bundle(src, dst, *, drop=None, replace=None, config_attrs=None):
    """Rewrite a bundle tensor by tensor, dropping/replacing some (to build bad bundles)."""
    with kdtr.File(src) as f, kdtr.File(dst, "w") as g:
        for k, v in f.attrs.items():
            g.attrs[k] = v
        cg = g.create_group("config")
        for k, v in dict(f["config"].attrs, **(config_attrs or {})).items():
            cg.attrs[k] = v
        if "config/rope_scaling" in f:
            rg = g.create_group("config/rope_scaling")
            for k, v in f["config/rope_scaling"].attrs.items():
                rg.attrs[k] = v
        names = []
        f.visititems(lambda n, node: names.append(n) if hasattr(node, "shape") else None)
        for name in names:
            if name == drop:
                continue
            data = (replace or {}).get(name, f[name][...])
            g.create_dataset(name, data=data)
        for name, data in (replace or {}).items():
            if name not in names:
                g.create_dataset(name, data=data)


# ----------------------------------------------------------------------------- round trips

def test_random_bundle_round_trip_and_determinism(tmp_path, tiny_cfg, tiny_weights):
    path = tmp_path / "m.kdtr"
    cfg = make_random_bundle(path, "tiny", seed=0, **TINY1)
    assert cfg == tiny_cfg
    got_cfg, got = read_bundle(path)
    assert got_cfg == tiny_cfg
    assert list(got) == list(weight_shapes(tiny_cfg))
    for name, w in tiny_weights.items():
        np.testing.assert_array_equal(got[name], w)
    assert read_bundle_config(path)[1]["kdtree.bundle"] == "model"
    # the weights are O(0.1-1), as mla-moe.md asks (routing and attention not trivial)
    std = np.std(got["model/layers/1/self_attn/q_a_proj"])
    assert 0.1 < std < 0.2
    bias = got["model/layers/1/mlp/e_score_correction_bias"]
    assert 0.1 < np.std(bias) < 0.6
    norm = got["model/layers/0/input_layernorm"]
    assert norm.min() >= 0.5 and norm.max() <= 1.5


def test_random_model_routes_to_many_experts(tiny_cfg, tiny_weights):
    """Re-initialised weights make routing depend on the token (default HF init would not)."""
    from reference.layers import moe_route
    rng = np.random.default_rng(0)
    h = rng.normal(size=(64, tiny_cfg.hidden_size)).astype(np.float32)
    idx, _ = moe_route(h, tiny_weights["model/layers/1/mlp/gate"],
                       tiny_weights["model/layers/1/mlp/e_score_correction_bias"],
                       top_k=2, n_group=4, topk_group=2, norm_topk_prob=True,
                       routed_scaling_factor=2.5, scoring="sigmoid")
    assert len(np.unique(idx)) == tiny_cfg.n_routed_experts


def test_bfloat16_bundle_loads_and_runs(tmp_path):
    path = tmp_path / "bf16.kdtr"
    cfg = make_random_bundle(path, "tiny", seed=1, dtype="bfloat16", **TINY1)
    _, w = read_bundle(path)
    assert w["model/embed_tokens"].dtype == ml_dtypes.bfloat16
    f32 = {k: np.asarray(v, np.float32) for k, v in w.items()}
    seq = [1, 2, 3]
    # bf16 weights widen exactly, so the model equals its float32 copy bit for bit
    np.testing.assert_array_equal(Model.load(path, "reference").score(seq),
                                  Model(cfg, f32, "reference").score(seq))


def test_drafter_bundles(tmp_path):
    target = make_random_bundle(tmp_path / "t.kdtr", "tiny", seed=2)
    draft = make_random_bundle(tmp_path / "d.kdtr", "tiny", seed=2, role="drafter")
    assert draft.vocab_size == target.vocab_size and draft.num_hidden_layers == 1
    assert Model.load(tmp_path / "d.kdtr", "reference").score([5, 6]).shape == (2, 128)
    make_random_bundle(tmp_path / "b.kdtr", "tiny", seed=2, role="block_drafter")
    assert read_bundle_config(tmp_path / "b.kdtr")[1]["kdtree.bundle"] == "block_drafter"


def test_config_attrs_round_trip_without_optional_fields():
    cfg = size_config("tiny", q_lora_rank=None, rope_scaling=None, eos_token_id=1)
    flat, rope = cfg.to_attrs()
    assert "q_lora_rank" not in flat and rope is None
    assert ModelConfig.from_attrs(flat, rope) == cfg


# ----------------------------------------------------------------------------- bad bundles

@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("b") / "good.kdtr"
    make_random_bundle(path, "tiny", seed=0, **TINY1)
    return str(path)


def test_missing_tensor_is_named(tmp_path, good_bundle):
    bad = str(tmp_path / "bad.kdtr")
    copy_bundle(good_bundle, bad, drop="model/layers/1/self_attn/kv_b_proj")
    with pytest.raises(BundleError, match=r"missing tensor model/layers/1/self_attn/kv_b_proj "
                                          r"\(expected shape \(128, 32\)"):
        read_bundle(bad)


def test_wrong_shape_is_named(tmp_path, good_bundle):
    bad = str(tmp_path / "bad.kdtr")
    copy_bundle(good_bundle, bad,
                replace={"model/layers/1/mlp/experts/down_proj": np.zeros((8, 64, 31), "f4")})
    with pytest.raises(BundleError, match=r"tensor model/layers/1/mlp/experts/down_proj has "
                                          r"shape \(8, 64, 31\), but the config implies "
                                          r"\(8, 64, 32\)"):
        read_bundle(bad)


def test_config_weight_mismatch_is_named(tmp_path, good_bundle):
    fewer_layers = str(tmp_path / "layers.kdtr")
    copy_bundle(good_bundle, fewer_layers, config_attrs={"num_hidden_layers": 1})
    with pytest.raises(BundleError, match=r"tensor model/layers/1/\S+ is not part of a model "
                                          r"with this config \(num_hidden_layers=1"):
        read_bundle(fewer_layers)
    vocab = str(tmp_path / "vocab.kdtr")
    copy_bundle(good_bundle, vocab, config_attrs={"vocab_size": 100})
    with pytest.raises(BundleError, match=r"tensor model/embed_tokens has shape \(128, 64\), "
                                          r"but the config implies \(100, 64\)"):
        read_bundle(vocab)
    dense = str(tmp_path / "dense.kdtr")
    copy_bundle(good_bundle, dense, config_attrs={"first_k_dense_replace": 2})
    with pytest.raises(BundleError, match=r"missing tensor model/layers/1/mlp/gate_proj"):
        read_bundle(dense)


def test_bad_config_and_non_bundles(tmp_path, good_bundle):
    bad = str(tmp_path / "cfg.kdtr")
    copy_bundle(good_bundle, bad, config_attrs={"n_group": 3})
    with pytest.raises(BundleError, match="bad config.*n_group=3"):
        read_bundle(bad)
    unknown = str(tmp_path / "unknown.kdtr")
    copy_bundle(good_bundle, unknown, config_attrs={"hidden_sise": 3})
    with pytest.raises(BundleError, match="unknown config attributes.*hidden_sise"):
        read_bundle(unknown)
    weights_only = str(tmp_path / "w.kdtr")
    with kdtr.File(weights_only, "w") as f:
        f["model/embed_tokens"] = np.zeros((4, 4), "f4")
    with pytest.raises(BundleError, match="no 'config' group"):
        read_bundle(weights_only)
    garbage = tmp_path / "g.kdtr"
    garbage.write_bytes(b"not a kdtr file at all")
    with pytest.raises(BundleError, match="not a readable KDTR file"):
        read_bundle(garbage)
    with pytest.raises(FileNotFoundError):
        read_bundle(tmp_path / "nope.kdtr")
    ints = str(tmp_path / "ints.kdtr")
    copy_bundle(good_bundle, ints, replace={"model/norm": np.ones(64, np.int32)})
    with pytest.raises(BundleError, match="tensor model/norm has dtype int32"):
        read_bundle(ints)


def test_write_bundle_rejects_incomplete_weights_and_leaves_no_file(tmp_path, tiny_cfg,
                                                                     tiny_weights):
    out = tmp_path / "x.kdtr"
    partial = {k: v for k, v in tiny_weights.items() if k != "model/norm"}
    with pytest.raises(BundleError, match="missing tensor model/norm"):
        write_bundle(out, tiny_cfg, partial)
    assert not out.exists()
    extra = dict(tiny_weights, **{"model/layers/7/input_layernorm": np.ones(64, "f4")})
    with pytest.raises(BundleError, match="model/layers/7/input_layernorm is not part"):
        write_bundle(out, tiny_cfg, extra)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ----------------------------------------------------------------------------- HF configs

DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                   num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                   first_k_dense_replace=3, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   model_type="deepseek_v3", scoring_func="sigmoid", topk_method="noaux_tc",
                   rope_theta=10000, eos_token_id=1,
                   rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096})
KIMI_K2 = dict(DEEPSEEK_V3, model_type="kimi_k2", num_attention_heads=64,
               num_key_value_heads=64, n_routed_experts=384, n_group=1, topk_group=1,
               routed_scaling_factor=2.827, first_k_dense_replace=1, vocab_size=163840,
               rope_theta=50000.0, eos_token_id=[163585, 163586],
               rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096})


@pytest.mark.parametrize("hf, tau", [(DEEPSEEK_V3, 0.135234), (KIMI_K2, 0.130861)])
def test_real_configs_parse_with_published_softmax_scale(hf, tau):
    from kdtree_numba.model import _rope_spec
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.num_attention_heads == hf["num_attention_heads"]
    assert cfg.rope_scaling["factor"] == hf["rope_scaling"]["factor"]
    assert cfg.eos_token_id in (1, 163585)
    assert abs(_rope_spec(cfg).softmax_scale(cfg.qk_head_dim) - tau) < 5e-7
    params = sum(int(np.prod(s)) for s in weight_shapes(cfg).values())
    assert 6.6e11 < params < 1.05e12          # 671 B (without MTP) and ~1 T parameters


def test_transformers5_rope_parameters_and_rejections():
    v5 = dict(size_config("tiny").to_hf_dict())
    rope = v5.pop("rope_scaling")
    v5.pop("rope_theta")
    v5["rope_parameters"] = dict(rope, rope_type="yarn", rope_theta=10000.0)
    assert ModelConfig.from_hf_dict(v5) == size_config("tiny")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        ModelConfig.from_hf_dict(dict(v5, model_type="llama"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict(dict(v5, num_key_value_heads=1))
    with pytest.raises(ValueError, match="rope scaling type 'linear'"):
        ModelConfig.from_hf_dict(dict(v5, rope_parameters={"rope_type": "linear",
                                                           "factor": 2.0}))


# ----------------------------------------------------------------------------- HF import

def write_safetensors(path, tensors: dict) -> None:
    """A minimal safetensors writer (so these tests need no torch)."""
    names = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": names[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def quantize_fp8(w: np.ndarray, block=128):
    """Per-block FP8 e4m3 quantisation as DeepSeek ships it: q = w / s, s = absmax / 448."""
    rows, cols = w.shape
    nb = (-(-rows // block), -(-cols // block))
    scale = np.zeros(nb, np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nb[0]):
        for j in range(nb[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = np.float32(np.abs(blk).max() / 448.0)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                (blk / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def test_dequantize_fp8_uses_the_block_of_each_element():
    q = np.ones((130, 260), ml_dtypes.float8_e4m3fn)
    s = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
    w = dequantize_fp8(q, s)
    assert w[0, 0] == 1 and w[127, 255] == 2 and w[128, 256] == 6 and w[129, 127] == 4
    with pytest.raises(BundleError, match="scale shape"):
        dequantize_fp8(q, s[:, :2])


def test_import_fp8_kimi_checkpoint_with_mtp_layer(tmp_path):
    """A kimi_k2 config.json, two shards with an index, FP8 block-scaled projections (one
    wider than a 128 block), per-expert names and an extra MTP layer that must be dropped."""
    cfg = size_config("tiny", num_hidden_layers=2, hidden_size=160, q_lora_rank=None,
                      n_group=1, topk_group=1)
    weights = dict(random_weights(cfg, 5))
    state = hf_state_dict(cfg, weights)
    fp8_names = ["model.layers.1.self_attn.q_proj.weight",           # [96, 160]: 2 col blocks
                 "model.layers.0.mlp.gate_proj.weight"]               # [96, 160]
    expected = {}
    shard_a, shard_b = {}, {}
    for i, (name, arr) in enumerate(state.items()):
        shard = shard_a if i % 2 else shard_b
        if name in fp8_names:
            q, s = quantize_fp8(np.asarray(arr, np.float32))
            shard[name], shard[name + "_scale_inv"] = q, s
            expected[name] = dequantize_fp8(q, s)
        else:
            shard[name] = np.asarray(arr, np.float32)
    shard_b["model.layers.2.self_attn.q_proj.weight"] = np.zeros((96, 160), np.float32)  # MTP
    hf_dir = tmp_path / "kimi"
    hf_dir.mkdir()
    write_safetensors(hf_dir / "a.safetensors", shard_a)
    write_safetensors(hf_dir / "b.safetensors", shard_b)
    index = {"weight_map": {**{n: "a.safetensors" for n in shard_a},
                            **{n: "b.safetensors" for n in shard_b}}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    hf = dict(cfg.to_hf_dict(), model_type="kimi_k2", num_nextn_predict_layers=1,
              quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (hf_dir / "config.json").write_text(json.dumps(hf))
    out = tmp_path / "kimi.kdtr"
    got_cfg = import_hf(hf_dir, out, dtype="float32", quiet=True)
    assert got_cfg == cfg.replace(model_type="kimi_k2")
    _, got = read_bundle(out)
    np.testing.assert_array_equal(got["model/layers/1/self_attn/q_proj"],
                                  expected["model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(got["model/layers/0/mlp/gate_proj"],
                                  expected["model.layers.0.mlp.gate_proj.weight"])
    # FP8 keeps 3 mantissa bits: the dequantised weight is within 1/16 of the original
    w = weights["model/layers/1/self_attn/q_proj"]
    assert np.abs(got["model/layers/1/self_attn/q_proj"] - w).max() <= np.abs(w).max() / 16
    for name in ("model/layers/1/mlp/experts/gate_up_proj", "model/embed_tokens", "lm_head"):
        np.testing.assert_array_equal(got[name], weights[name])
    # auto dtype: float32 sources stay float32
    import_hf(hf_dir, tmp_path / "auto.kdtr", quiet=True)
    assert read_bundle(tmp_path / "auto.kdtr")[1]["lm_head"].dtype == np.float32


def test_import_reports_missing_checkpoint_tensor(tmp_path):
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1)
    state = {k: np.asarray(v, np.float32)
             for k, v in hf_state_dict(cfg, dict(random_weights(cfg, 0))).items()}
    del state["model.layers.0.self_attn.kv_b_proj.weight"]
    write_safetensors(tmp_path / "model.safetensors", state)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with pytest.raises(BundleError, match="no tensor model.layers.0.self_attn.kv_b_proj.weight"):
        import_hf(tmp_path, tmp_path / "out.kdtr", quiet=True)
    assert not (tmp_path / "out.kdtr").exists()


def test_import_peak_memory_is_about_one_tensor(tmp_path):
    """The importer streams: its anonymous memory grows by about the largest tensor it writes
    (a layer's stacked experts, 32 MiB here), not two of them.  tools/bench_import.py measures it
    in a fresh interpreter; keeping the previous tensor alive while the next is stacked, or
    copying a mapped float32 source, gave ~2x."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "import.json"
    subprocess.run([sys.executable, os.path.join(root, "tools", "bench_import.py"), "--size",
                    "small", "--experts", "256", "--json", str(out)], check=True,
                   capture_output=True, timeout=300)
    row = json.loads(out.read_text())
    assert row["largest_tensor_mib"] == 32.0
    assert row["peak_anon_growth_mib"] <= 1.2 * row["largest_tensor_mib"] + 24, row

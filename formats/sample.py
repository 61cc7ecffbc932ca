"""A small model-shaped KDTR file for the README's first ``kdtr-dump`` command and for tests.

A 2-layer DeepSeek-V3 / Kimi-K2 shaped model (MLA attention, layer 0 dense, layer 1 MoE with 4
routed experts and one shared expert) at toy sizes: bf16 weights, fp32 norms and router, the
config as root attributes.  Deterministic: the same bytes on every run (the lead commits a copy
as tests/vectors/sample_model.kdtr; ``kdtr-dump --sample OUT`` writes one).
"""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from . import kdtr

__all__ = ["SAMPLE_CONFIG", "write_sample"]

SAMPLE_CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "intermediate_size": 96, "moe_intermediate_size": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True,
}


def _weights(rng: np.random.Generator, out_dim: int, in_dim: int) -> np.ndarray:
    """[out, in] bf16, y = x W^T; scaled like a trained layer (std ~ 1/sqrt(in))."""
    return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(ml_dtypes.bfloat16)


def _norm(rng: np.random.Generator, dim: int) -> np.ndarray:
    return (1.0 + 0.05 * rng.standard_normal(dim)).astype(np.float32)


def _ffn(group, rng: np.random.Generator, d: int, inner: int) -> None:
    group["gate_proj"] = _weights(rng, inner, d)
    group["up_proj"] = _weights(rng, inner, d)
    group["down_proj"] = _weights(rng, d, inner)


def write_sample(path: str | os.PathLike) -> None:
    """Write the sample model (about 230 KB) to ``path``."""
    c = SAMPLE_CONFIG
    d, heads, r, dr = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], \
        c["qk_rope_head_dim"]
    dn, dv, rq = c["qk_nope_head_dim"], c["v_head_dim"], c["q_lora_rank"]
    experts = c["n_routed_experts"]
    rng = np.random.default_rng(20250611)
    with kdtr.File(path, "w") as f:
        for key, value in c.items():
            f.attrs[key] = value
        f.attrs["description"] = "toy DeepSeek-V3-shaped model written by formats.sample"
        f["embed"] = _weights(rng, c["vocab_size"], d)
        for layer in range(c["num_hidden_layers"]):
            g = f.create_group(f"layers/{layer}")
            moe = layer >= c["first_k_dense_replace"]
            g.attrs["mlp"] = "moe" if moe else "dense"
            g["attn_norm"] = _norm(rng, d)
            attn = g.create_group("attn")
            attn["q_a_proj"] = _weights(rng, rq, d)
            attn["q_a_norm"] = _norm(rng, rq)
            attn["q_b_proj"] = _weights(rng, heads * (dn + dr), rq)
            attn["kv_a_proj"] = _weights(rng, r + dr, d)
            attn["kv_a_norm"] = _norm(rng, r)
            attn["kv_b_proj"] = _weights(rng, heads * (dn + dv), r)
            attn["o_proj"] = _weights(rng, d, heads * dv)
            g["ffn_norm"] = _norm(rng, d)
            if not moe:
                _ffn(g.create_group("mlp"), rng, d, c["intermediate_size"])
                continue
            mlp = g.create_group("mlp")
            mlp["router"] = (0.02 * rng.standard_normal((experts, d))).astype(np.float32)
            mlp["router_bias"] = (0.01 * rng.standard_normal(experts)).astype(np.float32)
            mlp["router"].attrs["scoring"] = "sigmoid"
            for e in range(experts):
                _ffn(mlp.create_group(f"experts/{e}"), rng, d, c["moe_intermediate_size"])
            _ffn(mlp.create_group("shared"), rng, d,
                 c["moe_intermediate_size"] * c["n_shared_experts"])
        f["norm"] = _norm(rng, d)
        f["lm_head"] = _weights(rng, c["vocab_size"], d)

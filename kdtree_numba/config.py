"""The model's configuration and parameter list, apart from the model that runs them.

``ModelConfig`` carries the Hugging Face ``DeepseekV3Config`` fields (``kimi_k2`` configs load
as the same thing); ``weight_shapes(config)`` names every parameter the model needs, in bundle
layout (HF names with ``/`` for ``.`` and no ``.weight`` suffix, experts stacked).  Bundles
(kdtree_numba/bundle.py), the HF importer (kdtree_numba/hf_import.py) and the model
(kdtree_numba/model.py) all read them from here, so none of them imports another for them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

__all__ = ["ModelConfig", "weight_shapes", "HF_MODEL_TYPES", "ROPE_SCALING_KEYS"]

HF_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ROPE_SCALING_KEYS = ("type", "factor", "original_max_position_embeddings", "beta_fast",
                     "beta_slow", "mscale", "mscale_all_dim")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF ``DeepseekV3Config`` this engine uses (HF names and meanings)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # dense FFN width (layers < first_k_dense_replace)
    moe_intermediate_size: int        # per routed expert (and per shared expert)
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None           # None: a single q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"     # "sigmoid" (V3/K2, with e_score_correction_bias) | "softmax"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # YaRN: type, factor, original_max_position_embeddings, ...
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "deepseek_v3"

    def __post_init__(self):
        self.validate()

    # ---- derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_dense_layer(self, layer: int) -> bool:
        return layer < self.first_k_dense_replace

    def validate(self) -> None:
        """ValueError naming the first inconsistent field."""
        positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                    "num_experts_per_tok", "n_group", "topk_group")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"config field q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config field qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"config field first_k_dense_replace={self.first_k_dense_replace} "
                             f"must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.n_shared_experts < 0:
            raise ValueError("config field n_shared_experts must be >= 0")
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"config field scoring_func must be sigmoid or softmax, "
                             f"got {self.scoring_func!r}")
        E = self.n_routed_experts
        if E % self.n_group or self.topk_group > self.n_group \
                or self.num_experts_per_tok > (E // self.n_group) * self.topk_group:
            raise ValueError(f"config fields n_routed_experts={E}, n_group={self.n_group}, "
                             f"topk_group={self.topk_group}, num_experts_per_tok="
                             f"{self.num_experts_per_tok} are inconsistent")
        if self.rope_scaling is not None and self.rope_scaling.get("type") not in ("yarn",):
            raise ValueError(f"config field rope_scaling: only YaRN is supported, got "
                             f"{self.rope_scaling!r}")

    # ---- Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """From a ``config.json`` dict of model_type deepseek_v3 or kimi_k2 (transformers 4
        ``rope_theta``/``rope_scaling`` or transformers 5 ``rope_parameters``)."""
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a DeepSeek-V3 architecture "
                             f"(accepted: {HF_MODEL_TYPES})")
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads", heads) not in (None, heads):
            raise ValueError("MLA needs num_key_value_heads == num_attention_heads")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
        theta, scaling = _hf_rope(hf)
        eos = hf.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf.items() if k in fields}
        kwargs.update(rope_theta=theta, rope_scaling=scaling, eos_token_id=eos,
                      model_type=model_type,
                      scoring_func=hf.get("scoring_func", "sigmoid"),
                      rope_interleave=bool(hf.get("rope_interleave", True)),
                      n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                      first_k_dense_replace=hf.get("first_k_dense_replace") or 0)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """A ``config.json`` dict that transformers' DeepseekV3Config accepts."""
        d = dataclasses.asdict(self)
        d.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                 num_key_value_heads=self.num_attention_heads, hidden_act="silu",
                 topk_method="noaux_tc" if self.scoring_func == "sigmoid" else "greedy")
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    # ---- KDTR attributes (None fields are left out; rope_scaling is a sub-group)
    def to_attrs(self) -> tuple[dict, dict | None]:
        flat = {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and k != "rope_scaling"}
        return flat, (dict(self.rope_scaling) if self.rope_scaling is not None else None)

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any], rope_scaling: Mapping | None) -> "ModelConfig":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(attrs) - set(fields))
        if unknown:
            raise ValueError(f"unknown config attributes {unknown}")
        kwargs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}
        kwargs["rope_scaling"] = dict(rope_scaling) if rope_scaling is not None else None
        kwargs.setdefault("q_lora_rank", None)
        return cls(**kwargs)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _hf_rope(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, YaRN dict or None) from either HF rope spelling."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if scaling is None and params.get("rope_type", "default") not in ("default", None):
        scaling = params
    if scaling is None:
        return theta, None
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind != "yarn":
        raise ValueError(f"rope scaling type {kind!r} is not supported (yarn only)")
    out = {"type": "yarn"}
    for key in ROPE_SCALING_KEYS[1:]:
        if scaling.get(key) is not None:
            out[key] = scaling[key]
    return theta, out


# ----------------------------------------------------------------------------- parameters

def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model in bundle layout, name -> shape, in a stable order."""
    D, V, H, r, dr = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads,
                      cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    dn, dv, E, Im = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.n_routed_experts, \
        cfg.moe_intermediate_size
    shapes = {"model/embed_tokens": (V, D)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model/layers/{layer}/"
        shapes[p + "input_layernorm"] = (D,)
        if cfg.q_lora_rank is None:
            shapes[p + "self_attn/q_proj"] = (H * (dn + dr), D)
        else:
            shapes[p + "self_attn/q_a_proj"] = (cfg.q_lora_rank, D)
            shapes[p + "self_attn/q_a_layernorm"] = (cfg.q_lora_rank,)
            shapes[p + "self_attn/q_b_proj"] = (H * (dn + dr), cfg.q_lora_rank)
        shapes[p + "self_attn/kv_a_proj_with_mqa"] = (r + dr, D)
        shapes[p + "self_attn/kv_a_layernorm"] = (r,)
        shapes[p + "self_attn/kv_b_proj"] = (H * (dn + dv), r)
        shapes[p + "self_attn/o_proj"] = (D, H * dv)
        shapes[p + "post_attention_layernorm"] = (D,)
        if cfg.is_dense_layer(layer):
            I = cfg.intermediate_size
            shapes.update({p + "mlp/gate_proj": (I, D), p + "mlp/up_proj": (I, D),
                           p + "mlp/down_proj": (D, I)})
            continue
        shapes[p + "mlp/gate"] = (E, D)
        shapes[p + "mlp/e_score_correction_bias"] = (E,)
        shapes[p + "mlp/experts/gate_up_proj"] = (E, 2 * Im, D)
        shapes[p + "mlp/experts/down_proj"] = (E, D, Im)
        if cfg.n_shared_experts:
            Is = Im * cfg.n_shared_experts
            shapes.update({p + "mlp/shared_experts/gate_proj": (Is, D),
                           p + "mlp/shared_experts/up_proj": (Is, D),
                           p + "mlp/shared_experts/down_proj": (D, Is)})
    shapes["model/norm"] = (D,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (V, D)
    return shapes

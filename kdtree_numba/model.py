"""A DeepSeek-V3 / Kimi-K2 (MLA + MoE) model, written once, running on either backend.

``ModelConfig`` carries the Hugging Face ``DeepseekV3Config`` fields (``kimi_k2`` configs load
as the same thing); ``weight_shapes(config)`` names every parameter the model needs, in bundle
layout (HF names with ``/`` for ``.`` and no ``.weight`` suffix, experts stacked); ``Model`` runs
the forward pass through ``backend.xp`` (glue) and ``backend.ops`` (kernels) only, so the NumPy
reference and the numba.cuda kernels execute the very same model code (kdtree_numba/backends.py).

One forward serves every phase: ``model.forward(tokens [bs, n], positions [bs, n], cache,
visible [bs, n, n]) -> logits [bs, n, V]`` writes the n new latents into the cache at
``[len_b, len_b + n)`` (uncommitted: the caller commits, kvcache.py) and lets token i of request
b attend to the cached prefix plus the new tokens j with ``visible[b, i, j]``.  A causal
``visible`` is prefill, n = 1 is decode, a DDTree ancestor mask with depth positions is tree
verification.  The math is shared/notes/mla-moe.md (absorbed MLA: the cache holds only the
latent c and the rope key).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Mapping

import numpy as np

from kdtree_numba.backends import Backend, make_backend
from kdtree_numba.graphs import ForwardGraphs, ForwardInputs, graphs_enabled
from kdtree_numba.kvcache import KVCache

__all__ = ["ModelConfig", "Model", "weight_shapes", "causal_mask", "LATENT_NORM_EPS",
           "HF_MODEL_TYPES"]

# generation caches are sized in steps of this many tokens, so that the next generation can reuse
# one (and the CUDA graphs captured against it): Model.reuse_cache
CACHE_BUCKET = 256
# q_a_layernorm and kv_a_layernorm use 1e-6 whatever rms_norm_eps says (DeepSeek's code).
LATENT_NORM_EPS = 1e-6
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


def causal_mask(n: int, bs: int = 1) -> np.ndarray:
    """visible [bs, n, n] for prefill: token i sees new tokens j <= i."""
    return np.broadcast_to(np.tri(n, dtype=bool), (bs, n, n)).copy()


# ----------------------------------------------------------------------------- the model

class Model:
    """The forward pass of a ModelConfig with its weights on one backend."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Any], backend="auto"):
        self.config = config
        self.backend: Backend = make_backend(backend)
        self.rope = _rope_spec(config)
        self.tau = float(self.rope.softmax_scale(config.qk_head_dim))
        self._load(weights)
        # CUDA graphs of repeated forward shapes (kdtree_numba/graphs.py); None: every
        # forward runs eagerly (the reference backend, the simulator, KDTREE_CUDA_GRAPHS=0)
        self.graphs = None
        # engine.generate's KV cache, kept for the next generation (reuse_cache)
        self.generation_cache: KVCache | None = None
        if self.backend.on_gpu and self.backend.name == "numba" and graphs_enabled():
            self.graphs = ForwardGraphs(self.backend)

    @classmethod
    def load(cls, path, backend="auto") -> "Model":
        """A model bundle (.kdtr, kdtree_numba/bundle.py), validated, on ``backend``."""
        from kdtree_numba.bundle import read_bundle
        config, weights = read_bundle(path)
        return cls(config, weights, backend)

    # ---- weights: bundle tensors -> backend arrays in the layouts the kernels take
    def _load(self, weights: Mapping[str, Any]) -> None:
        cfg, put = self.config, self.backend.asarray

        def w(name):
            return put(np.ascontiguousarray(weights[name]))

        def w32(name):  # for kernels that take float32 only (absorb_q/apply_uv, the router)
            return put(np.ascontiguousarray(weights[name], dtype=np.float32))

        def fused(*names):  # gate rows first, then up rows (the kernels' gate_up layout)
            # joined by the backend: on a GPU each part goes up once, no joined host copy
            return self.backend.xp.concatenate([w(n) for n in names], axis=0)

        self.embed = w("model/embed_tokens")
        self.final_norm = w("model/norm")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head")
        self.layers = []
        for layer in range(cfg.num_hidden_layers):
            p = f"model/layers/{layer}/"
            lw = SimpleNamespace(input_norm=w(p + "input_layernorm"),
                                 post_norm=w(p + "post_attention_layernorm"),
                                 kv_a=w(p + "self_attn/kv_a_proj_with_mqa"),
                                 kv_a_norm=w(p + "self_attn/kv_a_layernorm"),
                                 kv_b=w32(p + "self_attn/kv_b_proj"),
                                 o_proj=w(p + "self_attn/o_proj"),
                                 q_proj=None, q_a=None, q_a_norm=None, q_b=None,
                                 router=None, router_bias=None, shared_gate_up=None,
                                 shared_down=None)
            if cfg.q_lora_rank is None:
                lw.q_proj = w(p + "self_attn/q_proj")
            else:
                lw.q_a, lw.q_a_norm, lw.q_b = (w(p + "self_attn/" + n) for n in
                                               ("q_a_proj", "q_a_layernorm", "q_b_proj"))
            if cfg.is_dense_layer(layer):  # a dense FFN is a one-expert MoE with weight 1
                lw.gate_up = fused(p + "mlp/gate_proj", p + "mlp/up_proj")[None]
                lw.down = w(p + "mlp/down_proj")[None]
            else:
                # the router runs in fp32 or better, whatever the weights' storage dtype
                lw.router = w32(p + "mlp/gate")
                lw.router_bias = w32(p + "mlp/e_score_correction_bias")
                lw.gate_up = w(p + "mlp/experts/gate_up_proj")
                lw.down = w(p + "mlp/experts/down_proj")
                if cfg.n_shared_experts:
                    lw.shared_gate_up = fused(p + "mlp/shared_experts/gate_proj",
                                              p + "mlp/shared_experts/up_proj")
                    lw.shared_down = w(p + "mlp/shared_experts/down_proj")
            self.layers.append(lw)

    # ---- public API
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.config
        return KVCache(self.backend, cfg.num_hidden_layers, batch, max_len, cfg.kv_lora_rank,
                       cfg.qk_rope_head_dim)

    def reuse_cache(self, previous: KVCache | None, batch: int, max_len: int) -> KVCache:
        """An empty cache for a new generation: ``previous`` emptied when it has ``batch``
        requests and the same capacity bucket, else a new cache of ``max_len`` rounded up to a
        multiple of CACHE_BUCKET.  CUDA graphs are captured against a cache's buffers
        (kdtree_numba/graphs.py), so reusing them lets the next generation replay them."""
        bucket = -(-int(max_len) // CACHE_BUCKET) * CACHE_BUCKET
        if previous is not None and previous.batch == batch and previous.max_len == bucket:
            previous.truncate(np.zeros(batch, np.int64))
            return previous
        return self.new_cache(batch, bucket)

    def forward(self, tokens, positions, cache: KVCache, visible, *, return_hidden=False,
                embeds=None):
        """Logits [bs, n, V] float32 (``backend.xp``) of n new tokens per request.

        tokens, positions [bs, n] int; visible [bs, n, n] bool (host or device: a device
        ``tokens``, e.g. a drafter's own argmax, is used in place, never read back).  Writes the
        new latents at ``[cache.lengths[b], + n)`` without committing them (module docstring).
        With ``return_hidden`` also returns the final normed hidden states [bs, n, D].
        ``embeds`` [bs, n, D] float32 replaces the token embeddings (tokens then only give the
        shape; the BlockDrafter feeds MASK slots and target features this way).
        Host inputs are uploaded once per forward (asynchronous copies), so a forward never
        waits for the device.  On the GPU a shape seen before replays a CUDA graph
        (kdtree_numba/graphs.py).
        """
        be = self.backend
        tokens = tokens if hasattr(tokens, "shape") else np.asarray(tokens)
        if len(tokens.shape) != 2:
            raise ValueError(f"tokens must be [batch, n], got shape {tuple(tokens.shape)}")
        bs, n = tokens.shape
        if cache.batch != bs:
            raise ValueError(f"cache holds {cache.batch} requests, tokens {bs}")
        visible = visible if hasattr(visible, "shape") else np.asarray(visible)
        if tuple(visible.shape) != (bs, n, n):
            raise ValueError(f"visible must be {(bs, n, n)}, got {tuple(visible.shape)}")
        if self.graphs is not None and embeds is None:
            out = self.graphs.forward(self, tokens, positions, cache, visible, return_hidden)
            if out is not None:
                return out
        slots = cache.write_slots(n)
        if self.graphs is not None:
            # the graphs' split plan (the cache's capacity): eager calls then compile the
            # kernels a capture will use (the merge), and give the same bits as a replay
            slots = dataclasses.replace(slots, max_keys=cache.max_len)
        inputs = ForwardInputs(tokens=be.asarray(tokens).astype(np.int32),
                               positions=be.asarray(positions).astype(np.int32).reshape(bs * n),
                               visible=be.asarray(visible).astype(bool), slots=slots)
        return self._compute(inputs, cache, return_hidden, embeds)

    def _compute(self, inputs, cache: KVCache, return_hidden: bool, embeds):
        """The forward on device inputs (graphs.ForwardInputs): only device work, so a CUDA
        graph can capture it."""
        ops, be, cfg = self.backend.ops, self.backend, self.config
        tokens, positions, visible, slots = (inputs.tokens, inputs.positions, inputs.visible,
                                             inputs.slots)
        bs, n = tokens.shape
        if embeds is None:
            x = ops.embedding(tokens.reshape(bs * n), self.embed)
        else:
            x = be.xp.ascontiguousarray(be.asarray(embeds).reshape(bs * n, cfg.hidden_size),
                                        dtype=np.float32)
        for layer, lw in enumerate(self.layers):
            h = ops.rmsnorm(x, lw.input_norm, cfg.rms_norm_eps)
            x = x + self._attention(lw, layer, h, positions, cache, slots, visible, bs, n)
            h = ops.rmsnorm(x, lw.post_norm, cfg.rms_norm_eps)
            x = x + self._ffn(lw, h)
        h = ops.rmsnorm(x, self.final_norm, cfg.rms_norm_eps)
        logits = ops.linear(h, self.lm_head).reshape(bs, n, cfg.vocab_size)
        return (logits, h.reshape(bs, n, -1)) if return_hidden else logits

    def _attention(self, lw, layer, h, positions, cache, slots, visible, bs, n):
        """Absorbed MLA of one layer; writes this layer's latents of the n tokens."""
        xp, ops, cfg = self.backend.xp, self.backend.ops, self.config
        M, H = bs * n, cfg.num_attention_heads
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
            cfg.kv_lora_rank
        if lw.q_proj is not None:
            q = ops.linear(h, lw.q_proj)
        else:
            q = ops.linear(ops.rmsnorm(ops.linear(h, lw.q_a), lw.q_a_norm, LATENT_NORM_EPS),
                           lw.q_b)
        q = q.reshape(M, H, dn + dr)
        q_nope = xp.ascontiguousarray(q[:, :, :dn]).reshape(bs, n, H, dn)
        q_pe = ops.rope(xp.ascontiguousarray(q[:, :, dn:]), positions, self.rope)
        kv = ops.linear(h, lw.kv_a)                                        # [M, r + dr]
        c = ops.rmsnorm(xp.ascontiguousarray(kv[:, :r]), lw.kv_a_norm, LATENT_NORM_EPS)
        k_pe = ops.rope(xp.ascontiguousarray(kv[:, r:]).reshape(M, 1, dr), positions, self.rope)
        cache.write(layer, c.reshape(bs, n, r), k_pe.reshape(bs, n, dr), slots)
        q_abs = ops.absorb_q(q_nope, lw.kv_b)
        # a device prefix (no per-layer upload); max_keys keeps the split plan a host lengths
        # array would give, so the numbers do not change
        u = ops.mla_attention(q_abs, q_pe.reshape(bs, n, H, dr), cache.c[layer],
                              cache.k_pe[layer], slots.prefix, visible, self.tau,
                              max_keys=slots.max_keys)
        o = ops.apply_uv(u, lw.kv_b, dv)
        return ops.linear(o.reshape(M, H * dv), lw.o_proj)

    def _ffn(self, lw, h):
        xp, ops, cfg = self.backend.xp, self.backend.ops, self.config
        M = h.shape[0]
        if lw.router is None:
            return ops.moe_ffn(h, xp.zeros((M, 1), np.int32), xp.ones((M, 1), np.float32),
                               lw.gate_up, lw.down)
        idx, weight = ops.moe_route(h, lw.router, lw.router_bias,
                                    top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                                    topk_group=cfg.topk_group,
                                    norm_topk_prob=cfg.norm_topk_prob,
                                    routed_scaling_factor=cfg.routed_scaling_factor,
                                    scoring=cfg.scoring_func)
        return ops.moe_ffn(h, idx, weight, lw.gate_up, lw.down, lw.shared_gate_up,
                           lw.shared_down)

    def score(self, token_ids) -> np.ndarray:
        """Host float32 logits [T, V] of one sequence from position 0, through a fresh cache
        that is dropped afterwards (the model keeps no state)."""
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        T = ids.size
        if T == 0:
            raise ValueError("score needs at least one token")
        cache = self.new_cache(1, T)
        logits = self.forward(ids[None], np.arange(T)[None], cache, causal_mask(T))
        return np.asarray(self.backend.to_host(logits[0]), np.float32)


def _rope_spec(cfg: ModelConfig):
    """The kernels' RopeSpec, built by their own HF-config constructor (one reading of YaRN)."""
    from reference.layers import RopeSpec
    hf = {"rope_theta": cfg.rope_theta, "qk_rope_head_dim": cfg.qk_rope_head_dim,
          "rope_interleave": cfg.rope_interleave, "rope_scaling": cfg.rope_scaling}
    return RopeSpec.from_hf_config(hf)


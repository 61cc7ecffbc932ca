"""The DFlash block drafter in torch: the trainer's side of the engine's drafter.

One spec for both sides (the engine's numba/NumPy drafter and this module): docs/DEMO.md,
"The DFlash drafter".  In short:

* target features: the residual stream after target decoder layers ``target_layer_ids``
  (0-based, before any final norm), concatenated and fused, ``f = rmsnorm(fc(feature))``;
* a short stack of DeepSeek-V3 decoder layers (MLA with a plain q_proj, dense SwiGLU MLP,
  RMSNorm eps ``rms_norm_eps``, RoPE in NeoX halves at absolute positions, scale
  ``(dn + dr)^-0.5``), whose keys and values come from [context ; block]: a context entry at
  position p is ``kv_a(f(p))`` (no input_layernorm: f is already normed), a block slot's is
  ``kv_a(input_layernorm(x))`` as in any DeepSeek-V3 layer;
* a block of B slots at positions a .. a+B-1: ``[embed(root), mask_embedding x (B-1)]``,
  bidirectional inside the block, seeing the context strictly before a;
* logits of slots 1..B-1 through the target's frozen lm_head (its embedding when tied).

MLA is run un-absorbed here (``kv_b`` expands the latents to per-head keys and values);
the engine runs it absorbed: the same function.  Training puts many blocks of one sequence in
one forward (``block_mask``); each sees exactly what it would see alone.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

# The spec's default sizes for the demo target (D 256, 6 layers, vocab 8192).
DEFAULT_SIZES = dict(num_hidden_layers=2, num_attention_heads=8, kv_lora_rank=64,
                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                     intermediate_size=768)
TARGET_LAYER_IDS = (1, 3, 5)
LATENT_NORM_EPS = 1e-6          # kv_a_layernorm's eps in every DeepSeek-V3 layer
BLOCK_SIZE = 8
GAMMA = 4.0


def drafter_config(target_hf: dict, **overrides) -> dict:
    """The drafter's ModelConfig fields (a dict, as it goes into drafter_config.json) from the
    target's HF config.json dict: the target's vocabulary, width, rope theta, eps, context and
    embedding tying; the drafter's own attention and MLP sizes; every layer dense, a plain
    q_proj, NeoX rope, no YaRN.  The MoE fields are the target's (unused: no MoE layer)."""
    from kdtree_numba.config import ModelConfig
    target = ModelConfig.from_hf_dict(target_hf)
    sizes = dict(DEFAULT_SIZES, **overrides)
    cfg = target.replace(**sizes, first_k_dense_replace=sizes["num_hidden_layers"],
                         q_lora_rank=None, rope_interleave=False, rope_scaling=None)
    return dataclasses.asdict(cfg)


def bundle_names(cfg: dict, n_features: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter bundle stores, name -> shape: ``weight_shapes`` of the config
    minus the target's embedding and lm_head, plus the three dflash tensors."""
    from kdtree_numba.config import ModelConfig, weight_shapes
    shapes = weight_shapes(ModelConfig(**cfg))
    shapes.pop("model/embed_tokens")
    shapes.pop("lm_head", None)
    D = cfg["hidden_size"]
    shapes.update({"dflash/fc": (D, n_features * D), "dflash/hidden_norm": (D,),
                   "dflash/mask_embedding": (D,)})
    return shapes


# ----------------------------------------------------------------------------- pieces

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(theta: float, dr: int, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_positions, dr/2] (float32, angles computed in float64 as the engine does):
    ``inv_freq_i = theta^(-2i/dr)``."""
    inv = theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    ang = torch.arange(n_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX halves: pair i is (x[i], x[i + dr/2]); ``cos``/``sin`` broadcast to x[..., :dr/2]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def block_mask(anchors: torch.Tensor, n_ctx: int, B: int) -> torch.Tensor:
    """[bs, A*B, n_ctx + A*B] bool, True = visible: block slot (i, s) sees context key t iff
    t < anchors[i], and the B slots of block i (itself included), nothing else."""
    bs, A = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(B, dim=1)                            # [bs, A*B]
    ctx = torch.arange(n_ctx, device=dev)[None, None, :] < q_anchor[:, :, None]
    blk_id = torch.arange(A, device=dev).repeat_interleave(B)
    own = (blk_id[:, None] == blk_id[None, :]).expand(bs, -1, -1)
    return torch.cat([ctx, own], dim=2)


class MLAttention(nn.Module):
    """DeepSeek-V3 MLA with a plain q_proj; keys/values from [context latents ; block]."""

    def __init__(self, cfg: dict):
        super().__init__()
        D, H = cfg["hidden_size"], cfg["num_attention_heads"]
        self.H, self.r = H, cfg["kv_lora_rank"]
        self.dn, self.dr, self.dv = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                     cfg["v_head_dim"])
        self.scale = (self.dn + self.dr) ** -0.5
        self.q_proj = nn.Linear(D, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.r + self.dr, bias=False)
        # 1e-6 whatever rms_norm_eps says, as DeepSeek's code, HF and the engine
        self.kv_a_layernorm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.r, H * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)

    def latents(self, x, cos, sin):
        """(c [.., r] normed, k_pe [.., dr] rotated) of inputs x: what the cache holds."""
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., :self.r]).to(kv.dtype)
        return c, rope_halves(kv[..., self.r:], cos, sin)

    def forward(self, h, cos, sin, ctx_c, ctx_kpe, mask):
        """h [bs, M, D] (normed block inputs) at rope ``cos``/``sin`` [bs, M, dr/2]; context
        latents [bs, T, r] / [bs, T, dr]; mask [bs, M, T + M]."""
        bs, M, _ = h.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        q = self.q_proj(h).view(bs, M, H, dn + dr)
        q = torch.cat([q[..., :dn], rope_halves(q[..., dn:], cos[:, :, None], sin[:, :, None])],
                      dim=-1)
        c_blk, kpe_blk = self.latents(h, cos, sin)
        c = torch.cat([ctx_c.to(c_blk.dtype), c_blk], dim=1)
        kpe = torch.cat([ctx_kpe.to(kpe_blk.dtype), kpe_blk], dim=1)
        N = c.shape[1]
        kv = self.kv_b_proj(c).view(bs, N, H, dn + dv)
        k = torch.cat([kv[..., :dn], kpe[:, :, None, :].expand(bs, N, H, dr).to(kv.dtype)],
                      dim=-1)
        v = kv[..., dn:]
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask[:, None],
                                           scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(bs, M, H * dv))


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = MLP(D, cfg["intermediate_size"])


# ----------------------------------------------------------------------------- the drafter

class DFlashDrafter(nn.Module):
    """The trainable drafter; the target's embedding and lm_head are frozen buffers (not
    parameters: the optimizer never sees them and the bundle does not store them)."""

    def __init__(self, cfg: dict, target_layer_ids, block_size: int, embed: torch.Tensor,
                 lm_head: torch.Tensor | None = None):
        super().__init__()
        self.cfg = dict(cfg)
        self.target_layer_ids = tuple(int(j) for j in target_layer_ids)
        self.B = int(block_size)
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        k = len(self.target_layer_ids)
        if tuple(embed.shape) != (cfg["vocab_size"], D):
            raise ValueError(f"embedding {tuple(embed.shape)} != (vocab {cfg['vocab_size']}, "
                             f"hidden {D})")
        self.fc = nn.Linear(k * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, eps)
        self.mask_embedding = nn.Parameter(torch.zeros(D))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(D, eps)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("head", None if lm_head is None else lm_head.detach().clone(),
                             persistent=False)
        cos, sin = rope_tables(cfg["rope_theta"], cfg["qk_rope_head_dim"],
                               cfg["max_position_embeddings"] + self.B)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """HF-style: matrices N(0, std^2), norm weights 1, the MASK embedding at the scale of
        the target's embedding rows."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=g) * self.embed.float().std().cpu())
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """f = rmsnorm(fc(concat features), hidden_norm): [.., k*D] -> [.., D] (float32)."""
        return self.hidden_norm(self.fc(features))

    def forward(self, features: torch.Tensor, roots: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """Logits [bs, A, B-1, V] of block slots 1..B-1 for A blocks per sequence.

        features [bs, T, k*D]: the target's features of context positions 0..T-1;
        roots [bs, A]: the token at each block's slot 0; anchors [bs, A]: its position
        (1 <= a <= T; block i sees context t < anchors[i]).  One inference round is
        T = context length, A = 1, anchors = T."""
        bs, T, _ = features.shape
        A, B = anchors.shape[1], self.B
        f = self.fuse(features)                                              # [bs, T, D]
        ctx_cos, ctx_sin = self.rope_cos[:T][None], self.rope_sin[:T][None]
        pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).reshape(bs, A * B)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = torch.cat([F.embedding(roots, self.embed).float()[:, :, None, :],
                       self.mask_embedding.float().expand(bs, A, B - 1, -1)], dim=2)
        x = x.reshape(bs, A * B, -1)
        mask = block_mask(anchors, T, B)
        for layer in self.layers:
            attn = layer.self_attn
            ctx_c, ctx_kpe = attn.latents(f, ctx_cos, ctx_sin)
            x = x + attn(layer.input_layernorm(x), cos, sin, ctx_c, ctx_kpe, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x).view(bs, A, B, -1)[:, :, 1:]
        head = self.embed if self.head is None else self.head
        return F.linear(h, head)

    # ---- the bundle's names
    def bundle_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters under the bundle's names (detached, on their device, float32)."""
        out = {}
        for name, p in self.named_parameters():
            out[_bundle_name(name)] = p.detach().float()
        return out

    @torch.no_grad()
    def load_bundle_tensors(self, weights) -> None:
        """The inverse of bundle_tensors (arrays or tensors under the bundle's names)."""
        params = dict(self.named_parameters())
        names = {_bundle_name(n): n for n in params}
        missing = sorted(set(names) - set(weights))
        extra = sorted(set(weights) - set(names))
        if missing or extra:
            raise KeyError(f"bundle tensors: missing {missing}, unexpected {extra}")
        for bname, pname in names.items():
            src = torch.as_tensor(weights[bname])
            params[pname].copy_(src.to(params[pname].dtype))

    def check_names(self) -> None:
        """The parameters are exactly the spec's bundle tensors, shapes included."""
        want = bundle_names(self.cfg, len(self.target_layer_ids))
        have = {k: tuple(v.shape) for k, v in self.bundle_tensors().items()}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))
            raise RuntimeError(f"drafter tensors differ from the spec's bundle: {diff[:6]}")


def _bundle_name(param_name: str) -> str:
    """``layers.0.self_attn.q_proj.weight`` -> ``model/layers/0/self_attn/q_proj``;
    ``norm.weight`` -> ``model/norm``; fc, hidden_norm, mask_embedding under ``dflash/``."""
    base = param_name[:-len(".weight")] if param_name.endswith(".weight") else param_name
    if base in ("fc", "hidden_norm", "mask_embedding"):
        return "dflash/" + base
    return "model/" + base.replace(".", "/")


# ----------------------------------------------------------------------------- loss

def position_weights(B: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1, normalised to sum 1."""
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=device) / gamma)
    return w / w.sum()


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Mean over blocks of sum_k w_k CE_k; logits [.., B-1, V], labels [.., B-1]."""
    ce = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                         reduction="none").view(labels.shape)
    return (ce * weights).sum(-1).mean()


def weighted_kl(logits: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor):
    """Mean over blocks of sum_k w_k KL(p_k || softmax(logits_k)): the soft-target loss
    (``probs`` [.., B-1, V], the target's distribution at each slot).  Its gradient is the
    soft cross-entropy's; the entropy term only makes 0 the floor of what is reported."""
    logq = logits.float().log_softmax(-1)
    kl = (torch.special.xlogy(probs, probs) - probs * logq).sum(-1)
    return (kl * weights).sum(-1).mean()


def param_count(model: DFlashDrafter) -> int:
    return sum(p.numel() for p in model.parameters())


def bf16_mib(model: DFlashDrafter) -> float:
    return round(param_count(model) * 2 / 2**20, 2)


def expected_tau(acc: list[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: the chain's accepted tokens per round if acceptance at each
    depth were independent with these rates (the measured tau needs no such assumption)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


__all__ = ["DFlashDrafter", "drafter_config", "bundle_names", "block_mask", "rope_tables",
           "rope_halves", "position_weights", "weighted_ce", "weighted_kl", "expected_tau",
           "param_count", "bf16_mib", "DEFAULT_SIZES", "TARGET_LAYER_IDS", "BLOCK_SIZE", "GAMMA"]

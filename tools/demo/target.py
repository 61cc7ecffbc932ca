"""The target model: transformers' DeepseekV3ForCausalLM at demo size, and the router balancer.

Presets (``hf_config``): MLA with a q LoRA and decoupled RoPE (interleaved, as the real
checkpoints), one dense first layer, then MoE layers of 8 routed experts (top-2, sigmoid scores
with ``e_score_correction_bias``, noaux_tc) and one shared expert; tied embeddings.  The full
preset is ~8.7 M parameters, 16.7 MiB in bf16: with a drafter it has to ship inside 24 MiB.

transformers keeps ``e_score_correction_bias`` as a buffer and never updates it (no gradient
reaches it).  RouterBalancer does DeepSeek-V3's auxiliary-loss-free update outside the
gradient: after every optimizer step, ``bias += gamma * sign(mean_load - load)`` per expert,
loads counted from the routers' own top-k choices in that step.
"""
from __future__ import annotations

import inspect
import time

import torch

FULL = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
            num_hidden_layers=6, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1)
TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1)


def hf_config(preset: dict, vocab_size: int, seq_len: int, eot_id: int = 0,
              overrides: dict | None = None) -> dict:
    """The DeepseekV3Config fields (a plain dict: it goes into the checkpoint's state.json)."""
    cfg = dict(preset, vocab_size=vocab_size, max_position_embeddings=seq_len,
               num_key_value_heads=preset["num_attention_heads"],
               n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
               routed_scaling_factor=1.0, rope_interleave=True, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               rms_norm_eps=1e-6, bos_token_id=eot_id, eos_token_id=eot_id,
               pad_token_id=None, hidden_act="silu")
    cfg.update(overrides or {})
    return cfg


def build_model(cfg: dict, device, attn: str = "sdpa"):
    """A freshly initialised (HF's init, std 0.02) fp32 model on ``device``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    fields = dict(cfg)
    # transformers >= 5.2x appends an MTP module description (num_mtp_layers, default 1) to
    # the config; the demo has none, so say so where the field exists
    if "num_mtp_layers" in inspect.signature(DeepseekV3Config).parameters:
        fields.setdefault("num_mtp_layers", 0)
    config = DeepseekV3Config(**fields, attn_implementation=attn)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config)
    if cfg["tie_word_embeddings"] and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("tie_word_embeddings did not tie lm_head to embed_tokens")
    return model


def param_counts(model) -> dict:
    """Total parameters (tied counted once), those one token uses (top-k of the routed
    experts), and the bf16 size of the export (router kept in fp32)."""
    total = active = nbytes = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".mlp.experts." in name:
            cfg = model.config
            active += n * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            active += n
        nbytes += n * (4 if name.endswith("mlp.gate.weight") else 2)
    embed = model.model.embed_tokens.weight.numel()
    return {"params": total, "params_non_embedding": total - embed, "active_per_token": active,
            "export_bytes": nbytes, "export_mib": round(nbytes / 2**20, 2)}


def set_experts_impl(model, name: str) -> str:
    """Switch transformers' expert kernel ("eager": a loop over experts; "grouped_mm": one
    grouped GEMM) where this transformers version allows it; returns what is in use."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    elif hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = name
    return getattr(model.config, "_experts_implementation", None) or "eager"


def pick_experts_impl(model, opt_free_step, choice: str, device, log) -> str:
    """``auto`` on a GPU: time a few forward+backward passes with each kernel (no optimizer
    step, router counts off) and keep the faster (a kernel that fails is skipped: grouped_mm
    gets fp32 weights under autocast, which not every torch build takes).  On the CPU (the
    smoke test) ``eager``, which every version has."""
    if choice != "auto":
        return set_experts_impl(model, choice)
    if device.type != "cuda":
        return set_experts_impl(model, "eager")
    timings = {}
    for name in ("grouped_mm", "eager"):
        try:
            set_experts_impl(model, name)
            for i in range(5):
                if i == 2:
                    torch.cuda.synchronize()
                    t = time.monotonic()
                opt_free_step()
            torch.cuda.synchronize()
            timings[name] = (time.monotonic() - t) / 3
        except Exception as e:       # noqa: BLE001 -- a kernel this version cannot run
            log(f"experts {name}: unusable here ({type(e).__name__}: {e})"[:300])
    if not timings:
        raise RuntimeError("no expert implementation ran")
    best = min(timings, key=timings.get)
    log("experts kernel: " + ", ".join(f"{k} {v * 1e3:.1f} ms/step" for k, v in
                                       timings.items()) + f" -> {best}")
    return set_experts_impl(model, best)


def routers(model) -> list[torch.nn.Module]:
    """The MoE routers (modules holding e_score_correction_bias), in layer order."""
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]


class RouterBalancer:
    """Counts each router's top-k choices (forward hooks, on the device, no sync) and applies
    the aux-free bias update after each optimizer step.  ``gamma`` 0 leaves the bias at 0."""

    def __init__(self, model, gamma: float):
        self.gamma = gamma
        self.routers = routers(model)
        self.enabled = True
        E = model.config.n_routed_experts
        dev = model.model.embed_tokens.weight.device
        self.step_counts = torch.zeros(len(self.routers), E, device=dev)
        self.window_counts = torch.zeros_like(self.step_counts)   # since the last report
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i, model.config.num_experts_per_tok))

    def _hook(self, i: int, model_top_k: int):
        def hook(module, inputs, output):
            if not (self.enabled and module.training):
                return
            outs = output if isinstance(output, tuple) else (output,)
            # the top-k indices: the one integer tensor the router returns (transformers
            # 5.17-5.24: (logits, weights, indices))
            idx = next((t for t in outs if torch.is_tensor(t) and not t.is_floating_point()),
                       None)
            if idx is None:
                # a router that returns only its logits: choose as noaux_tc does with one
                # expert group (the presets' n_group = 1)
                scores = outs[0].float().sigmoid() + module.e_score_correction_bias
                idx = scores.topk(module.top_k if hasattr(module, "top_k") else
                                  model_top_k, dim=-1).indices
            # index_add_, not bincount: bincount's output size needs a device sync
            flat = idx.reshape(-1)
            self.step_counts[i].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return hook

    @torch.no_grad()
    def update(self) -> None:
        if self.gamma:
            for i, r in enumerate(self.routers):
                load = self.step_counts[i]
                r.e_score_correction_bias.add_(self.gamma * torch.sign(load.mean() - load))
        self.window_counts += self.step_counts
        self.step_counts.zero_()

    def imbalance(self) -> float:
        """max/mean expert load since the last call, worst layer (1.0 = perfectly even);
        syncs the device."""
        c = self.window_counts
        worst = float((c.max(dim=1).values / c.mean(dim=1).clamp_min(1e-9)).max()) \
            if c.numel() else 1.0
        self.window_counts.zero_()
        return worst

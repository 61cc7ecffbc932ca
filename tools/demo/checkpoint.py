"""The resumable checkpoint and the final export.

The GPU machine hands back at most 8 files of at most 16 MiB (64 MiB in all), and a resumed
call carries the checkpoint in with the repository (64 MiB in all).  An fp32 checkpoint of
weights and both AdamW moments would be ~105 MB, so:

* weights and moments are stored in bf16 (tensors under 4096 elements, i.e. norms and router
  biases, stay fp32).  Resuming rounds the fp32 master weights once to bf16: a relative change
  of at most 2^-9, about 1e-4 on weights of ~0.05, below one AdamW step (~lr = 1e-3); bf16
  keeps ~3 significant digits of each moment, plenty for Adam's ratio;
* tensors are packed into safetensors shards of at most 15 MiB;
* ``state.json`` (written last, so its presence means the checkpoint is complete) holds the
  step, the data position, the RNG states, the hyperparameters, the model config, the
  manifest digest and the tokenizer's JSON text.

Nothing is pickled: safetensors and JSON only.
"""
from __future__ import annotations

import base64
import glob
import json
import os

import numpy as np
import torch

CKPT_FORMAT = "kdtree-demo-target-ckpt/1"
SHARD_BYTES = 15 * 2**20
SMALL = 4096          # tensors below this many elements are stored in fp32


def _stored(t: torch.Tensor) -> torch.Tensor:
    dtype = torch.float32 if t.numel() < SMALL else torch.bfloat16
    return t.detach().to("cpu", dtype).contiguous()


def _persistent_buffers(model) -> list[tuple[str, torch.Tensor]]:
    keys = set(model.state_dict().keys())
    return [(n, b) for n, b in model.named_buffers() if n in keys]


def pack_shards(tensors: dict[str, torch.Tensor], limit: int = SHARD_BYTES) -> list[dict]:
    """Groups of tensors of at most ``limit`` bytes each, first-fit by decreasing size: as few
    files as the bytes allow (the GPU machine returns at most 8).  A tensor over the limit
    gets a shard of its own."""
    def nbytes(t):
        return t.numel() * t.element_size()
    shards: list[dict] = []
    sizes: list[int] = []
    for name in sorted(tensors, key=lambda n: (-nbytes(tensors[n]), n)):
        n = nbytes(tensors[name])
        for i, used in enumerate(sizes):
            if used + n <= limit:
                shards[i][name] = tensors[name]
                sizes[i] += n
                break
        else:
            shards.append({name: tensors[name]})
            sizes.append(n)
    return shards


def _rng_state() -> dict:
    out = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return out


def _set_rng_state(rng: dict) -> None:
    def tensor(s):
        return torch.from_numpy(np.frombuffer(base64.b64decode(s), np.uint8).copy())
    torch.set_rng_state(tensor(rng["torch"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(rng["cuda"]))


def save_checkpoint(ckpt_dir: str, model, opt, state: dict) -> list[str]:
    """Write the shards and state.json into ``ckpt_dir``; returns the file names."""
    from safetensors.torch import save_file
    os.makedirs(ckpt_dir, exist_ok=True)
    for old in glob.glob(os.path.join(ckpt_dir, "*")):
        os.remove(old)
    tensors, adam_step = {}, {}
    params = list(model.named_parameters())          # tied weights appear once
    for name, p in params:
        tensors["model/" + name] = _stored(p)
    for name, b in _persistent_buffers(model):
        tensors["model/" + name] = b.detach().to("cpu", torch.float32).contiguous()
    for name, p in params:
        st = opt.state.get(p)
        if st:                                       # no state before the first step
            tensors["adam_m/" + name] = _stored(st["exp_avg"])
            tensors["adam_v/" + name] = _stored(st["exp_avg_sq"])
            adam_step[name] = int(st["step"])
    names = []
    for i, shard in enumerate(pack_shards(tensors)):
        names.append(f"ckpt-{i:05d}.safetensors")
        save_file(shard, os.path.join(ckpt_dir, names[-1]), metadata={"format": CKPT_FORMAT})
    state = dict(state, format=CKPT_FORMAT, shards=names, adam_step=adam_step, rng=_rng_state())
    tmp = os.path.join(ckpt_dir, "state.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, os.path.join(ckpt_dir, "state.json"))
    return names + ["state.json"]


def read_checkpoint(ckpt_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(state, tensors) of a complete checkpoint."""
    from safetensors.torch import load_file
    path = os.path.join(ckpt_dir, "state.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{ckpt_dir}: no state.json (not a complete checkpoint)")
    with open(path) as fh:
        state = json.load(fh)
    if state.get("format") != CKPT_FORMAT:
        raise ValueError(f"{ckpt_dir}: format {state.get('format')!r}, expected {CKPT_FORMAT}")
    tensors = {}
    for name in state["shards"]:
        tensors.update(load_file(os.path.join(ckpt_dir, name)))
    return state, tensors


@torch.no_grad()
def restore(model, opt, state: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Weights, router biases, AdamW moments and steps, RNG states, from a checkpoint."""
    params = list(model.named_parameters())
    for name, p in params:
        p.copy_(tensors["model/" + name])
    for name, b in _persistent_buffers(model):
        b.copy_(tensors["model/" + name])
    # the optimizer's own state_dict layout: integer ids in param_groups order
    sd = opt.state_dict()
    ids = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for name, p in params:
        if name in state["adam_step"]:
            sd["state"][ids[id(p)]] = {
                "step": torch.tensor(float(state["adam_step"][name])),
                "exp_avg": tensors["adam_m/" + name].to(p.device, torch.float32),
                "exp_avg_sq": tensors["adam_v/" + name].to(p.device, torch.float32)}
    opt.load_state_dict(sd)
    _set_rng_state(state["rng"])


def export_pretrained(model, hf_cfg: dict, out_dir: str, tokenizer_json: str,
                      max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """``save_pretrained`` in bf16 (router weights and biases fp32, as transformers keeps
    them), shards of at most 15 MiB, plus tokenizer.json.  generation_config.json is left out:
    from_pretrained does not need it and the GPU machine returns only 8 files."""
    import transformers
    from .target import build_model, routers
    transformers.utils.logging.disable_progress_bar()
    os.makedirs(out_dir, exist_ok=True)
    for old in glob.glob(os.path.join(out_dir, "*")):
        os.remove(old)
    cpu = build_model(hf_cfg, "cpu", attn="eager")
    cpu.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    cpu = cpu.to(torch.bfloat16)
    for r in routers(cpu):
        r.float()
    cpu.save_pretrained(out_dir, max_shard_size=max_shard_bytes)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as fh:
        fh.write(tokenizer_json)
    return sorted(os.listdir(out_dir))

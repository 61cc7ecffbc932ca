"""compressed-tensors pack-quantized checkpoints written by the compressed-tensors package itself
(so the layout under test is the real one, not our reading of it), for tests/test_int4*.py.

``write_pack_quantized(cfg, weights, out_dir, group_size)`` takes a bundle's float weights,
quantises every routed expert linear with compressed-tensors (its scales: symmetric absmax per
group, ``compute_dynamic_scales_and_zp``; its packing: ``ModelCompressor.compress_model``),
writes config.json (``ModelCompressor.update_config`` adds quantization_config) and one bf16
model.safetensors, as ``save_pretrained`` of a quantised model would.  ``decompressed(out_dir)``
is the same checkpoint decompressed by compressed-tensors (``decompress_model``), as float32
HF tensors.  Needs torch and compressed-tensors (the test extra).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                             QuantizationScheme, apply_quantization_config)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors.torch import load_file, save_file

from kdtree_numba.hf_import import hf_state_dict

# Kimi-K2's ignore list, in its form: everything but the routed experts stays bf16
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def _scheme(group_size: int) -> QuantizationConfig:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size)
    return QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=args)}, format="pack-quantized", ignore=KIMI_IGNORE)


def _tree(linears: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module tree holding one nn.Linear per HF module path (``model.layers.1.mlp.
    experts.0.gate_proj``), so that compressed-tensors sees the names a real model has."""
    root = torch.nn.Module()
    for path, weight in linears.items():
        node = root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                              dtype=weight.dtype)
        lin.weight.data.copy_(weight)
        node.add_module(leaf, lin)
    return root


def write_pack_quantized(cfg, weights, out_dir, group_size: int = 32) -> dict:
    """Write the checkpoint; returns its quantization_config (as config.json holds it)."""
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(torch.bfloat16)
          for k, v in hf_state_dict(cfg, weights).items()}
    experts = {k[:-len(".weight")]: v for k, v in sd.items() if ".mlp.experts." in k}
    qconfig = _scheme(group_size)
    root = _tree(experts)
    apply_quantization_config(root, qconfig)
    for name, module in root.named_modules():
        if isinstance(module, torch.nn.Linear):
            scale, _ = compute_dynamic_scales_and_zp(module.weight.data,
                                                     module.quantization_scheme.weights,
                                                     module)
            module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(root)
    tensors = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    tensors.update({k: v.contiguous() for k, v in root.state_dict().items()})
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(dict(cfg.to_hf_dict(), torch_dtype="bfloat16"), fh, indent=1)
    compressor.update_config(out_dir)
    with open(os.path.join(out_dir, "config.json")) as fh:
        return json.load(fh)["quantization_config"]


def decompressed(out_dir, scale_dtype=torch.float32) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with every packed expert decompressed by compressed-tensors
    (float32 HF state dict).  ``scale_dtype`` float32: its ``q * scale`` is then exact (bf16
    would round the 12-bit products); bf16: what a bf16 consumer of the checkpoint gets."""
    with open(os.path.join(out_dir, "config.json")) as fh:
        qc = json.load(fh)["quantization_config"]
    qconfig = QuantizationConfig.model_validate(qc)
    sd = load_file(os.path.join(out_dir, "model.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in sd if k.endswith(".weight_packed")})
    root = _tree({m: torch.zeros(tuple(int(d) for d in sd[m + ".weight_shape"]),
                                 dtype=scale_dtype) for m in modules})
    apply_quantization_config(root, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(root)          # the compressed module layout, then load into it
    own = root.state_dict()
    for k in own:
        own[k] = sd[k].to(scale_dtype) if k.endswith("weight_scale") else sd[k]
    root.load_state_dict(own, strict=True, assign=True)
    compressor.decompress_model(root)
    out = {k: v.float().numpy() for k, v in sd.items()
           if not k.rsplit(".", 1)[0] in modules}
    for m in modules:
        out[m + ".weight"] = root.get_submodule(m).weight.detach().float().numpy()
    return out

"""Import a Hugging Face DeepSeek-V3 / Kimi-K2 checkpoint into a model bundle.

``kdtr-import-hf HF_DIR OUT.kdtr [--dtype auto|float32|bfloat16]``

* ``config.json`` (model_type deepseek_v3 or kimi_k2) becomes the bundle's config.
* Shards (``model.safetensors.index.json``'s weight map, else every ``*.safetensors``) are read
  with ``formats.safetensors_io`` (validated, memory-mapped) and streamed tensor by tensor into
  the bundle, so peak memory is about the largest output tensor (a layer's stacked experts).
* FP8 block-scaled weights are dequantised: ``W = q * S[i // 128, j // 128]`` with
  ``S = <name>_scale_inv`` (block size from ``quantization_config.weight_block_size``).
* compressed-tensors ``pack-quantized`` INT4 routed experts (Kimi-K2's) stay int4: each layer's
  experts become one int4-group weight (formats/int4_group.py) without being unpacked or
  dequantised; the scheme and every packed tensor are checked first (hf_compressed.py).
* Per-expert tensors are stacked into ``experts/gate_up_proj [E, 2Im, D]`` (gate rows first)
  and ``experts/down_proj [E, D, Im]``; transformers 5's fused names are accepted as well.
* The MTP layer (index ``num_hidden_layers``, DeepSeek-V3) and other unused tensors (rotary
  buffers) are dropped and counted on stderr.
* ``HF_DIR/tokenizer.json``, when present, is copied in (``tokenizer/json``, with
  ``tokenizer.bos_id`` = config.json's ``bos_token_id``: the id put in front of a text prompt)
  after it parses and fits the model's vocabulary (kdtree_numba/text.py); the summary line
  says so.  Without it the bundle takes token ids only.

``--dtype auto`` keeps float32 sources in float32 and writes everything else as bfloat16 (a
real checkpoint in float32 would be twice its bf16 size); the router is always float32.
"""
from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import sys
from typing import Iterator

import ml_dtypes
import numpy as np

from formats.console import (ArgumentParser, UsageError, add_debug_flag, refuse_existing,
                             run_console, writing)
from formats.int4_group import Int4GroupWeight
from formats.progress import ProgressBar
from formats.safetensors_io import SafetensorsFile
from kdtree_numba.bundle import BundleError, BundleTokenizer, check_output_path, write_bundle
from kdtree_numba.config import ModelConfig, weight_shapes
from kdtree_numba.hf_compressed import packed_module, read_scheme, stack_int4_experts
from kdtree_numba.text import TextCodec, TokenizerError

__all__ = ["import_hf", "main", "hf_source_names", "dequantize_fp8", "export_hf_checkpoint",
           "hf_state_dict", "read_hf_config", "read_hf_tokenizer", "HF_TOKENIZER"]

FP8_BLOCK = 128
HF_TOKENIZER = "tokenizer.json"


def dequantize_fp8(q: np.ndarray, scale_inv: np.ndarray, block=(FP8_BLOCK, FP8_BLOCK)):
    """``W[i, j] = float32(q[i, j]) * scale_inv[i // bi, j // bj]`` for a 2-D weight."""
    rows, cols = q.shape
    bi, bj = block
    need = (-(-rows // bi), -(-cols // bj))
    if tuple(scale_inv.shape) != need:
        raise BundleError(f"scale shape {tuple(scale_inv.shape)} does not match a {q.shape} "
                          f"weight in {bi}x{bj} blocks (expected {need})")
    s = np.asarray(scale_inv, np.float32)
    full = np.repeat(np.repeat(s, bi, axis=0), bj, axis=1)[:rows, :cols]
    return q.astype(np.float32) * full


class _Checkpoint:
    """HF tensor name -> array, over every shard of a checkpoint directory."""

    def __init__(self, hf_dir: str, block, scheme=None):
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as fh:
                weight_map = json.load(fh)["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(os.path.basename(p) for p in
                                 glob.glob(os.path.join(hf_dir, "*.safetensors")))
            weight_map = None
        if not shard_names:
            raise BundleError(f"{hf_dir}: no safetensors shards found")
        self.files = {s: SafetensorsFile(os.path.join(hf_dir, s)) for s in shard_names}
        self.where = {}
        for shard, f in self.files.items():
            for name in f.keys():
                self.where[name] = shard
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self.where.get(name) != shard:
                    raise BundleError(f"model.safetensors.index.json says {name} is in {shard}, "
                                      f"it is not there")
        self.block = block
        self.scheme = scheme       # compressed-tensors pack-quantized (hf_compressed.py) or None
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        """The tensor, float32 if it was FP8 (dequantised), else as stored."""
        if name not in self.where:
            if name.endswith(".weight") and packed_module(self, name[:-len(".weight")]):
                raise BundleError(f"tensor {name[:-len('.weight')]}.weight_packed: only the "
                                  f"routed experts may be int4 pack-quantized (the rest is "
                                  f"imported as it is, never dequantised)")
            raise BundleError(f"the checkpoint has no tensor {name}")
        self.used.add(name)
        arr = self.files[self.where[name]].array(name)
        if arr.dtype.name.startswith("float8"):
            scale = name + "_scale_inv"
            if scale not in self.where:
                raise BundleError(f"{name} is FP8 but {scale} is missing")
            self.used.add(scale)
            return dequantize_fp8(arr, self.files[self.where[scale]].array(scale), self.block)
        return arr

    def close(self):
        for f in self.files.values():
            f.close()


def hf_source_names(cfg: ModelConfig, bundle_name: str) -> str:
    """The HF state-dict name of a bundle tensor that maps one-to-one."""
    if bundle_name.endswith("mlp/e_score_correction_bias"):
        return bundle_name[:-len("e_score_correction_bias")].replace("/", ".") + \
            "gate.e_score_correction_bias"
    return bundle_name.replace("/", ".") + ".weight"


def _out_dtype(arr: np.ndarray, dtype: str) -> str:
    if dtype != "auto":
        return dtype
    return "float32" if arr.dtype == np.float32 else "bfloat16"


def _cast(arr: np.ndarray, dtype: str) -> np.ndarray:
    """``arr`` as ``dtype``; no copy when it already is (a mapped shard stays mapped)."""
    if dtype == "bfloat16":
        return np.asarray(arr).astype(ml_dtypes.bfloat16, copy=False)
    return np.asarray(arr).astype(dtype, copy=False)


def _stack_experts(ck: _Checkpoint, prefix: str, E: int, which: str, shape, dtype: str):
    """[E, 2Im, D] (gate rows, then up rows) or [E, D, Im], filled one expert at a time."""
    fused = f"{prefix}mlp.experts.{which}"
    first = f"{prefix}mlp.experts.0.{'gate_proj' if which == 'gate_up_proj' else 'down_proj'}"
    if packed_module(ck, first):     # int4 pack-quantized: stays int4 (hf_compressed.py)
        if ck.scheme is None:
            raise BundleError(f"tensor {first}.weight_packed: config.json has no "
                              f"compressed-tensors quantization_config to read it with")
        return stack_int4_experts(ck, prefix, which, shape, ck.scheme)
    if fused in ck:
        arr = ck.get(fused)
        return _cast(arr, _out_dtype(arr, dtype))
    out = None
    for e in range(E):
        if which == "gate_up_proj":
            gate = ck.get(f"{prefix}mlp.experts.{e}.gate_proj.weight")
            up = ck.get(f"{prefix}mlp.experts.{e}.up_proj.weight")
            parts, src = (gate, up), gate
        else:
            src = ck.get(f"{prefix}mlp.experts.{e}.down_proj.weight")
            parts = (src,)
        if out is None:
            out = np.empty(shape, _cast(np.zeros(0, src.dtype), _out_dtype(src, dtype)).dtype)
        out[e] = np.concatenate([_cast(p, out.dtype.name) for p in parts], axis=0)
    return out


def _tensors(ck: _Checkpoint, cfg: ModelConfig, dtype: str,
             progress) -> Iterator[tuple[str, np.ndarray]]:
    shapes = weight_shapes(cfg)
    for i, (name, shape) in enumerate(shapes.items()):
        layer_prefix = ""
        if name.startswith("model/layers/"):
            layer_prefix = "model.layers." + name.split("/")[2] + "."
        if name.endswith("mlp/experts/gate_up_proj"):
            arr = _stack_experts(ck, layer_prefix, cfg.n_routed_experts, "gate_up_proj", shape,
                                 dtype)
        elif name.endswith("mlp/experts/down_proj"):
            arr = _stack_experts(ck, layer_prefix, cfg.n_routed_experts, "down_proj", shape,
                                 dtype)
        elif name.endswith("mlp/e_score_correction_bias") and \
                hf_source_names(cfg, name) not in ck and cfg.scoring_func == "softmax":
            arr = np.zeros(shape, np.float32)       # DeepSeek-V2-style routing has no bias
        elif name.endswith("mlp/gate") or name.endswith("mlp/e_score_correction_bias"):
            arr = np.asarray(ck.get(hf_source_names(cfg, name)), np.float32)
        else:
            src = ck.get(hf_source_names(cfg, name))
            arr = _cast(src, _out_dtype(src, dtype))
        if tuple(arr.shape) != tuple(shape):
            raise BundleError(f"tensor {name}: the checkpoint gives shape {tuple(arr.shape)}, "
                              f"config.json implies {tuple(shape)}")
        progress(i + 1, len(shapes), name, arr)
        yield name, arr
        del arr   # before the next tensor is made: peak memory is one tensor, not two


def read_hf_config(hf_dir) -> tuple[dict, ModelConfig]:
    """``config.json`` of a checkpoint folder, raw and as a ModelConfig.  A missing folder or
    file is an OSError naming it; unreadable JSON, a model_type other than deepseek_v3 /
    kimi_k2 or an inconsistent config is a BundleError naming config.json."""
    hf_dir = os.fspath(hf_dir)
    if not os.path.isdir(hf_dir):
        if os.path.exists(hf_dir):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder (a Hugging Face checkpoint "
                                     "folder holds config.json and *.safetensors)", hf_dir)
        raise FileNotFoundError(errno.ENOENT, "no such folder", hf_dir)
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "missing (a Hugging Face checkpoint folder holds "
                                "config.json and *.safetensors)", path)
    try:
        with open(path, encoding="utf-8") as fh:
            hf_config = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not a JSON config: {e}") from None
    if not isinstance(hf_config, dict):
        raise BundleError(f"{path}: not a JSON object but a {type(hf_config).__name__}")
    try:
        return hf_config, ModelConfig.from_hf_dict(hf_config)
    except KeyError as e:
        raise BundleError(f"{path}: no field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise BundleError(f"{path}: {e}") from None


def read_hf_tokenizer(hf_dir, cfg: ModelConfig) -> tuple[BundleTokenizer, TextCodec] | None:
    """``HF_DIR/tokenizer.json`` as a bundle's tokenizer (bos_id: the config's
    ``bos_token_id``) and its codec, or None when the folder has none.  One that does not
    parse, or whose ids run past the model's vocabulary, is a BundleError naming it."""
    path = os.path.join(os.fspath(hf_dir), HF_TOKENIZER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        codec = TextCodec.from_json(data, cfg.bos_token_id, cfg.vocab_size)
    except (TokenizerError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: {e}") from None
    return BundleTokenizer(data, cfg.bos_token_id), codec


def import_hf(hf_dir, out_path, *, dtype: str = "auto", quiet: bool = False,
              progress=None, tokenizer: bool = True) -> ModelConfig:
    """Convert ``hf_dir`` (config.json + safetensors) into the bundle ``out_path``.
    ``progress(done_tensors, total_tensors)`` follows the bundle's tensors; ``quiet`` leaves
    out the note on stderr about the checkpoint tensors that were not used.  ``tokenizer``:
    copy ``tokenizer.json`` in when the folder has one (:func:`read_hf_tokenizer`)."""
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    hf_dir = os.fspath(hf_dir)
    hf_config, cfg = read_hf_config(hf_dir)
    tok = read_hf_tokenizer(hf_dir, cfg) if tokenizer else None
    qc = hf_config.get("quantization_config")
    scheme = read_scheme(qc)     # compressed-tensors INT4, checked before anything is read
    block = tuple((qc if isinstance(qc, dict) else {}).get("weight_block_size",
                                                          (FP8_BLOCK, FP8_BLOCK)))
    ck = _Checkpoint(hf_dir, block, scheme)

    def step(i, total, name, arr):
        if progress is not None:
            progress(i, total)
    try:
        write_bundle(out_path, cfg, _tensors(ck, cfg, dtype, step),
                     tokenizer=None if tok is None else tok[0])
        dropped = sorted(set(ck.where) - ck.used)
        if dropped and not quiet:
            mtp = [n for n in dropped if n.startswith(f"model.layers.{cfg.num_hidden_layers}.")]
            print(f"kdtr-import-hf: dropped {len(dropped)} checkpoint tensors not used for "
                  f"inference ({len(mtp)} of them the MTP layer {cfg.num_hidden_layers}), e.g. "
                  f"{dropped[0]}", file=sys.stderr)
    finally:
        ck.close()
    return cfg


def hf_state_dict(cfg: ModelConfig, weights) -> dict[str, np.ndarray]:
    """Bundle weights -> the state dict ``save_pretrained`` writes (per-expert names);
    int4-group experts are dequantised (exactly, float32)."""
    out = {}
    for name in weight_shapes(cfg):
        arr = weights[name]
        # int4-group experts leave as their exact values (float32 holds q * scale exactly)
        arr = arr.dequantize(np.float32) if isinstance(arr, Int4GroupWeight) else np.asarray(arr)
        if name.endswith("mlp/experts/gate_up_proj") or name.endswith("mlp/experts/down_proj"):
            prefix = name.rsplit("/", 1)[0].replace("/", ".")
            Im = cfg.moe_intermediate_size
            for e in range(cfg.n_routed_experts):
                if name.endswith("gate_up_proj"):
                    out[f"{prefix}.{e}.gate_proj.weight"] = arr[e, :Im]
                    out[f"{prefix}.{e}.up_proj.weight"] = arr[e, Im:]
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = arr[e]
        else:
            out[hf_source_names(cfg, name)] = arr
    return out


def export_hf_checkpoint(cfg: ModelConfig, weights, out_dir) -> None:
    """Write ``config.json`` + ``model.safetensors`` (float32) that transformers'
    ``DeepseekV3ForCausalLM.from_pretrained`` loads: the parity tests and the benchmark run HF
    on exactly the weights of a bundle."""
    from safetensors.numpy import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, np.float32) for k, v in
               hf_state_dict(cfg, weights).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg.to_hf_dict(), fh, indent=1)


def _main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="kdtr-import-hf", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Convert a Hugging Face DeepSeek-V3 / Kimi-K2 checkpoint (config.json + "
        "safetensors, FP8 dequantised) into a KDTR model bundle.")
    parser.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    parser.add_argument("out", help="output bundle, a name ending in .kdtr")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="weight dtype (auto: float32 stays float32, the rest bfloat16)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="leave HF_DIR/tokenizer.json out (the bundle then takes token ids "
                        "only)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress and no note about unused checkpoint tensors")
    parser.add_argument("--progress", action="store_true",
                        help="progress line on stderr even when it is not a terminal")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    check_output_path(args.out)
    refuse_existing(args.out, args.force)
    bar = ProgressBar(f"import {args.hf_dir}", unit="tensor",
                      force=args.progress and not args.quiet)
    if args.quiet:
        bar.enabled = False
    try:
        with writing(args.out):
            cfg = import_hf(args.hf_dir, args.out, dtype=args.dtype, quiet=args.quiet,
                            progress=bar, tokenizer=not args.no_tokenizer)
    except BundleError as e:   # what the checkpoint holds is wrong: bad input, one line
        text = str(e)
        raise UsageError(text if text.startswith(args.hf_dir) else
                         f"{args.hf_dir}: {text}") from None
    finally:
        bar.close()
    print(f"kdtr-import-hf: wrote {args.out}: {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}; {_tokenizer_note(args, cfg)}",
          file=sys.stderr)
    return 0


def _tokenizer_note(args, cfg: ModelConfig) -> str:
    if args.no_tokenizer:
        return "tokenizer left out (--no-tokenizer): token ids only"
    path = os.path.join(args.hf_dir, HF_TOKENIZER)
    if not os.path.isfile(path):
        return f"no {HF_TOKENIZER} in {args.hf_dir}: token ids only"
    bos = ("" if cfg.bos_token_id is None else
           f", text prompts begin with id {cfg.bos_token_id}")
    return f"{path} copied in (text in and out{bos})"


def main(argv=None) -> int:
    """The ``kdtr-import-hf`` entry point; returns the exit code (0, 2 for bad input)."""
    return run_console("kdtr-import-hf", _main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Turn a trained drafter (``drafter.safetensors`` + ``drafter_config.json``, written by
tools/train_drafter.py) into the engine's KDTR bundle of kind "dflash_drafter".

    python3 tools/export_drafter.py DIR OUT.kdtr      # DIR holds the two files

Runs without torch: the safetensors file is read here directly (an 8-byte header length, a
JSON header, raw little-endian tensors), bf16 widened to float32 exactly and written back as
bf16 by ``kdtree_numba.bundle.write_dflash_bundle`` (the bundle layout: docs/DEMO.md, "The
DFlash drafter").
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys

import numpy as np

FORMAT = "kdtree-dflash-drafter/1"
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """name -> float32 array (BF16 widened bit-exactly, F16/F32 converted)."""
    with open(path, "rb") as fh:
        data = fh.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        raw = np.frombuffer(data[base + lo:base + hi], dtype=_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.astype(np.float32).reshape(info["shape"])
    return out


def read_config(path: str):
    """(ModelConfig, dflash attributes dict) of drafter_config.json."""
    from kdtree_numba.config import ModelConfig
    with open(path) as fh:
        doc = json.load(fh)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT}")
    return ModelConfig(**doc["config"]), doc["dflash"]


def write(src_dir: str, out_path: str, dtype: str = "bfloat16") -> None:
    """The bundle from the two files in ``src_dir``.  ImportError when this tree's
    kdtree_numba.bundle has no write_dflash_bundle."""
    from kdtree_numba.bundle import write_dflash_bundle
    config, dspec = read_config(os.path.join(src_dir, "drafter_config.json"))
    weights = read_safetensors(os.path.join(src_dir, "drafter.safetensors"))
    write_dflash_bundle(out_path, config, weights,
                        target_layer_ids=[int(j) for j in dspec["target_layer_ids"]],
                        block_size=int(dspec["block_size"]),
                        target_hidden_size=int(dspec["target_hidden_size"]),
                        target_vocab_size=int(dspec["target_vocab_size"]),
                        target_num_layers=int(dspec["target_num_layers"]), dtype=dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="folder with drafter.safetensors and drafter_config.json")
    p.add_argument("out", help="the bundle to write (.kdtr)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    write(args.src, args.out, args.dtype)
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a model bundle back out as a Hugging Face checkpoint (config.json, model.safetensors
in float32, and tokenizer.json when the bundle carries one).

    python3 tools/bundle_to_hf.py kdtree_numba/demo/demo-target.kdtr .train/export

The drafter's trainer (tools/train_drafter.py) runs the frozen target in transformers; the
shipped bundle is the one copy of the demo target this repository keeps, so this is how its
trainer gets the target on a fresh machine.  bf16 weights widen exactly, so transformers sees the
weights the engine runs.  Check the result with ``python3 tools/check_export.py OUT_DIR``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kdtree_numba.bundle import read_bundle, read_bundle_tokenizer  # noqa: E402
from kdtree_numba.hf_import import export_hf_checkpoint  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", help="a model bundle (.kdtr)")
    p.add_argument("out_dir", help="folder for config.json, model.safetensors, tokenizer.json")
    args = p.parse_args(argv)
    config, weights = read_bundle(args.bundle)
    export_hf_checkpoint(config, weights, args.out_dir)
    tokenizer = read_bundle_tokenizer(args.bundle)
    if tokenizer is not None:
        with open(os.path.join(args.out_dir, "tokenizer.json"), "wb") as fh:
            fh.write(bytes(tokenizer.json))
    print(f"{args.bundle} -> {args.out_dir} (float32"
          f"{', tokenizer.json' if tokenizer is not None else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

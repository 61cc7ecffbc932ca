#!/usr/bin/env python3
"""Regenerate the KDTR test vectors from the NumPy references (one command for all kernels).

    python3 tools/make_vectors.py                 # all families into tests/vectors/
    python3 tools/make_vectors.py ddtree --out DIR

Each family lives in tools/vectors_<family>.py and exposes ``write(outdir) -> list[Path]``.
The file layouts are documented in docs/DDTREE.md, docs/LAYERS.md and docs/ATTENTION.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
FAMILIES = ("ddtree", "layers", "attention")


def load_family(name: str):
    path = TOOLS / f"vectors_{name}.py"
    spec = importlib.util.spec_from_file_location(f"vectors_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", metavar="FAMILY",
                        help=f"which to write: {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "vectors")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    sys.path.insert(0, str(ROOT))
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.families or FAMILIES:
        if not (TOOLS / f"vectors_{name}.py").exists():
            print(f"{name}: tools/vectors_{name}.py is missing", file=sys.stderr)
            return 2
        for path in load_family(name).write(args.out):
            print(f"{name}: wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

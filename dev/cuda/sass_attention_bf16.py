#!/usr/bin/env python3
"""Static sm_90 instruction mix of the bf16 attention kernel's key tile, per layout (no GPU).

    python3 dev/cuda/sass_attention_bf16.py [--layouts bf16,fragq,...] [--keys 32] [--rows 64]

Compiles ``mla_attention_bf16`` at Kimi-K2 widths (r 512, dr 64) for sm_90 as numba does on
the GPU (LTO-IR, nvJitLink -lto), disassembles the cubin (``nvdisasm``, from the
nvidia-cuda-nvdisasm wheel or PATH) and counts the instructions of one trip through the main
loop on a decode's path: a whole tile of cached keys (the lean copy where the layout has one,
no mask, no rescale), in three sections -- staging (to the cp.async commit), scores and the
exchange (to the second barrier), softmax and P V.  Prints registers and spills from ptxas
beside them.  Layouts: ``plan.BF16_LAYOUTS`` with dev/cuda/attention.py's candidates.
Needs NVVM and nvJitLink (the ``numba-cuda[cu13]`` extra); run without the CUDA simulator.
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev" / "cuda"))

INSTR = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[A-Z0-9_.]+)?")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def nvdisasm() -> str:
    import nvidia
    for base in nvidia.__path__:
        for found in Path(base).glob("*/bin/nvdisasm"):
            return str(found)
    found = shutil.which("nvdisasm")
    if not found:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found


def compile_sass(cfg) -> tuple[str, str]:
    """(SASS text, ptxas's registers and spills) of the bf16 kernel for ``cfg``."""
    import numba.cuda.dispatcher as dispatcher
    from cuda.bindings import nvjitlink as nj
    from numba import types as T
    from numba.cuda.compiler import compile as compile_numba

    from kdtree_numba.attention import bf16
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    f3, b3, f4 = T.float32[:, :, ::1], T.boolean[:, :, ::1], T.float32[:, :, :, ::1]
    kv = T.uint16[:, :, ::1]
    sig = (f3, f3, kv, kv, T.int32[::1], b3, T.float32, T.int64, T.int64, T.int64,
           T.boolean, f3, f4, f4)
    ltoir, _ = compile_numba(bf16.build_kernel(cfg).py_func, sig, cc=(9, 0), output="ltoir",
                             device=False, abi="numba")
    opts = ["-arch=sm_90", "-lto", "-verbose"]
    h = nj.create(len(opts), opts)
    nj.add_data(h, nj.InputType.LTOIR, bytes(ltoir), len(ltoir), "k")
    nj.complete(h)
    log = bytearray(nj.get_info_log_size(h))
    nj.get_info_log(h, log)
    cubin = bytearray(nj.get_linked_cubin_size(h))
    nj.get_linked_cubin(h, cubin)
    nj.destroy(h)
    text = log.decode()
    regs = re.findall(r"Used (\d+) registers", text)[-1]
    spilled = re.findall(r"(\d+) bytes spill stores", text)[-1]
    info = f"{regs} registers, {spilled} bytes spilled"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    return sass, info


def tile_path(sass: str) -> dict:
    """Section -> Counter of opcodes on one decode tile's path through the main loop."""
    lines = sass.splitlines()
    head = next(i for i, x in enumerate(lines) if re.match(r"\.L_x_\d+:", x)
                and any("DEPBAR.LE SB0" in y for y in lines[i:i + 8])
                and f"BRA `({x.strip()[:-1]})" in sass)
    tail = next(i for i, x in enumerate(lines)
                if i > head and f"BRA `({lines[head].strip()[:-1]})" in x)
    body = lines[head:tail + 1]

    def label(name):
        return next(i for i, x in enumerate(body) if x.strip() == name + ":")

    def plain_branch(start):      # the first unconditional BRA from start
        return next(i for i in range(start, len(body))
                    if re.match(r"\s+/\*[0-9a-f]+\*/\s+BRA", body[i]))

    skip = []
    bars = [i for i, x in enumerate(body) if "BAR.SYNC" in x]
    commit = next(i for i, x in enumerate(body) if "LDGDEPBAR" in x)
    first = plain_branch(bars[0])
    if first < commit:            # lean staging: skip the clamped copies it jumps over
        skip.append((first + 1, label(TARGET.search(body[first]).group(1))))
    masked = next(i for i in range(bars[1], len(body)) if re.search(r"@!?P\d BRA", body[i]))
    join = plain_branch(masked + 1)
    skip.append((label(TARGET.search(body[masked]).group(1)),
                 label(TARGET.search(body[join]).group(1))))
    vote = next(i for i, x in enumerate(body) if "VOTE.ANY" in x)
    branch = next(i for i in range(vote, len(body)) if "BRA" in body[i])
    skip.append((branch + 1, label(TARGET.search(body[branch]).group(1))))
    sections = {"staging": (0, commit + 1), "scores+exchange": (commit + 1, bars[1]),
                "softmax+P V": (bars[1], len(body))}
    out = {}
    for name, (a, b) in sections.items():
        counts = collections.Counter()
        for i in range(a, b):
            m = INSTR.match(body[i])
            if m and not any(s <= i < e for s, e in skip):
                op = m.group(1) + (".MOV" if (m.group(2) or "").startswith(".MOV") else "")
                counts[op] += 1
        out[name] = counts
    return out


def main() -> int:
    import attention as dev_attention   # dev/cuda/attention.py: registers the candidates
    from kdtree_numba.attention import plan
    dev_attention.register()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(plan.BF16_LAYOUTS))
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()
    for layout in args.layouts.split(","):
        cfg = plan.Bf16TileConfig(512, 64, rows=args.rows, threads=4 * args.rows,
                                  keys=args.keys, **plan.BF16_LAYOUTS[layout]).validate()
        sass, info = compile_sass(cfg)
        path = tile_path(sass)
        total = sum(sum(c.values()) for c in path.values())
        print(f"{layout}: {total} instructions a tile and warp ({info})")
        for name, counts in path.items():
            top = ", ".join(f"{k} {v}" for k, v in counts.most_common(6))
            print(f"  {name:16s} {sum(counts.values()):5d}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Write the absorbed-MLA attention test vectors (KDTR files) from the NumPy reference.

    python3 tools/vectors_attention.py [OUTDIR]        # default tests/vectors/
    python3 tools/make_vectors.py attention            # the same, through the family runner

Two files, each a set of groups ``caseN`` with ``in/...`` inputs, ``out/...`` expected outputs
and scalar arguments as group attributes (layout for C++ readers: docs/ATTENTION.md, "Test
vectors"):

* ``attention_mla.kdtr``: ``mla_attention`` cases (decode, causal prefill, DDTree verify with
  padding rows, a row that sees nothing, Kimi-K2 widths r=512/dr=64).  ``tau`` is stored as a
  float32-exact number so a float32 implementation uses exactly the reference's scale.
* ``attention_proj.kdtr``: ``absorb_q`` and ``apply_uv`` cases.

Everything is drawn from a fixed seed, so rerunning rewrites identical files.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from formats import kdtr  # noqa: E402
from reference import attention as ref  # noqa: E402
from reference.attention import tree_visible  # noqa: E402

SEED = 20260517
ALIGN_LOG2 = 6          # 64-byte alignment keeps these small files small
MLA_INPUTS = ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible")
KIMI_TAU = 0.130861     # Kimi-K2's softmax scale (docs/ATTENTION.md)

# The DDTree golden tree [[3,2,1,0]]x3, B=8 of docs/DDTREE.md: parents of nodes 0..8.
GOLDEN_PARENTS = (-1, 0, 1, 2, 0, 1, 4, 2, 5)


def _mla_case(rng, bs, n, heads, r, dr, prefix, visible, tau, note):
    prefix = np.asarray(prefix, np.int32)
    max_len = int(prefix.max()) + n
    f32 = np.float32
    return dict(note=note, tau=float(np.float32(tau)), prefix_len=prefix,
                visible=np.asarray(visible, bool).reshape(bs, n, n),
                q_abs=rng.normal(size=(bs, n, heads, r)).astype(f32),
                q_pe=rng.normal(size=(bs, n, heads, dr)).astype(f32),
                ckv=rng.normal(size=(bs, max_len, r)).astype(f32),
                kpe=rng.normal(size=(bs, max_len, dr)).astype(f32))


def _mla_cases(rng):
    golden = tree_visible(GOLDEN_PARENTS)
    padded = np.eye(12, dtype=bool)                    # 9 tree rows + 3 padding rows
    padded[:9, :9] = golden
    random_tree = tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, 7)])
    sees_nothing = np.zeros((3, 3), bool)
    sees_nothing[2, 2] = True                          # rows 0 and 1 see nothing at all
    return [
        _mla_case(rng, 3, 1, 4, 32, 16, [0, 5, 37], np.ones((3, 1, 1)), 0.125,
                  "decode: n=1, ragged prefixes incl. 0"),
        _mla_case(rng, 2, 6, 2, 32, 8, [0, 19], np.tril(np.ones((6, 6), bool))[None]
                  .repeat(2, 0), 0.25, "prefill: causal mask"),
        _mla_case(rng, 2, 12, 2, 32, 8, [33, 70], np.stack([padded, padded]), 0.1875,
                  "verify: golden DDTree (B=8) + 3 diagonal-only padding rows"),
        _mla_case(rng, 1, 7, 2, 32, 8, [41], random_tree[None], 0.3, "verify: random tree"),
        _mla_case(rng, 1, 3, 2, 16, 8, [0], sees_nothing[None], 0.5,
                  "prefix 0 and all-false rows: u = 0 by definition"),
        _mla_case(rng, 1, 2, 2, 512, 64, [17], np.tril(np.ones((2, 2), bool))[None], KIMI_TAU,
                  "Kimi-K2 widths r=512, dr=64, tau=0.130861 (rounded to float32)"),
    ]


def write_mla(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, case in enumerate(_mla_cases(rng)):
            g = f.create_group(f"case{c}")
            g.attrs["kind"] = "mla_attention"
            g.attrs["tau"] = case["tau"]
            g.attrs["note"] = case["note"]
            for name in MLA_INPUTS:
                g[f"in/{name}"] = case[name]
            args = {k: case[k] for k in MLA_INPUTS}
            g["out/u"] = ref.mla_attention(**args, tau=case["tau"])
    return path


def write_proj(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, (bs, n, heads, dn, dv, r) in enumerate([(2, 3, 4, 16, 16, 32),
                                                       (1, 2, 2, 8, 12, 64)]):
            kv_b_proj = (rng.normal(size=(heads * (dn + dv), r)) / np.sqrt(r)).astype(np.float32)
            q_nope = rng.normal(size=(bs, n, heads, dn)).astype(np.float32)
            u = rng.normal(size=(bs, n, heads, r)).astype(np.float32)
            g = f.create_group(f"case{c}")
            g.attrs["kind"] = "absorb_q+apply_uv"
            g.attrs["dn"], g.attrs["dv"] = dn, dv
            g["in/q_nope"], g["in/kv_b_proj"], g["in/u"] = q_nope, kv_b_proj, u
            g["out/q_abs"] = ref.absorb_q(q_nope, kv_b_proj)
            g["out/o"] = ref.apply_uv(u, kv_b_proj, dv)
    return path


def write(outdir) -> list[Path]:
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    return [write_mla(outdir / "attention_mla.kdtr", rng),
            write_proj(outdir / "attention_proj.kdtr", rng)]


def read_cases(path, kdtr_module=kdtr) -> list[dict]:
    """Every case of one file as ``{"kind", "inputs", "outputs"}`` (arrays copied out)."""
    cases = []
    with kdtr_module.File(path) as f:
        for name in f.keys():
            g = f[name]
            kind = g.attrs["kind"]
            inputs = {k: np.array(v[...]) for k, v in g["in"].items()}
            outputs = {k: np.array(v[...]) for k, v in g["out"].items()}
            if kind == "mla_attention":
                inputs["tau"] = float(g.attrs["tau"])
            else:
                inputs["dv"] = int(g.attrs["dv"])
            cases.append({"kind": kind, "name": name, "inputs": inputs, "outputs": outputs})
    return cases


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    outdir = Path(argv[0]) if argv else ROOT / "tests" / "vectors"
    for path in write(outdir):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

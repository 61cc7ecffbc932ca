#!/usr/bin/env python3
"""Write the DDTree test vectors (KDTR files) from the NumPy reference.

    python3 tools/vectors_ddtree.py [OUTDIR]        # default tests/vectors/
    python3 tools/make_vectors.py ddtree            # the same, through the family runner

Five files, ``ddtree_{topk,build,verify,accept,compact}.kdtr``, each a set of groups
``caseN`` with ``in/...`` inputs, ``out/...`` expected outputs and scalar arguments as group
attributes.  The layout is specified in docs/DDTREE.md ("Test vectors") for C++ readers.
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
from reference import ddtree as ref  # noqa: E402

SEED = 20260412
ALIGN_LOG2 = 6          # 64-byte alignment keeps these small files small
TREE_FIELDS = ("n_nodes", "token", "parent", "depth", "rank", "score")

# The golden cases of docs/DDTREE.md ("The algorithm in one round"): logits rows (before top-K) and budget.
GOLDEN = (([[2, 1, 0], [0, -1, 1]], 3), ([[1, 1, 0], [.5, .5, .5]], 4), ([[3, 2, 1, 0]] * 3, 8))


def _put_tree(group, tree: ref.DraftTree) -> None:
    for name in TREE_FIELDS:
        group[name] = getattr(tree, name)
    group.attrs["max_depth"] = tree.max_depth


def _tree_from_logits(logits: np.ndarray, budget: int) -> ref.DraftTree:
    lp, ids = ref.topk_logprobs(logits, min(budget, logits.shape[-1]))
    return ref.build_tree(lp, ids, budget)


def _topk_cases(rng):
    normal = (rng.normal(size=(2, 3, 50)) * 3).astype(np.float32)
    ties = rng.integers(-2, 3, size=(1, 4, 40)).astype(np.float32)   # heavy ties: id order
    tiny = rng.normal(size=(2, 1, 5)).astype(np.float32)
    wide = rng.normal(size=(1, 2, 2000)).astype(np.float32)
    return [(normal, 8), (ties, 16), (tiny, 5), (wide, 64)]


def write_topk(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, (logits, k) in enumerate(_topk_cases(rng)):
            g = f.create_group(f"case{c}")
            g.attrs["k"] = k
            lp, ids = ref.topk_logprobs(logits, k)
            g["in/logits"], g["out/lp"], g["out/ids"] = logits, lp, ids
    return path


def _build_cases(rng):
    cases = [(np.asarray([rows], np.float32), budget) for rows, budget in GOLDEN]
    cases.append(((rng.normal(size=(3, 4, 12)) * 2).astype(np.float32), 20))
    cases.append((rng.integers(-1, 2, size=(2, 5, 6)).astype(np.float32), 24))  # tie-heavy
    cases.append((rng.normal(size=(2, 3, 2)).astype(np.float32), 64))             # n < budget
    cases.append(((rng.normal(size=(2, 15, 64)) * 2).astype(np.float32), 64))      # real shape
    cases.append((rng.integers(0, 3, size=(1, 15, 300)).astype(np.float32), 256))  # ties, big B
    return cases


def write_build(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, (logits, budget) in enumerate(_build_cases(rng)):
            g = f.create_group(f"case{c}")
            g.attrs["budget"] = budget
            lp, ids = ref.topk_logprobs(logits, min(budget, logits.shape[-1]))
            g["in/lp"], g["in/ids"] = lp, ids
            _put_tree(g.create_group("out"), ref.build_tree(lp, ids, budget))
    return path


def write_verify(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, (logits, budget) in enumerate(_build_cases(rng)[3:7]):
            bs = logits.shape[0]
            tree = _tree_from_logits(logits, budget)
            root = rng.integers(0, 1000, size=bs).astype(np.int32)
            start = rng.integers(0, 100, size=bs).astype(np.int32)
            g = f.create_group(f"case{c}")
            _put_tree(g.create_group("in/tree"), tree)
            g["in/root_token"], g["in/start"] = root, start
            out = ref.compile_tree(tree, root, start)
            for name in ("input_ids", "positions", "anc", "visible"):
                g[f"out/{name}"] = getattr(out, name)
    return path


def _targets_following(tree: ref.DraftTree, rng, p_follow: float) -> np.ndarray:
    """Target tokens that agree with some child of each node with probability p_follow."""
    bs, width = tree.token.shape
    target = rng.integers(0, 50, size=(bs, width)).astype(np.int32)
    for b in range(bs):
        for c in range(1, int(tree.n_nodes[b]) + 1):
            if rng.random() < p_follow:
                target[b, tree.parent[b, c]] = tree.token[b, c]
    return target


def write_accept(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        c = 0
        for logits, budget in _build_cases(rng)[3:7]:
            tree = _tree_from_logits(logits, budget)
            for p_follow in (0.3, 0.9):
                g = f.create_group(f"case{c}")
                g.attrs["mode"] = "greedy"
                _put_tree(g.create_group("in/tree"), tree)
                g["in/target_tokens"] = target = _targets_following(tree, rng, p_follow)
                g["out/acc_idx"], g["out/acc_len"], g["out/next_token"] = \
                    ref.accept_greedy(tree, target)
                c += 1
        for logits, budget, vocab, temperature in ((_build_cases(rng)[3][0], 20, 12, 0.8),
                                                   (_build_cases(rng)[5][0], 64, 30, 1.5)):
            tree = _tree_from_logits(logits, budget)
            bs = tree.token.shape[0]
            # Target logits favouring the tree's tokens, so sampled walks go deep.
            target_logits = rng.normal(size=(bs, budget + 1, vocab)).astype(np.float32)
            for b in range(bs):
                for i in range(1, int(tree.n_nodes[b]) + 1):
                    target_logits[b, tree.parent[b, i], tree.token[b, i] % vocab] += 2.0
            uniforms = rng.random((bs, budget + 1))
            g = f.create_group(f"case{c}")
            g.attrs["mode"] = "sampled"
            g.attrs["temperature"] = temperature
            _put_tree(g.create_group("in/tree"), tree)
            g["in/target_logits"], g["in/uniforms"] = target_logits, uniforms
            g["out/target_tokens"] = ref.sample_targets(tree, target_logits, temperature,
                                                        uniforms)
            g["out/acc_idx"], g["out/acc_len"], g["out/next_token"] = \
                ref.accept_sampled(tree, target_logits, temperature, uniforms)
            c += 1
    return path


def _compact_cases(rng):
    """(caches, past_len, acc_idx, acc_len): float32, bf16 bits (uint16) and a 4-D stack."""
    acc_idx = np.array([[0, 2, 3, -1, -1], [0, 1, 2, -1, -1], [0, 1, 4, 5, 9], [0, -1, -1, -1, -1]],
                       np.int32)
    acc_len = np.array([3, 3, 5, 1], np.int32)
    past_len = np.array([3, 0, 7, 5], np.int32)
    f32 = rng.normal(size=(4, 20, 6)).astype(np.float32)
    bf16 = rng.integers(0, 2 ** 16, size=(4, 20, 10)).astype(np.uint16)
    stack = rng.integers(0, 2 ** 16, size=(3, 4, 20, 5)).astype(np.uint16)
    return [([f32, bf16], past_len, acc_idx, acc_len), ([stack], past_len, acc_idx, acc_len)]


def write_compact(path: Path, rng) -> Path:
    with kdtr.File(path, "w", align_log2=ALIGN_LOG2) as f:
        for c, (caches, past_len, acc_idx, acc_len) in enumerate(_compact_cases(rng)):
            g = f.create_group(f"case{c}")
            g.attrs["n_caches"] = len(caches)
            g["in/past_len"], g["in/acc_idx"], g["in/acc_len"] = past_len, acc_idx, acc_len
            after = [cache.copy() for cache in caches]
            ref.compact_kv(after, past_len, acc_idx, acc_len)
            for i, (before, moved) in enumerate(zip(caches, after)):
                g[f"in/caches/{i}"], g[f"out/caches/{i}"] = before, moved
    return path


def write(outdir) -> list[Path]:
    """Write every DDTree vector file into ``outdir``; returns their paths."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    return [write_topk(outdir / "ddtree_topk.kdtr", rng),
            write_build(outdir / "ddtree_build.kdtr", rng),
            write_verify(outdir / "ddtree_verify.kdtr", rng),
            write_accept(outdir / "ddtree_accept.kdtr", rng),
            write_compact(outdir / "ddtree_compact.kdtr", rng)]


if __name__ == "__main__":
    for p in write(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "vectors"):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")

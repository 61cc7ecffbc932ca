"""Rank the target's tokens by how often they occur in its training text, and write the ranking
into a DFlash drafter bundle (``dflash/vocab_rank``), so the drafter can rank only the N most
frequent tokens (``DFlashDrafter(draft_vocab=N)``, ``kdtree-run --draft-vocab N``; FR-Spec,
frequency-ranked speculative sampling, 2025).

    python3 tools/draft_vocab.py [--drafter DRAFTER.kdtr] [--out OUT.kdtr] [--model TARGET.kdtr]
        [--metrics METRICS.json] [--mb 8] [--workers 2]
    python3 tools/draft_vocab.py --files A.py B.py ... --out OUT.kdtr   # these texts instead

The text: the target's corpus rebuilt on this machine as its trainer built it
(tools/demo/corpus.py ``build`` with the ``hp`` of ``--metrics``, the target's metrics.json),
its **train** split only, and of that the files of no directory that a held-out prompt came
from (``--heldout``, tools/data/heldout_prompts.jsonl: its paths' directories and its files'
sha256, so no prompt is ever counted, even where this machine's split differs from the
target's); ``--mb`` MB of those files in sha256 order (a spread over packages).  Each file is
encoded as in training, ``[bos] + encode(text)``, with the target bundle's own tokenizer.

The ranking: every id of the vocabulary, most frequent first, ties by smaller id (int32 [V];
a token never seen ranks by id after every seen one).  The bundle is rewritten with every other
tensor and attribute as it was (``--out`` defaults to the drafter itself; the write is atomic).
It prints how much of the counted text the top N cover, and how many of the top N of the first
half of the files are in the top N of all of them (the ranking's stability).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)

from kdtree_numba import demo  # noqa: E402
from kdtree_numba.bundle import (DFLASH_VOCAB_RANK, check_vocab_rank,  # noqa: E402
                                 read_dflash_bundle, write_dflash_bundle)
from kdtree_numba.text import load_codec  # noqa: E402

METRICS = os.path.join(ROOT, "docs", "gpu-runs", "2026-12-01-run32-train_target-metrics.json")
HELDOUT = os.path.join(ROOT, "tools", "data", "heldout_prompts.jsonl")
SIZES = (256, 512, 1024, 2048, 4096)       # the cuts the report covers


def prompt_exclusions(path: str) -> tuple[set[str], set[str]]:
    """(directories, sha256s) of the held-out prompts' files: a directory as
    tools/demo/corpus.py's ``group_of`` names it (``stdlib:DIR`` or ``site:DIR``, DIR inside
    the root; a top-level module is its own group), from the prompt's absolute path on the
    machine that made it."""
    groups, hashes = set(), set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            hashes.add(rec["sha256"])
            p = rec["path"]
            for marker, root in (("/site-packages/", "site"), ("/dist-packages/", "site")):
                if marker in p:
                    rel = p.split(marker, 1)[1]
                    break
            else:                      # the standard library: .../lib/pythonX.Y/REL
                parts = p.split("/")
                at = [i for i, s in enumerate(parts) if s.startswith("python") and
                      s[6:7].isdigit()]
                if not at:
                    raise ValueError(f"{path}: prompt {rec.get('id')}'s path {p} is in "
                                     f"neither a site-packages nor a pythonX.Y directory")
                root, rel = "stdlib", "/".join(parts[at[-1] + 1:])
            groups.add(f"{root}:{os.path.dirname(rel) or rel}")
    return groups, hashes


def corpus_texts(metrics: str, heldout: str, mb: float, workers: int, log) -> list[str]:
    """The train texts to count (module docstring), in sha256 order, up to ``mb`` MB."""
    from demo import corpus
    with open(metrics) as fh:
        hp = json.load(fh)["hp"]
    files, _ = corpus.build(hp, workers, log)
    groups, hashes = prompt_exclusions(heldout)
    train = [f for f in files if f.split == "train"]
    kept = [f for f in train if f.group not in groups and f.sha256 not in hashes]
    log(f"train files: {len(train)}, {len(train) - len(kept)} left out (a held-out prompt's "
        f"directory, {len(groups)} directories)")
    out, used = [], 0
    for f in sorted(kept, key=lambda f: f.sha256):
        if used >= mb * 1e6:
            break
        out.append(f.text)
        used += len(f.text)
    return out


def count_tokens(codec, texts: list[str], vocab: int) -> np.ndarray:
    """Occurrences of each id [vocab] int64 over the texts, each as ``codec.encode`` gives it
    (the bos in front, as every training file began)."""
    counts = np.zeros(vocab, np.int64)
    encs = codec.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
    for enc in encs:
        counts += np.bincount(np.asarray(enc.ids, np.int64), minlength=vocab)[:vocab]
    if codec.bos_id is not None:
        counts[codec.bos_id] += len(texts)
    return counts


def rank_tokens(counts) -> np.ndarray:
    """Every id, most frequent first, ties by smaller id: int32 [V]."""
    counts = np.asarray(counts)
    return np.lexsort((np.arange(counts.size), -counts)).astype(np.int32)


def coverage(counts, rank, n: int) -> float:
    """The share of the counted tokens that the top ``n`` of ``rank`` cover."""
    total = int(np.sum(counts))
    return float(np.sum(np.asarray(counts)[rank[:n]]) / total) if total else 0.0


def write_ranking(drafter: str, out: str, rank) -> None:
    """The drafter bundle rewritten to ``out`` with ``rank`` as its ``dflash/vocab_rank``
    (replacing one it had); every other tensor and attribute as read (dtype kept)."""
    config, weights, spec = read_dflash_bundle(drafter)
    weights[DFLASH_VOCAB_RANK] = check_vocab_rank(rank, config.vocab_size)
    write_dflash_bundle(out, config, weights, target_layer_ids=spec.target_layer_ids,
                        block_size=spec.block_size, target_hidden_size=spec.target_hidden_size,
                        target_vocab_size=spec.target_vocab_size,
                        target_num_layers=spec.target_num_layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", default=str(demo.DRAFTER), help="the DFlash drafter bundle")
    p.add_argument("--out", help="the bundle to write (default: the drafter, in place)")
    p.add_argument("--model", default=str(demo.TARGET), help="the target (its tokenizer)")
    p.add_argument("--metrics", default=METRICS, help="the target's metrics.json (its corpus "
                   "settings, hp)")
    p.add_argument("--heldout", default=HELDOUT, help="held-out prompts whose directories "
                   "are never counted")
    p.add_argument("--mb", type=float, default=8.0, help="MB of train text to count")
    p.add_argument("--workers", type=int, default=2, help="threads reading the corpus")
    p.add_argument("--files", nargs="+", metavar="FILE",
                   help="count these files instead of the corpus")
    args = p.parse_args(argv)
    log = lambda msg: print(f"draft_vocab: {msg}", file=sys.stderr)  # noqa: E731
    codec = load_codec(args.model)
    if codec is None:
        p.error(f"{args.model} carries no tokenizer")
    if args.files:
        texts = []
        for path in args.files:
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read().replace("\r\n", "\n"))
    else:
        texts = corpus_texts(args.metrics, args.heldout, args.mb, args.workers, log)
    config = read_dflash_bundle(args.drafter, verify=False)[0]
    counts = count_tokens(codec, texts, config.vocab_size)
    rank = rank_tokens(counts)
    half = rank_tokens(count_tokens(codec, texts[:len(texts) // 2], config.vocab_size))
    log(f"counted {int(counts.sum()):,} tokens of {len(texts)} files "
        f"({sum(map(len, texts)) / 1e6:.1f} MB); {int((counts > 0).sum())} of "
        f"{config.vocab_size} ids seen")
    for n in (n for n in SIZES if n < config.vocab_size):
        same = np.intersect1d(rank[:n], half[:n]).size
        log(f"top {n}: {100 * coverage(counts, rank, n):.2f}% of the tokens; {same}/{n} "
            f"also in the first half's top {n}")
    out = args.out or args.drafter
    write_ranking(args.drafter, out, rank)
    log(f"wrote {DFLASH_VOCAB_RANK} into {out} ({os.path.getsize(out) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The draft vocabulary (issue 37; FR-Spec): a DFlash drafter whose lm_head ranks only the N
most frequent tokens of its bundle's ranking (kdtree_numba/dflash.py, ``draft_vocab``).

* Its logits against the full drafter's on the same context: equal on the kept tokens,
  MASKED_LOGIT on the others (the reference backend and the CPU path's float32).
* Lossless: DDTree with the cut gives AR's tokens (T = 0 and T > 0 under one seed, host and
  device rounds), and its trees hold kept tokens only.
* The checks: no ranking, N beyond the vocabulary, a budget whose top-K exceeds N (API,
  kdtree-run); the bundle's ranking refused by the writer and the reader when it is not a
  permutation of the vocabulary (typed, naming the problem), a bundle without one still loads.
* The CPU path's top-K (kdtree_numba/cpu.py) against the reference on masked rows with ties.
* tools/draft_vocab.py on a tiny corpus (ranking, exclusions, the rewritten bundle),
  bench_demo's --draft-vocab list.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import sys

import numpy as np
import pytest

from kdtree_numba import cpu, demo
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import (DFLASH_VOCAB_RANK, BundleError, check_vocab_rank,
                                 dflash_shapes, open_dflash_bundle, read_dflash_bundle,
                                 write_bundle, write_dflash_bundle)
from kdtree_numba.cli import run_main
from kdtree_numba.dflash import MASKED_LOGIT, DFlashDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model
from kdtree_numba.text import load_codec
from reference.ddtree import topk_logprobs as reference_topk
from test_dflash import parts2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_demo  # noqa: E402
import draft_vocab as tool  # noqa: E402

KEEP = 40      # of the tiny pair's 128 tokens


def ranked(vocab: int = 128, seed: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).permutation(vocab).astype(np.int32)


def drafters(backend="reference", n: int = KEEP, seed: int = 0):
    """(target, the full drafter, the drafter of the n first tokens of ``ranked()``)."""
    tcfg, tw, dcfg, dw, spec = parts2(seed=seed)
    target = Model(tcfg, tw, backend)
    weights = dict(dw, **{DFLASH_VOCAB_RANK: ranked(tcfg.vocab_size)})
    return (target, DFlashDrafter(target, dcfg, weights, spec),
            DFlashDrafter(target, dcfg, weights, spec, draft_vocab=n))


def proposals(drafter, depths=(None, 2), seed: int = 3) -> list[np.ndarray]:
    """Host logits of ``drafter.draft`` at each depth after a two-step context of random
    features (the same for every drafter of one seed)."""
    rng = np.random.default_rng(seed)
    be = drafter.model.backend
    width = len(drafter.feature_layers) * drafter.model.config.hidden_size
    drafter.start(2, 64)
    for m, lengths in ((5, [5, 2]), (3, [3, 1])):
        feats = rng.standard_normal((2, m, width)).astype(np.float32)
        drafter.extend_context(be.asarray(feats), np.array(lengths))
    roots = rng.integers(0, drafter.vocab_size, 2)
    return [np.asarray(be.to_host(drafter.draft(roots, d))) for d in depths]


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_masked_logits_are_the_full_logits_on_the_kept_tokens(precision):
    target, full, cut = drafters(make_backend("reference", precision=precision))
    kept = np.sort(ranked()[:KEEP])
    others = np.setdiff1d(np.arange(128), kept)
    assert full.draft_vocab is None and cut.draft_vocab == KEEP
    assert full.model.lm_head is target.lm_head and cut.model.lm_head.shape == (KEEP, 64)
    for a, b in zip(proposals(full), proposals(cut)):
        assert a.shape == b.shape and a.shape[-1] == 128 and a.dtype == b.dtype == np.float32
        assert np.abs(a).max() > 1.0
        np.testing.assert_allclose(b[..., kept], a[..., kept], rtol=1e-6,
                                   atol=1e-6 * np.abs(a).max())
        assert (b[..., others] == MASKED_LOGIT).all()


@pytest.mark.parametrize("device_rounds", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ddtree_with_a_draft_vocabulary_gives_ar_tokens(device_rounds, temperature):
    """The AR tokens under one seed, while every tree holds kept tokens only (a hook copies
    the first round's tree; the full drafter's tree takes others)."""
    target, full, cut = drafters(seed=41)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    ar = generate(target, prompts, 12, temperature=temperature, seed=4).tokens
    res = generate(target, prompts, 12, method="ddtree", drafter=cut, budget=6,
                   temperature=temperature, seed=4, device_rounds=device_rounds)
    assert res.tokens == ar
    kept = set(ranked()[:KEEP].tolist())
    for drafter, inside in ((cut, True), (full, False)):
        seen = []
        generate(target, prompts, 6, method="ddtree", drafter=drafter, budget=6,
                 temperature=temperature, seed=4,
                 on_round=lambda tree, *_: seen.extend(
                     int(t) for b in range(2) for t in tree.token[b, 1:1 + tree.n_nodes[b]]))
        assert seen and (set(seen) <= kept) == inside


def test_the_cpu_path_drafts_a_draft_vocabulary_at_t_above_0_only(monkeypatch):
    """The CPU path's default (draft_vocab None, a ranking): a draft at T > 0 gives the logits
    of the cut drafter (cpu.SAMPLED_DRAFT_VOCAB tokens, here KEEP), at T = 0 the full
    drafter's, bit for bit; draft_vocab 0 and the float64 reference keep the whole vocabulary
    at any T; DDTree at T > 0 still gives AR's tokens, its trees of kept tokens only."""
    monkeypatch.setattr(cpu, "SAMPLED_DRAFT_VOCAB", KEEP)
    target, default, cut = drafters(make_backend("reference", precision="float32"))
    _, _, dcfg, dw, spec = parts2()
    full = DFlashDrafter(target, dcfg, dict(dw, **{DFLASH_VOCAB_RANK: ranked()}), spec,
                         draft_vocab=0)
    assert default.draft_vocab is None

    def drafts(drafter, t):
        return proposals(_Tempered(drafter, t))
    for a, b in zip(drafts(default, 0.0), drafts(full, 0.0)):
        np.testing.assert_array_equal(a, b)
    for a, b, c in zip(drafts(default, 0.7), drafts(cut, 0.0), drafts(full, 0.7)):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)                 # full ranks every token at T > 0
    _, ref_default, _ = drafters()
    for a, b in zip(drafts(ref_default, 0.7), drafts(ref_default, 0.0)):
        np.testing.assert_array_equal(a, b)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    ar = generate(target, prompts, 10, temperature=0.8, seed=4).tokens
    seen = []
    res = generate(target, prompts, 10, method="ddtree", drafter=default, budget=6,
                   temperature=0.8, seed=4, on_round=lambda tree, *_: seen.extend(
                       int(t) for b in range(2) for t in tree.token[b, 1:1 + tree.n_nodes[b]]))
    assert res.tokens == ar and seen and set(seen) <= set(ranked()[:KEEP].tolist())


class _Tempered:
    """``drafter`` whose ``draft`` runs at temperature ``t`` (proposals' calls)."""

    def __init__(self, drafter, t):
        self.inner, self.t = drafter, t
        self.model, self.feature_layers = drafter.model, drafter.feature_layers
        self.vocab_size, self.start = drafter.vocab_size, drafter.start
        self.extend_context = drafter.extend_context

    def draft(self, roots, depth=None):
        return self.inner.draft(roots, depth, self.t)


def test_the_draft_vocabulary_checks():
    tcfg, tw, dcfg, dw, spec = parts2()
    target = Model(tcfg, tw, "reference")
    with pytest.raises(BundleError, match="needs the drafter bundle's token ranking"):
        DFlashDrafter(target, dcfg, dw, spec, draft_vocab=16)
    for none in (None, 0):                               # the whole vocabulary, no ranking
        assert DFlashDrafter(target, dcfg, dw, spec, draft_vocab=none).draft_vocab is None
    weights = dict(dw, **{DFLASH_VOCAB_RANK: ranked()})
    with pytest.raises(ValueError, match=r"draft_vocab 129: must lie in \[1, 128\]"):
        DFlashDrafter(target, dcfg, weights, spec, draft_vocab=129)
    assert DFlashDrafter(target, dcfg, weights, spec, draft_vocab=128).draft_vocab is None
    cut = DFlashDrafter(target, dcfg, weights, spec, draft_vocab=5)
    with pytest.raises(ValueError, match="takes each depth's top 6 tokens, but the drafter "
                       "ranks only its draft vocabulary of 5"):
        generate(target, [[1, 2]], 4, method="ddtree", drafter=cut, budget=6)
    with pytest.raises(ValueError, match="top 128 tokens"):   # auto's largest, 256, over V
        generate(target, [[1, 2]], 4, method="ddtree", drafter=cut, budget="auto")
    generate(target, [[1, 2]], 4, method="chain", drafter=cut)    # k = 1
    generate(target, [[1, 2]], 4, method="ddtree", drafter=cut, budget=5)


def _bundle(path, rank=None, **kw):
    tcfg, tw, dcfg, dw, spec = parts2()
    weights = dict(dw) if rank is None else dict(dw, **{DFLASH_VOCAB_RANK: rank})
    write_dflash_bundle(path, dcfg, weights, target_layer_ids=spec.target_layer_ids,
                        block_size=spec.block_size, target_hidden_size=tcfg.hidden_size,
                        target_vocab_size=tcfg.vocab_size,
                        target_num_layers=tcfg.num_hidden_layers, **kw)
    return dcfg, dw, spec


BAD_RANKS = [(ranked().astype(np.float32), "has dtype float32; it must hold integers"),
             (ranked()[:100], r"has shape \(100,\), expected \(128,\)"),
             (np.where(ranked() == 7, 3, ranked()), "not a permutation of 0..127: token 3 "
                                                    "appears 2 times"),
             (np.where(ranked() == 7, 128, ranked()), "holds 128, not a token id")]


def test_the_ranking_round_trips_and_a_bundle_without_one_loads(tmp_path):
    _, dw, _ = _bundle(tmp_path / "r.kdtr", ranked(), dtype="bfloat16")
    config, weights, _ = read_dflash_bundle(tmp_path / "r.kdtr")
    assert weights[DFLASH_VOCAB_RANK].dtype == np.int32
    np.testing.assert_array_equal(weights[DFLASH_VOCAB_RANK], ranked())
    assert weights["dflash/fc"].dtype.name == "bfloat16"     # the weights still bf16
    target = Model(*parts2()[:2], "reference")
    assert DFlashDrafter.load(tmp_path / "r.kdtr", target, draft_vocab=8).draft_vocab == 8
    _bundle(tmp_path / "none.kdtr")
    assert DFLASH_VOCAB_RANK not in read_dflash_bundle(tmp_path / "none.kdtr")[1]
    with pytest.raises(BundleError, match="token ranking"):
        DFlashDrafter.load(tmp_path / "none.kdtr", target, draft_vocab=8)


@pytest.mark.parametrize("rank, words", BAD_RANKS)
def test_a_bad_ranking_is_refused_by_the_writer_and_the_reader(tmp_path, rank, words):
    with pytest.raises(BundleError, match=words):
        _bundle(tmp_path / "w.kdtr", rank)
    assert not (tmp_path / "w.kdtr").exists()
    with pytest.raises(BundleError, match=words):
        check_vocab_rank(rank, 128)
    # a bundle that holds one anyway (written past the DFlash writer's check)
    dcfg, dw, spec = _bundle(tmp_path / "ok.kdtr")
    path = tmp_path / "bad.kdtr"
    integers = rank.dtype.kind in "iu"       # else a float dataset, written as a weight
    write_bundle(path, dcfg, dict(dw, **{DFLASH_VOCAB_RANK: rank}), kind="dflash_drafter",
                 shapes=dict(dflash_shapes(dcfg, 2),
                             **({} if integers else {DFLASH_VOCAB_RANK: rank.shape})),
                 optional={DFLASH_VOCAB_RANK: rank.shape} if integers else None,
                 extra_attrs=spec.to_attrs())
    with pytest.raises(BundleError, match=words) as e:
        with open_dflash_bundle(path):
            pass
    assert str(path) in str(e.value)


def test_the_cpu_top_k_is_the_references_on_masked_rows():
    rng = np.random.default_rng(3)
    logits = (3.0 * rng.standard_normal((2, 5, 256))).astype(np.float32)
    logits[..., 64:] = MASKED_LOGIT
    logits[0, 0, 9] = logits[0, 0, 3] = logits[0, 0].max() + 1.0      # a tie at the top
    for k in (1, 7, cpu.ARGMAX_TOPK, 40):
        lp, ids = cpu.topk_logprobs(logits, k)
        want_lp, want_ids = reference_topk(logits, k)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(lp, want_lp)
        assert lp.dtype == np.float32 and ids.dtype == np.int32
    assert cpu.topk_logprobs(logits, 2)[1][0, 0].tolist() == [3, 9]
    assert make_backend("reference", precision="float32").ops.topk_logprobs is \
        cpu.topk_logprobs


def test_the_tool_ranks_a_tiny_corpus(tmp_path, capsys):
    """tools/draft_vocab.py --files: the ranking is the counts' order (an independent count
    with the target's codec), written into a copy of the shipped drafter with every other
    tensor as it was; a held-out prompt's directory and file are named for exclusion."""
    texts = ["def f(x):\n    return x + x\n", "import os\nimport sys\nx = 1\n" * 3]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"{i}.py")
        files[-1].write_text(text)
    shutil.copy(demo.DRAFTER, tmp_path / "d.kdtr")
    assert tool.main(["--drafter", str(tmp_path / "d.kdtr"), "--out", str(tmp_path / "o.kdtr"),
                      "--files"] + [str(f) for f in files]) == 0
    assert "wrote dflash/vocab_rank" in capsys.readouterr().err
    codec = load_codec(demo.TARGET)
    counts = collections.Counter(t for text in texts for t in codec.encode(text))
    want = sorted(range(8192), key=lambda t: (-counts[t], t))
    _, before, _ = read_dflash_bundle(tmp_path / "d.kdtr")
    _, after, _ = read_dflash_bundle(tmp_path / "o.kdtr")
    np.testing.assert_array_equal(after.pop(DFLASH_VOCAB_RANK), want)
    before.pop(DFLASH_VOCAB_RANK, None)
    assert set(after) == set(before)
    for name, array in before.items():
        assert after[name].dtype == array.dtype and after[name].tobytes() == array.tobytes()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"path": "/usr/lib/python3.12/test/regrtest.py", "sha256": "aa"},
        {"path": "/usr/lib/python3.12/os.py", "sha256": "bb"},
        {"path": "/opt/v/lib/python3.12/site-packages/pandas/io/sql.py", "sha256": "cc"}]))
    assert tool.prompt_exclusions(str(prompts)) == (
        {"stdlib:test", "stdlib:os.py", "site:pandas/io"}, {"aa", "bb", "cc"})


def test_kdtree_run_draft_vocab(capsys):
    """The shipped pair at T = 1: --draft-vocab 1024 commits AR's tokens (one seed); a budget
    over N, a negative N and another drafter kind are refused in one line."""
    base = ["--max-new-tokens", "8", "--temperature", "1", "--json", "--seed", "3"]
    assert run_main(base) == 0
    ar = json.loads(capsys.readouterr().out)["tokens"]
    assert run_main(base + ["--method", "ddtree", "--draft-vocab", "1024"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ar
    for argv, words in [(["--draft-vocab", "4", "--budget", "7"], "--draft-vocab 4: a DDTree "
                         "round of --budget 7 takes each depth's top 7 tokens"),
                        (["--draft-vocab", "-1"], "must be an integer >= 0"),
                        (["--draft-vocab", "9000"], "the vocabulary holds 8192 tokens"),
                        (["--draft-vocab", "64", "--drafter", "oracle:0.9"],
                         "a DFlash drafter's option")]:
        assert run_main(["--method", "ddtree", "--max-new-tokens", "2"] + argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and words in err[0], err


def test_bench_demo_takes_a_list_of_draft_vocabularies(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n"}) + "\n")
    js = tmp_path / "b.json"
    assert bench_demo.main(["--prompts", "1", "--max-new-tokens", "4", "--backend",
                            "reference", "--temperature", "0", "--no-peers",
                            "--agreement-stride", "0", "--budgets", "4", "--draft-vocab",
                            "full,1024", "--prompt-file", str(path), "--json", str(js)]) == 0
    # the CPU path's default lookup (kdtree_numba/lookup.py) named beside the vocabulary
    assert "| ddtree | 4 (V_d 1024) (lookup 0.8) | 0 |" in capsys.readouterr().out
    rows = json.loads(js.read_text())["rows"]
    assert [(r["method"], r["draft_vocab"]) for r in rows] == \
        [("ar", None), ("chain", 0), ("ddtree", 0), ("ddtree", 1024)]
    assert all(r["identical"] == 1 for r in rows)
    assert bench_demo.parse_args(["--draft-vocab", "default,full,8"]).draft_vocab == \
        [None, 0, 8]
    with pytest.raises(SystemExit):
        bench_demo.parse_args(["--draft-vocab", "-3"])


@pytest.mark.gpu
@pytest.mark.parametrize("device_rounds", [False, True])
def test_gpu_draft_vocabulary_equals_ar_and_masks(device_rounds):
    """On the GPU (CuPy's take and scatter, inside the device round's CUDA graph too): the
    small target's AR tokens with a random drafter cut to 256 of its 1024 tokens, twice (the
    second replays), and its logits the full drafter's on the kept tokens."""
    from kdtree_numba.bundle import (DFlashSpec, default_target_layer_ids, dflash_config,
                                     random_weights, size_config)
    tcfg = size_config("small")
    gpu = Model(tcfg, dict(random_weights(tcfg, 0)), "numba")
    dcfg = dflash_config(tcfg)
    ids = default_target_layer_ids(tcfg.num_hidden_layers)
    dw = dict(random_weights(dcfg, 5, dflash_shapes(dcfg, len(ids))),
              **{DFLASH_VOCAB_RANK: ranked(1024)})
    spec = DFlashSpec(ids, 8, tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers)
    cut = DFlashDrafter(gpu, dcfg, dw, spec, draft_vocab=256)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    want = generate(gpu, prompts, 24).tokens
    for _ in range(2):
        res = generate(gpu, prompts, 24, method="ddtree", drafter=cut, budget=16,
                       device_rounds=device_rounds)
        assert res.tokens == want
    full = DFlashDrafter(gpu, dcfg, dw, spec)
    kept = np.sort(ranked(1024)[:256])
    for a, b in zip(proposals(full), proposals(cut)):
        np.testing.assert_allclose(b[..., kept], a[..., kept], rtol=1e-5,
                                   atol=1e-5 * np.abs(a).max())
        assert (np.delete(b, kept, axis=-1) == MASKED_LOGIT).all()

"""The draft temperature t_d (issue 37): a DDTree round builds its tree from the drafter's
logits / t_d (kdtree_numba/steps.py, ``draft_temperature`` and ``tree_phase``).

* The tree against an independent oracle: the B best prefix-closed token paths under the
  tempered drafter's float64 log-softmax, by brute force over every path; and bit for bit the
  reference builder's tree from ``logits / float32(t_d)``.
* t_d = 1 (the default, and T = 0's) hands the logits to the top-K untouched: no extra op.
* Lossless whatever t_d: DDTree's tokens equal AR's under a shared seed at T > 0 (host and
  device rounds) and at T = 0, while the trees themselves change.
* The numba path under the simulator (a `gpu` twin at the demo's vocabulary), the checks,
  kdtree-run's flag and bench_demo's list.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

import numpy as np
import pytest

import reference.ddtree as ref
from kdtree_numba.backends import make_backend
from kdtree_numba.cli import run_main
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.steps import draft_temperature, tree_phase
from reference.ddtree import Sampling
from test_dflash import target_and_drafter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_demo  # noqa: E402


def tempered_best_paths(logits: np.ndarray, budget: int, t_d: float) -> set[tuple]:
    """The oracle: every token path of depth 1..L scored by the float64 sum of
    log softmax(row_d / t_d)[token_d]; the ``budget`` best (ties cannot occur for these
    random rows).  The best-first tree is exactly this set (its paths are prefix-closed:
    a path never outscores its prefix)."""
    x = logits.astype(np.float64) / t_d
    lp = x - (x.max(-1, keepdims=True)
              + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
    n_rows, vocab = lp.shape
    scored = []
    for depth in range(1, n_rows + 1):
        for path in itertools.product(range(vocab), repeat=depth):
            scored.append((sum(lp[d, t] for d, t in enumerate(path)), path))
    scored.sort(key=lambda s: -s[0])
    return {path for _, path in scored[:budget]}


def tree_paths(tree, b: int = 0) -> set[tuple]:
    """The tree's nodes as token paths from the root."""
    paths = {0: ()}
    for i in range(1, int(tree.n_nodes[b]) + 1):
        paths[i] = paths[int(tree.parent[b, i])] + (int(tree.token[b, i]),)
    del paths[0]
    return set(paths.values())


def reference_tree(logits, budget, t_d):
    """The reference's top-K and builder on logits / float32(t_d), called directly."""
    lp, ids = ref.topk_logprobs(logits / np.float32(t_d), min(budget, logits.shape[-1]))
    return ref.build_tree(lp, ids, budget)


def build(ops, logits, budget, t_d):
    bs = logits.shape[0]
    roots, start = np.zeros(bs, np.int32), np.full(bs, 3, np.int32)
    tree, _ = tree_phase(ops, min(budget, logits.shape[-1]), budget, t_d)(logits, roots, start)
    return tree


@pytest.mark.parametrize("t_d", [0.5, 1.0, 1.5, 3.0])
def test_the_tree_is_the_best_paths_of_the_tempered_drafter(t_d):
    rng = np.random.default_rng(7)
    logits = (2.5 * rng.standard_normal((2, 3, 5))).astype(np.float32)
    budget = 12
    tree = build(make_backend("reference").ops, logits, budget, t_d)
    for b in range(2):
        assert tree_paths(tree, b) == tempered_best_paths(logits[b], budget, t_d)
    # bit for bit the reference pipeline on logits / float32(t_d)
    want = reference_tree(logits, budget, t_d)
    for name in ("n_nodes", "token", "parent", "depth", "rank", "score"):
        np.testing.assert_array_equal(getattr(tree, name), getattr(want, name))


def test_the_temperature_changes_the_tree():
    """A sharp drafter: t_d = 1 spends more of the budget deep on its argmax path, t_d = 3
    more on the alternatives near the root."""
    rng = np.random.default_rng(3)
    logits = (4.0 * rng.standard_normal((1, 4, 6))).astype(np.float32)
    ops = make_backend("reference").ops
    cold, warm = build(ops, logits, 8, 1.0), build(ops, logits, 8, 3.0)
    assert tree_paths(cold) != tree_paths(warm)
    cold_d, warm_d = cold.depth[0, 1:9], warm.depth[0, 1:9]
    assert warm_d.mean() < cold_d.mean() and (warm_d == 1).sum() > (cold_d == 1).sum()


def test_t_d_one_hands_the_logits_to_the_top_k_untouched():
    """T = 0's default and any t_d = 1: the very array the drafter made (no division, so no
    extra launch on the GPU and the bits of today's tree)."""
    seen = []
    real = make_backend("reference").ops

    class Spy:
        def topk_logprobs(self, logits, k):
            seen.append(logits)
            return real.topk_logprobs(logits, k)

        def __getattr__(self, name):
            return getattr(real, name)
    logits = np.random.default_rng(0).standard_normal((1, 2, 5)).astype(np.float32)
    build(Spy(), logits, 4, draft_temperature(Sampling(0.0)))
    build(Spy(), logits, 4, 2.0)
    assert seen[0] is logits and seen[1] is not logits
    np.testing.assert_array_equal(seen[1], logits / np.float32(2.0))


def test_the_default_policy_and_the_checks():
    for t in (0.0, 0.7, 1.0):
        assert draft_temperature(Sampling(t)) == 1.0 == draft_temperature(t)
    assert draft_temperature(Sampling(1.0), 2.5) == 2.5
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="draft_temperature must be finite and > 0"):
            draft_temperature(1.0, bad)
    with pytest.raises(TypeError, match="draft_temperature must be a real number"):
        draft_temperature(1.0, True)
    model, drafter = target_and_drafter()
    with pytest.raises(ValueError, match="draft_temperature"):
        generate(model, [[1, 2]], 2, method="ddtree", drafter=drafter, draft_temperature=0.0)


@pytest.mark.parametrize("device_rounds", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ddtree_with_a_draft_temperature_gives_ar_tokens(device_rounds, temperature):
    """Lossless for any tree: the same tokens as AR under one seed (T > 0: the same uniforms),
    on the host-driven and the device rounds, at t_d 1 and 0.1 (this random drafter is flat:
    only a sharpened one builds other trees than all depth 1); the rounds' trees differ.  A
    pair of its own (seed 37): the device-round programs it leaves on the target's cache are
    none of tests/test_device_round.py's business."""
    target, drafter = target_and_drafter(seed=37)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    ar = generate(target, prompts, 12, temperature=temperature, seed=4).tokens
    for t_d in (1.0, 0.1):
        res = generate(target, prompts, 12, method="ddtree", drafter=drafter, budget=6,
                       temperature=temperature, seed=4, draft_temperature=t_d,
                       device_rounds=device_rounds)
        assert res.tokens == ar and res.stats.draft_temperature == t_d
    trees = {}
    for t_d in (1.0, 0.1):                # the first round's tree (an on_round hook)
        got = []
        generate(target, prompts, 2, method="ddtree", drafter=drafter, budget=6,
                 temperature=temperature, seed=4, draft_temperature=t_d,
                 on_round=lambda tree, *_: got.append(tree_paths(tree)))
        trees[t_d] = got[0]
    assert trees[1.0] != trees[0.1]


def test_chain_ignores_the_draft_temperature():
    target, drafter = target_and_drafter(seed=37)
    kw = dict(method="chain", drafter=drafter, temperature=0.8, seed=1)
    a = generate(target, [[3, 4]], 8, **kw)
    b = generate(target, [[3, 4]], 8, draft_temperature=4.0, **kw)
    assert a.tokens == b.tokens and a.stats.tau == b.stats.tau
    assert a.stats.draft_temperature is None


def test_sampled_ddtree_with_an_oracle_drafter_equals_ar():
    """A sharp oracle drafter (the demo drafter's situation): any t_d, AR's tokens."""
    from test_engine import tiny_model
    model = tiny_model(1)
    prompts = [[7, 7, 7], [1, 2, 3, 4]]
    ar = generate(model, prompts, 8, temperature=1.0, seed=2)
    for t_d in (0.5, 2.0):
        dd = generate(model, prompts, 8, method="ddtree", temperature=1.0, seed=2, budget=6,
                      drafter=NoisyOracleDrafter(model, 3, 0.7, seed=2, sharpness=8.0),
                      draft_temperature=t_d)
        assert dd.tokens == ar.tokens


def test_numba_tree_with_a_draft_temperature_matches_the_reference(needs_kernels):
    """The numba path (simulator here): the same tree as the reference's from logits / t_d."""
    rng = np.random.default_rng(5)
    logits = (2.0 * rng.standard_normal((1, 3, 16))).astype(np.float32)
    ops = make_backend("numba").ops
    for t_d in (1.0, 2.0, 4.0):
        got, want = build(ops, logits, 6, t_d), reference_tree(logits, 6, t_d)
        for name in ("n_nodes", "token", "parent", "depth"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                          getattr(want, name))


@pytest.mark.gpu
@pytest.mark.parametrize("t_d", [1.0, 1.5, 3.0])
def test_gpu_tree_with_a_draft_temperature_at_the_demo_vocabulary(t_d):
    """On the GPU (CuPy's division, the numba top-K and builder): the reference's tree from
    logits / t_d at the demo pair's vocabulary and budget 32."""
    be = make_backend("numba")
    rng = np.random.default_rng(11)
    logits = (3.0 * rng.standard_normal((2, 15, 8192))).astype(np.float32)
    roots, start = np.zeros(2, np.int32), np.full(2, 9, np.int32)
    tree, _ = tree_phase(be.ops, 32, 32, t_d)(be.asarray(logits), be.asarray(roots),
                                              be.asarray(start))
    want = reference_tree(logits, 32, t_d)
    for name in ("n_nodes", "token", "parent", "depth"):
        np.testing.assert_array_equal(be.to_host(getattr(tree, name)), getattr(want, name))


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_kdtree_run_refuses_a_bad_draft_temperature(value, capsys):
    assert run_main(["--method", "ddtree", "--draft-temperature", value]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kdtree-run: error: --draft-temperature ")
    assert "must be a finite number > 0" in err[0]


def test_kdtree_run_draft_temperature_keeps_the_tokens(capsys):
    """The shipped pair at T = 1: --draft-temperature 2 commits AR's tokens (one seed)."""
    base = ["--max-new-tokens", "10", "--temperature", "1", "--json", "--seed", "3"]
    assert run_main(base) == 0
    ar = json.loads(capsys.readouterr().out)
    assert run_main(base + ["--method", "ddtree", "--draft-temperature", "2"]) == 0
    dd = json.loads(capsys.readouterr().out)
    assert dd["tokens"] == ar["tokens"] and dd["stats"]["draft_temperature"] == 2.0
    assert run_main(["--max-new-tokens", "2", "--draft-temperature", "2"]) == 0
    assert "--method ar ignores it" in capsys.readouterr().err


def test_bench_demo_takes_a_list_of_draft_temperatures(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "def f(x):\n"}) + "\n")
    js = tmp_path / "b.json"
    argv = ["--prompts", "1", "--max-new-tokens", "4", "--drafter", "oracle:0.9", "--backend",
            "reference", "--temperature", "1", "--no-peers", "--agreement-stride", "0",
            "--budgets", "4", "--draft-temperature", "default,2", "--prompt-file", str(path),
            "--json", str(js)]
    assert bench_demo.main(argv) == 0
    # the CPU path's default lookup (kdtree_numba/lookup.py) named beside the t_d
    assert "| ddtree | 4 (t_d 2) (lookup 0.8) | 1 |" in capsys.readouterr().out
    rows = json.loads(js.read_text())["rows"]
    assert [(r["method"], r["draft_temperature"]) for r in rows] == \
        [("ar", None), ("chain", None), ("ddtree", None), ("ddtree", 2.0)]
    assert all(r["identical"] == 1 for r in rows)
    with pytest.raises(SystemExit):
        bench_demo.parse_args(["--draft-temperature", "0"])

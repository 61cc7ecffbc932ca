"""DDTree kernels: the reference against goldens and independent oracles, the numba twin against
the reference (CUDA simulator, tiny shapes), and the committed KDTR vectors.

GPU-scale twin checks live in tests/test_ddtree_gpu.py.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference import ddtree as ref

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors"
TREE_FIELDS = ("n_nodes", "token", "parent", "depth", "rank", "score")
# Simulated kernels cost ~0.1-1 s per call: their property tests draw fewer examples.
SIM_EXAMPLES = settings(max_examples=8, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])
SIM_CHEAP_EXAMPLES = settings(max_examples=25, deadline=None,   # ~0.1 s per example
                              suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers

def make_logits(seed: int, shape, mode: str) -> np.ndarray:
    """Drafter-like logits: 'normal', 'ties' (small integers: heavy ties) or 'flat' (all equal)."""
    rng = np.random.default_rng(seed)
    if mode == "ties":
        return rng.integers(-2, 3, size=shape).astype(np.float32)
    if mode == "flat":
        return np.zeros(shape, np.float32)
    return (rng.normal(size=shape) * 3).astype(np.float32)


def tree_for(seed, bs, n_rows, vocab, budget, mode="normal") -> ref.DraftTree:
    lp, ids = ref.topk_logprobs(make_logits(seed, (bs, n_rows, vocab), mode), min(budget, vocab))
    return ref.build_tree(lp, ids, budget)


def assert_trees_identical(a: ref.DraftTree, b: ref.DraftTree) -> None:
    assert a.max_depth == b.max_depth
    for name in TREE_FIELDS:
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        # bytes, not values: -0.0 vs 0.0 or a last-bit score difference must fail
        assert x.tobytes() == y.tobytes(), f"{name} differs:\n{x}\n{y}"


def rank_path(tree: ref.DraftTree, b: int, i: int) -> tuple:
    path = []
    while i > 0:
        path.append(int(tree.rank[b, i]))
        i = int(tree.parent[b, i])
    return tuple(reversed(path))


def targets_following(tree: ref.DraftTree, seed: int, p_follow: float) -> np.ndarray:
    """Target tokens that pick some child's token at each node with probability p_follow."""
    rng = np.random.default_rng(seed)
    bs, width = tree.token.shape
    target = rng.integers(0, 7, size=(bs, width)).astype(np.int32)
    for b in range(bs):
        for c in range(1, int(tree.n_nodes[b]) + 1):
            if rng.random() < p_follow:
                target[b, tree.parent[b, c]] = tree.token[b, c]
    return target


def random_accepts(seed: int, bs: int, n_acc: int, max_offset: int):
    """Valid (acc_idx, acc_len): increasing from 0, identity prefixes and gaps mixed."""
    rng = np.random.default_rng(seed)
    acc_idx = np.full((bs, n_acc), -1, np.int32)
    acc_len = rng.integers(1, n_acc + 1, size=bs).astype(np.int32)
    for b in range(bs):
        idx = [0]
        for _ in range(acc_len[b] - 1):
            idx.append(idx[-1] + (1 if rng.random() < 0.5 else int(rng.integers(1, max_offset))))
        acc_idx[b, :acc_len[b]] = idx
    return acc_idx, acc_len


@pytest.fixture(scope="module")
def gpu():
    """The numba twin, or a skip where neither a GPU nor the simulator can run kernels (module
    scoped, unlike conftest's ``needs_kernels``, so Hypothesis tests may use it)."""
    from kdtree_numba import compat
    if not compat.kernels_runnable():
        pytest.skip("numba kernels need a GPU or NUMBA_ENABLE_CUDASIM=1")
    from kdtree_numba import ddtree
    return ddtree


# ----------------------------------------------------------------------------- goldens

@pytest.mark.parametrize("rows, budget, tokens, parents", [
    ([[2, 1, 0], [0, -1, 1]], 3, [0, 2, 1], [-1, 0, 1, 0]),
    ([[1, 1, 0], [.5, .5, .5]], 4, [0, 1, 2, 0], [-1, 0, 0, 0, 1]),
    ([[3, 2, 1, 0]] * 3, 8, None, [-1, 0, 1, 2, 0, 1, 4, 2, 5]),
])
def test_public_golden_trees(rows, budget, tokens, parents):
    logits = np.asarray([rows], np.float32)
    lp, ids = ref.topk_logprobs(logits, min(budget, logits.shape[-1]))
    tree = ref.build_tree(lp, ids, budget)
    n = int(tree.n_nodes[0])
    assert tree.parent[0, :n + 1].tolist() == parents
    if tokens is not None:
        assert tree.token[0, 1:n + 1].tolist() == tokens


def test_golden_topk_values():
    lp, ids = ref.topk_logprobs(np.asarray([[[1, 3, 3, 2]]], np.float32), 3)
    lse = math.log(math.exp(1) + 2 * math.exp(3) + math.exp(2))
    assert ids.tolist() == [[[1, 2, 3]]]            # the tie 3 == 3 goes to the smaller id
    np.testing.assert_array_equal(lp[0, 0], np.float32([3 - lse, 3 - lse, 2 - lse]))


# ----------------------------------------------------------------------------- top-K

@given(seed=st.integers(0, 2 ** 32 - 1), vocab=st.integers(1, 60), k_frac=st.floats(0, 1),
       mode=st.sampled_from(["normal", "ties", "flat"]))
def test_topk_is_the_full_sort_prefix_and_lp_is_logit_minus_exact_lse(seed, vocab, k_frac, mode):
    logits = make_logits(seed, (2, 2, vocab), mode)
    k = max(1, round(k_frac * vocab))
    lp, ids = ref.topk_logprobs(logits, k)
    for b, d in itertools.product(range(2), range(2)):
        row = logits[b, d]
        full = sorted(range(vocab), key=lambda j: (-float(row[j]), j))
        assert ids[b, d].tolist() == full[:k]
        lse = float(row.max()) + math.log(math.fsum(math.exp(float(x) - float(row.max()))
                                                    for x in row))
        want = np.float32([float(row[j]) - lse for j in full[:k]])
        np.testing.assert_array_max_ulp(lp[b, d], want, maxulp=1)
        assert np.all(np.diff(lp[b, d]) <= 0)


@pytest.mark.parametrize("logits, k, error", [
    (np.zeros((1, 2, 5), np.float64), 2, TypeError),
    (np.zeros((2, 5), np.float32), 2, ValueError),
    (np.zeros((1, 2, 5), np.float32), 0, ValueError),
    (np.zeros((1, 2, 5), np.float32), 6, ValueError),
    (np.zeros((1, 2, 5), np.float32), 2.0, TypeError),
    (np.full((1, 1, 3), np.nan, np.float32), 2, ValueError),
    (np.zeros((1, 0, 3), np.float32), 1, ValueError),
])
def test_topk_rejects_bad_input(logits, k, error):
    with pytest.raises(error):
        ref.topk_logprobs(logits, k)


# ----------------------------------------------------------------------------- tree builder

def check_tree_invariants(tree: ref.DraftTree, lp, ids, budget: int) -> None:
    bs, n_rows, k = lp.shape
    assert tree.token.shape == (bs, budget + 1) and tree.max_depth == n_rows
    reachable = sum(k ** d for d in range(1, n_rows + 1))
    for b in range(bs):
        n = int(tree.n_nodes[b])
        assert n == min(budget, reachable)   # < budget only for a tiny vocabulary
        assert (tree.token[b, 0], tree.parent[b, 0], tree.depth[b, 0], tree.rank[b, 0],
                tree.score[b, 0]) == (-1, -1, 0, -1, 0.0)
        pad = slice(n + 1, None)
        assert np.all(tree.token[b, pad] == -1) and np.all(tree.parent[b, pad] == -1)
        assert np.all(tree.depth[b, pad] == -1) and np.all(tree.rank[b, pad] == -1)
        assert np.all(tree.score[b, pad] == -np.inf)
        children: dict[int, list[int]] = {}
        for i in range(1, n + 1):
            p, d, r = int(tree.parent[b, i]), int(tree.depth[b, i]), int(tree.rank[b, i])
            assert 0 <= p < i
            assert d == tree.depth[b, p] + 1 and 1 <= d <= n_rows
            assert tree.token[b, i] == ids[b, d - 1, r]
            children.setdefault(p, []).append(i)
        assert np.all(np.diff(tree.score[b, 1:n + 1]) <= 0), "scores must not increase"
        for kids in children.values():   # ranks 0..c-1 in index order: prefix-closed
            assert [int(tree.rank[b, c]) for c in kids] == list(range(len(kids)))
            tokens = [int(tree.token[b, c]) for c in kids]
            assert len(set(tokens)) == len(tokens), "sibling tokens must be distinct"


@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 3), n_rows=st.integers(1, 6),
       vocab=st.integers(1, 12), budget=st.integers(1, 64),
       mode=st.sampled_from(["normal", "ties", "flat"]))
def test_build_tree_invariants(seed, bs, n_rows, vocab, budget, mode):
    lp, ids = ref.topk_logprobs(make_logits(seed, (bs, n_rows, vocab), mode), min(budget, vocab))
    check_tree_invariants(ref.build_tree(lp, ids, budget), lp, ids, budget)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), budget=st.sampled_from([256, 512, 1024]),
       mode=st.sampled_from(["normal", "ties"]))
def test_build_tree_invariants_large_budgets(seed, budget, mode):
    lp, ids = ref.topk_logprobs(make_logits(seed, (1, 15, 2048), mode), budget)
    check_tree_invariants(ref.build_tree(lp, ids, budget), lp, ids, budget)


def dyadic_lp(seed: int, bs: int, n_rows: int, k: int):
    """Sorted lp rows of multiples of 1/8 (sums and differences are exact in float64, so the
    builder's scores equal exact path sums) with many ties, and a random id permutation."""
    rng = np.random.default_rng(seed)
    lp = -np.sort(rng.integers(0, 12, size=(bs, n_rows, k)), axis=-1).astype(np.float32) / 8
    ids = np.argsort(rng.random((bs, n_rows, 40)), axis=-1)[..., :k].astype(np.int32)
    return lp, ids


@given(seed=st.integers(0, 2 ** 32 - 1), n_rows=st.integers(1, 3), k=st.integers(1, 4),
       budget=st.integers(1, 40))
def test_build_tree_pops_the_budget_best_rank_paths_in_order(seed, n_rows, k, budget):
    """Oracle: enumerate every rank path, sort by (exact score desc, path asc), take B."""
    lp, ids = dyadic_lp(seed, 1, n_rows, k)
    paths = [p for d in range(1, n_rows + 1) for p in itertools.product(range(k), repeat=d)]
    exact = {p: sum(float(lp[0, d, r]) for d, r in enumerate(p)) for p in paths}
    best = sorted(paths, key=lambda p: (-exact[p], p))[:budget]
    tree = ref.build_tree(lp, ids, budget)
    n = int(tree.n_nodes[0])
    assert [rank_path(tree, 0, i) for i in range(1, n + 1)] == best
    assert tree.score[0, 1:n + 1].tolist() == [exact[p] for p in best]


def test_build_tree_sibling_score_is_derived_from_the_popped_sibling():
    """Node 2's score is (score1 - lp[1][0]) + lp[1][1], which differs from the parent's score
    + lp[1][1] in the last bit for these values; every node follows the contract's recurrence."""
    lp = np.float32([[[-1.0566101e-09, -30.0], [-6.161779, -10.818729]]])
    ids = np.int32([[[0, 1], [0, 1]]])
    tree = ref.build_tree(lp, ids, 3)
    lp1 = lp[0, 1].astype(np.float64)
    assert tree.score[0, 3] == (tree.score[0, 2] - lp1[0]) + lp1[1]
    assert tree.score[0, 3] != tree.score[0, 1] + lp1[1]
    for i in range(1, int(tree.n_nodes[0]) + 1):
        p, d, r = tree.parent[0, i], tree.depth[0, i], tree.rank[0, i]
        if r == 0:
            want = tree.score[0, p] + np.float64(lp[0, d - 1, 0])
        else:   # the popped predecessor sibling has the same parent and rank r - 1
            prev = [j for j in range(1, i) if tree.parent[0, j] == p and tree.rank[0, j] == r - 1]
            want = ((tree.score[0, prev[0]] - np.float64(lp[0, d - 1, r - 1]))
                    + np.float64(lp[0, d - 1, r]))
        assert tree.score[0, i] == want


@pytest.mark.parametrize("args, error", [
    ((np.zeros((1, 2, 3), np.float64), np.zeros((1, 2, 3), np.int32), 4), TypeError),
    ((np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 3), np.int64), 4), TypeError),
    ((np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 2), np.int32), 4), ValueError),
    ((np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 3), np.int32), 0), ValueError),
    ((np.float32([[[-1, 0]]]), np.int32([[[0, 1]]]), 2), ValueError),      # row increases
    ((np.float32([[[-np.inf, -np.inf]]]), np.int32([[[0, 1]]]), 2), ValueError),
])
def test_build_tree_rejects_bad_input(args, error):
    with pytest.raises(error):
        ref.build_tree(*args)


# ----------------------------------------------------------------------------- verify inputs

def transitive_closure(tree: ref.DraftTree, b: int) -> np.ndarray:
    """Reflexive-transitive closure of the child -> parent relation (repeated boolean squaring)."""
    width = tree.token.shape[1]
    step = np.eye(width, dtype=bool)
    for i in range(1, int(tree.n_nodes[b]) + 1):
        step[i, tree.parent[b, i]] = True
    closure = step
    for _ in range(int(np.ceil(np.log2(width))) + 1):
        closure = (closure.astype(np.int64) @ closure.astype(np.int64)) > 0
    return closure


@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 3), n_rows=st.integers(1, 5),
       vocab=st.integers(1, 6), budget=st.integers(1, 30),
       mode=st.sampled_from(["normal", "ties"]))
def test_compile_tree_mask_is_the_ancestor_closure_and_anc_gives_the_same_mask(
        seed, bs, n_rows, vocab, budget, mode):
    tree = tree_for(seed, bs, n_rows, vocab, budget, mode)
    rng = np.random.default_rng(seed)
    root = rng.integers(0, 100, size=bs).astype(np.int32)
    start = rng.integers(0, 50, size=bs).astype(np.int64)
    out = ref.compile_tree(tree, root, start)
    width = budget + 1
    for b in range(bs):
        n = int(tree.n_nodes[b])
        np.testing.assert_array_equal(out.visible[b], transitive_closure(tree, b))
        pd = out.positions[b] - start[b]
        rule = np.array([[pd[j] <= pd[i] and out.anc[b, i, pd[j]] == j for j in range(width)]
                         for i in range(width)])
        np.testing.assert_array_equal(out.visible[b], rule)
        assert out.visible[b].any(axis=1).all(), "no row may be fully masked"
        assert out.input_ids[b, 0] == root[b] and np.all(out.input_ids[b, n + 1:] == root[b])
        np.testing.assert_array_equal(out.input_ids[b, 1:n + 1], tree.token[b, 1:n + 1])
        np.testing.assert_array_equal(pd[:n + 1], tree.depth[b, :n + 1])
        assert np.all(pd[n + 1:] == 0)
        for i in range(n + 1):   # anc: the path root -> i, then -1
            d = int(tree.depth[b, i])
            assert out.anc[b, i, d] == i and out.anc[b, i, 0] == 0
            assert np.all(out.anc[b, i, d + 1:] == -1)
            for dd in range(1, d + 1):
                assert tree.parent[b, out.anc[b, i, dd]] == out.anc[b, i, dd - 1]


# ----------------------------------------------------------------------------- acceptance

def check_accepted_walk(tree, target, acc_idx, acc_len, next_token) -> None:
    bs = tree.token.shape[0]
    for b in range(bs):
        m = int(acc_len[b])
        acc = acc_idx[b, :m].tolist()
        assert acc[0] == 0 and np.all(acc_idx[b, m:] == -1)
        for prev, cur in zip(acc, acc[1:]):   # a root-to-node chain whose tokens are the targets
            assert tree.parent[b, cur] == prev and tree.token[b, cur] == target[b, prev]
        assert next_token[b] == target[b, acc[-1]]
        n = int(tree.n_nodes[b])            # ... that stops at the first mismatch
        assert not any(tree.parent[b, c] == acc[-1] and tree.token[b, c] == next_token[b]
                       for c in range(1, n + 1))


@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 4), n_rows=st.integers(1, 6),
       vocab=st.integers(1, 5), budget=st.integers(1, 40), p_follow=st.floats(0, 1))
def test_accept_greedy_walks_matching_children_until_the_first_mismatch(
        seed, bs, n_rows, vocab, budget, p_follow):
    tree = tree_for(seed, bs, n_rows, vocab, budget, "ties")
    target = targets_following(tree, seed, p_follow)
    acc_idx, acc_len, nxt, packed = ref.accept_greedy(tree, target, pack=True)
    assert acc_idx.shape == (bs, n_rows + 1) and acc_idx.dtype == np.int32
    check_accepted_walk(tree, target, acc_idx, acc_len, nxt)
    # packed: acc_len, then what the round commits, which is the target's choice after the
    # root and after each accepted node, then -1; then the accepted nodes' slots, then -1
    assert packed.shape == (bs, 2 * (n_rows + 1)) and packed.dtype == np.int32
    for b in range(bs):
        m = int(acc_len[b])
        want = [m] + [int(target[b, acc_idx[b, s]]) for s in range(m)] + [-1] * (n_rows + 1 - m)
        slots = acc_idx[b, 1:m].tolist()
        assert packed[b].tolist() == want + slots + [-1] * (n_rows + 1 - m)
        assert ref.accepted_slots(packed, b).tolist() == slots


def test_accept_greedy_follows_a_full_path():
    tree = tree_for(1, 1, 4, 3, 12)
    deepest = int(np.argmax(tree.depth[0]))
    target = np.full((1, 13), 99, np.int32)
    node = deepest
    while node > 0:
        target[0, tree.parent[0, node]] = tree.token[0, node]
        node = int(tree.parent[0, node])
    acc_idx, acc_len, nxt = ref.accept_greedy(tree, target)
    assert acc_len[0] == tree.depth[0, deepest] + 1 and acc_idx[0, acc_len[0] - 1] == deepest
    assert nxt[0] == 99


def test_inverse_cdf_sample_boundaries():
    row = np.float32([0.0, 0.0, np.log(2.0)])   # weights 1, 1, 2 (T = 1): cdf 1, 2, 4
    assert [ref.inverse_cdf_sample(row, 1.0, u) for u in (0.0, 0.2499, 0.25, 0.4999, 0.5, 0.99)] \
        == [0, 0, 1, 1, 2, 2]
    assert ref.inverse_cdf_sample(np.float32([0, -1e4, 0]), 1.0, 0.5 - 1e-12) == 0
    assert ref.inverse_cdf_sample(np.float32([0, -1e4, 0]), 1.0, 0.5) == 2   # zero weight skipped


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_accept_commits_tokens_distributed_as_the_target():
    """The first committed token (accepted child or bonus) of N requests is softmax(z/T)."""
    n_req, temperature = 4000, 0.7
    z = np.float32([1.0, 0.5, 0.0, -0.5, 2.0])
    one = tree_for(3, 1, 2, 5, 3)                       # the root has children, some tokens
    tree = ref.DraftTree(*(np.repeat(getattr(one, f), n_req, axis=0) for f in TREE_FIELDS),
                         max_depth=one.max_depth)
    logits = np.broadcast_to(z, (n_req, 4, 5)).copy()
    uniforms = np.random.default_rng(12345).random((n_req, 4))
    acc_idx, acc_len, nxt = ref.accept_sampled(tree, logits, temperature, uniforms)
    first = np.where(acc_len >= 2, tree.token[np.arange(n_req), np.maximum(acc_idx[:, 1], 0)], nxt)
    counts = np.bincount(first, minlength=5)
    p = np.exp(z / temperature) / np.exp(z / temperature).sum()
    critical = 18.467   # chi-square, 4 degrees of freedom, p = 0.001
    assert chi_square(counts, p) < critical
    p_wrong = np.exp(z) / np.exp(z).sum()             # T = 1 instead: the test has power
    assert chi_square(counts, p_wrong) > critical


@pytest.mark.parametrize("sampling", [ref.Sampling(0.7), ref.Sampling(1.0, top_p=0.9),
                                      ref.Sampling(1.3, top_k=3)])
def test_sampled_accept_draws_only_the_visited_slots(monkeypatch, sampling):
    """accept_sampled draws a slot's target token only when the walk reaches it, with the
    outputs of the composition it is defined as: accept_greedy on every slot's sample."""
    from reference.ddtree import accept as accept_module
    bs, vocab, budget = 6, 6, 12
    tree = tree_for(7, bs, 4, vocab, budget)
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((bs, budget + 1, vocab)).astype(np.float32)
    # most of each node's mass on its first child's token, so walks go deep and also stop
    for b in range(bs):
        for c in range(1, int(tree.n_nodes[b]) + 1):
            logits[b, tree.parent[b, c], tree.token[b, c]] += 2.5 * (tree.rank[b, c] == 0)
    u = rng.random((bs, budget + 1))
    want = ref.accept_greedy(tree, ref.sample_targets(tree, logits, sampling, u))
    drawn = []
    real = accept_module.inverse_cdf_sample

    def counting(row, s, uniform):
        drawn.append(float(uniform))
        return real(row, s, uniform)
    monkeypatch.setattr(accept_module, "inverse_cdf_sample", counting)
    got = ref.accept_sampled(tree, logits, sampling, u)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)
    acc_idx, acc_len = got[0], got[1]
    assert acc_len.max() >= 3                             # some walks go deep
    visited = [float(u[b, slot]) for b in range(bs) for slot in acc_idx[b, :acc_len[b]]]
    assert drawn == visited          # one draw per visited slot (the root, accepted nodes)
    assert len(drawn) < int(tree.n_nodes.sum()) + bs     # fewer than sample_targets' draws


@pytest.mark.parametrize("temperature, error", [(0.0, ValueError), (-1.0, ValueError),
                                                (float("nan"), ValueError), ("1", TypeError)])
def test_sample_targets_rejects_bad_temperature(temperature, error):
    tree = tree_for(0, 1, 2, 3, 3)
    with pytest.raises(error):
        ref.sample_targets(tree, np.zeros((1, 4, 3), np.float32), temperature, np.zeros((1, 4)))


# ----------------------------------------------------------------------------- KV compaction

def compact_oracle(cache: np.ndarray, past_len, acc_idx, acc_len) -> np.ndarray:
    """Row by row through a dict snapshot: what the rows were before any move."""
    out = cache.copy()
    for b in range(cache.shape[-3]):
        before = {r: cache[..., b, r, :].copy() for r in range(cache.shape[-2])}
        for k in range(int(acc_len[b])):
            out[..., b, past_len[b] + k, :] = before[past_len[b] + acc_idx[b, k]]
    return out


@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 4), n_acc=st.integers(1, 6),
       width=st.integers(1, 9), dtype=st.sampled_from([np.float32, np.uint16, np.float16]),
       stacked=st.booleans())
def test_compact_kv_equals_gather_scatter_oracle(seed, bs, n_acc, width, dtype, stacked):
    rng = np.random.default_rng(seed)
    acc_idx, acc_len = random_accepts(seed, bs, n_acc, 4)
    past_len = rng.integers(0, 5, size=bs).astype(np.int32)
    max_len = int((past_len + acc_idx.max(axis=1)).max()) + 1 + int(rng.integers(0, 3))
    shape = ((2,) if stacked else ()) + (bs, max_len, width)
    cache = rng.integers(0, 2 ** 15, size=shape).astype(dtype)
    want = compact_oracle(cache, past_len, acc_idx, acc_len)
    ref.compact_kv([cache], past_len, acc_idx, acc_len)
    assert cache.tobytes() == want.tobytes()


def test_compact_kv_overlap_and_identity():
    cache = np.arange(2 * 8 * 1, dtype=np.float32).reshape(2, 8, 1)
    acc_idx = np.int32([[0, 2, 3], [0, 1, 2]])            # rows 2,3 are sources and targets
    ref.compact_kv([cache], np.int32([1, 0]), acc_idx, np.int32([3, 3]))
    assert cache[0, :, 0].tolist() == [0, 1, 3, 4, 4, 5, 6, 7]
    assert cache[1, :, 0].tolist() == list(range(8, 16))   # identity: untouched


def test_compact_kv_rejects_past_capacity_and_bad_paths():
    cache = np.zeros((1, 5, 2), np.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        ref.compact_kv([cache], np.int32([2]), np.int32([[0, 3]]), np.int32([2]))
    with pytest.raises(ValueError, match="outside the cache"):     # an identity path too
        ref.compact_kv([cache], np.int32([4]), np.int32([[0, 1]]), np.int32([2]))
    with pytest.raises(ValueError, match="not an accepted path"):
        ref.compact_kv([cache], np.int32([0]), np.int32([[0, 0]]), np.int32([2]))
    with pytest.raises(ValueError, match="batch"):
        ref.compact_kv([np.zeros((2, 5, 2))], np.int32([0]), np.int32([[0, 1]]), np.int32([1]))


# ----------------------------------------------------------------------------- numba twin
# These also run on a real GPU (tools/gpu_suite.sh runs every test there), where blocks have at
# least one full warp: ``few`` lifts the simulator's tiny thread counts to that minimum.

def few(gpu, threads):
    return None if threads is None else max(threads, gpu.MIN_THREADS)


@SIM_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), vocab=st.integers(1, 40), k_frac=st.floats(0, 1),
       mode=st.sampled_from(["normal", "ties", "flat"]),
       config=st.sampled_from([(None, None, None), (1, 1, 2), (2, 2, 1), (1, 4, 4), (2, 1, 2)]))
def test_numba_topk_matches_reference(gpu, seed, vocab, k_frac, mode, config):
    """ids exact; lp within LP_ATOL + LP_RTOL*|lp| (the twins sum exps in different orders
    and precisions).  Configs (warps, vec, parts): one or more warps per block, 16-byte or
    scalar loads (vocab % 4), one or several blocks per row (merge kernel, empty parts)."""
    logits = make_logits(seed, (1, 2, vocab), mode)
    k = max(1, round(k_frac * vocab))
    warps, vec, parts = config
    lp, ids = ref.topk_logprobs(logits, k)
    glp, gids = gpu.topk_logprobs(logits, k, warps=warps, vec=vec, parts=parts)
    np.testing.assert_array_equal(gids, ids)
    assert np.all(np.abs(glp - lp) <= ref.LP_ATOL + ref.LP_RTOL * np.abs(lp))


@pytest.mark.parametrize("vocab, k, mode, config", [
    (300, 3, "normal", (2, 1, 1)),     # many tiles: seeded threshold, staged merges, raises
    (301, 9, "ties", (2, 1, 2)),       # ties on the threshold, scalar loads, two parts
    (256, 40, "normal", (1, 1, 1)),    # k > the seed's group maxima: no seed
    (200, 16, "flat", (2, 2, 1)),      # every element ties: ids decide everything
    (160, 20, "ascending", (2, 1, 1)),  # every element beats the running k-th: merge storms
])
def test_numba_topk_streams_many_tiles(gpu, vocab, k, mode, config):
    """Rows of many block tiles (a simulated tile is 2 warps x 4 lanes x 4 elements), so the
    seeded threshold, the per-warp staging and merges and the shared threshold all act."""
    if mode == "ascending":
        logits = np.linspace(-3, 3, vocab, dtype=np.float32)[None, None]
    else:
        logits = make_logits(vocab + k, (1, 1, vocab), mode)
    warps, vec, parts = config
    lp, ids = ref.topk_logprobs(logits, k)
    glp, gids = gpu.topk_logprobs(logits, k, warps=warps, vec=vec, parts=parts)
    np.testing.assert_array_equal(gids, ids)
    assert np.all(np.abs(glp - lp) <= ref.LP_ATOL + ref.LP_RTOL * np.abs(lp))


def test_numba_topk_config_rules(gpu):
    assert gpu.topk_config(64, 960, 163840)[3] == 1        # big batch: a row per block
    warps, vec, kl, parts = gpu.topk_config(3, 1, 1 << 20)
    assert kl == max(gpu.WARP, 4) and parts > 1            # one row: split across blocks
    with pytest.raises(ValueError, match="config"):
        gpu.topk_config(64, warps=3)
    with pytest.raises(ValueError, match="config"):
        gpu.topk_config(gpu.MAX_GPU_TOPK, parts=64)


@SIM_CHEAP_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 2), n_rows=st.integers(1, 4),
       vocab=st.integers(1, 5), budget=st.integers(1, 14), threads=st.sampled_from([1, 2, 4]),
       mode=st.sampled_from(["normal", "ties", "flat"]))
def test_numba_build_tree_is_bit_identical(gpu, seed, bs, n_rows, vocab, budget, threads, mode):
    lp, ids = ref.topk_logprobs(make_logits(seed, (bs, n_rows, vocab), mode), min(budget, vocab))
    assert_trees_identical(gpu.build_tree(lp, ids, budget, threads=few(gpu, threads)),
                           ref.build_tree(lp, ids, budget))


def test_numba_build_tree_ties_on_dyadic_scores(gpu):
    lp, ids = dyadic_lp(7, 2, 3, 3)
    assert_trees_identical(gpu.build_tree(lp, ids, 12, threads=few(gpu, 4)),
                           ref.build_tree(lp, ids, 12))
    # A flat first row: all 40 siblings pop before any child (ranks up to 39).
    lp = np.stack([np.zeros(40), np.full(40, -5.0)]).astype(np.float32)[None]
    ids = np.argsort(np.random.default_rng(8).random((1, 2, 40)), axis=-1).astype(np.int32)
    want = ref.build_tree(lp, ids, 45)
    assert want.rank.max() == 39
    assert_trees_identical(gpu.build_tree(lp, ids, 45, threads=few(gpu, 8)), want)


def test_numba_build_tree_refuses_large_budget(gpu):
    lp, ids = dyadic_lp(0, 1, 1, 2)
    with pytest.raises(ValueError, match="budget"):
        gpu.build_tree(lp, ids, gpu.MAX_GPU_BUDGET + 1)


def test_numba_build_tree_many_slots_per_lane_with_ties(gpu):
    """Budget 60 on dyadic (tie-heavy) scores.  In the simulator's 4-lane warp a lane owns up
    to 16 frontier slots, so each lane reads 4 of the stale lane's slots per pop (a loop the
    GPU's 32 lanes never need below budget 1025), and equal scores reach the rank-path walk at
    every comparison site: that loop, both butterflies, the pick and the new slot's compare
    (counted by wrapping _path_before: 38 / 320 / 468 / 304 / 7 walks)."""
    lp, ids = dyadic_lp(11, 2, 4, 6)
    assert_trees_identical(gpu.build_tree(lp, ids, 60, threads=few(gpu, 4)),
                           ref.build_tree(lp, ids, 60))


@pytest.mark.parametrize("threads", [2, 4])
def test_numba_build_tree_fills_a_lane_to_the_frontier_bound(gpu, threads):
    """L = K = B = 64: no popped node lacks a child or a sibling, so every pop but the last
    deals one candidate round-robin to a lane, and lane 0 ends with 1 + 63 // lanes slots:
    the builder's per-lane bound, (bcap - 1) // lanes + 1, exactly (the simulator's arrays are
    bounds-checked, so a bound one slot short fails here)."""
    lp, ids = ref.topk_logprobs(make_logits(3, (1, 64, 64), "normal"), 64)
    want = ref.build_tree(lp, ids, 64)
    assert want.n_nodes[0] == 64 and want.rank.max() < 63 and want.depth.max() < 64
    assert_trees_identical(gpu.build_tree(lp, ids, 64, threads=few(gpu, threads)), want)


@pytest.mark.parametrize("n_rows, k, budget", [(64, 40, 45), (2049, 2, 6)])
def test_numba_build_tree_reads_lp_past_the_shared_cache(gpu, n_rows, k, budget):
    """The builder caches lp row d at d << shift, at most 2048 values: with L = 64 only 32
    columns fit (a flat first row pops 40 siblings, ranks past the cache), and with
    L = 2049 nothing fits (every lp value comes from global memory)."""
    lp = np.full((1, n_rows, k), -5.0, np.float32)
    lp[0, 0] = 0.0
    lp[0, :, 1:] -= np.arange(1, k, dtype=np.float32) / 1024 * (np.arange(n_rows) > 0)[:, None]
    ids = np.argsort(np.random.default_rng(n_rows).random((1, n_rows, k)), axis=-1)
    ids = ids.astype(np.int32)
    want = ref.build_tree(lp, ids, budget)
    assert want.rank.max() == min(k, budget) - 1
    assert_trees_identical(gpu.build_tree(lp, ids, budget, threads=few(gpu, 8)), want)


@SIM_CHEAP_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 2), n_rows=st.integers(1, 4),
       vocab=st.integers(1, 4), budget=st.integers(1, 10))
def test_numba_compile_tree_is_bit_identical(gpu, seed, bs, n_rows, vocab, budget):
    tree = tree_for(seed, bs, n_rows, vocab, budget, "ties")
    root = np.arange(bs, dtype=np.int32) + 5
    start = np.arange(bs, dtype=np.int64) * 3
    want, got = ref.compile_tree(tree, root, start), gpu.compile_tree(tree, root, start)
    for name in ("input_ids", "positions", "anc", "visible"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert getattr(got, name).dtype == getattr(want, name).dtype


@SIM_CHEAP_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 3), n_rows=st.integers(1, 5),
       vocab=st.integers(1, 4), budget=st.integers(1, 16), p_follow=st.floats(0, 1))
def test_numba_accept_greedy_is_bit_identical(gpu, seed, bs, n_rows, vocab, budget, p_follow):
    tree = tree_for(seed, bs, n_rows, vocab, budget, "ties")
    target = targets_following(tree, seed, p_follow)
    pack = bool(seed % 2)
    want, got = ref.accept_greedy(tree, target, pack), gpu.accept_greedy(tree, target, pack)
    assert len(got) == len(want) == 3 + pack
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def uniforms_off_boundaries(tree, logits, temperature, seed, gap=1e-9):
    """Uniforms at least ``gap`` (relative to the total) from every reference CDF boundary:
    there the twins' different float64 summation orders cannot change the token."""
    rng = np.random.default_rng(seed)
    u = rng.random(logits.shape[:2])
    for b, i in itertools.product(*map(range, logits.shape[:2])):
        x = logits[b, i].astype(np.float64)
        cdf = np.cumsum(np.exp((x - x.max()) / temperature))
        bounds = cdf / cdf[-1]
        while np.min(np.abs(bounds - u[b, i])) < gap:
            u[b, i] = rng.random()
    return u


@SIM_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 2), vocab=st.integers(1, 20),
       budget=st.integers(1, 5), temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_numba_sampled_accept_matches_reference(gpu, seed, bs, vocab, budget, temperature):
    tree = tree_for(seed, bs, 3, 3, budget, "normal")
    logits = make_logits(seed + 1, (bs, budget + 1, vocab), "ties")
    for b in range(bs):   # make the target agree with the tree often
        for i in range(1, int(tree.n_nodes[b]) + 1):
            logits[b, tree.parent[b, i], tree.token[b, i] % vocab] += 2
    u = uniforms_off_boundaries(tree, logits, temperature, seed)
    np.testing.assert_array_equal(gpu.sample_targets(tree, logits, temperature, u),
                                  ref.sample_targets(tree, logits, temperature, u))
    for want, got in zip(ref.accept_sampled(tree, logits, temperature, u, pack=True),
                         gpu.accept_sampled(tree, logits, temperature, u, pack=True)):
        np.testing.assert_array_equal(got, want)


@SIM_CHEAP_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 3), n_acc=st.integers(1, 5),
       width=st.integers(1, 7), dtype=st.sampled_from([np.float32, np.uint16, np.float16,
                                                        np.int8, np.float64]),
       stacked=st.booleans())
def test_numba_compact_kv_is_bit_identical(gpu, seed, bs, n_acc, width, dtype, stacked):
    rng = np.random.default_rng(seed)
    acc_idx, acc_len = random_accepts(seed, bs, n_acc, 4)
    past_len = rng.integers(0, 4, size=bs).astype(np.int32)
    max_len = int((past_len + acc_idx.max(axis=1)).max()) + 2
    shape = ((2,) if stacked else ()) + (bs, max_len, width)
    cache = rng.integers(0, 100, size=shape).astype(dtype)
    want, got = cache.copy(), cache.copy()
    ref.compact_kv([want], past_len, acc_idx, acc_len)
    gpu.compact_kv([got], past_len, acc_idx, acc_len)
    assert got.tobytes() == want.tobytes()


def test_numba_compact_kv_keeps_device_caches_on_device(gpu):
    from numba import cuda
    cache = np.arange(2 * 6 * 4, dtype=np.float32).reshape(2, 6, 4)
    want = cache.copy()
    args = (np.int32([1, 0]), np.int32([[0, 2, 3], [0, 1, 2]]), np.int32([3, 2]))
    ref.compact_kv([want], *args)
    d_cache = cuda.to_device(cache)
    gpu.compact_kv([d_cache], *(cuda.to_device(a) for a in args))
    np.testing.assert_array_equal(d_cache.copy_to_host(), want)


def test_numba_fills_preallocated_outputs(gpu):
    """``out=`` (what a captured CUDA graph needs): results land in the caller's arrays."""
    from numba import cuda
    lp, ids = dyadic_lp(3, 2, 3, 3)
    want = ref.build_tree(lp, ids, 7)
    out = ref.DraftTree(*(cuda.device_array_like(getattr(want, f)) for f in TREE_FIELDS),
                        max_depth=3)
    gpu.build_tree(cuda.to_device(lp), cuda.to_device(ids), 7, out=out, threads=few(gpu, 2))
    assert_trees_identical(ref.DraftTree(*(getattr(out, f).copy_to_host() for f in TREE_FIELDS),
                                         max_depth=3), want)
    target = targets_following(want, 0, 0.9)
    acc = tuple(cuda.device_array_like(a) for a in ref.accept_greedy(want, target))
    gpu.accept_greedy(out, cuda.to_device(target), out=acc)
    for got, w in zip(acc, ref.accept_greedy(want, target)):
        np.testing.assert_array_equal(got.copy_to_host(), w)
    acc = tuple(cuda.device_array_like(a) for a in ref.accept_greedy(want, target, pack=True))
    gpu.accept_greedy(out, cuda.to_device(target), pack=True, out=acc)
    for got, w in zip(acc, ref.accept_greedy(want, target, pack=True)):
        np.testing.assert_array_equal(got.copy_to_host(), w)
    with pytest.raises(ValueError, match="out acc_len"):
        gpu.accept_greedy(out, target, out=(acc[0], acc[0], acc[2]))


def test_numba_validates_like_the_reference(gpu):
    with pytest.raises(TypeError):
        gpu.topk_logprobs(np.zeros((1, 2, 5), np.float64), 2)
    with pytest.raises(ValueError):
        gpu.build_tree(np.zeros((1, 2, 3), np.float32), np.zeros((1, 2, 2), np.int32), 4)
    with pytest.raises(ValueError, match="outside the cache"):
        gpu.compact_kv([np.zeros((1, 5, 2), np.float32)], np.int32([2]), np.int32([[0, 3]]),
                       np.int32([2]))
    with pytest.raises(ValueError, match="finite"):   # NumPy input: values are checked too
        gpu.topk_logprobs(np.full((1, 1, 3), np.nan, np.float32), 2)
    with pytest.raises(ValueError, match="non-increasing"):
        gpu.build_tree(np.float32([[[-1, 0]]]), np.int32([[[0, 1]]]), 2)
    tree = tree_for(0, 1, 2, 3, 3)
    with pytest.raises(ValueError, match="uniforms"):
        gpu.sample_targets(tree, np.zeros((1, 4, 3), np.float32), 1.0, np.ones((1, 4)))
    with pytest.raises(ValueError, match="out must hold"):
        gpu.topk_logprobs(np.zeros((1, 2, 5), np.float32), 2, out=())


# A real compile catches typing errors the simulator never sees.  It runs in a subprocess
# without NUMBA_ENABLE_CUDASIM; device functions look up the current device's compute
# capability while compiling, so the script pins it to 9.0 (no GPU is needed for PTX).
PTX_SCRIPT = """
import sys, types
try:
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda, types as T
    cuda.cudadrv.nvvm.NVVM()
except Exception as error:
    print("nvvm unavailable:", error)
    sys.exit(77)
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
import numpy as np
from kdtree_numba.ddtree import accept, build, compact, compile, topk
f2, i1, i2 = T.float32[:, ::1], T.int32[::1], T.int32[:, ::1]
f3, i3 = T.float32[:, :, ::1], T.int32[:, :, ::1]
f1, d1 = T.float32[::1], T.float64[::1]
jobs = [
    (topk._topk_kernel(8, 4, 64), (f2, T.int64, T.int64, T.boolean, f2, i2, f1, d1)),
    (topk._topk_merge_kernel(2, 1024, 256), (f2, i2, f1, d1, T.int64, f2, i2)),
    (build._build_kernel(128, 1024), (f3, i3, T.int64, i1, i2, i2, i2, i2, T.float64[:, ::1])),
    (compile._tree_rows, (i1, i2, i2, i2, T.int64[::1], i1, i2, i2, i3)),
    (compile._tree_mask, (i1, i2, i3, T.boolean[:, :, ::1])),
    (accept._accept_kernel(15), (i1, i2, i2, i2, i2, i1, i1, i2)),
    (accept._sample_kernel(512), (i1, f3, T.float64, T.float64, T.int64, T.float64[:, ::1],
                                  i2)),
    (compact._compact_kernel(16, np.uint64), (T.uint64[:, :, :, ::1], i1, i2, i1)),
]
for kern, sig in jobs:
    cuda.compile_ptx(kern.py_func, sig, cc=(9, 0))
print("compiled", len(jobs))
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=600)
def test_every_kernel_compiles_to_ptx_for_hopper():
    from ptx_check import run_without_simulator
    assert "compiled 8" in run_without_simulator(PTX_SCRIPT, timeout=600)


# ----------------------------------------------------------------------------- vectors

def load_vectors_module():
    spec = importlib.util.spec_from_file_location("vectors_ddtree",
                                                  ROOT / "tools" / "vectors_ddtree.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_tree(group) -> ref.DraftTree:
    return ref.DraftTree(*(group[f][...] for f in TREE_FIELDS),
                         max_depth=int(group.attrs["max_depth"]))


def vector_results(api, path: Path, case, max_work: int | None = None):
    """Run ``api`` (reference or twin) on one vector case -> {output name: array}, or None
    when the case is bigger than ``max_work`` (simulator budget)."""
    g = case
    kind = path.stem.split("_", 1)[1]
    if kind == "topk":
        logits = g["in/logits"][...]
        if max_work and logits.shape[0] * logits.shape[1] > max_work:
            return None
        lp, ids = api.topk_logprobs(logits, int(g.attrs["k"]))
        return {"out/lp": lp, "out/ids": ids}
    if kind == "build":
        lp = g["in/lp"][...]
        if max_work and lp.shape[0] * int(g.attrs["budget"]) > max_work:
            return None
        tree = api.build_tree(lp, g["in/ids"][...], int(g.attrs["budget"]))
        return {f"out/{f}": np.asarray(getattr(tree, f)) for f in TREE_FIELDS}
    tree = read_tree(g["in/tree"]) if "in/tree" in g else None
    if tree is not None and max_work and tree.token.size > max_work:
        return None
    if kind == "verify":
        out = api.compile_tree(tree, g["in/root_token"][...], g["in/start"][...])
        return {f"out/{n}": getattr(out, n) for n in ("input_ids", "positions", "anc", "visible")}
    if kind == "accept":
        if g.attrs["mode"] == "greedy":
            res = api.accept_greedy(tree, g["in/target_tokens"][...])
            tokens = {}
        else:
            args = (tree, g["in/target_logits"][...], float(g.attrs["temperature"]),
                    g["in/uniforms"][...])
            tokens = {"out/target_tokens": api.sample_targets(*args)}
            res = api.accept_sampled(*args)
        return dict(zip(("out/acc_idx", "out/acc_len", "out/next_token"), res), **tokens)
    caches = [g[f"in/caches/{i}"][...].copy() for i in range(int(g.attrs["n_caches"]))]
    api.compact_kv(caches, g["in/past_len"][...], g["in/acc_idx"][...], g["in/acc_len"][...])
    return {f"out/caches/{i}": c for i, c in enumerate(caches)}


def vector_files():
    return sorted(VECTORS.glob("ddtree_*.kdtr"))


def check_vectors(api, max_work=None, lp_tolerance=False) -> int:
    from formats import kdtr
    checked = 0
    for path in vector_files():
        with kdtr.File(path) as f:
            for name in f.keys():
                got = vector_results(api, path, f[name], max_work)
                if got is None:
                    continue
                for key, value in got.items():
                    want = f[name][key][...]
                    value = np.asarray(value)
                    assert value.dtype == want.dtype and value.shape == want.shape, key
                    if lp_tolerance and key == "out/lp":
                        assert np.all(np.abs(value - want) <= ref.LP_ATOL
                                      + ref.LP_RTOL * np.abs(want)), f"{path.name} {name}"
                    else:
                        assert value.tobytes() == want.tobytes(), f"{path.name} {name} {key}"
                checked += 1
    return checked


def test_committed_vectors_exist_and_are_small():
    files = vector_files()
    assert {p.stem for p in files} == {"ddtree_topk", "ddtree_build", "ddtree_verify",
                                       "ddtree_accept", "ddtree_compact"}
    assert sum(p.stat().st_size for p in files) < 300_000


def test_reference_reproduces_committed_vectors():
    assert check_vectors(ref) == 28   # every case of the five files


def test_vector_writer_reproduces_committed_files(tmp_path):
    from formats import kdtr
    for path in load_vectors_module().write(tmp_path):
        with kdtr.File(path) as new, kdtr.File(VECTORS / path.name) as old:
            names = []
            new.visititems(lambda n, o: names.append(n) if hasattr(o, "shape") else None)
            assert names and set(new.keys()) == set(old.keys())
            for n in names:
                assert new[n][...].tobytes() == old[n][...].tobytes(), f"{path.name} {n}"


def test_numba_reproduces_small_committed_vectors(gpu):
    assert check_vectors(gpu, max_work=40, lp_tolerance=True) >= 8

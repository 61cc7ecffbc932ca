"""Issue 36: ``--budget auto``'s paired acceptance (kdtree_numba/budget.py, "Paired tau").

The tree at budget b is the first b nodes of the tree at any budget B >= b (the builder pops
best-first; the top-K of k = min(b, V) and a drafter block cut to depth b change nothing a
b-node tree can hold), so one round at B tells, from the slots of its accepted nodes, what
every b <= B would have committed on the same text.  Checked here against the builder, then
against the engine actually running each smaller budget (the reference backend, T = 0 and
T > 0: every node's target token is the same sample in any tree that holds it), then the
KDTREE_AUTO_V2 policy on a simulated machine whose rounds give paired acceptance like real
ones, and the engine with it lossless."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.ddtree as ref
from kdtree_numba.budget import AutoBudget, PairedTau

TREE_FIELDS = ("token", "parent", "depth", "rank", "score")


# ----------------------------------------------------------------------------- nested trees

def tie_heavy_logits(seed: int, bs: int, n_rows: int, vocab: int) -> np.ndarray:
    """Logits from a few distinct values: many equal scores, so the builder's tie rule (the
    lexicographically smaller rank path) decides often."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 4, (bs, n_rows, vocab)) * 0.5).astype(np.float32)


def tree_at(logits, budget: int, depth_cut: bool):
    """The engine's tree at ``budget``: top-K of k = min(budget, V), the drafter's rows cut
    to the tree's reach (depth <= budget) where ``depth_cut`` (a drafter may return only
    those: drafting.DraftContext.depth)."""
    if depth_cut:
        logits = logits[:, :min(budget, logits.shape[1])]
    lp, ids = ref.topk_logprobs(logits, min(budget, logits.shape[2]))
    return ref.build_tree(lp, ids, budget)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), bs=st.integers(1, 3), n_rows=st.integers(1, 6),
       vocab=st.integers(1, 6), big=st.integers(1, 40), depth_cut=st.booleans(),
       data=st.data())
def test_the_tree_at_b_is_the_first_b_nodes_of_the_tree_at_any_larger_budget(
        seed, bs, n_rows, vocab, big, depth_cut, data):
    logits = tie_heavy_logits(seed, bs, n_rows, vocab)
    small = data.draw(st.integers(1, big))
    wide, narrow = tree_at(logits, big, depth_cut), tree_at(logits, small, depth_cut)
    for b in range(bs):
        n = int(narrow.n_nodes[b])
        assert n == min(small, int(wide.n_nodes[b]))
        for name in TREE_FIELDS:
            np.testing.assert_array_equal(getattr(narrow, name)[b, :n + 1],
                                          getattr(wide, name)[b, :n + 1], err_msg=name)


def test_nested_trees_golden_case():
    """docs/DDTREE.md's third golden case, [[3,2,1,0]] x 3 at B = 8: the trees at 1..8 are
    its prefixes (parents [-1,0,1,2,0,1,4,2,5])."""
    logits = np.array([[[3, 2, 1, 0]] * 3], np.float32)
    want = [-1, 0, 1, 2, 0, 1, 4, 2, 5]
    for b in range(1, 9):
        assert tree_at(logits, b, True).parent[0].tolist() == want[:b + 1]


# ----------------------------------------------------------------------------- the oracle

class Pinned(AutoBudget):
    """A policy that runs one budget and records each round's accepted slots."""

    def __init__(self, budget: int, candidates):
        super().__init__(candidates=candidates, start=budget, v2=True)
        self.budget, self.rounds = budget, []

    def next_budget(self) -> int:
        return self.budget

    def observe(self, budget, seconds, tau, steady=None, paths=None):
        self.rounds.append([np.asarray(p).tolist() for p in paths])
        super().observe(budget, seconds, tau, steady, paths)


@pytest.fixture(scope="module")
def oracle_pair():
    from kdtree_numba.bundle import random_weights, size_config
    from kdtree_numba.drafter import NoisyOracleDrafter
    from kdtree_numba.model import Model
    cfg = size_config("tiny", num_hidden_layers=1)
    target = Model(cfg, dict(random_weights(cfg, 3)), "reference")   # its own oracle
    return target, NoisyOracleDrafter(target, 6, agreement=0.8, seed=1, sharpness=3.0)


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_one_round_at_B_gives_every_smaller_budgets_acceptance(oracle_pair, temperature):
    """Each request's first round from 12 states (prompts and AR continuations of them): run
    at B = 24, its accepted slots give each candidate's acceptance (accepted slots <= b, plus
    the bonus); the engine running each candidate for that round (an independent run)
    commits exactly that many.  At T > 0 too: a node's target token is drawn with the
    uniform of its position (engine module docstring), the same in every tree holding it."""
    from kdtree_numba.engine import generate
    target, drafter = oracle_pair
    seeds = [[5, 6, 7], [9, 8, 7, 6], [1, 2], [40, 41, 42, 43, 44], [77], [3, 3, 3]]
    ar = generate(target, seeds, 12, temperature=temperature, seed=3).tokens
    prompts = seeds + [s + a[:6] for s, a in zip(seeds, ar)]
    cands, big = (1, 2, 3, 5, 8, 13), 24
    pinned = Pinned(big, cands + (big,))
    kw = dict(method="ddtree", drafter=drafter, temperature=temperature, seed=3)
    res = generate(target, prompts, 2, budget=pinned, **kw)
    assert res.stats.rounds == 1
    paths = pinned.rounds[0]
    want = {b: [1 + sum(s <= b for s in p) for p in paths] for b in cands}
    for b in cands:
        assert generate(target, prompts, 2, budget=b, **kw).stats.tau[0] == want[b], b
    # the policy's counterfactual is their mean; the check can fail: budgets differ
    np.testing.assert_allclose(pinned.counterfactual(len(cands) - 1, paths),
                               [np.mean(want[b]) for b in cands])
    assert len({tuple(w) for w in want.values()}) >= 4 and max(want[13]) >= 4


# ----------------------------------------------------------------------------- the policy

# a round's fixed part, then growth (run 150's H100 costs for the demo pair, ms)
DEMO_COST = {2: 0.62, 4: 0.63, 8: 0.66, 16: 0.74, 32: 0.86, 64: 1.15, 128: 1.8, 256: 3.2}


def accepted_path(rng, f: float, L: int = 15) -> list[int]:
    """A round's accepted slots on text of difficulty ``f`` (larger: easier, deeper paths
    whose nodes the best-first builder reaches later): the path goes one deeper with
    probability 0.88 ** (1 / f), each next node some siblings later, more the deeper.
    Acceptance then grows concavely with the budget (about 2.5, 3.4, 4.4, 5.3, 5.9, 6.4 at
    2 .. 64 for f = 1) and varies ~55% round to round, as the demo pair's does."""
    slot, out = 0, []
    for d in range(L):
        if rng.random() > 0.88 ** (1 / f):
            break
        slot += 1 + int(rng.exponential(0.35 * 1.5 ** d * f))
        out.append(slot)
    return out


def expected_tau(candidates, n: int = 20000, seed: int = 99) -> dict:
    """Each budget's mean acceptance over the row's difficulty mix (Monte Carlo)."""
    rng = np.random.default_rng(seed)
    slots = [accepted_path(rng, rng.lognormal(0.0, 0.25)) for _ in range(n)]
    return {b: 1 + np.mean([sum(s <= b for s in p) for p in slots]) for b in candidates}


def run(policy, cost_ms, seed: int, prompts: int = 128, rounds: int = 30, paired=True,
        path=accepted_path, steady: bool | None = True):
    """Prompts of ``rounds`` rounds through ``policy``: a budget, an AutoBudget kept across
    them (as tools/bench_demo.py's auto row keeps it), or a callable making a fresh one per
    prompt (as generate(budget="auto") and tools/bench_engine.py's auto row do).  Per prompt
    a difficulty, per round an accepted path (``path(rng, difficulty)``; its slots: the
    policy's paired acceptance, unless ``paired`` is False), a cost +-5% with 1% of rounds 3x
    slower; ``steady``: what the policy is told of each round (True: replayed graphs; None:
    unknown, the host rounds).  Returns (tokens per second, rounds per budget)."""
    rng = np.random.default_rng(seed)
    tokens = seconds = 0.0
    mix: collections.Counter = collections.Counter()
    for _ in range(prompts):
        f = rng.lognormal(0.0, 0.25)
        auto = policy() if callable(policy) else policy
        for _ in range(rounds):
            slots_all = path(rng, f)
            b = auto if isinstance(auto, int) else auto.next_budget()
            slots = [s for s in slots_all if s <= b]
            cost = cost_ms[b] * 1e-3 * (1 + 0.05 * rng.standard_normal())
            if rng.random() < 0.01:
                cost *= 3
            if not isinstance(auto, int):
                auto.observe(b, cost, 1 + len(slots), steady=steady,
                             paths=[slots] if paired else None)
            tokens += 1 + len(slots)
            seconds += cost
            mix[b] += 1
    return tokens / seconds, mix


def cost_model(kind: str) -> dict:
    if kind == "demo":
        return DEMO_COST
    per_node = {"cpu": 1 / 16, "moe": 1 / 2}[kind]   # a fixed part, then each node's share
    return {b: 1.0 + per_node * b for b in DEMO_COST}


@pytest.mark.parametrize("kind, best", [("cpu", 8), ("moe", 2)])
def test_v2_converges_to_the_best_budget(kind, best):
    """A cost curve with one clear best (>= 7% ahead of the rest, known from the expected
    acceptance): within 200 rounds of noisy acceptance the policy's best and the budget it
    runs are that one, and it spends >= 75% of the next 200 rounds there (its probes take
    1 in 8 by design; a noisy cost of a neighbour may win it some rounds).  "moe" (every node
    dear) makes budget 2 the best: nothing rules the small budgets out beforehand."""
    cost = cost_model(kind)
    tau = expected_tau(DEMO_COST)
    rates = {b: tau[b] / cost[b] for b in DEMO_COST}
    assert max(rates, key=rates.get) == best
    assert all(r <= rates[best] / 1.07 for b, r in rates.items() if b != best)
    for seed in range(3):
        p = AutoBudget(v2=True)
        rng = np.random.default_rng(seed)
        for r in range(400):
            b = p.next_budget()
            if r == 200:
                assert p.best() == best and p.home == best, (seed, p.summary())
            if r >= 200:
                ran = ran + (b == best) if r > 200 else int(b == best)
            slots = [s for s in accepted_path(rng, 1.0) if s <= b]
            p.observe(b, cost[b] * (1 + 0.05 * rng.standard_normal()), 1 + len(slots),
                      steady=True, paths=[slots])
        assert ran >= 0.75 * 200, (seed, ran)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v2_is_within_10_percent_of_the_best_fixed_budget(seed):
    """The demo pair's machine (budget 16 best, 8 and 32 within 3-6%): 128 prompts of 30
    rounds through one policy get >= 90% of the best fixed budget's rate (the issue's goal;
    the paired policy gets ~98%), its rounds at 2 and 4 a handful at most (ruled out by the
    cost floor, or measured once and then by their paired acceptance)."""
    best_fixed = max(run(b, DEMO_COST, seed)[0] for b in (8, 16, 32))
    rate, mix = run(AutoBudget(v2=True), DEMO_COST, seed)
    assert rate >= 0.9 * best_fixed, (rate / best_fixed, dict(mix))
    assert mix[2] + mix[4] <= 0.01 * sum(mix.values()), dict(mix)
    assert sum(mix[b] for b in (8, 16, 32)) >= 0.9 * sum(mix.values()), dict(mix)


# Kimi-K2's widths, 384 int4 experts (tools/bench_engine.py --sizes kimi-k2-slice, H100,
# batch 1, 64 new tokens in 11 rounds): ms per round, (seconds - prefill) / rounds, at 8 / 16 /
# 32 / 64 on the tensor-core and the CUDA-core int4 kernels.  Every node can read another
# expert, so the cost climbs steeply; the replay drafter's tree is its chain of 8 first (the
# runner-ups never match), so tau is flat from 8 on (5.82 at every budget measured)
KIMI_COST = {"tensor-cores": {8: 4.42, 16: 5.11, 32: 5.87, 64: 7.94},
             "cuda-cores": {8: 9.63, 16: 14.77, 32: 22.0, 64: 47.3}}
KIMI_AGREEMENT = 0.886           # 1 + sum of its powers 1..8 = 5.82, the measured tau


def kimi_path(rng, f: float = 1.0) -> list[int]:
    """A round's accepted slots on the Kimi row: the chain's depth d sits at slot d, accepted
    while the replay drafter agrees (``f`` unused: the drafter agrees at one rate)."""
    out = []
    for d in range(1, 9):
        if rng.random() >= KIMI_AGREEMENT:
            break
        out.append(d)
    return out


@pytest.mark.parametrize("kernels", sorted(KIMI_COST))
@pytest.mark.parametrize("rounds, prompts", [(11, 24), (30, 10)])
@pytest.mark.parametrize("steady", [True, None])
def test_kimi_auto_settles_at_the_cheapest_budget(kernels, rounds, prompts, steady):
    """The first GPU runs of kimi-k2-slice: auto ran 60% (tensor cores) and 39% (CUDA cores)
    of budget 8's rate, starting at 32 and climbing to 64, whose acceptance bound (32's plus
    a doubling's gain of 0) only tied, and never running 8.  Each generation with a fresh
    policy among the row's budgets (as bench_engine's auto row), steady or unknown rounds
    (host rounds, which the Kimi row runs): >= 90% of the best fixed budget's rate; 32 and
    64 never run (their paired acceptance gains nothing on 8's, their cost is no less); 16
    at most one round per 16 (its probe: the paired gain, which stays 0)."""
    cost, cands = KIMI_COST[kernels], tuple(KIMI_COST[kernels])
    for seed in range(2):
        fixed = {b: run(b, cost, seed, prompts, rounds, path=kimi_path)[0] for b in cands}
        assert max(fixed, key=fixed.get) == 8
        rate, mix = run(lambda: AutoBudget(cands, v2=True), cost, seed, prompts, rounds,
                        path=kimi_path, steady=steady)
        assert rate >= 0.9 * fixed[8], (rate / fixed[8], dict(mix))
        assert mix[32] == mix[64] == 0, dict(mix)
        assert mix[16] <= prompts * -(-rounds // 16), dict(mix)


def test_v2_finishes_a_begun_cost_before_the_next_budget():
    """A budget's first rounds run eagerly or capture (steady False: no cost); the policy
    stays on it until MIN_COST replays give it one, rather than walking on to a wider budget
    whose acceptance the unsteady round made known (each new budget: two more slow rounds)."""
    p = AutoBudget(candidates=(16, 32, 64, 128), start=32, v2=True)
    told = []
    for r in range(12):
        b = p.next_budget()
        told.append(b)
        steady = told.count(b) > 2
        # every doubling gains a token (a node past slot 16, 32, 48), so 64 and then 128
        # could win (a wider tree that gains nothing is not worth a round: test_kimi_*)
        slots = [s for s in (1, 17, 33, 49) if s <= b]
        p.observe(b, 1e-3, 1 + len(slots), steady=steady, paths=[slots])
    # 32 (2 unsteady + 3 steady), then 64 the same; 128 only once 64 has a cost
    assert told[:10] == [32] * 5 + [64] * 5, told


def test_paired_tau_against_hand_sums():
    """PairedTau against hand sums: rounds at 16 measured 4 and 16; one at 4 measured 4
    only; a round that gave only its own tau (paths None) adds to its budget alone."""
    p = PairedTau((4, 16), horizon=1e12)        # no forgetting: plain means
    p.add(1, [2.0, 3.0])
    p.add(1, [4.0, 7.0])
    p.add(0, [10.0])
    # anchored at 16: both from the rounds at 16
    np.testing.assert_allclose(p.tau(1), [3.0, 5.0])
    # anchored at 4: 4 over every round (16/3), 16 scaled by the paired ratio 5/3
    np.testing.assert_allclose(p.tau(0), [16 / 3, 16 / 3 * 5 / 3])
    q = PairedTau((4, 16), horizon=1e12)
    q.add(1, 6.0)                               # unpaired: 4 falls back to its own mean
    q.add(0, 2.0)
    np.testing.assert_allclose(q.tau(1), [2.0, 6.0])


# ----------------------------------------------------------------------------- the engine

@pytest.mark.parametrize("device_rounds, temperature", [(True, 0.0), (False, 0.0),
                                                        (True, 0.8)])
def test_the_engine_under_auto_v2_is_lossless(device_rounds, temperature):
    """DDTree with the paired policy commits AR's tokens (host and device rounds, T = 0 and
    T > 0), and the policy was told every round's accepted slots."""
    from test_dflash import target_and_drafter
    from kdtree_numba.engine import generate
    # a pair of its own (not the cached one): its generation cache keeps a device program
    # per sampling, which tests of the shared pair count
    target, drafter = target_and_drafter.__wrapped__()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    want = generate(target, prompts, 20, temperature=temperature, seed=2).tokens
    policy = AutoBudget(candidates=(2, 4, 8, 16), v2=True, reprobe=4)
    be = target.backend
    reads = be.reads
    res = generate(target, prompts, 20, method="ddtree", drafter=drafter, budget=policy,
                   device_rounds=device_rounds, temperature=temperature, seed=2)
    assert res.tokens == want
    # the slots came in the rounds' own reads: the prefill's, then one a round
    assert be.reads - reads == 1 + res.stats.rounds + res.stats.rounds_dropped
    assert sum(e.rounds for e in policy.est.values()) == res.stats.rounds
    # every round at b measured every candidate <= b: the smallest, every round
    assert policy.paired.weights[:, 0].sum() > 0 and len(set(res.stats.budgets)) >= 2
    assert res.stats.budget_auto["paired_tau"]


def demo_counterfactual_check(backend, device_rounds: bool):
    """The demo pair's first round from 16 states (held-out prompts and AR continuations of
    them) run at 64 on ``backend`` (a name or a Backend): the counterfactual acceptance of
    4 .. 32 against running each.  Returns (mismatched requests, requests, budgets where the
    means differ by > 2%)."""
    from kdtree_numba import demo
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    from tests.test_demo_pair import heldout_ids
    model = Model.load(demo.TARGET, backend)
    drafter = DFlashDrafter.load(demo.DRAFTER, model)
    seeds = heldout_ids(8)
    ar = generate(model, seeds, 24).tokens
    prompts = seeds + [s + a[:20] for s, a in zip(seeds, ar)]
    cands, big = (4, 8, 16, 32), 64
    kw = dict(method="ddtree", drafter=drafter, device_rounds=device_rounds)
    pinned = Pinned(big, cands + (big,))
    assert generate(model, prompts, 2, budget=pinned, **kw).stats.rounds == 1
    paths = pinned.rounds[0]
    bad, off, means = 0, [], []
    for b in cands:
        want = [1 + sum(s <= b for s in p) for p in paths]
        got = generate(model, prompts, 2, budget=b, **kw).stats.tau[0]
        bad += sum(g != w for g, w in zip(got, want))
        if abs(np.mean(got) - np.mean(want)) > 0.02 * np.mean(got):
            off.append(b)
        means.append(np.mean(want))
    assert means[0] < means[-1]            # the budgets differ: the check can fail
    return bad, len(cands) * len(prompts), off


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_the_demo_pairs_counterfactual_on_the_reference_backend(precision):
    """The trained pair on the float64 reference (its drafter's full block at every
    budget): exact.  On the CPU path (float32) a budget under the drafter's block drafts
    with a block cut to it (dflash.py, ``trim_block``), whose logits differ slightly from the
    full block's: an estimate there, held to the GPU's tolerance (these 16 states: exact)."""
    from kdtree_numba.backends import make_backend
    bad, total, off = demo_counterfactual_check(make_backend("reference", precision=precision),
                                                False)
    assert (bad == 0 if precision == "float64" else bad <= 0.05 * total) and not off


@pytest.mark.gpu
@pytest.mark.parametrize("device_rounds", [True, False])
def test_gpu_the_demo_pairs_counterfactual(device_rounds):
    """On the GPU (device rounds: the accepted slots come through the round graph's one
    read).  A verify of another width may round a node's logits differently and flip a
    near-tie argmax, so a rare request may differ; the means agree within 2%."""
    bad, total, off = demo_counterfactual_check("numba", device_rounds)
    assert bad <= 0.05 * total and not off, (bad, total, off)

"""``--budget auto`` (kdtree_numba/budget.py): the policy finds the budget with the most tokens
per second on synthetic cost/acceptance curves, is not fooled by a compiling first round,
re-measures as the text drifts, and in the engine stays lossless."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kdtree_numba.budget import AutoBudget
from reference.ddtree import Sampling


def drive(policy, cost, tau, rounds, first_round_penalty=0.0, capture_penalty=0.0):
    """``rounds`` rounds of ``policy``; a budget's first round costs ``first_round_penalty``
    more (it compiles), its second ``capture_penalty`` more (its CUDA graph is captured)."""
    seen: dict = {}
    for _ in range(rounds):
        b = policy.next_budget()
        visit = seen.get(b, 0)
        seen[b] = visit + 1
        capture = capture_penalty(b) if callable(capture_penalty) else capture_penalty
        extra = first_round_penalty if visit == 0 else capture if visit == 1 else 0.0
        policy.observe(b, cost(b) + extra, tau(b))
    return policy


def best_of(candidates, cost, tau):
    return max(candidates, key=lambda b: tau(b) / cost(b))


@pytest.mark.parametrize("cost,tau", [
    # launch-bound GPU: the round costs the same whatever the width -> the widest tree
    (lambda b: 3e-3, lambda b: 1 + 4.6 * (1 - math.exp(-b / 20))),
    # CPU reference: cost grows with the nodes -> a small tree
    (lambda b: 8e-3 * (1 + b / 8), lambda b: 1 + 4.6 * (1 - math.exp(-b / 20))),
    # wide MoE: flat, then every node reads more experts -> a middle budget
    (lambda b: 9e-3 * max(1.0, b / 24), lambda b: 1 + 5 * (1 - math.exp(-b / 12))),
])
def test_it_settles_on_the_best_rate(cost, tau):
    p = drive(AutoBudget(), cost, tau, 60, first_round_penalty=2.0)
    want = best_of(p.candidates, cost, tau)
    assert p.best() == want
    # after the climb, the rounds are spent at the best budget but for the periodic re-probes
    tail = [p.next_budget() for _ in range(1)]
    assert tail[0] in (want, *p._neighbours(want))


def test_a_compiling_first_round_does_not_rule_a_budget_out():
    cost, tau = (lambda b: 3e-3), (lambda b: min(b, 64) / 10)
    p = drive(AutoBudget(candidates=(8, 16, 32, 64)), cost, tau, 30, first_round_penalty=5.0)
    assert p.best() == 64
    assert p.est[64].cost() == pytest.approx(3e-3)


def test_a_capturing_second_round_does_not_rule_a_budget_out():
    """A budget's second round captures its CUDA graph, longer for a wider tree's graph: had
    that round been the budget's whole cost when first compared (as it was), the narrower
    neighbour, measured past its capture first, would have kept the lead."""
    cost, tau = (lambda b: 3e-3), (lambda b: 3 + b / 32)
    p = drive(AutoBudget(candidates=(16, 32, 64)), cost, tau, 40, first_round_penalty=5.0,
              capture_penalty=lambda b: 0.02 * b)
    assert p.best() == 64
    assert p.est[64].cost() == pytest.approx(3e-3)


def test_it_follows_the_text_when_acceptance_changes():
    """The first policy (v2=False: its tau a running mean that forgets at ``decay``); the
    second's paired sums forget over HORIZON rounds (test_budget_paired)."""
    p = AutoBudget(candidates=(8, 16, 32, 64), reprobe=4, decay=0.5, v2=False)
    cost = lambda b: 1e-3 * (1 + b / 64)
    drive(p, cost, lambda b: 1 + 6 * (1 - math.exp(-b / 8)), 40)       # repetitive text
    wide = p.best()
    drive(p, cost, lambda b: 1.3, 60)                                  # nothing accepted now
    assert p.best() == 8 < wide


def test_candidates_respect_the_cap_and_bad_settings_are_refused():
    assert AutoBudget(max_budget=40).candidates == (2, 4, 8, 16, 32)
    assert AutoBudget(start=100).start == 128
    with pytest.raises(ValueError):
        AutoBudget(candidates=(512,), max_budget=256)
    with pytest.raises(ValueError):
        AutoBudget(decay=0)


def test_the_engine_with_an_automatic_budget_is_lossless_and_reports_it():
    from kdtree_numba import demo
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    from tests.test_demo_pair import heldout_ids
    model = Model.load(demo.TARGET, "reference")
    drafter = DFlashDrafter.load(demo.DRAFTER, model)
    prompts = heldout_ids(2)
    want = generate(model, prompts, 40).tokens
    res = generate(model, prompts, 40, method="ddtree", drafter=drafter, budget="auto")
    for got, ref in zip(res.tokens, want):
        np.testing.assert_array_equal(got, ref)
    st = res.stats
    assert st.budget == "auto" and len(st.budgets) == st.rounds
    assert set(st.budgets) <= set(AutoBudget().candidates)
    assert st.budget_auto["best"] in st.budgets
    assert sum(r["rounds"] for r in st.budget_auto["per_budget"].values()) == st.rounds
    with pytest.raises(ValueError, match="auto"):
        generate(model, prompts, 4, method="ddtree", drafter=drafter, budget="wide")


def test_auto_keeps_its_policy_across_generate_calls():
    """budget="auto" runs one policy per model, drafter, batch and sampling across calls
    (budget.kept_auto_budget): a second call goes on from what the first measured (its
    summary counts both calls' rounds); another batch, temperature or drafter object starts
    afresh, as does every call after forget_auto_budgets; an AutoBudget given is the
    caller's.  Tokens are AR's throughout."""
    from test_dflash import parts2, target_and_drafter
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.budget import forget_auto_budgets, kept_auto_budget
    from kdtree_numba.engine import generate
    target, drafter = target_and_drafter.__wrapped__()
    prompts = [[5, 6, 7]]
    want = generate(target, prompts, 12).tokens

    def seen(res):          # the rounds the policy that ran has seen, over every call
        return sum(r["rounds"] for r in res.stats.budget_auto["per_budget"].values())

    def auto(drafter_=drafter, batch=1, **kw):
        res = generate(target, prompts * batch, 12, method="ddtree", drafter=drafter_,
                       budget="auto", **kw)
        if not kw:
            assert res.tokens == want * batch
        return res
    first = auto()
    second = auto()
    assert seen(first) == first.stats.rounds
    assert seen(second) == first.stats.rounds + second.stats.rounds
    for fresh in (auto(batch=2), auto(temperature=0.8, seed=1),
                  auto(DFlashDrafter(target, *parts2(128, 0)[2:]))):
        assert seen(fresh) == fresh.stats.rounds
    kept = kept_auto_budget(target, drafter, 1, Sampling(), False, 1.0)
    third = auto()
    assert seen(third) == kept.round == sum(r.stats.rounds for r in (first, second, third))
    forget_auto_budgets(target)
    again = auto()
    assert seen(again) == again.stats.rounds
    mine = AutoBudget()
    res = generate(target, prompts, 12, method="ddtree", drafter=drafter, budget=mine)
    assert mine.round == res.stats.rounds
    assert kept_auto_budget(target, drafter, 1, Sampling(), False, 1.0) is not mine
    # a server's many samplings keep at most KEPT_AUTO_PER_MODEL policies, the oldest dropped
    from kdtree_numba.budget import KEPT_AUTO_PER_MODEL
    first_kept = kept_auto_budget(target, drafter, 1, Sampling(0.5), False, 1.0)
    for i in range(KEPT_AUTO_PER_MODEL):
        kept_auto_budget(target, drafter, 1, Sampling(1.0 + i), False, 1.0)
    assert kept_auto_budget(target, drafter, 1, Sampling(0.5), False, 1.0) is not first_kept

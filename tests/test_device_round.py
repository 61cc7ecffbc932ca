"""DDTree rounds as device programs enqueued one ahead of the host (kdtree_numba/device_round.py)
on the reference backend: the same tokens as AR and as the host-driven round, every round's
state on the device, the caches rolled back to the last read round, and the refusals; R
rounds a launch (``rounds_per_launch``) against one, there and (``gpu``) on the demo pair."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kdtree_numba.engine import generate
from kdtree_numba.drafter import ModelDrafter
from kdtree_numba.model import ForwardBatch, causal_mask
from test_dflash import _small_drafter_model, counted, parts2, target_and_drafter


@pytest.fixture(autouse=True)
def _hold_back_at_the_mean(monkeypatch):
    """The tests here compare device rounds' acceptances and rounds with the host rounds'
    (and R rounds a launch with one): waiting near the end at a margin of 1 (a request held
    back only where the rounds in flight look to finish it at their mean), which the tiny
    pair's ~1 token a round leaves no request to rejoin; the default margin of 2 holds more
    back, whose rounds then split otherwise (the same tokens: the held-back test below and
    the demo pair's GPU test).  A test that sets the variable overrides this."""
    monkeypatch.setenv("KDTREE_WAIT_NEAR_END", "1")


@pytest.mark.parametrize("method, budget", [("ddtree", 1), ("ddtree", 6), ("chain", 32)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_rounds_give_the_host_rounds_tokens(method, budget, temperature):
    """Ragged batch, one request stopping at eos: AR's tokens (T = 0; at T > 0 the same
    uniforms, so the host round's tokens), the same rounds and acceptances, one read per
    round, and afterwards the drafter's context and the target's cache agree, exact (a
    request that eos finished keeps the growth of the round that was in flight)."""
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    ar = generate(target, prompts, 10, temperature=temperature, seed=4)
    eos = ar.tokens[2][3]
    kw = dict(method=method, drafter=drafter, budget=budget, temperature=temperature, seed=4,
              eos=eos)
    want = generate(target, prompts, 10, eos=eos).tokens
    host = generate(target, prompts, 10, device_rounds=False, **kw)
    res, reads, syncs = counted(target.backend, lambda: generate(
        target, prompts, 10, device_rounds=True, **kw))
    assert res.tokens == host.tokens
    if temperature == 0:
        assert res.tokens == want
    assert reads == 1 + res.stats.rounds + res.stats.rounds_dropped and syncs == 1
    assert res.stats.time["round"] > 0 and res.stats.time["verify"] == 0
    assert res.stats.tau == host.stats.tau and res.stats.rounds == host.stats.rounds
    # the context and the target cache agree, and both are exact (not pending) after the end
    cache = target.generation_cache
    assert not cache.pending and not drafter.cache.pending
    assert drafter.context_lengths.tolist() == cache.lengths.tolist()
    np.testing.assert_array_equal(np.asarray(cache.device_lengths), cache.lengths)


def test_a_device_round_program_is_reused_by_the_next_generation():
    """The second generation on the same cache runs the same program object (its buffers are
    what a captured CUDA graph holds), restarted, with the first one's tokens."""
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [2, 3]]
    first = generate(target, prompts, 12, method="ddtree", drafter=drafter, budget=6,
                     device_rounds=True)
    programs = dict(target.generation_cache.programs)
    # this drafter's greedy budget-6 program (with KDTREE_DEVICE_ROUNDS=1 the tests before
    # this one leave programs of their own on the same cache)
    (rounds,) = [p for p in programs.values()
                 if p.drafter is drafter and p.fixed_k is None and p.sampling.greedy]
    key = rounds.key(6)
    again = generate(target, prompts, 12, method="ddtree", drafter=drafter, budget=6,
                     device_rounds=True)
    assert again.tokens == first.tokens == generate(target, prompts, 12).tokens
    assert dict(target.generation_cache.programs) == programs and rounds.key(6) == key
    # the drafter's context takes the target cache's capacity (engine.cache_slots); a new
    # drafter cache beside the same target cache (its kept ones dropped): the program is the
    # same, its graph key is not (it names the drafter cache's buffers)
    assert drafter.cache.max_len == rounds.cache.max_len == 256
    drafter.model.generation_cache = None
    longer = generate(target, [[5, 6, 7]] * 2, 33, method="ddtree", drafter=drafter,
                      budget=6, device_rounds=True)
    assert rounds in target.generation_cache.programs.values()
    assert drafter.cache.max_len == rounds.cache.max_len == 256
    assert longer.tokens == generate(target, [[5, 6, 7]] * 2, 33).tokens
    assert rounds.key(6) != key


def test_device_rounds_refuse_a_drafter_that_needs_the_host():
    target, _ = target_and_drafter()
    with pytest.raises(ValueError, match="device-only drafter"):
        generate(target, [[1, 2]], 4, method="ddtree", budget=4, device_rounds=True,
                 drafter=ModelDrafter(_small_drafter_model(), 4))
    with pytest.raises(ValueError, match="on_round"):
        generate(target, [[1, 2]], 4, method="ddtree", budget=4, device_rounds=True,
                 drafter=target_and_drafter()[1], on_round=lambda *a: None)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_auto_budget_runs_on_device_rounds(monkeypatch, v2):
    """``--budget auto`` with device rounds: each launch takes the policy's budget (one
    program, a graph per budget), every round's cost reaches the policy, and the tokens are
    AR's.  A round costs 1 / budget seconds of a fake clock, so the first policy (start 4)
    climbs through both neighbours whatever the machine's timing; the second (the default)
    may rule the narrower out by its cost floor, and runs the wider."""
    from kdtree_numba.budget import AutoBudget
    _fake_round_clock(monkeypatch, lambda b: 1.0 / b)
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    policy = AutoBudget(candidates=(2, 4, 8), start=4, v2=v2)
    res = generate(target, prompts, 40, method="ddtree", drafter=drafter, budget=policy,
                   device_rounds=True)
    assert res.tokens == generate(target, prompts, 40).tokens
    assert res.stats.time["round"] > 0 and res.stats.budget == "auto"
    assert len(res.stats.budgets) == res.stats.rounds
    # v1 probed both neighbours; v2 at least the wider one (cheaper per round here)
    assert set(res.stats.budgets) == {2, 4, 8} if not v2 else {4, 8} <= set(res.stats.budgets)
    summary = res.stats.budget_auto["per_budget"]
    assert sum(v["rounds"] for v in summary.values()) == res.stats.rounds
    programs = [p for p in target.generation_cache.programs.values() if p.drafter is drafter]
    assert len(programs) == 1


def test_many_rounds_keep_the_host_bounds_tight():
    """Sixty rounds with one always in flight: the host mirrors of both caches stay within one
    round's bound of the truth (a bound that only grew would overflow the 256-slot cache
    after ~50 rounds of 5), and the tokens are AR's."""
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7]]
    res = generate(target, prompts, 60, method="ddtree", drafter=drafter, budget=6,
                   device_rounds=True)
    assert res.tokens == generate(target, prompts, 60).tokens
    assert res.stats.rounds >= 40 and target.generation_cache.max_len == 256


def test_a_round_run_ahead_in_vain_is_dropped_not_counted():
    """A round launched while its predecessor was unread, for a request the predecessor then
    finished (it committed the last tokens): its tokens are dropped and it is counted apart,
    so the rounds and acceptances equal the host-driven rounds'."""
    target, drafter = target_and_drafter(vocab=8, seed=2)      # bushy, multi-token rounds
    prompts = [[3, 1, 4, 1, 5]]
    dropped = 0
    for n in range(6, 16):
        kw = dict(method="ddtree", drafter=drafter, budget=16)
        host = generate(target, prompts, n, device_rounds=False, **kw)
        dev = generate(target, prompts, n, device_rounds=True, **kw)
        assert dev.tokens == host.tokens and dev.stats.tau == host.stats.tau
        dropped += dev.stats.rounds_dropped
    assert dropped > 0


def test_kdtree_run_device_rounds_give_the_same_text(capsys, monkeypatch):
    """`kdtree-run --method ddtree --device-rounds` on the shipped pair prints what the
    host-driven rounds print; a flag that cannot apply is one line, exit 2."""
    import json
    from kdtree_numba.cli import run_main
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)
    args = ["--method", "ddtree", "--max-new-tokens", "12", "--json", "--budget", "8"]
    outs = []
    for extra in ([], ["--device-rounds"], ["--device-rounds", "--budget", "auto"]):
        assert run_main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outs[0] == outs[1] == outs[2]
    for bad, why in ((["--method", "ar"], "needs --method ddtree or chain"),
                     (["--method", "ddtree", "--drafter", "oracle"], "needs a device-only")):
        assert run_main(bad + ["--max-new-tokens", "2", "--device-rounds"]) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines()
               if "error" in line]
        assert len(err) == 1 and why in err[0], err


def test_programs_live_as_long_as_their_cache_and_nothing_runs_for_no_request():
    """A cache's device programs die with it (no global registry keeps the cache, the model
    and the drafter alive); a generation whose every request ends at its first token runs no
    round."""
    import gc
    import weakref
    target, drafter = target_and_drafter()
    res = generate(target, [[5, 6, 7]], 1, method="ddtree", drafter=drafter, budget=6,
                   device_rounds=True)
    assert res.stats.rounds == 0 and res.stats.rounds_dropped == 0 and len(res.tokens[0]) == 1
    generate(target, [[5, 6, 7]], 6, method="ddtree", drafter=drafter, budget=6,
             device_rounds=True)
    cache = weakref.ref(target.generation_cache)
    assert cache().programs
    target.generation_cache = None
    gc.collect()
    assert cache() is None


def test_a_batch_with_its_own_slots_writes_there_and_never_replays_a_graph(monkeypatch):
    """ForwardBatch.slots, what a device round's verify passes (device slots made from its own
    lengths, not the cache's): the logits and the latents are the default forward's at those
    lengths, bit for bit, and the forward runs eagerly even where the model has CUDA graphs,
    whose key could not name those slots (here a graph cache that fails on any call)."""
    target, _ = target_and_drafter()
    ids = np.array([[3, 1, 4], [1, 5, 9]])
    caches, out = [], []
    for own_slots in (False, True):
        cache = target.new_cache(2, 16)
        target.prefill(cache, [[5, 6, 7], [9, 8]])
        lengths = cache.device_lengths.copy()
        positions = cache.lengths[:, None] + np.arange(3)
        slots = None
        if own_slots:       # the cache's own lengths now say one token less
            cache.truncate(cache.lengths - 1)
            slots = cache.device_slots(lengths, 3)
            monkeypatch.setattr(target, "graphs", _NoGraphs())
        out.append(target.forward(ForwardBatch(ids, positions, causal_mask(3, 2), causal=True,
                                               return_hidden=True, slots=slots), cache))
        caches.append(cache)
    for want, got in zip(*out):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(caches[1].c, caches[0].c)
    np.testing.assert_array_equal(caches[1].k_pe, caches[0].k_pe)


class _NoGraphs:
    def call(self, *args, **kw):
        raise AssertionError("a forward with its own slots went through the model's graphs")


class _CyclingBudget:
    """A policy of its own (an AutoBudget by type, as generate() asks, none of its logic):
    the next budget of a fixed cycle at every call, widths 2..21 changing every round, so
    consecutive rounds in flight have different widths; it records what it is told."""

    def __new__(cls, cycle):
        from kdtree_numba.budget import AutoBudget

        class Cycling(AutoBudget):
            def __init__(self):
                super().__init__(candidates=sorted(set(cycle)), start=cycle[0])
                self.calls, self.seen = 0, []

            def next_budget(self):
                self.calls += 1
                return cycle[(self.calls - 1) % len(cycle)]

            def observe(self, budget, seconds, tau, steady=None, paths=None):
                assert seconds >= 0 and tau >= 1
                assert steady is None           # the simulator: no CUDA graphs
                # the round's accepted slots, from its one read: tau of them, with the bonus
                assert tau == np.mean([len(p) + 1 for p in paths])
                assert all(0 < p[0] and np.all(np.diff(p) > 0) and p[-1] <= budget
                           for p in paths if len(p))
                self.seen.append(budget)
                super().observe(budget, seconds, tau, steady, paths)
        return Cycling()


@functools.lru_cache(maxsize=None)
def _paged_pair(layout: str):
    """target_and_drafter's pair with the target's cache in ``layout``."""
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    tcfg, tw, dcfg, dw, spec = parts2()
    target = Model(tcfg, tw, "reference", kv_layout=layout)
    return target, DFlashDrafter(target, dcfg, dw, spec)


@pytest.mark.parametrize("temperature, layout", [(0.0, "dense"), (0.8, "dense"),
                                                 (0.0, "paged:3")])
def test_budgets_changing_every_round_on_device_give_ar_tokens(temperature, layout):
    """A policy whose budget changes at every launch (1 to 20 nodes: a tree shallower than
    the block, and one wider than the block's L + 1 bound), a ragged batch with one request
    stopping at eos mid-run: AR's tokens (T > 0: the same uniforms), the host rounds' rounds
    and acceptances under the same policy, each round observed at the budget it ran with,
    and both caches exact afterwards; a paged target cache too (each launch reserves pages
    for its own width after the bound of the round in flight)."""
    cycle = (7, 1, 20, 2, 11, 3)
    target, drafter = target_and_drafter() if layout == "dense" else _paged_pair(layout)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    ar = generate(target, prompts, 14, temperature=temperature, seed=4)
    eos = ar.tokens[2][3]
    want = generate(target, prompts, 14, temperature=temperature, seed=4, eos=eos).tokens
    runs = []
    for on_device in (False, True):
        policy = _CyclingBudget(cycle)
        res = generate(target, prompts, 14, method="ddtree", drafter=drafter, budget=policy,
                       temperature=temperature, seed=4, eos=eos, device_rounds=on_device)
        assert res.tokens == want
        assert policy.seen == res.stats.budgets and len(res.stats.budgets) == res.stats.rounds
        runs.append((res, policy))
    (host, _), (dev, policy) = runs
    assert dev.stats.budgets == host.stats.budgets == \
        [cycle[i % len(cycle)] for i in range(dev.stats.rounds)]
    assert dev.stats.tau == host.stats.tau
    assert policy.calls == dev.stats.rounds + dev.stats.rounds_dropped
    cache = target.generation_cache
    assert not cache.pending and not drafter.cache.pending
    assert drafter.context_lengths.tolist() == cache.lengths.tolist()
    np.testing.assert_array_equal(np.asarray(cache.device_lengths), cache.lengths)


def _fake_round_clock(monkeypatch, cost, asynchronous=False):
    """The engine's ``time`` made a fake clock on which a device round of budget b takes
    ``cost(b)`` seconds and nothing else takes any time.  Synchronous: ``launch`` runs the
    round (the reference backend, the simulator, an eager GPU round); asynchronous: as a
    replayed graph, ``launch`` returns at once, the device runs the rounds back to back and
    ``collect`` waits for the oldest."""
    from types import SimpleNamespace
    from kdtree_numba import engine
    from kdtree_numba.device_round import DeviceRounds
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    real_round, real_launch, real_collect = (DeviceRounds._round, DeviceRounds.launch,
                                            DeviceRounds.collect)
    done = []                             # async: when each round in flight ends

    def run_round(self, budget, active):
        if not asynchronous:
            clock.now += cost(budget)
        return real_round(self, budget, active)

    def launch(self, active, budget, n=1):
        real_launch(self, active, budget, n)
        if asynchronous:
            done.append(max([clock.now] + done[-1:]) + n * cost(budget))

    def collect(self):
        if asynchronous:
            clock.now = max(clock.now, done.pop(0))
        return real_collect(self)
    monkeypatch.setattr(DeviceRounds, "_round", run_round)
    monkeypatch.setattr(DeviceRounds, "launch", launch)
    monkeypatch.setattr(DeviceRounds, "collect", collect)


@pytest.mark.parametrize("per_launch", [1, 3])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_device_round_is_charged_its_own_cost(monkeypatch, asynchronous, per_launch):
    """The cost a policy observes for a device round is that round's own, whatever the budget
    of the next one, whether a launch runs its rounds or only enqueues them
    (:func:`_fake_round_clock`), one round or several a launch (each its share): budgets
    change every launch, so a cost charged to the wrong round shows."""
    _fake_round_clock(monkeypatch, float, asynchronous)
    target, drafter = target_and_drafter()
    policy = _CyclingBudget((3, 9, 1, 6))
    costs = []
    observe = policy.observe
    policy.observe = lambda b, seconds, tau, steady=None, paths=None: (
        costs.append((b, seconds)), observe(b, seconds, tau, steady, paths))
    res = generate(target, [[5, 6, 7], [9, 8]], 16, method="ddtree", drafter=drafter,
                   budget=policy, device_rounds=True, rounds_per_launch=per_launch)
    assert res.stats.rounds > 4 and len(set(res.stats.budgets)) == 4
    assert costs == [(b, float(b)) for b in res.stats.budgets]


@pytest.mark.parametrize("epilogue", ["1", "0"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_held_back_a_launch_continues_from_its_own_root(monkeypatch, epilogue,
                                                                  temperature):
    """A request left out of a launch (waiting near its end, or any plan) keeps its root
    through the rounds it did not run, so when it joins a later launch it continues from its
    last committed token: the host rounds' tokens (AR's at T = 0).  Before the fix the rounds
    it sat out overwrote its root, and its next round started from a wrong token."""
    from kdtree_numba import engine
    monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", epilogue)
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7, 8], [9, 8], [3, 1, 4]]
    kw = dict(method="ddtree", drafter=drafter, budget=4, temperature=temperature, seed=4)
    want = generate(target, prompts, 12, device_rounds=False, **kw)
    real, calls = engine.plan_launch, []

    def hold_back_request_0(req, *a):          # left out of the second and third launch ahead
        ahead, n = real(req, *a)
        calls.append(bool(ahead[0]))
        if len(calls) in (2, 3):
            ahead = ahead.copy()
            ahead[0] = False
        return ahead, n
    monkeypatch.setattr(engine, "plan_launch", hold_back_request_0)
    got = generate(target, prompts, 12, device_rounds=True, **kw)
    assert calls[1] and calls[2]                   # it was running, then held back
    assert got.tokens == want.tokens


@pytest.mark.parametrize("early", ["1", "0"])
def test_the_early_rounds_seconds_are_set_aside_where_graphs_replay(monkeypatch, early):
    """A replayed first round launched before the prefill's read ran partly during that read,
    which its measured wall time misses: the policy is told it was not steady (its tau
    counts, its seconds do not); every later replayed round is steady, as all are without
    the early round."""
    from kdtree_numba import engine
    monkeypatch.setattr(engine, "_replayed", lambda before, after: True)  # graphs replay
    monkeypatch.setenv("KDTREE_EARLY_ROUND", early)
    target, drafter = target_and_drafter()
    policy = _CyclingBudget((3, 9, 1, 6))
    told = []
    policy.observe = lambda b, seconds, tau, steady=None, paths=None: told.append(steady)
    res = generate(target, [[5, 6, 7], [9, 8]], 16, method="ddtree", drafter=drafter,
                   budget=policy, device_rounds=True)
    assert len(told) == res.stats.rounds > 4
    assert told == [early == "0"] + [True] * (len(told) - 1)


# ----------------------------------------------------------------------------- R rounds a launch

def _launch_sizes(monkeypatch, unread=None) -> list:
    """The rounds of every DeviceRounds launch from now on, in order (and into ``unread`` the
    rounds in flight at each)."""
    from kdtree_numba.device_round import DeviceRounds
    sizes, real = [], DeviceRounds.launch

    def launch(self, active, budget, n=1):
        sizes.append(n)
        if unread is not None:
            unread.append(self.rounds_in_flight)
        return real(self, active, budget, n)
    monkeypatch.setattr(DeviceRounds, "launch", launch)
    return sizes


@pytest.mark.parametrize("per_launch", [2, 3])
@pytest.mark.parametrize("method, budget, temperature", [("ddtree", 6, 0.0), ("ddtree", 6, 0.8),
                                                         ("chain", 32, 0.0)])
def test_rounds_per_launch_give_one_a_launchs_tokens(monkeypatch, per_launch, method, budget,
                                                     temperature):
    """R rounds a launch, a ragged batch with one request stopping at eos: the tokens,
    rounds and acceptances of one round a launch (AR's at T = 0), one read a launch,
    R-round launches while requests need many tokens and one-round launches otherwise, at most
    2 R - 1 rounds run past the last request's end, and afterwards both caches exact and
    agreeing."""
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    eos = generate(target, prompts, 24, temperature=temperature, seed=4).tokens[2][3]
    kw = dict(method=method, drafter=drafter, budget=budget, temperature=temperature, seed=4,
              eos=eos, device_rounds=True)
    one = generate(target, prompts, 24, **kw)
    if temperature == 0:
        assert one.tokens == generate(target, prompts, 24, eos=eos).tokens
    sizes = _launch_sizes(monkeypatch)
    res, reads, syncs = counted(target.backend, lambda: generate(
        target, prompts, 24, rounds_per_launch=per_launch, **kw))
    assert res.tokens == one.tokens
    assert res.stats.tau == one.stats.tau and res.stats.rounds == one.stats.rounds
    assert reads == 1 + len(sizes) and syncs == 1
    assert sum(sizes) == res.stats.rounds + res.stats.rounds_dropped
    assert per_launch in sizes and set(sizes) <= {1, per_launch}
    assert res.stats.rounds_dropped <= 2 * per_launch - 1
    cache = target.generation_cache
    assert not cache.pending and not drafter.cache.pending
    assert drafter.context_lengths.tolist() == cache.lengths.tolist()
    np.testing.assert_array_equal(np.asarray(cache.device_lengths), cache.lengths)


def test_rounds_per_launch_fit_the_caches_generate_sizes():
    """Bushy multi-token rounds, four a launch, at lengths where the last launches run past a
    request's end: the caches ``engine.cache_slots`` sizes hold the launch in flight and the
    next (the host bounds would raise CacheFullError), and the tokens are AR's."""
    target, drafter = target_and_drafter(vocab=8, seed=2)
    prompts = [[3, 1, 4, 1, 5]]
    for n in range(7, 41, 6):
        res = generate(target, prompts, n, method="ddtree", drafter=drafter, budget=16,
                       device_rounds=True, rounds_per_launch=4)
        assert res.tokens == generate(target, prompts, n).tokens


def test_plan_launch_sends_ahead_what_the_rounds_in_flight_leave():
    """plan_launch on requests with 20, 9, 3 tokens left and one finished: with one round a
    launch, every running request short by more than a token a round in flight, one round;
    with four, at 3 tokens a round so far, only those the rounds in flight look not to finish,
    and four rounds while one of them looks to need more than three."""
    from types import SimpleNamespace
    from kdtree_numba.device_round import plan_launch
    req = SimpleNamespace(active=np.array([True, True, True, False]), max_new=30,
                          out=[[0] * 10, [0] * 21, [0] * 27, [0] * 30])
    seen = [30, 10]                                 # 3 tokens a request-round
    ahead, n = plan_launch(req, 2, 1, seen)
    assert ahead.tolist() == [True, True, True, False] and n == 1
    ahead, n = plan_launch(req, 2, 4, seen)         # 6 tokens in flight: the third finishes
    assert ahead.tolist() == [True, True, False, False] and n == 4     # 20 - 6 > 3 x 3
    ahead, n = plan_launch(req, 4, 4, seen)         # 12 in flight: 20 - 12 = 8 <= 9
    assert ahead.tolist() == [True, False, False, False] and n == 1
    ahead, n = plan_launch(req, 0, 4, [0, 0])       # nothing seen: a token a round
    assert ahead.tolist() == [True, True, True, False] and n == 4
    # KDTREE_WAIT_NEAR_END: one round a launch, held back as with four where the rounds in
    # flight look to finish a request (20 - 2 x 3 > 0, 9 - 6 > 0, 3 - 6 <= 0)
    ahead, n = plan_launch(req, 2, 1, seen, wait_near_end=True)
    assert ahead.tolist() == [True, True, False, False] and n == 1
    ahead, n = plan_launch(req, 3, 1, seen, wait_near_end=True)      # 9 in flight: 9 <= 9
    assert ahead.tolist() == [True, False, False, False] and n == 1
    # a margin: the mean tokens in flight times it (2 in flight x 3 x 1.5 = 9: 9 - 9 <= 0)
    ahead, n = plan_launch(req, 2, 1, seen, wait_near_end=1.5)
    assert ahead.tolist() == [True, False, False, False] and n == 1
    ahead, n = plan_launch(req, 2, 1, seen, wait_near_end=0.5)       # 3 - 3 <= 0 still
    assert ahead.tolist() == [True, True, False, False] and n == 1
    ahead, n = plan_launch(req, 2, 1, seen, wait_near_end=0.0)       # off
    assert ahead.tolist() == [True, True, True, False] and n == 1


def test_a_launch_held_back_goes_in_after_the_read(monkeypatch):
    """Where the next launch is held back (the rounds in flight looked to finish every
    request; here every second launch, whatever they look like), the engine launches after
    the read, with none in flight: the same tokens, rounds and acceptances, both caches
    exact."""
    from kdtree_numba import engine
    target, drafter = target_and_drafter()
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    kw = dict(method="ddtree", drafter=drafter, budget=6, device_rounds=True,
              rounds_per_launch=3)
    ar = generate(target, prompts, 24).tokens
    want = generate(target, prompts, 24, **kw)
    real, calls, unread = engine.plan_launch, [], []

    def every_second_held(req, in_flight, per_launch, seen, *rest):
        ahead, n = real(req, in_flight, per_launch, seen, *rest)
        calls.append(in_flight)
        return (ahead & (len(calls) % 2 == 0 or in_flight == 0)), n
    monkeypatch.setattr(engine, "plan_launch", every_second_held)
    _launch_sizes(monkeypatch, unread)
    res = generate(target, prompts, 24, **kw)
    assert res.tokens == want.tokens == ar
    assert res.stats.tau == want.stats.tau and res.stats.rounds == want.stats.rounds
    assert unread[0] == 0 and 0 in unread[1:]
    cache = target.generation_cache
    assert not cache.pending and drafter.context_lengths.tolist() == cache.lengths.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_waiting_near_the_end_keeps_the_tokens(monkeypatch, temperature):
    """``KDTREE_WAIT_NEAR_END=1``, one round a launch, multi-token rounds of a ragged batch
    ending at max_new_tokens: every launch is planned with the switch
    (test_plan_launch_sends_ahead_what_the_rounds_in_flight_leave: what it holds back), and
    the tokens are the default run's (AR's at T = 0), both caches exact afterwards."""
    from kdtree_numba import engine
    target, drafter = target_and_drafter(vocab=8, seed=2)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    kw = dict(method="ddtree", drafter=drafter, budget=16, device_rounds=True,
              temperature=temperature, seed=4)
    want = generate(target, prompts, 18, **kw)
    if temperature == 0:
        assert want.tokens == generate(target, prompts, 18).tokens
    real, asked = engine.plan_launch, []

    def recorded(req, in_flight, per_launch, seen, *rest):
        asked.append(rest)
        return real(req, in_flight, per_launch, seen, *rest)
    monkeypatch.setattr(engine, "plan_launch", recorded)
    monkeypatch.setenv("KDTREE_WAIT_NEAR_END", "1")
    res = generate(target, prompts, 18, **kw)
    assert asked and set(asked) == {(True,)}
    # the tokens (the uniforms go by position); a request held back and not finished by the
    # rounds in flight joins the launch after, so its rounds may split otherwise
    assert res.tokens == want.tokens
    cache = target.generation_cache
    assert not cache.pending and drafter.context_lengths.tolist() == cache.lengths.tolist()
    np.testing.assert_array_equal(np.asarray(cache.device_lengths), cache.lengths)


@pytest.mark.parametrize("temperature, lookup", [(0.0, True), (0.8, False)])
def test_the_early_round_goes_in_before_the_first_read_and_keeps_the_tokens(
        monkeypatch, temperature, lookup):
    """The early round (the default; ``KDTREE_EARLY_ROUND=0`` off): the first device round is
    launched on the prefill's device tokens before their read, and the tokens, acceptances
    and both caches are the switch-off run's (a ragged batch; the lookup's history takes each
    root on the device), with the
    prefill's report made once, after the read; so with one new token (no round) and with a
    first token that is eos (its round run in vain)."""
    from kdtree_numba import device_round, engine
    target, drafter = target_and_drafter(vocab=8, seed=2)
    prompts = [[3, 1, 4, 1, 5, 3, 1], [2, 7]]
    kw = dict(method="ddtree", drafter=drafter, budget=16, device_rounds=True,
              temperature=temperature, seed=4, prompt_lookup=lookup)
    monkeypatch.setenv("KDTREE_EARLY_ROUND", "0")
    want = generate(target, prompts, 14, **kw)
    order, reports, programs = [], [], []
    real_launch, real_commit = device_round.DeviceRounds.launch, engine._commit_first

    def launch(self, *a, **k):
        order.append("launch")
        programs.append(self)
        return real_launch(self, *a, **k)

    def commit_first(*a):
        order.append("read")
        return real_commit(*a)
    monkeypatch.setattr(device_round.DeviceRounds, "launch", launch)
    monkeypatch.setattr(engine, "_commit_first", commit_first)
    monkeypatch.setenv("KDTREE_EARLY_ROUND", "1")
    res = generate(target, prompts, 14, progress=lambda done, total: reports.append(done),
                   **kw)
    assert order[:2] == ["launch", "read"] and order.count("read") == 1
    assert reports[0] == len(prompts)               # the prefill's report: one token each
    assert res.tokens == want.tokens and res.stats.tau == want.stats.tau
    cache = target.generation_cache
    assert not cache.pending and drafter.context_lengths.tolist() == cache.lengths.tolist()
    np.testing.assert_array_equal(np.asarray(cache.device_lengths), cache.lengths)
    if lookup:                      # the lookup's history: each prompt, its root, its tokens
        history = np.asarray(programs[-1].history)
        for b, p in enumerate(prompts):
            assert history[b, :len(p) + 14].tolist() == p + res.tokens[b]
    order.clear()                   # one new token each: no round, the read alone
    assert generate(target, prompts, 1, **kw).tokens == [t[:1] for t in want.tokens]
    assert order == ["read"]
    # request 1's first token its eos: the early round ran for it in vain, the tokens stay
    eos = want.tokens[1][0]
    ended = generate(target, prompts, 14, eos=eos, **kw)
    assert ended.tokens[1] == [eos]
    monkeypatch.setenv("KDTREE_EARLY_ROUND", "0")
    assert ended.tokens == generate(target, prompts, 14, eos=eos, **kw).tokens


def test_rounds_per_launch_refusals_and_the_switch(monkeypatch):
    """A count outside 1..16 or not a whole number, or more than one round a launch without
    device rounds: a ValueError naming it; unset, ``KDTREE_ROUNDS_PER_LAUNCH`` decides."""
    target, drafter = target_and_drafter()
    kw = dict(method="ddtree", drafter=drafter, budget=4)
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="rounds_per_launch must be"):
            generate(target, [[1, 2]], 4, device_rounds=True, rounds_per_launch=bad, **kw)
    with pytest.raises(ValueError, match="needs device rounds"):
        generate(target, [[1, 2]], 4, device_rounds=False, rounds_per_launch=2, **kw)
    sizes = _launch_sizes(monkeypatch)
    monkeypatch.setenv("KDTREE_ROUNDS_PER_LAUNCH", "3")
    res = generate(target, [[1, 2]], 30, device_rounds=True, **kw)
    assert res.tokens == generate(target, [[1, 2]], 30).tokens and 3 in sizes
    monkeypatch.setenv("KDTREE_ROUNDS_PER_LAUNCH", "17")
    with pytest.raises(ValueError, match="KDTREE_ROUNDS_PER_LAUNCH"):
        generate(target, [[1, 2]], 4, device_rounds=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_rounds_per_launch_give_one_a_launchs_tokens(monkeypatch, temperature):
    """The demo pair on the GPU with CUDA graphs, DDTree budget 16: one round a launch
    (unset), then four, twice: the same tokens and acceptances (AR's at T = 0), and the
    launches of four rounds replayed, each one graph launch, so fewer replays in all."""
    from test_demo_pair import heldout_ids
    from test_lean_round import demo_pair, demo_runs
    model, drafter = demo_pair()
    runs = demo_runs(monkeypatch, model, drafter, "KDTREE_ROUNDS_PER_LAUNCH", (None, "4", "4"),
                     16, temperature)
    (one, _), (four, _), (again, _) = runs
    assert four.tokens == one.tokens == again.tokens
    assert four.stats.tau == again.stats.tau == one.stats.tau
    assert 0 < again.stats.graph_replays < one.stats.graph_replays
    if temperature == 0:
        assert four.tokens == generate(model, heldout_ids(4), 64).tokens

"""``--budget auto``: each DDTree round's budget chosen from what the rounds so far measured.

A budget pays when the tokens it commits per round (tau) grow faster than the round's cost.
Both depend on the machine and the model: on a launch-bound small target the round costs
about the same at 8 and 128 nodes (so the widest tree wins), on a wide MoE every extra node
can touch another expert's weights (issue 15: verifying 65 nodes cost 8.5 AR steps), and on
the CPU reference the cost grows with the nodes from the start.  So nothing is assumed:
:class:`AutoBudget` keeps, per candidate budget, the measured wall time of its rounds (each
round ends in the engine's one host read, so a round's wall time is its cost) and the tokens
they committed, and picks the budget with the most expected tokens per second,
tau(b) / cost(b).

It climbs: it starts at ``start`` (:data:`START_V1`, 32), measures the neighbours (half and
double) of the best budget so far before trusting it, and every ``reprobe`` rounds measures
again the neighbour it has not seen for longest, since the text (and with it tau) drifts.  A
budget's cost is the median of its last 8 rounds, ignoring its first :data:`WARM_ROUNDS` once
there are more (a shape's first call runs eagerly and may compile kernels, its second captures
its CUDA graph: kdtree_numba/graphs.py); its tau is a running mean that forgets (``decay``), to
follow the text.

The second policy, v2, is the default (``runtime.current().auto_v2`` when the policy is made,
or ``v2=True``; ``KDTREE_AUTO_V2=0`` or ``v2=False`` gives the first, above).  Issue 36: on
the GPU the first lost 13-25% to the best fixed budget; v2 ran within 4% of it (run 156,
H200, 24 prompts: auto 6,443 tok/s against budget 16's 6,666; the first 5,632 against
6,454 in the same call):

* **Only replayed rounds are costs.**  The engine says of each round whether it replayed a
  captured CUDA graph (``observe(..., steady=True)``) or ran eagerly or captured one
  (``steady=False``: an eager round launches its ~200 kernels one by one from Python, the
  time of many replayed rounds); an unsteady round's tau counts, its seconds do not (unless a
  budget's rounds stay unsteady past :data:`WARM_ROUNDS` in a row: then that is its cost),
  and where the engine knows (``steady`` not None) no round is set aside as warm-up.
  Without graphs (``steady=None``: the CPU, the simulator) the :data:`WARM_ROUNDS` rule
  stays.
* **Room for every candidate's round graph.**  The device round's CUDA graphs are kept per
  budget and per (target cache, drafter cache) pair: kdtree_numba/graphs.py keeps 64 of that
  kind instead of 24, so the graphs a warm-up captured for every candidate are still there
  when the timed rounds probe them (a probe is then one replayed round, not an eager round
  and a capture).
* **Paired tau.**  Per-round tau varies ~55% and prompts differ more than budgets do (the
  demo pair's 8 / 16 / 32 are 3-7% apart), so means of each budget's own rounds, each on
  other text, wander.  But the trees nest: the builder pops best-first, so the tree at
  budget b is the first b nodes of the tree at any B >= b (k = min(b, V) changes nothing a
  b-node tree can hold, as a node of rank r needs its r elder siblings, nor does a drafter
  block cut to depth b, as a node at depth d needs its d - 1 ancestors; ties are broken by
  rank path, the same in both).  A node's target token does not depend on the tree around
  it (its logits see only its ancestors; at T > 0 it is drawn with the uniform of its
  position, ``U_b[start + depth + 1]``, in every tree that holds it).  So the walk of a
  round at B, truncated to the slots <= b, is exactly the walk the tree at b would have
  made: the round's accepted slots (the tail of its one read:
  ``reference.ddtree.pack_committed``; the engine passes them as ``observe(...,
  paths=...)``) give every candidate b <= B its tokens on the same text, 1 + #{accepted
  slots <= b}.  Exact at every temperature, up to float rounding of verifies of other widths
  (as the lossless claim is); an estimate on the CPU path (the reference backend in
  float32), where a budget under the drafter's block drafts with a block cut to it, whose
  logits differ slightly.  :class:`PairedTau` keeps, per (budget run, budget measured),
  sums that forget over ``horizon`` (:data:`HORIZON`, 128) rounds; a candidate's tau is its
  mean over the rounds run at or above the budget the policy runs (the "home" budget), and
  a candidate above home the home's times their paired ratio over the rounds run at or
  above that candidate.  Rounds that give no slots (a caller's ``observe`` without
  ``paths``) add their own tau alone, and the estimates fall back to each budget's own
  mean.
* **The choice.**  rate(b) = tau(b) / cost(b), cost the median of the steady rounds above,
  trusted after :data:`MIN_COST` of them.  It runs ``start`` until it has a cost, then the
  widest budget within ``slack`` (1%) of the best rate.  A budget without a cost is measured
  (until it has one, one begun first, then the widest, as its rounds measure every budget
  below it) only where it could win: its tau over a cost floor beats the best rate by more
  than a tie (:data:`TIE`: a bound that only ties cannot win, and each such round is paid).
  The floor, from the measured budgets: a tree costs no less than the nearest measured one
  below it; a narrower one no less per node than the nearest measured one above (cost(b) >=
  cost(m) b / m), and, with two measured above, saves per node no more than they differ per
  node, less :data:`SECANT_MARGIN` (10%).  Above every budget run, only the next candidate,
  its tau bound the widest one's plus that one's last doubling's gain (none known: no
  bound).  So on the demo pair's machine 2 and 4 are ruled out without a round (or after
  three, where the costs measured first leave them a chance), while where every node is dear
  (Kimi-K2's experts) they win; the candidates are not cut for any one pair.  A wider
  budget's first round gives its paired tau at once: where it gains nothing on the narrower
  ones (Kimi-K2's replay drafter: its chain of 8 holds every accepted node), its bound is the
  narrower's tau over at least the narrower's cost, a tie, so it is not measured further,
  and neither is anything wider.  ``reprobe`` / 2 rounds after the last round away from home
  (a measurement's included, so none follows it at once), by turns, one round at the
  candidate above home (its tau paired with home's, its cost) or at the stalest-costed
  candidate below home within :data:`REFRESH` (15%) of the best rate (none: the turn is
  spent at home).  On simulated rounds with paired acceptance (tests/test_budget_paired.py:
  128 prompts of 30 rounds, one policy) it gets 98-99% of the best fixed budget's rate on the
  demo pair's costs, a CPU-like and a MoE-like curve, where v1 gets 93-96%; 81-95% where each
  budget's first two rounds cost 50 ms more (no warm-up: every budget it tries runs eagerly,
  then captures; the demo pair the least, as from 8 it climbs through more budgets than it
  did from 32, 84-86%), v1 74-91%.
* **The start** (``start``; :data:`START_V2`, 8: the candidate nearest it).  Its rounds are
  paid before anything is known, and the risk is lopsided: where nodes are dear a wide start
  pays several times a narrow round (Kimi-K2's slice on an H100: a round at 32 costs 1.3x
  one at 8 on the tensor-core int4 kernels, 2.3x on the CUDA-core ones), where they are
  cheap a narrow start loses only the acceptance a wider tree adds (the demo pair: 8 within
  5% of the best, 16) and climbs in a few rounds, each step's paired tau known from its
  first round.  The first GPU runs of ``kimi-k2-slice`` (``bench_engine --budgets
  8,16,32,64,auto``, 11 rounds a generation, a fresh policy each) showed what a start of 32
  did there: 5 rounds at 32, 5 at 64 (its bound, 32's tau plus a gain of 0, tied and was
  measured, widest first), 1 at 16, none at 8: 60% of budget 8's rate on the tensor-core
  kernels, 39% on the CUDA-core ones.  Now: 8 until it has a cost, one round at 16 (its
  paired tau equals 8's), then 8 (simulated on those costs: 95-99% of budget 8's rate, 11 and
  30 rounds, tests/test_budget_paired.py's ``test_kimi_*``).
* **Kept across calls.**  ``generate(..., budget="auto")`` runs the policy kept for its model,
  drafter, batch, sampling, draft temperature, kind of round and runtime switches
  (:func:`kept_auto_budget`): a round's cost is the machine's and the model's, and the
  paired tau forgets over :data:`HORIZON` rounds anyway, so a later call goes on from what
  the earlier ones measured instead of climbing again (a server's short generations; on the
  simulated rounds a kept policy gets 95-99% of the best fixed rate where a fresh one per
  11-round generation gets 69-99%, the least where the best budget is furthest from the
  start).  A model keeps the :data:`KEPT_AUTO_PER_MODEL` (32) most
  recently used; :func:`forget_auto_budgets` drops them; an ``AutoBudget`` passed as ``budget``
  is the caller's own (a new one is fresh, one kept by the caller learns across its calls,
  as tools/bench_demo.py's auto row keeps one across its prompts).
"""
from __future__ import annotations

import collections
import dataclasses
import weakref
from statistics import median

import numpy as np

from kdtree_numba import runtime
from reference.ddtree import Sampling

__all__ = ["AutoBudget", "BudgetEstimate", "PairedTau", "DEFAULT_CANDIDATES", "WARM_ROUNDS",
           "kept_auto_budget", "forget_auto_budgets", "KEPT_AUTO_PER_MODEL"]

DEFAULT_CANDIDATES = (2, 4, 8, 16, 32, 64, 128, 256)
# a budget's rounds that may be slower than its steady state: the first (eager: compiles),
# the second (the CUDA graph's capture)
WARM_ROUNDS = 2
RECENT = 8       # a budget's cost: the median of its last RECENT rounds
# v2: a budget's steady rounds before its cost is trusted; the rate its run may give up for
# the acceptance of every budget below it; how near the best rate a budget below the one run
# must be to have its cost re-measured
MIN_COST = 3
SLACK = 0.01
REFRESH = 0.15
# v2: how far below the two nearest measured budgets' secant a narrower budget's cost may lie
SECANT_MARGIN = 0.1
# the budget a policy starts at (the candidate nearest it): v1 the middle; v2 low (module
# docstring, "The start": a narrow start risks little where nodes are cheap, a wide one a lot
# where they are dear)
START_V1, START_V2 = 32, 8
# v2: a rate bound must beat the best rate by more than this to be worth a round (a bound
# that only ties, as a wider tree's whose paired acceptance gained nothing, cannot win; the
# margin absorbs the float rounding of equal estimates)
TIE = 1e-6
# v2: the rounds its acceptance estimates remember (~4 of the demo row's prompts; 32 to 256
# gave 97.7-98.0% of the best fixed rate on tests/test_budget_paired.py's simulated rows, so
# the shorter memory, which follows a change of text sooner, costs little)
HORIZON = 128.0


@dataclasses.dataclass
class BudgetEstimate:
    """What the rounds at one budget measured."""
    budget: int
    rounds: int = 0
    tau: float = 0.0                 # running mean of committed tokens per request-round
    # wall seconds per round: the first WARM_ROUNDS of unknown steadiness, then the last
    # RECENT (bounded: a persistent policy sees thousands of rounds, and each next_budget()
    # takes every candidate's cost)
    warm: list = dataclasses.field(default_factory=list)
    recent: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT))
    last_round: int = -1             # the policy's round counter at its latest sample
    unsteady: int = 0                # its latest samples in a row that were not replays

    def add(self, seconds: float, steady: bool | None = None) -> None:
        """One round's wall time: ``steady`` True keeps it as a steady-state cost, False
        drops it (an eager or capturing round) unless it is the budget's third in a row
        (a graph that cannot be captured, or one evicted before each use: then eager
        rounds are what the budget costs), None (unknown) sets the budget's first
        :data:`WARM_ROUNDS` aside."""
        self.unsteady = self.unsteady + 1 if steady is False else 0
        if steady is False and self.unsteady <= WARM_ROUNDS:
            return
        if steady is None and not self.recent and len(self.warm) < WARM_ROUNDS:
            self.warm.append(float(seconds))
        else:
            self.recent.append(float(seconds))

    @property
    def timed(self) -> bool:
        """Whether any round's seconds were kept (a cost exists)."""
        return bool(self.recent or self.warm)

    def cost(self) -> float:
        """Median of the last :data:`RECENT` rounds' seconds, the first :data:`WARM_ROUNDS`
        excluded once there are more (they may have compiled or captured); before that the
        fastest so far."""
        return median(self.recent) if self.recent else min(self.warm)

    def rate(self) -> float:
        """Expected committed tokens per second per request."""
        c = self.cost()
        return self.tau / c if c > 0 else 0.0


class PairedTau:
    """Acceptance per candidate budget from nested trees (module docstring, "Paired tau").

    A round run at the candidate of index i adds, for every candidate j <= i, the tokens the
    round would have committed at candidate j (its counterfactual acceptance; where the round
    gave only its own tau, just that).  ``tau(anchor)`` then estimates every candidate's
    acceptance on the same text: candidates up to ``anchor`` from the rounds run at or above
    it (each of those rounds measured all of them), a candidate above it as the anchor's
    estimate times the paired ratio of the two over the rounds run at or above that candidate.
    Samples forget with a horizon of ``horizon`` rounds (weights growing by 1 / (1 - 1 /
    horizon) a round, renormalised now and then)."""

    def __init__(self, candidates, horizon: float = HORIZON):
        self.candidates = tuple(candidates)
        n = len(self.candidates)
        # [L, j]: weighted sums of candidate j's acceptance over the rounds run at a
        # candidate >= L, and their weights (kept cumulative: a round's add is one slice)
        self.sums = np.zeros((n, n))
        self.weights = np.zeros((n, n))
        self.growth = 1.0 / (1.0 - 1.0 / float(horizon))
        self.w = 1.0

    def add(self, i: int, taus) -> None:
        """A round run at candidate index ``i``: ``taus`` [i + 1] the acceptance it gave each
        candidate up to it, or one float: its own only."""
        self.w *= self.growth
        if self.w > 1e100:                 # renormalise: only ratios of weights matter
            self.sums /= self.w
            self.weights /= self.w
            self.w = 1.0
        if np.ndim(taus) == 0:
            self.sums[:i + 1, i] += self.w * float(taus)
            self.weights[:i + 1, i] += self.w
        else:
            self.sums[:i + 1, :i + 1] += self.w * np.asarray(taus, np.float64)[None, :]
            self.weights[:i + 1, :i + 1] += self.w

    def tau(self, anchor: int) -> np.ndarray:
        """[n] the estimated acceptance of every candidate, anchored at candidate index
        ``anchor`` (NaN where no round measured it)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = self.sums / self.weights   # [L, j]: j's mean over the runs >= L
            out = mean[anchor].copy()         # j <= anchor: the rounds run at >= anchor
            diag = np.diagonal(mean)          # j's own mean over the runs >= j
            ratio = diag / mean[:, anchor]    # j : anchor over the runs >= j
        above = np.arange(len(out)) > anchor
        out[above] = out[anchor] * ratio[above]
        # no paired sample (nothing run at or above the anchor, or rounds that gave only their
        # own tau): the candidate's own mean
        return np.where(np.isfinite(out), out, diag)


class AutoBudget:
    """Chooses each round's budget (module docstring).  ``next_budget()`` before a round,
    ``observe(budget, seconds, tau, steady=None, paths=None)`` after it; ``summary()`` for
    the stats.  ``v2``: ``KDTREE_AUTO_V2``'s steady costs and paired acceptance (None:
    ``runtime.current().auto_v2``); ``start``: the budget its first rounds run (the candidate
    nearest it; None: :data:`START_V2`, or :data:`START_V1` for v1); ``horizon`` (v2): the
    rounds its acceptance estimates remember; ``slack`` (v2): how far below the best rate the
    budget it runs may be, the largest such (it measures every smaller budget's acceptance at
    once)."""

    def __init__(self, candidates=DEFAULT_CANDIDATES, *, start: int | None = None,
                 reprobe: int = 16,
                 decay: float = 0.2, max_budget: int | None = None, v2: bool | None = None,
                 horizon: float = HORIZON, slack: float = SLACK):
        cands = sorted({int(b) for b in candidates if int(b) >= 1 and
                        (max_budget is None or int(b) <= max_budget)})
        if not cands:
            raise ValueError(f"no candidate budget in {tuple(candidates)} is within 1.."
                             f"{max_budget}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not horizon > 1:
            raise ValueError(f"horizon must be > 1 round, got {horizon}")
        if not 0 <= slack < 1:
            raise ValueError(f"slack must be in [0, 1), got {slack}")
        self.candidates = tuple(cands)
        self.v2 = runtime.current().auto_v2 if v2 is None else bool(v2)
        if start is None:
            start = START_V2 if self.v2 else START_V1
        self.start = min(cands, key=lambda b: (abs(b - start), b))
        self.reprobe, self.decay = int(reprobe), float(decay)
        self.est = {b: BudgetEstimate(b) for b in cands}
        self.round = 0
        # v2: paired acceptance, the budget run between probes, the probes' alternation
        self.index = {b: i for i, b in enumerate(cands)}
        self._cands = np.array(cands, np.int64)
        self.paired = PairedTau(cands, horizon)
        self.slack = float(slack)
        self.home = self.start
        self._probe_up = False
        self._away = -1                             # the latest round not at home (v2)
        self._tau = np.full(len(cands), np.nan)     # paired acceptance (v2)
        self._cost = np.full(len(cands), np.nan)    # steady cost, once trusted (v2)
        self._costed_at: list = []                  # the indices with one
        self._rate = np.full(len(cands), np.nan)

    @property
    def max_budget(self) -> int:
        return self.candidates[-1]

    def _neighbours(self, b: int) -> list[int]:
        i = self.candidates.index(b)
        return [self.candidates[j] for j in (i - 1, i + 1) if 0 <= j < len(self.candidates)]

    def _measured(self, b: int) -> bool:
        return bool(self.est[b].recent)      # one round past its warm-up

    def best(self) -> int:
        """The measured budget with the highest expected rate (the start before any)."""
        if self.v2:
            rated = np.flatnonzero(np.isfinite(self._rate))
            if not len(rated):
                return self.start
            return self.candidates[max(rated, key=lambda i: (self._rate[i], i))]
        done = [b for b in self.candidates if self.est[b].timed]
        if not done:
            return self.start
        return max(done, key=lambda b: (self.est[b].rate(), -b))

    def next_budget(self) -> int:
        if self.v2:
            return self._next_v2()
        best = self.best()
        if not self._measured(best):
            return best
        for n in self._neighbours(best):
            if not self._measured(n):
                return n
        if self.reprobe and self.round % self.reprobe == self.reprobe - 1:
            return min(self._neighbours(best) or [best], key=lambda b: self.est[b].last_round)
        return best

    def observe(self, budget: int, seconds: float, tau: float,
                steady: bool | None = None, paths=None) -> None:
        """A round at ``budget`` took ``seconds`` and committed ``tau`` tokens a request;
        ``steady``: whether it replayed a CUDA graph (None: unknown; module docstring; v2
        only, the v1 policy takes every round as of unknown steadiness); ``paths`` (v2): the
        slots of each running request's accepted nodes (increasing, root excluded:
        ``reference.ddtree.accepted_slots``), from which every smaller candidate's
        acceptance on this round follows (module docstring, "Paired tau"); None: only
        ``tau``, for ``budget`` itself."""
        e = self.est[budget]
        e.add(seconds, steady if self.v2 else None)
        e.tau = float(tau) if e.rounds == 0 else (1 - self.decay) * e.tau + self.decay * tau
        e.rounds += 1
        e.last_round = self.round
        self.round += 1
        if self.v2:
            i = self.index[budget]
            self.paired.add(i, float(tau) if paths is None else self.counterfactual(i, paths))
            self._update_v2(i)

    def counterfactual(self, i: int, paths) -> np.ndarray:
        """[i + 1] the mean tokens a round's requests would have committed at each candidate
        up to index ``i``: the accepted nodes among a candidate's first b slots, plus the
        bonus token (``paths``: as in :meth:`observe`; exact where the trees nest: module
        docstring)."""
        budgets = self._cands[:i + 1]
        total = np.zeros(i + 1)
        for slots in paths:
            total += np.searchsorted(np.asarray(slots), budgets, side="right")
        return 1.0 + total / max(len(paths), 1)

    # ---- v2: paired acceptance, steady costs (module docstring)
    def _costed(self, i: int) -> bool:
        return bool(np.isfinite(self._cost[i]))

    def _update_v2(self, i: int) -> None:
        """The estimates after a round at candidate i: its cost (once it has MIN_COST steady
        rounds), every candidate's acceptance (anchored at the budget run between probes),
        the rates of those with a cost, and that budget anew."""
        e = self.est[self.candidates[i]]
        self._cost[i] = max(e.cost(), 1e-12) if len(e.recent) >= MIN_COST else np.nan
        self._tau = self.paired.tau(self.index[self.home])
        self._rate = self._tau / self._cost          # NaN without a cost or an acceptance
        self._costed_at = np.flatnonzero(np.isfinite(self._cost)).tolist()
        rated = np.flatnonzero(np.isfinite(self._rate))
        if len(rated):
            top = self._rate[rated].max()
            self.home = self.candidates[rated[self._rate[rated] >= (1 - self.slack) * top][-1]]

    def _cost_floor(self, i: int) -> float:
        """The least candidate i's round can cost, from the measured ones: a wider tree
        costs no less (the nearest measured candidate's cost below it); a narrower one no
        less per node (cost(b) >= cost(m) b / m, m the nearest measured above), and, with two
        measured above, saves per node no more than they differ per node, less
        :data:`SECANT_MARGIN` (a round's fixed part, the draft and the launches, stays)."""
        costed, b = self._costed_at, self.candidates[i]
        above = [j for j in costed if j > i]
        below = [j for j in costed if j < i]
        floor = float(self._cost[below[-1]]) if below else 0.0
        if not above:
            return floor
        m, c = self.candidates[above[0]], float(self._cost[above[0]])
        floor = max(floor, c * b / m)
        if len(above) > 1:
            m2, c2 = self.candidates[above[1]], float(self._cost[above[1]])
            slope = max(c2 - c, 0.0) / (m2 - m)
            floor = max(floor, (1 - SECANT_MARGIN) * (c - slope * (m - b)))
        return floor

    def _plausible(self, i: int, best_rate: float) -> bool:
        """Whether candidate i (no cost yet) could beat ``best_rate``: its acceptance over its
        cost floor.  Its acceptance: the paired estimate; where none (unpaired rounds) that
        of the nearest wider candidate measured (a narrower tree accepts no more); above
        every budget run, the widest one's plus its last doubling's gain (acceptance grows
        less with each doubling), for the next candidate only (the others are reached by
        climbing)."""
        tau = self._tau[i]
        if not np.isfinite(tau):
            known = np.flatnonzero(np.isfinite(self._tau))
            wider = known[known > i]
            if len(wider):
                tau = self._tau[wider[0]]
            elif len(known) and i == known[-1] + 1:
                top = known[-1]
                gain = self._tau[top] - self._tau[top - 1] if top else np.inf
                tau = self._tau[top] + (gain if np.isfinite(gain) else np.inf)
            else:
                return False
        floor = self._cost_floor(i)
        return floor <= 0 or tau / floor > (1 + TIE) * best_rate

    def _next_v2(self) -> int:
        b = self._choose_v2()
        if b != self.home:
            self._away = self.round
        return b

    def _choose_v2(self) -> int:
        h = self.index[self.home]
        if not self._costed(h):            # first the budget it runs: the rates' baseline
            return self.home
        rates = self._rate[np.isfinite(self._rate)]
        best_rate = float(rates.max()) if len(rates) else 0.0
        # 1. a budget that could win but has no steady cost yet: measure it (one already
        #    begun first, then the widest: its rounds measure the acceptance of all below it)
        could = [i for i in range(len(self.candidates))
                 if i not in self._costed_at and self._plausible(i, best_rate)]
        if could:
            # begun: it ran (an eager or capturing first round leaves no cost behind)
            begun = [i for i in could if self.est[self.candidates[i]].rounds]
            pick = (begun or could)[-1]
            if pick > h:                   # a round above home: the next turn is below it
                self._probe_up = True
            return self.candidates[pick]
        # 2. reprobe / 2 rounds after the last round away from home, by turns: one round
        #    above the home budget (its acceptance on the same text, and its cost), or the
        #    stalest cost below it that is within REFRESH of the best rate (costs drift
        #    slowly: the context grows).  Counted from the last one, not by the clock: a
        #    probe right after a measurement would re-measure what was just seen
        half = max(self.reprobe // 2, 1)
        if self.reprobe and self.round - self._away >= half:
            self._probe_up = not self._probe_up
            if self._probe_up and h + 1 < len(self.candidates):
                return self.candidates[h + 1]
            near = [b for i, b in enumerate(self.candidates[:h])
                    if np.isfinite(self._rate[i]) and self._rate[i] >= (1 - REFRESH) * best_rate]
            if near:
                return min(near, key=lambda b: self.est[b].last_round)
            self._away = self.round      # no such budget: the turn is spent (one up follows
            #                              reprobe / 2 rounds later, not at once)
        return self.home

    def summary(self) -> dict:
        """Per budget that ran: rounds, tau, cost (ms) and rate (None where no round of it was
        timed: v2's unsteady rounds); and the best budget now.  v2: tau is the paired
        estimate (module docstring), and ``paired_tau`` has it for every candidate a round
        measured."""
        def tau(b, e):
            return float(self._tau[self.index[b]]) if self.v2 and np.isfinite(
                self._tau[self.index[b]]) else e.tau

        def rate(b, e):
            return tau(b, e) / e.cost() if e.cost() > 0 else 0.0
        rows = {b: {"rounds": e.rounds, "tau": round(tau(b, e), 3),
                    "round_ms": round(1e3 * e.cost(), 3) if e.timed else None,
                    "tokens_per_s": round(rate(b, e), 1) if e.timed else None}
                for b, e in self.est.items() if e.rounds}
        out = {"candidates": list(self.candidates), "best": self.best(), "per_budget": rows}
        if self.v2:
            out["paired_tau"] = {b: round(float(t), 3) for b, t in zip(self.candidates,
                                                                       self._tau)
                                 if np.isfinite(t)}
        return out


# budget="auto"'s policies, kept across generate() calls (the module docstring, "Kept
# across calls"): per model (dropped with it), by what a round's cost and acceptance depend
# on besides the text
_KEPT_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
KEPT_AUTO_PER_MODEL = 32


def kept_auto_budget(model, drafter, batch: int, sampling: Sampling, on_device: bool,
                     draft_temperature: float, lookup=None) -> AutoBudget:
    """The AutoBudget ``generate(..., budget="auto")`` runs: the one kept for this model,
    drafter (the very object: a new one, even of the same file, starts afresh), batch,
    sampling, draft temperature, prompt lookup, kind of round (device or host) and runtime
    switches, made on first use.  What it learnt (each budget's cost, its paired acceptance) is the
    machine's and the model's, not the prompt's, so a later call starts from it instead of
    climbing again; :func:`forget_auto_budgets` drops them, and an ``AutoBudget`` passed as
    ``budget`` is the caller's own (a new one: fresh)."""
    kept = _KEPT_AUTO.setdefault(model, collections.OrderedDict())
    key = (id(drafter), int(batch), sampling, bool(on_device), float(draft_temperature),
           lookup, runtime.current())
    ref, policy = kept.get(key, (None, None))
    if ref is None or ref() is not drafter:      # an id reused by a new drafter: afresh
        policy = AutoBudget()
        kept[key] = (weakref.ref(drafter), policy)
    kept.move_to_end(key)
    while len(kept) > KEPT_AUTO_PER_MODEL:       # a server's many samplings: the oldest go
        kept.popitem(last=False)
    return policy


def forget_auto_budgets(model=None) -> None:
    """Drop the kept ``budget="auto"`` policies of ``model`` (None: of every model), so its
    next auto generation climbs from the start."""
    if model is None:
        _KEPT_AUTO.clear()
    else:
        _KEPT_AUTO.pop(model, None)

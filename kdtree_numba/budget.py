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

It climbs: it starts at ``start``, measures the neighbours (half and double) of the best
budget so far before trusting it, and every ``reprobe`` rounds measures again the neighbour
it has not seen for longest, since the text (and with it tau) drifts.  A budget's cost is the
median of its last 8 rounds, ignoring its first :data:`WARM_ROUNDS` once there are more (a
shape's first call runs eagerly and may compile kernels, its second captures its CUDA
graph: kdtree_numba/graphs.py); its tau is a running mean that forgets (``decay``), to follow
the text.

With ``KDTREE_AUTO_V2=1`` (``runtime.current().auto_v2`` when the policy is made, or
``v2=True``; issue 36: on the GPU auto lost ~25% to the best fixed budget):

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
"""
from __future__ import annotations

import collections
import dataclasses
from statistics import median

from kdtree_numba import runtime

__all__ = ["AutoBudget", "BudgetEstimate", "DEFAULT_CANDIDATES", "WARM_ROUNDS"]

DEFAULT_CANDIDATES = (2, 4, 8, 16, 32, 64, 128, 256)
# a budget's rounds that may be slower than its steady state: the first (eager: compiles),
# the second (the CUDA graph's capture)
WARM_ROUNDS = 2
RECENT = 8       # a budget's cost: the median of its last RECENT rounds


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


class AutoBudget:
    """Chooses each round's budget (module docstring).  ``next_budget()`` before a round,
    ``observe(budget, seconds, tau, steady=None)`` after it; ``summary()`` for the stats.
    ``v2``: ``KDTREE_AUTO_V2``'s steady costs (None: ``runtime.current().auto_v2``)."""

    def __init__(self, candidates=DEFAULT_CANDIDATES, *, start: int = 32, reprobe: int = 16,
                 decay: float = 0.2, max_budget: int | None = None, v2: bool | None = None):
        cands = sorted({int(b) for b in candidates if int(b) >= 1 and
                        (max_budget is None or int(b) <= max_budget)})
        if not cands:
            raise ValueError(f"no candidate budget in {tuple(candidates)} is within 1.."
                             f"{max_budget}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.candidates = tuple(cands)
        self.start = min(cands, key=lambda b: (abs(b - start), b))
        self.reprobe, self.decay = int(reprobe), float(decay)
        self.v2 = runtime.current().auto_v2 if v2 is None else bool(v2)
        self.est = {b: BudgetEstimate(b) for b in cands}
        self.round = 0

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
        done = [b for b in self.candidates if self.est[b].timed]
        if not done:
            return self.start
        return max(done, key=lambda b: (self.est[b].rate(), -b))

    def next_budget(self) -> int:
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
                steady: bool | None = None) -> None:
        """A round at ``budget`` took ``seconds`` and committed ``tau`` tokens a request;
        ``steady``: whether it replayed a CUDA graph (None: unknown; module docstring; v2
        only, the v1 policy takes every round as of unknown steadiness)."""
        e = self.est[budget]
        e.add(seconds, steady if self.v2 else None)
        e.tau = float(tau) if e.rounds == 0 else (1 - self.decay) * e.tau + self.decay * tau
        e.rounds += 1
        e.last_round = self.round
        self.round += 1

    def summary(self) -> dict:
        """Per budget that ran: rounds, tau, cost (ms) and rate (None where no round of it was
        timed: v2's unsteady rounds); and the best budget now."""
        rows = {b: {"rounds": e.rounds, "tau": round(e.tau, 3),
                    "round_ms": round(1e3 * e.cost(), 3) if e.timed else None,
                    "tokens_per_s": round(e.rate(), 1) if e.timed else None}
                for b, e in self.est.items() if e.rounds}
        return {"candidates": list(self.candidates), "best": self.best(), "per_budget": rows}

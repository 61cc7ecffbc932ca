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
median of its last rounds, ignoring its first :data:`WARM_ROUNDS` once there are more (a
shape's first call runs eagerly and may compile kernels, its second captures its CUDA
graph: kdtree_numba/graphs.py); its tau is a running mean that forgets (``decay``), to follow
the text.
"""
from __future__ import annotations

import dataclasses
from statistics import median

__all__ = ["AutoBudget", "BudgetEstimate", "DEFAULT_CANDIDATES", "WARM_ROUNDS"]

DEFAULT_CANDIDATES = (2, 4, 8, 16, 32, 64, 128, 256)
# a budget's rounds that may be slower than its steady state: the first (eager: compiles),
# the second (the CUDA graph's capture)
WARM_ROUNDS = 2


@dataclasses.dataclass
class BudgetEstimate:
    """What the rounds at one budget measured."""
    budget: int
    rounds: int = 0
    tau: float = 0.0                 # running mean of committed tokens per request-round
    seconds: list = dataclasses.field(default_factory=list)   # wall time per round
    last_round: int = -1             # the policy's round counter at its latest sample

    def cost(self) -> float:
        """Median of the last 8 rounds' seconds, the first :data:`WARM_ROUNDS` excluded once
        there are more (they may have compiled or captured); before that the fastest so far."""
        xs = self.seconds[WARM_ROUNDS:] or [min(self.seconds)]
        return median(xs[-8:])

    def rate(self) -> float:
        """Expected committed tokens per second per request."""
        c = self.cost()
        return self.tau / c if c > 0 else 0.0


class AutoBudget:
    """Chooses each round's budget (module docstring).  ``next_budget()`` before a round,
    ``observe(budget, seconds, tau)`` after it; ``summary()`` for the stats."""

    def __init__(self, candidates=DEFAULT_CANDIDATES, *, start: int = 32, reprobe: int = 16,
                 decay: float = 0.2, max_budget: int | None = None):
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
        self.est = {b: BudgetEstimate(b) for b in cands}
        self.round = 0

    @property
    def max_budget(self) -> int:
        return self.candidates[-1]

    def _neighbours(self, b: int) -> list[int]:
        i = self.candidates.index(b)
        return [self.candidates[j] for j in (i - 1, i + 1) if 0 <= j < len(self.candidates)]

    def _measured(self, b: int) -> bool:
        return len(self.est[b].seconds) > WARM_ROUNDS     # one round past its warm-up

    def best(self) -> int:
        """The measured budget with the highest expected rate (the start before any)."""
        done = [b for b in self.candidates if self.est[b].rounds]
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

    def observe(self, budget: int, seconds: float, tau: float) -> None:
        e = self.est[budget]
        e.seconds.append(float(seconds))
        e.tau = float(tau) if e.rounds == 0 else (1 - self.decay) * e.tau + self.decay * tau
        e.rounds += 1
        e.last_round = self.round
        self.round += 1

    def summary(self) -> dict:
        """Per measured budget: rounds, tau, cost (ms) and rate; and the budget chosen last."""
        rows = {b: {"rounds": e.rounds, "tau": round(e.tau, 3),
                    "round_ms": round(1e3 * e.cost(), 3), "tokens_per_s": round(e.rate(), 1)}
                for b, e in self.est.items() if e.rounds}
        return {"candidates": list(self.candidates), "best": self.best(), "per_budget": rows}

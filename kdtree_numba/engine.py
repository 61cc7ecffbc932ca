"""Batched generation: autoregressive (AR), DDTree and greedy-chain speculative decoding.

``generate(model, prompts, max_new_tokens, method="ar"|"chain"|"ddtree", drafter=...,
budget=32, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos=None, draft_temperature=None)
-> GenerationResult``

Sequence bookkeeping (per request b): ``seq[b]`` = prompt + committed tokens.  The last committed
token is the *root*: the next token fed to the target.  The target cache always holds
``len(seq[b]) - 1`` tokens.

* Prefill: one causal forward over the right-padded prompts; the logits at each prompt's last
  row give the first new token.
* AR step: one forward of the roots (n = 1), commit 1, choose the next token.  Steps run one
  ahead: step j + 1 is launched on step j's tokens while they are still on the device, before
  the host reads them (``_ar_steps``), so the device does not idle through the host's read and
  launches between steps.  With ``ar_device_steps`` K > 0 (``KDTREE_AR_DEVICE_STEPS``; on a
  real GPU K = 4 by default) one launch runs K steps as one device program, each block
  launched before the last one is read (kdtree_numba/device_ar.py): the same tokens, the
  host's work paid once per K.
* DDTree round (docs/DDTREE.md, docs/ENGINE.md): drafter logits [bs, L, V] (/ the draft
  temperature t_d where it is not 1: ``steps.draft_temperature``) -> ``topk_logprobs``
  (k = min(budget, V)) -> ``build_tree`` -> ``compile_tree`` (start = cache lengths) -> ONE
  target forward over [root + B nodes] with the ancestor mask (KV written at [len, len+B+1)) ->
  accept (``accept_greedy`` on the target's argmax at T = 0, ``accept_sampled`` at T > 0) ->
  ``compact_kv`` of the accepted rows -> lengths += acc_len -> the bonus token is the next root.
  Each round commits the accepted nodes' tokens and the bonus token.
* Chain round: the same with the drafter's own greedy chain instead of a tree (top-K with
  k = 1 and a budget of L: each node's one child is its row's argmax), for every drafter.
* The drafter (kdtree_numba/drafting.py: the protocol) is asked once a round for its logits
  (``propose`` of a ``DraftContext``: the roots and their positions) and told after the
  prefill and after each round what the target verified (``on_commit`` of a ``Commit``):
  with it, what its ``needs`` declares: the target's hidden state at the row that chose each
  root, the residual streams after some target layers at the verified tokens (a DFlash
  drafter's context, kdtree_numba/dflash.py), or the verified tokens.  The prefill and each
  verify forward return exactly those, gathered on the device; the engine never asks what
  kind of drafter it holds.

Sampling (T > 0) is lossless *and* reproducible across methods: the token at absolute position p
of request b is drawn by inverse CDF from the target's softmax at temperature T, truncated by
``top_k`` (0: off) and ``top_p`` (1: off) and renormalised (``reference.ddtree.Sampling``, the
rule of ``sample_targets``; every method applies it to the target's logits) with the uniform
``U_b[p]`` from ``numpy.random.default_rng([seed, b])``.  AR uses ``U_b[p]`` for its token at p;
a DDTree node at depth d samples the target's token at position ``start + d + 1`` with
``U_b[start + d + 1]`` (siblings share it; only one path is ever committed, so every committed
token uses a fresh uniform and is an exact target sample).  Hence for a fixed seed DDTree and AR
produce the same tokens at any temperature, top-p and top-k (both choose with one sampling
kernel), up to a verify's logits differing from a decode's in their last bits (a kernel
whose summation order depends on the rows it is given) and flipping a draw that sits on a
CDF boundary: never seen on the float64 reference, a few prompts in 32 on the GPU at T = 1
(docs/BENCHMARKS.md, "Demo pair"); every token is still an exact sample of the target.

Finished requests (eos emitted or max_new_tokens reached) stop growing; the batch keeps running
until every request is finished (their rows are computed and discarded).

Host synchronisation (docs/ENGINE.md, "Sync points"): on the GPU a round, and an AR step, waits
for the device exactly once, when it reads the committed tokens (one packed int32 array for a
DDTree round: acc_len and the committed tokens).  Everything else stays on the device or is
host bookkeeping (lengths, sequences); phase timings come from markers read after the fact.

All device work is a model method: ``prefill``, ``decode``, ``forward`` (the verify), and the
device steps ``choose``, ``draft_tree``, ``accept``, ``last_accepted``, ``accepted_rows`` and
``compact`` (kdtree_numba/steps.py).  On the GPU the model replays them from CUDA graphs once
their shapes repeat (kdtree_numba/graphs.py, docs/ENGINE.md); the engine keeps only host state
(sequences, lengths, stats) and uses the backend for uploads, its reads, timing markers and
frees.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.budget import (DEFAULT_CANDIDATES, AutoBudget, forget_auto_budgets,  # noqa: F401
                                  kept_auto_budget)
from kdtree_numba.device_ar import decode as decode_on_device
from kdtree_numba.device_ar import steps_per_launch
from kdtree_numba.device_round import (DeviceRounds, device_rounds_possible, plan_launch,
                                       rounds_per_launch_of)
from kdtree_numba.drafting import NO_NEEDS, Commit, DraftContext, TargetNeeds, check_top_k
from kdtree_numba.model import ForwardBatch
from kdtree_numba.lookup import TokenHistory, resolve as resolve_lookup
from kdtree_numba.steps import draft_temperature as resolve_draft_temperature
from kdtree_numba.steps import tree_depth
from reference.ddtree import Sampling, accepted_slots

__all__ = ["generate", "GenerationResult", "GenerationStats", "METHODS", "uniform_table",
           "cache_slots", "runs_device_rounds", "kept_auto_budget", "forget_auto_budgets"]

METHODS = ("ar", "chain", "ddtree")
# "round": a whole DDTree round run as one device program (device_rounds)
PHASES = ("prefill", "decode", "draft", "tree_build", "verify", "accept", "compaction",
          "round")


@dataclasses.dataclass
class GenerationStats:
    method: str
    backend: str
    batch: int
    budget: int | str | None            # "auto": chosen per round (kdtree_numba/budget.py)
    block_len: int | None
    draft_temperature: float | None = None  # t_d the DDTree trees were built with (ddtree only)
    prompt_lookup: object = None        # its trees' PromptLookup (kdtree_numba/lookup.py)
    kv_cache_bytes: int = 0             # target KV cache (c + k_pe, all layers)
    # AR steps (with the one eos may waste; on the device K a launch) or DDTree rounds
    rounds: int = 0
    # device rounds enqueued for requests that the round before them finished: their tokens
    # are dropped (device_rounds only; AR's wasted step counts in rounds)
    rounds_dropped: int = 0
    new_tokens: int = 0                 # committed tokens returned, all requests
    seconds: float = 0.0                # wall time of generate(), prefill included
    time: dict = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PHASES})
    tau: list = dataclasses.field(default_factory=list)  # per round: acc_len of active requests
    budgets: list = dataclasses.field(default_factory=list)  # per DDTree round: its budget
    budget_auto: dict | None = None     # --budget auto: AutoBudget.summary() at the end
    # the target model's CUDA graphs during this call (kdtree_numba/graphs.py); None: graphs off
    graph_captures: int | None = None
    graph_replays: int | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one per request, over the time after prefill."""
        t = self.seconds - self.time["prefill"]
        return max(self.new_tokens - self.batch, 0) / t if t > 0 else 0.0

    @property
    def mean_tau(self) -> float:
        flat = [a for r in self.tau for a in r]
        return float(np.mean(flat)) if flat else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s,
                 mean_tau=self.mean_tau)
        return d


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]             # new tokens per prompt (eos included when emitted)
    stats: GenerationStats


def uniform_table(seed: int, request: int, length: int) -> np.ndarray:
    """``U_b[p]`` for p < length: the uniforms of request b (prefix-stable in ``length``)."""
    return np.random.default_rng([int(seed), int(request)]).random(length)


class _PhaseClock:
    """Phase durations from markers (``Backend.mark``: a CUDA event on the GPU) recorded at
    each phase boundary.  ``lap(phase)`` charges the time since the previous marker to phase;
    the sums are resolved only for markers the device has already passed (``settle``, called
    after each round's read, when all of its earlier markers are), so timing never waits.
    ``finish`` resolves the rest after the final synchronize.  Markers are recycled: a handful
    of events serve the whole generation."""

    def __init__(self, backend, stats: GenerationStats):
        self.backend, self.stats = backend, stats
        self.last = backend.mark()
        self.pending: collections.deque = collections.deque()

    def lap(self, phase: str) -> None:
        self.pending.append((phase, self.backend.mark()))

    def settle(self) -> None:
        be = self.backend
        while self.pending and be.passed(self.pending[0][1]):
            phase, marker = self.pending.popleft()
            self.stats.time[phase] += be.seconds_between(self.last, marker)
            be.recycle(self.last)
            self.last = marker

    def finish(self) -> None:
        """After ``backend.synchronize()``: every marker has been passed."""
        self.settle()
        self.backend.recycle(self.last)


class _Requests:
    """Host-side state of the batch: sequences, outputs, finished flags."""

    def __init__(self, prompts, max_new_tokens, eos):
        self.seq = [list(p) for p in prompts]
        self.out: list[list[int]] = [[] for _ in prompts]
        self.active = np.ones(len(prompts), bool)
        self.max_new, self.eos = max_new_tokens, eos

    def commit(self, b: int, tokens: Sequence[int]) -> None:
        """Append committed tokens, stopping at eos or max_new_tokens."""
        for t in tokens:
            if not self.active[b]:
                return
            self.seq[b].append(int(t))
            self.out[b].append(int(t))
            if (self.eos is not None and int(t) == self.eos) or len(self.out[b]) >= self.max_new:
                self.active[b] = False

    def committed(self) -> int:
        """Tokens committed so far, all requests."""
        return sum(len(o) for o in self.out)

    def roots(self) -> np.ndarray:
        return np.array([s[-1] for s in self.seq], np.int32)


def _check_prompts(prompts, vocab: int) -> list[np.ndarray]:
    if len(prompts) == 0:
        raise ValueError("generate needs at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        p = np.asarray(p, np.int64).reshape(-1)
        if p.size == 0:
            raise ValueError(f"prompt {i} is empty")
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"prompt {i} holds token ids outside [0, {vocab})")
        out.append(p)
    return out


def _prefill(model, cache, prompts, req: _Requests, sampling, tables, timer, drafter,
             needs: TargetNeeds):
    """The prompts' one causal forward, the first token of each request, and the drafter's
    first commit: the prompt, with what ``needs`` asks of the target (its context started
    once the prefill is enqueued: the host's work while the device runs it).  Returns the first
    tokens on the device and their read, started after the drafter's commit is enqueued (it
    needs no host value: the device runs it behind the prefill while the host issues it);
    the caller waits for the read (:func:`_commit_first`), where it may after enqueuing the
    first device round (``KDTREE_EARLY_ROUND``)."""
    be, bs = model.backend, len(prompts)
    lens = np.array([p.size for p in prompts], np.int64)
    out = model.prefill(cache, prompts, return_hidden=needs.hidden,
                        capture_layers=needs.feature_layers)
    if drafter is not None:
        drafter.start(bs, cache.max_len)
    parts = out if isinstance(out, tuple) else (out,)
    chosen = model.choose(parts[0], sampling, _uniforms_at(tables, lens))
    read_first = be.read_later(chosen)
    if drafter is not None:
        tokens = None
        if needs.tokens:          # the prompt, then the first token (drafting.Commit)
            ids = np.zeros((bs, int(lens.max()) + 1), np.int32)
            for b, p in enumerate(prompts):
                ids[b, :p.size] = p
            tokens = be.asarray(ids)
            tokens[be.xp.arange(bs), be.asarray(lens)] = chosen
        drafter.on_commit(Commit(counts=be.asarray(lens.astype(np.int32)),
                                 next_roots=chosen, counts_host=lens, tokens=tokens,
                                 hidden=parts[1] if needs.hidden else None,
                                 features=parts[-1] if needs.feature_layers else None))
    timer.lap("prefill")
    return chosen, read_first


def _uniforms_at(tables, positions) -> np.ndarray:
    """Each request's uniform at its position (the table's last past its end); zeros where
    there are no tables (T = 0: the choice reads none)."""
    if tables is None:
        return np.zeros(len(positions))
    return np.array([t[min(int(p), len(t) - 1)] for t, p in zip(tables, positions)])


def _commit_first(req: _Requests, read_first) -> None:
    """The prefill's first tokens read (the read started with the prefill) and committed."""
    for b, token in enumerate(np.asarray(read_first(), np.int64)):
        req.commit(b, [token])


def _ar_steps(model, cache, req: _Requests, sampling, tables, timer, stats, after_step):
    """AR steps, each launched one step ahead: step j+1 is enqueued on step j's chosen tokens
    while they are still on the device, and only then does the host read step j's tokens.  So
    the device never waits for the host's read, bookkeeping and launches between steps (on
    the H200 a decode step's GPU-clock time was 0.2-0.5 ms over its 2.43 ms forward, runs
    78-89).  Same tokens: step j+1 takes the rows the count (max_new_tokens) leaves running;
    a row that step j's token finishes (eos) also ran step j+1, whose token is dropped and
    whose cache slot is rolled back (so when eos ends the last running request, the step
    count and the ``after_step`` calls are one more than one step at a time would make).
    ``after_step()`` runs after each step's commit.  Every step still reads the device once."""
    be, bs = model.backend, cache.batch
    tokens = req.roots()                   # host: the prefill's tokens
    pending = None                         # (wait for its tokens, rows it ran) in flight
    launched = None
    try:
        while True:
            rows = req.active.copy()
            if pending is not None:        # the pending token leaves these short of max_new
                rows &= np.array([len(out) + 1 < req.max_new for out in req.out])
            launched = None
            with be.deferred_frees():      # numba frees wait for the step's read
                if rows.any():
                    logits = model.decode(cache, tokens)
                    cache.advance(rows.astype(np.int64))
                    chosen = model.choose(logits, sampling, _uniforms_at(tables, cache.lengths))
                    timer.lap("decode")
                    stats.rounds += 1
                    launched = (be.read_later(chosen), rows)
                    tokens = be.xp.asarray(chosen).reshape(bs)   # the next step's, on device
                if pending is not None:
                    wait, ran = pending
                    pending = None
                    got = np.asarray(wait(), np.int64)
                    for b in np.flatnonzero(ran):
                        req.commit(b, [got[b]])
                    if launched is not None:   # rows the commit finished ran a step too many
                        extra = launched[1] & ~req.active
                        if extra.any():
                            cache.truncate(cache.lengths - extra)
                            launched = (launched[0], launched[1] & req.active)
                    after_step()
            if launched is None:
                return
            pending, launched = launched, None
    except BaseException:
        # a read still in flight writes into pinned memory that its wait() keeps alive: let
        # it land before that memory can go back to CuPy's pool and be reused
        for step in (pending, launched):
            if step is not None:
                try:
                    step[0]()
                except Exception:
                    pass
        raise


def _ddtree_round(model, cache, drafter, req: _Requests, budget, sampling, table, timer,
                  stats, k: int | None = None, needs: TargetNeeds = NO_NEEDS, on_round=None,
                  while_verifying=None, draft_temperature: float = 1.0,
                  max_depth: int | None = None, lookup=None, history=None):
    """One round (a tree, or with ``k = 1`` and ``budget = L`` the greedy chain).  Its device
    work is the drafter's, then the model's: the tree, the verify forward, the acceptance,
    the compaction (on the GPU each one CUDA-graph launch once its shapes repeat); then the
    round's one read, then (DFlash) the drafter's context update.  ``on_round``: generate's
    hook, handed the round's device arrays right after the acceptance.
    ``while_verifying()``: host work run once the verify is launched, while the device runs
    it (the last round's report: generate).  ``draft_temperature``: the tree's t_d
    (``steps.draft_temperature``).  ``max_depth``: the tree's depth cap (``steps.tree_depth``;
    None: the budget's).  ``lookup``, ``history``: the tree's prompt lookup and the requests'
    token history (a kdtree_numba.lookup.TokenHistory), or None."""
    be = model.backend
    # the roots and their positions go up once: the drafter, the tree and the acceptance read
    # these device copies
    roots = be.asarray(req.roots())
    start = be.asarray(cache.lengths.astype(np.int32))
    depth = budget if max_depth is None else min(budget, max_depth)
    draft_logits = drafter.propose(DraftContext(roots=roots, positions=start, depth=depth,
                                                temperature=sampling.temperature))
    if max_depth is not None and draft_logits.shape[1] > depth:   # a drafter of whole blocks
        draft_logits = draft_logits[:, :depth]
    timer.lap("draft")
    # borrowed: the tree, the verify's outputs and the acceptance may be their CUDA graphs'
    # own buffers (no copies on the host's path from the read to the verify's launch); the
    # round consumes them before its read, and the next round's replays come after it
    tree, vin = model.draft_tree(draft_logits, roots, start, budget, k, borrow=True,
                                 draft_temperature=draft_temperature, lookup=lookup,
                                 history=None if history is None else history.array)
    timer.lap("tree_build")
    # causal: a tree's parents precede their children (the builder's invariant parent[i] < i)
    out = model.forward(ForwardBatch(vin.input_ids, vin.positions, vin.visible, causal=True,
                                     return_hidden=needs.hidden,
                                     capture_layers=needs.feature_layers), cache, borrow=True)
    parts = out if isinstance(out, tuple) else (out,)
    logits = parts[0]
    timer.lap("verify")
    if while_verifying is not None:
        while_verifying()
    acc_idx, acc_len, packed, next_roots = model.accept(tree, logits, sampling, table,
                                                        start, borrow=True)
    if on_round is not None:
        on_round(tree, acc_idx, acc_len)
    # what the drafter needs, gathered on the device before the read: the row of the last
    # accepted node (it chose the next root), the rows of the root and the accepted nodes,
    # the verified tokens
    hidden = model.last_accepted(parts[1], acc_idx, acc_len) if needs.hidden else None
    features = model.accepted_rows(parts[-1], acc_idx) if needs.feature_layers else None
    tokens = model.committed_tokens(packed, roots) if needs.tokens else None
    if history is not None:
        history.record(start, packed, be.asarray(req.active))
    timer.lap("accept")
    model.compact(cache, acc_idx, acc_len)
    timer.lap("compaction")
    packed = be.to_host(packed)        # THE host read of the round
    active = req.active.copy()
    grow = np.where(active, packed[:, 0], 0)
    cache.advance(grow)
    # launches only: a drafter's own context grows as the target's cache does
    drafter.on_commit(Commit(counts=acc_len, next_roots=next_roots, counts_host=grow,
                             tokens=tokens, hidden=hidden, features=features))
    stats.tau.append([int(packed[b, 0]) for b in np.flatnonzero(active)])
    for b in np.flatnonzero(active):
        req.commit(b, packed[b, 1:1 + int(packed[b, 0])])
    return packed, active


def _paths(packed, rows) -> list:
    """The accepted nodes' slots of the requests ``rows`` (host bools) from a round's packed
    read: what ``--budget auto`` learns every smaller budget's acceptance from
    (kdtree_numba/budget.py, "Paired tau"); no read of its own."""
    return [accepted_slots(packed, b) for b in np.flatnonzero(rows)]


def _replayed(before, after) -> bool | None:
    """Whether the one graph call between two ``model.graph_counts()`` (captures, replays)
    replayed a captured graph: False where it captured one (a capture replays it at once) or
    ran eagerly, None where graphs are off."""
    if before is None or after is None:
        return None
    return after[0] == before[0] and after[1] == before[1] + 1


def _device_rounds(model, cache, drafter, req: _Requests, budget, k, sampling, seed: int,
                   timer, stats, after_step, policy: AutoBudget | None = None,
                   draft_temperature: float = 1.0, per_launch: int = 1, lookup=None,
                   first=None) -> None:
    """The rounds of a device-only drafter as device programs, each launch enqueued before
    the previous one's tokens reach the host (kdtree_numba/device_round.py).  A request is
    launched while it may still need tokens: running, and short of max_new_tokens by more
    than the rounds in flight commit at the least (one token each).  With ``per_launch`` > 1
    (``device_round.plan_launch``) a launch runs that many rounds where some request it
    launches looks to need them, else one, and a request the rounds in flight look to finish
    waits for their read instead of running ahead, so few rounds run past its end.

    With ``policy`` (``--budget auto``) each launch asks it for its budget, one round before
    the last one's tokens are read, and a round's cost is the wall time from the previous
    read's end to its own, less the next round's launch made in between, plus its own
    launch: with a round always in flight (a replayed graph, whose launch returns at once)
    the device runs them back to back, so that is the round's device time, or more where the
    host is late (also a cost); where a launch runs its round before returning (the
    reference backend, the simulator, an eager round) the wall time between the reads is the
    next round's, and its own launch is its cost (a launch of n rounds: each its n-th).

    ``first``: the prefill's first tokens not yet read (``_prefill``'s device tokens and
    read): the first round starts on the device's copy, enqueued before the read, and
    after_step reports the prefill once they are committed."""
    table = None if sampling.greedy else _cache_uniforms(seed, cache)
    rounds = DeviceRounds.for_generation(model, cache, drafter, req.roots() if first is None
                                         else first[0], k, sampling, table,
                                         draft_temperature, lookup, req.seq)
    budgets = []                        # of the launches in flight, oldest first: [b, launch
    # s, steady]: whether it replayed a captured graph (None: no graphs), for the policy's costs
    seen = [0, 0]                       # tokens committed, request-rounds: their mean
    near_end = runtime.current().wait_near_end

    def launch(active, n: int = 1) -> float:
        """The launch of ``n`` rounds; its wall time."""
        b = policy.next_budget() if policy else budget
        before = model.graph_counts() if policy else None    # only a policy asks
        t = time.perf_counter()
        rounds.launch(active, b, n)
        launched = time.perf_counter() - t
        budgets.append([b, launched, _replayed(before, model.graph_counts()) if policy
                        else None])
        timer.lap("round")
        return launched
    try:
        if req.active.any():
            launch(req.active.copy())
        if first is not None:
            # the round went in before the prefill's read: a replayed round ran partly during
            # that read, which its wall time from here misses (its seconds set aside, its tau
            # kept); one that ran inside its launch (no graphs) has that launch as its cost
            if budgets and budgets[-1][2] is not None:
                budgets[-1][2] = False
            _commit_first(req, first[1])
            after_step()
        read_end = time.perf_counter()
        while rounds.in_flight:
            # the next launch goes in before this one is read
            ahead, n = plan_launch(req, rounds.rounds_in_flight, per_launch, seen, near_end)
            next_launch = launch(ahead, n) if ahead.any() else 0.0
            packs, ran = rounds.collect()
            b, own_launch, steady = budgets.pop(0)
            if steady and ahead.any() and budgets[-1][2] is False:
                # the next launch ran eagerly (or captured) while this one ran: the read
                # came early, so the device time its cost subtracts is not the launch's own
                steady = False
            now = time.perf_counter()
            cost = (now - read_end - next_launch + own_launch) / len(packs)
            read_end = now
            for packed in packs:
                running = ran & req.active
                if not running.any():   # run ahead for requests an earlier round finished
                    stats.rounds_dropped += 1
                    continue
                stats.tau.append([int(packed[b_, 0]) for b_ in np.flatnonzero(running)])
                stats.budgets.append(b)
                if policy:
                    policy.observe(b, cost, float(np.mean(stats.tau[-1])), steady=steady,
                                   paths=_paths(packed, running))
                stats.rounds += 1
                seen[0], seen[1] = seen[0] + sum(stats.tau[-1]), seen[1] + len(stats.tau[-1])
                for r in np.flatnonzero(running):
                    req.commit(r, packed[r, 1:1 + int(packed[r, 0])])
            if not rounds.in_flight and req.active.any():
                # none went ahead (the rounds read looked to finish every request): launched
                # after the read, its launch time is inside its wall time already
                launch(req.active.copy(), plan_launch(req, 0, per_launch, seen, near_end)[1])
                budgets[-1][1] = 0.0
            after_step()
    finally:
        rounds.finish()


def _cache_uniforms(seed: int, cache) -> np.ndarray:
    """The uniforms [bs, cache.max_len + 2] of a device program (host): the same ``U_b[p]``
    as the host's loops, over the cache's whole capacity (a program's table is a buffer of
    the cache's width, reused by every generation on it)."""
    return np.stack([uniform_table(seed, b, cache.max_len + 2) for b in range(cache.batch)])


def cache_slots(longest: int, method: str, budget, block_len: int | None,
                on_device: bool = False, per_launch: int = 1) -> int:
    """The slots a generation's KV caches need for sequences of up to ``longest`` tokens (the
    longest prompt plus ``max_new_tokens``): room past them for the last round's growth of a
    request that finishes in it (up to L + 1 accepted tokens; AR: its one step), with device
    rounds (``on_device``) for one more round run ahead of the host (enqueued for a request
    its unread round finished: kdtree_numba/device_round.py; ``per_launch`` rounds a launch:
    2 ``per_launch`` rounds in all, the launch's own rest and the next launch's), and then for
    the widest write:
    the target's verify block (the largest budget + 1 rows; AR's one token) or a drafter's
    block after its context (L + 1 rows).  AR on the device (``on_device``, ``block_len``
    its K steps a launch: kdtree_numba/device_ar.py): K slots more, which each launch
    reserves past every request's length.  ``budget``: the DDTree budget, an AutoBudget or
    ``"auto"`` (its largest candidate); the chain's is L.

    ``generate`` gives the target's cache and the drafter's context this one capacity, rounded
    up to the same bucket (``Model.cache_for_generation``): a device round's CUDA graph names
    both caches' buffers, and a drafter cache sized on its own fell in the next bucket for the
    prompts near a bucket's end, a (target, drafter) pair of its own whose graphs a warm-up on
    other prompts never captured (issue 36: run 151's auto row captured 7 while timed)."""
    if method == "ar":
        return int(longest) + 2 + (int(block_len or 0) if on_device else 0)
    if method == "chain":
        budget = block_len
    if budget == "auto":                  # a fresh AutoBudget's largest candidate
        widest = max(DEFAULT_CANDIDATES)
    else:
        widest = budget.max_budget if isinstance(budget, AutoBudget) else int(budget)
    block = int(block_len) + 1
    return int(longest) + block * (2 * int(per_launch) if on_device else 1) + \
        max(widest + 1, block)


def runs_device_rounds(model, method: str, drafter, device_rounds: bool | None = None,
                       on_round=None) -> bool:
    """Whether ``generate`` runs its rounds as device programs (its ``device_rounds``
    argument: True asks for them, a ValueError where the drafter cannot or ``on_round`` is
    set; None follows ``runtime.current().device_rounds``, unset on where the backend runs on
    a GPU; False never)."""
    possible = method != "ar" and on_round is None and device_rounds_possible(drafter)
    if device_rounds and not possible:
        raise ValueError("device_rounds needs a device-only drafter (its propose and "
                         "on_commit read no host value) and no on_round hook")
    if not possible:
        return False
    if device_rounds is None:
        device_rounds = runtime.current().device_rounds
    return bool(model.backend.on_gpu if device_rounds is None else device_rounds)


@runtime.holding
def generate(model, prompts, max_new_tokens: int, *, method: str = "ar", drafter=None,
             budget: int | str | AutoBudget = 32, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             eos: int | None = None, progress=None, stream=None,
             on_round=None, device_rounds: bool | None = None,
             draft_temperature: float | None = None,
             ar_device_steps: int | None = None,
             rounds_per_launch: int | None = None,
             prompt_lookup=None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (module docstring for the algorithm).

    prompts: sequences of token ids (ragged).  methods "ddtree" and "chain" need a
    ``drafter`` (kdtree_numba/drafter.py, kdtree_numba/dflash.py) with the target's
    vocabulary; ``budget`` = tree nodes per round ("ddtree"; a chain verifies the drafter's L
    greedy tokens), or ``"auto"`` (or an ``AutoBudget``): each round's budget chosen from the
    measured cost and acceptance of the rounds so far (kdtree_numba/budget.py; ``"auto"``
    runs the policy kept for this model, drafter, batch and sampling across calls:
    :func:`kept_auto_budget`; an ``AutoBudget`` given is used as it is); the stats keep
    every round's budget (``budgets``) and the estimates (``budget_auto``, of every round the
    policy has seen).
    ``temperature`` (0: greedy), ``top_p`` in (0, 1] (1: off) and ``top_k`` >= 0 (0: off):
    how each token is drawn (``reference.ddtree.Sampling``, which checks them; top_p and
    top_k are ignored at T = 0).
    A drafter that ranks only its ``draft_vocab`` tokens (kdtree_numba/dflash.py) needs a
    DDTree top-K k = min(budget, V) of at most that many (ValueError otherwise).
    ``draft_temperature`` ("ddtree"): the t_d its trees are built with, from the drafter's
    logits / t_d (``steps.draft_temperature``: None is the default policy, a number > 0 a
    fixed t_d); it shapes the tree only, never the tokens (the acceptance reads the target
    alone), and the chain, the drafter's argmax at each depth, ignores it.
    ``progress(done, total)``: called after the prefill and after each AR step (block of
    ``ar_device_steps``) or DDTree round with the tokens committed so far (all requests)
    and at most ``len(prompts) * max_new_tokens``; host bookkeeping only (a
    ``formats.progress.ProgressBar`` fits), so it adds no device wait.  A DDTree or chain
    round's call comes once the next round's verify is launched (the last round's at the
    end), so it overlaps the device's work.  The engine
    itself never prints.
    ``stream(tokens)``: called at the same moments with every request's new tokens so far
    (``tokens[b]``, the engine's own lists: read them, keep or change nothing), so a caller
    can show text as rounds commit (kdtree-run does).
    ``on_round(tree, acc_idx, acc_len)``: called in every DDTree or chain round right after
    the acceptance (never for ar), with the round's tree (a ``DraftTree``: slot 0 the root,
    nodes 1..n_nodes), ``acc_idx`` [bs, L + 1] (the accepted slots, root first) and
    ``acc_len`` [bs] (the round's committed tokens: the accepted nodes and the bonus token),
    all *device* arrays, valid only during the call (on the GPU they may be CUDA-graph
    buffers the next round overwrites): copy on the device what is to be kept.  The engine
    reads nothing for it, so a hook that only copies keeps the one read per round; one that
    reads the device adds its reads (kdtree-run --plot copies, and reads one round after
    generation: kdtree_numba/plots.py, ``RoundRecorder``).
    ``device_rounds``: run each DDTree or chain round as one device program, enqueued before
    the last one's tokens are read (kdtree_numba/device_round.py; the same tokens): True asks
    for it (a ValueError where the drafter cannot: it must be ``device_only``; no
    ``on_round``), None follows ``runtime.current().device_rounds`` where possible
    (``KDTREE_DEVICE_ROUNDS``; unset: on where the backend runs on a GPU, where they pay:
    docs/BENCHMARKS.md), False never.  Its rounds' device time is the phase "round".
    ``ar_device_steps`` (method "ar"): K decode steps a launch as one device program, each
    launch before the last one's tokens are read (kdtree_numba/device_ar.py; the same tokens
    and cache lengths): K (1 to 64) on any backend, 0 the host's loop, None
    ``runtime.current().ar_device_steps`` (``KDTREE_AR_DEVICE_STEPS``; unset: 4 a launch on
    a real GPU, the host's loop under the simulator) on the numba backend and the host's
    loop on the reference backend.  ``stats.rounds`` then
    counts the device's steps, K a launch (those past a request's end included).
    ``prompt_lookup`` ("ddtree"): the tokens that followed the context's last n tokens where
    they occurred before, mixed into the drafter's distributions before each tree is built
    (kdtree_numba/lookup.py: None ``KDTREE_PROMPT_LOOKUP``'s, unset: on the CPU path, False
    off, True on, a weight in (0, 1) or a ``PromptLookup``); it shapes the tree only.
    ``rounds_per_launch`` (device rounds): up to R rounds a launch, 1 to 16 (the same tokens);
    None ``runtime.current().rounds_per_launch`` (``KDTREE_ROUNDS_PER_LAUNCH``, default 1).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    sampling = Sampling(temperature, top_p, top_k)
    t_d = resolve_draft_temperature(sampling, draft_temperature)
    lookup = resolve_lookup(prompt_lookup, method, model.backend)
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    prompts = _check_prompts(prompts, model.vocab_size)
    bs = len(prompts)
    block_len, k, needs = None, None, NO_NEEDS
    speculative = method != "ar"
    if speculative:
        if drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        if method == "ddtree" and budget == "auto":
            budget = kept_auto_budget(
                model, drafter, bs, sampling,
                runs_device_rounds(model, method, drafter, device_rounds, on_round), t_d,
                lookup)
        if isinstance(budget, AutoBudget):
            if method != "ddtree":
                raise ValueError("an automatic budget is for method 'ddtree'")
        elif method == "ddtree" and (not isinstance(budget, (int, np.integer)) or budget < 1):
            raise ValueError(f"budget must be an integer >= 1 or 'auto', got {budget!r}")
        if drafter.vocab_size != model.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target "
                             f"{model.vocab_size}")
        block_len = drafter.block_len
        if method == "chain":         # the drafter's greedy chain: L nodes, one per depth
            budget, k, t_d = block_len, 1, 1.0
        if k is None:                 # DDTree's top-K: k = min(budget, V); auto: its largest
            largest = budget.max_budget if isinstance(budget, AutoBudget) else int(budget)
            check_top_k(drafter, min(largest, model.vocab_size))
        needs = drafter.needs
    policy = budget if isinstance(budget, AutoBudget) else None
    # DDTree's depth cap (the CPU path at T > 0); the chain verifies the drafter's whole block
    max_depth = tree_depth(model.backend, sampling) if method == "ddtree" else None
    on_device = runs_device_rounds(model, method, drafter, device_rounds, on_round)
    if method != "ar" and ar_device_steps:
        raise ValueError(f"ar_device_steps is for method 'ar', not {method!r}")
    ar_steps = steps_per_launch(model.backend, ar_device_steps) if method == "ar" else 0
    per_launch = rounds_per_launch_of(rounds_per_launch, on_device)
    stats = GenerationStats(method=method, backend=model.backend.name, batch=bs,
                            budget=("auto" if policy else budget) if speculative else None,
                            block_len=block_len,
                            draft_temperature=t_d if method == "ddtree" else None,
                            prompt_lookup=lookup)
    # Device arrays of earlier work (the last generate()'s final round, dropped when it
    # returned) sit in numba's free queue; a queue that overflows frees at once, waiting for
    # the device.  Free them here, before the clock starts, not in the middle of a round.
    be = model.backend
    be.free_deferred()
    t0 = time.perf_counter()
    if max_new_tokens == 0:
        return GenerationResult([[] for _ in prompts], stats)
    max_len = cache_slots(max(p.size for p in prompts) + max_new_tokens, method,
                          policy or budget, ar_steps or block_len, on_device or ar_steps > 0,
                          per_launch)
    # the uniforms (T > 0; each a generator's draws, ~30 us a request: none at T = 0)
    tables = None if sampling.greedy else [uniform_table(seed, b, max_len + 2)
                                           for b in range(bs)]
    # DDTree gathers its uniforms on the device: one upload per generate()
    table = be.asarray(np.stack(tables)) if speculative and tables is not None else None
    # the model's last generation cache is reused when it fits: its CUDA graphs replay
    # (a drafter's context takes the same capacity: cache_slots)
    cache = model.cache_for_generation(bs, max_len)
    stats.kv_cache_bytes = cache.nbytes
    req = _Requests(prompts, max_new_tokens, eos)
    timer = _PhaseClock(be, stats)
    graphs_before = model.graph_counts()
    # the first device round may go in before the first tokens are read: on their device copy
    early = on_device and max_new_tokens > 1 and runtime.current().early_round
    with be.deferred_frees():   # the drafter's old state dies here too
        first = _prefill(model, cache, prompts, req, sampling, tables, timer,
                         drafter if speculative else None, needs)
        if not early:
            _commit_first(req, first[1])
    total = bs * max_new_tokens

    def after_step():
        timer.settle()
        if progress is not None:
            progress(req.committed(), total)
        if stream is not None:
            stream(req.out)
    if not early:
        after_step()
    if method == "ar" and ar_steps:
        decode_on_device(model, cache, req, ar_steps, sampling,
                         None if sampling.greedy else _cache_uniforms(seed, cache), timer,
                         stats, after_step)
    elif method == "ar":
        _ar_steps(model, cache, req, sampling, tables, timer, stats, after_step)
    elif on_device:
        _device_rounds(model, cache, drafter, req, budget, k, sampling, seed, timer, stats,
                       after_step, policy, t_d, per_launch, lookup, first if early else None)
    else:
        # A round's report (timing markers, progress, streamed text) is made while the next
        # round's verify runs, not between the read and the next launch, where the device
        # waits for the host (the committed tokens it reports are the same then).
        owed = False
        history = None if lookup is None else TokenHistory(be, req.seq, cache.max_len)

        def report_owed():
            nonlocal owed
            if owed:
                owed = False
                after_step()
        while req.active.any():
            with be.deferred_frees():   # numba frees wait for the round's read (backends.py)
                b = policy.next_budget() if policy else budget
                before = model.graph_counts() if policy else None
                t_round = time.perf_counter()
                packed, ran = _ddtree_round(
                    model, cache, drafter, req, b, sampling, table, timer, stats, k, needs,
                    on_round, while_verifying=report_owed, draft_temperature=t_d,
                    max_depth=max_depth, lookup=lookup, history=history)
                stats.budgets.append(b)
                if policy:        # the round ended in its host read: its wall time is its cost
                    after = model.graph_counts()
                    # a round of several graphs: one that captured is not steady; whether
                    # any step ran eagerly for its first time is not known (WARM_ROUNDS)
                    policy.observe(b, time.perf_counter() - t_round,
                                   float(np.mean(stats.tau[-1])),
                                   steady=None if before is None or after[0] == before[0]
                                   else False, paths=_paths(packed, ran))
            stats.rounds += 1
            owed = True
        report_owed()
    be.synchronize()
    timer.finish()
    stats.seconds = time.perf_counter() - t0
    if graphs_before is not None:
        graphs_after = model.graph_counts()
        stats.graph_captures = graphs_after[0] - graphs_before[0]
        stats.graph_replays = graphs_after[1] - graphs_before[1]
    stats.new_tokens = req.committed()
    if policy:
        stats.budget_auto = policy.summary()
    return GenerationResult(req.out, stats)

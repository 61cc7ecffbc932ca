"""A DDTree (or chain) round as one device program, and rounds enqueued one ahead of the host.

The host-driven round (``engine._ddtree_round``) issues the drafter's forward, the tree, the
verify, the acceptance, the compaction and the drafter's context update as separate launches
with host work between them, then reads the committed tokens before it can start the next
round: at the demo pair's size the device idles through most of that host time.  Here every
piece of a round's state lives on the device (the roots, both caches' lengths), so a round
needs no host value at all:

    draft (drafter.propose)  ->  top-K, build, compile (start = the target's device lengths)
    ->  verify (Model.forward on device slots)  ->  accept (argmax or sampled)  ->  compaction
    ->  the target's lengths += acc_len (active requests)  ->  the drafter's commit
    (its context grows by the same counts)  ->  roots = the bonus tokens

(with ``KDTREE_ROUND_EPILOGUE`` the slots' arithmetic of the round's three forwards is one
launch at its start and the counts, both lengths, the roots and the features' gather one
launch after the compaction: kdtree_numba/ddtree/commit.py, docs/ENGINE.md "Device rounds"),
and :class:`DeviceRounds` replays it from one CUDA graph per (method, budget, batch, cache
buffers, rounds a launch) on the GPU (captured by the target model's graph cache on its second
call, like every device step), eagerly elsewhere.  ``launch()`` enqueues the next launch and
starts the read of its rounds' tokens into pinned memory; the host commits the launch before
it while the device runs this one, so the device never waits for the host's read, bookkeeping
or launch.  A launch runs one round, or R back to back (``KDTREE_ROUNDS_PER_LAUNCH``, like
device AR's K steps: the graph's launch and the read paid once per R rounds; the engine runs
the last rounds a request needs one a launch, so few rounds run past its end).

A round enqueued for a request the last unread round has finished (eos, max_new_tokens) is
wasted work whose tokens the host drops (``stats.rounds_dropped`` where no request of it was
still running); its cache growth is bounded by L + 1 slots a round (the engine sizes the
caches for it: ``engine.cache_slots``) and stays in the caches' lengths, as the device made
it.  Only a drafter whose ``propose``
and ``on_commit`` need no host value (``device_only``: a commit without host counts) can run
this way; ``engine.generate`` chooses it (docs/ENGINE.md, "Device rounds").
"""
from __future__ import annotations

import functools

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.drafting import Commit, DraftContext
from kdtree_numba.kvlayout import device_address
from kdtree_numba.lookup import history_rows
from kdtree_numba.model import ForwardBatch
from kdtree_numba.steps import TREE_ARRAYS, accept_phase, gather_phase, tree_phase
from reference.ddtree import as_sampling

__all__ = ["DeviceRounds", "device_rounds_possible", "plan_launch", "rounds_per_launch_of"]


def device_rounds_possible(drafter) -> bool:
    """Whether ``drafter`` declares that a round can run without host values (and so names
    its device state: ``graph_key``)."""
    return bool(getattr(drafter, "device_only", False))


class DeviceRounds:
    """Rounds of one generation as device programs, one ahead of the host (module docstring).

    ``model``, ``cache``: the target and its KV cache (lengths committed up to the prompts);
    ``drafter``: a device-only drafter already committed the prompt; ``k``: the tree's
    branching (None: as many as the budget, ``min(budget, V)``; ``k = 1`` with ``budget = L``
    is the chain); ``sampling`` (a ``reference.ddtree.Sampling`` or a bare temperature) and
    ``table`` (the uniforms, T > 0) as in ``DeviceSteps.accept``; ``draft_temperature``: the
    tree's t_d (``steps.draft_temperature``; 1: the logits as they are); ``lookup``: the
    tree's prompt lookup (kdtree_numba/lookup.py; None: none), whose token history the
    program keeps in a buffer of its own.  The budget is each
    launch's own (``--budget auto`` changes it between rounds): the rounds of every budget
    share the program's state (the roots, the caches' lengths, the rounds in flight), one
    CUDA graph per budget and rounds a launch (each launch's ``n``, the engine's choice:
    :func:`plan_launch`).
    """

    def __init__(self, model, cache, drafter, k: int | None, sampling,
                 draft_temperature: float = 1.0, lookup=None):
        self.model, self.cache, self.drafter = model, cache, drafter
        self.draft_temperature = float(draft_temperature)
        self.lookup = lookup
        self.be, self.xp = model.backend, model.backend.xp
        self.fixed_k = None if k is None else int(k)
        self.sampling = as_sampling(sampling)
        self.needs = drafter.needs
        bs = cache.batch
        # device state the program reads and writes in place (a graph holds the addresses)
        self.roots = self.xp.zeros(bs, np.int32)
        # the requests' index column, made once (KDTREE_LEAN_ROUND: the features' gather)
        self.requests = self.xp.arange(bs, dtype=np.int64)[:, None]
        self.table = self.xp.zeros((bs, cache.max_len + 2), np.float64) \
            if not self.sampling.greedy else None
        self.history = self.xp.zeros((bs, cache.max_len), np.int32) \
            if lookup is not None else None
        # per launch: (read's wait, launch mask, growth bound, rounds)
        self.in_flight: list = []
        self.floor = None

    def k(self, budget: int) -> int:
        """The tree's branching at ``budget``."""
        return min(int(budget), self.model.vocab_size) if self.fixed_k is None \
            else self.fixed_k

    @classmethod
    def for_generation(cls, model, cache, drafter, roots, k: int | None, sampling,
                       table=None, draft_temperature: float = 1.0, lookup=None,
                       sequences=None) -> "DeviceRounds":
        """The program of ``cache`` for this drafter, tree and sampling (made once, then
        reused by every generation on the same cache, so its CUDA graph replays), started on
        the first tokens ``roots`` [bs] (host ints, or a device array: the prefill's, not
        yet read) with the uniforms ``table`` [bs, W] (host, T > 0; W >= cache.max_len + 2
        is cut to it); with a ``lookup``, its token history starts from the ``sequences``
        (host: each prompt, with or without its root) and each root after its prompt.  The
        target cache and the drafter hold the prompts' commits."""
        # a cache's programs live on it (engine.generate reuses its cache, and so the
        # programs' device buffers, which their captured graphs hold), and die with it
        key = (id(model), id(drafter), k, as_sampling(sampling), float(draft_temperature),
               lookup)
        rounds = cache.programs.get(key)
        if rounds is None or rounds.drafter is not drafter or rounds.model is not model:
            rounds = cache.programs[key] = cls(model, cache, drafter, k, sampling,
                                               draft_temperature, lookup)
        rounds.restart(roots, table)
        if lookup is not None:
            # each root sits after its prompt, at the target cache's length after the
            # prefill: written from the roots' buffer on the device (a root not yet read too)
            rounds.be.upload_into(rounds.history,
                                  history_rows(sequences, cache.max_len, cache.lengths))
            rounds.history[rounds.requests[:, 0], cache.device_lengths] = rounds.roots
        return rounds

    def restart(self, roots, table=None) -> None:
        """A new generation: the roots (host ints or a device array) and uniforms written into
        the program's buffers, the host mirrors taken from both caches (exact after the
        prefill's commits)."""
        # each host array goes up into its buffer in one copy (no temporary, no copy kernel)
        if hasattr(roots, "__cuda_array_interface__"):
            self.roots[...] = roots
        else:
            self.be.upload_into(self.roots, np.asarray(roots, np.int32))
        if self.table is not None:
            width = self.table.shape[1]
            self.be.upload_into(self.table, np.asarray(table, np.float64)[:, :width])
        self.in_flight.clear()
        self.floor = self.cache.lengths.copy()

    # ---- the program: device work only, so a CUDA graph can capture it
    def _rounds(self, budget: int, n: int, active):
        """``n`` rounds back to back: their packed tokens [n, bs, 2 (L + 1)] (one array, so
        one read; one round's as ``_round`` makes it, [bs, 2 (L + 1)])."""
        packs = [self._round(budget, active) for _ in range(n)]
        return packs[0] if n == 1 else self.xp.stack(packs)

    def _round(self, budget: int, active):
        model, cache, xp, ops = self.model, self.cache, self.xp, self.be.ops
        lean = runtime.current().lean_round
        context = self._epilogue_context()
        # the tree's root positions: with KDTREE_LEAN_ROUND (or the epilogue's) the lengths
        # themselves, no copy, as nothing writes them before the round's last read of them
        # (add_on_device, or the commit launch, below)
        start = cache.device_lengths if lean or context is not None \
            else cache.device_lengths.copy()
        n = budget + 1
        slots = block = None
        if context is not None:      # the verify's and the drafter's block's slots: one launch
            rows, block_rows, block_positions = ops.round_slots(
                start, cache.max_len, n, context.device_lengths, context.max_len,
                self.drafter.block_len + 1)
            slots = cache.slots_at(start, rows)
            block = context.slots_at(context.device_lengths, block_rows, block_positions)
        draft_logits = self.drafter.propose(DraftContext(
            roots=self.roots, positions=start, depth=budget,
            temperature=self.sampling.temperature, slots=block))
        tree, vin = tree_phase(ops, self.k(budget), budget, self.draft_temperature,
                               self.lookup)(draft_logits, self.roots, start, self.history)
        # the verify's slots from the round's own device lengths: forward runs it eagerly
        # inside this program's capture (ForwardBatch.slots)
        out = model.forward(ForwardBatch(vin.input_ids, vin.positions, vin.visible,
                                         causal=True, return_hidden=self.needs.hidden,
                                         capture_layers=self.needs.feature_layers,
                                         slots=slots or cache.device_slots(start, n)), cache)
        parts = out if isinstance(out, tuple) else (out,)
        arrays = tuple(getattr(tree, name) for name in TREE_ARRAYS)
        if not self.sampling.greedy:
            arrays += (self.table, start)
        acc_idx, acc_len, packed, next_roots = accept_phase(
            ops, xp, self.sampling, tree.max_depth)(parts[0], *arrays)
        if self.lookup is not None:     # here: the commit below grows the lengths (``start``)
            ops.record_tokens(self.history, start, packed, active)
        hidden = model.last_accepted(parts[1], acc_idx, acc_len) if self.needs.hidden else None
        if context is not None:
            # KDTREE_ROUND_EPILOGUE: the compaction reads the lengths first, then one launch
            # makes the counts, grows both caches' lengths, sets the roots and gathers the
            # accepted rows' features (the drafter's context writes at ``block``, made above)
            cache.compact_tree(ops, acc_idx, acc_len, lengths=start)
            counts, features = ops.commit_round(
                parts[-1] if self.needs.feature_layers else None, acc_idx, acc_len, active,
                next_roots, self.roots, cache.device_lengths, context.device_lengths)
            self.drafter.on_commit(Commit(counts=counts, next_roots=next_roots,
                                          counts_host=None, hidden=hidden, features=features,
                                          slots=block, grown=True))
            return packed
        counts = (acc_len.astype(np.int32, copy=False) * active).astype(np.int32, copy=False)
        features = gather_phase(xp, self.requests if lean else None)(parts[-1], acc_idx) \
            if self.needs.feature_layers else None
        cache.compact_tree(ops, acc_idx, acc_len, lengths=start)
        cache.add_on_device(counts)
        self.drafter.on_commit(Commit(counts=counts, next_roots=next_roots, counts_host=None,
                                      hidden=hidden, features=features))
        # a request the round did not run (held back, finished) keeps its root
        self.roots[...] = xp.where(active != 0, next_roots, self.roots)
        return packed

    def _epilogue_context(self):
        """The drafter's context cache where the round makes its slots and commit in one
        launch each (``KDTREE_ROUND_EPILOGUE``; both caches dense, a drafter that names its
        ``context_cache``: drafting.py), else None."""
        context = getattr(self.drafter, "context_cache", None)
        if not runtime.current().round_epilogue or context is None or not context.dense \
                or not self.cache.dense:
            return None
        return context

    def key(self, budget: int, n: int = 1) -> tuple:
        """Everything the captured launch of ``n`` rounds at ``budget`` depends on besides its
        input: the tree
        (its t_d too) and the sampling, and the address of every device buffer it reads or
        writes in place (both caches' arrays and lengths, the drafter's own state, the roots,
        the uniforms): a buffer replaced (a drafter cache of another size, after a generation
        on this target cache) makes another key, never a replay against freed memory.  (The
        graph cache's key adds the input's shape.)"""
        key = ("round", int(budget), self.k(budget), self.draft_temperature, self.sampling,
               self.needs, int(n), self.lookup)
        key += self.cache.buffer_key() + tuple(self.drafter.graph_key())
        return key + (device_address(self.roots),
                      None if self.table is None else device_address(self.table),
                      None if self.history is None else device_address(self.history),
                      device_address(self.requests))

    # ---- the host side
    @property
    def rounds_in_flight(self) -> int:
        """The rounds launched and not yet collected."""
        return sum(n for *_, n in self.in_flight)

    def launch(self, active: np.ndarray, budget: int, n: int = 1) -> None:
        """Enqueue ``n`` rounds of ``budget`` nodes, one launch, for the requests ``active``
        [bs] (host bools: running as far as the host knows) and start the read of their
        committed tokens."""
        # a round commits acc_len <= min(W, L + 1) tokens a request (W = budget + 1 verify
        # rows): the host mirrors grow by that bound until the read; first the room for what
        # each round writes (the verify's W rows, the drafter's block of L + 1)
        width = int(budget) + 1
        grow = np.where(active, min(width, self.drafter.block_len + 1), 0)
        for _ in range(n):
            self.cache.reserve(width)
            self._bound(self.floor, self.cache.lengths + grow)
        mask = active.astype(np.int32)
        packed = self.model.device_step(self.key(budget, n),
                                        functools.partial(self._rounds, int(budget), int(n)),
                                        (mask,), before_capture=getattr(self.drafter,
                                                                        "prepare_capture", None))
        self.in_flight.append((self.be.read_later(packed), active.copy(), grow * n, int(n)))

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the oldest launch in flight and return its rounds' packed committed tokens
        and accepted slots [n, bs, 2 (L + 1)] (host int32; ``reference.ddtree.pack_committed``)
        and the requests they ran (the launch's mask); the lengths they made are confirmed in
        the host mirrors."""
        wait, active, _, n = self.in_flight.pop(0)
        packed = np.asarray(wait()).reshape(n, len(active), -1)
        grow = np.where(active, packed[:, :, 0].sum(axis=0), 0).astype(np.int64)
        self.floor = self.floor + grow
        # the host mirrors: exact again, or the read lengths plus the bounds still in flight
        pending = sum((bound for _, _, bound, _ in self.in_flight), np.zeros_like(self.floor))
        self._bound(self.floor, self.floor + pending)
        return packed, active

    def _bound(self, floor, upper) -> None:
        """The host mirrors of the lengths the device rounds make: the target cache's, and the
        drafter's own state, which grows as the target's cache does (``bound_lengths``:
        also its capacity check, as the replays run no Python); exact where ``floor`` and
        ``upper`` agree."""
        if np.array_equal(floor, upper):
            self.cache.confirm_lengths(floor)
        else:
            self.cache.expect_device_growth(floor, upper)
        self.drafter.bound_lengths(floor, upper)

    def finish(self) -> None:
        """Drop the rounds still in flight, if any (an exception in the loop): wait for them,
        then set the target cache to the last collected round's lengths (a drafter's state
        starts afresh with the next generation's ``start``)."""
        for wait, *_ in self.in_flight:
            wait()
        self.in_flight.clear()
        self.cache.truncate(self.floor)


def plan_launch(req, in_flight: int, per_launch: int, seen,
                wait_near_end: float = 0.0) -> tuple:
    """The requests the next device launch runs and its rounds, for the engine's requests
    ``req`` (``active``, ``out``, ``max_new``) with ``in_flight`` rounds unread: those that
    may still need tokens (short of max_new_tokens by more than one a round in flight); with
    ``per_launch`` > 1 or ``wait_near_end`` (``KDTREE_WAIT_NEAR_END``: a margin, 0 off), only
    those the rounds in flight look not to finish (at ``seen``'s mean tokens a round: tokens,
    request-rounds; one round a launch times the margin, which above 1 trades rounds run past
    an end for reads waited on); with ``per_launch`` > 1, that many rounds where some of them
    looks to need them all, else one."""
    left = np.array([req.max_new - len(out) for out in req.out])
    ahead = req.active & (left > in_flight)
    if per_launch == 1 and not wait_near_end:
        return ahead, 1
    mean = max(1.0, seen[0] / max(1, seen[1]))
    if per_launch == 1:
        return ahead & (left > in_flight * mean * float(wait_near_end)), 1
    ahead &= left > in_flight * mean
    need = left[ahead].max() - in_flight * mean if ahead.any() else 0.0
    return ahead, per_launch if need > (per_launch - 1) * mean else 1


def rounds_per_launch_of(asked: int | None, on_device: bool) -> int:
    """``engine.generate``'s ``rounds_per_launch`` checked (None: the runtime's); 1 without
    device rounds, where it asks for more a ValueError."""
    if asked is None:
        return runtime.current().rounds_per_launch if on_device else 1
    if isinstance(asked, bool) or not isinstance(asked, (int, np.integer)) \
            or not 1 <= asked <= runtime.ROUNDS_MAX:
        raise ValueError(f"rounds_per_launch must be a whole number 1 to "
                         f"{runtime.ROUNDS_MAX}, got {asked!r}")
    if asked > 1 and not on_device:
        raise ValueError("rounds_per_launch > 1 needs device rounds (method ddtree or chain "
                         "with a device-only drafter)")
    return int(asked)

"""Batched generation: autoregressive (AR) and DDTree speculative decoding.

``generate(model, prompts, max_new_tokens, method="ar"|"ddtree", drafter=..., budget=32,
temperature=0.0, seed=0, eos=None) -> GenerationResult``

Sequence bookkeeping (per request b): ``seq[b]`` = prompt + committed tokens.  The last committed
token is the *root*: the next token fed to the target.  The target cache always holds
``len(seq[b]) - 1`` tokens.

* Prefill: one causal forward over the right-padded prompts; the logits at each prompt's last
  row give the first new token.
* AR step: one forward of the roots (n = 1), commit 1, choose the next token.
* DDTree round (shared/notes/ddtree.md): drafter logits [bs, L, V] -> ``topk_logprobs``
  (k = min(budget, V)) -> ``build_tree`` -> ``compile_tree`` (start = cache lengths) -> ONE
  target forward over [root + B nodes] with the ancestor mask (KV written at [len, len+B+1)) ->
  accept (``accept_greedy`` on the target's argmax at T = 0, ``accept_sampled`` at T > 0) ->
  ``compact_kv`` of the accepted rows -> lengths += acc_len -> the bonus token is the next root.
  Each round commits the accepted nodes' tokens and the bonus token.

Sampling (T > 0) is lossless *and* reproducible across methods: the token at absolute position p
of request b is drawn by inverse CDF (``reference.ddtree.sample_targets``' rule) with the uniform
``U_b[p]`` from ``numpy.random.default_rng([seed, b])``.  AR uses ``U_b[p]`` for its token at p;
a DDTree node at depth d samples the target's token at position ``start + d + 1`` with
``U_b[start + d + 1]`` (siblings share it; only one path is ever committed, so every committed
token uses a fresh uniform and is an exact target sample).  Hence for a fixed seed DDTree and AR
produce the same tokens at any temperature, up to float rounding of the logits flipping a draw
that sits on a CDF boundary (probability ~1e-7 per token).

Finished requests (eos emitted or max_new_tokens reached) stop growing; the batch keeps running
until every request is finished (their rows are computed and discarded).

Host synchronisation (docs/ENGINE.md, "Sync points"): on the GPU a round, and an AR step, waits
for the device exactly once, when it reads the committed tokens (one packed int32 array for a
DDTree round: acc_len and the committed tokens).  Everything else stays on the device or is
host bookkeeping (lengths, sequences); phase timings come from markers read after the fact.

On the GPU the forwards and a round's device-only phases (tree, accept, compaction) replay
from CUDA graphs once their shapes repeat (kdtree_numba/graphs.py, docs/ENGINE.md).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import numpy as np

from reference.ddtree import DraftTree

__all__ = ["generate", "GenerationResult", "GenerationStats", "METHODS", "uniform_table"]

METHODS = ("ar", "ddtree")
PHASES = ("prefill", "decode", "draft", "tree_build", "verify", "accept", "compaction")


@dataclasses.dataclass
class GenerationStats:
    method: str
    backend: str
    batch: int
    budget: int | None
    block_len: int | None
    kv_cache_bytes: int = 0             # target KV cache (c + k_pe, all layers)
    rounds: int = 0                     # AR steps or DDTree rounds after prefill
    new_tokens: int = 0                 # committed tokens returned, all requests
    seconds: float = 0.0                # wall time of generate(), prefill included
    time: dict = dataclasses.field(default_factory=lambda: {p: 0.0 for p in PHASES})
    tau: list = dataclasses.field(default_factory=list)  # per round: acc_len of active requests
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

    def __init__(self, prompts, max_new_tokens, eos, keep_hidden: bool = False):
        self.keep_hidden = keep_hidden
        self.hidden = None      # target hidden state that chose each root (BlockDrafter input)
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


def _root_only_tree(be, bs: int) -> DraftTree:
    """A 1-slot-budget tree with no nodes, on the device: ``sample_targets`` on it samples
    slot 0 only."""
    full = lambda v, dt: np.full((bs, 2), v, dt)  # noqa: E731
    depth = full(-1, np.int32)
    depth[:, 0] = 0
    score = full(-np.inf, np.float64)
    score[:, 0] = 0.0
    return DraftTree(n_nodes=be.asarray(np.zeros(bs, np.int32)),
                     token=be.asarray(full(-1, np.int32)), parent=be.asarray(full(-1, np.int32)),
                     depth=be.asarray(depth), rank=be.asarray(full(-1, np.int32)),
                     score=be.asarray(score), max_depth=1)


def _choose(model, logits, temperature: float, uniforms: np.ndarray) -> np.ndarray:
    """Next token per request from logits [bs, V]: argmax at T = 0, else the inverse-CDF rule
    of ``sample_targets`` (the same kernel DDTree uses) with ``uniforms [bs]``.  The one host
    read of a prefill or an AR step."""
    be, ops, xp = model.backend, model.backend.ops, model.backend.xp
    logits = xp.ascontiguousarray(logits)          # rows of a [bs, n, V] block are strided
    if temperature == 0:   # one more CUDA graph on the GPU (an eager launch costs ~0.2 ms)
        tokens = _device_step(model, ("argmax",), ops.argmax, (logits,))
        return np.asarray(be.to_host(tokens), np.int64)
    bs = logits.shape[0]
    pair = xp.ascontiguousarray(xp.stack([logits, logits], axis=1))
    u = be.asarray(np.stack([uniforms, np.full(bs, 0.5)], axis=1))
    tokens = ops.sample_targets(_root_only_tree(be, bs), pair, temperature, u)
    return np.asarray(be.to_host(tokens[:, 0]), np.int64)


def _prefill(model, cache, prompts, req: _Requests, temperature, tables, timer):
    be = model.backend
    bs = len(prompts)
    lens = np.array([p.size for p in prompts], np.int64)
    n = int(lens.max())
    tokens = np.zeros((bs, n), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, :p.size] = p
    positions = np.broadcast_to(np.arange(n), (bs, n))
    visible = np.broadcast_to(np.tri(n, dtype=bool), (bs, n, n))
    logits = model.forward(tokens, positions, cache, visible, return_hidden=req.keep_hidden)
    rows = (be.asarray(np.arange(bs)), be.asarray(lens - 1))
    if req.keep_hidden:
        logits, hidden = logits
        req.hidden = hidden[rows]
    cache.advance(lens)
    last = logits[rows]
    u = np.array([tables[b][lens[b]] for b in range(bs)])
    first = _choose(model, last, temperature, u)
    timer.lap("prefill")
    for b in range(bs):
        req.commit(b, [first[b]])


def _ar_step(model, cache, req: _Requests, temperature, tables, timer):
    bs = cache.batch
    roots = req.roots()
    logits = model.forward(roots[:, None], cache.lengths[:, None].copy(), cache,
                           np.ones((bs, 1, 1), bool))
    cache.advance(req.active.astype(np.int64))
    u = np.array([tables[b][min(cache.lengths[b], len(tables[b]) - 1)] for b in range(bs)])
    nxt = _choose(model, logits[:, 0], temperature, u)
    timer.lap("decode")
    for b in np.flatnonzero(req.active):
        req.commit(b, [nxt[b]])


def _tree_uniforms(xp, table, tree, start):
    """``U_b[start_b + depth + 1]`` for every slot of the tree, gathered on the device from the
    uploaded uniform table [bs, W] (padding slots, depth -1, take depth 0's; positions clip at
    W - 1, as the table covers every position a committed token can have)."""
    pos = start[:, None] + xp.maximum(tree.depth, 0) + 1
    return xp.take_along_axis(table, xp.minimum(pos, table.shape[1] - 1), axis=1)


def _pack_committed(xp, tree, acc_idx, acc_len, next_token):
    """One int32 array [bs, 1 + (L + 1)] built on the device: column 0 is acc_len m, columns
    1..m the committed tokens (the accepted nodes after the root, then the bonus token), the
    rest -1.  Reading it is the round's only host read."""
    path = xp.take_along_axis(tree.token, xp.maximum(acc_idx[:, 1:], 0), axis=1)   # [bs, L]
    m = acc_len.astype(np.int32)[:, None]
    col = xp.arange(acc_idx.shape[1], dtype=np.int32)[None, :]                    # 0..L
    padded = xp.concatenate([path.astype(np.int32), xp.zeros_like(m)], axis=1)
    bonus = next_token.astype(np.int32)[:, None]
    committed = xp.where(col < m - 1, padded, xp.where(col == m - 1, bonus, np.int32(-1)))
    return xp.concatenate([m, committed.astype(np.int32)], axis=1)


def _device_step(model, key, fn, inputs):
    """``fn(*inputs)``, device work only, replayed from one of the model's CUDA graphs when it
    has them (graphs.ForwardGraphs.call: captured on the key's second call), else run eagerly
    on device copies of ``inputs`` (host or device arrays)."""
    be = model.backend
    if model.graphs is not None:
        specs = tuple((tuple(int(d) for d in a.shape), np.dtype(a.dtype)) for a in inputs)
        out = model.graphs.call(key + specs, fn, inputs, specs)
        if out is not None:
            return out
    return fn(*(be.asarray(a) for a in inputs))


def _tree_phase(ops, k: int, budget: int):
    """draft logits, roots, start -> (tree, verify inputs): top-K, build, compile."""
    def run(draft_logits, roots, start):
        lp, ids = ops.topk_logprobs(draft_logits, k)
        tree = ops.build_tree(lp, ids, budget)
        return tree, ops.compile_tree(tree, roots, start)
    return run


TREE_ARRAYS = ("n_nodes", "token", "parent", "depth", "rank", "score")


def _accept_phase(ops, xp, temperature: float, max_depth: int):
    """verify logits, the tree's arrays[, uniform table, start] -> (acc_idx, acc_len, packed
    committed tokens): the target's choice at every node, the walk, the packing."""
    def run(logits, *arrays):
        tree = DraftTree(*arrays[:len(TREE_ARRAYS)], max_depth=max_depth)
        if temperature == 0:
            bs, n, V = logits.shape
            target = ops.argmax(logits.reshape(bs * n, V)).reshape(bs, n)
            acc_idx, acc_len, nxt = ops.accept_greedy(tree, target)
        else:
            table, start = arrays[len(TREE_ARRAYS):]
            u = _tree_uniforms(xp, table, tree, start)
            acc_idx, acc_len, nxt = ops.accept_sampled(tree, logits, temperature, u)
        return acc_idx, acc_len, _pack_committed(xp, tree, acc_idx, acc_len, nxt)
    return run


def _compaction_phase(ops, cache):
    """lengths, acc_idx, acc_len -> (): KVCache.compact_tree on device inputs."""
    def run(lengths, acc_idx, acc_len):
        cache.compact_tree(ops, acc_idx, acc_len, lengths=lengths)
        return ()
    return run


def _ddtree_round(model, cache, drafter, req: _Requests, budget, temperature, table, timer,
                  stats):
    """One round.  Its three device-only phases (tree, accept, compaction) go through
    ``_device_step``: on the GPU each is one CUDA-graph launch once its shapes repeat, like the
    verify forward."""
    be, ops, xp = model.backend, model.backend.ops, model.backend.xp
    bs, V = cache.batch, model.vocab_size
    histories = [np.asarray(s, np.int64) for s in req.seq]
    if req.keep_hidden:
        draft_logits = drafter.propose(histories, target_hidden=req.hidden)
    else:
        draft_logits = drafter.propose(histories)
    timer.lap("draft")
    k = min(budget, V)
    start = cache.lengths.astype(np.int32)
    tree, vin = _device_step(model, ("tree", k, budget), _tree_phase(ops, k, budget),
                             (draft_logits, req.roots(), start))
    timer.lap("tree_build")
    logits = model.forward(vin.input_ids, vin.positions, cache, vin.visible,
                           return_hidden=req.keep_hidden)
    if req.keep_hidden:
        logits, hidden = logits
    timer.lap("verify")
    arrays = tuple(getattr(tree, name) for name in TREE_ARRAYS)
    if temperature > 0:
        arrays += (table, start)
    acc_idx, acc_len, packed = _device_step(
        model, ("accept", float(temperature), tree.max_depth),
        _accept_phase(ops, xp, temperature, tree.max_depth), (logits,) + arrays)
    if req.keep_hidden:  # the row of the last accepted node chose the next root
        last = xp.take_along_axis(acc_idx, xp.maximum(acc_len.astype(np.int32) - 1, 0)[:, None],
                                  axis=1)[:, 0]
        req.hidden = hidden[xp.arange(bs), last]
    timer.lap("accept")
    _device_step(model, ("compaction",) + cache.buffer_key(), _compaction_phase(ops, cache),
                 (cache.lengths, acc_idx, acc_len))
    timer.lap("compaction")
    packed = be.to_host(packed)                   # THE host read of the round
    active = req.active.copy()
    cache.advance(np.where(active, packed[:, 0], 0))
    stats.tau.append([int(packed[b, 0]) for b in np.flatnonzero(active)])
    for b in np.flatnonzero(active):
        req.commit(b, packed[b, 1:1 + int(packed[b, 0])])


def generate(model, prompts, max_new_tokens: int, *, method: str = "ar", drafter=None,
             budget: int = 32, temperature: float = 0.0, seed: int = 0,
             eos: int | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (module docstring for the algorithm).

    prompts: sequences of token ids (ragged).  method "ddtree" needs a ``drafter``
    (kdtree_numba/drafter.py) with the target's vocabulary; ``budget`` = tree nodes per round.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if temperature < 0 or not np.isfinite(temperature):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    prompts = _check_prompts(prompts, model.vocab_size)
    bs = len(prompts)
    block_len = None
    if method == "ddtree":
        if drafter is None:
            raise ValueError("method 'ddtree' needs a drafter")
        if budget < 1:
            raise ValueError("budget must be >= 1")
        if drafter.vocab_size != model.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target "
                             f"{model.vocab_size}")
        block_len = drafter.block_len
    stats = GenerationStats(method=method, backend=model.backend.name, batch=bs,
                            budget=budget if method == "ddtree" else None, block_len=block_len)
    # Device arrays of earlier work (the last generate()'s final round, dropped when it
    # returned) sit in numba's free queue; a queue that overflows frees at once, waiting for
    # the device.  Free them here, before the clock starts, not in the middle of a round.
    be = model.backend
    be.free_deferred()
    t0 = time.perf_counter()
    if max_new_tokens == 0:
        return GenerationResult([[] for _ in prompts], stats)
    # Room for the longest sequence, one verify block past it, and the last round's growth
    # of a request that finishes in it (up to L + 1 accepted tokens) before it stops.
    longest = max(p.size for p in prompts) + max_new_tokens
    verify_width = budget + 1 if method == "ddtree" else 1
    max_len = longest + verify_width + (block_len + 1 if method == "ddtree" else 1)
    tables = [uniform_table(seed, b, max_len + 2) for b in range(bs)]
    # DDTree gathers its uniforms on the device: one upload per generate()
    table = be.asarray(np.stack(tables)) if method == "ddtree" and temperature > 0 else None
    # the model's last generation cache is reused when it fits: its CUDA graphs replay
    cache = model.generation_cache = model.reuse_cache(model.generation_cache, bs, max_len)
    stats.kv_cache_bytes = cache.nbytes
    req = _Requests(prompts, max_new_tokens, eos,
                    keep_hidden=method == "ddtree" and getattr(drafter, "needs_target_hidden",
                                                               False))
    timer = _PhaseClock(be, stats)
    graphs = model.graphs
    graphs_before = (graphs.captures, graphs.replays) if graphs is not None else None
    with be.deferred_frees():   # the drafter's old state dies here too
        if method == "ddtree":
            drafter.start(bs, max_len + block_len + 1)
            timer.lap("draft")
        _prefill(model, cache, prompts, req, temperature, tables, timer)
    timer.settle()
    while req.active.any():
        with be.deferred_frees():   # numba frees wait for the round's read (backends.py)
            if method == "ar":
                _ar_step(model, cache, req, temperature, tables, timer)
            else:
                _ddtree_round(model, cache, drafter, req, budget, temperature, table, timer,
                              stats)
        timer.settle()
        stats.rounds += 1
    be.synchronize()
    timer.finish()
    stats.seconds = time.perf_counter() - t0
    if graphs_before is not None:
        stats.graph_captures = graphs.captures - graphs_before[0]
        stats.graph_replays = graphs.replays - graphs_before[1]
    stats.new_tokens = sum(len(o) for o in req.out)
    return GenerationResult(req.out, stats)

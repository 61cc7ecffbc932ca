"""AR decoding as a device program: K decode steps a launch, enqueued one launch ahead.

The host's AR loop (``engine._ar_steps``) runs one step a launch: the decode forward's CUDA
graph, the choice's graph, the cache's lengths advanced from the host, the step's uniforms
built and uploaded, the read started, the commit: ~0.5 ms of Python a token on a slow host,
where the demo target's forward runs 0.36 ms on an H100 (issue 36: the GPU idled 36% of AR).
Here one launch runs K steps with every piece of state on the device, so the host's work is
paid once per K tokens:

    for each of the K steps:
        the forward of one token per request at the cache's device lengths
        (``Model.forward`` of a batch whose ``slots`` are ``cache.device_slots``)
        ->  lengths += mask[step] (the requests the host let advance, ``add_on_device``)
        ->  the choice (``steps.choice_phase``: the argmax at T = 0, else the sampled rule
            with the uniform ``U_b[min(lengths_b, W - 1)]`` gathered from the uniform table
            on the device: the host loop's ``tables[b][min(cache.lengths[b], len - 1)]``)
        ->  the next step's token
    ->  the K chosen tokens [bs, K] (the launch's one read, ``backend.read_later``)

:class:`DeviceAR` replays it from one CUDA graph per (K, sampling, cache buffers) on the GPU
(captured by the target model's graph cache on its second launch, like every device step),
eagerly elsewhere (the simulator, the reference backend).  :func:`decode` drives it: block
j + 1 is launched before block j's tokens are read, so the device runs the blocks back to back
while the host reads, commits and reports.

Exactness.  Only eos depends on the tokens: how far a request advances is the host's choice
(``mask``: request b advances in the block's first ``counts[b]`` steps, at most its tokens
left to max_new_tokens less those of the block in flight), so the host always knows the
cache's lengths (no pending bounds, unlike device rounds) and no request ever commits past
max_new_tokens.  A request eos finishes inside a block ran that block's later steps and the
next block's in vain: their tokens are dropped and the slots they advanced stay within its
max_new_tokens; at the end the cache is rolled back to the committed tokens, as the host loop
leaves it.  The steps past a request's count write their KV at its length (scratch, as the
host loop's rows of a finished request) and their tokens are never read.  The tokens are the
host loop's: the same forward, the same choice, the same uniforms (docs/ENGINE.md, "AR steps
on the device").
"""
from __future__ import annotations

import collections

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.kvlayout import device_address
from kdtree_numba.model import ForwardBatch
from kdtree_numba.steps import TREE_ARRAYS, choice_phase, root_only_tree
from reference.ddtree import as_sampling

__all__ = ["DeviceAR", "decode", "steps_per_launch"]


def steps_per_launch(backend, steps: int | None = None) -> int:
    """The AR steps one device launch runs, 0 for the host's loop: ``steps`` where given
    (0 to ``runtime.AR_STEPS_MAX``; any backend), else ``runtime.current().ar_device_steps``
    (``KDTREE_AR_DEVICE_STEPS``; unset: ``runtime.AR_STEPS_ON`` on a real GPU, 0 under the
    simulator, which would run the program eagerly) on the numba backend and 0 on the
    reference backend, whose steps run as they are launched (nothing to hide the host's work
    behind)."""
    if steps is None:
        return runtime.current().ar_device_steps if backend.name == "numba" else 0
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) \
            or not 0 <= steps <= runtime.AR_STEPS_MAX:
        raise ValueError(f"ar_device_steps must be a whole number 0 (off) to "
                         f"{runtime.AR_STEPS_MAX}, got {steps!r}")
    return int(steps)


class DeviceAR:
    """AR steps of one generation cache as a device program, K a launch (module docstring).

    ``model``, ``cache``: the target and its KV cache (lengths committed up to the prompts);
    ``steps``: K; ``sampling``: a ``reference.ddtree.Sampling`` or a bare temperature.  The
    program's device buffers (the next step's tokens, the uniform table, the constants) are
    what its CUDA graph holds: made once, reused by every generation on the cache
    (:meth:`for_generation`)."""

    def __init__(self, model, cache, steps: int, sampling):
        self.model, self.cache = model, cache
        self.steps = int(steps)
        self.sampling = as_sampling(sampling)
        self.be, self.xp = model.backend, model.backend.xp
        bs, xp = cache.batch, self.xp
        self.roots = xp.zeros(bs, np.int32)          # the next step's token per request
        self.visible = xp.ones((bs, 1, 1), bool)     # a decode row sees its own key
        self.table = self.tree = self.half = None
        if not self.sampling.greedy:
            self.table = xp.zeros((bs, cache.max_len + 2), np.float64)
            self.tree = root_only_tree(self.be, bs)  # the sampled rule's one slot
            self.half = xp.full((bs, 1), 0.5)        # its empty slot's uniform, never read
        self.choose = choice_phase(self.be.ops, xp, self.sampling, self.tree)
        self.in_flight: collections.deque = collections.deque()  # (read's wait, counts)
        self.launch_key: tuple = ()                  # key() of this generation (restart)

    @classmethod
    def for_generation(cls, model, cache, steps: int, sampling, roots,
                       table=None) -> "DeviceAR":
        """The program of ``cache`` for K = ``steps`` and this sampling (made once, then
        reused, so its CUDA graph replays), started on the prefill's tokens ``roots`` [bs]
        (host ints) with the uniforms ``table`` [bs, >= cache.max_len + 2] (host, T > 0)."""
        key = ("ar", id(model), int(steps), as_sampling(sampling))
        program = cache.programs.get(key)
        if program is None or program.model is not model:
            program = cache.programs[key] = cls(model, cache, steps, sampling)
        program.restart(roots, table)
        return program

    def restart(self, roots, table=None) -> None:
        """A new generation: its first tokens and uniforms uploaded into the buffers (in
        place: the captured graph reads them there)."""
        self.be.upload_into(self.roots, roots)
        if self.table is not None:
            self.be.upload_into(self.table, np.asarray(table)[:, :self.table.shape[1]])
        self.in_flight.clear()
        # made once a generation, not a launch (~10 buffer addresses asked of CuPy)
        self.launch_key = self.key()

    # ---- the program: device work only, so a CUDA graph can capture it
    def _block(self, mask):
        """K steps; ``mask`` [K, bs] int32: 1 where the step advances the request."""
        model, cache, xp = self.model, self.cache, self.xp
        lengths = cache.device_lengths           # advanced in place by each step
        tokens, chosen = self.roots, []
        for step in range(self.steps):
            # positions = slots = the lengths (read by the forward before the add below)
            logits = model.forward(ForwardBatch(tokens[:, None], lengths[:, None],
                                                self.visible,
                                                slots=cache.device_slots(lengths, 1)), cache)
            cache.add_on_device(mask[step])
            args = (xp.ascontiguousarray(logits[:, 0]),)
            if self.table is not None:           # U_b[p], p the chosen token's position
                at = xp.minimum(lengths, self.table.shape[1] - 1)[:, None]
                args += (xp.concatenate([xp.take_along_axis(self.table, at, axis=1),
                                         self.half], axis=1),)
            tokens = self.choose(*args).astype(np.int32, copy=False)
            chosen.append(tokens)
        self.roots[...] = tokens
        return xp.stack(chosen, axis=1)

    def key(self) -> tuple:
        """Everything the captured block depends on besides its mask: K, the sampling, and
        the address of every device buffer it reads or writes (the cache's arrays and
        lengths, the program's own), so a buffer replaced makes another key, never a replay
        against freed memory.  (The graph cache's key adds the mask's shape.)"""
        own = [self.roots, self.visible]
        if self.table is not None:
            own += [self.table, self.half] + [getattr(self.tree, n) for n in TREE_ARRAYS]
        return ("ar_steps", self.steps, self.sampling) + self.cache.buffer_key() + tuple(
            device_address(a) for a in own)

    # ---- the host side
    def launch(self, counts: np.ndarray) -> None:
        """Enqueue one block in which request b advances in the first ``counts[b]`` steps
        (host ints 0..K) and start the read of its K tokens; the cache's host lengths take
        the growth at once (the host chose it)."""
        K, cache = self.steps, self.cache
        counts = np.asarray(counts, np.int64)
        # room for the block's writes (at most K slots a request past its length; the
        # engine sizes the cache for them: engine.cache_slots) and a paged layout's pages
        cache.reserve(K)
        before = cache.lengths.copy()
        mask = (np.arange(K)[:, None] < counts[None, :]).astype(np.int32)
        # borrowed: the graph's own output buffer, which the next launch's replay rewrites
        # only after the read enqueued here has copied it (both on the legacy stream's order)
        out = self.model.device_step(self.launch_key, self._block, (mask,), borrow=True)
        cache.expect_device_growth(before, before + counts)
        cache.confirm_lengths(before + counts)
        self.in_flight.append((self.be.read_later(out), counts))

    def collect(self) -> tuple[np.ndarray, np.ndarray]:
        """Wait for the oldest block in flight: its tokens [bs, K] (host int32) and the
        counts it was launched with."""
        wait, counts = self.in_flight.popleft()
        return np.asarray(wait()), counts

    def finish(self) -> None:
        """Wait for the reads still in flight (an exception in the loop): the pinned memory
        they write is kept alive by their waits until it has landed."""
        while self.in_flight:
            self.in_flight.popleft()[0]()


def decode(model, cache, req, steps: int, sampling, table, timer, stats, after_step) -> None:
    """engine.generate's AR steps on the device, K = ``steps`` a launch (module docstring),
    each block launched before the last one is read.  ``req``: the engine's requests (their
    ``active``, ``out``, ``max_new``, ``seq``, ``commit`` and ``roots``); ``table``: the
    uniforms [bs, cache.max_len + 2] (host, T > 0; None at T = 0); ``timer.lap("decode")``
    after each launch, ``stats.rounds`` += K a launch (the device's steps, those run in vain
    included: the phase "decode" over them is a step's device time), ``after_step()`` after
    each block's commit.  Leaves the cache at the committed tokens (len(seq) - 1 a request)."""
    be, bs = model.backend, cache.batch
    program = DeviceAR.for_generation(model, cache, steps, sampling, req.roots(), table)
    ahead = np.zeros(bs, np.int64)                # tokens of the blocks in flight
    limit = np.full(bs, req.max_new, np.int64)

    def launch() -> None:
        left = limit - np.array([len(out) for out in req.out]) - ahead
        counts = np.where(req.active, np.clip(left, 0, steps), 0)
        if counts.any():
            program.launch(counts)
            ahead[:] += counts
            timer.lap("decode")
            stats.rounds += steps

    done = False
    try:
        with be.deferred_frees():
            launch()
        while program.in_flight:
            with be.deferred_frees():        # numba frees wait for the block's read
                launch()                         # the next block before this one's read
                tokens, counts = program.collect()
                ahead[:] -= counts
                for b in np.flatnonzero(counts):
                    req.commit(b, tokens[b, :counts[b]])
                after_step()
        done = True
    finally:
        program.finish()
        # a request eos finished advanced in vain: back to its committed tokens (after an
        # exception, whatever a block cut short left, both lengths set again)
        committed = np.array([len(s) - 1 for s in req.seq], np.int64)
        if not done or not np.array_equal(committed, cache.lengths):
            cache.truncate(np.minimum(committed, cache.lengths))

"""The drafters: what proposes the L future-position distributions a DDTree round builds on.

Each implements the protocol of kdtree_numba/drafting.py (``needs``, ``start``,
``propose(DraftContext)``, ``on_commit(Commit)``) over device arrays of the target's backend;
the engine never asks which one it holds.  Row d of a proposal is the drafter's distribution
for the token at depth d + 1 under the root.

* :class:`ModelDrafter`: any model of this architecture (a bundle) run greedily for L steps
  with its own KV cache of the verified sequence; step d's logits are row d (conditionals along
  its own greedy chain).  Its greedy tokens stay on the device.
* :class:`NoisyOracleDrafter`: FOR TESTS AND DEMOS ONLY.  It runs the *target* itself as a
  ModelDrafter (so it knows the target's greedy future) and replaces each row, with probability
  ``1 - agreement``, by noise whose top token is never the target's.  It costs L extra target
  forwards per round and reads its logits to the host: its tokens/s mean nothing.
* :class:`BlockDrafter`: a DFlash-style block drafter: one forward over [root, MASK x (L)],
  bidirectional inside the block, conditioned on the target's hidden state at the root's
  parent through a learned projection (weights in a ``block_drafter`` bundle).
* :class:`ReplayDrafter`: FOR BENCHMARKS.  It replays a known future (the target's own greedy
  continuation, from an AR run) at a chosen agreement, for free: what the tree machinery
  delivers when the drafter is good and costs nothing (tools/bench_engine.py's replay rows).
* ``DFlashDrafter`` (kdtree_numba/dflash.py): the DFlash block drafter itself, with a KV
  context of fused target features from several layers.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.bundle import (BundleError, block_drafter_shapes, open_bundle,
                                 read_bundle_config)
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.drafting import NO_NEEDS, Commit, DraftContext, TargetNeeds
from kdtree_numba.model import ForwardBatch, Model, causal_mask

__all__ = ["ModelDrafter", "NoisyOracleDrafter", "BlockDrafter", "DFlashDrafter",
           "ReplayDrafter", "load_drafter", "parse_oracle_spec", "ORACLE_FORM",
           "DEFAULT_AGREEMENT"]

DEFAULT_AGREEMENT = 0.8
ORACLE_FORM = "oracle[:AGREEMENT] with AGREEMENT in [0, 1], e.g. oracle:0.8"


class ModelDrafter:
    """L greedy steps of a small model of the same architecture (module docstring).

    Its KV cache holds, per request, the sequence the target has verified (``committed[b]``
    tokens, exact) followed by the KV of its own drafted chain (speculative, dropped at the
    next proposal).  ``propose`` feeds the last commit's tokens (the verified ones and the
    root: after the prefill the prompt and the first token, after a round the root, the
    accepted nodes and the bonus) in one forward whose row at the root gives row 0 (on a
    weight-streaming GPU an m-token forward costs about what a 1-token one does), then its
    own argmax L - 1 times, all on the device.
    """
    needs = TargetNeeds(tokens=True)

    def __init__(self, model: Model, block_len: int = 8, name: str = "model"):
        if block_len < 1:
            raise ValueError("block_len must be >= 1")
        self.model, self.block_len, self.name = model, int(block_len), name
        self.cache = None
        self.committed = np.zeros(0, np.int64)
        self.pending = None          # the last commit's (tokens, host counts)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @classmethod
    def load(cls, path, backend="auto", block_len: int = 8, *, verify: bool = True,
             progress=None) -> "ModelDrafter":
        """A model bundle as a drafter (``verify``, ``progress``: as in ``Model.load``)."""
        return cls(Model.load(path, backend, verify=verify, progress=progress), block_len,
                   name=f"model:{path}")

    def start(self, batch: int, max_len: int) -> None:
        # a kept cache of this batch and capacity: the CUDA graphs of its forwards replay
        self.cache = self.model.cache_for_generation(batch, max_len, owner="drafter")
        self.committed = np.zeros(batch, np.int64)
        self.pending = None

    def on_commit(self, commit: Commit) -> None:
        self.pending = (commit.tokens, np.asarray(commit.counts_host, np.int64))

    def propose(self, ctx: DraftContext):
        ops, xp = self.model.backend.ops, self.model.backend.xp
        bs = int(ctx.roots.shape[0])
        if self.cache is None or self.cache.batch != bs or self.pending is None:
            raise RuntimeError(f"call start({bs}, max_len) and commit the prompt before "
                               f"drafting for {bs} requests")
        tokens, counts = self.pending
        cache, m = self.cache, int(tokens.shape[1])
        cache.truncate(self.committed)            # the drafted chain was speculative
        # rows past the root are padding: written to scratch slots, never committed
        logits = self.model.forward(ForwardBatch(
            tokens, self.committed[:, None] + np.arange(m)[None, :], causal_mask(m, bs),
            logit_rows=counts, causal=True, prefill=True), cache)[:, 0]
        self.committed = self.committed + counts
        cache.advance(counts + 1)                 # the verified tokens, then the root's slot
        rows = [xp.ascontiguousarray(logits)]
        for _ in range(1, self.block_len):
            token = ops.argmax(rows[-1])          # on the device, fed straight back
            rows.append(xp.ascontiguousarray(self.model.decode(cache, token)))
            cache.advance(1)
        return xp.ascontiguousarray(xp.stack(rows, axis=1).astype(np.float32))


class NoisyOracleDrafter:
    """FOR TESTS AND DEMOS: the target's own future logits mixed with noise (module doc).

    It mixes on the host, so each ``propose`` reads the oracle's [bs, L, V] logits from the
    device: one extra sync per round (the engine's one-read-per-round contract excludes it).

    Row d is the target's distribution at depth d + 1 along its greedy continuation with
    probability ``agreement`` (independently per row, from ``seed``), otherwise Gaussian noise
    logits (``noise_scale``) in which the target's greedy token is pushed to the very bottom.
    So agreement 1 drafts the target's greedy path exactly and agreement 0 never ranks the
    target's greedy token first (nor anywhere in a top-K with K < V).  ``sharpness`` multiplies
    the agreeing rows' logits: > 1 makes the drafter confident, so the best-first tree spends its
    budget on depth (the target's greedy path) rather than on siblings.
    """

    def __init__(self, target: Model, block_len: int = 8, agreement: float = 0.8,
                 seed: int = 0, noise_scale: float = 2.0, sharpness: float = 1.0):
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"agreement must lie in [0, 1], got {agreement}")
        if not sharpness > 0:
            raise ValueError(f"sharpness must be > 0, got {sharpness}")
        self.oracle = ModelDrafter(target, block_len)
        self.block_len, self.agreement, self.seed = int(block_len), float(agreement), int(seed)
        self.noise_scale, self.sharpness = float(noise_scale), float(sharpness)
        self.name = f"oracle:{agreement:g}"
        self.rng = np.random.default_rng(self.seed)

    needs = ModelDrafter.needs

    @property
    def vocab_size(self) -> int:
        return self.oracle.vocab_size

    def start(self, batch: int, max_len: int) -> None:
        self.oracle.start(batch, max_len)
        self.rng = np.random.default_rng(self.seed)

    def on_commit(self, commit: Commit) -> None:
        self.oracle.on_commit(commit)

    def propose(self, ctx: DraftContext):
        be = self.oracle.model.backend
        exact = np.array(be.to_host(self.oracle.propose(ctx)), np.float32)
        bs, L, V = exact.shape
        keep = self.rng.random((bs, L)) < self.agreement
        noise = (self.noise_scale * self.rng.standard_normal((bs, L, V))).astype(np.float32)
        top = exact.argmax(axis=-1)
        b_idx, d_idx = np.meshgrid(np.arange(bs), np.arange(L), indexing="ij")
        noise[b_idx, d_idx, top] = noise.min(axis=-1) - 1.0
        mixed = np.where(keep[..., None], exact * np.float32(self.sharpness), noise)
        return be.asarray(np.ascontiguousarray(mixed, np.float32))


class BlockDrafter:
    """DFlash-style block drafter: ONE forward over ``[root, MASK x L]`` per round.

    The block is bidirectional (every slot sees every other), and each slot's input is its
    embedding (the root token's, or the learned MASK embedding) plus ``target_proj @ h``, where
    ``h`` [D_target] is the target's final normed hidden state at the position whose logits
    chose the root (the commit's ``hidden``, :class:`~kdtree_numba.drafting.TargetNeeds`).  That projected feature is the
    only context the block gets: there is no drafter KV cache across rounds, so the drafter is
    stateless and never needs to resynchronise.  Output row d (d = 1..L) is the distribution
    of the token at depth d: DFlash's per-position marginals, as the tree builder expects.

    Weights: a ``block_drafter`` bundle (a model bundle of the target's vocabulary plus
    ``block/target_proj [D, D_target]`` and ``block/mask_embedding [D]``; attributes
    ``block.target_hidden_size`` and ``block.block_len``).  ``make_random_bundle(...,
    role="block_drafter")`` writes an untrained one (correct and lossless, tau ~ 1); training
    one is outside this project.
    """
    needs = TargetNeeds(hidden=True)

    def __init__(self, model: Model, target_proj, mask_embedding, block_len: int = 7,
                 name: str = "block"):
        if block_len < 1:
            raise ValueError("block_len must be >= 1")
        be = model.backend
        self.model, self.block_len, self.name = model, int(block_len), name
        self.target_proj = be.asarray(np.asarray(target_proj, np.float32))
        self.mask_embedding = be.asarray(np.asarray(mask_embedding, np.float32))

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return int(self.target_proj.shape[1])

    @classmethod
    def load(cls, path, backend="auto", block_len: int | None = None, *, verify: bool = True,
             progress=None) -> "BlockDrafter":
        """A block_drafter bundle (``verify``, ``progress``: as in ``Model.load``)."""
        config, attrs = read_bundle_config(path)
        if attrs.get("kdtree.bundle") != "block_drafter":
            raise BundleError(f"{path}: not a block_drafter bundle")
        if "block.target_hidden_size" not in attrs:
            raise BundleError(f"{path}: no block.target_hidden_size attribute")
        extra = block_drafter_shapes(config, int(attrs["block.target_hidden_size"]))
        with open_bundle(path, extra_shapes=extra, verify=verify,
                         progress=progress) as (config, _, weights):
            model = Model(config, weights, backend)
            target_proj = weights["block/target_proj"]
            mask_embedding = weights["block/mask_embedding"]
        L = block_len or int(attrs.get("block.block_len", 7))
        return cls(model, target_proj, mask_embedding, L, name=f"block:{path}")

    def start(self, batch: int, max_len: int) -> None:
        self.batch, self.hidden = batch, None

    def on_commit(self, commit: Commit) -> None:
        self.hidden = commit.hidden          # the target's state that chose the next roots

    def propose(self, ctx: DraftContext):
        be, ops, xp = self.model.backend, self.model.backend.ops, self.model.backend.xp
        bs, n = int(ctx.roots.shape[0]), self.block_len + 1
        if self.hidden is None:
            raise RuntimeError("BlockDrafter.propose before its first commit (the target's "
                               "hidden state)")
        if tuple(self.hidden.shape) != (bs, self.target_hidden_size):
            raise ValueError(f"the target's hidden state must be {(bs, self.target_hidden_size)}"
                             f", got {tuple(self.hidden.shape)}")
        x = xp.empty((bs, n, self.model.config.hidden_size), np.float32)
        x[:, 0] = ops.embedding(be.asarray(ctx.roots).astype(np.int32), self.model.embed)
        x[:, 1:] = self.mask_embedding
        x += ops.linear(xp.ascontiguousarray(self.hidden, dtype=np.float32),
                        self.target_proj)[:, None, :]
        positions = be.asarray(ctx.positions).astype(np.int32)[:, None] \
            + xp.arange(n, dtype=np.int32)[None, :]
        cache = self.model.new_cache(bs, n)          # the block attends only within itself
        logits = self.model.forward(ForwardBatch(np.zeros((bs, n), np.int32), positions,
                                                 np.ones((bs, n, n), bool), embeds=x), cache)
        return xp.ascontiguousarray(logits[:, 1:])


class ReplayDrafter:
    """Drafts a known future (benchmarks only, module docstring): row d peaks at the true token
    at depth d + 1 with probability ``agreement``, else at a wrong one, with a runner-up so
    trees are not chains.  ``futures[b]``: request b's whole sequence (prompt + the target's
    greedy continuation).  Costs a [bs, L, V] fill of one reused device buffer, an upload of
    the peaks' flat indices and one scatter a round (or, without ``on_device``, a host array
    and its upload).  It keeps each root's position from the commits' host counts."""
    PEAK, RUNNER_UP = 12.0, 6.0     # the true (or wrong) token's logit and the runner-up's
    needs = NO_NEEDS

    def __init__(self, backend, vocab: int, futures, agreement: float, block_len: int = 8,
                 seed: int = 0, on_device: bool = False):
        self.backend, self.vocab_size, self.block_len = backend, int(vocab), int(block_len)
        self.futures, self.agreement, self.seed = futures, float(agreement), int(seed)
        self.on_device = on_device
        self.name = f"replay:{agreement:g}"
        self._device = None      # on_device: (shape, logits buffer, the peaks' values)
        self.positions = np.zeros(0, np.int64)

    def start(self, batch: int, max_len: int) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.positions = np.zeros(batch, np.int64)

    def on_commit(self, commit: Commit) -> None:
        self.positions = self.positions + np.asarray(commit.counts_host, np.int64)

    def propose(self, ctx: DraftContext):
        bs, L, V = self.positions.size, self.block_len, self.vocab_size
        # whole arrays, not a Python loop per position: the host builds this while the GPU
        # idles; the same uniforms in the same order
        rows, depths = np.indices((bs, L))
        true = np.zeros((bs, L), np.int64)
        for b, p in enumerate(self.positions):
            ahead = np.asarray(self.futures[b][p + 1:p + 1 + L], np.int64)
            true[b, :ahead.size] = ahead
        hit = self.rng.random((bs, L)) < self.agreement
        toks = np.where(hit, true, (true + 1 + depths) % V)
        row_start = (rows * L + depths) * V
        # the flat indices of every row's peak, then of its runner-up
        flat = np.concatenate([(row_start + toks).ravel(),
                               (row_start + (toks + 7) % V).ravel()])
        if not self.on_device:
            logits = np.zeros((bs, L, V), np.float32)
            logits.reshape(-1)[flat] = np.repeat([self.PEAK, self.RUNNER_UP], bs * L)
            return self.backend.asarray(logits)
        # one buffer per shape, refilled in stream order (a round's tree has read the last
        # logits before these writes run): three device calls a round
        if self._device is None or self._device[0] != (bs, L, V):
            values = np.repeat(np.float32([self.PEAK, self.RUNNER_UP]), bs * L)
            self._device = ((bs, L, V), self.backend.xp.zeros((bs, L, V), np.float32),
                            self.backend.asarray(values))
        _, logits, values = self._device
        logits.fill(0)
        logits.reshape(-1)[self.backend.asarray(flat)] = values
        return logits


def parse_oracle_spec(spec: str) -> float | None:
    """The agreement of an ``oracle[:AGREEMENT]`` spec, or None when ``spec`` names something
    else (a bundle: ``oracle.kdtr`` is a file).  A malformed agreement raises ValueError
    naming the spec and the expected form (:data:`ORACLE_FORM`)."""
    if spec != "oracle" and not spec.startswith("oracle:"):
        return None
    if spec == "oracle":
        return DEFAULT_AGREEMENT
    text = spec.split(":", 1)[1]
    try:
        agreement = float(text)
    except ValueError:
        agreement = float("nan")
    if not 0.0 <= agreement <= 1.0:
        raise ValueError(f"{spec}: AGREEMENT {text!r} is not a number in [0, 1]; expected "
                         f"{ORACLE_FORM}")
    return agreement


def load_drafter(spec: str, target: Model, block_len: int = 8, seed: int = 0, *,
                 verify: bool = True, progress=None, draft_vocab: int | None = None):
    """A drafter from a CLI spec: a model bundle (ModelDrafter), a block_drafter bundle
    (BlockDrafter, its own block length), a dflash_drafter bundle (DFlashDrafter for
    ``target``, its own block size; kdtree_numba/dflash.py), or ``oracle[:AGREEMENT]``
    (tests/demos).  ``verify``, ``progress``: as in ``Model.load``, for a bundle;
    ``draft_vocab``: a DFlash drafter's (ValueError for another drafter, where not None/0)."""
    agreement = parse_oracle_spec(spec)
    if agreement is not None:
        return NoisyOracleDrafter(target, block_len, agreement, seed)
    kind = read_bundle_config(spec)[1].get("kdtree.bundle")
    if kind == "dflash_drafter":
        return DFlashDrafter.load(spec, target, verify=verify, progress=progress,
                                  draft_vocab=draft_vocab)
    if draft_vocab:
        raise ValueError(f"draft_vocab {draft_vocab}: a DFlash drafter's option; {spec} is a "
                         f"{kind or 'model'} bundle")
    if kind == "block_drafter":
        return BlockDrafter.load(spec, target.backend, verify=verify, progress=progress)
    return ModelDrafter.load(spec, target.backend, block_len, verify=verify, progress=progress)

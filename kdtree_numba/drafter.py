"""Drafters: what proposes the L future-position distributions a DDTree round builds on.

Every drafter has ``vocab_size``, ``block_len`` (L, the tree's maximum depth), ``name`` and

* ``start(batch, max_len)``: reset for a new batch (max_len bounds its own caches);
* ``propose(histories) -> logits [bs, L, V]`` float32 on the target's backend, where
  ``histories[b]`` is request b's whole committed sequence (prompt + generated) and its last
  token is the root the target verifies from.  Row d is the drafter's distribution for the token
  at depth d + 1 under the root.

Drafters keep their own state in sync from the histories alone (they compare with what they
have cached), so the engine never has to tell them what was accepted.  On the GPU a drafter
must not read the device: the round's one host read is the engine's (docs/ENGINE.md).

* :class:`ModelDrafter`: any model of this architecture (a bundle) run greedily for L steps
  with its own KV cache; step d's logits are row d (conditionals along its own greedy chain).
  Its greedy tokens stay on the device.
* :class:`NoisyOracleDrafter`: FOR TESTS AND DEMOS ONLY.  It runs the *target* itself as a
  ModelDrafter (so it knows the target's greedy future) and replaces each row, with probability
  ``1 - agreement``, by noise whose top token is never the target's.  It costs L extra target
  forwards per round and reads its logits to the host: its tokens/s mean nothing.
* :class:`BlockDrafter`: a DFlash-style block drafter: one forward over [root, MASK x (L)],
  bidirectional inside the block, conditioned on the target's hidden state at the root's
  parent through a learned projection (weights in a ``block_drafter`` bundle).
* ``DFlashDrafter`` (kdtree_numba/dflash.py): the DFlash block drafter itself, with a KV
  context of fused target features from several layers; the engine feeds it those features
  and the roots instead of histories (its own ``propose(roots)``).
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.bundle import (BundleError, block_drafter_shapes, open_bundle,
                                 read_bundle_config)
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.model import Model

__all__ = ["ModelDrafter", "NoisyOracleDrafter", "BlockDrafter", "DFlashDrafter",
           "load_drafter", "parse_oracle_spec", "ORACLE_FORM", "DEFAULT_AGREEMENT"]

DEFAULT_AGREEMENT = 0.8
ORACLE_FORM = "oracle[:AGREEMENT] with AGREEMENT in [0, 1], e.g. oracle:0.8"


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class ModelDrafter:
    """L greedy steps of a small model of the same architecture (module docstring).

    Its KV cache holds, per request, the committed history it was last given (``cached[b]``,
    host tokens whose KV is exact) followed by the KV of its own drafted chain (speculative,
    never read back).  ``propose`` truncates to the part of ``cached[b]`` that the new history
    still starts with (never past the new root) and feeds the rest in one forward: after a
    round that committed m tokens that is exactly those m tokens (the accepted ones and the
    bonus, the last being the new root), so the drafted chain's KV is recomputed rather than
    compared on the host.  On a weight-streaming GPU an m-token forward costs about what a
    1-token one does.
    """

    def __init__(self, model: Model, block_len: int = 8, name: str = "model"):
        if block_len < 1:
            raise ValueError("block_len must be >= 1")
        self.model, self.block_len, self.name = model, int(block_len), name
        self.cache = None
        self.cached: list[np.ndarray] = []

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
        # the last generation's cache when it fits: the CUDA graphs of its forwards replay
        self.cache = self.model.reuse_cache(self.cache, batch, max_len)
        self.cached = [np.zeros(0, np.int64) for _ in range(batch)]

    def _catch_up(self, histories):
        """Feed each history's tokens past its exact cached prefix (at least the root);
        returns the logits row of each root, [bs, V]."""
        cache = self.cache
        keep = np.array([min(_common_prefix(self.cached[b], h), h.size - 1)
                         for b, h in enumerate(histories)], np.int64)
        cache.truncate(keep)
        logits = self.model.prefill(cache, [h[k:] for h, k in zip(histories, keep)])
        self.cached = [h.copy() for h in histories]
        return logits

    def propose(self, histories):
        if self.cache is None or self.cache.batch != len(histories):
            raise RuntimeError("call start(batch, max_len) before propose")
        ops, xp = self.model.backend.ops, self.model.backend.xp
        histories = [np.asarray(h, np.int64) for h in histories]
        rows = [self._catch_up(histories)]
        for _ in range(1, self.block_len):
            token = ops.argmax(rows[-1])          # on the device, fed straight back
            logits = self.model.decode(self.cache, token)
            self.cache.advance(1)
            rows.append(xp.ascontiguousarray(logits))
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

    @property
    def vocab_size(self) -> int:
        return self.oracle.vocab_size

    def start(self, batch: int, max_len: int) -> None:
        self.oracle.start(batch, max_len)
        self.rng = np.random.default_rng(self.seed)

    def propose(self, histories):
        be = self.oracle.model.backend
        exact = np.array(be.to_host(self.oracle.propose(histories)), np.float32)
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
    chose the root (the engine passes it as ``target_hidden``).  That projected feature is the
    only context the block gets: there is no drafter KV cache across rounds, so the drafter is
    stateless and never needs to resynchronise.  Output row d (d = 1..L) is the distribution
    of the token at depth d: DFlash's per-position marginals, as the tree builder expects.

    Weights: a ``block_drafter`` bundle (a model bundle of the target's vocabulary plus
    ``block/target_proj [D, D_target]`` and ``block/mask_embedding [D]``; attributes
    ``block.target_hidden_size`` and ``block.block_len``).  ``make_random_bundle(...,
    role="block_drafter")`` writes an untrained one (correct and lossless, tau ~ 1); training
    one is outside this project.
    """
    needs_target_hidden = True

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
        self.batch = batch

    def propose(self, histories, target_hidden=None):
        if target_hidden is None:
            raise ValueError("BlockDrafter.propose needs the target's hidden state")
        be, ops, xp = self.model.backend, self.model.backend.ops, self.model.backend.xp
        bs, n = len(histories), self.block_len + 1
        if tuple(target_hidden.shape) != (bs, self.target_hidden_size):
            raise ValueError(f"target_hidden must be {(bs, self.target_hidden_size)}, got "
                             f"{tuple(target_hidden.shape)}")
        roots = np.array([int(h[-1]) for h in histories], np.int32)
        x = xp.empty((bs, n, self.model.config.hidden_size), np.float32)
        x[:, 0] = ops.embedding(be.asarray(roots), self.model.embed)
        x[:, 1:] = self.mask_embedding
        x += ops.linear(xp.ascontiguousarray(target_hidden, dtype=np.float32),
                        self.target_proj)[:, None, :]
        starts = np.array([len(h) - 1 for h in histories], np.int64)
        cache = self.model.new_cache(bs, n)          # the block attends only within itself
        logits = self.model.forward(np.zeros((bs, n), np.int32),
                                    starts[:, None] + np.arange(n)[None, :], cache,
                                    np.ones((bs, n, n), bool), embeds=x)
        return xp.ascontiguousarray(logits[:, 1:])


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
                 verify: bool = True, progress=None):
    """A drafter from a CLI spec: a model bundle (ModelDrafter), a block_drafter bundle
    (BlockDrafter, its own block length), a dflash_drafter bundle (DFlashDrafter for
    ``target``, its own block size; kdtree_numba/dflash.py), or ``oracle[:AGREEMENT]``
    (tests/demos).  ``verify``, ``progress``: as in ``Model.load``, for a bundle."""
    agreement = parse_oracle_spec(spec)
    if agreement is not None:
        return NoisyOracleDrafter(target, block_len, agreement, seed)
    kind = read_bundle_config(spec)[1].get("kdtree.bundle")
    if kind == "block_drafter":
        return BlockDrafter.load(spec, target.backend, verify=verify, progress=progress)
    if kind == "dflash_drafter":
        return DFlashDrafter.load(spec, target, verify=verify, progress=progress)
    return ModelDrafter.load(spec, target.backend, block_len, verify=verify, progress=progress)

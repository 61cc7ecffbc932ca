"""The DFlash block drafter: a short stack of decoder layers conditioned on the target's own
hidden states, drafting all B - 1 positions after the root in one forward.

The spec (the engine and the torch trainer both implement it) is docs/ENGINE.md, "DFlash
block drafter"; the trained demo pair is docs/DEMO.md.  In short:

* **Weights.** A ``dflash_drafter`` bundle (kdtree_numba/bundle.py, :func:`dflash_shapes`):
  n DeepSeek-V3 decoder layers of the target's width (dense MLPs, a plain q_proj), a final
  norm, ``dflash/fc`` [D, k D], ``dflash/hidden_norm`` [D] and ``dflash/mask_embedding`` [D].
  No embedding and no lm_head: the drafter's :class:`~kdtree_numba.model.Model` gets the
  target's arrays (shared, not copied).
* **Features.** ``feature(t)`` is the residual stream after each target layer of
  ``spec.target_layer_ids`` at token t, concatenated [k D] (``ForwardBatch(...,
  capture_layers=...)``: the prefill and the verify forward return them, nothing runs twice);
  fused ``f(t) = rmsnorm(fc feature(t), hidden_norm)``.
* **Context.** The drafter's own KV cache holds, per request, one entry per token whose
  features are known, at its absolute position: the prompt after prefill, then each round's
  root and accepted nodes.  :meth:`DFlashDrafter.extend_context` injects them: every drafter
  layer caches ``kv_a(f)`` (its latent and rope key, ``Model.kv_latents``) and commits.  Only
  target-verified tokens ever enter it, so nothing is trimmed: it always equals the target's
  cache length, the position of the root.
* **Propose.** One forward over the block ``[embed(root), MASK x (B - 1)]`` at positions
  ``P .. P + B - 1`` (P = context length), bidirectional inside the block, attending to the
  whole context; logits of slots 1..B-1 are the marginals of depths 1..B-1 the tree is built
  from.  The block's latents are written uncommitted at ``[P, P + B)`` and overwritten by the
  next context.  On the CPU path (``trim_block``) a proposal of depth d < B - 1 runs the
  block's first d + 1 rows only, and a commit injects only the rows that enter the context.

* **Draft vocabulary** (``draft_vocab`` N, FR-Spec's frequency-ranked drafting): with a
  bundle that ranks the target's tokens by frequency (``dflash/vocab_rank``,
  tools/draft_vocab.py), the lm_head runs on a contiguous copy of the N most frequent tokens'
  rows (made once, in id order) and every other token's logit is :data:`MASKED_LOGIT`: the
  same [bs, d, V] logits, a head read N / V as large.  The tree then holds only those tokens;
  the acceptance reads the target alone, so the tokens committed are the same.

Everything runs through the drafter's Model and the backend's ops, so the reference backend
and the numba kernels both run it (no kernel of its own); on the GPU the context injection
and the block forward replay CUDA graphs once their shapes repeat, and nothing is read back.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from kdtree_numba import cpu, runtime
from kdtree_numba.bundle import (DFLASH_VOCAB_RANK, BundleError, DFlashSpec,
                                 check_vocab_rank, dflash_shapes, open_dflash_bundle,
                                 read_dflash_spec)
from kdtree_numba.config import ModelConfig
from kdtree_numba.drafting import Commit, DraftContext, TargetNeeds
from kdtree_numba.kvcache import KVCache
from kdtree_numba.kvlayout import device_address
from kdtree_numba.model import ForwardBatch, Model

__all__ = ["DFlashDrafter", "context_phase", "MASKED_LOGIT", "subset_ids"]

DFLASH_TENSORS = ("dflash/fc", "dflash/hidden_norm", "dflash/mask_embedding")
# the logit of a token outside the draft vocabulary: finite (top-K takes finite logits only),
# far below any real logit, and still finite divided by any draft temperature >= 1e-8 (the
# tree is built from logits / t_d); its softmax weight is exactly 0 in float32 and float64
MASKED_LOGIT = np.float32(-1e30)


def subset_ids(rank, n: int | None) -> np.ndarray | None:
    """The token ids a draft vocabulary of ``n`` keeps, ascending (int32), from a ranking
    (``check_vocab_rank``'s, most frequent first): the first ``n``; None for the whole
    vocabulary (``n`` None, 0 or the vocabulary's size).  ValueError for n outside
    [0, V]; BundleError when n asks for a cut and there is no ranking."""
    if n is None or n == 0:
        return None
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"draft_vocab must be an int or None, got {type(n).__name__}")
    vocab = None if rank is None else len(rank)
    if n < 0 or (vocab is not None and n > vocab):
        raise ValueError(f"draft_vocab {n}: must lie in [1, {vocab or 'V'}] (0 or None: "
                         f"the whole vocabulary)")
    if rank is None:
        raise BundleError(f"draft_vocab {n} needs the drafter bundle's token ranking "
                          f"({DFLASH_VOCAB_RANK}, written by tools/draft_vocab.py); this "
                          f"drafter has none")
    return None if n == vocab else np.sort(np.asarray(rank[:n], np.int32))


def context_phase(model: Model, cache: KVCache, fc, hidden_norm):
    """features [bs, m, k D], lengths [bs] (the cache's device lengths)[, slots] -> (): fuse
    the features and write every drafter layer's latents of them at the next m slots (slot =
    position; uncommitted; device work only, so a CUDA graph can capture it).  ``slots``:
    those m slots with their positions, made by the caller (a device round's,
    ``Commit.slots``), else made here."""
    xp, ops, cfg = model.backend.xp, model.backend.ops, model.config

    def run(features, lengths, slots=None):
        bs, m, width = features.shape
        x = xp.ascontiguousarray(features.reshape(bs * m, width), dtype=np.float32)
        f = ops.rmsnorm(ops.linear(x, fc), hidden_norm, cfg.rms_norm_eps)
        if slots is None:
            slots = cache.device_slots(lengths, m)
        if slots.positions is not None:
            positions = slots.positions.reshape(bs * m)
        elif slots.rows is None:     # KDTREE_LEAN_ROUND: one int32 add (the same positions)
            positions = cache.positions(lengths, m)
        else:
            positions = xp.ascontiguousarray(slots.rows.reshape(bs * m)).astype(np.int32)
        for layer in range(cfg.num_hidden_layers):
            model.kv_latents(layer, f, positions, into=cache.latent_store(layer, slots))
        return ()
    return run


class DFlashDrafter:
    """A DFlash block drafter for one target model (module docstring), a
    :class:`~kdtree_numba.drafting.Drafter`.

    ``needs`` asks the target for the residual streams after ``feature_layers``; each commit's
    features of the newly verified tokens (the prompt after prefill, the root and the
    accepted nodes after a round) extend its context (:meth:`extend_context`);
    :meth:`propose` drafts from the roots (:meth:`draft`).  ``block_len`` (L = B - 1) is the
    tree's maximum depth.  ``draft_vocab`` (module docstring): 0, the whole vocabulary; N,
    the N most frequent tokens of ``weights``' ranking (``dflash/vocab_rank``;
    :func:`subset_ids`); the drafter's ``draft_vocab`` is then N (None where it ranks all),
    which a DDTree budget's top-K must not exceed (``engine.generate`` checks).  None: the
    whole vocabulary, except on the CPU path with a ranking, where a draft at T > 0 ranks the
    ``cpu.SAMPLED_DRAFT_VOCAB`` most frequent tokens (the tree's candidates only; its
    ``draft_vocab`` stays None: budgets past that N see masked candidates, never a refusal)."""

    def __init__(self, target: Model, config: ModelConfig, weights: Mapping[str, Any],
                 spec: DFlashSpec, name: str = "dflash", *, draft_vocab: int | None = None):
        problem = spec.config_problem(config) or spec.target_problem(target.config)
        if problem:
            raise BundleError(problem)
        be = target.backend
        expected = dflash_shapes(config, len(spec.target_layer_ids))
        own = {}
        for tensor in DFLASH_TENSORS:
            own[tensor] = weights[tensor]          # read once (a bundle's are read on access)
            if tuple(own[tensor].shape) != expected[tensor]:
                raise BundleError(f"tensor {tensor} has shape {tuple(own[tensor].shape)}, "
                                  f"expected {expected[tensor]}")
        # On the CPU path (the reference backend in float32) a proposal of depth d forwards
        # the block's first d + 1 rows only (draft): its cost grows with the rows there,
        # and the mask rows past d, which no tree of that depth reads, moved the demo pair's
        # tau by < 1% (docs/ENGINE.md, "The CPU path"); its ops need not be batch invariant
        # (cpu.drafter_ops).  Elsewhere the full block, as trained, on the target's ops.
        self.trim_block = be.cpu_path
        if self.trim_block:
            self._bits = cpu.Bf16Bits()
            be = dataclasses.replace(be, ops=cpu.drafter_ops(be.ops, self._bits))
            cpu.compile_drafter_kernels()
        rank = weights[DFLASH_VOCAB_RANK] if DFLASH_VOCAB_RANK in weights else None
        if rank is not None:
            rank = check_vocab_rank(rank, config.vocab_size)
        ids = subset_ids(rank, draft_vocab)
        head, self.vocab_ids, self.draft_vocab = target.lm_head, None, None
        if ids is not None:       # the kept rows, contiguous, once: the head each draft reads
            self.vocab_ids = be.asarray(ids)
            head = _head_rows(be, target.lm_head, self.vocab_ids)
            self.draft_vocab = int(ids.size)
        # the CPU path's default at T > 0 (draft_vocab None, a bundle that ranks): the
        # cpu.SAMPLED_DRAFT_VOCAB most frequent tokens' rows, read by a draft whose context
        # says T > 0 (draft); T = 0 keeps the whole vocabulary (docs/ENGINE.md, "The CPU path")
        self._sampled, self._flat = None, {}
        if self.trim_block and draft_vocab is None and rank is not None:
            cut = subset_ids(rank, min(cpu.SAMPLED_DRAFT_VOCAB, config.vocab_size))
            if cut is not None:
                cut = be.asarray(cut)
                self._sampled = (cut, _head_rows(be, target.lm_head, cut))
        self.model = Model(config, weights, be, shared={"model/embed_tokens": target.embed,
                                                        "lm_head": head})
        fc, hidden_norm = own["dflash/fc"], own["dflash/hidden_norm"]
        if self.trim_block:       # float32 once (the same values): the CPU path's ops widen a
            # bf16 weight on every call, which cost a commit's injection ~70 us for fc alone
            fc, hidden_norm = be.weight(fc), be.weight(hidden_norm)
        self.fc = be.asarray(np.ascontiguousarray(fc))
        self.hidden_norm = be.asarray(np.ascontiguousarray(hidden_norm))
        if self.trim_block:       # the weights a draft's GEMVs read, as bf16 bits where exact
            self._bits.add(self.fc, self.model.lm_head, *(
                w for layer in self.model.layers for w in vars(layer).values()))
            if self._sampled is not None:
                self._bits.add(self._sampled[1])
        self.mask_embedding = be.asarray(np.asarray(own["dflash/mask_embedding"], np.float32))
        self.spec, self.name = spec, name
        self.feature_layers: tuple[int, ...] = spec.target_layer_ids
        self.block_len = spec.block_size - 1
        self.cache: KVCache | None = None

    @classmethod
    def load(cls, path, target: Model, *, verify: bool = True, progress=None,
             draft_vocab: int | None = None) -> "DFlashDrafter":
        """A ``dflash_drafter`` bundle for ``target``, on the target's backend.  A drafter
        trained for another target (hidden size, vocabulary, a feature layer the target lacks,
        another number of layers) raises :class:`BundleError` naming the mismatch before any
        weight is read.  ``verify``, ``progress``: as in ``Model.load``; ``draft_vocab``: as
        in the constructor (the bundle's ranking)."""
        _, spec = read_dflash_spec(path)
        problem = spec.target_problem(target.config)
        if problem:
            raise BundleError(f"{path}: {problem}")
        with open_dflash_bundle(path, verify=verify, progress=progress) as \
                (config, weights, spec):
            return cls(target, config, weights, spec, name=f"dflash:{path}",
                       draft_vocab=draft_vocab)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def needs(self) -> TargetNeeds:
        return TargetNeeds(feature_layers=self.feature_layers)

    @property
    def context_lengths(self) -> np.ndarray:
        """Entries in each request's context (host int64 [bs])."""
        return self.cache.lengths.copy()

    # propose and on_commit read no host value when the commit's host counts are absent:
    # the engine may run whole rounds as one device program (kdtree_numba/device_round.py)
    device_only = True

    def start(self, batch: int, max_len: int) -> None:
        """An empty context for ``batch`` requests of up to ``max_len`` positions (a kept cache
        of that batch and capacity when there is one, so its CUDA graphs replay)."""
        self.cache = self.model.cache_for_generation(batch, max_len, owner="drafter")
        B, xp = self.spec.block_size, self.model.backend.xp
        # the block forward's token ids (unused: it takes embeddings) and visibility, on the
        # device once, so a proposal uploads nothing; kept while the batch is (a captured
        # device round holds their addresses)
        if getattr(self, "_block", None) is None or self._block[0].shape[0] != batch:
            self._block = (xp.zeros((batch, B), np.int32), xp.ones((batch, B, B), bool),
                           xp.arange(B, dtype=np.int32))
            # KDTREE_LEAN_ROUND: the block's embeddings, its mask rows written once; a
            # proposal writes row 0 only (one copy, where the concatenation copied both parts)
            D = self.model.config.hidden_size
            self._embeds = xp.empty((batch, B, D), np.float32)
            self._embeds[:, 1:] = self.mask_embedding

    def _started(self, bs: int) -> KVCache:
        if self.cache is None or self.cache.batch != bs:
            raise RuntimeError(f"call start({bs}, max_len) before feeding {bs} requests")
        return self.cache

    def extend_context(self, features, lengths) -> None:
        """Append ``lengths[b]`` (host ints) entries to request b's context: the first
        ``lengths[b]`` rows of ``features`` [bs, m, k D] (float32, device or host; the rows of
        the next tokens in order, the rest ignored), fused and injected into every layer's
        cache at the next positions, and committed."""
        m = int(features.shape[1])
        lengths = np.broadcast_to(np.asarray(lengths, np.int64), (int(features.shape[0]),))
        if np.any(lengths < 0) or np.any(lengths > m):
            raise ValueError(f"lengths {lengths.tolist()} must lie in [0, {m}]")
        if self.trim_block:      # the CPU path: only the rows that enter a context (a round's
            features = features[:, :int(lengths.max())]    # commit fills 1.7 of 16 at T = 1)
        self._inject(features)
        self.cache.advance(lengths)

    def extend_on_device(self, features, counts, slots=None, grown: bool = False) -> None:
        """:meth:`extend_context` by device ``counts`` [bs] (never read): the same injection,
        then the context lengths grow on the device (``grown``: the caller grew them
        already).  The host's mirror of them is the caller's (a device round program:
        ``KVCache.expect_device_growth``).  ``slots``: as :meth:`_inject`'s."""
        self._inject(features, slots)
        if not grown:
            self.cache.add_on_device(counts)

    def _inject(self, features, slots=None) -> int:
        """Fuse ``features`` [bs, m, k D] and write every layer's latents of them at the next
        m slots (uncommitted); returns m.  ``slots``: those slots with their positions, made
        by a device round (``Commit.slots``: run inside its program, never as a graph of the
        drafter's own, whose key could not name them)."""
        bs, m, width = (int(d) for d in features.shape)
        cache = self._started(bs)
        if width != len(self.feature_layers) * self.model.config.hidden_size:
            raise ValueError(f"features must be [bs, m, {len(self.feature_layers)} * "
                             f"{self.model.config.hidden_size}], got {tuple(features.shape)}")
        if m and slots is not None:
            # the block's first m slots (a tree shallower than the block commits fewer rows;
            # for bs > 1 the cut is a copy each, once, not one per layer's reshape), never the
            # lengths, which the round grew already
            if int(slots.storage.shape[1]) != m:
                xp = self.model.backend.xp
                slots = dataclasses.replace(
                    slots, storage=xp.ascontiguousarray(slots.storage[:, :m]),
                    positions=xp.ascontiguousarray(slots.positions[:, :m]))
            context_phase(self.model, cache, self.fc, self.hidden_norm)(
                features, cache.device_lengths, slots)
        elif m:
            cache.reserve(m)
            self.model.device_step(("dflash_context",) + cache.buffer_key(),
                                   context_phase(self.model, cache, self.fc, self.hidden_norm),
                                   (features, cache.device_lengths))
        return m

    def graph_key(self) -> tuple:
        """The device state a captured device round reads and writes of this drafter: its
        context cache's buffers and lengths, its block's constant arrays (addresses)."""
        return self._started(self.cache.batch).buffer_key() + tuple(
            device_address(a) for a in self._block + (self._embeds,))

    def bound_lengths(self, floor, upper) -> None:
        """A device round's host side (kdtree_numba/device_round.py): the context's lengths,
        always the target cache's, lie in ``[floor, upper]`` (host ints; exact where equal),
        and the room for a block after them is checked (its replays run no Python)."""
        cache = self._started(len(floor))
        if np.array_equal(floor, upper):
            cache.confirm_lengths(floor)
        else:
            cache.expect_device_growth(floor, upper)
            cache.check_room(self.spec.block_size)

    def prepare_capture(self) -> None:
        """Before a CUDA graph captures a device round that runs this drafter: its model's
        attention plans are made inside the capture, so their scratch is recorded with it."""
        self.model.fresh_attention_plans()

    def on_commit(self, commit: Commit) -> None:
        """Extend the context by the commit's features: by its host counts where the engine
        has read them, else (a device round) by its device counts, on the device."""
        if commit.counts_host is None:
            self.extend_on_device(commit.features, commit.counts, commit.slots, commit.grown)
        else:
            self.extend_context(commit.features, commit.counts_host)

    @property
    def context_cache(self) -> KVCache:
        """The context's KV cache (drafting.py: a device round makes its block's slots and
        grows its lengths, ``KDTREE_ROUND_EPILOGUE``)."""
        return self.cache

    def propose(self, ctx: DraftContext):
        return self.draft(ctx.roots, ctx.depth, ctx.temperature, ctx.slots)

    def draft(self, roots, depth: int | None = None, temperature: float = 0.0, slots=None):
        """Logits [bs, d, V] float32 (device) of depths 1..d (d = B - 1, or ``depth`` where
        smaller) under each request's root ``roots`` [bs] (host or device ints), which sits
        at the position after its context: one forward over ``[root, MASK x (B - 1)]``, the
        lm_head on its rows 1..d only.  With ``trim_block`` (the CPU path) the forward is
        over ``[root, MASK x d]``: the rows a tree of depth d can use.  With a draft
        vocabulary the head covers its tokens only, the others' logits MASKED_LOGIT; so does
        the CPU path's default one at ``temperature`` > 0 (the round's sampling temperature;
        constructor).  ``slots``: the block's slots with their positions in the context's
        cache, made by a device round (``DraftContext.slots``), used where the whole block
        runs."""
        be, xp, ops = self.model.backend, self.model.backend.xp, self.model.backend.ops
        cache = self._started(len(roots))
        bs, B, D = cache.batch, self.spec.block_size, self.model.config.hidden_size
        d = B - 1 if depth is None else max(1, min(B - 1, int(depth)))
        tokens, visible, steps = self._block
        if self.trim_block and d + 1 < B:
            B = d + 1
            tokens, visible, steps = tokens[:, :B], visible[:, :B, :B], steps[:B]
        roots = roots if hasattr(roots, "__cuda_array_interface__") \
            else np.asarray(roots, np.int32)
        first = ops.embedding(be.asarray(roots).astype(np.int32, copy=False), self.model.embed)
        if B == self.spec.block_size and runtime.current().lean_round:
            x = self._embeds
            x[:, 0] = first
        else:
            x = xp.concatenate([first.reshape(bs, 1, D),
                                xp.broadcast_to(self.mask_embedding, (bs, B - 1, D))], axis=1)
        if slots is not None and int(slots.storage.shape[1]) != B:
            slots = None
        # the context's device lengths: no host value, so a device round can capture it
        positions = cache.device_lengths[:, None] + steps[None, :] if slots is None \
            else slots.positions
        batch = ForwardBatch(tokens, positions, visible, embeds=x, logit_span=(1, 1 + d),
                             slots=slots)
        vocab_ids = self.vocab_ids
        if self._sampled is not None and temperature > 0:
            vocab_ids, full_head = self._sampled[0], self.model.lm_head
            self.model.lm_head = self._sampled[1]     # this forward's head only
            try:
                logits = self.model.forward(batch, cache)
            finally:
                self.model.lm_head = full_head
        else:
            logits = self.model.forward(batch, cache)
        if vocab_ids is None:
            return logits
        full = xp.full((bs, d, self.vocab_size), MASKED_LOGIT, np.float32)
        if self.trim_block:      # the CPU path: one flat int64 scatter (37 -> 13 us at d = 2)
            full.reshape(-1)[self._flat_ids(vocab_ids, bs * d)] = logits.reshape(-1)
        else:
            full[:, :, vocab_ids] = logits
        return full

    def _flat_ids(self, vocab_ids, rows: int):
        """The flat positions of ``vocab_ids`` in each of ``rows`` rows of the vocabulary
        (host int64, made once a head and a row count): a [rows, V] scatter's indices."""
        key = (id(vocab_ids), rows)
        got = self._flat.get(key)
        if got is None or got[0] is not vocab_ids:
            flat = (np.arange(rows)[:, None] * self.vocab_size
                    + np.asarray(vocab_ids, np.int64)[None, :]).reshape(-1)
            got = self._flat[key] = (vocab_ids, flat)
        return got[1]


def _head_rows(be, lm_head, ids):
    """The rows ``ids`` of ``lm_head``, contiguous (a draft vocabulary's head, made once)."""
    return be.xp.ascontiguousarray(be.xp.take(lm_head, ids, axis=0))

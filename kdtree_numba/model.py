"""A DeepSeek-V3 / Kimi-K2 (MLA + MoE) model, written once, running on either backend.

``Model`` runs the forward pass of a ``ModelConfig`` (kdtree_numba/config.py, which also has
``weight_shapes``, the parameters in bundle layout) through ``backend.xp`` (glue) and
``backend.ops`` (kernels) only, so the NumPy reference and the numba.cuda kernels execute the
very same model code (kdtree_numba/backends.py).

One forward serves every phase: ``model.forward(ForwardBatch(tokens [bs, n], positions [bs, n],
visible [bs, n, n]), cache) -> logits [bs, n, V]`` writes the n new latents into the cache at
``[len_b, len_b + n)`` (uncommitted: the caller commits, kvcache.py) and lets token i of request
b attend to the cached prefix plus the new tokens j with ``visible[b, i, j]``.  A causal
``visible`` is prefill, n = 1 is decode, a DDTree ancestor mask with depth positions is tree
verification.  The math is docs/ENGINE.md, "The forward pass" (absorbed MLA, docs/ATTENTION.md:
the cache holds only the latent c and the rope key).

What decoding needs is a model method (the engine's seam, docs/ENGINE.md): ``prefill`` (ragged
sequences, committed), ``decode`` (one token per request), ``cache_for_generation``,
``graph_counts``, and the device steps of a round (kdtree_numba/steps.py: ``choose``,
``draft_tree``, ``accept``, ``last_accepted``, ``accepted_rows``, ``compact``).  On the GPU the
model owns the CUDA graphs its forwards and steps replay from (kdtree_numba/graphs.py) and
builds their keys.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping

import numpy as np

from kdtree_numba import attention as numba_attention, runtime
from kdtree_numba.backends import Backend, make_backend
from kdtree_numba.bundle import open_bundle
# ModelConfig, weight_shapes and HF_MODEL_TYPES live in config.py; they stay importable from
# here, where they were first documented.
from kdtree_numba.config import HF_MODEL_TYPES, ModelConfig, weight_shapes
from kdtree_numba.graphs import GraphCache, graphs_enabled
from kdtree_numba.kvcache import CACHE_DTYPES, KVCache, WriteSlots
from kdtree_numba.kvlayout import layout_spec, make_layout
from kdtree_numba.steps import DeviceSteps
from kdtree_numba.weights import load_weight
from reference.layers import RopeSpec

__all__ = ["ModelConfig", "Model", "ForwardBatch", "LayerWeights", "weight_shapes",
           "causal_mask", "pad_ragged", "prefill_rows", "LATENT_NORM_EPS", "HF_MODEL_TYPES",
           "CACHE_BUCKET"]

# generation caches are sized in steps of this many tokens, so that the next generation can reuse
# one (and the CUDA graphs captured against it): Model.reuse_cache
CACHE_BUCKET = 256
# generation caches a model keeps per owner (engine, drafter), by capacity bucket, the least
# recently used dropped: prompts of different lengths need caches of different buckets, and a
# cache's CUDA graphs replay only on it, so with one cache kept, prompts alternating between
# two buckets made a new cache, and recaptured every graph, on each generation
GENERATION_CACHES = 4
# q_a_layernorm and kv_a_layernorm use 1e-6 whatever rms_norm_eps says (DeepSeek's code).
LATENT_NORM_EPS = 1e-6


def causal_mask(n: int, bs: int = 1) -> np.ndarray:
    """visible [bs, n, n] for prefill: token i sees new tokens j <= i."""
    return np.broadcast_to(np.tri(n, dtype=bool), (bs, n, n)).copy()


def prefill_rows(n: int) -> int:
    """The rows a padded prefill of n tokens runs (``Model.pad_prefills``): the next power of
    two from 16 to 64, then the next multiple of 64, or of 1/16 to 1/8 of n past 1,024.  A
    prompt's CUDA graph is captured per row count (kdtree_numba/graphs.py), so the held-out
    prompts' 93 lengths share 7 graphs; the padding's cost is a launch-bound model's nothing
    below ~128 rows and at most 1/8 of a long prompt's compute."""
    n = int(n)
    if n <= 64:
        return max(16, 1 << (n - 1).bit_length())
    step = max(64, 1 << ((n - 1).bit_length() - 4))
    return -(-n // step) * step


def pad_ragged(seqs, rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids [bs, n] int64, lengths [bs] int64, visible [bs, n, n])`` of ragged token
    sequences: right-padded with 0 to n (``rows``, else the longest) and the causal mask, the
    inputs of one prefill-shaped forward (the padding rows are computed and ignored)."""
    lengths = np.array([len(s) for s in seqs], np.int64)
    n = int(lengths.max()) if rows is None else int(rows)
    if n < int(lengths.max()):
        raise ValueError(f"rows {n} < the longest sequence's {int(lengths.max())} tokens")
    ids = np.zeros((len(seqs), n), np.int64)
    for b, s in enumerate(seqs):
        ids[b, :lengths[b]] = s
    return ids, lengths, causal_mask(n, len(seqs))


def _bucket(max_len: int) -> int:
    """A generation cache's capacity for ``max_len`` slots: the next multiple of
    CACHE_BUCKET."""
    return -(-int(max_len) // CACHE_BUCKET) * CACHE_BUCKET


# slotted, not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__ (1.7 us for these ten against 0.5), and every verify forward makes one on
# the engine's host path; nothing writes a batch's fields after making it
@dataclasses.dataclass(slots=True, eq=False)
class ForwardBatch:
    """One forward's batch, what :meth:`Model.forward` takes: n new tokens per request and
    what to return for them.  Made once per forward by its caller (one small object holding
    its arrays, never copying them).

    ``tokens``, ``positions`` [bs, n] int and ``visible`` [bs, n, n] bool: host or device
    arrays (a device ``tokens``, e.g. a drafter's own argmax, is used in place, never read
    back); token i of request b sees the cached prefix and the new tokens j with
    ``visible[b, i, j]``.
    ``embeds`` [bs, n, D] float32 replaces the token embeddings (tokens then only give the
    shape; the block drafters feed MASK slots and target features this way).
    ``logit_rows`` [bs] (host ints in [0, n)): only row ``logit_rows[b]`` of request b goes
    through the lm_head, and logits are [bs, 1, V].  A prefill needs only its last token's
    logits (the lm_head of every row is a large share of a long prompt's forward).  On tensor
    cores the linear is batch invariant, so the row gets the same bits either way; on CUDA
    cores a few rows take another kernel (last-bit differences).
    ``logit_span`` (start, stop), Python ints with 0 <= start < stop <= n: only rows
    ``start .. stop - 1`` of every request go through the lm_head, and logits are
    [bs, stop - start, V] (a block drafter's round reads only the depths its tree can reach);
    not with ``logit_rows``.
    ``causal``: a promise that ``visible[b, i, j]`` is false for j > i (a prefill's causal
    mask; a DDTree verify, whose parents precede their children): attention then skips the
    keys after each block's last token, the same bits for half a long prefill's work.
    ``prefill``: the rows are a prompt's (:meth:`Model.prefill`, :meth:`Model.score`), whose
    bits no later decode or verify must reproduce: batch-invariant attention then takes each
    row's keys in one split instead of fixed chunks (kdtree_numba/attention/mla.py), 2.9x
    faster at 4,096 tokens; a prompt still gets the same bits alone or in a batch.
    ``return_hidden``: also return the final normed hidden states [bs, n, D].
    ``capture_layers`` (decoder layer indices, 0-based): also return the residual stream
    after each listed layer (before any final norm), concatenated in the order given:
    features [bs, n, k * D] float32, the DFlash drafter's target features
    (kdtree_numba/dflash.py), from the same pass.
    ``slots`` (kvcache.WriteSlots): where the new latents go.  None (the usual): after the
    cache's lengths (``cache.write_slots``).  Given: device slots the caller made
    (``cache.device_slots`` of device lengths), for a device program that captures the forward
    in a graph of its own (kdtree_numba/device_round.py); the forward then runs eagerly,
    never from one of the model's graphs, whose key could not name them.
    """
    tokens: Any
    positions: Any
    visible: Any
    embeds: Any = None
    logit_rows: Any = None
    logit_span: tuple | None = None
    causal: bool = False
    prefill: bool = False
    return_hidden: bool = False
    capture_layers: tuple = ()
    slots: WriteSlots | None = None


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights on the backend, in the layouts the kernels take (bundle
    names in ``config.weight_shapes``).  Attention: ``q_proj`` without a q LoRA, else
    ``qkv_a`` (q_a and kv_a stacked: one GEMM) with ``q_a_norm`` and ``q_b``; ``kv_a`` is
    kv_a_proj_with_mqa (a row block of ``qkv_a`` when fused); ``kv_b`` float32 (absorbed
    MLA's head products).  FFN: ``gate_up`` [E, 2I, D] (gate rows, then up rows) and
    ``down`` [E, D, I], one expert for a dense layer; a MoE layer's ``router`` [E, D] and
    ``router_bias`` [E] (float32) and its shared expert's ``shared_gate_up`` /
    ``shared_down`` (None without one)."""
    input_norm: Any
    post_norm: Any
    kv_a_norm: Any
    kv_b: Any
    o_proj: Any
    kv_a: Any = None
    q_proj: Any = None
    qkv_a: Any = None
    q_a_norm: Any = None
    q_b: Any = None
    gate_up: Any = None
    down: Any = None
    router: Any = None
    router_bias: Any = None
    shared_gate_up: Any = None
    shared_down: Any = None



# ----------------------------------------------------------------------------- the model


def _model_plans():
    """A model's attention plans: attention's output has one reader, the model's apply_uv,
    which may merge the key splits itself (``KDTREE_MERGE_IN_UV``, read at each call: one
    launch fewer a layer)."""
    return numba_attention.PlanCache(defer_merge=None)

class Model(DeviceSteps):
    """The forward pass of a ModelConfig with its weights on one backend, and the device steps
    of decoding (kdtree_numba/steps.py)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Any], backend="auto", *,
                 shared: Mapping[str, Any] | None = None, kv_cache: str = "float32",
                 kv_layout: str = "dense"):
        """``weights``: name -> array in bundle layout (``weight_shapes``): host arrays (a
        bundle's), or on a GPU device arrays as ``Backend.weight`` takes them (random weights
        built there: kdtree_numba/device_weights.py).
        ``shared``: arrays already on ``backend`` used as they are instead of
        ``weights[name]``, for "model/embed_tokens" and "lm_head" (a DFlash drafter runs on its
        target's embedding and head, kdtree_numba/dflash.py: one copy on the device).  A
        shared "lm_head" may hold fewer rows than the vocabulary (a drafter's head over its N
        most frequent tokens, ``DFlashDrafter(draft_vocab=N)``): the logits are then [.., N].
        ``kv_cache``: what the latent cache stores (kvcache.CACHE_DTYPES): "float32" (the
        accuracy default) or "bfloat16" (half the cache's bytes; attention then rounds its
        queries and weights to bf16 and runs on bf16 tensor cores, docs/ATTENTION.md).
        ``kv_layout``: where the caches' token slots live (kdtree_numba/kvlayout.py): "dense"
        (the GPU layout) or "paged:P" (pages of P slots; the reference backend only)."""
        if kv_cache not in CACHE_DTYPES:
            raise ValueError(f"kv_cache must be one of {CACHE_DTYPES}, got {kv_cache!r}")
        self.kv_cache = kv_cache
        self.kv_layout = layout_spec(kv_layout)
        self.config = config
        self.backend: Backend = make_backend(backend)
        make_layout(self.kv_layout, 1, 1).check_backend(self.backend)   # refused before loading
        self.rope = _rope_spec(config)
        # attention's plans (split counts, kernels, scratch) by shape: the model's own
        self.attention_plans = _model_plans()
        self.tau = float(self.rope.softmax_scale(config.qk_head_dim))
        self._load(weights, shared or {})
        # CUDA graphs of repeated forward shapes and round steps (kdtree_numba/graphs.py);
        # None: everything runs eagerly (the reference backend, the simulator,
        # KDTREE_CUDA_GRAPHS=0)
        self.graphs: GraphCache | None = None
        # None: prefills are padded (prefill_rows) on the GPU where the runtime says so
        self.pad_prefills: bool | None = None
        # the generations' KV caches, kept for the next generations (cache_for_generation)
        self._generation_caches: collections.OrderedDict = collections.OrderedDict()
        # AR's sampled step's root-only trees by batch (DeviceSteps.choose): graph constants
        self._root_trees: dict = {}
        if self.backend.on_gpu and self.backend.name == "numba" and graphs_enabled():
            self.graphs = self.new_graphs()

    @classmethod
    def load(cls, path, backend="auto", *, verify: bool = True, progress=None,
             kv_cache: str = "float32") -> "Model":
        """A model bundle (.kdtr, kdtree_numba/bundle.py), validated, on ``backend``.

        Each tensor's CRC32C is checked as it is copied (``verify=False`` maps the file and
        checks nothing): a damaged tensor raises ``formats.kdtr.KdtrError`` K056 naming the
        file and the tensor.  ``progress(done_bytes, total_bytes)`` follows the reads.
        ``kv_cache``: as for the constructor."""
        with open_bundle(path, verify=verify, progress=progress) as (config, _, weights):
            return cls(config, weights, backend, kv_cache=kv_cache)

    # ---- weights: bundle tensors -> backend arrays in the layouts the kernels take
    def _load(self, weights: Mapping[str, Any], shared: Mapping[str, Any]) -> None:
        cfg, be = self.config, self.backend

        def w(name, use="linear"):   # through the format registry (kdtree_numba/weights.py)
            return load_weight(be, name, weights[name], use)

        def w32(name):  # for kernels that take float32 only (absorb_q/apply_uv, the router)
            return load_weight(be, name, weights[name], "float32", np.float32)

        def fused(*names):  # gate rows first, then up rows (the kernels' gate_up layout)
            # joined by the backend: on a GPU each part goes up once, no joined host copy
            return self.backend.xp.concatenate([w(n) for n in names], axis=0)

        self.embed = shared.get("model/embed_tokens")
        if self.embed is None:
            self.embed = w("model/embed_tokens", "embedding")
        self.final_norm = w("model/norm", "norm")
        self.lm_head = shared.get("lm_head")
        if self.lm_head is None:
            self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head")
        self.layers = []
        for layer in range(cfg.num_hidden_layers):
            p = f"model/layers/{layer}/"
            lw = LayerWeights(input_norm=w(p + "input_layernorm", "norm"),
                              post_norm=w(p + "post_attention_layernorm", "norm"),
                              kv_a_norm=w(p + "self_attn/kv_a_layernorm", "norm"),
                              kv_b=w32(p + "self_attn/kv_b_proj"),
                              o_proj=w(p + "self_attn/o_proj"))
            if cfg.q_lora_rank is None:
                lw.q_proj = w(p + "self_attn/q_proj")
                lw.kv_a = w(p + "self_attn/kv_a_proj_with_mqa")
            else:
                lw.q_a_norm = w(p + "self_attn/q_a_layernorm", "norm")
                lw.q_b = w(p + "self_attn/q_b_proj")
                # q_a and kv_a read the same input: one GEMM over their stacked rows
                # (_attention); kv_a alone (kv_latents) is a row block (a view) of it
                lw.qkv_a = fused(p + "self_attn/q_a_proj",
                                 p + "self_attn/kv_a_proj_with_mqa")
                lw.kv_a = lw.qkv_a[cfg.q_lora_rank:]
            if cfg.is_dense_layer(layer):  # one expert: moe_ffn's dense FFN (_ffn)
                lw.gate_up = fused(p + "mlp/gate_proj", p + "mlp/up_proj")[None]
                lw.down = w(p + "mlp/down_proj")[None]
            else:
                # the router runs in fp32 or better, whatever the weights' storage dtype
                lw.router = w32(p + "mlp/gate")
                lw.router_bias = w32(p + "mlp/e_score_correction_bias")
                lw.gate_up = w(p + "mlp/experts/gate_up_proj", "experts")
                lw.down = w(p + "mlp/experts/down_proj", "experts")
                if cfg.n_shared_experts:
                    lw.shared_gate_up = fused(p + "mlp/shared_experts/gate_proj",
                                              p + "mlp/shared_experts/up_proj")
                    lw.shared_down = w(p + "mlp/shared_experts/down_proj")
            self.layers.append(lw)

    # ---- public API
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty latent cache of ``batch`` requests and ``max_len`` slots, storing the
        model's ``kv_cache`` dtype in its ``kv_layout``."""
        cfg = self.config
        return KVCache(self.backend, cfg.num_hidden_layers, batch, max_len, cfg.kv_lora_rank,
                       cfg.qk_rope_head_dim, dtype=self.kv_cache, layout=self.kv_layout)

    def reuse_cache(self, previous: KVCache | None, batch: int, max_len: int) -> KVCache:
        """An empty cache for a new generation: ``previous`` emptied when it has ``batch``
        requests and the same capacity bucket in the model's layout (KVLayout.reusable; a paged
        cache's pages go back to its pool), else a new cache of ``max_len`` rounded up to a
        multiple of CACHE_BUCKET.  CUDA graphs are captured against a cache's buffers
        (kdtree_numba/graphs.py), so reusing them lets the next generation replay them."""
        bucket = _bucket(max_len)
        if previous is not None and previous.dtype == self.kv_cache \
                and previous.layout.reusable(self.kv_layout, batch, bucket):
            previous.truncate(np.zeros(batch, np.int64))
            return previous
        return self.new_cache(batch, bucket)

    def cache_for_generation(self, batch: int, max_len: int, owner: str = "engine") -> KVCache:
        """A generation's KV cache: a kept one of ``owner``'s, emptied, when one has this
        batch and capacity bucket (:meth:`reuse_cache`), else a new one, kept for the next
        calls (up to GENERATION_CACHES per owner, the least recently used dropped), so the
        CUDA graphs captured on it replay there.  ``owner`` keeps apart the caches of users
        of one model (engine.generate's, a drafter's own context)."""
        key = (owner, int(batch), _bucket(max_len))
        cache = self.reuse_cache(self._generation_caches.pop(key, None), batch, max_len)
        self._generation_caches[key] = cache
        mine = [k for k in self._generation_caches if k[0] == owner]
        for old in mine[:-GENERATION_CACHES]:
            del self._generation_caches[old]
        return cache

    @property
    def generation_cache(self) -> KVCache | None:
        """engine.generate's most recent KV cache (None before the first generation)."""
        mine = [c for (owner, *_), c in self._generation_caches.items() if owner == "engine"]
        return mine[-1] if mine else None

    @generation_cache.setter
    def generation_cache(self, value: KVCache | None) -> None:
        """``None`` drops every kept cache (and so the CUDA graphs' hold on them); a cache
        becomes engine.generate's for its batch and capacity."""
        if value is None:
            self._generation_caches.clear()
        else:
            self._generation_caches[("engine", value.batch, value.max_len)] = value

    def new_graphs(self) -> GraphCache:
        """An empty CUDA-graph cache for this model's forwards and steps (GPU numba backend
        only); ``model.graphs = model.new_graphs()`` starts counting afresh."""
        return GraphCache(self.backend, before_capture=self.fresh_attention_plans)

    def fresh_attention_plans(self) -> None:
        """Before each CUDA-graph capture: attention plans hold scratch between calls, so the
        capture starts a new plan cache, whose plans are made inside it and their scratch
        recorded with the graph (kdtree_numba/graphs.py); a plan made outside could be
        dropped, its scratch reused, while the graph still writes it."""
        self.attention_plans = _model_plans()

    def graph_counts(self) -> tuple[int, int] | None:
        """(captures, replays) of the model's CUDA graphs so far; None where graphs are off."""
        if self.graphs is None:
            return None
        return self.graphs.captures, self.graphs.replays

    def forward(self, batch: ForwardBatch, cache: KVCache, *, borrow: bool = False):
        """Logits [bs, n, V] float32 (``backend.xp``) of ``batch``'s n new tokens per request
        (:class:`ForwardBatch`), or the tuple ``(logits[, hidden][, features])`` when it asks
        for either extra.  Writes the new latents at ``[cache.lengths[b], + n)`` without
        committing them (module docstring).

        Host inputs are uploaded once per forward (asynchronous copies), so a forward never
        waits for the device.  On the GPU a shape seen before replays a CUDA graph
        (kdtree_numba/graphs.py); ``borrow``: its outputs may then be the graph's own buffers,
        which the next forward of this shape overwrites (the engine's verify, whose logits the
        round's acceptance reads at once), instead of copies.
        """
        # borrow is a keyword, not a field of the batch: it says who owns the outputs (the
        # caller until this shape's next replay), not what is computed; the values are the same
        be = self.backend
        tokens, visible = batch.tokens, batch.visible
        tokens = tokens if hasattr(tokens, "shape") else np.asarray(tokens)
        if len(tokens.shape) != 2:
            raise ValueError(f"tokens must be [batch, n], got shape {tuple(tokens.shape)}")
        bs, n = tokens.shape
        if cache.batch != bs:
            raise ValueError(f"cache holds {cache.batch} requests, tokens {bs}")
        visible = visible if hasattr(visible, "shape") else np.asarray(visible)
        if tuple(visible.shape) != (bs, n, n):
            raise ValueError(f"visible must be {(bs, n, n)}, got {tuple(visible.shape)}")
        capture = self._check_capture(batch.capture_layers)
        logit_rows = batch.logit_rows
        if logit_rows is not None:
            given = np.asarray(logit_rows)
            if given.dtype.kind not in "iu":
                raise ValueError(f"logit_rows must be integers, got {given.dtype}")
            logit_rows = given.astype(np.int64)
            if logit_rows.shape != (bs,) or np.any(logit_rows < 0) or np.any(logit_rows >= n):
                raise ValueError(f"logit_rows must be [{bs}] row indices in [0, {n}), got "
                                 f"{logit_rows.tolist()}")
        span = batch.logit_span
        if span is not None:
            span = tuple(int(i) for i in span)
            if len(span) != 2 or not 0 <= span[0] < span[1] <= n or logit_rows is not None:
                raise ValueError(f"logit_span must be (start, stop) with 0 <= start < stop <= "
                                 f"{n}, and no logit_rows; got {batch.logit_span}")
        embeds = batch.embeds
        if embeds is not None and tuple(embeds.shape) != (bs, n, self.config.hidden_size):
            raise ValueError(f"embeds must be {(bs, n, self.config.hidden_size)}, got "
                             f"{tuple(embeds.shape)}")
        slots = batch.slots
        if slots is None and self.graphs is not None:
            out = self._replay_forward(batch, tokens, visible, capture, logit_rows, span,
                                       cache, borrow)
            if out is not None:
                return out
        if slots is None:
            slots = cache.write_slots(n)
            if self.graphs is not None:
                # the graphs' split plan (the cache's capacity): eager calls then compile the
                # kernels a capture will use (the merge), and give the same bits as a replay
                slots = dataclasses.replace(slots, max_keys=cache.max_len)
        # copy=False: a device input already of its dtype (a round's tree, the drafter's
        # constant block) is read in place, not copied by a launch of its own
        device = ForwardBatch(tokens=be.asarray(tokens).astype(np.int32, copy=False),
                              positions=be.asarray(batch.positions).astype(np.int32,
                                                                           copy=False),
                              visible=be.asarray(visible).astype(bool, copy=False),
                              embeds=embeds,
                              logit_rows=None if logit_rows is None
                              else be.asarray(logit_rows), logit_span=span,
                              causal=bool(batch.causal),
                              prefill=bool(batch.prefill),
                              return_hidden=bool(batch.return_hidden),
                              capture_layers=capture, slots=slots)
        return self._compute(device, cache)

    def _check_capture(self, layers) -> tuple[int, ...]:
        if not layers:      # most forwards: nothing to build (a forward's host path)
            return ()
        layers = tuple(int(j) for j in layers)
        bad = [j for j in layers if not 0 <= j < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"capture_layers {list(layers)}: layer {bad[0]} is not a decoder "
                             f"layer of this model (0..{self.config.num_hidden_layers - 1})")
        return layers

    def prefill(self, cache: KVCache, seqs, *, return_hidden: bool = False,
                capture_layers=()):
        """Feed request b's tokens ``seqs[b]`` (ragged, at least one each) after its cached
        prefix in one causal forward (:func:`pad_ragged`), and commit them.  Returns the logits
        [bs, V] of each request's last token, plus its final hidden state [bs, D] with
        ``return_hidden``, plus with ``capture_layers`` the features (:meth:`forward`) of every
        fed token, [bs, n, k * D] with n :meth:`prefill_width` (rows past ``len(seqs[b])`` are
        padding), on the device."""
        ids, lengths, visible = pad_ragged(
            seqs, self.prefill_width(cache, max(len(s) for s in seqs)))
        positions = cache.lengths[:, None] + np.arange(ids.shape[1])[None, :]
        capture = self._check_capture(capture_layers)
        out = self.forward(ForwardBatch(ids, positions, visible, logit_rows=lengths - 1,
                                        causal=True, prefill=True, return_hidden=return_hidden,
                                        capture_layers=capture), cache)
        cache.advance(lengths)
        if not (return_hidden or capture):
            return out[:, 0]
        parts = (out[0][:, 0],)
        if return_hidden:
            rows = (self.backend.asarray(np.arange(len(seqs))),
                    self.backend.asarray(lengths - 1))
            parts += (out[1][rows],)
        if capture:
            parts += (out[-1],)
        return parts

    def prefill_width(self, cache: KVCache, n: int) -> int:
        """The rows a prefill of up to n tokens a request runs on ``cache``: n, or where
        prefills are padded :func:`prefill_rows` (n), as far as the cache has room.
        ``pad_prefills`` decides; None: on the GPU unless the runtime's switch is off
        (``KDTREE_PAD_PREFILLS=0``), graphs or not, so that both give the same bits.
        Unpadded, every prompt length is a graph of its own, captured on its second sight,
        and a prompt of a new length runs eagerly: ~200 launches issued from Python."""
        pad = self.pad_prefills
        if pad is None:
            pad = self.backend.on_gpu and self.backend.name == "numba" and \
                runtime.current().pad_prefills
        if not pad:
            return int(n)
        room = cache.max_len - int(np.max(cache.lengths))
        return max(int(n), min(prefill_rows(n), room))

    def decode(self, cache: KVCache, tokens):
        """Logits [bs, V] of one new token per request (``tokens`` [bs], host or device) at
        position ``cache.lengths[b]``.  Written, not committed: the caller advances the cache
        (e.g. only for the requests still running)."""
        bs = cache.batch
        logits = self.forward(ForwardBatch(tokens[:, None], cache.lengths[:, None].copy(),
                                           np.ones((bs, 1, 1), bool)), cache)
        return logits[:, 0]

    def _replay_forward(self, batch: ForwardBatch, tokens, visible, capture: tuple, logit_rows,
                        span, cache: KVCache, borrow: bool):
        """:meth:`forward` through one of the model's CUDA graphs, or ``None`` when this call
        must run eagerly (``tokens``, ``visible``, ``capture``, ``logit_rows``, ``span``: the
        batch's, checked).  The graph reads static buffers of the inputs and of the cache's device
        lengths, from which it makes the slots (KVCache.device_slots), so one graph serves
        every prefix length."""
        bs, n = tokens.shape
        cache.reserve(n)
        selected = logit_rows is not None
        embedded = batch.embeds is not None
        return_hidden, causal, prefill = (bool(batch.return_hidden), bool(batch.causal),
                                          bool(batch.prefill))
        # prefills are a kind of their own: one graph per padded length, in a pool of their
        # own (graphs.MAX_GRAPHS), so they never push out the decode and verify graphs
        key = ("prefill" if prefill else "forward", bs, n, return_hidden, capture, embedded,
               selected, span, causal) + cache.buffer_key()

        def run(tok, pos, vis, lengths, *extra):
            extra = list(extra)
            picked = extra.pop(0) if selected else None
            return self._compute(ForwardBatch(
                tokens=tok, positions=pos, visible=vis, embeds=extra[0] if extra else None,
                logit_rows=picked, logit_span=span, causal=causal, prefill=prefill,
                return_hidden=return_hidden,
                capture_layers=capture, slots=cache.device_slots(lengths, n)), cache)
        specs = (((bs, n), np.int32), ((bs * n,), np.int32), ((bs, n, n), np.bool_),
                 ((bs,), np.int32))
        inputs = (tokens, batch.positions, visible, cache.device_lengths)
        if selected:
            specs += (((bs,), np.int64),)
            inputs += (logit_rows,)
        if embedded:
            specs += (((bs, n, self.config.hidden_size), np.float32),)
            inputs += (batch.embeds,)
        return self.graphs.call(key, run, inputs, specs, borrow=borrow)

    def _compute(self, batch: ForwardBatch, cache: KVCache):
        """The forward of a checked batch on the device (its arrays on the backend, its
        ``capture_layers`` checked, its ``slots`` made): only device work, so a CUDA graph can
        capture it."""
        be, cfg = self.backend, self.config
        # a prompt's rows may run other ops (Backend.prefill_ops: the CPU path's wider GEMM
        # blocks); the lm_head always runs the backend's own
        ops = be.prefill_ops if batch.prefill else be.ops
        tokens, visible, slots = batch.tokens, batch.visible, batch.slots
        bs, n = tokens.shape
        positions = batch.positions.reshape(bs * n)     # a view: [bs, n] or already flat
        capture = batch.capture_layers
        embeds = batch.embeds
        if embeds is None:
            x = ops.embedding(tokens.reshape(bs * n), self.embed)
        else:
            x = be.xp.ascontiguousarray(be.asarray(embeds).reshape(bs * n, cfg.hidden_size),
                                        dtype=np.float32)
        after = {}             # the residual stream after each captured layer
        # KDTREE_ROUND_EPILOGUE (or KDTREE_FEWER_LAUNCHES): a captured layer's residual sum
        # is written by its norm straight into its columns of the features (add_rmsnorm's
        # sum_out), where a concatenation copied each (one launch per captured layer); the
        # same values.  The numba ops only (the reference's add_rmsnorm has no sum_out).
        D = cfg.hidden_size
        now = runtime.current()
        features = (be.xp.empty((bs * n, len(capture) * D), np.float32)
                    if capture and be.name == "numba" and (now.round_epilogue or
                                                           now.fewer_launches)
                    and len(set(capture)) == len(capture) else None)
        eps = cfg.rms_norm_eps
        h = ops.rmsnorm(x, self.layers[0].input_norm, eps)   # config: >= 1 layer
        # each residual add runs inside the norm that reads its sum (add_rmsnorm): the next
        # layer's input norm, after the last layer the final norm
        norms = [lw.input_norm for lw in self.layers[1:]] + [self.final_norm]
        for layer, (lw, next_norm) in enumerate(zip(self.layers, norms)):
            attn = self._attention(lw, layer, h, positions, cache, slots, visible, bs, n,
                                   batch.causal, batch.prefill, ops)
            x, h = ops.add_rmsnorm(x, attn, lw.post_norm, eps)
            into = {}
            if features is not None and layer in capture:
                i = capture.index(layer)
                into = dict(sum_out=features[:, i * D:(i + 1) * D])
            x, h = ops.add_rmsnorm(x, self._ffn(lw, h, batch.prefill, ops), next_norm, eps, **into)
            if layer in capture:
                after[layer] = x        # each layer makes a new x: this one is never written
        if batch.logit_span is not None:
            start, stop = batch.logit_span
            rows = be.xp.ascontiguousarray(h.reshape(bs, n, -1)[:, start:stop])
            logits = be.ops.linear(rows.reshape(bs * (stop - start), -1),
                                   self.lm_head).reshape(bs, stop - start, -1)
        elif batch.logit_rows is None:
            logits = be.ops.linear(h, self.lm_head).reshape(bs, n, -1)
        else:   # one row per request: b n + logit_rows[b] of the flattened [bs n, D]
            picked = be.xp.arange(bs) * n + batch.logit_rows
            logits = be.ops.linear(be.xp.ascontiguousarray(h[picked]),
                                   self.lm_head).reshape(bs, 1, -1)
        out = (logits,)
        if batch.return_hidden:
            out += (h.reshape(bs, n, -1),)
        if capture:
            if features is None:
                features = be.xp.concatenate([after[j] for j in capture], axis=1)
            out += (features.reshape(bs, n, len(capture) * cfg.hidden_size),)
        return out if len(out) > 1 else logits

    def kv_latents(self, layer: int, h, positions, into=None, ops=None):
        """What layer ``layer`` caches for the normed inputs ``h`` [M, D] at ``positions`` [M]
        (int32, device): the latent ``c = rmsnorm(kv[:r])`` [M, r] and the rotated rope key
        ``k_pe = rope(kv[r:])`` [M, 1, dr], with ``kv = h kv_a^T``; with ``into`` (a
        ``KVCache.latent_store``) written there instead, and ``(None, None)`` returned.  The
        attention uses it for its own tokens; a DFlash drafter injects its fused target
        features through it.  ``ops``: the forward's (default: the backend's)."""
        lw, ops = self.layers[layer], ops or self.backend.ops
        _, c, k_pe = ops.mla_latents(
            ops.linear(h, lw.kv_a), None, lw.kv_a_norm, positions, self.rope,
            LATENT_NORM_EPS, q_lora=0, rank=self.config.kv_lora_rank, into=into)
        return c, k_pe

    def _attention(self, lw, layer, h, positions, cache, slots, visible, bs, n, causal=False,
                   prefill=False, ops=None):
        """Absorbed MLA of one layer; writes this layer's latents of the n tokens (straight
        into the cache: ``mla_latents(into=)``); ``ops``: the forward's."""
        ops, cfg = ops or self.backend.ops, self.config
        M, H = bs * n, cfg.num_attention_heads
        dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        into = cache.latent_store(layer, slots)
        if lw.q_proj is not None:
            q = ops.linear(h, lw.q_proj)
            self.kv_latents(layer, h, positions, into, ops)
        else:
            qkv = ops.linear(h, lw.qkv_a)                  # [M, q_lora + r + dr]: q_a | kv_a
            q_a, _, _ = ops.mla_latents(qkv, lw.q_a_norm, lw.kv_a_norm, positions, self.rope,
                                        LATENT_NORM_EPS, q_lora=cfg.q_lora_rank,
                                        rank=cfg.kv_lora_rank, into=into)
            q = ops.linear(q_a, lw.q_b)
        q_nope, q_pe = ops.mla_q_split(q.reshape(M, H, dn + dr), positions, self.rope, dn=dn)
        q_nope = q_nope.reshape(bs, n, H, dn)
        q_abs = ops.absorb_q(q_nope, lw.kv_b)
        u = cache.attend(ops, layer, q_abs, q_pe.reshape(bs, n, H, dr), slots, visible,
                         self.tau, prefill=prefill, causal=causal, plans=self.attention_plans)
        o = ops.apply_uv(u, lw.kv_b, dv)
        return ops.linear(o.reshape(M, H * dv), lw.o_proj)

    def _ffn(self, lw, h, prefill=False, ops=None):
        xp, ops, cfg = self.backend.xp, ops or self.backend.ops, self.config
        M = h.shape[0]
        if lw.router is None and prefill:
            # a prompt's thousands of rows fill the GPU with the one-expert grouped launch's
            # M tiles (no K slices to add); its bits need not match a decode's (forward())
            return ops.moe_ffn(h, xp.zeros((M, 1), np.int32), xp.ones((M, 1), np.float32),
                               lw.gate_up, lw.down)
        if lw.router is None:   # the dense FFN: two sliced projections on tensor cores
            return ops.moe_ffn(h, None, None, lw.gate_up, lw.down)
        idx, weight = ops.moe_route(h, lw.router, lw.router_bias,
                                    top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                                    topk_group=cfg.topk_group,
                                    norm_topk_prob=cfg.norm_topk_prob,
                                    routed_scaling_factor=cfg.routed_scaling_factor,
                                    scoring=cfg.scoring_func)
        return ops.moe_ffn(h, idx, weight, lw.gate_up, lw.down, lw.shared_gate_up,
                           lw.shared_down)

    def score(self, token_ids) -> np.ndarray:
        """Host float32 logits [T, V] of one sequence from position 0, through a fresh cache
        that is dropped afterwards (the model keeps no state)."""
        ids = np.asarray(token_ids, np.int64).reshape(-1)
        T = ids.size
        if T == 0:
            raise ValueError("score needs at least one token")
        cache = self.new_cache(1, T)
        logits = self.forward(ForwardBatch(ids[None], np.arange(T)[None], causal_mask(T),
                                           causal=True, prefill=True), cache)
        return np.asarray(self.backend.to_host(logits[0]), np.float32)


def _rope_spec(cfg: ModelConfig) -> RopeSpec:
    """The kernels' RopeSpec, built by their own HF-config constructor (one reading of YaRN)."""
    hf = {"rope_theta": cfg.rope_theta, "qk_rope_head_dim": cfg.qk_rope_head_dim,
          "rope_interleave": cfg.rope_interleave, "rope_scaling": cfg.rope_scaling}
    return RopeSpec.from_hf_config(hf)

"""Roofs of the engine's forwards, for tools/bench_engine.py.

A forward at small batch is bound by the bytes of weights it reads, a wide one by its
arithmetic; the roof of one forward is the larger of :func:`forward_bytes` /
``HBM_BYTES_PER_S`` (a default of 4.1 TB/s, the H200's measured HBM rate; benchmarks replace it
with the running card's own, tools/card_roofs.py) and :func:`forward_flops` /
``FLOPS_PER_S`` (51 TFLOP/s, the H200's fp32 FMA rate, at which the engine's GEMMs compute; the
project's roof for its kernels, docs/LAYERS.md).  It reads every tensor once, except two,
which it reads only in part:

* the embedding: one row per distinct token id fed (all of it when the embedding is tied, since
  it is then also the lm_head);
* the routed experts: in each MoE layer only the distinct experts its tokens chose (the MoE
  kernel streams each active expert once for all its tokens, kdtree_numba/layers/moe.py).

Bytes per element are what the engine holds (:func:`engine_itemsize`): the bundle's dtype,
except the router, its bias and kv_b_proj, which ``Model`` keeps in float32 for the kernels that
take float32 only, and int4-group routed experts (``kimi-k2-slice``: 0.5625 bytes a weight at
group 32).

The distinct experts are either counted (:class:`RoutingCounter`: the expert ids each MoE layer
of a forward selected, from a re-run of the same generation) or estimated for uniform routing
(:func:`expected_distinct`: n tokens each choosing k of E experts, E (1 - (1 - k/E)^n)).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from kdtree_numba.config import ModelConfig, weight_shapes

HBM_BYTES_PER_S = 4.1e12
FLOPS_PER_S = 51e12
TENSOR_FLOPS_PER_S = 989e12     # the H200's dense bf16 tensor-core rate (make_backend gemm=)
# the weights Model keeps in float32 whatever the bundle's dtype (Model._load's w32)
FLOAT32_WEIGHTS = ("self_attn/kv_b_proj", "mlp/gate", "mlp/e_score_correction_bias")


def engine_itemsize(stored_bytes: int, expert_bytes: float | None = None):
    """name -> bytes per element the engine holds for a model stored with ``stored_bytes``
    per element (2 for bf16): the stored size, 4 for :data:`FLOAT32_WEIGHTS`, and
    ``expert_bytes`` for the routed experts when they have their own format (int4-group at
    group g: 0.5 + 2 / g, the packed nibbles and a bf16 scale per group)."""
    def itemsize(name: str) -> float:
        if expert_bytes is not None and "/experts/" in name:
            return expert_bytes
        return 4 if name.endswith(FLOAT32_WEIGHTS) else stored_bytes
    return itemsize


def moe_layers(cfg: ModelConfig) -> list[int]:
    return [j for j in range(cfg.num_hidden_layers) if not cfg.is_dense_layer(j)]


def forward_bytes(cfg: ModelConfig, rows: int, distinct: Sequence[float], itemsize=2) -> float:
    """Bytes of weights one forward reads (module docstring): ``rows`` distinct token ids
    embedded, ``distinct[j]`` routed experts in the j-th MoE layer (in layer order);
    ``itemsize``: bytes per element, an int or a function of the tensor's name."""
    size = itemsize if callable(itemsize) else (lambda name: itemsize)
    layers = moe_layers(cfg)
    if len(distinct) != len(layers):
        raise ValueError(f"distinct gives {len(distinct)} MoE layers, the config has "
                         f"{len(layers)}")
    per_layer = dict(zip(layers, distinct))
    total = 0.0
    for name, shape in weight_shapes(cfg).items():
        n = float(np.prod(shape))
        if name == "model/embed_tokens" and not cfg.tie_word_embeddings:
            n = float(min(rows, shape[0]) * shape[1])
        elif "/experts/" in name:
            layer = int(name.split("/")[2])
            n = n / shape[0] * per_layer[layer]
        total += n * size(name)
    return total


def forward_flops(cfg: ModelConfig, rows: int) -> float:
    """Multiply-add FLOPs of one forward's matrix products over ``rows`` tokens: 2 per weight
    of every matrix a token goes through (attention, dense FFN, router, shared expert,
    lm_head, and its own top-k routed experts); the embedding is a lookup.  Attention over the
    cached keys is left out (2 (r + dr) + 2 r per head and key: under 1% of a kimi-slice token's
    6.4 GFLOP at a few hundred keys)."""
    per_token = 0.0
    for name, shape in weight_shapes(cfg).items():
        if len(shape) < 2 or (name == "model/embed_tokens" and not cfg.tie_word_embeddings):
            continue
        n = float(np.prod(shape))
        per_token += n / shape[0] * cfg.num_experts_per_tok if "/experts/" in name else n
    return 2.0 * rows * per_token


def expected_distinct(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens touch when each picks ``top_k``
    of ``n_experts`` uniformly: E (1 - (1 - k/E)^n)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def uniform_distinct(cfg: ModelConfig, tokens: int) -> list[float]:
    """:func:`expected_distinct` for each MoE layer of ``cfg``."""
    d = expected_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)
    return [d] * len(moe_layers(cfg))


@dataclasses.dataclass
class ForwardRecord:
    """One forward: ``rows`` tokens fed, ``tokens`` distinct ids among them, ``experts[j]``
    distinct routed experts chosen in the j-th MoE layer."""
    rows: int
    tokens: int
    experts: list


class _EagerGraphs:
    """Stands in for a model's GraphCache: every call runs eagerly (``call`` -> None) through
    the very code a capture records, with the graphs' split plans, so the tokens do not
    change; the counts are the real cache's."""

    def __init__(self, graphs):
        self.captures, self.replays = graphs.captures, graphs.replays

    def call(self, key, fn, inputs, specs, borrow=False, before_capture=None):
        return None


class RoutingCounter:
    """``with RoutingCounter(model) as rc: generate(model, ...)``, then ``rc.records()``: a
    :class:`ForwardRecord` per forward of the block, prefill first.

    Wraps the backend's ``embedding`` (each forward starts with one: a new record) and
    ``moe_route`` (each MoE layer's expert ids: the distinct ones counted on the device, read
    once by :meth:`records`).  So no other model may share the backend inside the block (a
    replay drafter, not a model drafter).  A CUDA graph replay runs no Python, so inside the
    block the model's graphs are set aside and every forward runs eagerly: slower, not timed."""

    def __init__(self, model):
        self.model, self.backend = model, model.backend
        self._rows: list = []      # per forward: [rows, distinct-token count, expert counts...]

    def __enter__(self):
        be, xp = self.backend, self.backend.xp
        self._ops, self._graphs = be.ops, self.model.graphs
        embedding, moe_route = be.ops.embedding, be.ops.moe_route

        def distinct(ids, n):
            present = xp.zeros(n, np.int32)
            present[ids.reshape(-1)] = 1
            return present.sum()

        def counting_embedding(ids, table, *args, **kwargs):
            self._rows.append([int(ids.shape[0]), distinct(ids, table.shape[0])])
            return embedding(ids, table, *args, **kwargs)

        def counting_route(h, gate_w, *args, **kwargs):
            idx, weight = moe_route(h, gate_w, *args, **kwargs)
            self._rows[-1].append(distinct(idx, gate_w.shape[0]))
            return idx, weight

        be.ops = be.ops.replaced(embedding=counting_embedding, moe_route=counting_route)
        if self._graphs is not None:
            self.model.graphs = _EagerGraphs(self._graphs)
        return self

    def __exit__(self, *exc):
        self.backend.ops = self._ops
        self.model.graphs = self._graphs
        return False

    def records(self) -> list[ForwardRecord]:
        """The counts, read from the device at once."""
        be, xp = self.backend, self.backend.xp
        counts = [c for r in self._rows for c in r[1:]]
        host = np.asarray(be.to_host(xp.stack([xp.asarray(c) for c in counts]))) \
            if counts else np.zeros(0)
        out, i = [], 0
        for r in self._rows:
            k = len(r) - 1
            vals = [int(v) for v in host[i:i + k]]
            out.append(ForwardRecord(rows=r[0], tokens=vals[0], experts=vals[1:]))
            i += k
        return out


def roof_seconds(cfg: ModelConfig, record: ForwardRecord, itemsize,
                 flops_per_s: float = FLOPS_PER_S) -> tuple[float, float]:
    """One forward's two roofs, seconds: (its :func:`forward_bytes` over ``HBM_BYTES_PER_S``,
    its :func:`forward_flops` over ``flops_per_s``: FLOPS_PER_S for GEMMs on CUDA cores,
    TENSOR_FLOPS_PER_S on tensor cores); the roof is the larger."""
    return (forward_bytes(cfg, record.tokens, record.experts, itemsize) / HBM_BYTES_PER_S,
            forward_flops(cfg, record.rows) / flops_per_s)


def uniform_records(cfg: ModelConfig, prefill_rows: int,
                    step_rows: list[int]) -> list[ForwardRecord]:
    """Records of a generation under uniform routing: the prefill, then one forward per entry
    of ``step_rows`` with its tokens (every token id counted as distinct)."""
    def rec(rows):
        return ForwardRecord(rows, rows, uniform_distinct(cfg, rows))
    return [rec(prefill_rows)] + [rec(rows) for rows in step_rows]

"""The drafter protocol (kdtree_numba/drafting.py): a drafter added without touching the engine,
every shipped drafter implementing it, and the benchmark's replay drafter."""
from __future__ import annotations

import inspect

import numpy as np

from kdtree_numba import engine
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.drafter import (BlockDrafter, DFlashDrafter, ModelDrafter, NoisyOracleDrafter,
                                  ReplayDrafter)
from kdtree_numba.drafting import NO_NEEDS, Commit, DraftContext, Drafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

TINY = dict(num_hidden_layers=2, first_k_dense_replace=1, vocab_size=48, hidden_size=32,
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            num_attention_heads=2)


def _target(seed: int = 0) -> Model:
    cfg = size_config("tiny", **TINY)
    return Model(cfg, dict(random_weights(cfg, seed)), "reference")


class BigramDrafter:
    """A drafter the engine has never heard of: a table of next-token logits [V, V]; row 0 is
    the root's row, row d the row of row d - 1's argmax, computed on the backend's arrays.
    It needs nothing from the target and keeps no state."""
    needs = NO_NEEDS

    def __init__(self, backend, table, block_len: int):
        self.backend, self.block_len, self.name = backend, block_len, "bigram"
        self.table = backend.asarray(np.asarray(table, np.float32))

    @property
    def vocab_size(self) -> int:
        return int(self.table.shape[0])

    def start(self, batch, max_len):
        pass

    def on_commit(self, commit):
        pass

    def propose(self, ctx):
        xp, token, rows = self.backend.xp, ctx.roots, []
        for _ in range(self.block_len):
            rows.append(self.table[token])
            token = xp.argmax(rows[-1], axis=-1)
        return xp.ascontiguousarray(xp.stack(rows, axis=1))


def test_a_new_drafter_runs_without_touching_the_engine():
    """The proof of the protocol: a drafter defined here, from the target's own greedy
    bigrams, runs DDTree and the chain through engine.generate as it is: AR's tokens, and
    more than one token a round where its bigrams hold."""
    target = _target(0)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    ar = generate(target, prompts, 16)
    V = target.vocab_size
    table = np.zeros((V, V), np.float32)
    for p, out in zip(prompts, ar.tokens):
        seq = list(p) + out
        for a, b in zip(seq, seq[1:]):
            table[a, b] += 8.0                     # the target's greedy successor
    drafter = BigramDrafter(target.backend, table, block_len=4)
    assert isinstance(drafter, Drafter)
    for method in ("ddtree", "chain"):
        res = generate(target, prompts, 16, method=method, drafter=drafter, budget=6)
        assert res.tokens == ar.tokens
        assert max(max(t) for t in res.stats.tau) > 1
    # the engine itself names no drafter class: it only speaks the protocol
    source = inspect.getsource(engine)
    for name in ("ModelDrafter", "BlockDrafter", "DFlashDrafter", "ReplayDrafter",
                 "NoisyOracleDrafter", "needs_target_hidden",
                 "extend_context", "getattr(drafter"):
        assert name not in source, name


def test_every_shipped_drafter_implements_the_protocol():
    for cls in (ModelDrafter, NoisyOracleDrafter, BlockDrafter, DFlashDrafter, ReplayDrafter):
        for attr in ("needs", "start", "propose", "on_commit"):
            assert hasattr(cls, attr), (cls.__name__, attr)


def _advance(drafter, histories):
    """Commit to a replay drafter the tokens that bring each request's root to the end of
    its history, and the context asking about those roots."""
    positions = np.array([len(h) - 1 for h in histories], np.int64)
    drafter.on_commit(Commit(counts=None, next_roots=None,
                             counts_host=positions - drafter.positions))
    return DraftContext(roots=np.array([h[-1] for h in histories], np.int32),
                        positions=positions.astype(np.int32))


def test_replay_drafter_on_the_device_refills_one_buffer():
    """ReplayDrafter(on_device=True) writes each round's peaks into one reused buffer; the
    logits equal the host-built ones of a drafter with the same seed."""
    be = make_backend("reference")
    futures = [list(range(3, 40)), list(range(50, 90))]
    host = ReplayDrafter(be, 96, futures, 0.7, block_len=4, seed=5)
    dev = ReplayDrafter(be, 96, futures, 0.7, block_len=4, seed=5,
                                     on_device=True)
    host.start(2, 64)
    dev.start(2, 64)
    first = None
    for hist in ([[3, 4], [50]], [[3, 4, 5, 6], [50, 51, 52]]):
        want = np.array(host.propose(_advance(host, hist)))
        got = dev.propose(_advance(dev, hist))
        first = got if first is None else first
        assert got is first                                   # the same buffer every round
        assert np.array_equal(np.asarray(got), want)
        assert (np.asarray(got) != 0).sum() == 2 * 2 * 4      # two peaks per row, no leftovers


def test_replay_drafter_peaks_at_the_future_with_the_agreement_uniforms():
    """Row d of request b peaks (12) at the true token at depth d + 1 where the round's d-th
    uniform of b is below the agreement, else at (true + 1 + d) % V -- 0 past the future's end
    -- with a runner-up (6) 7 tokens on: checked against a per-position loop over the same
    generator's draws, in request-major order."""
    be = make_backend("reference")
    V, L = 50, 6
    futures = [list(range(3, 12)), [49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39]]
    drafter = ReplayDrafter(be, V, futures, 0.6, block_len=L, seed=11)
    drafter.start(2, 64)
    oracle = np.random.default_rng(11)
    for hist in ([[3, 4], [49]], [[3, 4, 5, 6, 7], list(range(8))]):
        got = np.asarray(drafter.propose(_advance(drafter, hist)))
        for b, h in enumerate(hist):
            for d in range(L):
                p = len(h) + d
                true = futures[b][p] if p < len(futures[b]) else 0
                tok = true if oracle.random() < 0.6 else (true + 1 + d) % V
                want = np.zeros(V, np.float32)
                want[tok] = 12.0
                want[(tok + 7) % V] = 6.0
                assert np.array_equal(got[b, d], want), (b, d)

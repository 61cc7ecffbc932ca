"""The drafter protocol: what the engine gives a drafter and what it gets back.

A drafter proposes, once a round, the distributions of the L tokens after each request's root;
the DDTree round builds its tree from them (docs/DDTREE.md).  The engine talks to every
drafter through the three calls of :class:`Drafter` and never asks what kind it holds:

* ``start(batch, max_len)``: a new batch (called once the target's prefill is enqueued, before
  the prompt's commit: host work the device overlaps);
* ``propose(ctx: DraftContext) -> logits [bs, L, V]`` float32 on the target's backend;
* ``on_commit(commit: Commit)``: what the target has just verified (the prompt after the
  prefill, the root and the accepted nodes after a round) and the next roots.

What a drafter needs from the target besides the tokens is declared once, in ``needs``
(:class:`TargetNeeds`): the target's final hidden state at the row that chose each root (a
block drafter's conditioning), the residual streams after some target layers (a DFlash
drafter's context features), or the verified tokens themselves (a drafter with its own KV
cache of the sequence).  The engine asks the target's forwards for exactly that, and hands it
over in the :class:`Commit`.

Every array in a context or a commit is a **device** array of the target's backend, never read
by the engine for the drafter, and a drafter must not read them either: the round's one host
read is the engine's (docs/ENGINE.md, "Sync points"), and a round captured whole into a CUDA
graph cannot read at all.  The one host value a commit carries is ``counts_host``, the counts
the engine has already read with the round's committed tokens, for a drafter's own host
bookkeeping (its cache's capacity).

A drafter may declare ``device_only = True`` when its ``propose`` and ``on_commit`` read no
host value (it accepts a commit whose ``counts_host`` is None): the engine may then run whole
rounds as device programs captured in one CUDA graph (kdtree_numba/device_round.py).  Such a
drafter names the device buffers a round reads and writes in place (``graph_key()``: their
addresses, part of the graph's key), keeps the host's view of its own state given the bounds
of the target cache's lengths (``bound_lengths(floor, upper)``), and its optional ``prepare_capture()`` runs before a
capture (state that must be recorded with the graph, such as its model's attention plans, is
made inside it).  Such a drafter may also name ``context_cache``: its own dense KV cache
whose lengths always equal the target cache's (the DFlash drafter's context) and whose next
block of ``block_len + 1`` tokens a round's ``propose`` and ``on_commit`` both write.  With
``KDTREE_ROUND_EPILOGUE`` a device round then makes that block's slots with the verify's in
one launch (``DraftContext.slots``, ``Commit.slots``: used in place of the drafter's own) and
grows the cache's lengths in its commit launch (``Commit.grown``: the drafter must not).

A drafter whose logits rank only some tokens (the others masked: a DFlash drafter's
``draft_vocab``, kdtree_numba/dflash.py) says how many in ``draft_vocab`` (None or absent: all);
the engine refuses a round whose top-K would reach past them (:func:`check_top_k`).

Adding a drafter (docs/ARCHITECTURE.md, "Adding a drafter"): a class with ``name``,
``vocab_size``, ``block_len``, ``needs`` and the three calls; ``engine.generate`` takes it as
it is (tests/test_drafting.py adds one without touching the engine).
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

__all__ = ["Drafter", "TargetNeeds", "DraftContext", "Commit", "NO_NEEDS", "check_top_k"]


@dataclasses.dataclass(frozen=True)
class TargetNeeds:
    """What a drafter needs from the target's forwards, besides the roots.

    ``hidden``: the target's final normed hidden state [bs, D] at the row whose logits chose
    each new root (``Commit.hidden``).  ``feature_layers``: the residual stream after each of
    these target decoder layers (0-based), concatenated [k D], at every verified token
    (``Commit.features``).  ``tokens``: the verified tokens themselves (``Commit.tokens``)."""
    hidden: bool = False
    feature_layers: tuple[int, ...] = ()
    tokens: bool = False


NO_NEEDS = TargetNeeds()


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """One round's question to the drafter (device arrays).

    ``roots`` [bs] int32: each request's root, the last committed token, which the target's
    verify feeds first.  ``positions`` [bs] int32: the root's position (the number of tokens
    the target has cached for the request before it).  ``depth`` (a Python int, or None):
    the deepest draft position the round can use (a tree of n nodes reaches depth n at
    most): a drafter may return only the first ``min(L, depth)`` rows of logits (a block
    drafter then runs its lm_head on those alone), never fewer.  ``temperature``: the round's
    sampling temperature (0: greedy); a drafter may shape its draft by it (the CPU path's
    DFlash drafter ranks a draft vocabulary at T > 0: kdtree_numba/dflash.py), never the
    tokens committed, which are the target's.  ``slots``: the write slots (with their
    positions) of the drafter's block in its ``context_cache``, made by a device round
    (module docstring), or None."""
    roots: object
    positions: object
    depth: int | None = None
    temperature: float = 0.0
    slots: object = None


@dataclasses.dataclass(frozen=True)
class Commit:
    """What the target verified since the last commit, for request b (device arrays).

    ``counts`` [bs] int32: how many tokens the target's cache gained (the prompt's length
    after the prefill; after a round the root and the accepted nodes: acc_len).
    ``next_roots`` [bs] int32: the token each request continues from (the prefill's first new
    token; a round's bonus token).  ``tokens`` [bs, m] int32 (``needs.tokens``): the verified
    tokens in order followed by the next root: entries ``0 .. counts[b] - 1`` of row b are
    verified, entry ``counts[b]`` is ``next_roots[b]``, the rest padding (token 0).  ``hidden`` [bs, D] float32
    (``needs.hidden``): the target's final hidden state at the row that chose ``next_roots``.
    ``features`` [bs, m, k D] float32 (``needs.feature_layers``): the captured rows of the
    verified tokens, the first ``counts[b]`` valid.  ``counts_host`` (host int64 [bs]): the
    counts as the engine has read them.  ``slots``: as ``DraftContext.slots`` (the same block
    of the drafter's ``context_cache``: the features' rows go there), or None; ``grown``: the
    ``context_cache``'s device lengths already grew by ``counts`` (module docstring)."""
    counts: object
    next_roots: object
    counts_host: object
    tokens: object = None
    hidden: object = None
    features: object = None
    slots: object = None
    grown: bool = False


@runtime_checkable
class Drafter(Protocol):
    """The protocol every drafter implements (module docstring)."""
    name: str
    block_len: int

    @property
    def vocab_size(self) -> int: ...

    @property
    def needs(self) -> TargetNeeds: ...

    def start(self, batch: int, max_len: int) -> None: ...

    def propose(self, ctx: DraftContext): ...

    def on_commit(self, commit: Commit) -> None: ...


def check_top_k(drafter, k: int) -> None:
    """A round's top-K of ``k`` tokens a depth must lie within what ``drafter`` ranks: its
    ``draft_vocab`` where it declares one (module docstring), else every token.  ValueError
    otherwise: the tree would take masked tokens."""
    cover = getattr(drafter, "draft_vocab", None)
    if cover is not None and k > cover:
        raise ValueError(f"a DDTree round of this budget takes each depth's top {k} tokens, "
                         f"but the drafter ranks only its draft vocabulary of {cover}: a "
                         f"budget <= {cover} or a larger draft vocabulary")

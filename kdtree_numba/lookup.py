"""Prompt lookup in DDTree's rounds (docs/ENGINE.md, "Prompt lookup").

The tokens that followed the last earlier occurrence of the context's final n tokens are mixed
into the drafter's per-depth distributions before each round's tree is built
(reference/ddtree/lookup.py: ``lookup_path``, ``mix_lookup``; the numba twins in
kdtree_numba/ddtree/lookup.py), so the builder spends nodes on that path where the drafter
does not already.  The acceptance reads the target alone: the same tokens, fewer rounds where
the text repeats itself.  It works with any drafter and needs nothing from it.

The engine keeps each request's tokens by position on the device (:class:`TokenHistory`):
the prompt and the first token after the prefill (one upload), then each round's committed
tokens written there by ``record_tokens`` before the round's read (a launch, no read).
``generate(prompt_lookup=...)`` and ``KDTREE_PROMPT_LOOKUP`` choose it (:func:`resolve`: on
by default on the CPU path and the numba backend, off on the exact float64 reference);
"chain" and "ar" ignore it.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from kdtree_numba import runtime
from reference.ddtree.checks import check_lookup

__all__ = ["PromptLookup", "TokenHistory", "history_rows", "resolve", "ON"]


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """A round's lookup: the path's ``weight`` w in the mixture (1 - w) draft + w path, and
    the suffix lengths it matches, ``max_n`` down to ``min_n`` tokens (checked: a one-line
    ValueError or TypeError naming the field)."""
    weight: float = runtime.LOOKUP_ON
    max_n: int = 8
    min_n: int = 2

    def __post_init__(self):
        weight, max_n, min_n = check_lookup(self.weight, self.max_n, self.min_n)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "max_n", max_n)
        object.__setattr__(self, "min_n", min_n)

    def key(self) -> tuple:
        """What a captured tree step depends on (a CUDA graph's key)."""
        return ("lookup", self.weight, self.max_n, self.min_n)

    def mix(self, ops, lp, ids, history, start):
        """The top-K rows ``lp``, ``ids`` [bs, R, k] with the lookup path from ``history`` at
        the roots' positions ``start`` mixed in (device work: two launches)."""
        path = ops.lookup_path(history, start, int(lp.shape[1]), self.max_n, self.min_n)
        return ops.mix_lookup(lp, ids, path, self.weight)


ON = PromptLookup()           # KDTREE_PROMPT_LOOKUP=on, prompt_lookup=True


def resolve(asked, method: str, backend) -> PromptLookup | None:
    """``generate``'s ``prompt_lookup`` for ``method`` on ``backend``: None (the runtime's,
    ``KDTREE_PROMPT_LOOKUP``; unset: :data:`ON` on the CPU path and the numba backend, none
    on the exact float64 reference), False (off), True (:data:`ON`), a weight in
    (0, 1) (the other settings :data:`ON`'s) or a PromptLookup.  Only "ddtree" uses it: None
    for the others."""
    if asked is None:
        weight = runtime.current().prompt_lookup
        if weight is None:      # the exact float64 reference: the plain drafter's trees
            weight = ON.weight if backend.cpu_path or backend.name == "numba" else 0.0
        chosen = dataclasses.replace(ON, weight=weight) if weight else None
    elif asked is False:
        chosen = None
    elif asked is True:
        chosen = ON
    elif isinstance(asked, PromptLookup):
        chosen = asked
    elif isinstance(asked, numbers.Real):
        chosen = dataclasses.replace(ON, weight=asked)
    else:
        raise TypeError(f"prompt_lookup must be None, a bool, a weight in (0, 1) or a "
                        f"PromptLookup, got {type(asked).__name__}")
    return chosen if method == "ddtree" else None


def history_rows(sequences, max_len: int, lengths=None) -> np.ndarray:
    """Each request's tokens by position, [bs, max_len] int32 (host): sequence b's first
    ``lengths[b]`` tokens (host ints; all of them where None)."""
    host = np.zeros((len(sequences), int(max_len)), np.int32)
    for b, seq in enumerate(sequences):
        n = len(seq) if lengths is None else int(lengths[b])
        host[b, :n] = seq[:n]
    return host


class TokenHistory:
    """Each request's tokens by position on the device: ``array`` [bs, max_len] int32, entry
    (b, p) the token at position p, up to each round's root (reference/ddtree/lookup.py);
    made after the prefill from each request's ``sequences`` (its prompt and root: one
    upload of :func:`history_rows`)."""

    def __init__(self, backend, sequences, max_len: int):
        self.backend = backend
        self.array = backend.asarray(history_rows(sequences, max_len))

    def record(self, start, packed, active) -> None:
        """A round's committed tokens (``packed``, at the roots' positions ``start``) into the
        history, for the ``active`` requests (device arrays; one launch, nothing read)."""
        self.backend.ops.record_tokens(self.array, start, packed, active)

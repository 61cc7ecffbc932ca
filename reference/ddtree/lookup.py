"""Prompt lookup in DDTree's tree: the NumPy reference.  This docstring is the contract of
``lookup_path``, ``mix_lookup`` and ``record_tokens`` (docs/DDTREE.md, "Prompt lookup").

Code repeats itself (parameter lists, docstring sections, lines like the one before), and so
does a small model's greedy text: the tokens that followed the last earlier occurrence of the
context's final n tokens often follow again.  A round mixes that *lookup path* into the
drafter's per-depth distributions before the tree is built, so the builder (its contract
unchanged) spends nodes on the path where the drafter does not already.  The acceptance
never reads draft probabilities, so the lookup shapes the tree, never the tokens.

Package conventions (batched over ``bs`` requests, int32 indices, padding -1):
reference/ddtree/__init__.py.

``history`` [bs, H] int32: request b's tokens by position, ``history[b, p]`` the token at
position p, for p = 0 .. ``lengths[b]`` (the root, at ``lengths[b]``: the round's start, the
number of tokens the target has cached before it).  Entries past that are stale.

``lookup_path(history, lengths, rows, max_n, min_n) -> path [bs, rows] int32``
    Per request, with P = lengths[b] and s = history[b]: for every earlier end j < P, the
    backward match m_j = the largest m <= max_n with s[j - i] == s[P - i] for i < m (and
    j - m + 1 >= 0).  The match is the j with the largest (m_j, j) among m_j >= min_n: the
    longest suffix of up to max_n tokens, its latest occurrence.  path[b, d] = s[j + 1 + d]
    where j + 1 + d <= P (a known token), else -1; all -1 without a match (or P = 0).
    ``1 <= min_n <= max_n <= MAX_NGRAM``.

``mix_lookup(lp, ids, path, weight) -> (lp, ids)``
    lp [bs, R, k] float32 (non-increasing along k), ids [bs, R, k] int32: ``topk_logprobs``'s
    rows; path [bs, >= R] int32.  A row d whose path token t = path[b, d] is >= 0 becomes the
    top k of the mixture (1 - w) p + w [token = t]: every entry but t's gets
    ``float32(lp + log1p(-w))`` (order kept), t's ``float32(log((1 - w) exp(lp_t) + w))``
    where t is in the row, else ``float32(log(w))`` (its own mass outside the top k is not
    known, and at the weights that pay it is far below w) replacing the row's last entry, if
    it ranks in the top k at all.  t then moves up to the first position whose value it
    exceeds strictly (ties keep the older entry first).  Rows without a path token are as
    they were.  float64 inside, float32 out; ``0 < weight < 1``.  New arrays (the GPU twin
    writes its inputs in place).

``record_tokens(history, lengths, packed, active) -> None``
    In place, after a round's acceptance and before its lengths grow: for each active request
    the m = packed[b, 0] committed tokens packed[b, 1 .. m] (``accept.pack_committed``: the
    accepted nodes' tokens, then the bonus, the next root) go to history[b, lengths[b] + 1 ..
    lengths[b] + m], those within H.  So the history again holds every position up to the
    next round's root.
"""
from __future__ import annotations

import numpy as np

from .checks import (MAX_NGRAM, check_lookup, check_lookup_args, check_mix_args,
                     check_record_args)

__all__ = ["lookup_path", "mix_lookup", "record_tokens"]


def lookup_path(history, lengths, rows: int, max_n: int, min_n: int) -> np.ndarray:
    """The lookup path of each request (contract: module docstring)."""
    bs, H, rows, max_n, min_n = check_lookup_args(history, lengths, rows, max_n, min_n)
    history, lengths = np.asarray(history), np.asarray(lengths)
    path = np.full((bs, rows), -1, np.int32)
    for b in range(bs):
        P = int(lengths[b])
        if not 0 <= P < H:
            raise ValueError(f"lengths[{b}] = {P} outside the history's {H} positions")
        s = history[b]
        best = (0, -1)
        for j in range(P):
            m = 0
            while m < max_n and j - m >= 0 and s[j - m] == s[P - m]:
                m += 1
            if m >= min_n and (m, j) > best:
                best = (m, j)
        j = best[1]
        if j >= 0:
            follow = s[j + 1:min(P, j + rows) + 1]
            path[b, :follow.size] = follow
    return path


def mix_lookup(lp, ids, path, weight: float):
    """The rows' top k after mixing in the lookup path (contract: module docstring)."""
    bs, R, k, weight = check_mix_args(lp, ids, path, weight)
    lp, ids, path = np.array(lp), np.array(ids), np.asarray(path)
    shift = np.log1p(-weight)
    for b in range(bs):
        for d in range(R):
            t = int(path[b, d])
            if t < 0:
                continue
            row, tok = lp[b, d].astype(np.float64), ids[b, d].copy()
            where = np.flatnonzero(tok == t)
            if where.size:
                i = int(where[0])
                v = np.float32(np.log((1.0 - weight) * np.exp(row[i]) + weight))
                others = np.delete(np.arange(k), i)
            else:
                v = np.float32(np.log(weight))
                others = np.arange(k - 1)
            vals = (row[others] + shift).astype(np.float32)
            if where.size == 0 and v <= np.float32(row[k - 1] + shift):
                lp[b, d], ids[b, d] = (row + shift).astype(np.float32), tok
                continue            # t does not rank in the top k
            at = int(np.flatnonzero(np.append(v > vals, True))[0])
            lp[b, d] = np.concatenate([vals[:at], [v], vals[at:]])
            ids[b, d] = np.concatenate([tok[others][:at], [t], tok[others][at:]])
    return lp, ids


def record_tokens(history, lengths, packed, active) -> None:
    """The committed tokens into the history, in place (contract: module docstring)."""
    history = np.asarray(history)
    bs, H = check_record_args(history, lengths, packed, active)
    for b in range(bs):
        if not active[b]:
            continue
        m, at = int(packed[b, 0]), int(lengths[b])
        for j in range(1, m + 1):
            if at + j < H:
                history[b, at + j] = packed[b, j]

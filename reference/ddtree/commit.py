"""A device round's index arithmetic and commit (kdtree_numba/device_round.py with
``KDTREE_ROUND_EPILOGUE``): integers and copies only, so the numba twin
(kdtree_numba/ddtree/commit.py) gives the same values in one launch each.

* :func:`round_slots`: the verify's storage rows in the target's dense cache and the drafter's
  block's storage rows and positions in its own (position = slot there), from the two caches'
  device lengths at the round's start;
* :func:`commit_round`: ``counts = acc_len * active``, both caches' lengths grown by them, the
  roots set to the bonus tokens, and the verify's captured rows at the accepted nodes (the
  drafter's next context).
"""
from __future__ import annotations

import numpy as np

__all__ = ["dense_rows", "round_slots", "commit_round"]


def dense_rows(lengths, max_len: int, n: int) -> np.ndarray:
    """Storage rows [bs, n] int64 of n new tokens after ``lengths`` [bs] in a dense cache of
    ``max_len`` slots a request: ``b max_len + lengths[b] + j``."""
    lengths = np.asarray(lengths).astype(np.int64)
    bs = lengths.shape[0]
    return (np.arange(bs, dtype=np.int64)[:, None] * int(max_len) + lengths[:, None]
            + np.arange(int(n), dtype=np.int64)[None, :])


def round_slots(lengths, max_len: int, n: int, block_lengths, block_max_len: int,
                block: int):
    """``(rows [bs, n] int64, block_rows [bs, block] int64, block_positions [bs, block]
    int32)``: :func:`dense_rows` of the verify's n tokens after ``lengths`` (the target's) and
    of the drafter's ``block`` tokens after ``block_lengths`` (its context's), and the block's
    positions ``block_lengths[b] + j``."""
    block_lengths = np.asarray(block_lengths)
    positions = (block_lengths.astype(np.int64)[:, None]
                 + np.arange(int(block), dtype=np.int64)[None, :]).astype(np.int32)
    return (dense_rows(lengths, max_len, n), dense_rows(block_lengths, block_max_len, block),
            positions)


def commit_round(rows, acc_idx, acc_len, active, next_roots, roots, lengths, block_lengths):
    """A round's commit, in place: ``counts = acc_len * active`` (int32 [bs]); ``lengths`` and
    ``block_lengths`` ([bs] int32, or None) grow by them; ``roots[b] = next_roots[b]`` where
    ``active[b]`` (a request the round did not run keeps the token it continues from).  Returns
    ``(counts, accepted)``: ``accepted`` [bs, L + 1, F] the rows [bs, W, F] at ``acc_idx``
    [bs, L + 1] (padding -1 reads row 0), or None where ``rows`` is None."""
    counts = (np.asarray(acc_len).astype(np.int32) * np.asarray(active).astype(np.int32)
              ).astype(np.int32)
    for grown in (lengths, block_lengths):
        if grown is not None:
            grown += counts
    roots[...] = np.where(np.asarray(active) != 0, next_roots, roots)
    if rows is None:
        return counts, None
    rows = np.asarray(rows)
    bs = rows.shape[0]
    return counts, rows[np.arange(bs)[:, None], np.maximum(np.asarray(acc_idx), 0)]

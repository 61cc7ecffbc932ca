"""A device round's index arithmetic and commit on the GPU, one launch each
(``KDTREE_ROUND_EPILOGUE``, kdtree_numba/device_round.py): ``round_slots`` and
``commit_round``.

Reference twin and contract: reference/ddtree/commit.py (the same integers and copies).  Why:
a budget-16 round on the demo pair ran ~15 CuPy launches of 1-2 us each for this glue (the
slots' adds of three forwards, the drafter's positions, ``counts = acc_len * active``, two
lengths' adds, the roots' copy, the accepted rows' maximum, index preparation and take).
Host plumbing shared with the other DDTree kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, SIMULATOR

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import copy_back, device_view

__all__ = ["round_slots", "commit_round"]

THREADS = 32 if SIMULATOR else 128


@kernel
def _slots(lengths, max_len, rows, block_lengths, block_max_len, block_rows, block_positions):
    """One block per request, threads over the tokens: both caches' storage rows and the
    block's positions."""
    b = cuda.blockIdx.x
    base = np.int64(b) * max_len + lengths[b]
    for j in range(cuda.threadIdx.x, rows.shape[1], cuda.blockDim.x):
        rows[b, j] = base + j
    block_base = np.int64(b) * block_max_len + block_lengths[b]
    for j in range(cuda.threadIdx.x, block_rows.shape[1], cuda.blockDim.x):
        block_rows[b, j] = block_base + j
        block_positions[b, j] = block_lengths[b] + j


def round_slots(lengths, max_len: int, n: int, block_lengths, block_max_len: int, block: int,
                *, stream=0):
    """GPU twin of ``reference.ddtree.commit.round_slots``, one launch; device arrays out."""
    bs = int(lengths.shape[0])
    compat.require_kernels()
    rows = compat.device_empty((bs, int(n)), np.int64, stream)
    block_rows = compat.device_empty((bs, int(block)), np.int64, stream)
    positions = compat.device_empty((bs, int(block)), np.int32, stream)
    _slots[bs, THREADS, stream](device_view(lengths, stream), np.int64(max_len), rows,
                                device_view(block_lengths, stream), np.int64(block_max_len),
                                block_rows, positions)
    return rows, block_rows, positions


@kernel_factory
def _commit_kernel(gather: bool, grow_block: bool):
    @kernel
    def commit(rows, acc_idx, acc_len, active, next_roots, roots, lengths, block_lengths,
               counts, out):
        """Grid (request, chunk of its accepted rows' elements), one element a thread: the
        gather; block (b, 0)'s thread 0 also request b's counts, lengths and root (kept where
        the round did not run it)."""
        b = cuda.blockIdx.x
        if cuda.blockIdx.y == 0 and cuda.threadIdx.x == 0:
            c = acc_len[b] * active[b]
            counts[b] = c
            lengths[b] += c
            if grow_block:
                block_lengths[b] += c
            if active[b]:
                roots[b] = next_roots[b]
        if gather:
            width = out.shape[2]
            k = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
            j = k // width
            if j < out.shape[1]:
                f = k - j * width
                i = acc_idx[b, j]
                out[b, j, f] = rows[b, i if i > 0 else 0, f]
    return commit


def commit_round(rows, acc_idx, acc_len, active, next_roots, roots, lengths, block_lengths,
                 *, stream=0):
    """GPU twin of ``reference.ddtree.commit.commit_round``, one launch: ``lengths``,
    ``block_lengths`` (or None) and ``roots`` in place (NumPy ones copied back, as the
    simulator's device arrays are); ``(counts, accepted)`` device arrays out."""
    bs = int(acc_idx.shape[0])
    compat.require_kernels()
    counts = compat.device_empty((bs,), np.int32, stream)
    if rows is None:
        out = compat.device_empty((bs, 1, 1), np.float32, stream)
        rows_d, chunks = out, 1
    else:
        out = compat.device_empty((bs, int(acc_idx.shape[1]), int(rows.shape[2])),
                                  rows.dtype, stream)
        rows_d = device_view(rows, stream)
        chunks = max(1, -(-int(out.shape[1]) * int(out.shape[2]) // THREADS))
    grow_block = block_lengths is not None
    grown = (lengths, roots) + ((block_lengths,) if grow_block else ())
    views = [device_view(a, stream) for a in grown]
    _commit_kernel(rows is not None, grow_block)[(bs, chunks), THREADS, stream](
        rows_d, device_view(acc_idx, stream), device_view(acc_len, stream),
        device_view(active, stream), device_view(next_roots, stream), views[1], views[0],
        views[-1], counts, out)
    copy_back(grown, views, stream)
    return counts, (out if rows is not None else None)

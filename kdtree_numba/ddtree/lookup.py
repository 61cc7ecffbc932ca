"""Prompt lookup in DDTree's tree on the GPU, one launch each: ``lookup_path``,
``mix_lookup`` and ``record_tokens``.

Reference twin and contract: reference/ddtree/lookup.py (the same path and history integers;
the mixed rows' ids and every lp but the path token's bit-identical; an in-row path token's
value comes from the device's ``log``/``exp`` (and maybe a fused multiply-add), so on the GPU
it may lie an ulp apart, and at an exact float32 tie take another place).
``mix_lookup`` and ``record_tokens`` write their inputs in place (NumPy ones copied back, as
``commit_round`` does).  Host plumbing shared with the other DDTree kernels: arrays.py.
"""
import math

from kdtree_numba.compat import cuda, device_function, kernel, SIMULATOR

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import copy_back, device_view
from kdtree_numba.gpu.reduce import tree_reduce
from reference.ddtree.checks import check_lookup_args, check_mix_args, check_record_args

__all__ = ["lookup_path", "mix_lookup", "record_tokens"]

THREADS = 32 if SIMULATOR else 128      # a power of two: tree_reduce's block max
_LOW32 = np.int64(0xFFFFFFFF)


# ----------------------------------------------------------------------------- lookup_path

@kernel
def _lookup(history, lengths, max_n, min_n, path):
    """One block per request: threads over the candidate ends j < P, a block max of the key
    m_j * 2^32 + j (the contract's largest (m_j, j)), then threads over the path's rows."""
    b, t = cuda.blockIdx.x, cuda.threadIdx.x
    best = cuda.shared.array(THREADS, np.int64)
    P = lengths[b]
    key = np.int64(-1)
    if P >= 0 and P < history.shape[1]:      # else the caller's promise broke: no read past the row
        for j in range(t, P, cuda.blockDim.x):
            m = 0
            while m < max_n and j - m >= 0 and history[b, j - m] == history[b, P - m]:
                m += 1
            if m >= min_n:
                key = max(key, (np.int64(m) << 32) + j)
    best[t] = key
    tree_reduce(best, t, THREADS, True)
    key = best[0]
    first = (key & _LOW32) + 1                # the match's next position
    for d in range(t, path.shape[1], cuda.blockDim.x):
        path[b, d] = history[b, first + d] if key >= 0 and first + d <= P else -1


def _check_lengths(history, lengths) -> None:
    """The reference's value check, for NumPy inputs only (device values are not read)."""
    if isinstance(lengths, np.ndarray):
        H = int(history.shape[1])
        for b, P in enumerate(lengths.tolist()):
            if not 0 <= P < H:
                raise ValueError(f"lengths[{b}] = {P} outside the history's {H} positions")


def lookup_path(history, lengths, rows: int, max_n: int, min_n: int, *, stream=0):
    """GPU twin of ``reference.ddtree.lookup.lookup_path``, one launch (a block a request); a
    device array out.  On device inputs 0 <= lengths[b] < H is the caller's promise (the
    reference raises; the kernel gives such a request -1s and reads nothing outside its row)."""
    bs, _, rows, max_n, min_n = check_lookup_args(history, lengths, rows, max_n, min_n)
    _check_lengths(history, lengths)
    compat.require_kernels()
    path = compat.device_empty((bs, rows), np.int32, stream)
    if bs:
        _lookup[bs, THREADS, stream](device_view(history, stream), device_view(lengths, stream),
                                     np.int32(max_n), np.int32(min_n), path)
    return path


# ----------------------------------------------------------------------------- mix_lookup

@device_function
def _shifted(x, shift):
    """An entry other than the path token's: its lp plus log(1 - w), in float64."""
    return np.float32(np.float64(x) + shift)


@device_function
def _shift_span(lp, lo, hi, shift):
    for p in range(lo, hi):
        lp[p] = _shifted(lp[p], shift)


@device_function
def _mix_row(lp, ids, t, w, shift, absent):
    """One row in place.  The entry dropped is t's (index i), or the last one where t is
    absent; t goes to ``at``, the first position whose shifted value it exceeds strictly (of
    the row without index i), and the entries between i and ``at`` move one step towards i.
    Each is read before it is written: moves run away from ``at``, the rest stay put."""
    k = lp.shape[0]
    i = k - 1
    for q in range(k):
        if ids[q] == t:
            i = q
            break
    if ids[i] == t:
        v = np.float32(math.log((1.0 - w) * math.exp(np.float64(lp[i])) + w))
    else:
        v = absent
        if v <= _shifted(lp[i], shift):     # t does not rank in the top k
            _shift_span(lp, 0, k, shift)
            return
    at = k - 1
    for q in range(k - 1):
        if v > _shifted(lp[q + 1 if q >= i else q], shift):
            at = q
            break
    if at <= i:
        for p in range(i, at, -1):
            lp[p], ids[p] = _shifted(lp[p - 1], shift), ids[p - 1]
    else:
        for p in range(i, at):
            lp[p], ids[p] = _shifted(lp[p + 1], shift), ids[p + 1]
    lp[at], ids[at] = v, t
    _shift_span(lp, 0, min(at, i), shift)
    _shift_span(lp, max(at, i) + 1, k, shift)


@kernel
def _mix(lp, ids, path, w, shift, absent):
    """Grid (request, chunk of rows), a thread per row: the rows with a path token mixed."""
    b = cuda.blockIdx.x
    d = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    if d < lp.shape[1] and path[b, d] >= 0:
        _mix_row(lp[b, d], ids[b, d], path[b, d], w, shift, absent)


def mix_lookup(lp, ids, path, weight: float, *, stream=0):
    """GPU twin of ``reference.ddtree.lookup.mix_lookup``, one launch: ``lp`` and ``ids`` in
    place, and returned.  log(1 - w) and float32(log w) are made on the host with the
    reference's NumPy calls, so every value but an in-row path token's is bit-identical."""
    bs, R, k, weight = check_mix_args(lp, ids, path, weight)
    compat.require_kernels()
    views = [device_view(a, stream) for a in (lp, ids)]
    if bs and R and k:
        threads = min(THREADS, R)
        _mix[(bs, -(-R // threads)), threads, stream](
            *views, device_view(path, stream), np.float64(weight), np.log1p(-weight),
            np.float32(np.log(weight)))
    copy_back((lp, ids), views, stream)
    return lp, ids


# ----------------------------------------------------------------------------- record_tokens

@kernel
def _record(history, lengths, packed, active):
    """One block per active request, threads over its committed tokens."""
    b = cuda.blockIdx.x
    if active[b] != 0:
        at = lengths[b]
        # m <= packed's width - 1 is pack_committed's promise: read no further in any case
        m = min(packed[b, 0], packed.shape[1] - 1)
        for j in range(1 + cuda.threadIdx.x, m + 1, cuda.blockDim.x):
            if at + j < history.shape[1]:
                history[b, at + j] = packed[b, j]


def record_tokens(history, lengths, packed, active, *, stream=0) -> None:
    """GPU twin of ``reference.ddtree.lookup.record_tokens``, one launch: ``history`` in place.
    ``active`` bool or int."""
    bs, _ = check_record_args(history, lengths, packed, active)
    compat.require_kernels()
    view = device_view(history, stream)
    if bs:
        _record[bs, THREADS, stream](view, device_view(lengths, stream),
                                     device_view(packed, stream), device_view(active, stream))
    copy_back((history,), (view,), stream)

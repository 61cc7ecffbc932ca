"""DDTree KV compaction on the GPU: ``compact_kv`` (moves the accepted tree slots' cache rows to
their final places, in place, for caches of any dtype as unsigned words), its block size
``compact_threads`` and its kernel.

Reference twin and contract: reference/ddtree/compact.py.  The kernel and why: docs/DDTREE.md,
"compile_tree, accept, sampling, compaction".  Host plumbing shared with the other DDTree
kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, SIMULATOR


import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import any_on_device, device_view
from reference.ddtree.checks import check_accepted, check_compact_args

__all__ = ["compact_kv", "compact_threads"]


# ----------------------------------------------------------------------------- KV compaction

@kernel_factory
def _compact_kernel(max_rows: int, word):
    """Grid (bs * n_stack, column chunks); each thread owns one column of one request and
    copies its accepted rows through registers: all reads, then all writes (the aliasing
    hazard is between rows of one column, and one thread does all of them)."""

    @kernel
    def compact(cache, past_len, acc_idx, acc_len):
        n_batch = cache.shape[1]
        max_len = cache.shape[2]
        stack = cuda.blockIdx.x // n_batch
        b = cuda.blockIdx.x - stack * n_batch
        m = min(acc_len[b], max_rows)
        first = 0                 # rows of an identity prefix (acc[k] == k) stay where they are
        while first < m and acc_idx[b, first] == first:
            first += 1
        if first >= m:
            return
        past = past_len[b]
        rows = cuda.local.array(max_rows, word)
        col = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
        if col >= cache.shape[3]:
            return
        for k in range(max_rows):   # unrolled: the rows stay in registers
            if first <= k < m:
                src = past + acc_idx[b, k]
                if 0 <= src < max_len:
                    rows[k] = cache[stack, b, src, col]
        for k in range(max_rows):
            if first <= k < m and 0 <= past + acc_idx[b, k] < max_len:
                cache[stack, b, past + k, col] = rows[k]

    return compact


_WORDS = {8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}


def _as_words(cache):
    """A 4-D view of a device cache in the widest unsigned words its rows allow (bf16, fp16 and
    any other dtype become bit patterns; nothing is converted)."""
    if len(cache.shape) == 3:
        if not cache.is_c_contiguous():
            raise ValueError("a 3-D device cache must be C-contiguous (or pass a 4-D stack)")
        cache = cache.reshape((1,) + tuple(cache.shape))
    itemsize = np.dtype(cache.dtype).itemsize
    if itemsize not in _WORDS:
        raise TypeError(f"cache dtype {cache.dtype} has no unsigned word of its size")
    row_bytes = int(cache.shape[3]) * itemsize
    address = 0 if SIMULATOR else cache.__cuda_array_interface__["data"][0]
    if cache.is_c_contiguous():
        for size in (8, 4):
            if size > itemsize and row_bytes % size == 0 and address % size == 0:
                return cache.view(_WORDS[size])
    return cache.view(_WORDS[itemsize])


def compact_threads(n_words: int) -> int:
    """Threads per compaction block: one per word column, whole warps, at most 256."""
    return 8 if SIMULATOR else min(256, 32 * ((n_words + 31) // 32))


def _check_capacity(cache, past_len, acc_idx, acc_len) -> None:
    """The reference's capacity check, for NumPy indices (free on the host)."""
    past_len, acc_idx, acc_len = (np.asarray(a) for a in (past_len, acc_idx, acc_len))
    last = past_len + np.take_along_axis(acc_idx, acc_len[:, None] - 1, axis=1)[:, 0]
    if np.any(past_len < 0) or np.any(last >= tuple(cache.shape)[-2]):
        raise ValueError(f"rows past_len + acc_idx reach {int(last.max())}: outside the cache "
                         f"(max_len {tuple(cache.shape)[-2]})")


def compact_kv(caches, past_len, acc_idx, acc_len, *, stream=0) -> None:
    """GPU twin of ``reference.ddtree.compact_kv``, bit-identical, in place.

    Host-side checks: shapes and dtypes only, plus (for NumPy indices) the reference's value
    checks.  On device indices a row outside ``[0, max_len)`` is skipped, never written; that
    is the caller's error and is not reported (reporting it would need a host read).
    One launch per array in ``caches``: pass a 4-D stack [n_layers, bs, max_len, width] to
    compact every layer in one launch.
    """
    caches, bs, n_acc = check_compact_args(caches, past_len, acc_idx, acc_len)
    compat.require_kernels()
    host_index = not any_on_device(past_len, acc_idx, acc_len)
    if host_index:
        for b in range(bs):
            check_accepted(np.asarray(acc_idx)[b], int(np.asarray(acc_len)[b]), b)
        for cache in caches:
            _check_capacity(cache, past_len, acc_idx, acc_len)
    d_past, d_acc, d_len = (device_view(a, stream) for a in (past_len, acc_idx, acc_len))
    for cache in caches:
        on_host = isinstance(cache, np.ndarray)
        if on_host:   # bit patterns travel; the result is copied back in place
            itemsize = cache.dtype.itemsize
            if itemsize not in _WORDS:
                raise TypeError(f"cache dtype {cache.dtype} has no unsigned word of its size")
            d_cache = device_view(cache.view(_WORDS[itemsize]), stream)
        else:
            d_cache = device_view(cache, stream)
        words = _as_words(d_cache)
        n_stack, _, _, n_words = (int(s) for s in words.shape)
        threads = compact_threads(n_words)
        grid = (n_stack * bs, (n_words + threads - 1) // threads)
        _compact_kernel(n_acc, words.dtype.type)[grid, threads, stream](words, d_past, d_acc,
                                                                        d_len)
        if on_host:
            cache[...] = d_cache.copy_to_host(stream=stream).view(cache.dtype)

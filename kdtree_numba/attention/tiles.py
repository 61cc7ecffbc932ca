"""The kernel pieces both attention block kernels share: constants, block geometry, masking and
the ``cp.async`` row-tile copier.

The FFMA kernel (ffma.py) and the tensor-core kernel (mma.py) compute the same function
(contract: reference/attention/mla.py) with the same grid (row tiles x key splits x requests),
the same key-slot masking and the same staging of query and key rows in shared memory; those
parts are written once here, below both kernels, so neither kernel module imports the other.
docs/ATTENTION.md has the design.
"""
from kdtree_numba.compat import SIMULATOR, cuda, device_function  # noqa: I001

import math

import numpy as np
from numba import float32, int32

from kdtree_numba.gpu.bits import divmod_u32
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (MAX_SHARED_BYTES, cp_async16, cp_async_strided,  # noqa: F401
                                     load_f32x4, load_l2_f32, load_l2_f32x4, store_f32x4)

__all__ = ["NEG_INF", "ZERO", "ONE", "RESCALE_SLACK", "MAX_SHARED_BYTES", "block_keys",
           "block_row0", "masked_score", "seen_new_keys", "splits_with_keys", "row_tile_copier",
           "request_keys", "split_merge", "merged_value", "merge_when_last",
           "merge_smem_floats",
           "MERGE_ITEMS", "MERGE_LOADS"]

NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
RESCALE_SLACK = np.float32(8.0)  # online softmax: lag of the reference point behind the max


# ---------------------------------------------------------------------------------------------
# Block geometry and masking, shared by the FFMA and the tensor-core kernels
# ---------------------------------------------------------------------------------------------
@inline_device_function
def request_keys(prefix, n, causal, row, heads):
    """The key slots a row (query * heads + head) of a request with ``prefix`` cached keys
    may see: prefix + n, or with ``causal`` those up to its own query's."""
    if causal:
        # 32-bit division: numba's 64-bit one is a subroutine call, which serializes a
        # kernel's wgmma (attention/wgmma.py)
        return prefix + min(n - 1, divmod_u32(row, heads)[0]) + 1
    return prefix + n


def block_keys(prefix_len, n, chunk, causal, last_row, heads):
    """(b, split, prefix, first, end) of this block (grid: row tiles x splits x requests):
    its request b, key split, the request's cached length, and the key slots [first, end):
    ``chunk`` slots from split * chunk, clipped to the request's keys; the last split takes
    the rest, whatever the plan's max_keys promised.  The request's keys end at prefix + n, or
    with ``causal`` (no query sees a new key after its own) after the block's last query
    (its row ``last_row``, rows = query * heads + head): the keys past it are masked for every
    row of the block, so skipping them changes no bit (a masked key adds exact zeros)."""
    split, b = cuda.blockIdx.y, cuda.blockIdx.z
    prefix = prefix_len[b]
    keys = request_keys(prefix, n, causal, last_row, heads)
    first = split * chunk
    end = min(first + chunk, keys)
    if split == cuda.gridDim.y - 1:
        end = keys
    return b, split, prefix, first, end


def block_row0(rows, causal):
    """The first query-head row of this block (grid.x: row tiles of ``rows``).  With
    ``causal`` the tiles go last first: a causal block's keys end after its last query, so its
    work grows with its position, and the GPU starts blocks in index order -- in order, the
    longest would run last and leave the tail to a few busy SMs (a 4,096-token prefill's 4,096
    blocks, the last ~2x the mean); longest first, the tail is the shortest blocks.  Each block
    computes the same rows over the same keys either way: only the start order changes."""
    i = cuda.blockIdx.x
    if causal:
        i = cuda.gridDim.x - 1 - i
    return i * rows


# Inlined on the GPU.  In the simulator device functions rather than plain ones (as
# inline_device_function would leave them): the simulator points ``cuda`` at its fake module
# only in the globals of the running kernel's module and of device functions being called, and
# this module is no kernel's, so a plain function here would read the real numba.cuda's blockIdx.
block_keys = device_function(block_keys) if SIMULATOR else inline_device_function(block_keys)
block_row0 = device_function(block_row0) if SIMULATOR else inline_device_function(block_row0)


def seen_new_keys(visible, b, first_row, last_row, heads, tid, threads):
    """How many leading new keys every query of the block's rows [first_row, last_row] sees:
    its first query's own position + 1 when ``visible[b, q, j]`` holds for each of the
    block's queries q and j up to that bound, else 0.  Key tiles inside the cached keys and
    these are scored without reading the mask (a causal prefill's block skips it on every
    tile but its diagonal one, where otherwise most of a long prefill's attention time was
    the mask's loads and branches on every score); the scores are the same either way.  The
    block's threads read the bytes once, then a barrier ANDs their findings (every thread
    of the block must call it)."""
    q_first = divmod_u32(first_row, heads)[0]
    q_last = divmod_u32(last_row, heads)[0]
    bound = q_first + 1
    ok = 1
    for q in range(q_first, q_last + 1):
        for j in range(tid, bound, threads):
            if not visible[b, q, j]:
                ok = 0
    return bound if cuda.syncthreads_and(ok) else 0


# device_function under the simulator for the reason of block_keys' comment
seen_new_keys = (device_function(seen_new_keys) if SIMULATOR
                 else inline_device_function(seen_new_keys))


@inline_device_function
def splits_with_keys(keys, chunk, splits):
    """How many of a request's ``splits`` key splits hold one of its first ``keys`` slots
    (block_keys' end: prefix + n, or with ``causal`` after the row's own query): all of
    them when the last one takes the rest.  The block kernels run no key tile for the others
    and write nothing (the tensor-core kernel returns at once; the FFMA kernel guards its
    writes instead, see ffma.py), and the merge reads only these: a split past a row's keys
    would add exact zeros (weight exp(-inf) = 0 times a zero output), so skipping it keeps
    every bit and saves its launch's partial-output traffic.  Batch-invariant plans size the
    splits for the cache's capacity, so most of a short request's splits are such."""
    return min(splits, (keys + chunk - 1) // chunk)


@inline_device_function
def masked_score(s, key, end, prefix, visible, b, row_ok, query):
    """Score ``s`` of slot ``key``, or -inf where the slot lies past the split's end or is a new
    token that the row's query must not see (``visible[b, query, key - prefix]``)."""
    if key >= end:
        return NEG_INF
    if key >= prefix:
        if not row_ok:
            return NEG_INF
        if not visible[b, query, key - prefix]:
            return NEG_INF
    return s


def _tile_slot_fn(threads: int):
    """(row, float4 column) of slot ``tid + s*threads`` in a tile ``width4`` float4s wide.

    When ``width4`` divides the thread count the column is fixed per thread and the row steps
    by a constant, which keeps 64-bit division out of the per-tile load loop.
    """
    def tile_slot(tid, s, width4):
        if threads % width4 == 0:
            return tid // width4 + s * (threads // width4), tid % width4
        f = tid + s * threads
        return f // width4, f % width4
    return inline_device_function(tile_slot)


# ---------------------------------------------------------------------------------------------
# Staging query and key rows in shared memory
# ---------------------------------------------------------------------------------------------
def row_tile_copier(cfg, rows: int):
    """``issue(smem, off, main, rope, b, first, limit, tid)``: cp.async rows ``first + i``
    (i < rows) of ``[main[b] | rope[b]]`` (widths r and dr) into the tile at smem[off] (row
    stride ``row_stride``); rows >= limit become zeros (their source row is clamped to
    limit - 1 >= 0, so no address leaves the array).  The caller commits.

    When the rows divide the threads evenly, thread tid copies row tid / (T/rows), float4
    columns tid % (T/rows) + (T/rows)*s: one address pair per row and array, the rest are
    constant offsets.  Otherwise float4 slots are dealt out round-robin.  ``cfg`` is either
    kernel's tile configuration (plan.TileConfig or plan.MmaTileConfig): it reads threads,
    row_stride, r and dr.
    """
    T, QS = cfg.threads, cfg.row_stride
    DV4, DR4 = cfg.r // 4, cfg.dr // 4
    TPR = T // rows if T % rows == 0 else 0     # threads per row
    if TPR and DV4 % TPR == 0 and DR4 % TPR == 0:
        @inline_device_function
        def issue(smem, off, main, rope, b, first, limit, tid):
            i, quad = tid // TPR, tid % TPR
            src = min(first + i, limit - 1)
            nbytes = int32(16) if first + i < limit else int32(0)
            at = off + i * QS + 4 * quad
            cp_async_strided(smem, at, main, (b, src, 4 * quad), DV4 // TPR, TPR, nbytes)
            cp_async_strided(smem, at + DV4 * 4, rope, (b, src, 4 * quad), DR4 // TPR, TPR,
                             nbytes)
        return issue

    tile_slot = _tile_slot_fn(T)

    @inline_device_function
    def issue_any(smem, off, main, rope, b, first, limit, tid):
        for s in range(-(-rows * DV4 // T)):
            i, quad = tile_slot(tid, s, DV4)
            if rows * DV4 % T == 0 or i < rows:
                nbytes = int32(16) if first + i < limit else int32(0)
                cp_async16(smem, off + i * QS + 4 * quad, main,
                           (b, min(first + i, limit - 1), 4 * quad), nbytes)
        for s in range(-(-rows * DR4 // T)):
            i, quad = tile_slot(tid, s, DR4)
            if rows * DR4 % T == 0 or i < rows:
                nbytes = int32(16) if first + i < limit else int32(0)
                cp_async16(smem, off + i * QS + 4 * (DV4 + quad), rope,
                           (b, min(first + i, limit - 1), 4 * quad), nbytes)
    return issue_any


# ---------------------------------------------------------------------------------------------
# Merging the key splits: mla.py's merge kernel, or the block kernels' last block to finish
# ---------------------------------------------------------------------------------------------
@inline_device_function
def merge_scale(part_ml, b, row, splits):
    """(m_safe, scale) of a row's merge over its first ``splits`` splits: the largest
    reference max (0 where none is finite) and 1 / sum_s exp(m_s - m_safe) l_s (0 for an
    empty sum), in split order."""
    m_max = NEG_INF
    for s in range(splits):
        m_max = max(m_max, part_ml[b, s, row, 0])
    m_safe = m_max if m_max > NEG_INF else ZERO
    total = ZERO
    for s in range(splits):
        total += math.exp(part_ml[b, s, row, 0] - m_safe) * part_ml[b, s, row, 1]
    return m_safe, ONE / total if total > ZERO else ZERO


def split_merge():
    """``merge_quad(part_o, part_ml, out, b, row, quad, splits)``: columns 4 quad .. + 3 of
    out[b, row] = sum_s w_s O_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s) over the
    row's first ``splits`` splits (the others hold none of its keys and wrote nothing): the
    merge kernel's arithmetic (mla.py).  :func:`merge_when_last` computes the same
    operations in the same order, spread over a block, so the two merges' bits are equal."""
    @inline_device_function
    def merge_quad(part_o, part_ml, out, b, row, quad, splits):
        m_safe, scale = merge_scale(part_ml, b, row, splits)
        y0 = y1 = y2 = y3 = ZERO
        for s in range(splits):
            w = math.exp(part_ml[b, s, row, 0] - m_safe)
            x0, x1, x2, x3 = load_f32x4(part_o, (b, s, row, 4 * quad))
            y0 += w * x0
            y1 += w * x1
            y2 += w * x2
            y3 += w * x3
        store_f32x4(out, (b, row, 4 * quad), y0 * scale, y1 * scale, y2 * scale, y3 * scale)
    return merge_quad


@inline_device_function
def merged_value(part_o, part_ml, b, row, col, splits):
    """out[b, row, col] of the merge of the row's first ``splits`` key splits: for one column,
    split_merge's operations in its order (the maximum, the weighted sum of the split sums,
    their reciprocal, the weighted sum of the partial outputs, the product), so a consumer that
    merges as it loads (apply_uv under ``KDTREE_MERGE_IN_UV``, projections.py) reads the bits
    the merge kernel would have written."""
    m_safe, scale = merge_scale(part_ml, b, row, splits)
    y = ZERO
    for s in range(splits):
        w = math.exp(part_ml[b, s, row, 0] - m_safe)
        y += w * part_o[b, s, row, col]
    return y * scale


# A thread of the in-kernel merge takes MERGE_ITEMS output float4s at a time and loads the
# partials of MERGE_LOADS splits of each at once: 16 float4 loads in flight, none waiting on
# another (the engine's decodes have a few splits with keys: a float4 costs one L2 latency)
MERGE_ITEMS, MERGE_LOADS = 4, 4


def merge_smem_floats(rows: int, splits: int) -> int:
    """The shared floats the in-kernel merge needs to take ``rows`` rows of ``splits`` splits
    at once: a weight and a sum per (row, split), a scale and a split count per row."""
    return rows * (2 * splits + 2)


def merge_when_last(r: int, rows: int, threads: int, causal: bool, smem_floats: int):
    """``merge(smem, part_o, part_ml, out, b, row0, n_rows, prefix, n, heads, chunk, tid)``,
    called by every thread of a block kernel (``threads``, ``rows`` query-heads from row0)
    after it wrote its split's partial output and (max, sum): the in-kernel merge of
    ``KDTREE_FEWER_LAUNCHES`` (docs/ATTENTION.md, "Merging in the kernel").  Each block
    fences its writes and counts itself in the arrival counter of its (row tile, request),
    ``part_ml[b, splits, tile, 0]`` (a float32 count: exact, and the kernel keeps its
    argument types); the block that arrives last -- of the splits that hold the tile's keys,
    the ones that run -- merges every row of the tile and sets the counter back to 0 for the
    next call (and the next replay of a CUDA graph).  Only blocks with keys may call it.

    The merge reuses the block's dynamic shared memory ``smem`` (float32, ``smem_floats``
    of it; the block is done with its keys) and computes :func:`split_merge`'s arithmetic in
    its order, so its bits are the merge kernel's, but without split_merge's serial chains
    of L2 loads per output float4 (run 158: one merging block took ~33 us):

    1. every thread loads (m_s, l_s) pairs of the tile's rows in parallel into shared memory;
    2. one thread per row: m_max over its splits in split order, w_s = exp(m_s - m_safe)
       (stored over m_s), total += w_s l_s in split order, scale = 1 / total (or 0);
    3. every thread takes :data:`MERGE_ITEMS` output float4s at a time, loads their partials
       of up to :data:`MERGE_LOADS` splits each at once (no load waits on another), then adds
       y += w_s x_s in split order and writes y * scale.

    Each row takes its own splits with keys (:func:`splits_with_keys`), as the merge kernel
    does.  Rows go in groups of as many as ``smem_floats`` holds (:func:`merge_smem_floats`;
    all of a tile's at the engine's split counts; the plan keeps the merge kernel where not
    even one row fits)."""
    DV4 = r // 4
    P, U = MERGE_ITEMS, MERGE_LOADS
    PU4, P4 = P * U * 4, P * 4            # local arrays' sizes must be constants

    def merge(smem, part_o, part_ml, out, b, row0, n_rows, prefix, n, heads, chunk, tid):
        splits = cuda.gridDim.y
        tile = row0 // rows
        running = splits_with_keys(request_keys(prefix, n, causal, row0 + rows - 1, heads),
                                   chunk, splits)
        cuda.threadfence()      # every thread's partials reach L2 (fenced) ...
        cuda.syncthreads()      # ... before thread 0 counts the block
        last = 0
        if tid == 0:
            arrived = cuda.atomic.add(part_ml, (b, splits, tile, 0), ONE)
            last = int32(arrived == running - 1)
        if cuda.syncthreads_or(last):   # every other split's partials are in L2
            cuda.threadfence()
            # shared layout for a group of g rows: w (first m) [g][running], l [g][running],
            # scale [g], splits with keys [g] (exact small integers as floats); the tile's
            # rows have at most running splits with keys each
            group = min(rows, smem_floats // (2 * running + 2))
            l_at = group * running
            scale_at = 2 * group * running
            sp_at = scale_at + group
            x = cuda.local.array(PU4, float32)
            y = cuda.local.array(P4, float32)
            sp = cuda.local.array(P, int32)
            for g0 in range(row0, row0 + rows, group):
                if g0 > row0:
                    cuda.syncthreads()  # the previous group's readers are done
                # 1. the (max, sum) pairs of the group's rows, all loads independent
                for i in range(tid, group * running, threads):
                    row, s = g0 + i // running, i % running
                    if row < n_rows and row < row0 + rows:
                        if s < splits_with_keys(request_keys(prefix, n, causal, row, heads),
                                                chunk, splits):
                            smem[i] = load_l2_f32(part_ml, (b, s, row, 0))
                            smem[l_at + i] = load_l2_f32(part_ml, (b, s, row, 1))
                cuda.syncthreads()
                # 2. per row: the weights, the total and the scale (split_merge's order)
                for k in range(tid, group, threads):
                    row_sp = 0
                    if g0 + k < n_rows and g0 + k < row0 + rows:
                        row_sp = splits_with_keys(request_keys(prefix, n, causal, g0 + k,
                                                               heads), chunk, splits)
                    smem[sp_at + k] = float32(row_sp)
                    at = k * running
                    m_max = NEG_INF
                    for s in range(row_sp):
                        m_max = max(m_max, smem[at + s])
                    m_safe = m_max if m_max > NEG_INF else ZERO
                    total = ZERO
                    for s in range(row_sp):
                        w = math.exp(smem[at + s] - m_safe)
                        smem[at + s] = w
                        total += w * smem[l_at + at + s]
                    smem[scale_at + k] = ONE / total if total > ZERO else ZERO
                cuda.syncthreads()
                # 3. the outputs: float4s i + p threads (p < P) of the group's, at a time
                items = min(group, row0 + rows - g0) * DV4
                for i in range(tid, items, P * threads):
                    most = 0
                    for p in range(P):
                        sp[p] = 0
                        if i + p * threads < items:
                            sp[p] = int32(smem[sp_at + (i + p * threads) // DV4])
                        most = max(most, sp[p])
                        y[4 * p] = y[4 * p + 1] = y[4 * p + 2] = y[4 * p + 3] = ZERO
                    for s0 in range(0, most, U):
                        for p in range(P):      # all loads first: none waits on another
                            k, q = (i + p * threads) // DV4, (i + p * threads) % DV4
                            for u in range(U):
                                if s0 + u < sp[p]:
                                    o = 4 * (U * p + u)
                                    x[o], x[o + 1], x[o + 2], x[o + 3] = load_l2_f32x4(
                                        part_o, (b, s0 + u, g0 + k, 4 * q))
                        for p in range(P):      # then the sums, in split order
                            k = (i + p * threads) // DV4
                            for u in range(U):
                                if s0 + u < sp[p]:
                                    w = smem[k * running + s0 + u]
                                    o = 4 * (U * p + u)
                                    y[4 * p] += w * x[o]
                                    y[4 * p + 1] += w * x[o + 1]
                                    y[4 * p + 2] += w * x[o + 2]
                                    y[4 * p + 3] += w * x[o + 3]
                    for p in range(P):
                        if sp[p] > 0:
                            k, q = (i + p * threads) // DV4, (i + p * threads) % DV4
                            scale = smem[scale_at + k]
                            store_f32x4(out, (b, g0 + k, 4 * q), y[4 * p] * scale,
                                        y[4 * p + 1] * scale, y[4 * p + 2] * scale,
                                        y[4 * p + 3] * scale)
            if tid == 0:
                part_ml[b, splits, tile, 0] = ZERO
    # device_function under the simulator for the reason of block_keys' comment
    return device_function(merge) if SIMULATOR else inline_device_function(merge)

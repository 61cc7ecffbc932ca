"""DDTree top-K on the GPU: ``topk_logprobs`` (the k best tokens of each row and their log
probabilities), its launch configuration ``topk_config``, and the two kernels behind it (one
block per row or row part, and the merge of the parts).

Reference twin and contract: reference/ddtree/topk.py (ids exact, lp within LP_ATOL/LP_RTOL).
The algorithm and why it was chosen: docs/DDTREE.md, "topk_logprobs".  Host plumbing shared
with the other DDTree kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, device_function, SIMULATOR

import functools
import math

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import (INT32_MAX, NEG_INF32, any_on_device, device_view,
                                        outputs, pow2_at_least, to_host)
from kdtree_numba.gpu.memory import device_address, load_global_invariant_f32x4
from kdtree_numba.gpu.reduce import stage_barrier
from kdtree_numba.gpu.warp import (WARP, ballot, shfl_idx, shfl_xor, syncwarp, warp_any,
                                   warp_max_f32, warp_sum_f64)
from reference.ddtree.checks import check_topk_args

__all__ = ["topk_logprobs", "topk_config", "MAX_GPU_TOPK", "TOPK_SHARED_BYTES",
           "TOPK_MERGE_THREADS"]

MAX_GPU_TOPK = 2048     # top-K keeps per-warp lists of k (logit, id) pairs in shared memory


# ----------------------------------------------------------------------------- sort helpers

@device_function
def _before(x1, i1, x2, i2):
    """(logit, id) order of top-K: larger logit first, then smaller id (a strict total order)."""
    return x1 > x2 or (x1 == x2 and i1 < i2)


@device_function
def _pair(p, shift):
    """Lower index of compare-exchange pair ``p`` at stride ``1 << shift`` in a bitonic net."""
    return ((p >> shift) << (shift + 1)) + (p & ((1 << shift) - 1))


@device_function
def _log2(n):
    shift = 0
    while (1 << shift) < n:
        shift += 1
    return shift


@device_function
def _swap(sx, si, a, b):
    x = sx[a]
    i = si[a]
    sx[a] = sx[b]
    si[a] = si[b]
    sx[b] = x
    si[b] = i


# ----------------------------------------------------------------------------- top-K
# docs/DDTREE.md, "topk_logprobs", has the design and why.  In short: a row (or a part of it,
# ``parts`` blocks per row) is streamed once with 16-byte loads by independent warps; each lane
# keeps an online logsumexp; an element is a candidate only if it can still be in the top k
# (x >= a block threshold shared in shared memory, and better than the warp's own k-th best);
# candidates are staged per warp and merged WARP at a time into the warp's sorted list in shared
# memory; at the end the block merges its warps' lists.  With parts > 1 a second kernel merges
# the parts of each row.  Lists hold (logit, id) pairs, best first; padding is (-inf, INT32_MAX).

@device_function
def _warp_sort_desc(x, i, lane):
    """Bitonic sort of one (x, i) pair per lane across the warp, best pair in lane 0."""
    size = 2
    while size <= WARP:
        stride = size // 2
        while stride > 0:
            ox = shfl_xor(x, stride)
            oi = shfl_xor(i, stride)
            keep_better = ((lane & stride) == 0) == ((lane & size) == 0)
            if _before(ox, oi, x, i) == keep_better:
                x = ox
                i = oi
            stride //= 2
        size *= 2
    return x, i


@device_function
def _count_at_most(r, i):
    """Number of lanes whose (nondecreasing across lanes) ``r`` is <= this lane's ``i``."""
    count = 0
    step = WARP
    while step > 0:
        probe = shfl_idx(r, min(count + step, WARP) - 1)
        if count + step <= WARP and probe <= i:
            count += step
        step //= 2
    return count


@device_function
def _warp_merge(lx, li, base, kl, n_real, sx, si, sbase, n_valid, k, lane):
    """Merge the first ``n_valid`` (<= WARP) staged pairs into this warp's sorted list
    lx/li[base : base + kl] holding ``n_real`` real pairs; keeps the best kl.
    Returns (k-th best x, its id, new n_real).

    The staged pairs are sorted across the warp (pair j in lane j); r_j = the number of list
    pairs better than pair j (binary search) is nondecreasing in j.  So pair j lands at j + r_j,
    and list pair i (i >= r_0) moves up by #{j : r_j <= i}: distinct, increasing destinations.
    List chunks are moved from the top down (every destination is >= its source), each chunk
    read before it is written; the staged pairs are written last.
    """
    bx = NEG_INF32
    bi = INT32_MAX
    if lane < n_valid:
        bx = sx[sbase + lane]
        bi = si[sbase + lane]
    bx, bi = _warp_sort_desc(bx, bi, lane)
    lo = 0
    hi = n_real
    while lo < hi:
        mid = (lo + hi) >> 1
        if _before(lx[base + mid], li[base + mid], bx, bi):
            lo = mid + 1
        else:
            hi = mid
    r = lo
    r0 = shfl_idx(r, 0)
    chunk = (n_real - 1) // WARP       # -1 for an empty list: no chunk moves
    while chunk >= 0 and chunk >= r0 // WARP:
        i = chunk * WARP + lane
        ax = lx[base + i]
        ai = li[base + i]
        up = _count_at_most(r, i)
        syncwarp()
        if r0 <= i < n_real and i + up < kl:
            lx[base + i + up] = ax
            li[base + i + up] = ai
        syncwarp()
        chunk -= 1
    if lane < n_valid and lane + r < kl:
        lx[base + lane + r] = bx
        li[base + lane + r] = bi
    syncwarp()
    return lx[base + k - 1], li[base + k - 1], min(kl, n_real + n_valid)


@device_function
def _block_sort_desc(lx, li, n, t, threads):
    """Bitonic sort (best first) of lx/li[0:n], n a power of two, by the whole block."""
    size = 2
    while size <= n:
        shift = _log2(size) - 1
        while shift >= 0:
            stride = 1 << shift
            for p in range(t, n // 2, threads):
                lo = _pair(p, shift)
                if _before(lx[lo + stride], li[lo + stride], lx[lo], li[lo]) == ((lo & size) == 0):
                    _swap(lx, li, lo, lo + stride)
            stage_barrier(stride, stride // 2 if stride > 1 else (size if size < n else 0))
            shift -= 1
        size *= 2


@device_function
def _merge_lists(lx, li, n_lists, kl, t, threads):
    """Merge n_lists (a power of two) sorted lists lx/li[j*kl : (j+1)*kl] pairwise into the
    best kl, sorted, in list 0.  A pair (A, B): A_i = better(A_i, B_{kl-1-i}) holds the best kl
    of both as a bitonic sequence; a bitonic merge sorts it.  Ends with a block barrier."""
    half_kl = kl // 2
    log_kl = _log2(kl)
    step = 1
    while step < n_lists:
        n_pairs = n_lists // (2 * step)
        for idx in range(t, n_pairs * kl, threads):
            g = idx >> log_kl
            i = idx - (g << log_kl)
            a = 2 * step * g * kl + i
            b = (2 * step * g + step) * kl + kl - 1 - i
            if _before(lx[b], li[b], lx[a], li[a]):
                lx[a] = lx[b]
                li[a] = li[b]
        cuda.syncthreads()
        shift = log_kl - 1
        while shift >= 0:
            stride = 1 << shift
            for idx in range(t, n_pairs * half_kl, threads):
                g = idx >> (log_kl - 1)
                lo = 2 * step * g * kl + _pair(idx - (g << (log_kl - 1)), shift)
                if _before(lx[lo + stride], li[lo + stride], lx[lo], li[lo]):
                    _swap(lx, li, lo, lo + stride)
            cuda.syncthreads()
            shift -= 1
        step *= 2
    cuda.syncthreads()


@device_function
def _raise_threshold(lx, li, base, k, table, w, points, lane):
    """After warp w's list changed: publish its (ceil((j+1)k/points))-th best x at table[w *
    points + j], then return the points-th largest of the whole table (one value per lane).
    That is a valid block threshold: if m_v entries of warp v's row are >= it, warp v holds at
    least m_v * k / points elements >= it (lists only improve, so stale rows of other warps,
    read while they change, understate), and the entries >= it number >= points in all.
    It is the k-th best of the warps' union up to the rounding to k / points."""
    if lane < points:
        table[w * points + lane] = lx[base + ((lane + 1) * k + points - 1) // points - 1]
    syncwarp()
    value, _ = _warp_sort_desc(table[lane], lane, lane)
    return shfl_idx(value, points - 1)


@device_function
def _fold_warps(red, value, w, lane, warps, take_max):
    """The max (``take_max``) or the sum of the ``warps`` warps' ``value`` (a warp's lane 0
    speaks for it: a warp reduction came first), through the shared ``red`` (one slot per
    warp), in warp order; every thread gets it.  ``take_max`` is a literal at each call, so
    the branch folds away once the call is inlined (the sm_90 PTX is that of the loop written
    out at each site)."""
    if lane == 0:
        red[w] = value
    cuda.syncthreads()
    result = red[0]
    for v in range(1, warps):
        if take_max:
            result = max(result, red[v])
        else:
            result += red[v]
    return result


def _topk_registers(vec: int, kl: int) -> int:
    """Register cap of the top-K kernel, the smallest that keeps the streaming loop free of
    spills (sm_90 compile): 64 for vec <= 4 and kl <= 64 (4 blocks of 256 threads per SM);
    longer lists need 80 (k >= 128: 3 blocks of 256 threads, or 6 of 128), vec 8 needs 96."""
    if vec > 4:
        return 96
    return 64 if kl <= 64 else 80


def _seed_groups(kl: int, warps: int, per_lane: int) -> int:
    """Group maxima per lane for the threshold seed: about 2k of them per block, each the max
    of per_lane / groups consecutive elements, and no more than the lists' shared memory holds."""
    groups = 1
    while (groups * warps * WARP < 2 * kl and groups < per_lane
           and 2 * groups * WARP <= kl):
        groups *= 2
    return groups


@kernel_factory
def _topk_kernel(warps: int, vec: int, kl: int):
    """Top-k candidates and online logsumexp of one part of one row per block (grid rows x
    parts).  With one part it writes lp/ids; else each block writes its part's best k pairs
    and its (max, sum of exps), which ``_topk_merge_kernel`` combines.  ``aligned`` (rows
    16-byte aligned) enables the 16-byte loads.  Both are run-time arguments, so one compile
    serves every shape.  docs/DDTREE.md has the scheme."""
    threads = warps * WARP
    per_lane = 4 * vec                # elements per lane per iteration
    warp_span = WARP * vec            # float4 groups per warp per iteration
    block_span = warps * warp_span    # float4 groups per block per iteration
    list_size = warps * kl
    stage_cap = 2 * WARP              # a merge happens once WARP are staged; a ballot adds <= WARP
    stage_size = warps * stage_cap
    groups = _seed_groups(kl, warps, per_lane)
    group_len = per_lane // groups
    n_seed = threads * groups         # <= list_size: the seed sort borrows the lists' memory
    points = WARP // warps            # published quantiles per warp list (one table = one warp)

    @kernel(max_registers=_topk_registers(vec, kl))
    def topk_part(logits, k, per_part, aligned, out_x, out_i, part_m, part_s):
        lx = cuda.shared.array(list_size, np.float32)
        li = cuda.shared.array(list_size, np.int32)
        sx = cuda.shared.array(stage_size, np.float32)
        si = cuda.shared.array(stage_size, np.int32)
        theta = cuda.shared.array(1, np.float32)     # block threshold: a k-th best x so far
        table = cuda.shared.array(WARP, np.float32)  # per warp: points quantiles of its list
        red32 = cuda.shared.array(warps, np.float32)
        red64 = cuda.shared.array(warps, np.float64)
        xs = cuda.local.array(per_lane, np.float32)  # constant indices only: registers
        t = cuda.threadIdx.x
        w = t // WARP
        lane = t - w * WARP
        row = cuda.blockIdx.x
        part = cuda.blockIdx.y
        parts = cuda.gridDim.y
        vocab = logits.shape[1]
        n_q = (vocab + 3) // 4        # float4 groups; part p reads [p, p + 1) * per_part of them
        q_lo = min(n_q, part * per_part)
        q_hi = min(n_q, q_lo + per_part)
        e_hi = min(vocab, 4 * q_hi)
        n_it = (q_hi - q_lo + block_span - 1) // block_span
        base = w * kl
        sbase = w * stage_cap
        m = NEG_INF32                 # this lane's exp reference (>= all its elements)
        s = np.float64(0.0)           # sum of exp(x - m) over this lane's elements
        own_x = NEG_INF32             # this warp's k-th best pair (sentinel until k are kept)
        own_i = INT32_MAX
        n_real = 0
        n_stage = 0
        if n_it > 0:
            # Seed, from the first tile (read again below, from L1/L2): the k-th best of n_seed
            # distinct group maxima is a valid threshold (k elements are at least as good), and
            # the best is every lane's exp reference (later rescales are then rare).
            qb = q_lo + w * warp_span + lane
            for g in range(groups):
                gx = NEG_INF32
                gi = INT32_MAX
                for f in range(group_len):
                    e = g * group_len + f
                    j = 4 * (qb + (e >> 2) * WARP) + (e & 3)
                    if j < e_hi:
                        x = logits[row, j]
                        if x > gx:   # the first max wins: ids grow with e within a lane
                            gx = x
                            gi = j
                lx[t * groups + g] = gx
                li[t * groups + g] = gi
            cuda.syncthreads()
            _block_sort_desc(lx, li, n_seed, t, threads)
            seed = lx[k - 1] if k <= n_seed else NEG_INF32
            m = lx[0]
            cuda.syncthreads()
            if t == 0:
                theta[0] = seed
        for idx in range(t, list_size, threads):
            lx[idx] = NEG_INF32
            li[idx] = INT32_MAX
        if t < WARP:
            table[t] = NEG_INF32
        cuda.syncthreads()
        for it in range(n_it):
            qb = q_lo + (it * warps + w) * warp_span + lane
            if aligned and q_lo + (it * warps + w + 1) * warp_span <= q_hi:
                for u in range(vec):
                    x0, x1, x2, x3 = load_global_invariant_f32x4(logits, row, qb + u * WARP)
                    xs[4 * u] = x0
                    xs[4 * u + 1] = x1
                    xs[4 * u + 2] = x2
                    xs[4 * u + 3] = x3
            else:
                for u in range(vec):
                    for c in range(4):
                        j = 4 * (qb + u * WARP) + c
                        xs[4 * u + c] = logits[row, j] if j < e_hi else NEG_INF32
            mx = xs[0]
            for e in range(1, per_lane):
                mx = max(mx, xs[e])
            if mx > m:
                s *= math.exp(np.float64(m) - np.float64(mx))
                m = mx
            # Four float32 accumulators, then a pairwise sum: <= 5 roundings per term at any
            # vec <= 8 (the LP_ATOL derivation in docs/DDTREE.md), not vec + 1.
            acc = cuda.local.array(4, np.float32)   # constant indices only: registers
            for q in range(4):
                acc[q] = np.float32(0.0)
            for u in range(vec):
                acc[u % 4] += ((math.exp(xs[4 * u] - m) + math.exp(xs[4 * u + 1] - m))
                               + (math.exp(xs[4 * u + 2] - m) + math.exp(xs[4 * u + 3] - m)))
            s += np.float64((acc[0] + acc[1]) + (acc[2] + acc[3]))
            theta_x = theta[0]
            bound = max(theta_x, own_x)
            if warp_any(mx >= bound):
                cand = 0
                for e in range(per_lane):
                    if xs[e] >= bound and xs[e] > NEG_INF32:
                        cand |= 1 << e
                # One round stages each lane's next candidate, so the rounds number the most
                # candidates one lane holds (usually 1-2), not the positions any lane holds.
                # xs[e] comes from an unrolled select: a runtime index would put xs in local
                # memory (as would an ``if f == e: x = xs[f]`` loop, which LLVM turns back into
                # xs[e]), and re-reading the logits was a dependent L2 load per position (a
                # third of the kernel's time went to the candidate path).
                while warp_any(cand != 0):
                    x = NEG_INF32
                    j = 0
                    take = False
                    if cand != 0:
                        low = cand & -cand
                        cand ^= low
                        e = cuda.popc(low - 1)
                        for f in range(per_lane):   # a max of selects, not xs[e]
                            x = max(x, xs[f] if (low >> f) & 1 else NEG_INF32)
                        j = 4 * (qb + (e >> 2) * WARP) + (e & 3)
                        take = x >= theta_x and _before(x, j, own_x, own_i)
                    mask = ballot(take)
                    if mask != 0:
                        if take:
                            slot = sbase + n_stage + cuda.popc(mask & ((1 << lane) - 1))
                            sx[slot] = x
                            si[slot] = j
                        n_stage += cuda.popc(mask)
                        if n_stage >= WARP:
                            syncwarp()
                            own_x, own_i, n_real = _warp_merge(lx, li, base, kl, n_real, sx, si,
                                                               sbase, WARP, k, lane)
                            n_stage -= WARP
                            if lane < n_stage:
                                sx[sbase + lane] = sx[sbase + WARP + lane]
                                si[sbase + lane] = si[sbase + WARP + lane]
                            raised = _raise_threshold(lx, li, base, k, table, w, points, lane)
                            if lane == 0 and raised > theta[0]:
                                cuda.atomic.max(theta, 0, raised)
                            theta_x = theta[0]
        if n_stage > 0:
            syncwarp()
            own_x, own_i, n_real = _warp_merge(lx, li, base, kl, n_real, sx, si, sbase, n_stage,
                                               k, lane)
        cuda.syncthreads()
        _merge_lists(lx, li, warps, kl, t, threads)
        big = _fold_warps(red32, warp_max_f32(m), w, lane, warps, True)
        mine = np.float64(0.0)
        if m > NEG_INF32:
            mine = s * math.exp(np.float64(m) - np.float64(big))
        total = _fold_warps(red64, warp_sum_f64(mine), w, lane, warps, False)
        if parts == 1:
            lse = np.float64(big) + math.log(total)
            for i in range(t, k, threads):
                out_x[row, i] = np.float32(np.float64(lx[i]) - lse)
                out_i[row, i] = li[i]
        else:
            slot = row * parts + part
            for i in range(t, k, threads):
                out_x[slot, i] = lx[i]
                out_i[slot, i] = li[i]
            if t == 0:
                part_m[slot] = big
                part_s[slot] = total

    return topk_part


@kernel_factory
def _topk_merge_kernel(parts: int, kl: int, threads: int):
    """One block per row: merge the rows' ``parts`` sorted candidate lists, combine their
    (max, sum of exps) into the logsumexp, write lp and ids."""
    size = parts * kl

    @kernel
    def topk_merge(cand_x, cand_i, part_m, part_s, k, lp_out, ids_out):
        lx = cuda.shared.array(size, np.float32)
        li = cuda.shared.array(size, np.int32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        for idx in range(t, size, threads):
            p = idx // kl
            i = idx - p * kl
            if i < k:
                lx[idx] = cand_x[row * parts + p, i]
                li[idx] = cand_i[row * parts + p, i]
            else:
                lx[idx] = NEG_INF32
                li[idx] = INT32_MAX
        cuda.syncthreads()
        _merge_lists(lx, li, parts, kl, t, threads)
        big = part_m[row * parts]
        for p in range(1, parts):
            big = max(big, part_m[row * parts + p])
        total = np.float64(0.0)
        for p in range(parts):     # every thread sums in the same order: one lse per row
            mp = part_m[row * parts + p]
            if mp > NEG_INF32:
                total += part_s[row * parts + p] * math.exp(np.float64(mp) - np.float64(big))
        lse = np.float64(big) + math.log(total)
        for i in range(t, k, threads):
            lp_out[row, i] = np.float32(np.float64(lx[i]) - lse)
            ids_out[row, i] = li[i]

    return topk_merge


TOPK_SHARED_BYTES = 40 * 1024   # per block, of the 48 KB of static shared memory
TOPK_MERGE_THREADS = 8 if SIMULATOR else 256


@functools.cache
def _multiprocessors() -> int:
    return 2 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _topk_shared_bytes(warps: int, kl: int) -> int:
    return warps * (kl + 2 * WARP) * 8 + warps * 12 + 4


def topk_config(k: int, rows: int = 1, vocab: int = 1, warps=None, vec=None,
                parts=None) -> tuple[int, int, int, int]:
    """(warps, vec, kl, parts) for ``topk_logprobs``: ``warps`` per block, ``vec`` float4
    groups per lane per iteration (4 * vec elements in flight per lane), kl = list length (k
    rounded up to a power of two, at least a warp), ``parts`` blocks per row (a power of two; >
    1 adds a merge kernel).  Defaults: the fastest measured shape; parts grows until the grid
    has ~4 blocks per multiprocessor, while each part keeps >= 4 tiles (a block's seed and final
    merge cost about a tile each)."""
    kl = max(WARP, pow2_at_least(k))
    # At bs 64 x L 15 x V 163,840, k = 64, 2 warps of 8 float4 groups per lane beat 4 warps of
    # 4 groups (and 8 of 4, 1 of 8): with short lists, fewer warps to merge and more loads in
    # flight per lane win.  Longer lists keep 4 warps of 4 (their merges dominate).
    short = kl <= 64 and not SIMULATOR
    if warps is None:
        warps = 2 if SIMULATOR or short else 4
        while warps > 1 and _topk_shared_bytes(warps, kl) > TOPK_SHARED_BYTES:
            warps //= 2
    if vec is None:
        vec = 8 if short else 4
    max_parts = max(1, TOPK_SHARED_BYTES // (8 * kl))
    if parts is None:
        parts = 1
        tile = 4 * warps * WARP * vec
        while (rows * parts < 4 * _multiprocessors() and 2 * parts <= max_parts
               and vocab >= 2 * parts * 4 * tile):
            parts *= 2
    if (warps & (warps - 1) or not 1 <= warps <= WARP or warps * WARP > 1024
            or vec not in (1, 2, 4, 8)
            or parts & (parts - 1) or not 1 <= parts <= max_parts
            or _topk_shared_bytes(warps, kl) > TOPK_SHARED_BYTES):
        raise ValueError(f"bad top-K config warps={warps} vec={vec} parts={parts} for k={k}: "
                         f"powers of two, warps <= {WARP} and warps * {WARP} <= 1024, "
                         f"vec in 1/2/4/8, parts <= {max_parts}, lists within "
                         f"{TOPK_SHARED_BYTES} bytes")
    return warps, vec, kl, parts


_SCRATCH: dict = {}


def _scratch(name: str, shape, dtype, stream):
    """A device array cached per (name, shape, dtype): allocated on first use, then reused, so
    calls after the first allocate nothing (CUDA-graph capture).  Calls that share a shape
    share it: serialise them (one stream), as a decode loop does."""
    key = (name, tuple(shape), np.dtype(dtype).str)
    if key not in _SCRATCH:
        _SCRATCH[key] = compat.device_empty(shape, dtype, stream)
    return _SCRATCH[key]


def _launch_topk(rows, k, lp, ids, config, stream) -> None:
    """rows [R, V] float32, lp/ids [R, k] device arrays."""
    warps, vec, kl, parts = config
    n_rows, vocab = (int(s) for s in rows.shape)
    aligned = vocab % 4 == 0 and device_address(rows) % 16 == 0
    part_kernel = _topk_kernel(warps, vec, kl)
    grid = (n_rows, parts)
    per_part = ((vocab + 3) // 4 + parts - 1) // parts   # on the host: no division in the kernel
    if parts == 1:
        dummy_m = _scratch("topk_m", (1,), np.float32, stream)
        dummy_s = _scratch("topk_s", (1,), np.float64, stream)
        part_kernel[grid, warps * WARP, stream](rows, k, per_part, aligned, lp, ids, dummy_m,
                                                dummy_s)
        return
    cand_x = _scratch("topk_cx", (n_rows * parts, k), np.float32, stream)
    cand_i = _scratch("topk_ci", (n_rows * parts, k), np.int32, stream)
    part_m = _scratch("topk_m", (n_rows * parts,), np.float32, stream)
    part_s = _scratch("topk_s", (n_rows * parts,), np.float64, stream)
    part_kernel[grid, warps * WARP, stream](rows, k, per_part, aligned, cand_x, cand_i, part_m,
                                            part_s)
    _topk_merge_kernel(parts, kl, TOPK_MERGE_THREADS)[n_rows, TOPK_MERGE_THREADS, stream](
        cand_x, cand_i, part_m, part_s, k, lp, ids)


def topk_logprobs(logits, k: int, *, stream=0, out=None, warps=None, vec=None, parts=None):
    """GPU twin of ``reference.ddtree.topk_logprobs``.  Logits must be finite (checked only for
    NumPy input).  ids equal the reference exactly; lp within LP_ATOL + LP_RTOL*|lp|.
    k <= MAX_GPU_TOPK.  ``out``: optional (lp, ids) device arrays, C-contiguous.
    ``warps/vec/parts``: see ``topk_config``.  With parts > 1 (the default for small batches)
    the per-part candidates live in a scratch buffer cached per shape (see ``_scratch``)."""
    bs, n_rows, vocab, k = check_topk_args(logits, k)
    if k > MAX_GPU_TOPK:
        raise ValueError(f"k = {k} > {MAX_GPU_TOPK}: the GPU top-K keeps its candidates in "
                         f"shared memory; use reference.ddtree.topk_logprobs")
    if not any_on_device(logits) and not np.isfinite(logits).all():
        raise ValueError("logits must be finite")
    host = not any_on_device(logits) and out is None
    compat.require_kernels()
    config = topk_config(k, bs * n_rows, vocab, warps, vec, parts)
    rows = device_view(logits, stream).reshape(bs * n_rows, vocab)
    lp, ids = outputs(out, [("lp", (bs, n_rows, k), np.float32),
                            ("ids", (bs, n_rows, k), np.int32)], stream)
    _launch_topk(rows, k, lp.reshape(bs * n_rows, k), ids.reshape(bs * n_rows, k), config,
                 stream)
    return to_host((lp, ids), stream) if host else (lp, ids)

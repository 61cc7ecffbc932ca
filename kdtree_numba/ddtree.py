"""DDTree kernels on the GPU with numba.cuda.  The contract is ``reference.ddtree``'s docstring.

Same function names and results as the reference (bit-identical except ``topk_logprobs``'s lp,
within ``reference.ddtree.LP_ATOL/LP_RTOL``, and the measure-zero CDF-boundary case of
``sample_targets``).  The GPU algorithms and why they were chosen: docs/DDTREE.md.

Arrays in and out:
* Inputs may be NumPy, CuPy or numba device arrays.  If any input is on the device, every result
  is a numba device array (``cupy.asarray(x)`` wraps one without a copy), nothing is copied to
  the host and nothing synchronises: launches are queued on ``stream`` (CuPy inputs are wrapped
  without numba's import-time stream sync, so queue on the stream that produced them, or on the
  default stream).
* If every input is NumPy, inputs are copied to the device and results come back as NumPy
  (that copy synchronises).  ``compact_kv`` on NumPy caches copies them back in place.
* Shapes and dtypes are checked on the host from array metadata (no device read).  Values
  (finite logits, sorted lp, in-range uniforms, cache capacity) are checked only for NumPy
  inputs; on device inputs they are the caller's promise (see each function).
"""
from kdtree_numba.compat import cuda, kernel, device_function, to_device, SIMULATOR

import functools
import math

import numpy as np

from kdtree_numba import compat
from kdtree_numba.gpu.bits import f64_bits
from kdtree_numba.gpu.memory import device_address, load_global_invariant_f32x4
from kdtree_numba.gpu.reduce import block_max_f32, stage_barrier
from kdtree_numba.gpu.warp import (WARP, ballot, ballot2, redux_max2, shfl_idx, shfl_idx_pairs,
                                   shfl_xor, shfl_xor4, syncwarp, warp_any, warp_max_f32,
                                   warp_sum_f64)
from reference import ddtree as ref
from reference.ddtree import DraftTree, VerifyInput

__all__ = ["DraftTree", "VerifyInput", "topk_logprobs", "build_tree", "compile_tree",
           "accept_greedy", "sample_targets", "accept_sampled", "compact_kv",
           "MAX_GPU_BUDGET", "MAX_GPU_TOPK", "MIN_THREADS"]

NEG_INF32 = np.float32(-np.inf)
NEG_INF64 = np.float64(-np.inf)
INT32_MAX = np.int32(2 ** 31 - 1)
MAX_GPU_BUDGET = 1024   # the builder keeps its <= B+1 candidates in static shared memory
MAX_GPU_TOPK = 2048     # top-K keeps per-warp lists of k (logit, id) pairs in shared memory
# Blocks of at least one full warp on the GPU (warp barriers need every lane); the simulator,
# where warp barriers are block barriers, also runs 1-16 threads so its tests stay fast.
MIN_THREADS = 1 if SIMULATOR else 32


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- host plumbing

def _any_on_device(*arrays) -> bool:
    return any(compat.is_device_array(a) for a in arrays if a is not None)


def _dev(x, stream):
    """A numba device view of x; CuPy arrays are wrapped without a host sync (compat.to_device)."""
    return to_device(x, stream=stream)


def _to_host(results, stream):
    return tuple(r.copy_to_host(stream=stream) for r in results)


def _outputs(out, specs, stream) -> list:
    """Device arrays for ``specs`` [(name, shape, dtype)]: freshly allocated, or the caller's
    ``out`` (a sequence of device arrays, checked against the specs on the host).  Passing
    ``out`` makes a call allocation-free, so it can sit inside a captured CUDA graph."""
    if out is None:
        return [cuda.device_array(shape, dtype=dtype, stream=stream) for _, shape, dtype in specs]
    out = list(out)
    if len(out) != len(specs):
        raise ValueError(f"out must hold {len(specs)} arrays, got {len(out)}")
    arrays = []
    for array, (name, shape, dtype) in zip(out, specs):
        if not compat.is_device_array(array):
            raise TypeError(f"out {name} must be a device array")
        ref.check_array(f"out {name}", array, len(shape), dtype=dtype)
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"out {name} must be {tuple(shape)}, got {tuple(array.shape)}")
        arrays.append(_dev(array, stream))
    return arrays


TREE_FIELDS = ("n_nodes", "token", "parent", "depth", "rank", "score")


def _tree_on_device(tree: DraftTree, stream) -> DraftTree:
    fields = {f: _dev(getattr(tree, f), stream) for f in TREE_FIELDS}
    return DraftTree(max_depth=tree.max_depth, **fields)


def _tree_is_on_device(tree: DraftTree) -> bool:
    return _any_on_device(tree.n_nodes, tree.token, tree.parent, tree.depth, tree.rank,
                          tree.score)


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


@functools.cache
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
                # xs[e]), and re-reading the logits was a dependent L2 load per position (the
                # candidate path then took 37% of the kernel's time on the H200).
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
        big = warp_max_f32(m)
        if lane == 0:
            red32[w] = big
        cuda.syncthreads()
        big = red32[0]
        for v in range(1, warps):
            big = max(big, red32[v])
        mine = np.float64(0.0)
        if m > NEG_INF32:
            mine = s * math.exp(np.float64(m) - np.float64(big))
        mine = warp_sum_f64(mine)
        if lane == 0:
            red64[w] = mine
        cuda.syncthreads()
        total = red64[0]
        for v in range(1, warps):
            total += red64[v]
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


@functools.cache
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
    groups per lane per iteration (4 * vec elements in flight per lane), kl = list length
    (k rounded up to a power of two, at least a warp), ``parts`` blocks per row (a power of
    two; > 1 adds a merge kernel).  Defaults: the H200 choice; parts grows until the grid has
    ~4 blocks per multiprocessor, while each part keeps >= 4 tiles (a block's seed and final
    merge cost about a tile each)."""
    kl = max(WARP, _pow2_at_least(k))
    # H200 (bs 64 x L 15 x V 163,840, k = 64, docs/GPU_RESULTS.md runs 22-24): 2 warps of 8
    # float4 groups per lane 242-243 us, 4 warps of 4 groups 253-254 us (8 warps of 4: 288 us,
    # 1 of 8: 336 us): with short lists, fewer warps to merge and more loads in flight per lane
    # win.  Longer lists keep 4 warps of 4 (their merges dominate; not re-measured).
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
        _SCRATCH[key] = cuda.device_array(shape, dtype=dtype, stream=stream)
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
    bs, n_rows, vocab, k = ref.check_topk_args(logits, k)
    if k > MAX_GPU_TOPK:
        raise ValueError(f"k = {k} > {MAX_GPU_TOPK}: the GPU top-K keeps its candidates in "
                         f"shared memory; use reference.ddtree.topk_logprobs")
    if not _any_on_device(logits) and not np.isfinite(logits).all():
        raise ValueError("logits must be finite")
    host = not _any_on_device(logits) and out is None
    compat.require_kernels()
    config = topk_config(k, bs * n_rows, vocab, warps, vec, parts)
    rows = _dev(logits, stream).reshape(bs * n_rows, vocab)
    lp, ids = _outputs(out, [("lp", (bs, n_rows, k), np.float32),
                             ("ids", (bs, n_rows, k), np.int32)], stream)
    _launch_topk(rows, k, lp.reshape(bs * n_rows, k), ids.reshape(bs * n_rows, k), config,
                 stream)
    return _to_host((lp, ids), stream) if host else (lp, ids)


# ----------------------------------------------------------------------------- tree builder
# docs/DDTREE.md, "build_tree", has the design and why.  One block per request; warp 0 runs the
# contract's pop loop over a frontier of candidates spread across its lanes (a warp arg-best per
# pop instead of a serial heap), with float64 scores and ties broken by rank path; all threads
# fill the lp cache before and write the tree after.  A candidate is (score, key): the key packs
# its frontier slot, its parent node, its rank and its depth:
# slot << 48 | parent << 32 | rank << 16 | depth (slot < 2**15, parent, rank, depth < 2**16).

LP_CACHE = 2048   # float32 lp values per request cached in shared memory (8 KB)
_KEY_NOT_SLOT = np.int64(0xFFFFFFFFFFFF)   # mask of a key's bits but its slot


@device_function
def _pack(slot, parent, rank, depth):
    return ((np.int64(slot) << 48) | (np.int64(parent) << 32) | (np.int64(rank) << 16)
            | np.int64(depth))


@device_function
def _path_before(ia, ib, n_parent, n_rank):
    """Candidate ia's rank path is lexicographically smaller than ib's.  A candidate is child
    ``rank`` of popped node ``parent``; live candidates never prefix one another (a prefix
    would have been popped, and is not a live candidate), so walking the deeper one up to the
    other's depth, then both to their lowest common ancestor, the ranks just below it decide.
    One loop (not three): every comparison site inlines this, so it is kept small."""
    pa = np.int32((ia >> 32) & 0xFFFF)
    ra = np.int32((ia >> 16) & 0xFFFF)
    da = np.int32(ia & 0xFFFF)
    pb = np.int32((ib >> 32) & 0xFFFF)
    rb = np.int32((ib >> 16) & 0xFFFF)
    db = np.int32(ib & 0xFFFF)
    while pa != pb or da != db:
        if da >= db:
            ra = np.int32(n_rank[pa])
            pa = np.int32(n_parent[pa])
            da -= 1
        if db > da:
            rb = np.int32(n_rank[pb])
            pb = np.int32(n_parent[pb])
            db -= 1
    return ra < rb


@device_function
def _better(sa, ia, sb, ib, n_parent, n_rank):
    """Whichever of candidates a and b pops first: the higher score, then the smaller rank
    path; a if they are one candidate.  -inf marks an empty slot and never wins (scores are
    finite).  The common case is two compares and a select; only a finite tie walks."""
    take = sb > sa
    if sb == sa and sb != NEG_INF64:
        take = _path_before(ib, ia, n_parent, n_rank)
    if take:
        return sb, ib
    return sa, ia


_MIN_INT64 = np.int64(-2 ** 63)
_NEG_INF_HIGH = np.uint32(0x000FFFFF)   # the order halves of -inf (see _order_halves)
_NEG_INF_LOW = np.uint32(0xFFFFFFFF)


@device_function
def _order_halves(x):
    """(high, low) 32-bit halves of a 64-bit unsigned key in x's order (float64, finite or -inf;
    -0.0 is made +0.0 first, as float compares equate them): a non-negative float's bits with
    the sign bit set, a negative one's bits flipped."""
    b = f64_bits(x + 0.0)
    u = ~b if b < 0 else b ^ _MIN_INT64
    return np.uint32((u >> 32) & 0xFFFFFFFF), np.uint32(u & 0xFFFFFFFF)


@device_function
def _warp_best2(sa, ia, sc, ic, lanes, n_parent, n_rank):
    """Two warp arg-bests at once over the first ``lanes`` lanes, which all call it: every lane
    ends with the best of all lanes' a and the best of all lanes' c, in ``_better``'s order.

    The scores' order keys go through two ``redux.sync`` maxima each (high half, then the low
    half among the lanes that hold the high maximum), one ballot names the winning lane and a
    shuffle brings its pair: about six dependent warp instructions, the two chains interleaved,
    against five dependent butterfly rounds.  Equal finite scores in two lanes (the rank paths
    decide) fall back to the butterfly over the tied lanes; all -inf (no candidate) needs no
    decision."""
    ha, la = _order_halves(sa)
    hc, lc = _order_halves(sc)
    top_ha, top_hc = redux_max2(ha, hc)
    top_la, top_lc = redux_max2(la if ha == top_ha else np.uint32(0),
                                 lc if hc == top_hc else np.uint32(0))
    best_a = ha == top_ha and la == top_la
    best_c = hc == top_hc and lc == top_lc
    win_a, win_c = ballot2(best_a, best_c)
    tie_a = (win_a & (win_a - 1)) != 0 and not (top_ha == _NEG_INF_HIGH
                                                 and top_la == _NEG_INF_LOW)
    tie_c = (win_c & (win_c - 1)) != 0 and not (top_hc == _NEG_INF_HIGH
                                                 and top_lc == _NEG_INF_LOW)
    if tie_a or tie_c:                  # warp-uniform: the ballots are
        return _butterfly_best2(sa if best_a else NEG_INF64, ia, sc if best_c else NEG_INF64,
                                ic, lanes, n_parent, n_rank)
    src_a = cuda.popc((win_a & -win_a) - 1)
    src_c = cuda.popc((win_c & -win_c) - 1)
    return shfl_idx_pairs(sa, ia, src_a, sc, ic, src_c)


@device_function
def _butterfly_best2(sa, ia, sc, ic, lanes, n_parent, n_rank):
    """``_warp_best2`` by butterflies (the tie fallback): every lane ends with the best of all
    lanes' a and the best of all lanes' c (the order of ``_better``, strict and total on live
    candidates, so every lane agrees).  A round issues its eight 32-bit shuffles back to back,
    then both score compares, then one branch into the tie walks (taken only on equal finite
    scores); the walks read shared memory only, after the shuffles, never around them."""
    offset = lanes // 2
    while offset > 0:
        osa, oia, osc, oic = shfl_xor4(sa, ia, sc, ic, offset)
        take_a = osa > sa
        take_c = osc > sc
        tie_a = osa == sa and sa != NEG_INF64
        tie_c = osc == sc and sc != NEG_INF64
        if tie_a or tie_c:
            if tie_a:
                take_a = _path_before(oia, ia, n_parent, n_rank)
            if tie_c:
                take_c = _path_before(oic, ic, n_parent, n_rank)
        if take_a:
            sa = osa
            ia = oia
        if take_c:
            sc = osc
            ic = oic
        offset >>= 1
    return sa, ia, sc, ic


@device_function
def _lp_three(lp, lp_c, cols, shift, b, dep, rk):
    """(lp[dep-1][rk], lp[dep-1][rk+1], lp[dep][0]) for a node at depth dep and rank rk, from
    the shared cache (row d at d << shift, its first ``cols`` columns): three independent loads
    (clamped in bounds; a value past a row's cached columns or past the last row is not used),
    and the rare ranks past the cached columns from global memory."""
    k = lp.shape[2]
    at = ((dep - 1) << shift) + rk
    # Unsigned indices: numba adds a negative-index wrap-around (3 instructions) to a signed
    # one, on the pop's critical path here.
    here = lp_c[np.uint32(min(at, LP_CACHE - 1))]
    nxt = lp_c[np.uint32(min(at + 1, LP_CACHE - 1))]
    kid = lp_c[np.uint32(min(dep << shift, LP_CACHE - 1))]
    if rk + 1 >= cols:
        if rk >= cols:
            here = lp[b, dep - 1, rk]
        if rk + 1 < k:
            nxt = lp[b, dep - 1, rk + 1]
        if cols == 0 and dep < lp.shape[1]:
            kid = lp[b, dep, 0]
    return np.float64(here), np.float64(nxt), np.float64(kid)


@device_function
def _pop_loop(lp, lp_c, cols, shift, b, budget, lane, lanes, per_lane, cand_s, cand_k,
              n_parent, n_rank, n_depth, score):
    """The contract's loop (reference.ddtree._build_one) on lanes 0..lanes-1 of one warp, which
    all call it; returns the number of nodes.

    The frontier: lane l owns slots j * lanes + l, j < per_lane, of cand_s/cand_k, filled
    densely from j = 0 (``mine`` of them; empty slots hold -inf), and keeps the best of them in
    registers (best_s, best_k), except the *stale* lane: the owner of the last popped slot,
    whose best is unknown.  A pop: every lane reads the stale lane's slot j = lane (and
    j + lanes, ... where per_lane > lanes: only in the simulator's narrow warps), then one
    double warp arg-best (``_warp_best2``) gives both the stale lane's best and the best of the
    other lanes' bests; the better of the two is the pop, known to every lane.  So a pop costs
    one warp arg-best and one slot read per lane, whatever the budget (a heap's depth, or a
    lane rescanning its own slots, would grow with it).

    Each pop pushes at most two candidates (the next sibling, the first child), computed by
    every lane with the contract's float64 adds: the better one replaces the popped slot (its
    owner writes it), the other goes to lane ``rr % lanes`` (a rotating counter) at its next
    free slot; with neither, the owner moves its last slot into the hole.  The last pop pushes
    nothing (nothing pops after it).  Bound: lane l holds at most its first candidate (lane 0)
    plus the pushes dealt to it, rr = 1, 2, ..., P with P <= budget - 1 <= bcap - 1; lane 0
    gets 1 + floor(P / lanes), lane l >= 1 gets ceil((P - l + 1) / lanes), both
    <= (bcap - 1) // lanes + 1 = per_lane (32 at bcap = 1024 with 32 lanes: one slot per lane
    to read).  Only lane 0 writes the popped nodes' parent/rank/depth (the tie walks read them)
    and only a slot's owner writes a slot; a warp barrier before the slot writes (other lanes
    read them at the top of the pop) and one after them (for the next pop's reads and walks)."""
    n_rows = lp.shape[1]
    k = lp.shape[2]
    mine = 1 if lane == 0 else 0     # the kernel put the first candidate in slot 0
    best_s = NEG_INF64
    best_k = np.int64(-1)
    stale = 0
    rr = 1
    n = 0
    if lane == 0:
        n_parent[0] = -1
        n_rank[0] = -1
        n_depth[0] = 0
    while n < budget:
        sa = NEG_INF64
        ka = np.int64(-1)
        if lane < per_lane:
            at = np.uint32(lane * lanes + stale)   # unsigned: no wrap-around (_lp_three)
            sa = cand_s[at]
            ka = cand_k[at]
        for j in range(lane + lanes, per_lane, lanes):
            at = j * lanes + stale
            sa, ka = _better(sa, ka, cand_s[at], cand_k[at], n_parent, n_rank)
        sc = best_s if lane != stale else NEG_INF64
        sa, ka, sc, kc = _warp_best2(sa, ka, sc, best_k, lanes, n_parent, n_rank)
        if lane == stale:
            best_s = sa
            best_k = ka
        sg, kg = _better(sc, kc, sa, ka, n_parent, n_rank)
        if sg == NEG_INF64:
            break                      # no candidates left: a tiny vocabulary
        n += 1
        slot = np.int32(kg >> 48)
        par = np.int32((kg >> 32) & 0xFFFF)
        rk = np.int32((kg >> 16) & 0xFFFF)
        dep = np.int32(kg & 0xFFFF)
        stale = slot & (lanes - 1)     # the popped slot's owner
        if lane == 0:
            n_parent[n] = par
            n_rank[n] = rk
            n_depth[n] = dep
            score[b, n] = sg
        target = -1
        y = NEG_INF64
        yk = np.int64(-1)
        if n < budget:
            has_sib = rk + 1 < k
            has_kid = dep < n_rows
            lp_here, lp_next, lp_kid = _lp_three(lp, lp_c, cols, shift, b, dep, rk)
            sib = (sg - lp_here) + lp_next   # next sibling: (score - lp[r]) + lp[r+1], that order
            kid = sg + lp_kid                # first child
            sib_k = _pack(0, par, rk + 1, dep)
            kid_k = _pack(0, n, 0, dep + 1)
            # On equal scores the child's path (.., r, 0) is below the sibling's (.., r + 1).
            x, xk, y, yk = sib, sib_k, kid, kid_k    # x replaces the popped slot
            if has_kid and (not has_sib or kid >= sib):
                x, xk, y, yk = kid, kid_k, sib, sib_k
            syncwarp()   # every lane has read the stale lane's slots: now they may change
            if lane == stale:
                if has_sib or has_kid:
                    cand_s[slot] = x
                    cand_k[slot] = xk | (np.int64(slot) << 48)
                else:                  # no successor: the last own slot fills the hole
                    mine -= 1
                    last = mine * lanes + lane
                    cand_s[slot] = cand_s[last]
                    cand_k[slot] = (cand_k[last] & _KEY_NOT_SLOT) | (np.int64(slot) << 48)
                    cand_s[last] = NEG_INF64   # last == slot: the hole itself empties
            if has_sib and has_kid:
                target = rr & (lanes - 1)
                rr += 1
                if lane == target:
                    at = mine * lanes + lane
                    yk = yk | (np.int64(at) << 48)
                    cand_s[at] = y
                    cand_k[at] = yk
                    mine += 1
        syncwarp()
        if lane == target and lane != stale:   # the new slot may beat the lane's best
            best_s, best_k = _better(best_s, best_k, y, yk, n_parent, n_rank)
    return n


@functools.cache
def _build_kernel(threads: int, bcap: int):
    """One block per request; warp 0 pops (``lanes`` = one warp, or the whole block in the
    simulator's narrower blocks), all threads load the lp cache and write the tree."""
    lanes = min(WARP, threads)
    per_lane = (bcap - 1) // lanes + 1   # frontier slots per lane: the bound at _pop_loop
    slots = per_lane * lanes
    nodes = bcap + 1

    @kernel
    def build(lp, ids, budget, n_nodes, token, parent, depth, rank, score):
        cand_s = cuda.shared.array(slots, np.float64)
        cand_k = cuda.shared.array(slots, np.int64)
        n_parent = cuda.shared.array(nodes, np.int16)
        n_rank = cuda.shared.array(nodes, np.int16)
        n_depth = cuda.shared.array(nodes, np.int16)
        lp_c = cuda.shared.array(LP_CACHE, np.float32)
        count = cuda.shared.array(1, np.int32)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        n_rows = lp.shape[1]
        shift = 0                 # cached row d starts at d << shift
        while n_rows << (shift + 1) <= LP_CACHE:
            shift += 1
        cols = min(lp.shape[2], 1 << shift) if n_rows <= LP_CACHE else 0
        fill = cuda.local.array(4, np.float32)
        for first in range(t, LP_CACHE, 4 * threads):   # 4 loads in flight per thread
            for q in range(4):
                idx = first + q * threads
                d = idx >> shift
                r = idx - (d << shift)
                fill[q] = lp[b, d, r] if d < n_rows and r < cols else np.float32(0.0)
            for q in range(4):
                if first + q * threads < LP_CACHE:
                    lp_c[first + q * threads] = fill[q]
        for i in range(t, slots, threads):   # an empty frontier but the root's first child
            cand_s[i] = np.float64(lp[b, 0, 0]) if i == 0 else NEG_INF64
            cand_k[i] = _pack(0, 0, 0, 1) if i == 0 else np.int64(-1)
        cuda.syncthreads()
        if t < lanes:
            n = _pop_loop(lp, lp_c, cols, shift, b, budget, t, lanes, per_lane, cand_s,
                          cand_k, n_parent, n_rank, n_depth, score)
            if t == 0:
                count[0] = n
        cuda.syncthreads()
        n = count[0]
        for i in range(t, budget + 1, threads):
            if i == 0:
                token[b, 0] = -1
                parent[b, 0] = -1
                depth[b, 0] = 0
                rank[b, 0] = -1
                score[b, 0] = 0.0
            elif i <= n:
                d = np.int32(n_depth[i])
                r = np.int32(n_rank[i])
                token[b, i] = ids[b, d - 1, r]
                parent[b, i] = n_parent[i]
                depth[b, i] = d
                rank[b, i] = r
            else:
                token[b, i] = -1
                parent[b, i] = -1
                depth[b, i] = -1
                rank[b, i] = -1
                score[b, i] = NEG_INF64
        if t == 0:
            n_nodes[b] = n

    return build


def build_config(budget: int, threads=None) -> tuple[int, int]:
    """(threads, budget class) for ``build_tree``.  The pops run on one warp; the other threads
    only fill the lp cache and write the tree, so a few warps suffice."""
    bcap = max(8, _pow2_at_least(budget))
    if threads is None:
        threads = 2 if SIMULATOR else 128
    if threads & (threads - 1) or not MIN_THREADS <= threads <= 1024:
        raise ValueError(f"threads={threads} must be a power of two in [{MIN_THREADS}, 1024]")
    return threads, bcap


def build_tree(lp, ids, budget: int, *, stream=0, out: DraftTree | None = None,
               threads=None) -> DraftTree:
    """GPU twin of ``reference.ddtree.build_tree``, bit-identical.  lp must be finite with
    non-increasing rows (checked only for NumPy input).  budget <= MAX_GPU_BUDGET and
    L < 32768.  ``out``: an optional DraftTree of device arrays to fill (its max_depth is not
    read)."""
    bs, n_rows, _, budget = ref.check_build_args(lp, ids, budget)
    if budget > MAX_GPU_BUDGET:
        raise ValueError(f"budget {budget} > {MAX_GPU_BUDGET}: the GPU builder keeps its "
                         f"candidates in shared memory; use reference.ddtree.build_tree")
    if n_rows >= 2 ** 15:
        raise ValueError(f"L = {n_rows} must be < 32768 (depths are int16 on the GPU)")
    if not _any_on_device(lp) and (not np.isfinite(lp).all()
                                   or np.any(np.diff(lp, axis=-1) > 0)):
        raise ValueError("lp must be finite with non-increasing rows")
    host = not _any_on_device(lp, ids) and out is None
    compat.require_kernels()
    threads, bcap = build_config(budget, threads)
    d_lp, d_ids = _dev(lp, stream), _dev(ids, stream)
    width = budget + 1
    specs = [("n_nodes", (bs,), np.int32)] + [(f, (bs, width), np.int32) for f in (
        "token", "parent", "depth", "rank")] + [("score", (bs, width), np.float64)]
    out = _outputs(None if out is None else [getattr(out, f) for f in TREE_FIELDS], specs,
                   stream)
    _build_kernel(threads, bcap)[bs, threads, stream](d_lp, d_ids, budget, *out)
    if host:
        out = _to_host(out, stream)
    return DraftTree(*out, max_depth=n_rows)


# ----------------------------------------------------------------------------- verify inputs

@kernel
def _tree_rows(n_nodes, token, parent, depth, root_token, start, input_ids, positions, anc):
    """One block per request, one thread per slot: ids, positions and the ancestor row."""
    b = cuda.blockIdx.x
    width = token.shape[1]
    n_anc = anc.shape[2]
    n = n_nodes[b]
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        for d in range(n_anc):
            anc[b, i, d] = -1
        if i <= n:
            dep = depth[b, i]
            input_ids[b, i] = token[b, i] if i > 0 else root_token[b]
            positions[b, i] = start[b] + dep
            node = i
            for d in range(dep, -1, -1):
                anc[b, i, d] = node
                node = parent[b, node]
        else:
            input_ids[b, i] = root_token[b]
            positions[b, i] = start[b]
            anc[b, i, 0] = i


@kernel
def _tree_mask(n_nodes, depth, anc, visible):
    """One block per (request, query row), threads over key columns: the rule of the contract,
    ``visible[i][j] = pd(j) <= pd(i) and anc[i][pd(j)] == j`` (padding depth 0)."""
    width = depth.shape[1]
    b = cuda.blockIdx.x // width
    i = cuda.blockIdx.x - b * width
    n = n_nodes[b]
    di = depth[b, i] if i <= n else 0
    for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        dj = depth[b, j] if j <= n else 0
        visible[b, i, j] = dj <= di and anc[b, i, dj] == j


def compile_tree(tree: DraftTree, root_token, start, *, stream=0,
                 out: VerifyInput | None = None) -> VerifyInput:
    """GPU twin of ``reference.ddtree.compile_tree``, bit-identical.  ``out``: an optional
    VerifyInput of device arrays to fill (positions written in place, as CUDA graphs need)."""
    bs, budget, max_depth = ref.check_tree(tree)
    ref.check_per_request("root_token", root_token, bs)
    ref.check_per_request("start", start, bs)
    host = not (_tree_is_on_device(tree) or _any_on_device(root_token, start)) and out is None
    compat.require_kernels()
    d_tree = _tree_on_device(tree, stream)
    width = budget + 1
    input_ids, positions, anc, visible = _outputs(
        None if out is None else (out.input_ids, out.positions, out.anc, out.visible),
        [("input_ids", (bs, width), np.int32), ("positions", (bs, width), np.int32),
         ("anc", (bs, width, max_depth + 1), np.int32),
         ("visible", (bs, width, width), np.bool_)], stream)
    threads = 32 if SIMULATOR else 128
    _tree_rows[bs, threads, stream](d_tree.n_nodes, d_tree.token, d_tree.parent, d_tree.depth,
                                    _dev(root_token, stream), _dev(start, stream), input_ids,
                                    positions, anc)
    _tree_mask[bs * width, threads, stream](d_tree.n_nodes, d_tree.depth, anc, visible)
    out = (input_ids, positions, anc, visible)
    return VerifyInput(*(_to_host(out, stream) if host else out))


# ----------------------------------------------------------------------------- acceptance

@functools.cache
def _accept_kernel(max_steps: int):
    """One block per request.  Step s: every thread tests its slots for ``parent == cur and
    token == nxt`` (at most one matches: siblings carry distinct tokens) and writes the match
    to found[s]; one barrier; everybody follows it.  At most L steps, L barriers."""

    @kernel
    def accept(n_nodes, token, parent, target, acc_idx, acc_len, next_token):
        found = cuda.shared.array(max_steps, np.int32)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        for s in range(t, max_steps, cuda.blockDim.x):
            found[s] = -1
        for s in range(t, max_steps + 1, cuda.blockDim.x):
            acc_idx[b, s] = -1
        n = n_nodes[b]
        cur = 0
        nxt = target[b, 0]
        length = 1
        cuda.syncthreads()
        for step in range(max_steps):
            for j in range(cur + 1 + t, n + 1, cuda.blockDim.x):   # children follow their parent
                if parent[b, j] == cur and token[b, j] == nxt:
                    found[step] = j
            cuda.syncthreads()
            f = found[step]
            if f < 0:
                break
            cur = f
            nxt = target[b, f]
            length += 1
        if t == 0:
            acc_idx[b, 0] = 0
            for s in range(1, length):
                acc_idx[b, s] = found[s - 1]
            acc_len[b] = length
            next_token[b] = nxt

    return accept


def accept_greedy(tree: DraftTree, target_tokens, *, stream=0, out=None):
    """GPU twin of ``reference.ddtree.accept_greedy``, bit-identical.  ``out``: optional
    (acc_idx, acc_len, next_token) device arrays."""
    bs, budget, max_depth = ref.check_tree(tree)
    ref.check_per_slot("target_tokens", target_tokens, bs, budget + 1, "iu")
    host = not (_tree_is_on_device(tree) or _any_on_device(target_tokens)) and out is None
    compat.require_kernels()
    d_tree = _tree_on_device(tree, stream)
    out = _outputs(out, [("acc_idx", (bs, max_depth + 1), np.int32),
                         ("acc_len", (bs,), np.int32), ("next_token", (bs,), np.int32)], stream)
    threads = 32 if SIMULATOR else 256
    _accept_kernel(max_depth)[bs, threads, stream](d_tree.n_nodes, d_tree.token, d_tree.parent,
                                                   _dev(target_tokens, stream), *out)
    return _to_host(out, stream) if host else tuple(out)


@functools.cache
def _sample_kernel(threads: int):
    """One block per (request, slot); padding slots write -1.  Pass 1: row max.  Pass 2: each
    thread sums the float64 weights of its contiguous chunk; a block scan gives chunk
    prefixes.  Pass 3: each thread walks its chunk from its prefix and reports the first token
    whose running sum exceeds u * total; the smallest such token wins (shared atomic min)."""

    @kernel
    def sample(n_nodes, logits, temperature, uniforms, tokens):
        red32 = cuda.shared.array(threads, np.float32)
        scan = cuda.shared.array(threads, np.float64)
        pick = cuda.shared.array(2, np.int32)   # [first crossing, last token with weight > 0]
        width = logits.shape[1]
        vocab = logits.shape[2]
        b = cuda.blockIdx.x // width
        i = cuda.blockIdx.x - b * width
        t = cuda.threadIdx.x
        if i > n_nodes[b]:   # uniform across the block: no barrier is skipped by some threads
            if t == 0:
                tokens[b, i] = -1
            return
        top = NEG_INF32
        for j in range(t, vocab, threads):
            top = max(top, logits[b, i, j])
        top = np.float64(block_max_f32(red32, top, t, threads))
        chunk = (vocab + threads - 1) // threads
        lo = min(t * chunk, vocab)
        hi = min(lo + chunk, vocab)
        mine = np.float64(0.0)
        last = -1
        for j in range(lo, hi):
            w = math.exp((np.float64(logits[b, i, j]) - top) / temperature)
            mine += w
            if w > 0:
                last = j
        if t == 0:
            pick[0] = INT32_MAX
            pick[1] = -1
        scan[t] = mine
        cuda.syncthreads()
        if last >= 0:
            cuda.atomic.max(pick, 1, last)
        offset = 1                       # Hillis-Steele inclusive scan of the chunk sums
        while offset < threads:
            add = scan[t - offset] if t >= offset else 0.0
            cuda.syncthreads()
            scan[t] += add
            cuda.syncthreads()
            offset *= 2
        total = scan[threads - 1]
        goal = uniforms[b, i] * total
        running = scan[t] - mine         # this chunk's exclusive prefix
        if running + mine > goal:
            for j in range(lo, hi):
                running += math.exp((np.float64(logits[b, i, j]) - top) / temperature)
                if running > goal:
                    cuda.atomic.min(pick, 0, j)
                    break
        cuda.syncthreads()
        if t == 0:
            tokens[b, i] = pick[0] if pick[0] != INT32_MAX else pick[1]

    return sample


def sample_targets(tree: DraftTree, target_logits, temperature: float, uniforms, *, stream=0,
                   out=None):
    """GPU twin of ``reference.ddtree.sample_targets``: equal tokens except when a uniform lies
    within ~1e-12 (relative) of a CDF boundary (the twins sum float64 weights in different
    orders).  Values (finite logits, uniforms in [0, 1)) are checked only for NumPy input.
    ``out``: an optional [bs, B+1] int32 device array."""
    bs, budget, _, temperature = ref.check_sample_args(tree, target_logits, temperature,
                                                       uniforms)
    if not _any_on_device(target_logits) and not np.isfinite(target_logits).all():
        raise ValueError("target_logits must be finite")
    if not _any_on_device(uniforms) and (np.any(uniforms < 0) or np.any(uniforms >= 1)):
        raise ValueError("uniforms must lie in [0, 1)")
    host = (not (_tree_is_on_device(tree) or _any_on_device(target_logits, uniforms))
            and out is None)
    compat.require_kernels()
    d_tree = _tree_on_device(tree, stream)
    (tokens,) = _outputs(None if out is None else (out,),
                         [("tokens", (bs, budget + 1), np.int32)], stream)
    threads = 8 if SIMULATOR else 512
    # (x - max) / T exactly as the reference writes it (multiplying by 1/T rounds differently).
    _sample_kernel(threads)[bs * (budget + 1), threads, stream](
        d_tree.n_nodes, _dev(target_logits, stream), np.float64(temperature),
        _dev(uniforms, stream), tokens)
    return tokens.copy_to_host(stream=stream) if host else tokens


def accept_sampled(tree: DraftTree, target_logits, temperature: float, uniforms, *, stream=0,
                   out=None, targets_out=None):
    """GPU twin of ``reference.ddtree.accept_sampled``: sample_targets, then accept_greedy.
    ``out`` as for accept_greedy; ``targets_out`` receives the sampled target tokens."""
    tokens = sample_targets(tree, target_logits, temperature, uniforms, stream=stream,
                            out=targets_out)
    return accept_greedy(tree, tokens, stream=stream, out=out)


# ----------------------------------------------------------------------------- KV compaction

@functools.cache
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
    caches, bs, n_acc = ref.check_compact_args(caches, past_len, acc_idx, acc_len)
    compat.require_kernels()
    host_index = not _any_on_device(past_len, acc_idx, acc_len)
    if host_index:
        for b in range(bs):
            ref.check_accepted(np.asarray(acc_idx)[b], int(np.asarray(acc_len)[b]), b)
        for cache in caches:
            _check_capacity(cache, past_len, acc_idx, acc_len)
    d_past, d_acc, d_len = (_dev(a, stream) for a in (past_len, acc_idx, acc_len))
    for cache in caches:
        on_host = isinstance(cache, np.ndarray)
        if on_host:   # bit patterns travel; the result is copied back in place
            itemsize = cache.dtype.itemsize
            if itemsize not in _WORDS:
                raise TypeError(f"cache dtype {cache.dtype} has no unsigned word of its size")
            d_cache = _dev(cache.view(_WORDS[itemsize]), stream)
        else:
            d_cache = _dev(cache, stream)
        words = _as_words(d_cache)
        n_stack, _, _, n_words = (int(s) for s in words.shape)
        threads = compact_threads(n_words)
        grid = (n_stack * bs, (n_words + threads - 1) // threads)
        _compact_kernel(n_acc, words.dtype.type)[grid, threads, stream](words, d_past, d_acc,
                                                                        d_len)
        if on_host:
            cache[...] = d_cache.copy_to_host(stream=stream).view(cache.dtype)

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
from reference import ddtree as ref
from reference.ddtree import DraftTree, VerifyInput

__all__ = ["DraftTree", "VerifyInput", "topk_logprobs", "build_tree", "compile_tree",
           "accept_greedy", "sample_targets", "accept_sampled", "compact_kv",
           "MAX_GPU_BUDGET", "MAX_GPU_TOPK", "MIN_THREADS"]

NEG_INF32 = np.float32(-np.inf)
NEG_INF64 = np.float64(-np.inf)
INT32_MAX = np.int32(2 ** 31 - 1)
MAX_GPU_BUDGET = 1024   # the builder keeps its 2B+1 candidates in static shared memory (48 KB)
MAX_GPU_TOPK = 2048     # top-K keeps 2 x kpad (logit, id) pairs in static shared memory
# Blocks of at least one full warp on the GPU (warp barriers need every lane); the simulator,
# where warp barriers are block barriers, also runs 1-16 threads so its tests stay fast.
MIN_THREADS = 1 if SIMULATOR else 32
TOPK_MAX_REGISTERS = 64   # 2 blocks of 512 threads per SM: 32 KB of loads in flight


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


# ----------------------------------------------------------------------------- block helpers
# Steps whose data stays inside one warp need only a warp barrier on the GPU.  The simulator has
# no warp intrinsics, so there the same call is a block barrier (correct, slower); callers call
# it uniformly (every thread of the block), which both forms need.

if SIMULATOR:
    @device_function
    def _sync_warp():
        cuda.syncthreads()
else:
    @device_function
    def _sync_warp():
        cuda.syncwarp()


@device_function
def _barrier(span):
    """Barrier after a step whose reads and writes lie within ``span`` consecutive threads'
    data: a warp barrier when span <= 32, else a block barrier.  span 0 means 'the block'."""
    if span == 0 or span > 32:
        cuda.syncthreads()
    else:
        _sync_warp()


@device_function
def _stage_barrier(stride, next_stride):
    """Barrier between two bitonic stages.  With pairs p -> (lo, lo + stride), a warp's 32
    consecutive pairs stay inside one aligned 64-element segment when stride <= 32, so two
    such stages in a row only synchronise the warp; next_stride 0 ends the network."""
    if next_stride == 0:
        cuda.syncthreads()
    else:
        _barrier(max(stride, next_stride))


# Shared-memory tree reductions (``threads`` a power of two).  Level ``stride`` is written by
# threads < stride and read at the next level by threads < stride / 2: a warp barrier suffices
# once stride <= 32.  Each ends with a block barrier so the scratch array can be reused.

@device_function
def _block_max_f32(red, value, t, threads):
    red[t] = value
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if t < stride:
            red[t] = max(red[t], red[t + stride])
        _barrier(stride)
        stride //= 2
    cuda.syncthreads()
    result = red[0]
    cuda.syncthreads()
    return result


@device_function
def _block_sum_f64(red, value, t, threads):
    red[t] = value
    cuda.syncthreads()
    stride = threads // 2
    while stride > 0:
        if t < stride:
            red[t] = red[t] + red[t + stride]
        _barrier(stride)
        stride //= 2
    cuda.syncthreads()
    result = red[0]
    cuda.syncthreads()
    return result


@device_function
def _before(x1, i1, x2, i2):
    """(logit, id) order of top-K: larger logit first, then smaller id (a strict total order)."""
    return x1 > x2 or (x1 == x2 and i1 < i2)


@device_function
def _pair(p, shift):
    """Lower index of compare-exchange pair ``p`` at stride ``1 << shift`` in a bitonic net."""
    return ((p >> shift) << (shift + 1)) + (p & ((1 << shift) - 1))


@device_function
def _swap(sx, si, a, b):
    x = sx[a]
    i = si[a]
    sx[a] = sx[b]
    si[a] = si[b]
    sx[b] = x
    si[b] = i


# ----------------------------------------------------------------------------- top-K

@functools.cache
def _topk_kernel(threads: int, per_thread: int, kpad: int, new: int):
    """One block per row, streaming the row once (docs/DDTREE.md, "top-K").

    Shared ``sx/si`` hold [kpad sorted best | new unsorted candidates].  An element enters the
    candidate region only if it beats theta = the current k-th best, so after the first tiles
    almost nothing is written.  When the region overflows, the block sorts it and merges it
    into the best list (a compaction), raises theta and retries the elements that did not fit
    (still in registers).  The row's logsumexp is accumulated at the same time.
    """
    tile = threads * per_thread
    cap = kpad + new

    @device_function
    def compact(sx, si, cnt, k, t):
        """Merge the candidate region into the sorted best list; returns the new theta.

        Loop bounds come from the runtime k (kp == kpad), not from constants: constant bounds
        let the compiler unroll these networks and nearly double the kernel's registers.
        """
        kp = 1
        kp_shift = -1
        while kp < k:
            kp *= 2
            kp_shift += 1
        count = min(cnt[0], new)
        for i in range(count + t, new, threads):
            sx[kp + i] = NEG_INF32
            si[kp + i] = INT32_MAX
        size = kp
        while size < count:   # only the filled part needs sorting (rest is padding)
            size *= 2
        cuda.syncthreads()
        merge = 2             # bitonic sort of the candidates, best first
        while merge <= size:
            shift = 0         # log2(stride): pair index -> position with shifts, no division
            while (2 << shift) < merge:
                shift += 1
            while shift >= 0:
                stride = 1 << shift
                for p in range(t, size // 2, threads):
                    lo = _pair(p, shift)
                    a, b = kp + lo, kp + lo + stride
                    if _before(sx[b], si[b], sx[a], si[a]) == ((lo & merge) == 0):
                        _swap(sx, si, a, b)
                _stage_barrier(stride, stride // 2 if stride > 1 else
                               (merge if merge < size else 0))
                shift -= 1
            merge *= 2
        for i in range(t, kp, threads):      # best kpad of both lists: a bitonic sequence
            j = 2 * kp - 1 - i
            if _before(sx[j], si[j], sx[i], si[i]):
                sx[i] = sx[j]
                si[i] = si[j]
        cuda.syncthreads()
        shift = kp_shift
        while shift >= 0:                    # bitonic merge back into order
            stride = 1 << shift
            for p in range(t, kp // 2, threads):
                lo = _pair(p, shift)
                if _before(sx[lo + stride], si[lo + stride], sx[lo], si[lo]):
                    _swap(sx, si, lo, lo + stride)
            _stage_barrier(stride, stride // 2)
            shift -= 1
        if t == 0:
            cnt[0] = 0
        cuda.syncthreads()
        return sx[k - 1], si[k - 1]

    @kernel(max_registers=TOPK_MAX_REGISTERS)
    def topk_rows(logits, k, lp_out, ids_out):
        sx = cuda.shared.array(cap, np.float32)
        si = cuda.shared.array(cap, np.int32)
        red32 = cuda.shared.array(threads, np.float32)
        red64 = cuda.shared.array(threads, np.float64)
        cnt = cuda.shared.array(1, np.int32)
        flag = cuda.shared.array(3, np.int32)   # overflow flags, one per round mod 3
        xs = cuda.local.array(per_thread, np.float32)
        t = cuda.threadIdx.x
        row = cuda.blockIdx.x
        vocab = logits.shape[1]
        for i in range(t, cap, threads):
            sx[i] = NEG_INF32
            si[i] = INT32_MAX
        if t == 0:
            cnt[0] = 0
            flag[0] = 0
            flag[1] = 0
            flag[2] = 0
        theta_x = NEG_INF32
        theta_i = INT32_MAX
        m = NEG_INF32          # this thread's exp reference (the row max, once known)
        s = np.float64(0.0)    # sum of exp(x - m) over this thread's elements
        rnd = 0
        n_tiles = (vocab + tile - 1) // tile
        cuda.syncthreads()
        for tile_no in range(n_tiles + 1):   # the extra, empty tile runs the final compaction
            last = tile_no == n_tiles
            base = tile_no * tile + t
            top = NEG_INF32
            for u in range(per_thread):
                j = base + u * threads
                x = logits[row, j] if j < vocab else NEG_INF32
                xs[u] = x
                top = max(top, x)
            if tile_no == 0:   # start every thread at the first tile's max: later rescales are rare
                top = _block_max_f32(red32, top, t, threads)
            if top > m:
                s = s * math.exp(np.float64(m) - np.float64(top))
                m = top
            part = np.float32(0.0)
            pending = 0
            for u in range(per_thread):
                part += math.exp(xs[u] - m)
                if base + u * threads < vocab:
                    pending |= 1 << u
            s += np.float64(part)
            while True:
                for u in range(per_thread):
                    if pending & (1 << u):
                        j = base + u * threads
                        if _before(xs[u], j, theta_x, theta_i):
                            slot = cuda.atomic.add(cnt, 0, 1)
                            if slot < new:
                                sx[kpad + slot] = xs[u]
                                si[kpad + slot] = j
                                pending ^= 1 << u
                            else:
                                flag[rnd % 3] = 1
                        else:
                            pending ^= 1 << u
                # flag[(rnd+1)%3] was last read in round rnd-2, before the barrier of rnd-1.
                if t == 0:
                    flag[(rnd + 1) % 3] = 0
                cuda.syncthreads()
                overflow = flag[rnd % 3] != 0 or last
                rnd += 1
                if not overflow:
                    break
                theta_x, theta_i = compact(sx, si, cnt, k, t)   # the only call site: inlined once
                if last:
                    break
        big = _block_max_f32(red32, m, t, threads)
        total = _block_sum_f64(red64, s * math.exp(np.float64(m) - np.float64(big)), t, threads)
        lse = np.float64(big) + math.log(total)
        for i in range(t, k, threads):
            lp_out[row, i] = np.float32(np.float64(sx[i]) - lse)
            ids_out[row, i] = si[i]

    return topk_rows


def topk_config(k: int, threads=None, per_thread=None, new=None) -> tuple[int, int, int, int]:
    """(threads, per_thread, kpad, new) for ``topk_logprobs``; the defaults are the H200 choice."""
    kpad = _pow2_at_least(k)
    if threads is None:
        threads = 8 if SIMULATOR else 512
    if per_thread is None:
        per_thread = 2 if SIMULATOR else 8
    if new is None:
        new = max(kpad, 8 if SIMULATOR else 512)
    if (threads & (threads - 1) or not MIN_THREADS <= threads <= 1024 or new & (new - 1)
            or new < kpad or not 1 <= per_thread <= 30):
        raise ValueError(f"bad top-K config threads={threads} per_thread={per_thread} "
                         f"new={new}: powers of two, threads in [{MIN_THREADS}, 1024], "
                         f"new >= {kpad}, per_thread <= 30")
    return threads, per_thread, kpad, new


def topk_logprobs(logits, k: int, *, stream=0, out=None, threads=None, per_thread=None,
                  new=None):
    """GPU twin of ``reference.ddtree.topk_logprobs``.  Logits must be finite (checked only for
    NumPy input).  ids equal the reference exactly; lp within LP_ATOL + LP_RTOL*|lp|.
    k <= MAX_GPU_TOPK.
    ``out``: optional (lp, ids) device arrays, C-contiguous."""
    bs, n_rows, vocab, k = ref.check_topk_args(logits, k)
    if k > MAX_GPU_TOPK:
        raise ValueError(f"k = {k} > {MAX_GPU_TOPK}: the GPU top-K keeps its candidates in "
                         f"shared memory; use reference.ddtree.topk_logprobs")
    if not _any_on_device(logits) and not np.isfinite(logits).all():
        raise ValueError("logits must be finite")
    host = not _any_on_device(logits) and out is None
    compat.require_kernels()
    threads, per_thread, kpad, new = topk_config(k, threads, per_thread, new)
    rows = _dev(logits, stream).reshape(bs * n_rows, vocab)
    lp, ids = _outputs(out, [("lp", (bs, n_rows, k), np.float32),
                             ("ids", (bs, n_rows, k), np.int32)], stream)
    _topk_kernel(threads, per_thread, kpad, new)[bs * n_rows, threads, stream](
        rows, k, lp.reshape(bs * n_rows, k), ids.reshape(bs * n_rows, k))
    return _to_host((lp, ids), stream) if host else (lp, ids)


# ----------------------------------------------------------------------------- tree builder

@device_function
def _node_up(node, n_parent, n_rank, last, last_parent, last_rank):
    """(parent, rank) of a popped node; the one popped this round may not be in shared yet."""
    if node == last:
        return np.int32(last_parent), np.int32(last_rank)
    return np.int32(n_parent[node]), np.int32(n_rank[node])


@device_function
def _better(a, c, c_score, c_parent, c_depth, c_rank, n_parent, n_rank, last, last_par,
            last_rank):
    """Candidate slot a pops before slot c: higher score, then smaller rank path.

    Two live candidates never have one path prefixing the other (the prefix would be popped),
    so walking both up to their lowest common ancestor and comparing the ranks just below it
    gives the lexicographic order without storing paths.
    """
    sa = c_score[a]
    sc = c_score[c]
    if sa != sc:
        return sa > sc
    xp, xr, xd = np.int32(c_parent[a]), np.int32(c_rank[a]), np.int32(c_depth[a])
    yp, yr, yd = np.int32(c_parent[c]), np.int32(c_rank[c]), np.int32(c_depth[c])
    while xd > yd:
        xp, xr = _node_up(xp, n_parent, n_rank, last, last_par, last_rank)
        xd -= 1
    while yd > xd:
        yp, yr = _node_up(yp, n_parent, n_rank, last, last_par, last_rank)
        yd -= 1
    while xp != yp:
        xp, xr = _node_up(xp, n_parent, n_rank, last, last_par, last_rank)
        yp, yr = _node_up(yp, n_parent, n_rank, last, last_par, last_rank)
    return xr < yr


@functools.cache
def _build_kernel(threads: int, bcap: int):
    """One block per request; candidates in a flat array of 2B+1 shared slots (pop n writes
    slots 2n-1 and 2n); each pop is a block-wide arg-best reduction (docs/DDTREE.md)."""
    slots = 2 * bcap + 1
    nodes = bcap + 1
    red_size = 2 * threads   # shared-array sizes must be closure constants, not expressions
    # The first ranks of the first rows of lp and ids, cached in shared memory: nearly every
    # pop reads them, and a global load on the critical path of a pop costs ~1 us.
    cache_rows, cache_cols = 16, 32
    cache_size = cache_rows * cache_cols

    @device_function
    def lp_at(lp, lp_c, b, d, r):
        if d < cache_rows and r < cache_cols:
            return lp_c[d * cache_cols + r]
        return lp[b, d, r]

    @device_function
    def ids_at(ids, ids_c, b, d, r):
        if d < cache_rows and r < cache_cols:
            return ids_c[d * cache_cols + r]
        return ids[b, d, r]

    @device_function
    def local_best(t, frontier, c_live, c_score, c_parent, c_depth, c_rank, n_parent, n_rank,
                   last, last_par, last_rank):
        best = -1
        for s in range(t, frontier, threads):
            if c_live[s] != 0 and (best < 0 or _better(s, best, c_score, c_parent, c_depth,
                                                       c_rank, n_parent, n_rank, last,
                                                       last_par, last_rank)):
                best = s
        return best

    @kernel
    def build(lp, ids, budget, n_nodes, token, parent, depth, rank, score):
        c_score = cuda.shared.array(slots, np.float64)
        c_parent = cuda.shared.array(slots, np.int16)
        c_depth = cuda.shared.array(slots, np.int16)
        c_rank = cuda.shared.array(slots, np.int16)
        c_live = cuda.shared.array(slots, np.int8)      # read and written by the slot's owner only
        n_parent = cuda.shared.array(nodes, np.int16)
        n_rank = cuda.shared.array(nodes, np.int16)
        red = cuda.shared.array(red_size, np.int32)  # double-buffered by pop parity
        lp_c = cuda.shared.array(cache_size, np.float32)
        ids_c = cuda.shared.array(cache_size, np.int32)
        t = cuda.threadIdx.x
        b = cuda.blockIdx.x
        n_rows = lp.shape[1]
        k = lp.shape[2]
        for s in range(t, slots, threads):
            c_live[s] = 0
        for i in range(t, cache_size, threads):
            d = i // cache_cols
            r = i - d * cache_cols
            if d < n_rows and r < k:
                lp_c[i] = lp[b, d, r]
                ids_c[i] = ids[b, d, r]
        best = -1
        if t == 0:   # slot 0 (owned by thread 0): the first child of the root
            c_score[0] = np.float64(lp[b, 0, 0])
            c_parent[0] = 0
            c_depth[0] = 1
            c_rank[0] = 0
            c_live[0] = 1
            n_parent[0] = -1
            n_rank[0] = -1
            best = 0
        n = 0
        buf = 0
        while n < budget:
            red[buf + t] = best
            cuda.syncthreads()
            stride = threads // 2
            while stride > 0:
                if t < stride:
                    a = red[buf + t]
                    c = red[buf + t + stride]
                    if c >= 0 and (a < 0 or _better(c, a, c_score, c_parent, c_depth, c_rank,
                                                    n_parent, n_rank, -1, -1, -1)):
                        red[buf + t] = c
                _barrier(stride)
                stride //= 2
            if threads > 32:
                cuda.syncthreads()   # the winner was written by warp 0 only
            w = red[buf]
            if w < 0:
                break
            n += 1
            sc = c_score[w]
            par = np.int32(c_parent[w])
            dep = np.int32(c_depth[w])
            rk = np.int32(c_rank[w])
            if t == 0:
                token[b, n] = ids_at(ids, ids_c, b, dep - 1, rk)
                parent[b, n] = par
                depth[b, n] = dep
                rank[b, n] = rk
                score[b, n] = sc
                n_parent[n] = par
                n_rank[n] = rk
            changed = False
            if w % threads == t:
                c_live[w] = 0
                changed = True
            sib = 2 * n - 1
            if sib % threads == t and rk + 1 < k:   # next sibling, (score - lp[r]) + lp[r+1]
                c_score[sib] = ((sc - np.float64(lp_at(lp, lp_c, b, dep - 1, rk)))
                                + np.float64(lp_at(lp, lp_c, b, dep - 1, rk + 1)))
                c_parent[sib] = par
                c_depth[sib] = dep
                c_rank[sib] = rk + 1
                c_live[sib] = 1
                changed = True
            kid = 2 * n
            if kid % threads == t and dep < n_rows:  # first child
                c_score[kid] = sc + np.float64(lp_at(lp, lp_c, b, dep, 0))
                c_parent[kid] = n
                c_depth[kid] = dep + 1
                c_rank[kid] = 0
                c_live[kid] = 1
                changed = True
            if changed:
                best = local_best(t, 2 * n + 1, c_live, c_score, c_parent, c_depth, c_rank,
                                  n_parent, n_rank, n, par, rk)
            buf = threads - buf
        if t == 0:
            n_nodes[b] = n
            token[b, 0] = -1
            parent[b, 0] = -1
            depth[b, 0] = 0
            rank[b, 0] = -1
            score[b, 0] = 0.0
        for i in range(n + 1 + t, budget + 1, threads):
            token[b, i] = -1
            parent[b, i] = -1
            depth[b, i] = -1
            rank[b, i] = -1
            score[b, i] = NEG_INF64

    return build


def build_config(budget: int, threads=None) -> tuple[int, int]:
    """(threads, budget class) for ``build_tree``: about 8 candidate slots per thread."""
    bcap = max(8, _pow2_at_least(budget))
    if threads is None:
        threads = 2 if SIMULATOR else min(256, max(32, bcap // 4))
    if threads & (threads - 1) or not MIN_THREADS <= threads <= 1024:
        raise ValueError(f"threads={threads} must be a power of two in [{MIN_THREADS}, 1024]")
    return threads, bcap


def build_tree(lp, ids, budget: int, *, stream=0, out: DraftTree | None = None,
               threads=None) -> DraftTree:
    """GPU twin of ``reference.ddtree.build_tree``, bit-identical.  lp must be finite with
    non-increasing rows (checked only for NumPy input).  budget <= MAX_GPU_BUDGET.
    ``out``: an optional DraftTree of device arrays to fill (its max_depth is not read)."""
    bs, n_rows, _, budget = ref.check_build_args(lp, ids, budget)
    if budget > MAX_GPU_BUDGET:
        raise ValueError(f"budget {budget} > {MAX_GPU_BUDGET}: the GPU builder keeps 2B+1 "
                         f"candidates in shared memory; use reference.ddtree.build_tree")
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
        top = np.float64(_block_max_f32(red32, top, t, threads))
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

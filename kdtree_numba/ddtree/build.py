"""DDTree tree builder on the GPU: ``build_tree`` (the best-first draft tree of each request, bit
identical to the reference), its launch configuration ``build_config``, and the kernel with its
device functions (the frontier pop loop on one warp, the warp arg-best of two candidates).

Reference twin and contract: reference/ddtree/build.py (``build_tree`` and the DraftTree
fields).  The algorithm and why it was chosen: docs/DDTREE.md, "build_tree".  Host plumbing
shared with the other DDTree kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, device_function, SIMULATOR


import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import (MIN_THREADS, NEG_INF64, TREE_FIELDS, any_on_device,
                                        device_view, outputs, pow2_at_least, to_host)
from kdtree_numba.gpu.bits import f64_bits
from kdtree_numba.gpu.warp import WARP, ballot2, redux_max2, shfl_idx_pairs, shfl_xor4, syncwarp
from reference.ddtree.checks import check_build_args
from reference.ddtree.tree import DraftTree

__all__ = ["build_tree", "build_config", "MAX_GPU_BUDGET", "LP_CACHE"]

MAX_GPU_BUDGET = 1024   # the builder keeps its <= B+1 candidates in static shared memory


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
    """The contract's pop loop (reference/ddtree/build.py) on lanes 0..lanes-1 of one warp, which
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


@kernel_factory
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
    bcap = max(8, pow2_at_least(budget))
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
    bs, n_rows, _, budget = check_build_args(lp, ids, budget)
    if budget > MAX_GPU_BUDGET:
        raise ValueError(f"budget {budget} > {MAX_GPU_BUDGET}: the GPU builder keeps its "
                         f"candidates in shared memory; use reference.ddtree.build_tree")
    if n_rows >= 2 ** 15:
        raise ValueError(f"L = {n_rows} must be < 32768 (depths are int16 on the GPU)")
    if not any_on_device(lp) and (not np.isfinite(lp).all()
                                   or np.any(np.diff(lp, axis=-1) > 0)):
        raise ValueError("lp must be finite with non-increasing rows")
    host = not any_on_device(lp, ids) and out is None
    compat.require_kernels()
    threads, bcap = build_config(budget, threads)
    d_lp, d_ids = device_view(lp, stream), device_view(ids, stream)
    width = budget + 1
    specs = [("n_nodes", (bs,), np.int32)] + [(f, (bs, width), np.int32) for f in (
        "token", "parent", "depth", "rank")] + [("score", (bs, width), np.float64)]
    out = outputs(None if out is None else [getattr(out, f) for f in TREE_FIELDS], specs,
                  stream)
    _build_kernel(threads, bcap)[bs, threads, stream](d_lp, d_ids, budget, *out)
    if host:
        out = to_host(out, stream)
    return DraftTree(*out, max_depth=n_rows)

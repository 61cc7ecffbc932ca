"""DDTree acceptance on the GPU: ``accept_greedy`` (the longest tree path the target agrees with),
``sample_targets`` (the target's sampled token at each tree slot) and ``accept_sampled`` (the
two in turn), with their kernels.

Reference twin and contract: reference/ddtree/accept.py.  The kernels and why: docs/DDTREE.md,
"compile_tree, accept, sampling, compaction".  Host plumbing shared with the other DDTree
kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, device_function, kernel, kernel_factory, SIMULATOR

import math

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import (INT32_MAX, NEG_INF32, any_on_device, device_view,
                                        outputs, to_host, tree_is_on_device, tree_on_device)
from kdtree_numba.gpu.bits import f32_bits
from kdtree_numba.gpu.reduce import block_max_f32
from reference.ddtree.checks import check_per_slot, check_sample_args, check_tree
from reference.ddtree.tree import DraftTree

__all__ = ["accept_greedy", "sample_targets", "accept_sampled"]


# ----------------------------------------------------------------------------- acceptance

@kernel_factory
def _accept_kernel(max_steps: int):
    """One block per request.  Step s: every thread tests its slots for ``parent == cur and
    token == nxt`` (at most one matches: siblings carry distinct tokens) and writes the match
    to found[s]; one barrier; everybody follows it.  At most L steps, L barriers."""

    @kernel
    def accept(n_nodes, token, parent, target, acc_idx, acc_len, next_token, packed):
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
            packed[b, 0] = length
            for s in range(1, length):
                acc_idx[b, s] = found[s - 1]
                packed[b, s] = token[b, found[s - 1]]
                packed[b, max_steps + 1 + s] = found[s - 1]   # the accepted slots' tail
            acc_len[b] = length
            next_token[b] = nxt
            packed[b, length] = nxt
            for s in range(length + 1, max_steps + 2):
                packed[b, s] = -1
            for s in range(max_steps + 1 + length, 2 * max_steps + 2):
                packed[b, s] = -1

    return accept


def accept_greedy(tree: DraftTree, target_tokens, pack: bool = False, *, stream=0, out=None):
    """GPU twin of ``reference.ddtree.accept_greedy``, bit-identical; ``pack``: the packed
    committed tokens and accepted slots too (``reference.ddtree.pack_committed``), written by
    the same launch (a DDTree round's one read, where CuPy glue took ten launches).
    ``out``: optional (acc_idx, acc_len, next_token[, packed]) device arrays."""
    bs, budget, max_depth = check_tree(tree)
    check_per_slot("target_tokens", target_tokens, bs, budget + 1, "iu")
    host = not (tree_is_on_device(tree) or any_on_device(target_tokens)) and out is None
    compat.require_kernels()
    d_tree = tree_on_device(tree, stream)
    specs = [("acc_idx", (bs, max_depth + 1), np.int32), ("acc_len", (bs,), np.int32),
             ("next_token", (bs,), np.int32), ("packed", (bs, 2 * max_depth + 2), np.int32)]
    out = outputs(out, specs if out is None or len(out) == 4 else specs[:3], stream)
    if len(out) == 3:           # the caller's three arrays: the packing goes to a scratch one
        out += outputs(None, specs[3:], stream)
    threads = 32 if SIMULATOR else 256
    _accept_kernel(max_depth)[bs, threads, stream](d_tree.n_nodes, d_tree.token, d_tree.parent,
                                                   device_view(target_tokens, stream), *out)
    out = out if pack else out[:3]
    return to_host(out, stream) if host else tuple(out)


@device_function
def _rank_key(x, j, vocab):
    """The int64 rank key of token j with logit x: larger means ranked first (a larger logit;
    ties: the smaller id).  The float's bits made order-preserving as a signed integer s
    (negative floats have their low 31 bits flipped; x + 0 turns -0.0 into 0.0, which ties
    it), then ``s * V + (V - 1 - j)``: for finite x every key lies in (-2^31 V, 2^31 V)."""
    s = np.int64(f32_bits(x + np.float32(0.0)))
    if s < 0:
        s = s ^ np.int64(0x7FFFFFFF)
    return s * np.int64(vocab) + np.int64(vocab - 1 - j)


@device_function
def _block_sum(count, mass, count_sh, mass_sh, t, threads):
    """Block sums of one int64 and one float64 per thread: every thread adds the block's
    values in thread order (the same bits on every thread and every run; two barriers, where
    a tree takes log2(threads) + 2).  Every thread must call it."""
    count_sh[t] = count
    mass_sh[t] = mass
    cuda.syncthreads()
    total_count = np.int64(0)
    total_mass = np.float64(0.0)
    for k in range(threads):
        total_count += count_sh[k]
        total_mass += mass_sh[k]
    cuda.syncthreads()           # before anyone writes the next sum
    return total_count, total_mass


@device_function
def _above(logits, b, i, vocab, top, temperature, bound, with_mass, count_sh, mass_sh, t,
           threads):
    """(count, float64 mass) of the tokens whose rank key is > bound, over the block."""
    count = np.int64(0)
    mass = np.float64(0.0)
    for j in range(t, vocab, threads):
        x = logits[b, i, j]
        if _rank_key(x, j, vocab) > bound:
            count += 1
            if with_mass:
                mass += math.exp((np.float64(x) - top) / temperature)
    return _block_sum(count, mass, count_sh, mass_sh, t, threads)


@device_function
def _keep_from(logits, b, i, vocab, top, temperature, top_p, top_k, count_sh, mass_sh, t,
               threads):
    """The smallest rank key the truncation keeps (reference/ddtree/sampling.py): top-k keeps
    the keys >= t_k, the smallest bound with fewer than k keys above it; top-p then the keys
    >= the smallest bound (>= t_k) with fewer than k keys and less than top_p * Z_k of mass
    above it (Z_k: the mass of keys >= t_k).  Both by bisection: lo fails, hi holds."""
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    lo = np.int64(-(2 ** 31)) * np.int64(vocab)   # below every key
    top_key = -lo - 1                              # at or above every key
    hi = lo + 1                      # no top-k: every key is kept
    if k < vocab:
        hi = top_key
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            c, _ = _above(logits, b, i, vocab, top, temperature, mid, False, count_sh,
                          mass_sh, t, threads)
            if c < k:
                hi = mid
            else:
                lo = mid
    if top_p >= 1.0:
        return hi
    _, kept = _above(logits, b, i, vocab, top, temperature, hi - 1, True, count_sh, mass_sh,
                     t, threads)
    goal = top_p * kept
    lo = hi - 1
    hi = top_key
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        c, m = _above(logits, b, i, vocab, top, temperature, mid, True, count_sh, mass_sh, t,
                      threads)
        if c < k and m < goal:
            hi = mid
        else:
            lo = mid
    return hi


@kernel_factory
def _sample_kernel(threads: int):
    """One block per (request, slot); padding slots write -1.  Pass 1: row max.  With top-k
    or top-p, the smallest kept rank key (``_keep_from``: bisection over the keys, each step a
    block count and float64 mass above the candidate; the other tokens weigh 0).  Pass 2: each
    thread sums the float64 weights of its contiguous chunk; a block scan gives chunk
    prefixes.  Pass 3: each thread walks its chunk from its prefix and reports the first token
    whose running sum exceeds u * total; the smallest such token wins (shared atomic min)."""

    @kernel
    def sample(n_nodes, logits, temperature, top_p, top_k, uniforms, tokens):
        red32 = cuda.shared.array(threads, np.float32)
        scan = cuda.shared.array(threads, np.float64)
        count_sh = cuda.shared.array(threads, np.int64)
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
        keep = np.int64(-(2 ** 31)) * np.int64(vocab)   # below every key: nothing dropped
        if top_k > 0 or top_p < 1.0:     # uniform across the block
            keep = _keep_from(logits, b, i, vocab, top, temperature, top_p, top_k, count_sh,
                              scan, t, threads)
        chunk = (vocab + threads - 1) // threads
        lo = min(t * chunk, vocab)
        hi = min(lo + chunk, vocab)
        mine = np.float64(0.0)
        last = -1
        for j in range(lo, hi):
            x = logits[b, i, j]
            if _rank_key(x, j, vocab) >= keep:
                w = math.exp((np.float64(x) - top) / temperature)
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
                x = logits[b, i, j]
                if _rank_key(x, j, vocab) >= keep:
                    running += math.exp((np.float64(x) - top) / temperature)
                    if running > goal:
                        cuda.atomic.min(pick, 0, j)
                        break
        cuda.syncthreads()
        if t == 0:
            tokens[b, i] = pick[0] if pick[0] != INT32_MAX else pick[1]

    return sample


def sample_targets(tree: DraftTree, target_logits, sampling, uniforms, *, stream=0, out=None):
    """GPU twin of ``reference.ddtree.sample_targets`` (``sampling``: a Sampling, or a bare
    temperature): equal tokens except when a uniform lies within ~1e-12 (relative) of a CDF
    boundary, or a top-p prefix mass that close to its threshold (the twins sum float64
    weights in different orders).  Values (finite logits, uniforms in [0, 1)) are checked only
    for NumPy input.  ``out``: an optional [bs, B+1] int32 device array."""
    bs, budget, _, sampling = check_sample_args(tree, target_logits, sampling, uniforms)
    if not any_on_device(target_logits) and not np.isfinite(target_logits).all():
        raise ValueError("target_logits must be finite")
    if not any_on_device(uniforms) and (np.any(uniforms < 0) or np.any(uniforms >= 1)):
        raise ValueError("uniforms must lie in [0, 1)")
    host = (not (tree_is_on_device(tree) or any_on_device(target_logits, uniforms))
            and out is None)
    compat.require_kernels()
    d_tree = tree_on_device(tree, stream)
    (tokens,) = outputs(None if out is None else (out,),
                        [("tokens", (bs, budget + 1), np.int32)], stream)
    threads = 8 if SIMULATOR else 512
    # (x - max) / T exactly as the reference writes it (multiplying by 1/T rounds differently).
    _sample_kernel(threads)[bs * (budget + 1), threads, stream](
        d_tree.n_nodes, device_view(target_logits, stream), np.float64(sampling.temperature),
        np.float64(sampling.top_p), np.int64(sampling.top_k), device_view(uniforms, stream),
        tokens)
    return tokens.copy_to_host(stream=stream) if host else tokens


def accept_sampled(tree: DraftTree, target_logits, sampling, uniforms, pack: bool = False, *,
                   stream=0, out=None, targets_out=None):
    """GPU twin of ``reference.ddtree.accept_sampled``: sample_targets, then accept_greedy.
    ``pack`` and ``out`` as for accept_greedy; ``targets_out`` receives the sampled target
    tokens."""
    tokens = sample_targets(tree, target_logits, sampling, uniforms, stream=stream,
                            out=targets_out)
    return accept_greedy(tree, tokens, pack, stream=stream, out=out)

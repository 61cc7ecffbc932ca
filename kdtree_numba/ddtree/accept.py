"""DDTree acceptance on the GPU: ``accept_greedy`` (the longest tree path the target agrees with),
``sample_targets`` (the target's sampled token at each tree slot) and ``accept_sampled`` (the
two in turn), with their kernels.

Reference twin and contract: reference/ddtree/accept.py.  The kernels and why: docs/DDTREE.md,
"compile_tree, accept, sampling, compaction".  Host plumbing shared with the other DDTree
kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, SIMULATOR

import functools
import math

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import (INT32_MAX, NEG_INF32, any_on_device, device_view,
                                        outputs, to_host, tree_is_on_device, tree_on_device)
from kdtree_numba.gpu.reduce import block_max_f32
from reference.ddtree.checks import check_per_slot, check_sample_args, check_tree
from reference.ddtree.tree import DraftTree

__all__ = ["accept_greedy", "sample_targets", "accept_sampled"]


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
    bs, budget, max_depth = check_tree(tree)
    check_per_slot("target_tokens", target_tokens, bs, budget + 1, "iu")
    host = not (tree_is_on_device(tree) or any_on_device(target_tokens)) and out is None
    compat.require_kernels()
    d_tree = tree_on_device(tree, stream)
    out = outputs(out, [("acc_idx", (bs, max_depth + 1), np.int32),
                        ("acc_len", (bs,), np.int32), ("next_token", (bs,), np.int32)], stream)
    threads = 32 if SIMULATOR else 256
    _accept_kernel(max_depth)[bs, threads, stream](d_tree.n_nodes, d_tree.token, d_tree.parent,
                                                   device_view(target_tokens, stream), *out)
    return to_host(out, stream) if host else tuple(out)


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
    bs, budget, _, temperature = check_sample_args(tree, target_logits, temperature,
                                                   uniforms)
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
        d_tree.n_nodes, device_view(target_logits, stream), np.float64(temperature),
        device_view(uniforms, stream), tokens)
    return tokens.copy_to_host(stream=stream) if host else tokens


def accept_sampled(tree: DraftTree, target_logits, temperature: float, uniforms, *, stream=0,
                   out=None, targets_out=None):
    """GPU twin of ``reference.ddtree.accept_sampled``: sample_targets, then accept_greedy.
    ``out`` as for accept_greedy; ``targets_out`` receives the sampled target tokens."""
    tokens = sample_targets(tree, target_logits, temperature, uniforms, stream=stream,
                            out=targets_out)
    return accept_greedy(tree, tokens, stream=stream, out=out)

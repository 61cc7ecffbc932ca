"""MoE routing on the GPU: ``router_logits``, ``route_from_logits``, ``moe_route`` (re-exported
by layers/moe.py, whose ``moe_ffn`` takes the routing they give).

Twin: reference/layers/moe.py (the routing rules are its docstring).  Design and tolerances:
docs/LAYERS.md.
"""
from __future__ import annotations

import math

import numpy as np

from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.gpu.reduce import tree_reduce
from kdtree_numba.layers.common import pow2_ceil
from kdtree_numba.layers.linear import linear
from kdtree_numba.layers.workspace import device_f32, placeholder, result_array, workspace_buffer
from reference.layers import check_routing_args

__all__ = ["router_logits", "route_from_logits", "moe_route"]

# ============================================================================ MoE routing

def router_logits(h, gate_w, *, stream=0, workspace=None):
    """``h gate_w^T`` [M, E] in fp32 through :func:`linear` (gate weights fp32 or bf16)."""
    return linear(h, gate_w, stream=stream, workspace=workspace)


@device_function
def _key_beats(kf, f, ke, e):
    """Expert/group f ranks before e: larger key, or equal key and lower index."""
    return kf > ke or (kf == ke and f < e)


@kernel_factory
def _route_kernel(n_experts: int, n_group: int, threads: int, softmax: bool):
    group_size = n_experts // n_group

    @kernel
    def route_rows(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling,
                   out_idx, out_w):
        """One block per token, rules of reference.route_from_logits.  Ranks are counted
        (rank(e) = #experts that beat e), which is exact, order-free and tie-deterministic."""
        score = cuda.shared.array(n_experts, np.float32)
        key = cuda.shared.array(n_experts, np.float32)
        chosen = cuda.shared.array(n_experts, np.int32)
        group_score = cuda.shared.array(n_group, np.float32)
        group_kept = cuda.shared.array(n_group, np.int32)
        picked = cuda.shared.array(n_experts, np.float32)
        tree = cuda.shared.array(threads, np.float32)
        row = cuda.blockIdx.x
        t = cuda.threadIdx.x

        if softmax:   # s = exp(l - max) / sum, both reductions as shared-memory trees
            top = -np.inf
            for e in range(t, n_experts, threads):
                top = max(top, logits[row, e])
            tree[t] = top
            tree_reduce(tree, t, threads, True)
            top = tree[0]
            cuda.syncthreads()
            part = np.float32(0.0)
            for e in range(t, n_experts, threads):
                z = math.exp(logits[row, e] - top)
                score[e] = z
                part += z
            tree[t] = part
            tree_reduce(tree, t, threads, False)
            total = tree[0]
            for e in range(t, n_experts, threads):
                score[e] = score[e] / total
        else:
            for e in range(t, n_experts, threads):
                score[e] = np.float32(1.0) / (np.float32(1.0) + math.exp(-logits[row, e]))
        cuda.syncthreads()
        for e in range(t, n_experts, threads):
            key[e] = score[e] + bias[e] if has_bias else score[e]
        cuda.syncthreads()

        if n_group > 1:
            for g in range(t, n_group, threads):
                first = -np.inf
                second = -np.inf
                for e in range(g * group_size, (g + 1) * group_size):
                    v = key[e]
                    if v > first:
                        second = first
                        first = v
                    elif v > second:
                        second = v
                group_score[g] = first if softmax else first + second
            cuda.syncthreads()
            for g in range(t, n_group, threads):
                rank = 0
                for f in range(n_group):
                    if _key_beats(group_score[f], f, group_score[g], g):
                        rank += 1
                group_kept[g] = 1 if rank < topk_group else 0
            cuda.syncthreads()
            for e in range(t, n_experts, threads):
                if group_kept[e // group_size] == 0:
                    key[e] = -np.inf
            cuda.syncthreads()

        for e in range(t, n_experts, threads):
            rank = 0
            for f in range(n_experts):
                if _key_beats(key[f], f, key[e], e):
                    rank += 1
            chosen[e] = 1 if rank < top_k else 0
        cuda.syncthreads()
        for e in range(t, n_experts, threads):
            if chosen[e] != 0:
                pos = 0
                for f in range(e):
                    pos += chosen[f]
                out_idx[row, pos] = e
                picked[pos] = score[e]
        cuda.syncthreads()
        if t == 0:   # ascending-expert order, one thread: a fixed summation order
            total = np.float32(0.0)
            for j in range(top_k):
                total += picked[j]
            tree[0] = total + np.float32(1e-20) if norm_topk_prob else np.float32(1.0)
        cuda.syncthreads()
        for j in range(t, top_k, threads):
            out_w[row, j] = picked[j] / tree[0] * scaling
    return route_rows


def route_from_logits(logits, bias=None, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                      norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                      scoring: str = "sigmoid", out=None, stream=0, workspace=None):
    """See reference.route_from_logits; returns device arrays (idx int32, weight float32)
    (or fills ``out = (idx, weight)``).

    fp32 throughout (the reference is float64): indices equal the reference's except where two
    keys are within fp32 rounding (~1e-7) of each other; weights within 1e-6 relative."""
    ld = device_f32(logits, "logits", 2, stream)
    m, n_experts = ld.shape
    check_routing_args(n_experts, top_k, n_group, topk_group, scoring)
    has_bias = bias is not None
    bd = device_f32(bias, "bias", 1, stream) if has_bias else placeholder()
    if has_bias and bd.shape[0] != n_experts:
        raise ValueError(f"bias must have {n_experts} entries, got {bd.shape}")
    idx, w = (None, None) if out is None else out
    idx = result_array(idx, (m, top_k), np.int32, stream)
    w = result_array(w, (m, top_k), np.float32, stream)
    if m:
        threads = 32 if SIMULATOR else min(1024, max(32, pow2_ceil(n_experts)))
        _route_kernel(n_experts, n_group, threads, scoring == "softmax")[m, threads, stream](
            ld, bd, has_bias, top_k, topk_group, bool(norm_topk_prob),
            np.float32(routed_scaling_factor), idx, w)
    return idx, w


def moe_route(h, gate_w, bias=None, *, method: str = "auto", out=None, stream=0,
              workspace=None, **routing):
    """See reference.moe_route: fp32 router logits (:func:`linear` with ``method``) then
    route_from_logits."""
    logits = workspace_buffer(workspace, "route.logits", (h.shape[0], gate_w.shape[0]), np.float32,
                     stream)
    linear(h, gate_w, out=logits, method=method, stream=stream, workspace=workspace)
    return route_from_logits(logits, bias, out=out, stream=stream, workspace=workspace,
                             **routing)

"""MoE routing on the GPU: ``router_logits``, ``route_from_logits``, ``moe_route`` (re-exported
by layers/moe.py, whose ``moe_ffn`` takes the routing they give).

Twin: reference/layers/moe.py (the routing rules are its docstring).  Design and tolerances:
docs/LAYERS.md.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.compat import SIMULATOR, cuda, device_function, kernel, kernel_factory
from kdtree_numba.gpu.reduce import tree_reduce
from kdtree_numba.layers.common import CHUNK, pow2_ceil, takes_tiled
from kdtree_numba.layers.linear import linear, mma_takes
from kdtree_numba.layers.skinny import (ROWS_UNROLL, SkinnyConfig, make_skinny_block,
                                        skinny_config)
from kdtree_numba.layers.workspace import (device_f32, device_weight, kernel_weight,
                                           load_kind_for, placeholder, result_array,
                                           workspace_buffer)
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
    route_row = _make_route_row(n_experts, n_group, threads, softmax)

    @kernel
    def route_rows(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling,
                   out_idx, out_w):
        """One block per token (:func:`_make_route_row`)."""
        route_row(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling, out_idx,
                  out_w, cuda.blockIdx.x)
    return route_rows


def _make_route_row(n_experts: int, n_group: int, threads: int, softmax: bool):
    """``route_row(logits, ..., out_w, row)``: token ``row``'s routing by the whole block
    (``threads`` threads), rules of reference.route_from_logits."""
    group_size = n_experts // n_group

    @device_function(inline="always")
    def route_row(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling,
                  out_idx, out_w, row):
        """Ranks are counted (rank(e) = #experts that beat e), which is exact, order-free and
        tie-deterministic."""
        score = cuda.shared.array(n_experts, np.float32)
        key = cuda.shared.array(n_experts, np.float32)
        chosen = cuda.shared.array(n_experts, np.int32)
        group_score = cuda.shared.array(n_group, np.float32)
        group_kept = cuda.shared.array(n_group, np.int32)
        picked = cuda.shared.array(n_experts, np.float32)
        tree = cuda.shared.array(threads, np.float32)
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
    return route_row


@kernel_factory
def _router_route_kernel(cfg: SkinnyConfig, wkind: str, n_experts: int, n_group: int,
                         softmax: bool):
    """``KDTREE_FUSED_ROUTER``: one block per token computes its E router logits with the
    skinny linear's block (``cfg``: one x row, its tiles of weight rows one after another:
    each logit the bits linear() gives it, which do not depend on the x rows or weight rows a
    block takes), then routes the token as route_rows does, at ``cfg.threads``."""
    route_row = _make_route_row(n_experts, n_group, cfg.threads, softmax)
    logits_block = make_skinny_block(cfg, wkind)
    tiles = -(-n_experts // cfg.rows)

    @kernel
    def router_and_route(h, gate_w, logits3, k8, logits, bias, has_bias, top_k, topk_group,
                         norm_topk_prob, scaling, out_idx, out_w):
        m = cuda.blockIdx.x
        m_total = h.shape[0]
        for tile in range(tiles):       # grid index of (x row m, weight tile): m fastest
            logits_block(h, gate_w, logits3, m_total, n_experts, k8, m_total, 1,
                         tile * m_total + m)
            cuda.syncthreads()          # its logits written; its reduction scratch free
        route_row(logits, bias, has_bias, top_k, topk_group, norm_topk_prob, scaling, out_idx,
                  out_w, m)
    return router_and_route


def route_from_logits(logits, bias=None, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                      norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                      scoring: str = "sigmoid", out=None, stream=0, workspace=None):
    """See reference.route_from_logits; returns device arrays (idx int32, weight float32)
    (or fills ``out = (idx, weight)``).

    fp32 throughout (the reference is float64): indices equal the reference's except where two
    keys are within fp32 rounding (~1e-7) of each other; weights within 1e-6 relative."""
    ld = device_f32(logits, "logits", 2, stream)
    m, n_experts = ld.shape
    bd, idx, w = _routing_arrays(m, n_experts, bias, top_k, n_group, topk_group, scoring, out,
                                 stream)
    if m:
        _route_kernel(n_experts, n_group, _route_threads(n_experts), scoring == "softmax")[
            m, _route_threads(n_experts), stream](
            ld, bd, bias is not None, top_k, topk_group, bool(norm_topk_prob),
            np.float32(routed_scaling_factor), idx, w)
    return idx, w


def _route_threads(n_experts: int) -> int:
    return 32 if SIMULATOR else min(1024, max(32, pow2_ceil(n_experts)))


def _routing_arrays(m, n_experts, bias, top_k, n_group, topk_group, scoring, out, stream):
    """(bias on the device or a placeholder, idx [M, k], weight [M, k]) after the routing
    arguments' checks."""
    check_routing_args(n_experts, top_k, n_group, topk_group, scoring)
    bd = device_f32(bias, "bias", 1, stream) if bias is not None else placeholder()
    if bias is not None and bd.shape[0] != n_experts:
        raise ValueError(f"bias must have {n_experts} entries, got {bd.shape}")
    idx, w = (None, None) if out is None else out
    return (bd, result_array(idx, (m, top_k), np.int32, stream),
            result_array(w, (m, top_k), np.float32, stream))


def moe_route(h, gate_w, bias=None, *, method: str = "auto", out=None, stream=0,
              workspace=None, **routing):
    """See reference.moe_route: fp32 router logits (:func:`linear` with ``method``) then
    route_from_logits; with ``KDTREE_FUSED_ROUTER`` both in one launch where linear() would
    stream a small router's weight (:func:`_fused_router_config`): the same bits."""
    logits = workspace_buffer(workspace, "route.logits", (h.shape[0], gate_w.shape[0]), np.float32,
                     stream)
    fused = runtime.current().fused_router and _fused_router_config(
        h, gate_w, method, routing.get("scoring", "sigmoid"), stream)
    if not fused:
        linear(h, gate_w, out=logits, method=method, stream=stream, workspace=workspace)
        return route_from_logits(logits, bias, out=out, stream=stream, workspace=workspace,
                                 **routing)
    return _fused_route(fused, logits, bias, out=out, stream=stream, **routing)


def _fused_route(fused, logits, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 scoring: str = "sigmoid", out=None, stream=0):
    """route_from_logits' arguments, the logits computed in the same launch
    (_router_route_kernel over :func:`_fused_router_config`'s ``fused``) into ``logits``."""
    (cfg, load_kind, xd, wd), (m, n_experts) = fused, logits.shape
    bd, idx, w = _routing_arrays(m, n_experts, bias, top_k, n_group, topk_group, scoring, out,
                                 stream)
    _router_route_kernel(cfg, load_kind, n_experts, n_group, scoring == "softmax")[
        m, cfg.threads, stream](
        xd, kernel_weight(wd, load_kind), logits.reshape(1, m, n_experts),
        -(-xd.shape[1] // CHUNK), logits, bd, bias is not None, top_k, topk_group,
        bool(norm_topk_prob), np.float32(routed_scaling_factor), idx, w)
    return idx, w


# the largest router (E x D weights) a token's block streams whole under KDTREE_FUSED_ROUTER
# (the demo target's is 8 x 256; Kimi-K2's 384 x 7,168, 11 MB, would take one block ~10 us)
FUSED_ROUTER_ELEMENTS = 1 << 15


def _fused_router_config(h, gate_w, method: str, scoring: str, stream):
    """(SkinnyConfig, load kind, h, gate_w on the device) of the fused router's block, or None
    where moe_route keeps its two launches: linear() would not stream the weight (the
    tiled or tensor-core kernels: other bits), the router is past FUSED_ROUTER_ELEMENTS, or a
    softmax's block sums would run at other threads than route_rows' (other bits)."""
    if len(gate_w.shape) != 2 or gate_w.shape[0] * gate_w.shape[1] > FUSED_ROUTER_ELEMENTS:
        return None         # (before any conversion: Kimi-K2's router, at every call)
    xd = device_f32(h, "h", 2, stream)
    wd, kind = device_weight(gate_w, stream)
    (m, k), n = xd.shape, wd.shape[0]
    if m == 0 or wd.shape[1] != k:
        return None
    skinny = (method == "skinny" or (method == "auto" and not takes_tiled(m, n * k))
              or (method == "tensor-cores" and not mma_takes(xd, wd, kind)))
    if not skinny:
        return None
    base = skinny_config(m, n, k, kind)
    rows, unroll = next((r, u) for r, u in ROWS_UNROLL[1] if r <= max(1, min(n, base.threads)))
    cfg = dataclasses.replace(base, mt=1, rows=rows, unroll=unroll, x_major=False)
    if scoring == "softmax" and cfg.threads != _route_threads(n):
        return None
    return cfg, load_kind_for(kind, k, xd, wd), xd, wd

"""Shared by tests/test_w4a16.py (simulator) and tests/test_w4a16_gpu.py (Kimi widths): int4
expert cases and the derived error bound of the W4A16 MoE against the float64 reference.

The bound (first order in the unit roundoff u = 2^-24; the kernels accumulate in float32):
* one int4 GEMM output over K inputs: 8-weight partial sums (8 roundings with the products),
  one scaled add each, then K/8 such terms summed in whatever order the block uses:
  |err| <= (K/8 + 10) u sum |x||w| (=: g4(K) times the absolute dot);
* a float/bf16 GEMM output (the shared expert): |err| <= (K + 2) u sum |x||w| (any order);
* act = silu(g) u: |silu'| <= 1.1 and |silu(g)| <= |g|, silu's exp and division a few u:
  |err(act)| <= (2.1 g(D) + 8u) G U, G and U the absolute dots of gate and up;
* y = sum_j w_j down_j act_j (+ shared): |err| <= (2.1 g(D) + g(I) + (k + 10) u) x
  sum_j |w_j| |down_j| G U, and G U <= 2 silu(G) U for G >= 0 (sigmoid >= 1/2): so twice
  the reference MoE over absolute values bounds the magnitude.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np

from formats.int4_group import Int4GroupWeight
from test_layers import moe_case

U32 = 2.0 ** -24
BF16 = ml_dtypes.bfloat16


def g_int4(k: int) -> float:
    return (k / 8 + 10) * U32


def g_dense(k: int) -> float:
    return (k + 2) * U32


def swiglu_abs(x, gate_up, down):
    """|down| (silu(G) U) over absolute values, float64, rows of x: the magnitude one expert
    contributes (gate_up [2I, D], down [D, I] as float64 arrays)."""
    inter = down.shape[1]
    g = np.abs(x) @ np.abs(gate_up[:inter]).T
    u = np.abs(x) @ np.abs(gate_up[inter:]).T
    return (g / (1 + np.exp(-g)) * u) @ np.abs(down).T


def moe_bound(h, idx, wt, expert, shared=None):
    """The elementwise bound above.  ``expert(e)`` -> (gate_up, down) float64 of expert e (the
    dequantised int4 weights); ``shared``: (gate_up, down) float64 or None."""
    d = h.shape[1]
    out = np.zeros(h.shape, np.float64)
    inter = None
    for e in np.unique(idx):
        gu, dn = expert(int(e))
        inter = dn.shape[1]
        rows, cols = np.nonzero(idx == e)
        out[rows] += np.abs(wt[rows, cols])[:, None] * swiglu_abs(h[rows], gu, dn)
    top_k = idx.shape[1]
    bound = 2 * (2.1 * g_int4(d) + g_int4(inter or d) + (top_k + 10) * U32) * out
    if shared is not None:
        sgu, sdn = shared
        bound += 2 * (2.1 * g_dense(d) + g_dense(sdn.shape[1]) + 10 * U32) * \
            swiglu_abs(h, sgu, sdn)
    return bound + 1e-30


def int4_case(rng, m, d, n_experts, inter, top_k, group, shared=True):
    """tests/test_layers.py's moe_case (bf16 shared expert) with its routed experts replaced
    by int4-group ones: q uniform on [-8, 7], scales U[0.04, 0.1] (~the bf16 ones' spread)."""
    h, idx, wt, _, _, sgu, sdn = moe_case(rng, m, d, n_experts, inter, top_k, BF16, shared)

    def weight(shape):
        q = rng.integers(-8, 8, shape).astype(np.int8)
        s = rng.uniform(0.04, 0.1, shape[:-1] + (shape[-1] // group,)).astype(BF16)
        return Int4GroupWeight.from_values(q, s, group)
    return h, idx, wt, weight((n_experts, 2 * inter, d)), weight((n_experts, d, inter)), sgu, sdn


@functools.cache
def bench_layers():
    """tools/bench_layers.py as a module: the variant tables its int4 section times
    (INT4_GEMV_VARIANTS, INT4_MMA_TILES), which the tests run before a GPU run times them."""
    path = Path(__file__).resolve().parents[1] / "tools" / "bench_layers.py"
    spec = importlib.util.spec_from_file_location("bench_layers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

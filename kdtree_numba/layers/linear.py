"""``linear``: the dense projection ``y = x w^T``, dispatching to the skinny or the tiled GEMM
(or, on request, the bf16 tensor-core GEMM).

Twin: reference/layers/linear.py.  The kernels are in skinny.py (weight streaming, up to
SKINNY_MAX_M rows), tiled.py / gemm_source.py (register-blocked, above) and mma.py (bf16 tensor
cores, ``method="mma"`` only); this module picks one, launches it and adds the K slices of a
split-K launch in order.  Design and tolerances: docs/LAYERS.md.
"""
from __future__ import annotations

import numpy as np

from kdtree_numba.layers.common import CHUNK, add_splits, takes_tiled
from kdtree_numba.layers import mma_tma
from kdtree_numba.layers.mma import MmaConfig, mma_config, mma_linear
from kdtree_numba.layers.skinny import (SkinnyConfig, skinny_config, skinny_linear_kernel,
                                        swiglu_config)
from kdtree_numba.layers.tiled import TiledConfig, tiled_config, tiled_kernel
from kdtree_numba.layers.workspace import (device_f32, device_weight, kernel_weight,
                                           load_kind_for, result_array, workspace_buffer)

__all__ = ["linear", "skinny_swiglu", "swiglu_fuses", "mma_takes", "METHODS"]

METHODS = ("auto", "skinny", "tiled", "mma", "tensor-cores")


def linear(x, w, *, out=None, method: str = "auto", config=None, stream=0, workspace=None):
    """``y [M, N] = x [M, K] w [N, K]^T`` (see reference.linear).

    ``method``: "skinny" (weight streaming: each weight element read once per ``mt`` rows of
    x), "tiled" (register-blocked shared-memory GEMM: each weight element read once per BM
    rows, BM >= M up to 128), or "auto": skinny up to SKINNY_MAX_M rows, else tiled (a small
    weight at a verify's rows stays skinny: ``common.takes_tiled``).
    ``config`` (a SkinnyConfig or TiledConfig) overrides the kernel shape and with it the
    method.  Both use 16-byte vector loads when K % 8 == 0 and x, w are C-contiguous and
    16-byte aligned, scalar loads otherwise.  Error vs the float64 reference: at most
    (depth + 2) 2^-24 sum_k |x_k w_k|, depth = K/8 + 10 skinny, tiled_depth(K, splits) tiled
    (<= K/8 + 15 for K >= 512) (docs/LAYERS.md).

    ``method="mma"`` (or an MmaConfig): bf16 tensor cores, x rounded to bf16; bf16 weights,
    K % 8 == 0 and C-contiguous 16-byte aligned x and w only (ValueError otherwise); error at
    most mma_error_coefficient(K, splits) sum_k |x_k w_k| (~2^-8 relative).
    ``method="tensor-cores"``: "mma" wherever it can take the operands, else "skinny" at every
    M -- the choice depends on the weight and the layout, never on M, and each kernel gives a
    row the same bits at every M, so the whole option is batch invariant ("auto" is not: its
    skinny and tiled kernels sum in different orders).  "skinny" past 16 rows re-reads the
    weight once per ``mt`` rows: cheap for what takes this path in a bf16 model (the float32
    router), slow for a large float32 weight at large M.  "auto" never picks mma: rounding x
    to bf16 changes the numbers, so it is the model's choice (``make_backend(gemm=...)``).
    """
    xd = device_f32(x, "x", 2, stream)
    wd, kind = device_weight(w, stream)
    (m, k), n = xd.shape, wd.shape[0]
    if len(wd.shape) != 2 or wd.shape[1] != k:
        raise ValueError(f"linear wants x [M, K] and w [N, K], got {xd.shape}, {wd.shape}")
    y = result_array(out, (m, n), np.float32, stream)
    if m == 0 or n == 0:
        return y
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    # "tensor-cores" checks the operands once, here; an explicit "mma" must take them
    chosen = method == "tensor-cores" and config is None and mma_takes(xd, wd, kind)
    if chosen or method == "mma" or isinstance(config, MmaConfig):
        if not chosen:
            _check_mma(xd, wd, kind)
        cfg = config if isinstance(config, MmaConfig) else mma_config(m, n, k)
        tma = mma_tma.planned(cfg)      # the TMA kernel's tiles (sm_90), else cp.async's
        if tma is not None:
            mma_tma.tma_linear(xd, wd, y, tma, stream, workspace)
        else:
            mma_linear(xd, wd, y, cfg, stream, workspace)
        return y
    if method == "tensor-cores":
        method = "skinny"
    tiled = isinstance(config, TiledConfig) or (method == "tiled" and config is None) or (
        method == "auto" and takes_tiled(m, n * k)
        and not isinstance(config, SkinnyConfig))
    load_kind = load_kind_for(kind, k, xd, wd)
    if not tiled:
        cfg = config if isinstance(config, SkinnyConfig) else skinny_config(m, n, k, kind)
        _linear_skinny(xd, wd, load_kind, y, cfg, stream, workspace)
    else:
        cfg = config if isinstance(config, TiledConfig) else tiled_config(m, n, k)
        _linear_tiled(xd, wd, load_kind, y, cfg, stream, workspace)
    return y


def swiglu_fuses(method: str, m: int, gate_up) -> bool:
    """Whether ``linear(x, gate_up, method=method)`` at ``m`` rows streams the weight (the
    skinny kernel), so that :func:`skinny_swiglu` gives its SwiGLU the same bits in one
    launch."""
    n, k = gate_up.shape
    return method == "skinny" or (method == "auto" and not takes_tiled(m, n * k))


def skinny_swiglu(x, gate_up, *, out=None, stream=0):
    """``out [M, I] = silu(x gate^T) * (x up^T)`` for ``gate_up`` [2I, K] (its gate rows, then
    its up rows) in one launch of the skinny kernel: each output's block streams its gate
    and up rows together and applies SwiGLU to the two sums, each the bits
    ``linear(x, gate_up, method="skinny")`` gives (the kernel's shape from ``skinny_config``
    of the whole gate_up, half its rows a block as outputs), so the result is that linear
    followed by the SwiGLU kernel's, one launch and one [M, 2I] buffer fewer."""
    xd = device_f32(x, "x", 2, stream)
    wd, kind = device_weight(gate_up, stream)
    (m, k), two_i = xd.shape, wd.shape[0]
    if len(wd.shape) != 2 or wd.shape[1] != k or two_i % 2:
        raise ValueError(f"skinny_swiglu wants x [M, K] and gate_up [2I, K], got {xd.shape}, "
                         f"{wd.shape}")
    inter = two_i // 2
    y = result_array(out, (m, inter), np.float32, stream)
    if m == 0 or inter == 0:
        return y
    load_kind = load_kind_for(kind, k, xd, wd)
    cfg = swiglu_config(skinny_config(m, two_i, k, kind))
    _linear_skinny(xd, wd, load_kind, y, cfg, stream, None, swiglu=True)
    return y


def mma_takes(xd, wd, kind) -> bool:
    """Whether the bf16 tensor-core kernel takes these device operands: bf16 weights, K % 8
    == 0, C-contiguous and 16-byte aligned."""
    return kind == "bf16" and load_kind_for(kind, xd.shape[1], xd, wd) == "bf16"


def _check_mma(xd, wd, kind):
    if kind != "bf16":
        raise ValueError("linear(method='mma') takes bf16 weights only (ml_dtypes.bfloat16 or "
                         "uint16 bits), got float32; use method='auto'")
    k = xd.shape[1]
    if load_kind_for(kind, k, xd, wd) != "bf16":
        raise ValueError(f"linear(method='mma') needs K % 8 == 0 (got K = {k}) and C-contiguous, "
                         "16-byte aligned x and w; use method='auto'")


def _linear_tiled(xd, wd, load_kind, y, cfg: TiledConfig, stream, workspace):
    (m, k), n = xd.shape, wd.shape[0]
    n_mtiles = -(-m // cfg.bm)
    blocks = n_mtiles * cfg.splits * -(-n // cfg.bn)
    launch = tiled_kernel(cfg, load_kind, "linear")[blocks, cfg.threads, stream]
    wk, kc = kernel_weight(wd, load_kind), -(-k // CHUNK)
    if cfg.splits == 1:
        launch(xd, wk, y, m, n, k, n_mtiles, 1, kc)
        return
    part = workspace_buffer(workspace, "linear.part", (cfg.splits, m, n), np.float32, stream)
    launch(xd, wk, part.reshape(cfg.splits * m, n), m, n, k, n_mtiles, cfg.splits, kc)
    add_splits(part, y, stream)


def _linear_skinny(xd, wd, load_kind, y, cfg: SkinnyConfig, stream, workspace,
                   swiglu: bool = False):
    """The skinny kernel's launch: ``y`` [M, N] = x w^T, or with ``swiglu`` (splits 1) the
    SwiGLU of w's halves, N = w's rows / 2 (:func:`skinny_swiglu`)."""
    (m, k), n = xd.shape, y.shape[1]
    wk = kernel_weight(wd, load_kind)
    n_mchunks = -(-m // cfg.mt)
    blocks = n_mchunks * cfg.splits * -(-n // cfg.rows)
    # the plain kernel's recipe as before (the demo's kernel manifest names it so)
    factory = skinny_linear_kernel(cfg, load_kind, True) if swiglu else \
        skinny_linear_kernel(cfg, load_kind)
    launch = factory[blocks, cfg.threads, stream]
    k8 = -(-k // CHUNK)
    if cfg.splits == 1:
        launch(xd, wk, y.reshape(1, m, n), m, n, k8, n_mchunks, 1)
        return
    part = workspace_buffer(workspace, "linear.part", (cfg.splits, m, n), np.float32, stream)
    launch(xd, wk, part, m, n, k8, n_mchunks, cfg.splits)
    add_splits(part, y, stream)

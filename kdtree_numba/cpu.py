"""The reference backend's float32 mode: the CPU path that pays (``make_backend("reference",
precision="float32")``, kdtree-run's default without a GPU).

The same functions as ``reference.layers`` / ``reference.attention`` (their contracts), in
float32 through BLAS, and **batch invariant**: a token's row gets the same bits whether it is
computed alone (an AR decode, M = 1) or among others (a verify, M = B + 1), so DDTree's greedy
tokens equal AR's on this path as they do on the GPU's tensor-core path.  The float64 reference
stays the contract and the tests' oracle; this mode agrees with it to float32 rounding.

How the invariance is had (OpenBLAS picks its kernel, its small-matrix path and its thread
split by the whole call's shape, so ``x @ w.T`` gives a row other bits at M = 1 than at M = 9;
tests/test_cpu_path.py measures it):

* every GEMM is a stack of fixed-shape products: the rows are padded to a multiple of ``ROWS``
  and multiplied as ``[M / ROWS, ROWS, K] @ [K, N]`` (NumPy calls one BLAS GEMM per block, each
  of the same shape); a row's bits must not depend on its place in the block either, which is
  the BLAS micro-kernel's business: :func:`invariant_block` measures it once a weight shape
  and halves the block where a place disagrees;
* attention scores are computed per query against fixed blocks of ``KEYS`` cache slots, and
  the softmax sums run over each query's key list (the cached prefix, then its visible new
  keys in order) in fixed blocks of ``KEYS`` list positions, added block after block: a tree
  node's list is exactly the list its token has in a decode, so the sums are too;
* norms, RoPE, routing and the experts work row by row (per-row reductions, elementwise math,
  experts in ascending index), so they are invariant by construction.

Prefill rows go through the same code (their bits need not match anything, but one path is
simpler).

A drafter's rows need no invariance (a draft only shapes the tree; every committed token is
the target's), so a DFlash drafter on this path runs :func:`drafter_ops`: its GEMMs on the
weights as stored, weight-side or one GEMV a row (:func:`weight_side_matmul`), and one-GEMM
attention (:func:`dense_mla_attention`).
"""
from __future__ import annotations

import ctypes
import functools
import threading

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba import types
from numba.core.extending import intrinsic

from formats.int4_group import Int4GroupWeight
from kdtree_numba import runtime
from reference import attention as ref_attention
from reference import ddtree as ref_ddtree
from reference import layers as ref_layers
from reference.ddtree.checks import check_topk_args

__all__ = ["ROWS", "KEYS", "blocked_matmul", "blas_threads", "DEFAULT_BLAS_THREADS",
           "DEFAULT_BUDGET", "SAMPLED_DEPTH", "SAMPLED_DRAFT_VOCAB", "DENSE_EXPERTS",
           "drafter_ops", "compile_drafter_kernels", "dense_mla_attention", "topk_logprobs",
           "ARGMAX_TOPK", "weight_side_matmul", "GEMV_ROWS", "Bf16Bits", "PREFILL_ROWS",
           "prefill_ops"]

# OpenBLAS threads for this path unless OPENBLAS_NUM_THREADS says otherwise: one.  Its GEMMs
# are small (a demo decode's largest is 8 x 256 x 8192), and OpenBLAS's threads spin while they
# wait: with 2 cores shared by other jobs a 2-thread GEMM took 21 ms instead of 0.4 ms (docs/
# ENGINE.md, "The CPU path").
DEFAULT_BLAS_THREADS = 1

ROWS = 8        # GEMM row block (invariant_block halves it where the BLAS needs)
KEYS = 64       # attention key block
# kdtree-run's DDTree budget on this path, at any temperature: ROWS - 1 nodes and the root fill
# one GEMM block, so a verify costs about one decode (a 9th row would start a second block);
# at T = 1, with the tree kept to SAMPLED_DEPTH, budget 7 ran 1.15x AR against budget 5's 1.11x
# (docs/ENGINE.md, "The CPU path")
DEFAULT_BUDGET = ROWS - 1
# the deepest draft row a DDTree round reads on this path at T > 0 (steps.tree_depth): at T = 1
# the demo pair commits ~1.7 tokens a round, so nodes past depth 2 are rarely reached; a tree of
# budget 7 kept to depths 1-2 spends them on more depth-1 and depth-2 candidates (tau 1.74
# against 1.71 uncapped on 8 held-out prompts; cap 3: 1.73, cap 1: 1.59) and its drafter block
# is 3 rows, its top-K 2 rows (docs/ENGINE.md, "The CPU path")
SAMPLED_DEPTH = 2
# a DFlash drafter's vocabulary on this path at T > 0, where its bundle ranks the tokens (the
# N most frequent; kdtree_numba/dflash.py): its lm_head, the largest read of a draft, covers
# half the demo's 8,192 rows, which held tau at T = 1 (1.69 either way, 12 held-out prompts)
# while a cut costs T = 0 5-15% of tau, so T = 0 keeps the whole vocabulary (docs/ENGINE.md,
# "The CPU path")
SAMPLED_DRAFT_VOCAB = 4096


def _f32(a) -> np.ndarray:
    if type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous:
        return a                              # the common case, without dtype-name lookups
    if isinstance(a, Int4GroupWeight):        # q * bf16 scale: exact in float32
        return a.dequantize(np.float32)
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    return np.ascontiguousarray(a, dtype=np.float32)


def blocked_matmul(x, wt, rows: int = ROWS) -> np.ndarray:
    """``x [M, K] @ wt [K, N]`` in float32 as ``rows``-row blocks of one shape (module doc)."""
    return _blocked(_f32(x), wt, rows)


def _blocked(x, w, rows: int) -> np.ndarray:
    """``x [..., M, K] @ w [..., K, N]`` (the same leading dims, or none for ``w``) as a stack
    of blocks of :func:`invariant_block` rows: ``[..., M / b, b, K] @ [..., 1, K, N]``."""
    *lead, m, k = x.shape
    b = invariant_block(rows, w)
    pad = -m % b
    if pad:
        x = np.concatenate([x, np.zeros((*lead, pad, k), np.float32)], axis=-2)
    y = np.matmul(x.reshape(*lead, -1, b, k), w[..., None, :, :] if lead else w)
    return y.reshape(*lead, -1, w.shape[-1])[..., :m, :]


_BLOCKS: dict = {}


def invariant_block(rows: int, w) -> int:
    """The GEMM row block to use for ``rows`` against a weight of ``w``'s shape and layout:
    ``rows`` where this BLAS gives a row the same bits in every place of a block, else the
    largest ``rows / 2^i`` that does (1 always does).  Which places agree is the BLAS's
    micro-kernel's business and differs by CPU (docs/ENGINE.md, "Which blocks keep a row's
    bits"), so it is measured, once a shape: ``rows`` copies of two random rows must come
    out as ``rows`` copies of two results."""
    k, n = w.shape[-2:]
    order = "C" if w.strides[-1] == w.itemsize else "F" if w.strides[-2] == w.itemsize else "A"
    key = (rows, k, n, order)
    if key not in _BLOCKS:
        rng = np.random.default_rng(0)
        probe = rng.standard_normal((k, n), dtype=np.float32)
        probe = probe if order == "C" else np.asfortranarray(probe)
        r = rows
        while r > 1:
            x = np.repeat(rng.standard_normal((2, 1, k), dtype=np.float32), r, axis=1)
            y = np.matmul(x, probe)
            if (y == y[:, :1]).all():
                break
            r //= 2
        _BLOCKS[key] = r
    return _BLOCKS[key]


def linear(x, w, rows: int = ROWS) -> np.ndarray:
    """``reference.layers.linear`` in float32, batch invariant (``rows``: the GEMM block)."""
    x, w = np.asarray(x), np.asarray(w)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear wants x [M, K], w [N, K]; got {x.shape}, {w.shape}")
    return blocked_matmul(x, _f32(w).T, rows)


def rmsnorm(x, weight, eps: float) -> np.ndarray:
    """``reference.layers.rmsnorm`` in float32 (a per-row reduction)."""
    x, w = _f32(x), _f32(weight)
    if x.ndim != 2 or w.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm wants x [M, D] and weight [D], got {x.shape}, {w.shape}")
    ms = np.einsum("md,md->m", x, x)[:, None] / np.float32(x.shape[1])
    return w * (x * (np.float32(1.0) / np.sqrt(ms + np.float32(eps))))


def add_rmsnorm(x, delta, weight, eps: float):
    """``reference.layers.add_rmsnorm``: the float32 sum, then :func:`rmsnorm`."""
    s = _f32(x) + _f32(delta)
    return s, rmsnorm(s, weight, eps)


def rope(x, positions, spec) -> np.ndarray:
    """``reference.layers.rope`` with float32 products (angles and cos/sin in float64)."""
    return ref_layers.rotate(_f32(x), positions, spec, np.float32)


def moe_route(h, gate_w, bias=None, *, top_k: int, n_group: int = 1, topk_group: int = 1,
              norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
              scoring: str = "sigmoid"):
    """``reference.layers.moe_route`` on float32 router logits: vectorised over the rows for
    ungrouped sigmoid routing, the reference's own rule row by row otherwise."""
    logits = blocked_matmul(h, _f32(gate_w).T).astype(np.float64)
    e = logits.shape[1]
    if n_group != 1 or scoring != "sigmoid":
        return ref_layers.route_from_logits(
            logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
            scoring=scoring)
    ref_layers.check_routing_args(e, top_k, n_group, topk_group, scoring)
    scores = 1.0 / (1.0 + np.exp(-logits))
    keys = scores + (0.0 if bias is None else np.asarray(bias, np.float64)[None, :])
    ids = np.broadcast_to(np.arange(e), keys.shape)
    chosen = np.sort(np.lexsort((ids, -keys), axis=-1)[:, :top_k], axis=1)
    w = np.take_along_axis(scores, chosen, axis=1)
    if norm_topk_prob:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    return chosen.astype(np.int32), (w * routed_scaling_factor).astype(np.float32)


def _invariant_matmul(x, w) -> np.ndarray:
    return blocked_matmul(x, w.T)


def _prefill_matmul(x, w) -> np.ndarray:
    return blocked_matmul(x, w.T, PREFILL_ROWS)


def _ffn(h, gate_up, down, matmul=_invariant_matmul):
    """The SwiGLU FFN of ``h`` with ``gate_up`` [2I, D] (gate rows first), ``down`` [D, I];
    ``matmul(x, w)`` is ``x @ w.T`` (batch invariant unless the caller says otherwise)."""
    inter = gate_up.shape[0] // 2
    gu = matmul(h, gate_up)
    g = gu[:, :inter]
    return matmul(g / (np.float32(1.0) + np.exp(-g)) * gu[:, inter:], down)


def _dense_experts(h, expert_idx, weight, gate_up, down, rows: int = ROWS):
    """Every row through every expert, two calls (one GEMM over the experts' stacked gate_up
    rows, one batched GEMM for their down projections), then each row's chosen experts added
    in ascending order: for a handful of experts, fewer and larger calls than one expert at a
    time, and each row's bits still depend on that row alone."""
    m, d = h.shape
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    gu = blocked_matmul(h, gate_up.reshape(e * two_i, d).T, rows).reshape(m, e, two_i)
    g = gu[..., :inter]
    act = np.ascontiguousarray((g / (np.float32(1.0) + np.exp(-g)) * gu[..., inter:])
                               .transpose(1, 0, 2))                       # [E, M, I]
    y = _blocked(act, down.transpose(0, 2, 1), rows)                     # [E, M, D]
    rows = np.arange(m)
    out = np.zeros((m, d), np.float32)
    for j in range(expert_idx.shape[1]):          # ascending expert index in every row
        out += weight[:, j:j + 1] * y[expert_idx[:, j], rows]
    return out


DENSE_EXPERTS = 16      # up to this many experts a MoE layer runs them all (_dense_experts)


def moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None, shared_down=None, *,
            rows: int = ROWS):
    """``reference.layers.moe_ffn`` in float32: each token's experts added in ascending
    expert order, then the shared expert (per row, so batch invariant).  A layer of at most
    DENSE_EXPERTS experts runs every expert on every row (_dense_experts), a larger one
    expert by expert: which way depends only on the layer, so decode and verify agree.
    ``rows``: the GEMM row block (PREFILL_ROWS for a prompt's rows: prefill_ops)."""
    if rows not in (ROWS, PREFILL_ROWS):
        raise ValueError(f"rows must be {ROWS} or {PREFILL_ROWS}, got {rows}")
    matmul = _invariant_matmul if rows == ROWS else _prefill_matmul
    if ref_layers.is_dense(expert_idx, weight, gate_up, shared_gate_up):
        return _ffn(_f32(h), _f32(gate_up[0]), _f32(down[0]), matmul)
    h = _f32(h)
    expert_idx, weight = np.asarray(expert_idx), _f32(weight)
    if gate_up.shape[0] <= DENSE_EXPERTS:
        out = _dense_experts(h, expert_idx, weight, _f32(gate_up), _f32(down), rows)
    else:
        out = np.zeros_like(h)
        for e in np.unique(expert_idx):
            tokens, slots = np.nonzero(expert_idx == e)
            out[tokens] += weight[tokens, slots][:, None] * _ffn(
                h[tokens], _f32(gate_up[e]), _f32(down[e]), matmul)
    if shared_gate_up is not None:
        out += _ffn(h, _f32(shared_gate_up), _f32(shared_down), matmul)
    return out


# a prompt's rows (prefill_ops) multiply in blocks of this many: its bits need match no
# decode's, only its own alone or in a batch (model.ForwardBatch, ``prefill``), which any
# fixed block gives; 64 rows pack each weight an eighth as often as ROWS (the demo's
# 256 x 2048 experts at 100 rows: 1.2 ms against 3.9) where the BLAS keeps a row's bits in
# every place of 64 (invariant_block halves it elsewhere)
PREFILL_ROWS = 64


def prefill_ops(ops):
    """The CPU path's ops for a prompt's rows (``Backend.prefill_ops``): ``linear`` and
    ``moe_ffn`` in PREFILL_ROWS blocks (the prefill of a demo prompt of ~100 tokens spent
    ~80% of its time packing weights for 8-row blocks); the rest as ``ops``."""
    return ops.replaced(linear=functools.partial(linear, rows=PREFILL_ROWS),
                        moe_ffn=functools.partial(moe_ffn, rows=PREFILL_ROWS))


def _per_head(x, w):
    """``x [bs, n, H, a] -> [bs, n, H, c]`` with ``w [H, a, c]``: per head, ROWS-row blocks."""
    bs, n, heads, a = x.shape
    m = bs * n
    xh = np.ascontiguousarray(_f32(x).reshape(m, heads, a).transpose(1, 0, 2))
    y = _blocked(xh, w, ROWS)                                          # [H, M, c]
    return np.ascontiguousarray(y.transpose(1, 0, 2)).reshape(bs, n, heads, -1)


def absorb_q(q_nope, kv_b_proj):
    """``reference.attention.absorb_q`` in float32."""
    heads, dn = q_nope.shape[-2], q_nope.shape[-1]
    w_uk, _ = ref_attention.split_kv_b_proj(_f32(kv_b_proj), heads, dn)
    return _per_head(q_nope, np.ascontiguousarray(w_uk))


def apply_uv(u, kv_b_proj, dv: int):
    """``reference.attention.apply_uv`` in float32."""
    heads = u.shape[-2]
    _, w_uv = ref_attention.split_kv_b_proj(_f32(kv_b_proj), heads,
                                            kv_b_proj.shape[0] // heads - dv)
    return _per_head(u, np.ascontiguousarray(w_uv.transpose(0, 2, 1)))


@functools.lru_cache(maxsize=64)
def _after_own(n: int) -> np.ndarray:
    return np.triu(np.ones((n, n), bool), 1)


def _attend(kernel, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, causal: bool):
    """``kernel`` on float32 queries and a float32 cache, ``causal`` checked; a bf16 cache
    (uint16 ckv/kpe) goes to the reference itself."""
    if np.asarray(ckv).dtype == np.uint16:
        return ref_attention.mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau,
                                           causal=causal)
    visible = np.asarray(visible, bool)
    _check_causal(visible, causal)
    return kernel(_f32(q_abs), _f32(q_pe), ckv, kpe, prefix_len, visible, tau)


def _check_causal(visible, causal: bool) -> None:
    """``reference.attention.check_causal`` (its error names the query), after a cheaper
    test that nothing breaks the promise: every verify makes one check a layer (the
    reference's took ~50 us each)."""
    if causal and np.logical_and(visible, _after_own(visible.shape[-1])).any():
        ref_attention.check_causal(visible, causal)


def mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, max_keys=None,
                  prefill=False, causal=False, plans=None):
    """``reference.attention.mla_attention`` in float32, batch invariant (module docstring).
    ``max_keys``, ``prefill`` and ``plans`` (the numba twin's split-plan hints and plan
    cache) change nothing here.  A
    bf16 cache (uint16 ckv/kpe) goes to the reference itself: its per-query loop takes the
    same shapes for a node as for its decode, so it is batch invariant too, only slower."""
    return _attend(_invariant_attention, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau,
                   causal)


def _invariant_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau):
    """Batch invariant attention (module docstring).  Scores and probabilities are kept as
    [n, blocks, H, KEYS] (the score GEMMs' own layout), so each (query, block) GEMM reads a
    contiguous [H, KEYS] operand; a query's list past the shared prefix differs from slot
    order only where the new keys it sees are not its first ones (a tree node's, never a
    decode's or a causal block's): those few positions are written over a copy of the slot
    order (_KeyLists), and the blocks they touch multiply a per-query value block; the others
    share one.  The GEMMs, their operands and the sums' order are those of the per-query
    lists, so a node gets its decode's bits (tests/test_cpu_path.py) and the same bits as
    the per-position gather this replaced (300 random masks, compared once)."""
    bs, n, heads, r = q_abs.shape
    u = np.empty((bs, n, heads, r), np.float32)
    q = np.concatenate([q_abs, q_pe], axis=-1)                      # [bs, n, H, r + dr]
    tau = np.float32(tau)
    width_k = r + kpe.shape[-1]
    for b in range(bs):
        p0 = int(prefix_len[b])
        slots = p0 + n
        lists = _key_lists(visible[b], p0)
        nb = max(-(-slots // KEYS), lists.blocks)
        span = nb * KEYS
        keys = np.empty((span, width_k), np.float32)
        keys[:slots, :r], keys[:slots, r:] = ckv[b, :slots], kpe[b, :slots]
        keys[slots:] = 0                                           # zero rows pad the span
        values = np.empty((span, r + 1), np.float32)               # + a ones column: the sum
        values[:slots, :r] = ckv[b, :slots]
        values[slots:, :r] = 0
        values[:, r] = 1
        # scores against every slot, one fixed-shape GEMM per (query, key block)
        blocks = keys.reshape(nb, KEYS, width_k).transpose(0, 2, 1)
        s = np.matmul(q[b][:, None], blocks[None])                  # [n, nb, H, KEYS]
        s *= tau
        listed = s[:, :lists.blocks]
        if lists.moved is not None:       # list positions that hold another slot's score
            q_of, place, slot = lists.moved
            listed[q_of, place // KEYS, :, place % KEYS] = \
                s[q_of, slot // KEYS, :, slot % KEYS]
        np.copyto(listed, -np.inf, where=lists.past_end)
        top = listed.max(axis=(1, 3), keepdims=True)
        p = np.exp(listed - top)                                    # [n, blocks, H, KEYS]
        # sums over list positions, block after block: the blocks before any moved position
        # share their value blocks (one matmul over them all), the others get a per-query
        # one where a list moves a position in them
        shared = lists.own_blocks[0] if lists.own_blocks else lists.blocks
        y = np.empty((n, lists.blocks, heads, r + 1), np.float32)
        np.matmul(p[:, :shared], values[:shared * KEYS].reshape(shared, KEYS, r + 1),
                  out=y[:, :shared])
        for j in range(shared, lists.blocks):
            block = values[j * KEYS:(j + 1) * KEYS]
            if j in lists.own_blocks:
                # rows past every list's end get p = 0: whatever finite values they hold
                block = _scratch((n, KEYS, r + 1), block[:lists.longest - j * KEYS])
                q_of, place, slot = lists.moved
                here = place // KEYS == j
                block[q_of[here], place[here] % KEYS] = values[slot[here]]
            np.matmul(p[:, j], block, out=y[:, j])
        acc = np.zeros((n, heads, r + 1), np.float32)
        for j in range(lists.blocks):
            acc += y[:, j]
        u[b] = acc[..., :r] / acc[..., r:]
    return u


class _KeyLists:
    """Each query's key list (the cached prefix, then its visible new keys in slot order)
    of a request's ``visible`` [n, n] over ``p0`` cached keys, in KEYS blocks: ``blocks``
    (enough for the ``longest`` list's length), ``past_end`` (bool [n, blocks, 1, KEYS]:
    positions past a list's end), ``moved`` (query, list position, slot) where a list's
    position holds another slot than its own number (None where none does: a decode, a
    causal block) and ``own_blocks``, the blocks such positions fall in."""

    def __init__(self, visible, p0: int):
        n = visible.shape[0]
        counts = visible.sum(axis=1)
        self.blocks = max(1, -(-int(p0 + counts.max()) // KEYS))
        ends = p0 + counts
        self.longest = int(ends.max())
        pos = np.arange(self.blocks * KEYS).reshape(self.blocks, 1, KEYS)
        self.past_end = pos[None] >= ends[:, None, None, None]
        q_of, cols = np.nonzero(visible)               # by query, then key: the list order
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        place = p0 + np.arange(q_of.size) - first[q_of]
        slot = p0 + cols
        keep = place != slot
        self.moved = (q_of[keep], place[keep], slot[keep]) if keep.any() else None
        self.own_blocks = [] if self.moved is None else \
            sorted(set((self.moved[1] // KEYS).tolist()))


_SCRATCH = threading.local()


def _scratch(shape, fill) -> np.ndarray:
    """A float32 array of ``shape`` [n, rows, c] whose first ``len(fill)`` rows hold ``fill``
    (broadcast over n) and the rest finite values of earlier calls (or zeros), in this
    thread's reused memory: a tree's per-query value blocks (~260 KB a layer) allocated
    afresh took ~60 us of page faults each on the 2-core VM, and a list rarely reaches past
    a few rows of its last block.  Valid until the next call."""
    size = int(np.prod(shape))
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.zeros(size, np.float32)
    out = buf[:size].reshape(shape)
    out[:, :len(fill)] = fill
    return out


# a forward's layers see the same visibility: the lists of up to LISTED_QUERIES queries (a
# decode's, a verify's) are made once and kept (up to 16 kinds); a prompt's, made per layer
LISTED_QUERIES = 64
_LISTS: dict = {}


def _key_lists(visible, p0: int) -> _KeyLists:
    if visible.shape[0] > LISTED_QUERIES:
        return _KeyLists(visible, p0)
    key = (p0, visible.shape[0], np.packbits(visible).tobytes())
    got = _LISTS.get(key)
    if got is None:
        if len(_LISTS) >= 16:
            _LISTS.clear()
        got = _LISTS[key] = _KeyLists(visible, p0)
    return got


def dense_mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, max_keys=None,
                        prefill=False, causal=False, plans=None):
    """``reference.attention.mla_attention`` in float32 for rows whose bits need match no
    other call's (a drafter's block, :func:`drafter_ops`): per request one GEMM of all its
    queries against all its keys, the softmax over the whole row.  Not batch invariant."""
    return _attend(_dense_attention, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, causal)


def _dense_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau):
    bs, n, heads, r = q_abs.shape
    u = np.empty((bs, n, heads, r), np.float32)
    for b in range(bs):
        p0 = int(prefix_len[b])
        c, k = ckv[b, :p0 + n], kpe[b, :p0 + n]
        s = (np.matmul(q_abs[b], c.T) + np.matmul(q_pe[b], k.T)) * np.float32(tau)
        s[:, :, p0:] = np.where(visible[b][:, None, :], s[:, :, p0:], -np.inf)
        p = np.exp(s - s.max(axis=2, keepdims=True))
        u[b] = np.matmul(p, c) / p.sum(axis=2, keepdims=True)
    return u


# up to this k the CPU path's top-K takes k argmaxes of a row (topk_logprobs); above it, the
# reference's partition (DEFAULT_BUDGET = 7 is k on this path)
ARGMAX_TOPK = 32


def topk_logprobs(logits, k: int):
    """``reference.ddtree.topk_logprobs`` (its contract: the same ids, lp within
    LP_ATOL/LP_RTOL; in the tests, the same bits) with two passes made cheaper, row by row (a
    row's float64 copy stays in cache): for k <= ARGMAX_TOPK the k best are k argmaxes (each
    the first maximum, the smallest id: the contract's order of ties) instead of
    ``np.partition``, which takes ~5x longer on a row of many equal values (a draft
    vocabulary's masked tokens: kdtree_numba/dflash.py); and exp's argument is clipped at -700
    (NumPy's exp takes a slow path where it underflows; a term of e^-700 vanishes beside the
    row's largest, 1).  Demo rows of 8192, k = 7: ~35 us a row against ~45 (full logits) and
    ~200 (masked)."""
    bs, n_rows, vocab, k = check_topk_args(logits, k)
    if k > ARGMAX_TOPK:
        return ref_ddtree.topk_logprobs(logits, k)
    rows = np.asarray(logits).reshape(bs * n_rows, vocab)
    if not np.isfinite(rows).all():
        raise ValueError("logits must be finite")
    lp = np.empty((bs * n_rows, k), np.float32)
    ids = np.empty((bs * n_rows, k), np.int64)
    for i, row in enumerate(rows):
        work = row.copy()
        for j in range(k):
            ids[i, j] = best = work.argmax()
            work[best] = -np.inf
        row64 = row.astype(np.float64)
        top = row64.max()
        terms = row64 - top
        np.exp(np.maximum(terms, -700.0, out=terms), out=terms)
        lp[i] = (row64[ids[i]] - (top + np.log(terms.sum()))).astype(np.float32)
    return lp.reshape(bs, n_rows, k), ids.astype(np.int32).reshape(bs, n_rows, k)


# drafter rows (weight_side_matmul) up to which one pass over the weight (_rows_gemv: each
# weight row read once for all the rows) beats OpenBLAS (measured, one thread, weights cycled
# through 80 MB, load average ~2, us: 1536 x 256 at 1 / 2 / 3 rows 46 / 58 / 58 against a
# GEMV a row's 48-137 / 150-256 / 247 (the padded GEMM ~180); the draft head 4096 x 256 at
# 2 rows 215 against 452; at 5 rows 173 against 192, at 8 215 against the padded GEMM's 190:
# past 3 rows its dot products' sums cost more than the reads): a DDTree block at T > 0 is 3
# rows (SAMPLED_DEPTH + 1), its head 2, a round's context commit 1-3
GEMV_ROWS = 3


@intrinsic
def _widened(typingctx, w):      # pragma: no cover (compiled)
    """A weight element as float32 inside a compiled loop: a float32 as it is, a uint16 as
    the bf16 whose bits it holds (shifted into a float32's high half: exact)."""
    if w == types.float32:
        return types.float32(w), lambda context, builder, sig, args: args[0]
    if w == types.uint16:
        def codegen(context, builder, sig, args):
            wide = builder.zext(args[0], llvm_ir.IntType(32))
            return builder.bitcast(builder.shl(wide, llvm_ir.Constant(llvm_ir.IntType(32), 16)),
                                   llvm_ir.FloatType())
        return types.float32(w), codegen
    return None


@numba.njit(fastmath=True, nogil=True, cache=False)
def _rows_gemv(w, x, out):     # pragma: no cover (compiled; tests call it through its callers)
    """``out[r] = w @ x[r]`` for the few rows of ``x``, each weight row read once into one
    accumulator a row (2 or 3 rows: one loop over the weight row for all of them); ``w``
    float32 or bf16 bits (uint16, :class:`Bf16Bits`: half the bytes, the same values and
    sums).  fastmath lets LLVM vectorise the dot products (their sums in its order: a
    drafter's rows need no particular bits, and the same inputs give the same ones)."""
    n, k = w.shape
    rows = x.shape[0]
    if rows == 3:
        for i in range(n):
            a0 = a1 = a2 = np.float32(0.0)
            for j in range(k):
                v = _widened(w[i, j])
                a0 += v * x[0, j]
                a1 += v * x[1, j]
                a2 += v * x[2, j]
            out[0, i], out[1, i], out[2, i] = a0, a1, a2
    elif rows == 2:
        for i in range(n):
            a0 = a1 = np.float32(0.0)
            for j in range(k):
                v = _widened(w[i, j])
                a0 += v * x[0, j]
                a1 += v * x[1, j]
            out[0, i], out[1, i] = a0, a1
    else:
        for i in range(n):
            for r in range(rows):
                acc = np.float32(0.0)
                for j in range(k):
                    acc += _widened(w[i, j]) * x[r, j]
                out[r, i] = acc


def compile_drafter_kernels() -> None:
    """Compile :func:`_rows_gemv` for the arrays it is called with (2-D C-contiguous, float32
    or uint16 weights), where a CPU-path drafter is made (kdtree_numba/dflash.py): ~1 s once
    a process, at load rather than inside the first generate.  No on-disk cache (as
    formats/checksum.py): numba refuses at import where it finds no writable cache
    directory."""
    one = np.zeros((1, 1), np.float32)
    for w in (one, np.zeros((1, 1), np.uint16)):
        _rows_gemv(w, one, np.empty((1, 1), np.float32))


class Bf16Bits:
    """The bf16 bit patterns (uint16, half the bytes) of a drafter's float32 weights whose
    values are all bf16 (a bf16 bundle's, widened at load): the GEMV rows of
    :func:`weight_side_matmul` read them instead, the same values, so the same sums.  Made
    once for the weights :meth:`add` is given (kept alive here, so an id names one array);
    any other weight, or one with a value bf16 cannot hold, is read as float32.  The weights
    must not change after :meth:`add` (a model's never do).  On the demo drafter the
    draft's GEMVs read from memory, and half the bytes took them ~465 -> ~260 us a round
    (T = 1, budget 7)."""

    def __init__(self):
        self._bits: dict[int, tuple] = {}

    def add(self, *arrays) -> None:
        for a in arrays:
            if type(a) is not np.ndarray or a.dtype != np.float32 or a.ndim not in (2, 3) \
                    or not a.flags.c_contiguous:
                continue
            wide = a.view(np.uint32)
            if not (wide & np.uint32(0xFFFF)).any():
                self._bits[id(a)] = (a, (wide >> np.uint32(16)).astype(np.uint16))

    def of(self, w):
        """``w``'s bits, or None."""
        got = self._bits.get(id(w))
        return got[1] if got is not None and got[0] is w else None


def weight_side_matmul(x, w, bits=None) -> np.ndarray:
    """``x [M, K] @ w [N, K].T`` for a drafter's rows, on the weight as stored: with at most
    GEMV_ROWS rows one pass over the weight (_rows_gemv, compile_drafter_kernels; over
    ``bits``, ``w``'s bf16 bits, where given); else ``(w @ x_pad.T).T``, the rows padded to
    a multiple of ROWS: with a few rows OpenBLAS runs this faster than ``x @ w.T`` on the
    transposed view or on a contiguous transposed copy, and copies no weight (8 rows, one
    thread, weights cycled through 80 MB: the demo's 8192 x 256 lm_head 0.66 ms against 1.18
    on the view and 0.85 on a copy; 1536 x 256 0.15 against 0.25 and 0.22).  Not batch
    invariant by contract (drafter rows only)."""
    x = _f32(x)
    m, k = x.shape
    if m <= GEMV_ROWS:
        out = np.empty((m, w.shape[0]), np.float32)
        _rows_gemv(w if bits is None else bits, x, out)
        return out
    pad = -m % ROWS
    if pad:
        x = np.concatenate([x, np.zeros((pad, k), np.float32)])
    return np.ascontiguousarray(np.matmul(w, x.T).T[:m])


def _drafter_linear(x, w, bits: Bf16Bits | None = None) -> np.ndarray:
    if np.ndim(w) != 2 or np.ndim(x) != 2 or np.shape(x)[1] != np.shape(w)[1]:
        raise ValueError(f"linear wants x [M, K], w [N, K]; got {np.shape(x)}, {np.shape(w)}")
    return weight_side_matmul(x, _f32(w), None if bits is None else bits.of(w))


def _drafter_moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up=None,
                     shared_down=None, bits: Bf16Bits | None = None) -> np.ndarray:
    """A dense FFN (the DFlash drafter's) by :func:`weight_side_matmul`; a MoE as moe_ffn."""
    if not ref_layers.is_dense(expert_idx, weight, gate_up, shared_gate_up):
        return moe_ffn(h, expert_idx, weight, gate_up, down, shared_gate_up, shared_down)
    gu, dn = _f32(gate_up[0]), _f32(down[0])
    narrow = {}                     # the two weights' bf16 bits, by the arrays _ffn passes
    for w, whole in ((gu, gate_up), (dn, down)):
        got = None if bits is None else bits.of(whole)
        if got is not None:
            narrow[id(w)] = got[0]
    return _ffn(h, gu, dn, lambda x, w: weight_side_matmul(x, w, narrow.get(id(w))))


def drafter_ops(ops, bits: Bf16Bits | None = None):
    """The CPU path's ops for a drafter (kdtree_numba/dflash.py): a draft only shapes the
    tree, every committed token is the target's, so its rows need not be batch invariant:
    ``linear`` and the dense FFN as :func:`weight_side_matmul` on the weights as stored (their
    GEMV rows on ``bits``' bf16 bits where it has a weight's), and
    :func:`dense_mla_attention`; the rest as ``ops``."""
    return ops.replaced(linear=functools.partial(_drafter_linear, bits=bits),
                        moe_ffn=functools.partial(_drafter_moe_ffn, bits=bits),
                        mla_attention=dense_mla_attention)


def _openblas_setters():
    """The ``*openblas_set_num_threads*`` entry points of the OpenBLAS libraries loaded in
    this process (NumPy's wheels bundle one under a prefixed name); Linux only (it reads
    /proc/self/maps), nothing elsewhere."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()
                     and line.split()[-1].startswith("/")}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                found.append(fn)
                break
    return found


def blas_threads(n: int | None = None) -> int | None:
    """Set OpenBLAS's thread count for this process: ``n``, else OPENBLAS_NUM_THREADS when it
    is set (the user's word wins), else DEFAULT_BLAS_THREADS.  Returns the count set, or None
    where no OpenBLAS was found (another BLAS keeps its own setting)."""
    if n is None:
        n = runtime.current().blas_threads or DEFAULT_BLAS_THREADS
    setters = _openblas_setters()
    for fn in setters:
        fn(int(n))
    return int(n) if setters else None

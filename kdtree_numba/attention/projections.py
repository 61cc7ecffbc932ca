"""The per-head projections around absorbed-MLA attention on the device: absorb_q, apply_uv.

The numba twins of reference/attention/projections.py (the contract): ``absorb_q`` folds each
head's W_UK into its query, ``apply_uv`` applies W_UV to the attention output; both read the
weights from HF's ``kv_b_proj`` and run as one small fp32 GEMM per head, batched over heads in
grid.z.  Given :class:`Bf16HeadWeights` instead (:func:`bf16_head_weights`, what
``make_backend(gemm="tensor-cores")`` passes), they run on bf16 tensor cores: one launch of
the linear's mma kernel for all heads (layers/mma.py, ``mma_head_products``), x rounded to
bf16 like every input in that mode.  docs/ATTENTION.md has the family's design.
"""
from kdtree_numba.compat import cuda, kernel, kernel_factory, to_device, SIMULATOR  # noqa: I001

from dataclasses import dataclass

import numpy as np
from numba import float32

from kdtree_numba import compat, runtime
from kdtree_numba.attention.mla import PendingMerge
from kdtree_numba.attention.tiles import ZERO, merged_value, request_keys, splits_with_keys
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.tensorcore import pack_bf16x2

__all__ = ["absorb_q", "apply_uv", "Bf16HeadWeights", "bf16_head_weights"]


# ---------------------------------------------------------------------------------------------
# kv_b_proj's two blocks as bf16 bits, in the layouts the tensor-core product reads
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bf16HeadWeights:
    """W_UK and W_UV of a ``kv_b_proj [H*(dn+dv), r]`` as bf16 bits (uint16 device arrays),
    each head's matrix with its reduction axis contiguous, as the mma kernel stages it:
    ``w_uk_t [H*r, dn]`` (row h r + j = column j of W_UK[h], for absorb_q) and ``w_uv [H*dv, r]``
    (W_UV[h]'s rows, for apply_uv)."""
    w_uk_t: object
    w_uv: object
    heads: int
    dn: int
    dv: int
    r: int


@kernel
def _split_kv_b_bf16(kv_b, per_head, dn, w_uk_t, w_uv):
    """kv_b [H*per_head, r] float32 -> w_uk_t [H*r, dn], w_uv [H*(per_head-dn), r] bf16 bits
    (round to nearest even), one element per thread."""
    i = cuda.grid(1)
    r = kv_b.shape[1]
    if i < kv_b.shape[0] * r:
        row, j = i // r, i % r
        h, k = row // per_head, row % per_head
        bits = np.uint16(pack_bf16x2(kv_b[row, j], ZERO) & 0xFFFF)
        if k < dn:
            w_uk_t[h * r + j, k] = bits
        else:
            w_uv[h * (per_head - dn) + k - dn, j] = bits


def bf16_head_weights(kv_b_proj, heads: int, dn: int, stream=0) -> Bf16HeadWeights:
    """``kv_b_proj [H*(dn+dv), r]`` (float32) as :class:`Bf16HeadWeights`, rounded to bf16 (to
    nearest even: exact for the bf16 checkpoints these models ship).  One launch; call it once
    per weight, outside any CUDA-graph capture (the backend does so on first use)."""
    rows, r = kv_b_proj.shape
    per_head = rows // heads if heads else 0
    if not heads or rows % heads or per_head <= dn:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dn={dn}")
    dv = per_head - dn
    if dn % 8 or r % 8:          # both reductions (dn, r) in whole 16-byte chunks of bf16
        raise ValueError(f"the tensor-core head product needs dn and r multiples of 8, got "
                         f"dn={dn}, r={r}")
    w = to_device(_f32(kv_b_proj), stream)
    w_uk_t = compat.device_empty((heads * r, dn), np.uint16, stream)
    w_uv = compat.device_empty((heads * dv, r), np.uint16, stream)
    threads = 256
    _split_kv_b_bf16[-(-rows * r // threads), threads, stream](w, np.int64(per_head),
                                                               np.int64(dn), w_uk_t, w_uv)
    return Bf16HeadWeights(w_uk_t, w_uv, heads, dn, dv, r)


# ---------------------------------------------------------------------------------------------
# absorb_q / apply_uv: one small GEMM per head, batched over heads in grid.z
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GemmTile:
    tm: int
    tn: int
    tk: int
    ty: int
    tx: int


def _gemm_tile():
    return _GemmTile(8, 8, 4, 4, 4) if SIMULATOR else _GemmTile(64, 64, 16, 16, 16)


@kernel_factory
def _head_gemm_kernel(tile: _GemmTile, b_transposed: bool):
    """C[m, h*c_hs + col] = sum_k A[m, h*a_hs + k] * B_h[k, col] for every head h = blockIdx.z.

    B_h[k, col] = B[h*b_hs + b_off + k, col], or B[h*b_hs + b_off + col, k] when transposed.
    Plain fp32 shared-memory tiling; each thread owns a (tm/ty) x (tn/tx) interleaved block.
    """
    TM, TN, TK, TY, TX = tile.tm, tile.tn, tile.tk, tile.ty, tile.tx
    FM, FN = TM // TY, TN // TX
    FMN = FM * FN
    THREADS = TY * TX

    @kernel
    def head_gemm(a, a_hs, bmat, b_hs, b_off, cmat, c_hs, m_size, n_size, k_size):
        a_tile = cuda.shared.array((TK, TM), float32)
        b_tile = cuda.shared.array((TK, TN), float32)
        tid = cuda.threadIdx.x
        ty, tx = tid // TX, tid % TX
        n0, m0, h = cuda.blockIdx.x * TN, cuda.blockIdx.y * TM, cuda.blockIdx.z
        acc = cuda.local.array(FMN, float32)
        for x in range(FMN):
            acc[x] = ZERO
        for k0 in range(0, k_size, TK):
            for f in range(tid, TK * TM, THREADS):
                kk, mm = f % TK, f // TK
                ok = m0 + mm < m_size and k0 + kk < k_size
                a_tile[kk, mm] = a[m0 + mm, h * a_hs + k0 + kk] if ok else ZERO
            for f in range(tid, TK * TN, THREADS):
                if b_transposed:
                    kk, nn = f % TK, f // TK
                else:
                    kk, nn = f // TN, f % TN
                ok = n0 + nn < n_size and k0 + kk < k_size
                if b_transposed:
                    bv = bmat[h * b_hs + b_off + n0 + nn, k0 + kk] if ok else ZERO
                else:
                    bv = bmat[h * b_hs + b_off + k0 + kk, n0 + nn] if ok else ZERO
                b_tile[kk, nn] = bv
            cuda.syncthreads()
            for kk in range(TK):
                for i in range(FM):
                    av = a_tile[kk, ty + TY * i]
                    for j in range(FN):
                        acc[i * FN + j] += av * b_tile[kk, tx + TX * j]
            cuda.syncthreads()
        for i in range(FM):
            for j in range(FN):
                mm, nn = m0 + ty + TY * i, n0 + tx + TX * j
                if mm < m_size and nn < n_size:
                    cmat[mm, h * c_hs + nn] = acc[i * FN + j]

    return head_gemm


# For M <= STREAM_MAX_M rows (decode, verify, small batches; and any M over small head
# weights: streams_heads) the weights are the only large operand and the tiled kernel above is
# latency-bound: a 64-row tile holds few live rows, and
# each of its K steps waits for a global load behind a barrier (over ten times the time of its
# weight bytes).  The streaming kernel below gives each thread one output column of one head for
# a block of up to 16 rows (more rows: more row blocks, which re-read the weights from L2),
# keeps those rows' x in shared memory, and has STREAM_UNROLL weights (64 bytes) in flight per
# thread. Each output is the same fp32 chain as the tiled kernel's, acc += x_k w_k for k
# ascending from zero, so a row's bits do not depend on which kernel M picked: the projections
# stay batch invariant (tests/test_attention_gpu.py compares the two kernels bitwise).  One
# exception, harmless: the tiled kernel also adds the zero products of its padding past K, which
# turns an exact -0 sum into +0 when K % 16 != 0.
STREAM_MAX_M = 64
STREAM_ROWS = 16         # rows per block, at most
# A block re-reads its head's weights (from L2 after the first), so fewer rows a block give
# more blocks and shorter serial chains (a thread's rows x K FMAs) for more weight reads.  At
# the demo model's widths (128 KiB of head weights a call) the chains decide: its 17-row
# verify's per-head products took 8-14 us a launch at 16 rows a block against 2-3 us for a
# decode's one; at Kimi-K2's (16 MiB in float32) the reads do.  So a call takes as few rows a
# block as keep its weight reads within this many bytes (stream_rows); with
# KDTREE_LEAN_ROUND=0 as many rows as M has, up to 16.
STREAM_REREAD_BYTES = 4 << 20


def stream_rows(m: int, weight_bytes: int | None) -> int:
    """Rows of x per streaming block for an M-row call over ``weight_bytes`` of head weights
    (None: no re-reads, the one row block of M's rows): a power of two, at most STREAM_ROWS.
    Any choice gives every row the same bits (each output is one fp32 chain over k
    ascending), so it is free to follow the cost."""
    blocks = 1 if weight_bytes is None else \
        max(1, STREAM_REREAD_BYTES // max(1, int(weight_bytes)))       # row blocks allowed
    rows = -(-int(m) // blocks)
    return min(1 << max(0, (rows - 1).bit_length()), STREAM_ROWS)


STREAM_THREADS = 64
STREAM_UNROLL = 16


def _stream_products(mt: int, k_size: int, b_transposed: bool, vector: bool):
    """``products(xs, bmat, b_hs, b_off, cmat, c_hs, h, m0, m_size, n_size, tid)``: the
    streaming per-head product's body once x (``mt`` rows of K = ``k_size``) is in shared
    memory: thread tid's column of head h for those rows, one fp32 chain over k ascending.
    Both streaming kernels call it, so their outputs have the same bits."""
    from kdtree_numba.gpu.memory import ld_cached_f32x4
    STEP = STREAM_UNROLL                   # k per unrolled step (vector: STEP / 4 loads)
    THREADS = STREAM_THREADS

    @inline_device_function
    def products(xs, bmat, b_hs, b_off, cmat, c_hs, h, m0, m_size, n_size, tid):
        n = cuda.blockIdx.x * THREADS + tid
        if n >= n_size:
            return
        acc = cuda.local.array(mt, float32)
        wv = cuda.local.array(STEP, float32)
        for i in range(mt):
            acc[i] = ZERO
        row = h * b_hs + b_off + n                 # the transposed case's weight row
        k0 = 0
        while k0 < k_size:
            if b_transposed and vector:            # the loads first: all in flight
                for q in range(STEP // 4):
                    k = k0 + 4 * q
                    w0 = w1 = w2 = w3 = ZERO
                    if k < k_size:
                        w0, w1, w2, w3 = ld_cached_f32x4(bmat, row, k)
                    wv[4 * q] = w0
                    wv[4 * q + 1] = w1
                    wv[4 * q + 2] = w2
                    wv[4 * q + 3] = w3
            else:
                for u in range(STEP):
                    k = k0 + u
                    if b_transposed:
                        wv[u] = bmat[row, k] if k < k_size else ZERO
                    else:
                        wv[u] = bmat[h * b_hs + b_off + k, n] if k < k_size else ZERO
            for u in range(STEP):
                k = k0 + u
                if k < k_size:
                    for i in range(mt):
                        acc[i] += xs[i * k_size + k] * wv[u]
            k0 += STEP
        for i in range(mt):
            if m0 + i < m_size:
                cmat[m0 + i, h * c_hs + n] = acc[i]

    return products


@kernel_factory
def _head_stream_kernel(mt: int, k_size: int, b_transposed: bool, vector: bool):
    """The streaming per-head product for ``mt`` rows and K = ``k_size`` (both compile-time:
    x lives in shared memory, the accumulators in registers).  Same contract as
    _head_gemm_kernel's; grid (column blocks, heads, row blocks).  ``vector``: the transposed
    weight rows are read 16 bytes at a time (K % 4 == 0, rows 16-byte aligned)."""
    XS = mt * k_size
    THREADS = STREAM_THREADS
    products = _stream_products(mt, k_size, b_transposed, vector)

    @kernel
    def head_stream(a, a_hs, bmat, b_hs, b_off, cmat, c_hs, m_size, n_size):
        xs = cuda.shared.array(XS, float32)
        tid = cuda.threadIdx.x
        h = cuda.blockIdx.y
        m0 = cuda.blockIdx.z * mt
        for f in range(tid, XS, THREADS):
            mm = f // k_size
            xs[f] = a[m0 + mm, h * a_hs + f - mm * k_size] if m0 + mm < m_size else ZERO
        cuda.syncthreads()
        products(xs, bmat, b_hs, b_off, cmat, c_hs, h, m0, m_size, n_size, tid)

    return head_stream


@kernel_factory
def _merged_uv_kernel(mt: int, k_size: int, vector: bool):
    """apply_uv's streaming kernel reading attention's key splits instead of u
    (``KDTREE_MERGE_IN_UV``): each x element is merged as it is staged (tiles.merged_value,
    the merge kernel's arithmetic), so the merge's launch goes and every output keeps its
    bits.  Row m of x is query i = m % n of request b = m // n, attention row i H + h."""
    XS = mt * k_size
    THREADS = STREAM_THREADS
    products = _stream_products(mt, k_size, True, vector)

    @kernel
    def merged_uv(part_o, part_ml, prefix_len, n, heads, causal, chunk, all_splits, bmat, b_hs,
                  b_off, cmat, c_hs, m_size, n_size):
        xs = cuda.shared.array(XS, float32)
        tid = cuda.threadIdx.x
        h = cuda.blockIdx.y
        m0 = cuda.blockIdx.z * mt
        for f in range(tid, XS, THREADS):
            mm = f // k_size
            m = m0 + mm
            v = ZERO
            if m < m_size:
                b = m // n
                row = (m - b * n) * heads + h
                keys = request_keys(prefix_len[b], n, causal, row, heads)
                v = merged_value(part_o, part_ml, b, row, f - mm * k_size,
                                 splits_with_keys(keys, chunk, all_splits))
            xs[f] = v
        cuda.syncthreads()
        products(xs, bmat, b_hs, b_off, cmat, c_hs, h, m0, m_size, n_size, tid)

    return merged_uv


def stream_vector_loads(b2, k: int) -> bool:
    """Whether the streaming kernel may read kv_b_proj's rows 16 bytes at a time: K % 4 == 0,
    unit column stride, rows a multiple of 16 bytes apart and a 16-byte aligned first element
    (a device view of kv_b_proj can be strided or offset; scalar loads take any layout)."""
    from kdtree_numba.gpu.memory import device_address
    itemsize = np.dtype(b2.dtype).itemsize
    return (k % 4 == 0 and b2.strides[1] == itemsize and b2.strides[0] % 16 == 0
            and device_address(b2) % 16 == 0)


def streams_heads(m: int, weight_bytes: int) -> bool:
    """Whether "auto" runs the per-head products of ``m`` rows over ``weight_bytes`` of head
    weights on the streaming kernel: up to STREAM_MAX_M rows, and at any M where the weights
    are small enough that re-reading them per row block costs less than the tiled kernel's
    latency (at most STREAM_REREAD_BYTES: the demo model's 128 KiB, whose 128-row prefill
    took 26 us a launch on 16 tiled blocks, run 164; Kimi-K2's 16 MiB in float32 keep the
    tiled kernel past 64 rows).  Either kernel gives every row the same bits."""
    return m <= STREAM_MAX_M or weight_bytes <= STREAM_REREAD_BYTES


def _stream_plan(m: int, k: int, weight_bytes: int) -> tuple[int, bool]:
    """(rows a block, whether "auto" streams) of an M-row per-head product over K and
    ``weight_bytes`` of head weights: :func:`streams_heads`, and x's mt x K floats within
    the static 48 KiB of shared memory."""
    mt = stream_rows(m, weight_bytes if runtime.current().lean_round else None)
    return mt, streams_heads(m, weight_bytes) and mt * k * 4 <= 48 * 1024


def _run_head_gemm(a2, a_hs, b2, b_hs, b_off, b_transposed, c2, c_hs, m, n_out, k, heads,
                   stream=0, kernel_kind="auto"):
    """One launch of the per-head product: the streaming kernel where :func:`streams_heads`
    says so (and its x fits the static shared memory), else the tiled one; ``kernel_kind``
    ("stream", "tiled") forces one (tests)."""
    weight_bytes = heads * n_out * k * np.dtype(b2.dtype).itemsize
    mt, stream_ok = _stream_plan(m, k, weight_bytes)
    if kernel_kind == "stream" or (kernel_kind == "auto" and stream_ok):
        if not stream_ok:
            raise ValueError(f"the streaming head kernel takes M <= {STREAM_MAX_M} rows (or "
                             f"head weights of at most {STREAM_REREAD_BYTES} bytes) and "
                             f"{mt} x K floats of x in 48 KiB of shared memory, got M = {m}, "
                             f"K = {k}, {weight_bytes} bytes of head weights")
        vector = b_transposed and stream_vector_loads(b2, k)
        grid = (-(-n_out // STREAM_THREADS), heads, -(-m // mt))
        _head_stream_kernel(mt, k, b_transposed, vector)[grid, STREAM_THREADS, stream](
            a2, np.int64(a_hs), b2, np.int64(b_hs), np.int64(b_off), c2, np.int64(c_hs),
            np.int64(m), np.int64(n_out))
        return
    tile = _gemm_tile()
    grid = (-(-n_out // tile.tn), -(-m // tile.tm), heads)
    _head_gemm_kernel(tile, b_transposed)[grid, tile.ty * tile.tx, stream](
        a2, np.int64(a_hs), b2, np.int64(b_hs), np.int64(b_off), c2, np.int64(c_hs),
        np.int64(m), np.int64(n_out), np.int64(k))


def absorb_q(q_nope, kv_b_proj, *, out=None, stream=0, kernel_kind="auto", config=None):
    """``q_abs[b,i,h,:] = W_UK[h]^T q_nope[b,i,h,:]`` on the device (reference: same name).

    q_nope [bs, n, H, dn] float32, kv_b_proj [H*(dn+dv), r] float32 -> device [bs, n, H, r].
    ``kernel_kind``: "auto" (streaming up to 64 rows or over small head weights, else tiled:
    ``streams_heads``), "stream" or "tiled".
    kv_b_proj as :class:`Bf16HeadWeights`: on bf16 tensor cores (q_nope rounded to bf16;
    ``config``: an ``MmaConfig`` tile, for tests; ``kernel_kind`` is then not used).
    """
    bs, n, heads, dn = q_nope.shape
    if isinstance(kv_b_proj, Bf16HeadWeights):
        return _bf16_head_product(q_nope, kv_b_proj, kv_b_proj.w_uk_t, kv_b_proj.dn,
                                  kv_b_proj.r, out, stream, config)
    return _per_head_product(q_nope, kv_b_proj, dn, kv_b_proj.shape[1], "dn", False, out,
                             stream, kernel_kind)


def apply_uv(u, kv_b_proj, dv, *, out=None, stream=0, kernel_kind="auto", config=None):
    """``o[b,i,h,:] = W_UV[h] u[b,i,h,:]`` on the device (reference: same name).

    u [bs, n, H, r] float32, kv_b_proj [H*(dn+dv), r] float32, dv = v_head_dim
    -> device [bs, n, H, dv].  ``kernel_kind`` as absorb_q's; kv_b_proj as
    :class:`Bf16HeadWeights` (and ``config``) as there, u rounded to bf16.
    """
    if isinstance(u, PendingMerge):
        merged = _merged_apply_uv(u, kv_b_proj, dv, out, stream, kernel_kind)
        if merged is not None:
            return merged
        u = u.materialize(stream=stream)
    if isinstance(kv_b_proj, Bf16HeadWeights):
        if dv != kv_b_proj.dv:
            raise ValueError(f"dv={dv}, but the bf16 head weights hold dv={kv_b_proj.dv}")
        return _bf16_head_product(u, kv_b_proj, kv_b_proj.w_uv, kv_b_proj.r, dv, out, stream,
                                  config)
    return _per_head_product(u, kv_b_proj, u.shape[3], dv, "dv", True, out, stream,
                             kernel_kind)


def _merged_apply_uv(pending, kv_b_proj, dv, out, stream, kernel_kind):
    """apply_uv of attention's unmerged splits in one launch (:func:`_merged_uv_kernel`), or
    None where that kernel does not apply: bf16 head weights, a tiled call (the streaming
    kernel's rule, :func:`streams_heads`), or more than one column block (each would merge
    its rows again)."""
    if kernel_kind not in ("auto", "stream", "tiled"):
        raise ValueError(f"kernel_kind must be auto, stream or tiled, got {kernel_kind!r}")
    bs, n, heads, r = pending.shape
    if isinstance(kv_b_proj, Bf16HeadWeights) or kernel_kind == "tiled":
        return None
    rows, tokens = kv_b_proj.shape[0], bs * n
    if kv_b_proj.shape[1] != r:
        raise ValueError(f"kv_b_proj has {kv_b_proj.shape[1]} columns, attention's output "
                         f"{r}")
    per_head = rows // heads
    if rows % heads or per_head <= dv:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dv={dv}")
    w = to_device(_f32(kv_b_proj), stream)
    mt, stream_ok = _stream_plan(tokens, r, heads * dv * r * np.dtype(w.dtype).itemsize)
    if not stream_ok or dv > STREAM_THREADS:
        return None
    if out is None:
        out = compat.device_empty((bs, n, heads, dv), np.float32, stream)
    plan = pending.plan
    grid = (1, heads, -(-tokens // mt))
    _merged_uv_kernel(mt, r, stream_vector_loads(w, r))[grid, STREAM_THREADS, stream](
        plan.part_o, plan.part_ml, pending.prefix, np.int64(n), np.int64(heads),
        bool(pending.causal), np.int64(plan.chunk), np.int64(plan.splits), w,
        np.int64(per_head), np.int64(per_head - dv), out.reshape(tokens, heads * dv),
        np.int64(dv), np.int64(tokens), np.int64(dv))
    return out


def _bf16_head_product(x, hw, w16, k, n_out, out, stream, config=None):
    """x [bs, n, H, k] float32 times each head's bf16 block of ``w16`` ([H*n_out, k]) on
    tensor cores -> [bs, n, H, n_out] float32."""
    from kdtree_numba.layers.mma import mma_head_products   # layers re-exports this package
    bs, n, heads, width = x.shape
    if heads != hw.heads or width != k:
        raise ValueError(f"input [.., {heads}, {width}] does not fit the bf16 head weights "
                         f"of {hw.heads} heads, width {k}")
    tokens = bs * n
    xd = to_device(_f32(x), stream)
    if not xd.is_c_contiguous():
        raise ValueError("the tensor-core head product stages x by 16-byte copies: it needs a "
                         "C-contiguous x")
    if out is None:
        out = compat.device_empty((bs, n, heads, n_out), np.float32, stream)
    mma_head_products(xd.reshape(tokens, heads, k), heads, w16, n_out, 0,
                      out.reshape(tokens, heads, n_out), stream, config=config)
    return out


def _per_head_product(x, kv_b_proj, k, n_out, part, uv, out, stream, kernel_kind="auto"):
    """The body of absorb_q (``uv`` False: x = q_nope, k = dn, W_UK rows 0 .. dn of each head)
    and apply_uv (``uv`` True: x = u, k = r, the last dv = n_out rows of each head, W_UV,
    read transposed): check that kv_b_proj has H*(dn+dv) rows (``part``, "dn" or "dv", names
    the checked width), stage the inputs and run one GEMM per head into out [bs, n, H, n_out].
    """
    if kernel_kind not in ("auto", "stream", "tiled"):
        raise ValueError(f"kernel_kind must be auto, stream or tiled, got {kernel_kind!r}")
    bs, n, heads = x.shape[:3]
    rows = kv_b_proj.shape[0]
    per_head = rows // heads
    width = n_out if uv else k              # dv or dn: the per-head row block that is read
    if rows % heads or per_head <= width:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, "
                         f"{part}={width}")
    tokens = bs * n
    a2 = to_device(_f32(x), stream).reshape(tokens, heads * k)
    w = to_device(_f32(kv_b_proj), stream)
    if out is None:
        out = compat.device_empty((bs, n, heads, n_out), np.float32, stream)
    b_off = per_head - n_out if uv else 0
    _run_head_gemm(a2, k, w, per_head, b_off, uv, out.reshape(tokens, heads * n_out), n_out,
                   tokens, n_out, k, heads, stream, kernel_kind)
    return out


def _f32(x):
    if compat.is_device_array(x):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"expected float32 device array, got {x.dtype}")
        return x
    return np.ascontiguousarray(x, dtype=np.float32)

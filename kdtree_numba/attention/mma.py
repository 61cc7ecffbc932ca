"""Absorbed-MLA attention on tensor cores: 3xTF32 ``mma.sync``, within the fp32 error bound.

Same contract (reference/attention/mla.py), launch plumbing, split planning and merge as the
FFMA kernel of ffma.py: mla.py's ``MlaAttentionPlan`` builds this kernel for the ``"tf32x3"``
variant, with the tile shape of plan.py's ``MmaTileConfig``; the pieces both
kernels share live in tiles.py.  This module holds only the block kernel.  docs/ATTENTION.md
("The tensor-core kernel") has the design; in short:

* A block of 8 warps owns 64 flattened query-heads of one request and one key split, stages
  the queries in shared memory once and streams 16-key tiles through two ``cp.async`` stages,
  like the FFMA kernel (same shared-memory budget: 64 + 2 x 16 rows of r + dr + 4 floats).
  Blocks of 16 or 32 rows (2 or 4 warps) run the same per-warp code: they spread a small
  problem (a decode's 64 heads) over more SMs and give every row the same bits
  (plan.mma_rows).
* Warp w = RG kh + rg (RG = rows / 16 row groups) owns query rows 16 rg .. 16 rg + 15.
  Scores: it multiplies them with the
  16 keys over column half kh of the r + dr columns (``m16n8k8`` tiles, two key n-tiles), then
  adds the partner warp's half through shared memory; both partners then hold identical scores
  (fp32 addition commutes) and run identical online softmaxes in registers.
* P V: the probabilities stay in registers.  A score tile's accumulator holds keys 2t, 2t + 1 of
  its 8 where an ``m16n8k8`` A fragment wants t, t + 4, so the k order of P V is permuted
  instead: lane t reads value rows 2t and 2t + 1.  The warp accumulates value column half kh
  (256 of 512 columns: 32 n-tiles, 128 fp32 registers per lane), with n-tile j of a 32-column
  group taking columns 4g + j, so each lane's B operands are one 128-bit load per key.
* Every product is 3xTF32: x = hi + lo (``split_tf32_fast``), hi*hi + hi*lo + lo*hi.  Scores
  keep the three partial sums in separate accumulators (three independent mma chains per
  n-tile instead of one three times as long).
* ``fp32_sums``: the tensor core's fp32 accumulation does not round to nearest, so a long
  chain of mma into one accumulator drifts (a few times the FFMA kernels' error, within the
  fp32 bound).  With it, mma chains stop after three 32-column score chunks and at one 8-key
  P V step, and their results are added to fp32 registers with FADD: the FFMA kernels'
  accuracy, at more time.  The package's ``tf32x3`` runs without it (the chains run over the
  whole split); dev/cuda/attention.py keeps the ``tf32x3acc`` layout that sets it.

Tensor cores exist only on the GPU: the simulator runs the FFMA variants instead.
"""
from kdtree_numba.compat import cuda, kernel  # noqa: I001

import math

from numba import float32, uint32

from kdtree_numba.attention.plan import MmaTileConfig
from kdtree_numba.attention.tiles import (NEG_INF, ONE, RESCALE_SLACK, ZERO, block_keys,
                                          block_row0, masked_score, merge_when_last,
                                          row_tile_copier)
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import cp_async_commit, cp_async_wait_all, load_f32x4, store_f32x4
from kdtree_numba.gpu.tensorcore import mma_tf32_m16n8k8, split_tf32_fast
from kdtree_numba.gpu.warp import FULL_MASK

__all__ = ["build_kernel"]


@inline_device_function
def _mma_into(acc, o, a0, a1, a2, a3, b0, b1):
    """acc[o : o + 4] += A B for one m16n8k8 TF32 tile (fragments as in gpu/tensorcore.py)."""
    acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma_tf32_m16n8k8(
        a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])


@inline_device_function
def _split4(hi, lo, at, x0, x1, x2, x3):
    """hi/lo[at : at + 4] = the 3xTF32 splits of x0..x3."""
    hi[at], lo[at] = split_tf32_fast(x0)
    hi[at + 1], lo[at + 1] = split_tf32_fast(x1)
    hi[at + 2], lo[at + 2] = split_tf32_fast(x2)
    hi[at + 3], lo[at + 3] = split_tf32_fast(x3)


def _unrolled_groups(pv_group, groups: int):
    """``pv_tile(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at)``: pv_group for grp = 0 .. groups-1,
    each call with grp a compile-time constant.  A Python-level unroll: NVVM leaves a loop this
    large rolled (with fp32_sums it did), and a rolled loop indexes the accumulator array with a
    variable, which puts all 128 accumulators in local memory."""
    @inline_device_function
    def nothing(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at):
        pass

    def then(previous, grp):
        @inline_device_function
        def step(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at):
            previous(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at)
            pv_group(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at, grp)
        return step

    pv_tile = nothing
    for grp in range(groups):
        pv_tile = then(pv_tile, grp)
    return pv_tile


def build_kernel(cfg: MmaTileConfig):
    """The tensor-core block kernel for one configuration (same arguments as the FFMA one)."""
    cfg.validate()
    M, N, QS = cfg.rows, cfg.keys, cfg.row_stride
    RG = M // 16                          # row groups of 16; warp = RG kh + rg
    HALF = cfg.d // 2                     # score columns per warp
    CHUNKS = HALF // 32                   # 32-column chunks: 4 k-steps of 8 each
    RH = cfg.r // 2                       # value columns per warp
    GROUPS = RH // 32                     # 32-column groups: 4 n-tiles each
    NT = N // 8                           # key n-tiles (scores) = k-steps (P V)
    ACC = GROUPS * 16                     # P V accumulators per lane
    SN = 4 * NT                           # score accumulators per lane (one set)
    FP32_SUMS = cfg.fp32_sums
    CAUSAL = cfg.causal                   # a compile-time constant: one kernel each way
    FUSED_MERGE = cfg.fused_merge         # compiled in: the plain kernel has no such tail
    # never an empty closure cell: kernel_cache.closure_key describes every cell
    merge = merge_when_last(cfg.r, M, cfg.threads, CAUSAL,
                            cfg.smem_bytes() // 4) if FUSED_MERGE else None
    # score chunks per fp32 fold: 3 (chains of 12 k-steps: about the accuracy of folding
    # every chunk with a third of the adds); all chunks without fp32 sums
    FOLD = (3 if CHUNKS % 3 == 0 else 1) if FP32_SUMS else CHUNKS
    Q_OFF, KV_OFF = 0, M * QS
    XCH_OFF = KV_OFF + cfg.stages * N * QS
    copy_keys = row_tile_copier(cfg, N)
    copy_queries = row_tile_copier(cfg, M)

    @inline_device_function
    def score_chunk(s_hh, s_hl, s_lh, a_hi, a_lo, b_hi, b_lo, smem, q_at, k_at):
        """Scores += Q K^T over one 32-column chunk.  Lane (g, t) holds columns 8t .. 8t + 7
        of rows g, g + 8 (A) and of keys g, 8 + g (B); k-step j takes columns 8t + j (the
        fragment's k = t) and 8t + 4 + j (k = t + 4).  A index: 8 * (row half) + column."""
        for h in range(2):
            x0, x1, x2, x3 = load_f32x4(smem, q_at + 8 * h * QS)
            _split4(a_hi, a_lo, 8 * h, x0, x1, x2, x3)
            x0, x1, x2, x3 = load_f32x4(smem, q_at + 8 * h * QS + 4)
            _split4(a_hi, a_lo, 8 * h + 4, x0, x1, x2, x3)
        for nt in range(NT):
            x0, x1, x2, x3 = load_f32x4(smem, k_at + 8 * nt * QS)
            _split4(b_hi, b_lo, 0, x0, x1, x2, x3)
            x0, x1, x2, x3 = load_f32x4(smem, k_at + 8 * nt * QS + 4)
            _split4(b_hi, b_lo, 4, x0, x1, x2, x3)
            for j in range(4):
                _mma_into(s_hh, 4 * nt, a_hi[j], a_hi[8 + j], a_hi[4 + j], a_hi[12 + j],
                          b_hi[j], b_hi[4 + j])
                _mma_into(s_hl, 4 * nt, a_hi[j], a_hi[8 + j], a_hi[4 + j], a_hi[12 + j],
                          b_lo[j], b_lo[4 + j])
                _mma_into(s_lh, 4 * nt, a_lo[j], a_lo[8 + j], a_lo[4 + j], a_lo[12 + j],
                          b_hi[j], b_hi[4 + j])

    @inline_device_function
    def pv_group(acc, p_hi, p_lo, b_hi, b_lo, smem, v_at, grp):
        """acc += P V over the tile's keys, for value column group grp (a compile-time
        constant, see pv_tile).  P (hi/lo) is the softmaxed score accumulator:
        p[4 ks + c] = row g + 8 (c // 2), key 8 ks + 2t + c % 2.  k-step ks pairs fragment
        k = t with key 8 ks + 2t and k = t + 4 with 8 ks + 2t + 1; n-tile j of column group
        grp is columns 32 grp + 4g + j, whose B operands are element j of one float4."""
        for ks in range(NT):
            x0, x1, x2, x3 = load_f32x4(smem, v_at + 8 * ks * QS + 32 * grp)
            _split4(b_hi, b_lo, 0, x0, x1, x2, x3)
            x0, x1, x2, x3 = load_f32x4(smem, v_at + (8 * ks + 1) * QS + 32 * grp)
            _split4(b_hi, b_lo, 4, x0, x1, x2, x3)
            p = 4 * ks
            for j in range(4):
                o = 16 * grp + 4 * j
                if FP32_SUMS:  # this step's three products from zero, then FADD
                    d0, d1, d2, d3 = mma_tf32_m16n8k8(
                        p_lo[p], p_lo[p + 2], p_lo[p + 1], p_lo[p + 3], b_hi[j],
                        b_hi[4 + j], ZERO, ZERO, ZERO, ZERO)
                    d0, d1, d2, d3 = mma_tf32_m16n8k8(
                        p_hi[p], p_hi[p + 2], p_hi[p + 1], p_hi[p + 3], b_lo[j],
                        b_lo[4 + j], d0, d1, d2, d3)
                    d0, d1, d2, d3 = mma_tf32_m16n8k8(
                        p_hi[p], p_hi[p + 2], p_hi[p + 1], p_hi[p + 3], b_hi[j],
                        b_hi[4 + j], d0, d1, d2, d3)
                    acc[o] += d0
                    acc[o + 1] += d1
                    acc[o + 2] += d2
                    acc[o + 3] += d3
                else:
                    _mma_into(acc, o, p_lo[p], p_lo[p + 2], p_lo[p + 1], p_lo[p + 3],
                              b_hi[j], b_hi[4 + j])
                    _mma_into(acc, o, p_hi[p], p_hi[p + 2], p_hi[p + 1], p_hi[p + 3],
                              b_lo[j], b_lo[4 + j])
                    _mma_into(acc, o, p_hi[p], p_hi[p + 2], p_hi[p + 1], p_hi[p + 3],
                              b_hi[j], b_hi[4 + j])

    pv_tile = _unrolled_groups(pv_group, GROUPS)

    @inline_device_function
    def fold_scores(s_sum, s_hh, s_hl, s_lh):
        """s_sum += the three partial products; they restart from zero."""
        for x in range(SN):
            s_sum[x] += s_hh[x] + (s_hl[x] + s_lh[x])
            s_hh[x] = ZERO
            s_hl[x] = ZERO
            s_lh[x] = ZERO

    @inline_device_function
    def quad_max(x):  # over the 4 lanes t of a fragment row
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
        return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))

    @inline_device_function
    def quad_sum(x):
        x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
        return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)

    @inline_device_function
    def finish_row(out, part_o, part_ml, direct, b, split, row, n_rows, m_run, l_run, acc, h,
                   col0, t, writes_ml):
        """Row g + 8h of the lane's accumulators -> u (normalised; one split) or the split's
        partial output, and its (max, sum).  In column group grp the lane holds columns
        col0 + 32 grp + 8t .. + 7 (see pv_tile)."""
        if row < n_rows:
            if direct:
                dst = out[b, row]
                scale = ONE / l_run if l_run > ZERO else ZERO  # sees nothing -> zeros
            else:
                dst = part_o[b, split, row]
                scale = ONE
                if writes_ml:
                    part_ml[b, split, row, 0] = m_run
                    part_ml[b, split, row, 1] = l_run
            for grp in range(GROUPS):
                o = 16 * grp + 2 * h
                col = col0 + 32 * grp + 8 * t
                store_f32x4(dst, col, acc[o] * scale, acc[o + 4] * scale, acc[o + 8] * scale,
                       acc[o + 12] * scale)
                store_f32x4(dst, col + 4, acc[o + 1] * scale, acc[o + 5] * scale,
                       acc[o + 9] * scale, acc[o + 13] * scale)

    @kernel
    def mla_attention_mma(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                          direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        rg, kh = warp % RG, warp // RG
        row0 = block_row0(M, CAUSAL)
        n_rows = n * heads
        b, split, prefix, kbeg, kend = block_keys(prefix_len, n, chunk, CAUSAL,
                                                     row0 + M - 1, heads)
        if kbeg >= kend:  # a split past the request's keys: the merge skips it
            return

        copy_queries(smem, Q_OFF, q_abs, q_pe, b, row0, n_rows, tid)
        copy_keys(smem, KV_OFF, ckv, kpe, b, kbeg, kend, tid)
        cp_async_commit()

        # the lane's two fragment rows g and g + 8 of the warp's 16
        row_a = row0 + 16 * rg + g
        row_b = row_a + 8
        ok_a, ok_b = row_a < n_rows, row_b < n_rows
        query_a, query_b = row_a // heads, row_b // heads

        acc = cuda.local.array(ACC, float32)
        for x in range(ACC):
            acc[x] = ZERO
        s_hh = cuda.local.array(SN, float32)  # partial products since the last fold
        s_hl = cuda.local.array(SN, float32)
        s_lh = cuda.local.array(SN, float32)
        s_sum = cuda.local.array(SN, float32)
        for x in range(SN):  # fold_scores restarts them from zero after every use
            s_hh[x] = ZERO
            s_hl[x] = ZERO
            s_lh[x] = ZERO
        a_hi = cuda.local.array(16, uint32)
        a_lo = cuda.local.array(16, uint32)
        b_hi = cuda.local.array(8, uint32)
        b_lo = cuda.local.array(8, uint32)
        p_hi = cuda.local.array(SN, uint32)
        p_lo = cuda.local.array(SN, uint32)
        m_a = m_b = NEG_INF  # online-softmax state of rows a and b (same in all 4 lanes t
        l_a = l_b = ZERO     # and in the partner warp); l: this lane's keys only

        xch_mine = XCH_OFF + warp * (32 * SN) + lane
        xch_partner = XCH_OFF + (warp ^ RG) * (32 * SN) + lane   # warp = RG kh + rg, RG = 2^i
        stage = 0
        for t0 in range(kbeg, kend, N):
            kv = KV_OFF + stage * (N * QS)
            cp_async_wait_all()
            cuda.syncthreads()  # tile t0 (and the queries) landed; tile t0 - N is consumed
            if t0 + N < kend:   # prefetch the next tile into the other buffer
                copy_keys(smem, KV_OFF + (1 - stage) * (N * QS), ckv, kpe, b, t0 + N, kend,
                          tid)
                cp_async_commit()

            for x in range(SN):
                s_sum[x] = ZERO
            q_at = Q_OFF + (16 * rg + g) * QS + kh * HALF + 8 * t
            k_at = kv + g * QS + kh * HALF + 8 * t
            for _ in range(CHUNKS // FOLD):
                for _ in range(FOLD):
                    score_chunk(s_hh, s_hl, s_lh, a_hi, a_lo, b_hi, b_lo, smem, q_at, k_at)
                    q_at += 32
                    k_at += 32
                fold_scores(s_sum, s_hh, s_hl, s_lh)
            for x in range(SN):  # leave this half's scores for the partner warp
                smem[xch_mine + 32 * x] = s_sum[x]
            cuda.syncthreads()

            # online softmax of both halves' sum, identical in the two partner warps.  The
            # reference point moves only when a score exceeds it by more than RESCALE_SLACK.
            mt_a = mt_b = NEG_INF
            for x in range(SN):
                s = (s_sum[x] + smem[xch_partner + 32 * x]) * tau
                key = t0 + 8 * (x // 4) + 2 * t + x % 2
                if x % 4 < 2:
                    s = masked_score(s, key, kend, prefix, visible, b, ok_a, query_a)
                    mt_a = max(mt_a, s)
                else:
                    s = masked_score(s, key, kend, prefix, visible, b, ok_b, query_b)
                    mt_b = max(mt_b, s)
                s_sum[x] = s
            mt_a, mt_b = quad_max(mt_a), quad_max(mt_b)
            alpha_a = alpha_b = ONE
            if mt_a > m_a + RESCALE_SLACK:  # also the first visible score (m = -inf)
                alpha_a = math.exp(m_a - mt_a)
                m_a = mt_a
            if mt_b > m_b + RESCALE_SLACK:
                alpha_b = math.exp(m_b - mt_b)
                m_b = mt_b
            if cuda.any_sync(FULL_MASK, alpha_a != ONE or alpha_b != ONE):
                for x in range(ACC // 4):
                    acc[4 * x] *= alpha_a
                    acc[4 * x + 1] *= alpha_a
                    acc[4 * x + 2] *= alpha_b
                    acc[4 * x + 3] *= alpha_b
            ms_a = m_a if m_a > NEG_INF else ZERO  # nothing visible yet: all p = 0
            ms_b = m_b if m_b > NEG_INF else ZERO
            sum_a = sum_b = ZERO
            for x in range(SN):
                if x % 4 < 2:
                    p = math.exp(s_sum[x] - ms_a)
                    sum_a += p
                else:
                    p = math.exp(s_sum[x] - ms_b)
                    sum_b += p
                p_hi[x], p_lo[x] = split_tf32_fast(p)
            l_a = l_a * alpha_a + sum_a
            l_b = l_b * alpha_b + sum_b

            pv_tile(acc, p_hi, p_lo, b_hi, b_lo, smem, kv + 2 * t * QS + kh * RH + 4 * g)
            stage = 1 - stage
        cp_async_wait_all()  # nothing may be in flight when the block exits

        # epilogue: normalised u (one split) or the split's partial output and (max, sum)
        l_a, l_b = quad_sum(l_a), quad_sum(l_b)
        writes_ml = kh == 0 and t == 0
        finish_row(out, part_o, part_ml, direct, b, split, row_a, n_rows, m_a, l_a, acc, 0,
                   kh * RH, t, writes_ml)
        finish_row(out, part_o, part_ml, direct, b, split, row_b, n_rows, m_b, l_b, acc, 1,
                   kh * RH, t, writes_ml)
        if FUSED_MERGE:     # the blocks that ran keys count themselves; the last merges
            merge(smem, part_o, part_ml, out, b, row0, n_rows, prefix, n, heads, chunk, tid)

    return mla_attention_mma

"""The FFMA (CUDA-core) block kernel of absorbed-MLA attention: register-blocked mini-GEMMs.

The contract (shapes, dtypes, masking, the empty-row rule) is the docstring of
reference/attention/mla.py; this kernel computes the same thing in float32 on the device.  Its
tile shape comes from plan.py (:class:`~kdtree_numba.attention.plan.TileConfig`, one per layout
of :data:`~kdtree_numba.attention.plan.VARIANTS` that is not the tensor-core one), mla.py
launches it and merges the splits, and the pieces it shares with the tensor-core kernel (mma.py)
live in tiles.py.  docs/ATTENTION.md explains the kernel design and the measured speed; the
short version:

* One block owns a tile of ``rows`` flattened query-heads (row = i*H + h) of one request and one
  *split* (a contiguous range of key slots).  All query-heads of a request share the same keys
  (MQA with one latent head), so the block stages its queries in shared memory once and streams
  key tiles of ``keys`` slots x (r + dr) floats through shared memory with ``cp.async``; with
  two stages the next tile is in flight while the current one is computed.
* Per key tile: scores are a split-K register-blocked mini-GEMM (each lane an ``8 x 4`` block
  over a slice of the 576 columns, fed by 128-bit shared loads, reduce-scattered across lanes
  with shuffles; with ``k_warps = 2`` two warps share an output block and leave two partial
  tiles).  Then the online softmax: in registers where a warp's block spans whole rows
  ("fused"), else ``row_threads`` threads per row add the partial tiles from shared memory.
  Then every thread accumulates its ``rv x 4cv4`` block of the ``rows x r`` output from the
  probabilities and the same key tile (V = the first r columns).
* Long prefixes are split across blocks (flash-decoding): each split writes its unnormalised
  partial output and (reference max, sum); the merge kernel of mla.py combines them.  With one
  split the kernel normalises and writes ``u`` directly.
"""
from kdtree_numba.compat import block_size_options, cuda, kernel  # noqa: I001

import math

from numba import float32, int32

from kdtree_numba.attention.plan import TileConfig
from kdtree_numba.attention.tiles import (NEG_INF, ONE, RESCALE_SLACK, ZERO, block_keys,
                                          block_row0, masked_score, merge_when_last,
                                          row_tile_copier)
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import cp_async_commit, cp_async_wait_all, load_f32x4, store_f32x4
from kdtree_numba.gpu.reduce import make_reduce_scatter, make_row_group_reducers

__all__ = ["build_kernel"]


def build_kernel(cfg: TileConfig):
    """The FFMA (CUDA-core) kernel for one configuration (constants are closed over):
    register-blocked mini-GEMMs, see the module docstring."""
    T, M, N, STAGES = cfg.threads, cfg.rows, cfg.keys, cfg.stages
    CAUSAL = cfg.causal                   # a compile-time constant: one kernel each way
    Q4 = cfg.quads
    QS, ST = cfg.row_stride, cfg.score_stride
    # score phase
    SA, SB, KL, GK, KW = cfg.lane_rows, cfg.lane_keys, cfg.k_lanes, cfg.key_lanes, cfg.k_warps
    KSP = cfg.k_splits
    QPS = -(-Q4 // KSP)                   # column quads per split
    Q_EXACT = Q4 % KSP == 0
    QU = min(cfg.score_unroll, QPS)       # 1 or 2 quads per loop iteration
    RSP, GRD = cfg.row_spread, cfg.row_spread * cfg.row_lanes  # a -> a%RSP + (a//RSP)*GRD
    WPK = T // 32 // KW                   # warps per column split
    WROWS, WKEYS = cfg.warp_rows, cfg.warp_keys
    RTILES = M // WROWS
    SC = SA * SB
    OWN = SC // KL                        # complete scores a lane holds after reduce-scatter
    H1, H2, H3 = [(SC >> (k + 1)) if (1 << k) < KL else 0 for k in range(3)]
    # output phase
    CG, RV, CV4, CLW = cfg.cg, cfg.rv, cfg.cv4, cfg.out_lane_cols
    RG = cfg.rg
    RLW = 32 // CLW
    WR = -(-RG // RLW)
    P_VEC = RV % 4 == 0                   # a thread's probabilities load as float4s
    ACC, KF, PF = RV * CV4 * 4, SB * 4, RV  # register (local) array sizes
    PU = 2 if N % 2 == 0 else 1           # P.V loop unroll
    # softmax.  Fused: a warp's score block spans whole rows (all N keys, one column split),
    # so after the reduce-scatter lane (ks, gk) holds row a = own0 / SB, keys gk*SB + bb, and
    # the softmax runs in registers (row reductions over the GK lanes ks + KL*gk).
    # Otherwise TPR threads per row take keys part + TPR*jj from the partial tiles in smem.
    FUSED = KW == 1 and cfg.warp_keys == N and SC // KL == SB and cfg.row_lanes == 1
    TPR = cfg.row_threads
    RPW = 32 // TPR                       # rows per warp in the separate softmax layout
    KPT = SB if FUSED else N // TPR       # keys per softmax thread
    SK_STEP = 1 if FUSED else TPR         # key distance between them
    # shared memory: queries [M][QS], key tiles STAGES x [N][QS], partial score tiles
    # KW x [N][ST] (tile 0 then holds the probabilities), rescale factors [M], sums [M],
    # simulator-only scratch
    Q_OFF, KV_OFF = 0, M * QS
    PS_OFF = KV_OFF + STAGES * N * QS
    ALPHA_OFF = PS_OFF + KW * N * ST
    L_OFF = ALPHA_OFF + M
    SCR_OFF = L_OFF + M
    if FUSED:
        row_max, row_sum = make_row_group_reducers(GK, KL, SCR_OFF)
    else:
        row_max, row_sum = make_row_group_reducers(TPR, RPW, SCR_OFF)
    reduce_scatter = make_reduce_scatter(SC, KL, SCR_OFF)
    copy_keys = row_tile_copier(cfg, N)
    copy_queries = row_tile_copier(cfg, M)
    FUSED_MERGE = cfg.fused_merge         # compiled in: the plain kernel has no such tail
    # never an empty closure cell: kernel_cache.closure_key describes every cell
    merge = merge_when_last(cfg.r, M, T, CAUSAL, cfg.smem_bytes() // 4) if FUSED_MERGE else None

    QSTEP = 4 * KSP                       # floats between a lane's column quads

    @inline_device_function
    def score_quad(sc, kf, smem, q_at, k_at, col):
        """sc += the lane's block of q k^T over one column quad (q_at, k_at: its offsets)."""
        if Q_EXACT or col < 4 * Q4:
            for bb in range(SB):
                k0, k1, k2, k3 = load_f32x4(smem, k_at + bb * QS)
                kf[4 * bb], kf[4 * bb + 1], kf[4 * bb + 2], kf[4 * bb + 3] = k0, k1, k2, k3
            for a in range(SA):
                q0, q1, q2, q3 = load_f32x4(smem, q_at + (a % RSP + a // RSP * GRD) * QS)
                for bb in range(SB):
                    v = sc[a * SB + bb]
                    v += q0 * kf[4 * bb]
                    v += q1 * kf[4 * bb + 1]
                    v += q2 * kf[4 * bb + 2]
                    v += q3 * kf[4 * bb + 3]
                    sc[a * SB + bb] = v

    @inline_device_function
    def pv_key(acc, pf, smem, p_at, v_at):
        """acc += p[rows] v[columns] for one key (p_at, v_at: offsets of the thread's first)."""
        if P_VEC:
            for a4 in range(RV // 4):
                pf[4 * a4], pf[4 * a4 + 1], pf[4 * a4 + 2], pf[4 * a4 + 3] = \
                    load_f32x4(smem, p_at + 4 * a4)
        else:
            for a in range(RV):
                pf[a] = smem[p_at + a]
        for t in range(CV4):
            v0, v1, v2, v3 = load_f32x4(smem, v_at + 4 * CG * t)
            for a in range(RV):
                p = pf[a]
                x = (a * CV4 + t) * 4
                acc[x] += p * v0
                acc[x + 1] += p * v1
                acc[x + 2] += p * v2
                acc[x + 3] += p * v3

    @kernel(**block_size_options(cfg.threads))
    def mla_attention_tiles(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                            direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        row0 = block_row0(M, CAUSAL)
        n_rows = n * heads
        b, split, prefix, kbeg, kend = block_keys(prefix_len, n, chunk, CAUSAL,
                                                     row0 + M - 1, heads)
        # A split past the request's keys (kbeg >= kend) runs no key tile and writes nothing:
        # the merge skips it.  Not an early return, as the tensor-core kernel has: with one,
        # pipe16x2 (the one layout that spills) as built by nvJitLink 13.0 read a garbage
        # global address in this query copy (CUDA_ERROR_ILLEGAL_ADDRESS), though nothing the
        # return skipped was wrong (docs/HISTORY.md).  The copies
        # stay in bounds either way (rows and key slots clamped, no bytes read past the end).
        has_keys = kbeg < kend

        copy_queries(smem, Q_OFF, q_abs, q_pe, b, row0, n_rows, tid)
        if STAGES == 2:
            copy_keys(smem, KV_OFF, ckv, kpe, b, kbeg, kend, tid)
        cp_async_commit()

        # score phase: lane (ks, gk, gr) of warp (kw, key tile, row tile)
        ks = lane % KL
        gk = lane // KL % GK
        gr = lane // (KL * GK)
        kw = warp // WPK
        srow0 = (warp % WPK % RTILES) * WROWS + gr * RSP
        skey0 = (warp % WPK // RTILES) * WKEYS + gk * SB
        col0 = 4 * (ks + KL * kw)
        own0 = (ks & 1) * H1 + ((ks >> 1) & 1) * H2 + ((ks >> 2) & 1) * H3
        # softmax phase: row srow, keys sk0 + SK_STEP*jj; row_writer: one lane per row
        if FUSED:
            srow = srow0 + own0 // SB
            sk0, row_writer = skey0, gk == 0
        else:
            srow = warp * RPW + lane % RPW
            sk0, row_writer = lane // RPW, lane // RPW == 0
        srow_ok = row0 + srow < n_rows
        squery = (row0 + srow) // heads   # the new-token index whose mask row applies
        # output phase: rows RV*g + a, float4 columns c + CG*t
        g = (warp % WR) * RLW + lane // CLW
        c = (warp // WR) * CLW + lane % CLW
        pv_ok = g < RG and c < CG

        acc = cuda.local.array(ACC, float32)
        for x in range(ACC):
            acc[x] = ZERO
        sc = cuda.local.array(SC, float32)
        kf = cuda.local.array(KF, float32)
        pf = cuda.local.array(PF, float32)
        sv = cuda.local.array(KPT, float32)
        m_run = NEG_INF  # online-softmax state of this thread's softmax row
        l_run = ZERO

        stage = 0
        for t0 in range(kbeg, kend, N):
            kv = KV_OFF + stage * (N * QS)
            if STAGES == 1:
                cuda.syncthreads()  # the previous tile's readers are done with it
                copy_keys(smem, kv, ckv, kpe, b, t0, kend, tid)
                cp_async_commit()
            cp_async_wait_all()
            cuda.syncthreads()  # tile t0 (and the queries) landed; tile t0 - N is consumed
            if STAGES == 2:
                if t0 + N < kend:  # prefetch the next tile into the other buffer
                    copy_keys(smem, KV_OFF + (1 - stage) * (N * QS), ckv, kpe, b, t0 + N,
                              kend, tid)
                    cp_async_commit()

            # scores: sc[a, bb] = q[row a] . k[key bb] over this lane's column quads
            for x in range(SC):
                sc[x] = ZERO
            q_at = Q_OFF + srow0 * QS + col0
            k_at = kv + skey0 * QS + col0
            for j in range(int32(QPS // QU)):
                score_quad(sc, kf, smem, q_at, k_at, col0 + QSTEP * QU * j)
                if QU == 2:
                    score_quad(sc, kf, smem, q_at + QSTEP, k_at + QSTEP,
                               col0 + QSTEP * (QU * j + 1))
                q_at += QU * QSTEP
                k_at += QU * QSTEP
            if QPS % QU:
                score_quad(sc, kf, smem, q_at, k_at, col0 + QSTEP * (QPS - 1))
            reduce_scatter(sc, ks, own0, smem, tid)
            if FUSED:
                for jj in range(KPT):
                    sv[jj] = sc[jj]
            else:  # leave the partial tile, then gather this thread's row from all of them
                for x in range(OWN):
                    a, bb = (own0 + x) // SB, (own0 + x) % SB
                    row = srow0 + a % RSP + a // RSP * GRD
                    smem[PS_OFF + kw * (N * ST) + (skey0 + bb) * ST + row] = sc[x]
                cuda.syncthreads()
                for jj in range(KPT):
                    at = PS_OFF + (sk0 + SK_STEP * jj) * ST + srow
                    s = smem[at]
                    for w in range(1, KW):
                        s += smem[at + w * (N * ST)]
                    sv[jj] = s

            # online softmax: scale and mask sv; probabilities go to partial tile 0.  The
            # reference point m_run moves only when a score exceeds it by more than
            # RESCALE_SLACK, so most tiles skip rescaling the accumulator (p <= e^8 is harmless
            # in float32); every thread of a row keeps the same (m_run, l_run).
            m_tile = NEG_INF
            for jj in range(KPT):
                s = masked_score(sv[jj] * tau, t0 + sk0 + SK_STEP * jj, kend, prefix, visible,
                                 b, srow_ok, squery)
                sv[jj] = s
                m_tile = max(m_tile, s)
            m_tile = row_max(m_tile, smem, tid)
            alpha = ONE
            if m_tile > m_run + RESCALE_SLACK:  # also the first visible score (m_run = -inf)
                alpha = math.exp(m_run - m_tile)
                m_run = m_tile
            m_safe = m_run if m_run > NEG_INF else ZERO  # nothing visible yet: all p = 0
            total = ZERO
            for jj in range(KPT):
                p = math.exp(sv[jj] - m_safe)
                smem[PS_OFF + (sk0 + SK_STEP * jj) * ST + srow] = p
                total += p
            l_run = l_run * alpha + row_sum(total, smem, tid)
            if row_writer:
                smem[ALPHA_OFF + srow] = alpha
            # the barrier also tells whether any row's reference moved (else skip the rescale)
            rescale = cuda.syncthreads_or(int32(alpha != ONE))

            # acc = alpha * acc + P V for rows RV*g + a, columns of c (V = first DV columns)
            if pv_ok:
                if rescale:
                    for a in range(RV):
                        alpha = smem[ALPHA_OFF + RV * g + a]
                        for x in range(CV4 * 4):
                            acc[a * CV4 * 4 + x] *= alpha
                p_at = PS_OFF + RV * g
                v_at = kv + 4 * c
                for j in range(int32(N // PU)):
                    pv_key(acc, pf, smem, p_at, v_at)
                    if PU == 2:
                        pv_key(acc, pf, smem, p_at + ST, v_at + QS)
                    p_at += PU * ST
                    v_at += PU * QS
            stage = 1 - stage if STAGES == 2 else 0
        cp_async_wait_all()  # nothing may be in flight when the block exits

        # epilogue: normalised u (one split) or the split's partial output and (max, sum)
        if row_writer:
            smem[L_OFF + srow] = l_run
            if not direct and srow_ok and has_keys:
                part_ml[b, split, row0 + srow, 0] = m_run
                part_ml[b, split, row0 + srow, 1] = l_run
        cuda.syncthreads()
        if pv_ok and has_keys:
            for a in range(RV):
                row = RV * g + a
                if row0 + row < n_rows:
                    scale = ONE
                    if direct:
                        l_row = smem[L_OFF + row]
                        scale = ONE / l_row if l_row > ZERO else ZERO  # sees nothing -> zeros
                    for t in range(CV4):
                        x = (a * CV4 + t) * 4
                        col = 4 * (c + CG * t)
                        if direct:
                            store_f32x4(out, (b, row0 + row, col), acc[x] * scale,
                                   acc[x + 1] * scale, acc[x + 2] * scale, acc[x + 3] * scale)
                        else:
                            store_f32x4(part_o, (b, split, row0 + row, col), acc[x], acc[x + 1],
                                   acc[x + 2], acc[x + 3])
        if FUSED_MERGE:
            if has_keys:    # the blocks that ran keys count themselves; the last merges
                merge(smem, part_o, part_ml, out, b, row0, n_rows, prefix, n, heads, chunk, tid)

    return mla_attention_tiles

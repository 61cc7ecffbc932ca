"""Absorbed-MLA attention over a bf16 latent cache on Hopper's warpgroup tensor cores (``wgmma``):
the bf16 cache's kernel when ``KDTREE_ATTENTION_WGMMA=1`` (opt-in until a GPU run decides;
issue 38: bf16 decode attention at 31% of HBM, a 4,096-token prefill's attention ~146 TFLOP/s).

Same contract, arguments, split planning and merge as bf16.py's kernel (reference/attention/
mla.py's bf16 paragraph: queries rounded to bf16 once, scores in float32, probabilities rounded
to bf16 for P V and summed as rounded into the denominator, the online softmax in log2 units
with the float32 kernels' slack), so the same error bound; not its bits (its tensor-core k16
sums group other products).  A block is 64 query-head rows (the wgmma's M) and two warpgroups:

* Tiles are bf16 in 64-column panels of 128-byte rows, chunk c of row r at c ^ (r % 8)
  (:func:`swizzled_word`: the 128-byte swizzle wgmma reads through its descriptors), the
  query tile (64 rows) first at a 1,024-byte boundary, then ``stages`` key tiles of ``keys``
  rows, staged by cp.async as bf16.py stages its own (:func:`~kdtree_numba.attention.bf16.
  staging`).
* Scores: warpgroup kh multiplies its half of the d / 16 k16 steps, ``m64n{keys}k16`` with the
  query tile as A and the key tile as B (both K-major), leaves its partial scores in shared
  memory and adds the other half's: both warpgroups then hold the same scores and run the
  same online softmax (float addition commutes, so the same bits).
* P V: warpgroup kh accumulates value columns kh r / 2 .. + r / 2 - 1 (its 64 x r / 2 outputs
  in registers: 128 a thread at Kimi-K2's r = 512), ``m64n{r / 2}k16`` a k16 step of keys, P
  from registers (the score accumulators' layout is the A fragment's: packed to bf16 pairs as
  they stand) and the values as B read N-major from the key tile as it lies (its rows are
  keys: ``wgmma_descriptor_128_n``).
* The queries' st.shared and the keys' cp.async are generic-proxy writes: each thread fences
  them to the async proxy (``fence.proxy.async``) before the barrier after which the wgmma
  reads them.

Under the CUDA simulator the wgmma calls go to ``sim_wgmma`` / ``sim_wgmma_rs`` (the tests'
emulations), so CI runs the index math, staging, masks and softmax.  Design and status:
docs/ATTENTION.md ("The warpgroup kernel").
"""
from kdtree_numba.compat import SIMULATOR, cuda, kernel  # noqa: I001

from numba import float32, uint32

from kdtree_numba.attention.bf16 import (LOG2E, key_ring, quad_sum, row_output,
                                         softmax_step, staging)
from kdtree_numba.attention.plan import Bf16TileConfig
from kdtree_numba.attention.tiles import (NEG_INF, ONE, ZERO, block_keys, block_row0,
                                          seen_new_keys)
from kdtree_numba.gpu.bits import divmod_u32
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import cp_async_wait_all
from kdtree_numba.gpu.tensorcore import (fence_proxy_async, wgmma_bf16, wgmma_bf16_rs,
                                         wgmma_commit, wgmma_descriptor_128,
                                         wgmma_descriptor_128_n, wgmma_fence, wgmma_wait_all)

__all__ = ["build_kernel", "swizzled_word"]


def swizzled_word(rows, row, col):
    """Word of (row, column ``col``) in a tile of ``rows`` rows held as 64-column panels of
    128-byte rows (``((col >> 6) * rows + row) * 32`` words), the row's 16-byte chunk c at
    c ^ (row % 8).  The word holds columns ``col & ~1`` (low half) and ``col | 1``."""
    chunk = (col >> 3) & 7
    return (((col >> 6) * rows + row) << 5) + ((chunk ^ (row & 7)) << 2) + ((col & 7) >> 1)


_swizzled_word = inline_device_function(swizzled_word)


@inline_device_function
def _fragment_key(x, t):
    """The key (from the tile's first) of score accumulator x of lane t: D's column
    8 (x >> 2) + 2t + (x & 1)."""
    return 8 * (x >> 2) + 2 * t + (x & 1)


_describe = inline_device_function(wgmma_descriptor_128)
_describe_n = inline_device_function(wgmma_descriptor_128_n)

if SIMULATOR:
    def _window(smem):
        """smem[0]'s shared address: the simulator's descriptors count from smem[0]."""
        return 0

    def _reciprocal(x):
        return ONE / x
else:
    from numba.cuda import libdevice

    from kdtree_numba.gpu.memory import shared_address

    @inline_device_function
    def _window(smem):
        return shared_address(smem, 0)

    @inline_device_function
    def _reciprocal(x):
        """1 / x by ``div.approx`` (2 ulp, where the bound allows 2^-8): IEEE division is a
        slow-path subroutine call in SASS, and a call anywhere in a kernel serializes its
        wgmma (ptxas C7509)."""
        return libdevice.fast_fdividef(ONE, x)


def build_kernel(cfg: Bf16TileConfig):
    """The warpgroup block kernel for one configuration (bf16.py's kernel's arguments)."""
    cfg.validate()
    if not cfg.wgmma or cfg.frag_queries or cfg.fused_merge:
        # the in-block merge's IEEE division is a subroutine call, which would serialize the
        # wgmma (ptxas C7509): the plan keeps the merge kernel
        raise ValueError(f"the warpgroup kernel takes wgmma tiles in the row layout, without "
                         f"the in-block merge: {cfg}")
    M, N, T = cfg.rows, cfg.keys, cfg.threads      # 64 rows, two warpgroups
    STEPS = cfg.d_pad // 16        # k16 steps of a score; warpgroup kh takes half of them
    HALF = STEPS // 2
    R = cfg.r
    VN = R // 2                    # value columns of a warpgroup
    VATOMS = VN // 64              # ... in 64-column panels
    NS = N // 2                    # score accumulators a thread (m64n{N})
    NO = VN // 2                   # output accumulators a thread (m64n{VN})
    KS = N // 16                   # P V k16 steps of a key tile
    PK = N // 4                    # bf16 probability pairs a thread
    CH, CD = cfg.d_pad // 8, cfg.d // 8
    ROW_WORDS = cfg.row_words
    Q_WORDS, TILE_WORDS = M * ROW_WORDS, N * ROW_WORDS
    Q_PANEL, K_PANEL = M * 128, N * 128            # bytes between a tile's panels
    STAGES = cfg.stages
    CAUSAL = cfg.causal
    stage_keys, zero_padding, stage_queries = staging(cfg, _swizzled_word, _swizzled_word)
    ring_start, ring_wait, ring_prefetch, ring_advance = key_ring(cfg, stage_keys)
    scores = wgmma_bf16(N)
    values = wgmma_bf16_rs(VN, True)
    softmax = softmax_step(NS, NO, 128, _fragment_key)
    target = row_output(_reciprocal)

    @inline_device_function
    def finish_row(out, part_o, part_ml, direct, b, split, row, n_rows, m_run, l_run, acc, h,
                   kh, t, writes_ml):
        """Row g + 8h of the warp's 16 -> u (normalised; one split) or the split's partial
        output and its (max, sum): accumulators 4j + 2h, + 1 are columns kh VN + 8j + 2t,
        + 1."""
        if row < n_rows:
            dst, scale = target(out, part_o, part_ml, direct, b, split, row, m_run, l_run,
                                writes_ml)
            for j in range(NO // 4):
                col = kh * VN + 8 * j + 2 * t
                dst[col] = acc[4 * j + 2 * h] * scale
                dst[col + 1] = acc[4 * j + 2 * h + 1] * scale

    @kernel
    def mla_attention_wgmma(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                            direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, uint32)
        xch = cuda.shared.array(0, float32)     # the same memory: the score exchange's view
        tid = cuda.threadIdx.x
        lane, warp = tid & 31, tid >> 5
        g, t = lane >> 2, lane & 3
        kh, wt = tid >> 7, tid & 127             # warpgroup, thread in it
        row0 = block_row0(M, CAUSAL)
        n_rows = n * heads
        tau2 = tau * LOG2E
        b, split, prefix, kbeg, kend = block_keys(prefix_len, n, chunk, CAUSAL,
                                                  row0 + M - 1, heads)
        if kbeg >= kend:  # a split past the request's keys: the merge skips it
            return

        window = _window(smem)
        q_bytes = (window + 1023) & ~1023        # the tiles at the 128-byte swizzle's period,
        w0 = (q_bytes - window) >> 2             # which wgmma applies to absolute addresses
        kv0 = w0 + Q_WORDS
        kv_bytes = q_bytes + 4 * Q_WORDS
        xch_mine = kv0 + STAGES * TILE_WORDS + kh * (NS * 128) + wt
        xch_other = kv0 + STAGES * TILE_WORDS + (1 - kh) * (NS * 128) + wt
        stage_queries(smem, w0, q_abs, q_pe, b, row0, n_rows, tid)
        if CH > CD:
            zero_padding(smem, kv0, tid)
        lat_src, rope_src = ring_start(smem, kv0, ckv, kpe, b, kbeg, kend, tid)

        row_a = row0 + 16 * (warp & 3) + g      # the thread's fragment rows g and g + 8
        row_b = row_a + 8
        ok_a, ok_b = row_a < n_rows, row_b < n_rows
        query_a, query_b = divmod_u32(row_a, heads)[0], divmod_u32(row_b, heads)[0]
        unmasked_end = min(prefix + seen_new_keys(visible, b, row0, min(row0 + M, n_rows) - 1,
                                                  heads, tid, T), kend)

        acc = cuda.local.array(NO, float32)
        for x in range(NO):
            acc[x] = ZERO
        s = cuda.local.array(NS, float32)
        pk = cuda.local.array(PK, uint32)
        m_a = m_b = NEG_INF  # online-softmax state of rows a and b (same in all 4 lanes t
        l_a = l_b = ZERO     # and in both warpgroups); l: this thread's keys only
        stage = 0
        for t0 in range(kbeg, kend, N):
            ring_wait()
            fence_proxy_async()     # this thread's copies (and queries) -> wgmma's reads
            cuda.syncthreads()      # tile t0 landed; tile t0 - N's products are done
            ring_prefetch(smem, kv0, stage, ckv, kpe, b, t0, kend, tid, lat_src, rope_src)
            k_bytes = kv_bytes + stage * (4 * TILE_WORDS)

            # this warpgroup's half of the scores, then the other half's from shared memory
            for x in range(NS):
                s[x] = ZERO
            wgmma_fence()
            for step in range(kh * HALF, kh * HALF + HALF):
                scores(s, smem, _describe(q_bytes + (step >> 2) * Q_PANEL + 32 * (step & 3)),
                       _describe(k_bytes + (step >> 2) * K_PANEL + 32 * (step & 3)))
            wgmma_commit()
            wgmma_wait_all()
            for x in range(NS):
                xch[xch_mine + 128 * x] = s[x]
            cuda.syncthreads()

            # online softmax of the sum, identical in both warpgroups
            m_a, m_b, l_a, l_b = softmax(s, xch, xch_other, acc, pk, t0, t,
                                         t0 + N <= unmasked_end, tau2, kend, prefix, visible,
                                         b, ok_a, ok_b, query_a, query_b, m_a, m_b, l_a, l_b)

            # P V: k16 step ks takes n-tiles 2 ks and 2 ks + 1 of P as the A fragment
            wgmma_fence()
            for ks in range(KS):
                values(acc, smem, pk[4 * ks], pk[4 * ks + 1], pk[4 * ks + 2], pk[4 * ks + 3],
                       _describe_n(k_bytes + kh * VATOMS * K_PANEL + ks * 2048, K_PANEL))
            wgmma_commit()
            # waited here: leaving it to run under the next tile's scores (acc and pk kept
            # until their wait, the prefetch after it) spilled 160 bytes at the register
            # ceiling and ran 1.5x slower (run 205)
            wgmma_wait_all()
            stage = ring_advance(stage)
        cp_async_wait_all()  # nothing may be in flight when the block exits

        l_a, l_b = quad_sum(l_a), quad_sum(l_b)
        writes_ml = kh == 0 and t == 0
        finish_row(out, part_o, part_ml, direct, b, split, row_a, n_rows, m_a, l_a, acc, 0,
                   kh, t, writes_ml)
        finish_row(out, part_o, part_ml, direct, b, split, row_b, n_rows, m_b, l_b, acc, 1,
                   kh, t, writes_ml)

    return mla_attention_wgmma

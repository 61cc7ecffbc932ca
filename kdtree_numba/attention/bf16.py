"""Absorbed-MLA attention over a bf16 latent cache, on bf16 tensor cores (``mma.sync m16n8k16``).

The kernel behind ``mla_attention`` when the cache (``ckv``, ``kpe``) holds bf16 bit patterns
(uint16): same contract (reference/attention/mla.py, whose bf16 paragraph says what is rounded),
launch plumbing, split planning and merge as the float32 kernels; mla.py's ``MlaAttentionPlan``
builds it with the tile shape of plan.py's :class:`~kdtree_numba.attention.plan.
Bf16TileConfig`.  Half the bytes of a float32 cache per key, and one bf16 product per
multiply-add where the float32 cache's tensor-core kernel (mma.py) needs three TF32 ones at
half the k depth.  docs/ATTENTION.md ("The bf16 cache") has the design, the error bound and
the measurements.  In short:

* The queries (float32) are rounded to bf16 once per block, to nearest even, as they are
  staged; the keys arrive as bf16 by ``cp.async``.  Scores accumulate in float32 on the tensor
  cores; the probabilities are rounded to bf16 for P V, and the softmax denominator sums those
  rounded values, so a row's output is an exact convex combination of the value rows with
  weights within 2^-8 (relative) of the true ones.  The online softmax runs in log2 units
  (scores times tau log2 e, ``exp2``: one instruction where ``exp`` takes several); the
  partial maxima go to the merge in natural units.
* Warp roles are the tensor-core kernel's: a block has ``rows / 16`` row groups, two warps each
  (w = RG kh + rg): warp (rg, kh) scores its 16 rows against the tile's keys over column half
  kh, adds the partner's half through shared memory (both then hold identical scores and run
  identical online softmaxes), and accumulates value column half kh (256 of 512 columns: 32
  n-tiles, 128 float32 accumulators a lane).
* Tiles are bf16 in 32-column panels, 16 words (64 bytes) a row; the 16-byte chunks of a row
  are swizzled by bit 1 of the row (:func:`tile_word`), a key tile's by bits 1-2 under
  ``ldsm_values`` (:func:`key_word`).  Scores: per panel, lane (g, t) loads
  words 4t .. 4t + 3 of query rows g and g + 8 and of one key row per n-tile, one 128-bit load
  each, which feed both k16 steps of the panel (the k order inside a panel is permuted the same
  way for both operands, as in the bf16 GEMM, layers/mma.py).
* The key of score column n of an n8 tile is tile row :func:`key_row` (n), not n: the P V step
  needs, as its B operand, two keys of one value column in one register.  In the package's
  layout (``ldsm_values``) ``ldmatrix.x4.trans`` delivers them: its matrix rows are a k16
  step's keys in the P fragment's order (:func:`ldsm_value_word`), n-tile j of a 64-column
  value group is its 8 consecutive columns 8j .. 8j + 7, and :func:`key_word`'s two-bit
  swizzle keeps a matrix's 8 rows free of bank conflicts (and the score loads).  With
  ``ldsm_values`` off, lane (g, t) builds them from 128-bit loads of key rows key_row(2t) and
  key_row(2t + 1) (8 columns each) paired by byte permutes, 128 a tile; this row order makes
  those loads conflict free under :func:`tile_word`, and n-tile j takes columns 8g + j.
  Either way an output element has the same products in the same order (only the n-slot
  that holds it moves): the same bits.

Four layout switches of :class:`~kdtree_numba.attention.plan.Bf16TileConfig` change how the
operands reach the mma, never which values or in what order, so every layout gives the same
bits (plan.BF16_LAYOUTS; issue 38, decode at 29% of HBM).  The package's layout has
``ldsm_values`` on (the faster verify: docs/ATTENTION.md, "The bf16 cache") and the other
three off.  ``frag_queries``: the query tile in A-fragment order (:func:`query_word`), so
that lane (g, t)'s one 128-bit load per k16 step is the mma's A operand as it stands, where
the row layout's two loads (rows g and g + 8) must be interleaved into it; in the row
layout's sm_90 code that interleave took 240 register moves a tile and warp, more than the 72
mma and 54 loads of the scores.  ``lean_staging``: a tile whose keys all lie before the
split's end is copied without the per-chunk clamp and size select, one 64-bit add per chunk
(the row layout's staging: 186 instructions for 9 copies).  ``stages`` 3: a ring of three
key buffers, two tiles in flight during a tile's compute (``cp.async.wait_group 1``).
``ldsm_values``: the P V B operands by ``ldmatrix.x4.trans`` rather than byte permutes (the
bullet above).

Under the CUDA simulator the mma is ``block_uniform_mma_bf16``'s emulation (every warp of a
block issues the same mma sequence here), so CI runs this kernel's index math and softmax.
"""
from kdtree_numba.compat import SIMULATOR, cuda, kernel  # noqa: I001

import math

import numpy as np
from numba import float32, int32, uint32

from kdtree_numba.attention.plan import Bf16TileConfig
from kdtree_numba.attention.tiles import (NEG_INF, ONE, RESCALE_SLACK, ZERO, block_keys,
                                          block_row0, masked_score, merge_when_last,
                                          seen_new_keys)
from kdtree_numba.gpu.llvm import inline_device_function
from kdtree_numba.gpu.memory import (cp_async_commit, cp_async_wait_1, cp_async_wait_all,
                                     ld_shared_words4, load_f32x4, store_f32x4)
from kdtree_numba.gpu.bits import bf16_hi, bf16_lo, pair_high_halves, pair_low_halves
from kdtree_numba.gpu.tensorcore import block_uniform_mma_bf16, pack_bf16x2
from kdtree_numba.gpu.warp import shfl_xor, warp_any

__all__ = ["build_kernel", "key_row", "tile_word", "key_word", "query_word",
           "ldsm_value_word", "staging", "key_ring", "softmax_step", "quad_max",
           "quad_sum", "row_output", "LOG2E", "LN2"]


def key_row(n):
    """Tile row of score column n (0..7) of an n8 tile: 2i -> i, 2i + 1 -> 4 + (i ^ 1).

    Lane (g, t) builds the P V B operand of k16 step ks from key rows key_row(2t) and
    key_row(2t + 1) (+ 16 ks, and + 8 for its second register); across t the first four are
    rows 0, 1, 2, 3 and the second 5, 4, 7, 6: two even and two odd rows each, which the chunk
    swizzle of :func:`tile_word` spreads over all 32 banks.  The score loads (key rows
    key_row(g) of lanes g = 2i, 2i + 1 in one phase: an even and an odd row) are conflict
    free too."""
    return ((n >> 1) ^ (n & 1)) + 4 * (n & 1)


def tile_word(rows, row, col):
    """Word of (row, column ``col``) in a staged tile of ``rows`` rows: 32-column panels of 16
    words a row (``(panel * rows + row) * 16``), the row's four 16-byte chunks swizzled by bit 1
    of the row.  The word holds columns ``col & ~1`` (low half) and ``col | 1``."""
    chunk = (col & 31) >> 3      # shifts and masks: non-negative ints (numba's // and % keep
    return (((col >> 5) * rows + row) << 4) + 4 * (chunk ^ (row & 2)) + ((col & 7) >> 1)


def key_word(rows, row, col):
    """:func:`tile_word` with a row's chunks swizzled by bits 1-2 of the row (the key tiles of
    ``ldsm_values``): one chunk of 8 consecutive rows, what an ldmatrix matrix reads, then
    falls in 8 different bank quads, where tile_word puts rows r and r + 4 in one."""
    chunk = (col & 31) >> 3
    return (((col >> 5) * rows + row) << 4) + 4 * (chunk ^ ((row >> 1) & 3)) + ((col & 7) >> 1)


def ldsm_value_word(keys, lane, half):
    """Word (:func:`key_word`) of the 16-byte row ``lane`` gives ``ldmatrix.x4.trans`` for
    the values of a k16 step (``ldsm_values``), chunks 2 half and 2 half + 1 of a panel:
    matrix m = lane >> 3 holds keys 8 (m & 1) .. + 7 of the step in the P fragment's order
    (tile row :func:`key_row` (lane & 7)) and value chunk 2 half + (m >> 1), so the four
    registers are B operands b0, b1 of n-tile 2 half (8 consecutive columns) and of the
    next."""
    m, r = lane >> 3, lane & 7
    row = 8 * (m & 1) + ((r >> 1) ^ (r & 1)) + 4 * (r & 1)
    return (row << 4) + 4 * ((2 * half + (m >> 1)) ^ ((row >> 1) & 3))
    # = key_word(keys, 8 (m & 1) + key_row(r), 8 (2 half + (m >> 1))), written out: a device
    # function calls no plain-Python function


def query_word(panels, row, col):
    """Word of query (row, column ``col``) in a fragment-order query tile (``frag_queries``)
    of rows of ``panels`` 32-column panels.  Per row group of 16 and panel, two blocks of 128
    words, one per k16 step (h: words 4t, 4t + 1 or 4t + 2, 4t + 3 of a row's panel); lane
    (g, t)'s 4 words of block h are at 4 lane: rows g and g + 8 of word 4t + 2h, then of word
    4t + 2h + 1 -- the m16n8k16 A operand (a0, a1, a2, a3) of the row layout's k order, and
    a warp's 128-bit loads cover 512 consecutive bytes (no bank conflict).  Same size as the
    row layout."""
    word = col >> 1
    cw = word & 15                  # word in the row's panel: 4t + 2h + odd
    lane = 4 * (row & 7) + (cw >> 2)
    block = ((row >> 4) * panels + (word >> 4)) * 2 + ((cw >> 1) & 1)
    return (block << 7) + 4 * lane + 2 * (cw & 1) + ((row >> 3) & 1)


_key_row = inline_device_function(key_row)


@inline_device_function
def _row_layout_key(x, t):
    """The key (from the tile's first) of lane t's score x: n-tile x // 4, column
    :func:`key_row` (2t + x % 2)."""
    return 8 * (x // 4) + _key_row(2 * t + x % 2)

_tile_word = inline_device_function(tile_word)
_query_word = inline_device_function(query_word)
_key_word = inline_device_function(key_word)
_ldsm_value_word = inline_device_function(ldsm_value_word)

# One 16-byte chunk (8 bf16) of a cache row into the staged tile.  ``chunk_source(arr, b, col)``
# is computed once per block: on the GPU the global address of arr[b, 0, col], so that a
# chunk's copy costs one multiply-add (``src + row * row_bytes``) and the cp.async; the
# simulator keeps the indices.
# ``advance(source, rows, row_bytes)``: the source ``rows`` rows further (lean staging walks a
# whole tile's chunks from one source, one add each).
if SIMULATOR:
    def _chunk_source(arr, b, col):
        return arr, b, col, 0

    def _advance(source, rows, row_bytes):
        arr, b, col, row0 = source
        return arr, b, col, row0 + rows

    from kdtree_numba.gpu.memory import sim_copy_u16x8

    def _copy_chunk(smem, word, source, row, row_bytes, nbytes):
        arr, b, col, row0 = source
        sim_copy_u16x8(smem, word, arr, (b, row0 + row, col), nbytes)

    def _ldsm_values(smem, base, own, offset, lane, keys, half):
        """What ldmatrix.x4.trans gives ``lane`` (register m: column g of rows 2t, 2t + 1 of
        matrix m), each row at the address its lane gives (``ldsm_value_word``): ``base`` is
        this lane's, ``own`` its ldsm_value_word."""
        g, t = lane >> 2, lane & 3
        regs = []
        for m in range(4):
            pair = []
            for r in (2 * t, 2 * t + 1):
                word = smem[base - own + ldsm_value_word(keys, 8 * m + r, half) + offset
                            + (g >> 1)]
                pair.append((int(word) >> (16 * (g & 1))) & 0xFFFF)
            regs.append(np.uint32(pair[0] | (pair[1] << 16)))
        return regs[0], regs[1], regs[2], regs[3]
else:
    from kdtree_numba.gpu.memory import cp_async16_raw, global_address, shared_address

    @inline_device_function
    def _chunk_source(arr, b, col):
        return global_address(arr, (b, 0, col))

    @inline_device_function
    def _advance(source, rows, row_bytes):
        return source + rows * row_bytes

    @inline_device_function
    def _copy_chunk(smem, word, source, row, row_bytes, nbytes):
        cp_async16_raw(shared_address(smem, 0) + 4 * word, source + row * row_bytes, nbytes)

    from kdtree_numba.gpu.memory import ldmatrix_x4_trans

    @inline_device_function
    def _ldsm_values(smem, base, own, offset, lane, keys, half):
        return ldmatrix_x4_trans(smem, base, offset)


LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)
SLACK2 = np.float32(RESCALE_SLACK * LOG2E)   # the float32 kernels' slack, in log2 units


@inline_device_function
def quad_max(x):
    """The max over the 4 lanes t of a fragment row."""
    x = max(x, shfl_xor(x, 1))
    return max(x, shfl_xor(x, 2))


@inline_device_function
def quad_sum(x):
    """The sum over the 4 lanes t of a fragment row."""
    x += shfl_xor(x, 1)
    return x + shfl_xor(x, 2)


def softmax_step(scores: int, accumulators: int, stride: int, key_col):
    """``step(s, xch, partner, acc, pk, t0, t, unmasked, tau2, kend, prefix, visible, b, ok_a,
    ok_b, query_a, query_b, m_a, m_b, l_a, l_b) -> (m_a, m_b, l_a, l_b)``: one key tile of
    the online softmax of a thread's two fragment rows a, b (accumulators 4j, 4j + 1 and
    4j + 2, 4j + 3), identical in the two warps (warpgroups) that hold halves of the scores:
    its ``scores`` partial scores ``s`` plus the partner's (``xch[partner + stride x]``) in
    log2 units, masked past the unmasked keys (score x is key t0 + ``key_col(x, t)``), the
    reference point moved only by more than the slack, the ``accumulators`` P V sums
    rescaled, and the probabilities packed to bf16 pairs into ``pk`` (pair x: scores 2x,
    2x + 1, one row), the denominators summing what P V multiplies.  This kernel's and
    attention/wgmma.py's."""
    SN, ACC, PK = scores, accumulators, scores // 2

    @inline_device_function
    def step(s, xch, partner, acc, pk, t0, t, unmasked, tau2, kend, prefix, visible, b, ok_a,
             ok_b, query_a, query_b, m_a, m_b, l_a, l_b):
        mt_a = mt_b = NEG_INF
        if unmasked:  # keys every row sees, all in range: no mask
            for x in range(SN):
                sc = (s[x] + xch[partner + stride * x]) * tau2
                if x % 4 < 2:
                    mt_a = max(mt_a, sc)
                else:
                    mt_b = max(mt_b, sc)
                s[x] = sc
        else:
            for x in range(SN):
                sc = (s[x] + xch[partner + stride * x]) * tau2
                key = t0 + key_col(x, t)
                if x % 4 < 2:
                    sc = masked_score(sc, key, kend, prefix, visible, b, ok_a, query_a)
                    mt_a = max(mt_a, sc)
                else:
                    sc = masked_score(sc, key, kend, prefix, visible, b, ok_b, query_b)
                    mt_b = max(mt_b, sc)
                s[x] = sc
        mt_a, mt_b = quad_max(mt_a), quad_max(mt_b)
        alpha_a = alpha_b = ONE
        if mt_a > m_a + SLACK2:  # also the first visible score (m = -inf)
            alpha_a = math.exp2(m_a - mt_a)
            m_a = mt_a
        if mt_b > m_b + SLACK2:
            alpha_b = math.exp2(m_b - mt_b)
            m_b = mt_b
        if warp_any(alpha_a != ONE or alpha_b != ONE):
            for x in range(ACC // 4):
                acc[4 * x] *= alpha_a
                acc[4 * x + 1] *= alpha_a
                acc[4 * x + 2] *= alpha_b
                acc[4 * x + 3] *= alpha_b
        ms_a = m_a if m_a > NEG_INF else ZERO  # nothing visible yet: all p = 0
        ms_b = m_b if m_b > NEG_INF else ZERO
        sum_a = sum_b = ZERO
        for x in range(PK):  # pk[2 j + h]: n-tile j's row g + 8h, keys 2t, 2t + 1
            ms = ms_a if x % 2 == 0 else ms_b
            word = pack_bf16x2(math.exp2(s[2 * x] - ms), math.exp2(s[2 * x + 1] - ms))
            rounded = bf16_lo(word) + bf16_hi(word)   # the denominator sums what P V uses
            if x % 2 == 0:
                sum_a += rounded
            else:
                sum_b += rounded
            pk[x] = word
        return m_a, m_b, l_a * alpha_a + sum_a, l_b * alpha_b + sum_b
    return step


def row_output(reciprocal):
    """``target(out, part_o, part_ml, direct, b, split, row, m_run, l_run, writes_ml) ->
    (dst, scale)``: where a finished row goes -- u[b, row] normalised by ``reciprocal(l)``
    (zeros where it saw nothing) with one split, else the split's partial output, its
    (max in natural units, sum) written by the thread with ``writes_ml``."""
    @inline_device_function
    def target(out, part_o, part_ml, direct, b, split, row, m_run, l_run, writes_ml):
        if direct:
            return out[b, row], reciprocal(l_run) if l_run > ZERO else ZERO
        if writes_ml:  # the merge works in natural units
            part_ml[b, split, row, 0] = m_run * LN2
            part_ml[b, split, row, 1] = l_run
        return part_o[b, split, row], ONE
    return target


@inline_device_function
def _ieee_reciprocal(x):
    return ONE / x


def staging(cfg: Bf16TileConfig, kword, qword):
    """``(stage_keys, zero_padding, stage_queries)``: the device functions that stage a block's
    key tiles (cp.async of 16-byte chunks from the cache, rows clamped at the split's end) and
    its query tile (float32 rounded to bf16) into shared memory for the tile shape ``cfg``,
    chunk (row, column) of a tile of ``rows`` rows at word ``kword(rows, row, col)`` of a key
    tile and ``qword(rows, row, col)`` of the query tile (the four words of a 16-byte chunk
    consecutive): this kernel's layouts and attention/wgmma.py's 128-byte swizzle."""
    M, N, T = cfg.rows, cfg.keys, cfg.threads
    CH = cfg.d_pad // 8            # 16-byte chunks of a staged row
    CR = cfg.r // 8                # ... of them from the latent, then the rope key's
    CD = cfg.d // 8                # ... and zeros from chunk CD on (padding to whole panels)
    CP = CD - CR                   # rope chunks of a row
    # staging by thread: latent chunk tid % CR of rows tid // CR + s T / CR (and the rope's
    # alike) when the threads divide the chunks evenly (DeepSeek-V3 / Kimi-K2 widths); else
    # slots dealt out round-robin
    BY_COLUMN = T % CR == 0 and (N * CR) % T == 0 and T % CP == 0 \
        and ((N * CP) % T == 0 or N * CP < T)
    LAT_STEP, LAT_SLOTS = T // CR, N * CR // T
    ROPE_STEP, ROPE_SLOTS = T // CP, max(1, N * CP // T)
    TILE_WORDS = N * cfg.row_words
    STAGES = cfg.stages
    FRAGQ, LEAN = cfg.frag_queries, cfg.lean_staging
    PANELS = cfg.d_pad // 32       # of a staged row (the fragment-order query tile's unit)

    @inline_device_function
    def stage_keys(smem, at, ckv, kpe, b, first, limit, tid, lat_src, rope_src):
        """cp.async keys first .. first + N - 1 of request b into the tile at word ``at``;
        rows at or past ``limit`` become zeros (their source clamped to limit - 1 >= 0).  The
        padding chunks are not touched (zeros since the kernel's start).  ``lean_staging``:
        a tile whose keys all lie before ``limit`` walks its chunks from one source row, no
        clamp or size select (the same bytes land)."""
        if BY_COLUMN and LEAN and first + N <= limit:
            i0 = tid // CR
            src = _advance(lat_src, first + i0, ckv.strides[1])
            for s in range(LAT_SLOTS):
                _copy_chunk(smem, at + kword(N, i0 + s * LAT_STEP, 8 * (tid % CR)), src,
                            0, ckv.strides[1], int32(16))
                src = _advance(src, LAT_STEP, ckv.strides[1])
            i0 = tid // CP
            src = _advance(rope_src, first + i0, kpe.strides[1])
            for s in range(ROPE_SLOTS):
                if N * CP >= T or i0 < N:
                    _copy_chunk(smem, at + kword(N, i0 + s * ROPE_STEP,
                                                 8 * (CR + tid % CP)),
                                src, 0, kpe.strides[1], int32(16))
                src = _advance(src, ROPE_STEP, kpe.strides[1])
            return
        if BY_COLUMN:
            q = tid % CR
            for s in range(LAT_SLOTS):
                i = tid // CR + s * LAT_STEP
                key = first + i
                nbytes = int32(16) if key < limit else int32(0)
                _copy_chunk(smem, at + kword(N, i, 8 * q), lat_src,
                            min(key, limit - 1), ckv.strides[1], nbytes)
            q = tid % CP
            for s in range(ROPE_SLOTS):
                i = tid // CP + s * ROPE_STEP
                if N * CP >= T or i < N:
                    key = first + i
                    nbytes = int32(16) if key < limit else int32(0)
                    _copy_chunk(smem, at + kword(N, i, 8 * (CR + q)), rope_src,
                                min(key, limit - 1), kpe.strides[1], nbytes)
            return
        for s in range(-(-N * CH // T)):
            f = tid + s * T
            if N * CH % T == 0 or f < N * CH:
                i, q = f // CH, f % CH
                key = min(first + i, limit - 1)
                nbytes = int32(16) if first + i < limit else int32(0)
                w = at + kword(N, i, 8 * q)
                if q < CR:
                    _copy_chunk(smem, w, _chunk_source(ckv, b, 8 * q), key, ckv.strides[1],
                                nbytes)
                elif q < CD:
                    _copy_chunk(smem, w, _chunk_source(kpe, b, 8 * (q - CR)), key,
                                kpe.strides[1], nbytes)

    @inline_device_function
    def zero_padding(smem, kv_base, tid):
        """The key stages' padding chunks (CD .. CH - 1 of every row) from word ``kv_base``,
        once: no copy writes them."""
        for f in range(tid, STAGES * N * (CH - CD), T):
            i, q = f // (CH - CD), CD + f % (CH - CD)
            w = kv_base + kword(N, i % N, 8 * q) + (i // N) * TILE_WORDS
            smem[w] = smem[w + 1] = smem[w + 2] = smem[w + 3] = uint32(0)

    @inline_device_function
    def stage_queries(smem, q_base, q_abs, q_pe, b, row0, n_rows, tid):
        """Query rows row0 .. row0 + M - 1 (float32) rounded to bf16 into the query tile at
        word ``q_base``; rows past n_rows and the padding columns are zeros."""
        for s in range(-(-M * CH // T)):
            f = tid + s * T
            if M * CH % T == 0 or f < M * CH:
                i, q = f // CH, f % CH
                row = row0 + i
                w0 = w1 = w2 = w3 = uint32(0)
                if row < n_rows and q < CD:
                    if q < CR:
                        x0, x1, x2, x3 = load_f32x4(q_abs, (b, row, 8 * q))
                        y0, y1, y2, y3 = load_f32x4(q_abs, (b, row, 8 * q + 4))
                    else:
                        x0, x1, x2, x3 = load_f32x4(q_pe, (b, row, 8 * (q - CR)))
                        y0, y1, y2, y3 = load_f32x4(q_pe, (b, row, 8 * (q - CR) + 4))
                    w0, w1 = pack_bf16x2(x0, x1), pack_bf16x2(x2, x3)
                    w2, w3 = pack_bf16x2(y0, y1), pack_bf16x2(y2, y3)
                if FRAGQ:   # words 4t, 4t + 1 in step 0's block, 4t + 2, 4t + 3 in step 1's
                    w = q_base + _query_word(PANELS, i, 8 * q)
                    smem[w] = w0
                    smem[w + 2] = w1
                    smem[w + 128] = w2
                    smem[w + 130] = w3
                else:
                    w = q_base + qword(M, i, 8 * q)
                    smem[w] = w0
                    smem[w + 1] = w1
                    smem[w + 2] = w2
                    smem[w + 3] = w3
    return stage_keys, zero_padding, stage_queries


def key_ring(cfg: Bf16TileConfig, stage_keys):
    """``(start, wait, prefetch, advance)``: the ring of ``cfg.stages`` key tiles a block
    streams its keys through, on :func:`staging`'s ``stage_keys`` (a cp.async commit group a
    tile, even empty, since the waits count groups).  ``start(smem, kv0, ckv, kpe, b, first,
    end, tid) -> (lat_src, rope_src)``: the thread's key sources and the first tile (two
    with three stages) in flight into the tiles from word ``kv0``; ``wait()``: tile t0 of
    the loop landed (every group but the newest with three stages); ``prefetch(smem, kv0,
    stage, ckv, kpe, b, t0, end, tid, lat_src, rope_src)``: after the loop's barrier, the
    tile one ahead (two with three stages) into the buffer the ring freed; ``advance(stage)``:
    the next tile's buffer."""
    N, STAGES = cfg.keys, cfg.stages
    CR, CD = cfg.r // 8, cfg.d // 8
    TILE_WORDS = N * cfg.row_words

    @inline_device_function
    def start(smem, kv0, ckv, kpe, b, first, end, tid):
        lat_src = _chunk_source(ckv, b, 8 * (tid % CR))
        rope_src = _chunk_source(kpe, b, 8 * (tid % (CD - CR)))
        stage_keys(smem, kv0, ckv, kpe, b, first, end, tid, lat_src, rope_src)
        cp_async_commit()
        if STAGES == 3:     # the ring starts two tiles ahead
            if first + N < end:
                stage_keys(smem, kv0 + TILE_WORDS, ckv, kpe, b, first + N, end, tid, lat_src,
                           rope_src)
            cp_async_commit()
        return lat_src, rope_src

    @inline_device_function
    def wait():
        if STAGES == 2:
            cp_async_wait_all()
        else:
            cp_async_wait_1()   # all but the newest group: tile t0's

    @inline_device_function
    def prefetch(smem, kv0, stage, ckv, kpe, b, t0, end, tid, lat_src, rope_src):
        if STAGES == 2:
            if t0 + N < end:    # the next tile into the other buffer
                stage_keys(smem, kv0 + (1 - stage) * TILE_WORDS, ckv, kpe, b, t0 + N, end,
                           tid, lat_src, rope_src)
                cp_async_commit()
        else:   # tile t0 + 2N into the buffer tile t0 - N left (the ring's previous)
            if t0 + 2 * N < end:
                ahead = stage + 2 if stage == 0 else stage - 1
                stage_keys(smem, kv0 + ahead * TILE_WORDS, ckv, kpe, b, t0 + 2 * N, end, tid,
                           lat_src, rope_src)
            cp_async_commit()

    @inline_device_function
    def advance(stage):
        if STAGES == 2:
            return 1 - stage
        return 0 if stage == 2 else stage + 1

    return start, wait, prefetch, advance


def build_kernel(cfg: Bf16TileConfig):
    """The bf16 block kernel for one configuration (the float32 kernels' arguments; ``ckv``
    and ``kpe`` uint16 bf16 bit patterns)."""
    cfg.validate()
    M, N, T = cfg.rows, cfg.keys, cfg.threads
    RG = M // 16                   # row groups of 16; warp = RG kh + rg
    DH = cfg.d_pad // 2            # score columns per warp (its column half)
    PH = DH // 32                  # ... in 32-column panels
    VG = cfg.value_groups          # 64-column value groups (8 n-tiles each) covering r
    GROUPS = cfg.groups_per_warp   # ... per warp: kh GROUPS + i, the last clamped to VG - 1
    R = cfg.r
    NT = N // 8                    # score n-tiles of a key tile
    KS = N // 16                   # P V k16 steps of a key tile
    SN = 4 * NT                    # score accumulators per lane
    PK = SN // 2                   # bf16 probability words per lane
    ACC = 32 * GROUPS              # P V accumulators per lane
    CH = cfg.d_pad // 8            # 16-byte chunks of a staged row
    CD = cfg.d // 8                # ... up to chunk CD from the cache, then zeros (padding)
    TILE_WORDS = N * cfg.row_words
    Q_OFF, KV_OFF = 0, M * cfg.row_words
    STAGES = cfg.stages
    FRAGQ, LDSM = cfg.frag_queries, cfg.ldsm_values
    kword = _key_word if LDSM else _tile_word      # the key tiles' layout
    stage_keys, zero_padding, stage_queries = staging(cfg, kword, _tile_word)
    ring_start, ring_wait, ring_prefetch, ring_advance = key_ring(cfg, stage_keys)
    PANELS = cfg.d_pad // 32       # of a staged row (the fragment-order query tile's unit)
    XCH_OFF = KV_OFF + STAGES * TILE_WORDS
    CAUSAL = cfg.causal
    FUSED_MERGE = cfg.fused_merge         # compiled in: the plain kernel has no such tail
    # never an empty closure cell: kernel_cache.closure_key describes every cell
    merge = merge_when_last(cfg.r, M, cfg.threads, CAUSAL,
                            cfg.smem_bytes() // 4) if FUSED_MERGE else None
    CLAMP = 2 * GROUPS != VG       # the second warp repeats the last group
    Q_PANEL, K_PANEL = 16 * M, 16 * N   # words between a row's panels in the two tiles
    V_GROUP = 2 * K_PANEL          # words between 64-column groups of a key tile
    mma = block_uniform_mma_bf16
    softmax = softmax_step(SN, ACC, 32, _row_layout_key)
    target = row_output(_ieee_reciprocal)

    @inline_device_function
    def pv_word(acc, o, a0, a1, a2, a3, x, y, z, w):
        """acc[o : o + 8] += P V for the two n-tiles of one word of the lane's value chunk:
        x, y (key rows of k 2t, 2t + 1) and z, w (k 2t + 8, 2t + 9) each hold two columns;
        the low halves are n-tile j = 2h (acc[o]), the high halves j = 2h + 1 (acc[o + 4])."""
        b0 = pair_low_halves(x, y)
        b1 = pair_low_halves(z, w)
        acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2], acc[o + 3])
        b0 = pair_high_halves(x, y)
        b1 = pair_high_halves(z, w)
        acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7] = mma(
            a0, a1, a2, a3, b0, b1, acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7])

    @inline_device_function
    def finish_row(out, part_o, part_ml, direct, b, split, row, n_rows, m_run, l_run, acc, h,
                   kh, t, writes_ml):
        """Row g + 8h of the lane's accumulators -> u (normalised; one split) or the split's
        partial output and its (max, sum).  In the warp's value group i (group kh GROUPS + i),
        n-tile j's columns 2t and 2t + 1 are columns 64 group + 16t + j and + 8 + j; columns
        past r and the second warp's repeat of the last group are not written."""
        if row < n_rows:
            dst, scale = target(out, part_o, part_ml, direct, b, split, row, m_run, l_run,
                                writes_ml)
            for grp in range(GROUPS):
                group = kh * GROUPS + grp
                if LDSM:    # n-tile j: columns 8 j .. 8 j + 7 of the group, 2t and 2t + 1 here
                    for j in range(8):
                        col = 64 * group + 8 * j + 2 * t
                        o = 32 * grp + 4 * j + 2 * h
                        if group < VG and col < R:
                            dst[col] = acc[o] * scale
                            dst[col + 1] = acc[o + 1] * scale
                    continue
                col = 64 * group + 16 * t
                for c in range(2):
                    for half in range(2):
                        o = 32 * grp + 16 * half + 2 * h + c
                        if group < VG and col + 8 * c + 4 * half < R:
                            store_f32x4(dst, col + 8 * c + 4 * half, acc[o] * scale,
                                        acc[o + 4] * scale, acc[o + 8] * scale,
                                        acc[o + 12] * scale)

    @kernel
    def mla_attention_bf16(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                           direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, uint32)
        xch = cuda.shared.array(0, float32)     # the same memory: the score exchange's view
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        g, t = lane // 4, lane % 4
        rg, kh = warp % RG, warp // RG
        row0 = block_row0(M, CAUSAL)
        n_rows = n * heads
        tau2 = tau * LOG2E    # scores in log2 units: exp2 is one instruction, exp several
        b, split, prefix, kbeg, kend = block_keys(prefix_len, n, chunk, CAUSAL,
                                                  row0 + M - 1, heads)
        if kbeg >= kend:  # a split past the request's keys: the merge skips it
            return

        stage_queries(smem, Q_OFF, q_abs, q_pe, b, row0, n_rows, tid)
        if CH > CD:
            zero_padding(smem, KV_OFF, tid)
        lat_src, rope_src = ring_start(smem, KV_OFF, ckv, kpe, b, kbeg, kend, tid)

        row_a = row0 + 16 * rg + g        # the lane's fragment rows g and g + 8
        row_b = row_a + 8
        ok_a, ok_b = row_a < n_rows, row_b < n_rows
        query_a, query_b = row_a // heads, row_b // heads
        # tiles of keys before this (cached, or new keys every query of the block sees) are
        # scored without the mask
        unmasked_end = min(prefix + seen_new_keys(visible, b, row0, min(row0 + M, n_rows) - 1,
                                                  heads, tid, T), kend)
        # the lane's shared words, as a base plus compile-time steps (rows + 8 keep their
        # swizzle: bit 1 of the row is the same).  Scores: query rows 16 rg + g (+ 8), key row
        # key_row(g) (+ 8 nt), chunk t of panel p of the warp's half (+ p * PANEL words).
        # P V without ldsm_values: key rows key_row(2t), key_row(2t + 1) (+ 16 ks, + 8),
        # chunk g of each group
        score_col = kh * DH + 8 * t
        q_at = Q_OFF + _tile_word(M, 16 * rg + g, score_col)
        if FRAGQ:   # lane's words of panel kh PH (step 0's block), panels 256 words apart
            q_at = Q_OFF + (rg * PANELS + kh * PH) * 256 + 4 * lane
        k_at = kword(N, _key_row(g), score_col)
        v_at0 = _tile_word(N, _key_row(2 * t), 8 * g)
        v_at1 = _tile_word(N, _key_row(2 * t + 1), 8 * g)
        v_first = kh * GROUPS
        vl_at0 = _ldsm_value_word(N, lane, 0)     # ldsm_values: this lane's matrix rows
        vl_at1 = _ldsm_value_word(N, lane, 1)

        acc = cuda.local.array(ACC, float32)
        for x in range(ACC):
            acc[x] = ZERO
        s = cuda.local.array(SN, float32)
        pk = cuda.local.array(PK, uint32)   # bf16 probabilities, the P V A operands
        m_a = m_b = NEG_INF  # online-softmax state of rows a and b (same in all 4 lanes t
        l_a = l_b = ZERO     # and in the partner warp); l: this lane's keys only

        xch_mine = XCH_OFF + warp * (32 * SN) + lane
        xch_partner = XCH_OFF + (warp ^ RG) * (32 * SN) + lane   # warp = RG kh + rg, RG = 2^i
        stage = 0
        for t0 in range(kbeg, kend, N):
            kv = KV_OFF + stage * TILE_WORDS
            ring_wait()
            cuda.syncthreads()  # tile t0 (and the queries) landed; tile t0 - N is consumed
            ring_prefetch(smem, KV_OFF, stage, ckv, kpe, b, t0, kend, tid, lat_src, rope_src)

            for x in range(SN):
                s[x] = ZERO
            k_tile = kv + k_at
            for p in range(PH):
                if FRAGQ:   # the A operands of steps 0 and 1 as loaded
                    a0, a1, a2, a3 = ld_shared_words4(smem, q_at, p * 256)
                    c0, c1, c2, c3 = ld_shared_words4(smem, q_at, p * 256 + 128)
                else:       # rows g (qa) and g + 8 (qb), interleaved into the operands
                    qa0, qa1, qa2, qa3 = ld_shared_words4(smem, q_at, p * Q_PANEL)
                    qb0, qb1, qb2, qb3 = ld_shared_words4(smem, q_at, p * Q_PANEL + 128)
                    a0, a1, a2, a3 = qa0, qb0, qa1, qb1
                    c0, c1, c2, c3 = qa2, qb2, qa3, qb3
                for nt in range(NT):
                    k0, k1, k2, k3 = ld_shared_words4(smem, k_tile, p * K_PANEL + 128 * nt)
                    o = 4 * nt
                    s[o], s[o + 1], s[o + 2], s[o + 3] = mma(
                        a0, a1, a2, a3, k0, k1, s[o], s[o + 1], s[o + 2], s[o + 3])
                    s[o], s[o + 1], s[o + 2], s[o + 3] = mma(
                        c0, c1, c2, c3, k2, k3, s[o], s[o + 1], s[o + 2], s[o + 3])
            for x in range(SN):  # leave this half's scores for the partner warp
                xch[xch_mine + 32 * x] = s[x]
            cuda.syncthreads()

            # online softmax of both halves' sum, identical in the two partner warps.  The
            # reference point moves only when a score exceeds it by more than RESCALE_SLACK.
            m_a, m_b, l_a, l_b = softmax(s, xch, xch_partner, acc, pk, t0, t,
                                         t0 + N <= unmasked_end, tau2, kend, prefix, visible,
                                         b, ok_a, ok_b, query_a, query_b, m_a, m_b, l_a, l_b)

            if LDSM:    # B operands by ldmatrix.trans: n-tile j = 8 consecutive columns
                vb0 = kv + vl_at0 + v_first * V_GROUP
                vb1 = kv + vl_at1 + v_first * V_GROUP
                for ks in range(KS):
                    a0, a1, a2, a3 = pk[4 * ks], pk[4 * ks + 1], pk[4 * ks + 2], pk[4 * ks + 3]
                    for grp in range(GROUPS):
                        at = 256 * ks + grp * V_GROUP
                        if CLAMP:
                            at += (min(v_first + grp, VG - 1) - v_first - grp) * V_GROUP
                        for jp in range(4):     # n-tiles 2 jp, 2 jp + 1
                            vb, own = (vb0, vl_at0) if jp % 2 == 0 else (vb1, vl_at1)
                            b0, b1, b2, b3 = _ldsm_values(smem, vb, own,
                                                          at + (jp >> 1) * K_PANEL, lane, N,
                                                          jp % 2)
                            o = 32 * grp + 8 * jp
                            acc[o], acc[o + 1], acc[o + 2], acc[o + 3] = mma(
                                a0, a1, a2, a3, b0, b1, acc[o], acc[o + 1], acc[o + 2],
                                acc[o + 3])
                            acc[o + 4], acc[o + 5], acc[o + 6], acc[o + 7] = mma(
                                a0, a1, a2, a3, b2, b3, acc[o + 4], acc[o + 5], acc[o + 6],
                                acc[o + 7])
            v_tile0 = kv + v_at0 + v_first * V_GROUP
            v_tile1 = kv + v_at1 + v_first * V_GROUP
            # k16 step ks: n-tiles 2 ks (A k < 8) and 2 ks + 1 (k >= 8); none under LDSM
            for ks in range(0 if LDSM else KS):
                a0, a1, a2, a3 = pk[4 * ks], pk[4 * ks + 1], pk[4 * ks + 2], pk[4 * ks + 3]
                for grp in range(GROUPS):
                    at = 256 * ks + grp * V_GROUP
                    if CLAMP:  # the second warp's groups past the last repeat the last
                        at += (min(v_first + grp, VG - 1) - v_first - grp) * V_GROUP
                    x0, x1, x2, x3 = ld_shared_words4(smem, v_tile0, at)
                    y0, y1, y2, y3 = ld_shared_words4(smem, v_tile1, at)
                    z0, z1, z2, z3 = ld_shared_words4(smem, v_tile0, at + 128)
                    w0, w1, w2, w3 = ld_shared_words4(smem, v_tile1, at + 128)
                    o = 32 * grp
                    pv_word(acc, o, a0, a1, a2, a3, x0, y0, z0, w0)
                    pv_word(acc, o + 8, a0, a1, a2, a3, x1, y1, z1, w1)
                    pv_word(acc, o + 16, a0, a1, a2, a3, x2, y2, z2, w2)
                    pv_word(acc, o + 24, a0, a1, a2, a3, x3, y3, z3, w3)
            stage = ring_advance(stage)
        cp_async_wait_all()  # nothing may be in flight when the block exits

        # epilogue: normalised u (one split) or the split's partial output and (max, sum)
        l_a, l_b = quad_sum(l_a), quad_sum(l_b)
        writes_ml = kh == 0 and t == 0
        finish_row(out, part_o, part_ml, direct, b, split, row_a, n_rows, m_a, l_a, acc, 0,
                   kh, t, writes_ml)
        finish_row(out, part_o, part_ml, direct, b, split, row_b, n_rows, m_b, l_b, acc, 1,
                   kh, t, writes_ml)
        if FUSED_MERGE:     # the blocks that ran keys count themselves; the last merges
            merge(xch, part_o, part_ml, out, b, row0, n_rows, prefix, n, heads, chunk, tid)

    return mla_attention_bf16

"""Absorbed-MLA attention (prefill, decode, DDTree verify) as numba.cuda kernels.

The contract (shapes, dtypes, masking, the empty-row rule) is the docstring of
``reference/attention.py``; these functions compute the same thing in float32 on the device.
docs/ATTENTION.md explains the kernel design; the short version:

* One block owns a tile of ``rows`` flattened query-heads (row = i*H + h) of one request and one
  *split* (a contiguous range of key slots).  All query-heads of a request share the same keys
  (MQA with one latent head), so the block stages its queries in shared memory once and streams
  key tiles of ``keys`` slots x (r + dr) floats through shared memory.
* Per key tile: scores are a register-blocked mini-GEMM (each thread an ``as x bs`` block, fed by
  128-bit shared loads), masked and scaled into a small score tile; one thread per row runs the
  online softmax in place; then every thread accumulates its ``rv x cv`` block of the
  ``rows x r`` output from the probabilities and the same key tile (V = the first r columns).
  The score matrix is never materialised beyond one tile.
* Long prefixes are split across blocks (flash-decoding): each split writes its unnormalised
  partial output and (max, sum); :func:`_merge_kernel` combines them.  With one split the kernel
  normalises and writes ``u`` directly.
"""
from kdtree_numba.compat import cuda, kernel, device_function, to_device, SIMULATOR  # noqa: I001

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, int32

from kdtree_numba import compat

__all__ = ["mla_attention", "absorb_q", "apply_uv", "MlaAttentionPlan", "TileConfig",
           "tile_config", "choose_splits"]

NEG_INF = np.float32(-np.inf)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
MAX_SHARED_BYTES = 232448  # sm_90 opt-in dynamic shared memory per block (227 KiB)


# ---------------------------------------------------------------------------------------------
# 128-bit loads and stores.  On the GPU they are LLVM <4 x float> accesses with align 16, which
# NVVM turns into ld/st.{shared,global}.v4.f32: the score mini-GEMM needs them, since scalar
# shared loads would cap it at a third of the FMA rate.  The simulator gets plain Python.
# Callers guarantee 16-byte alignment: every row offset and stride used with them is a
# multiple of 4 floats, and device allocations are 256-byte aligned.
# ---------------------------------------------------------------------------------------------
def _make_vec4_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def element_pointer(context, builder, arrty, arr, idxty, idx):
        if isinstance(idxty, types.BaseTuple):
            idx_types, idx_vals = idxty.types, cgutils.unpack_tuple(builder, idx, len(idxty))
        else:
            idx_types, idx_vals = (idxty,), (idx,)
        idx_vals = [context.cast(builder, v, t, types.intp) for t, v in zip(idx_types, idx_vals)]
        ary = context.make_array(arrty)(context, builder, value=arr)
        ptr = cgutils.get_item_pointer(context, builder, arrty, ary, idx_vals, wraparound=False)
        return builder.bitcast(ptr, ir.VectorType(ir.FloatType(), 4).as_pointer())

    def check(arr, idx):
        ndim = len(idx) if isinstance(idx, types.BaseTuple) else 1
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.ndim == ndim):
            raise TypeError(f"vec4 access needs a float32 array of ndim {ndim}, got {arr}")

    @intrinsic
    def load4(typingctx, arr, idx):
        check(arr, idx)

        def codegen(context, builder, sig, args):
            vptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = builder.load(vptr, align=16)
            vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), e))
                    for e in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)
        return types.UniTuple(types.float32, 4)(arr, idx), codegen

    @intrinsic
    def store4(typingctx, arr, idx, x0, x1, x2, x3):
        check(arr, idx)

        def codegen(context, builder, sig, args):
            vptr = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = ir.Constant(ir.VectorType(ir.FloatType(), 4), ir.Undefined)
            for e in range(4):
                val = context.cast(builder, args[2 + e], sig.args[2 + e], types.float32)
                vec = builder.insert_element(vec, val, ir.Constant(ir.IntType(32), e))
            builder.store(vec, vptr, align=16)
        return types.void(arr, idx, x0, x1, x2, x3), codegen

    return load4, store4


def _sim_load4(arr, idx):
    if isinstance(idx, tuple):
        head, k = idx[:-1], idx[-1]
        return (arr[head + (k,)], arr[head + (k + 1,)], arr[head + (k + 2,)],
                arr[head + (k + 3,)])
    return arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3]


def _sim_store4(arr, idx, x0, x1, x2, x3):
    if isinstance(idx, tuple):
        head, k = idx[:-1], idx[-1]
        arr[head + (k,)], arr[head + (k + 1,)] = x0, x1
        arr[head + (k + 2,)], arr[head + (k + 3,)] = x2, x3
    else:
        arr[idx], arr[idx + 1], arr[idx + 2], arr[idx + 3] = x0, x1, x2, x3


if SIMULATOR:
    load4, store4 = _sim_load4, _sim_store4
else:
    load4, store4 = _make_vec4_intrinsics()


def _tile_slot_fn(threads: int):
    """(row, float4 column) of slot ``tid + s*threads`` in a tile ``width4`` float4s wide.

    When ``width4`` divides the thread count the column is fixed per thread and the row steps
    by a constant, which keeps 64-bit division out of the per-tile load loop.
    """
    def tile_slot(tid, s, width4):
        if threads % width4 == 0:
            return tid // width4 + s * (threads // width4), tid % width4
        f = tid + s * threads
        return f // width4, f % width4
    return device_function(tile_slot) if not SIMULATOR else tile_slot


def _row_group_reducers(tpr: int, rpw: int, scratch_off: int):
    """(max, sum) over the ``tpr`` lanes lane % rpw + rpw*k of a warp that share one row.

    On the GPU: xor shuffles.  In the simulator (no warp intrinsics): a shared-memory scratch of
    one float per thread, fenced by syncthreads, so every thread must call it.
    """
    if SIMULATOR:
        def gather(x, smem, tid, use_max):
            cuda.syncthreads()
            smem[scratch_off + tid] = x
            cuda.syncthreads()
            first = scratch_off + tid - tid % 32 + tid % rpw
            r = smem[first]
            for k in range(1, tpr):
                v = smem[first + rpw * k]
                r = max(r, v) if use_max else r + v
            return r

        def row_max(x, smem, tid):
            return gather(x, smem, tid, True)

        def row_sum(x, smem, tid):
            return gather(x, smem, tid, False)
        return row_max, row_sum

    steps = tpr.bit_length() - 1  # tpr is a power of two

    @device_function
    def row_max(x, smem, tid):
        for k in range(steps):
            x = max(x, cuda.shfl_xor_sync(0xFFFFFFFF, x, rpw << k))
        return x

    @device_function
    def row_sum(x, smem, tid):
        for k in range(steps):
            x += cuda.shfl_xor_sync(0xFFFFFFFF, x, rpw << k)
        return x
    return row_max, row_sum


# ---------------------------------------------------------------------------------------------
# Tile configuration
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """Compile-time shape of one attention block (see docs/ATTENTION.md for the layouts).

    threads = srg * skg (score layout) = rg * cg (output layout).
    Score phase: thread (rg_i, kg_i) owns rows rg_i + srg*a (a < rows/srg) and keys kg_i + skg*b
    (b < keys/skg); within a warp, ``score_lane_rows`` consecutive lanes take consecutive rows.
    Output phase: thread (g, c) owns rows rv*g .. rv*g+rv-1 and the float4 columns
    4c + 4*cg*t (t < r/(4*cg)); within a warp ``out_lane_cols`` consecutive lanes take
    consecutive c.
    """
    r: int
    dr: int
    threads: int
    rows: int              # M: query-heads per block
    keys: int              # N: key slots per tile
    srg: int
    skg: int
    score_lane_rows: int
    cg: int
    out_lane_cols: int
    scratch: int = 0       # floats of shared scratch (the simulator's stand-in for shuffles)

    @property
    def d(self):           # key width r + dr
        return self.r + self.dr

    @property
    def row_stride(self):  # floats per staged query/key row; +4 shifts rows by 4 banks
        return self.d + 4

    @property
    def score_stride(self):  # floats per key of the transposed score tile [keys][rows + 4]
        return self.rows + 4

    @property
    def rg(self):
        return self.threads // self.cg

    @property
    def rv(self):
        return self.rows // self.rg

    @property
    def cv4(self):         # float4 column groups per thread
        return self.r // (4 * self.cg)

    @property
    def row_threads(self):  # threads that share one row's softmax (keys split among them)
        return self.threads // self.rows

    def smem_floats(self):
        return (self.rows + self.keys) * self.row_stride + self.keys * self.score_stride \
            + 2 * self.rows + self.scratch

    def smem_bytes(self):
        return 4 * self.smem_floats()

    def validate(self):
        ok = (self.r % 4 == 0 and self.dr % 4 == 0 and self.threads % 32 == 0
              and self.srg * self.skg == self.threads and self.rows % self.srg == 0
              and self.keys % self.skg == 0 and self.threads % self.cg == 0
              and self.rows % self.rg == 0 and self.r % (4 * self.cg) == 0
              and self.threads % self.rows == 0 and self.keys % self.row_threads == 0
              and 32 % self.row_threads == 0
              and 32 % self.score_lane_rows == 0 and self.srg % self.score_lane_rows == 0
              and self.skg % (32 // self.score_lane_rows) == 0
              and 32 % self.out_lane_cols == 0 and self.cg % self.out_lane_cols == 0
              and self.rg % (32 // self.out_lane_cols) == 0
              and self.smem_bytes() <= MAX_SHARED_BYTES)
        if not ok:
            raise ValueError(f"inconsistent attention tile configuration {self}")
        return self


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap that divides x."""
    p = cap
    while x % p:
        p //= 2
    return p


def gpu_tile_config(r: int, dr: int) -> TileConfig:
    """256 threads, 64 query-heads x 32 keys per tile; 8 x 16 outputs per thread at r = 512.

    Narrow latents (r < 128, tests) get fewer column groups and so more rows per block.
    """
    cg = _pow2_divisor(r // 4, 32)
    rows, keys = max(64, 256 // cg), 32
    while TileConfig(r, dr, 256, rows, keys, 16, 16, 8, cg, min(cg, 8)).smem_bytes() \
            > MAX_SHARED_BYTES and keys > 16:
        keys //= 2
    return TileConfig(r, dr, threads=256, rows=rows, keys=keys, srg=16, skg=16,
                      score_lane_rows=8, cg=cg, out_lane_cols=min(cg, 8)).validate()


def sim_tile_config(r: int, dr: int) -> TileConfig:
    """One warp and tiny tiles: the simulator costs ~30 ms per syncthreads."""
    cg = _pow2_divisor(r // 4, 8)
    rows = max(16, 32 // cg)
    return TileConfig(r, dr, threads=32, rows=rows, keys=8, srg=8, skg=4, score_lane_rows=8,
                      cg=cg, out_lane_cols=cg, scratch=32).validate()


def tile_config(r: int, dr: int) -> TileConfig:
    """The tile shape used here for latent width r and rope width dr."""
    return sim_tile_config(r, dr) if SIMULATOR else gpu_tile_config(r, dr)


BLOCK_OVERHEAD_TILES = 2          # staging queries + writing outputs, in key-tile times
MERGE_BYTES_PER_TILE_TIME = 37e6  # HBM bytes the whole GPU moves in one key-tile time (~9 us)


def choose_splits(blocks_per_split: int, max_keys: int, tile_keys: int, sm_count: int,
                  partial_bytes_per_block: int, max_splits: int = 64) -> int:
    """Number of key splits with the least modelled time, fewest splits on ties.

    One block fits per SM (the tiles take ~226 KiB of shared memory), so a request alone (decode:
    one row tile) would use one SM per split.  Model, in units of one key tile's time:
    waves * (tiles per split + per-block overhead) + traffic of the partial outputs (written by
    the splits, read by the merge).
    """
    tiles = max(1, -(-max_keys // tile_keys))
    best, best_cost = 1, None
    for s in range(1, min(max_splits, tiles) + 1):
        tiles_per_split = -(-tiles // s)
        if s > 1 and -(-tiles // tiles_per_split) < s:
            continue  # some split would be empty
        waves = -(-blocks_per_split * s // sm_count)
        cost = waves * (tiles_per_split + BLOCK_OVERHEAD_TILES)
        if s > 1:
            cost += 2 * s * blocks_per_split * partial_bytes_per_block / MERGE_BYTES_PER_TILE_TIME
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _attention_kernel(cfg: TileConfig):
    """Build the tiled attention kernel for one configuration (constants are closed over)."""
    T, M, N, DV, DR = cfg.threads, cfg.rows, cfg.keys, cfg.r, cfg.dr
    DV4, DR4 = DV // 4, DR // 4           # float4 columns of the latent and of the rope part
    QS, ST = cfg.row_stride, cfg.score_stride
    SRG, SKG, AS, BS = cfg.srg, cfg.skg, cfg.rows // cfg.srg, cfg.keys // cfg.skg
    RLS = cfg.score_lane_rows
    KLS, WS = 32 // RLS, cfg.srg // RLS
    CG, RV, CV4 = cfg.cg, cfg.rv, cfg.cv4
    CLW = cfg.out_lane_cols
    RLW = 32 // CLW
    WR = cfg.rg // RLW
    P_VEC = RV % 4 == 0                   # a thread's probabilities load as float4s
    ACC, SC, KF, PF = RV * CV4 * 4, AS * BS, BS * 4, RV  # register (local) array sizes
    QU = 2 if (DV4 + DR4) % 2 == 0 else 1  # score loop unroll: loads of 2 quads in flight
    PU = 2 if N % 2 == 0 else 1           # P.V loop unroll
    TPR = cfg.row_threads                 # softmax: TPR threads per row, keys p + TPR*jj
    RPW = 32 // TPR                       # rows per warp in the softmax layout
    KPT = N // TPR                        # keys per softmax thread
    Q_OFF, KV_OFF = 0, M * QS             # smem: queries [M][QS], keys [N][QS],
    PT_OFF = KV_OFF + N * QS              # scores/probabilities transposed [N][ST],
    ALPHA_OFF = PT_OFF + N * ST           # per-row rescale factor [M], final sum [M],
    L_OFF = ALPHA_OFF + M                 # simulator-only reduction scratch [T]
    SCR_OFF = L_OFF + M
    row_max, row_sum = _row_group_reducers(TPR, RPW, SCR_OFF)
    # key-tile loads: pass s covers float4 slots tid + s*T of the [N][width/4] tile
    CKV_PASSES, KPE_PASSES = -(-N * DV4 // T), -(-N * DR4 // T)
    CKV_EXACT, KPE_EXACT = N * DV4 % T == 0, N * DR4 % T == 0
    _tile_slot = _tile_slot_fn(T)

    @kernel
    def mla_attention_tiles(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, n, heads, chunk,
                            direct, out, part_o, part_ml):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        row0 = cuda.blockIdx.x * M
        split = cuda.blockIdx.y
        b = cuda.blockIdx.z
        n_rows = n * heads
        prefix = prefix_len[b]
        kbeg = split * chunk
        kend = min(kbeg + chunk, prefix + n)
        if split == cuda.gridDim.y - 1:
            kend = prefix + n  # the last split takes the rest, whatever max_keys promised

        # stage this block's query rows [q_abs | q_pe]; rows past the last are zeros
        for f in range(tid, M * DV4, T):
            row, quad = f // DV4, f % DV4
            x0 = x1 = x2 = x3 = ZERO
            if row0 + row < n_rows:
                x0, x1, x2, x3 = load4(q_abs, (b, row0 + row, 4 * quad))
            store4(smem, Q_OFF + row * QS + 4 * quad, x0, x1, x2, x3)
        for f in range(tid, M * DR4, T):
            row, quad = f // DR4, f % DR4
            x0 = x1 = x2 = x3 = ZERO
            if row0 + row < n_rows:
                x0, x1, x2, x3 = load4(q_pe, (b, row0 + row, 4 * quad))
            store4(smem, Q_OFF + row * QS + 4 * (DV4 + quad), x0, x1, x2, x3)

        # score phase: rows rg + SRG*a, keys kg + SKG*bb (lanes spread over rows, then keys)
        rg = (warp % WS) * RLS + lane % RLS
        kg = (warp // WS) * KLS + lane // RLS
        # output phase: rows RV*g + a, float4 columns c + CG*t
        g = (warp % WR) * RLW + lane // CLW
        c = (warp // WR) * CLW + lane % CLW

        acc = cuda.local.array(ACC, float32)
        for x in range(ACC):
            acc[x] = ZERO
        sc = cuda.local.array(SC, float32)
        kf = cuda.local.array(KF, float32)
        pf = cuda.local.array(PF, float32)
        m_run = NEG_INF  # online-softmax state of this thread's softmax row
        l_run = ZERO

        for t0 in range(kbeg, kend, N):
            cuda.syncthreads()  # the previous tile's readers are done with keys and scores
            for s in range(CKV_PASSES):  # key tile [ckv | kpe]; zeros past kend
                j, quad = _tile_slot(tid, s, DV4)
                if CKV_EXACT or j < N:
                    x0 = x1 = x2 = x3 = ZERO
                    if t0 + j < kend:
                        x0, x1, x2, x3 = load4(ckv, (b, t0 + j, 4 * quad))
                    store4(smem, KV_OFF + j * QS + 4 * quad, x0, x1, x2, x3)
            for s in range(KPE_PASSES):
                j, quad = _tile_slot(tid, s, DR4)
                if KPE_EXACT or j < N:
                    x0 = x1 = x2 = x3 = ZERO
                    if t0 + j < kend:
                        x0, x1, x2, x3 = load4(kpe, (b, t0 + j, 4 * quad))
                    store4(smem, KV_OFF + j * QS + 4 * (DV4 + quad), x0, x1, x2, x3)
            cuda.syncthreads()

            # scores: sc[a, bb] = q[row a] . k[key bb] over all r + dr columns
            for x in range(SC):
                sc[x] = ZERO
            for quad0 in range(0, DV4 + DR4, QU):
                for u in range(QU):
                    col = 4 * (quad0 + u)
                    for bb in range(BS):
                        k0, k1, k2, k3 = load4(smem, KV_OFF + (kg + SKG * bb) * QS + col)
                        kf[4 * bb], kf[4 * bb + 1], kf[4 * bb + 2], kf[4 * bb + 3] = \
                            k0, k1, k2, k3
                    for a in range(AS):
                        q0, q1, q2, q3 = load4(smem, Q_OFF + (rg + SRG * a) * QS + col)
                        for bb in range(BS):
                            v = sc[a * BS + bb]
                            v += q0 * kf[4 * bb]
                            v += q1 * kf[4 * bb + 1]
                            v += q2 * kf[4 * bb + 2]
                            v += q3 * kf[4 * bb + 3]
                            sc[a * BS + bb] = v
            # scale and mask into the transposed score tile
            for a in range(AS):
                row = rg + SRG * a
                for bb in range(BS):
                    key = kg + SKG * bb
                    t = t0 + key
                    v = tau * sc[a * BS + bb]
                    if t >= kend:
                        v = NEG_INF
                    elif t >= prefix:  # a new token: ask the n x n mask
                        if row0 + row >= n_rows:
                            v = NEG_INF
                        elif not visible[b, (row0 + row) // heads, t - prefix]:
                            v = NEG_INF
                    smem[PT_OFF + key * ST + row] = v
            cuda.syncthreads()

            # online softmax: TPR threads per row (keys p, p + TPR, ...), probabilities
            # overwrite the scores; every thread of a row keeps the same (m_run, l_run)
            srow = warp * RPW + lane % RPW
            part = lane // RPW
            m_new = m_run
            for jj in range(KPT):
                m_new = max(m_new, smem[PT_OFF + (part + TPR * jj) * ST + srow])
            m_new = row_max(m_new, smem, tid)
            m_safe = m_new if m_new > NEG_INF else ZERO  # nothing visible yet: all p = 0
            alpha = math.exp(m_run - m_safe)
            total = ZERO
            for jj in range(KPT):
                at = PT_OFF + (part + TPR * jj) * ST + srow
                p = math.exp(smem[at] - m_safe)
                smem[at] = p
                total += p
            l_run = l_run * alpha + row_sum(total, smem, tid)
            m_run = m_new
            if part == 0:
                smem[ALPHA_OFF + srow] = alpha
            # the barrier also tells whether any row's max moved (else skip the rescale)
            rescale = cuda.syncthreads_or(int32(alpha != ONE))

            # acc = alpha * acc + P V for rows RV*g + a, columns of c (V = first DV columns)
            if rescale:
                for a in range(RV):
                    alpha = smem[ALPHA_OFF + RV * g + a]
                    for x in range(CV4 * 4):
                        acc[a * CV4 * 4 + x] *= alpha
            for j0 in range(0, N, PU):
                for u in range(PU):
                    j = j0 + u
                    if P_VEC:
                        for a4 in range(RV // 4):
                            pf[4 * a4], pf[4 * a4 + 1], pf[4 * a4 + 2], pf[4 * a4 + 3] = \
                                load4(smem, PT_OFF + j * ST + RV * g + 4 * a4)
                    else:
                        for a in range(RV):
                            pf[a] = smem[PT_OFF + j * ST + RV * g + a]
                    for t in range(CV4):
                        v0, v1, v2, v3 = load4(smem, KV_OFF + j * QS + 4 * (c + CG * t))
                        for a in range(RV):
                            p = pf[a]
                            x = (a * CV4 + t) * 4
                            acc[x] += p * v0
                            acc[x + 1] += p * v1
                            acc[x + 2] += p * v2
                            acc[x + 3] += p * v3

        # epilogue: normalised u (one split) or the split's partial output and (max, sum)
        srow = warp * RPW + lane % RPW
        if lane // RPW == 0:
            smem[L_OFF + srow] = l_run
            if not direct and row0 + srow < n_rows:
                part_ml[b, split, row0 + srow, 0] = m_run
                part_ml[b, split, row0 + srow, 1] = l_run
        cuda.syncthreads()
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
                        store4(out, (b, row0 + row, col), acc[x] * scale, acc[x + 1] * scale,
                               acc[x + 2] * scale, acc[x + 3] * scale)
                    else:
                        store4(part_o, (b, split, row0 + row, col), acc[x], acc[x + 1],
                               acc[x + 2], acc[x + 3])

    return mla_attention_tiles


MERGE_THREADS = 128


@lru_cache(maxsize=None)
def _merge_kernel(r: int):
    """out[b, row] = sum_s w_s O_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s)."""
    DV4 = r // 4

    @kernel
    def merge_splits(part_o, part_ml, splits, out):
        row, b = cuda.blockIdx.x, cuda.blockIdx.y
        m_max = NEG_INF
        for s in range(splits):
            m_max = max(m_max, part_ml[b, s, row, 0])
        m_safe = m_max if m_max > NEG_INF else ZERO
        total = ZERO
        for s in range(splits):
            total += math.exp(part_ml[b, s, row, 0] - m_safe) * part_ml[b, s, row, 1]
        scale = ONE / total if total > ZERO else ZERO
        for quad in range(cuda.threadIdx.x, DV4, cuda.blockDim.x):
            y0 = y1 = y2 = y3 = ZERO
            for s in range(splits):
                w = math.exp(part_ml[b, s, row, 0] - m_safe)
                x0, x1, x2, x3 = load4(part_o, (b, s, row, 4 * quad))
                y0 += w * x0
                y1 += w * x1
                y2 += w * x2
                y3 += w * x3
            store4(out, (b, row, 4 * quad), y0 * scale, y1 * scale, y2 * scale, y3 * scale)

    return merge_splits


# ---------------------------------------------------------------------------------------------
# Launch plumbing
# ---------------------------------------------------------------------------------------------
_SMEM_READY = set()


def _allow_large_shared_memory(dispatcher, args, nbytes):
    """Opt the compiled kernel in to > 48 KiB of dynamic shared memory (a no-op in the sim).

    numba-cuda 0.30 launches through cuda.core, which does not raise the per-function limit
    itself; without this the launch fails with CUDA_ERROR_INVALID_VALUE.
    """
    if SIMULATOR or nbytes <= 48 * 1024:
        return
    argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
    compiled = dispatcher.compile(argtypes)
    cufunc = compiled._codelibrary.get_cufunc()
    key = (id(cufunc), nbytes)
    if key in _SMEM_READY:
        return
    from numba.cuda.cudadrv import driver as drv
    attr = drv.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    drv.driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, cufunc.device.id)
    _SMEM_READY.add(key)


@lru_cache(maxsize=1)
def _sm_count() -> int:
    if SIMULATOR:
        return 4
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


class MlaAttentionPlan:
    """Buffers, split count and configured kernels for one problem shape; call it to run.

    Reuse one plan per shape in a decode loop: it allocates nothing per call, so its launches
    can also be captured in a CUDA graph.  ``max_keys`` bounds ``prefix_len + n`` and only sets
    the split count (default: ``max_len``); ``keys_per_split`` forces a split size (tests).
    """

    def __init__(self, bs, n, heads, r, dr, max_len, *, max_keys=None, keys_per_split=None,
                 stream=0):
        compat.require_kernels()
        self.shape = (bs, n, heads, r, dr, max_len)
        self.cfg = tile_config(r, dr)
        self.stream = stream
        self.n_rows = n * heads
        row_tiles = -(-self.n_rows // self.cfg.rows)
        max_keys = max_len if max_keys is None else min(int(max_keys), max_len)
        if keys_per_split is None:
            splits = choose_splits(row_tiles * bs, max_keys, self.cfg.keys, _sm_count(),
                                   4 * self.cfg.rows * (r + 2))
            tiles = -(-max(1, max_keys) // self.cfg.keys)
            keys_per_split = -(-tiles // splits) * self.cfg.keys
        self.chunk = int(keys_per_split)
        self.splits = max(1, -(-max_keys // self.chunk))
        self.grid = (row_tiles, self.splits, bs)
        self.attn = _attention_kernel(self.cfg)
        self.merge = _merge_kernel(r) if self.splits > 1 else None
        if self.splits > 1:
            self.part_o = cuda.device_array((bs, self.splits, self.n_rows, r), np.float32,
                                            stream=stream)
            self.part_ml = cuda.device_array((bs, self.splits, self.n_rows, 2), np.float32,
                                             stream=stream)
        else:  # unused by the kernel, but typed arguments must exist
            self.part_o = cuda.device_array((1, 1, 1, 4), np.float32, stream=stream)
            self.part_ml = cuda.device_array((1, 1, 1, 2), np.float32, stream=stream)

    def __call__(self, q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=None):
        bs, n, heads, r, dr, max_len = self.shape
        _check_shapes(self.shape, q_abs, q_pe, ckv, kpe, prefix_len, visible)
        st = self.stream
        q_abs3 = to_device(q_abs, st).reshape(bs, self.n_rows, r)
        q_pe3 = to_device(q_pe, st).reshape(bs, self.n_rows, dr)
        ckv_d, kpe_d = to_device(ckv, st), to_device(kpe, st)
        prefix_d = to_device(_as_int32(prefix_len), st)
        visible_d = to_device(_as_bool(visible), st)
        if out is None:
            out = cuda.device_array((bs, n, heads, r), np.float32, stream=st)
        out3 = out.reshape(bs, self.n_rows, r)
        direct = self.splits == 1
        args = (q_abs3, q_pe3, ckv_d, kpe_d, prefix_d, visible_d, np.float32(tau), np.int64(n),
                np.int64(heads), np.int64(self.chunk), direct, out3, self.part_o, self.part_ml)
        nbytes = self.cfg.smem_bytes()
        _allow_large_shared_memory(self.attn, args, nbytes)
        self.attn[self.grid, self.cfg.threads, st, nbytes](*args)
        if not direct:
            self.merge[(self.n_rows, bs), min(MERGE_THREADS, r // 4), st](
                self.part_o, self.part_ml, np.int64(self.splits), out3)
        return out


def _as_int32(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.int32)


def _as_bool(x):
    if compat.is_device_array(x):
        return x
    return np.ascontiguousarray(x, dtype=np.bool_)


def _check_shapes(shape, q_abs, q_pe, ckv, kpe, prefix_len, visible):
    bs, n, heads, r, dr, max_len = shape
    want = {"q_abs": (bs, n, heads, r), "q_pe": (bs, n, heads, dr), "ckv": (bs, max_len, r),
            "kpe": (bs, max_len, dr), "prefix_len": (bs,), "visible": (bs, n, n)}
    got = {"q_abs": q_abs, "q_pe": q_pe, "ckv": ckv, "kpe": kpe, "prefix_len": prefix_len,
           "visible": visible}
    for name, arr in got.items():
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"{name} has shape {tuple(arr.shape)}, expected {want[name]}")
    for name in ("q_abs", "q_pe", "ckv", "kpe"):
        if np.dtype(got[name].dtype) != np.float32:
            raise TypeError(f"{name} must be float32, got {got[name].dtype}")
    if np.dtype(visible.dtype) not in (np.dtype(np.bool_), np.dtype(np.uint8)):
        raise TypeError(f"visible must be bool or uint8, got {visible.dtype}")
    if not compat.is_device_array(prefix_len):
        p = np.asarray(prefix_len)
        if np.any(p < 0) or np.any(p + n > max_len):
            raise ValueError(f"prefix_len + n must lie in [n, max_len={max_len}]: {p}")


@lru_cache(maxsize=16)
def _cached_plan(shape, max_keys, keys_per_split):
    return MlaAttentionPlan(*shape, max_keys=max_keys, keys_per_split=keys_per_split)


def mla_attention(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, *, out=None, max_keys=None,
                  keys_per_split=None):
    """Absorbed-MLA attention on the device; contract in ``reference/attention.py``.

    Inputs may be NumPy, numba device or CuPy arrays (float32; ``visible`` bool or uint8;
    ``prefix_len`` integer).  Returns a numba device array u [bs, n, H, r] float32 (or ``out``).
    A host ``prefix_len`` sets the split count from its maximum; for a device one pass
    ``max_keys`` (>= max(prefix_len) + n) or the cache length ``max_len`` is assumed.
    """
    bs, n, heads, r = q_abs.shape
    shape = (bs, n, heads, r, q_pe.shape[-1], ckv.shape[1])
    if max_keys is None and not compat.is_device_array(prefix_len):
        max_keys = int(np.max(prefix_len)) + n if bs else n
    plan = _cached_plan(shape, max_keys, keys_per_split)
    return plan(q_abs, q_pe, ckv, kpe, prefix_len, visible, tau, out=out)


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


@lru_cache(maxsize=None)
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


def _run_head_gemm(a2, a_hs, b2, b_hs, b_off, b_transposed, c2, c_hs, m, n_out, k, heads):
    tile = _gemm_tile()
    grid = (-(-n_out // tile.tn), -(-m // tile.tm), heads)
    _head_gemm_kernel(tile, b_transposed)[grid, tile.ty * tile.tx](
        a2, np.int64(a_hs), b2, np.int64(b_hs), np.int64(b_off), c2, np.int64(c_hs),
        np.int64(m), np.int64(n_out), np.int64(k))


def absorb_q(q_nope, kv_b_proj, *, out=None):
    """``q_abs[b,i,h,:] = W_UK[h]^T q_nope[b,i,h,:]`` on the device (reference: same name).

    q_nope [bs, n, H, dn] float32, kv_b_proj [H*(dn+dv), r] float32 -> device [bs, n, H, r].
    """
    bs, n, heads, dn = q_nope.shape
    rows, r = kv_b_proj.shape
    per_head = rows // heads
    if rows % heads or per_head <= dn:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dn={dn}")
    tokens = bs * n
    a2 = to_device(_f32(q_nope)).reshape(tokens, heads * dn)
    w = to_device(_f32(kv_b_proj))
    if out is None:
        out = cuda.device_array((bs, n, heads, r), np.float32)
    _run_head_gemm(a2, dn, w, per_head, 0, False, out.reshape(tokens, heads * r), r,
                   tokens, r, dn, heads)
    return out


def apply_uv(u, kv_b_proj, dv, *, out=None):
    """``o[b,i,h,:] = W_UV[h] u[b,i,h,:]`` on the device (reference: same name).

    u [bs, n, H, r] float32, kv_b_proj [H*(dn+dv), r] float32, dv = v_head_dim
    -> device [bs, n, H, dv].
    """
    bs, n, heads, r = u.shape
    rows = kv_b_proj.shape[0]
    per_head = rows // heads
    if rows % heads or per_head <= dv:
        raise ValueError(f"kv_b_proj has {rows} rows: not H*(dn+dv) for H={heads}, dv={dv}")
    tokens = bs * n
    a2 = to_device(_f32(u)).reshape(tokens, heads * r)
    w = to_device(_f32(kv_b_proj))
    if out is None:
        out = cuda.device_array((bs, n, heads, dv), np.float32)
    _run_head_gemm(a2, r, w, per_head, per_head - dv, True, out.reshape(tokens, heads * dv),
                   dv, tokens, dv, r, heads)
    return out


def _f32(x):
    if compat.is_device_array(x):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"expected float32 device array, got {x.dtype}")
        return x
    return np.ascontiguousarray(x, dtype=np.float32)

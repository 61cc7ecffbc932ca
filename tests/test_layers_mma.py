"""linear(method="mma"): the bf16 tensor-core GEMM (kdtree_numba/layers/mma.py).

Anywhere (CI): the bf16 rounding oracle; a NumPy replay of one whole block of the kernel --
staging through the module's index helpers into the swizzled panels, the fragments by
``ldmatrix`` at the lanes' ``ldsm_word`` addresses, ldmatrix and the mma as the PTX ISA
defines them (written out here, independently of the module), the epilogue through
``c_position`` -- against bf16(x) @ w^T; the panels' bank quads; the
argument checks; the kernel itself run by the simulator with the warp's mma emulated by the
ISA layout (``test_simulated_kernel_equals_the_bf16_product``); and (subprocess, no simulator)
the kernels compile to sm_90 PTX holding the ``mma.sync ... m16n8k16 ... bf16`` instruction, no
local memory, and ptxas assembles them.
On the GPU (marker ``gpu``): a one-warp tile, then linear(method="mma") against the float64
reference within the bound of docs/LAYERS.md ("bf16 tensor-core linear"), per output element.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from ptx_check import HOPPER_PRELUDE

import reference.layers as ref
from kdtree_numba.gpu.memory import MAX_SHARED_BYTES
from kdtree_numba.layers import mma as mm


def bf16_bits(x) -> np.ndarray:
    """The oracle: float32 -> bf16 bits, round to nearest, ties to even (finite inputs)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def test_bf16_oracle_rounds_to_nearest_even():
    u = 2.0 ** -7                       # bf16's ulp at 1.0
    x = np.array([1.0, 1 + u / 2, 1 + 3 * u / 2, 1 + u / 4, 1 + 3 * u / 4, -(1 + u / 2), 3.0],
                 np.float32)
    want = np.array([1.0, 1.0, 1 + 2 * u, 1.0, 1 + u, -1.0, 3.0], np.float32)
    assert bf16_value(bf16_bits(x)).tobytes() == want.tobytes()


def test_simulator_pack_bf16x2_rounds_like_the_oracle(needs_kernels):
    from kdtree_numba import compat
    from kdtree_numba.gpu.tensorcore import pack_bf16x2
    if not compat.SIMULATOR:
        pytest.skip("the bit-level fallback exists only under the simulator")
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    x[:4] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 0.0]
    bits = bf16_bits(x)
    for i in range(0, len(x), 2):
        word = int(pack_bf16x2(x[i], x[i + 1]))
        assert (word & 0xFFFF, word >> 16) == (int(bits[i]), int(bits[i + 1]))


# ------------------------------------------------------------------ NumPy replay of a block

def isa_mma(a_regs, b_regs):
    """(A [16, 16], B [16, 8]) that 32 lanes' registers stand for, by the PTX ISA's "Matrix
    Fragments for mma.m16n8k16 with floating point type" (.bf16): a_regs [32, 4], b_regs
    [32, 2] uint32, element i of a fragment is half i % 2 of register i // 2 (low half first)."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        group, tig = lane >> 2, lane % 4
        for i in range(8):
            row = group if (i < 2 or 4 <= i < 6) else group + 8
            col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
            A[row, col] = bf16_value((int(a_regs[lane][i // 2]) >> (16 * (i & 1))) & 0xFFFF)
        for i in range(4):
            row = tig * 2 + (i & 1) + (8 if i >= 2 else 0)
            B[row, group] = bf16_value((int(b_regs[lane][i // 2]) >> (16 * (i & 1))) & 0xFFFF)
    assert not np.isnan(A).any() and not np.isnan(B).any(), "a fragment element never set"
    return A, B


def _isa_positions():
    """isa_mma's (row, col) of each lane's fragment elements as index arrays: A's [32, 8],
    B's [32, 4] (element i of a lane, as isa_mma numbers them)."""
    lane, i = np.arange(32)[:, None], np.arange(8)[None, :]
    group, tig = lane >> 2, lane % 4
    a_row = group + 8 * ((i // 2) % 2)           # rows g for i in 0, 1, 4, 5; g + 8 else
    a_col = tig * 2 + (i & 1) + 8 * (i >= 4)
    i = i[:, :4]
    b_row = tig * 2 + (i & 1) + 8 * (i >= 2)
    return a_row, a_col, b_row, np.broadcast_to(group, b_row.shape)


_ISA_AT = _isa_positions()


def isa_mma_arrays(a_regs, b_regs):
    """isa_mma's (A, B) by NumPy indexing, for the simulator's mma emulation, where isa_mma's
    per-element loop was most of an emulated mma; the same values
    (test_isa_mma_arrays_places_every_element_as_isa_mma_does)."""
    a_row, a_col, b_row, b_col = _ISA_AT

    def elements(regs, n):      # [32, n] uint32 words -> [32, 2n] bf16 values, low half first
        words = np.array([[int(r) for r in lane] for lane in regs], np.uint32).reshape(32, n)
        halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(32, 2 * n)
        return bf16_value(halves.astype(np.uint16)).astype(np.float64)
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    A[a_row, a_col] = elements(a_regs, 4)
    B[b_row, b_col] = elements(b_regs, 2)
    return A, B


def test_isa_mma_arrays_places_every_element_as_isa_mma_does():
    rng = np.random.default_rng(12)
    for _ in range(3):
        a = [tuple(np.uint32(v) for v in bf16_bits(rng.standard_normal(8) * 10).view(np.uint32))
             for _ in range(32)]
        b = [tuple(np.uint32(v) for v in bf16_bits(rng.standard_normal(4) * 10).view(np.uint32))
             for _ in range(32)]
        want, got = isa_mma(a, b), isa_mma_arrays(a, b)
        assert all(w.tobytes() == g.tobytes() for w, g in zip(want, got))


def isa_c(lane, e):
    """Accumulator e of a lane: row groupID (+ 8 for e >= 2), column 2 threadID + e % 2."""
    return (lane >> 2) + (8 if e >= 2 else 0), 2 * (lane % 4) + (e & 1)


def isa_ldmatrix(smem, addrs, n):
    """PTX ISA ``ldmatrix.sync.aligned.m8n8.x{n}.shared.b16``: lane i gives the (word) address
    of row i % 8 of matrix i // 8, 16 bytes; every lane receives, from each matrix m, the
    32-bit word i % 4 of row i // 4 (its elements 2 (i % 4), 2 (i % 4) + 1) in register m."""
    return [[smem[addrs[8 * m + lane // 4] + lane % 4] for m in range(n)] for lane in range(32)]


def replay_block(x, w16, cfg, ldsm_word=mm.ldsm_word):
    """y [M, N] of one block (M <= BM, N <= BN, no K slices) computed as the kernel moves the
    data: stages of bk staged by w_stage_slot (x rounded to bf16 first), per warp, panel and
    k16 step the lanes' ldmatrix loads at ldsm_word(...) from each fragment's first row
    (x4: an m16 tile, or two n8 tiles; x2: an odd last n8 tile), the mma by the ISA,
    accumulators written through c_position."""
    (m, k), n = x.shape, w16.shape[0]
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    acc = np.zeros((cfg.wm * cfg.wn, 32, cfg.tm, cfg.tn, 4))
    for ks in range(0, k, bk):
        asm = np.zeros(bm * bk // 2, np.uint32)
        bsm = np.zeros(bn * bk // 2, np.uint32)
        for q in range(bm * bk // 8):
            row, kk, off = mm.w_stage_slot(q, bm, bk)
            if row < m and ks + kk < k:
                asm[off:off + 4] = bf16_bits(x[row, ks + kk:ks + kk + 8]).view(np.uint32)
        for c in range(bn * bk // 8):
            row, kk, off = mm.w_stage_slot(c, bn, bk)
            if row < n and ks + kk < k:
                bsm[off:off + 4] = w16[row, ks + kk:ks + kk + 8].copy().view(np.uint32)
        for warp in range(cfg.wm * cfg.wn):
            wm_i, wn_i = warp % cfg.wm, warp // cfg.wm
            for p in range(bk // 32):
                for step in range(2):
                    for i in range(cfg.tm):
                        a_at = mm.panel_word(p, bm, wm_i * 16 * cfg.tm + 16 * i, 0)
                        a_regs = isa_ldmatrix(asm, [a_at + ldsm_word(lane, step, True)
                                                    for lane in range(32)], 4)
                        for j in range(cfg.tn):
                            b_at = mm.panel_word(p, bn, wn_i * 8 * cfg.tn + 16 * (j // 2), 0)
                            both = isa_ldmatrix(bsm, [b_at + ldsm_word(lane, step, False)
                                                      for lane in range(32)],
                                                4 if j // 2 * 2 + 1 < cfg.tn else 2)
                            b_regs = [r[2 * (j % 2):2 * (j % 2) + 2] for r in both]
                            A, B = isa_mma(a_regs, b_regs)
                            D = A @ B
                            for lane in range(32):
                                for e in range(4):
                                    acc[warp, lane, i, j, e] += D[isa_c(lane, e)]
    y = np.zeros((m, n))
    for warp in range(cfg.wm * cfg.wn):
        wm_i, wn_i = warp % cfg.wm, warp // cfg.wm
        for lane in range(32):
            for i in range(cfg.tm):
                for j in range(cfg.tn):
                    for e in range(4):
                        r, c = mm.c_position(lane, e)
                        row = wm_i * 16 * cfg.tm + 16 * i + r
                        col = wn_i * 8 * cfg.tn + 8 * j + c
                        if row < m and col < n:
                            y[row, col] = acc[warp, lane, i, j, e]
    return y


@pytest.mark.parametrize("splits, k", [(2, 320), (3, 320), (2, 192)])
def test_simulated_stages_of_128_slice_k_like_stages_of_64(splits, k, needs_kernels,
                                                            monkeypatch):
    """The K slices are cut in units of 64 whatever the stage: a 128-element stage that runs
    past its slice's end (5 units in 2 slices: 2 + 3, a stage and a half) zero-fills the
    rest, and the zero mma steps leave every accumulator as it was, so the decode tile's
    256-byte stages give a row bitwise what the 64-element stages of the other tiles give."""
    from kdtree_numba import compat
    from kdtree_numba.layers import linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU's batch-invariance test covers the real mma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    x, w16, want = _block_case(7, 3, 8, k)
    rows = [linear(x, w16, method="mma", config=mm.MmaConfig(
        wm=1, wn=1, tm=1, tn=1, bk=bk, stages=2, splits=splits)).copy_to_host()
        for bk in (64, 128)]
    assert rows[0].tobytes() == rows[1].tobytes()
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(bf16_value(w16).astype(np.float64)).T
    assert np.all(np.abs(rows[1] - want) <= (k + 2) * 2.0 ** -24 * magnitude)


@pytest.mark.parametrize("m, n, k, splits", [(19, 9, 320, 2),
                                             pytest.param(5, 20, 456, 3,
                                                          marks=pytest.mark.slow)])
def test_simulated_sums_in_the_last_slice_block_keep_the_bits(m, n, k, splits, needs_kernels,
                                                              monkeypatch):
    """``KDTREE_MMA_SUMS_IN_LAST``: each output tile's last K-slice block adds the slices'
    partial sums (mma.make_sum_when_last) -- sum_splits' bits without its launch, over 2 M
    tiles x 3 N tiles or ragged ones; the counters back at 0, so a second call on the same
    workspace (another x) is right too; after the first call, which makes and zeroes the
    counters (gpu/counters.py), one launch fewer."""
    import launch_counter
    from kdtree_numba import compat
    from kdtree_numba.layers import Workspace, linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real mma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    cfg = mm.MmaConfig(wm=1, wn=1, tm=1, tn=1, splits=splits)
    ws = Workspace()
    monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", "1")       # the counters made (one launch)
    linear(*_block_case(7, m, n, k)[:2], method="mma", config=cfg, workspace=ws)
    for seed in (8, 9):
        x, w16, _ = _block_case(seed, m, n, k)
        got = {}
        for switch in ("0", "1"):
            monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", switch)
            with launch_counter.installed() as counter, counter.window() as launches:
                got[switch] = linear(x, w16, method="mma", config=cfg,
                                     workspace=ws).copy_to_host()
            assert sum(launches.values()) == (3 if switch == "0" else 2)   # round, GEMM, sum
        assert got["1"].tobytes() == got["0"].tobytes(), seed
        from kdtree_numba.gpu import counters
        kept = counters.made("linear.mma")
        assert kept and not any(a.copy_to_host().any() for a in kept)


def _wgmma_operand(smem, desc, rows):
    """The rows x 16 bf16 operand a wgmma reads through a shared-memory matrix descriptor, as
    the PTX ISA defines it for K-major operands with the 64- or 128-byte swizzle (mode 2 or
    1 in bits 62-63): start address (bits 0-13) << 4, stride byte offset (bits 32-45) << 4
    between groups of 8 rows, rows of a group 64 (128) bytes apart, element k 2k bytes into
    its row, then the swizzle on the absolute address: bits 4-5 ^= bits 7-8 (bits 4-6 ^=
    bits 7-9)."""
    desc = int(desc) & (1 << 64) - 1
    width = {2: 64, 1: 128}[desc >> 62]     # 64- or 128-byte swizzle (the TMA kernel's too)
    start, sbo = (desc & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    r, k = np.arange(rows)[:, None], np.arange(16)[None, :]
    addr = start + (r // 8) * sbo + (r % 8) * width + 2 * k
    addr ^= ((addr >> 7) & (width // 16 - 1)) << 4
    words = np.asarray(smem).view(np.uint32)[addr // 4]
    halves = np.where(addr % 4 == 0, words & 0xFFFF, words >> 16).astype(np.uint32)
    return (halves << 16).view(np.float32).astype(np.float64)


def _wgmma_emulation(n, acc, smem, desc_a, desc_b):
    """``wgmma.mma_async ... m64n{n}k16.f32.bf16.bf16`` for one thread of the simulated
    warpgroup: its n / 2 accumulators of D = A B^T + acc (A, B read from shared memory through
    the descriptors, products exact in float64, each output rounded to float32 once, as the
    mma.sync emulation does per k16 step), placed by the ISA's fragment layout for D:
    register i of thread T at row 16 (T / 32) + (T % 32) / 4 + 8 ((i / 2) % 2), column
    8 (i / 4) + 2 (T % 4) + i % 2.  Operands in shared memory need no exchange between
    threads, so no barrier.  The product is the warpgroup's: the first of its 128 threads to
    issue a call reads the operands, the others take its D (their call's number, operands and
    block agree: the kernel's barriers keep the stage in place until all have read it)."""
    import threading
    me = threading.current_thread()
    t = me.threadIdx.x % 128
    call = me.__dict__.get("_wgmma_calls", 0)
    me._wgmma_calls = call + 1
    key = (id(me._manager), me.threadIdx.x // 128, call, int(desc_a), int(desc_b))
    with _WGMMA_LOCK:
        entry = _WGMMA_PRODUCTS.get(key)
        if entry is None:
            entry = _WGMMA_PRODUCTS[key] = [_wgmma_operand(smem, desc_a, 64)
                                            @ _wgmma_operand(smem, desc_b, n).T, 0]
        d = entry[0]
        entry[1] += 1
        if entry[1] == 128:             # the warpgroup's last thread: the product is done
            del _WGMMA_PRODUCTS[key]
    for i in range(n // 2):
        row = 16 * (t // 32) + (t % 32) // 4 + 8 * ((i // 2) % 2)
        col = 8 * (i // 4) + 2 * (t % 4) + i % 2
        acc[i] = np.float32(d[row, col] + np.float64(acc[i]))


_WGMMA_LOCK = __import__("threading").Lock()
_WGMMA_PRODUCTS: dict = {}


def test_wgmma_descriptor_fields():
    """Start address >> 4 in bits 0-13 (addresses below 256 KiB), leading byte offset 1,
    stride byte offset 512 >> 4 in bits 32-45, the 64-byte swizzle (2) in bits 62-63."""
    d = int(np.int64(mm.wgmma_descriptor(np.int64(0x12340))).view(np.uint64))
    assert d & 0x3FFF == 0x1234 and (d >> 16) & 0x3FFF == 1
    assert (d >> 32) & 0x3FFF == 32 and d >> 62 == 2 and (d >> 46) & 0xFFFF == 0


def test_wgmma_operand_reads_the_panel_layout():
    """The ISA's 64-byte swizzle, read through a descriptor, finds every element where
    panel_word put it (the kernel's staging): the two layouts are one."""
    rows = 24
    smem = np.zeros(rows * 16 * 2, np.uint32)
    bits = bf16_bits(np.random.default_rng(2).standard_normal((rows, 32)).astype(np.float32))
    vals = bf16_value(bits)                                # distinct, exact in bf16
    for r in range(rows):
        for c in range(4):                        # 16-byte chunks of a 32-wide panel row
            w = mm.panel_word(0, rows, r, c)
            smem[w:w + 4] = bits[r, 8 * c:8 * c + 8].view(np.uint32)
    for step in range(2):
        got = _wgmma_operand(smem, mm.wgmma_descriptor(32 * step), rows)
        assert np.array_equal(got, vals[:, 16 * step:16 * step + 16])


@pytest.mark.parametrize("m, n, k, cfg", [
    (40, 72, 136, mm.MmaConfig(wm=1, wn=4, tm=4, tn=2, stages=3, wgmma=True)),  # ragged
    # two warpgroups, K slices, 2 stages ahead (BN = 32, the narrowest tile of 256 threads:
    # the mma.sync twin's 8 warps cost the simulator 2 block barriers per mma; N = 24 ragged)
    pytest.param(100, 24, 320, mm.MmaConfig(wm=2, wn=4, tm=4, tn=1, stages=4, wgmma=True,
                                            splits=2),
                 marks=pytest.mark.slow),  # ~9 s; the GPU suite runs WGMMA_TILE's two
    #                                        warpgroups from 100 rows (test_gpu_linear_mma_*)
    pytest.param(100, 24, 320, mm.MmaConfig(wm=2, wn=4, tm=4, tn=1, stages=4, wgmma=True,
                                            splits=3, slices_in_block=True),
                 marks=pytest.mark.slow),  # each block adds its 3 slices (~7 s; the mma.sync
    #                                        case below adds them in CI)
    (20, 24, 200, mm.MmaConfig(wm=1, wn=1, tm=2, tn=3, stages=3, splits=2,
                               slices_in_block=True)),         # the same on mma.sync
    # four warpgroups of 64 rows (BM = 256, 512 threads: bench_layers' "wgmma 256 x 128"
    # variant at BN = 64), ragged in both M and N
    pytest.param(200, 72, 192, mm.MmaConfig(wm=4, wn=4, tm=4, tn=2, stages=3, wgmma=True),
                 marks=pytest.mark.slow),
])
def test_simulated_wgmma_kernel_equals_the_mma_sync_kernel(m, n, k, cfg, needs_kernels,
                                                           monkeypatch):
    """The warpgroup-mma kernel (tiles staged as for mma.sync, descriptors into them, the
    warpgroup's fragment layout in the epilogue) on the simulator, its wgmma emulated from
    the ISA: bitwise the mma.sync kernel on the same staging (both emulations round each
    k16 step's output once), and within the bf16 product's accumulation bound.  A block
    that adds its own K slices (``slices_in_block``) gives sum_splits' bits."""
    from kdtree_numba import compat
    from kdtree_numba.gpu import tensorcore
    from kdtree_numba.layers import linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real wgmma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    monkeypatch.setattr(tensorcore, "sim_wgmma", _wgmma_emulation)
    x, w16, want = _block_case(9, m, n, k)
    got = linear(x, w16, method="mma", config=cfg).copy_to_host()
    sync = linear(x, w16, method="mma", config=dataclasses.replace(
        cfg, wgmma=False, slices_in_block=False)).copy_to_host()
    assert got.tobytes() == sync.tobytes()
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(bf16_value(w16).astype(np.float64)).T
    assert np.all(np.abs(got - want) <= (k + 2) * 2.0 ** -24 * magnitude)


def _block_case(seed, m, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32))
    want = bf16_value(bf16_bits(x)).astype(np.float64) @ bf16_value(w16).astype(np.float64).T
    return x, w16, want


@pytest.mark.parametrize("cfg, m, n, k", [
    (mm.MmaConfig(wm=1, wn=1, tm=1, tn=1), 16, 8, 32),          # one m16n8 tile (x2 for B)
    (mm.MmaConfig(wm=1, wn=2, tm=1, tn=2), 11, 29, 72),         # ragged M, N, K (zero fill)
    (mm.MmaConfig(wm=2, wn=1, tm=2, tn=1, bk=64), 64, 8, 128),  # two panels per stage
    (mm.MmaConfig(wm=1, wn=1, tm=2, tn=3), 30, 21, 64),         # a B pair, then an x2 tile
])
def test_block_replay_equals_the_bf16_product(cfg, m, n, k):
    x, w16, want = _block_case(1, m, n, k)
    got = replay_block(x, w16, cfg)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_block_replay_catches_a_wrong_fragment():
    """The replay has teeth: A's matrices 1 and 2 swapped (rows g + 8 and k + 8 mixed up)."""
    def swapped(lane, step, a_operand):
        m = lane >> 3
        if a_operand and m in (1, 2):
            lane = (3 - m) * 8 + (lane & 7)
        return mm.ldsm_word(lane, step, a_operand)
    x, w16, want = _block_case(2, 16, 8, 32)
    got = replay_block(x, w16, mm.MmaConfig(wm=1, wn=1, tm=1, tn=1), ldsm_word=swapped)
    assert np.max(np.abs(got - want)) > 0.1 * np.max(np.abs(want))


def test_panels_are_swizzled_into_distinct_bank_quads():
    """Every chunk of a panel row lands once; the 8 rows one ldmatrix matrix reads (8
    consecutive rows from a multiple of 8, one chunk) sit in 8 different 16-byte bank quads
    (word // 4 mod 8), which the unswizzled layout would not (rows r, r + 2 share one); the
    staging slot and the lanes' addresses are panel_word's."""
    rows, bk = 48, 64
    offs = [mm.w_stage_slot(c, rows, bk)[2] for c in range(rows * bk // 8)]
    assert sorted(offs) == list(range(0, rows * bk // 2, 4))
    for c in range(rows * bk // 8):
        row, kk, off = mm.w_stage_slot(c, rows, bk)
        assert off == mm.panel_word(kk // 32, rows, row, kk % 32 // 8)
    for p in range(bk // 32):
        for r0 in range(0, rows, 8):
            for chunk in range(4):
                quads = {mm.panel_word(p, rows, r0 + r, chunk) // 4 % 8 for r in range(8)}
                assert len(quads) == 8
                plain = {((p * rows + r0 + r) * 16 + 4 * chunk) // 4 % 8 for r in range(8)}
                assert len(plain) < 8
    for lane in range(32):
        for step in range(2):
            m, r = lane >> 3, lane & 7
            assert mm.ldsm_word(lane, step, True) == mm.panel_word(0, 0, 8 * (m & 1) + r,
                                                                   2 * step + (m >> 1))
            assert mm.ldsm_word(lane, step, False) == mm.panel_word(0, 0, 8 * (m >> 1) + r,
                                                                    2 * step + (m & 1))


def test_slices_fold_into_the_block_from_64_tiles_of_two_warpgroups_at_most():
    """mma_linear's fold (runs 200-201: faster from 64 M x N tiles, slower below; a
    four-warpgroup tile's folded accumulators would not fit an SM's registers)."""
    tile = mm.WGMMA_TILE                                            # 128 x 128
    assert mm.folds_slices(tile, 512, 2048, 4)                      # 4 x 16 = 64 tiles
    assert not mm.folds_slices(tile, 512, 1920, 4)                  # 4 x 15 = 60
    assert mm.folds_slices(tile, 256, 7168, 4)                      # 2 x 56 = 112
    assert not mm.folds_slices(tile, 128, 7168, 4)                  # 56
    assert not mm.folds_slices(tile, 512, 7168, 1)                  # no slices to fold
    assert not mm.folds_slices(dataclasses.replace(tile, wm=4), 4096, 7168, 4)   # 512 threads
    assert not mm.folds_slices(dataclasses.replace(tile, wgmma=False), 4096, 7168, 4)


def test_configs_and_splits():
    assert mm.mma_config(1, 163840, 7168) == mm.MmaConfig(wm=1, wn=4, tm=1, tn=4, bk=128,
                                                          stages=3, splits=1)
    for n, k in [(1536, 7168), (7168, 2048), (163840, 7168), (200, 72), (12288, 1536)]:
        picks = [mm.mma_config(m, n, k) for m in (1, 9, 16, 17, 33, 65, 512, 4096)]
        # batch invariance: every tile of every M slices K alike (in units of 64 whatever
        # its stage: test_simulated_stages_of_128_slice_k_like_stages_of_64)
        assert {c.splits for c in picks} == {mm.mma_splits(n, k)}
        assert {c.bk for c in picks} == {64, 128}
        for m, cfg in zip((1, 9, 16, 17, 33, 65, 512, 4096), picks):
            if cfg.swap_ab:         # sm_90: a verify's rows (or a decode's sliced product)
                assert (m in mm.SWAPPED_ROWS or m == 1) and cfg.bn == 8 * -(-m // 8)
                continue
            assert cfg.bm >= min(m, 64) and cfg.bn in (64, 128)
            assert cfg.bm >= m or m > 80                     # up to 80 rows: one M tile
            assert cfg.smem_bytes <= MAX_SHARED_BYTES
        s = mm.mma_splits(n, k)
        assert s == 1 or -(-k // 64) // s >= 8                # >= 2 rings of stages per slice
    # products without K slices keep twice the N tiles at 65-80 rows (their only parallelism)
    assert (mm.mma_tile(72).bn, mm.unsliced_tile(72).bn, mm.unsliced_tile(72).bm) == (128, 64, 80)
    assert all(mm.unsliced_tile(m) == mm.mma_tile(m) for m in (1, 16, 33, 64, 81, 512))
    assert mm.mma_splits(1536, 7168) == 8                    # 12 N tiles: K slices fill the GPU
    assert mm.mma_splits(163840, 7168) == 1                  # 1280 N tiles already do


@pytest.mark.parametrize("n, k, best", [(7168, 8192, 4), (2112, 7168, 8), (7168, 18432, 4),
                                        (36864, 7168, 4), (163840, 7168, 1), (12288, 1536, 1)])
def test_k_slices_stop_once_the_waves_are_three_quarters_full(n, k, best):
    """mma_splits doubles while more than a quarter of its waves' block slots (two blocks per
    SM) would idle: the slices the H200 sweep of 1-64 found fastest at M = 1 for o_proj, q_a +
    kv_a, 18432 -> 7168 and 7168 -> 36864 (runs 130-131; the old bound of four blocks per SM
    gave o_proj 16, 1.26x slower), and the lm_head's 1280 tiles need none; q_b (K = 1536,
    under MIN_SLICED_STAGES) ran fastest whole at M = 1, 33 and 65 (run 130)."""
    assert mm.mma_splits(n, k) == best
    # past 80 rows: warpgroup mma where the GPU has it (sm_90), else 64 x 128 on warps
    assert mm.mma_tile(81) == (mm.WGMMA_TILE if mm.wgmma_available() else
                               mm.MmaConfig(wm=2, wn=2, tm=2, tn=8, stages=3))
    assert (mm.WGMMA_TILE.bm, mm.WGMMA_TILE.bn, mm.WGMMA_TILE.threads) == (128, 128, 256)
    for bad in (dict(bk=48), dict(stages=1), dict(stages=5),
                dict(wm=4, wn=4, tm=4, tn=8, stages=4),           # 256 KiB of shared memory
                dict(wm=1, wn=4, tm=1, tn=4, bk=32)):   # 64 x chunks for 128 threads (the ring)
        with pytest.raises(ValueError):
            mm.MmaConfig(**bad)


def test_error_coefficient_is_dominated_by_the_bf16_rounding_of_x():
    c = mm.mma_error_coefficient(7168, 1)
    assert 2.0 ** -8 < c < 2.0 ** -8 + 2 ** -11        # accumulation: < 1/8 of the rounding
    assert mm.mma_error_coefficient(7168, 8) < c        # slices shorten the mma chains


@pytest.mark.parametrize("what", ["f32 weights", "K % 8", "strided x"])
def test_mma_rejects_what_it_cannot_take(what, needs_kernels):
    from kdtree_numba.layers import linear
    rng = np.random.default_rng(3)
    k = 20 if what == "K % 8" else 32
    x = rng.standard_normal((4, 2 * k if what == "strided x" else k)).astype(np.float32)
    w = rng.standard_normal((8, k)).astype(np.float32)
    if what != "f32 weights":
        w = bf16_bits(w)
    if what == "strided x":
        from kdtree_numba.compat import to_device
        x = to_device(x)[:, ::2]
    with pytest.raises(ValueError, match="mma"):
        linear(x, w, method="mma")


def test_mma_needs_a_gpu_under_the_simulator(needs_kernels):
    from kdtree_numba import compat
    from kdtree_numba.layers import linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only")
    x = np.ones((2, 16), np.float32)
    with pytest.raises(NotImplementedError, match="tensor cores"):   # at the first mma
        linear(x, bf16_bits(np.ones((8, 16), np.float32)), method="mma")


def test_tensor_cores_method_takes_mma_where_it_can(needs_kernels, monkeypatch):
    """linear(method="tensor-cores") and make_backend(gemm="tensor-cores") run the mma kernel
    for bf16 weights whose K % 8 == 0 (on the simulator: the emulated warp mma, so the result
    is the bf16 product) and the skinny float32 kernel otherwise (float32 weights, K = 20),
    whatever M: the choice never looks at M, so it is batch invariant.  The backend's
    setting sends the experts there too and plans attention's splits batch invariantly."""
    from kdtree_numba import compat
    from kdtree_numba.backends import make_backend
    from kdtree_numba.layers import linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real mma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    got_at = {}
    for m in (1, 20):
        x, w16, want = _block_case(6, m, 8, 32)
        got = got_at[m] = linear(x, w16, method="tensor-cores").copy_to_host()
        fp32 = linear(x, w16).copy_to_host()            # x kept in float32: another result
        magnitude = np.abs(x.astype(np.float64)) @ np.abs(bf16_value(w16).astype(np.float64)).T
        assert np.all(np.abs(got - want) <= 34 * 2.0 ** -24 * magnitude)
        assert not np.array_equal(got, fp32)
        w32 = bf16_value(w16).astype(np.float32)        # float32 weights: skinny at every M
        assert np.array_equal(linear(x, w32, method="tensor-cores").copy_to_host(),
                              linear(x, w32, method="skinny").copy_to_host())
    x20 = np.ones((3, 20), np.float32)                  # K % 8 != 0: skinny, no ValueError
    w20 = bf16_bits(np.full((8, 20), 0.5, np.float32))
    assert np.array_equal(linear(x20, w20, method="tensor-cores").copy_to_host(),
                          np.full((3, 8), 10.0, np.float32))
    be = make_backend("numba", gemm="tensor-cores")
    assert be.gemm == "tensor-cores"
    x, w16, _ = _block_case(6, 1, 8, 32)
    assert np.array_equal(np.asarray(be.ops.linear(x, w16)), got_at[1])
    # the experts go to the grouped tensor-core kernel in that mode
    from kdtree_numba.layers import moe_ffn
    rng = np.random.default_rng(8)
    h = rng.standard_normal((3, 32)).astype(np.float32)
    idx, wt = np.array([[0], [1], [1]], np.int32), np.ones((3, 1), np.float32)
    gu = bf16_bits(rng.standard_normal((2, 32, 32)))
    dn = bf16_bits(rng.standard_normal((2, 32, 16)))
    small = mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=32, stages=2)     # 32 emulated lanes
    on_mma = moe_ffn(h, idx, wt, gu, dn, method="mma", configs=small).copy_to_host()
    assert np.array_equal(np.asarray(be.ops.moe_ffn(h, idx, wt, gu, dn, configs=small)), on_mma)
    assert not np.array_equal(on_mma, moe_ffn(h, idx, wt, gu, dn).copy_to_host())
    assert be.ops.moe_route.keywords == {"method": "tensor-cores"}     # the fp32 router: skinny
    assert be.ops.mla_attention.keywords == {"batch_invariant": True}
    with pytest.raises(ValueError, match="gemm"):
        make_backend("numba", gemm="tf32")
    with pytest.raises(ValueError, match="numba"):
        make_backend("reference", gemm="tensor-cores")


# ------------------------------------------------------------------ sm_90 PTX, any machine

def _tile_kernel():
    from kdtree_numba.compat import cuda, kernel
    from kdtree_numba.gpu.tensorcore import mma_bf16_m16n8k16, pack_bf16x2

    @kernel
    def tile(a, w32, c, d):
        """d = bf16(a) @ w^T + c for a [16, 16] float32, w [8, 16] bf16 (as uint32 pairs
        [8, 8]), c [16, 8], on one warp, fragments loaded straight from the ISA layout."""
        lane = cuda.threadIdx.x
        g = lane // 4
        t = lane % 4
        a0 = pack_bf16x2(a[g, 2 * t], a[g, 2 * t + 1])
        a1 = pack_bf16x2(a[g + 8, 2 * t], a[g + 8, 2 * t + 1])
        a2 = pack_bf16x2(a[g, 2 * t + 8], a[g, 2 * t + 9])
        a3 = pack_bf16x2(a[g + 8, 2 * t + 8], a[g + 8, 2 * t + 9])
        d0, d1, d2, d3 = mma_bf16_m16n8k16(a0, a1, a2, a3, w32[g, t], w32[g, t + 4],
                                           c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t],
                                           c[g + 8, 2 * t + 1])
        d[g, 2 * t] = d0
        d[g, 2 * t + 1] = d1
        d[g + 8, 2 * t] = d2
        d[g + 8, 2 * t + 1] = d3

    return tile


PTX_SCRIPT = HOPPER_PRELUDE + r"""
import dataclasses
sys.path.insert(0, "tests")
import test_layers_mma as tm
from kdtree_numba.layers import mma as mm
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

f2, u2 = T.float32[:, ::1], T.uint32[:, ::1]
ptx, _ = cuda.compile_ptx(tm._tile_kernel().py_func, (f2, u2, f2, f2), cc=(9, 0))
assert ptx.count(MMA) == 1 and ptx.count("cvt.rn.bf16x2.f32") == 4, "tile kernel"
ptxas(ptx)
print("tile assembled")
configs = {mm.mma_config(m, n, k) for m in (1, 16, 20, 40, 65, 512) for n, k in
           [(163840, 7168), (7168, 2048), (1536, 7168)]}
wgmma_configs = {c for c in configs if c.wgmma}
wgmma_configs |= {mm.WGMMA_TILE, dataclasses.replace(mm.WGMMA_TILE, slices_in_block=True),
                  dataclasses.replace(mm.WGMMA_TILE, wm=4)}   # bench_layers' 256 x 128
configs -= wgmma_configs
ptx, _ = cuda.compile_ptx(mm._round_to_bf16_pairs.py_func, (T.float32[::1], T.uint32[::1]),
                          cc=(9, 0))
assert ptx.count("cvt.rn.bf16x2.f32") == 1, "x rounding kernel"
ptxas(ptx)
u16 = T.uint16[:, ::1]
sig = (u16, u16, f2) + (T.int64,) * 9
for cfg in sorted({dataclasses.replace(c, splits=1, sums_in_last=False) for c in configs},
                  key=str):
    ptx, _ = cuda.compile_ptx(mm.mma_kernel(cfg).py_func, sig, cc=(9, 0))
    log = ptxas(ptx, cfg.max_registers)
    n_mma = ptx.count(MMA)
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    print("kernel", cfg, "mma", n_mma, "regs", regs, "spill", spill, "local", local, flush=True)
    assert n_mma == 2 * cfg.tm * cfg.tn * cfg.bk // 32, "mma count"
    assert "cp.async.cg.shared.global" in ptx
    assert "cp.async.wait_group %d;" % (cfg.stages - 2) in ptx, "ring wait"
    x4 = 2 * (cfg.tm + cfg.tn // 2) * cfg.bk // 32        # per m16 tile, two n8 tiles
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == x4, "A/B loads"
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x2.shared.b16") == \
        cfg.tn % 2 * cfg.bk // 16, "odd n8 tile"
    assert local == 0, "local memory: accumulators or fragments left registers"
    assert spill == 0 or cfg.max_registers, "spills"
# a decode's sliced tile adds its K slices in its last block (mma_config): the same tile with
# the arrival protocol and the sum in its tail
for cfg in sorted({c for c in configs if c.sums_in_last}, key=str):
    ptx, _ = cuda.compile_ptx(mm.mma_kernel(cfg).py_func, sig + (f2, T.int32[::1]), cc=(9, 0))
    log = ptxas(ptx, cfg.max_registers)
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    print("summing kernel", cfg, "spill", spill, "local", local, flush=True)
    assert ptx.count(MMA) == 2 * cfg.tm * cfg.tn * cfg.bk // 32, "mma count"
    assert "atom.global.add" in ptx and "membar.gl" in ptx, "the last block's arrival"
    assert local == 0 and spill == 0, "the sum's tail spilled"
assert any(c.sums_in_last for c in configs), "a decode's sliced tile"
# warpgroup mma exists on sm_90a only, the target numba-cuda gives launches on the H200
WGMMA = "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16"
for cfg in sorted({dataclasses.replace(c, splits=1) for c in wgmma_configs}, key=str):
    ptx, _ = cuda.compile_ptx(mm.mma_kernel(cfg).py_func, sig, cc=(9, 0, "a"))
    log = ptxas(ptx, arch="sm_90a")
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    n_wgmma = ptx.count(WGMMA % cfg.bn)
    print("wgmma kernel", cfg, "wgmma", n_wgmma, "regs", regs, "spill", spill, flush=True)
    assert n_wgmma == 2 * cfg.bk // 32, "a wgmma per panel and k16 step"
    assert "wgmma.wait_group.sync.aligned 0;" in ptx and "wgmma.fence.sync.aligned;" in ptx
    # one stage's products in flight (wait for all but the newest group), so the ring stages
    # one stage fewer ahead: its cp.async wait leaves stages - 3 groups
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == 1, "one group in flight"
    assert "cp.async.wait_group %d;" % (cfg.stages - 3) in ptx, "ring wait"
    assert "fence.proxy.async.shared::cta;" in ptx, "cp.async writes before wgmma reads"
    assert "ldmatrix" not in ptx and "mma.sync" not in ptx
    assert local == 0 and spill == 0, "accumulators left registers"
    assert "serialized" not in log, "a call (64-bit division?) serializes the wgmma"
print("assembled")
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=600)
def test_mma_kernels_compile_to_hopper_ptx():
    """The bf16 tile and every mma_config tile compile for
    sm_90 with the m16n8k16 bf16 mma, cp.async and 128-bit shared loads, no local memory, no
    spills (uncapped), and ptxas assembles them (nvJitLink, no GPU needed)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PTX_SCRIPT, timeout=600)
    assert "tile assembled" in out and "assembled" in out.splitlines()[-1], out[-2000:]


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_gpu_bf16_tile_equals_the_product_of_rounded_inputs(seed):
    from numba import cuda
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 16)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((8, 16)).astype(np.float32))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = cuda.device_array((16, 8), np.float32)
    _tile_kernel()[1, 32](cuda.to_device(a), cuda.to_device(w16.view(np.uint32)),
                          cuda.to_device(c), d)
    ra, rw = bf16_value(bf16_bits(a)).astype(np.float64), bf16_value(w16).astype(np.float64)
    want = ra @ rw.T + c
    bound = 16 * 2.0 ** -24 * (np.abs(ra) @ np.abs(rw).T + np.abs(c))
    assert np.all(np.abs(d.copy_to_host() - want) <= bound)


def _check_linear(m, n, k, seed=0, config=None, scale=1.0):
    from kdtree_numba.layers import linear
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05))
    cfg = config or mm.mma_config(m, n, k)
    got = linear(x, w16, method="mma", config=config).copy_to_host()
    w64 = bf16_value(w16).astype(np.float64)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w64).T       # sum_k |x_k w_k|
    want = ref.linear(x, bf16_value(w16))
    bound = mm.mma_error_coefficient(k, cfg.splits, cfg.bk) * magnitude
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), (np.max(err / np.maximum(bound, 1e-300)), cfg)
    # sharper: against bf16(x) exactly, only the accumulation term remains -- a wrong rounding
    # of x (truncation, or none) or a lost K stage fails this by orders of magnitude
    exact = bf16_value(bf16_bits(x)).astype(np.float64) @ w64.T
    acc_bound = (mm.mma_error_coefficient(k, cfg.splits, cfg.bk) - 2.0 ** -8) * magnitude
    assert np.all(np.abs(got - exact) <= acc_bound), cfg
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(256, 512), (1000, 768), (2048, 7168)])
@pytest.mark.parametrize("m", [1, 16, 65, 100, 512])
def test_gpu_linear_mma_within_the_bf16_bound(m, n, k):
    _check_linear(m, n, k, seed=m + n)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 200, 72), (65, 200, 72), (17, 130, 40), (3, 9, 8),
                                     (129, 1000, 1016)])
def test_gpu_linear_mma_ragged_edges(m, n, k):
    """N, M and K off every tile multiple (K % 8 == 0 is required; K % 8 != 0 raises, tested
    in test_mma_rejects_what_it_cannot_take)."""
    _check_linear(m, n, k, seed=k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 65, 200])
def test_gpu_linear_mma_k_slices(m):
    n, k = 1000, 2048
    base = mm.mma_config(m, n, k)
    plans = {f"splits={s}": dataclasses.replace(base, splits=s) for s in (1, 8)}
    for name, cfg in plans.items():
        _check_linear(m, n, k, seed=5, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(1536, 7168), (7168, 2048), (4096, 7168)])
def test_gpu_linear_mma_is_batch_invariant(n, k):
    """A row's result is bitwise the same at every M (tiles of 16 to 128 rows, one K slicing,
    its slices summed by sum_splits or in the block):
    what lets a verify forward on tensor cores reproduce the decode's logits exactly."""
    from kdtree_numba.layers import linear
    rng = np.random.default_rng(n)
    x = rng.standard_normal((4096, k)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05))
    # 4096: on sm_90 warpgroup tiles whose blocks add their own K slices (FOLD_MIN_TILES)
    rows = {m: linear(x[:m], w16, method="mma").copy_to_host()
            for m in (1, 9, 17, 33, 65, 512, 4096)}
    for m, y in rows.items():
        assert y.tobytes() == rows[4096][:m].tobytes(), m


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(2112, 7168), (7168, 8192), (7168, 2048)])
def test_gpu_sums_in_the_last_slice_block_keep_the_bits(n, k, monkeypatch):
    """``KDTREE_MMA_SUMS_IN_LAST`` at Kimi-K2's sliced shapes (q_a + kv_a, o_proj, the shared
    expert's down) and a decode's (the default there: mma_config), a verify's and a prefill's
    rows: the sum launch's bits, three calls in a row on one workspace (each leaves its
    counters at 0)."""
    from kdtree_numba.layers import Workspace, linear
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")       # the cp.async kernels, whose sums these are
    rng = np.random.default_rng(k)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05))
    for m in (1, 9, 65, 512):
        x = rng.standard_normal((m, k)).astype(np.float32)
        monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", "0")
        launch = dataclasses.replace(mm.mma_config(m, n, k), sums_in_last=False)
        want = linear(x, w16, method="mma", config=launch).copy_to_host()
        monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", "1")
        ws = Workspace()
        for _ in range(3):
            got = linear(x, w16, method="mma", workspace=ws).copy_to_host()
            assert got.tobytes() == want.tobytes(), (m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 65])
def test_gpu_sums_in_the_last_slice_block_under_graph_replay(m, monkeypatch):
    """Two sliced linears (q_a + kv_a's and o_proj's shapes) with ``KDTREE_MMA_SUMS_IN_LAST``
    captured in a CUDA graph (graphs.py) and replayed, the arrival counters made afresh
    inside the key's calls (gpu/counters.py): the eager bits with the sum launch."""
    import cupy

    from kdtree_numba.backends import make_backend
    from kdtree_numba.gpu import counters
    from kdtree_numba.graphs import GraphCache
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")       # the cp.async kernels, whose sums these are
    be = make_backend("numba")
    linear = be.ops.linear      # the backend's op: it launches on the capture's stream
    rng = np.random.default_rng(m)
    w_a = cupy.asarray(bf16_bits(rng.standard_normal((8192, 7168)).astype(np.float32) * 0.02))
    w_b = cupy.asarray(bf16_bits(rng.standard_normal((7168, 8192)).astype(np.float32) * 0.02))
    x = rng.standard_normal((m, 7168)).astype(np.float32)

    def forward(v, **launch):
        return cupy.asarray(linear(cupy.asarray(linear(v, w_a, method="mma", **launch.get(
            "a", {}))), w_b, method="mma", **launch.get("b", {})))

    monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", "0")
    sum_launch = {name: {"config": dataclasses.replace(mm.mma_config(m, *w.shape),
                                                       sums_in_last=False)}
                  for name, w in (("a", w_a), ("b", w_b))}
    eager = cupy.asnumpy(forward(cupy.asarray(x), **sum_launch))
    monkeypatch.setenv("KDTREE_MMA_SUMS_IN_LAST", "1")
    monkeypatch.setattr(counters, "_KEPT", {})
    graphs = GraphCache(be)
    runs = [graphs.call(("linears", m), forward, [x], [((m, 7168), np.float32)])
            for _ in range(4)]
    assert runs[0] is None and graphs.captures == 1 and graphs.failures == 0
    for i, out in enumerate(runs[1:]):
        assert cupy.asnumpy(out).tobytes() == eager.tobytes(), i


@pytest.mark.gpu
def test_gpu_linear_mma_large_and_small_magnitudes():
    """x far from 1 (bf16 keeps float32's exponent range): relative bound unchanged."""
    _check_linear(33, 300, 256, seed=7, scale=1e-30)
    _check_linear(33, 300, 256, seed=8, scale=1e20)


@pytest.mark.gpu
def test_gpu_linear_mma_reuses_out_and_workspace():
    from kdtree_numba.layers import Workspace, linear
    from numba import cuda
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 7168)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((1536, 7168)).astype(np.float32))
    ws, out = Workspace(), cuda.device_array((4, 1536), np.float32)
    first = linear(x, w16, method="mma", out=out, workspace=ws).copy_to_host()
    again = linear(x, w16, method="mma", out=out, workspace=ws).copy_to_host()
    assert first.tobytes() == again.tobytes()          # deterministic: fixed K slices and order


# ------------------------------------------------------------------ the whole kernel, simulated

def _warp_mma_emulation():
    """mma_bf16_m16n8k16 for the simulator: every lane leaves its registers in a table, a
    barrier, the warp's product from the table (the ISA layout, isa_mma_arrays; computed by the
    first lane to get there, the others take it), each lane its 4 outputs (isa_c), a barrier.
    Block-wide barriers stand in for the warp's: every warp of the kernel issues the same
    number of mma (tm x tn per k16 step)."""
    import threading
    table, products, lock = {}, {}, threading.Lock()

    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        me = threading.current_thread()
        tid = me.threadIdx.x
        key = (me.blockIdx.x, tid // 32)
        table.setdefault(key, [None] * 32)[tid % 32] = ((a0, a1, a2, a3), (b0, b1))
        me.syncthreads()
        with lock:
            D = products.get(key)
            if D is None:
                lanes = table[key]
                A, B = isa_mma_arrays([r[0] for r in lanes], [r[1] for r in lanes])
                D = products[key] = A @ B
        out = [np.float32(D[isa_c(tid % 32, e)] + np.float64(c)) for e, c in
               enumerate((c0, c1, c2, c3))]
        me.syncthreads()
        if tid % 32 == 0:     # every lane has read D; the next call's comes after a barrier
            del products[key]
        return tuple(out)
    return mma


@pytest.mark.parametrize("m, n, k, cfg", [
    (5, 20, 72, mm.MmaConfig(wm=1, wn=1, tm=1, tn=1)),              # ragged M, N; partial stage
    (19, 9, 96, mm.MmaConfig(wm=1, wn=1, tm=2, tn=1, splits=2)),   # 2 M tiles x 2 K slices
    (3, 16, 128, mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=64)),     # two panels per stage
    (4, 8, 328, mm.MmaConfig(wm=1, wn=1, tm=1, tn=1, stages=3)),   # 6 stages round a 3-ring
    (17, 8, 456, mm.MmaConfig(wm=1, wn=1, tm=1, tn=1, stages=4, splits=2)),  # 4 + 4 of 4-ring
    (2, 8, 200, mm.MmaConfig(wm=1, wn=1, tm=1, tn=1, stages=4)),   # fewer stages than ring
])
def test_simulated_kernel_equals_the_bf16_product(m, n, k, cfg, needs_kernels, monkeypatch):
    """The kernel itself (staging, cp.async twin, pipeline, K slices, epilogue) on the
    simulator, the warp's mma emulated by the ISA layout: y = bf16(x) w^T up to the fp32
    rounding of the emulated steps."""
    from kdtree_numba import compat
    from kdtree_numba.layers import linear
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real mma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    x, w16, want = _block_case(4, m, n, k)
    got = linear(x, w16, method="mma", config=cfg).copy_to_host()
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(bf16_value(w16).astype(np.float64)).T
    assert np.all(np.abs(got - want) <= (k + 2) * 2.0 ** -24 * magnitude)

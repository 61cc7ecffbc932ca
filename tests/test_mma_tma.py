"""The bf16 GEMM staged by TMA (kdtree_numba/layers/mma_tma.py, ``KDTREE_MMA_TMA``): on the
simulator (its copies and mbarriers emulated by gpu/tma.py's twins, wgmma by the ISA's
emulation of test_layers_mma) bitwise the cp.async warpgroup kernel, which test_layers_mma ties
to mma.sync; for Hopper, its PTX assembled by ptxas; on the GPU bitwise the default path."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ptx_check import HOPPER_PRELUDE
from test_layers_mma import _block_case, _wgmma_emulation, bf16_bits, bf16_value

from kdtree_numba.layers import mma as mm
from kdtree_numba.layers import mma_tma

# one consumer warpgroup of 64 rows by 32 columns: the cheapest tile the simulator can run
SMALL = mm.MmaConfig(wm=1, wn=4, tm=4, tn=1, stages=3, wgmma=True, tma=True)


def _simulated(monkeypatch):
    from kdtree_numba import compat
    from kdtree_numba.gpu import tensorcore
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real TMA and wgmma)")
    monkeypatch.setattr(tensorcore, "sim_wgmma", _wgmma_emulation)


@pytest.mark.parametrize("m, n, k, cfg", [
    # 3 N tiles on the simulator's 2 blocks (block 0 takes units 0 and 2: the ring's slots
    # and phases run on across units), 2 slices added in the block, K = 200: the last stage's
    # second panel wholly past K (zero-filled), ragged M and N
    (40, 72, 200, dataclasses.replace(SMALL, splits=2, slices_in_block=True)),
    # the slices through memory (units slice-major, then sum_splits), two warpgroups
    pytest.param(100, 24, 320, mm.MmaConfig(wm=2, wn=4, tm=4, tn=1, stages=4, wgmma=True,
                                            tma=True, splits=3),
                 marks=pytest.mark.slow),
    # the weights as the A operand (64 rows a tile), x as B (24 rows): y^T's tiles, 2 x 2
    # of them, the slices added in the block
    (20, 72, 200, mm.MmaConfig(wm=4, wn=1, tm=1, tn=3, stages=3, wgmma=True, tma=True,
                               swap_ab=True, splits=2, slices_in_block=True)),
    # the 128-byte swizzle (one 64-wide panel a stage, 4 k16 steps): the same bits
    (40, 72, 200, dataclasses.replace(SMALL, splits=2, slices_in_block=True, swizzle=128)),
    # one slice, more units than blocks in both M and N, a 2-stage ring
    pytest.param(130, 40, 136, dataclasses.replace(SMALL, stages=2),
                 marks=pytest.mark.slow),
    # three warpgroups (BM = 192, cuBLAS's tile height at M = 512), the slices through memory
    pytest.param(200, 40, 136, mm.MmaConfig(wm=3, wn=4, tm=4, tn=1, stages=3, wgmma=True,
                                            tma=True, splits=2), marks=pytest.mark.slow),
    # three warpgroups stream-K (a counter each; on the GPU with registers capped): tiles 0
    # and 1 whole, tile 2's two slices a block each
    pytest.param(100, 72, 136, mm.MmaConfig(wm=3, wn=4, tm=4, tn=1, stages=3, wgmma=True,
                                            tma=True, splits=2, stream_k=1, max_registers=152),
                 marks=pytest.mark.slow),
    # stream-K over the simulator's 2 blocks, the partial last wave shared: 3 tiles of 3
    # slices, tiles 0 and 1 whole (a block each), then tile 2's slice 0 in block 0 (folded
    # into the part buffer's slot 0) and its slices 1 and 2 in block 1 (apart), which
    # completes the tile
    (40, 72, 200, dataclasses.replace(SMALL, splits=3, stream_k=1)),
    # 5 tiles of 2 slices, the last two waves shared: tiles 0 and 1 whole, then the other
    # 3's 6 slices, 3 a block
    pytest.param(40, 160, 200, dataclasses.replace(SMALL, splits=2, stream_k=2),
                 marks=pytest.mark.slow),
    # swapped, two warpgroups (a counter each): 3 weight tiles of 128 rows by x's 24, 3 slices
    pytest.param(20, 300, 320, mm.MmaConfig(wm=8, wn=1, tm=1, tn=3, stages=3, wgmma=True,
                                            tma=True, swap_ab=True, splits=3, stream_k=2),
                 marks=pytest.mark.slow),
])
def test_simulated_tma_kernel_equals_the_cp_async_wgmma_kernel(m, n, k, cfg, needs_kernels,
                                                              monkeypatch):
    """Bitwise the warpgroup kernel that stages by cp.async (the same panels, slices and
    order), and within the bf16 product's accumulation bound."""
    from kdtree_numba.layers import linear
    _simulated(monkeypatch)
    x, w16, want = _block_case(11, m, n, k)
    got = linear(x, w16, method="mma", config=cfg).copy_to_host()
    # a tile the cp.async kernel can stage (any tile gives a row the same bits)
    plain = SMALL if cfg.swap_ab or cfg.threads > 256 else cfg
    staged = linear(x, w16, method="mma", config=dataclasses.replace(
        plain, tma=False, stages=min(max(cfg.stages, 3), 4), splits=cfg.splits,
        slices_in_block=cfg.slices_in_block, swizzle=64, stream_k=False)).copy_to_host()
    assert got.tobytes() == staged.tobytes()
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(bf16_value(w16).astype(np.float64)).T
    assert np.all(np.abs(got - want) <= (k + 2) * 2.0 ** -24 * magnitude)


@pytest.mark.parametrize("blocks, m, n, k, splits", [
    # one tile of 4 K slices, a block a slice: slice 0 folded alone into the part buffer's
    # slot 0, slices 1-3 each apart, the last block to count in adds them in slice order
    (4, 40, 24, 256, 4),
    # 9 tiles of 2 slices, the partial wave shared: tiles 0-7 whole, tile 8's 2 slices over 8
    # blocks (blocks 3 and 7 own one each, the rest none): the tile counts its slices, not
    # the blocks between its owners (review of ff70aec: counting blocks left it unstored)
    (8, 24, 288, 256, 2),
], ids=["a tile cut over four blocks", "fewer slices than blocks"])
def test_stream_k_cut_tiles_keep_the_folds_bits(blocks, m, n, k, splits, needs_kernels,
                                                monkeypatch):
    """Stream-K over more blocks than the simulator's 2: the fold's bits, and every cut
    tile's counters back at 0 for the next launch."""
    from kdtree_numba.gpu import counters
    from kdtree_numba.layers import linear
    _simulated(monkeypatch)
    monkeypatch.setattr(mma_tma, "_sm_count", lambda: blocks)
    x, w16, _ = _block_case(blocks, m, n, k)
    cfg = dataclasses.replace(SMALL, splits=splits)
    folded = linear(x, w16, method="mma", config=dataclasses.replace(
        cfg, slices_in_block=True)).copy_to_host()
    got = linear(x, w16, method="mma", config=dataclasses.replace(
        cfg, stream_k=1)).copy_to_host()
    assert got.tobytes() == folded.tobytes()
    assert all(not np.any(c.copy_to_host()) for c in counters.made("linear.mma_stream_k"))


def test_stream_k_runs_whole_waves_first():
    """whole_tiles: the data-parallel waves before the partial last one (or before the last
    full one too); every tile where the tiles fill whole waves; none below one wave."""
    assert mma_tma.whole_tiles(224, 132, 1) == 132     # 2048 -> 7168 at M = 512: 92 shared
    assert mma_tma.whole_tiles(224, 132, 2) == 0       # ... or all 224
    assert mma_tma.whole_tiles(68, 132, 1) == mma_tma.whole_tiles(68, 132, 2) == 0
    assert mma_tma.whole_tiles(264, 132, 2) == 264     # two whole waves: no stream-K
    assert mma_tma.whole_tiles(1152, 132, 1) == 1056   # 8.7 waves: 8 whole, 0.7 shared
    assert mma_tma.whole_tiles(1152, 132, 2) == 924    # ... or 7 whole, 1.7 shared
    assert (mma_tma.whole_tiles(5, 2, 1), mma_tma.whole_tiles(5, 2, 2)) == (4, 2)


def test_units_cover_every_tile_once_in_groups_of_m_tiles():
    """The units' order (a plain-Python copy of the kernel's): every (M tile, N tile, slice)
    once; within a group of GROUP_M M tiles the M tile changes fastest."""
    def unit_tile(u, n_mtiles, n_ntiles, splits, fold):
        s = 0
        if not fold:
            s, u = divmod(u, n_mtiles * n_ntiles)
        group, within = divmod(u, mma_tma.GROUP_M * n_ntiles)
        first = group * mma_tma.GROUP_M
        nt, mt = divmod(within, min(n_mtiles - first, mma_tma.GROUP_M))
        return first + mt, nt, s
    for n_mtiles, n_ntiles, splits, fold in [(4, 56, 4, True), (19, 3, 2, False), (1, 9, 1, True),
                                             (32, 288, 4, True)]:
        units = n_mtiles * n_ntiles * (1 if fold else splits)
        seen = [unit_tile(u, n_mtiles, n_ntiles, splits, fold) for u in range(units)]
        want = {(a, b, c) for a in range(n_mtiles) for b in range(n_ntiles)
                for c in range(1 if fold else splits)}
        assert len(seen) == len(set(seen)) and set(seen) == want
        assert seen[1][0] == min(1, n_mtiles - 1)


def test_swapped_tiles_fit_shared_memory():
    for m in (1, 9, 65, 80, 200, 256):
        for wgs in (1, 2):
            cfg = mma_tma.swapped_tile(m, wgs)
            assert cfg.bn == 8 * -(-m // 8) and cfg.bm == 64 * wgs and cfg.swap_ab
            assert 2 <= cfg.stages <= 8 and cfg.smem_bytes <= 227 * 1024
    assert mma_tma.swapped_tile(65, 2).stages == 8
    with pytest.raises(ValueError, match="rows"):
        mma_tma.swapped_tile(257, 1)


def test_a_verifys_rows_and_a_decodes_sliced_products_take_the_swapped_tile(monkeypatch):
    """mma_config at 65-80 rows where wgmma runs: the swapped TMA tile, two warpgroups of
    weight rows where the 128-row weight tiles fill half the GPU; at one row for the sliced
    products; elsewhere unchanged."""
    from kdtree_numba.layers import mma_plan
    monkeypatch.setattr(mma_plan, "wgmma_available", lambda: True)
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    lm = mma_plan.mma_config(65, 163840, 7168)
    down = mma_plan.mma_config(80, 7168, 2048)
    assert lm == mma_tma.swapped_tile(65, 2, 1) and lm.bn == 72
    assert down == mma_tma.swapped_tile(80, 1, 4) and down.bm == 64
    assert not mma_plan.mma_config(64, 7168, 2048).tma
    assert not mma_plan.mma_config(81, 7168, 2048).tma
    # a decode: the sliced products swapped (n = 8), the unsliced ones on the 16-row tile
    assert mma_plan.mma_config(1, 7168, 2048) == mma_tma.swapped_tile(1, 1, 4)
    assert not mma_plan.mma_config(1, 163840, 7168).tma
    assert not mma_plan.mma_config(2, 7168, 2048).tma
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")             # the switch: cp.async's tiles
    assert not mma_plan.mma_config(65, 163840, 7168).tma
    assert not mma_plan.mma_config(1, 7168, 2048).tma
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    monkeypatch.setattr(mma_plan, "wgmma_available", lambda: False)
    assert not mma_plan.mma_config(65, 163840, 7168).tma


def test_a_map_is_written_in_every_capture_until_an_eager_call_writes_it(monkeypatch,
                                                                          needs_kernels):
    """gpu/tma.py's pool: a new map is written on its first call; one first written inside a
    capture is written again by each later capture (a graph may replay before the first
    one's) and by the next eager call, after which no call writes it."""
    from kdtree_numba.gpu import tma
    writes, capturing = [], [True]

    class Launch:
        def __getitem__(self, launch):
            return lambda maps, slot, *words: writes.append((slot, capturing[0]))
    monkeypatch.setattr(tma, "_write_map", Launch())
    monkeypatch.setattr(tma, "_capturing", lambda stream: capturing[0])
    pool = tma._MapPool()
    encoded = []
    for capture in (True, True, False, False, True):
        capturing[0] = capture
        pool.get("key", lambda: encoded.append(1) or [7] * 16, 0)
    assert writes == [(0, True), (0, True), (0, False)] and encoded == [1]
    assert pool.get("other", lambda: [1] * 16, 0)[1] == 1


def test_an_outgrown_x_buffer_stays_allocated(needs_kernels):
    """A captured graph may still round into the old buffer: growing keeps it."""
    mma_tma._X_ROWS.clear()
    first = mma_tma._x_rows(3, 64, 0)
    assert mma_tma._x_rows(100, 64, 0) is first and first.shape == (128, 64)
    grown = mma_tma._x_rows(300, 64, 0)
    assert grown.shape == (512, 64) and mma_tma._X_OUTGROWN[-1] is first


def test_tma_configs_are_checked():
    with pytest.raises(ValueError, match="tma"):
        dataclasses.replace(mma_tma.TMA_TILE, wgmma=False)
    with pytest.raises(ValueError, match="tma"):
        dataclasses.replace(mma_tma.TMA_TILE, tn=8, slices_in_block=True)   # BN 256 folded
    with pytest.raises(ValueError, match="tma"):
        dataclasses.replace(mma_tma.TMA_TILE, sums_in_last=True)
    with pytest.raises(ValueError, match="tma"):       # 1024 consumer threads and a producer
        dataclasses.replace(mma_tma.TMA_TILE, wm=8, wn=4, tm=4, stages=2)
    with pytest.raises(ValueError, match="stream_k"):  # a fold's two accumulator sets
        dataclasses.replace(mma_tma.TMA_TILE, tn=8, stages=4, stream_k=1)
    with pytest.raises(ValueError, match="stream_k"):
        dataclasses.replace(mm.WGMMA_TILE, stream_k=1)
    with pytest.raises(ValueError, match="stream_k"):   # three warpgroups, no register cap
        dataclasses.replace(mma_tma.TMA_TILE, wm=3, stages=5, stream_k=1)
    assert dataclasses.replace(mma_tma.WIDE_FOLDING, stream_k=1).holds_two_accumulator_sets
    with pytest.raises(ValueError, match="stream_k"):   # 160 x 416 > 64 K registers
        dataclasses.replace(mma_tma.WIDE_FOLDING, max_registers=160, stream_k=1)
    with pytest.raises(ValueError, match="stream_k"):
        dataclasses.replace(mma_tma.TMA_TILE, stream_k=3)
    assert mma_tma.TMA_TILE.smem_bytes <= 227 * 1024
    assert all(t.smem_bytes <= 227 * 1024 for t in mma_tma.WIDE_TILES.values())
    assert mma_tma.tma_config(mm.mma_config(512, 7168, 2048)).splits == 4


def test_every_tma_tile_is_capped_to_fit_a_block_on_an_sm():
    """Registers a thread times the block's threads (consumers and the producer warp) within
    an SM's 65,536 for every tile the package or the bench launches (run 205: stream-K's and
    the 256 x 128 tile's launches failed without the cap)."""
    tiles = [mma_tma.TMA_TILE, dataclasses.replace(mma_tma.TMA_TILE, stream_k=1),
             mma_tma.swapped_tile(65, 2), mma_tma.WIDE_FOLDING, *mma_tma.WIDE_TILES.values()]
    for cfg in tiles:
        cap = mma_tma.register_cap(cfg)
        assert cap % 8 == 0 and cap * (cfg.threads + 32) <= 65536 and cap <= 255, cfg
    assert mma_tma.register_cap(mma_tma.TMA_TILE) == 224          # 288 threads
    assert mma_tma.register_cap(mma_tma.WIDE_TILES["tma 256 x 128"]) == 120   # 544
    assert mma_tma.register_cap(mma_tma.WIDE_FOLDING) == 152     # its own cap


def test_the_switch_sends_the_warpgroup_tile_to_tma(monkeypatch):
    """``KDTREE_MMA_TMA`` reroutes the warpgroup tile (its slices and fold kept) and nothing
    else (the mma.sync tiles of a decode); a TMA tile runs as planned either way."""
    wide = dataclasses.replace(mm.WGMMA_TILE, splits=4, slices_in_block=True)
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")     # the cp.async decode tile, on any machine
    decode = mm.mma_config(1, 7168, 2048)
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    assert mma_tma.planned(wide) == dataclasses.replace(mma_tma.TMA_TILE, splits=4,
                                                         slices_in_block=True)
    assert mma_tma.planned(decode) is None
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")
    assert mma_tma.planned(wide) is None
    swapped = mma_tma.swapped_tile(65, 1, 4)
    assert mma_tma.planned(swapped) is swapped


def test_the_stream_k_switch_marks_the_tma_tiles(monkeypatch):
    """``KDTREE_MMA_STREAM_K`` (with ``KDTREE_MMA_TMA``) asks the rerouted warpgroup tile and
    the swapped tiles to share their slices out; tiles that cannot hold a fold stay as they
    are."""
    from kdtree_numba.layers import mma_plan
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    monkeypatch.setenv("KDTREE_MMA_STREAM_K", "1")
    assert mma_tma.planned(dataclasses.replace(mm.WGMMA_TILE, splits=4)).stream_k
    assert mma_plan.with_stream_k(mma_tma.swapped_tile(65, 2, 4)).stream_k
    wide = mma_tma.WIDE_TILES["tma 128 x 256"]
    assert mma_plan.with_stream_k(wide) is wide
    monkeypatch.setenv("KDTREE_MMA_STREAM_K", "0")
    assert not mma_tma.planned(dataclasses.replace(mm.WGMMA_TILE, splits=4)).stream_k


PTX_SCRIPT = HOPPER_PRELUDE + r"""
import dataclasses
from kdtree_numba.layers import mma as mm, mma_tma
u16, f2, u64 = T.uint16[:, ::1], T.float32[:, ::1], T.uint64[:, ::1]
sig = ((u16, u16, f2, u64, T.int64, u64, T.int64) + (T.int64,) * 7
       + (T.float32[::1], T.int32[::1], T.int64))
WGMMA = "wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16"
swapped = mma_tma.swapped_tile(65, 2)
for cfg in (mma_tma.TMA_TILE, dataclasses.replace(mma_tma.TMA_TILE, slices_in_block=True),
            dataclasses.replace(mma_tma.TMA_TILE, tn=8, stages=4), swapped,
            dataclasses.replace(swapped, slices_in_block=True),
            dataclasses.replace(mma_tma.TMA_TILE, swizzle=64),
            dataclasses.replace(mma_tma.TMA_TILE, stream_k=1),
            dataclasses.replace(mma_tma.swapped_tile(65, 1), stream_k=1),
            dataclasses.replace(mma_tma.swapped_tile(1, 1), stream_k=1),
            mma_tma.WIDE_TILES["tma 192 x 128"], mma_tma.WIDE_TILES["tma 256 x 128"],
            dataclasses.replace(mma_tma.WIDE_FOLDING, slices_in_block=True),
            dataclasses.replace(mma_tma.WIDE_FOLDING, stream_k=1)):
    ptx, _ = cuda.compile_ptx(mma_tma.tma_kernel(cfg).py_func, sig, cc=(9, 0, "a"))
    log = ptxas(ptx, max_registers=mma_tma.register_cap(cfg), arch="sm_90a")
    regs = int(re.findall(r"Used (\d+) registers", log)[0])
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    print("tma kernel", cfg, "regs", regs, "spill", spill, "local", local, flush=True)
    assert ptx.count(WGMMA % cfg.bn) == cfg.bk // 16, "a wgmma per k16 step"
    assert ptx.count("cp.async.bulk.tensor.2d") == 2 * cfg.bk // (cfg.swizzle // 2), "a box per operand, panel"
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "fence.proxy.tensormap::generic.acquire" in ptx
    assert "cp.async.cg" not in ptx and "ldmatrix" not in ptx and "bar.sync" in ptx
    assert ("barrier.red.or.pred" in ptx) == bool(cfg.stream_k), "a warpgroup's barrier"
    assert regs * (cfg.threads + 32) <= 65536, "one block an SM"
    # capped tiles may spill a little (loop-invariant values), never the accumulators
    assert local == 0 and spill <= (96 if cfg.max_registers else 0), "spilled"
    assert "serialized" not in log, "a call (64-bit division?) serializes the wgmma"
from kdtree_numba.gpu import tma
ptx, _ = cuda.compile_ptx(tma._write_map.py_func, (u64, T.int64) + (T.uint64,) * 16, cc=(9, 0))
assert "fence.proxy.tensormap::generic.release.gpu" in ptx, "the map writer's release"
ptxas(ptx)
print("assembled")
"""


@pytest.mark.slow      # ~1 min of compiling beside CI's tests; run before each GPU call
@pytest.mark.compile_check(PTX_SCRIPT, timeout=600)
def test_tma_kernels_compile_to_hopper_ptx():
    """The TMA kernel (unsliced, folded, and at BN = 256) for sm_90a: a wgmma per panel and
    k16 step, a TMA box per operand and panel, its mbarriers, no spills, registers for one
    block of 288 threads an SM, no serialized wgmma; assembled by ptxas (no GPU needed)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PTX_SCRIPT, timeout=600)
    assert "assembled" in out.splitlines()[-1], out[-3000:]


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(100, 1000, 768), (512, 7168, 2048), (200, 2112, 7168),
                                     (4096, 1536, 7168), (129, 12288, 1536), (81, 200, 72),
                                     (1024, 2112, 7168)])
def test_gpu_tma_linear_keeps_the_default_bits(m, n, k, monkeypatch):
    """``KDTREE_MMA_TMA=1`` gives the cp.async kernel's bits (the same panels, slices, fold
    and order) on the real TMA and wgmma: ragged edges, sliced and unsliced Kimi-K2 shapes,
    folded (M = 512, 4096) and through memory (M = 100-200), and again on a second call (the
    kept x buffer and tensor maps); the wide tiles, and stream-K at 1 and 2 waves (at M =
    1024 on 7168 -> 2112 the partial wave's 32 slices over 132 blocks)."""
    from kdtree_numba.layers import linear
    if not mm.wgmma_available():
        pytest.skip("needs an sm_90 GPU")
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05))
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")             # the cp.async kernels' bits
    want = linear(x, w16, method="mma").copy_to_host()
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    for _ in range(2):
        got = linear(x, w16, method="mma").copy_to_host()
        assert got.tobytes() == want.tobytes()
    sw64 = dataclasses.replace(mma_tma.TMA_TILE, swizzle=64, splits=mm.mma_splits(n, k))
    got = linear(x, w16, method="mma", config=sw64).copy_to_host()
    assert got.tobytes() == want.tobytes(), "64-byte swizzle"
    if m <= 256:
        for swizzle in (64, 128):
            swapped = mma_tma.swapped_tile(m, 1, mm.mma_splits(n, k), swizzle=swizzle)
            got = linear(x, w16, method="mma", config=swapped).copy_to_host()
            assert got.tobytes() == want.tobytes(), ("swapped", swizzle)
    splits = mm.mma_splits(n, k)
    for name, wide in mma_tma.WIDE_TILES.items():       # unfolded: slices through memory
        got = linear(x, w16, method="mma", config=dataclasses.replace(
            wide, splits=splits)).copy_to_host()
        assert got.tobytes() == want.tobytes(), name
    wide = dataclasses.replace(mma_tma.WIDE_FOLDING, splits=splits)
    for folding in (dict(slices_in_block=True), dict(stream_k=1)):     # capped registers
        got = linear(x, w16, method="mma", config=dataclasses.replace(
            wide, **folding)).copy_to_host()
        assert got.tobytes() == want.tobytes(), ("192 x 128", folding)
    for waves in (1, 2, 1):             # the counters back at 0 for each next call
        shared = dataclasses.replace(mma_tma.TMA_TILE, splits=splits, stream_k=waves)
        got = linear(x, w16, method="mma", config=shared).copy_to_host()
        assert got.tobytes() == want.tobytes(), ("stream-K", waves)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(7168, 2048), (2112, 7168), (12288, 1536)])
@pytest.mark.parametrize("m", [1, 9, 33, 65, 80, 200])
def test_gpu_swapped_tiles_keep_the_default_bits(m, n, k, monkeypatch):
    """The weights as wgmma's A operand and x as its B (``swap_ab``: y^T's tiles, n = M
    rounded up to 8): the default path's bits, one and two warpgroups, folded or not."""
    from kdtree_numba.layers import linear
    if not mm.wgmma_available():
        pytest.skip("needs an sm_90 GPU")
    rng = np.random.default_rng(m * n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w16 = bf16_bits(rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.05))
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")             # the cp.async kernels' bits
    want = linear(x, w16, method="mma").copy_to_host()
    for wgs in (1, 2):
        cfg = mma_tma.swapped_tile(m, wgs, mm.mma_splits(n, k))
        for fold in (False, True) if cfg.splits > 1 and cfg.bn <= 128 else (False,):
            got = linear(x, w16, method="mma", config=dataclasses.replace(
                cfg, slices_in_block=fold)).copy_to_host()
            assert got.tobytes() == want.tobytes(), (wgs, fold)
        if cfg.splits > 1 and cfg.bn <= 128:
            for waves in (1, 2):
                got = linear(x, w16, method="mma", config=dataclasses.replace(
                    cfg, stream_k=waves)).copy_to_host()
                assert got.tobytes() == want.tobytes(), (wgs, "stream-K", waves)


@pytest.mark.gpu
@pytest.mark.parametrize("stream_k", ["0", "1", "2"])
def test_gpu_tma_linear_under_graph_replay(stream_k, monkeypatch):
    """A weight whose tensor map is first written inside a CUDA-graph capture: its replays,
    then an eager call (which writes the map again before any use outside the graph), give
    the default path's bits; with ``KDTREE_MMA_STREAM_K`` too (each replay finds the cut
    tiles' counters back at 0)."""
    import cupy
    from numba import cuda

    from kdtree_numba.layers import linear
    if not mm.wgmma_available():
        pytest.skip("needs an sm_90 GPU")
    rng = np.random.default_rng(3)
    m, n, k = 512, 2112, 7168 + 64        # 68 tiles: the slices added in the block
    x = cupy.asarray(rng.standard_normal((m, k)).astype(np.float32))
    w_eager, w_graph = (cupy.asarray(bf16_bits(rng.standard_normal((n, k)).astype(np.float32)))
                        for _ in range(2))
    monkeypatch.setenv("KDTREE_MMA_TMA", "0")
    want = cupy.asnumpy(cupy.asarray(linear(x, w_graph, method="mma")))
    monkeypatch.setenv("KDTREE_MMA_TMA", "1")
    monkeypatch.setenv("KDTREE_MMA_STREAM_K", stream_k)
    linear(x, w_eager, method="mma")          # x's kept buffer and the maps' pool, eagerly
    stream = cupy.cuda.Stream(non_blocking=False)
    out = cupy.zeros((m, n), np.float32)
    stream.begin_capture()
    linear(x, w_graph, method="mma", out=out, stream=cuda.external_stream(stream.ptr))
    graph = stream.end_capture()
    for _ in range(2):
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        assert cupy.asnumpy(out).tobytes() == want.tobytes()
    assert cupy.asnumpy(cupy.asarray(linear(x, w_graph, method="mma"))).tobytes() == \
        want.tobytes()

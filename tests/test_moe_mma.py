"""moe_ffn(method="mma"): the grouped MoE FFN on bf16 tensor cores (kdtree_numba/layers/moe_mma.py).

Anywhere (CI): the argument checks; the two grouped kernels run by the simulator with the warp's
mma emulated by the PTX ISA fragment layout (tests/test_layers_mma.py's emulation), against
reference.layers.moe at the bound of docs/LAYERS.md ("Grouped MoE on tensor cores"), for
routings with experts of zero, one and many (> BM) tokens, with and without a shared expert of
another width; and (subprocess, no simulator) the kernels compile to sm_90 PTX with the
m16n8k16 bf16 mma, no local memory, and ptxas assembles them without spills.
On the GPU (marker ``gpu``): Kimi-K2 shapes (D 7168, I 2048, 64 experts top-8, a shared
expert) at M in {1, 9, 33, 65, 257} within the bound, rows batch invariant, and the work list
(KDTREE_MOE_WORK_LIST=1) bitwise the full grid; the dense FFN's two sliced linears.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest
from ptx_check import HOPPER_PRELUDE

import reference.layers as ref
from kdtree_numba.layers import mma as mm
from test_layers_mma import _warp_mma_emulation, _wgmma_emulation, bf16_bits, bf16_value

SILU_LIPSCHITZ = 1.1          # max |silu'(z)| = 1.0998 (at z ~ 2.4)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _coefficient(k, splits):
    """mma_error_coefficient of a product in ``splits`` K slices, each whole SLICE_UNITs."""
    return mm.mma_error_coefficient(k, splits, mm.SLICE_UNIT if splits > 1 else mm.PANEL)


def _expert_bound(x, gu, dn, splits=(1, 1)):
    """(y*, bound on |y - y*|) per row of x [T, D] for one expert (float64, bf16 weights as
    values): docs/LAYERS.md, "Grouped MoE on tensor cores".  ``splits``: the K slices of the
    gate_up and down products (the dense FFN's two sliced linears; the grouped kernels have
    none)."""
    d, inter = dn.shape
    c1 = _coefficient(x.shape[1], splits[0])
    c_acc = _coefficient(inter, splits[1]) - 2.0 ** -8
    g, u = x @ gu[:inter].T, x @ gu[inter:].T
    e_g = c1 * (np.abs(x) @ np.abs(gu[:inter]).T)
    e_u = c1 * (np.abs(x) @ np.abs(gu[inter:]).T)
    a = _silu(g) * u
    e_a = (np.abs(_silu(g)) + SILU_LIPSCHITZ * e_g) * e_u + SILU_LIPSCHITZ * e_g * np.abs(u)
    big_a = np.abs(a) + e_a
    e_a = e_a + (2.0 ** -8 + 2.0 ** -19) * big_a          # fp32 silu * up, then bf16(act)
    y = a @ dn.T
    e_y = e_a @ np.abs(dn).T + c_acc * ((np.abs(a) + e_a) @ np.abs(dn).T)
    return y, e_y


def moe_mma_bound(h, idx, weight, gate_up, down, sgu=None, sdn=None, expert=None):
    """Per-output bound of moe_ffn(method="mma") against ref.moe_ffn; ``expert(e)`` ->
    (gate_up, down) of expert e as float64 values (the int4 experts' dequantised weights,
    exact), by default the bf16 bits ``gate_up[e]``, ``down[e]`` widened."""
    h64 = h.astype(np.float64)
    w64 = weight.astype(np.float64)
    m, d = h.shape
    err = np.zeros((m, d))
    mag = np.zeros((m, d))
    if expert is None:
        def expert(e):
            return (bf16_value(gate_up[e]).astype(np.float64),
                    bf16_value(down[e]).astype(np.float64))
    for e in np.unique(idx):
        tokens, js = np.nonzero(idx == e)
        y, e_y = _expert_bound(h64[tokens], *expert(e))
        wj = np.abs(w64[tokens, js])[:, None]
        np.add.at(err, tokens, wj * e_y)
        np.add.at(mag, tokens, wj * (np.abs(y) + e_y))
    if sgu is not None:
        y, e_y = _expert_bound(h64, bf16_value(sgu).astype(np.float64),
                               bf16_value(sdn).astype(np.float64))
        err += e_y
        mag += np.abs(y) + e_y
    k = idx.shape[1]
    return err + (k + 3) * 2.0 ** -24 * mag      # the ordered fp32 combine, the output rounding


def _case(seed, m, d, n_experts, inter, idx, s_inter=None):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((m, d)).astype(np.float32)
    weight = rng.uniform(0.1, 1.0, idx.shape).astype(np.float32)
    gate_up = bf16_bits(rng.standard_normal((n_experts, 2 * inter, d)) * 0.2)
    down = bf16_bits(rng.standard_normal((n_experts, d, inter)) * 0.2)
    shared = (None, None)
    if s_inter:
        shared = (bf16_bits(rng.standard_normal((2 * s_inter, d)) * 0.2),
                  bf16_bits(rng.standard_normal((d, s_inter)) * 0.2))
    return h, idx.astype(np.int32), weight, gate_up, down, *shared


def _check(args, device_weights=None, **kw):
    """moe_ffn(method="mma") against ref.moe_ffn within moe_mma_bound; device_weights: the
    four weights already on the device (the GPU tests upload Kimi's 5.6 GB once)."""
    from kdtree_numba.layers import moe_ffn
    h, idx, weight, gate_up, down, sgu, sdn = args
    weights = device_weights or (gate_up, down, sgu, sdn)
    got = moe_ffn(h, idx, weight, *weights, method="mma", **kw).copy_to_host()
    got = got.astype(np.float64)
    as_bf = [None if a is None else a.view(ml_dtypes.bfloat16) for a in (gate_up, down, sgu, sdn)]
    want = ref.moe_ffn(h, idx, weight, *as_bf).astype(np.float64)
    bound = moe_mma_bound(*args)
    err = np.abs(got - want)
    assert np.all(err <= bound), np.max(err / bound)
    return got


def _routing_many_one_zero(m):
    """top-2 over 5 experts: expert 0 takes every token (> BM = 16 when m > 16), expert 3 one
    token, expert 2 none, experts 1 and 4 the rest."""
    idx = np.zeros((m, 2), np.int32)
    idx[:, 1] = np.where(np.arange(m) % 2, 1, 4)
    idx[0, 1] = 3
    return idx


SIM_CASES = [   # (name, M, D, I, Is, routing, MmaConfig): one or two warps, bk 32
    ("one token, shared wider", 1, 64, 32, 48, np.array([[1, 3]]),
     mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=32, stages=2)),
    ("many/one/zero, 2 M tiles", 20, 64, 32, 32, None,
     mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=32, stages=2)),
    ("two warps along N, tn 4, no shared", 6, 96, 40, 0, None,
     mm.MmaConfig(wm=1, wn=2, tm=1, tn=4, bk=32, stages=2)),
    ("two warps along M, tm 2", 20, 32, 32, 0, None,
     mm.MmaConfig(wm=2, wn=1, tm=2, tn=2, bk=32, stages=2)),
    ("5 stages round a 3-ring, K ragged", 3, 160, 40, 0, np.array([[0, 2], [2, 4], [0, 1]]),
     mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=32, stages=3)),
]


@pytest.mark.parametrize("name, m, d, inter, s_inter, routing, cfg", [
    # "many/one/zero, 2 M tiles": the work-list test's full grid (below) is this check, the
    # same case and seed, in CI
    pytest.param(*c, marks=pytest.mark.slow) if c is SIM_CASES[1] else c for c in SIM_CASES],
                         ids=[c[0] for c in SIM_CASES])
def test_simulated_grouped_moe_within_the_bound(name, m, d, inter, s_inter, routing, cfg,
                                                needs_kernels, monkeypatch):
    from kdtree_numba import compat
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real mma)")
    # the stage's mma steps are mma.py's (stage_compute): the emulation goes in there
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    idx = _routing_many_one_zero(m) if routing is None else routing
    args = _case(m + d, m, d, 5, inter, idx, s_inter)
    _check(args, configs=cfg)


def test_simulated_warpgroup_tile_equals_the_warp_tiles(needs_kernels, monkeypatch):
    """The grouped kernels on a wgmma tile (mma_tile's past 80 rows on sm_90: a prefill's
    experts), wgmma emulated from the ISA: the gate_up weight rows and the SwiGLU epilogue
    follow the warpgroup's fragment layout, so every output equals the mma.sync tile's
    bitwise, and both are within the bound."""
    from kdtree_numba import compat
    from kdtree_numba.gpu import tensorcore
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU tests run the real wgmma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    monkeypatch.setattr(tensorcore, "sim_wgmma", _wgmma_emulation)
    args = _case(7, 20, 64, 5, 32, _routing_many_one_zero(20), 32)
    wgmma = _check(args, configs=mm.MmaConfig(wm=1, wn=4, tm=4, tn=2, bk=32, stages=3,
                                              wgmma=True))
    sync = _check(args, configs=mm.MmaConfig(wm=1, wn=2, tm=1, tn=4, bk=32, stages=2))
    assert wgmma.tobytes() == sync.tobytes()


def test_simulated_bound_has_teeth(needs_kernels, monkeypatch):
    """A kernel that drops SwiGLU's silu (act = gate * up) fails the bound by far."""
    from kdtree_numba import compat
    from kdtree_numba.layers import moe_mma
    if not compat.SIMULATOR:
        pytest.skip("simulator only")
    # the stage's mma steps are mma.py's (stage_compute): the emulation goes in there
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    monkeypatch.setattr(moe_mma, "silu_approx", lambda v: v)
    moe_mma.moe_mma_kernel.cache_clear()
    try:
        with pytest.raises(AssertionError):
            _check(_case(3, 2, 64, 3, 32, np.array([[0, 2], [1, 2]]), 32),
                   configs=mm.MmaConfig(wm=1, wn=1, tm=1, tn=2, bk=32, stages=2))
    finally:
        moe_mma.moe_mma_kernel.cache_clear()


@pytest.mark.parametrize("what", ["f32 weights", "D % 8", "odd tn"])
def test_mma_moe_rejects_what_it_cannot_take(what, needs_kernels):
    from kdtree_numba.layers import moe_ffn
    d = 20 if what == "D % 8" else 32
    args = list(_case(1, 2, d, 3, 16, np.array([[0, 1], [1, 2]])))
    cfg = None
    if what == "f32 weights":
        args[3], args[4] = bf16_value(args[3]), bf16_value(args[4])
    if what == "odd tn":
        cfg = mm.MmaConfig(wm=1, wn=1, tm=1, tn=1)
    with pytest.raises(ValueError, match="mma|tn"):
        moe_ffn(*args, method="mma", configs=cfg)


def test_configs_and_grid():
    from kdtree_numba.layers.moe_mma import moe_mma_config, moe_mma_grid
    small = mm.MmaConfig(wm=1, wn=4, tm=1, tn=2, bk=128, stages=3)        # 16 x 64
    mid = mm.MmaConfig(wm=1, wn=4, tm=2, tn=4, bk=64, stages=4)           # 32 x 128
    tall = mm.MmaConfig(wm=1, wn=4, tm=3, tn=4, bk=64, stages=3)          # 48 x 128
    taller = mm.MmaConfig(wm=1, wn=4, tm=5, tn=2, bk=64, stages=4)        # 80 x 64
    big = mm.MmaConfig(wm=2, wn=2, tm=2, tn=8, bk=64, stages=3)           # 64 x 128
    if mm.wgmma_available():                          # sm_90: past 80 rows warpgroup mma
        big = mm.MmaConfig(wm=2, wn=4, tm=4, tn=4, bk=64, stages=4, wgmma=True)   # 128 x 128
    # tokens per active expert: M k / min(E, M k) = 1, 2, 5, 9 (E = 64) and 8 ... 100
    for m, top_k, n_experts, want in ((1, 8, 64, small), (9, 8, 64, small), (33, 8, 64, small),
                                      (65, 8, 64, small), (8, 1, 1, small), (16, 1, 1, small),
                                      (24, 1, 1, mid), (40, 1, 1, tall), (72, 1, 1, taller),
                                      (100, 1, 1, big), (0, 8, 64, small)):
        assert moe_mma_config(m, top_k, n_experts) == want, (m, top_k, n_experts)
    cfg = moe_mma_config(9, 8, 64)
    blocks, mt, nt = moe_mma_grid(cfg, True, 9, 64, True, 2048)
    assert (mt, nt) == (1, 2048 // 32) and blocks == 65 * mt * nt      # 32 columns a block
    assert moe_mma_grid(cfg, False, 9, 64, False, 7168)[2] == 7168 // 64
    # the work list at a verify's 65 tokens, top-8 of 64 (16-row tiles): R = 64 + (520 - 64)
    # // 16 = 92 routed tiles at most, then the shared expert's 5
    cfg = moe_mma_config(65, 8, 64)
    assert moe_mma_grid(cfg, True, 65, 64, True, 2048, 520, 64) == (97 * 64, 97, 64)
    assert moe_mma_grid(cfg, True, 65, 64, True, 2048)[0] == 65 * 5 * 64


@pytest.mark.parametrize("seed", range(6))
def test_routed_tile_bound_holds_for_every_routing(seed):
    """sum over experts of ceil(tokens / BM) never exceeds routed_tile_bound, and reaches it
    (every expert one token but one, which takes the rest: the bound is tight)."""
    from kdtree_numba.layers.moe_mma import routed_tile_bound
    rng = np.random.default_rng(seed)
    for _ in range(200):
        n_experts, bm = int(rng.integers(1, 70)), int(rng.choice([16, 32, 64, 80, 128]))
        n_entries = int(rng.integers(1, 600))
        skew = rng.dirichlet(np.full(n_experts, rng.choice([0.05, 1.0, 20.0])))
        counts = np.bincount(rng.choice(n_experts, n_entries, p=skew), minlength=n_experts)
        assert np.sum(-(-counts // bm)) <= routed_tile_bound(n_entries, n_experts, bm)
        a = min(n_experts, n_entries)
        tight = np.ones(a, int)
        tight[0] += n_entries - a
        assert np.sum(-(-tight // bm)) == routed_tile_bound(n_entries, n_experts, bm)


def test_simulated_grouping_writes_the_work_list(needs_kernels):
    """moe.py's grouping kernel with tile_rows: each active expert's ceil(count / BM) tiles in
    ascending expert order (first slot rows 0, BM, ...) and their number, for skewed,
    uniform and one-expert routings (invalid indices count for nothing)."""
    from kdtree_numba.layers.moe import _group_tokens
    from kdtree_numba.layers.workspace import Workspace
    from kdtree_numba.compat import to_device
    rng = np.random.default_rng(31)
    for m, top_k, n_experts, bm in ((65, 8, 64, 16), (40, 2, 5, 16), (9, 1, 1, 4),
                                    (30, 3, 40, 8)):
        idx = np.sort(np.stack([rng.choice(n_experts, top_k, replace=False, p=None)
                                for _ in range(m)]), axis=1).astype(np.int32)
        if n_experts == 5:
            idx[:, 0] = 0                           # expert 0 takes every token: 3 tiles
        if n_experts == 40:
            idx[0, 0] = -1                          # an invalid entry: ignored
        _, lists, tiles = _group_tokens(to_device(idx), n_experts, Workspace(), 0, bm)
        counts = np.bincount(idx[idx >= 0], minlength=n_experts)
        want_e = [e for e in range(n_experts) for _ in range(-(-counts[e] // bm))]
        want_r = [r for e in range(n_experts) for r in range(0, counts[e], bm)]
        n = int(tiles[2].copy_to_host()[0])
        assert n == len(want_e)
        assert tiles[0].copy_to_host()[:n].tolist() == want_e
        assert tiles[1].copy_to_host()[:n].tolist() == want_r


def _record_work_lists(monkeypatch, launcher="grouped_experts_mma"):
    """The ``tiles`` argument (the last) of each call of moe.py's ``launcher`` moe_ffn makes
    from now on (None: the full grid; else the work list's device arrays), in call order."""
    from kdtree_numba.layers import moe as moe_module
    seen = []
    real = getattr(moe_module, launcher)

    def spy(*args, **kw):
        seen.append(args[-1])
        return real(*args, **kw)
    monkeypatch.setattr(moe_module, launcher, spy)
    return seen


def test_simulated_work_list_gives_the_full_grid_bits(needs_kernels, monkeypatch):
    """KDTREE_MOE_WORK_LIST=1: the same outputs bit for bit as the full (expert, M tile)
    grid -- a block's tile, rows and K loop are the same, only its index differs (an expert
    of 20 tokens in two 16-row tiles, one of one token, one of none, a shared expert)."""
    from kdtree_numba import compat
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU test compares both at Kimi shapes)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    lists = _record_work_lists(monkeypatch)
    name, m, d, inter, s_inter, routing, cfg = SIM_CASES[1]
    args = _case(m + d, m, d, 5, inter, _routing_many_one_zero(m), s_inter)
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "0")
    full = _check(args, configs=cfg)
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")
    listed = _check(args, configs=cfg)
    assert lists[0] is None and int(lists[1][2].copy_to_host()[0]) == 2 + 1 + 1 + 1
    assert listed.tobytes() == full.tobytes()


# ------------------------------------------------------------------ sm_90 PTX, any machine

PTX_SCRIPT = HOPPER_PRELUDE + r"""
import itertools
from kdtree_numba.layers.moe_mma import moe_mma_config, moe_mma_kernel
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"

f2, u2, i1 = T.float32[:, ::1], T.uint16[:, ::1], T.int32[::1]
configs = {moe_mma_config(m, 8, 64) for m in (1, 9, 33, 65, 200, 257)}
configs |= {moe_mma_config(m, 1, 1) for m in (40, 72, 100)}    # a dense FFN's tiles
for cfg, gate_up, work_list in itertools.product(sorted(configs, key=str), (True, False),
                                                 (False, True)):
        out = T.uint32[:, ::1] if gate_up else f2       # act as bf16 pairs, or y_slot
        sig = (u2,) + (i1,) * 7 + (T.uint16[:, :, ::1], u2, out) + (T.int64,) * 9
        ptx, _ = cuda.compile_ptx(moe_mma_kernel(cfg, gate_up, work_list).py_func, sig,
                                  cc=(9, 0))
        log = ptxas(ptx)
        n_mma = ptx.count(MMA)
        local = len(re.findall(r"(?:ld|st)\.local", ptx))
        regs = int(re.findall(r"Used (\d+) registers", log)[0])
        spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
        print("kernel", cfg, "gate_up" if gate_up else "down", "work list" * work_list, "mma",
              n_mma, "regs", regs, "spill", spill, "local", local, flush=True)
        assert n_mma == 2 * cfg.tm * cfg.tn * cfg.bk // 32, "mma count"
        assert "cp.async.cg.shared.global" in ptx
        assert "cp.async.wait_group %d;" % (cfg.stages - 2) in ptx, "ring wait"
        assert ("cvt.rn.bf16x2.f32" in ptx) == gate_up, "act stored as bf16 pairs"
        x4 = 2 * (cfg.tm + cfg.tn // 2) * cfg.bk // 32        # per m16 tile, two n8 tiles
        assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == x4, "A/B loads"
        assert ptx.count("ldmatrix.sync.aligned.m8n8.x2.shared.b16") == \
            cfg.tn % 2 * cfg.bk // 16, "odd n8 tile"
        assert local == 0, "local memory"
        assert spill == 0, "spills"
# the warpgroup tile (mma_tile's past 80 rows on sm_90, e.g. a prefill's ~512 tokens an
# expert), on sm_90a, the target numba-cuda gives H200 launches
from kdtree_numba.layers.mma import WGMMA_TILE
for gate_up, work_list in itertools.product((True, False), (False, True)):
    out = T.uint32[:, ::1] if gate_up else f2
    sig = (u2,) + (i1,) * 7 + (T.uint16[:, :, ::1], u2, out) + (T.int64,) * 9
    ptx, _ = cuda.compile_ptx(moe_mma_kernel(WGMMA_TILE, gate_up, work_list).py_func, sig,
                              cc=(9, 0, "a"))
    log = ptxas(ptx, arch="sm_90a")
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
    local = len(re.findall(r"(?:ld|st)\.local", ptx))
    print("wgmma kernel", "gate_up" if gate_up else "down", "work list" * work_list, "spill",
          spill, "local", local, flush=True)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16") == 4, "a wgmma per k16 step"
    assert "mma.sync" not in ptx and local == 0 and spill == 0
    # the SwiGLU's IEEE division would be a subroutine call, which serializes wgmma
    assert "serialized" not in log, "a call serializes the wgmma"
print("assembled")
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=600)
def test_moe_mma_kernels_compile_to_hopper_ptx():
    """Both grouped kernels of every moe_mma_config tile at the Kimi-K2 batch sizes compile
    for sm_90 (m16n8k16 bf16 mma, cp.async, 128-bit shared loads), no local memory, and ptxas
    assembles them without spills (nvJitLink, no GPU needed)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PTX_SCRIPT, timeout=600)
    assert "assembled" in out.splitlines()[-1], out[-2000:]


# ------------------------------------------------------------------ GPU (Kimi-K2 shapes)

KIMI = dict(d=7168, inter=2048, n_experts=64, top_k=8)


def _device_bf16_random(shape, seed):
    """bf16 bits of random sign, mantissa and magnitude in [2^-8, 2^-5) (rms ~0.015, so the
    activations stay O(1) at D = 7168), drawn on the device with CuPy (Kimi's 5.6 GB of
    experts in a second; NumPy on the host took minutes)."""
    import cupy
    bits = cupy.random.RandomState(seed).randint(0, 1 << 16, shape, dtype=np.int32)
    bits = bits.astype(cupy.uint16)
    exponent = (bits >> 7) % 3 + 119
    return ((bits & 0x807F) | (exponent << 7)).astype(cupy.uint16)


def _dense_check(h, gate_up, down, **kw):
    """moe_ffn(h, None, None, ...) with method="mma" (two sliced linears around SwiGLU)
    against the reference's dense FFN, within the bound of one expert whose two products take
    mma_splits' K slices (and, since the linears write float32 gate_up rows, the
    same rounding steps as the grouped kernel's epilogue)."""
    from kdtree_numba.layers import moe_ffn
    got = moe_ffn(h, None, None, gate_up, down, method="mma", **kw)
    got = (got if isinstance(got, np.ndarray) else got.copy_to_host()).astype(np.float64)
    gu, dn = (bf16_value(np.asarray(a)[0]).astype(np.float64) for a in (gate_up, down))
    want = ref.moe_ffn(h, None, None, bf16_value(np.asarray(gate_up)),
                       bf16_value(np.asarray(down))).astype(np.float64)
    inter, d = dn.shape[1], dn.shape[0]
    splits = (mm.mma_splits(2 * inter, d), mm.mma_splits(d, inter))
    y, e_y = _expert_bound(h.astype(np.float64), gu, dn, splits)
    bound = e_y + 3 * 2.0 ** -24 * (np.abs(y) + e_y)     # the linear's output rounding
    err = np.abs(got - want)
    assert np.all(err <= bound), np.max(err / bound)
    return got, splits


def test_simulated_dense_ffn_runs_as_two_tensor_core_linears(needs_kernels, monkeypatch):
    """A dense layer (expert_idx, weight None) under "mma" is linear(gate_up) -> SwiGLU ->
    linear(down), both on tensor cores (with mma_splits' K slices: one at these widths; the
    sliced linear has its own simulated tests, and the GPU test below takes several), within
    the bound of the reference; a row alone gives its batch bits."""
    from kdtree_numba import compat
    from kdtree_numba.layers import moe as moe_module
    if not compat.SIMULATOR:
        pytest.skip("simulator only (the GPU test runs the real mma)")
    monkeypatch.setattr(mm, "mma_bf16_m16n8k16", _warp_mma_emulation())
    calls = []
    real_linear = moe_module.linear

    def spy(x, w, **kw):
        calls.append((tuple(w.shape), kw.get("method")))
        return real_linear(x, w, **kw)
    monkeypatch.setattr(moe_module, "linear", spy)
    rng = np.random.default_rng(29)
    d, inter, m = 64, 16, 2
    h = rng.standard_normal((m, d)).astype(np.float32)
    gate_up = bf16_bits(rng.standard_normal((1, 2 * inter, d)) * 0.2)
    down = bf16_bits(rng.standard_normal((1, d, inter)) * 0.2)
    got, _ = _dense_check(h, gate_up, down)
    assert calls == [((2 * inter, d), "mma"), ((d, inter), "mma")]
    one, _ = _dense_check(h[1:], gate_up, down)
    assert one.tobytes() == got[1:].tobytes()
    # the model's backend asks for "tensor-cores", which resolves to the same two linears
    from kdtree_numba.layers import moe_ffn
    calls.clear()
    via = moe_ffn(h, None, None, gate_up, down, method="tensor-cores").copy_to_host()
    assert calls == [((2 * inter, d), "mma"), ((d, inter), "mma")]
    assert via.tobytes() == got.astype(np.float32).tobytes()
    with pytest.raises(ValueError, match="configs"):
        moe_ffn(h, None, None, gate_up, down, method="mma", configs=mm.mma_tile(1))


@functools.cache
def _kimi_weights():
    """(host bf16 bits, the same on the device) of a Kimi-K2 layer at 64 experts: gate_up
    [64, 4096, 7168], down [64, 7168, 2048], a shared expert of width 2048; drawn on the
    device and copied back once."""
    import cupy
    d, inter, n_experts = KIMI["d"], KIMI["inter"], KIMI["n_experts"]
    device = (_device_bf16_random((n_experts, 2 * inter, d), 10),
              _device_bf16_random((n_experts, d, inter), 11),
              _device_bf16_random((2 * inter, d), 12), _device_bf16_random((d, inter), 13))
    return tuple(cupy.asnumpy(w) for w in device), device


def _kimi_case(m, seed=0):
    """h [m, 7168] and a sigmoid top-8 routing from random logits (ascending experts, weights
    normalised, scaling 2.827) for the cached Kimi-K2 weights."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((m, KIMI["d"])).astype(np.float32)
    logits = rng.standard_normal((m, KIMI["n_experts"]))
    idx, weight = ref.route_from_logits(logits, top_k=KIMI["top_k"],
                                        routed_scaling_factor=2.827)
    return h, idx, weight


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 9, 33, 65, 257])
def test_gpu_moe_mma_kimi_shapes_within_the_bound(m):
    host, device = _kimi_weights()
    _check((*_kimi_case(m, seed=m), *host), device_weights=device)


@pytest.mark.gpu
def test_gpu_moe_mma_rows_are_batch_invariant():
    """A token's output bits do not depend on its batch (M = 65, its own row alone, M = 9;
    M = 1100 against its row 3 and rows 0-64): no K slices, one mma chain in panel order in
    every tile, warp or warpgroup mma, the ordered combine (docs/LAYERS.md)."""
    from kdtree_numba.layers import moe_ffn
    _, device = _kimi_weights()
    h, idx, weight = _kimi_case(65, seed=1)
    full = moe_ffn(h, idx, weight, *device, method="mma").copy_to_host()
    for rows in (slice(3, 4), slice(0, 9)):
        part = moe_ffn(h[rows], idx[rows], weight[rows], *device, method="mma").copy_to_host()
        assert part.tobytes() == full[rows].tobytes()
    # a prefill's ~140 tokens an expert: past 80 rows the tile on sm_90 is the warpgroup's
    h, idx, weight = _kimi_case(1100, seed=2)
    full = moe_ffn(h, idx, weight, *device, method="mma").copy_to_host()
    for rows in (slice(3, 4), slice(0, 65)):
        part = moe_ffn(h[rows], idx[rows], weight[rows], *device, method="mma").copy_to_host()
        assert part.tobytes() == full[rows].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 33, 65, 257, 1100])
def test_gpu_moe_mma_work_list_gives_the_full_grid_bits(m, monkeypatch):
    """KDTREE_MOE_WORK_LIST=1 at Kimi shapes (decode, verify, a prefill's 1100 tokens on the
    warpgroup tile): bit for bit the full grid's output, which the tests above bound."""
    from kdtree_numba.layers import moe as moe_module
    from kdtree_numba.layers import moe_ffn
    _, device = _kimi_weights()
    h, idx, weight = _kimi_case(m, seed=m + 3)
    tiles = _record_work_lists(monkeypatch)
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "0")
    full = moe_ffn(h, idx, weight, *device, method="mma").copy_to_host()
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1")
    listed = moe_ffn(h, idx, weight, *device, method="mma").copy_to_host()
    counts = np.bincount(idx.ravel(), minlength=KIMI["n_experts"])
    bm = moe_module.moe_mma_config(m, KIMI["top_k"], KIMI["n_experts"]).bm
    assert tiles[0] is None                     # the full grid, then the list of every tile
    assert int(tiles[1][2].copy_to_host()[0]) == int(np.sum(-(-counts // bm)))
    assert listed.tobytes() == full.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [33, 72])
def test_gpu_moe_mma_dense_layer_tiles_agree(m):
    """A dense FFN through moe_ffn (one expert, every token) is where M > 32 tokens share an
    expert and moe_mma_config picks the 32- and 64-row tiles: each tile is within the bound
    of the reference, and every tile, bk (32, 64) and ring depth (2-4 stages) gives the same
    bits (one mma chain per output in panel order, no K slices)."""
    d, inter = 1024, 2048
    args = _case(m, m, d, 1, inter, np.zeros((m, 1), np.int32))
    args = (args[0], args[1], np.ones((m, 1), np.float32)) + args[3:]
    rows = {}
    for cfg in (mm.MmaConfig(wm=1, wn=2, tm=1, tn=8, bk=32, stages=2),
                mm.MmaConfig(wm=1, wn=4, tm=2, tn=4, bk=32, stages=2),
                mm.MmaConfig(wm=2, wn=2, tm=2, tn=8, bk=32, stages=2),
                mm.mma_tile(16), mm.mma_tile(32), mm.mma_tile(48), mm.mma_tile(80),
                mm.mma_tile(81)):
        rows[cfg] = _check(args, configs=cfg).tobytes()
    picked = _check(args)                                   # moe_mma_config's own tile
    assert set(rows.values()) == {picked.tobytes()}, "tiles, bk or ring depths disagree"


@pytest.mark.gpu
def test_gpu_dense_ffn_as_sliced_linears_within_the_bound_and_batch_invariant():
    """The dense FFN under "mma" (Kimi-K2's first layer, scaled: D 2048, I 4096) at a verify's
    65 and 33 rows and a decode's 1: within the bound of the reference, and each smaller batch
    gives the rows of the 65-row batch bit for bit (K slices fixed by N and K)."""
    rng = np.random.default_rng(30)
    d, inter = 2048, 4096
    h = rng.standard_normal((65, d)).astype(np.float32)
    gate_up = bf16_bits(rng.standard_normal((1, 2 * inter, d)) * 0.05)
    down = bf16_bits(rng.standard_normal((1, d, inter)) * 0.02)
    full, splits = _dense_check(h, gate_up, down)
    assert max(splits) > 1, splits
    for rows in (slice(0, 33), slice(7, 8)):
        part, _ = _dense_check(h[rows], gate_up, down)
        assert part.tobytes() == full[rows].tobytes(), rows


@pytest.mark.gpu
@pytest.mark.parametrize("m", [9, 33])
@pytest.mark.parametrize("layers", ["dense", "routed", "dense,routed", "routed,dense",
                                    "dense,routed,routed", "linears", "linears,routed"])
def test_gpu_moe_mma_graph_replay_equals_eager(layers, m, monkeypatch):
    """A chain of FFN layers through moe_ffn(method="mma") as a model runs them (a dense FFN
    of Kimi's width 18,432 as the one-expert case -- a prefill's -- or, "linears", without
    routing as decode and verify run it: two sliced linears; then routed layers of 64 experts
    and a shared expert, with "linears" over the work list): a CUDA-graph replay (graphs.py)
    gives the eager run's bits.  At 33 tokens the dense layer takes the 64-row tile and the
    routed ones the 16-row tile; kimi-slice's DDTree diverged there under graphs with both on
    tensor cores (run 45)."""
    monkeypatch.setenv("KDTREE_MOE_WORK_LIST", "1" if "linears" in layers else "0")
    import cupy

    from kdtree_numba.backends import make_backend
    from kdtree_numba.graphs import GraphCache
    be = make_backend("numba")
    d = KIMI["d"]
    dense = (_device_bf16_random((1, 2 * 18432, d), 1), _device_bf16_random((1, d, 18432), 2))
    _, routed = _kimi_weights()
    h, idx, weight = _kimi_case(m, seed=5)
    idx, weight = cupy.asarray(idx), cupy.asarray(weight)

    def forward(x):
        for kind in layers.split(","):
            if kind == "dense":        # as kdtree_numba/model.py's _ffn runs a prefill's
                y = be.ops.moe_ffn(x, cupy.zeros((m, 1), np.int32),
                                   cupy.ones((m, 1), np.float32), *dense, method="mma")
            elif kind == "linears":    # ... and a decode's or a verify's
                y = be.ops.moe_ffn(x, None, None, *dense, method="mma")
            else:
                y = be.ops.moe_ffn(x, idx, weight, *routed, method="mma")
            x = x + y
        return x

    eager = cupy.asnumpy(forward(cupy.asarray(h)))
    assert np.isfinite(eager).all()
    graphs = GraphCache(be)
    runs = [graphs.call(("ffn", m, layers), forward, [h], [((m, d), np.float32)])
            for _ in range(4)]
    assert runs[0] is None and graphs.captures == 1 and graphs.failures == 0
    for i, out in enumerate(runs[1:]):
        got = cupy.asnumpy(out)
        bad = np.argwhere(got != eager)
        assert bad.size == 0, (f"replay {i}: {len(bad)} of {got.size} differ, rows "
                               f"{sorted(set(bad[:, 0].tolist()))[:12]}")

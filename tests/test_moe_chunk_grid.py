"""``KDTREE_MOE_CHUNK_GRID=1`` (kdtree_numba/layers/moe.py): the weight-streaming expert kernel
with an expert's mt-token chunks in blocks of their own, and the grouping's scan over pow2(E)
lanes of fewer threads.  Each output is one block's reduction over K whichever block holds its
chunk, so the switch moves no bit: the simulator tests compare both grids bit for bit on the
same grouped lists (gate_up's act and down's y_slot) and end to end (moe_ffn), on routings
that give experts many chunks, one token or none, float32 / bf16 / int4 (W4A16) experts,
against the reference too; the GPU twins run the demo pair's widths.

Tiny shapes: a simulated thread costs ~120 us.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference.layers as ref
from kdtree_numba import compat
from kdtree_numba.layers import moe
from kdtree_numba.layers.moe_mma import routed_tile_bound
from kdtree_numba.layers.common import pow2_ceil
from kdtree_numba.layers.workspace import Workspace, int4_experts, int4_load_kind
from ptx_check import HOPPER_PRELUDE
from test_layers import BF16, gpu_layers, host, moe_case   # noqa: F401 (a fixture)
from w4a16_cases import U32, g_dense, int4_case, moe_bound, swiglu_abs

SWITCH = "KDTREE_MOE_CHUNK_GRID"


class LaunchLog:
    """Records the grid of each expert and grouping launch (their recipes and grid sizes):
    wraps moe's two kernel factories, so the kernels themselves run unchanged."""

    def __init__(self, monkeypatch):
        self.launches = []
        for name in ("_expert_kernel", "_group_kernel"):
            monkeypatch.setattr(moe, name, self._wrap(name, getattr(moe, name)))

    def _wrap(self, name, factory):
        log = self.launches

        class Configured:
            def __init__(self, recipe):
                self.recipe, self.kernel = recipe, factory(*recipe)

            def __getitem__(self, config):
                log.append((name, self.recipe, config[0], config[1]))
                return self.kernel[config]
        return lambda *recipe: Configured(recipe)

    def of(self, name):
        return [launch[1:] for launch in self.launches if launch[0] == name]


def expert_inputs(kind, m, d, inter, n_experts, top_k, rng, group=16):
    """(h, idx, weight, gate_up, down) with the routed experts float32, bf16 or int4."""
    if kind in ("f32", "bf16"):
        h, idx, wt, gu, dn, _, _ = moe_case(rng, m, d, n_experts, inter, top_k,
                                            BF16 if kind == "bf16" else np.float32, False)
        return h, idx, wt, gu, dn
    h, idx, wt, gu, dn, _, _ = int4_case(rng, m, d, n_experts, inter, top_k, group, False)
    return h, idx, wt, gu, dn


def routing(name, m, n_experts, top_k, rng):
    """'many': expert 1 in every row (more chunks than one block's loop would take at once),
    expert 0 in none; 'one': each expert at most one token; 'spread': the random routing."""
    if name == "many":
        others = rng.choice(np.arange(2, n_experts), (m, top_k - 1))
        return np.sort(np.concatenate([np.ones((m, 1), int), others], axis=1),
                       axis=1).astype(np.int32)
    if name == "one":
        assert m * top_k <= n_experts
        return np.arange(m * top_k, dtype=np.int32).reshape(m, top_k)
    return None


def check_reference(kind, got, h, idx, wt, gu, dn):
    """Within tests/w4a16_cases.py's first-order bound of reference.moe_ffn: its int4 one,
    or for float experts the same derivation with the float GEMMs' (K + 2) u."""
    want = ref.moe_ffn(h, idx, wt, gu, dn)
    if kind.startswith("i4"):
        bound = moe_bound(h, idx, wt, lambda e: (gu[e].dequantize(), dn[e].dequantize()))
    else:
        mag = np.zeros(h.shape, np.float64)
        for e in np.unique(idx):
            rows, cols = np.nonzero(idx == e)
            mag[rows] += np.abs(wt[rows, cols])[:, None] * swiglu_abs(
                h[rows], ref.as_float64(gu[e]), ref.as_float64(dn[e]))
        bound = 2 * (2.1 * g_dense(h.shape[1]) + g_dense(dn.shape[2]) +
                     (idx.shape[1] + 10) * U32) * mag + 1e-30
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, ratio {(err / bound).max():.3g}"
    assert np.abs(want).max() > 0.1          # not a vacuous comparison


# ------------------------------------------------------------------------------- the bound

def test_chunk_bound_takes_every_chunk_at_once_where_the_grid_stays_small():
    """The demo pair (E 8, k 2; the GPU's mt 4, 8 and 16 at 9, 17 and 33 rows): ceil(M / mt)
    = 3 blocks, every chunk of an expert holding all M tokens in a block of its own; Kimi-K2
    (E 384, k 8, mt 1) at a verify's 17 rows: 2, not 17; one row: 1.  Everywhere: at least 1,
    at most ceil(M / mt), and the (slot, chunk) blocks fewer than 2R + A."""
    assert [moe.expert_chunk_bound(m, 2, 8, mt) for m, mt in ((1, 1), (9, 4), (17, 8), (33, 16))] \
        == [1, 3, 3, 3]
    assert moe.expert_chunk_bound(17, 8, 384, 1) == 2
    assert moe.expert_chunk_bound(200, 1, 1, 16) == 13      # the dense FFN: one expert
    for m in (1, 2, 5, 9, 17, 33, 64, 200):
        for top_k, n_experts in ((1, 1), (2, 8), (4, 16), (8, 64), (8, 384)):
            for mt in (1, 2, 4, 8, 16):
                c = moe.expert_chunk_bound(m, top_k, n_experts, mt)
                slots = min(n_experts, m * top_k)
                assert 1 <= c <= -(-m // mt)
                assert slots * c < 2 * routed_tile_bound(m * top_k, n_experts, mt) + slots


# ----------------------------------------------------------------------- bitwise: simulator

CASES = [  # (kind, m, d, inter, E, top_k, routing, C in the simulator, where mt <= 4)
    ("f32", 9, 16, 8, 4, 2, "many", 3),       # mt 4: expert 1's 9 tokens in 3 blocks
    ("bf16", 9, 16, 8, 16, 1, "many", 2),     # mt 1: the cap binds, 9 chunks in 2 blocks
    ("bf16", 2, 16, 8, 4, 2, "one", 2),       # one token an expert: C 2's second block idle
    ("bf16", 5, 12, 6, 8, 2, "spread", 3),    # scalar loads, mt 2
    ("i4", 5, 32, 16, 3, 2, "many", 2),       # W4A16, 16-byte chunks of 32 weights
    ("i4s", 5, 40, 8, 3, 2, "many", 2),       # W4A16, word loads (rows not whole chunks)
]


@pytest.mark.parametrize("kind, m, d, inter, n_experts, top_k, name, sim_chunks", CASES,
                         ids=[f"{c[0]}-M{c[1]}-E{c[4]}k{c[5]}-{c[6]}" for c in CASES])
def test_chunk_grid_gives_the_one_chunk_grids_bits(gpu_layers, monkeypatch, kind, m, d, inter,
                                                   n_experts, top_k, name, sim_chunks):
    """gate_up's act and down's y_slot from the same grouped lists under both grids, bit for
    bit, every slot's row written, with the launch shapes expected; then moe_ffn end to end
    both ways (the grouping's narrow scan included), bitwise, and within the reference's
    bound."""
    rng = np.random.default_rng(len(name) * 100 + m * 10 + n_experts)
    h, idx, wt, gu, dn = expert_inputs(kind, m, d, inter, n_experts, top_k, rng,
                                       group=8 if kind == "i4s" else 16)
    idx = routing(name, m, n_experts, top_k, rng) if name != "spread" else idx
    int4 = kind.startswith("i4")
    gud, dnd = (int4_experts(gu), int4_experts(dn)) if int4 else (gu, dn)
    hd, idx_d = compat.to_device(h), compat.to_device(idx)
    if int4:       # the kind the kernels pick from these device arrays
        assert int4_load_kind(d, hd, gud.on_device()) == kind

    monkeypatch.delenv(SWITCH, raising=False)
    ws = Workspace()
    _, lists, _ = moe._group_tokens(idx_d, n_experts, ws, 0)
    gu_dev, w_kind = moe._expert_weight(gud, 0)
    dn_dev, _ = moe._expert_weight(dnd, 0)
    n_entries = m * top_k
    outputs = {}
    log = LaunchLog(monkeypatch)
    for on in ("0", "1"):
        monkeypatch.setenv(SWITCH, on)
        act = compat.to_device(np.full((n_entries, inter), np.nan, np.float32))
        y_slot = compat.to_device(np.full((n_entries, d), np.nan, np.float32))
        moe._experts_skinny(hd, lists, gu_dev, dn_dev, w_kind, act, y_slot,
                            min(n_entries, n_experts), m, top_k, 0)
        outputs[on] = host(act), host(y_slot)
    for off, on in zip(outputs["0"], outputs["1"]):
        assert not np.isnan(off).any()
        np.testing.assert_array_equal(on.view(np.uint32), off.view(np.uint32))

    # the one-chunk grid's recipe and size, then C times its blocks (C > 1 in the recipe
    # alone), C the bound at the config's mt: gate_up, down, gate_up, down
    launches = log.of("_expert_kernel")
    assert len(launches) == 4
    for (recipe0, grid0, threads0), (recipe1, grid1, threads1) in zip(launches[:2],
                                                                      launches[2:]):
        c = moe.expert_chunk_bound(m, top_k, n_experts, recipe0[0].mt)
        assert len(recipe0) == 4 and recipe1 == recipe0 + ((c,) if c > 1 else ())
        assert grid1 == grid0 * c and threads1 == threads0
        assert c == sim_chunks or not compat.SIMULATOR

    full = {}
    for on in ("0", "1"):
        monkeypatch.setenv(SWITCH, on)
        full[on] = host(gpu_layers.moe_ffn(h, idx, wt, gud, dnd, method="skinny"))
    np.testing.assert_array_equal(full["1"].view(np.uint32), full["0"].view(np.uint32))
    check_reference(kind, full["1"], h, idx, wt, gu, dn)


@pytest.mark.parametrize("kind, lean", [("bf16", "0"), ("i4", "1")])
def test_dense_ffn_over_the_chunk_grid_keeps_its_bits(gpu_layers, monkeypatch, kind, lean):
    """The dense FFN on the expert kernel (one expert holding every row, C = ceil(M / mt)):
    bf16 without the lean round (its device-filled routing grouped), int4 with it (the
    constant lists, _dense_lists): the switch on gives the bits of the switch off."""
    monkeypatch.setenv("KDTREE_LEAN_ROUND", lean)
    rng = np.random.default_rng(29)
    # more rows than a GPU chunk (mt 8 at 6 rows there: one chunk, as run 151 found) and than
    # the simulator's
    m = 20
    h, _, _, gu, dn = expert_inputs(kind, m, 32, 16, 1, 1, rng)
    if kind == "i4":
        gu, dn = int4_experts(gu), int4_experts(dn)
    log = LaunchLog(monkeypatch)
    out = {}
    for on in ("0", "1"):
        monkeypatch.setenv(SWITCH, on)
        out[on] = host(gpu_layers.moe_ffn(h, None, None, gu, dn, method="skinny"))
    np.testing.assert_array_equal(out["1"].view(np.uint32), out["0"].view(np.uint32))
    experts = log.of("_expert_kernel")
    assert len(experts) == 4
    for (recipe, grid0, _), (_, grid1, _) in zip(experts[:2], experts[2:]):
        assert grid1 == grid0 * -(-m // recipe[0].mt) > grid0


def group_threads(n_entries: int, n_experts: int, chunk_grid: bool) -> int:
    """The grouping's block size: 32 in the simulator; 1024 on the GPU, with the chunk grid
    pow2(max(entries, E)) within 32..1024."""
    if compat.SIMULATOR:
        return 32
    return min(1024, max(32, pow2_ceil(max(n_entries, n_experts)))) if chunk_grid else 1024


# --------------------------------------------------------------------- the grouping's scan

@pytest.mark.parametrize("n_experts, top_k, m, tile_rows", [(8, 2, 7, 0), (5, 3, 4, 2),
                                                            (40, 2, 9, 0), (1, 1, 6, 4)])
def test_narrow_scan_groups_as_the_full_one(gpu_layers, monkeypatch, n_experts, top_k, m,
                                            tile_rows):
    """The grouping with the scan over pow2(E) lanes (8 of 32 threads at E 8; all 32 at E
    40, two experts a lane; one lane, no round, for the dense FFN's E 1) writes the lists of
    the full-width scan: offsets, active experts, their count and the M-tile work list the
    same; token_of_slot the same tokens in each expert's slots (the atomics number an
    expert's entries in their order) and slot_of_entry pointing at its token's slot."""
    rng = np.random.default_rng(n_experts * 10 + m)
    if n_experts == 1:
        idx = np.zeros((m, 1), np.int32)
    else:
        idx = np.stack([np.sort(rng.choice(n_experts // 2 + 1, top_k, replace=False))
                        for _ in range(m)]).astype(np.int32)     # some experts hold none
    log = LaunchLog(monkeypatch)
    lists = {}
    for on in ("0", "1"):
        monkeypatch.setenv(SWITCH, on)
        slot, (token, offsets, active, n_active), tiles = moe._group_tokens(
            compat.to_device(idx), n_experts, Workspace(), 0, tile_rows)
        lists[on] = [host(a).copy() for a in (slot, token, offsets, active, n_active)] + (
            [host(a).copy() for a in tiles] if tiles else [])
    (recipe0, _, threads0), (recipe1, _, threads1) = log.of("_group_kernel")
    n_entries = m * top_k
    assert threads0 == group_threads(n_entries, n_experts, False)
    assert threads1 == group_threads(n_entries, n_experts, True)
    lanes = min(threads1, pow2_ceil(n_experts))
    assert recipe0 == (n_experts, threads0, tile_rows)
    assert recipe1 == (n_experts, threads1, tile_rows) + ((lanes,) if lanes < threads1 else ())

    slot0, token0, offsets0, active0, n_active0 = lists["0"][:5]
    slot1, token1, offsets1, active1, n_active1 = lists["1"][:5]
    counts = np.bincount(idx.ravel(), minlength=n_experts)
    np.testing.assert_array_equal(offsets1, np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(offsets1, offsets0)
    n = int(n_active1[0])
    assert n == int(n_active0[0]) == np.count_nonzero(counts)
    np.testing.assert_array_equal(active1[:n], np.flatnonzero(counts))
    np.testing.assert_array_equal(active1[:n], active0[:n])
    if tile_rows:     # the work list: (tile_expert, tile_row, n_tiles)
        n_tiles = int(lists["1"][7][0])
        assert n_tiles == int(lists["0"][7][0]) == sum(-(-c // tile_rows) for c in counts)
        for a, b in zip(lists["0"][5:7], lists["1"][5:7]):
            np.testing.assert_array_equal(b[:n_tiles], a[:n_tiles])
    tokens = np.repeat(np.arange(m), top_k)
    for e in range(n_experts):
        lo, hi = offsets1[e], offsets1[e + 1]
        assert sorted(token1[lo:hi]) == sorted(token0[lo:hi]) == sorted(
            tokens[idx.ravel() == e])
    np.testing.assert_array_equal(token1[slot1], tokens)
    np.testing.assert_array_equal(token0[slot0], tokens)


# ------------------------------------------------------------------ registers (sm_90 ptxas)

PTX_SCRIPT = HOPPER_PRELUDE + r"""
import kdtree_numba.layers as L
from kdtree_numba.layers.moe import _expert_kernel, expert_chunk_bound
f2, i1, i64 = T.float32[:, ::1], T.int32[::1], T.int64
bad = []
# the demo pair's widths (E 8, k 2) at a verify's and a block's rows, Kimi-K2's at 17 rows
for m, top_k, n_experts, k_in, gate_up, int4 in (
        (17, 2, 8, 256, True, False), (17, 2, 8, 128, False, False),
        (33, 2, 8, 128, False, False), (9, 2, 8, 256, True, True),
        (17, 8, 384, 7168, True, False), (17, 8, 384, 2048, False, True)):
    cfg = L.expert_config(m, top_k, n_experts, k_in, gate_up, int4)
    chunks = expert_chunk_bound(m, top_k, n_experts, cfg.mt)
    weights = T.uint16[:, :, ::1] if int4 else T.float32[::1]
    sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], weights, f2, i64, i64, i64)
    regs = []
    for recipe in ((), (chunks,)):
        fn = _expert_kernel(cfg, "i4" if int4 else "bf16", gate_up, 32 if int4 else 0,
                            *recipe)
        ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=(9, 0))
        log = ptxas(ptx)
        regs.append(int(re.findall(r"Used (\d+) registers", log)[0]))
        spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log))
        local = len(re.findall(r"(?:ld|st)\.local", ptx))
        print(m, top_k, n_experts, k_in, gate_up, int4, cfg.mt, recipe, "regs", regs[-1],
              "spills", spills, "local", local, flush=True)
        if spills or local or regs[-1] > (176 if int4 else 144):
            bad.append((m, n_experts, k_in, gate_up, recipe))
    if regs[1] > regs[0] + 8:      # a register step: the chunk grid costs next to nothing
        bad.append((m, n_experts, k_in, gate_up, regs))
print("BAD", bad)
print("assembled" if not bad else "failed")
"""


@pytest.mark.compile_check(PTX_SCRIPT, timeout=300)
def test_chunk_grid_kernels_compile_to_registers_alone():
    """The chunk grid's expert kernels (the demo's widths, Kimi-K2's) compile for sm_90 with
    no local memory and no spills, within test_layers' register limits (144; int4 176) and
    at most one allocation step (8) above the one-chunk kernel's (measured: the same)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(PTX_SCRIPT, timeout=300)
    assert out.splitlines()[-1] == "assembled", out[-2000:]


# ----------------------------------------------------------------------------- GPU twins

DEMO = dict(d=256, inter=128, n_experts=8, top_k=2)       # docs/DEMO.md: the target's MoE


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f32", "bf16", "i4"])
@pytest.mark.parametrize("m", [1, 9, 17, 33])
def test_gpu_chunk_grid_at_the_demo_widths_gives_the_same_bits(monkeypatch, kind, m):
    """The demo target's routed experts (D 256, I 128, E 8, k 2) on the weight-streaming
    kernels at an AR step's, a verify's and a block's rows, a router-like routing and one
    where expert 3 holds every token: the switch on gives the bits of the switch off, with
    C = 3 chunk blocks (1 at one row) where the grid had 1, and within the reference's bound."""
    import cupy
    rng = np.random.default_rng(m)
    d, inter, n_experts, top_k = DEMO.values()
    h, idx, wt, gu, dn = expert_inputs(kind, m, d, inter, n_experts, top_k, rng, group=32)
    many = np.sort(np.stack([[3, e] for e in rng.choice([0, 1, 2, 4, 5, 6, 7], m)]),
                   axis=1).astype(np.int32)
    gud, dnd = (int4_experts(gu), int4_experts(dn)) if kind == "i4" else (gu, dn)
    if kind == "i4":
        gud, dnd = gud.on_device(), dnd.on_device()
    log = LaunchLog(monkeypatch)
    for routed in (idx, many):
        log.launches.clear()
        out = {}
        for on in ("0", "1"):
            monkeypatch.setenv(SWITCH, on)
            out[on] = cupy.asnumpy(cupy.asarray(moe.moe_ffn(h, routed, wt, gud, dnd,
                                                             method="skinny")))
        np.testing.assert_array_equal(out["1"].view(np.uint32), out["0"].view(np.uint32))
        check_reference(kind, out["1"], h, routed, wt, gu, dn)
        experts = log.of("_expert_kernel")
        assert len(experts) == 4
        for (_, grid0, _), (_, grid1, _) in zip(experts[:2], experts[2:]):
            assert grid1 == grid0 * (1 if m == 1 else 3)
        (_, _, threads0), (_, _, threads1) = log.of("_group_kernel")
        assert (threads0, threads1) == (1024, group_threads(m * top_k, n_experts, True))


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_chunk_grid_gives_the_demo_pairs_rounds(monkeypatch, temperature):
    """The demo pair's DDTree device rounds at budget 16 (17-row verifies) with CUDA graphs,
    the chunk grid off, on, on: the same tokens and acceptances, the caches' committed bits,
    and the chunk grid's rounds captured as graphs of their own (the grid is capturable:
    its bound comes from the shapes alone)."""
    from test_lean_round import assert_same_rounds, demo_pair, demo_runs
    model, drafter = demo_pair()
    assert_same_rounds(demo_runs(monkeypatch, model, drafter, SWITCH, ("0", "1", "1"), 16,
                                 temperature))

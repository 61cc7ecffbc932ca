"""``KDTREE_FEWER_LAUNCHES=1`` (runtime.fewer_launches, off by default until a GPU run
validates it): fewer launches in the small forwards with the same bits.

Attention's key splits merged by the block kernel's last block of each row tile
(tiles.merge_when_last) instead of a merge launch: the outputs equal the merge kernel's bit
for bit, on the FFMA kernel and the bf16 one, with causal and tree masks, rows whose keys end
before the last split, splits past a request's keys (never written, never read: the partial
buffers start as NaN), and over repeated calls (the arrival counters go back to zero).  The
tensor-core (tf32x3) kernel runs only on a GPU: the GPU twins below.  The engine under the
switch (DDTree = AR, the same bits, the launches it removes: the merges, and the features'
concatenation a verify made) is tests/test_lean_round.py's launch-count test."""
from __future__ import annotations

import numpy as np
import pytest
from ptx_check import HOPPER_PRELUDE

from kdtree_numba.compat import cuda   # the simulator swaps `cuda` in a kernel's globals
from reference import attention as ref
from reference.attention import tree_visible


def _problem(rng, bs, n, heads, r, dr, cap, prefix, kind, bf16=False):
    if kind == "tree":
        visible = np.stack([tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
                            for _ in range(bs)])
    else:
        visible = np.broadcast_to(np.tril(np.ones((n, n), bool)), (bs, n, n)).copy()
    ckv = rng.standard_normal((bs, cap, r)).astype(np.float32)
    kpe = rng.standard_normal((bs, cap, dr)).astype(np.float32)
    if bf16:
        from test_attention_bf16 import bf16_bits
        ckv, kpe = bf16_bits(ckv), bf16_bits(kpe)
    return dict(q_abs=rng.standard_normal((bs, n, heads, r)).astype(np.float32),
                q_pe=rng.standard_normal((bs, n, heads, dr)).astype(np.float32),
                ckv=ckv, kpe=kpe, prefix_len=np.array(prefix, np.int32), visible=visible,
                tau=0.35)


def _both_plans(prob, chunk, variant=None):
    """(plan merging by launch, plan merging in the kernel) of one shape, their partial
    buffers poisoned with NaN."""
    from kdtree_numba.attention import MlaAttentionPlan
    bs, n, heads, r = prob["q_abs"].shape
    shape = (bs, n, heads, r, prob["q_pe"].shape[-1], prob["ckv"].shape[1])
    bf16 = prob["ckv"].dtype == np.uint16
    plans = [MlaAttentionPlan(*shape, keys_per_split=chunk, variant=variant, bf16_cache=bf16,
                              fused_merge=fused) for fused in (False, True)]
    for plan in plans:
        plan.part_o.copy_to_device(np.full(plan.part_o.shape, np.nan, np.float32))
        ml = np.full(plan.part_ml.shape, np.nan, np.float32)
        plan.part_ml.copy_to_device(ml)
    assert plans[0].merge is not None and plans[1].merge is None and plans[1].fused_merge
    return plans


def _call(plan, prob, causal):
    args = [prob[k] for k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible", "tau")]
    return plan(*args, causal=causal).copy_to_host()


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
def test_the_kernels_last_block_merges_the_splits_with_the_merge_kernels_bits(needs_kernels,
                                                                               causal):
    from kdtree_numba.attention import tile_config
    rng = np.random.default_rng(11)
    r, dr = 8, 4
    rows = tile_config(r, dr, "pipe16x2").rows
    # two row tiles, the second ragged, at a few tokens whatever the tile's rows (the
    # simulator's 8, a GPU's 64: run 156 ran 35 tokens past the 64-key cache at 2 heads)
    heads = max(2, rows // 4)
    n = rows // heads + 3
    chunk, cap = 16, 64              # 4 splits; request 1's keys fill one, request 2's two
    prob = _problem(rng, 3, n, heads, r, dr, cap, [37, 1, 14],
                    "causal" if causal else "tree")
    separate, fused = _both_plans(prob, chunk, "pipe16x2")
    assert separate.splits == fused.splits == 4
    want = _call(separate, prob, causal)
    np.testing.assert_allclose(want, ref.mla_attention(**prob, out_dtype=np.float64), rtol=0,
                               atol=ref.fp32_error_bound(**prob))
    for _ in range(2):               # the counters went back to zero: a second call agrees
        got = _call(fused, prob, causal)
        assert got.tobytes() == want.tobytes()
        counters = fused.part_ml.copy_to_host()[:, fused.splits, :, 0]
        tiles = fused.grid[0]
        assert (counters[:, :tiles] == 0).all()
    # request 1 has keys in split 0 only: the others ran nothing and wrote nothing
    assert np.isnan(fused.part_ml.copy_to_host()[1, 1:fused.splits]).all()


def test_the_bf16_kernels_last_block_merges_with_the_merge_kernels_bits(needs_kernels):
    rng = np.random.default_rng(12)
    prob = _problem(rng, 2, 3, 1, 16, 8, 32, [20, 3], "tree", bf16=True)
    separate, fused = _both_plans(prob, 16)
    assert separate.splits == 2          # request 0's keys in both, request 1's in one
    want = _call(separate, prob, False)
    assert _call(fused, prob, False).tobytes() == want.tobytes()
    assert (fused.part_ml.copy_to_host()[:, 2, 0, 0] == 0).all()


def _merge_tail_blocks(r, rows, threads, causal, smem_floats):
    """A kernel of the block kernels' grid (row tiles x splits x requests) whose blocks with
    keys copy their split's partials from given arrays, then run the merge tail."""
    from numba import float32

    from kdtree_numba.attention.tiles import merge_when_last, request_keys, splits_with_keys
    merge = merge_when_last(r, rows, threads, causal, smem_floats)

    @cuda.jit
    def blocks(src_o, src_ml, prefix_len, n, heads, chunk, out, part_o, part_ml):
        smem = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        row0, split, b = cuda.blockIdx.x * rows, cuda.blockIdx.y, cuda.blockIdx.z
        n_rows = n * heads
        keys = request_keys(prefix_len[b], n, causal, row0 + rows - 1, heads)
        if split < splits_with_keys(keys, chunk, cuda.gridDim.y):
            for i in range(tid, rows * r, threads):
                if row0 + i // r < n_rows:
                    part_o[b, split, row0 + i // r, i % r] = src_o[b, split, row0 + i // r,
                                                                   i % r]
            for i in range(tid, rows * 2, threads):
                if row0 + i // 2 < n_rows:
                    part_ml[b, split, row0 + i // 2, i % 2] = src_ml[b, split, row0 + i // 2,
                                                                     i % 2]
            merge(smem, part_o, part_ml, out, b, row0, n_rows, prefix_len[b], n, heads, chunk,
                  tid)
    return blocks


@pytest.mark.parametrize("causal, smem_floats", [(False, 60), (True, 80), (True, 4096)],
                         ids=["tree-groups-of-2", "causal-groups-of-3", "causal-whole-tile"])
def test_the_merge_tail_gives_the_merge_kernels_bits(needs_kernels, causal, smem_floats):
    """tiles.merge_when_last alone, against mla.py's merge kernel on the same partials: more
    splits than one thread loads at once (MERGE_LOADS), a ragged row tile, rows of one tile
    with different splits with keys (causal), a row that sees nothing (all maxima -inf),
    NaN in every partial the merge must skip (a row's splits past its keys, splits past
    its tile's keys), a thread count that leaves outputs over (16 float4s a tile, taken
    MERGE_ITEMS x 3 at a time), and the rows of a tile merged in groups of 2 and 3 when the
    shared memory holds fewer (smem_floats: 26 floats a row at 12 splits)."""
    from kdtree_numba.attention.mla import _merge_kernel
    from kdtree_numba.attention.tiles import MERGE_ITEMS, MERGE_LOADS, merge_smem_floats
    from kdtree_numba.compat import to_device
    rng = np.random.default_rng(15)
    r, rows, threads, n, heads, chunk = 16, 4, 3, 3, 2, 1
    prefix = np.array([9, 1], np.int32)
    bs, splits, n_rows = 2, 12, n * heads          # request 0's last key in split 11
    src_o = np.full((bs, splits, n_rows, r), np.nan, np.float32)
    src_ml = np.full((bs, splits + 1, n_rows, 2), np.nan, np.float32)
    sp = np.zeros((bs, n_rows), int)
    for b in range(bs):
        for row in range(n_rows):
            keys = prefix[b] + (row // heads + 1 if causal else n)
            sp[b, row] = min(splits, keys)
            s = sp[b, row]
            src_o[b, :s, row] = rng.standard_normal((s, r))
            src_ml[b, :s, row, 0] = rng.uniform(-3, 3, s)
            src_ml[b, :s, row, 1] = rng.uniform(0.5, 4, s)
            src_ml[b, rng.integers(0, s), row] = (-np.inf, 0.0)    # a split it sees nothing of
    src_ml[0, :, 1] = (-np.inf, 0.0)                # row 1 of request 0 sees nothing at all
    src_o[0, :, 1] = 0.0
    src_ml[0, sp[0, 1]:, 1] = np.nan
    src_o[0, sp[0, 1]:, 1] = np.nan
    assert merge_smem_floats(1, splits) == 26 and 16 % (MERGE_ITEMS * threads)
    assert sp.max() > MERGE_LOADS and len(set(sp[0].tolist())) > 1 - (not causal)
    if causal:
        assert len(set(sp[0, :rows].tolist())) > 1      # one tile, rows of different splits
    want = to_device(np.full((bs, n_rows, r), np.nan, np.float32))
    _merge_kernel(r)[(n_rows, bs), r // 4](to_device(src_o), to_device(src_ml),
                                           to_device(prefix), np.int64(n), np.int64(heads),
                                           causal, np.int64(chunk), np.int64(splits), want)
    want = want.copy_to_host()
    for b in range(bs):                             # an independent float64 oracle
        for row in range(n_rows):
            m, l = src_ml[b, :sp[b, row], row].astype(np.float64).T
            o = src_o[b, :sp[b, row], row].astype(np.float64)
            if m.max() == -np.inf:
                oracle = np.zeros(r)
            else:
                w = np.exp(m - m.max())
                oracle = (w[:, None] * o).sum(0) / (w * l).sum()
            np.testing.assert_allclose(want[b, row], oracle, rtol=1e-5, atol=1e-6)
    assert (want[0, 1] == 0).all()
    kernel = _merge_tail_blocks(r, rows, threads, causal, smem_floats)
    part_o = to_device(np.full(src_o.shape, np.nan, np.float32))
    part_ml = np.full(src_ml.shape, np.nan, np.float32)
    part_ml[:, splits] = 0.0                            # the counters
    part_ml = to_device(part_ml)
    for _ in range(2):                                  # the counters go back to zero
        got = to_device(np.full((bs, n_rows, r), np.nan, np.float32))
        kernel[(-(-n_rows // rows), splits, bs), threads, 0, 4 * smem_floats](
            to_device(src_o), to_device(src_ml), to_device(prefix), n, heads, chunk, got,
            part_o, part_ml)
        assert got.copy_to_host().tobytes() == want.tobytes()
        assert (part_ml.copy_to_host()[:, splits, :2, 0] == 0).all()


def test_a_plan_whose_splits_leave_no_room_for_one_row_keeps_the_merge_kernel(needs_kernels):
    """The in-kernel merge needs (2 splits + 2) shared floats for a row (merge_smem_floats):
    a plan with more splits than that leaves no room for keeps the merge launch (fused_merge
    off), one with fewer merges in the kernel."""
    from kdtree_numba.attention import MlaAttentionPlan, tile_config
    from kdtree_numba.attention.tiles import merge_smem_floats
    floats = tile_config(8, 4, "pipe16x2").smem_bytes() // 4
    fits = (floats - 2) // 2                       # the most splits one row has room for
    assert merge_smem_floats(1, fits) <= floats < merge_smem_floats(1, fits + 1)
    for splits, fused in ((fits, True), (fits + 1, False)):
        plan = MlaAttentionPlan(1, 1, 1, 8, 4, 16 * splits, keys_per_split=16,
                                variant="pipe16x2", fused_merge=True)
        assert plan.splits == splits and plan.fused_merge == fused
        assert (plan.merge is None) == fused


def test_add_rmsnorm_writes_its_sum_into_a_column_block_of_the_features(needs_kernels):
    """A captured layer's norm under the switch: s written into columns [D, 2D) of a wider
    array (a device one, and under the simulator also a host one, as the simulator's model
    has: a GPU refuses a host ``out``), the same bits as a fresh s, the other columns
    untouched."""
    from kdtree_numba.compat import SIMULATOR, to_device
    from kdtree_numba.layers import add_rmsnorm
    rng = np.random.default_rng(14)
    x, delta = (rng.standard_normal((3, 40)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(40).astype(np.float32)
    s, y = (np.array(a.copy_to_host()) for a in add_rmsnorm(x, delta, w, 1e-6))
    for on_device in (False, True) if SIMULATOR else (True,):
        features = np.full((3, 120), 7.0, np.float32)
        into = to_device(features) if on_device else features
        s2, y2 = add_rmsnorm(x, delta, w, 1e-6, sum_out=into[:, 40:80])
        got = into.copy_to_host() if on_device else into
        assert got[:, 40:80].tobytes() == s.tobytes() == s2.copy_to_host().tobytes()
        assert (got[:, :40] == 7).all() and (got[:, 80:] == 7).all()
        assert y2.copy_to_host().tobytes() == y.tobytes()


def test_the_switch_picks_the_fused_plan_and_keys_graphs_apart(monkeypatch, needs_kernels):
    """mla_attention follows KDTREE_FEWER_LAUNCHES (a plan of each kind, cached apart), and a
    CUDA graph captured under one setting is not replayed under the other
    (GraphCache.stored_key)."""
    from kdtree_numba.attention import PlanCache, mla_attention
    from kdtree_numba.graphs import GraphCache
    rng = np.random.default_rng(13)
    prob = _problem(rng, 1, 1, 1, 8, 4, 40, [30], "causal")
    plans, out = PlanCache(), {}
    for value in ("0", "1"):
        monkeypatch.setenv("KDTREE_FEWER_LAUNCHES", value)
        out[value] = mla_attention(**prob, keys_per_split=16, plans=plans).copy_to_host()
    assert [p.fused_merge for p in plans._plans.values()] == [False, True]
    assert out["0"].tobytes() == out["1"].tobytes()
    graphs = object.__new__(GraphCache)         # no device: only the keyed dictionary
    graphs._graphs = {GraphCache.stored_key(("round", 16, 4)): None}
    assert graphs.holds(("round", 16, 4))
    monkeypatch.setenv("KDTREE_FEWER_LAUNCHES", "0")
    assert not graphs.holds(("round", 16, 4))


# ----------------------------------------------------------------------------- the GPU

FUSED_PTX = r"""
import dataclasses
from kdtree_numba.attention import gpu_tile_config
from kdtree_numba.attention.plan import bf16_tile_config
from kdtree_numba.attention import bf16, ffma, mma
f3, b3, f4 = T.float32[:, :, ::1], T.boolean[:, :, ::1], T.float32[:, :, :, ::1]
for name, cfg, build in (("pipe16x2", gpu_tile_config(512, 64, "pipe16x2"), ffma.build_kernel),
                         ("tf32x3", gpu_tile_config(512, 64, "tf32x3"), mma.build_kernel),
                         ("bf16", bf16_tile_config(512, 64), bf16.build_kernel)):
    kv = T.uint16[:, :, ::1] if name == "bf16" else f3
    sig = (f3, f3, kv, kv, T.int32[::1], b3, T.float32, T.int64, T.int64, T.int64, T.boolean,
           f3, f4, f4)
    spills = []
    for fused in (False, True):
        ptx, _ = cuda.compile_ptx(build(dataclasses.replace(cfg, fused_merge=fused)).py_func,
                                  sig, cc=(9, 0))
        log = ptxas(ptx)
        spills.append(sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", log)))
        loads = ptx.count("ld.global.cg")
        print(name, fused, "ld.global.cg", loads, "atom", ptx.count("atom.global.add.f32"),
              "spill", spills[-1], flush=True)
        assert (loads > 0) == fused and (ptx.count("atom.global.add.f32") > 0) == fused
    # the merge runs after the main loop: it may not add spills to the loop's registers
    assert spills[1] <= spills[0] + 16, (name, spills)
print("assembled")
"""


@pytest.mark.slow      # six sm_90 compiles (minutes); skipped (exit 77) without NVVM
@pytest.mark.compile_check(HOPPER_PRELUDE + FUSED_PTX, timeout=600)
def test_the_fused_merge_kernels_compile_for_hopper():
    """The three block kernels with the in-kernel merge compile for sm_90 and assemble: the
    merge's L2 loads and its atomic count are there (and absent from the plain kernels), and
    it adds at most 16 bytes of spills (nvJitLink; no GPU needed, but NVVM)."""
    from ptx_check import run_without_simulator
    out = run_without_simulator(HOPPER_PRELUDE + FUSED_PTX, timeout=600)
    assert out.splitlines()[-1] == "assembled", out[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tf32x3", "pipe16x2", "bf16"])
@pytest.mark.parametrize("bs, n, prefix, invariant", [
    (1, 1, [4000], True), (4, 1, [700, 129, 0, 2000], False), (2, 17, [1000, 130], True),
    (1, 33, [300], False)])
def test_gpu_fused_merge_gives_the_merge_kernels_bits(variant, bs, n, prefix, invariant):
    """Kimi widths (H 64, r 512, dr 64) on the GPU, decodes and verifies (tree masks, causal),
    batch-invariant plans (128-key splits: up to 32 splits) and modelled ones: the in-kernel
    merge's outputs equal the merge kernel's bit for bit, over three calls of one plan (its
    counters reset by each call) with other calls between them."""
    import cupy
    from kdtree_numba.attention import PlanCache, mla_attention
    rng = np.random.default_rng(n + bs)
    bf16 = variant == "bf16"
    prob = _problem(rng, bs, n, 64, 512, 64, max(prefix) + n + 5, prefix, "tree", bf16=bf16)
    prob["q_abs"] *= 0.05
    prob = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in prob.items()}
    plans = PlanCache()
    kw = dict(batch_invariant=invariant, variant=None if bf16 else variant, plans=plans)
    outs = {}
    for round_ in range(3):
        for fused in (False, True):
            for causal in (False, True):
                u = mla_attention(**prob, fused_merge=fused, causal=causal, **kw)
                outs.setdefault((fused, causal), []).append(cupy.asnumpy(cupy.asarray(u)))
    assert any(p.fused_merge for p in plans._plans.values())   # several splits were merged
    for causal in (False, True):
        want = outs[(False, causal)][0]
        for got in outs[(True, causal)] + outs[(False, causal)]:
            assert got.tobytes() == want.tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_fewer_launches_give_the_same_rounds(monkeypatch, temperature):
    """The demo pair on the GPU with CUDA graphs, device rounds at budgets 8 and 16, the
    switch off and on: the same tokens and acceptances (AR's at T = 0), the drafter's context
    and the target's cache the same bits, the last run replaying graphs."""
    from test_lean_round import switch_keeps_the_rounds
    switch_keeps_the_rounds(monkeypatch, "KDTREE_FEWER_LAUNCHES", temperature)

"""mla_attention over a bf16 latent cache (kdtree_numba/attention/bf16.py) against the
reference's bf16 contract (reference/attention/mla.py, "A bf16 cache").

Anywhere (CI): the tile index math (``key_row``, ``tile_word``: a bijection, and the three
shared-memory load patterns free of bank conflicts, as the kernel's docstring claims); the
reference's bf16 rounding against a bit oracle; the kernel itself on the simulator (its mma
emulated by ``block_uniform_mma_bf16``) within ``bf16_error_bound`` on decode, tree verify with
key splits, causal prefill, ragged and empty rows and four widths, with a check that the bound
still catches a one-bit mask error; the rounded-sum normalisation (equal value rows come back
to the last bits); batch invariance; the plan's and the reference's type errors; the decode
layouts of dev/cuda/attention.py (issue 38: fragment-order queries, lean staging, three key
stages, ldmatrix.trans values, a 128-bit exchange), each giving the package layout's bits.
On the GPU (marker ``gpu``): Kimi widths (H 64, r 512, dr 64) on decode bs 64 prefix 4096,
verify and causal prefill, every block height giving the same bits; every layout the
package layout's bits on decode and verify.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference import attention as ref
from reference.attention import tree_visible


def bf16_bits(x) -> np.ndarray:
    """The oracle: float32 -> bf16 bits, round to nearest, ties to even (finite inputs)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def problem(rng, prefix, n, visible, heads, r, dr, tau=0.3, max_len=None, boost=4.0):
    """A bf16-cache problem whose new keys score ``boost`` above the prefix's through rope
    channel 0 (as tests/test_attention_gpu.py does), so that every visible new key carries a
    large share of the softmax: a masking error moves outputs far beyond the tolerance."""
    prefix = np.asarray(prefix, np.int32)
    bs = len(prefix)
    max_len = max_len or int(prefix.max()) + n + 3
    q_pe = rng.standard_normal((bs, n, heads, dr)).astype(np.float32)
    kpe = rng.standard_normal((bs, max_len, dr)).astype(np.float32)
    q_pe[..., 0] = 1.0 / tau
    kpe[..., 0] = 0.0
    for b, p in enumerate(prefix):
        kpe[b, p:p + n, 0] = boost
    return dict(q_abs=rng.standard_normal((bs, n, heads, r)).astype(np.float32), q_pe=q_pe,
                ckv=bf16_bits(rng.standard_normal((bs, max_len, r))), kpe=bf16_bits(kpe),
                prefix_len=prefix, visible=np.asarray(visible, bool), tau=tau)


def run(prob, **kwargs):
    from kdtree_numba.attention import mla_attention
    return mla_attention(**prob, **kwargs).copy_to_host()


# ------------------------------------------------------------------ index math

def test_key_rows_are_a_permutation_with_an_even_and_an_odd_row_per_score_phase():
    from kdtree_numba.attention.bf16 import key_row
    rows = [key_row(n) for n in range(8)]
    assert sorted(rows) == list(range(8))
    assert [rows[2 * t] for t in range(4)] == [0, 1, 2, 3]
    assert [rows[2 * t + 1] for t in range(4)] == [5, 4, 7, 6]


@pytest.mark.parametrize("rows, d", [(16, 576), (32, 64), (64, 192)])
def test_tile_words_cover_the_tile_once(rows, d):
    from kdtree_numba.attention.bf16 import tile_word
    words = [tile_word(rows, row, col) for row in range(rows) for col in range(0, d, 2)]
    assert sorted(words) == list(range(rows * d // 2))
    # a column pair shares its word; a 16-byte chunk is 4 consecutive words
    assert all(tile_word(rows, 5, c) == tile_word(rows, 5, c + 1) for c in range(0, d, 2))
    assert all(tile_word(rows, 6, c + 2 * i) == tile_word(rows, 6, c) + i
               for c in range(0, d, 8) for i in range(4))


def _phases_conflict_free(addresses, width):
    """Shared memory serves a 128-bit (64-bit) load in phases of 8 (16) lanes; within a phase
    the lanes' words must fall on distinct banks."""
    lanes_per_phase = {4: 8, 2: 16}[width]
    for start in range(0, 32, lanes_per_phase):
        banks = [(a + i) % 32 for a in addresses[start:start + lanes_per_phase]
                 for i in range(width)]
        if len(set(banks)) != len(banks):
            return False
    return True


@pytest.mark.parametrize("keys", [16, 32])
def test_the_kernels_shared_loads_are_free_of_bank_conflicts(keys):
    from kdtree_numba.attention.bf16 import key_row, tile_word
    rows = 64
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    for panel in range(3):
        col = 32 * panel
        # scores: query rows g and g + 8, key row 8 nt + key_row(g); words 4t .. 4t + 3
        for row_of in (lambda g: g, lambda g: g + 8, lambda g: 8 + key_row(g)):
            assert _phases_conflict_free([tile_word(rows, row_of(g), col + 8 * t)
                                          for g, t in lanes], 4)
    for group in range(2):
        for ks in range(keys // 16):
            # P V: key rows 16 ks + key_row(2t) (+1, +8), chunk g of a 64-column group
            for off in (0, 1):
                for plus in (0, 8):
                    addr = [tile_word(keys, 16 * ks + key_row(2 * t + off) + plus,
                                      64 * group + 8 * g) for g, t in lanes]
                    assert _phases_conflict_free(addr, 4)
    # the check itself catches a conflict: natural key order (rows 2t) collides
    addr = [tile_word(keys, 2 * t, 8 * g) for g, t in lanes]
    assert not _phases_conflict_free(addr, 4)


@pytest.mark.parametrize("keys", [16, 32])
def test_ldsm_values_rows_are_the_p_fragments_keys_and_free_of_bank_conflicts(keys):
    """ldsm_values: lane (m, r) of ldmatrix.x4.trans addresses key row 8 (m & 1) + key_row(r)
    (the P fragment's k order) of value chunk 2 half + (m >> 1) in key_word's layout; one
    matrix's 8 rows (a phase) fall in 8 bank quads there, and the score loads stay conflict
    free; in tile_word's layout the same rows would collide."""
    from kdtree_numba.attention.bf16 import key_row, key_word, ldsm_value_word, tile_word
    assert sorted(key_word(keys, r, c) for r in range(keys) for c in range(0, 64, 2)) == \
        list(range(keys * 32))
    for half in range(2):
        rows = [(8 * ((lane >> 3) & 1) + key_row(lane & 7), 8 * (2 * half + (lane >> 4)))
                for lane in range(32)]
        assert [ldsm_value_word(keys, lane, half) for lane in range(32)] == \
            [key_word(keys, r, c) for r, c in rows]
        for ks in range(keys // 16):
            for word in (key_word, tile_word):
                addr = [word(keys, 16 * ks + r, c + 32 * p) for r, c in rows for p in (0,)]
                ok = all(_phases_conflict_free(addr[8 * m:8 * m + 8] * 4, 4)
                         for m in range(4))
                assert ok == (word is key_word)
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    for nt in range(keys // 8):
        assert _phases_conflict_free([key_word(keys, 8 * nt + key_row(g), 8 * t)
                                      for g, t in lanes], 4)


@pytest.mark.parametrize("panels, rows", [(9, 64), (2, 32), (3, 16)])
def test_query_words_cover_the_tile_once_and_load_as_a_operands(panels, rows):
    """The fragment-order query tile (frag_queries): a bijection onto the row layout's words;
    lane (g, t)'s 128-bit load of block h (panel p, row group rg) is the m16n8k16 A operand
    the row layout builds from rows g and g + 8 (their words 4t + 2h, 4t + 2h + 1, bf16 column
    pairs 2 word, 2 word + 1); a warp's load spans 512 consecutive bytes (conflict free)."""
    from kdtree_numba.attention.bf16 import query_word
    words = [query_word(panels, row, col) for row in range(rows)
             for col in range(0, 32 * panels, 2)]
    assert sorted(words) == list(range(rows * 16 * panels))
    assert all(query_word(panels, 3, c) == query_word(panels, 3, c + 1)
               for c in range(0, 32 * panels, 2))
    for rg in range(rows // 16):
        for p in range(panels):
            for h in range(2):
                base = ((rg * panels + p) * 2 + h) * 128
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    word = 16 * p + 4 * t + 2 * h         # row-relative word of a0 and a1
                    want = [(g, word), (g + 8, word), (g, word + 1), (g + 8, word + 1)]
                    got = [query_word(panels, 16 * rg + r, 2 * w) for r, w in want]
                    assert got == [base + 4 * lane + j for j in range(4)]
                assert _phases_conflict_free([base + 4 * lane for lane in range(32)], 4)


# ------------------------------------------------------------------ the reference's bf16

def test_reference_rounds_queries_and_widens_the_cache_like_the_bit_oracle():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(2000) * 50).astype(np.float32)
    x[:3] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)]     # ties: to even
    want = (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    assert ref.bf16_round(x).astype(np.float32).tobytes() == want.tobytes()
    assert ref.bf16_widen(bf16_bits(x)).astype(np.float32).tobytes() == want.tobytes()
    prob = problem(rng, [7], 2, np.tril(np.ones((1, 2, 2), bool)), 2, 8, 8)
    as_floats = dict(prob, ckv=ref.bf16_widen(prob["ckv"]).astype(np.float32),
                     kpe=ref.bf16_widen(prob["kpe"]).astype(np.float32),
                     q_abs=ref.bf16_round(prob["q_abs"]).astype(np.float32),
                     q_pe=ref.bf16_round(prob["q_pe"]).astype(np.float32))
    assert ref.mla_attention(**prob).tobytes() == ref.mla_attention(**as_floats).tobytes()
    with pytest.raises(TypeError, match="both"):
        ref.mla_attention(**dict(prob, kpe=as_floats["kpe"]))


# ------------------------------------------------------------------ the kernel (simulator)

CASES = [
    # name, prefix, n, visible kind, heads, r, dr, keys_per_split
    ("decode", [21, 0, 9], 1, "causal", 4, 32, 8, None),
    ("tree verify, 3 splits", [20, 5], 5, "tree", 4, 64, 16, 16),
    ("prefill ragged rows", [0, 3], 6, "causal", 3, 128, 32, None),
    ("Kimi-like widths", [17], 2, "tree", 2, 256, 64, None),
    ("r 24: chunks dealt round-robin", [9], 2, "tree", 2, 24, 8, None),
    # whole tiles of new keys: the masked path must run for every tile past the prefix
    ("prefill n 20 after a prefix", [5], 20, "causal", 2, 32, 8, None),
    ("tree verify n 17", [3], 17, "tree", 1, 32, 8, None),
    # later blocks see whole tiles of new keys unmasked (seen_new_keys); with a hole in the
    # last query's early keys, that query's block must mask every tile again
    ("long causal prefill", [3], 48, "causal", 4, 32, 8, None),
    # 2 heads: the masking is per query token, the simulator's cost per head
    ("long causal prefill, a hole", [3], 48, "causal-hole", 2, 32, 8, None),
]


def _visible(rng, kind, bs, n):
    if kind.startswith("causal"):
        visible = np.tril(np.ones((bs, n, n), bool))
        if kind == "causal-hole":       # still causal: the promise holds
            visible[:, n - 1, 1:n // 2] = False
        return visible
    return np.stack([tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
                     for _ in range(bs)])


@pytest.mark.parametrize("name, prefix, n, kind, heads, r, dr, kps", [
    pytest.param(*c, id=c[0]) for c in CASES])
def test_bf16_kernel_matches_the_reference_within_the_bound(name, prefix, n, kind, heads, r, dr,
                                                            kps, needs_kernels):
    rng = np.random.default_rng(len(name))
    prob = problem(rng, prefix, n, _visible(rng, kind, len(prefix), n), heads, r, dr)
    got = run(prob, keys_per_split=kps, causal=kind.startswith("causal"))
    want = ref.mla_attention(**prob)
    bound = ref.bf16_error_bound(**prob)
    err = np.abs(got - want).max()
    assert err <= bound, (err, bound)
    assert err > 0           # the weights were rounded: not the float32 cache's kernel
    if n > 1:  # the bound still sees a mask error of the last query: one bit (at 48 keys,
        # where one key's weight is below the bound, half its keys)
        vis = prob["visible"].copy()
        flip = slice(0, 1) if n <= 20 else slice(0, n // 2)
        vis[0, n - 1, flip] = ~vis[0, n - 1, flip]
        assert np.abs(got - ref.mla_attention(**dict(prob, visible=vis))).max() > bound


def test_a_row_that_sees_nothing_is_zero(needs_kernels):
    rng = np.random.default_rng(3)
    vis = np.zeros((2, 2, 2), bool)
    vis[0] = np.eye(2, dtype=bool)
    prob = problem(rng, [0, 0], 2, vis, 4, 64, 16)
    got = run(prob)
    assert np.all(got[1] == 0)
    want = ref.mla_attention(**prob)
    assert np.abs(got - want).max() <= ref.bf16_error_bound(**prob)


def test_a_jump_in_one_querys_scores_rescales_only_its_rows(needs_kernels):
    """The online softmax's reference point moves for token 1 alone (its own key scores +14
    above the prefix), so its rows rescale their accumulators and token 0's do not; rescaling
    rows g + 8 by rows g's factor, or the other way, is an error of O(1)."""
    rng = np.random.default_rng(8)
    prob = problem(rng, [40], 2, np.tril(np.ones((1, 2, 2), bool)), 8, 32, 8, boost=0.0)
    kpe = ref.bf16_widen(prob["kpe"]).astype(np.float32)
    kpe[0, 41, 0] = 14.0
    prob["kpe"] = bf16_bits(kpe)
    got = run(prob, keys_per_split=64, causal=True)
    assert np.abs(got - ref.mla_attention(**prob)).max() <= ref.bf16_error_bound(**prob)


def test_32_key_tiles_in_the_simulator(needs_kernels, monkeypatch):
    """The GPU's tile (32 keys: 4 score n-tiles, 2 P V k16 steps); the simulator runs 16."""
    from kdtree_numba.attention import clear_plan_cache, plan
    monkeypatch.setattr(plan, "BF16_KEYS", 32)
    clear_plan_cache()
    rng = np.random.default_rng(9)
    prob = problem(rng, [37, 4], 3, _visible(rng, "tree", 2, 3), 4, 64, 16)
    try:
        got = run(prob, keys_per_split=32)
    finally:
        clear_plan_cache()
    assert np.abs(got - ref.mla_attention(**prob)).max() <= ref.bf16_error_bound(**prob)


def test_padding_columns_do_not_depend_on_what_shared_memory_held(needs_kernels, monkeypatch):
    """Rows padded to whole panels (r + dr = 160 -> 192): the kernel zeroes the padding once.
    The simulator's shared memory starts zeroed, the GPU's does not, so here it starts as NaN
    bits; a kernel that left the padding alone would return NaN."""
    from numba.cuda.simulator import kernelapi
    init = kernelapi.FakeCUDAShared.__init__

    def nan_filled(self, size):
        init(self, size)
        words = np.full(size // 4, 0x7FC00001, np.uint32).view(np.uint8)
        self._dynshared[:words.size] = words.view(np.int8)
    monkeypatch.setattr(kernelapi.FakeCUDAShared, "__init__", nan_filled)
    rng = np.random.default_rng(10)
    prob = problem(rng, [21], 2, np.tril(np.ones((1, 2, 2), bool)), 2, 128, 32)
    got = run(prob)
    assert np.all(np.isfinite(got))
    assert np.abs(got - ref.mla_attention(**prob)).max() <= ref.bf16_error_bound(**prob)


def test_weights_are_normalised_by_their_rounded_sum(needs_kernels):
    """Equal value rows: u is that row up to float32 rounding (a normalisation by the sum of
    the unrounded weights would be off by ~2^-9 relative)."""
    rng = np.random.default_rng(4)
    prob = problem(rng, [40], 1, np.ones((1, 1, 1), bool), 4, 64, 16)
    prob["ckv"][:] = prob["ckv"][0, 0]
    got = run(prob)
    row = ref.bf16_widen(prob["ckv"][0, 0])
    np.testing.assert_allclose(got[0, 0], np.broadcast_to(row, (4, 64)), rtol=2e-6,
                               atol=1e-30)


def test_batch_invariant_plan_gives_a_decode_row_the_bits_of_the_same_row_in_a_verify(
        needs_kernels):
    rng = np.random.default_rng(5)
    verify = problem(rng, [19], 3, np.tril(np.ones((1, 3, 3), bool)), 4, 64, 16)
    decode = dict(verify, q_abs=verify["q_abs"][:, :1], q_pe=verify["q_pe"][:, :1],
                  visible=np.ones((1, 1, 1), bool))
    a = run(verify, batch_invariant=True)
    b = run(decode, batch_invariant=True)
    assert a[:, 0].tobytes() == b[:, 0].tobytes()


def test_prefill_plan_gives_a_prompt_its_bits_alone_or_batched(needs_kernels, monkeypatch):
    """A bf16 cache's prefill plan (one split a row) gives a causal 12-token prefill after 25
    cached tokens the same bits alone and beside another request against a larger cache,
    where the fixed plan (16 keys, rounded up to the tile's: 16 in the simulator, 32 on a
    GPU) would split its 37 keys (tests/test_attention.py: the float32 layouts)."""
    from kdtree_numba.attention import MlaAttentionPlan, mla
    monkeypatch.setattr(mla, "INVARIANT_SPLIT_KEYS", 16)
    mla.clear_plan_cache()
    rng = np.random.default_rng(9)
    n = 12                       # the simulator's cost grows with n x keys: a short prefill
    causal = np.broadcast_to(np.tril(np.ones((n, n), bool)), (2, n, n)).copy()
    both = problem(rng, [25, 2], n, causal, 2, 64, 16, max_len=60)
    alone = {k: (v[:1, :37] if k in ("ckv", "kpe") else v[:1])
             if isinstance(v, np.ndarray) else v for k, v in both.items()}
    try:
        fixed = MlaAttentionPlan(1, n, 2, 64, 16, 37, batch_invariant=True, bf16_cache=True)
        assert fixed.splits == -(-37 // fixed.chunk) >= 2
        got = run(both, batch_invariant=True, prefill=True, causal=True)
        assert np.abs(got - ref.mla_attention(**both)).max() <= ref.bf16_error_bound(**both)
        one = run(alone, batch_invariant=True, prefill=True, causal=True)
        assert one[0].tobytes() == got[0].tobytes()
    finally:
        mla.clear_plan_cache()


def test_plans_refuse_a_float32_layout_or_a_mixed_cache(needs_kernels):
    from kdtree_numba.attention import MlaAttentionPlan
    rng = np.random.default_rng(6)
    prob = problem(rng, [4], 1, np.ones((1, 1, 1), bool), 2, 32, 8)
    with pytest.raises(ValueError, match="bf16 cache"):
        run(prob, variant="pipe16x2")
    plan = MlaAttentionPlan(1, 1, 2, 32, 8, prob["ckv"].shape[1], bf16_cache=True)
    assert plan.variant == "bf16"
    with pytest.raises(TypeError, match="kpe must be uint16"):
        plan(**dict(prob, kpe=prob["kpe"].astype(np.float32)))


def test_bf16_tiles_fit_every_model_width_and_pad_to_whole_panels():
    from kdtree_numba.attention.plan import Bf16TileConfig, bf16_fits
    for r, dr in [(32, 8), (64, 16), (128, 32), (512, 64), (8, 8)]:
        assert bf16_fits(r, dr)
        cfg = Bf16TileConfig(r, dr)
        assert cfg.d_pad % 64 == 0 and cfg.d <= cfg.d_pad < cfg.d + 64
        assert 64 * cfg.value_groups >= r and 2 * cfg.groups_per_warp >= cfg.value_groups
    assert not bf16_fits(12, 4)                       # rows of 16-byte chunks only


# ------------------------------------------------------------------ layouts (issue 38)

def _dev_bf16_layouts() -> dict:
    """dev/cuda/attention.py's bf16 layouts, the candidates tools/bench_attention.py times."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "dev" / "cuda" / "attention.py"
    spec = importlib.util.spec_from_file_location("dev_cuda_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BF16_LAYOUTS


BF16_LAYOUT_NAMES = tuple(_dev_bf16_layouts())
LAYOUT_CASES = [
    # name, prefix, n, visible kind, heads, r, dr, keys_per_split, tile keys, rows
    # 16-key tiles: request 0's 4 tiles wrap a 3-buffer ring; its last tile is partial; a
    # thread copies two latent chunks of a tile (16 keys x 8 chunks on 64 threads)
    ("decode", [50, 0, 9], 1, "causal", 4, 64, 8, None, None, None),
    ("tree verify, 3 splits", [20, 5], 5, "tree", 4, 64, 16, 16, None, None),
    ("causal prefill, 32-key tiles", [40], 8, "causal", 2, 32, 8, None, 32, None),
    ("r 24: chunks dealt round-robin", [37], 2, "tree", 2, 24, 8, None, None, None),
    ("two row groups a block", [21], 4, "tree", 8, 32, 8, None, None, 32),
]
# every case for all switches together; each switch alone (permute: the package's layout
# without ldsm_values) where it has the most to get wrong
ONE_CASE = {"fragq": "two row groups a block", "lean": "decode", "s3": "decode",
            "permute": "tree verify, 3 splits"}
LAYOUT_RUNS = [pytest.param(layout, case, id=f"{layout}-{case[0]}")
               for layout in BF16_LAYOUT_NAMES for case in LAYOUT_CASES
               if layout == "all" or ONE_CASE.get(layout) == case[0]]
_PACKAGE_BITS: dict = {}


def _layout_run(monkeypatch, case, layout):
    from kdtree_numba.attention import MlaAttentionPlan, plan
    name, prefix, n, kind, heads, r, dr, kps, keys, rows = case
    rng = np.random.default_rng(len(name))
    prob = problem(rng, prefix, n, _visible(rng, kind, len(prefix), n), heads, r, dr)
    if keys:
        monkeypatch.setattr(plan, "BF16_KEYS", keys)
    fields = _dev_bf16_layouts().get(layout, {})
    monkeypatch.setitem(plan.BF16_LAYOUTS, layout, fields)
    monkeypatch.setattr(plan, "BF16_LAYOUT", layout)
    p = MlaAttentionPlan(len(prefix), n, heads, r, dr, prob["ckv"].shape[1],
                         keys_per_split=kps, rows=rows, bf16_cache=True)
    assert all(getattr(p.cfg, k) == v for k, v in fields.items())     # the layout ran
    return prob, p(**prob, causal=kind == "causal").copy_to_host()


@pytest.mark.parametrize("layout, case", LAYOUT_RUNS)
def test_every_bf16_layout_gives_the_packages_bits(layout, case, needs_kernels, monkeypatch):
    """The decode layouts (queries in fragment order, lean staging, three key stages) move
    the same operands into the same mma sequence as the package's layout: the same bits
    (hence the same batch invariance), on decode, split verify, a causal prefill with 32-key
    tiles, round-robin staging and a block of two row groups."""
    from kdtree_numba.attention import plan
    if case[0] not in _PACKAGE_BITS:
        with monkeypatch.context() as m:
            _PACKAGE_BITS[case[0]] = _layout_run(m, case, plan.BF16_VARIANT)[1]
    prob, got = _layout_run(monkeypatch, case, layout)
    assert got.tobytes() == _PACKAGE_BITS[case[0]].tobytes()
    assert np.abs(got - ref.mla_attention(**prob)).max() <= ref.bf16_error_bound(**prob)


def test_bf16_layouts_are_named_and_checked(monkeypatch):
    from kdtree_numba.attention import plan
    assert list(plan.BF16_LAYOUTS) == [plan.BF16_VARIANT] and plan.BF16_LAYOUT == "bf16"
    assert plan.bf16_tile_config(512, 64) == plan.Bf16TileConfig(512, 64, keys=plan.BF16_KEYS)
    # the package's layout: the P V operands by ldmatrix.trans (run 167), the rest off
    cfg = plan.bf16_tile_config(512, 64)
    assert cfg.ldsm_values and cfg.stages == 2 and not (cfg.frag_queries or cfg.lean_staging)
    with pytest.raises(ValueError, match="unknown bf16 attention layout 'nope'"):
        plan.bf16_tile_config(512, 64, layout="nope")
    assert set(BF16_LAYOUT_NAMES) == set(ONE_CASE) | {"all"}    # each one is run above
    for fields in _dev_bf16_layouts().values():   # every candidate fits Kimi's widths
        cfg = plan.Bf16TileConfig(512, 64, keys=32, **fields).validate()
        assert cfg.smem_bytes() <= plan.MAX_SHARED_BYTES
        assert cfg != plan.Bf16TileConfig(512, 64, keys=32), fields   # not the package's
    with pytest.raises(ValueError, match="2 or 3 stages"):
        plan.Bf16TileConfig(32, 8, stages=4).validate()


# ------------------------------------------------------------------ the GPU at Kimi widths

H, R, DR = 64, 512, 64
KIMI_TAU = float(np.float32(0.130861))


def kimi_problem(rng, prefix, n, visible):
    """The float32 tests' scaling (tests/test_attention_gpu.py): prefix scores ~ N(0, 1), new
    keys +4, so that a masking error moves outputs by a few percent of max|v|."""
    prob = problem(rng, prefix, n, visible, H, R, DR, tau=KIMI_TAU)
    scale = np.float32(1.0 / (KIMI_TAU * np.sqrt(R + DR)))
    prob["q_abs"] *= scale
    prob["q_pe"][..., 1:] *= scale
    return prob


@pytest.mark.gpu
@pytest.mark.parametrize("name, prefix, n, kind", [
    ("decode bs 64 prefix 4096", [4096] * 64, 1, "causal"),
    ("verify bs 4 n 65", [1000, 3, 517, 64], 65, "tree"),
    ("prefill 300", [0, 40], 300, "causal"),
    ("prefill 300, a hole", [0, 40], 300, "causal-hole"),
])
def test_bf16_kernel_at_kimi_widths(name, prefix, n, kind):
    rng = np.random.default_rng(7)
    prob = kimi_problem(rng, prefix, n, _visible(rng, kind, len(prefix), n))
    if len(prefix) > 8:   # the float64 reference costs ~1 s a request: check a sample
        want_rows = [0, 17, 63]
    else:
        want_rows = list(range(len(prefix)))
    outs = {rows: run(prob, rows=rows, causal=kind.startswith("causal"))
            for rows in (16, 32, 64)}
    assert outs[16].tobytes() == outs[32].tobytes() == outs[64].tobytes()
    sub = {k: (v[want_rows] if k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible")
               else v) for k, v in prob.items()}
    want = ref.mla_attention(**sub)
    err = np.abs(outs[64][want_rows] - want).max()
    assert err <= ref.bf16_error_bound(**sub), err


@pytest.mark.gpu
@pytest.mark.parametrize("name, prefix, n, kind", [
    ("decode bs 8 prefix 4096", [4096, 4096, 4000, 129, 31, 0, 2048, 4096], 1, "causal"),
    ("verify bs 2 n 65", [1000, 3], 65, "tree"),
])
def test_bf16_layouts_give_the_packages_bits_at_kimi_widths(name, prefix, n, kind,
                                                            monkeypatch):
    """dev/cuda/attention.py's decode layouts (issue 38) on the H200's 32-key tiles, against
    the package's layout: the same bits, within the bound (a sample of requests)."""
    from kdtree_numba.attention import MlaAttentionPlan, plan
    rng = np.random.default_rng(11)
    prob = kimi_problem(rng, prefix, n, _visible(rng, kind, len(prefix), n))
    outs = {}
    for layout in (plan.BF16_VARIANT,) + BF16_LAYOUT_NAMES:
        monkeypatch.setitem(plan.BF16_LAYOUTS, layout, _dev_bf16_layouts().get(layout, {}))
        monkeypatch.setattr(plan, "BF16_LAYOUT", layout)
        p = MlaAttentionPlan(len(prefix), n, H, R, DR, prob["ckv"].shape[1], bf16_cache=True)
        outs[layout] = p(**prob, causal=kind == "causal").copy_to_host()
    for layout in BF16_LAYOUT_NAMES:
        assert outs[layout].tobytes() == outs[plan.BF16_VARIANT].tobytes(), layout
    sub = {k: (v[:2] if k in ("q_abs", "q_pe", "ckv", "kpe", "prefix_len", "visible") else v)
           for k, v in prob.items()}
    err = np.abs(outs[plan.BF16_VARIANT][:2] - ref.mla_attention(**sub)).max()
    assert err <= ref.bf16_error_bound(**sub), err

"""W4A16 routed experts on the numba backend (issue 39): the int4 expert kernels against the
float64 reference (dequantise, then the matmul) at the derived bound of tests/w4a16_cases.py,
their batch invariance, the registry's numba entry (packed on the device, never widened), and
a tiny model with int4 experts giving the reference backend's tokens (AR and DDTree).

Tiny shapes (each simulated thread costs ~120 us): CI runs them in the simulator, and they run
as they are on a GPU (e.g. under compute-sanitizer); the Kimi widths are
tests/test_w4a16_gpu.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import reference.layers as ref
from formats.int4_group import Int4GroupWeight
from kdtree_numba import compat
from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import QUANTIZABLE, BundleError, random_weights, size_config
from kdtree_numba.compat import cuda, kernel, to_device
from kdtree_numba.layers.skinny import RING_WORDS, int4_chunks, make_accumulate
from kdtree_numba.layers.workspace import Int4Experts, int4_experts, int4_load_kind
from kdtree_numba.model import Model
from kdtree_numba.weights import load_weight
from w4a16_cases import BF16, g_int4, int4_case, moe_bound

@pytest.fixture(scope="module")
def layers():
    if not compat.kernels_runnable():
        pytest.skip("numba kernels need a GPU or NUMBA_ENABLE_CUDASIM=1")
    import kdtree_numba.layers as layers
    return layers


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def run(layers, case, **kw):
    h, idx, wt, gu, dn, sgu, sdn = case
    return host(layers.moe_ffn(h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn, **kw))


def check(got, case):
    h, idx, wt, gu, dn, sgu, sdn = case
    want = ref.moe_ffn(*case)
    bound = moe_bound(h, idx, wt, lambda e: (gu[e].dequantize(), dn[e].dequantize()),
                      None if sgu is None else (ref.as_float64(sgu), ref.as_float64(sdn)))
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, worst ratio {(err / bound).max():.3g}"
    assert np.abs(want).max() > 0.1          # not a vacuous comparison


@pytest.mark.parametrize("m, d, inter, group, kinds", [
    (1, 64, 32, 32, ("i4", "i4")),        # decode: 16-byte chunks of 32 weights, one scale
    (2, 64, 32, 16, ("i4", "i4")),        # two scales a chunk
    (2, 40, 24, 8, ("i4s", "i4s")),       # rows not in whole chunks: word loads, 4 scales
], ids=["decode-g32", "g16", "scalar-g8"])
def test_int4_experts_match_the_reference(layers, m, d, inter, group, kinds):
    case = int4_case(np.random.default_rng(40 + group), m, d, 5, inter, 2, group)
    h, _, _, gu, dn = case[:5]
    # the kinds moe_ffn picks from the device arrays it runs on (alignment is an address's)
    hd, gud, dnd = to_device(h), int4_experts(gu).on_device(), int4_experts(dn).on_device()
    assert (int4_load_kind(d, hd, gud), int4_load_kind(inter, hd, dnd)) == kinds
    check(run(layers, case), case)


def test_grouped_rows_stream_popular_experts_in_chunks_and_are_batch_invariant(layers):
    """A verify-sized call (more rows than SKINNY_MAX_M: 'auto' stays on the int4 kernels,
    where bf16 experts would go tiled): expert 3 holds every token, more than one mt chunk of its token list.  A row
    alone gives its batch result bit for bit (the summation order is the weight shape's)."""
    m = layers.SKINNY_MAX_M + 1
    rng = np.random.default_rng(41)
    case = list(int4_case(rng, m, 32, 6, 16, 2, 16, shared=False))
    case[1] = np.sort(np.stack([[3, e] for e in rng.choice([0, 1, 2, 4, 5], m)]),
                      axis=1).astype(np.int32)
    got = run(layers, case)
    check(got, case)
    # "tensor-cores" (the batch-invariant setting) runs int4 experts on the same kernels
    assert np.array_equal(run(layers, case, method="tensor-cores"), got)
    one = run(layers, [case[0][-1:], case[1][-1:], case[2][-1:], *case[3:]])
    assert np.array_equal(one[0], got[-1])


@pytest.mark.slow   # ~5 s: tests/test_shared_in_experts.py checks a row's bits with the shared
#                     expert in the routed launches (this path) in CI
def test_with_a_shared_expert_tensor_cores_keeps_a_rows_bits(layers):
    """With a bf16 shared expert too, "tensor-cores" gives a verify-sized call's row the bits
    it gets alone: the shared expert's linear streams its weights at every M as the int4
    kernels do (under "auto" it goes tiled above SKINNY_MAX_M, as beside bf16 experts; on
    the H100 the last bits then moved at 33 and 65 rows)."""
    m = layers.SKINNY_MAX_M + 1
    case = list(int4_case(np.random.default_rng(43), m, 32, 6, 16, 2, 16, shared=True))
    got = run(layers, case, method="tensor-cores")
    check(got, case)
    one = run(layers, [case[0][-1:], case[1][-1:], case[2][-1:], *case[3:]],
              method="tensor-cores")
    assert np.array_equal(one[0], got[-1])


def _skinny_pair(**kw):
    """(gate_up, down) SkinnyConfigs of the int4 expert kernels: one x row, 4 outputs (8
    weight rows) a gate_up block, 8 a down block, 32 threads, and ``kw``."""
    from kdtree_numba.layers.skinny import SkinnyConfig
    kw = {"mt": 1, "threads": 32, "unroll": 1, **kw}
    return SkinnyConfig(rows=4, **kw), SkinnyConfig(rows=8, **kw)


def test_gemv_variants_give_the_default_bits(layers):
    """The decode GEMV's bench variants (tools/bench_layers.py, "int4" M = 1): N tiles one
    after another in a block (span 3 over 8 and 5 tiles: a short last span), the L2 bulk
    prefetch of each tile's rows (alone and one tile ahead), two chunks in flight a row, a
    register cap (the simulator ignores it): each gives the bits of the plain kernel of the
    same threads (same products, same order), which is within the bound, as is moe_ffn's
    own pick (rows do not move a bit either).  Top-1 routing: each (token, expert) pair runs
    the same GEMV blocks, and a second pair only doubles the simulated threads."""
    case = int4_case(np.random.default_rng(44), 1, 64, 5, 32, 1, 32)
    ws = layers.Workspace()
    base = run(layers, case, configs=_skinny_pair(), workspace=ws)
    check(base, case)
    assert np.array_equal(run(layers, case), base)
    for kw in (dict(span=3), dict(prefetch=True), dict(prefetch=True, span=3),
               dict(unroll=2, max_registers=144)):
        for buf in ws._buffers.values():    # NaN where an output the variant skips stays
            if np.dtype(buf.dtype).kind == "f":
                buf.copy_to_device(np.full(buf.shape, np.nan, buf.dtype))
        got = run(layers, case, configs=_skinny_pair(**kw), workspace=ws)
        assert np.array_equal(got, base), kw


def test_gemv_ring_and_unpack_variants(layers):
    """The decode GEMV's session-38 variants (tools/bench_layers.py INT4_GEMV_VARIANTS) under
    each unpacking, the default's denormal one (since run 167) and the magic number's: the
    two give other bits, each within the bound; the cp.async ring around either (stages 2,
    and 4 at gate_up) gives its plain kernel's bits, as does the default's ring with half the
    rows a block.  I = 64: both GEMMs have an even number of scales a row, so both take the
    ring (int4_ring_ok).  Top-1 routing: each (token, expert) pair runs the same GEMV blocks,
    and a second pair only doubles the simulated threads."""
    case = int4_case(np.random.default_rng(45), 1, 64, 5, 64, 1, 32, shared=False)
    bits = {}
    for unpack in ("denormal", "magic"):
        bits[unpack] = base = run(layers, case, configs=_skinny_pair(unpack=unpack))
        check(base, case)
        for gate_up_kw, down_kw in ((dict(stages=2), dict(stages=2)),
                                    (dict(stages=4), dict(stages=2))):
            pair = (_skinny_pair(unpack=unpack, **gate_up_kw)[0],
                    _skinny_pair(unpack=unpack, **down_kw)[1])
            assert np.array_equal(run(layers, case, configs=pair), base), (unpack, gate_up_kw)
    # the default is the denormal unpacking (the config itself: bits["denormal"] ran the
    # kernel of that very config), with half the rows a block its bits too
    assert _skinny_pair() == _skinny_pair(unpack="denormal")
    half = tuple(dataclasses.replace(c, rows=c.rows // 2) for c in _skinny_pair(stages=2))
    assert np.array_equal(run(layers, case, configs=half), bits["denormal"])
    assert not np.array_equal(bits["denormal"], bits["magic"])    # two unpackings ran


# the ring's 16-byte cp.async needs 16-byte alignment on a GPU (the simulator rejects one)
RING_ALIGN = None if compat.SIMULATOR else 16


def _two_row_kernel(threads, group, stages, unpack):
    """A one-block kernel running make_accumulate's int4 loop over weight rows 0 and 1 and x
    row 0, each thread's two partial sums written to out[t] (no block reduction)."""
    accumulate = make_accumulate(1, 2, threads, 1, "i4", group, stages, unpack)
    ring_len = max(1, stages * 2 * threads * RING_WORDS)

    @kernel
    def two_rows(x, words, scale, c1, out):
        ring = cuda.shared.array(ring_len, np.uint32, alignment=RING_ALIGN)
        xrows = cuda.local.array(1, np.int32)
        wrows = cuda.local.array(2, np.int32)
        acc = cuda.local.array(2, np.float32)
        xrows[0], wrows[0], wrows[1] = 0, 0, 1
        acc[0], acc[1] = np.float32(0.0), np.float32(0.0)
        accumulate(x, xrows, words, wrows, 0, c1, acc, scale, ring)
        t = cuda.threadIdx.x
        out[t, 0], out[t, 1] = acc[0], acc[1]
    return two_rows


@pytest.mark.parametrize("stages, unpack", [(2, "magic"), (3, "magic"), (5, "magic"),
                                            (0, "denormal"), (3, "denormal")])
def test_int4_accumulate_ring_and_denormal_rows(layers, stages, unpack):
    """The int4 accumulate loop alone, one block of 32 threads over a row of 5 chunks a
    thread (the ring's slots wrap around, its last trips stage nothing): each thread's
    partial sums are the plain loop's bit for bit with the ring, and with the denormal
    unpacking within the bound g4(K) sum |x||w| of the float64 dot; a row of q = 0 gives 0
    exactly (the offset's correction cancels bit for bit)."""
    k, group, threads = 32 * 32 * 5, 32, 32
    rng = np.random.default_rng(46)
    q = rng.integers(-8, 8, (2, k)).astype(np.int8)
    q[1] = 0
    scale = rng.uniform(0.04, 0.1, (2, k // group)).astype(BF16)
    w = Int4GroupWeight.from_values(q, scale, group)
    ex = int4_experts(Int4GroupWeight.from_values(q[None], scale[None], group))
    x = rng.standard_normal((1, k)).astype(np.float32) * 3

    xd, words, scales = (to_device(np.ascontiguousarray(a)) for a in (x, ex.words[0],
                                                                      ex.scale[0]))

    def partials(n_stages, how):      # device arrays: a GPU runs the test as it is
        out = to_device(np.zeros((threads, 2), np.float32))
        _two_row_kernel(threads, group, n_stages, how)[1, threads](xd, words, scales,
                                                                   int4_chunks(k), out)
        return host(out)
    got = partials(stages, unpack)
    if unpack == "magic":
        assert np.array_equal(got, partials(0, "magic"))
    want = w.dequantize() @ x[0].astype(np.float64)
    bound = g_int4(k) * (np.abs(w.dequantize()) @ np.abs(x[0].astype(np.float64)))
    assert np.all(np.abs(got.astype(np.float64).sum(0) - want) <= bound + 1e-30)
    assert np.abs(want[0]) > 1 and np.all(got[:, 1] == 0)


def test_int4_experts_refuse_what_the_kernels_do_not_take(layers):
    rng = np.random.default_rng(42)
    h, idx, wt, gu, dn, _, _ = int4_case(rng, 2, 32, 4, 16, 2, 16, shared=False)
    with pytest.raises(ValueError, match="takes bf16 experts"):
        layers.moe_ffn(h, idx, wt, int4_experts(gu), int4_experts(dn), method="mma")
    with pytest.raises(TypeError, match="Int4Experts"):
        layers.moe_ffn(h, idx, wt, gu, dn)
    odd = Int4GroupWeight.quantize(rng.standard_normal((2, 4, 36)), 4)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        int4_experts(odd)
    g24 = Int4GroupWeight.quantize(rng.standard_normal((2, 4, 48)), 24)
    with pytest.raises(ValueError, match="group sizes 8, 16 and multiples of 32, not 24"):
        int4_experts(g24)
    with pytest.raises(BundleError, match="^layer/experts/down_proj: the W4A16 kernels take "
                                          "group sizes"):
        load_weight(make_backend("numba"), "layer/experts/down_proj", g24, "experts")
    with pytest.raises(ValueError, match="int4 group size 24"):
        make_accumulate(1, 2, 32, 1, "i4", 24)


def test_int4_words_are_the_packed_bytes():
    """Weight k of a row is nibble k % 8 of word k // 8 (lowest first), a two's complement q:
    decoded here bit by bit from the words the kernels read."""
    rng = np.random.default_rng(43)
    w = Int4GroupWeight.from_values(rng.integers(-8, 8, (2, 3, 16)), np.ones((2, 3, 1)), 16)
    words = int4_experts(w).words
    assert words.dtype == np.uint32 and words.shape == (2, 3, 2)
    nib = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    q = np.where(nib >= 8, nib.astype(np.int64) - 16, nib).reshape(2, 3, 16)
    assert np.array_equal(q, w.values())


# ----------------------------------------------------------------------------- the model

def _one_moe_layer_config():
    return size_config("tiny", num_hidden_layers=1, first_k_dense_replace=0, vocab_size=32,
                       hidden_size=16, intermediate_size=16, moe_intermediate_size=16,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=2,
                       n_routed_experts=4, n_group=2, topk_group=1)


def _int4_weights(cfg, group):
    return {k: Int4GroupWeight.quantize(v, group) if k.endswith(QUANTIZABLE) else v
            for k, v in random_weights(cfg, 0)}


@pytest.mark.parametrize("source", ["weights", "bundle"])
def test_numba_model_holds_int4_experts_packed(layers, tmp_path, source):
    """Issue 39's rule: no path keeps a bf16 or int8 copy of an INT4 expert.  The model holds
    each expert tensor as the packed words and the scales, exactly the stored weight's bytes
    (4.5 bits a weight at group 32), and nothing else of it: from weights in memory and from
    a bundle read through its memory map."""
    from kdtree_numba.bundle import write_bundle
    cfg = size_config("tiny")
    weights = _int4_weights(cfg, 32)
    if source == "bundle":
        write_bundle(tmp_path / "q.kdtr", cfg, weights, dtype="bfloat16")
        model = Model.load(tmp_path / "q.kdtr", "numba", verify=False)
    else:
        model = Model(cfg, weights, "numba")
    for j, lw in enumerate(model.layers):
        if cfg.is_dense_layer(j):
            continue
        for attr, name in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            kept, stored = getattr(lw, attr), weights[f"model/layers/{j}/mlp/experts/{name}"]
            assert isinstance(kept, Int4Experts)
            assert kept.words.dtype == np.uint32 and kept.scale.dtype == np.uint16
            assert kept.nbytes == stored.nbytes == stored.size * 4.5 / 8
            assert kept.shape == stored.shape
            words = kept.words.get() if hasattr(kept.words, "get") else kept.words  # CuPy
            assert np.array_equal(np.asarray(words).view(np.uint8), stored.packed)


def test_int4_model_gives_the_reference_backends_tokens(layers):
    """One MoE layer with int4 experts (group 8: the down projection's 16 inputs run the word
    loads) on the numba kernels: logits within float32 of the reference's, AR's tokens, and a
    DDTree generation (prefill + one verify round) equal to reference AR.  ~13 s in the
    simulator; the oracle drafter drafts with the numba model (on a GPU the round needs its
    device logits: run 142 failed with the reference model's host arrays)."""
    from kdtree_numba.drafter import NoisyOracleDrafter
    from kdtree_numba.engine import generate
    cfg = _one_moe_layer_config()
    weights = _int4_weights(cfg, 8)
    ref_model, sim = Model(cfg, weights, "reference"), Model(cfg, weights, "numba")
    seq = [3, 9, 27, 17]
    # float32 kernels vs the float64 reference, O(1) logits (measured ~1e-6)
    np.testing.assert_allclose(sim.backend.to_host(sim.score(seq)), ref_model.score(seq),
                               rtol=0, atol=1e-4)
    want = generate(ref_model, [seq], 3).tokens
    assert generate(sim, [seq], 3).tokens == want
    dd = generate(sim, [seq], 3, method="ddtree", budget=2,
                  drafter=NoisyOracleDrafter(sim, 2, agreement=1.0, sharpness=8.0))
    assert dd.tokens == want and dd.stats.rounds == 1

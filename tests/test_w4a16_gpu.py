"""W4A16 routed experts (issue 39) on a real GPU, marked ``gpu``: the int4 expert kernels at
Kimi-K2's widths (D 7168, expert intermediate 2048, 384 experts, top-8, group 32, a bf16
shared expert) against the float64 reference at tests/w4a16_cases.py's derived bound; the
device bytes a model holds for int4 experts; a tiny int4 model's tokens on the GPU (AR the
reference backend's, DDTree AR's, both GEMM settings).

    python3 -m pytest -q -m gpu tests/test_w4a16_gpu.py        (~2-3 min on an H100)

The experts are drawn as packed words on the device (device_weights.random_int4_experts);
the reference dequantises, on the host in float64, only the experts a case's routing uses.
"""
from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import reference.layers as ref
from formats.int4_group import Int4GroupWeight
from test_layers_gpu import cp, layers  # noqa: F401 (the fixtures)
from w4a16_cases import bench_layers, moe_bound

pytestmark = pytest.mark.gpu
D, IM, E, TOP_K, G = 7168, 2048, 384, 8, 32


@pytest.fixture(scope="module")
def kimi_experts(cp):
    """384 int4 experts and a bf16 shared expert at Kimi widths, on the device (8.4 GB)."""
    from kdtree_numba.backends import bf16_bits
    from kdtree_numba.device_weights import random_int4_experts
    gate_up = random_int4_experts(cp, (E, 2 * IM, D), 1.2 / np.sqrt(D), 1, G)
    down = random_int4_experts(cp, (E, D, IM), 1.2 / np.sqrt(IM), 3, G)
    rs = cp.random.RandomState(5)
    sgu = bf16_bits(cp, rs.standard_normal((2 * IM, D), dtype=cp.float32) * 0.014)
    sdn = bf16_bits(cp, rs.standard_normal((D, IM), dtype=cp.float32) * 0.026)
    yield gate_up, down, sgu, sdn
    del gate_up, down
    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def host_expert(cp, w, e) -> Int4GroupWeight:
    """Expert e of device Int4Experts as the format's host weight (what a bundle holds)."""
    return Int4GroupWeight(cp.asnumpy(w.words[e]).view(np.uint8),
                           cp.asnumpy(w.scale[e]).view(ml_dtypes.bfloat16), w.group_size)


def expert_loader(cp, gate_up, down):
    """``expert(e)`` -> expert e's (gate_up, down) dequantised in float64 on the host, each
    made once."""
    cache = {}

    def expert(e):
        if e not in cache:
            cache[e] = (host_expert(cp, gate_up, e).dequantize(),
                        host_expert(cp, down, e).dequantize())
        return cache[e]
    return expert


def reference(cp, h, idx, wt, gate_up, down, sgu, sdn, expert=None):
    """reference.moe_ffn, one used expert at a time (its own float64 dequantisation: the
    whole layer would be 100+ GB of float64; ``expert``: an :func:`expert_loader` to share),
    plus the shared expert; and the bound."""
    def bf16(a):
        return cp.asnumpy(a).view(ml_dtypes.bfloat16)
    out = ref.moe_ffn(h, np.zeros((len(h), 1), np.int32), np.ones((len(h), 1), np.float32),
                      bf16(sgu)[None], bf16(sdn)[None])
    expert = expert or expert_loader(cp, gate_up, down)
    for e in np.unique(idx):
        rows, cols = np.nonzero(idx == e)
        gu, dn = expert(int(e))
        out[rows] += ref.moe_ffn(h[rows], np.zeros((rows.size, 1), np.int32),
                                 wt[rows, cols][:, None].astype(np.float32), gu[None],
                                 dn[None])
    shared = (ref.as_float64(bf16(sgu)), ref.as_float64(bf16(sdn)))
    return out, moe_bound(h, idx, wt, expert, shared)


@pytest.mark.parametrize("m, pool", [(1, E), (3, E), (33, 24), (65, 24)],
                         ids=["decode-M1", "M3", "verify-M33", "verify-M65"])
def test_int4_moe_kimi_widths(cp, layers, kimi_experts, m, pool, monkeypatch):
    """M = 1: one token's 8 routed experts (the decode GEMV); 33 / 65: a verify's rows, their
    routing drawn from ``pool`` experts so that several hold many tokens (more than one mt
    chunk) and the float64 reference stays affordable.  A row alone gives its batch bits
    under "tensor-cores" with KDTREE_INT4_MMA=0 (the CUDA-core int4 kernels at every M, the
    shared expert's linear streaming its weights at every M too; under "auto" that linear
    goes tiled above 16 rows, as for bf16 experts, and run 141 saw the last bits move; the
    tensor-core kernel "tensor-cores" runs by default: tests/test_moe_int4_mma.py)."""
    monkeypatch.setenv("KDTREE_INT4_MMA", "0")
    rng = np.random.default_rng(m)
    experts = rng.choice(E, pool, replace=False)
    idx = np.sort(np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (m, TOP_K)).astype(np.float32)
    h = rng.standard_normal((m, D)).astype(np.float32)
    got = cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts,
                                               method="tensor-cores")))
    want, bound = reference(cp, h, idx, wt, *kimi_experts)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, ratio {(err / bound).max():.3g}"
    assert np.abs(want).max() > 1e-2
    alone = cp.asnumpy(cp.asarray(layers.moe_ffn(h[-1:], idx[-1:], wt[-1:], *kimi_experts,
                                                 method="tensor-cores")))
    assert np.array_equal(alone[0], got[-1])


@pytest.mark.parametrize("m", [1, 9], ids=["decode-M1", "verify-M9"])
def test_int4_moe_kimi_widths_shared_in_experts(cp, layers, kimi_experts, m, monkeypatch):
    """``KDTREE_SHARED_IN_EXPERTS`` (tests/test_shared_in_experts.py) under "auto": one token
    and a 9-row verify (its routing from 16 experts, so that the float64 reference stays
    affordable) within the float64 reference's bound, the last row alone its batch bits."""
    monkeypatch.setenv("KDTREE_SHARED_IN_EXPERTS", "1")
    rng = np.random.default_rng(m)
    pool = rng.choice(E, 16, replace=False)
    idx = np.sort(np.stack([rng.choice(pool, TOP_K, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (m, TOP_K)).astype(np.float32)
    h = rng.standard_normal((m, D)).astype(np.float32)
    got = cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts)))
    want, bound = reference(cp, h, idx, wt, *kimi_experts)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"M={m}: ratio {(err / bound).max():.3g}"
    alone = cp.asnumpy(cp.asarray(layers.moe_ffn(h[-1:], idx[-1:], wt[-1:], *kimi_experts)))
    assert np.array_equal(alone[0], got[-1])


@pytest.mark.parametrize("m", [1, 9, 16])
def test_int4_moe_kimi_widths_combine_in_down(cp, layers, kimi_experts, m, monkeypatch):
    """``KDTREE_COMBINE_IN_DOWN`` (tests/test_combine_in_down.py) under "auto" at Kimi widths
    (the real launch's blocks, tiles and arrivals): the switch off's bits, three calls in a
    row on one workspace (each leaves its counters at 0 for the next)."""
    rng = np.random.default_rng(m)
    idx = np.sort(np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (m, TOP_K)).astype(np.float32)
    h = rng.standard_normal((m, D)).astype(np.float32)
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "0")
    want = cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts)))
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "1")
    ws = layers.Workspace()
    for _ in range(3):
        got = cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts, workspace=ws)))
        assert got.tobytes() == want.tobytes(), m


@pytest.mark.parametrize("m", [1, 8])
def test_int4_moe_kimi_widths_group_in_experts(cp, layers, kimi_experts, m, monkeypatch):
    """``KDTREE_GROUP_IN_EXPERTS`` (tests/test_group_in_experts.py) under "auto" at Kimi widths
    (8 and 64 entries: the bound), with the combine in the down launch and without: the
    grouping launch's bits, a routing with an invalid entry too, three calls a workspace."""
    rng = np.random.default_rng(40 + m)
    idx = np.sort(np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(m)]),
                  axis=1).astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (m, TOP_K)).astype(np.float32)
    h = rng.standard_normal((m, D)).astype(np.float32)
    for routing in (idx, np.where(np.arange(TOP_K) == 3, -1, idx).astype(np.int32)):
        monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "0")
        monkeypatch.setenv("KDTREE_GROUP_IN_EXPERTS", "0")
        want = cp.asnumpy(cp.asarray(layers.moe_ffn(h, routing, wt, *kimi_experts)))
        monkeypatch.setenv("KDTREE_GROUP_IN_EXPERTS", "1")
        for combine in ("0", "1"):
            monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", combine)
            ws = layers.Workspace()
            for _ in range(3):
                got = cp.asnumpy(cp.asarray(layers.moe_ffn(h, routing, wt, *kimi_experts,
                                                           workspace=ws)))
                assert got.tobytes() == want.tobytes(), (m, combine)


@pytest.mark.parametrize("variant", [v[0] for v in bench_layers().INT4_GEMV_VARIANTS])
def test_gemv_variants_kimi_widths(cp, layers, kimi_experts, variant):
    """One token at Kimi widths through each decode-GEMV variant tools/bench_layers.py times
    (INT4_GEMV_VARIANTS): the default's bits where the variant keeps its threads and the
    unpacking (same products, same order), else within the bound of the float64
    reference.  Run it before
    the bench: a variant that faulted there (the L2 bulk prefetch is real only on a GPU)
    would end the bench's CUDA context and every row after it."""
    import dataclasses
    from kdtree_numba.layers.moe_shapes import expert_config
    rng = np.random.default_rng(7)
    idx = np.sort(rng.choice(E, TOP_K, replace=False))[None].astype(np.int32)
    wt = rng.uniform(0.05, 0.5, (1, TOP_K)).astype(np.float32)
    h = rng.standard_normal((1, D)).astype(np.float32)
    _, gate_up_kw, down_kw = next(v for v in bench_layers().INT4_GEMV_VARIANTS
                                  if v[0] == variant)
    picked = (expert_config(1, TOP_K, E, D, True, True),
              expert_config(1, TOP_K, E, IM, False, True))
    pair = (dataclasses.replace(picked[0], **gate_up_kw),
            dataclasses.replace(picked[1], **down_kw))

    def run(**kw):
        return cp.asnumpy(cp.asarray(layers.moe_ffn(h, idx, wt, *kimi_experts, **kw)))
    got = run(configs=pair)
    if all(p.threads == c.threads and p.unpack == c.unpack for p, c in zip(picked, pair)):
        assert np.array_equal(got, run())
    else:
        want, bound = reference(cp, h, idx, wt, *kimi_experts)
        assert np.all(np.abs(got - want) <= bound)
        assert np.abs(want).max() > 1e-2


def test_model_holds_int4_experts_packed_on_the_device(cp):
    """No path materialises a bf16 or int8 copy of an INT4 expert: a model with Kimi-width
    int4 experts (one MoE layer of 384) holds the packed words and scales on the device, and
    the memory pool grew by their bytes plus the bf16 rest (a bf16 copy of the experts would
    be 33.8 GB more, an int8 one 16.9 GB)."""
    from kdtree_numba.config import weight_shapes
    from kdtree_numba.device_weights import kimi_k2_slice_config, random_model
    from kdtree_numba.layers.workspace import Int4Experts
    cfg = kimi_k2_slice_config(num_hidden_layers=2, vocab_size=1024)
    pool = cp.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    before = pool.used_bytes()
    model = random_model(cfg, "numba", experts="int4")
    held = pool.used_bytes() - before
    lw = model.layers[1]
    expert_weights = 0
    for w, shape in ((lw.gate_up, (E, 2 * IM, D)), (lw.down, (E, D, IM))):
        assert isinstance(w, Int4Experts) and isinstance(w.words, cp.ndarray)
        assert w.shape == shape and w.words.dtype == cp.uint32
        assert w.nbytes == np.prod(shape) * (0.5 + 2 / G)
        expert_weights += np.prod(shape)
    rest = sum(int(np.prod(s)) for n, s in weight_shapes(cfg).items() if "/experts/" not in n)
    # the rest is bf16, a few float32 copies (router, kv_b_proj) and the fused gate/up copies
    assert held <= lw.gate_up.nbytes + lw.down.nbytes + 4 * rest + (256 << 20), held
    assert held < lw.gate_up.nbytes + lw.down.nbytes + expert_weights   # not even int8
    del model
    gc.collect()
    pool.free_all_blocks()


@pytest.mark.parametrize("gemm", ["cuda-cores", "tensor-cores"])
def test_int4_model_tokens_on_the_gpu(gemm):
    """A tiny model with int4 experts (group 16) on the GPU: on CUDA cores its logits within
    float32 of the reference backend's and its AR tokens the reference's; under both GEMM
    settings DDTree's greedy tokens equal AR's."""
    from kdtree_numba.backends import make_backend
    from kdtree_numba.bundle import QUANTIZABLE, random_weights, size_config
    from kdtree_numba.drafter import NoisyOracleDrafter
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    cfg = size_config("tiny")
    weights = {k: Int4GroupWeight.quantize(v, 16) if k.endswith(QUANTIZABLE) else v
               for k, v in random_weights(cfg, 4)}
    gpu = Model(cfg, weights, make_backend("numba", gemm=gemm))
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7]]
    ar = generate(gpu, prompts, 20)
    if gemm == "cuda-cores":
        ref_model = Model(cfg, weights, "reference")
        seq = np.random.default_rng(1).integers(0, cfg.vocab_size, 24)
        np.testing.assert_allclose(gpu.score(seq), ref_model.score(seq), rtol=0, atol=1e-4)
        assert ar.tokens == generate(ref_model, prompts, 20).tokens
    for budget in (8, 32):
        dd = generate(gpu, prompts, 20, method="ddtree", budget=budget,
                      drafter=NoisyOracleDrafter(gpu, 6, agreement=0.7, seed=2, sharpness=3.0))
        assert dd.tokens == ar.tokens, budget

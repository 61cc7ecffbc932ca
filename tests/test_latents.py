"""An MLA layer's norms and ropes between its projections, fused (kdtree_numba/layers/latents.py)
against the reference (reference/layers/latents.py) and, bit for bit, against the separate
norm, rope and copy launches they replace; and a model gives the same logits with them or
without (``KDTREE_FUSED_LATENTS``)."""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import reference.layers as rl
from kdtree_numba import layers as nl
from kdtree_numba.backends import LatentsByParts, make_backend
from kdtree_numba.layers.norm import MAX_PER_THREAD, norm_threads

BF16 = ml_dtypes.bfloat16
SPECS = {
    "interleaved": rl.RopeSpec(1e4, 8, True),
    "halves+yarn": rl.RopeSpec(5e4, 8, False, rl.YarnScaling(32.0, 64, 1.0, 1.0, 1.0, 0.5)),
}


def host(a):
    """A numba device array, a CuPy array or a NumPy one, as NumPy."""
    if hasattr(a, "copy_to_host"):
        return a.copy_to_host()
    return a.get() if hasattr(a, "get") else np.asarray(a)


def dev(a):
    """``a`` on the numba backend's device (CuPy on a GPU, NumPy in the simulator), as the
    model's arrays are: the ops by parts run CuPy glue there, which takes no host array."""
    return None if a is None else make_backend("numba").asarray(a)


def _store(fill, shape_c, shape_k, rows):
    """A LatentStore of ``fill`` on the numba backend's device."""
    from kdtree_numba.kvcache import LatentStore
    xp = make_backend("numba").xp
    return LatentStore(dev(np.full(shape_c, fill)), dev(np.full(shape_k, fill)), dev(rows), xp)


def _case(seed, m, q_lora, rank, dr, weight_dtype):
    rng = np.random.default_rng(seed)
    x = (3 * rng.standard_normal((m, q_lora + rank + dr))).astype(np.float32)
    q_norm = rng.uniform(0.5, 1.5, q_lora).astype(weight_dtype) if q_lora else None
    kv_norm = rng.uniform(0.5, 1.5, rank).astype(weight_dtype)
    positions = rng.integers(0, 4000, m).astype(np.int32)
    return x, q_norm, kv_norm, positions


@pytest.fixture(scope="module")
def unfused():
    """The numba backend's ops by parts (what the model ran before the fused kernels)."""
    ops = make_backend("numba").ops      # its own norms and ropes, whatever the switch says
    return (functools.partial(LatentsByParts.mla_latents, ops),
            functools.partial(LatentsByParts.mla_q_split, ops))


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("q_lora, rank, m, dtype", [(12, 16, 3, np.float32), (0, 16, 2, BF16),
                                                    (40, 36, 1, BF16)])
def test_fused_latents_equal_the_parts_bitwise_and_the_reference(spec, q_lora, rank, m, dtype,
                                                                 unfused):
    """Segments narrower and wider than the simulator's 32-thread block, no q LoRA, f32 and
    bf16 norm weights, both rope layouts (YaRN's amplitude included)."""
    spec = SPECS[spec]
    x, q_norm, kv_norm, pos = _case(7, m, q_lora, rank, spec.head_dim, dtype)
    eps = 1e-6
    got = nl.mla_latents(dev(x), q_norm, kv_norm, dev(pos), spec, eps, q_lora=q_lora,
                         rank=rank)
    parts = unfused[0](dev(x), q_norm, kv_norm, dev(pos), spec, eps, q_lora=q_lora, rank=rank)
    want = rl.mla_latents(x, q_norm, kv_norm, pos, spec, eps, q_lora=q_lora, rank=rank)
    assert (got[0] is None) == (q_lora == 0) == (want[0] is None)
    for g, p, w in zip(got, parts, want):
        if w is None:
            continue
        g, p = host(g), host(p)
        assert g.shape == w.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g, p)                 # the same arithmetic
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("spec", list(SPECS))
def test_fused_q_split_equals_the_parts_bitwise_and_the_reference(spec, unfused):
    spec = SPECS[spec]
    rng = np.random.default_rng(3)
    m, heads, dn = 3, 5, 12
    q = (2 * rng.standard_normal((m, heads, dn + spec.head_dim))).astype(np.float32)
    pos = rng.integers(0, 4000, m).astype(np.int32)
    got = [host(a) for a in nl.mla_q_split(dev(q), dev(pos), spec, dn=dn)]
    parts = unfused[1](dev(q), dev(pos), spec, dn=dn)
    want = rl.mla_q_split(q, pos, spec, dn=dn)
    for g, p, w in zip(got, parts, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, host(p))
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], q[:, :, :dn])      # the copy is exact


@pytest.mark.parametrize("store", [np.float32, np.uint16])
def test_fused_latents_write_into_a_cache_store_as_the_parts_do(store, unfused):
    """``into``: c and k_pe go straight to the store's rows (a bf16 cache's bits rounded as
    KVCache.write rounds); the rest of the store is untouched; both return (q_a, None, None)."""
    spec = SPECS["halves+yarn"]
    m, q_lora, rank, dr = 3, 12, 16, spec.head_dim
    x, q_norm, kv_norm, pos = _case(5, m, q_lora, rank, dr, BF16)
    rows = np.array([7, 2, 4], np.int64)
    fill = np.uint16(0xABCD) if store == np.uint16 else np.float32(-7.5)
    got = []
    for fn in (nl.mla_latents, unfused[0]):
        into = _store(store(fill), (9, rank), (9, dr), rows)
        q_a, c, k_pe = fn(dev(x), q_norm, kv_norm, dev(pos), spec, 1e-6, q_lora=q_lora,
                          rank=rank, into=into)
        assert c is None and k_pe is None
        got.append((host(q_a), host(into.c), host(into.k_pe)))
    _, want_c, want_k = rl.mla_latents(x, q_norm, kv_norm, pos, spec, 1e-6, q_lora=q_lora,
                                       rank=rank)
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    c, k_pe = got[0][1], got[0][2]
    untouched = np.setdiff1d(np.arange(9), rows)
    assert (c[untouched] == fill).all() and (k_pe[untouched] == fill).all()
    if store == np.uint16:       # widen the bits: within a bf16 rounding of the reference
        c, k_pe = (np.asarray(a, np.uint32) << 16 for a in (c, k_pe))
        c, k_pe = c.view(np.float32), k_pe.view(np.float32)
    tol = dict(rtol=2 ** -8, atol=1e-6) if store == np.uint16 else dict(rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(c[rows], want_c, **tol)
    np.testing.assert_allclose(k_pe[rows], want_k[:, 0], **tol)


def test_by_parts_latents_call_a_replaced_copys_norms():
    """A profiler's or a counter's ``Ops.replaced`` copy sees the norms and the rope that
    mla_latents and mla_q_split run (methods of the copy, not closures over the original)."""
    ops = make_backend("reference").ops
    calls = []

    def counted(name):
        def fn(*args, **kwargs):
            calls.append(name)
            return getattr(ops, name)(*args, **kwargs)
        return fn
    spy = ops.replaced(rmsnorm=counted("rmsnorm"), rope=counted("rope"))
    spec = SPECS["interleaved"]
    x, q_norm, kv_norm, pos = _case(1, 2, 8, 16, spec.head_dim, np.float32)
    spy.mla_latents(x, q_norm, kv_norm, pos, spec, 1e-6, q_lora=8, rank=16)
    spy.mla_q_split(x[:, :24].reshape(2, 2, 12), pos, spec, dn=4)
    assert calls == ["rmsnorm", "rmsnorm", "rope", "rope"]


@pytest.mark.parametrize("store", [np.float32, np.uint16])
def test_fused_latents_without_a_q_lora_write_a_wide_store_as_the_parts_do(store, unfused):
    """No q LoRA (q_a's placeholder is then the store itself, never written), a kv segment
    wider than the block and not a multiple of it (40 columns, 32 threads), a rope key of
    8 pairs over 32 threads, rows out of order: the store's rows bit for bit the parts'
    (a bf16 cache's bits rounded as ``bf16_bits``, ties included), the rest untouched."""
    from kdtree_numba.backends import bf16_bits
    spec = rl.RopeSpec(1e4, 16, True)
    m, rank, dr = 4, 40, spec.head_dim
    x, _, kv_norm, pos = _case(9, m, 0, rank, dr, np.float32)
    # values on a bf16 tie (the 16 bits dropped are exactly 0x8000): after the norm with a
    # weight of ones most are not ties any more, so the rope's exactly representable inputs
    # at position 0 carry them (cos 1, sin 0: the rotated key is its input)
    ties = (np.arange(1, 1 + m * dr, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    x[:, rank:] = ties.reshape(m, dr)
    pos[:2] = 0
    rows = np.array([5, 0, 9, 3], np.int64)
    fill = np.uint16(0x1234) if store == np.uint16 else np.float32(3.25)
    got = []
    for fn in (nl.mla_latents, unfused[0]):
        into = _store(store(fill), (11, rank), (11, dr), rows)
        q_a, c, k_pe = fn(dev(x), None, kv_norm, dev(pos), spec, 1e-6, q_lora=0, rank=rank,
                          into=into)
        assert q_a is None and c is None and k_pe is None
        got.append((host(into.c), host(into.k_pe)))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)
    _, want_c, want_k = rl.mla_latents(x, None, kv_norm, pos, spec, 1e-6, q_lora=0, rank=rank)
    c, k_pe = got[0]
    if store == np.uint16:
        tied = want_k[:2, 0]                 # exact at position 0: ties to even
        assert ((tied.view(np.uint32) & 0xFFFF) == 0x8000).all()
        np.testing.assert_array_equal(k_pe[rows[:2]], bf16_bits(np, tied))
        assert (k_pe[rows[:2]] % 2 == 0).all()
        want_c, want_k = bf16_bits(np, want_c), bf16_bits(np, want_k[:, 0])
        assert np.abs(c[rows].astype(np.int32) - want_c).max() <= 1       # one bf16 ulp
        assert np.abs(k_pe[rows].astype(np.int32) - want_k).max() <= 1
    else:
        np.testing.assert_allclose(c[rows], want_c, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(k_pe[rows], want_k[:, 0], rtol=2e-6, atol=1e-6)
    untouched = np.setdiff1d(np.arange(11), rows)
    assert (c[untouched] == fill).all() and (k_pe[untouched] == fill).all()


def test_latents_refuse_bad_shapes():
    spec = SPECS["interleaved"]
    x, q_norm, kv_norm, pos = _case(0, 2, 8, 16, 8, np.float32)
    for bad in (dict(q_lora=8, rank=15), dict(q_lora=0, rank=24)):   # widths / q norm given
        with pytest.raises(ValueError, match="mla_latents wants"):
            nl.mla_latents(x, q_norm, kv_norm, pos, spec, 1e-6, **bad)
        with pytest.raises(ValueError, match="mla_latents wants"):
            rl.mla_latents(x, q_norm, kv_norm, pos, spec, 1e-6, **bad)
    with pytest.raises(ValueError, match="mla_latents wants"):
        nl.mla_latents(x, q_norm, kv_norm, pos[:1], spec, 1e-6, q_lora=8, rank=16)
    with pytest.raises(ValueError, match="mla_q_split wants"):
        nl.mla_q_split(x.reshape(2, 1, 32), pos, spec, dn=8)
    rank = MAX_PER_THREAD * norm_threads() + 1       # one column more than a block keeps
    with pytest.raises(ValueError, match="wider than"):
        wide = np.zeros((1, rank + 8), np.float32)
        nl.mla_latents(wide, None, np.ones(rank, np.float32), pos[:1], spec, 1e-6, q_lora=0,
                       rank=rank)


@pytest.mark.parametrize("q_lora, kv_cache", [(True, "float32"), (False, "float32"),
                                              (True, "bfloat16")])
def test_a_model_gives_the_same_logits_fused_or_not(monkeypatch, q_lora, kv_cache):
    """The tiny config's attention (q LoRA, YaRN; at 2 heads), and without a q LoRA (a DFlash
    drafter's): a tree-verify-shaped forward of 3 tokens after 2 cached ones, fused and by
    parts, bit for bit, logits and the cache's latents (a bf16 cache too: the fused kernel's
    own rounding); narrowed: the simulator runs a thread per GPU thread."""
    from kdtree_numba.bundle import random_weights, size_config
    from kdtree_numba.model import ForwardBatch, Model
    # one (dense) layer: the latents are the attention's; the experts would only cost time
    cfg = size_config("tiny", num_hidden_layers=1, hidden_size=16, intermediate_size=16,
                      vocab_size=32, num_attention_heads=2, q_lora_rank=48 if q_lora else None)
    weights = dict(random_weights(cfg, 1))
    outs = []
    for fused in ("0", "1"):
        monkeypatch.setenv("KDTREE_FUSED_LATENTS", fused)
        model = Model(cfg, weights, make_backend("numba"), kv_cache=kv_cache)
        # the switch took: the fused kernels' op, or the parts'
        assert (getattr(model.backend.ops.mla_latents, "__wrapped__", None) is
                nl.mla_latents) == (fused == "1")
        cache = model.new_cache(1, 8)
        cache.advance(2)               # two cached slots (zeros): the keys attention reads
        toks = np.array([[3, 11, 6]], np.int32)
        pos = np.array([[2, 3, 3]], np.int32)
        visible = np.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
        outs.append((model.backend.to_host(model.forward(ForwardBatch(toks, pos, visible),
                                                         cache)),
                     host(cache.c).copy(), host(cache.k_pe).copy()))
    assert np.isfinite(outs[0][0]).all() and outs[0][0].std() > 0
    assert outs[0][1].dtype == (np.uint16 if kv_cache == "bfloat16" else np.float32)
    assert np.any(outs[0][1][:, 0, 2:5] != 0) and not np.any(outs[0][1][:, 0, 5:])
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 65])
@pytest.mark.parametrize("q_lora, rank, dr, heads, dn", [(1536, 512, 64, 64, 128),
                                                        (128, 128, 32, 8, 32)])
def test_gpu_fused_latents_equal_the_parts_bitwise(m, q_lora, rank, dr, heads, dn, unfused):
    """Kimi-K2's widths and the demo model's, a decode and a 64-node verify: the butterfly
    reduction of two sums gives each the bits of the norm kernel's one (gpu/reduce.py)."""
    spec = rl.RopeSpec(5e4, dr, True, rl.YarnScaling(32.0, 4096, 1.0, 1.0, 1.0, 1.0))
    x_host, q_norm, kv_norm, pos_host = _case(11, m, q_lora, rank, dr, BF16)
    be = make_backend("numba")
    x, pos = be.asarray(x_host), be.asarray(pos_host)   # device arrays, as the model's are
    got = nl.mla_latents(x, q_norm, kv_norm, pos, spec, 1e-6, q_lora=q_lora, rank=rank)
    parts = unfused[0](x, q_norm, kv_norm, pos, spec, 1e-6, q_lora=q_lora, rank=rank)
    want = rl.mla_latents(x_host, q_norm, kv_norm, pos_host, spec, 1e-6, q_lora=q_lora,
                          rank=rank)
    for g, p, w in zip(got, parts, want):
        np.testing.assert_array_equal(host(g), host(p))
        np.testing.assert_allclose(host(g), w, rtol=2e-6, atol=1e-6)
    q = be.asarray(np.random.default_rng(2).standard_normal((m, heads, dn + dr))
                   .astype(np.float32))
    for g, p in zip(nl.mla_q_split(q, pos, spec, dn=dn), unfused[1](q, pos, spec, dn=dn)):
        np.testing.assert_array_equal(host(g), host(p))


@pytest.mark.gpu
def test_gpu_demo_pair_gives_the_same_tokens_fused(monkeypatch):
    """The shipped pair, AR and DDTree (host and device rounds), fused and by parts: the
    same tokens (the fused kernels give the parts' bits)."""
    from kdtree_numba import demo
    from kdtree_numba.drafter import load_drafter
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    prompts = [[5, 6, 7, 8, 9, 10], [300, 301, 302]]
    runs = []
    for fused in ("0", "1"):
        monkeypatch.setenv("KDTREE_FUSED_LATENTS", fused)
        target = Model.load(demo.TARGET, make_backend("numba"))
        drafter = load_drafter(str(demo.DRAFTER), target)
        runs.append([generate(target, prompts, 40).tokens]
                    + [generate(target, prompts, 40, method="ddtree", drafter=drafter,
                                budget=8, device_rounds=d).tokens for d in (False, True)])
    assert runs[0] == runs[1]
    assert runs[1][0] == runs[1][1] == runs[1][2]

"""The bf16 latent cache option (``Model(kv_cache="bfloat16")``, ``kdtree-run --kv-cache``):
the cache stores bf16 bits, rounded on write like the bit oracle, at half the bytes; a model
over it is self-consistent (prefill + decode equals scoring the whole sequence, DDTree's
greedy tokens equal AR's, with compaction moving bf16 rows), its logits really differ from
the float32 cache's but stay close; the numba kernels (simulator) agree with the reference
backend over it; bad choices are clear errors.  The GPU run is tests/test_attention_bf16.py
(kernel) and tools/bench_engine.py --kv-cache bfloat16 (engine).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kdtree_numba.backends import bf16_bits, make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.cli import run_main
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.kvcache import KVCache
from kdtree_numba.model import ForwardBatch, Model, causal_mask


def oracle_bits(x) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


# the simulator's model: tiny's structure (a dense layer, then MoE with grouped routing and a
# shared expert) at the widths the kernels' simulated blocks can afford
SIM_WIDTHS = (("vocab_size", 32), ("hidden_size", 16), ("intermediate_size", 16),
              ("moe_intermediate_size", 16), ("q_lora_rank", 16), ("kv_lora_rank", 16),
              ("num_attention_heads", 2), ("n_routed_experts", 4), ("n_group", 2),
              ("topk_group", 1))


@functools.lru_cache(maxsize=None)
def tiny(kv_cache: str, backend: str = "reference", widths: tuple = ()) -> Model:
    cfg = size_config("tiny", num_hidden_layers=2, **dict(widths))
    return Model(cfg, dict(random_weights(cfg, 3)), backend, kv_cache=kv_cache)


def test_bf16_cache_rounds_on_write_and_holds_half_the_bytes():
    be = make_backend("reference")
    f32 = KVCache(be, 2, 2, 8, 16, 8)
    b16 = KVCache(be, 2, 2, 8, 16, 8, dtype="bfloat16")
    assert b16.c.dtype == np.uint16 and b16.k_pe.dtype == np.uint16
    assert 2 * b16.nbytes == f32.nbytes
    rng = np.random.default_rng(0)
    c = (rng.standard_normal((2, 3, 16)) * 30).astype(np.float32)
    c[0, 0, :2] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8]             # ties go to even
    k_pe = rng.standard_normal((2, 3, 8)).astype(np.float32)
    b16.advance([2, 5])                       # the requests hold 2 and 5 tokens
    b16.write(1, c, k_pe)
    assert b16.c[1, 0, 2:5].tobytes() == oracle_bits(c[0]).tobytes()
    assert b16.c[1, 1, 5:8].tobytes() == oracle_bits(c[1]).tobytes()
    assert b16.k_pe[1, 1, 5:8].tobytes() == oracle_bits(k_pe[1]).tobytes()
    assert not b16.c[0].any()                                    # other layers untouched
    assert bf16_bits(np, c).tobytes() == oracle_bits(c).tobytes()


def test_bad_cache_dtypes_are_value_errors():
    be = make_backend("reference")
    with pytest.raises(ValueError, match="KV cache dtype"):
        KVCache(be, 1, 1, 4, 8, 8, dtype="float16")
    cfg = size_config("tiny", num_hidden_layers=2)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        Model(cfg, dict(random_weights(cfg, 3)), "reference", kv_cache="bf16")


def test_prefill_then_decode_equals_scoring_over_a_bf16_cache():
    model = tiny("bfloat16")
    ids = np.array([5, 17, 2, 99, 41, 7])
    want = model.score(ids)
    cache = model.new_cache(1, 16)
    assert cache.dtype == "bfloat16"
    logits = [model.prefill(cache, [ids[:3].tolist()])[0]]      # after position 2
    for i in range(3, len(ids)):                                  # token i at position i
        logits.append(model.decode(cache, ids[i:i + 1])[0])
        cache.advance(1)
    got = np.stack([np.asarray(x, np.float32).reshape(-1) for x in logits])
    np.testing.assert_allclose(got, want[2:], rtol=1e-5, atol=1e-5)


def test_bf16_cache_logits_differ_from_the_float32_caches_but_stay_close():
    ids = np.array([5, 17, 2, 99, 41, 7, 3, 3, 60])
    a, b = tiny("bfloat16").score(ids), tiny("float32").score(ids)
    diff = np.abs(a - b).max()
    assert 0 < diff <= 0.05 * np.abs(b).max(), diff


def test_ddtree_greedy_equals_ar_over_a_bf16_cache_with_compaction():
    model = tiny("bfloat16")
    prompts = [[3, 9, 27], [81, 4]]
    ar = generate(model, prompts, 12, method="ar")
    drafter = NoisyOracleDrafter(model, 4, 0.9, seed=1, sharpness=1.5)  # bushy: rows move
    dd = generate(model, prompts, 12, method="ddtree", drafter=drafter, budget=8)
    assert dd.tokens == ar.tokens
    assert model.generation_cache.dtype == "bfloat16"


def test_numba_kernels_agree_with_the_reference_over_a_bf16_cache(needs_kernels):
    ids = np.array([[5, 17, 2, 29]])
    got, want = (tiny("bfloat16", be, SIM_WIDTHS).forward(
        ForwardBatch(ids, np.arange(4)[None], causal_mask(4), causal=True),
        tiny("bfloat16", be, SIM_WIDTHS).new_cache(1, 8)) for be in ("numba", "reference"))
    got = np.asarray(tiny("bfloat16", "numba", SIM_WIDTHS).backend.to_host(got), np.float32)
    want = np.asarray(want, np.float32)
    # the kernel also rounds its softmax weights to bf16 (2^-8 relative): logits move by a
    # few 1e-3 of their scale, against O(1) for a plumbing error
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_kdtree_run_takes_kv_cache_bfloat16(capsys, monkeypatch):
    import json
    made = []
    load = Model.load.__func__

    def recording_load(cls, *args, **kwargs):
        made.append(load(cls, *args, **kwargs))
        return made[-1]
    monkeypatch.setattr(Model, "load", classmethod(recording_load))
    assert run_main(["--backend", "reference", "--kv-cache", "bfloat16", "--max-new-tokens",
                     "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"][0]) == 4
    assert made[0].kv_cache == "bfloat16" and made[0].generation_cache.dtype == "bfloat16"

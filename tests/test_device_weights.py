"""Random weights built where the model runs (kdtree_numba/device_weights.py) and the
kimi-slice benchmark's roofs (tools/engine_roof.py, tools/bench_engine.py), at tiny widths.

On a GPU the same builder runs on CuPy (kimi-slice in tools/bench_engine.py); here NumPy
draws, and the reference and the numba kernels (simulator) run the model it builds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest

from kdtree_numba.bundle import init_spec, random_weights, size_config
from kdtree_numba.config import weight_shapes
from kdtree_numba.device_weights import (KIMI_SLICE, bf16_bits, kimi_slice_config,
                                         random_device_weights, random_model)
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_engine  # noqa: E402
import engine_roof  # noqa: E402

# kimi-slice's structure (q LoRA, the first layer dense, sigmoid routing, one group, YaRN,
# interleaved rope) at widths a test affords
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, max_position_embeddings=512,
            rope_scaling=dict(KIMI_SLICE["rope_scaling"], original_max_position_embeddings=64))


def tiny_config(**overrides):
    return kimi_slice_config(**dict(TINY, **overrides))


def test_kimi_slice_config_is_kimi_k2_widths():
    cfg = kimi_slice_config()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
            cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == \
        (7168, 64, 1536, 512, 64, 128, 128)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.intermediate_size) == (64, 1, 8, 2048, 18432)
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.vocab_size) == (4, 1, 163840)
    n = sum(int(np.prod(s)) for s in weight_shapes(cfg).values())
    assert 11.5e9 < n < 12e9          # 23.5 GB in bf16: drawn on the device, never the host


def test_bf16_bits_round_like_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 3
    # exact ties (both directions of even), the smallest normal, a subnormal, zeros
    x[:7] = [1.00390625, 1.01171875, -1.00390625, 1.1754944e-38, 1e-40, 0.0, -0.0]
    assert np.array_equal(bf16_bits(np, x), x.astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_weight_with_its_shape_dtype_and_scale(dtype):
    cfg = tiny_config(vocab_size=2048)     # enough embedding values for a tight std
    shapes = weight_shapes(cfg)
    weights = dict(random_device_weights(cfg, np, seed=3, dtype=dtype, chunk=1000))
    assert list(weights) == list(shapes)
    for name, shape in shapes.items():
        w = weights[name]
        assert w.shape == shape, name
        assert np.dtype(w.dtype).name == dtype, name
        v = np.asarray(w, np.float64)
        kind, a, b = init_spec(name, shape)
        if kind == "uniform":
            assert 0.5 <= v.min() and v.max() <= 1.5, name
        elif v.size >= 1000:
            assert abs(v.std() / b - 1) < 0.1 and abs(v.mean()) < 0.1 * b, name
        else:                               # the router bias: E values
            assert np.all(np.abs(v) < 6 * b), name
    # the same scales as a bundle's random weights (other draws: another generator)
    bundle = dict(random_weights(cfg, 3))
    for name in ("model/embed_tokens", "lm_head", "model/layers/1/mlp/experts/gate_up_proj"):
        assert np.asarray(weights[name], np.float64).std() == \
            pytest.approx(bundle[name].std(), rel=0.05), name


def test_chunks_do_not_change_the_values():
    cfg = tiny_config()
    a = dict(random_device_weights(cfg, np, seed=1))
    b = dict(random_device_weights(cfg, np, seed=1, chunk=777))
    assert all(np.array_equal(a[n].view(np.uint16), b[n].view(np.uint16)) for n in a)
    c = dict(random_device_weights(cfg, np, seed=2))
    assert not np.array_equal(a["lm_head"].view(np.uint16), c["lm_head"].view(np.uint16))


def test_the_model_takes_them_as_a_bf16_bundle_gives_them():
    """A host bf16 array per name, as a bf16 bundle's reader returns, and the model widens its
    float32-only weights the same way."""
    cfg = tiny_config()
    weights = dict(random_device_weights(cfg, np, seed=0))
    model = Model(cfg, weights, "reference")
    layer = model.layers[1]
    assert np.array_equal(layer.kv_b, np.asarray(
        weights["model/layers/1/self_attn/kv_b_proj"], np.float64))
    assert np.array_equal(layer.router, np.asarray(weights["model/layers/1/mlp/gate"],
                                                    np.float64))


class _FakeDeviceArray(np.ndarray):
    """A host array that says it lives on a GPU (``__cuda_array_interface__``)."""
    @property
    def __cuda_array_interface__(self):
        return {}


def test_device_arrays_load_as_uploads_of_a_bf16_bundle(monkeypatch):
    """The GPU path without a GPU: a backend that claims one (NumPy as its array module), fed
    (a) the host bf16 arrays a bf16 bundle gives and (b) the same weights as device uint16 bit
    arrays (what CuPy builds): the model holds the same arrays, dtypes included (bf16 as
    uint16 bits, the router, its bias and kv_b_proj widened to float32)."""
    from kdtree_numba.backends import Backend, make_backend
    monkeypatch.setenv("KDTREE_CUDA_GRAPHS", "0")
    cfg = tiny_config()
    host = dict(random_device_weights(cfg, np, seed=0))
    device = {n: w.view(np.uint16).view(_FakeDeviceArray) for n, w in host.items()}

    def gpu():
        return Backend("numba", np, make_backend("reference").ops, on_gpu=True)
    a, b = Model(cfg, host, gpu()), Model(cfg, device, gpu())
    pairs = [(a.embed, b.embed), (a.lm_head, b.lm_head), (a.final_norm, b.final_norm)]
    for la, lb in zip(a.layers, b.layers):
        pairs += [(getattr(la, k), getattr(lb, k)) for k in vars(la)
                  if getattr(la, k) is not None]
        assert [k for k in vars(la) if getattr(la, k) is None] == \
            [k for k in vars(lb) if getattr(lb, k) is None]
    for x, y in pairs:
        assert x.dtype == y.dtype and x.dtype in (np.uint16, np.float32)
        assert np.array_equal(x, y)
    assert a.layers[1].router.dtype == np.float32 and a.layers[1].gate_up.dtype == np.uint16


def test_the_weights_generate_the_same_on_reference_and_numba_kernels(needs_kernels):
    """Two greedy tokens of a model on these weights: the reference backend and the numba
    kernels (the simulator here, the GPU under tools/gpu_suite.sh) agree, and the logits are
    not flat.  (One host draw for both: on a GPU random_model would draw the numba model's
    with CuPy, another stream.)"""
    cfg = tiny_config(num_hidden_layers=2, hidden_size=16, intermediate_size=16,
                      moe_intermediate_size=16, q_lora_rank=16, kv_lora_rank=16,
                      num_attention_heads=2, vocab_size=32,
                      n_routed_experts=4)        # the simulator's time grows with the widths
    weights = dict(random_device_weights(cfg, np, seed=0))
    prompt = [[5, 17]]
    ref = Model(cfg, weights, "reference")
    out_ref = generate(ref, prompt, 2)
    out_numba = generate(Model(cfg, weights, "numba"), prompt, 2)
    assert out_ref.tokens == out_numba.tokens
    assert ref.score(prompt[0]).std(axis=-1).min() > 0.1
    assert random_model(cfg, "reference", seed=0).score(prompt[0]).tolist() == \
        ref.score(prompt[0]).tolist()


@pytest.mark.gpu
def test_cupy_weights_on_the_gpu_are_a_bf16_bundle_uploaded():
    """On the GPU: CuPy's draws (uint16 bf16 bits on the device, rounded as ml_dtypes rounds)
    give the model the arrays a host bf16 bundle of the same values gives it, and its logits
    match the reference's on those values."""
    import cupy
    cfg = tiny_config(num_hidden_layers=2)
    x = cupy.random.default_rng(1).standard_normal(1 << 16, dtype=np.float32) * 3
    assert np.array_equal(cupy.asnumpy(bf16_bits(cupy, x)),
                          cupy.asnumpy(x).astype(ml_dtypes.bfloat16).view(np.uint16))
    device = dict(random_device_weights(cfg, cupy, seed=0, chunk=1000))
    for name, shape in weight_shapes(cfg).items():
        assert isinstance(device[name], cupy.ndarray) and device[name].dtype == np.uint16
        assert device[name].shape == shape, name
    host = {n: cupy.asnumpy(w).view(ml_dtypes.bfloat16) for n, w in device.items()}
    spec = init_spec("lm_head", weight_shapes(cfg)["lm_head"])
    assert abs(np.asarray(host["lm_head"], np.float64).std() / spec[2] - 1) < 0.1
    a, b = Model(cfg, host, "numba"), Model(cfg, device, "numba")
    for la, lb in zip(a.layers, b.layers):
        for k, v in vars(la).items():
            if v is not None:
                assert v.dtype == getattr(lb, k).dtype and bool(cupy.array_equal(
                    v, getattr(lb, k))), k
    seq = np.arange(1, 30)
    want = Model(cfg, host, "reference").score(seq)
    assert np.abs(b.score(seq) - want).max() <= 2e-4 * np.abs(want).max()
    model = random_model(cfg, "numba", seed=0)
    assert isinstance(model.lm_head, cupy.ndarray) and model.lm_head.dtype == np.uint16


# ----------------------------------------------------------------------------- roofs

def test_forward_bytes_hand_computed():
    """2 layers (dense, then MoE with 4 experts of width 3), D 4, V 10, H 1, q_proj, no shared
    expert, bf16 (2 bytes) but kv_b_proj, the router and its bias in float32."""
    cfg = size_config("tiny").replace(
        vocab_size=10, hidden_size=4, intermediate_size=5, moe_intermediate_size=3,
        num_hidden_layers=2, num_attention_heads=1, q_lora_rank=None, kv_lora_rank=2,
        qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2, n_routed_experts=4,
        n_shared_experts=0, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1)
    # per layer: norms 4 + 4, q_proj 4*4, kv_a 4*4, kv_a_norm 2, o_proj 4*2 = 50 elements at 2 B
    # plus kv_b 4*2 = 8 at 4 B
    attention = 2 * 50 + 4 * 8
    dense = 2 * 3 * 5 * 4                      # gate, up, down: 5 x 4 each
    router = 4 * (4 * 4 + 4)                   # gate [4, 4] and bias [4], float32
    expert = 2 * (2 * 3 * 4 + 4 * 3)           # gate_up [6, 4] + down [4, 3]
    final = 2 * 4 + 2 * 10 * 4                 # model/norm, lm_head
    row = 2 * 4                                # one embedding row
    itemsize = engine_roof.engine_itemsize(2)
    for rows, d in ((1, 2), (3, 3), (50, 4)):
        expect = 2 * attention + dense + router + d * expert + final + min(rows, 10) * row
        assert engine_roof.forward_bytes(cfg, rows, [d], itemsize) == expect
    # tied: the embedding is the lm_head, read whole
    tied = cfg.replace(tie_word_embeddings=True)
    assert engine_roof.forward_bytes(tied, 1, [2], itemsize) == \
        2 * attention + dense + router + 2 * expert + 2 * 4 + 10 * row
    with pytest.raises(ValueError, match="MoE layers"):
        engine_roof.forward_bytes(cfg, 1, [2, 2], itemsize)
    # FLOPs: 2 per weight of each matrix a token passes: q_proj 16, kv_a 16, kv_b 8, o_proj 8
    # per layer, dense 60, router 16, lm_head 40, its 2 experts of 36; no embedding, no norms
    per_token = 2 * 48 + 60 + 16 + 40 + 2 * 36
    assert engine_roof.forward_flops(cfg, 3) == 2 * 3 * per_token
    assert engine_roof.forward_flops(tied, 1) == 2 * per_token    # the embedding as lm_head


def test_expected_distinct_experts():
    assert engine_roof.expected_distinct(64, 8, 1) == pytest.approx(8)
    assert engine_roof.expected_distinct(64, 8, 2) == pytest.approx(15)   # 64 (1 - 49/64)
    assert engine_roof.expected_distinct(64, 8, 257) == pytest.approx(64, abs=1e-9)
    cfg = kimi_slice_config()
    assert engine_roof.uniform_distinct(cfg, 1) == pytest.approx([8.0] * 3)


def test_routing_counter_counts_each_forward():
    """AR at batch 1: every decode forward touches exactly k experts per MoE layer; the prefill
    between k and E; one record per forward; the model's ops come back afterwards."""
    cfg = tiny_config()
    model = random_model(cfg, "reference", seed=0)
    ops = model.backend.ops

    class Graphs:            # what the counter sets aside on a GPU (here: the same path)
        captures, replays = 3, 5

        def call(self, *args, **kwargs):
            raise AssertionError("the counter runs every forward eagerly")
    model.graphs = graphs = Graphs()
    with engine_roof.RoutingCounter(model) as counter:
        res = generate(model, [[1, 2, 3, 4, 5, 6]], 4)
    assert model.backend.ops is ops and model.graphs is graphs
    assert (res.stats.graph_captures, res.stats.graph_replays) == (0, 0)
    records = counter.records()
    assert len(records) == 1 + res.stats.rounds
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    assert records[0].rows == 6 and records[0].tokens == 6
    assert all(k <= d <= E for d in records[0].experts) and len(records[0].experts) == 2
    assert all(r.rows == 1 and r.tokens == 1 and r.experts == [k, k] for r in records[1:])


# CI's default run takes the counted experts (the uniform ones and a bf16 cache: ~3 s more)
@pytest.mark.parametrize("count, kv_cache", [("counted", "float32"),
                                             pytest.param("uniform", "bfloat16",
                                                          marks=pytest.mark.slow)])
def test_kimi_slice_rows_end_to_end(count, kv_cache, monkeypatch, tmp_path, capsys):
    """bench_engine's device-size path on a tiny kimi-like config through the reference
    backend: AR and replay DDTree rows at two batches, counted or uniform experts, lossless,
    every roof column filled, the JSON written."""
    monkeypatch.setitem(bench_engine.DEVICE_SIZES, "kimi-slice", tiny_config)
    monkeypatch.setattr(bench_engine, "_SHOWN", set())     # its table's header printed anew
    args = argparse.Namespace(seed=0, dtype="bfloat16", prompt_len=6, budgets=[4],
                              batches=[1, 2], new_tokens=5, agreement=0.9, no_replay=False,
                              expert_count=count, gemm=["cuda-cores"], kv_cache=kv_cache,
                              json=str(tmp_path / f"{count}.json"))
    rows: list = []
    bench_engine.bench_device_size("kimi-slice", args, bench_engine.Budget(600), rows,
                                   backend="reference")
    assert [(r["batch"], r["method"]) for r in rows] == \
        [(1, "ar"), (1, "ddtree/replay"), (2, "ar"), (2, "ddtree/replay")]
    for r in rows:
        assert r["step_roof_ms"] > 0 and r["roof_tokens_per_s"] > 0
        assert r["prefill_ms"] > 0 and r["prefill_roof_ms"] > 0
        assert r["decode_vs_ar"] == pytest.approx(
            r["decode_tokens_per_s"] / next(a["decode_tokens_per_s"] for a in rows
                                            if a["method"] == "ar"
                                            and a["batch"] == r["batch"]))
        assert 1 <= r["distinct_experts"] <= 8
        assert r.get("same_tokens_as_ar", True) is True
        assert r.get("routing_run_same_tokens", True) is True
    assert rows[0]["distinct_experts"] == 2              # batch 1 AR: top-2 of 8
    assert all(r["gemm"] == "cuda-cores" + (" + bf16 cache" if kv_cache == "bfloat16"
                                            else "") for r in rows)
    assert rows[1]["step_rows"] == 5 and rows[3]["step_rows"] == 10
    saved = json.loads((tmp_path / f"{count}.json").read_text())
    assert len(saved["rows"]) == 4
    out = capsys.readouterr().out
    assert "| size | gemm | batch | method |" in out and "AR roof" in out
    assert "| prefill ms (its roof) |" in out and "| vs AR after the prefill |" in out


def test_kimi_slice_auto_budget_row(monkeypatch):
    """``--budgets 2,6,auto``: the auto row picks each round's budget among 2 and 6 (a fresh
    policy per generate, warmed at both first), keeps the budgets it chose and the policy's
    estimates, commits AR's tokens, and its roofs follow the chosen widths: the counted
    routing re-run replays the timed run's budgets, the uniform roofs take one forward of
    budget + 1 rows per round."""
    monkeypatch.setitem(bench_engine.DEVICE_SIZES, "kimi-slice", tiny_config)
    seen = []
    plain = bench_engine.generate

    def spy(model, prompts, n_new, **kw):
        res = plain(model, prompts, n_new, **kw)
        seen.append((kw.get("budget"), list(res.stats.budgets)))
        return res
    monkeypatch.setattr(bench_engine, "generate", spy)
    for count in ("counted", "uniform"):
        seen.clear()
        args = argparse.Namespace(seed=0, dtype="bfloat16", prompt_len=6,
                                  budgets=bench_engine._budgets("2,6,auto"), batches=[1],
                                  new_tokens=9, agreement=0.9, no_replay=False,
                                  expert_count=count, gemm=["cuda-cores"], kv_cache="float32",
                                  json=None)
        rows: list = []
        bench_engine.bench_device_size("kimi-slice", args, bench_engine.Budget(600), rows,
                                       backend="reference")
        assert [r["budget"] for r in rows] == [None, 2, 6, "auto"]
        auto = rows[-1]
        chosen = auto["budgets_chosen"]
        assert set(chosen) <= {2, 6} and sum(chosen.values()) == auto["rounds"] >= 2
        assert auto["budget_auto"]["candidates"] == [2, 6]
        assert auto["auto_policy"] == "fresh per generate"       # what the row says it timed
        assert auto["same_tokens_as_ar"] is True
        assert auto.get("routing_run_same_tokens", True) is True
        policies = [b for b, _ in seen if isinstance(b, bench_engine.AutoBudget)]
        timed = [b for b in policies if not isinstance(b, bench_engine.ReplayedBudgets)]
        assert len({id(b) for b in timed}) == len(timed) >= 2    # a fresh policy per call
        assert all(b.round == len(used) for b, used in seen if b in timed)
        first = next(i for i, (b, _) in enumerate(seen) if b is timed[0])
        # each candidate to its steady state first (no graphs here: two calls each)
        assert [b for b, _ in seen[first - 4:first]] == [2, 2, 6, 6]
        steps = [rows[1], rows[2]]               # the fixed rows' per-round roofs bracket it
        lo, hi = (min(r["step_roof_ms"] for r in steps), max(r["step_roof_ms"] for r in steps))
        assert lo * (1 - 1e-9) <= auto["step_roof_ms"] <= hi * (1 + 1e-9)
        replayed = [(b, used) for b, used in seen if isinstance(b, bench_engine.ReplayedBudgets)]
        if count == "counted":
            assert len(replayed) == 1 and replayed[0][1] == replayed[0][0].sequence
        else:
            assert not replayed


def test_budgets_option_takes_integers_and_auto():
    assert bench_engine._budgets("8, 32,AUTO") == [8, 32, "auto"]
    for bad in ("0", "x", "8,,32", "-4"):
        with pytest.raises(ValueError, match="integer >= 1 or 'auto'"):
            bench_engine._budgets(bad)
    assert bench_engine.auto_policy([8, "auto", 64]).candidates == (8, 64)
    assert bench_engine.auto_policy(["auto"]).candidates == bench_engine.DEFAULT_CANDIDATES


def test_batch_invariance_probe_on_the_host(monkeypatch):
    """tools/probe_batch_invariance.py on a tiny kimi-like model through the reference backend
    (float64 and batch invariant): every op call's verify rows equal the decodes' bit for bit;
    an op made to depend on the number of rows is reported as the first difference, and the
    logits differ too.  The tree case checks the probe's plumbing only: the reference gathers
    a row's visible keys, so it cannot show the slot dependence of the numba attention."""
    import probe_batch_invariance as probe
    monkeypatch.setitem(bench_engine.DEVICE_SIZES, "kimi-slice", tiny_config)
    model = probe.build_model("kimi-slice", "cuda-cores", "reference")
    report = probe.probe(model, n=4, prefix=6)
    assert [e["op"] for e in report[:3]] == ["embedding", "rmsnorm", "linear"]
    assert probe.first_difference(report) is None
    assert not any(e["skipped"] for e in report)
    for seed in (0, 1):       # a scattered path; seed 0's ends before the tree's last node
        tree = probe.probe(model, n=4, prefix=6, seed=seed, batch=2, tree_nodes=12)
        assert len(tree) == len(report) and probe.first_difference(tree) is None
        assert not any(e["skipped"] for e in tree)
    parents, path = probe.scattered_tree(4, 9, np.random.default_rng(1))
    assert path[0] == 0 and list(path) == sorted(path) and len(set(path)) == 4
    assert [parents[i] for i in path[1:]] == list(path[:-1])
    assert all(parents[i] in path and parents[i] < i for i in range(9) if i not in path)
    plain = model.backend.ops.rope

    def rope_by_rows(x, *args, **kwargs):      # M-dependent: 2^-16 M relative
        return plain(x, *args, **kwargs) * (1.0 + 2.0 ** -16 * x.shape[0])
    monkeypatch.setattr(model.backend.ops, "rope", rope_by_rows)
    report = probe.probe(model, n=4, prefix=6)
    first = probe.first_difference(report)
    assert first["op"] == "rope" and first["rows_differ"] == 4
    assert 0 < first["max_abs"] < 1e-3
    assert not report[-1]["equal"]                 # the logits: it reached the output


def test_bench_measures_the_first_call_that_captures_no_graph(monkeypatch):
    """time_generate_batch's steady state: identical calls until one, after the first,
    captures no CUDA graph; that call is the measurement, and the warm-ups are bounded."""
    from types import SimpleNamespace
    for captures, want in (([4, 1, 0, 0], 2), ([4, 0, 0], 1), ([None, None], 1),
                           ([5, 3, 2, 1, 1, 1], bench_engine.MAX_WARMUPS)):
        calls = []

        def fake(model, prompts, n_new, _c=captures, **kw):
            calls.append(kw)
            return SimpleNamespace(stats=SimpleNamespace(graph_captures=_c[len(calls) - 1]),
                                   call=len(calls) - 1)
        monkeypatch.setattr(bench_engine, "generate", fake)
        res = bench_engine.time_generate_batch(None, [[1]], 4, method="ar")
        assert res.call == want and len(calls) == want + 1 and calls[-1] == {"method": "ar"}


# ----------------------------------------------------------------------------- kimi-k2-slice

def test_kimi_k2_slice_is_kimi_with_all_384_experts_in_int4():
    from kdtree_numba.device_weights import kimi_k2_slice_config
    cfg = kimi_k2_slice_config()
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts,
            cfg.num_hidden_layers, cfg.first_k_dense_replace) == (384, 8, 1, 4, 1)
    assert bench_engine.DEVICE_EXPERTS["kimi-k2-slice"] == "int4"
    # 3 MoE layers of 384 int4 experts: 9.5 GB a layer (notes/int4.md), never bf16's 33.8
    itemsize = engine_roof.engine_itemsize(2, 0.5 + 2 / 32)
    layer = sum(int(np.prod(s)) * itemsize(n) for n, s in weight_shapes(cfg).items()
                if n.startswith("model/layers/1/mlp/experts/"))
    assert 9.4e9 < layer < 9.6e9


def test_random_int4_experts_are_packed_symmetric_and_chunk_free():
    """Drawn as packed words: values in [-7, 7] (the -8 nibble folded onto 0), the scales the
    asked spread, the same bits whatever the chunk."""
    from formats.int4_group import Int4GroupWeight
    from kdtree_numba.device_weights import random_int4_experts
    w = random_int4_experts(np, (4, 32, 64), 0.05, seed=7)
    assert isinstance(w, Int4GroupWeight) and w.shape == (4, 32, 64) and w.group_size == 32
    q = w.values()
    assert q.min() == -7 and q.max() == 7 and abs(q.mean()) < 0.3
    assert 0.04 < w.dequantize().std() < 0.06
    again = random_int4_experts(np, (4, 32, 64), 0.05, seed=7, chunk=100)
    assert np.array_equal(again.packed, w.packed) and np.array_equal(again.scale, w.scale)
    other = random_int4_experts(np, (4, 32, 64), 0.05, seed=8)
    assert not np.array_equal(other.packed, w.packed)


def test_kimi_k2_slice_rows_end_to_end(monkeypatch):
    """bench_engine's kimi-k2-slice path on a tiny config through the reference backend: the
    routed experts drawn int4, AR and replay DDTree rows lossless, the roofs priced at int4's
    bytes for the experts (the MoE layer's bf16 comparison runs on the GPU only)."""
    from formats.int4_group import Int4GroupWeight
    monkeypatch.setitem(bench_engine.DEVICE_SIZES, "kimi-k2-slice",
                        lambda: tiny_config(n_routed_experts=16))
    made = []
    plain = bench_engine.random_model

    def spy(cfg, *a, **kw):
        model = plain(cfg, *a, **kw)
        made.append((kw.get("experts"), model))
        return model
    monkeypatch.setattr(bench_engine, "random_model", spy)
    args = argparse.Namespace(seed=0, dtype="bfloat16", prompt_len=6, budgets=[4], batches=[1],
                              new_tokens=4, agreement=0.9, no_replay=False, no_layer=False,
                              expert_count="uniform", gemm=["cuda-cores"], kv_cache="float32",
                              json=None)
    rows: list = []
    bench_engine.bench_device_size("kimi-k2-slice", args, bench_engine.Budget(600), rows,
                                   backend="reference")
    assert [r["method"] for r in rows] == ["ar", "ddtree/replay"]
    assert rows[1]["same_tokens_as_ar"] is True
    (experts, model), = made
    assert experts == "int4" and isinstance(model.layers[1].gate_up, Int4GroupWeight)
    cfg = tiny_config(n_routed_experts=16)
    int4 = engine_roof.forward_bytes(cfg, 1, [2, 2], engine_roof.engine_itemsize(2, 0.5625))
    bf16 = engine_roof.forward_bytes(cfg, 1, [2, 2], engine_roof.engine_itemsize(2))
    assert int4 < bf16
    decode = [r for r in engine_roof.uniform_records(cfg, 6, [1])][1]
    assert rows[0]["step_bytes_roof_ms"] == pytest.approx(
        1e3 * engine_roof.roof_seconds(cfg, decode, engine_roof.engine_itemsize(2, 0.5625))[0])

"""The engine on a real GPU: the numba backend (CuPy glue, numba kernels) against the NumPy
reference, DDTree losslessness on the device, and the sync contract (docs/ENGINE.md, "Sync
points": a round waits for the device once, when it reads its committed tokens).  Run on the
H200:

    HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -m gpu tests/test_engine_gpu.py
"""
from __future__ import annotations

import functools
import gc
import traceback

import numpy as np
import pytest

from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.device_ar import steps_per_launch
from kdtree_numba.drafter import BlockDrafter, ModelDrafter, NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import ForwardBatch, Model

pytestmark = pytest.mark.gpu

# numba driver calls that make the host wait for the device (synchronous copies, syncs, frees)
NUMBA_WAITS = ("cuMemcpyHtoD", "cuMemcpyDtoH", "cuCtxSynchronize", "cuStreamSynchronize",
               "cuEventSynchronize", "cuMemFree")


@functools.lru_cache(maxsize=None)
def pair(size: str, seed: int = 0, dtype: str = "float32", **overrides):
    """(reference model, numba-GPU model) on the same weights."""
    cfg = size_config(size, **overrides)
    weights = dict(random_weights(cfg, seed))
    if dtype == "bfloat16":
        import ml_dtypes
        weights = {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}
    return Model(cfg, weights, "reference"), Model(cfg, weights, "numba")


def test_backend_is_gpu_and_cache_lives_on_device():
    _, gpu = pair("tiny")
    import cupy
    assert gpu.backend.name == "numba" and gpu.backend.on_gpu
    cache = gpu.new_cache(2, 64)
    assert isinstance(cache.c, cupy.ndarray)
    logits = gpu.forward(ForwardBatch(
        np.ones((2, 3), np.int64), np.tile(np.arange(3), (2, 1)),
        np.tile(np.tri(3, dtype=bool), (2, 1, 1))), cache)
    assert isinstance(logits, cupy.ndarray) and logits.shape == (2, 3, 128)


@pytest.mark.parametrize("size, overrides", [
    ("tiny", {}),
    ("tiny", {"q_lora_rank": None, "tie_word_embeddings": True, "rope_interleave": False,
              "scoring_func": "softmax", "n_group": 1, "topk_group": 1}),
    ("small", {}),
    ("medium", {"num_hidden_layers": 2}),
])
def test_gpu_logits_match_reference(size, overrides):
    ref, gpu = pair(size, **overrides)
    seq = np.random.default_rng(1).integers(0, ref.vocab_size, 40)
    want = ref.score(seq)
    got = gpu.score(seq)
    # float32 kernels (fp32 accumulation over K <= 2816) vs the float64 reference
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 2e-4 * scale, np.abs(got - want).max() / scale


def test_gpu_bf16_weights_match_reference():
    ref, gpu = pair("small", dtype="bfloat16")
    seq = np.arange(1, 30)
    want = ref.score(seq)
    assert np.abs(gpu.score(seq) - want).max() <= 2e-4 * np.abs(want).max()


def test_gpu_tensor_cores_logits_match_reference():
    """make_backend(gemm="tensor-cores") on the medium config's Kimi attention widths (bf16
    weights, 2 layers): every projection, expert, absorb_q / apply_uv and the lm_head on bf16
    tensor cores with their inputs rounded to bf16 (relative 2^-9 each), attention 3xTF32.
    The logits stay within 2e-2 of the float64 reference's scale (bf16 inference's usual
    agreement; the test prints the measured error), and differ from the CUDA-core model's:
    the rounding really happened."""
    from kdtree_numba.backends import make_backend
    ref, gpu = pair("medium", dtype="bfloat16", num_hidden_layers=2)
    tc = Model(ref.config, _bf16_weights("medium", num_hidden_layers=2),
               make_backend("numba", gemm="tensor-cores"))
    seq = np.random.default_rng(3).integers(0, ref.vocab_size, 40)
    want, fp32, got = ref.score(seq), gpu.score(seq), tc.score(seq)
    scale = np.abs(want).max()
    print(f"tensor-cores logits: max error {np.abs(got - want).max() / scale:.2e} of the scale")
    assert np.abs(got - want).max() <= 2e-2 * scale
    assert not np.array_equal(got, fp32)


def _bf16_weights(size, seed=0, **overrides):
    import ml_dtypes
    cfg = size_config(size, **overrides)
    return {k: v.astype(ml_dtypes.bfloat16) for k, v in random_weights(cfg, seed)}


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("budget", [8, 32, 64])
def test_gpu_ddtree_greedy_equals_gpu_ar(size, budget):
    _, gpu = pair(size)
    rng = np.random.default_rng(budget)
    prompts = [rng.integers(0, gpu.vocab_size, n).tolist() for n in (5, 17, 1)]
    ar = generate(gpu, prompts, 24)
    drafters = [NoisyOracleDrafter(gpu, 6, agreement=0.7, seed=2, sharpness=3.0),
                NoisyOracleDrafter(gpu, 4, agreement=0.0, seed=3)]
    draft_cfg = size_config(size, num_hidden_layers=1, first_k_dense_replace=1)
    draft = Model(draft_cfg, dict(random_weights(draft_cfg, 9)), "numba")
    drafters.append(ModelDrafter(draft, 5))
    for drafter in drafters:
        dd = generate(gpu, prompts, 24, method="ddtree", drafter=drafter, budget=budget)
        assert dd.tokens == ar.tokens, drafter.name


def test_gpu_tensor_cores_ddtree_equals_ar_and_a_prompt_alone_its_batch():
    """Under gemm="tensor-cores" every op is batch invariant (docs/ENGINE.md, "Tensor
    cores"): DDTree's greedy tokens equal AR's, and each prompt decodes to the same tokens
    alone as in a ragged batch -- its prefill (one key split a row, kdtree_numba/attention/
    mla.py), decodes and verifies get the same bits whatever shares their forward."""
    from kdtree_numba.backends import make_backend
    cfg = size_config("medium", num_hidden_layers=2)
    tc = Model(cfg, _bf16_weights("medium", num_hidden_layers=2),
               make_backend("numba", gemm="tensor-cores"))
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, tc.vocab_size, n).tolist() for n in (5, 70, 1, 17)]
    ar = generate(tc, prompts, 20)
    assert [generate(tc, [p], 20).tokens[0] for p in prompts] == ar.tokens
    for budget in (8, 32):
        dd = generate(tc, prompts, 20, method="ddtree", budget=budget,
                      drafter=NoisyOracleDrafter(tc, 6, agreement=0.7, seed=2, sharpness=3.0))
        assert dd.tokens == ar.tokens, budget


@pytest.mark.parametrize("budget", [64])
def test_gpu_tma_gemm_keeps_the_tensor_cores_tokens(budget, monkeypatch):
    """The TMA GEMM's tiles (layers/mma_tma.py: past 80 rows, a verify's 65-80 rows), and
    with ``KDTREE_MMA_STREAM_K`` their slices shared out, give the cp.async kernels' tokens
    under gemm="tensor-cores": a 90-token prefill, AR's decodes and DDTree's 65-row
    verifies, each prompt alone and in a batch."""
    from kdtree_numba.backends import make_backend
    cfg = size_config("medium", num_hidden_layers=2)
    weights = _bf16_weights("medium", num_hidden_layers=2)
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (90, 5, 33)]
    runs = {}
    for switch in ("0", "1", "stream-K"):
        monkeypatch.setenv("KDTREE_MMA_TMA", "0" if switch == "0" else "1")
        monkeypatch.setenv("KDTREE_MMA_STREAM_K", "1" if switch == "stream-K" else "0")
        tc = Model(cfg, weights, make_backend("numba", gemm="tensor-cores"))
        drafter = NoisyOracleDrafter(tc, 6, agreement=0.7, seed=2, sharpness=3.0)
        runs[switch] = (generate(tc, prompts, 16).tokens,
                        generate(tc, prompts, 16, method="ddtree", budget=budget,
                                 drafter=drafter).tokens,
                        generate(tc, prompts[:1], 16).tokens)
    assert runs["1"] == runs["0"]
    assert runs["stream-K"] == runs["0"]
    assert runs["1"][1] == runs["1"][0]


def test_gpu_greedy_tokens_match_reference():
    ref, gpu = pair("tiny", seed=4)
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7]]
    assert generate(gpu, prompts, 20).tokens == generate(ref, prompts, 20).tokens


def test_gpu_sampled_ddtree_equals_sampled_ar():
    _, gpu = pair("small")
    prompts = [[10, 20, 30], [40]]
    ar = generate(gpu, prompts, 20, temperature=0.8, seed=5)
    dd = generate(gpu, prompts, 20, method="ddtree", temperature=0.8, seed=5, budget=16,
                  drafter=NoisyOracleDrafter(gpu, 5, agreement=0.8, seed=1, sharpness=3.0))
    assert dd.tokens == ar.tokens


def test_gpu_block_drafter_is_lossless():
    from kdtree_numba.bundle import block_drafter_shapes
    from kdtree_numba.config import weight_shapes
    _, gpu = pair("small")
    cfg = size_config("small", num_hidden_layers=1, first_k_dense_replace=1, hidden_size=128)
    shapes = dict(weight_shapes(cfg), **block_drafter_shapes(cfg, gpu.config.hidden_size))
    w = dict(random_weights(cfg, 3, shapes))
    drafter = BlockDrafter(Model(cfg, w, "numba"), w["block/target_proj"],
                           w["block/mask_embedding"], block_len=7)
    prompts = [[1, 2, 3, 4], [5, 6]]
    assert generate(gpu, prompts, 16, method="ddtree", drafter=drafter,
                    budget=32).tokens == generate(gpu, prompts, 16).tokens


# ----------------------------------------------------------------------------- sync contract

def sync_case(temperature: float, method: str = "ddtree"):
    """A small target and a ModelDrafter sharing one backend, and a generate() call on them;
    the call runs once here (compiling every kernel and upload that later calls reuse)."""
    _, gpu = pair("small")
    draft_cfg = size_config("small", num_hidden_layers=1, first_k_dense_replace=1)
    draft = Model(draft_cfg, dict(random_weights(draft_cfg, 9)), gpu.backend)
    prompts = [[10, 20, 30, 40, 50], [7, 8]]

    def run():
        kw = dict(method="ddtree", drafter=ModelDrafter(draft, 5), budget=16) \
            if method == "ddtree" else {}
        return generate(gpu, prompts, 24, temperature=temperature, seed=5, **kw)
    run()
    return gpu, run


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_gpu_round_reads_the_device_once(temperature):
    gpu, run = sync_case(temperature)
    be = gpu.backend
    reads, syncs = be.reads, be.syncs
    dd = run()
    reads, syncs = be.reads - reads, be.syncs - syncs
    assert dd.stats.rounds >= 5
    assert reads == 1 + dd.stats.rounds and syncs == 1
    assert dd.tokens == generate(gpu, [[10, 20, 30, 40, 50], [7, 8]], 24,
                                 temperature=temperature, seed=5).tokens
    t = dd.stats.time
    assert all(t[p] > 0 for p in ("prefill", "draft", "tree_build", "verify", "accept",
                                  "compaction"))
    assert sum(t.values()) <= dd.stats.seconds


@pytest.mark.parametrize("method, temperature", [("ddtree", 0.0), ("ddtree", 0.8),
                                                 ("ar", 0.8), ("ar-device", 0.8)])
def test_gpu_rounds_make_no_numba_waits(monkeypatch, method, temperature):
    """No numba driver call that waits for the device (a synchronous copy: a NumPy array
    reaching a kernel, a copy_to_host; a sync; a cuMemFree outside the deferred free at the
    end of a round) happens during a warmed-up generate(); "ar": the host's loop of one step
    a launch (``KDTREE_AR_DEVICE_STEPS=0``); "ar-device": the GPU's default, AR's steps on
    the device, 4 a launch (kdtree_numba/device_ar.py)."""
    from numba.cuda.cudadrv.driver import driver
    if method == "ar":
        monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", "0")
    else:
        monkeypatch.delenv("KDTREE_AR_DEVICE_STEPS", raising=False)
    gpu, run = sync_case(temperature, method)
    if method == "ar-device":
        assert steps_per_launch(gpu.backend) == 4
    be = gpu.backend
    # earlier tests' garbage (cycles holding device arrays) is collected and freed now, before
    # the spies go in: run 13 caught a collection here freeing 22 of them
    gc.collect()
    be.free_deferred()
    calls, flushing, where = [], [], []
    for name in NUMBA_WAITS:
        real = getattr(driver, name)

        def spy(*args, _real=real, _name=name):
            if not flushing:
                calls.append(_name)
                if not where:      # the first offender's stack, for the failure message
                    where.append("".join(traceback.format_stack(limit=14)[:-1]))
            return _real(*args)
        monkeypatch.setattr(driver, name, spy)
    real_free = be.free_deferred

    def free_deferred():
        flushing.append(True)
        try:
            real_free()
        finally:
            flushing.pop()
    monkeypatch.setattr(be, "free_deferred", free_deferred)
    gc.disable()        # and no collection during the run
    try:
        res = run()
    finally:
        gc.enable()
        monkeypatch.undo()
    assert res.stats.rounds >= 5
    assert calls == [], f"{sorted(set(calls))} x{len(calls)}, first from:\n{where[0]}"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_gpu_rounds_make_no_cupy_syncs(monkeypatch):
    """CuPy's own sync detector (``cupyx.allow_synchronize``, deprecated; skipped where gone)
    sees no synchronisation besides ``Backend.to_host`` / ``synchronize``."""
    import cupyx
    allow = getattr(cupyx, "allow_synchronize", None)
    if allow is None:
        pytest.skip("this CuPy has no cupyx.allow_synchronize")
    gpu, run = sync_case(0.8)
    be = gpu.backend
    for name in ("to_host", "synchronize"):
        real = getattr(be, name)

        def allowed(*args, _real=real):
            with allow(True):
                return _real(*args)
        monkeypatch.setattr(be, name, allowed)
    with allow(False):
        res = run()
    assert res.stats.rounds >= 5


# ---- CUDA graphs (kdtree_numba/graphs.py)
def _tree_visible(rng, n):
    """A random tree's ancestor mask over n nodes (node 0 the root)."""
    from reference.attention import tree_visible
    return tree_visible([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


@pytest.mark.parametrize("n", [1, 9])
def test_gpu_graph_replays_equal_eager_forwards(monkeypatch, n):
    """Decode (n = 1) and tree-verify (n = 9) forwards: the first call of a shape runs eagerly,
    the second captures, the rest replay; each step's logits and the cache it wrote equal an
    eager run fed the same inputs, while tokens, positions and masks change every step."""
    import cupy
    _, gpu = pair("small")
    assert gpu.graphs is not None               # on by default on the GPU
    graphs = gpu.new_graphs()                   # this test's own: counts start at 0
    monkeypatch.setattr(gpu, "graphs", graphs)
    rng = np.random.default_rng(n)
    bs, steps = 2, 5
    caches = {"graph": gpu.new_cache(bs, 96), "eager": gpu.new_cache(bs, 96)}
    prompt = rng.integers(0, gpu.vocab_size, (bs, 7))
    for cache in caches.values():
        gpu.graphs = None
        gpu.forward(ForwardBatch(
            prompt, np.tile(np.arange(7), (bs, 1)), np.tile(np.tri(7, dtype=bool), (bs, 1, 1))),
            cache)
        cache.advance([7, 5])            # ragged: request 1 keeps 5 of its 7
    gpu.graphs = graphs
    try:
        for step in range(steps):
            tokens = rng.integers(0, gpu.vocab_size, (bs, n))
            vis = np.stack([_tree_visible(rng, n) for _ in range(bs)])
            depth = vis.sum(-1) - 1
            out = {}
            for mode, cache in caches.items():
                gpu.graphs = graphs if mode == "graph" else None
                pos = cache.lengths[:, None] + depth
                out[mode] = cupy.asnumpy(gpu.forward(ForwardBatch(tokens, pos, vis), cache))
                cache.advance([1, 1 + step % 2])
            np.testing.assert_allclose(out["graph"], out["eager"], rtol=1e-4, atol=1e-4)
    finally:
        gpu.graphs = graphs
    assert graphs.captures == 1 and graphs.replays == steps - 1
    g, e = caches["graph"], caches["eager"]
    np.testing.assert_array_equal(g.lengths, e.lengths)
    for b in range(bs):
        L = int(g.lengths[b])
        np.testing.assert_allclose(cupy.asnumpy(g.c[:, b, :L]), cupy.asnumpy(e.c[:, b, :L]),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method, temperature, top_p, top_k",
                         [("ar", 0.0, 1.0, 0), ("ar", 0.8, 1.0, 0), ("ar", 1.0, 0.9, 50),
                          ("ddtree", 0.0, 1.0, 0), ("ddtree", 0.8, 1.0, 0)])
def test_gpu_generate_with_graphs_equals_eager(monkeypatch, method, temperature, top_p, top_k):
    """Same tokens with and without CUDA graphs; in DDTree the round's tree, accept and
    compaction phases replay from graphs as well as the forwards.  AR (19 steps after the
    prefill's token) under ``runtime.current().ar_device_steps`` K: K > 0 (the GPU's
    default, kdtree_numba/device_ar.py) one graph a launch of K steps, ceil(19 / K) launches,
    each a replay in the second call; K = 0 (the host's loop) a step's forward and its choice
    (the sampled one, top-p and top-k too, a graph of its own) two replays a step."""
    _, gpu = pair("small")
    monkeypatch.setattr(gpu, "graphs", gpu.new_graphs())
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    if method == "ddtree":
        kw.update(method="ddtree", budget=16,
                  drafter=NoisyOracleDrafter(gpu, 4, agreement=0.7))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    graphs = gpu.graphs
    try:
        gpu.graphs = None
        want = generate(gpu, prompts, 20, **kw).tokens
    finally:
        gpu.graphs = graphs
    for _ in range(2):                     # the second call replays the first one's captures
        res = generate(gpu, prompts, 20, **kw)
        assert res.tokens == want
    assert graphs.failures == 0 and graphs.captures >= 1
    kinds = graphs.kinds()
    if method == "ddtree":
        assert kinds["forward"] >= 1, kinds             # the verify
        assert res.stats.graph_replays > 10     # counted in the stats too
        assert graphs.replays > 10
        assert kinds["tree"] == kinds["accept"] == kinds["compaction"] == 1, kinds
    else:
        K = steps_per_launch(gpu.backend)
        launches = -(-19 // K) if K else 19
        # every launch of the second call replays (besides its prefill's graphs)
        assert res.stats.graph_replays >= (1 if K else 2) * launches, (K, res.stats)
        # the first call replayed too: from its second launch on (captured there)
        assert graphs.replays >= res.stats.graph_replays + launches - 1
        assert res.stats.rounds == (K * launches if K else 19)
        # the host loop's decode forward, or the program (one key: batch, K, sampling),
        # whose forwards are inside its graph
        assert kinds["forward"] >= 1 if K == 0 else kinds["forward"] == 0, kinds
        assert kinds["ar_steps"] == (1 if K else 0), kinds
    if temperature == 0:
        assert kinds["argmax"] >= 1, kinds          # the AR step's / prefill's choice
    elif method == "ar":
        assert kinds["sample"] == 1, kinds          # one key: batch and sampling fixed


def test_gpu_failed_capture_falls_back_to_eager(monkeypatch):
    """A forward that cannot be captured (here: it raises while capturing) warns once and
    runs eagerly from then on, with the right logits."""
    _, gpu = pair("tiny")
    real_compute = gpu._compute

    def compute(*args, **kw):
        if gpu.backend._launch.stream is not None:     # inside the capture
            raise RuntimeError("not capturable")
        return real_compute(*args, **kw)
    monkeypatch.setattr(gpu, "_compute", compute)
    monkeypatch.setattr(gpu, "graphs", gpu.new_graphs())
    cache = gpu.new_cache(1, 32)
    tok, vis = np.array([[5]]), np.ones((1, 1, 1), bool)
    ref, _ = pair("tiny")
    ref_cache = ref.new_cache(1, 32)
    with pytest.warns(RuntimeWarning, match="not capturable"):
        for step in range(4):
            got = gpu.forward(ForwardBatch(tok, [[step]], vis), cache)
            want = ref.forward(ForwardBatch(tok, [[step]], vis), ref_cache)
            np.testing.assert_allclose(gpu.backend.to_host(got), want, rtol=1e-4, atol=1e-4)
            cache.advance(1)
            ref_cache.advance(1)
    assert gpu.graphs.failures == 1 and gpu.graphs.captures == 0


def test_gpu_borrowed_outputs_are_the_graphs_buffers_until_the_next_replay():
    """GraphCache.call(borrow=True) hands out buffers the graph writes (the same arrays every
    replay, overwritten by the next one: a DDTree round's tree, verify logits and acceptance),
    with the values a copying call returns, and no other graph's replay touches them: graph B
    below is captured after A freed its scratch (x * 2) into the graphs' pool, where B's own
    result then lands; B's borrowed output must survive A's next replay."""
    import cupy
    from kdtree_numba.graphs import GraphCache
    _, gpu = pair("tiny")
    graphs = GraphCache(gpu.backend)
    spec = (((4096,), np.float32),)

    def call(key, fn, value, borrow):
        return graphs.call((key,), fn, (np.full(4096, value, np.float32),), spec,
                           borrow=borrow)
    a = lambda x: x * 2 + 1                 # noqa: E731  (scratch x * 2, freed in capture)
    b = lambda y: y + 3                     # noqa: E731
    for key, fn in (("a", a), ("b", b)):
        assert call(key, fn, 0, True) is None                      # first sight: eager
        call(key, fn, 0, True)                                      # captured, replayed
    out_b = call("b", b, 5, True)
    kept_a = call("a", a, 7, False)                                 # a copy: kept
    np.testing.assert_array_equal(cupy.asnumpy(out_b), 8)           # A's scratch missed it
    np.testing.assert_array_equal(cupy.asnumpy(kept_a), 15)
    again = call("b", b, 1, True)
    assert again is out_b                                           # the same buffer
    np.testing.assert_array_equal(cupy.asnumpy(out_b), 4)           # overwritten by B
    np.testing.assert_array_equal(cupy.asnumpy(kept_a), 15)
    assert graphs.captures == 2 and graphs.replays == 5


def test_gpu_graph_inputs_from_the_device_in_any_layout_and_dtype():
    """A replay's device inputs reach its static buffers whether they can take the one-copy
    path (same dtype, C order) or not (a strided view, another dtype to convert), and a host
    input as well."""
    import cupy
    from kdtree_numba.graphs import GraphCache
    _, gpu = pair("tiny")
    graphs = GraphCache(gpu.backend)
    specs = (((3, 4), np.int32), ((3, 4), np.int32), ((3, 4), np.int32), ((3, 4), np.int32))

    def call(inputs):
        return graphs.call(("sum",), lambda *a: sum(a[1:], a[0] * 1000), inputs, specs)
    base = np.arange(24, dtype=np.int32).reshape(3, 8)
    for step in range(4):
        dense = cupy.asarray(base[:, :4] + step)                  # contiguous int32
        strided = cupy.asarray(base + 10 * step)[:, ::2]          # a view with strides
        wide = cupy.asarray(base[:, 4:] - step, dtype=cupy.int64)  # converted to int32
        host = base[:, 1:5] * step                                # uploaded
        got = call((dense, strided, wide, host))
        if step == 0:
            assert got is None                                    # first sight: eager
            continue
        want = ((base[:, :4] + step) * 1000 + (base + 10 * step)[:, ::2]
                + (base[:, 4:] - step) + base[:, 1:5] * step)
        np.testing.assert_array_equal(cupy.asnumpy(got), want)
    assert graphs.captures == 1 and graphs.replays == 3


def test_gpu_host_inputs_go_up_without_waiting_for_the_device():
    """A replay's host inputs are written stream-ordered: the host does not wait for the work
    queued before it (~100 ms of float32 GEMMs here), so a decode step or a device round
    launched one ahead really is ahead; and replays queued back to back with different host
    values each read their own."""
    import time

    import cupy

    from kdtree_numba.graphs import GraphCache
    _, gpu = pair("tiny")
    graphs = GraphCache(gpu.backend)
    spec = (((256,), np.float32),)

    def call(value):
        return graphs.call(("up",), lambda x: x * 3 + 1, (np.full(256, value, np.float32),),
                           spec)

    call(0)
    call(0)                                               # eager, then captured
    big = cupy.ones((8192, 8192), np.float32)
    cupy.cuda.Device().synchronize()
    for _ in range(6):                                    # ~100+ ms of queued work
        big = big @ big * np.float32(1 / 8192)
    t0 = time.perf_counter()
    first = [call(v) for v in (1, 2)]
    queued = time.perf_counter() - t0
    rest = [call(v) for v in range(3, 9)]
    for value, out in enumerate(first + rest, start=1):
        np.testing.assert_array_equal(cupy.asnumpy(out), 3 * value + 1)
    assert queued < 0.03, f"two replays with host inputs took {queued:.3f} s behind " \
                          f"~100 ms of queued GEMMs: their uploads waited for the device"

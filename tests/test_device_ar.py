"""AR steps as a device program, K a launch, enqueued one launch ahead
(kdtree_numba/device_ar.py): the host loop's tokens and cache lengths at T = 0 and T > 0
(top-p and top-k too), eos inside a block, max_new_tokens not a multiple of K, a batch whose
requests finish at different steps; one read a launch; the switch and its refusals.  On the
reference backend through ``generate(ar_device_steps=K)`` (fast), on the numba kernels in the
simulator through ``KDTREE_AR_DEVICE_STEPS``, and (``gpu``) on the demo pair with its CUDA
graph replayed."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from kdtree_numba import compat, runtime
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.device_ar import DeviceAR, steps_per_launch
from kdtree_numba.engine import generate
from kdtree_numba.model import Model
from test_engine import SIM_TINY, counted, tiny_model

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5], [3]]
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0),
             dict(temperature=1.0, top_p=0.8, top_k=5)]


@functools.lru_cache(maxsize=None)
def paged_model() -> Model:
    """tiny_model(1)'s weights with its cache in pages of 3 slots."""
    base = tiny_model(1)
    return Model(base.config, dict(random_weights(base.config, 1)), "reference",
                 kv_layout="paged:3")


def host_loop(model, prompts, n, **kw):
    """Today's AR (the host's loop, one step a launch): its result and the cache's lengths."""
    res = generate(model, prompts, n, ar_device_steps=0, **kw)
    return res, model.generation_cache.lengths.tolist()


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "T1", "T1-top-p-k"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_device_steps_give_the_host_loops_tokens_and_lengths(sampling, steps):
    """A ragged batch of 3 at every max_new_tokens from 1 to 9 (multiples of K and not),
    with and without an eos that finishes request 1 at its third token while the others run
    on (for K = 3 and 4 inside the first block; at T > 0 it ends request 0 early too once):
    the host loop's tokens (T > 0: the same uniforms) and the cache lengths it leaves
    (len(seq) - 1 a request); one read a launch besides the prefill's, K device steps a
    launch, and the phase "decode" charged."""
    model = tiny_model(1)
    kw = dict(seed=3, **sampling)
    for n in range(1, 10):
        full, _ = host_loop(model, PROMPTS, n, **kw)
        for eos in (None,) if n < 3 else (None, full.tokens[1][2]):
            want, lengths = host_loop(model, PROMPTS, n, eos=eos, **kw)
            if eos is not None:       # step 2's token: a block's second step
                assert len(want.tokens[1]) == 3
            got, reads, syncs = counted([model.backend], lambda: generate(
                model, PROMPTS, n, eos=eos, ar_device_steps=steps, **kw))
            assert got.tokens == want.tokens, (n, eos)
            assert model.generation_cache.lengths.tolist() == lengths, (n, eos)
            assert not model.generation_cache.pending
            launches = reads - 1
            assert syncs == 1 and got.stats.rounds == steps * launches
            # n - 1 steps after the prefill's token, K a launch (fewer where eos ends all)
            needed = -(-(n - 1) // steps)
            assert launches == needed if eos is None else 0 < launches <= needed
            assert (got.stats.time["decode"] > 0) == (launches > 0)
    assert any(isinstance(p, DeviceAR) and p.steps == steps
               for p in model.generation_cache.programs.values())


def test_a_paged_cache_reserves_each_blocks_pages():
    """A paged target cache (pages of 3 slots, K = 4): each launch reserves the pages of its
    K writes past every request's length; the host loop's tokens and lengths."""
    model = paged_model()
    for n, eos in ((11, None), (11, 2)):
        want, lengths = host_loop(model, PROMPTS, n, eos=eos)
        got = generate(model, PROMPTS, n, eos=eos, ar_device_steps=4)
        assert got.tokens == want.tokens
        assert model.generation_cache.lengths.tolist() == lengths


def test_batch_of_two_one_finishing_early_and_blocks_launched_one_ahead(monkeypatch):
    """Batch 2, request 1 stopped by eos in the first block while request 0 runs to
    max_new_tokens: block j + 1 is launched before block j is read (launch, launch, read,
    launch, read, ..., read), the launches after the eos is read advance request 1 no more,
    and no launch lets request 0 past max_new_tokens."""
    model = tiny_model(1)
    prompts = PROMPTS[:2]
    full, _ = host_loop(model, prompts, 14)
    eos = full.tokens[1][1]
    assert eos not in full.tokens[0]
    want, lengths = host_loop(model, prompts, 14, eos=eos)
    assert len(want.tokens[1]) == 2 and len(want.tokens[0]) == 14
    events = []
    launch, collect = DeviceAR.launch, DeviceAR.collect

    def spy_launch(self, counts):
        events.append(("launch", np.asarray(counts).tolist()))
        return launch(self, counts)

    def spy_collect(self):
        events.append(("read", None))
        return collect(self)
    monkeypatch.setattr(DeviceAR, "launch", spy_launch)
    monkeypatch.setattr(DeviceAR, "collect", spy_collect)
    progress = []
    got = generate(model, prompts, 14, eos=eos, ar_device_steps=3,
                   progress=lambda done, total: progress.append(done))
    assert got.tokens == want.tokens and model.generation_cache.lengths.tolist() == lengths
    counts = [c for k, c in events if k == "launch"]
    assert [k for k, _ in events] == \
        ["launch"] + ["launch", "read"] * (len(counts) - 1) + ["read"]
    # request 0: 13 steps after the prefill's token, 3 a block; request 1: the first block's
    # 3 and the second's (launched before the eos was read), then none
    assert [c[0] for c in counts] == [3, 3, 3, 3, 1]
    assert [c[1] for c in counts] == [3, 3, 0, 0, 0]
    # one report after the prefill and one after each block's commit
    assert len(progress) == 1 + len(counts) and progress[-1] == 16


def test_each_blocks_pinned_copy_is_read_after_waiting_for_it():
    """On a fake device whose asynchronous copies land only when the host waits
    (test_engine.FakeCupy: a read of the pinned buffer before its wait sees zeros), with a
    block always in flight: the reference backend's tokens and lengths, one read a launch,
    at T = 0 and 0.7, eos and max_new_tokens finishing requests at different steps."""
    from kdtree_numba.backends import Backend, make_backend
    from test_engine import FakeCupy
    be = Backend("reference", FakeCupy(), make_backend("reference").ops, on_gpu=True)
    base = tiny_model(1)
    model = Model(base.config, dict(random_weights(base.config, 1)), be)
    for temperature in (0.0, 0.7):
        full, _ = host_loop(base, PROMPTS, 8, temperature=temperature, seed=3)
        eos = full.tokens[1][2]
        want, lengths = host_loop(base, PROMPTS, 8, temperature=temperature, seed=3, eos=eos)
        got, reads, syncs = counted([be], lambda: generate(
            model, PROMPTS, 8, temperature=temperature, seed=3, eos=eos, ar_device_steps=3))
        assert got.tokens == want.tokens
        assert model.generation_cache.lengths.tolist() == lengths
        assert reads == 1 + got.stats.rounds // 3 and syncs == 1


def test_the_next_generation_reuses_the_program():
    """A second generation on the same cache runs the same program object (its buffers are
    what a captured graph holds), restarted on its own roots and uniforms, key unchanged."""
    model = tiny_model(1)
    kw = dict(temperature=0.7, seed=5, ar_device_steps=2)
    first = generate(model, PROMPTS, 7, **kw)
    (program,) = [p for p in model.generation_cache.programs.values()
                  if isinstance(p, DeviceAR) and p.steps == 2 and not p.sampling.greedy
                  and p.sampling.temperature == 0.7]
    key = program.key()
    again = generate(model, PROMPTS, 7, **kw)
    assert again.tokens == first.tokens == host_loop(model, PROMPTS, 7, temperature=0.7,
                                                     seed=5)[0].tokens
    assert program in model.generation_cache.programs.values() and program.key() == key
    other = generate(model, PROMPTS, 7, temperature=0.7, seed=6, ar_device_steps=2)
    assert other.tokens == host_loop(model, PROMPTS, 7, temperature=0.7, seed=6)[0].tokens


def test_the_switch_and_its_refusals(monkeypatch):
    """``KDTREE_AR_DEVICE_STEPS`` decides on the numba backend only (the reference backend
    keeps the host loop; unset: 4 on a real GPU, the host loop under the simulator); a given
    ``ar_device_steps`` decides anywhere; bad values are one ValueError, as is the argument
    for another method."""
    model = tiny_model(1)
    numba = type("B", (), {"name": "numba"})()
    unset = 0 if runtime.current().simulator else runtime.AR_STEPS_ON
    for value, want in (("", unset), ("0", 0), ("off", 0), ("3", 3), ("on", 4), ("64", 64)):
        monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", value)
        assert runtime.current().ar_device_steps == want
        assert steps_per_launch(numba) == want and steps_per_launch(model.backend) == 0
        assert steps_per_launch(model.backend, 2) == 2
    monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", "3")
    res = generate(model, PROMPTS, 6)                  # the reference backend: the host loop
    assert res.stats.rounds == 5
    for bad in ("65", "-1", "two", "2.5"):
        monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", bad)
        with pytest.raises(ValueError, match="KDTREE_AR_DEVICE_STEPS"):
            runtime.current()
    monkeypatch.delenv("KDTREE_AR_DEVICE_STEPS")
    for bad in (-1, 65, 2.5, True, "2"):
        with pytest.raises(ValueError, match="ar_device_steps"):
            generate(model, PROMPTS, 4, ar_device_steps=bad)
    from test_engine import make_drafter
    with pytest.raises(ValueError, match="ar_device_steps is for method 'ar'"):
        generate(model, PROMPTS, 4, method="ddtree", budget=4, ar_device_steps=2,
                 drafter=make_drafter("model", model, 3, 0))


@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba backend runs here only in the "
                    "CUDA simulator (the GPU twin is test_gpu_device_ar_steps_on_the_demo_pair)")
@pytest.mark.parametrize("sampling", [
    # ~15 s of CI's budget each: the program runs on the reference backend above and, on the
    # numba kernels, in the GPU twin below
    pytest.param(dict(temperature=0.0), marks=pytest.mark.slow),
    pytest.param(dict(temperature=1.0, top_p=0.9, top_k=8), marks=pytest.mark.slow)],
                         ids=["greedy", "T1-top-p-k"])
def test_numba_kernels_under_the_switch_in_simulator(monkeypatch, needs_kernels, sampling):
    """The numba kernels' outputs (their dtypes) through the program, run eagerly in the
    simulator under ``KDTREE_AR_DEVICE_STEPS=2``: the host loop's tokens (cut at the eos)
    and lengths, with request 1 stopped by eos at the first block's first step, 4 new tokens
    (3 steps: not a multiple of 2), two launches and their two reads.  ~10-15 s."""
    cfg = size_config("tiny", **SIM_TINY)
    model = Model(cfg, dict(random_weights(cfg, 0)), "numba")
    prompts = [[3, 9], [4]]
    kw = dict(seed=2, **sampling)
    monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", "0")
    full = generate(model, prompts, 4, **kw).tokens
    eos = full[1][1]
    assert eos not in full[0] and eos != full[1][0]
    want = [full[0], full[1][:2]]            # the host loop stops request 1 there
    monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", "2")
    got, reads, syncs = counted([model.backend], lambda: generate(
        model, prompts, 4, eos=eos, **kw))
    assert got.tokens == want
    assert model.generation_cache.lengths.tolist() == [2 + 4 - 1, 1 + 2 - 1]
    assert reads == 3 and syncs == 1 and got.stats.rounds == 4


# ----------------------------------------------------------------------------- GPU

@functools.lru_cache(maxsize=None)
def demo_target() -> Model:
    from kdtree_numba import demo
    return Model.load(demo.TARGET, "numba")


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=1.0, top_p=0.9, top_k=50)],
                         ids=["greedy", "T1", "T1-top-p-k"])
@pytest.mark.parametrize("steps", [2, 4])
def test_gpu_device_ar_steps_on_the_demo_pair(monkeypatch, sampling, steps):
    """The demo target on the GPU under ``KDTREE_AR_DEVICE_STEPS``: the host loop's tokens
    (``=0``; the same seed at T > 0) at batch 1 and in a ragged batch of 3, the cache
    lengths it leaves; the first generation captures the program, the second captures
    nothing and replays one graph a launch (plus the prefill's), one read a launch.  Unset,
    the GPU runs 4 steps a launch."""
    from test_demo_pair import heldout_ids
    model = demo_target()
    assert model.graphs is not None
    monkeypatch.delenv("KDTREE_AR_DEVICE_STEPS", raising=False)
    assert steps_per_launch(model.backend) == runtime.AR_STEPS_ON
    prompts = heldout_ids(4)
    kw = dict(seed=3, **sampling)
    for batch in (prompts[:1], prompts[1:4]):
        monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", "0")
        want = generate(model, batch, 61, **kw)
        lengths = model.generation_cache.lengths.tolist()
        monkeypatch.setenv("KDTREE_AR_DEVICE_STEPS", str(steps))
        first = generate(model, batch, 61, **kw)
        again, reads, syncs = counted([model.backend], lambda: generate(model, batch, 61, **kw))
        assert first.tokens == want.tokens == again.tokens
        assert model.generation_cache.lengths.tolist() == lengths
        launches = reads - 1
        assert syncs == 1 and again.stats.rounds == steps * launches
        assert launches == -(-60 // steps)           # no eos: every launch advances K
        assert first.stats.graph_captures >= 1
        assert again.stats.graph_captures == 0 and again.stats.graph_replays >= launches
        assert model.graphs.kinds()["ar_steps"] >= 1
        assert again.stats.time["decode"] > 0

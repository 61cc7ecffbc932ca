"""tools/bench_demo.py and its helpers (issue 36, item 5): the measurement must not mislead.

* The warm-up covers what the timed prompts run for the first time: ``cache_bucket`` is the
  KV-cache capacity ``generate`` really makes (every method, auto included), ``warm_plan``
  picks each bucket's shortest and longest prompt and every distinct length, ``warm_up``
  prefills first and pins each of auto's candidates in auto's own cache.
* The round clock's split is the host clock's (wall = wait + host, the reads still one per
  round), and it gives the backend its own methods back; the first-call counter counts only
  calls that made a kernel; the GPU sampler averages its readings.
* End to end on the reference backend (the shipped demo target, tiny settings): prompts
  without an ``id`` compare by position (they used to all be MISMATCH), every method gives
  AR's tokens, the warm-up's seconds are a column and a line of their own, the round table
  and the JSON are written; a forced mismatch is loud and exit 1; a peer that differs is
  reported, not fatal; the real transformers peers on the CPU (slow).
"""
from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kdtree_numba.budget import AutoBudget
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.device_ar import steps_per_launch
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_demo  # noqa: E402
import bench_demo_peers  # noqa: E402
import bench_demo_timing as timing  # noqa: E402

@pytest.fixture(scope="module")
def tiny():
    cfg = size_config("tiny", num_hidden_layers=1)
    weights = dict(random_weights(cfg, 3))
    target = Model(cfg, weights, "reference")
    return target, NoisyOracleDrafter(Model(cfg, weights, "reference"), 3, agreement=0.8,
                                      seed=1)


def text_prompts(tmp_path, texts=("def f(x):\n", "import os\n")):
    """A prompt file whose lines have only a text, as the --prompt-file help asks."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


# ----------------------------------------------------------------------------- the warm-up

@pytest.mark.parametrize("method,budget", [("ar", None), ("chain", None), ("ddtree", 4),
                                           ("ddtree", "auto")])
@pytest.mark.parametrize("prompt_len,max_new", [(3, 2), (250, 3)])
def test_cache_bucket_is_the_cache_generate_makes(tiny, method, budget, prompt_len, max_new):
    target, drafter = tiny
    ids = list(np.arange(prompt_len) % (target.vocab_size - 1) + 1)
    target.generation_cache = None
    generate(target, [ids], max_new, method=method, budget=budget or 32,
             drafter=drafter if method != "ar" else None)
    want = timing.cache_bucket(prompt_len, max_new, method, budget, drafter.block_len)
    assert target.generation_cache.max_len == want


def test_cache_bucket_crosses_at_the_engines_max_len():
    # max_len = prompt + new + L + 1 + the wider of the verify (budget + 1) and the drafter's
    # block (L + 1), with device rounds L + 1 more; AR: prompt + new + 1 + 1
    assert timing.cache_bucket(254, 0, "ar", None, 7) == 256
    assert timing.cache_bucket(255, 0, "ar", None, 7) == 512
    assert timing.cache_bucket(96, 128, "ddtree", 8, 15) == 256       # 96+128+16+16 = 256
    assert timing.cache_bucket(97, 128, "ddtree", 8, 15) == 512
    assert timing.cache_bucket(95, 128, "ddtree", 16, 15) == 256      # 95+128+16+17 = 256
    assert timing.cache_bucket(96, 128, "ddtree", 16, 15) == 512
    assert timing.cache_bucket(79, 128, "ddtree", 16, 15, on_device=True) == 256   # +16
    assert timing.cache_bucket(80, 128, "ddtree", 16, 15, on_device=True) == 512
    assert timing.cache_bucket(10, 10, "ddtree", "auto", 15) == 512   # 10+10+257+16
    assert timing.cache_bucket(10, 10, "ddtree", timing.PinnedBudget(8), 15) == 512
    assert timing.cache_bucket(214, 10, "chain", 999, 15) == 256      # the chain: L nodes
    assert timing.cache_bucket(214, 10, "ddtree", 16, 15) == 512


def test_warm_plan_takes_each_buckets_lengths_its_shortest_longest_and_padded_lengths():
    lengths = [30, 200, 40, 250, 30, 120, 60]
    plan = timing.warm_plan(lengths, 4, "ar", None, 7)
    # AR: max_len = n + 4 + 2 -> 256 up to n = 250; padded prefills of 32 (30), 64 (40, 60),
    # 128 (120) and 256 rows (200, 250): each one's shortest prompt, and the longest
    assert plan == {256: ([30, 40, 60, 120, 200, 250], [0, 1, 2, 3, 5])}
    plan = timing.warm_plan(lengths, 10, "ar", None, 7)
    assert plan == {256: ([30, 40, 60, 120, 200], [0, 1, 2, 5]), 512: ([250], [3])}


def test_warm_up_prefills_first_then_pins_every_auto_candidate(monkeypatch):
    calls = []

    def fake_generate(model, prompts, n, **kw):
        b = kw["budget"]
        calls.append(("gen", prompts[0][0], b.pinned if isinstance(b, timing.PinnedBudget)
                      else b))

    def fake_prefill(model, drafter, method, ids, cache):
        calls.append(("prefill", len(ids), cache))

    class State(timing.WarmState):
        def cache(self, model, bucket):          # no model here: the bucket stands for it
            return bucket
    monkeypatch.setattr(timing, "generate", fake_generate)
    monkeypatch.setattr(timing, "_prefill_like_generate", fake_prefill)
    drafter = SimpleNamespace(block_len=7, name="d")
    prompts = [{"ids": [7] * 30}, {"ids": [8] * 40}, {"ids": [9] * 30}]
    state = State()
    got = timing.warm_up(None, drafter, prompts, "ddtree", "auto", 0.0, 4, 0, state)
    cands = list(AutoBudget().candidates)
    assert calls == [("prefill", 30, 512), ("prefill", 40, 512)] + \
        [("gen", 7, b) for b in cands] + [("gen", 7, "auto")] + \
        [("gen", 8, b) for b in cands] + [("gen", 8, "auto")]
    assert got["generate_calls"] == 2 * (len(cands) + 1) and got["prefills"] == 2
    assert got["buckets"] == [512]
    calls.clear()                           # a later row: the same prefills are not redone
    timing.warm_up(None, drafter, prompts, "ddtree", 4, 0.0, 4, 0, state)
    assert calls == [("prefill", 30, 256), ("prefill", 40, 256)] + [("gen", 7, 4)] * 2 + \
        [("gen", 8, 4)] * 2
    calls.clear()
    timing.warm_up(None, drafter, prompts, "ddtree", 8, 0.0, 4, 0, state)
    assert calls == [("gen", 7, 8)] * 2 + [("gen", 8, 8)] * 2


def test_pinned_budget_runs_its_budget_in_autos_cache(tiny):
    target, drafter = tiny
    target.generation_cache = None
    res = generate(target, [[1, 2, 3]], 6, method="ddtree", drafter=drafter,
                   budget=timing.PinnedBudget(8))
    assert set(res.stats.budgets) == {8}
    assert target.generation_cache.max_len == timing.cache_bucket(3, 6, "ddtree", "auto", 3)


def test_warm_prefills_run_in_a_scratch_cache_the_timed_prompts_never_meet(tiny):
    """A prefill's CUDA-graph key names its cache's buffers: swept in the generation cache
    it would make every timed prefill a second call, i.e. a capture."""
    target, drafter = tiny
    target.generation_cache = None
    state = timing.WarmState()
    scratch = state.cache(target, 256)
    timing._prefill_like_generate(target, drafter, "ddtree", [1, 2, 3], scratch)
    assert scratch.max_len == 256 and int(scratch.lengths[0]) == 3
    assert state.cache(target, 256) is scratch and int(scratch.lengths[0]) == 0   # emptied
    generate(target, [[1, 2, 3]], 2, method="ddtree", drafter=drafter, budget=4)
    gen = target.generation_cache
    assert gen.max_len == 256 and gen is not scratch
    assert gen.buffer_key() != scratch.buffer_key()


# ----------------------------------------------------------------------------- the meters

def test_round_clock_splits_the_host_clock_and_restores_the_backend(tiny):
    target, _ = tiny
    be = target.backend
    clock = timing.RoundClock(be)
    slept = 0.004
    real, started = type(be).read_later, []

    def slow_first(a):            # the first read (the prefill's) blocks the host 4 ms
        wait = real(be, a)
        started.append(a)
        return wait if len(started) > 1 else (lambda: (time.sleep(slept), wait())[1])
    be.read_later = slow_first
    try:
        reads = be.reads
        t0 = time.perf_counter()
        with clock.timing():
            res = generate(target, [[1, 2, 3]], 5, progress=clock.progress)
        wall = time.perf_counter() - t0
        got = clock.last
        assert be.read_later is slow_first   # the instance's own attribute given back
    finally:
        del be.read_later
    assert "to_host" not in vars(be) and "read_later" not in vars(be)
    assert be.reads - reads == 1 + res.stats.rounds     # the wrapper adds no read
    assert 0 < got["prefill"] + got["rounds"] <= wall
    assert got["prefill"] >= slept                      # the prefill's read is its own
    assert got["host"] == pytest.approx(got["rounds"] - got["wait"])
    # AR reads each step's tokens through read_later too, not slowed here: the rounds waited
    # less than the one slow read
    assert 0 <= got["wait"] < slept


def test_round_clock_counts_the_wait_of_read_later(tiny):
    target, _ = tiny
    be = target.backend
    real = type(be).read_later

    def slow(a):                   # its wait() blocks 3 ms, as a read of a busy device
        w = real(be, a)
        return lambda: (time.sleep(0.003), w())[1]
    be.read_later = slow
    clock = timing.RoundClock(be)
    try:
        with clock.timing():
            res = generate(target, [[1, 2, 3]], 6, progress=clock.progress)
    finally:
        del be.read_later
    # each AR step after the prefill is read once through wait()
    assert clock.last["wait"] >= 0.003 * (res.stats.rounds - 1)
    assert clock.last["host"] == pytest.approx(clock.last["rounds"] - clock.last["wait"])


def test_first_calls_counts_only_calls_that_made_a_kernel():
    class Dispatcher:
        def __init__(self):
            self.overloads = {}

        def compile(self, sig):
            if sig not in self.overloads:
                time.sleep(0.01)
                self.overloads[sig] = object()
            return self.overloads[sig]
    original = Dispatcher.compile
    meter = timing.FirstCalls(True, dispatcher_cls=Dispatcher)
    d = Dispatcher()
    with meter.counting():
        d.compile("a")
        d.compile("a")
        d.compile("b")
    assert meter.kernels == 2 and meter.seconds >= 0.02
    assert Dispatcher.compile is original
    off = timing.FirstCalls(False, dispatcher_cls=Dispatcher)
    with off.counting():
        d.compile("c")
    assert off.kernels is None and off.seconds is None


def test_gpu_busy_is_none_off_the_gpu_and_averages_its_readings():
    busy = timing.GpuBusy(None)
    with busy.sampling():
        pass
    assert busy.share is None and busy.read() is None

    class Fake(timing.GpuBusy):
        def read(self):
            return 0.25
    fake = Fake(None, interval=0.001)
    fake._lib = object()            # as if NVML had answered
    with fake.sampling():
        time.sleep(0.03)
    assert fake.share == 0.25 and fake.samples >= 1


# ----------------------------------------------------------------------------- end to end

TINY = ["--prompts", "2", "--max-new-tokens", "4", "--drafter", "oracle:0.9", "--backend",
        "reference", "--temperature", "0", "--no-peers"]


def test_end_to_end_prompts_without_ids_warm_up_apart(tmp_path, capsys):
    pytest.importorskip("matplotlib")          # --plot (the plot extra; CI's test extra)
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    argv = TINY + ["--budgets", "4", "--warmup", "--prompt-file", text_prompts(tmp_path),
                   "--json", str(js), "--plot", str(png)]
    assert bench_demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out
    assert "| method | budget | T | tau | tokens/s | speedup vs AR" in out
    assert "warm-up s (untimed) |" in out and "engine warm-up: " in out and " s untimed" in out
    assert "| method | budget | T | wall | wait | host |" in out
    data = json.loads(js.read_text())
    rows = data["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == \
        [("ar", None), ("chain", None), ("ddtree", 4)]
    for r in rows:                      # lossless: every method gives AR's tokens
        assert r["identical"] == r["compared"] == 2 and not r["mismatches"]
        assert r["new_tokens"] == 8 and r["tokens_per_s"] > 0
        assert r["warmup_seconds"] > 0 and r["timing"]["warmup"]["generate_calls"] >= 1
        assert r["wall_ms_per_round"] == pytest.approx(r["wait_ms_per_round"]
                                                       + r["host_ms_per_round"])
        assert r["gpu_idle_share"] is None and r["timed_kernels"] is None
    # the timed seconds hold no warm-up: each row's seconds are its prompts' generate calls
    runs = data["per_prompt"]
    for r in rows:
        got = runs[f"{r['method']}:{r['budget']}:0"]
        assert r["seconds"] == pytest.approx(sum(p["seconds"] for p in got))
        assert [p["key"] for p in got] == [0, 1] and [p["id"] for p in got] == [0, 1]
        for p in got:
            assert p["host"]["prefill"] + p["host"]["rounds"] >= p["seconds"]
    assert rows[0]["tau"] == 1.0 and all(r["tau"] >= 1 for r in rows)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_end_to_end_auto_row_and_agreement(tmp_path, capsys):
    js, path = tmp_path / "b.json", tmp_path / "ids.jsonl"
    path.write_text('{"id": "a7", "text": "x = 1\\n"}\n{"id": 9, "text": "def h(y):\\n"}\n')
    argv = TINY + ["--budgets", "auto", "--no-warmup", "--prompt-file", str(path),
                   "--json", str(js)]
    assert bench_demo.main(argv) == 0
    out = capsys.readouterr().out
    assert "engine warm-up: off" in out and "MISMATCH" not in out
    data = json.loads(js.read_text())
    auto = data["rows"][-1]
    assert auto["budget"] == "auto" and auto["identical"] == 2
    budgets = [b for p in data["per_prompt"]["ddtree:auto:0"] for b in p["budgets"]]
    assert budgets and set(budgets) <= set(AutoBudget().candidates)
    agree = data["agreement"]
    assert len(agree["top1"]) == 7 and agree["anchors"][0] == 2 * 3    # anchors 1..3
    assert [p["id"] for p in data["per_prompt"]["ar:None:0"]] == ["a7", 9]   # the file's


def test_mismatch_is_loud_and_exit_1(monkeypatch, capsys, tmp_path):
    real = bench_demo.generate

    def broken(model, prompts, n, **kw):     # a "lossy" DDTree: its last token is off by one
        res = real(model, prompts, n, **kw)
        if kw["method"] == "ddtree":
            res.tokens[0][-1] = (res.tokens[0][-1] + 1) % model.vocab_size
        return res

    monkeypatch.setattr(bench_demo, "generate", broken)
    argv = ["--prompts", "1", "--max-new-tokens", "4", "--budgets", "4", "--drafter",
            "oracle:1", "--backend", "reference", "--temperature", "0",
            "--agreement-stride", "0", "--no-peers", "--prompt-file",
            text_prompts(tmp_path, ["def g():\n"])]
    assert bench_demo.main(argv) == 1
    captured = capsys.readouterr()
    assert "**MISMATCH** 0/1" in captured.out
    assert "MISMATCH: ddtree budget 4 T = 0, prompt 0: tokens differ from AR's from new " \
           "token 3" in captured.err


@pytest.mark.parametrize("line,why", [("{not json\n", "not JSON"),
                                      ('{"id": 3}\n', 'needs a "text" string'),
                                      ("\n", "no prompts")])
def test_bad_prompt_file_is_one_line(tmp_path, line, why):
    path = tmp_path / "p.jsonl"
    path.write_text(line)
    with pytest.raises(SystemExit) as e:
        bench_demo.read_prompts(str(path), 4, SimpleNamespace(encode=lambda t: [0, 1]))
    assert why in str(e.value) and "\n" not in str(e.value)


def test_compile_line_keeps_first_calls_apart_and_names_what_leaked_into_timing():
    def row(method, warm, made, inside, caps):
        return dict(method=method, warmup_seconds=warm, warmup_compile_seconds=made,
                    timed_compile_seconds=inside, timed_graph_captures=caps)
    rows = [row("ar", 30.0, 25.0, 0.5, 3), row("ddtree", 2.0, 1.0, 0.0, 0),
            row("hf generate", 4.0, None, None, None)]
    text = bench_demo.compile_line(rows)
    assert text == ("engine warm-up: 32.0 s untimed, of which numba made kernels for 26.0 s; "
                    "inside the timed rows: 0.50 s of kernel making, 3 graph captures\n"
                    "peers' warm-up: 4.0 s untimed")


class FakePeer:
    """transformers' generate() stood in: AR's tokens, the last one changed for one mode."""
    info = dict(transformers="x", torch="y", dtype="float32", device="cpu", attention="sdpa",
                load_seconds=0.0)

    def __init__(self, hf_dir, dtype, device):
        assert os.path.exists(os.path.join(hf_dir, "config.json"))   # bundle_to_hf ran
        self.calls = []

    def generate(self, ids, n, extra):
        self.calls.append((len(ids), dict(extra)))
        tokens = list(FakePeer.want[tuple(ids)])
        if extra:
            tokens[-1] += 1
        return tokens, 0.01

    def close(self):
        pass


def test_peers_are_rows_their_differences_reported_not_fatal(monkeypatch, capsys, tmp_path):
    model = Model.load(bench_demo.demo.TARGET, "reference")
    codec = bench_demo.load_codec(bench_demo.demo.TARGET)
    prompts = bench_demo.read_prompts(text_prompts(tmp_path), 2, codec)
    ar = [dict(key=p["key"], id=p["label"], seconds=0.02, new_tokens=3,
               tokens=generate(model, [p["ids"]], 3).tokens[0]) for p in prompts]
    FakePeer.want = {tuple(p["ids"]): r["tokens"] for p, r in zip(prompts, ar)}
    monkeypatch.setattr(bench_demo_peers, "HFPeer", FakePeer)
    monkeypatch.setattr(bench_demo_peers, "available", lambda: None)   # torch not needed
    monkeypatch.setattr(bench_demo_peers, "peer_device", lambda on_gpu: "cpu")
    args = bench_demo.parse_args(["--max-new-tokens", "3", "--hf-dtype", "float32"])
    rows, runs = [], {}
    stop = bench_demo.Stop(0)
    try:
        info = bench_demo.measure_peers(args, model, prompts, ar, bench_demo.Meters(
            model.backend), stop, runs, rows)
    finally:
        stop.close()
    assert "tokenizer.json" in info["export"]
    assert [r["method"] for r in rows] == ["hf generate", "hf prompt lookup"]
    assert rows[0]["identical"] == 2 and rows[1]["identical"] == 0
    assert rows[1]["mismatches"][0]["first"] == 2
    assert rows[0]["tokens_per_s"] == pytest.approx(300)     # 3 tokens in 0.01 s
    assert rows[0]["speedup"] == pytest.approx(2.0)          # AR: 3 tokens in 0.02 s
    cells = bench_demo.table(rows, "reference")
    assert "0/2 (differs)" in cells and "MISMATCH" not in cells
    ar[1]["seconds"] = 0.06                 # --peer-prompts 1: compared with AR's first only
    args = bench_demo.parse_args(["--max-new-tokens", "3", "--peer-prompts", "1"])
    rows = []
    stop = bench_demo.Stop(0)
    try:
        bench_demo.measure_peers(args, model, prompts, ar, bench_demo.Meters(model.backend),
                                 stop, {}, rows)
    finally:
        stop.close()
    assert [r["compared"] for r in rows] == [1, 1] and rows[0]["prompts"] == 1
    assert rows[0]["speedup"] == pytest.approx(2.0)


def test_a_peer_that_cannot_run_loses_no_engine_row(monkeypatch, capsys, tmp_path):
    def broken(*a, **k):
        raise RuntimeError("CUDA error: out of memory\nmore")
    monkeypatch.setattr(bench_demo_peers, "available", lambda: None)
    monkeypatch.setattr(bench_demo_peers, "export_target", broken)
    js = tmp_path / "b.json"
    argv = ["--prompts", "1", "--max-new-tokens", "2", "--budgets", "4", "--drafter",
            "oracle:1", "--backend", "reference", "--temperature", "0", "--no-warmup",
            "--agreement-stride", "0", "--prompt-file", text_prompts(tmp_path, ["x = 2\n"]),
            "--json", str(js)]
    assert bench_demo.main(argv) == 0
    err = capsys.readouterr().err
    assert "bench_demo: peers failed: RuntimeError: CUDA error: out of memory\n" in err
    data = json.loads(js.read_text())
    assert [r["method"] for r in data["rows"]] == ["ar", "chain", "ddtree"]
    assert data["peers"] == {"failed": "RuntimeError: CUDA error: out of memory"}


@pytest.mark.slow
def test_transformers_peers_on_the_cpu(tmp_path, capsys):
    """The real peers: the demo target exported by tools/bundle_to_hf.py, transformers'
    generate() and its prompt lookup, float32 on the CPU; at float32 they give the engine's
    AR tokens on these prompts (measured; reported, not judged, by the tool)."""
    pytest.importorskip("transformers")
    js = tmp_path / "b.json"
    argv = ["--prompts", "2", "--max-new-tokens", "4", "--budgets", "4", "--drafter",
            "oracle:0.9", "--backend", "reference", "--temperature", "0", "--no-warmup",
            "--agreement-stride", "0", "--prompt-file", text_prompts(tmp_path),
            "--json", str(js)]
    assert bench_demo.main(argv) == 0
    data = json.loads(js.read_text())
    peers = {r["method"]: r for r in data["rows"] if r["method"].startswith("hf")}
    assert set(peers) == {"hf generate", "hf prompt lookup"}
    for r in peers.values():
        assert r["new_tokens"] == 8 and r["tokens_per_s"] > 0 and r["warmup_seconds"] > 0
        assert r["identical"] == r["compared"] == 2
    assert data["peers"]["dtype"] == "float32" and data["peers"]["device"] == "cpu"


# ----------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
def test_gpu_meters_count_a_real_compile_and_read_nvml():
    """The GPU-only instruments on a real device: a fresh kernel's first launch is counted
    (and its second is not), NVML answers for the CUDA device, and the round clock keeps one
    read per AR launch on the numba backend: the prefill's, then one a step in the host's
    loop, one a block of K steps under device AR (``runtime.current().ar_device_steps``, the
    GPU's default: 4), 15 steps after the prefill's token."""
    from numba import cuda

    @cuda.jit
    def fill(a, v):
        i = cuda.grid(1)
        if i < a.size:
            a[i] = v

    a = cuda.device_array(64, np.float32)
    meter = timing.FirstCalls(True)
    with meter.counting():
        fill[1, 64](a, 1.0)
    assert meter.kernels == 1 and meter.seconds > 0
    with meter.counting():
        fill[1, 64](a, 2.0)
    assert meter.kernels == 0
    import cupy
    busy = timing.GpuBusy(cupy.cuda.Device().pci_bus_id, interval=0.01)
    v = busy.read()
    assert v is not None and 0.0 <= v <= 1.0
    cfg = size_config("tiny", num_hidden_layers=1)
    target = Model(cfg, dict(random_weights(cfg, 3)), "numba")
    clock = timing.RoundClock(target.backend)
    reads = target.backend.reads
    with busy.sampling(), clock.timing():
        res = generate(target, [[1, 2, 3]], 16, progress=clock.progress)
    K = steps_per_launch(target.backend)
    launches = -(-15 // K) if K else 15
    assert target.backend.reads - reads == 1 + launches, (K, res.stats.rounds)
    assert res.stats.rounds == (K * launches if K else 15)
    assert clock.last["rounds"] > 0 and 0 <= clock.last["wait"] <= clock.last["rounds"]
    assert busy.share is None or 0.0 <= busy.share <= 1.0

"""How tools/bench_demo.py keeps first-call work out of its timed rows and times each round.

**What the warm-up must cover** (:func:`warm_up`).  On the GPU the first call of a kernel
signature compiles it (numba; the kernel cache, kdtree_numba/kernel_cache.py, turns that
into a load from disk in a later process), and the tiled GEMMs and attention are configured
by the row count, so each prefill width can need its own kernels; the decode and verify
forwards and the round's device steps are captured as CUDA graphs on their second call, and
a graph's key names the KV cache's buffers (a device round's: the target's and the
drafter's, which take one capacity), whose capacity ``generate`` rounds up to a multiple of
``CACHE_BUCKET`` (kdtree_numba/model.py) from the prompt's length, the token count, the
verify width, the drafter's depth and, with device rounds, the round run ahead (AR's steps
on the device: their K a launch) (``engine.cache_slots``, :func:`cache_bucket`; the warm-up
asks ``engine.runs_device_rounds`` and ``device_ar.steps_per_launch`` as ``generate``
does).  So per configuration (method, budget, temperature) the warm-up

1. prefills every distinct prompt length of the timed prompts once into a scratch cache of
   each capacity bucket that configuration will use (the prefill ``generate`` makes: with
   the drafter's feature layers, or the hidden state a block drafter needs; once per run,
   :class:`WarmState` says why a scratch cache);
2. then runs ``generate`` in full on the shortest and the longest timed prompt of each
   bucket and on one prompt of each padded prefill length in it (``prefill_rows``: on the
   GPU a prompt runs as the next of a few row counts, each a CUDA graph), twice (its rounds
   repeat their shapes, so the second round captures what the first compiled; the second
   call captures the prompt's prefill); for ``auto`` once per candidate budget, pinned, in
   auto's own (widest) cache, then once as auto itself.

So the timed prompts' prefills replay graphs of their padded length (the engine's behaviour
for any caller: a padded length is captured on its second call).  The model keeps a
generation cache per capacity bucket
(``GENERATION_CACHES``, kdtree_numba/model.py) and at most ``graphs.max_graphs(kind)`` graphs
of a kind (kdtree_numba/graphs.py, least recently used dropped; the prefills a kind of their
own, so they never push a round's graphs out; auto's 8 candidates need 8 round graphs per
bucket, 16 for the 40 first held-out prompts' 2 buckets, within the kind's 24, and
``KDTREE_AUTO_V2=1`` keeps 64): a row with more shapes than that recaptures them while
timed.  tests/test_bench_demo_graph_keys.py runs a row's warm-up and timed prompts under
GraphCache's rules over the real keys and asserts every timed call replays.

Whatever still ran for the first time inside a timed row is counted there, not hidden:
:class:`FirstCalls` adds up the seconds numba spent making new kernels (compiles and
kernel-cache loads: ``CUDADispatcher.compile`` calls that added an overload) and the CUDA
graphs captured (``GenerationStats.graph_captures``).  Both should read 0.

**The round clock** (:class:`RoundClock`): the host clock around one ``generate`` call.  The
engine's ``progress`` callback fires first right after the prefill's read, so ``prefill``
is the host time from the call to then and ``rounds`` the host time from then to the
return; ``wait`` is the part of ``rounds`` the host spent blocked in the backend's device
reads (``Backend.to_host`` and the ``wait()`` of ``read_later``, wrapped on the backend
instance for the call), and ``host = rounds - wait`` the host's own work (bookkeeping,
drafting and launching, uploads).  The engine's phase times (``GenerationStats.time``,
CUDA events) are the device's timeline between markers, idle gaps included
(docs/ENGINE.md, "Timing without syncs"), so their sum is about the wall time and says
nothing about idling.

**GPU idle share** (:class:`GpuBusy`): 1 - busy / wall over a row's timed prompts, where
busy / wall is the mean of NVML's ``utilization.gpu`` (the share of its sample period, 1/6
to 1 s, in which any kernel ran on the device), read every ``interval`` seconds by a
thread while the row runs.  GPU only, through the driver's libnvidia-ml; None where that
cannot be read.  A lower bound on idling, coarse for rows shorter than a few seconds: a
kernel that runs on a single SM counts as busy.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time

import numpy as np

from kdtree_numba import runtime
from kdtree_numba.budget import AutoBudget
from kdtree_numba.device_ar import steps_per_launch
from kdtree_numba.engine import cache_slots, generate, runs_device_rounds
from kdtree_numba.model import CACHE_BUCKET, prefill_rows

__all__ = ["cache_bucket", "warm_plan", "warm_up", "WarmState", "PinnedBudget", "RoundClock",
           "FirstCalls", "GpuBusy"]


def cache_bucket(prompt_len: int, max_new: int, method: str, budget, block_len: int,
                 on_device: bool = False) -> int:
    """The KV-cache capacity ``generate`` gives one prompt of ``prompt_len`` tokens at batch
    1, its target cache's and its drafter's alike: ``engine.cache_slots`` (with device rounds,
    ``on_device``, room for the round run ahead) rounded up to CACHE_BUCKET as
    ``Model.cache_for_generation`` does.  tests/test_bench_demo.py and
    tests/test_bench_demo_graph_keys.py hold it to the caches the engine makes."""
    slots = cache_slots(prompt_len + max_new, method, budget, block_len, on_device,
                        runtime.current().rounds_per_launch)
    return -(-slots // CACHE_BUCKET) * CACHE_BUCKET


def warm_plan(lengths, max_new: int, method: str, budget, block_len: int,
              on_device: bool = False) -> dict:
    """bucket -> (distinct prompt lengths in it, indices of the prompts to generate from: the
    shortest, the longest, and one of each padded prefill length, ``prefill_rows``, whose
    CUDA graph a generation's cache of the bucket captures) over the timed prompts'
    ``lengths`` (``on_device``: generate runs device rounds, :func:`cache_bucket`)."""
    plan: dict = {}
    for i, n in enumerate(lengths):
        lens, ends = plan.setdefault(cache_bucket(n, max_new, method, budget, block_len,
                                                  on_device), (set(), []))
        lens.add(int(n))
        ends.append(i)

    def chosen(ends):
        by_rows = {}
        for i in sorted(ends, key=lambda i: lengths[i]):
            by_rows.setdefault(prefill_rows(lengths[i]), i)
        return sorted({min(ends, key=lambda i: lengths[i]),
                       max(ends, key=lambda i: lengths[i])} | set(by_rows.values()))
    return {b: (sorted(lens), chosen(ends)) for b, (lens, ends) in sorted(plan.items())}


class PinnedBudget(AutoBudget):
    """An AutoBudget that always picks ``budget``: the warm-up runs each of auto's candidates
    in auto's own cache (its capacity is set by the widest candidate), so the timed auto row
    replays graphs captured against the same buffers."""

    def __init__(self, budget: int):
        super().__init__()
        self.pinned = int(budget)

    def next_budget(self) -> int:
        return self.pinned


class WarmState:
    """What the warm-ups of one run share: the (bucket, length, kind) prefills done, and one
    scratch KV cache per bucket that they run in, kept for the whole run.  Not the model's
    generation cache: a CUDA graph is captured on a key's second call and a prefill's key
    names the cache's buffers, so a prefill swept in the generation cache would make every
    timed prompt's prefill a capture; a scratch cache compiles the same kernels (the split
    plan follows the capacity) under keys the timed prompts never meet (kept alive, so its
    buffers' addresses are not handed to another cache)."""

    def __init__(self):
        self.prefilled: set = set()
        self.caches: dict = {}

    def cache(self, model, bucket: int):
        if bucket not in self.caches:
            self.caches[bucket] = model.new_cache(1, bucket)
        cache = self.caches[bucket]
        cache.truncate(np.zeros(1, np.int64))
        return cache


def _prefill_like_generate(model, drafter, method: str, ids, cache) -> None:
    """The prefill ``generate`` makes for ``ids``, with what the drafter needs, in
    ``cache``."""
    speculative = method != "ar"
    model.prefill(cache, [np.asarray(ids, np.int64)],
                  return_hidden=speculative and bool(getattr(drafter, "needs_target_hidden",
                                                             False)),
                  capture_layers=tuple(getattr(drafter, "feature_layers", None) or ())
                  if speculative else ())
    model.backend.synchronize()


def warm_up(model, drafter, prompts, method: str, budget, temperature: float, max_new: int,
            seed: int, state: WarmState | None = None, draft_temperature=None) -> dict:
    """Run what the timed row will run for the first time (module docstring): first the
    prefills (``state``: shared by the run's rows, so a later row skips what an earlier one
    prefilled), then the generate calls, so the rounds' CUDA graphs are the most recently
    used when timing starts.  Returns its wall seconds, the generate calls and prefills it
    made, and the buckets it covered.  ``draft_temperature``: generate's (a DDTree tree's
    t_d is part of its CUDA graphs' keys)."""
    block_len = drafter.block_len if drafter is not None else 1
    lengths = [len(r["ids"]) for r in prompts]
    # the timed rows' generate calls decide the same way (no device_rounds argument)
    on_device = runs_device_rounds(model, method, drafter)
    if method == "ar":      # AR's steps on the device: K more slots (engine.cache_slots)
        block_len = steps_per_launch(model.backend)
        on_device = block_len > 0
    plan = warm_plan(lengths, max_new, method, budget, block_len, on_device)
    kw = dict(method=method, drafter=drafter if method != "ar" else None,
              budget=budget or 32, temperature=temperature, seed=seed,
              draft_temperature=draft_temperature)
    state = WarmState() if state is None else state
    kind = (method != "ar", getattr(drafter, "name", None))
    t0, calls, prefills = time.perf_counter(), 0, 0
    for bucket, (lens, _) in plan.items():
        for n in lens:
            if (bucket, n, kind) in state.prefilled:
                continue
            ids = next(r["ids"] for r in prompts if len(r["ids"]) == n)
            _prefill_like_generate(model, drafter, method, ids, state.cache(model, bucket))
            state.prefilled.add((bucket, n, kind))
            prefills += 1
    for bucket, (_, ends) in plan.items():
        for i in ends:
            # auto: each candidate pinned, then auto; the rest twice, so the prompt's own
            # prefill (a key of the generation cache) is captured here, not when timed
            runs = [PinnedBudget(b) for b in AutoBudget().candidates] + ["auto"] \
                if budget == "auto" else [kw["budget"]] * 2
            for b in runs:
                generate(model, [prompts[i]["ids"]], max_new, **dict(kw, budget=b))
                calls += 1
    return dict(seconds=time.perf_counter() - t0, generate_calls=calls, prefills=prefills,
                buckets=list(plan))


class RoundClock:
    """Host-clock split of ``generate`` calls (module docstring): use ``with clock.timing():
    generate(..., progress=clock.progress)``, then ``clock.last``: prefill, rounds, wait and
    host seconds of that call."""

    def __init__(self, backend):
        self.backend = backend
        self.last: dict = {}
        self._first = None
        self._waited = 0.0
        self._waited_at_first = 0.0

    def progress(self, done, total) -> None:
        if self._first is None:
            self._first = time.perf_counter()
            self._waited_at_first = self._waited

    def _blocked(self, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._waited += time.perf_counter() - t0
        return timed

    @contextlib.contextmanager
    def timing(self):
        be = self.backend
        to_host, read_later = be.to_host, be.read_later
        before = {k: vars(be)[k] for k in ("to_host", "read_later") if k in vars(be)}

        def read_later_timed(a):
            return self._blocked(read_later(a))
        self._first, self._waited = None, 0.0
        be.to_host, be.read_later = self._blocked(to_host), read_later_timed
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            end = time.perf_counter()
            for k in ("to_host", "read_later"):     # what the instance had: usually nothing
                if k in before:
                    setattr(be, k, before[k])
                else:
                    delattr(be, k)
            first = self._first if self._first is not None else end
            wait = self._waited - self._waited_at_first if self._first is not None else 0.0
            self.last = dict(prefill=first - t0, rounds=end - first, wait=wait,
                             host=end - first - wait)


class FirstCalls:
    """Seconds numba spends making new kernels inside a block (compiles, kernel-cache loads):
    ``CUDADispatcher.compile`` wrapped for the block, each call that added an overload
    counted (``dispatcher_cls``: another class with ``compile`` and ``overloads``, for
    tests).  ``seconds`` and ``kernels`` stay None where numba's CUDA dispatcher is not in
    use (the reference backend, the simulator)."""

    def __init__(self, active: bool, dispatcher_cls=None):
        self.active, self.dispatcher_cls = active, dispatcher_cls
        self.seconds = self.kernels = None

    @contextlib.contextmanager
    def counting(self):
        cls = self.dispatcher_cls
        if self.active and cls is None:
            try:
                from numba.cuda.dispatcher import CUDADispatcher as cls
            except ImportError:
                cls = None
        if not self.active:
            cls = None
        if cls is None:
            yield self
            return
        original = cls.compile
        self.seconds, self.kernels = 0.0, 0
        meter = self

        def compile(dispatcher, sig):
            before = len(dispatcher.overloads)
            t0 = time.perf_counter()
            try:
                return original(dispatcher, sig)
            finally:
                if len(dispatcher.overloads) != before:
                    meter.seconds += time.perf_counter() - t0
                    meter.kernels += 1
        cls.compile = compile
        try:
            yield self
        finally:
            cls.compile = original


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class GpuBusy:
    """NVML's ``utilization.gpu`` of the current CUDA device, sampled by a thread (module
    docstring).  ``with busy.sampling(): ...`` then ``busy.share``: the mean busy share of
    the block, or None where NVML cannot be read."""

    def __init__(self, pci_bus_id: str | None, interval: float = 0.05):
        self.interval, self.share, self.samples = interval, None, 0
        self._lib = self._handle = None
        if not pci_bus_id:
            return
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByPciBusId_v2(
                    ctypes.c_char_p(pci_bus_id.encode()), ctypes.byref(handle)) == 0:
                self._lib, self._handle = lib, handle
        except (OSError, AttributeError):
            pass

    def read(self) -> float | None:
        """One reading, 0..1 (None: NVML unavailable)."""
        if self._lib is None:
            return None
        u = _Utilization()
        if self._lib.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(u)) != 0:
            return None
        return u.gpu / 100.0

    @contextlib.contextmanager
    def sampling(self):
        self.share, self.samples = None, 0
        if self._lib is None:
            yield self
            return
        got, stop = [], threading.Event()

        def loop():
            while not stop.wait(self.interval):
                v = self.read()
                if v is not None:
                    got.append(v)
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.samples = len(got)
            self.share = float(np.mean(got)) if got else None


class Meters:
    """The instruments of one bench_demo run: the round clock, the count of first-call work
    (numba's kernels; GPU only) and the GPU's busy share (NVML; GPU only)."""

    def __init__(self, backend):
        self.clock = RoundClock(backend)
        self.first = FirstCalls(backend.on_gpu and backend.name == "numba")
        pci = None
        if backend.on_gpu:
            try:
                pci = backend.xp.cuda.Device().pci_bus_id
            except Exception:       # no PCI id: the idle share is reported as unknown
                pci = None
        self.busy = GpuBusy(pci)
        self.warm = WarmState()           # what the rows' warm-ups share

"""Issue 36 (run 151): tools/bench_demo.py's warm-up must capture every CUDA graph its timed rows
replay, ``--budget auto`` included.  On the H200 the auto row still captured 7 round graphs
while timed (prompts 0, 3 and 4: ~26% of the row's time): those prompts' target cache and
drafter cache were of different capacity buckets (a pair the warm-up never ran), and the
warm-up's plan put them in the wrong bucket (it left out the device rounds' run-ahead room).

Here the GPU's graph bookkeeping runs without a GPU: :class:`RecordedGraphs` stands in for
both models' GraphCache (the target's, the DFlash drafter's own model's) and applies its rules
to the keys the real code makes (``GraphCache.stored_key``, a key captured on its second
call, the least recently used of a kind dropped past ``graphs.max_graphs``), while the work
itself runs eagerly, as it computes the same.  The tiny pair runs on the reference backend
with device rounds on (``KDTREE_DEVICE_ROUNDS=1``) and padded prefills, as on the GPU; the
keys name the same buffers there (``kvlayout.device_address`` reads a host array's address
as it does a device one's).  ``bench_demo.run_config`` runs its real warm-up and its timed
prompts; every graph call of the timed prompts must be a replay."""
from __future__ import annotations

import collections
import os
import sys
from types import SimpleNamespace

import pytest

from kdtree_numba import graphs
from kdtree_numba.dflash import DFlashDrafter
from kdtree_numba.graphs import GraphCache
from kdtree_numba.model import Model
from test_dflash import parts2

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import bench_demo  # noqa: E402
import bench_demo_timing as timing  # noqa: E402

MAX_NEW = 8
# with the pair's L = 4, auto's widest verify (257) and MAX_NEW, capacity buckets 512 and
# 768: 233's target slots used to fit 512 while its drafter's (5 more) did not, a pair of its
# own that the old plan never ran (it put 233 and 240 under 512, having left out the device
# rounds' run-ahead room, and picked 200 for their padded prefill length of 256 rows and 240
# as the longest)
LENGTHS = (3, 200, 233, 240)


class RecordedGraphs:
    """GraphCache's bookkeeping without CuPy (kdtree_numba/graphs.py): ``call`` says what the
    GPU would do with a key (replay a held graph; run eagerly on its first sight; capture on
    its second, evicting past the kind's cap) and returns None, so the caller runs the work
    eagerly.  ``log``: (what, key, phase) of every call; ``captures``/``replays`` count as
    GraphCache's do (a capture replays at once)."""

    def __init__(self):
        self.held: collections.OrderedDict = collections.OrderedDict()
        self.seen: dict = {}
        self.captures = self.replays = 0
        self.log: list = []
        self.phase = "warm-up"

    def call(self, key, fn, inputs, specs, borrow=False, before_capture=None):
        key = GraphCache.stored_key(key)
        if key in self.held:
            what = "replay"
            self.held.move_to_end(key)
        else:
            if len(self.seen) >= graphs.MAX_SEEN:
                self.seen.clear()
            self.seen[key] = self.seen.get(key, 0) + 1
            what = "eager" if self.seen[key] < 2 else "capture"
            if what == "capture":
                del self.seen[key]
                self.held[key] = True
                self.captures += 1
                for old in graphs.evicted(self.held, key[0]):
                    del self.held[old]
        self.replays += what != "eager"
        self.log.append((what, key, self.phase))
        return None

    def timed(self, kind=None) -> list:
        return [(what, key) for what, key, phase in self.log
                if phase == "timed" and (kind is None or key[0] == kind)]


def pair_with_recorders():
    tcfg, tw, dcfg, dw, spec = parts2()
    target = Model(tcfg, tw, "reference")
    target.pad_prefills = True                   # as on the GPU (Model.prefill_width)
    drafter = DFlashDrafter(target, dcfg, dw, spec)
    target.graphs, drafter.model.graphs = RecordedGraphs(), RecordedGraphs()
    return target, drafter


def run_row(monkeypatch, target, drafter, budget, prompts):
    """bench_demo.run_config's row (its warm-up, then its timed prompts) of ``budget``; the
    recorders' phase turns "timed" when the warm-up returns."""
    real = bench_demo.warm_up

    def warm_up(*args, **kw):
        out = real(*args, **kw)
        target.graphs.phase = drafter.model.graphs.phase = "timed"
        return out
    monkeypatch.setattr(bench_demo, "warm_up", warm_up)
    args = SimpleNamespace(max_new_tokens=MAX_NEW, seed=0)
    target.graphs.phase = drafter.model.graphs.phase = "warm-up"
    out, _ = bench_demo.run_config(target, drafter, prompts, "ddtree", budget, 0.0, args,
                                   True)
    return out


def prompts_of(lengths):
    return [{"ids": [1 + (7 * i + j) % 120 for j in range(n)], "key": i, "label": i}
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("auto_v2", [
    pytest.param(False, marks=pytest.mark.slow),   # the first policy, off by default: ~6 s
    True])
def test_the_warm_up_captures_every_graph_the_timed_rows_replay(monkeypatch, auto_v2):
    """A fixed budget's row, then auto's (one policy across the prompts, as bench_demo keeps
    it), then a fixed budget's again, over prompts of nine lengths in two capacity buckets:
    every graph call of each row's timed prompts (the target's prefills, argmax and device
    rounds; the drafter's context and forwards) replays a graph its warm-up captured, so no
    prompt's ``graph_captures`` is above 0; auto's timed rounds ran several budgets in both
    buckets, each target bucket with the drafter cache of its own capacity."""
    monkeypatch.setenv("KDTREE_DEVICE_ROUNDS", "1")
    monkeypatch.setenv("KDTREE_AUTO_V2", "1" if auto_v2 else "0")
    target, drafter = pair_with_recorders()
    prompts = prompts_of(LENGTHS)
    for budget in (16, "auto", 4):
        for g in (target.graphs, drafter.model.graphs):
            g.log.clear()
        out = run_row(monkeypatch, target, drafter, budget, prompts)
        assert len(out) == len(prompts)
        assert [r["graph_captures"] for r in out] == [0] * len(prompts), budget
        for g in (target.graphs, drafter.model.graphs):
            missed = [(what, key[:3]) for what, key in g.timed() if what != "replay"]
            assert not missed, (budget, missed[:4])
        rounds = target.graphs.timed("round")
        assert rounds and {key[0] for _, key in target.graphs.timed()} >= {"prefill", "round"}
        if budget == "auto":
            budgets = {key[1] for _, key in rounds}
            assert len(budgets) >= 3, budgets
        # a device round's key: the target cache's buffers, then the drafter's (the same
        # layout): one drafter cache per target cache
        width = len(target.generation_cache.buffer_key())
        by_target = collections.defaultdict(set)
        for _, key in rounds:
            by_target[key[6:6 + width]].add(key[6 + width:6 + 2 * width])
        assert len(by_target) == 2 and all(len(v) == 1 for v in by_target.values()), budget

def test_warm_plan_buckets_are_the_caches_device_rounds_make(monkeypatch):
    """``cache_bucket`` with device rounds: the capacity generate gives both caches, the run
    ahead's room included, at each of the lengths around the 512 boundary."""
    monkeypatch.setenv("KDTREE_DEVICE_ROUNDS", "1")
    target, drafter = pair_with_recorders()
    target.graphs = drafter.model.graphs = None
    from kdtree_numba.engine import generate
    for n in range(230, 242):
        generate(target, [[3] * n], MAX_NEW, method="ddtree", drafter=drafter, budget="auto")
        want = timing.cache_bucket(n, MAX_NEW, "ddtree", "auto", drafter.block_len,
                                   on_device=True)
        assert target.generation_cache.max_len == drafter.cache.max_len == want, n

"""Where a DDTree round's time goes on the GPU: a timeline of CUDA events and host clocks.

    python3 tools/round_timeline.py [--prompts 8] [--budgets 8,32] [--max-new-tokens 128]

For the demo pair (or ``--model`` / ``--drafter``) at T = 0, each budget is run with rounds
as device programs (kdtree_numba/device_round.py) and, for comparison, with the host-driven
round, on the same warmed prompts (and AR first).  Around every round's replay (the
``GraphCache.call`` of its "round" key) the tool records a CUDA event before and after it,
and host clocks around ``DeviceRounds.launch`` and the wait for a round's tokens
(``collect``), so per round:

* ``device``: the event after the replay minus the event before it: the round's own device
  time (its CUDA graph), since the event before it fires only once the work enqueued before
  it is done;
* ``gap``: the event before round r's replay minus the event after round r - 1's: the time
  the device idled waiting for the host to launch round r (0 while the host is ahead);
* ``launch`` / ``wait``: the host's time inside ``launch`` and blocked in ``collect``;
* the captured round graph's nodes (kernels, copies, memsets) from the driver
  (``cuGraphGetNodes``), so its launches are counted, not guessed.

The summary table gives, per budget, the wall time per round, the device time, the idle gap
and its share of the round (issue 36's goal: <= 5 %), the captures that still happened inside
the timed generations (should read 0), and the graph's kernel count beside (kernels x 2.5
us), an assumed order of a graph's kernel-to-kernel cost on an H100-class card: at the demo
pair's widths a kernel does little more than launch.  GPU only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kdtree_numba import compat, demo  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.device_round import DeviceRounds  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402

LAUNCH_FLOOR_US = 2.5          # a kernel node's launch-to-launch floor inside a graph (H100)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset"}


def graph_nodes(graph) -> dict:
    """Node counts by type of a CuPy ``Graph`` (its cudaGraph_t), from the driver."""
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p(graph.graph)
    n = ctypes.c_size_t(0)
    if cuda.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        return {}
    nodes = (ctypes.c_void_p * n.value)()
    cuda.cuGraphGetNodes(handle, nodes, ctypes.byref(n))
    counts: dict = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        name = NODE_TYPES.get(kind.value, f"type{kind.value}")
        counts[name] = counts.get(name, 0) + 1
    return counts


class Timeline:
    """CUDA events around each round's replay (``GraphCache.call`` of a "round" key) and host
    clocks around ``DeviceRounds.launch`` and ``collect`` (module docstring), installed on
    the classes for the tool's process."""

    def __init__(self, cupy):
        from kdtree_numba.graphs import GraphCache
        self.cp = cupy
        self.rounds: list[dict] = []
        self.graph_call = GraphCache.call
        self.launch, self.collect = DeviceRounds.launch, DeviceRounds.collect
        timeline = self

        def call(graphs, key, *args, **kwargs):
            if key[0] != "round":
                return timeline.graph_call(graphs, key, *args, **kwargs)
            before = cupy.cuda.Event()
            before.record()
            out = timeline.graph_call(graphs, key, *args, **kwargs)
            after = cupy.cuda.Event()
            after.record()
            timeline.rounds.append(dict(before=before, after=after, replayed=out is not None))
            return out

        def launch(rounds, active, budget, n=1):
            t0 = time.perf_counter()
            seen = len(timeline.rounds)
            timeline.launch(rounds, active, budget, n)
            if len(timeline.rounds) == seen:       # no graph call (graphs off): eager
                timeline.rounds.append(dict(replayed=False))
            # one entry a launch (of n rounds under KDTREE_ROUNDS_PER_LAUNCH)
            timeline.rounds[-1].update(launch=time.perf_counter() - t0, program=rounds,
                                       budget=budget, n=n)

        def collect(rounds):
            t0 = time.perf_counter()
            out = timeline.collect(rounds)
            timeline.rounds[len(timeline.rounds) - len(rounds.in_flight) - 1]["wait"] = \
                time.perf_counter() - t0
            return out

        GraphCache.call = call
        DeviceRounds.launch, DeviceRounds.collect = launch, collect

    def reset(self) -> None:
        self.rounds.clear()

    def summary(self, wall: float, n_rounds: int) -> dict:
        """Per round: its replay's device time, the device's idle gap before it (the event
        before a replay fires when the device reaches it: at once where the device waited
        for the host, else when the work before it ends)."""
        self.cp.cuda.Device().synchronize()
        rs = [r for r in self.rounds if r["replayed"]]
        elapsed = self.cp.cuda.get_elapsed_time
        device = [elapsed(r["before"], r["after"]) for r in rs]
        gaps = [max(0.0, elapsed(a["after"], b["before"])) for a, b in zip(rs, rs[1:])]
        span = elapsed(rs[0]["before"], rs[-1]["after"]) if rs else 0.0
        program, budget = self.rounds[-1]["program"], self.rounds[-1]["budget"]
        key = program.key(budget)           # the graph cache's key adds the input's specs
        graphs = program.model.graphs._graphs if program.model.graphs is not None else {}
        graph = next((g for k, g in graphs.items() if k[:len(key)] == key), None)
        return dict(launched=len(self.rounds), replayed=len(rs), committed_rounds=n_rounds,
                    wall_ms_per_round=1e3 * wall / max(n_rounds, 1),
                    device_ms=float(np.mean(device or [0.0])),
                    gap_ms=float(np.mean(gaps or [0.0])),
                    idle_share=float(sum(gaps) / span) if span > 0 else 0.0,
                    launch_ms=1e3 * float(np.mean([r["launch"] for r in self.rounds])),
                    wait_ms=1e3 * float(np.mean([r.get("wait", 0.0) for r in self.rounds])),
                    nodes=graph_nodes(graph.graph) if graph is not None else {})


def pair_arguments(p: argparse.ArgumentParser, prompts: int, tokens: int) -> None:
    """The options this tool and tools/round_kernels.py share: the pair, the prompts, the
    budgets, the JSON output."""
    p.add_argument("--prompts", type=int, default=prompts)
    p.add_argument("--budgets", default="8,32")
    p.add_argument("--max-new-tokens", type=int, default=tokens)
    p.add_argument("--model", default=str(demo.TARGET))
    p.add_argument("--drafter", default=str(demo.DRAFTER))
    p.add_argument("--prompt-file", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "data", "heldout_prompts.jsonl"))
    p.add_argument("--json", metavar="PATH")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(p, prompts=8, tokens=128)
    args = p.parse_args(argv)
    if not compat.gpu_available():
        sys.exit("round_timeline: needs a GPU (it reads CUDA events and graphs)")
    import cupy
    from bench_demo import make_drafter, read_prompts
    model = Model.load(args.model, make_backend("numba"))
    codec = load_codec(args.model)
    prompts = [r["ids"] for r in read_prompts(args.prompt_file, args.prompts, codec)]
    drafter = make_drafter(args.drafter, model, 7, 0)
    timeline = Timeline(cupy)
    rows = []
    configs = [(0, False)] + [(int(b), d) for b in args.budgets.split(",") for d in (True, False)]
    for budget, device_rounds in configs:
        kw = dict(method="ddtree", drafter=drafter, budget=budget,
                  device_rounds=device_rounds) if budget else dict(method="ar")
        for ids in prompts:                       # compile, capture, warm
            generate(model, [ids], args.max_new_tokens, **kw)
            generate(model, [ids], args.max_new_tokens, **kw)
        walls, n_rounds, summaries, captures = [], [], [], 0
        for ids in prompts:
            timeline.reset()
            t0 = time.perf_counter()
            res = generate(model, [ids], args.max_new_tokens, **kw)
            wall = time.perf_counter() - t0
            walls.append(wall)
            n_rounds.append(res.stats.rounds)
            captures += res.stats.graph_captures or 0
            if device_rounds and timeline.rounds:
                summaries.append(timeline.summary(wall, res.stats.rounds))
        row = dict(budget=budget or "ar", device_rounds=device_rounds,
                   tokens_per_s=len(prompts) * args.max_new_tokens / sum(walls),
                   wall_ms_per_round=1e3 * sum(walls) / max(sum(n_rounds), 1),
                   captures_timed=captures)
        if summaries:
            for key in ("device_ms", "gap_ms", "idle_share", "launch_ms", "wait_ms",
                        "replayed", "launched"):
                row[key] = float(np.mean([s[key] for s in summaries]))
            row["nodes"] = summaries[-1]["nodes"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| budget | rounds | tok/s | wall / round (ms) | device / round | idle gap | "
          "idle share | host launch | host wait | graph kernels (x 2.5 us) | captures timed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kernels = r.get("nodes", {}).get("kernel")
        floor = f"{kernels} ({kernels * LAUNCH_FLOOR_US / 1e3:.2f} ms)" if kernels else "-"
        cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("device_ms", "gap_ms")]
        share = f"{100 * r['idle_share']:.1f} %" if "idle_share" in r else "-"
        host = [f"{r[k]:.3f}" if k in r else "-" for k in ("launch_ms", "wait_ms")]
        print(f"| {r['budget']} | {'device' if r['device_rounds'] else 'host'} | "
              f"{r['tokens_per_s']:.1f} | {r['wall_ms_per_round']:.3f} | {cells[0]} | "
              f"{cells[1]} | {share} | {host[0]} | {host[1]} | {floor} | "
              f"{r['captures_timed']} |")
    if args.json:
        with open(args.json, "w") as f:
            card = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
            json.dump(dict(card=card, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

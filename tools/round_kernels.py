"""Which kernels an AR step and a DDTree round run on the GPU, and what each one costs.

    python3 tools/round_kernels.py [--prompts 2] [--budgets 8,32] [--max-new-tokens 64]
                                   [--top 30] [--json PATH]

tools/round_timeline.py gives a round's device time; this names its kernels (issue 36, item 1:
"each kernel of the demo target's and the drafter's forwards").  For the demo pair (or
``--model`` / ``--drafter``) at T = 0 it runs AR and, per budget, DDTree with device rounds
(one CUDA graph a round), warmed, then once more under torch's profiler, whose CUPTI kernel
records hold every kernel of the process (numba's, CuPy's, inside CUDA graphs too).  Every
replay of the engine's graph cache (``GraphCache.call``) is bracketed by two empty marker
kernels on the legacy stream, with which the graph's replays are ordered, so the kernels
between a pair are that replay's.  Per kind of replay ("forward n=1": an AR step; "round
b=8": a device round; prefills and the drafter's own graphs apart) the tool prints:

* kernels per replay, their summed durations (``busy``) and the replay's ``span`` (first
  kernel's start to last kernel's end): ``span - busy`` is what the graph spends between its
  kernels (launch latency and dependencies), ``span / kernels`` the cost of a node;
* the GPU's idle time before each replay (the last kernel's end to the replay's first
  kernel's start, a generation's boundaries left out): what a round waits for the host to
  launch it, the issue's "GPU idle waiting for the host" per round;
* the kernels themselves (numba's mangled names shortened to module.function), per replay:
  launches, mean and summed microseconds, so a fusion's gain can be read off beforehand.

Kernels outside any bracket (the engine's eager work between replays: an AR step's sampling)
are counted per generated token.  Each ``generate()`` is also a host annotation in the same
trace, so a prompt's wall time is split (``generation`` table) into: the host's start before
the device's first kernel, the prefill's replay, the work between it and the first round (the
drafter's first commit, the first choice), the rounds (their kernels and the GPU's idle
between them), and the host's end after the last kernel: what a prompt pays outside its
rounds.  The profiler's own work on the host at each launch inflates the host's pieces (the
start, the gaps): compare them between runs of this tool, not with tools/bench_demo.py's.
GPU only, with torch (the ``hf`` extra) for the profiler.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kdtree_numba import compat  # noqa: E402
from kdtree_numba.backends import make_backend  # noqa: E402
from kdtree_numba.engine import generate  # noqa: E402
from kdtree_numba.model import Model  # noqa: E402
from kdtree_numba.text import load_codec  # noqa: E402
from round_timeline import pair_arguments  # noqa: E402

BEGIN, END = "kdtree_replay_begin", "kdtree_replay_end"
GENERATE = "kdtree_generate"        # the host annotation around each timed generate()
MARKERS = (r'extern "C" __global__ void kdtree_replay_begin() {}'
           r' extern "C" __global__ void kdtree_replay_end() {}')


def short_name(name: str) -> str:
    """``module.function`` of a numba kernel's Itanium-mangled name (``_ZN<len><part>...``);
    or of the demangled ``a::b::c[abi:...]`` that CUPTI records; other names (CuPy's) as
    they are."""
    if "::" in name and not name.startswith("_ZN"):
        parts = re.sub(r"\[abi:[^\]]*\]", "", name.split("(")[0]).split("::")
    elif not name.startswith("_ZN"):
        return name.split("(")[0]
    else:
        parts, i = [], 3
        while i < len(name) and name[i].isdigit():
            m = re.match(r"\d+", name[i:])
            n = int(m.group())
            i += len(m.group())
            parts.append(name[i:i + n])
            i += n
    parts = [p for p in parts if p not in ("cudapy",)]
    # a kernel made in a factory (every @kernel_factory's): ``<factory>.<locals>.<kernel>``,
    # "<locals>" escaped; the factory is not the module
    while "_3clocals_3e" in parts:
        i = parts.index("_3clocals_3e")
        del parts[max(i - 1, 0):i + 1]
    return ".".join(parts[-2:]) if parts else name


def label(key) -> str:
    """A readable kind of graph replay from its ``GraphCache`` key."""
    kind = key[0]
    if kind == "round":
        return f"round b={key[1]}"
    if kind in ("forward", "prefill"):
        return f"{kind} bs={key[1]} n={key[2]}"
    return str(kind)


class Brackets:
    """Marker kernels around every ``GraphCache.call`` that replays (installed for the tool's
    process); ``labels`` the replays' kinds in launch order."""

    def __init__(self, cupy):
        from kdtree_numba.graphs import GraphCache
        module = cupy.RawModule(code=MARKERS)
        begin, end = module.get_function(BEGIN), module.get_function(END)
        self.labels: list[str] = []
        self.active = False
        original = GraphCache.call
        brackets = self

        def call(graphs, key, *args, **kwargs):
            if not brackets.active or not graphs.holds(key):
                return original(graphs, key, *args, **kwargs)   # eager or captured now
            begin((1,), (1,), ())
            out = original(graphs, key, *args, **kwargs)
            end((1,), (1,), ())
            brackets.labels.append(label(key))
            return out

        GraphCache.call = call


def launch_shape(args: dict) -> str:
    """`` grid x block`` of a kernel record's args (CUPTI's), or "" where the trace has none:
    one kernel's launches of different shapes (a router's 8 outputs, an lm_head's 8,192) are
    then listed apart."""
    grid, block = args.get("grid"), args.get("block")
    if not grid or not block:
        return ""
    return " <<<%s, %s>>>" % ("x".join(map(str, grid)), "x".join(map(str, block)))


def kernel_records(trace_path: str) -> tuple[list[tuple[float, float, str, str]], list]:
    """(start us, duration us, name, launch shape) of every kernel in a Chrome trace from
    torch's profiler, by start; and the (start, end) us of each ``GENERATE`` annotation (the
    host's generate() calls, on the same clock)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [(float(e["ts"]), float(e.get("dur", 0.0)), e["name"], launch_shape(e.get("args", {})))
          for e in events if e.get("cat") == "kernel"]
    calls = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                   for e in events if e.get("name") == GENERATE and e.get("ph") == "X"
                   and e.get("cat") != "gpu_user_annotation")
    return sorted(ks), calls


def tag_replays(per_label, outside) -> list[tuple[float, float, str]]:
    """(start, end, what) of every kernel of :func:`segment`'s replays (``per_label``) and of
    those outside them (``outside``, "eager"), by start."""
    tagged = [(ts, ts + dur, lab) for lab, replays in per_label.items() for r in replays
              for ts, dur, _ in r]
    return sorted(tagged + [(ts, ts + dur, "eager") for ts, dur, _ in outside])


def generation_phases(tagged, calls) -> list[dict]:
    """Per generate() call (host start, end): where its wall time went, in us.  ``start``: the
    host's start to the first kernel (the device idle, waiting for the host's preamble);
    ``prefill``: the first prefill replay's span; ``to_rounds``: its end to the first round
    replay's first kernel (``to_rounds_busy`` of it kernels: the first choice, the drafter's
    first commit); ``rounds``: the first round's start to the last kernel's end
    (``rounds_busy`` of it kernels, the rest the GPU idle between them); ``end``: the last
    kernel's end to the host's return.  AR: its steps are the "rounds"."""
    out = []
    for t0, t1 in calls:
        ks = [k for k in tagged if t0 <= k[0] < t1]
        if not ks:
            continue
        pre = [k for k in ks if k[2].startswith("prefill")]
        first_pre_end = max(k[1] for k in pre) if pre else ks[0][0]
        later = [k for k in ks if k[0] >= first_pre_end]
        loop = [k for k in later if k[2].startswith(("round", "forward", "ar_steps"))]
        first_round = loop[0][0] if loop else first_pre_end
        last_end = max(k[1] for k in ks)
        between = [k for k in later if k[0] < first_round]
        in_loop = [k for k in ks if k[0] >= first_round]
        out.append(dict(
            wall=t1 - t0, start=ks[0][0] - t0,
            prefill=(first_pre_end - min(k[0] for k in pre)) if pre else 0.0,
            prefill_busy=sum(k[1] - k[0] for k in pre),
            to_rounds=first_round - first_pre_end,
            to_rounds_busy=sum(k[1] - k[0] for k in between),
            rounds=last_end - first_round,
            rounds_busy=sum(k[1] - k[0] for k in in_loop),
            end=t1 - last_end))
    return out


# a gap longer than this before a replay is a generation's boundary (its prefill's host work,
# the next prompt's setup), not the host falling behind the rounds
BOUNDARY_US = 1000.0


def segment(records, labels) -> tuple[dict, list, dict]:
    """Kernels between each begin/end marker pair, by the pair's label; the rest apart; and
    per label the GPU's idle time before each replay: its first kernel's start less the end
    of the last kernel before it (the markers left out; a gap past BOUNDARY_US dropped), the
    time the device waited for the host to launch it."""
    per_label: dict = collections.defaultdict(list)
    idle: dict = collections.defaultdict(list)
    outside, inside, k, last_end, begun = [], None, 0, None, None
    for ts, dur, name, shape in records:
        if name == BEGIN:
            inside, begun = [], last_end
        elif name == END:
            if inside is not None and k < len(labels):
                per_label[labels[k]].append(inside)
                if inside and begun is not None and inside[0][0] - begun <= BOUNDARY_US:
                    idle[labels[k]].append(max(0.0, inside[0][0] - begun))
            inside, k = None, k + 1
        else:
            (inside if inside is not None else outside).append(
                (ts, dur, short_name(name) + shape))
            last_end = ts + dur
    return per_label, outside, idle


def summarise(replays: list, idle=()) -> dict:
    """Per replay: kernels, busy and span (us), the GPU's idle time before it (``idle``: us
    per replay, :func:`segment`) and its share of span + idle, and the kernels by name."""
    busy = [sum(d for _, d, _ in r) for r in replays if r]
    span = [r[-1][0] + r[-1][1] - r[0][0] for r in replays if r]
    names: dict = collections.defaultdict(list)
    for r in replays:
        for _, d, n in r:
            names[n].append(d)
    count = len(replays)
    kernels = sorted(((n, len(ds) / count, float(np.mean(ds)), sum(ds) / count)
                      for n, ds in names.items()), key=lambda t: -t[3])
    idle_us = float(np.mean(idle)) if len(idle) else None
    return dict(replays=count, kernels=float(np.mean([len(r) for r in replays])),
                busy_us=float(np.mean(busy)), span_us=float(np.mean(span)),
                idle_before_us=idle_us,
                idle_share=None if idle_us is None else idle_us / (idle_us + np.mean(span)),
                by_kernel=[dict(name=n, per_replay=c, mean_us=m, us_per_replay=t)
                           for n, c, m, t in kernels])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_arguments(p, prompts=2, tokens=64)
    p.add_argument("--top", type=int, default=30, help="kernels listed per kind of replay")
    args = p.parse_args(argv)
    if not compat.gpu_available():
        sys.exit("round_kernels: needs a GPU (it reads CUPTI's kernel records)")
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function
    except ImportError:
        sys.exit("round_kernels: needs torch for its profiler (pip install -e .[hf])")
    import cupy
    from bench_demo import make_drafter, read_prompts
    torch.cuda.init()
    model = Model.load(args.model, make_backend("numba"))
    codec = load_codec(args.model)
    prompts = [r["ids"] for r in read_prompts(args.prompt_file, args.prompts, codec)]
    drafter = make_drafter(args.drafter, model, 7, 0)
    brackets = Brackets(cupy)
    result = dict(card=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), configs=[])
    for budget in [0] + [int(b) for b in args.budgets.split(",")]:
        kw = dict(method="ddtree", drafter=drafter, budget=budget, device_rounds=True) \
            if budget else dict(method="ar")
        for ids in prompts:                       # compile, capture, warm
            generate(model, [ids], args.max_new_tokens, **kw)
            generate(model, [ids], args.max_new_tokens, **kw)
        brackets.labels.clear()
        brackets.active = True
        cupy.cuda.Device().synchronize()
        tokens = rounds = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for ids in prompts:
                with record_function(GENERATE):
                    res = generate(model, [ids], args.max_new_tokens, **kw)
                tokens += res.stats.new_tokens
                rounds += res.stats.rounds
            cupy.cuda.Device().synchronize()
        brackets.active = False
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            records, calls = kernel_records(trace)
        per_label, outside, idle = segment(records, brackets.labels)
        phases = generation_phases(tag_replays(per_label, outside), calls)
        config = dict(method=f"ddtree b={budget}" if budget else "ar", tokens=tokens,
                      rounds=rounds, kernels_recorded=len(records),
                      outside_per_token=len(outside) / max(tokens, 1),
                      outside_us_per_token=sum(d for _, d, _ in outside) / max(tokens, 1),
                      replays={lab: summarise(rs, idle[lab])
                               for lab, rs in per_label.items()},
                      generation={k: float(np.mean([g[k] for g in phases]))
                                  for k in (phases[0] if phases else {})})
        result["configs"].append(config)
        print(f"\n## {config['method']}  ({result['card']}; {len(prompts)} prompts x "
              f"{args.max_new_tokens} tokens; {len(records)} kernels recorded; outside the "
              f"graphs {config['outside_per_token']:.1f} kernels, "
              f"{config['outside_us_per_token']:.1f} us a token)")
        g = config["generation"]
        if g:
            print(f"\n### a generation (mean of {len(phases)}): wall {g['wall']:.1f} us = host "
                  f"start {g['start']:.1f} + prefill {g['prefill']:.1f} (busy "
                  f"{g['prefill_busy']:.1f}) + to the first round {g['to_rounds']:.1f} (busy "
                  f"{g['to_rounds_busy']:.1f}) + rounds {g['rounds']:.1f} (busy "
                  f"{g['rounds_busy']:.1f}) + host end {g['end']:.1f}")
        for lab, s in sorted(config["replays"].items(), key=lambda t: -t[1]["replays"]):
            print(f"\n### {lab}: {s['replays']} replays; {s['kernels']:.1f} kernels, busy "
                  f"{s['busy_us']:.1f} us, span {s['span_us']:.1f} us, between kernels "
                  f"{s['span_us'] - s['busy_us']:.1f} us "
                  f"({(s['span_us'] - s['busy_us']) / max(s['kernels'] - 1, 1):.2f} us a gap)"
                  + ("" if s["idle_before_us"] is None else
                     f"; the GPU idle {s['idle_before_us']:.1f} us before a replay (marker "
                     f"kernels included), {100 * s['idle_share']:.1f}% of idle + span"))
            print("| kernel | per replay | mean us | us per replay |\n|---|---|---|---|")
            for k in s["by_kernel"][:args.top]:
                print(f"| {k['name']} | {k['per_replay']:.2f} | {k['mean_us']:.2f} | "
                      f"{k['us_per_replay']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

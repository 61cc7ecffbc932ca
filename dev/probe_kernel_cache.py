"""Where a process's first tokens go on a GPU: each numba kernel compile, timed and marked
as loaded from the disk cache (hit), compiled (miss) or already in memory.  Run it twice:
the second process should be all hits.  (Issue 14 item 6's diagnostic; docs/ENGINE.md.)

    python3 dev/probe_kernel_cache.py [--lengths 4,5]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4,5", help="prompt lengths, one generate each")
    args = p.parse_args()
    t_start = time.perf_counter()
    from numba.cuda import dispatcher as D
    counts, secs = collections.Counter(), collections.Counter()
    slow = []
    orig = D.CUDADispatcher.compile

    def timed(self, sig):
        h0, m0 = sum(self._cache_hits.values()), sum(self._cache_misses.values())
        t = time.perf_counter()
        out = orig(self, sig)
        dt = time.perf_counter() - t
        hit = sum(self._cache_hits.values()) > h0
        miss = sum(self._cache_misses.values()) > m0
        kind = "hit" if hit else "miss" if miss else "memory"
        counts[kind] += 1
        secs[kind] += dt
        if dt > 0.2:
            slow.append((dt, kind, self.py_func.__qualname__,
                         os.path.basename(self.py_func.__code__.co_filename)))
        return out
    D.CUDADispatcher.compile = timed

    from kdtree_numba import demo, kernel_cache
    from kdtree_numba.engine import generate
    from kdtree_numba.model import Model
    print(kernel_cache.describe())
    model = Model.load(demo.TARGET, "numba")
    print(f"imports + load {time.perf_counter() - t_start:.2f} s")
    for n in (int(v) for v in args.lengths.split(",")):
        counts.clear(), secs.clear(), slow.clear()
        t = time.perf_counter()
        generate(model, [list(range(2, 2 + n))], 4)
        print(f"prompt of {n}: {time.perf_counter() - t:.2f} s; compiles "
              + ", ".join(f"{k} {counts[k]} ({secs[k]:.2f} s)" for k in counts))
        for dt, kind, name, f in sorted(slow, reverse=True)[:12]:
            print(f"   {dt:6.2f} s {kind:6s} {name} ({f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

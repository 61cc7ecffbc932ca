#!/usr/bin/env python3
"""Time one bf16-cache attention plan on the decode shape, for a profiler to attach to.

    python3 dev/cuda/probe_attention_bf16.py [KEYS]
    ncu --kernel-name regex:mla_attention_bf16 --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats python3 dev/cuda/probe_attention_bf16.py 32

Decode at Kimi-K2 widths (bs 64, n 1, H 64, r 512, dr 64, prefix 4,096) over a bf16 cache,
``KEYS`` keys per tile (``kdtree_numba.attention.plan.BF16_KEYS``, default 32): three warm-up
calls (the kernel compiles on the first), then 20 timed back to back; prints the mean time,
the split count and the block height.  docs/ATTENTION.md ("The bf16 cache") records what
Nsight Compute said about it.  Needs a GPU and CuPy.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BS, N, H, R, DR, PREFIX, TAU = 64, 1, 64, 512, 64, 4096, 0.130861


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        import cupy as cp
    except ImportError:
        print("probe_attention_bf16: needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    from kdtree_numba.attention import MlaAttentionPlan
    from kdtree_numba.attention import plan as plans
    from kdtree_numba.backends import bf16_bits
    plans.BF16_KEYS = int(argv[0]) if argv else plans.BF16_KEYS
    g = cp.random.default_rng(0)
    scale = 1.0 / (TAU * (R + DR) ** 0.5)
    q = g.standard_normal((BS, N, H, R), dtype=cp.float32) * scale
    q_pe = g.standard_normal((BS, N, H, DR), dtype=cp.float32) * scale
    ckv = bf16_bits(cp, g.standard_normal((BS, PREFIX + N, R), dtype=cp.float32))
    kpe = bf16_bits(cp, g.standard_normal((BS, PREFIX + N, DR), dtype=cp.float32))
    prefix = cp.full((BS,), PREFIX, cp.int32)
    visible = cp.ones((BS, N, N), cp.bool_)
    plan = MlaAttentionPlan(BS, N, H, R, DR, PREFIX + N, max_keys=PREFIX + N, bf16_cache=True)
    out = cp.empty((BS, N, H, R), cp.float32)
    for _ in range(3):
        plan(q, q_pe, ckv, kpe, prefix, visible, TAU, out=out)
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(20):
        plan(q, q_pe, ckv, kpe, prefix, visible, TAU, out=out)
    stop.record()
    stop.synchronize()
    print(f"keys {plans.BF16_KEYS}: {cp.cuda.get_elapsed_time(start, stop) / 20:.3f} ms a "
          f"call, {plan.splits} splits x {plan.cfg.rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

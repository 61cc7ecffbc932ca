"""The card's own ceilings, measured in the benchmark's process: HBM bandwidth and bf16 GEMM rate.

    python3 tools/card_roofs.py [--json PATH]

The benchmarks' roofs used to be constants measured once on an H200 (4.1 TB/s), while an H100
(3.35 TB/s on its datasheet) is often what is lent; a roof from another card misreports every
"share of the roof" column.  :func:`measure` times, with CUDA events after a warm-up:

* a device-to-device copy of 2 GiB (bytes read + bytes written over the median time), CuPy;
* a bf16 matrix product 8192^3 through cuBLAS (CuPy), on random data (zeros run faster).

:func:`apply` writes the bandwidth into the benchmark modules' ``HBM_BYTES_PER_S`` so every
roof of the run uses the card that ran it, and returns the figures for the table's header.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys


@functools.lru_cache(maxsize=1)
def measure() -> dict:
    """{"card", "hbm_bytes_per_s", "bf16_flop_per_s"} of the current CUDA device."""
    import cupy
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()

    def median_ms(fn, reps):
        fn()
        cupy.cuda.Device().synchronize()
        times = []
        for _ in range(reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(cupy.cuda.get_elapsed_time(a, b))
        times.sort()
        return times[len(times) // 2]

    n = 1 << 31                                      # 2 GiB, ~40x the L2
    src = cupy.random.randint(0, 255, n, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    copy_ms = median_ms(lambda: cupy.copyto(dst, src), 10)
    del src, dst
    m = 8192
    a = cupy.random.standard_normal((m, m), dtype=cupy.float32).astype("bfloat16") \
        if hasattr(cupy, "bfloat16") else None
    if a is None:                                    # CuPy without bf16: through ml_dtypes
        import ml_dtypes
        import numpy as np
        host = np.random.default_rng(0).standard_normal((m, m)).astype(ml_dtypes.bfloat16)
        a = cupy.asarray(host.view(np.uint16)).view(cupy.dtype(ml_dtypes.bfloat16))
    gemm_ms = median_ms(lambda: cupy.matmul(a, a), 10)
    return {"card": name, "hbm_bytes_per_s": 2 * n / (copy_ms * 1e-3),
            "bf16_flop_per_s": 2 * m ** 3 / (gemm_ms * 1e-3)}


def apply(*modules) -> dict:
    """Measure (once per process) and set each module's ``HBM_BYTES_PER_S`` to the card's."""
    roofs = measure()
    for module in modules:
        module.HBM_BYTES_PER_S = roofs["hbm_bytes_per_s"]
    return roofs


def describe(roofs: dict) -> str:
    return (f"card: {roofs['card']}; measured HBM copy {roofs['hbm_bytes_per_s'] / 1e12:.2f} "
            f"TB/s (read + write), cuBLAS bf16 {roofs['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    roofs = measure()
    print(describe(roofs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(roofs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One bf16 tensor-core linear and one cuBLAS bf16 matmul per shape: the target for Nsight
Compute's look at where the GEMM stalls beside cuBLAS (docs/LAYERS.md, "Warpgroup mma";
docs/GPU_RESULTS.md, run 202).  Each product runs once after nothing else, so with
``--launch-count`` the profiler sees our kernel (and its sum launch, if any) then cuBLAS's:

    ncu -k regex:'mma_linear|gemm|nvjet|cutlass|xmma|sum_splits' --launch-count 12 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python3 tools/ncu_gemm.py --shapes 512x7168x36864,512x2048x7168,65x2048x7168

GPU only (CuPy, and ml_dtypes for cuBLAS's bf16 operands)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SHAPES = "512x7168x36864,512x2048x7168,65x2048x7168"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'MxKxN,...' -> [(M, K, N), ...], each positive; a one-line ValueError otherwise."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a shape is MxKxN with positive integers, got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help=f"comma-separated MxKxN products (default {DEFAULT_SHAPES})")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        parser.error(str(exc))
    import cupy as cp
    import ml_dtypes
    from kdtree_numba.compat import cuda
    from kdtree_numba.layers import Workspace, linear
    nb = cuda.as_cuda_array
    for m, k, n in shapes:
        w16 = ((cp.random.standard_normal((n, k), dtype=cp.float32) * cp.float32(0.02))
               .view(cp.uint32) >> 16).astype(cp.uint16)
        x = cp.random.standard_normal((m, k), dtype=cp.float32)
        y = cp.empty((m, n), cp.float32)
        linear(nb(x), nb(w16), out=nb(y), method="mma", workspace=Workspace())
        x16 = ((x.view(cp.uint32) >> 16).astype(cp.uint16)).view(ml_dtypes.bfloat16)
        cp.matmul(x16, w16.view(ml_dtypes.bfloat16).T,
                  out=cp.empty((m, n), ml_dtypes.bfloat16))
        cp.cuda.Device().synchronize()
        print(f"ran {m} x {k} -> {n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

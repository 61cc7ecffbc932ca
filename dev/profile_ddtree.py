"""A profiling target: one warm top-K (bs 64 x L 15 x V 163,840, k = 64) and a warm build_tree
(B = 64), each launched twice, for Nsight Compute on the GPU machine, e.g.

    KDTREE_CUDA_LINEINFO=1 ncu --clock-control none -k regex:"topk_part|build" \
        --launch-skip 1 --launch-count 3 --section SpeedOfLight --section WarpStateStats \
        python3 dev/profile_ddtree.py
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from numba import cuda  # noqa: E402

from kdtree_numba import ddtree as gpu  # noqa: E402
from kdtree_numba.ddtree import topk as gpu_topk  # noqa: E402
from reference import ddtree as ref  # noqa: E402

BS, L, VOCAB, K, BUDGET = 64, 15, 163840, 64, 64


def main() -> None:
    rng = np.random.default_rng(0)
    logits = cuda.to_device(rng.standard_normal((BS * L, VOCAB), np.float32) * 3)
    lp = cuda.device_array((BS * L, K), np.float32)
    ids = cuda.device_array((BS * L, K), np.int32)
    config = gpu.topk_config(K, BS * L, VOCAB)
    for _ in range(2):
        gpu_topk._launch_topk(logits, K, lp, ids, config, 0)
    host_lp, host_ids = ref.topk_logprobs(rng.standard_normal((BS, L, 2 * BUDGET),
                                                              np.float32) * 3, BUDGET)
    tree_lp, tree_ids = cuda.to_device(host_lp), cuda.to_device(host_ids)
    for _ in range(2):
        gpu.build_tree(tree_lp, tree_ids, BUDGET)
    cuda.synchronize()
    print("profiled: topk_logprobs", config, "and build_tree B =", BUDGET)


if __name__ == "__main__":
    main()

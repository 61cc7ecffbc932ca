"""DDTree verify inputs on the GPU: ``compile_tree`` (the target's verify-forward inputs of a
draft tree: token ids, positions, ancestor rows, the tree attention mask) and its two kernels.

Reference twin and contract: reference/ddtree/compile.py (``compile_tree`` and the VerifyInput
fields).  The kernels and why: docs/DDTREE.md, "compile_tree, accept, sampling, compaction".
Host plumbing shared with the other DDTree kernels: arrays.py.
"""
from kdtree_numba.compat import cuda, kernel, SIMULATOR

import numpy as np

from kdtree_numba import compat
from kdtree_numba.ddtree.arrays import (any_on_device, device_view, outputs, to_host,
                                        tree_is_on_device, tree_on_device)
from reference.ddtree.checks import check_per_request, check_tree
from reference.ddtree.tree import DraftTree, VerifyInput

__all__ = ["compile_tree"]


# ----------------------------------------------------------------------------- verify inputs

@kernel
def _tree_rows(n_nodes, token, parent, depth, root_token, start, input_ids, positions, anc):
    """One block per request, one thread per slot: ids, positions and the ancestor row."""
    b = cuda.blockIdx.x
    width = token.shape[1]
    n_anc = anc.shape[2]
    n = n_nodes[b]
    for i in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        for d in range(n_anc):
            anc[b, i, d] = -1
        if i <= n:
            dep = depth[b, i]
            input_ids[b, i] = token[b, i] if i > 0 else root_token[b]
            positions[b, i] = start[b] + dep
            node = i
            for d in range(dep, -1, -1):
                anc[b, i, d] = node
                node = parent[b, node]
        else:
            input_ids[b, i] = root_token[b]
            positions[b, i] = start[b]
            anc[b, i, 0] = i


@kernel
def _tree_mask(n_nodes, depth, anc, visible):
    """One block per (request, query row), threads over key columns: the rule of the contract,
    ``visible[i][j] = pd(j) <= pd(i) and anc[i][pd(j)] == j`` (padding depth 0)."""
    width = depth.shape[1]
    b = cuda.blockIdx.x // width
    i = cuda.blockIdx.x - b * width
    n = n_nodes[b]
    di = depth[b, i] if i <= n else 0
    for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        dj = depth[b, j] if j <= n else 0
        visible[b, i, j] = dj <= di and anc[b, i, dj] == j


def compile_tree(tree: DraftTree, root_token, start, *, stream=0,
                 out: VerifyInput | None = None) -> VerifyInput:
    """GPU twin of ``reference.ddtree.compile_tree``, bit-identical.  ``out``: an optional
    VerifyInput of device arrays to fill (positions written in place, as CUDA graphs need)."""
    bs, budget, max_depth = check_tree(tree)
    check_per_request("root_token", root_token, bs)
    check_per_request("start", start, bs)
    host = not (tree_is_on_device(tree) or any_on_device(root_token, start)) and out is None
    compat.require_kernels()
    d_tree = tree_on_device(tree, stream)
    width = budget + 1
    input_ids, positions, anc, visible = outputs(
        None if out is None else (out.input_ids, out.positions, out.anc, out.visible),
        [("input_ids", (bs, width), np.int32), ("positions", (bs, width), np.int32),
         ("anc", (bs, width, max_depth + 1), np.int32),
         ("visible", (bs, width, width), np.bool_)], stream)
    threads = 32 if SIMULATOR else 128
    _tree_rows[bs, threads, stream](d_tree.n_nodes, d_tree.token, d_tree.parent, d_tree.depth,
                                    device_view(root_token, stream), device_view(start, stream),
                                    input_ids, positions, anc)
    _tree_mask[bs * width, threads, stream](d_tree.n_nodes, d_tree.depth, anc, visible)
    out = (input_ids, positions, anc, visible)
    return VerifyInput(*(to_host(out, stream) if host else out))

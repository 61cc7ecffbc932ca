"""Host plumbing the DDTree kernel modules share, and the sentinels and sizes they agree on.

No kernel here.  The family modules (topk.py, build.py, compile.py, accept.py, compact.py)
import from it:

* device views of the inputs (NumPy, CuPy or numba device arrays) and copies back to the host,
  the array rules of the package docstring (kdtree_numba/ddtree/__init__.py);
* ``outputs``: the results' device arrays, fresh or the caller's ``out=`` (checked on the host),
  which makes a call allocation-free for CUDA-graph capture;
* a DraftTree moved to the device (``tree_on_device``), and whether it is there already;
* the padding sentinels the kernels write (-inf, INT32_MAX), the block-size floor
  ``MIN_THREADS`` and the power-of-two size classes kernels compile for.

Its reference twins are the records and checks both sides share: reference/ddtree/tree.py and
reference/ddtree/checks.py.  What is checked on the host and what is the caller's promise:
docs/DDTREE.md, "The numba twin's boundary".
"""
from kdtree_numba.compat import to_device, SIMULATOR

import numpy as np

from kdtree_numba import compat
from reference.ddtree.checks import check_array
from reference.ddtree.tree import DraftTree

__all__ = ["NEG_INF32", "NEG_INF64", "INT32_MAX", "MIN_THREADS", "TREE_FIELDS", "pow2_at_least",
           "any_on_device", "device_view", "copy_back", "to_host", "outputs", "tree_on_device",
           "tree_is_on_device"]

NEG_INF32 = np.float32(-np.inf)
NEG_INF64 = np.float64(-np.inf)
INT32_MAX = np.int32(2 ** 31 - 1)
# Blocks of at least one full warp on the GPU (warp barriers need every lane); the simulator,
# where warp barriers are block barriers, also runs 1-16 threads so its tests stay fast.
MIN_THREADS = 1 if SIMULATOR else 32


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the size classes kernels compile for."""
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- host plumbing

def any_on_device(*arrays) -> bool:
    return any(compat.is_device_array(a) for a in arrays if a is not None)


def device_view(x, stream):
    """A numba device view of x; CuPy arrays are wrapped without a host sync (compat.to_device)."""
    return to_device(x, stream=stream)


def copy_back(hosts, views, stream) -> None:
    """NumPy arguments a kernel wrote in place (through their device ``views``) get the
    device's result; device arguments were written where they are."""
    for host, view in zip(hosts, views):
        if isinstance(host, np.ndarray):
            host[...] = view.copy_to_host(stream=stream)


def to_host(results, stream):
    return tuple(r.copy_to_host(stream=stream) for r in results)


def outputs(out, specs, stream) -> list:
    """Device arrays for ``specs`` [(name, shape, dtype)]: freshly allocated, or the caller's
    ``out`` (a sequence of device arrays, checked against the specs on the host).  Passing
    ``out`` makes a call allocation-free, so it can sit inside a captured CUDA graph."""
    if out is None:
        return [compat.device_empty(shape, dtype, stream) for _, shape, dtype in specs]
    out = list(out)
    if len(out) != len(specs):
        raise ValueError(f"out must hold {len(specs)} arrays, got {len(out)}")
    arrays = []
    for array, (name, shape, dtype) in zip(out, specs):
        if not compat.is_device_array(array):
            raise TypeError(f"out {name} must be a device array")
        check_array(f"out {name}", array, len(shape), dtype=dtype)
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"out {name} must be {tuple(shape)}, got {tuple(array.shape)}")
        arrays.append(device_view(array, stream))
    return arrays


TREE_FIELDS = ("n_nodes", "token", "parent", "depth", "rank", "score")


def tree_on_device(tree: DraftTree, stream) -> DraftTree:
    fields = {f: device_view(getattr(tree, f), stream) for f in TREE_FIELDS}
    return DraftTree(max_depth=tree.max_depth, **fields)


def tree_is_on_device(tree: DraftTree) -> bool:
    return any_on_device(tree.n_nodes, tree.token, tree.parent, tree.depth, tree.rank,
                         tree.score)

"""DDTree kernels on the GPU with numba.cuda.  The contract is ``reference.ddtree``'s docstring.

Same function names and results as the reference (bit-identical except ``topk_logprobs``'s lp,
within ``reference.ddtree.LP_ATOL/LP_RTOL``, and the measure-zero CDF-boundary case of
``sample_targets``).  The GPU algorithms and why they were chosen: docs/DDTREE.md.

Arrays in and out:
* Inputs may be NumPy, CuPy or numba device arrays.  If any input is on the device, every result
  is a numba device array (``cupy.asarray(x)`` wraps one without a copy), nothing is copied to
  the host and nothing synchronises: launches are queued on ``stream`` (CuPy inputs are wrapped
  without numba's import-time stream sync, so queue on the stream that produced them, or on the
  default stream).
* If every input is NumPy, inputs are copied to the device and results come back as NumPy
  (that copy synchronises).  ``compact_kv`` on NumPy caches copies them back in place.
* Shapes and dtypes are checked on the host from array metadata (no device read).  Values
  (finite logits, sorted lp, in-range uniforms, cache capacity) are checked only for NumPy
  inputs; on device inputs they are the caller's promise (see each function).

The modules, named as the reference's (reference/ddtree/), one kernel family each:

============  ==================================================================
module        holds
============  ==================================================================
topk.py       ``topk_logprobs``, ``topk_config``, ``MAX_GPU_TOPK``
build.py      ``build_tree``, ``build_config``, ``MAX_GPU_BUDGET``
compile.py    ``compile_tree``
accept.py     ``accept_greedy``, ``sample_targets``, ``accept_sampled``
compact.py    ``compact_kv``, ``compact_threads``
commit.py     ``round_slots``, ``commit_round`` (a device round's index arithmetic and commit)
lookup.py     ``lookup_path``, ``mix_lookup``, ``record_tokens`` (prompt lookup in the tree)
arrays.py     the host plumbing they share (device views, ``out=`` arrays, the tree on the
              device), the padding sentinels and ``MIN_THREADS``
============  ==================================================================

The GPU primitives the kernels use (warp shuffles, ``redux``, 16-byte loads, block
reductions) live in kdtree_numba/gpu/.
"""
from kdtree_numba.ddtree.accept import accept_greedy, accept_sampled, sample_targets
from kdtree_numba.ddtree.arrays import MIN_THREADS
from kdtree_numba.ddtree.build import MAX_GPU_BUDGET, build_tree
from kdtree_numba.ddtree.commit import commit_round, round_slots
from kdtree_numba.ddtree.compact import compact_kv
from kdtree_numba.ddtree.compile import compile_tree
from kdtree_numba.ddtree.lookup import lookup_path, mix_lookup, record_tokens
from kdtree_numba.ddtree.topk import MAX_GPU_TOPK, topk_logprobs
from reference.ddtree.tree import DraftTree, VerifyInput

# Importable from here as before the split, though outside __all__: the launch configurations,
# block sizes and constants that tests and tools/ read.
from kdtree_numba.ddtree.arrays import INT32_MAX, NEG_INF32, NEG_INF64, TREE_FIELDS  # noqa: F401
from kdtree_numba.ddtree.build import LP_CACHE, build_config  # noqa: F401
from kdtree_numba.ddtree.compact import compact_threads  # noqa: F401
from kdtree_numba.ddtree.topk import (TOPK_MERGE_THREADS, TOPK_SHARED_BYTES,  # noqa: F401
                                      topk_config)
from kdtree_numba.gpu.warp import WARP  # noqa: F401

__all__ = ["DraftTree", "VerifyInput", "topk_logprobs", "build_tree", "compile_tree",
           "accept_greedy", "sample_targets", "accept_sampled", "compact_kv",
           "round_slots", "commit_round", "lookup_path", "mix_lookup", "record_tokens",
           "MAX_GPU_BUDGET", "MAX_GPU_TOPK", "MIN_THREADS"]

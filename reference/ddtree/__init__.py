"""DDTree draft-tree kernels: the NumPy reference.  The docstrings of this package are the
contract.

``kdtree_numba.ddtree`` implements the same functions with numba.cuda and points here; the
algorithm itself is described in docs/DDTREE.md.  Everything is batched over ``bs``
independent requests.  Indices are int32 and padding is -1.

Each module's docstring carries the contract of what it implements; the numba twin's modules
have the same names:

============  ==================================================================
module        contract of
============  ==================================================================
topk.py       ``topk_logprobs(logits, k) -> (lp, ids)``, the lp tolerance LP_ATOL/LP_RTOL
build.py      ``build_tree(lp, ids, budget) -> DraftTree`` and the DraftTree fields
compile.py    ``compile_tree(tree, root_token, start) -> VerifyInput`` and its fields
accept.py     ``accept_greedy``, ``sample_targets``, ``accept_sampled``
sampling.py   ``Sampling``, ``kept_weights``, ``inverse_cdf_sample``
compact.py    ``compact_kv(caches, past_len, acc_idx, acc_len) -> None``, ``compact_kv_paged``
commit.py     a device round's slot indices and commit (integers and copies)
lookup.py     ``lookup_path``, ``mix_lookup``, ``record_tokens``: prompt lookup in the tree
tree.py       the DraftTree and VerifyInput records
checks.py     the argument checks both twins run (metadata only, so also on device arrays)
============  ==================================================================
"""
from __future__ import annotations

from .accept import accept_greedy, accept_sampled, accepted_slots, pack_committed, sample_targets
from .build import build_tree
from .commit import commit_round, round_slots
from .checks import (cache_list, check_accepted, check_array, check_build_args,
                     check_compact_args, check_draft_temperature, check_int,
                     check_per_request, check_per_slot, check_sample_args, check_sampling,
                     check_temperature, check_topk_args, check_tree)
from .compact import compact_kv, compact_kv_paged
from .compile import compile_tree
from .lookup import lookup_path, mix_lookup, record_tokens
from .sampling import Sampling, as_sampling, inverse_cdf_sample, kept_weights
from .topk import LP_ATOL, LP_RTOL, topk_logprobs
from .tree import DraftTree, VerifyInput

__all__ = ["DraftTree", "VerifyInput", "topk_logprobs", "build_tree", "compile_tree",
           "accept_greedy", "sample_targets", "accept_sampled", "compact_kv",
           "compact_kv_paged", "LP_ATOL", "LP_RTOL", "Sampling", "as_sampling", "kept_weights",
           "inverse_cdf_sample", "pack_committed", "accepted_slots", "round_slots",
           "commit_round", "lookup_path", "mix_lookup", "record_tokens"]

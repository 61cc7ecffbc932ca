"""Argument checks of the DDTree functions, shared by the two twins.

All but ``check_accepted`` check only metadata (shape, dtype, Python ints and floats), so the
numba twin runs them on device arrays too.  ``check_accepted`` reads the values of one
request's accepted path: the twin calls it only for NumPy inputs (docs/DDTREE.md, "The numba
twin's boundary").
"""
from __future__ import annotations

import numbers

import numpy as np

from .sampling import Sampling, as_sampling
from .tree import DraftTree

__all__ = ["check_array", "check_int", "check_topk_args", "check_build_args", "check_tree",
           "check_per_request", "check_per_slot", "check_temperature", "check_sampling",
           "check_sample_args", "check_draft_temperature",
           "cache_list", "check_compact_args", "check_accepted"]


def _dtype_of(x) -> np.dtype:
    return np.dtype(x.dtype)


def check_array(name: str, x, ndim: int, kinds: str = "", dtype=None):
    """Raise TypeError/ValueError unless ``x`` is an array of ``ndim`` dims of the right dtype."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (NumPy, CuPy or numba device), "
                        f"not {type(x).__name__}")
    dt = _dtype_of(x)
    if dtype is not None and dt != np.dtype(dtype):
        raise TypeError(f"{name} must be {np.dtype(dtype)}, got {dt}")
    if kinds and dt.kind not in kinds:
        raise TypeError(f"{name} must have dtype kind in {kinds!r}, got {dt}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        top = "inf" if high is None else high
        raise ValueError(f"{name} = {value} must lie in [{low}, {top}]")
    return value


def check_topk_args(logits, k) -> tuple[int, int, int, int]:
    check_array("logits", logits, 3, dtype=np.float32)
    bs, n_rows, vocab = (int(s) for s in logits.shape)
    if min(bs, n_rows, vocab) == 0:
        raise ValueError(f"logits must be non-empty, got shape {tuple(logits.shape)}")
    return bs, n_rows, vocab, check_int("k", k, 1, vocab)


def check_build_args(lp, ids, budget) -> tuple[int, int, int, int]:
    check_array("lp", lp, 3, dtype=np.float32)
    check_array("ids", ids, 3, dtype=np.int32)
    if tuple(lp.shape) != tuple(ids.shape):
        raise ValueError(f"lp {tuple(lp.shape)} and ids {tuple(ids.shape)} must have one shape")
    bs, n_rows, k = (int(s) for s in lp.shape)
    if min(bs, n_rows, k) == 0:
        raise ValueError(f"lp must be non-empty, got shape {tuple(lp.shape)}")
    return bs, n_rows, k, check_int("budget", budget, 1)


def check_tree(tree) -> tuple[int, int, int]:
    """-> (bs, budget, max_depth) after checking every field's shape and dtype."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    check_array("tree.token", tree.token, 2, dtype=np.int32)
    bs, width = (int(s) for s in tree.token.shape)
    check_array("tree.n_nodes", tree.n_nodes, 1, dtype=np.int32)
    for name in ("parent", "depth", "rank"):
        check_array(f"tree.{name}", getattr(tree, name), 2, dtype=np.int32)
    check_array("tree.score", tree.score, 2, dtype=np.float64)
    for name in ("parent", "depth", "rank", "score"):
        if tuple(getattr(tree, name).shape) != (bs, width):
            raise ValueError(f"tree.{name} must be {(bs, width)}, got "
                             f"{tuple(getattr(tree, name).shape)}")
    if tuple(tree.n_nodes.shape) != (bs,) or width < 2:
        raise ValueError(f"tree.n_nodes must be ({bs},) and budget >= 1")
    return bs, width - 1, check_int("tree.max_depth", tree.max_depth, 1)


def check_per_request(name: str, x, bs: int, kinds: str = "iu"):
    check_array(name, x, 1, kinds)
    if tuple(x.shape) != (bs,):
        raise ValueError(f"{name} must be ({bs},), got {tuple(x.shape)}")
    return x


def check_per_slot(name: str, x, bs: int, width: int, kinds: str):
    check_array(name, x, 2, kinds)
    if tuple(x.shape) != (bs, width):
        raise ValueError(f"{name} must be {(bs, width)}, got {tuple(x.shape)}")
    return x


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    t = float(temperature)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be finite and > 0 (use accept_greedy for T = 0), "
                         f"got {t}")
    return t


def check_draft_temperature(value) -> float:
    """A draft temperature t_d: a finite real > 0 (the tree is built from the drafter's logits
    divided by it; 1: the logits as they are)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"draft_temperature must be a real number, got {type(value).__name__}")
    t = float(value)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"draft_temperature must be finite and > 0, got {t}")
    return t


def check_sampling(sampling):
    """A Sampling (or a bare temperature) for a sampled choice: temperature > 0 (T = 0 is
    accept_greedy's), the other fields as ``Sampling`` checks them."""
    if not isinstance(sampling, Sampling):
        check_temperature(sampling)
    s = as_sampling(sampling)
    if s.greedy:
        raise ValueError("temperature must be finite and > 0 (use accept_greedy for T = 0), "
                         "got 0.0")
    return s


def check_sample_args(tree, target_logits, sampling, uniforms):
    """-> (bs, budget, V, the Sampling); ``sampling`` a Sampling or a bare temperature."""
    bs, budget, _ = check_tree(tree)
    check_array("target_logits", target_logits, 3, dtype=np.float32)
    if tuple(target_logits.shape[:2]) != (bs, budget + 1) or target_logits.shape[2] == 0:
        raise ValueError(f"target_logits must be ({bs}, {budget + 1}, V>0), got "
                         f"{tuple(target_logits.shape)}")
    check_per_slot("uniforms", uniforms, bs, budget + 1, "f")
    return bs, budget, int(target_logits.shape[2]), check_sampling(sampling)


def cache_list(caches) -> list:
    """``caches`` as a list of arrays (a single array is accepted as a list of one)."""
    if hasattr(caches, "shape"):
        return [caches]
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"caches must be a list of arrays, got {type(caches).__name__}")
    return list(caches)


def check_compact_args(caches, past_len, acc_idx, acc_len) -> tuple[list, int, int]:
    """-> (caches as a list, bs, L + 1); every cache is [bs, max_len, width] or [n, bs, ...]."""
    check_array("acc_idx", acc_idx, 2, "iu")
    bs, n_acc = (int(s) for s in acc_idx.shape)
    check_per_request("acc_len", acc_len, bs)
    check_per_request("past_len", past_len, bs)
    caches = cache_list(caches)
    for c, cache in enumerate(caches):
        shape = tuple(getattr(cache, "shape", ()))
        if len(shape) not in (3, 4):
            raise ValueError(f"caches[{c}] must be [bs, max_len, width] or "
                             f"[n, bs, max_len, width], got {getattr(cache, 'shape', cache)!r}")
        if int(shape[-3]) != bs:
            raise ValueError(f"caches[{c}] has batch {shape[-3]}, acc_idx has {bs}")
    return caches, bs, n_acc


def check_accepted(acc: np.ndarray, m: int, b: int) -> None:
    if m < 1 or m > acc.size or acc[0] != 0 or np.any(np.diff(acc[:m]) <= 0):
        raise ValueError(f"request {b}: acc_len {m} / acc_idx {acc.tolist()} is not an "
                         f"accepted path (starts at 0, strictly increasing)")


MAX_NGRAM = 32       # the longest suffix a prompt lookup matches (lookup.py; the GPU's loop bound)


def check_lookup(weight, max_n, min_n) -> tuple[float, int, int]:
    """A prompt lookup's settings (lookup.py): ``(weight, max_n, min_n)``, or a one-line
    ValueError or TypeError naming the field."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"lookup weight must be a number, got {type(weight).__name__}")
    if not 0.0 < float(weight) < 1.0:
        raise ValueError(f"lookup weight = {weight!r} must lie in (0, 1)")
    max_n = check_int("lookup max_n", max_n, 1, MAX_NGRAM)
    min_n = check_int("lookup min_n", min_n, 1, max_n)
    return float(weight), max_n, min_n


def check_lookup_args(history, lengths, rows, max_n, min_n):
    """``lookup_path``'s arguments (metadata only): ``(bs, H, rows, max_n, min_n)``."""
    _, max_n, min_n = check_lookup(0.5, max_n, min_n)
    check_array("history", history, 2, dtype=np.int32)
    bs, H = (int(s) for s in history.shape)
    check_array("lengths", lengths, 1, dtype=np.int32)
    if tuple(lengths.shape) != (bs,):
        raise ValueError(f"lengths must have shape ({bs},), got {tuple(lengths.shape)}")
    return bs, H, check_int("rows", rows, 0), max_n, min_n


def check_mix_args(lp, ids, path, weight):
    """``mix_lookup``'s arguments (metadata only): ``(bs, R, k, weight)``."""
    weight, _, _ = check_lookup(weight, 1, 1)
    check_array("lp", lp, 3, dtype=np.float32)
    bs, R, k = (int(s) for s in lp.shape)
    check_array("ids", ids, 3, dtype=np.int32)
    if tuple(ids.shape) != (bs, R, k):
        raise ValueError(f"ids must have lp's shape {(bs, R, k)}, got {tuple(ids.shape)}")
    check_array("path", path, 2, dtype=np.int32)
    if int(path.shape[0]) != bs or int(path.shape[1]) < R:
        raise ValueError(f"path must have shape ({bs}, >= {R}), got {tuple(path.shape)}")
    return bs, R, k, weight


def check_record_args(history, lengths, packed, active) -> tuple[int, int]:
    """``record_tokens``' arguments (metadata only): ``(bs, H)``; ``active`` bool or int."""
    check_array("history", history, 2, "iu")
    bs, H = (int(s) for s in history.shape)
    check_per_request("lengths", lengths, bs)
    check_per_request("active", active, bs, "biu")
    check_array("packed", packed, 2, "iu")
    if int(packed.shape[0]) != bs or int(packed.shape[1]) == 0:
        raise ValueError(f"packed must have shape ({bs}, > 0), got {tuple(packed.shape)}")
    return bs, H

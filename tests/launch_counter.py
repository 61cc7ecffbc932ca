"""Launches of one device round and of one AR step, counted by site in the CUDA simulator.

On the GPU the demo pair is launch-bound: a device round's cost is its kernel count (issue 36).
Here, on the numba backend under the simulator (``NUMBA_ENABLE_CUDASIM=1``), every launch the
GPU would make is counted where it is made:

* **numba kernels**: each launch of a kernel (``FakeCUDAKernel.__call__``, device functions
  excluded), by kernel name (``kernel moe.group_by_expert``);
* **array-module operations** (CuPy on the GPU, NumPy here): the backend's ``xp`` is replaced
  by :class:`CountingXp` and its arrays are :class:`DevArray` views, so each operation that
  CuPy runs as a kernel is counted at the package function that asked for it
  (``kvcache.KVCache.device_slots``).  The model of CuPy: a ufunc (``+``, ``maximum``, a
  reduction), ``copy``, an ``astype`` that converts, ``fill``, ``ones``/``zeros``/``arange``,
  a setitem (copy or scatter), an advanced-index getitem (a take), ``take_along_axis``,
  ``where`` and an ``ascontiguousarray`` that copies are one launch each; ``concatenate`` /
  ``stack`` one per input (CuPy copies a few arrays one by one); views (reshape, slicing,
  ``broadcast_to``) none.  An upload of a host array is listed apart ("uploads"), not as a
  launch.

Work inside a numba op (its own host code) is the kernels it launches, nothing else.

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=$PWD python3 tests/launch_counter.py [--full-glue]

prints the table for a tiny pair with the demo pair's structure (a 6-layer target whose first
layer is dense, a 2-layer DFlash drafter reading layers 1, 3, 5): the counts do not depend on
the widths.  ``--full-glue`` sets ``KDTREE_LEAN_ROUND=0`` (docs/ENGINE.md, "Device rounds").
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
import threading

import numpy as np

_PACKAGE = os.sep + "kdtree_numba" + os.sep
_state = threading.local()
_lock = threading.Lock()


class Counter:
    """Launch counts by site while :attr:`active`; ``uploads`` apart."""

    def __init__(self):
        self.counts = collections.Counter()
        self.uploads = collections.Counter()
        self.active = False
        self.quiet = 0            # > 0: inside a counted operation or a numba op

    def snapshot(self) -> collections.Counter:
        return collections.Counter(self.counts)

    @contextlib.contextmanager
    def window(self):
        """Counts made inside the block (a fresh Counter, yielded, filled on exit)."""
        before, was = self.snapshot(), self.active
        self.active = True
        got = collections.Counter()
        try:
            yield got
        finally:
            self.active = was
            got.update(self.counts)
            got.subtract(before)
            for k in [k for k, v in got.items() if v == 0]:
                del got[k]

    def add(self, what: str, n: int = 1, upload: bool = False, kernel: bool = False) -> None:
        """Count ``n`` launches of ``what`` at the calling package function (an array
        operation inside another one, or inside a numba op, is not counted: ``quiet``); a
        numba ``kernel`` launch counts wherever it is made."""
        if not self.active or (self.quiet and not kernel) or n == 0:
            return
        site = _site()
        (self.uploads if upload else self.counts)[f"{site}: {what}"] += n

    @contextlib.contextmanager
    def silenced(self):
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1


COUNTER = Counter()


def _site() -> str:
    """The innermost package function on the stack outside this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if _PACKAGE in name:
            module = os.path.splitext(name.split(_PACKAGE)[-1])[0].replace(os.sep, ".")
            return f"{module}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "(outside the package)"


def _plain(x):
    return x.view(np.ndarray) if isinstance(x, DevArray) else x


def _wrap(x):
    if isinstance(x, np.ndarray) and not isinstance(x, DevArray) and x.ndim > 0:
        return x.view(DevArray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


def _advanced(index) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (np.ndarray, list)) for i in index)


class DevArray(np.ndarray):
    """A device array of the counted backend: each operation CuPy would launch is counted."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        COUNTER.add(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}")
        inputs = tuple(_plain(i) for i in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(o) for o in kwargs["out"])
        with COUNTER.silenced():
            out = getattr(ufunc, method)(*inputs, **kwargs)
        return _wrap(out)

    def __getitem__(self, index):
        if _advanced(index):
            COUNTER.add("take")
        index = tuple(_plain(i) for i in index) if isinstance(index, tuple) else _plain(index)
        return _wrap(np.ndarray.__getitem__(self.view(np.ndarray), index))

    def __setitem__(self, index, value):
        if isinstance(value, np.ndarray) and not isinstance(value, DevArray):
            COUNTER.add("setitem", upload=True)         # a host array copied up
        else:
            COUNTER.add("scatter" if _advanced(index) else "setitem")
        index = tuple(_plain(i) for i in index) if isinstance(index, tuple) else _plain(index)
        np.ndarray.__setitem__(self.view(np.ndarray), index, _plain(value))

    def copy(self, order="C"):
        COUNTER.add("copy")
        return _wrap(self.view(np.ndarray).copy(order))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if copy or np.dtype(dtype) != self.dtype:
            COUNTER.add("astype")
        return _wrap(self.view(np.ndarray).astype(dtype, order, casting, False, copy))

    def fill(self, value):
        COUNTER.add("fill")
        self.view(np.ndarray).fill(value)


def _copies_inputs(name):
    def count(*args, **kwargs):
        arrays = args[0] if args else kwargs.get("arrays", ())
        return len(arrays)
    return count


# xp functions: launches each call makes (a callable of the arguments, or a number)
_XP_LAUNCHES = {
    "zeros": 1, "ones": 1, "full": 1, "arange": 1, "zeros_like": 1, "ones_like": 1,
    "full_like": 1, "take_along_axis": 1, "where": 1, "take": 1, "copy": 1,
    "concatenate": _copies_inputs("concatenate"), "stack": _copies_inputs("stack"),
    "empty": 0, "empty_like": 0, "broadcast_to": 0, "reshape": 0, "asnumpy": 0,
}


class CountingXp:
    """NumPy as the array module of the counted backend (module docstring)."""

    def __getattr__(self, name):
        target = getattr(np, name)
        if not callable(target) or isinstance(target, type):
            return target
        if name in ("asarray", "ascontiguousarray", "array"):
            return functools.partial(self._asarray, name, target)
        launches = _XP_LAUNCHES.get(name)
        if launches is None and isinstance(target, np.ufunc):
            launches = 1

        def call(*args, **kwargs):
            n = launches(*args, **kwargs) if callable(launches) else (launches or 0)
            if launches is None:
                n = 1         # an operation not modelled above: one launch, named
            COUNTER.add(name, n)
            args = tuple(_plain(a) if not isinstance(a, (list, tuple)) else
                         type(a)(_plain(v) for v in a) for a in args)
            kwargs = {k: _plain(v) for k, v in kwargs.items()}
            with COUNTER.silenced():
                out = target(*args, **kwargs)
            if name in ("concatenate", "stack"):
                # CuPy's result is C-ordered; NumPy's follows its inputs' (a broadcast one
                # can leave it strided, and a later ascontiguousarray would count a copy)
                out = np.ascontiguousarray(out)
            return _wrap(out)
        return call

    @staticmethod
    def _asarray(name, target, a, *args, **kwargs):
        if isinstance(a, DevArray):
            plain = a.view(np.ndarray)
            with COUNTER.silenced():
                out = target(plain, *args, **kwargs)
            if not np.shares_memory(out, plain) or name == "array":
                COUNTER.add(name)
            return _wrap(out)
        COUNTER.add(name, upload=True)
        return _wrap(np.array(target(a, *args, **kwargs)))


def _counted_kernel_call(real):
    def call(self, *args):
        from numba.cuda.simulator import kernel as sim
        if self._device or sim._kernel_context:
            return real(self, *args)
        fn = self.fn
        module = (fn.__module__ or "generated").rsplit('.', 1)[-1]     # tiled.py's: exec'd
        COUNTER.add(f"kernel {module}.{fn.__name__}", kernel=True)
        with COUNTER.silenced():
            return real(self, *(_plain(a) for a in args))
    return call


def _quiet_op(op):
    """A numba op that counts only its kernels and gives DevArray results."""
    from kdtree_numba.backends import map_arrays

    def run(*args, **kwargs):
        with COUNTER.silenced():
            args = map_arrays(_plain, args, lambda x: isinstance(x, np.ndarray))
            kwargs = map_arrays(_plain, kwargs, lambda x: isinstance(x, np.ndarray))
            out = op(*args, **kwargs)
        return map_arrays(_wrap, out, lambda x: isinstance(x, np.ndarray))
    return run


@contextlib.contextmanager
def installed():
    """The simulator's kernel launches counted (while a :class:`Counter` window is open)."""
    from numba.cuda.simulator import kernel as sim
    real = sim.FakeCUDAKernel.__call__
    sim.FakeCUDAKernel.__call__ = _counted_kernel_call(real)
    try:
        yield COUNTER
    finally:
        sim.FakeCUDAKernel.__call__ = real


def counting_backend():
    """A numba backend (simulator) whose array module and arrays count (module docstring)."""
    from kdtree_numba.backends import make_backend
    be = make_backend("numba")
    if be.on_gpu:
        raise RuntimeError("the launch counter runs in the CUDA simulator only")
    xp = CountingXp()
    ops = be.ops
    for name, value in list(vars(ops).items()):
        if name == "glue":
            ops.glue = xp
        elif callable(value) and (hasattr(value, "__wrapped__") or
                                  hasattr(getattr(value, "func", None), "__wrapped__")):
            setattr(ops, name, _quiet_op(value))
    return dataclasses.replace(be, xp=xp, ops=ops)


def round_and_step(target, drafter, budget: int, prompts, new_tokens: int = 2):
    """(launches of the first device round, of the first AR step): counts by
    site from DDTree with device rounds and from AR, both on ``target``; the DDTree tokens are
    returned too, and AR's."""
    from kdtree_numba.device_round import DeviceRounds
    from kdtree_numba.engine import generate
    counts = {}
    real_round = DeviceRounds._round

    def counted_round(self, b, active):
        if "round" in counts:
            return real_round(self, b, active)
        with COUNTER.window() as got:
            out = real_round(self, b, active)
        counts["round"] = got
        return out
    DeviceRounds._round = counted_round
    try:
        dd = generate(target, prompts, new_tokens, method="ddtree", drafter=drafter,
                      budget=budget, device_rounds=True)
    finally:
        DeviceRounds._round = real_round
    decode, choose = target.decode, target.choose
    steps = []

    def counted_decode(cache, tokens):
        window = COUNTER.window()
        steps.append((window, window.__enter__()))
        return decode(cache, tokens)

    def counted_choose(*args, **kwargs):
        out = choose(*args, **kwargs)
        if steps and steps[-1][0] is not None:       # a decode's window (not the prefill's)
            steps[-1][0].__exit__(None, None, None)
            steps[-1] = (None, steps[-1][1])
        return out
    target.decode, target.choose = counted_decode, counted_choose
    try:
        ar = generate(target, prompts, new_tokens)
    finally:
        del target.decode, target.choose
    counts["step"] = steps[0][1]
    return counts["round"], counts["step"], dd.tokens, ar.tokens


def tiny_pair(target_over: dict, drafter_over: dict, feature_layers, block: int,
              seed: int = 0):
    """A tiny target (``size_config("tiny", **target_over)``) and its DFlash drafter, both on
    :func:`counting_backend` (tests/test_dflash.py's fixtures)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_dflash import pair
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    tcfg, tw, dcfg, dw, spec = pair(target_over, drafter_over, feature_layers, block, seed)
    target = Model(tcfg, tw, counting_backend())
    return target, DFlashDrafter(target, dcfg, dw, spec)


# a 2-layer target (the first dense, then MoE with a shared expert, 4 experts in 2 groups) and
# a 2-layer drafter reading both layers, block 3: the switches' same-bits tests
# (test_lean_round.py and others).  Small widths (D 8, r 8, V 16) and 4 experts: the launch
# counts do not depend on them, and the simulated blocks of a launch scale with them.
SMALL_TARGET = dict(num_hidden_layers=2, first_k_dense_replace=1, vocab_size=16,
                    hidden_size=8, intermediate_size=8, q_lora_rank=None, kv_lora_rank=8,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                    num_attention_heads=1, moe_intermediate_size=8, n_routed_experts=4,
                    n_group=2, topk_group=1)


def rounds_and_bits():
    """On a fresh :data:`SMALL_TARGET` pair under the environment as it is: (launches of a
    device round, of an AR step, DDTree's tokens, AR's tokens, (one more proposal's logits,
    one more decode's), (the drafter's and the target's cache arrays and lengths)) -- what a switch that
    keeps the bits must keep, and the launches it changes."""
    target, drafter = tiny_pair(SMALL_TARGET, dict(num_hidden_layers=2), (0, 1), 3)
    rnd, step, dd, ar = round_and_step(target, drafter, 3, [[3, 9, 4], [5]])
    # the drafter's context after DDTree, the target's cache after AR, one more proposal's
    # logits and one more decode's (the drafter's block, the dense FFN, the slots)
    dcache, tcache = drafter.cache, target.generation_cache
    roots = np.array([7, 2], np.int32)
    logits = (np.array(drafter.draft(roots)), np.array(target.decode(tcache, roots)))
    caches = tuple(np.array(a) for a in (dcache.c, dcache.k_pe, tcache.c, tcache.k_pe,
                                         dcache.device_lengths, tcache.device_lengths))
    return rnd, step, dd, ar, logits, caches


def same_results(*runs):
    """Assert that :func:`rounds_and_bits` results give the same DDTree and AR tokens (DDTree's
    = AR's) and the same logits and cache bits."""
    first = runs[0]
    for run in runs:
        assert run[2] == first[2] == run[3] == first[3]          # DDTree's, AR's tokens
        for a, b in zip(run[4] + run[5], first[4] + first[5]):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# the demo pair's structure at tiny widths: 6 layers, the first dense, MoE with a shared
# expert; a 2-layer drafter reading layers 1, 3, 5, block 4
DEMO_LIKE = (dict(num_hidden_layers=6, first_k_dense_replace=1, vocab_size=32, hidden_size=16,
                  intermediate_size=16, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=1,
                  moe_intermediate_size=8),
             dict(num_hidden_layers=2), (1, 3, 5), 4)


def table(counts: collections.Counter) -> list[tuple[str, int]]:
    """(site, launches) sorted by site, and the total last."""
    rows = sorted(counts.items())
    return rows + [("total", sum(counts.values()))]


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full-glue", action="store_true", help="KDTREE_LEAN_ROUND=0")
    p.add_argument("--budget", type=int, default=4)
    args = p.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        p.error("run with NUMBA_ENABLE_CUDASIM=1 (the counter wraps the CUDA simulator)")
    if args.full_glue:
        os.environ["KDTREE_LEAN_ROUND"] = "0"
    with installed():
        target, drafter = tiny_pair(*DEMO_LIKE)
        rnd, step, _, _ = round_and_step(target, drafter, args.budget, [[3, 9, 4]])
    for name, counts in (("device round, budget %d" % args.budget, rnd), ("AR step", step)):
        print(f"\n{name}")
        for site, n in table(counts):
            print(f"  {n:4d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where each kernel comes from, in words another process can act on: the recipes behind
kdtree_numba/precompile.py (issue 36 item 4, "First run on a GPU"; docs/ENGINE.md).

A fresh process compiles every kernel on its first launch, one after another (numba holds one
compiler lock per process): ~45 s of a first AR run on an H100, ~50 s more for DDTree.  To
compile them in parallel, in other processes, ahead of the run, those processes must make the
*same* kernel (same function, same closure, so the same disk-cache key) and compile it for the
*same* argument types.  Most kernels are made by factories per configuration (a tile config,
a thread count, a row bound); so each kernel carries its **recipe**:

* a kernel made inside a factory decorated with :func:`kernel_factory` records that factory's
  module, name and call arguments (the innermost decorated factory on the call stack), and the
  kernel function's qualified name (one factory can make several);
* a module-level kernel records its module and name.

:func:`register` (called by ``compat.kernel`` for every kernel) files each kernel under its
Python function.  After a run, :func:`recorded_entries` lists every (recipe, argument types)
the process compiled or loaded: on a GPU from each dispatcher's own overloads, under the CUDA
simulator (which never types its arguments) from the launches seen while
:func:`recording_launches` was on.  An entry is plain JSON (:func:`entry_json`); another
process turns it back into the kernel with :func:`rebuild` and into numba types with
:func:`decode_types`.  A factory argument or type that would not survive that round trip makes
the entry ``unrebuildable`` (with the reason), never a wrong one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import threading

import numpy as np

from kdtree_numba import runtime

__all__ = ["kernel_factory", "register", "recorded_entries", "recording_launches", "rebuild",
           "decode_types", "encode_types", "entry_json", "RecipeError", "kernel_name",
           "compile_counts"]


class RecipeError(ValueError):
    """A recipe or argument type that cannot be written as JSON or made again."""


_STACK = threading.local()      # .calls: the kernel_factory calls in progress on this thread
# py_func -> (recipe or None, kernel object); kernels live as long as their factory's cache
_KERNELS: dict = {}
_LAUNCHED: dict = {}            # simulator recording: py_func -> set of argument-type tuples


def kernel_factory(fn):
    """``functools.cache`` for a function that makes kernels, remembering its call as the
    recipe of the kernels it makes (module docstring).  Its arguments must be JSON-able:
    numbers, strings, None, tuples, numpy scalar types and frozen dataclasses of those."""
    name = f"{fn.__module__}:{fn.__qualname__}"

    @functools.wraps(fn)
    def build(*args, **kwargs):
        calls = getattr(_STACK, "calls", None)
        if calls is None:
            calls = _STACK.calls = []
        calls.append((name, args, kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            calls.pop()
    cached = functools.cache(build)
    cached.kernel_factory = True      # what rebuild() may call
    return cached


def kernel_name(py_func) -> str:
    return f"{py_func.__module__}:{py_func.__qualname__}"


def register(kernel, py_func) -> None:
    """File ``kernel`` (what ``compat.kernel`` returns) under ``py_func`` with its recipe."""
    calls = getattr(_STACK, "calls", None)
    _KERNELS[py_func] = (calls[-1] if calls else None, kernel)


# ----------------------------------------------------------------------------- recording

@contextlib.contextmanager
def recording_launches():
    """Under the simulator: note each kernel launch's argument types while inside (on a GPU
    the dispatchers keep their own overloads, and this does nothing)."""
    if not runtime.current().simulator:
        yield
        return
    from numba.cuda.simulator import kernel as sim
    original = sim.FakeCUDAKernel.__call__

    def call(self, *args):
        if not self._device and self.fn in _KERNELS:
            _LAUNCHED.setdefault(self.fn, set()).add(tuple(_typeof(a) for a in args))
        return original(self, *args)
    sim.FakeCUDAKernel.__call__ = call
    try:
        yield
    finally:
        sim.FakeCUDAKernel.__call__ = original


def _typeof(value):
    from numba import typeof
    return typeof(value)


def compile_counts() -> tuple[int, int]:
    """(loaded from the disk cache, compiled) over every kernel of this process so far (a GPU
    only: numba's own counters; the GPU test of kdtree_numba/precompile.py reads them)."""
    hits = misses = 0
    for _recipe, kernel in list(_KERNELS.values()):
        dispatcher = getattr(kernel, "dispatcher", kernel)
        hits += sum(getattr(dispatcher, "_cache_hits", {}).values())
        misses += sum(getattr(dispatcher, "_cache_misses", {}).values())
    return hits, misses


def _signatures(py_func, kernel):
    dispatcher = getattr(kernel, "dispatcher", kernel)
    overloads = getattr(dispatcher, "overloads", None)
    if isinstance(overloads, dict) and overloads:
        return set(overloads)
    return _LAUNCHED.get(py_func, set())


def recorded_entries() -> list[dict]:
    """Every (recipe, argument types) this process compiled or loaded (module docstring), as
    :func:`entry_json` dicts, in a stable order; entries that cannot be made again carry
    ``"unrebuildable": reason``."""
    out = []
    for py_func, (recipe, kernel) in list(_KERNELS.items()):
        for argtypes in _signatures(py_func, kernel):
            out.append(entry_json(py_func, recipe, argtypes))
    return sorted(out, key=lambda e: (e["kernel"], repr(e.get("factory")), repr(e["types"])))


def entry_json(py_func, recipe, argtypes) -> dict:
    entry = {"kernel": kernel_name(py_func)}
    try:
        if recipe is None:
            if "<locals>" in py_func.__qualname__:
                raise RecipeError(f"{entry['kernel']} is made outside any kernel_factory")
        else:
            name, args, kwargs = recipe
            entry["factory"] = {"name": name, "args": [_encode(a) for a in args],
                                "kwargs": {k: _encode(v) for k, v in sorted(kwargs.items())}}
        entry["types"] = encode_types(argtypes)
    except RecipeError as e:
        entry.setdefault("types", [str(t) for t in argtypes])
        entry["unrebuildable"] = str(e)
    return entry


# ----------------------------------------------------------------------------- values

_PLAIN = (bool, int, float, str, type(None))


def _encode(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    if isinstance(value, type) and issubclass(value, np.generic):
        return {"numpy": np.dtype(value).name}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not value.__dataclass_params__.frozen:
            raise RecipeError(f"{type(value).__qualname__} is not a frozen dataclass")
        cls = type(value)
        fields = {f.name: _encode(getattr(value, f.name))
                  for f in dataclasses.fields(value) if f.init}
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise RecipeError(f"a factory argument of type {type(value).__qualname__} has no JSON "
                      f"form")


def _resolve(name: str, what: str):
    """The object ``module:qualname`` names, only inside this package and only if it is
    ``what`` ("factory": a kernel_factory; "kernel": a registered kernel; "dataclass"): a
    manifest is data, and must not name any other callable."""
    module, _, qualname = name.partition(":")
    if module.split(".")[0] != "kdtree_numba":
        raise RecipeError(f"{name}: not a kdtree_numba name")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    ok = {"factory": lambda: getattr(obj, "kernel_factory", False) is True,
          "kernel": lambda: any(k is obj for _r, k in list(_KERNELS.values())),
          "dataclass": lambda: isinstance(obj, type) and dataclasses.is_dataclass(obj)}[what]
    if not ok():
        raise RecipeError(f"{name}: not a {'kernel factory' if what == 'factory' else what}")
    return obj


def _decode(value):
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    if "numpy" in value:
        return np.dtype(value["numpy"]).type
    if "dataclass" in value:
        cls = _resolve(value["dataclass"], "dataclass")
        return cls(**{k: _decode(v) for k, v in value["fields"].items()})
    raise RecipeError(f"unknown value form {sorted(value)}")


# ----------------------------------------------------------------------------- numba types

@functools.cache
def _scalar_names() -> dict:
    """numba's scalar types by the name ``numba.cuda.types`` gives them (float16, bfloat16,
    int64, bool, ...): the JSON form of a scalar, or of an array's dtype."""
    from numba.cuda import types
    out = {}
    for name in sorted(dir(types)):
        value = getattr(types, name)
        if isinstance(value, (types.Number, types.Boolean)) or \
                type(value).__name__.lower().startswith("bfloat16"):
            # its own name where that is one ("int64", not the alias "c_int64")
            if name == str(value) or value not in out:
                out[value] = name
    return out


def _encode_type(ty):
    from numba.cuda import types
    if isinstance(ty, types.Array):
        return {"array": _encode_type(ty.dtype), "ndim": ty.ndim, "layout": ty.layout,
                "mutable": ty.mutable, "aligned": ty.aligned}
    try:
        return _scalar_names()[ty]
    except (KeyError, TypeError):
        raise RecipeError(f"argument type {ty} has no JSON form") from None


def _decode_type(value):
    from numba.cuda import types
    if isinstance(value, str):
        ty = getattr(types, value, None)
        if ty not in _scalar_names():
            raise RecipeError(f"unknown scalar type {value!r}")
        return ty
    return types.Array(_decode_type(value["array"]), value["ndim"], value["layout"],
                       readonly=not value["mutable"], aligned=value["aligned"])


def encode_types(argtypes) -> list:
    """The JSON form of a tuple of numba argument types; RecipeError where a type has none or
    would not decode to itself."""
    out = [_encode_type(t) for t in argtypes]
    if decode_types(out) != tuple(argtypes):
        raise RecipeError(f"argument types {argtypes} do not survive their JSON form")
    return out


def decode_types(values) -> tuple:
    return tuple(_decode_type(v) for v in values)


# ----------------------------------------------------------------------------- rebuilding

def rebuild(entry: dict):
    """The kernel object of ``entry`` in this process (making it through its factory), or
    RecipeError naming what no longer matches the source (a renamed factory or kernel)."""
    if "unrebuildable" in entry:
        raise RecipeError(entry["unrebuildable"])
    wanted = entry["kernel"]
    factory = entry.get("factory")
    try:
        if factory is None:
            kernel = _resolve(wanted, "kernel")
            made = {kernel_name(getattr(kernel, "py_func", kernel)): kernel}
        else:
            fn = _resolve(factory["name"], "factory")
            args = [_decode(a) for a in factory["args"]]
            kwargs = {k: _decode(v) for k, v in factory["kwargs"].items()}
            fn(*args, **kwargs)
            made = {kernel_name(f): k for f, (r, k) in list(_KERNELS.items())
                    if r is not None and r[0] == factory["name"] and r[1] == tuple(args)
                    and r[2] == kwargs}
    except (ImportError, AttributeError, TypeError) as e:
        raise RecipeError(f"{factory['name'] if factory else wanted}: {type(e).__name__}: "
                          f"{e}") from None
    if wanted not in made:
        raise RecipeError(f"{factory['name'] if factory else wanted} no longer makes "
                          f"{wanted}")
    return made[wanted]

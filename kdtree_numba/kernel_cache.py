"""Compiled kernels kept between processes: numba's disk cache, in a directory keyed by this
package's source (issue 14, "The first run on a GPU"; docs/ENGINE.md, "Kernel cache").

numba compiles each kernel on its first launch in a process; the engine's first forward on the
H200 spent ~25 s of a 55 s first run doing it.  With ``cache=True`` numba stores each compiled
kernel on disk and the next process loads it instead.  Two things make that safe here:

* **Stale entries.**  numba keys an entry by the kernel function's own bytecode and its source
  file's timestamp, not by the device functions it calls from other files: an edit to
  ``gpu/memory.py`` would leave every kernel that inlines it stale.  So the directory is named
  by a hash of every ``.py`` file of ``kdtree_numba`` (and the numba-cuda and Python versions):
  any source change starts a fresh directory, and an installed release keeps one.
* **Kernels made by factories** close over device functions and configuration values.  numba
  hashes a closure by pickling its cells, and a pickled dispatcher differs from process to
  process, so such a kernel never hit the cache (measured on the H200: 11 of 24 kernels of a
  first forward missed in a second process, 12 of its 13 s).  :class:`StableKeyCache` keys the
  closure by what it names instead: functions by module, qualified name, file, line and
  bytecode (recursively through their own closures), plain values by their ``repr``.  A cell
  with no stable description falls back to numba's own key (a miss per process, never a
  wrong hit).
* **Generated kernels** (the tiled GEMM and the skinny accumulators are made from source text
  per configuration) have no file, and numba caches only functions backed by one.
  :func:`generated_code` writes each generated source once, under its content hash, into the
  cache directory and compiles it from there: the key is stable across processes.

The entries are numba's own files, which it reads with pickle.  They are written and read only
by this user's processes: the directory is created private (0700), and one that is not owned by
this user or that others can write is not used (the run then compiles, with a warning).  That
is the same trust as the installed Python code itself; a bundle or any other input never goes
near it.

``KDTREE_KERNEL_CACHE=0`` turns the cache off; ``KDTREE_KERNEL_CACHE_DIR`` moves it (default
``$XDG_CACHE_HOME/kdtree-numba`` or ``~/.cache/kdtree-numba``).  Under the CUDA simulator there
is nothing to cache.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
import sys
import warnings

from kdtree_numba import runtime

__all__ = ["cache_dir", "cache_is_warm", "generated_code", "describe", "closure_key",
           "UnstableClosure", "stable_cache_for", "has_stable_key"]

PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _enabled() -> bool:
    config = runtime.current()
    return config.kernel_cache and not config.simulator


def source_key() -> str:
    """16 hex digits over the package's .py files (paths and bytes), numba-cuda's version, the
    Python version and KDTREE_CUDA_LINEINFO: what a compiled kernel can depend on (the GPU's
    compute capability is in numba's own key)."""
    h = hashlib.sha256()
    try:
        from importlib.metadata import version
        h.update(version("numba-cuda").encode())
    except Exception:       # noqa: BLE001 -- a source checkout without metadata
        h.update(b"numba-cuda ?")
    h.update(sys.version.encode())
    # compile options that come from the environment, not the source
    h.update(f"lineinfo={'1' if runtime.current().lineinfo else '0'}".encode())
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, PACKAGE).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _base_dir() -> str:
    return runtime.current().kernel_cache_dir


def _private_dir(path: str) -> bool:
    """Create ``path`` (0700) if needed; True when it is a directory this user owns that no one
    else can write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        warnings.warn(f"kdtree-numba: kernel cache {path} not usable ({e}); kernels compile "
                      f"in every process", stacklevel=3)
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        warnings.warn(f"kdtree-numba: kernel cache {path} is not private to this user (owner "
                      f"uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); not used",
                      stacklevel=3)
        return False
    return True


@functools.cache
def cache_dir() -> str | None:
    """The directory of this source's compiled kernels, or None when caching is off.  Points
    numba's cache there the first time it is asked (``runtime.point_numba_cache``: its
    variable as well as its config, which numba resets from the variables; else kernels made
    later cache beside their source, where the precompile workers' are not and the source key
    above guards nothing: runs 170-172)."""
    if not _enabled():
        return None
    base = _base_dir()
    path = os.path.join(base, f"kernels-{source_key()}")
    if not (_private_dir(base) and _private_dir(path)):
        return None
    runtime.point_numba_cache(path)
    return path


def cache_is_warm() -> bool:
    """True when the cache directory holds compiled kernels (a previous process ran here)."""
    path = cache_dir()
    if path is None:
        return False
    for _root, _dirs, files in os.walk(path):
        if any(f.endswith(".nbc") for f in files):
            return True
    return False


def generated_code(source: str, tag: str, namespace: dict) -> str:
    """Compile generated ``source`` into ``namespace`` from a real file (so numba can cache what
    it defines); returns that file's path, or a pseudo-name when the cache is off.

    The file is named by the hash of the source and of the names the namespace binds, written
    once (atomically, the first writer of several processes winning) and never rewritten:
    numba keys its index on the file's timestamp."""
    path = cache_dir()
    if path is None:
        filename = f"<{tag}>"
    else:
        bound = ",".join(f"{k}={getattr(v, '__qualname__', type(v).__name__)}"
                         for k, v in sorted(namespace.items()))
        digest = hashlib.sha256((source + "\0" + bound).encode()).hexdigest()[:20]
        folder = os.path.join(path, "generated")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        safe = "".join(c if c.isalnum() else "_" for c in tag.split()[0])[:24]
        filename = os.path.join(folder, f"{safe}_{digest}.py")
        if not os.path.exists(filename):
            tmp = f"{filename}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"# generated by kdtree-numba: {tag}\n" + source)
            # the first writer wins and the file is never replaced: a process that compiled
            # from it keyed its index on its timestamp (the precompile workers write at once)
            try:
                os.link(tmp, filename)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        source = f"# generated by kdtree-numba: {tag}\n" + source
    exec(compile(source, filename, "exec"), namespace)    # noqa: S102 -- our own generated code
    return filename


class UnstableClosure(Exception):
    """A closure cell with no description that is the same in every process."""


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def _describe(value, depth: int = 0) -> str:
    if depth > 8:
        raise UnstableClosure("closure nesting too deep")
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, frozenset) else value
        return f"{type(value).__name__}(" + ",".join(_describe(v, depth + 1) for v in items) + ")"
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):   # arrays, scalars
        # not repr: numpy abbreviates big arrays, and two tables would look alike
        return (f"numpy:{value.dtype.str}:{getattr(value, 'shape', ())}:"
                f"{hashlib.sha256(value.tobytes()).hexdigest()}")
    fn = getattr(value, "py_func", value)          # a numba dispatcher -> its Python function
    code = getattr(fn, "__code__", None)
    if code is not None:
        return (f"fn:{getattr(fn, '__module__', '')}:{fn.__qualname__}:{code.co_filename}:"
                f"{code.co_firstlineno}:{hashlib.sha256(code.co_code).hexdigest()[:16]}:"
                f"{closure_key(fn, depth + 1)}")
    if isinstance(value, type):
        return f"type:{value.__module__}.{value.__qualname__}"
    text = repr(value)
    if " at 0x" in text or " object at " in text:
        raise UnstableClosure(f"{type(value).__qualname__} has no stable repr")
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def closure_key(fn, depth: int = 0) -> str:
    """A description of ``fn``'s closure cells that is identical in every process (raises
    UnstableClosure when a cell has none)."""
    cells = fn.__closure__ or ()
    return "[" + ";".join(_describe(c.cell_contents, depth) for c in cells) + "]"


def stable_cache_for(dispatcher):
    """Give a ``cache=True`` kernel dispatcher the process-stable closure key (module
    docstring); one whose closure cannot be described keeps numba's cache."""
    from numba.cuda.dispatcher import CUDACache
    if not isinstance(getattr(dispatcher, "_cache", None), CUDACache):
        return dispatcher
    try:
        key = closure_key(dispatcher.py_func)
    except UnstableClosure:
        return dispatcher
    dispatcher._cache = _stable_cache_class()(dispatcher.py_func, key)
    return dispatcher


def has_stable_key(dispatcher) -> bool:
    """True when ``dispatcher`` keeps its kernels on disk under a key every process computes
    alike (what a precompile worker can fill for the run)."""
    return type(getattr(dispatcher, "_cache", None)) is _stable_cache_class()


@functools.cache
def _stable_cache_class():
    import numba_cuda
    from numba.cuda.dispatcher import CUDACache

    class StableKeyCache(CUDACache):
        """numba's CUDA kernel cache with the closure hashed from :func:`closure_key`."""

        def __init__(self, py_func, closure: str):
            self._closure = closure
            super().__init__(py_func)

        def save_overload(self, sig, data):
            # numba rewrites a function's whole index on each save and numbers a new entry's
            # data file by the index it read: two processes saving into one index at once
            # (the precompile workers, two runs) could lose an entry or, worse, give two keys
            # one data file.  One lock per cache folder makes each save see the last.
            with _folder_lock(self._cache_path):
                super().save_overload(sig, data)

        def _index_key(self, sig, codegen):
            code = hashlib.sha256(self._py_func.__code__.co_code).hexdigest()
            key = (sig, codegen.magic_tuple(), numba_cuda.__version__,
                   (code, hashlib.sha256(self._closure.encode()).hexdigest()))
            if self._launch_config_key is not None:
                key += (("launch_config", self._launch_config_key),)
            return key
    return StableKeyCache


@contextlib.contextmanager
def _folder_lock(folder: str):
    """An exclusive lock on ``folder``'s ``.save.lock`` (POSIX; elsewhere none)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    with open(os.path.join(folder, ".save.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def describe() -> str:
    path = cache_dir()
    if path is None:
        return "kernel cache off"
    return f"kernel cache {path} ({'warm' if cache_is_warm() else 'cold: kernels compile now'})"

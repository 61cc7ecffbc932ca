"""Compile a run's kernels in parallel into the disk cache before the run (issue 36 item 4;
docs/ENGINE.md, "First run on a GPU").  Console script: ``kdtree-precompile``.

Why: numba compiles a kernel on its first launch and holds one compiler lock per process, so a
fresh process compiles its ~100 kernels one after another (a first ``kdtree-run --method
ddtree`` on an H100: ~95 s of compiles).  The kernels do not depend on each other, and the GPU
machine has 16 cores.

How:

* **A manifest** lists what a run needs: per kernel its recipe (the factory and arguments that
  make it, kdtree_numba/kernel_recipes.py) and the numba argument types it was compiled for.
  Runs record it (:func:`record`): every ``kdtree-run`` on a GPU adds what it compiled or
  loaded to ``manifest.json`` in the kernel cache's base directory (outside the per-source
  folder, so it outlives a source change), and ``kdtree_numba/demo/kernels.json`` ships the
  demo pair's, so a fresh machine has one.  Entries are grouped by a **profile**: the target's
  config and the drafter's (:func:`profile`).
* **Workers** (:func:`compile_entries`): fresh interpreters (``python -m
  kdtree_numba.precompile --worker``; a fresh process, as ``spawn`` gives, never a fork of a
  process that holds a CUDA context), each fed one entry at a time over a pipe as JSON lines,
  so the slow kernels spread out.  A worker makes the kernel through its recipe, which gives the
  same function and closure and so the same disk-cache key as the run
  (kdtree_numba/kernel_cache.py), and calls the dispatcher's own ``compile`` for the recorded
  types: numba compiles, links the cubin for this GPU and saves the entry to the disk cache,
  exactly as the run's first launch would, so the run then only loads.  numba-cuda's cache
  key includes the GPU's compute capability and the CUDA runtime version from the current
  context, so a cache worker needs the GPU (one context each); ``--mode ptx`` compiles to
  sm_90 PTX without one (a check for machines without a GPU, and the tests).
* numba rewrites a function's index file on each save; kernel_cache.py's lock keeps two
  workers' saves into one index from losing an entry.

Errors: a worker reports each entry that fails as one line (the kernel, the exception); the
run then compiles that kernel itself, as before.  An entry whose recipe no longer matches the
source (a renamed factory) fails the same way: re-record the manifest (``kdtree-run
--record-kernels FILE``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time

from formats.console import ArgumentParser, UsageError, add_debug_flag, run_console
from kdtree_numba import kernel_cache, kernel_recipes, runtime

__all__ = ["profile", "read_manifest", "entries_for", "record", "compile_entries", "warm_up",
           "mark_warm", "PrecompileResult", "ManifestError", "SHIPPED", "local_manifest",
           "ptx_digest", "main"]

FORMAT = "kdtree-numba kernel manifest"
VERSION = 1
PACKAGE = os.path.dirname(os.path.abspath(__file__))
SHIPPED = os.path.join(PACKAGE, "demo", "kernels.json")
PROG = "kdtree-precompile"
# what numba numbers per process in PTX symbol names: compiled functions ("...B2v7B...") and
# shared arrays ("_cudapy_smem_12")
_PROCESS_NUMBERS = re.compile(r"B\d+v\d+B|(?<=_cudapy_smem_)\d+")


class ManifestError(UsageError):
    """A manifest file that is not one, or of another version (one line, exit 2)."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile(target_config, drafter_kind: str | None = None, drafter_config=None,
            run: str | None = None) -> str:
    """``<target>/<drafter>``: hashes of the configs that choose the kernels (their dataclass
    reprs: widths, experts, dtypes), ``none`` for no drafter; ``run`` names a kind of run that
    needs kernels the default one does not (``"auto"``: ``--budget auto``, whose rounds visit
    other budgets, so other tree and verify widths): ``<target>/<drafter>/<run>``, whose
    entries add to the default's (:func:`entries_for`)."""
    drafter = "none" if drafter_kind is None else _digest(f"{drafter_kind}|{drafter_config!r}")
    key = f"{_digest(repr(target_config))}/{drafter}"
    return key if run is None else f"{key}/{run}"


def _run_tag(key: str) -> str | None:
    parts = key.split("/")
    return parts[2] if len(parts) > 2 else None


def local_manifest() -> str:
    """This machine's recorded manifest, beside the per-source kernel folders."""
    return os.path.join(runtime.current().kernel_cache_dir, "manifest.json")


def read_manifest(path: str) -> dict:
    """``{profile: [entry, ...]}`` from ``path``; {} when there is no such file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: not a kernel manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ManifestError(f"{path}: not a kernel manifest (no format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ManifestError(f"{path}: kernel manifest version {data.get('version')!r}; this "
                            f"kdtree-numba reads version {VERSION}")
    profiles = data.get("profiles")
    if not isinstance(profiles, dict) or not all(
            isinstance(es, list) and all(isinstance(e, dict) for e in es)
            for es in profiles.values()):
        raise ManifestError(f"{path}: a kernel manifest's profiles map names to lists of "
                            f"entries")
    return profiles


def _unique(entries) -> list[dict]:
    """``entries`` without repeats, in their order."""
    seen, out = set(), []
    for e in entries:
        text = json.dumps(e, sort_keys=True)
        if text not in seen:
            seen.add(text)
            out.append(e)
    return out


def entries_for(key: str, paths=None) -> list[dict]:
    """The entries recorded for profile ``key`` in the manifests at ``paths`` (default: the
    shipped one and this machine's), without repeats (a run-tagged key: its run's and the
    default run's, :func:`profile`); where the exact profile was never recorded, those of
    every profile of the same target (the drafter's kernels too: compiled in parallel, an
    unneeded one costs a core for a while, not the run)."""
    if paths is None:
        paths = [SHIPPED, local_manifest()]
    manifests = [read_manifest(p) for p in paths]
    keys = [key] if _run_tag(key) is None else ["/".join(key.split("/")[:2]), key]
    exact = [e for k in keys for m in manifests for e in m.get(k, [])]
    target = key.split("/")[0] + "/"
    return _unique(exact or [e for m in manifests for k, es in m.items()
                             if k.startswith(target) for e in es])


def record(key: str, path: str | None = None) -> tuple[int, list[str]]:
    """Add what this process compiled or loaded to the manifest at ``path`` (default
    :func:`local_manifest`) under ``key``; returns how many entries were new and, one line
    each, those left out for want of a recipe (they compile in the run, as before)."""
    try:
        profiles = read_manifest(path or local_manifest())
    except ManifestError:
        if path is not None:
            raise
        profiles = {}       # this machine's own file, unreadable: it starts again
    path = path or local_manifest()
    old = {json.dumps(e, sort_keys=True) for e in profiles.get(key, [])}
    entries = kernel_recipes.recorded_entries()
    left_out = sorted({f"{e['kernel']}: {e['unrebuildable']}" for e in entries
                       if "unrebuildable" in e})
    new = [e for e in entries if "unrebuildable" not in e
           and json.dumps(e, sort_keys=True) not in old]
    if not new:
        return 0, left_out
    profiles[key] = profiles.get(key, []) + new
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": VERSION, "profiles": profiles}, f, indent=1,
                  sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return len(new), left_out


# ----------------------------------------------------------------------------- the pool

class PrecompileResult:
    """``compiled`` / ``cached`` counts, ``failed`` one line per failed entry, ``replies``
    every worker reply by entry index, ``seconds`` wall time, ``processes`` used."""

    def __init__(self, processes: int):
        self.processes, self.compiled, self.cached, self.seconds = processes, 0, 0, 0.0
        self.failed: list[str] = []
        self.replies: dict = {}


def _describe(entry: dict) -> str:
    """``KERNEL from FACTORY(ARGS)`` for a failure line (any entry, however malformed)."""
    kernel = str(entry.get("kernel", "?")).rpartition(":")[2].rpartition(".")[2]
    factory = entry.get("factory")
    if not isinstance(factory, dict):
        return kernel
    args = ", ".join(json.dumps(a, sort_keys=True) for a in factory.get("args", []))
    return f"{kernel} from {str(factory.get('name')).rpartition(':')[2]}({args[:120]})"


def cores() -> int:
    """The cores this process may run on (the workers' default count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_command(mode: str) -> list[str]:
    return [sys.executable, "-m", "kdtree_numba.precompile", "--worker", mode]


def _child_env(mode: str) -> dict:
    """The workers' environment: this package first on the path, this process's cache folder,
    and the simulator switch off where they compile (kept for "check", which compares what
    a fresh process makes with what this one made)."""
    root = os.path.dirname(PACKAGE)
    path = runtime.child_environment().get("PYTHONPATH", "")
    changes = {} if mode == "check" else {"NUMBA_ENABLE_CUDASIM": None}
    return runtime.child_environment(
        PYTHONPATH=os.pathsep.join(p for p in (root, path) if p),
        KDTREE_KERNEL_CACHE_DIR=runtime.current().kernel_cache_dir,
        NUMBA_DISABLE_PERFORMANCE_WARNINGS="1", **changes)


def compile_entries(entries: list[dict], processes: int | None = None, mode: str = "cache",
                    log=None, every: float = 5.0) -> PrecompileResult:
    """Compile ``entries`` on ``processes`` worker processes (default: one per core, at most
    one per entry).  ``mode`` "cache": into the disk cache (needs the GPU); "ptx": sm_90 PTX,
    whose :func:`ptx_digest` each reply carries; "check": each kernel made again and described
    (its name, its closure key's hash), nothing compiled.  ``log(line)`` gets progress
    lines."""
    processes = max(1, min(processes or cores(), len(entries) or 1))
    result = PrecompileResult(processes)
    todo: queue.Queue = queue.Queue()
    # the big kernels (attention, the GEMMs) take the most arguments: started first, the
    # pool does not end waiting on one of them alone
    for i in sorted(range(len(entries)), key=lambda i: -_size(entries[i])):
        todo.put(i)
    lock, t0, done = threading.Lock(), time.perf_counter(), [0]

    def finish(i, reply):
        with lock:
            result.replies[i] = reply
            done[0] += 1
            if reply.get("ok"):
                if reply.get("hit"):
                    result.cached += 1
                else:
                    result.compiled += 1
            else:
                result.failed.append(f"{_describe(entries[i])}: {reply.get('error')}")

    def serve(worker: subprocess.Popen, errors):
        current = None
        try:
            while True:
                try:
                    current = todo.get_nowait()
                except queue.Empty:
                    return
                worker.stdin.write(json.dumps({"id": current, "entry": entries[current]})
                                   + "\n")
                worker.stdin.flush()
                finish(current, _reply(worker, current))
                current = None
        except (EOFError, OSError, ValueError):
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or \
                ["no message"]
            worker.wait()
            if current is not None:
                finish(current, {"ok": False, "error": f"the worker died (exit "
                                 f"{worker.returncode}): {tail[0]}"})
        finally:
            try:
                worker.stdin.close()
            except OSError:
                pass
            worker.wait()
            worker.stdout.close()
            errors.close()

    threads = []
    for _ in range(processes):
        errors = tempfile.TemporaryFile()
        worker = subprocess.Popen(_worker_command(mode), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=errors, text=True,
                                  env=_child_env(mode), cwd=os.path.dirname(PACKAGE))
        t = threading.Thread(target=serve, args=(worker, errors), daemon=True)
        t.start()
        threads.append(t)
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(every)
            if log is not None and t.is_alive():
                log(f"... {done[0]} of {len(entries)} kernels, "
                    f"{time.perf_counter() - t0:.0f} s")
                break
    for i in range(len(entries)):         # every worker died before it got to these
        if i not in result.replies:
            finish(i, {"ok": False, "error": "not tried: every worker had died"})
    result.seconds = time.perf_counter() - t0
    return result


def _size(entry: dict) -> int:
    types = entry.get("types")
    return len(types) if isinstance(types, list) else 0


def _gpu() -> bool:
    from kdtree_numba import compat
    return compat.gpu_available()


def _reply(worker: subprocess.Popen, wanted: int) -> dict:
    """The worker's JSON answer for entry ``wanted``; a line that is not one (something the
    compiler printed) is skipped.  EOFError when the worker is gone."""
    while True:
        line = worker.stdout.readline()
        if not line:
            raise EOFError
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict) and reply.get("id") == wanted:
            return reply


# ----------------------------------------------------------------------------- a worker

def ptx_digest(ptx: str) -> str:
    """A hash of ``ptx`` that is the same for the same kernel compiled in any process: without
    the numbers numba gives per process (:data:`_PROCESS_NUMBERS`), and with the module-scope
    ``.common .global`` declarations sorted (their order follows Python's per-process string
    hashing)."""
    lines = _PROCESS_NUMBERS.sub("#", ptx).splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(".common .global")]
    for i, line in zip(at, sorted(lines[i] for i in at)):
        lines[i] = line
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _compile_one(entry: dict, mode: str) -> dict:
    kernel = kernel_recipes.rebuild(entry)
    argtypes = kernel_recipes.decode_types(entry["types"])
    dispatcher = getattr(kernel, "dispatcher", kernel)
    if mode == "check":      # made again, nothing compiled: what the cache key is built from
        py_func = getattr(dispatcher, "py_func", None) or dispatcher.fn
        try:
            closure = _digest(kernel_cache.closure_key(py_func))
        except kernel_cache.UnstableClosure:
            closure = "unstable"
        return {"ok": True, "kernel": kernel_recipes.kernel_name(py_func),
                "closure": closure, "types": [str(t) for t in argtypes]}
    if mode == "ptx":
        from numba import cuda
        options = {k: v for k, v in dispatcher.targetoptions.items()
                   if k in ("fastmath", "lineinfo", "launch_bounds", "debug", "opt")}
        ptx, _ = cuda.compile_ptx(dispatcher.py_func, argtypes, cc=(9, 0), **options)
        return {"ok": True, "ptx": ptx_digest(ptx)}
    if not _gpu() or kernel_cache.cache_dir() is None:
        return {"ok": False, "error": "no kernel cache to fill here (no GPU, or the cache off)"}
    if not kernel_cache.has_stable_key(dispatcher):
        return {"ok": False, "error": "no cache key that is the same in every process"}
    hits = sum(dispatcher._cache_hits.values())
    dispatcher.compile(argtypes)
    return {"ok": True, "hit": sum(dispatcher._cache_hits.values()) > hits}


def _worker(mode: str) -> int:
    if mode == "ptx":
        # numba-cuda 0.30 looks the device up while compiling a kernel's device functions,
        # even for compile_ptx with a given cc: on a machine without a GPU, name sm_90's
        import types
        import numba.cuda.dispatcher as dispatcher
        dispatcher.get_current_device = lambda: types.SimpleNamespace(
            compute_capability=(9, 0))
    for line in sys.stdin:
        request = json.loads(line)
        t = time.perf_counter()
        try:
            reply = _compile_one(request["entry"], mode)
        except Exception as e:  # noqa: BLE001 -- reported as one line, the run compiles it
            message = str(e).strip().splitlines()
            reply = {"ok": False, "error": f"{type(e).__name__}: "
                     f"{message[0] if message else ''}"[:300]}
        reply.update(id=request["id"], seconds=round(time.perf_counter() - t, 3))
        print(json.dumps(reply), flush=True)
    return 0


# ----------------------------------------------------------------------------- entry points

def _warm_marker(where: str, key: str) -> str:
    return os.path.join(where, f"warm-{_digest(key)}")


def mark_warm(key: str) -> None:
    """Note in the kernel cache that profile ``key``'s kernels are in it (after its
    precompile, or a run of it that made them): a run-tagged key's :func:`warm_up` then skips
    the fan-out on a warm cache."""
    where = kernel_cache.cache_dir()
    if where is not None:
        with open(_warm_marker(where, key), "w", encoding="utf-8") as f:
            f.write(key + "\n")


def warm_up(key: str, log, force: bool = False, processes: int | None = None,
            paths=None) -> PrecompileResult | None:
    """``kdtree-run``'s step before a run on a GPU: when the kernel cache is cold (or
    ``force``), compile the manifest's entries for profile ``key`` into it in parallel, saying
    so through ``log``; a run-tagged key (``--budget auto``'s) also where the cache is warm
    but never held its run's kernels (no :func:`mark_warm` of it) and a manifest lists them:
    the default run's kernels then load in the workers, its run's own compile there in
    parallel, where the run would compile them one after another (a first ``--budget auto``
    on the demo pair: ~30 s, run 165).  None when nothing was done."""
    where = kernel_cache.cache_dir()
    if where is None:
        return None
    paths = paths or [SHIPPED, local_manifest()]
    if not force and kernel_cache.cache_is_warm():
        unwarmed_run = _run_tag(key) is not None and not os.path.exists(_warm_marker(where, key))
        if not (unwarmed_run and any(read_manifest(p).get(key) for p in paths)):
            return None
    entries = entries_for(key, paths)
    if not entries:
        log("no kernel manifest for this model yet: the kernels compile in this process "
            "(this run records them for the next first run)")
        return None
    result = _compile_saying(entries, processes, "cache", f" into {where}", log, shown=3)
    if result.failed:
        log("the run compiles the kernels that failed")
    else:
        mark_warm(key)
    return result


def _compile_saying(entries, processes, mode: str, where: str, log, shown: int):
    """:func:`compile_entries` with its start, its end and the first ``shown`` failures
    said through ``log``."""
    processes = max(1, min(processes or cores(), len(entries)))
    log(f"compiling {len(entries)} kernels on {processes} processes{where}...")
    result = compile_entries(entries, processes, mode=mode, log=log)
    log(f"... done in {result.seconds:.1f} s ({result.compiled} compiled, {result.cached} "
        f"already cached, {len(result.failed)} failed)")
    for line in result.failed[:shown]:
        log(f"  failed: {line}")
    if len(result.failed) > shown:
        log(f"  ... and {len(result.failed) - shown} more")
    return result


def _log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """The ``kdtree-precompile`` entry point; returns the exit code (2 for bad input, 1 when
    a kernel failed)."""
    return run_console(PROG, _main, argv)


def _main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog=PROG, description="Compile every kernel the kernel manifests list into the "
        "kernel disk cache, in parallel (an image's build step: the first kdtree-run then only "
        "loads), or to sm_90 PTX without a GPU (--mode ptx, a check).",
        epilog="docs/ENGINE.md, 'First run on a GPU'.")
    p.add_argument("--manifest", action="append", metavar="FILE",
                   help=f"a kernel manifest (repeatable; default: the shipped one, {SHIPPED}, "
                   f"and this machine's, {local_manifest()})")
    p.add_argument("--processes", type=int, default=None, metavar="K",
                   help="worker processes (default: one per core)")
    p.add_argument("--mode", choices=["cache", "ptx"], default="cache",
                   help="cache: into the kernel disk cache (needs the GPU); ptx: sm_90 PTX "
                   "only, a check that needs no GPU")
    p.add_argument("--worker", choices=["cache", "ptx", "check"], help=argparse.SUPPRESS)
    add_debug_flag(p)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.worker)
    if args.processes is not None and args.processes < 1:
        raise UsageError("--processes must be at least 1")
    paths = args.manifest or [SHIPPED, local_manifest()]
    unique = _unique(e for path in paths for es in read_manifest(path).values() for e in es)
    if not unique:
        raise UsageError(f"no kernels listed in {', '.join(paths)} (kdtree-run "
                         f"--record-kernels FILE records a run's)")
    if args.mode == "cache" and not (_gpu() and kernel_cache.cache_dir()):
        raise UsageError("no kernel cache to fill here (no GPU, KDTREE_KERNEL_CACHE=0, or a "
                         "folder others can write); --mode ptx checks the kernels compile")
    where = f" into {kernel_cache.cache_dir()}" if args.mode == "cache" else " to sm_90 PTX"
    result = _compile_saying(unique, args.processes, args.mode, where, _log, shown=10)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Do the kernels compile to the same sm_90 PTX as at an older commit?  The check a restructure
owes (issue 35: "every kernel not meant to change compiles to the same sm_90 PTX as before,
symbol names normalised"); it needs NVVM (the numba-cuda[cu13] extra), no GPU.

    python3 tools/ptx_diff.py record MANIFEST.json          # ~6 min: simulator runs
    python3 tools/ptx_diff.py compare MANIFEST.json --old 6088df3 \
        [--expect-changed REGEX ...] [--out DIR]            # ~8 min on 2 cores

``record`` (at the newer commit) writes a kernel manifest (kdtree_numba/precompile.py's
format) of what tiny runs launch under the CUDA simulator (``kdtree-run --record-kernels``,
:data:`RUNS`: AR, DDTree and chain with the oracle and a random DFlash drafter, T = 0 and
T > 0 with top-p/top-k, the float32 and the bf16 cache, float32 and bf16 weights), plus a
profile ``gpu``: the factory calls the GPU path makes at Kimi-K2's widths (:func:`_gpu_jobs`:
the simulator picks smaller tiles and thread counts, and cannot run the tensor-core GEMMs),
each with its GPU tests' signature or the argument types a recorded launch of the same kernel
had.

``compare`` extracts the old commit (``git archive``) into ``--out`` and runs two worker
processes, one per tree, each importing its own package (its PYTHONPATH) with the simulator
off.  Per entry a worker finds the factory by module and qualified name (else in the tree's
other module that defines it: a function that moved), calls it uncached with the recorded
arguments (dropping trailing ones the newer factory added, where they hold its defaults), takes
the kernel of the recorded qualified name it made, maps the recorded argument types onto that
kernel's parameters by name (a parameter only the newer kernel has is dropped), and compiles
it with ``cuda.compile_ptx`` for sm_90 (sm_90a for wgmma tiles) and the kernel's jit options.
The PTX is normalised (:func:`normalise`) and compared, the jit options too
(``max_registers`` reaches ptxas, not the PTX).  Each entry is ``same``, ``same body`` (only
parameters the kernel never reads differ: :func:`without_unused_params`), ``different``,
``unmapped`` (the old tree cannot make it: a new factory, argument or kernel) or ``error``;
``(expected)`` where an ``--expect-changed`` regex matches the kernel's name or its factory
call's JSON.  A difference's normalised PTX (both sides) and diff land in ``--out``, with
ptxas's registers, spills and constant bank of both (nvJitLink).  Exit 1 on a difference,
unmapped entry or error that no ``--expect-changed`` covers.

What it does not see: a planner (``skinny_config``, ``mma_config``, the attention plan, ...)
that now picks other factory arguments at a shape; both trees compile the newer tree's
choices.  The planners' own tests cover those.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tiny runs whose launches make the manifest (kdtree-run arguments; "{dflash}" is a random
# DFlash drafter bundle for the target): one MoE layer of VERY_TINY widths, as
# tests/test_precompile.py's (the simulator runs ~120 us a thread: the "tiny" size's DDTree
# run took 270 s on a loaded 2-core machine)
VERY_TINY = dict(num_hidden_layers=1, first_k_dense_replace=0, vocab_size=64, hidden_size=32,
                 intermediate_size=32, moe_intermediate_size=16, q_lora_rank=16,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 num_attention_heads=2)
RUNS = [       # (the target's weights, kdtree-run arguments)
    ("float32", ["--method", "ar"]),
    ("float32", ["--method", "ddtree", "--drafter", "oracle:1", "--budget", "2",
                 "--block-len", "2"]),
    ("float32", ["--method", "ddtree", "--drafter", "{dflash}", "--budget", "2"]),
    ("float32", ["--method", "chain", "--drafter", "{dflash}"]),
    ("float32", ["--method", "ddtree", "--drafter", "oracle:0.5", "--budget", "2",
                 "--block-len", "2", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5"]),
    ("float32", ["--method", "ddtree", "--drafter", "oracle:1", "--budget", "2",
                 "--block-len", "2", "--kv-cache", "bfloat16"]),
    ("bfloat16", ["--method", "ddtree", "--drafter", "oracle:1", "--budget", "2",
                  "--block-len", "2"]),
]


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update({k: v for k, v in changes.items() if v is not None})
    env.setdefault("NUMBA_DISABLE_PERFORMANCE_WARNINGS", "1")
    return env


# ============================================================================ record

def record(manifest: str, sim: bool = True) -> int:
    """Record the simulator runs' kernels (``sim``) and the GPU path's into ``manifest``."""
    with tempfile.TemporaryDirectory() as tmp:
        if sim:
            script = ("import sys, json; from kdtree_numba.bundle import make_random_bundle as m; "
                      "kw = json.loads(sys.argv[4]); m(sys.argv[1], 'tiny', **kw); "
                      "m(sys.argv[2], 'tiny', role='dflash_drafter', **kw); "
                      "m(sys.argv[3], 'tiny', dtype='bfloat16', **kw)")
            subprocess.run([sys.executable, "-c", script, f"{tmp}/float32.kdtr",
                            f"{tmp}/d.kdtr", f"{tmp}/bfloat16.kdtr", json.dumps(VERY_TINY)],
                           check=True, env=_env(PYTHONPATH=ROOT), cwd=ROOT)
            for weights, args in RUNS:
                args = [a.replace("{dflash}", f"{tmp}/d.kdtr") for a in args]
                cmd = [sys.executable, "-m", "kdtree_numba.cli", "--backend", "numba",
                       "--model", f"{tmp}/{weights}.kdtr", "--prompt-ids", "3,9,27,17",
                       "--max-new-tokens", "2", "--record-kernels",
                       os.path.abspath(manifest)] + args
                t = time.perf_counter()
                proc = subprocess.run(cmd, env=_env(PYTHONPATH=ROOT, NUMBA_ENABLE_CUDASIM="1"),
                                      cwd=ROOT, capture_output=True, text=True)
                print(f"record: {weights} weights, {' '.join(args)}: exit {proc.returncode}, "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
                if proc.returncode:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_gpu-entries",
                           os.path.abspath(manifest)], env=_env(PYTHONPATH=ROOT), cwd=ROOT)
    return proc.returncode


# ============================================================================ the GPU path's

def _gpu_jobs():
    """(kernel, numba signature or None, compute capability) for the factory calls the GPU
    path makes at Kimi-K2's widths (7168 hidden, 64 heads, r 512, dr 64, 384 experts of 2048,
    top-8, a 163840 vocabulary): the configurations tests/test_layers.py,
    test_layers_mma.py, test_moe_mma.py, test_attention.py and test_ddtree.py compile for
    sm_90, and the thread counts the launchers pick off the simulator.  None: the types a
    recorded launch of the same kernel had."""
    import dataclasses
    import importlib
    import itertools

    import numpy as np
    from numba.cuda import types as T

    import kdtree_numba.layers as L
    from kdtree_numba import attention as A
    from kdtree_numba.attention.plan import Bf16TileConfig
    # the modules themselves: the packages re-export functions of the same names
    accept, build, compact, topk = (importlib.import_module(f"kdtree_numba.ddtree.{m}")
                                    for m in ("accept", "build", "compact", "topk"))
    argmax, embedding, moe, norm, rope, mm = (
        importlib.import_module(f"kdtree_numba.layers.{m}")
        for m in ("argmax", "embedding", "moe", "norm", "rope", "mma"))
    mla, projections = (importlib.import_module(f"kdtree_numba.attention.{m}")
                        for m in ("mla", "projections"))
    from kdtree_numba.layers.moe_mma import moe_mma_config, moe_mma_kernel
    from kdtree_numba.layers.skinny import skinny_linear_kernel
    from kdtree_numba.layers.tiled import tiled_kernel
    f2, u2, h2 = T.float32[:, ::1], T.uint32[:, ::1], T.uint16[:, ::1]
    i1, i2, i64 = T.int32[::1], T.int32[:, ::1], T.int64
    sm90, sm90a = (9, 0), (9, 0, "a")
    jobs = []
    # the CUDA-core GEMMs (tests/test_layers.py's registers-only check)
    for k, n in [(7168, 1536), (7168, 576), (2048, 7168), (7168, 163840), (7168, 384),
                 (1536, 12288), (512, 16384), (8192, 7168)]:
        for m, kind in itertools.product((1, 2, 4, 8, 16), ("f32", "bf16")):
            jobs.append((skinny_linear_kernel(L.skinny_config(m, n, k, kind), kind),
                         (f2, u2 if kind == "bf16" else f2, T.float32[:, :, ::1]) + (i64,) * 5,
                         sm90))
        for m, kind in itertools.product((17, 65, 100, 1100), ("f32", "bf16")):
            cfg = dataclasses.replace(L.tiled_config(m, n, k), splits=1)
            jobs.append((tiled_kernel(cfg, kind, "linear"),
                         (f2, u2 if kind == "bf16" else f2, f2) + (i64,) * 6, sm90))
    for m in (512, 4096):
        jobs.append((skinny_linear_kernel(L.skinny_config(m, 64, 7168, "f32"), "f32"),
                     (f2, f2, T.float32[:, :, ::1]) + (i64,) * 5, sm90))
    expert_sig = (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], T.uint16[:, :, ::1], f2, i64, i64,
                  i64)
    for m in (1, 3, 16):
        for k_in, gate_up in ((7168, True), (2048, False)):
            cfg = L.expert_config(m, 8, 384, k_in, gate_up)
            jobs.append((moe._expert_kernel(cfg, "bf16", gate_up), expert_sig, sm90))
    for m in (1, 65, 200, 4096):       # W4A16 (meant to change)
        for k_in, gate_up in ((7168, True), (2048, False)):
            cfg = L.expert_config(m, 8, 384, k_in, gate_up, True)
            jobs.append((moe._expert_kernel(cfg, "i4", gate_up, 32), expert_sig, sm90))
    for m in (17, 65):
        for cfg, _, _ in L.expert_tiled_configs(m):
            for mode in ("gate_up", "down"):
                jobs.append((tiled_kernel(cfg, "bf16", mode),
                             (f2, i1, i1, i1, i1, T.uint32[:, :, ::1], f2) + (i64,) * 5, sm90))
    # the tensor-core GEMMs (test_layers_mma.py, test_moe_mma.py)
    configs = {mm.mma_config(m, n, k) for m in (1, 16, 20, 40, 65, 512, 4096) for n, k in
               [(163840, 7168), (7168, 2048), (1536, 7168), (576, 7168), (7168, 8192)]}
    wgmma = {c for c in configs if c.wgmma}
    wgmma |= {mm.WGMMA_TILE, dataclasses.replace(mm.WGMMA_TILE, slices_in_block=True)}
    for cfg in sorted({dataclasses.replace(c, splits=1, sums_in_last=False)
                       for c in configs | wgmma}, key=str):
        if cfg.tma:     # the TMA kernel's tiles (a verify's rows on sm_90)
            from kdtree_numba.layers.mma_tma import tma_kernel
            u64 = T.uint64[:, ::1]
            jobs.append((tma_kernel(cfg), (h2, h2, f2, u64, i64, u64, i64) + (i64,) * 7
                         + (T.float32[::1], i1, i64), sm90a))   # + stream-K's part, counters
            continue
        jobs.append((mm.mma_kernel(cfg), (h2, h2, f2) + (i64,) * 9,
                     sm90a if cfg.wgmma else sm90))
    for cfg in sorted({c for c in configs if c.sums_in_last}, key=str):   # a decode's sums
        jobs.append((mm.mma_kernel(cfg), (h2, h2, f2) + (i64,) * 9 + (f2, i1), sm90))
    jobs.append((mm._round_to_bf16_pairs, (T.float32[::1], T.uint32[::1]), sm90))
    jobs.append((importlib.import_module("kdtree_numba.layers.common").sum_splits,
                 (T.float32[:, :, ::1], f2), sm90))     # the split-K GEMMs' sums
    moe_configs = {moe_mma_config(m, 8, 384) for m in (1, 9, 33, 65, 200, 257, 4096)}
    moe_configs |= {moe_mma_config(m, 1, 1) for m in (40, 72, 100)}
    for cfg, gate_up, work_list in itertools.product(sorted(moe_configs, key=str),
                                                     (True, False), (False, True)):
        out = T.uint32[:, ::1] if gate_up else f2
        jobs.append((moe_mma_kernel(cfg, gate_up, work_list),
                     (h2,) + (i1,) * 7 + (T.uint16[:, :, ::1], h2, out) + (i64,) * 9,
                     sm90a if cfg.wgmma else sm90))
    for gate_up, work_list in itertools.product((True, False), (False, True)):
        out = T.uint32[:, ::1] if gate_up else f2
        jobs.append((moe_mma_kernel(mm.WGMMA_TILE, gate_up, work_list),
                     (h2,) + (i1,) * 7 + (T.uint16[:, :, ::1], h2, out) + (i64,) * 9, sm90a))
    # attention (test_attention.py's sm_90 checks)
    a2, a3, a4 = (T.Array(T.float32, d, "C") for d in (2, 3, 4))
    sig = (a3, a3, a3, a3, i1, T.boolean[:, :, ::1], T.float32, i64, i64, i64, T.boolean,
           a3, a4, a4)
    sig16 = (a3, a3, T.uint16[:, :, ::1], T.uint16[:, :, ::1]) + sig[4:]
    for v in A.FFMA_VARIANTS:
        for causal in (False, True):
            cfg = dataclasses.replace(A.gpu_tile_config(512, 64, v), causal=causal)
            jobs.append((mla._attention_kernel(cfg), sig, sm90))
    base = A.gpu_tile_config(512, 64, "tf32x3")
    for rows, causal in ((64, False), (32, False), (16, False), (64, True), (16, True)):
        cfg = dataclasses.replace(base, rows=rows, threads=4 * rows, causal=causal).validate()
        jobs.append((mla._attention_kernel(cfg), sig, sm90))
    jobs.append((mla._attention_kernel(A.gpu_tile_config(64, 16)), sig, sm90))
    for rows, keys, causal in ((64, 32, False), (64, 32, True), (16, 16, False),
                               (32, 32, False), (16, 32, True)):
        cfg = Bf16TileConfig(512, 64, rows=rows, threads=4 * rows, keys=keys, causal=causal)
        jobs.append((mla._attention_kernel(cfg), sig16, sm90))
    for r, dr in ((128, 32), (32, 8), (24, 8)):
        jobs.append((mla._attention_kernel(Bf16TileConfig(r, dr, rows=16, threads=64)), sig16,
                     sm90))
    jobs.append((mla._merge_kernel(512), (a4, a4, i1, i64, i64, T.boolean, i64, i64, a3), sm90))
    jobs.append((projections._split_kv_b_bf16, (f2, i64, i64, h2, h2), sm90))
    for transposed in (False, True):
        jobs.append((projections._head_gemm_kernel(projections._GemmTile(64, 64, 16, 16, 16),
                                                   transposed),
                     (a2, i64, a2, i64, i64, a2, i64, i64, i64, i64), sm90))
    for mt, (k, transposed, vector) in itertools.product(
            (1, 2, 4, 8, 16), ((512, False, False), (128, True, True), (512, True, True),
                               (128, False, False))):
        jobs.append((projections._head_stream_kernel(mt, k, transposed, vector), None, sm90))
    # the small kernels at the GPU's thread counts (the simulator launches 32 or fewer)
    for width, is_bf16, add in itertools.product((7168, 1536, 512), (False, True),
                                                 (False, True)):
        threads = 256
        per_thread = -(-width // threads)
        jobs.append((norm._rmsnorm_kernel(threads, is_bf16, per_thread, add), None, sm90))
    for half, interleave, threads in itertools.product((32,), (False, True), (32, 1024)):
        jobs.append((rope._rope_kernel(half, interleave, threads), None, sm90))
    jobs.append((argmax._argmax_kernel(1024), None, sm90))
    for is_bf16 in (False, True):
        jobs.append((embedding._embedding_kernel(is_bf16), None, sm90))
    moe_route = importlib.import_module("kdtree_numba.layers.moe_route")   # (the package's
    #                                         moe_route is the function of that name)
    jobs.append((moe_route._route_kernel(384, 1, 512, False), None, sm90))
    jobs.append((moe_route._route_kernel(256, 8, 256, False), None, sm90))
    for tile_rows in (0, 16, 64):
        jobs.append((moe._group_kernel(384, 1024, tile_rows), None, sm90))
    for has_shared in (False, True):
        jobs.append((moe._combine_kernel(has_shared), None, sm90))
    # DDTree (test_ddtree.py's sm_90 check, Kimi's vocabulary, the default budgets)
    merge_sig = (f2, i2, T.float32[::1], T.float64[::1], i64, f2, i2)
    for k, rows in ((8, 1), (8, 8), (32, 16), (64, 1)):
        warps, vec, kl, parts = topk.topk_config(k, rows, 163840)
        jobs.append((topk._topk_kernel(warps, vec, kl), None, sm90))
        if parts > 1:
            jobs.append((topk._topk_merge_kernel(parts, kl, topk.TOPK_MERGE_THREADS),
                         merge_sig, sm90))
    jobs.append((topk._topk_kernel(8, 4, 64), None, sm90))
    jobs.append((topk._topk_merge_kernel(2, 1024, 256), merge_sig, sm90))
    for bcap in (8, 32, 128, 1024):
        jobs.append((build._build_kernel(128, bcap), None, sm90))
    for depth in (8, 15, 16):
        jobs.append((accept._accept_kernel(depth), None, sm90))
    jobs.append((accept._sample_kernel(512), None, sm90))
    for n_acc in (1, 8, 16):
        jobs.append((compact._compact_kernel(n_acc, np.uint64), None, sm90))
    return jobs


def gpu_entries(manifest: str) -> int:
    """Add profile ``gpu`` (:func:`_gpu_jobs`) to ``manifest``, each kernel with its recipe
    and its signature or, where none is given, every argument-type list recorded for it."""
    import types as pytypes
    from numba import cuda
    # the launch plans that size grids by the GPU ask it for its SMs: an H100's 132
    cuda.get_current_device = lambda: pytypes.SimpleNamespace(
        compute_capability=(9, 0), MULTIPROCESSOR_COUNT=132)
    from kdtree_numba import kernel_recipes
    with open(manifest, encoding="utf-8") as f:
        data = json.load(f)
    recorded: dict = {}
    for entries in data["profiles"].values():
        for e in entries:
            recorded.setdefault(e["kernel"], [])
            if e["types"] not in recorded[e["kernel"]]:
                recorded[e["kernel"]].append(e["types"])
    out, missing = [], set()
    for kernel, sig, cc in _gpu_jobs():
        dispatcher = getattr(kernel, "dispatcher", kernel)
        py_func = dispatcher.py_func
        # the recipe kernel_recipes filed for this kernel (the tool reads the registry, which
        # has no public lookup by kernel)
        recipe = kernel_recipes._KERNELS[py_func][0]
        name = kernel_recipes.kernel_name(py_func)
        for types in ([kernel_recipes.encode_types(sig)] if sig is not None
                      else recorded.get(name, [])):
            entry = kernel_recipes.entry_json(py_func, recipe,
                                              kernel_recipes.decode_types(types))
            if cc != (9, 0):
                entry["cc"] = list(cc)
            out.append(entry)
        if sig is None and name not in recorded:
            missing.add(name)
    data["profiles"]["gpu"] = [e for i, e in enumerate(out) if e not in out[:i]]
    with open(manifest, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"record: {len(data['profiles']['gpu'])} GPU-path entries"
          + (f"; no recorded types for {sorted(missing)}" if missing else ""), flush=True)
    return 0


# ============================================================================ compare

def _entries(manifest: str) -> list:
    with open(manifest, encoding="utf-8") as f:
        profiles = json.load(f)["profiles"]
    seen, out = set(), []
    for name in sorted(profiles):
        for e in profiles[name]:
            key = json.dumps(e, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(e)
    return out


def _run_workers(trees: dict, entries: list, out: str) -> dict:
    """{side: {id: reply}}: one worker process per tree, both at once (two cores)."""
    procs, logs = {}, []
    for side, root in trees.items():
        logs.append(open(os.path.join(out, f"{side}.log"), "w", encoding="utf-8"))
        procs[side] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_worker", os.path.join(out, side)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[-1], text=True,
            env=_env(PYTHONPATH=root, PYTHONHASHSEED="0"), cwd=root)
    requests = "".join(json.dumps({"id": i, "entry": e}) + "\n" for i, e in enumerate(entries))

    def feed(proc):           # in a thread: the replies are read meanwhile
        proc.stdin.write(requests)
        proc.stdin.close()
    for proc in procs.values():
        threading.Thread(target=feed, args=(proc,), daemon=True).start()
    replies = {}
    for side, proc in procs.items():
        replies[side] = {}
        for line in proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            replies[side][reply["id"]] = reply
        proc.wait()
    for log in logs:
        log.close()
    return replies


def _label(entry: dict) -> tuple:
    kernel = entry["kernel"].partition(":")[2].replace(".<locals>.", ".")
    module = entry["kernel"].partition(":")[0].replace("kdtree_numba.", "")
    factory = entry.get("factory")
    args = ""
    if factory:
        args = json.dumps(factory["args"] + ([factory["kwargs"]] if factory["kwargs"] else []),
                          separators=(",", ":"))
        args = re.sub(r'\{"dataclass":"[^"]*:(\w+)","fields":', r"\1", args)
    return f"{module}:{kernel}", args, len(entry["types"])


def _old_tree(out: str, old: str) -> tuple[str, str]:
    """(the old commit's files under ``out``, its short hash), extracted once per commit."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", old], check=True,
                            capture_output=True, text=True).stdout.strip()
    root = os.path.join(out, f"tree-{commit}")
    if not os.path.isdir(os.path.join(root, "kdtree_numba")):
        os.makedirs(root, exist_ok=True)
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    return root, commit


def compare(manifest: str, old: str, out: str, expect: list) -> int:
    """Compile every entry of ``manifest`` at this tree and at ``old``; print and write
    (``out``/table.txt) the table; 1 when a difference no ``expect`` regex covers shows."""
    entries = _entries(manifest)
    os.makedirs(out, exist_ok=True)
    for side in ("new", "old", "diff"):       # nothing of an earlier comparison stays
        shutil.rmtree(os.path.join(out, side), ignore_errors=True)
    old_root, old_commit = _old_tree(out, old)
    new_commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                check=True, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "kdtree_numba",
                            "reference"], capture_output=True, text=True).stdout.strip()
    t = time.perf_counter()
    listed = os.path.join(out, "entries.json")
    with open(listed, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    subprocess.run([sys.executable, os.path.abspath(__file__), "_annotate", listed],
                   check=True, env=_env(PYTHONPATH=ROOT), cwd=ROOT)
    with open(listed, encoding="utf-8") as f:
        entries = json.load(f)
    replies = _run_workers({"new": ROOT, "old": old_root}, entries, out)
    patterns = [re.compile(p) for p in expect]
    rows, counts, unexpected = [], {}, []
    for i, entry in enumerate(entries):
        new, was = replies["new"].get(i, {}), replies["old"].get(i, {})
        name, args, n_types = _label(entry)
        text = f"{entry['kernel']} {json.dumps(entry.get('factory', {}), sort_keys=True)}"
        expected = any(p.search(text) for p in patterns)
        if new.get("status") != "ok":
            status, why = "error (new)", new.get("why", "no reply")
        elif was.get("status") == "unmapped":
            status, why = "unmapped", was["why"]
        elif was.get("status") != "ok":
            status, why = "error (old)", was.get("why", "no reply")
        elif new["strict"] == was["strict"] and new["options"] == was["options"]:
            status, why = "same", was.get("note", "")
        elif new["loose"] == was["loose"] and new["options"] == was["options"]:
            status, why = "same body", "only unused parameters differ; " + was.get("note", "")
        else:
            status = "different"
            why = "; ".join(filter(None, [
                "jit options differ" if new["options"] != was["options"] else "",
                _diff_files(out, i, entry.get("cc", (9, 0))), was.get("note", "")]))
        if status not in ("same", "same body"):
            if expected:
                status += " (expected)"
            else:
                unexpected.append(i)
        counts[status] = counts.get(status, 0) + 1
        rows.append((name, args, n_types, status, why.strip("; ")))
    width = max(len(r[0]) for r in rows)
    lines = [f"# sm_90 PTX of {len(entries)} kernel entries: {new_commit}"
             f"{' (+ uncommitted changes)' if dirty else ''} against {old_commit} "
             f"({time.perf_counter() - t:.0f} s)",
             f"{'kernel':<{width}}  {'types':>5}  status  factory args / note"]
    for name, args, n_types, status, why in rows:
        lines.append(f"{name:<{width}}  {n_types:>5}  {status}  {args}"
                     f"{'  -- ' + why if why else ''}")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"summary: {len(entries)} entries: {summary}; "
                 f"{len(unexpected)} unexpected")
    report = "\n".join(lines)
    print(report)
    with open(os.path.join(out, "table.txt"), "w", encoding="utf-8") as f:
        f.write(report + "\n")
    return 1 if unexpected else 0


def _diff_files(out: str, i: int, cc=(9, 0)) -> str:
    """Write ``diff/<i>.diff`` (the normalised PTX, old -> new); its size in words."""
    try:
        with open(os.path.join(out, "old", f"{i}.ptx"), encoding="utf-8") as f:
            a = f.read().splitlines()
        with open(os.path.join(out, "new", f"{i}.ptx"), encoding="utf-8") as f:
            b = f.read().splitlines()
    except OSError:
        return ""
    diff = list(difflib.unified_diff(a, b, "old", "new", lineterm="", n=2))
    os.makedirs(os.path.join(out, "diff"), exist_ok=True)
    with open(os.path.join(out, "diff", f"{i}.diff"), "w", encoding="utf-8") as f:
        f.write("\n".join(diff) + "\n")
    minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
    plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
    return (f"PTX lines -{minus} +{plus} (diff/{i}.diff; {len(a)} -> {len(b)} lines); "
            f"ptxas {_ptxas(out, 'old', i, cc)} -> {_ptxas(out, 'new', i, cc)}")


def _ptxas(out: str, side: str, i: int, cc) -> str:
    """ptxas's resources for one side's normalised PTX (still valid PTX), through nvJitLink:
    ``<registers> regs <spill stores> spill <cmem> cmem`` (what a difference costs)."""
    try:
        from cuda.bindings import nvjitlink as nj
        with open(os.path.join(out, side, f"{i}.ptx"), encoding="utf-8") as f:
            ptx = f.read().encode()
        arch = "sm_" + "".join(str(c) for c in cc)
        opts = [f"-arch={arch}", "-O3", "-verbose"]
        h = nj.create(len(opts), opts)
        nj.add_data(h, nj.InputType.PTX, ptx, len(ptx), "k.ptx")
        nj.complete(h)
        log = bytearray(nj.get_info_log_size(h))
        nj.get_info_log(h, log)
        nj.destroy(h)
    except Exception as e:   # noqa: BLE001 -- no nvJitLink here, or ptxas refused it
        return f"(no ptxas: {type(e).__name__})"
    text = log.decode()
    regs = re.findall(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    cmem = re.findall(r"(\d+) bytes cmem\[0\]", text)
    return f"{regs[-1] if regs else '?'} regs/{spill[-1] if spill else '?'} spill/" \
           f"{cmem[-1] if cmem else '?'} cmem"


# ============================================================================ one tree's worker
# Runs with the tree's own package first on PYTHONPATH and the simulator off; it imports
# nothing of the package at module scope, and never kernel_recipes (older trees lack it).

def _resolve(name: str):
    """``module:qualname`` in this process's tree, or in another of its kdtree_numba modules
    that defines the same top-level name (a function that moved); (object, where) or
    LookupError."""
    import importlib
    import pkgutil
    module, _, qualname = name.partition(":")

    def walk(mod):
        obj = importlib.import_module(mod)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    try:
        return walk(module), module
    except (ImportError, AttributeError):
        pass
    import kdtree_numba
    for info in pkgutil.walk_packages(kdtree_numba.__path__, "kdtree_numba."):
        if info.name == module or ".demo" in info.name:
            continue
        try:
            mod = importlib.import_module(info.name)
        except Exception:       # noqa: BLE001 -- a module that cannot import holds nothing
            continue
        obj = mod.__dict__.get(qualname.split(".")[0])
        if obj is not None and getattr(obj, "__module__", None) == info.name:
            try:
                return walk(info.name), info.name
            except AttributeError:
                continue
    raise LookupError(f"{name}: not in this tree")


def _decode(value):
    """A factory argument from its JSON form (kernel_recipes.py's ``_decode``, which the older
    trees lack, so the worker carries its own): classes resolved in this tree, where they may
    have moved, and a class that no longer takes the fields is LookupError (unmapped)."""
    import numpy as np
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    if "numpy" in value:
        return np.dtype(value["numpy"]).type
    if "dataclass" in value:
        cls, _ = _resolve(value["dataclass"])
        fields = {k: _decode(v) for k, v in value["fields"].items()}
        try:
            return cls(**fields)
        except TypeError as e:
            raise LookupError(f"{value['dataclass']}: {e}") from None
    raise LookupError(f"unknown value form {sorted(value)}")


def _decode_type(value):
    from numba.cuda import types
    if isinstance(value, str):
        return getattr(types, value)
    return types.Array(_decode_type(value["array"]), value["ndim"], value["layout"],
                       readonly=not value["mutable"], aligned=value["aligned"])


def _bind(fn, args, kwargs, defaults):
    """``args`` as ``fn`` takes them: trailing arguments equal to the newer factory's
    defaults (``defaults``: position -> default) are dropped where ``fn`` has no such
    parameter (a parameter added since, at its old behaviour)."""
    import inspect
    sig = inspect.signature(fn)
    args = list(args)
    while True:
        try:
            sig.bind(*args, **kwargs)
            return args
        except TypeError as e:
            last = len(args) - 1
            if args and str(last) in defaults and defaults[str(last)] == _encode_plain(args[-1]):
                args.pop()
                continue
            raise LookupError(f"the factory takes other arguments: {e}") from None


def _encode_plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


_MADE: list = []          # (py_func, kernel) of every kernel this worker's tree made
_FACTORY_CALLS: dict = {}


def _install_hook():
    import types
    import numba.cuda.dispatcher as dispatcher
    # numba-cuda 0.30 asks the (absent) device for its compute capability while compiling a
    # kernel's device functions, even for compile_ptx with a given cc
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    from kdtree_numba import compat
    original = compat._jit

    def jit(fn, options):
        made = original(fn, options)
        if not options.get("device"):
            _MADE.append((fn, made))
        return made
    compat._jit = jit


def _kernel_of(entry: dict):
    """(dispatcher, note) for ``entry`` in this tree; LookupError where it cannot be made."""
    wanted = entry["kernel"]
    module, _, qualname = wanted.partition(":")
    factory = entry.get("factory")
    if factory is None:
        obj, where = _resolve(wanted)
        return obj, ("" if where == module else f"moved from {where}")
    fn, where = _resolve(factory["name"])
    note = "" if where == factory["name"].partition(":")[0] else f"factory in {where}"
    key = json.dumps(factory, sort_keys=True)
    if key not in _FACTORY_CALLS:
        args = [_decode(a) for a in factory["args"]]
        kwargs = {k: _decode(v) for k, v in factory["kwargs"].items()}
        raw = getattr(fn, "__wrapped__", fn)      # uncached: the kernels are made again
        args = _bind(raw, args, kwargs, entry.get("factory_defaults", {}))
        if len(args) < len(factory["args"]):
            note = "; ".join(filter(None, [note, f"called without the trailing "
                                           f"{len(factory['args']) - len(args)} default(s)"]))
        start = len(_MADE)
        try:
            raw(*args, **kwargs)
        except Exception as e:   # noqa: BLE001 -- the old factory refuses these arguments
            raise LookupError(f"the factory raised {type(e).__name__}: {e}") from None
        _FACTORY_CALLS[key] = (_MADE[start:], note)
    made, note = _FACTORY_CALLS[key]
    by_name = {f"{f.__module__}:{f.__qualname__}": k for f, k in made}
    if wanted in by_name:
        return by_name[wanted], note
    same = [k for f, k in made if f.__qualname__ == qualname]
    if len(same) == 1:
        return same[0], "; ".join(filter(None, [note, "kernel in another module"]))
    raise LookupError(f"the factory makes no kernel {qualname} (it makes "
                      f"{sorted(by_name) or 'none'})")


def _types_for(py_func, entry: dict):
    """The recorded argument types, mapped onto this tree's kernel parameters by name where
    the newer kernel's (``entry["params"]``) differ: a parameter only the newer one has is
    dropped, one renamed in place keeps its type; one only this tree has cannot be mapped."""
    import inspect
    types = [_decode_type(t) for t in entry["types"]]
    mine = list(inspect.signature(py_func).parameters)
    newer = entry.get("params") or mine
    if mine == newer:
        return types, ""
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=newer, b=mine).get_opcodes():
        if op == "equal" or (op == "replace" and i2 - i1 == j2 - j1):
            out += types[i1:i2]
        elif op != "delete":
            raise LookupError(f"parameters {mine[j1:j2]} have no recorded type")
    return out, f"parameters then {', '.join(mine)}"


def _compile(entry: dict, out_path: str) -> dict:
    from numba import cuda
    kernel, note = _kernel_of(entry)
    dispatcher = getattr(kernel, "dispatcher", kernel)
    py_func = dispatcher.py_func
    argtypes, pnote = _types_for(py_func, entry)
    options = {k: v for k, v in dispatcher.targetoptions.items()
               if k in ("fastmath", "lineinfo", "launch_bounds", "debug", "opt")}
    ptx, _ = cuda.compile_ptx(py_func, tuple(argtypes), cc=tuple(entry.get("cc", (9, 0))),
                              **options)
    text = normalise(ptx)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text)
    jit_options = {k: repr(v) for k, v in sorted(dispatcher.targetoptions.items())
                   if k not in ("link", "extensions")}
    return {"status": "ok", "strict": _hash(text), "loose": _hash(without_unused_params(text)),
            "options": jit_options, "note": "; ".join(filter(None, [note, pnote])),
            "params": list(__import__("inspect").signature(py_func).parameters)}


def _hash(text: str) -> str:
    import hashlib
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker(out_dir: str) -> int:
    _install_hook()
    os.makedirs(out_dir, exist_ok=True)
    for line in sys.stdin:
        request = json.loads(line)
        i = request["id"]
        try:
            reply = _compile(request["entry"], os.path.join(out_dir, f"{i}.ptx"))
        except LookupError as e:
            reply = {"status": "unmapped", "why": str(e)[:300]}
        except Exception as e:  # noqa: BLE001 -- one entry's failure is one line
            message = (str(e).strip().splitlines() or [""])[0]
            reply = {"status": "error", "why": f"{type(e).__name__}: {message}"[:300]}
        reply["id"] = i
        print(json.dumps(reply), flush=True)
    return 0


def annotate(manifest_entries_path: str) -> int:
    """At the newer tree: each entry's kernel parameters and factory defaults (what the older
    tree's worker maps recorded types and arguments by); no compile."""
    import inspect
    _install_hook()
    with open(manifest_entries_path, encoding="utf-8") as f:
        entries = json.load(f)
    for entry in entries:
        try:
            kernel, _ = _kernel_of(entry)
            dispatcher = getattr(kernel, "dispatcher", kernel)
            entry["params"] = list(inspect.signature(dispatcher.py_func).parameters)
            factory = entry.get("factory")
            if factory:
                fn, _ = _resolve(factory["name"])
                sig = inspect.signature(getattr(fn, "__wrapped__", fn))
                entry["factory_defaults"] = {
                    str(i): _encode_plain(p.default) for i, p in enumerate(sig.parameters.values())
                    if p.default is not inspect.Parameter.empty}
        except Exception as e:  # noqa: BLE001 -- the compile then reports it
            entry["annotate_error"] = f"{type(e).__name__}: {e}"[:300]
    with open(manifest_entries_path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return 0


# ============================================================================ normalising

_SYMBOL = re.compile(r"_ZN[0-9A-Za-z_$]+?(?=_param_\d+\b|[^0-9A-Za-z_$]|$)")
_SMEM = re.compile(r"_cudapy_smem_\d+")


def normalise(ptx: str) -> str:
    """``ptx`` without what differs between two processes compiling the same kernel: comment
    lines (compiler banner), ``.file``/``.loc`` debug lines, the module-scope ``NumbaEnv``
    declarations (unused environment pointers, in per-process string-hash order), and every
    mangled symbol (it carries the module path, numba's per-process function numbers
    ``B<n>v<k>B`` and a hash of the function's identity) and shared array, renamed in order of
    first appearance (SYM0, SYM1, ...; SMEM0, ...)."""
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith("//") or stripped.startswith((".file", ".loc")):
            continue
        if stripped.startswith(".common .global") and "NumbaEnv" in stripped:
            continue
        lines.append(line.rstrip())
    text = "\n".join(lines)
    names: dict = {}
    text = _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"SYM{len(names)}"), text)
    smem: dict = {}
    return _SMEM.sub(lambda m: smem.setdefault(m.group(0), f"SMEM{len(smem)}"), text) + "\n"


_PARAM_DECL = re.compile(r"^\s*\.param\s.*?(SYM\d+_param_\d+)\b")


def without_unused_params(text: str) -> str:
    """``text`` (normalised) without the kernel parameters its body never reads, the rest
    numbered again in order: the same body behind a signature that gained a placeholder."""
    lines = text.splitlines()
    declared = [(i, m.group(1)) for i, line in enumerate(lines)
                if (m := _PARAM_DECL.match(line))]
    body = "\n".join(line for i, line in enumerate(lines)
                     if i not in {j for j, _ in declared})
    used = [name for _, name in declared if re.search(re.escape(name) + r"\b", body)]
    drop = {i for i, name in declared if name not in used}
    # a kept declaration's comma depends on whether a dropped one followed it
    kept = "\n".join(line.rstrip(",") if i in {j for j, _ in declared} else line
                     for i, line in enumerate(lines) if i not in drop)
    renames = {name: f"PARAM{n}" for n, name in enumerate(used)}
    kept = re.sub(r"SYM\d+_param_\d+\b", lambda m: renames.get(m.group(0), m.group(0)), kept)
    return _renumber_registers(kept)


def _renumber_registers(text: str) -> str:
    """Virtual registers numbered again in order of first use, their ``.reg`` counts dropped:
    NVVM numbers them per function, so one more parameter load shifts every later number."""
    text = "\n".join(line for line in text.splitlines()
                     if not re.match(r"\s*\.reg\s", line))
    seen: dict = {}
    return re.sub(r"%(rd|rs|r|fd|f|p|h|hh|b)(\d+)\b",
                  lambda m: seen.setdefault(m.group(0), f"%{m.group(1)}_{len(seen)}"), text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="write the manifest of kernels to compare")
    r.add_argument("manifest")
    r.add_argument("--gpu-only", action="store_true",
                   help="only (re)add the GPU path's profile, no simulator runs")
    w = sub.add_parser("_worker")
    w.add_argument("out_dir")
    c = sub.add_parser("compare", help="compile every entry at both commits and compare")
    c.add_argument("manifest")
    c.add_argument("--old", required=True, metavar="REV", help="the older commit")
    c.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "ptx_diff"),
                   help="where the old tree, the normalised PTX and the diffs go")
    c.add_argument("--expect-changed", action="append", default=[], metavar="REGEX",
                   help="entries meant to change: a regex over the kernel name and its "
                   "factory call's JSON (repeatable)")
    g = sub.add_parser("_gpu-entries")
    g.add_argument("manifest")
    a = sub.add_parser("_annotate")
    a.add_argument("entries")
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args.manifest, sim=not args.gpu_only)
    if args.cmd == "compare":
        return compare(args.manifest, args.old, args.out, args.expect_changed)
    if args.cmd == "_gpu-entries":
        return gpu_entries(args.manifest)
    if args.cmd == "_worker":
        return worker(args.out_dir)
    if args.cmd == "_annotate":
        return annotate(args.entries)
    return 2


if __name__ == "__main__":
    sys.exit(main())

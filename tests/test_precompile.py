"""The first run on a GPU (issue 36 item 4): kernel recipes (kdtree_numba/kernel_recipes.py),
the kernel manifest and the parallel precompile (kdtree_numba/precompile.py).

Here (no GPU): a recording run under the simulator lists every kernel a tiny model's DDTree
run launches, as seen by an independent hook on the simulator's launches, and a fresh process
makes each again with the same closure key (the disk-cache key's source-dependent part); the
fan-out's PTX equals a serial compile's; a failing entry or a dying worker comes back as one
line; the manifest format's checks.  On the GPU (the lead): an empty cache, the precompile,
then a run that compiles nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdtree_numba import compat, kernel_recipes, precompile
from kdtree_numba.kernel_cache import UnstableClosure, closure_key
from kdtree_numba.kernel_recipes import RecipeError
from ptx_check import HOPPER_PRELUDE

ROOT = Path(__file__).resolve().parents[1]

# the engine test's very tiny model: one MoE layer, every op, a few seconds a forward; here
# at smaller widths and 4 experts in 2 groups (a shared expert): the kernels a DDTree run
# launches are the same, the simulated blocks of each launch fewer
VERY_TINY = dict(num_hidden_layers=1, first_k_dense_replace=0, vocab_size=32, hidden_size=16,
                 intermediate_size=16, moe_intermediate_size=16, q_lora_rank=16,
                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 num_attention_heads=2, n_routed_experts=4, n_group=2, topk_group=1)


def _array(dtype: str, ndim: int) -> dict:
    return {"array": dtype, "ndim": ndim, "layout": "C", "mutable": True, "aligned": True}


ARGMAX = {"kernel": "kdtree_numba.layers.argmax:_argmax_kernel.<locals>.argmax_rows",
          "factory": {"name": "kdtree_numba.layers.argmax:_argmax_kernel", "args": [128],
                      "kwargs": {}},
          "types": [_array("float32", 2), _array("int32", 1)]}
SILU = {"kernel": "kdtree_numba.layers.moe:_silu_mul",
        "types": [_array("float32", 2), _array("float32", 2)]}
RMSNORM = {"kernel": "kdtree_numba.layers.norm:_rmsnorm_kernel.<locals>.rmsnorm_rows",
           "factory": {"name": "kdtree_numba.layers.norm:_rmsnorm_kernel",
                       "args": [128, False, 2, True], "kwargs": {}},
           "types": [_array("float32", 2)] * 3 + [_array("float32", 1), _array("float32", 2),
                                                  "float32"]}


# ----------------------------------------------------------------------------- recording

@pytest.mark.skipif(not compat.SIMULATOR, reason="records launches under the simulator")
def test_a_recorded_manifest_names_every_kernel_the_run_launched(tmp_path, monkeypatch):
    """kdtree-run --record-kernels on a tiny DDTree run: the manifest holds exactly the
    (kernel, argument types) an independent hook saw launched, and a fresh process makes every
    entry's kernel again with the same closure key."""
    from numba import typeof
    from numba.cuda.simulator import kernel as sim
    from kdtree_numba.bundle import make_random_bundle
    from kdtree_numba.cli import run_main
    launched = set()
    original = sim.FakeCUDAKernel.__call__

    def spy(self, *args):
        if not self._device:
            launched.add((kernel_recipes.kernel_name(self.fn),
                          tuple(str(typeof(a)) for a in args)))
        return original(self, *args)
    monkeypatch.setattr(sim.FakeCUDAKernel, "__call__", spy)
    model, out = tmp_path / "m.kdtr", tmp_path / "kernels.json"
    make_random_bundle(model, "tiny", **VERY_TINY)
    assert run_main(["--backend", "numba", "--model", str(model), "--method", "ddtree",
                     "--drafter", "oracle:1", "--budget", "2", "--block-len", "2",
                     "--prompt-ids", "3,9,27,17", "--max-new-tokens", "2",
                     "--record-kernels", str(out)]) == 0
    profiles = precompile.read_manifest(str(out))
    assert len(profiles) == 1
    (entries,) = profiles.values()
    assert all("unrebuildable" not in e for e in entries)
    recorded = {(e["kernel"], tuple(str(t) for t in kernel_recipes.decode_types(e["types"])))
                for e in entries}
    assert launched and recorded == launched
    # the build, the tree, attention, the MoE: the factories' recipes are all there
    names = {e["kernel"].rpartition(":")[2] for e in entries}
    assert {"_build_kernel.<locals>.build", "_compact_kernel.<locals>.compact",
            "_route_kernel.<locals>.route_rows",
            "_expert_kernel.<locals>.expert_rows_and_shared"} <= names

    result = precompile.compile_entries(entries, 1, mode="check")
    assert result.failed == []
    for i, e in enumerate(entries):
        here = kernel_recipes.rebuild(e)
        py_func = here.py_func
        try:
            mine = hashlib.sha256(closure_key(py_func).encode()).hexdigest()[:16]
        except UnstableClosure:
            mine = "unstable"
        reply = result.replies[i]
        assert reply["kernel"] == e["kernel"] and reply["closure"] == mine != "unstable"


# ----------------------------------------------------------------------------- JSON forms

def test_argument_types_round_trip_and_refuse_what_has_no_form():
    from numba.cuda import types
    sig = (types.float32[:, ::1], types.Array(types.uint16, 3, "A", readonly=True),
           types.bfloat16[:, :, ::1], types.int64, types.uint64, types.boolean,
           types.float64, types.float16)
    encoded = kernel_recipes.encode_types(sig)
    assert kernel_recipes.decode_types(json.loads(json.dumps(encoded))) == sig
    assert encoded[3:] == ["int64", "uint64", "bool", "float64", "float16"]
    with pytest.raises(RecipeError, match="no JSON form"):
        kernel_recipes.encode_types((types.UniTuple(types.int64, 2),))


def test_a_factory_argument_without_a_json_form_marks_the_entry_unrebuildable():
    from numba.cuda import types

    @dataclasses.dataclass
    class Loose:            # not frozen: its fields could change under the cache
        n: int = 1
    py_func = test_a_factory_argument_without_a_json_form_marks_the_entry_unrebuildable
    entry = kernel_recipes.entry_json(py_func, ("m:f", (Loose(),), {}), (types.int64,))
    assert "not a frozen dataclass" in entry["unrebuildable"]
    with pytest.raises(RecipeError, match="not a frozen dataclass"):
        kernel_recipes.rebuild(entry)


def test_a_frozen_dataclass_and_a_numpy_type_come_back_equal():
    from kdtree_numba.layers.skinny import skinny_config
    values = (3, True, "bf16", None, 0.5, (1, (2, 3)), np.uint64,
              skinny_config(4, 64, 64, "f32"))
    encoded = json.loads(json.dumps([kernel_recipes._encode(v) for v in values]))
    assert tuple(kernel_recipes._decode(v) for v in encoded) == values


def test_a_manifest_names_only_this_packages_kernel_factories_and_kernels():
    """A manifest is data: rebuilding an entry calls nothing but a kernel_factory or a
    registered kernel of kdtree_numba (never os.system, never another package function)."""
    def entry(factory=None, kernel="kdtree_numba.layers.moe:_silu_mul"):
        out = {"kernel": kernel, "types": []}
        if factory:
            out["factory"] = {"name": factory, "args": ["true"], "kwargs": {}}
        return out
    with pytest.raises(RecipeError, match="not a kdtree_numba name"):
        kernel_recipes.rebuild(entry("os:system"))
    with pytest.raises(RecipeError, match="not a kernel factory"):
        kernel_recipes.rebuild(entry("kdtree_numba.precompile:main"))
    with pytest.raises(RecipeError, match="not a kernel$"):
        kernel_recipes.rebuild(entry(kernel="kdtree_numba.runtime:current"))
    with pytest.raises(RecipeError, match="not a dataclass"):
        kernel_recipes._decode({"dataclass": "kdtree_numba.runtime:current", "fields": {}})
    # what the refusals leave alone
    assert kernel_recipes.rebuild(entry()).py_func.__name__ == "_silu_mul"


# ----------------------------------------------------------------------------- manifests

def _write(path, profiles, version=precompile.VERSION):
    path.write_text(json.dumps({"format": precompile.FORMAT, "version": version,
                                "profiles": profiles}))
    return str(path)


def test_entries_for_a_profile_then_its_target_without_repeats(tmp_path):
    a = _write(tmp_path / "a.json", {"t1/d1": [ARGMAX, SILU], "t1/none": [SILU, RMSNORM],
                                     "t2/none": [RMSNORM]})
    b = _write(tmp_path / "b.json", {"t1/d1": [ARGMAX]})
    assert precompile.entries_for("t1/d1", [a, b]) == [ARGMAX, SILU]
    # never recorded with this drafter: every profile of the target, once each
    assert precompile.entries_for("t1/d9", [a, b]) == [ARGMAX, SILU, RMSNORM]
    assert precompile.entries_for("t3/none", [a, str(tmp_path / "missing.json")]) == []


def test_a_run_tagged_profile_adds_its_entries_to_the_default_runs(tmp_path):
    """--budget auto's profile (``<target>/<drafter>/auto``): the default run's entries, then
    its own, once each; never recorded: the default's, else the target's."""
    a = _write(tmp_path / "a.json", {"t1/d1": [ARGMAX, SILU], "t1/d1/auto": [SILU, RMSNORM]})
    assert precompile.entries_for("t1/d1/auto", [a]) == [ARGMAX, SILU, RMSNORM]
    assert precompile.entries_for("t1/d1", [a]) == [ARGMAX, SILU]
    b = _write(tmp_path / "b.json", {"t1/d1": [ARGMAX]})
    assert precompile.entries_for("t1/d1/auto", [b]) == [ARGMAX]
    assert precompile.profile(_Cfg(), run="auto") == precompile.profile(_Cfg()) + "/auto"


@dataclasses.dataclass(frozen=True)
class _Cfg:
    width: int = 8


def test_a_warm_cache_precompiles_a_run_tagged_profile_once(tmp_path, monkeypatch):
    """On a warm cache the default run's profile starts no fan-out; --budget auto's does where
    a manifest lists its kernels and the cache never held them (no mark_warm), once: a run
    that made them (or the fan-out) marks it."""
    (tmp_path / "cache").mkdir()        # (the simulator keeps no kernel cache of its own)
    monkeypatch.setattr(precompile.kernel_cache, "cache_dir", lambda: str(tmp_path / "cache"))
    manifest = _write(tmp_path / "m.json", {"t1/d1": [ARGMAX], "t1/d1/auto": [SILU]})
    fanned = []

    def fan_out(entries, processes, mode, where, log, shown):
        fanned.append(entries)
        return precompile.PrecompileResult(1)
    monkeypatch.setattr(precompile, "_compile_saying", fan_out)
    monkeypatch.setattr(precompile.kernel_cache, "cache_is_warm", lambda: True)
    log = []
    assert precompile.warm_up("t1/d1", log.append, paths=[manifest]) is None
    assert precompile.warm_up("t1/d2/auto", log.append, paths=[manifest]) is None  # unlisted
    assert precompile.warm_up("t1/d1/auto", log.append, paths=[manifest]) is not None
    assert fanned == [[ARGMAX, SILU]]
    assert precompile.warm_up("t1/d1/auto", log.append, paths=[manifest]) is None
    precompile.mark_warm("t1/d9/auto")
    monkeypatch.setattr(precompile.kernel_cache, "cache_is_warm", lambda: False)
    assert precompile.warm_up("t1/d1", log.append, paths=[manifest]) is not None  # cold
    assert len(fanned) == 2


def test_record_adds_only_new_rebuildable_entries_and_heals_this_machines_file(
        tmp_path, monkeypatch):
    broken = dict(SILU, unrebuildable="made outside any kernel_factory")
    monkeypatch.setattr(kernel_recipes, "recorded_entries", lambda: [ARGMAX, SILU, broken])
    out = str(tmp_path / "k.json")
    left_out = [f"{SILU['kernel']}: made outside any kernel_factory"]
    assert precompile.record("t1/d1", out) == (2, left_out)
    assert precompile.record("t1/d1", out) == (0, left_out)
    assert precompile.record("t1/none", out) == (2, left_out)
    assert precompile.read_manifest(out) == {"t1/d1": [ARGMAX, SILU], "t1/none": [ARGMAX, SILU]}
    # a named file that is no manifest is refused; this machine's own starts again
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(precompile.ManifestError):
        precompile.record("t1/d1", str(tmp_path / "bad.json"))
    monkeypatch.setenv("KDTREE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text("{truncated")
    assert precompile.local_manifest() == str(tmp_path / "cache" / "manifest.json")
    assert precompile.record("t1/d1")[0] == 2
    assert precompile.read_manifest(precompile.local_manifest()) == {"t1/d1": [ARGMAX, SILU]}


def test_a_file_that_is_no_manifest_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(precompile.ManifestError, match="not a kernel manifest") as e:
        precompile.read_manifest(str(bad))
    assert "\n" not in str(e.value)
    with pytest.raises(precompile.ManifestError, match="version 99"):
        precompile.read_manifest(_write(tmp_path / "v.json", {}, version=99))
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(precompile.ManifestError, match="no format"):
        precompile.read_manifest(str(bad))
    for profiles in ([], {"t/none": "x"}, {"t/none": [1]}):
        with pytest.raises(precompile.ManifestError, match="map names to lists of entries"):
            precompile.read_manifest(_write(tmp_path / "p.json", profiles))


def test_profile_follows_the_configs():
    from kdtree_numba.bundle import size_config
    tiny, small = size_config("tiny"), size_config("small")
    assert precompile.profile(tiny) == precompile.profile(size_config("tiny"))
    assert precompile.profile(tiny).endswith("/none")
    assert precompile.profile(tiny).split("/")[0] != precompile.profile(small).split("/")[0]
    assert precompile.profile(tiny, "dflash", small) != precompile.profile(tiny, "model", small)


# ----------------------------------------------------------------------------- workers

def test_failing_entries_come_back_as_one_line_each():
    missing = dict(SILU, kernel="kdtree_numba.layers.moe:no_such_kernel")
    renamed = dict(ARGMAX, factory=dict(ARGMAX["factory"],
                                        name="kdtree_numba.layers.argmax:gone"))
    malformed = {"kernel": 7, "factory": "x"}
    result = precompile.compile_entries([missing, SILU, renamed, malformed], 2, mode="check")
    assert result.compiled == 1 and len(result.failed) == 3
    assert all("\n" not in line for line in result.failed)
    assert any(line.startswith("no_such_kernel: RecipeError: ") and "no attribute" in line
               for line in result.failed)
    assert any(line.startswith("argmax_rows from gone(128): RecipeError: ")
               for line in result.failed)



def test_a_worker_that_dies_fails_its_entry_with_its_last_word(monkeypatch):
    script = "import sys; sys.stderr.write('warming up\\nCUDA_ERROR_OUT_OF_MEMORY\\n'); sys.exit(3)"
    monkeypatch.setattr(precompile, "_worker_command", lambda mode: [sys.executable, "-c",
                                                                     script])
    dead = precompile.compile_entries([SILU, ARGMAX], 2, mode="cache")
    assert dead.compiled == 0 and len(dead.failed) == 2
    assert all(line.endswith("the worker died (exit 3): CUDA_ERROR_OUT_OF_MEMORY")
               for line in dead.failed)
    # one worker, three entries: the two it never got to are reported too
    alone = precompile.compile_entries([SILU, ARGMAX, RMSNORM], 1, mode="cache")
    assert len(alone.failed) == 3 and alone.compiled == alone.cached == 0
    assert sum(line.endswith("not tried: every worker had died") for line in alone.failed) == 2


FAN_OUT_SCRIPT = HOPPER_PRELUDE + f"""
import json
from kdtree_numba import precompile
entries = json.loads({json.dumps(json.dumps([ARGMAX, SILU, RMSNORM]))})
serial = [precompile._compile_one(e, "ptx")["ptx"] for e in entries]
fanned = precompile.compile_entries(entries, 2, mode="ptx")
assert fanned.failed == [], fanned.failed
print("same", [fanned.replies[i]["ptx"] == serial[i] for i in range(len(entries))])
"""


@pytest.mark.compile_check(FAN_OUT_SCRIPT, timeout=300)
def test_the_fan_out_compiles_the_same_ptx_as_a_serial_compile():
    from ptx_check import run_without_simulator
    assert "same [True, True, True]" in run_without_simulator(FAN_OUT_SCRIPT, timeout=300)


def test_ptx_digest_ignores_what_numba_numbers_per_process_only():
    a = (".common .global .align 8 .u64 _ZN08NumbaEnv1xB2v3B1yE;\n"
         ".common .global .align 8 .u64 _ZN08NumbaEnv1aB2v4B1yE;\n"
         ".visible .shared .align 4 .b8 _cudapy_smem_7[20];\nadd.f32 %f1, %f2, %f3;")
    b = (".common .global .align 8 .u64 _ZN08NumbaEnv1aB3v11B1yE;\n"
         ".common .global .align 8 .u64 _ZN08NumbaEnv1xB2v9B1yE;\n"
         ".visible .shared .align 4 .b8 _cudapy_smem_2[20];\nadd.f32 %f1, %f2, %f3;")
    assert precompile.ptx_digest(a) == precompile.ptx_digest(b)
    assert precompile.ptx_digest(a) != precompile.ptx_digest(a.replace("add.f32", "sub.f32"))
    assert precompile.ptx_digest(a) != precompile.ptx_digest(a.replace("[20]", "[24]"))


# ----------------------------------------------------------------------------- the GPU

RUN_AND_COUNT = """
import sys
from kdtree_numba.cli import run_main
from kdtree_numba import kernel_recipes
rc = run_main(sys.argv[1:])
hits, misses = kernel_recipes.compile_counts()
print(f"rc {rc} hits {hits} misses {misses}")
"""


def _python(args, cache, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(KDTREE_KERNEL_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.gpu
def test_after_the_precompile_a_run_compiles_nothing(tmp_path):
    """An empty cache; the kernel manifest (the shipped one, else recorded by a first run into
    another empty cache); kdtree-precompile; then a fresh ``kdtree-run --method ddtree`` loads
    every kernel from the disk cache and compiles none."""
    run = ["--method", "ddtree", "--max-new-tokens", "64", "--precompile", "off"]
    manifest = Path(precompile.SHIPPED)
    if not manifest.exists():
        manifest = tmp_path / "kernels.json"
        _python(["-m", "kdtree_numba.cli", *run, "--record-kernels", str(manifest)],
                tmp_path / "first")
    cache = tmp_path / "cache"
    out = _python(["-m", "kdtree_numba.precompile", "--manifest", str(manifest)], cache)
    assert " 0 failed" in out, out
    out = _python(["-c", RUN_AND_COUNT, *run], cache)
    line = [x for x in out.splitlines() if x.startswith("rc ")][-1]
    assert line.startswith("rc 0 ") and line.endswith(" misses 0"), out[-3000:]

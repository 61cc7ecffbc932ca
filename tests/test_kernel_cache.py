"""kdtree_numba/kernel_cache.py: the directory key follows the source, the directory must be
private, generated code gets one stable file, and the switch turns it all off.  Whether numba
then loads kernels from it is a GPU fact (docs/GPU_RESULTS.md: two kdtree-run processes)."""
from __future__ import annotations

import os
import stat

import pytest

from kdtree_numba import kernel_cache, runtime


def _environment_decides(monkeypatch):
    """The switches fixed at import (the simulator, line info) read from the environment as the
    test sets it, as a process started with those variables would see them."""
    monkeypatch.setattr(runtime, "current", runtime.RuntimeConfig.from_environment)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Caching on (as on a GPU machine), into tmp_path; the memoised directory forgotten."""
    _environment_decides(monkeypatch)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    monkeypatch.setenv("KDTREE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KDTREE_KERNEL_CACHE", raising=False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    from numba.cuda.core import config
    monkeypatch.setattr(config, "CACHE_DIR", config.CACHE_DIR)
    kernel_cache.cache_dir.cache_clear()
    yield tmp_path / "cache"
    kernel_cache.cache_dir.cache_clear()
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    config.reload_config()          # numba's config as the restored environment has it


def test_the_key_changes_with_any_source_byte(monkeypatch, tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    monkeypatch.setattr(kernel_cache, "PACKAGE", str(pkg))
    k0 = kernel_cache.source_key()
    assert len(k0) == 16 and k0 == kernel_cache.source_key()
    (pkg / "notes.txt").write_text("edited")                 # not a .py file: same key
    assert kernel_cache.source_key() == k0
    (pkg / "sub" / "b.py").write_text("y = 3\n")              # a device function edited
    k1 = kernel_cache.source_key()
    assert k1 != k0
    (pkg / "sub" / "b.py").rename(pkg / "c.py")               # same bytes, other module
    assert kernel_cache.source_key() not in (k0, k1)


def test_cache_dir_is_private_and_points_numba_there(fresh):
    path = kernel_cache.cache_dir()
    assert path == str(fresh / f"kernels-{kernel_cache.source_key()}")
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    from numba.cuda.core import config
    assert config.CACHE_DIR == path
    # numba re-reads its NUMBA_* variables before a compile once one changed (as
    # runtime.quiet_numba_hints changes one): the directory must survive that
    os.environ["NUMBA_KDTREE_TEST_PROBE"] = "1"
    try:
        config.reload_config()
        assert config.CACHE_DIR == path and os.environ["NUMBA_CACHE_DIR"] == path
    finally:
        del os.environ["NUMBA_KDTREE_TEST_PROBE"]
    assert not kernel_cache.cache_is_warm()
    os.makedirs(os.path.join(path, "x"))
    open(os.path.join(path, "x", "k.nbc"), "wb").close()
    assert kernel_cache.cache_is_warm()


def test_a_directory_others_can_write_is_not_used(fresh):
    fresh.mkdir(mode=0o700)
    os.chmod(fresh, 0o777)
    with pytest.warns(UserWarning, match="not private"):
        assert kernel_cache.cache_dir() is None
    assert "off" in kernel_cache.describe()


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_turns_caching_off(fresh, monkeypatch, value):
    monkeypatch.setenv("KDTREE_KERNEL_CACHE", value)
    assert kernel_cache.cache_dir() is None
    ns = {}
    assert kernel_cache.generated_code("def f():\n    return 7\n", "gen f", ns) == "<gen f>"
    assert ns["f"]() == 7
    assert not fresh.exists()


def test_generated_code_gets_one_stable_file(fresh):
    src = "def f(a):\n    return a + K\n"
    ns1, ns2, ns3 = {"K": 1}, {"K": 1}, {"K": 1.5}
    p1 = kernel_cache.generated_code(src, "tiled linear bf16 cfg", ns1)
    mtime = os.stat(p1).st_mtime_ns
    p2 = kernel_cache.generated_code(src, "tiled linear bf16 cfg", ns2)
    assert p1 == p2 and os.stat(p1).st_mtime_ns == mtime      # not rewritten: numba's stamp
    assert os.path.dirname(p1) == os.path.join(kernel_cache.cache_dir(), "generated")
    assert ns1["f"](1) == 2 and ns1["f"].__code__.co_filename == p1
    # the source numba reads back is the code that runs, line for line
    with open(p1) as f:
        lines = f.read().splitlines()
    assert lines[ns1["f"].__code__.co_firstlineno - 1] == "def f(a):"
    # other bindings (another helper behind the same name): another file
    assert kernel_cache.generated_code(src, "tiled linear bf16 cfg", ns3) != p1


def _factory(n, table, helper):
    def kernel_like(a):
        return helper(a) + n + table[0]
    return kernel_like


def _helper(a):
    return a


KEY_SCRIPT = """
import numpy as np
from kdtree_numba import kernel_cache
from tests.test_kernel_cache import _factory, _helper
print(kernel_cache.closure_key(_factory(3, np.arange(4.0), _helper)))
"""


def test_the_closure_key_is_the_same_in_every_process():
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, PYTHONPATH=root, PYTHONHASHSEED="random")
    keys = {subprocess.run([sys.executable, "-c", KEY_SCRIPT], cwd=root, env=env, check=True,
                           capture_output=True, text=True).stdout for _ in range(2)}
    assert len(keys) == 1 and "_helper" in keys.pop()


def test_the_closure_key_tells_configurations_apart_and_refuses_unstable_cells():
    import numpy as np
    key = kernel_cache.closure_key
    base = key(_factory(3, np.arange(4.0), _helper))
    assert base == key(_factory(3, np.arange(4.0), _helper))
    assert base != key(_factory(4, np.arange(4.0), _helper))
    big1, big2 = np.zeros(5000), np.zeros(5000)
    big2[2500] = 1.0                                       # repr() would show both as zeros
    assert key(_factory(3, big1, _helper)) != key(_factory(3, big2, _helper))
    assert base != key(_factory(3, np.arange(4.0), abs))
    with pytest.raises(kernel_cache.UnstableClosure):
        key(_factory(3, np.arange(4.0), object()))


def test_line_info_builds_get_their_own_directory(monkeypatch):
    _environment_decides(monkeypatch)
    monkeypatch.delenv("KDTREE_CUDA_LINEINFO", raising=False)
    plain = kernel_cache.source_key()
    monkeypatch.setenv("KDTREE_CUDA_LINEINFO", "1")
    assert kernel_cache.source_key() != plain


def test_no_gpu_no_cache_directory(tmp_path):
    """On a machine without a GPU (and without the simulator) nothing compiles: importing the
    kernels makes no directory and hashes nothing."""
    import subprocess
    import sys
    from kdtree_numba import compat
    if compat.gpu_available():
        pytest.skip("a GPU is here: kernels are cached")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(PYTHONPATH=root, KDTREE_KERNEL_CACHE_DIR=str(tmp_path / "kc"))
    subprocess.run([sys.executable, "-c", "import kdtree_numba.model, kdtree_numba.layers, "
                    "kdtree_numba.attention, kdtree_numba.ddtree"], cwd=root, env=env,
                   check=True, capture_output=True)
    assert not (tmp_path / "kc").exists()

"""Rules every console script (kdtree-run, kdtr-dump, kdtr-make-model, kdtr-import-hf) keeps
through formats/console.py (issue 40): a reader that goes away ends the script quietly with
the shell's 141; an argparse error is one line and exit 2 (``--help`` stays full); an output
that exists is replaced only with ``--force``; a full disk while writing is one line naming
the output, exit 2, with no partial output left; ``kdtr-dump diff`` takes only finite,
non-negative tolerances.  The entry points run in-process (``main(argv)`` returns the exit
code); the closed pipe and a real full file system (RLIMIT_FSIZE) also run as processes."""
from __future__ import annotations

import configparser
import errno
import importlib
import io
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from formats import dump, kdtr
from formats.console import (EXIT_PIPE, EXIT_USAGE, UsageError, full_disk_errno,
                             run_console, writing)
from formats.dump.comparison import compare_tensors
from formats.dump.sources import open_source
from kdtree_numba.bundle import make_random_bundle, random_weights, size_config
from kdtree_numba.cli import make_model_main, run_main
from kdtree_numba.hf_import import export_hf_checkpoint
from kdtree_numba.hf_import import main as import_main

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = str(ROOT / "tests/vectors/sample_model.kdtr")
NO_SPACE = os.strerror(errno.ENOSPC)
# What h5py raises on a failed write, and on the close after it (errno only in the text).
H5_WRITE = ("Can't synchronously write data (file write failed: time = x, filename = "
            "'/t/.o.h5.tmp', file descriptor = 3, errno = 28, error message = 'No space "
            "left on device', buf = 0x1, total write size = 4096, offset = 0)")
H5_CLOSE = ("Can't decrement id ref count (unable to extend file properly, errno = 28, "
            "error message = 'No space left on device')")


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bundles") / "tiny.kdtr"
    make_random_bundle(path, "tiny")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1)
    d = tmp_path_factory.mktemp("hf") / "hf"
    export_hf_checkpoint(cfg, dict(random_weights(cfg, 0)), d)
    return d


def one_error_line(capsys, prog: str) -> str:
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
    assert lines[0].startswith(f"{prog}: error: "), cap.err
    return lines[0]


def console_scripts() -> dict[str, object]:
    """The installed entry points, as setup.cfg declares them."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    out = {}
    for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines():
        name, target = (s.strip() for s in line.split("="))
        module, func = target.split(":")
        out[name] = getattr(importlib.import_module(module), func)
    return out


# ----------------------------------------------------------------------------- closed pipe

class _ClosedPipe(io.StringIO):
    """A stdout whose reader has gone away."""

    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def flush(self):
        self.write("")


def test_closed_pipe_is_quiet_exit_141(capsys):
    def main(argv):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
    assert EXIT_PIPE == 128 + signal.SIGPIPE == 141
    assert run_console("prog", main, []) == EXIT_PIPE
    assert run_console("prog", main, ["--debug"]) == EXIT_PIPE    # not an error to debug
    assert capsys.readouterr().err == ""


def test_closed_pipe_seen_when_stdout_is_flushed_after_main(capsys, monkeypatch):
    """Output still buffered when main returns is flushed inside run_console, so a gone
    reader is caught there and not at interpreter exit ("Exception ignored", exit 120)."""
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert run_console("prog", lambda argv: 0, []) == EXIT_PIPE
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("which", ["kdtr-dump", "kdtree-run", "kdtree-run-text"])
def test_every_script_ends_quietly_on_a_closed_pipe(which, tiny, capsys, monkeypatch):
    argv = {"kdtr-dump": [SAMPLE, "--summary"],
            "kdtree-run": ["--model", str(tiny), "--backend", "reference",   # id lines at the end
                           "--max-new-tokens", "2"],
            "kdtree-run-text": ["--backend", "reference", "--max-new-tokens", "2"],  # streamed
            }[which]
    main = console_scripts()[which.removesuffix("-text")]
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(argv) == EXIT_PIPE
    err = capsys.readouterr().err
    assert "error" not in err and "Traceback" not in err and "BrokenPipe" not in err


def test_closed_pipe_as_a_process():
    """What a shell sees for ``kdtr-dump m.kdtr --verify | head -c 0``: the reader is gone
    before the first write; the process ends with 141 and says nothing, not even at exit,
    where its one short line, still buffered, is flushed again (without the redirect to
    /dev/null: "Exception ignored ... BrokenPipeError", exit 120).  kdtr-dump: the same
    run_console as kdtree-run, tested in-process above, without numba's import time."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("KDTREE_DEBUG", "PYTHONUNBUFFERED"):   # stdout buffered, as a user's is
        env.pop(name, None)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "formats.dump", SAMPLE, "--verify"],
                              stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == EXIT_PIPE, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert "error" not in done.stderr


# ----------------------------------------------------------------------------- argparse

BAD_ARGS = [
    ("kdtr-dump", ["--bogus"], "kdtr-dump", "unrecognized arguments: --bogus"),
    ("kdtr-dump", ["diff", "a.kdtr"], "kdtr-dump", "the following arguments are required: b"),
    ("kdtr-dump", ["diff", "a", "b", "--atol", "x"], "kdtr-dump", "--atol: invalid float"),
    ("kdtr-dump", ["convert", "a.kdtr"], "kdtr-dump", "required: dst"),
    ("kdtr-dump", [], "kdtr-dump", "a FILE is needed"),
    ("kdtr-dump", ["a.kdtr", "--force"], "kdtr-dump", "--force goes with --sample OUT"),
    ("kdtree-run", ["--method", "beam"], "kdtree-run", "invalid choice: 'beam'"),
    ("kdtree-run", ["--prompt", "a", "--prompt-ids", "1"], "kdtree-run", "not allowed with"),
    ("kdtree-run", ["--max-new-tokens", "many"], "kdtree-run", "invalid int value: 'many'"),
    ("kdtr-make-model", [], "kdtr-make-model", "required: out"),
    ("kdtr-make-model", ["x.kdtr", "--size", "huge"], "kdtr-make-model", "'huge'"),
    ("kdtr-import-hf", ["only_one"], "kdtr-import-hf", "required: out"),
    ("kdtr-import-hf", ["d", "o.kdtr", "--dtype", "int3"], "kdtr-import-hf", "'int3'"),
]


@pytest.mark.parametrize("script, argv, prog, words", BAD_ARGS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_ARGS)])
def test_argparse_errors_are_one_line_exit_2(script, argv, prog, words, capsys):
    assert console_scripts()[script](argv) == EXIT_USAGE
    line = one_error_line(capsys, prog)
    assert words in line and "--help" in line and "usage:" not in line


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_every_script_one_line_on_an_unknown_option_and_full_help(script, capsys):
    main = console_scripts()[script]
    assert main(["--no-such-option"]) == EXIT_USAGE
    line = one_error_line(capsys, script)     # unknown option, or a missing positional
    assert line.endswith(f"(see {script} --help)") and "usage:" not in line
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--debug" in out and len(out.splitlines()) > 5


# ----------------------------------------------------------------------------- diff tolerances

@pytest.fixture()
def far_apart(tmp_path) -> tuple[str, str]:
    a, b = tmp_path / "a.kdtr", tmp_path / "b.kdtr"
    with kdtr.File(a, "w") as f:
        f["w"] = np.array([1.0, 1e37], np.float32)
    with kdtr.File(b, "w") as f:
        f["w"] = np.array([1.0, -1e37], np.float32)
    return str(a), str(b)


@pytest.mark.parametrize("option, value", [("--rtol", "nan"), ("--atol", "nan"),
                                           ("--atol", "-1"), ("--rtol", "-0.5"),
                                           ("--rtol", "inf"), ("--atol", "1e400")])
def test_diff_tolerances_finite_and_non_negative(far_apart, option, value, capsys):
    a, b = far_apart
    assert dump.main(["diff", a, b, option, value]) == EXIT_USAGE
    line = one_error_line(capsys, "kdtr-dump")
    assert f"{option} " in line and "finite number >= 0" in line
    assert dump.main(["diff", a, a, option, value]) == EXIT_USAGE    # same file: still refused
    one_error_line(capsys, "kdtr-dump")


def test_diff_with_sane_tolerances_still_judges(far_apart, capsys):
    a, b = far_apart
    assert dump.main(["diff", a, b, "--rtol", "1"]) == 1     # |a - b| = 2e37 > 1 * 1e37
    assert dump.main(["diff", a, b, "--rtol", "2"]) == 0
    assert dump.main(["diff", a, a, "--atol", "0", "--rtol", "0"]) == 0
    capsys.readouterr()
    with open_source(a) as sa, open_source(b) as sb:
        ta, tb = sa.entries()[-1].tensor, sb.entries()[-1].tensor
        assert compare_tensors(ta, tb, 0.0, 2.0)["mismatched"] == 0
        with pytest.raises(UsageError, match="--rtol nan"):
            compare_tensors(ta, tb, 0.0, float("nan"))


# ----------------------------------------------------------------------------- --force

def _existing(path: Path) -> bytes:
    path.write_bytes(b"precious, not to be replaced")
    return path.read_bytes()


def _refuses(capsys, prog: str, main, argv: list[str], dst: Path) -> None:
    before = _existing(dst)
    listing = sorted(os.listdir(dst.parent))
    assert main([str(a) for a in argv]) == EXIT_USAGE
    line = one_error_line(capsys, prog)
    assert str(dst) in line and "already exists" in line and "--force" in line
    assert dst.read_bytes() == before and sorted(os.listdir(dst.parent)) == listing


def test_convert_refuses_an_existing_output_without_force(tmp_path, capsys):
    for dst in (tmp_path / "o.h5", tmp_path / "o.kdtr"):
        src = SAMPLE if dst.suffix == ".h5" else str(tmp_path / "o.h5")
        _refuses(capsys, "kdtr-dump", dump.main, ["convert", src, dst], dst)
        assert dump.main(["convert", src, str(dst), "--force"]) == 0
        capsys.readouterr()
    assert (tmp_path / "o.kdtr").read_bytes() == open(SAMPLE, "rb").read()


def test_sample_refuses_an_existing_output_without_force(tmp_path, capsys):
    dst = tmp_path / "s.kdtr"
    _refuses(capsys, "kdtr-dump", dump.main, ["--sample", dst], dst)
    assert dump.main(["--sample", str(dst), "--force"]) == 0
    assert dst.read_bytes() == open(SAMPLE, "rb").read()


def test_make_model_refuses_an_existing_output_without_force(tmp_path, capsys):
    dst = tmp_path / "m.kdtr"
    _refuses(capsys, "kdtr-make-model", make_model_main, [dst], dst)
    assert make_model_main([str(dst), "--force"]) == 0
    with kdtr.File(dst) as f:
        assert len(list(f)) > 0


def test_import_refuses_an_existing_output_without_force(tmp_path, hf_dir, capsys):
    dst = tmp_path / "m.kdtr"
    _refuses(capsys, "kdtr-import-hf", import_main, [hf_dir, dst], dst)
    assert import_main([str(hf_dir), str(dst), "--force", "--quiet"]) == 0
    with kdtr.File(dst) as f:
        assert len(list(f)) > 0


# ----------------------------------------------------------------------------- full disk

class _FillsUp:
    """A file object that takes ``room`` bytes, then fails as a full disk does: every later
    write and the flush of ``close`` raise ENOSPC (what the KDTR writer meets)."""

    def __init__(self, inner, room: int):
        self._inner, self._room, self._full = inner, room, False

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._room:
            self._full = True
            raise OSError(errno.ENOSPC, NO_SPACE)
        self._room -= n
        return self._inner.write(data)

    def close(self) -> None:
        self._inner.close()
        if self._full:
            raise OSError(errno.ENOSPC, NO_SPACE)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def fill_kdtr_disk(monkeypatch) -> None:
    """From now on, KDTR outputs (written through ``os.fdopen(fd, "w+b")``) get 64 KiB."""
    real = os.fdopen

    def fdopen(fd, mode="r", *a, **k):
        f = real(fd, mode, *a, **k)
        return _FillsUp(f, 64 << 10) if mode == "w+b" else f
    monkeypatch.setattr(kdtr.os, "fdopen", fdopen)


@pytest.fixture()
def h5_disk_fills(monkeypatch):
    """HDF5 outputs: the first dataset write fails as h5py reports ENOSPC, and so does the
    close after it (h5py's RuntimeError, errno in the text only)."""
    def setitem(self, key, value):
        raise OSError(errno.ENOSPC, H5_WRITE)
    real_close = h5py.File.close

    def close(self):
        was_open = bool(self.id.valid)
        real_close(self)
        if was_open and self.mode == "r+":
            raise RuntimeError(H5_CLOSE)
    monkeypatch.setattr(h5py.Dataset, "__setitem__", setitem)
    monkeypatch.setattr(h5py.File, "close", close)


def _left_alone(folder: Path, before: dict[str, bytes]) -> None:
    """No partial output, no temporary file; what was there is byte for byte the same."""
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def _full_disk_line(capsys, prog: str, dst: Path) -> None:
    line = one_error_line(capsys, prog)
    assert line.startswith(f"{prog}: error: {dst}: no space left on the device"), line
    assert "partial output was removed" in line


@pytest.mark.parametrize("force", [False, True])
def test_convert_to_hdf5_on_a_full_disk(tmp_path, h5_disk_fills, capsys, force):
    src, dst = tmp_path / "in.kdtr", tmp_path / "out.h5"
    src.write_bytes(open(SAMPLE, "rb").read())
    if force:
        _existing(dst)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert dump.main(["convert", str(src), str(dst)] + ["--force"] * force) == EXIT_USAGE
    _full_disk_line(capsys, "kdtr-dump", dst)
    _left_alone(tmp_path, before)


def test_convert_to_kdtr_on_a_full_disk(tmp_path, capsys, monkeypatch):
    src, dst = tmp_path / "in.h5", tmp_path / "out.kdtr"
    assert dump.main(["convert", SAMPLE, str(src)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    fill_kdtr_disk(monkeypatch)
    assert dump.main(["convert", str(src), str(dst)]) == EXIT_USAGE
    _full_disk_line(capsys, "kdtr-dump", dst)
    _left_alone(tmp_path, before)


def test_make_model_and_import_on_a_full_disk(tmp_path, hf_dir, capsys, monkeypatch):
    dst = tmp_path / "m.kdtr"
    fill_kdtr_disk(monkeypatch)
    assert make_model_main([str(dst)]) == EXIT_USAGE
    _full_disk_line(capsys, "kdtr-make-model", dst)
    assert import_main([str(hf_dir), str(dst), "--quiet"]) == EXIT_USAGE
    _full_disk_line(capsys, "kdtr-import-hf", dst)
    _left_alone(tmp_path, {})


def test_full_disk_errno_reads_h5py_and_chained_errors():
    assert full_disk_errno(RuntimeError(H5_CLOSE)) == errno.ENOSPC
    assert full_disk_errno(OSError(errno.EDQUOT, "quota")) == errno.EDQUOT
    try:
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError:
            raise RuntimeError("Can't close (unrelated words)")
    except RuntimeError as e:
        assert full_disk_errno(e) == errno.EFBIG
    assert full_disk_errno(OSError(errno.EACCES, "denied")) is None
    assert full_disk_errno(ValueError("errno = 28")) is None     # only OSError/RuntimeError
    with pytest.raises(ValueError, match="other"):
        with writing("x.kdtr"):
            raise ValueError("other")                           # anything else passes through


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(
        resource.RLIMIT_FSIZE)[1]))


def test_a_real_file_size_limit_as_a_process(tmp_path):
    """The operating system's own EFBIG (RLIMIT_FSIZE), through real h5py and the KDTR
    writer: one line naming the output, exit 2, nothing left behind."""
    big = tmp_path / "big.kdtr"
    with kdtr.File(big, "w") as f:
        f["w"] = np.ones((256, 1024), np.float32)       # 1 MiB of data: past the 64 KiB limit
    h5 = tmp_path / "big.h5"
    assert dump.main(["convert", str(big), str(h5)]) == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KDTREE_DEBUG", None)
    script = ("import sys; from formats.dump import main\n"
              "print(main(['convert', sys.argv[1], sys.argv[2]]),"
              " main(['convert', sys.argv[3], sys.argv[4]]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(big), str(tmp_path / "o.h5"),
                           str(h5), str(tmp_path / "o.kdtr")], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120,
                          preexec_fn=_limit_file_size)
    assert done.stdout.split() == ["2", "2"], done.stderr
    assert done.stderr.splitlines() == [
        f"kdtr-dump: error: {tmp_path / name}: file too large while writing it; the partial "
        f"output was removed" for name in ("o.h5", "o.kdtr")], done.stderr
    _left_alone(tmp_path, before)


def test_writers_raise_the_first_full_disk_error_and_leave_nothing(tmp_path, h5_disk_fills,
                                                                   monkeypatch):
    """For library callers too: the error is the write's ENOSPC (not the close's
    RuntimeError that follows it), and no temporary file is left."""
    from formats.hdf5 import to_hdf5
    with pytest.raises(OSError) as info:
        to_hdf5(SAMPLE, tmp_path / "o.h5")
    assert info.value.errno == errno.ENOSPC and not isinstance(info.value, RuntimeError)
    fill_kdtr_disk(monkeypatch)
    with pytest.raises(OSError) as info:
        with kdtr.File(tmp_path / "o.kdtr", "w") as f:
            f["w"] = np.zeros(1 << 16, np.float32)
    assert info.value.errno == errno.ENOSPC and info.value.__context__ is None
    assert os.listdir(tmp_path) == []

"""formats/console.py (issue 16): bad input is one line ``PROG: error: MESSAGE`` and exit 2,
Ctrl-C one line and 130, internal errors keep their traceback (exit 1); ``--debug`` and
``KDTREE_DEBUG=1`` show the traceback of an expected failure too."""
from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys

import pytest

from formats.console import (EXIT_INTERRUPTED, EXIT_USAGE, UsageError, add_debug_flag,
                             error_message, is_expected, read_user_text, run_console,
                             split_debug)
from formats.errors import KdtrError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raiser(exc: BaseException):
    def main(argv):
        raise exc
    return main


def _run(capsys, main, argv=()):
    code = run_console("prog", main, list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


EXPECTED = [
    (UsageError("--budget 0: must be at least 1"), "--budget 0: must be at least 1"),
    (KdtrError("K056", "stored 0x1, computed 0x2", "/w", "m.kdtr"),
     "m.kdtr: K056 tensor checksum mismatch at '/w': stored 0x1, computed 0x2"),
    (KdtrError("K002", "first bytes b'abc'"), "K002 not a KDTR file (wrong magic): first "),
    (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "gone.kdtr"),
     "gone.kdtr: no such file or folder"),
    (IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), "adir"),
     "adir: is a folder, not a file"),
    (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "secret"),
     "secret: permission denied"),
    (FileNotFoundError(errno.ENOENT, "no such folder (cannot write x.kdtr in it)", "nodir"),
     "nodir: no such folder (cannot write x.kdtr in it)"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left on the device"),
    (UnicodeDecodeError("utf-8", b"\x89PNG", 0, 1, "invalid start byte"),
     "not utf-8 text: byte 0x89 at offset 0"),
    (UsageError("two\nlines \x1b[31m"), "two\\x0alines \\x1b[31m"),
]


@pytest.mark.parametrize("exc,text", EXPECTED, ids=[type(e).__name__ + str(i)
                                                   for i, (e, _) in enumerate(EXPECTED)])
def test_expected_failures_are_one_line_exit_2(capsys, exc, text):
    code, out, err = _run(capsys, _raiser(exc))
    assert code == EXIT_USAGE and out == ""
    assert err.startswith("prog: error: ") and text in err
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    assert "Traceback" not in err


@pytest.mark.parametrize("exc", [RuntimeError("bug"), ValueError("internal"),
                                 KeyError("k"), OSError("no errno, no file"),
                                 TypeError("bad call")])
def test_internal_errors_propagate(capsys, exc):
    assert not is_expected(exc)
    with pytest.raises(type(exc)):
        run_console("prog", _raiser(exc), [])
    assert capsys.readouterr().err == ""


def test_keyboard_interrupt_is_one_line_130(capsys):
    code, _, err = _run(capsys, _raiser(KeyboardInterrupt()))
    assert code == EXIT_INTERRUPTED == 130 and err == "prog: interrupted\n"


@pytest.mark.parametrize("how", ["flag", "flag-late", "env"])
def test_debug_reraises_expected_failures(capsys, monkeypatch, how):
    seen = []

    def main(argv):
        seen.append(argv)
        raise UsageError("--x 1: bad")
    argv = {"flag": ["--debug", "a"], "flag-late": ["a", "--debug"], "env": ["a"]}[how]
    if how == "env":
        monkeypatch.setenv("KDTREE_DEBUG", "1")
    with pytest.raises(UsageError):
        run_console("prog", main, argv)
    assert seen == [["a"]]                           # --debug never reaches main


def test_debug_env_off_values(capsys, monkeypatch):
    for value in ("", "0", "no", "false"):
        monkeypatch.setenv("KDTREE_DEBUG", value)
        assert _run(capsys, _raiser(UsageError("x")))[0] == 2


def test_split_debug_keeps_what_follows_a_double_dash():
    assert split_debug(["a", "--debug", "--", "--debug"]) == (["a", "--", "--debug"], True)
    assert split_debug(["a"]) == (["a"], False)


def test_system_exit_and_argparse(capsys):
    def main(argv):
        p = argparse.ArgumentParser(prog="prog")
        p.add_argument("--n", type=int, default=3)
        add_debug_flag(p)
        p.parse_args(argv)
        return 0
    assert _run(capsys, main, ["--n", "x"])[0] == 2              # argparse's usage error
    code, out, _ = _run(capsys, main, ["--help"])
    assert code == 0 and "--debug" in out and "KDTREE_DEBUG" in out
    assert _run(capsys, main, ["--debug"])[0] == 0
    assert _run(capsys, _raiser(SystemExit(None)))[0] == 0
    code, _, err = _run(capsys, _raiser(SystemExit("prog: gave up")))
    assert code == 1 and err == "prog: gave up\n"


def test_read_user_text(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("1 2 3\n")
    assert read_user_text(str(good), "--prompt-file") == "1 2 3\n"
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(UsageError, match=r"--prompt-file .*b\.bin: not utf-8 text"):
        read_user_text(str(binary), "--prompt-file")
    with pytest.raises(UsageError, match=r"--prompt-file .*nope: no such file"):
        read_user_text(str(tmp_path / "nope"), "--prompt-file")
    with pytest.raises(UsageError, match="is a folder"):
        read_user_text(str(tmp_path), "--prompt-file")


def test_error_message_of_a_rename_names_both_paths():
    e = OSError(errno.EXDEV, os.strerror(errno.EXDEV), "a", None, "b")
    assert error_message(e).startswith("a -> b: ")


def test_as_a_real_process_traceback_only_when_asked(tmp_path):
    """Through a real interpreter: exit codes and what reaches stderr."""
    script = ("import sys; from formats.console import run_console, UsageError\n"
              "def main(argv):\n"
              "    if argv[0] == 'bad': raise UsageError('--n -5: must be >= 0')\n"
              "    raise RuntimeError('internal')\n"
              "sys.exit(run_console('prog', main))\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("KDTREE_DEBUG", None)

    def go(*argv, **extra):
        return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True,
                              text=True, env=dict(env, **extra), timeout=60)
    done = go("bad")
    assert done.returncode == 2 and done.stderr == "prog: error: --n -5: must be >= 0\n"
    done = go("bad", "--debug")
    assert done.returncode == 1 and "Traceback" in done.stderr and "UsageError" in done.stderr
    done = go("bad", KDTREE_DEBUG="1")
    assert done.returncode == 1 and "Traceback" in done.stderr
    done = go("internal")
    assert done.returncode == 1 and "Traceback" in done.stderr and "RuntimeError" in done.stderr

"""kdtr-dump on bad input (issue 16): exit 2, exactly one line on stderr naming the file (in
``diff``, the side that failed), no traceback; a bit flip in a tensor is named by ``--verify``
(exit 3) and refused by ``convert`` (exit 2, no output and no temporary file left);
``--debug``/``KDTREE_DEBUG=1`` show the traceback; an internal error still exits 1 with one."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from formats import dump, kdtr
from formats.errors import KdtrError

SAMPLE = "tests/vectors/sample_model.kdtr"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR = "/layers/1/attn/o_proj"


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    """Good and bad inputs, by name."""
    good = tmp_path / "good.kdtr"
    shutil.copy(SAMPLE, good)
    raw = bytearray(good.read_bytes())
    with kdtr.File(good) as f:
        offset = f[TENSOR].offset + 100
    raw[offset] ^= 0x10
    (tmp_path / "flip.kdtr").write_bytes(bytes(raw))
    (tmp_path / "trunc.kdtr").write_bytes(good.read_bytes()[:4000])
    (tmp_path / "notes.txt").write_text("not a tensor file\n" * 20)
    (tmp_path / "adir").mkdir()
    with h5py.File(tmp_path / "good.h5", "w") as f:
        f["w"] = np.ones(4, np.float32)
    (tmp_path / "trunc.h5").write_bytes((tmp_path / "good.h5").read_bytes()[:600])
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!}")
    names = ["good.kdtr", "flip.kdtr", "trunc.kdtr", "notes.txt", "adir", "good.h5", "trunc.h5",
             "junk.safetensors"]
    out = {n: str(tmp_path / n) for n in names}
    out["missing"] = str(tmp_path / "missing.kdtr")
    out["nodir"] = str(tmp_path / "nodir")
    out["tmp"] = str(tmp_path)
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    code = dump.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


# (id, argv with {name} placeholders, what the error line must name, what it must not name)
CASES = [
    ("missing-file", ["{missing}"], ["missing.kdtr"], []),
    ("directory", ["{adir}"], ["adir", "K058"], []),
    ("text-file", ["{notes.txt}"], ["notes.txt", "K002"], []),
    ("truncated-kdtr", ["{trunc.kdtr}"], ["trunc.kdtr", "K017"], []),
    ("truncated-kdtr-summary", ["{trunc.kdtr}", "--summary"], ["trunc.kdtr"], []),
    ("missing-verify", ["{missing}", "--verify"], ["missing.kdtr", "no such file"], []),
    ("text-file-verify", ["{notes.txt}", "--verify"], ["notes.txt"], []),
    ("truncated-hdf5", ["{trunc.h5}"], ["trunc.h5"], []),
    ("junk-safetensors", ["{junk.safetensors}"], ["junk.safetensors"], []),
    ("no-such-dataset", ["{good.kdtr}", "-d", "no/such"], ["-d /no/such", "good.kdtr"], []),
    ("group-as-dataset", ["{good.kdtr}", "-d", "layers"], ["-d /layers", "good.kdtr"], []),
    ("bad-slice", ["{good.kdtr}", "-d", "embed", "--slice", "0:1:0"],
     ["--slice 0:1:0", "embed"], []),
    ("diff-missing-b", ["diff", "{good.kdtr}", "{missing}"], ["missing.kdtr"], ["good.kdtr"]),
    ("diff-missing-a", ["diff", "{missing}", "{good.kdtr}"], ["missing.kdtr"], ["good.kdtr"]),
    ("diff-truncated-b", ["diff", "{good.kdtr}", "{trunc.kdtr}"], ["trunc.kdtr", "K017"],
     ["good.kdtr"]),
    ("diff-truncated-a", ["diff", "{trunc.kdtr}", "{good.kdtr}"], ["trunc.kdtr", "K017"],
     ["good.kdtr"]),
    ("diff-text-b", ["diff", "{good.kdtr}", "{notes.txt}"], ["notes.txt"], ["good.kdtr"]),
    ("diff-directory-a", ["diff", "{adir}", "{good.kdtr}"], ["adir"], ["good.kdtr"]),
    ("diff-truncated-hdf5-b", ["diff", "{good.h5}", "{trunc.h5}"], ["trunc.h5"], ["good.h5"]),
    ("convert-bit-flip", ["convert", "{flip.kdtr}", "{tmp}/out.h5"],
     ["flip.kdtr", "K056", TENSOR], ["out.h5"]),
    ("convert-missing-folder", ["convert", "{good.kdtr}", "{nodir}/out.h5"],
     ["nodir", "no such folder"], [".tmp"]),
    ("convert-missing-folder-kdtr", ["convert", "{good.h5}", "{nodir}/out.kdtr"],
     ["nodir", "no such folder"], [".tmp"]),
    ("convert-missing-source", ["convert", "{missing}", "{tmp}/out.h5"], ["missing.kdtr"], []),
    ("convert-truncated-source", ["convert", "{trunc.kdtr}", "{tmp}/out.h5"],
     ["trunc.kdtr"], []),
    ("convert-into-a-folder", ["convert", "{good.kdtr}", "{adir}"], ["adir", "DST"], []),
    ("convert-bad-extension", ["convert", "{good.kdtr}", "{tmp}/out.txt"], ["out.txt"], []),
]


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for name, path in files.items():
            a = a.replace("{" + name + "}", path)
        out.append(a)
    return out


@pytest.mark.parametrize("argv,named,not_named", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_naming_the_file(capsys, files, argv, named, not_named):
    before = sorted(os.listdir(files["tmp"]))
    code, out, err = run(capsys, *_fill(argv, files))
    assert code == 2, (out, err)
    assert err.startswith("kdtr-dump: error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    line = err.rstrip("\n")
    for what in named:
        assert what in line, (what, line)
    for what in not_named:
        assert what not in line, (what, line)
    assert sorted(os.listdir(files["tmp"])) == before   # no output, no temporary file


@pytest.mark.parametrize("name,named", [("flip.kdtr", ["K056", TENSOR]),
                                        ("trunc.kdtr", ["K017"])])
def test_verify_reports_a_damaged_file_as_corrupt(capsys, files, name, named):
    """--verify's own answer for a file of the format that fails a check: exit 3, one line
    on stdout naming the file (and the tensor)."""
    code, out, err = run(capsys, files[name], "--verify")
    assert code == 3 and err == ""
    assert out.startswith("CORRUPT ") and len(out.splitlines()) == 1 and name in out
    for what in named:
        assert what in out


def test_convert_of_clean_data_still_works(capsys, files):
    code, out, err = run(capsys, "convert", files["good.kdtr"], files["tmp"] + "/ok.h5")
    assert code == 0 and err == "" and "41 datasets" in out


def test_debug_flag_shows_the_traceback(capsys, files):
    with pytest.raises(KdtrError, match="K017"):
        dump.main([files["trunc.kdtr"], "--debug"])
    with pytest.raises(FileNotFoundError):
        dump.main(["diff", files["good.kdtr"], "--debug", files["missing"]])


def test_debug_environment_variable_shows_the_traceback(files, monkeypatch):
    monkeypatch.setenv("KDTREE_DEBUG", "1")
    with pytest.raises(KdtrError, match="K056"):
        dump.main(["convert", files["flip.kdtr"], files["tmp"] + "/out.h5"])
    assert not os.path.exists(files["tmp"] + "/out.h5")


def test_help_lists_debug(capsys):
    for argv in (["--help"], ["diff", "--help"], ["convert", "--help"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0 and "--debug" in out


def test_internal_error_keeps_its_traceback(capsys, files, monkeypatch):
    def boom(entries):
        raise RuntimeError("a bug, not bad input")
    monkeypatch.setattr(dump.inspection, "summarize", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        dump.main([files["good.kdtr"], "--summary"])


def _python(code: str, *argv: str, **env) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=REPO, **env)
    if "KDTREE_DEBUG" not in env:
        environ.pop("KDTREE_DEBUG", None)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=environ, timeout=120, cwd=REPO)


def test_as_a_process(files):
    """Exit codes and stderr of the real entry point: bad input 2 (one line), --debug and an
    internal error 1 with a traceback."""
    entry = "import sys; from formats.dump import main; sys.exit(main())"
    done = _python(entry, files["trunc.kdtr"])
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert "trunc.kdtr" in done.stderr and "Traceback" not in done.stderr
    done = _python(entry, files["trunc.kdtr"], "--debug")
    assert done.returncode == 1 and "Traceback" in done.stderr and "KdtrError" in done.stderr
    done = _python(entry, files["trunc.kdtr"], KDTREE_DEBUG="1")
    assert done.returncode == 1 and "Traceback" in done.stderr
    internal = ("import sys; import formats.dump.inspection as i\n"
                "def boom(e): raise RuntimeError('a bug')\n"
                "i.summarize = boom\n"
                "from formats.dump import main; sys.exit(main())")
    done = _python(internal, files["good.kdtr"], "--summary")
    assert done.returncode == 1 and "Traceback" in done.stderr and "RuntimeError" in done.stderr

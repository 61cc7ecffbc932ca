"""The README's bash blocks, run as written (issue 16: its "Running models" block had rotted).

Each ```bash block of README.md runs in a fresh temporary folder, command after command
(``\\`` continuations joined, ``#`` comments dropped, ``A && B`` split, ``NAME=value``
prefixes set in the environment).  The project's console scripts run in-process through
their entry points (``kdtree-run`` -> ``kdtree_numba.cli.run_main`` and so on, the functions
setup.cfg's console_scripts name) and must exit 0.  ``kdtree-run`` runs on the reference
backend whatever ``--backend`` says, so that the test means the same with and without a GPU
(and does not spend the numba kernels' first-call compile).

Only the commands matched by ``SKIPS`` are not run, each for the reason given there; any other
command that is not a console script fails the test, so a new README command is either
runnable here or skipped on purpose.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _entry_points():
    from formats.dump import main as dump_main
    from kdtree_numba.cli import make_model_main, run_main
    from kdtree_numba.hf_import import main as import_main
    return {"kdtree-run": run_main, "kdtr-make-model": make_model_main,
            "kdtr-import-hf": import_main, "kdtr-dump": dump_main}


# (test on the command's words, why it is not run here)
SKIPS = [
    (lambda w: w[:2] == ["pip", "install"],
     "installing is CI's own first step (.ci/run); this test runs inside that install"),
    (lambda w: w[:3] in (["python3", "-m", "pytest"], ["python", "-m", "pytest"]),
     "the test suite itself, which is running this test"),
    (lambda w: w[0] == "kdtr-import-hf" and w[1].startswith("/path/to/"),
     "needs a real Hugging Face checkpoint (tests/test_bundle.py and tests/test_hf_parity.py "
     "import generated ones through the same code)"),
    (lambda w: w[0] == "bash" and w[1].startswith("tools/gpu_"),
     "the GPU suite: needs the GPU machine (docs/GPU_RESULTS.md records its runs)"),
]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[tuple[dict, list[str]]]:
    """(environment, words) of each simple command of a block."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        part: list[str] = []
        for w in words + ["&&"]:
            if w != "&&":
                part.append(w)
                continue
            env = {}
            while part and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", part[0]):
                key, value = part.pop(0).split("=", 1)
                env[key] = value
            if part:
                out.append((env, part))
            part = []
    return out


def skip_reason(words: list[str]) -> str | None:
    for test, why in SKIPS:
        if test(words + [""]):
            return why
    return None


BLOCKS = bash_blocks(README.read_text())


def test_readme_has_the_blocks_this_test_is_about():
    firsts = [commands(b)[0][1][:2] for b in BLOCKS]
    assert ["pip", "install"] in firsts                  # the first-lines commands
    assert ["kdtr-make-model", "target.kdtr"] in firsts  # "Running models"


def test_parser_reads_continuations_chains_env_and_comments():
    block = "A=1 B=x kdtree-run --json \\\n   --seed 2  # note\npip install -e . && kdtr-dump f\n"
    assert commands(block) == [({"A": "1", "B": "x"}, ["kdtree-run", "--json", "--seed", "2"]),
                               ({}, ["pip", "install", "-e", "."]), ({}, ["kdtr-dump", "f"])]


def _reference_backend(words: list[str]) -> list[str]:
    words = list(words)
    if "--backend" in words:
        words[words.index("--backend") + 1] = "reference"
    else:
        words += ["--backend", "reference"]
    return words


@pytest.mark.parametrize("block", BLOCKS,
                         ids=[commands(b)[0][1][0] + f"-{i}" for i, b in enumerate(BLOCKS)])
def test_readme_block_runs(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)
    entry = _entry_points()
    ran, skipped = 0, []
    for env, words in commands(block):
        reason = skip_reason(words)
        if reason is not None:
            skipped.append(f"{shlex.join(words)}: {reason}")
            continue
        assert words[0] in entry, (f"README command {shlex.join(words)!r} is neither a console "
                                   f"script nor in tests/test_readme.py's SKIPS")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        argv = words[1:]
        if words[0] == "kdtree-run":
            argv = _reference_backend(argv)
        code = entry[words[0]](argv)
        out, err = capsys.readouterr()
        assert code == 0, f"{shlex.join(words)} exited {code}:\n{err}"
        assert "Traceback" not in err
        ran += 1
    if not ran:
        pytest.skip("; ".join(skipped))

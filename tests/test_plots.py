"""Pictures (issue 14, item 5).

* ``kdtree-run --plot`` writes a PNG (DDTree and chain on the shipped demo target), and says
  so; without matplotlib it is one usage line naming the extra.
* The engine's ``on_round`` hook: the rounds read the device exactly as without it (the one
  read per round of docs/ENGINE.md, "Sync points"), ``RoundRecorder.pick`` adds one read, and
  the round it returns is the one the engine committed (root, accepted tokens, bonus).
(tools/bench_demo.py, whose --plot draws plot_budget_curves, has its own tests:
tests/test_bench_demo.py.)
"""
from __future__ import annotations

import sys

import pytest

from kdtree_numba import plots
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.cli import run_main
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

PNG = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("matplotlib"),
    reason="matplotlib (the plot extra; CI's test extra has it)")


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)


def is_png(path) -> bool:
    data = open(path, "rb").read()
    return data[:8] == PNG and len(data) > 1000


# ----------------------------------------------------------------------------- kdtree-run --plot

@needs_matplotlib
@pytest.mark.parametrize("method", ["ddtree", "chain"])
def test_kdtree_run_plot_writes_a_png(method, tmp_path, capsys):
    path = tmp_path / f"{method}.png"
    assert run_main(["--method", method, "--drafter", "oracle:0.9", "--max-new-tokens", "16",
                     "--budget", "8", "--backend", "reference", "--plot", str(path)]) == 0
    err = capsys.readouterr().err
    assert is_png(path)
    assert f"--plot: wrote {path}" in err and "median acceptance" in err, err


def test_plot_without_matplotlib_is_one_usage_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib fails
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert run_main(["--method", "ddtree", "--plot", str(tmp_path / "x.png")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["kdtree-run: error: --plot needs matplotlib: pip install "
                     "'kdtree-numba[plot]'"]
    assert not (tmp_path / "x.png").exists()


# ----------------------------------------------------------------------------- the hook

def reads_of(backend, fn):
    before = backend.reads
    out = fn()
    return out, backend.reads - before


def test_round_hook_keeps_one_read_per_round_and_pick_reads_once():
    """A target on its own backend, an oracle drafter on another instance of it (the oracle's
    own reads are not the engine's): with or without the recorder the rounds read
    1 + rounds times; pick() reads once more; its round is what the engine committed."""
    cfg = size_config("tiny", num_hidden_layers=2)
    weights = dict(random_weights(cfg, 3))
    target = Model(cfg, weights, "reference")
    prompt = [5, 6, 7, 8]

    def run(hook):
        oracle = NoisyOracleDrafter(Model(cfg, weights, "reference"), 4, agreement=0.8,
                                    sharpness=4.0)
        return generate(target, [prompt], 20, method="ddtree", drafter=oracle, budget=6,
                        on_round=hook)

    plain, plain_reads = reads_of(target.backend, lambda: run(None))
    recorder = plots.RoundRecorder(target.backend)
    hooked, hooked_reads = reads_of(target.backend, lambda: run(recorder))
    assert plain_reads == 1 + plain.stats.rounds
    assert hooked_reads == plain_reads and hooked.tokens == plain.tokens
    assert len(recorder.packed) == hooked.stats.rounds
    out = hooked.tokens[0]
    rt, pick_reads = reads_of(target.backend, lambda: recorder.pick(hooked.stats.tau, out))
    assert pick_reads == 1
    rounds = plots.request_rounds(hooked.stats.tau, len(out))
    r, acc_len, before = next(x for x in rounds if x[0] == rt.index)
    accs = sorted(a for _, a, _ in rounds)
    assert acc_len == accs[(len(accs) - 1) // 2]            # the median round
    assert rt.root == ([*prompt, *out][len(prompt) + before - 1])
    assert len(rt.accepted) == acc_len and rt.accepted[0] == 0
    assert rt.accepted_tokens() == out[before:before + acc_len - 1]
    if before + acc_len <= len(out):
        assert rt.bonus == out[before + acc_len - 1]
    for s in rt.accepted[1:]:                               # a path: each node's parent before it
        assert rt.parent[s] in rt.accepted
    assert rt.n_nodes == 6 and all(0 <= rt.parent[s] < s for s in range(1, 7))


def test_request_rounds_and_pick_round():
    # request 0 ran rounds 0 and 1 (1 + 3 + 2 = 6 tokens), then request 1 alone
    tau = [[3, 1], [2, 4], [5]]
    assert plots.request_rounds(tau, 6) == [(0, 3, 1), (1, 2, 4)]
    assert plots.request_rounds([], 1) == [] and plots.pick_round([]) is None
    i, how = plots.pick_round([(0, 3, 1), (1, 2, 4), (2, 7, 6)])
    assert i == 0 and "median acceptance, 3" in how


def test_token_label_makes_whitespace_visible_and_escapes_mathtext():
    assert plots.token_label(" x\n") == "\u00b7x\\n"
    assert plots.token_label("$a$") == r"\$a\$"
    assert plots.token_label("abcdefghijklmnop") == "abcdefghijk\u2026"
    assert plots.token_label("") == "''"

"""tools/ab_switches.py: the interleaved A/B of runtime switches (the tool times on a GPU;
here its bookkeeping on the reference backend with a made-up clock): variants parsed or
refused in one line, every prompt under every variant in a rotated order, the environment
restored, rates from the summed times and their spread (the passes' rates, the prompts a
variant was faster on), a switch that changes a token reported."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import ab_switches  # noqa: E402
from test_bench_demo import tiny  # noqa: E402,F401  (the fixture: a tiny target, an oracle)


def test_variants_parse_and_bad_ones_are_one_line():
    assert ab_switches.parse_variants("base; on=KDTREE_X=1,KDTREE_Y=0") == [
        ("base", {}), ("on", {"KDTREE_X": "1", "KDTREE_Y": "0"})]
    for bad, says in (("base", "at least two"), ("a;a", "a name of its own"),
                      ("a;b=PATH=1", "KDTREE_ or NUMBA_"), ("a;b=KDTREE_X", "KDTREE_ or")):
        with pytest.raises(SystemExit, match=says):
            ab_switches.parse_variants(bad)


def test_every_prompt_runs_every_variant_in_turn_and_the_environment_comes_back(
        tiny, monkeypatch):
    """Timed calls: prompts x repeats x variants, the first variant of each prompt's turn
    rotated; rates = tokens / summed clock; the same tokens under a switch no op reads."""
    model, drafter = tiny
    monkeypatch.setenv("KDTREE_AB_PROBE", "outer")
    seen, ticks = [], iter(range(10_000))
    real = ab_switches.generate

    def spy(model, prompts, tokens, **kw):
        seen.append(os.environ.get("KDTREE_AB_PROBE"))
        return real(model, prompts, tokens, **kw)
    monkeypatch.setattr(ab_switches, "generate", spy)
    variants = [("a", {}), ("b", {"KDTREE_AB_PROBE": "b"})]
    rows = ab_switches.run_ab(model, drafter, [[1, 2, 3], [4, 5]], variants, [0, 3], 4, 2,
                              clock=lambda: float(next(ticks)))
    assert os.environ["KDTREE_AB_PROBE"] == "outer"
    # per budget: the untimed passes (a's two over both prompts, then b's), then 2 repeats x
    # 2 prompts, turns rotated
    timed = ["outer", "b", "b", "outer", "b", "outer", "outer", "b"]
    assert seen == (["outer"] * 4 + ["b"] * 4 + timed) * 2
    assert [(r["budget"], r["variant"]) for r in rows] == [("ar", "a"), ("ar", "b"),
                                                           (3, "a"), (3, "b")]
    for r in rows:
        assert r["tokens"] == 4 * 4 and r["seconds"] == 4.0 and r["same_tokens"]
        assert r["tok_s"] == pytest.approx(4.0) and r["vs_first"] == pytest.approx(1.0)
        assert r["timed_captures"] == 0            # the reference backend keeps no graphs
        assert r["dropped_per_prompt"] == 0        # host rounds: none runs ahead
    assert rows[0]["rounds_per_prompt"] == 3       # AR: a step a token after the prefill's
    assert rows[2]["rounds_per_prompt"] == rows[3]["rounds_per_prompt"] <= 3
    assert [r["vs_first_passes"] for r in rows] == [[1.0, 1.0]] * 4
    assert [r["faster_prompts"] for r in rows] == [None, 0, None, 0]


def test_the_spread_is_each_passs_rate_and_the_prompts_a_variant_won(tiny, monkeypatch):
    """A made-up clock each call advances by its (variant, prompt, pass)'s seconds: variant b
    is faster on both prompts summed, though slower than on the first in pass 0."""
    model, drafter = tiny
    now, calls = [0.0], []
    seconds = {("a", 0): 2.0, ("a", 1): 2.0, ("b", 0): 1.0, ("b", 1): 2.5}
    real = ab_switches.generate

    def timed(model, prompts, tokens, **kw):
        variant = os.environ.get("KDTREE_AB_PROBE", "a")
        prompt = 0 if list(prompts[0]) == [1, 2, 3] else 1
        calls.append(variant)
        # past the warm-ups (each pass over both prompts) and pass 0
        passed = sum(1 for v in calls if v == variant) > ab_switches.WARM_PASSES * 2 + 2
        now[0] += 1.0 if (variant, prompt) == ("b", 1) and passed else seconds[variant, prompt]
        return real(model, prompts, tokens, **kw)
    monkeypatch.setattr(ab_switches, "generate", timed)
    rows = ab_switches.run_ab(model, drafter, [[1, 2, 3], [4, 5]],
                              [("a", {}), ("b", {"KDTREE_AB_PROBE": "b"})], [0], 4, 2,
                              clock=lambda: now[0])
    a, b = rows
    assert a["vs_first_passes"] == [1.0, 1.0] and a["faster_prompts"] is None
    # pass 0: a 8 tokens in 4 s, b in 3.5 s; pass 1: b in 2 s; summed: b 16 in 5.5 s, a in 8
    assert b["vs_first_passes"] == pytest.approx([4 / 3.5, 2.0])
    assert b["vs_first"] == pytest.approx(8 / 5.5)
    assert b["faster_prompts"] == 2               # 2 s against 4, 3.5 against 4


def test_a_variant_that_changes_a_token_is_reported(tiny, monkeypatch):
    model, drafter = tiny
    real = ab_switches.generate

    def flip(model, prompts, tokens, **kw):
        res = real(model, prompts, tokens, **kw)
        if os.environ.get("KDTREE_AB_PROBE") == "b":
            res.tokens[0][-1] = (res.tokens[0][-1] + 1) % model.vocab_size
        return res
    monkeypatch.setattr(ab_switches, "generate", flip)
    rows = ab_switches.run_ab(model, drafter, [[1, 2, 3]], [("a", {}), ("b", {
        "KDTREE_AB_PROBE": "b"})], [0], 3, 1)
    assert [r["same_tokens"] for r in rows] == [True, False]

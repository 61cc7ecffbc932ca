"""tools/tree_roofs.py: the distinct experts of uniform routing against a simulation, and the
break-even tau's shape (the verify's bytes over a decode's grow with the budget; the 4-layer
slice, whose bf16 lm_head every forward reads, is kinder than the 61-layer model)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import tree_roofs  # noqa: E402
from engine_roof import engine_itemsize, expected_distinct  # noqa: E402


@pytest.mark.parametrize("rows", [1, 9, 33])
def test_uniform_distinct_experts_match_a_simulation(rows):
    rng = np.random.default_rng(rows)
    draws = [len({int(e) for _ in range(rows) for e in rng.choice(384, 8, replace=False)})
             for _ in range(400)]
    assert expected_distinct(384, 8, rows) == pytest.approx(np.mean(draws), rel=0.02)


def test_break_even_grows_with_the_budget_and_the_slice_is_kinder():
    budgets = [1, 2, 4, 8, 16, 32, 64]
    int4 = engine_itemsize(2, tree_roofs.INT4_GROUP32_BYTES)
    full = tree_roofs.breakeven_rows(tree_roofs.SIZES["kimi-k2"](), budgets, int4)
    part = tree_roofs.breakeven_rows(tree_roofs.SIZES["kimi-k2-slice"](), budgets, int4)
    ratios = [r["breakeven_tau"] for r in full]
    assert all(1 < a < b for a, b in zip(ratios, ratios[1:]))
    assert all(p["breakeven_tau"] < f["breakeven_tau"] for p, f in zip(part, full))
    assert full[0]["experts"] == pytest.approx(expected_distinct(384, 8, 2))
    # Kimi-K2 as it ships reads ~34 GB a decode (32 B active parameters, int4 experts)
    assert 30 < full[0]["decode_gb"] < 40
    # the docs' claim: at uniform routing a 33-node verify needs tau ~9 to break even
    assert 8 < full[5]["breakeven_tau"] < 10


def test_the_tool_prints_the_bound_and_refuses_bad_tau(capsys):
    assert tree_roofs.main(["--size", "kimi-k2", "--budgets", "8,32", "--tau", "8:4.6"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 9 |" in out and "x |" in out and "| 32 | 33 |" in out
    with pytest.raises(SystemExit, match="BUDGET:TAU"):
        tree_roofs.main(["--tau", "eight:4"])

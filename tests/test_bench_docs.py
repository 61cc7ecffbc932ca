"""docs/BENCHMARKS.md's tables are the rendering of docs/results/*.json (tools/bench_docs.py),
and a malformed result file is refused with a one-line error naming the file and the key."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import bench_docs  # noqa: E402


def test_committed_benchmarks_page_is_the_rendering_of_the_result_files():
    text = bench_docs.BENCHMARKS.read_text()
    assert bench_docs.rewrite(text, bench_docs.load_all()) == text, \
        "docs/BENCHMARKS.md is stale: run python3 tools/bench_docs.py"
    assert bench_docs.main(["--check"]) == 0


def test_every_component_has_a_table_with_the_documented_columns():
    text = bench_docs.BENCHMARKS.read_text()
    components = bench_docs.load_all()
    assert len(components) == len(list(bench_docs.RESULTS.glob("*.json"))) >= 10
    header = "| " + " | ".join(bench_docs.COLUMNS) + " |"
    for c in components:
        block = text[text.index(f"## {c['title']}\n"):]
        assert block.split("\n\n", 3)[2].startswith(header), c["title"]
        for row in c["rows"]:      # each row's result and its measurement's command are shown
            m = c["measurements"][row["measurement"]]
            # (a table cell escapes "|", a command's regular expression too)
            assert f"`{m['command']}`".replace("|", "\\|") in block
            assert row["result"].replace("|", "\\|") in block


def _copy(tmp_path: Path) -> tuple[Path, Path]:
    results = tmp_path / "results"
    shutil.copytree(bench_docs.RESULTS, results)
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text(bench_docs.BENCHMARKS.read_text())
    return results, docs


def test_adding_a_result_is_one_file_and_the_generator(tmp_path, capsys):
    results, docs = _copy(tmp_path)
    args = ["--results", str(results), "--docs", str(docs)]
    path = results / "ddtree.json"
    data = json.loads(path.read_text())
    data["measurements"]["new"] = dict(command="python3 tools/bench_ddtree.py", card="H100",
                                       commit="abc1234", date="2026-12-06", roof="3.3 TB/s")
    data["rows"][0] = dict(data["rows"][0], measurement="new", result="200.0 us = 70%: met")
    path.write_text(json.dumps(data))
    assert bench_docs.main(["--check"] + args) == 1          # stale until rendered
    assert "not the rendering" in capsys.readouterr().err
    assert bench_docs.main(args) == 0
    assert bench_docs.main(["--check"] + args) == 0
    row = next(line for line in docs.read_text().splitlines() if "200.0 us = 70%" in line)
    assert "| H100 | abc1234 | 2026-12-06 |" in row and "(3.3 TB/s)" in row
    assert docs.read_text().count("\n## ") == bench_docs.BENCHMARKS.read_text().count("\n## ")


@pytest.mark.parametrize("change, message", [
    (lambda d: d["rows"][0].pop("goal"), "rows[0].goal: must be a non-empty one-line string"),
    (lambda d: d["rows"][0].update(measurement="nope"), "rows[0] names measurement 'nope'"),
    (lambda d: next(iter(d["measurements"].values())).update(date="5 Dec"),
     "date must be YYYY-MM-DD"),
    (lambda d: d.update(order="1"), "order must be an integer"),
    (lambda d: d.update(rows=[]), "rows must be a non-empty list"),
])
def test_a_malformed_result_file_is_a_one_line_error(tmp_path, capsys, change, message):
    results, docs = _copy(tmp_path)
    path = results / "moe.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(bench_docs.ResultsError) as info:
        bench_docs.load_all(results)
    assert str(info.value).startswith("moe.json: ") and message in str(info.value)
    before = docs.read_text()
    assert bench_docs.main(["--results", str(results), "--docs", str(docs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert docs.read_text() == before                        # nothing written


def test_a_page_without_its_markers_is_refused(tmp_path):
    results, docs = _copy(tmp_path)
    docs.write_text("# Benchmarks\n")
    assert bench_docs.main(["--results", str(results), "--docs", str(docs)]) == 2
    assert docs.read_text() == "# Benchmarks\n"

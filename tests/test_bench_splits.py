"""dev/bench_splits.py's host side: which slice counts it times and its table rows (the
timing needs a GPU: run on the H200, docs/GPU_RESULTS.md)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))

import bench_splits  # noqa: E402


def test_candidates_keep_a_unit_a_slice_and_the_pick():
    assert bench_splits.candidates(1536, 2) == [1, 2, 4, 8, 16]         # q_b: 24 units
    assert bench_splits.candidates(7168, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert bench_splits.candidates(100, 1) == [1, 2]                    # 2 units
    assert bench_splits.candidates(1536, 3) == [1, 2, 3, 4, 8, 16]      # a pick off the grid


def test_row_marks_the_pick_and_the_fastest_beside_the_roof():
    times = {1: 16.5, 2: 20.6, 4: 23.1}
    row = bench_splits.table_row("q_b", 12288, 1536, 33, times, pick=2)
    roof = 12288 * 1536 * 2 / bench_splits.HBM_BYTES_PER_S * 1e6
    assert row == (f"| q_b 1536 -> 12288 | 33 | **16.5** | 20.6* | 23.1 |  |  |  |  | 2 | 1 "
                   f"| 1.25x | {roof:.1f} |")
    header = bench_splits.table_header().splitlines()
    assert header[0].count("|") == row.count("|") == header[1].count("|")


def test_unknown_shapes_are_refused(capsys):
    import pytest
    with pytest.raises(SystemExit):
        bench_splits.main(["--shapes", "q_b,nope"])
    assert "unknown shape(s) nope" in capsys.readouterr().err

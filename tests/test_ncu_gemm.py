"""tools/ncu_gemm.py's host side: the shapes it runs under Nsight Compute, and a clear error
for a malformed one."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ncu_gemm  # noqa: E402


def test_shapes_parse_as_m_k_n():
    assert ncu_gemm.parse_shapes("512x7168x36864, 65X2048x7168") == [(512, 7168, 36864),
                                                                    (65, 2048, 7168)]
    assert len(ncu_gemm.parse_shapes(ncu_gemm.DEFAULT_SHAPES)) == 3


@pytest.mark.parametrize("bad", ["5x3", "0x8x8", "axbxc", "8x8x8x8", "-1x8x8", ""])
def test_a_malformed_shape_is_a_one_line_error(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ncu_gemm.main([f"--shapes={bad}"])
    assert exit_info.value.code == 2
    assert "a shape is MxKxN" in capsys.readouterr().err

"""tools/round_kernels.py's bookkeeping on made-up CUPTI records (the tool itself needs a GPU):
kernel names shortened, kernels assigned to the replay between their markers, per-replay sums."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import round_kernels as rk  # noqa: E402


def test_numba_names_shorten_to_module_and_function():
    mangled = ("_ZN12kdtree_numba6layers4norm12rmsnorm_rowsB2v1B94cw51cXTLSUwv1sDUaKthqqNFVIE"
               "E5ArrayIfLi2E1C7mutable7alignedE")
    assert rk.short_name(mangled) == "norm.rmsnorm_rows"
    assert rk.short_name("_ZN6cudapy5numba4cuda3foo7kernel_E") == "foo.kernel_"
    assert rk.short_name("cupy_copy__float32_float32") == "cupy_copy__float32_float32"
    assert rk.short_name("void gemm_kernel(float*, int)") == "void gemm_kernel"
    # CUPTI's records hold the demangled name (run 153)
    assert rk.short_name("kdtree_numba::layers::norm::_rmsnorm_kernel::_3clocals_3e::"
                         "rmsnorm_rows[abi:v4][abi:cw51cXTLSUwv1sD_3d_3d]") == "norm.rmsnorm_rows"


def test_launch_shapes_tell_one_kernels_launches_apart():
    assert rk.launch_shape({"grid": [8, 1, 1], "block": [128, 1, 1]}) == " <<<8x1x1, 128x1x1>>>"
    assert rk.launch_shape({}) == ""


def test_kernels_between_markers_belong_to_that_replay():
    records = [(0.0, 1.0, "stray", ""), (1.0, 0.1, rk.BEGIN, ""), (2.0, 3.0, "_ZN1a3aaaE", ""),
               (6.0, 2.0, "_ZN1a3bbbE", ""), (9.0, 0.1, rk.END, ""), (10.0, 0.5, "argmax", ""),
               (11.0, 0.1, rk.BEGIN, ""), (12.0, 4.0, "_ZN1a3aaaE", ""), (17.0, 0.1, rk.END, "")]
    per_label, outside, idle = rk.segment(records, ["round b=8", "round b=8"])
    assert [n for _, _, n in outside] == ["stray", "argmax"]
    # idle before each replay: from the last kernel's end (the markers not counted)
    assert idle["round b=8"] == [pytest.approx(2.0 - 1.0), pytest.approx(12.0 - 10.5)]
    s = rk.summarise(per_label["round b=8"], idle["round b=8"])
    assert s["idle_before_us"] == pytest.approx(1.25)
    assert s["idle_share"] == pytest.approx(1.25 / (1.25 + s["span_us"]))
    assert s["replays"] == 2 and s["kernels"] == 1.5
    assert s["busy_us"] == pytest.approx((5.0 + 4.0) / 2)
    assert s["span_us"] == pytest.approx((8.0 - 2.0 + 4.0) / 2)   # first start to last end
    top = s["by_kernel"][0]
    assert top["name"] == "a.aaa" and top["per_replay"] == 1.0 and top["mean_us"] == 3.5


def test_a_generations_boundary_is_no_idle_time_of_a_round():
    """A gap past BOUNDARY_US before a replay (the next prompt's prefill and setup) is left
    out; the first replay of the trace has no kernel before it."""
    gap = rk.BOUNDARY_US + 1.0
    records = [(0.0, 0.1, rk.BEGIN, ""), (1.0, 1.0, "_ZN1a3aaaE", ""), (2.5, 0.1, rk.END, ""),
               (2.0 + gap, 0.1, rk.BEGIN, ""), (3.0 + gap, 1.0, "_ZN1a3aaaE", ""),
               (4.5 + gap, 0.1, rk.END, "")]
    per_label, _, idle = rk.segment(records, ["forward bs=1 n=1"] * 2)
    assert len(per_label["forward bs=1 n=1"]) == 2 and idle["forward bs=1 n=1"] == []
    assert rk.summarise(per_label["forward bs=1 n=1"], [])["idle_share"] is None


def test_labels_name_the_kind_of_replay():
    assert rk.label(("round", 8, 8, None)) == "round b=8"
    assert rk.label(("forward", 1, 9, False)) == "forward bs=1 n=9"
    assert rk.label(("dflash_context", 1)) == "dflash_context"


def test_a_kernel_made_by_a_factory_shortens_to_its_module_and_name():
    """Every kernel here is made inside a factory (``@kernel_factory``), so numba mangles its
    qualified name ``module.<factory>.<locals>.<kernel>`` (``<locals>`` escaped): the name
    is still ``module.function``, as numba's own mangler writes it."""
    from numba.core import itanium_mangler, types
    mangled = itanium_mangler.mangle(
        "kdtree_numba.layers.latents._latents_kernel.<locals>.latents_rows",
        [types.float32[:, ::1]], uid=7)
    assert "_3clocals_3e" in mangled
    assert rk.short_name(mangled) == "latents.latents_rows"
    nested = itanium_mangler.mangle("kdtree_numba.gpu.reduce.make_block_reduce.<locals>."
                                    "outer.<locals>.block_reduce", [], uid=1)
    assert rk.short_name(nested) == "reduce.block_reduce"


def test_a_generations_wall_time_splits_into_its_phases():
    """A made-up prompt: the host starts at 0, the prefill replays at 10..30, two eager
    kernels (the first choice, the drafter's commit) till 36, the rounds at 40..50 and
    52..60 (2 us idle between them), the host returns at 65; kernels outside the host's
    call belong to no generation."""
    labels = ["prefill bs=1 n=128", "round b=16", "round b=16"]
    records = [(-5.0, 1.0, "earlier", ""),
               (9.0, 0.1, rk.BEGIN, ""), (10.0, 20.0, "_ZN1a3preE", ""), (30.0, 0.1, rk.END, ""),
               (31.0, 2.0, "argmax", ""), (34.0, 2.0, "_ZN1a3ctxE", ""),
               (39.0, 0.1, rk.BEGIN, ""), (40.0, 10.0, "_ZN1a3rndE", ""), (50.0, 0.1, rk.END, ""),
               (51.0, 0.1, rk.BEGIN, ""), (52.0, 8.0, "_ZN1a3rndE", ""), (60.0, 0.1, rk.END, "")]
    tagged = rk.tag_replays(*rk.segment(records, labels)[:2])
    assert [w for _, _, w in tagged] == ["eager", "prefill bs=1 n=128", "eager", "eager",
                                         "round b=16", "round b=16"]
    (g,) = rk.generation_phases(tagged, [(0.0, 65.0)])
    assert g == dict(wall=65.0, start=10.0, prefill=20.0, prefill_busy=20.0, to_rounds=10.0,
                     to_rounds_busy=4.0, rounds=20.0, rounds_busy=18.0, end=5.0)
    # the phases add up to the wall time
    assert g["start"] + g["prefill"] + g["to_rounds"] + g["rounds"] + g["end"] == g["wall"]

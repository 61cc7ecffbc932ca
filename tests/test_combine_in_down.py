"""``KDTREE_COMBINE_IN_DOWN``: the MoE's combine in the tail of the routed experts' down launch
(kdtree_numba/layers/moe_combine.py; moe._combining_rows): the last block to write a tile of
output columns, counted in the tile's arrival counter, sums that tile's outputs in the combine
kernel's order.  The same bits as the combine's launch of its own, no such launch, and the
counters back at 0 after each call (the next call, or a CUDA graph's next replay, counts
from there).  Tiny shapes: each simulated thread costs ~120 us.  On the GPU: the demo pair's
tokens here, Kimi widths (int4, the real launch's blocks and tiles) in
tests/test_w4a16_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

import reference.layers as ref
from test_layers import moe_case
from w4a16_cases import BF16, int4_case


@pytest.fixture
def moe_layers(needs_kernels):
    from kdtree_numba.layers import moe
    return moe


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _run(moe_layers, monkeypatch, args, switch, **kw):
    """moe_ffn with the switch at ``switch``: (output, the combine's own launches run)."""
    real, calls = moe_layers._combine, []

    def counted(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(moe_layers, "_combine", counted)
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", switch)
    out = host(moe_layers.moe_ffn(*args, **kw))
    monkeypatch.undo()
    return out, len(calls)


def _counters_zero():
    from kdtree_numba.gpu import counters
    kept = counters.made("moe.combine")
    return kept and not any(host(a).any() for a in kept)


# all off CI's default run since the switch was timed slower and stays off (runs 200-201; ~15 s
# a case under the simulator): the shared expert at 6 rows (two x-row chunks, a ragged
# tile), the routed-only case, both at a decode's row too
@pytest.mark.parametrize("shared", [pytest.param(True, marks=pytest.mark.slow),
                                    pytest.param(False, marks=pytest.mark.slow),
                                    pytest.param("slow", marks=pytest.mark.slow)],
                         ids=["shared", "routed_only", "shared_and_decode"])
def test_the_combine_in_down_keeps_the_bits(moe_layers, monkeypatch, shared):
    """bf16 experts, with and without a shared expert, at a decode's row and at several x-row
    chunks with ragged D (combine tiles that end past D): the switch's bits, no combine
    launch, the counters back at 0, and a second call with another routing on the same
    workspace (its counters) right too."""
    from kdtree_numba.layers import Workspace
    rng = np.random.default_rng(11)
    shapes = ((6, 40, 9), (1, 32, 12)) if shared == "slow" else ((6, 40, 9),)
    for m, d, inter in shapes:
        args = moe_case(rng, m, d, 4, inter, 2, BF16, bool(shared))
        off, launches_off = _run(moe_layers, monkeypatch, args, "0", method="skinny")
        ws = Workspace()
        on, launches_on = _run(moe_layers, monkeypatch, args, "1", method="skinny",
                               workspace=ws)
        assert launches_off == 1 and launches_on == 0
        assert on.tobytes() == off.tobytes(), (m, d, inter)
        np.testing.assert_allclose(on, ref.moe_ffn(*args), rtol=1e-4, atol=1e-4)
        assert _counters_zero()
        again = (args[0], np.ascontiguousarray(args[1][::-1]), *args[2:])
        second, _ = _run(moe_layers, monkeypatch, again, "1", method="skinny", workspace=ws)
        want, _ = _run(moe_layers, monkeypatch, again, "0", method="skinny")
        assert second.tobytes() == want.tobytes()


@pytest.mark.slow
def test_no_valid_expert_still_writes_the_output(moe_layers, monkeypatch):
    """Every routing index out of range (no active expert): the output is the shared expert's
    (or zeros), as the combine's launch gives, since slot 0's blocks still arrive."""
    rng = np.random.default_rng(3)
    for shared in (True, False):
        h, idx, w, gu, dn, sgu, sdn = moe_case(rng, 2, 16, 3, 8, 2, np.float32, shared)
        args = (h, np.full_like(idx, -1), w, gu, dn, sgu, sdn)
        off, _ = _run(moe_layers, monkeypatch, args, "0", method="skinny")
        on, launches = _run(moe_layers, monkeypatch, args, "1", method="skinny")
        assert launches == 0 and on.tobytes() == off.tobytes()
        assert np.abs(on).max() > 0 if shared else not on.any()


@pytest.mark.slow
def test_int4_experts_in_spans_keep_the_bits(moe_layers, monkeypatch):
    """int4 routed experts with a bf16 shared expert, the default shapes and two N tiles a
    block (``span``: a block arrives at each tile it wrote): the switch's bits."""
    import dataclasses

    from kdtree_numba.layers.moe_shapes import expert_config
    from kdtree_numba.layers.workspace import int4_experts
    rng = np.random.default_rng(29)
    m, d, n_experts, inter, top_k = 3, 64, 5, 16, 2
    h, idx, wt, gu, dn, sgu, sdn = int4_case(rng, m, d, n_experts, inter, top_k, 16)
    args = (h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn)
    spans = tuple(dataclasses.replace(expert_config(m, top_k, n_experts, k, up, True), span=2)
                  for k, up in ((d, True), (inter, False)))
    for configs in (None, spans):
        off, _ = _run(moe_layers, monkeypatch, args, "0", configs=configs)
        on, launches = _run(moe_layers, monkeypatch, args, "1", configs=configs)
        assert launches == 0 and on.tobytes() == off.tobytes()


@pytest.mark.slow      # a bench variant; test_w4a16_gpu checks it at Kimi widths on the GPU
def test_shared_blocks_first_keep_the_bits(moe_layers, monkeypatch):
    """``SkinnyConfig.shared_first`` (the shared expert's blocks first in the grid, a bench
    variant) moves no bit, with the combine in the down launch and without."""
    import dataclasses

    from kdtree_numba.layers.moe_shapes import expert_config
    from kdtree_numba.layers.workspace import int4_experts
    rng = np.random.default_rng(31)
    m, d, n_experts, inter, top_k = 2, 32, 4, 16, 2
    h, idx, wt, gu, dn, sgu, sdn = int4_case(rng, m, d, n_experts, inter, top_k, 16)
    args = (h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn)
    first = tuple(dataclasses.replace(expert_config(m, top_k, n_experts, k, up, True),
                                      shared_first=True)
                  for k, up in ((d, True), (inter, False)))
    want, _ = _run(moe_layers, monkeypatch, args, "0")
    for switch in ("0", "1"):
        got, _ = _run(moe_layers, monkeypatch, args, switch, configs=first)
        assert got.tobytes() == want.tobytes(), switch


def test_tiled_experts_keep_their_combine(moe_layers, monkeypatch):
    """Where the routed experts are tiled (no down launch of the streaming kernel to fold
    into), the switch changes nothing: the combine's own launch, the same bits."""
    rng = np.random.default_rng(9)
    args = moe_case(rng, 3, 16, 3, 8, 2, np.float32)
    off, _ = _run(moe_layers, monkeypatch, args, "0", method="tiled")
    on, launches = _run(moe_layers, monkeypatch, args, "1", method="tiled")
    assert launches == 1 and on.tobytes() == off.tobytes()


def test_combine_tiles_cover_both_blocks():
    from kdtree_numba.layers.moe_combine import combine_tiles, combine_width
    for routed, shared in ((8, 2), (2, 16), (4, 4), (16, 1)):
        width = combine_width(routed, shared)
        assert width % routed == 0 and width % shared == 0
        for d in (1, 7, 64, 7168, 7170):
            assert (combine_tiles(d, width) - 1) * width < d <= combine_tiles(d, width) * width


@pytest.mark.gpu
def test_gpu_the_demo_pair_with_the_switch_gives_the_defaults_tokens(monkeypatch):
    """On the GPU: the demo pair's AR and DDTree (budget 16, T = 0 and 1) tokens are the
    same with the switch off and on."""
    from test_demo_pair import assert_switch_keeps_tokens
    assert_switch_keeps_tokens(monkeypatch, "KDTREE_COMBINE_IN_DOWN")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17])
def test_gpu_graph_replays_give_the_eager_bits(m, monkeypatch):
    """Three MoE layers of the demo target's widths (a small router, 8 bf16 experts and a
    shared one) through moe_route and moe_ffn as the model runs them, with
    ``KDTREE_COMBINE_IN_DOWN`` and ``KDTREE_FUSED_ROUTER`` on, captured in a CUDA graph
    (graphs.py) and replayed: the eager bits with both off.  The arrival counters are made
    afresh inside this key's calls (gpu/counters.py): run 196's A/B lost AR's tokens under
    graphs where the eager tests passed (a host upload recorded in a capture)."""
    import cupy

    from kdtree_numba.backends import make_backend
    from kdtree_numba.gpu import counters
    from kdtree_numba.graphs import GraphCache
    be = make_backend("numba")
    rng = np.random.default_rng(m)
    d, e, inter, top_k = 256, 8, 128, 2
    h = rng.standard_normal((m, d)).astype(np.float32)
    layers = []
    for _ in range(3):
        *_, gu, dn, sgu, sdn = moe_case(rng, 1, d, e, inter, top_k, BF16)
        gate = (rng.standard_normal((e, d)) * 0.1).astype(np.float32)
        bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
        layers.append(tuple(cupy.asarray(a.view(np.uint16) if a.dtype == BF16 else a)
                            for a in (gate, bias, gu, dn, sgu, sdn)))

    def forward(x):
        for gate, bias, gu, dn, sgu, sdn in layers:
            idx, w = be.ops.moe_route(x, gate, bias, top_k=top_k)
            x = x + cupy.asarray(be.ops.moe_ffn(x, idx, w, gu, dn, sgu, sdn))
        return x

    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "0")
    monkeypatch.setenv("KDTREE_FUSED_ROUTER", "0")
    eager = cupy.asnumpy(forward(cupy.asarray(h)))
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "1")
    monkeypatch.setenv("KDTREE_FUSED_ROUTER", "1")
    monkeypatch.setattr(counters, "_KEPT", {})
    graphs = GraphCache(be)
    runs = [graphs.call(("moe", m), forward, [h], [((m, d), np.float32)]) for _ in range(4)]
    assert runs[0] is None and graphs.captures == 1 and graphs.failures == 0
    for i, out in enumerate(runs[1:]):
        assert cupy.asnumpy(out).tobytes() == eager.tobytes(), i

"""``KDTREE_FUSED_ROUTER``: a small router's logits and its routing in one launch
(kdtree_numba/layers/moe_route.py, ``_router_route_kernel``): each token's block computes its
E logits with the skinny linear's block, then routes as route_rows does.  Where linear() would
stream the weight the logits are its bits, so the routing is the two launches' to the bit; a
large router, the tiled or tensor-core kernels and a softmax at other threads keep the two.
Together with ``KDTREE_COMBINE_IN_DOWN`` (tests/test_combine_in_down.py) a model's MoE layer
runs two launches fewer.  On the GPU: the demo pair's tokens with both switches."""
from __future__ import annotations

import numpy as np
import pytest

import launch_counter
from w4a16_cases import BF16


@pytest.fixture
def route_layers(needs_kernels):
    import importlib
    return importlib.import_module("kdtree_numba.layers.moe_route")   # (the module)


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _route(route_layers, monkeypatch, switch, h, gate, bias, **kw):
    """(idx, weight, logits, launches) of moe_route with the switch at ``switch``."""
    from kdtree_numba.layers import Workspace
    monkeypatch.setenv("KDTREE_FUSED_ROUTER", switch)
    ws = Workspace()
    with launch_counter.installed() as counter, counter.window() as got:
        idx, w = route_layers.moe_route(h, gate, bias, workspace=ws, **kw)
    logits = next(buf for key, buf in ws._buffers.items() if key[0] == "route.logits")
    return host(idx), host(w), host(logits), sum(got.values())


CASES = [  # (M, E, D, weights, routing)
    (1, 8, 256, np.float32, dict(top_k=2)),                                   # the demo's
    (5, 8, 40, BF16, dict(top_k=2, routed_scaling_factor=2.5)),              # K % 8 != 0
    (3, 16, 64, np.float32, dict(top_k=4, n_group=4, topk_group=2, scoring="softmax",
                                 norm_topk_prob=False)),
]


@pytest.mark.parametrize("case", CASES, ids=["demo", "bf16-ragged", "softmax-groups"])
def test_one_launch_gives_the_two_launches_bits(route_layers, monkeypatch, case):
    """The fused launch's logits, indices and weights are the linear-then-route_rows bits,
    in one launch where they took two."""
    m, e, d, dtype, routing = case
    rng = np.random.default_rng(m * e)
    h = rng.standard_normal((m, d)).astype(np.float32)
    gate = (rng.standard_normal((e, d)) * 0.3).astype(dtype)
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32)
    *two, launches_two = _route(route_layers, monkeypatch, "0", h, gate, bias, **routing)
    *one, launches_one = _route(route_layers, monkeypatch, "1", h, gate, bias, **routing)
    assert (launches_two, launches_one) == (2, 1)
    for a, b in zip(two, one):
        assert a.tobytes() == b.tobytes()


def test_where_linear_would_not_stream_the_two_launches_stay(route_layers, monkeypatch):
    """A router past FUSED_ROUTER_ELEMENTS (lowered here to 8 x 16 - 1), or "tiled": two
    launches, the same results."""
    monkeypatch.setattr(route_layers, "FUSED_ROUTER_ELEMENTS", 8 * 16 - 1)
    rng = np.random.default_rng(1)
    h = rng.standard_normal((2, 16)).astype(np.float32)
    for method in ("auto", "tiled"):
        gate = (rng.standard_normal((8, 16)) * 0.3).astype(np.float32)
        *two, _ = _route(route_layers, monkeypatch, "0", h, gate, None, top_k=2, method=method)
        *one, launches = _route(route_layers, monkeypatch, "1", h, gate, None, top_k=2,
                                method=method)
        assert launches == 2
        for a, b in zip(two, one):
            assert a.tobytes() == b.tobytes()


def test_a_softmax_at_other_threads_keeps_the_two_launches(route_layers, monkeypatch):
    """A softmax's sums run over the block's threads: where the skinny block's threads are not
    route_rows', the fused config declines (on a GPU a 7,168-wide router takes 128 threads
    where route_rows takes 32 for 8 experts)."""
    monkeypatch.setattr(route_layers, "_route_threads", lambda n: 64)
    h = np.ones((1, 16), np.float32)
    gate = np.ones((8, 16), np.float32)
    assert route_layers._fused_router_config(h, gate, "auto", "softmax", 0) is None
    assert route_layers._fused_router_config(h, gate, "auto", "sigmoid", 0) is not None


@pytest.mark.slow
def test_a_model_runs_two_launches_fewer_a_moe_layer_with_the_same_bits(monkeypatch,
                                                                         needs_kernels):
    """The small target's round and AR step with the fused router and the combine in the down
    launch: the same tokens, logits and caches, and two launches fewer a MoE layer a
    forward (the round: the target's verify; its drafter has no MoE)."""
    with launch_counter.installed():
        monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", "0")
        base = launch_counter.rounds_and_bits()
        monkeypatch.setenv("KDTREE_FUSED_ROUTER", "1")
        monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "1")
        fused = launch_counter.rounds_and_bits()
    launch_counter.same_results(base, fused)
    moe_layers = 1          # SMALL_TARGET: 2 layers, the first dense
    assert sum(base[1].values()) - sum(fused[1].values()) == 2 * moe_layers
    assert sum(base[0].values()) - sum(fused[0].values()) == 2 * moe_layers


@pytest.mark.gpu
def test_gpu_the_demo_pair_with_the_switch_gives_the_defaults_tokens(monkeypatch):
    """On the GPU: the demo pair's AR and DDTree (budget 16, T = 0 and 1) tokens are the
    same with the switch off and on."""
    from test_demo_pair import assert_switch_keeps_tokens
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "1")
    assert_switch_keeps_tokens(monkeypatch, "KDTREE_FUSED_ROUTER")

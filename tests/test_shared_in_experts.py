"""``KDTREE_SHARED_IN_EXPERTS``: the MoE's shared expert run by the routed experts' two
launches (kdtree_numba/layers/moe.py; where: moe_shapes.shared_in_experts; its blocks after
the routed ones, each the skinny linear's block, skinny.make_skinny_block), where the routed
experts and both of the shared expert's linears stream their weights.

With bf16 or float32 routed experts the launch runs at the threads linear() picks: the same
bits as the switch off.  With int4 routed experts at the int4 kernels' threads (fewer on a
GPU): the float64 reference's bound (tests/w4a16_cases.py), and a row alone its batch bits.
On the GPU: the demo pair's tokens here, Kimi widths (int4) in tests/test_w4a16_gpu.py.  Tiny
shapes: each simulated thread costs ~120 us."""
from __future__ import annotations

import numpy as np
import pytest

import reference.layers as ref
from test_layers import moe_case
from w4a16_cases import BF16, int4_case, moe_bound


@pytest.fixture
def moe_layers(needs_kernels):
    from kdtree_numba.layers import moe
    return moe


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


class _Calls:
    """Stands in for moe._swiglu_linears (the shared expert's own launches): counts, runs it."""

    def __init__(self, real):
        self.real, self.n = real, 0

    def __call__(self, *args, **kw):
        self.n += 1
        return self.real(*args, **kw)


def _run(moe_layers, monkeypatch, args, switch, **kw):
    """moe_ffn with the switch at ``switch``; (output, the shared expert's own launches ran)."""
    calls = _Calls(moe_layers._swiglu_linears)
    monkeypatch.setattr(moe_layers, "_swiglu_linears", calls)
    monkeypatch.setenv("KDTREE_SHARED_IN_EXPERTS", switch)
    out = host(moe_layers.moe_ffn(*args, **kw))
    monkeypatch.undo()
    return out, calls.n > 0


# the float32 case (~2 s under the simulator) only off CI's default run
@pytest.mark.parametrize("dtype", [pytest.param(np.float32, marks=pytest.mark.slow), BF16],
                         ids=["f32", "bf16"])
def test_float_experts_keep_their_bits_in_two_launches(moe_layers, monkeypatch, dtype):
    """bf16 and float32 routed experts with a shared expert: the switch on gives the switch
    off's bits (the same threads, so the same sums) without the shared expert's launches, at
    a decode's rows and across several x-row chunks (mt 4 under the simulator), outputs that
    fill a block's rows or leave them ragged, K a multiple of the 16-byte chunk or not."""
    rng = np.random.default_rng(5)
    for m, d, inter in ((1, 32, 12), (6, 40, 9)):
        args = moe_case(rng, m, d, 4, inter, 2, dtype)
        off, own_off = _run(moe_layers, monkeypatch, args, "0", method="skinny")
        on, own_on = _run(moe_layers, monkeypatch, args, "1", method="skinny")
        assert own_off and not own_on
        assert on.tobytes() == off.tobytes(), (m, d, inter)
        np.testing.assert_allclose(on, ref.moe_ffn(*args), rtol=1e-4, atol=1e-4)


def test_int4_experts_within_the_bound_and_batch_invariant(moe_layers, monkeypatch):
    """int4 routed experts (group 16) and a bf16 shared expert under "auto" at rows that
    stream (<= SKINNY_MAX_M): the switch on runs no launch of the shared expert's own, stays
    within the float64 reference's bound, and a row alone gives its batch bits (the shared
    expert's sums from the int4 kernels' threads, K alone, at every M)."""
    from kdtree_numba.layers import SKINNY_MAX_M
    from kdtree_numba.layers.workspace import int4_experts
    rng = np.random.default_rng(47)
    m = 6
    h, idx, wt, gu, dn, sgu, sdn = int4_case(rng, m, 64, 5, 16, 2, 16)
    args = (h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn)
    got, own = _run(moe_layers, monkeypatch, args, "1")
    assert not own and m <= SKINNY_MAX_M
    want = ref.moe_ffn(h, idx, wt, gu, dn, sgu, sdn)
    bound = moe_bound(h, idx, wt, lambda e: (gu[e].dequantize(), dn[e].dequantize()),
                      (ref.as_float64(sgu), ref.as_float64(sdn)))
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max err {err.max():.3g}, ratio {(err / bound).max():.3g}"
    assert np.abs(want).max() > 0.1
    alone, _ = _run(moe_layers, monkeypatch, (h[-1:], idx[-1:], wt[-1:], *args[3:]), "1")
    assert np.array_equal(alone[0], got[-1])


def test_the_shared_expert_keeps_its_launches_where_linear_tiles(moe_layers, monkeypatch):
    """Where linear() would not stream the shared expert's weights ("tiled", or "auto" past
    SKINNY_MAX_M rows) nor the routed experts theirs, the switch changes nothing: the shared
    expert's own launches, the same bits."""
    rng = np.random.default_rng(9)
    args = moe_case(rng, 3, 16, 3, 8, 2, np.float32)
    off, _ = _run(moe_layers, monkeypatch, args, "0", method="tiled")
    on, own = _run(moe_layers, monkeypatch, args, "1", method="tiled")
    assert own and on.tobytes() == off.tobytes()


def test_shared_expert_config_fits_the_launchs_threads():
    """The shared blocks' shape at the routed launch's threads: accumulators (x rows times
    weight rows) within the threads, the threads the launch's."""
    from kdtree_numba.layers.moe_shapes import shared_expert_config
    for m in (1, 5, 17, 65):
        for threads in (32, 64, 128):
            for swiglu, (n, k) in ((True, (4096, 7168)), (False, (7168, 2048)),
                                   (True, (24, 40))):
                cfg = shared_expert_config(m, n, k, "bf16", threads, swiglu)
                assert cfg.threads == threads and cfg.splits == 1
                assert cfg.mt * cfg.rows * (2 if swiglu else 1) <= threads, (m, threads, cfg)


@pytest.mark.gpu
def test_gpu_the_demo_pair_with_the_switch_gives_the_defaults_tokens(monkeypatch):
    """On the GPU: the demo pair's AR and DDTree (budget 16, T = 0 and 1) tokens are the
    same with the switch off and on (bf16 experts: the same bits)."""
    from test_demo_pair import assert_switch_keeps_tokens
    assert_switch_keeps_tokens(monkeypatch, "KDTREE_SHARED_IN_EXPERTS")

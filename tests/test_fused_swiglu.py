"""``KDTREE_FUSED_SWIGLU``: an FFN's SwiGLU in its gate_up linear's launch
(kdtree_numba/layers/linear.py's ``skinny_swiglu``): the skinny linear's bits followed by the
SwiGLU kernel's, one launch fewer; the shared expert and the dense FFN bit for bit with the
switch off and on, within the float64 reference's bound; on the GPU the demo pair's tokens."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference.layers as ref


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _weights(rng, d, inter, bf16):
    dtype = ml_dtypes.bfloat16 if bf16 else np.float32
    gu = (rng.standard_normal((2 * inter, d)) / np.sqrt(d)).astype(dtype)
    dn = (rng.standard_normal((d, inter)) / np.sqrt(inter)).astype(dtype)
    return gu, dn


# the opt-in switch's second cases (~6 s under the simulator) only off CI's default run
@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["f32", "bf16"])
def test_skinny_swiglu_is_the_skinny_linear_then_swiglu_bit_for_bit(needs_kernels, bf16):
    """Against the two launches it replaces (the skinny linear of the whole gate_up, then
    moe._silu_mul): the same bits, at row counts inside one and across several x-row
    chunks, outputs that fill a block's rows or leave them ragged, K a multiple of the
    16-byte chunk or not (the scalar loads); the float64 reference within its bound."""
    from kdtree_numba.compat import to_device
    from kdtree_numba.layers.linear import linear, skinny_swiglu
    from kdtree_numba.layers.moe import _silu_mul
    from kdtree_numba.layers.workspace import launch_1d
    rng = np.random.default_rng(7 + bf16)
    for d, inter in ((64, 24), (40, 13)):
        gu, _ = _weights(rng, d, inter, bf16)
        for m in (1, 3, 6):
            h = rng.standard_normal((m, d)).astype(np.float32)
            got = host(skinny_swiglu(h, gu))
            both = to_device(host(linear(h, gu, method="skinny")))
            act = to_device(np.zeros((m, inter), np.float32))
            grid, block = launch_1d(m * inter, 256)
            _silu_mul[grid, block](both, act)
            assert got.shape == (m, inter)
            assert got.tobytes() == host(act).tobytes(), (d, inter, m)
            g, u = np.split(h.astype(np.float64) @ gu.astype(np.float64).T, 2, axis=1)
            np.testing.assert_allclose(got, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gate_up"):
        skinny_swiglu(np.zeros((2, 8), np.float32), np.zeros((5, 8), np.float32))


@pytest.mark.parametrize("shared", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["dense", "shared-expert"])
def test_the_switch_keeps_the_ffns_bits_and_drops_a_launch(needs_kernels, monkeypatch,
                                                             shared):
    """moe_ffn with the switch on and off: the dense FFN (lean round) and a routed MoE with
    a shared expert give the same bits at a decode's and a small verify's rows, and the
    switch on launches no SwiGLU kernel; the reference within the float32 bound."""
    from kdtree_numba.layers import moe as moe_layers
    rng = np.random.default_rng(11)
    d, inter, n_exp = 32, 24, 4
    gu, dn = _weights(rng, d, inter, False)
    experts = [(rng.standard_normal((n_exp, 2 * 16, d)) / np.sqrt(d)).astype(np.float32),
               (rng.standard_normal((n_exp, d, 16)) / 4).astype(np.float32)]
    launched = []
    real = moe_layers._silu_mul
    monkeypatch.setattr(moe_layers, "_silu_mul", _Counted(real, launched))
    # the shared expert in launches of its own (in the routed ones it has no SwiGLU launch
    # to fuse: tests/test_shared_in_experts.py)
    monkeypatch.setenv("KDTREE_SHARED_IN_EXPERTS", "0")
    for m in (1, 5):
        h = rng.standard_normal((m, d)).astype(np.float32)
        if shared:
            idx = rng.integers(0, n_exp, (m, 2)).astype(np.int32)
            wt = rng.random((m, 2)).astype(np.float32)
            args = (h, idx, wt, *experts, gu, dn)
        else:
            args = (h, None, None, gu[None], dn[None])
        outs = []
        for switch in ("0", "1"):
            monkeypatch.setenv("KDTREE_FUSED_SWIGLU", switch)
            del launched[:]
            outs.append(host(moe_layers.moe_ffn(*args, method="skinny")))
            assert len(launched) == (switch == "0"), (switch, launched)
        assert outs[0].tobytes() == outs[1].tobytes(), m
        np.testing.assert_allclose(outs[1], ref.moe_ffn(*args), rtol=1e-4, atol=1e-4)


class _Counted:
    """A kernel whose launches (``kernel[grid, block](...)``) are recorded."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, config):
        self.launched.append(config)
        return self.kernel[config]


@pytest.mark.gpu
def test_gpu_the_demo_pair_with_the_switch_gives_the_defaults_tokens(monkeypatch):
    """On the GPU: the demo pair's AR and DDTree (budget 16, T = 0 and 1) tokens are the
    same with the switch off and on."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_demo_pair import assert_switch_keeps_tokens
    assert_switch_keeps_tokens(monkeypatch, "KDTREE_FUSED_SWIGLU")

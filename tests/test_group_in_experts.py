"""``KDTREE_GROUP_IN_EXPERTS``: a few (token, expert) entries grouped by the routed experts'
gate_up blocks themselves (kdtree_numba/layers/moe_lists.py) instead of a grouping launch.
The block's ranking against a NumPy oracle (every entry's slot, the active experts, their
slot ranges; invalid experts and one expert picked by several tokens), then the MoE with the
switch: the grouping launch's bits, one launch fewer, the lists the down launch and the
combine read written by the gate_up launch.  Tiny shapes: each simulated thread costs
~120 us.  On the GPU: the Kimi-width int4 decode (tests/test_w4a16_gpu.py) and the demo
pair's tokens here."""
from __future__ import annotations

import numpy as np
import pytest

import reference.layers as ref
from kdtree_numba.compat import cuda   # the simulator swaps `cuda` in a kernel's globals
from test_layers import moe_case
from w4a16_cases import BF16, int4_case


@pytest.fixture
def moe_layers(needs_kernels):
    from kdtree_numba.layers import moe
    return moe


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def grouping_oracle(idx_flat, top_k, n_experts):
    """(slot of each entry, token of each slot, active experts in order, {e: (first, end)}):
    the valid entries sorted by (expert, entry)."""
    valid = [(int(e), i) for i, e in enumerate(idx_flat) if 0 <= e < n_experts]
    order = sorted(valid)
    slot = np.full(len(idx_flat), -1, np.int32)
    tok = np.zeros(len(order), np.int32)
    for s, (_, i) in enumerate(order):
        slot[i] = s
        tok[s] = i // top_k
    active = sorted({e for e, _ in valid})
    ranges = {e: (min(s for s, (f, _) in enumerate(order) if f == e),
                  1 + max(s for s, (f, _) in enumerate(order) if f == e)) for e in active}
    return slot, tok, active, ranges


@pytest.mark.parametrize("idx, top_k, n_experts", [
    ([3, 1, 0, 3, 2, 1], 2, 4),                       # three tokens, experts shared
    ([5, -1, 5, 7, 9, 0, 2, 5], 2, 8),                # invalid experts (-1, 9 >= E)
    ([-1, -1], 2, 4),                                 # none valid
    (list(range(7, -1, -1)) * 5, 8, 12),              # 40 entries, more than the threads
])
def test_a_blocks_grouping_is_the_sorted_entries(idx, top_k, n_experts, needs_kernels):
    from kdtree_numba.layers.moe_lists import GROUP_IN_BLOCK_ENTRIES, make_block_lists
    threads, n_off = 32, n_experts + 1
    lists = make_block_lists(n_experts, GROUP_IN_BLOCK_ENTRIES, threads)

    @cuda.jit
    def run(idx_flat, top_k, slot_out, tok_out, act_out, n_act_out, off_out):
        slot = cuda.shared.array(GROUP_IN_BLOCK_ENTRIES, np.int32)
        tok = cuda.shared.array(GROUP_IN_BLOCK_ENTRIES, np.int32)
        act = cuda.shared.array(GROUP_IN_BLOCK_ENTRIES, np.int32)
        off = cuda.shared.array(n_off, np.int32)
        n_act = cuda.shared.array(1, np.int32)
        for e in range(cuda.threadIdx.x, n_experts + 1, threads):
            off[e] = -7               # (unwritten entries stay visible)
        cuda.syncthreads()
        lists(idx_flat, top_k, slot, tok, off, act, n_act)
        for i in range(cuda.threadIdx.x, idx_flat.shape[0], threads):
            slot_out[i] = slot[i]
            tok_out[i] = tok[i]
            act_out[i] = act[i]
        for e in range(cuda.threadIdx.x, n_experts + 1, threads):
            off_out[e] = off[e]
        if cuda.threadIdx.x == 0:
            n_act_out[0] = n_act[0]

    flat = np.asarray(idx, np.int32)
    n = flat.size
    slot, tok, act = (np.full(n, -9, np.int32) for _ in range(3))
    n_act, off = np.zeros(1, np.int32), np.zeros(n_experts + 1, np.int32)
    run[1, threads](flat, top_k, slot, tok, act, n_act, off)
    want_slot, want_tok, want_active, ranges = grouping_oracle(flat, top_k, n_experts)
    np.testing.assert_array_equal(slot, want_slot)
    np.testing.assert_array_equal(tok[:len(want_tok)], want_tok)
    assert n_act[0] == len(want_active)
    np.testing.assert_array_equal(act[:n_act[0]], want_active)
    for e, (first, end) in ranges.items():
        assert (off[e], off[e + 1]) == (first, end), e


def _run(moe_layers, monkeypatch, args, switch, **kw):
    """moe_ffn with the switch at ``switch``: (output, grouping launches, all launches)."""
    import launch_counter

    from kdtree_numba import compat
    if not compat.SIMULATOR:        # run 203: on the GPU it counted nothing
        pytest.skip("the launch counter counts in the simulator only")
    monkeypatch.setenv("KDTREE_GROUP_IN_EXPERTS", switch)
    with launch_counter.installed() as counter, counter.window() as launches:
        out = host(moe_layers.moe_ffn(*args, **kw))
    monkeypatch.delenv("KDTREE_GROUP_IN_EXPERTS")
    groups = sum(n for site, n in launches.items() if "group_by_expert" in site)
    return out, groups, sum(launches.values())


@pytest.mark.parametrize("shared", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["shared", "routed_only"])
def test_the_grouping_in_the_gate_up_launch_keeps_the_bits(moe_layers, monkeypatch, shared):
    """bf16 experts, with the shared expert in the routed launches and without: the grouping
    launch's bits without it, and a second routing (one expert for every token, an invalid
    entry) on the same workspace right too."""
    from kdtree_numba.layers import Workspace
    rng = np.random.default_rng(17)
    args = moe_case(rng, 3, 16, 4, 8, 2, BF16, shared)
    off, groups_off, launches_off = _run(moe_layers, monkeypatch, args, "0", method="skinny")
    ws = Workspace()
    on, groups_on, launches_on = _run(moe_layers, monkeypatch, args, "1", method="skinny",
                                      workspace=ws)
    assert (groups_off, groups_on) == (1, 0) and launches_on == launches_off - 1
    assert on.tobytes() == off.tobytes()
    np.testing.assert_allclose(on, ref.moe_ffn(*args), rtol=1e-4, atol=1e-4)
    idx = np.zeros_like(args[1])
    idx[:, 1] = [2, -1, 2]
    again = (args[0], idx, *args[2:])
    second, _, _ = _run(moe_layers, monkeypatch, again, "1", method="skinny", workspace=ws)
    want, _, _ = _run(moe_layers, monkeypatch, again, "0", method="skinny")
    assert second.tobytes() == want.tobytes()


@pytest.mark.slow
def test_int4_experts_with_the_combine_in_down_keep_the_bits(moe_layers, monkeypatch):
    """int4 routed experts with a bf16 shared expert, the grouping in the gate_up launch and
    the combine in the down launch together (the combine reads the lists the gate_up launch
    wrote): the bits of neither."""
    from kdtree_numba.layers.workspace import int4_experts
    rng = np.random.default_rng(23)
    h, idx, wt, gu, dn, sgu, sdn = int4_case(rng, 3, 64, 5, 16, 2, 16)
    args = (h, idx, wt, int4_experts(gu), int4_experts(dn), sgu, sdn)
    want, _, _ = _run(moe_layers, monkeypatch, args, "0")
    monkeypatch.setenv("KDTREE_COMBINE_IN_DOWN", "1")
    got, groups, _ = _run(moe_layers, monkeypatch, args, "1")
    assert groups == 0 and got.tobytes() == want.tobytes()


@pytest.mark.slow
def test_many_entries_keep_the_grouping_launch(moe_layers, monkeypatch):
    """Past GROUP_IN_BLOCK_ENTRIES entries the switch changes nothing: the grouping launch."""
    from kdtree_numba.layers.moe_lists import GROUP_IN_BLOCK_ENTRIES
    rng = np.random.default_rng(5)
    m = GROUP_IN_BLOCK_ENTRIES // 2 + 1
    args = moe_case(rng, m, 8, 3, 4, 2, np.float32, False)
    off, _, _ = _run(moe_layers, monkeypatch, args, "0", method="skinny")
    on, groups, _ = _run(moe_layers, monkeypatch, args, "1", method="skinny")
    assert groups == 1 and on.tobytes() == off.tobytes()


def test_tiled_experts_keep_the_grouping_launch(moe_layers, monkeypatch):
    """Tiled routed experts read the grouping launch's lists: the switch changes nothing."""
    rng = np.random.default_rng(9)
    args = moe_case(rng, 3, 16, 3, 8, 2, np.float32)
    off, _, _ = _run(moe_layers, monkeypatch, args, "0", method="tiled")
    on, groups, _ = _run(moe_layers, monkeypatch, args, "1", method="tiled")
    assert groups == 1 and on.tobytes() == off.tobytes()


@pytest.mark.slow
def test_a_model_runs_a_launch_fewer_a_moe_layer_with_the_same_bits(monkeypatch,
                                                                    needs_kernels):
    """The small target's round and AR step with the switch: the same tokens, logits and
    caches, and one launch fewer a MoE layer a forward (the round: the target's verify, a
    tree's rows within the bound; its drafter has no MoE)."""
    import launch_counter
    with launch_counter.installed():
        monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", "0")
        base = launch_counter.rounds_and_bits()
        monkeypatch.setenv("KDTREE_GROUP_IN_EXPERTS", "1")
        grouped = launch_counter.rounds_and_bits()
    launch_counter.same_results(base, grouped)
    moe_layers = 1          # SMALL_TARGET: 2 layers, the first dense
    assert sum(base[1].values()) - sum(grouped[1].values()) == moe_layers
    assert sum(base[0].values()) - sum(grouped[0].values()) == moe_layers


@pytest.mark.gpu
def test_gpu_the_demo_pair_with_the_switch_gives_the_defaults_tokens(monkeypatch):
    """On the GPU: the demo pair's AR and DDTree (budget 16, T = 0 and 1) tokens are the
    same with the switch off and on."""
    from test_demo_pair import assert_switch_keeps_tokens
    assert_switch_keeps_tokens(monkeypatch, "KDTREE_GROUP_IN_EXPERTS")

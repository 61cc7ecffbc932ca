"""``KDTREE_INVARIANT_ATTENTION`` (kdtree_numba/runtime.py): attention's key splits fixed on
every GEMM setting, as ``gemm="tensor-cores"`` fixes them, so a verify's row gets a decode's
bits (the demo pair's tokens at T > 0 then AR's); graphs of either setting keyed apart."""
from __future__ import annotations

import numpy as np
import pytest

from test_fewer_launches import _problem


def test_the_switch_gives_a_verify_row_the_bits_of_its_decode(monkeypatch, needs_kernels):
    """A chain of 3 tokens verified in one call after a 140-key prefix, and each of them
    decoded alone (its prefix the keys before it, the same cache): with the switch, every row
    equals its decode bit for bit (2 splits of 128 keys, so the merge runs), and the plans
    are the batch-invariant ones."""
    from kdtree_numba.attention import PlanCache, mla_attention
    monkeypatch.setenv("KDTREE_INVARIANT_ATTENTION", "1")
    rng = np.random.default_rng(11)
    n, prefix = 3, 140
    prob = _problem(rng, 1, n, 2, 8, 4, 160, [prefix], "chain")
    plans = PlanCache()
    verify = mla_attention(**prob, plans=plans).copy_to_host()
    for j in range(n):
        one = dict(prob, q_abs=prob["q_abs"][:, j:j + 1], q_pe=prob["q_pe"][:, j:j + 1],
                   prefix_len=np.array([prefix + j], np.int32),
                   visible=np.ones((1, 1, 1), bool))
        decode = mla_attention(**one, plans=plans).copy_to_host()
        assert decode[0, 0].tobytes() == verify[0, j].tobytes(), j
    assert {p.chunk for p in plans._plans.values()} == {128}
    assert all(key[4] for key in plans._plans)      # batch_invariant in every plan's key


@pytest.mark.parametrize("name, default", [
    ("KDTREE_INVARIANT_ATTENTION", "0"), ("KDTREE_FUSED_SWIGLU", "1"),
    ("KDTREE_MOE_WORK_LIST", "0"), ("KDTREE_INT4_MMA", "1"),
    ("KDTREE_SHARED_IN_EXPERTS", "1")])
def test_the_switches_that_change_kernels_key_graphs_apart(monkeypatch, name, default):
    """GraphCache.stored_key marks the graphs of a per-call switch that changes kernels or
    plans, so an A/B in one process (tools/ab_switches.py) never replays one setting's graph
    for the other (run 178's fused-SwiGLU A/B did, before the mark)."""
    from kdtree_numba.graphs import GraphCache
    other = "1" if default == "0" else "0"
    monkeypatch.delenv(name, raising=False)
    plain = GraphCache.stored_key(("forward", 1, 1))
    monkeypatch.setenv(name, default)
    assert GraphCache.stored_key(("forward", 1, 1)) == plain
    monkeypatch.setenv(name, other)
    assert GraphCache.stored_key(("forward", 1, 1)) != plain

"""tools/profile_ops.py's host side: the weight bytes it charges each op and its table (the
timing itself needs a GPU: run on the H200, docs/GPU_RESULTS.md)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import profile_ops  # noqa: E402


def test_weight_bytes_counts_the_experts_a_routing_reads():
    h = np.zeros((3, 8), np.float32)
    w = np.zeros((16, 8), np.uint16)
    assert profile_ops.weight_bytes("linear", (h, w)) == 16 * 8 * 2
    gate_up, down = np.zeros((4, 6, 8), np.uint16), np.zeros((4, 8, 3), np.uint16)
    idx = np.array([[0, 2], [2, 3], [0, 3]], np.int32)          # experts 0, 2, 3 of 4
    per_expert = (6 * 8 + 8 * 3) * 2
    assert profile_ops.weight_bytes("moe_ffn", (h, idx, None, gate_up, down)) == 3 * per_expert
    shared = (np.zeros((6, 8), np.uint16), np.zeros((8, 3), np.uint16))
    assert (profile_ops.weight_bytes("moe_ffn", (h, idx, None, gate_up, down, *shared))
            == 3 * per_expert + per_expert)
    assert profile_ops.weight_bytes("rmsnorm", (h,)) is None
    assert profile_ops.shape_label("linear", (h, w)) == "8->16"
    assert profile_ops.shape_label("moe_ffn", (h, idx[:, :1])) == "dense"
    # the dense FFN without routing (expert_idx, weight None): its one expert's bytes
    dense = (np.zeros((1, 6, 8), np.uint16), np.zeros((1, 8, 3), np.uint16))
    assert profile_ops.weight_bytes("moe_ffn", (h, None, None, *dense)) == per_expert
    assert profile_ops.shape_label("moe_ffn", (h, None, None, *dense)) == "dense"


def test_table_groups_calls_and_sets_each_beside_its_roof(capsys):
    nbytes = int(profile_ops.HBM_BYTES_PER_S * 10e-6)            # a 10 us roof
    rows = [("linear", "8->16", 15.0, nbytes), ("rmsnorm", "", 2.0, None),
            ("linear", "8->16", 15.0, nbytes)]
    profile_ops.print_table(rows, {"replayed": 40.0}, "t")
    out = capsys.readouterr().out
    assert "| linear | 8->16 | 2 | 30.0 | 93.8% | 20.0 | 1.50x |" in out
    assert "| rmsnorm | - | 1 | 2.0 | 6.2% | - | - |" in out
    assert "| **sum of ops** | | 3 | 32.0 | 100% | 20.0 | 1.60x |" in out
    assert "glue and copies outside the ops: 8.0 us (20.0% of the replayed forward)" in out


def test_prefill_forward_is_causal_and_takes_the_last_logits_only():
    """--prefill profiles the forward the engine's prefill runs (Model.prefill: causal
    attention, logit_rows = the last token), the default a chain verify (every row)."""
    from types import SimpleNamespace
    calls = []

    class Fake:
        config = SimpleNamespace(vocab_size=50)

        def new_cache(self, bs, capacity):
            return SimpleNamespace(advance=lambda lengths: calls.append(("advance", lengths)))

        def forward(self, batch, cache, **kw):
            calls.append((batch.tokens.shape, batch.positions[0, 0], batch.visible.shape,
                          batch, kw))

    profile_ops._forward(Fake(), 6, 3, prefill=True)()
    profile_ops._forward(Fake(), 6, 3)()
    prefix, advance, prefill, _, _, verify = calls
    assert prefix[:3] == ((1, 3), 0, (1, 3, 3)) and advance == ("advance", [3])
    assert prefill[:3] == ((1, 6), 3, (1, 6, 6)) and prefill[3].causal is True
    assert prefill[3].prefill is True and prefill[3].logit_rows.tolist() == [5]
    assert verify[:3] == ((1, 6), 3, (1, 6, 6)) and verify[4] == {}
    assert (verify[3].causal, verify[3].prefill, verify[3].logit_rows) == (False, False, None)


def test_weight_bytes_of_int4_experts_are_their_packed_bytes():
    """kimi-k2-slice's routed experts (Int4Experts): charged at the packed words and scales."""
    from kdtree_numba.layers.workspace import Int4Experts
    h = np.zeros((2, 64), np.float32)
    gate_up = Int4Experts(np.zeros((4, 6, 8), np.uint32), np.zeros((4, 6, 2), np.uint16), 32)
    down = Int4Experts(np.zeros((4, 64, 1), np.uint32), np.zeros((4, 64, 1), np.uint16), 8)
    idx = np.array([[0, 1], [1, 3]], np.int32)                  # experts 0, 1, 3 of 4
    per_expert = (6 * 8 * 4 + 6 * 2 * 2) + (64 * 4 + 64 * 2)
    assert profile_ops.weight_bytes("moe_ffn", (h, idx, None, gate_up, down)) == 3 * per_expert

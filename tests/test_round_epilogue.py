"""A device round's glue in two launches (runtime.round_epilogue, on by default;
``KDTREE_ROUND_EPILOGUE=0`` turns it off): the verify's and the drafter's block's slots made together
(``round_slots``), and the counts, both caches' lengths, the roots and the accepted rows'
features in one commit launch (``commit_round``), kdtree_numba/ddtree/commit.py.  The kernels
against a loop oracle and their reference twins; device rounds with the switch on against
off: the same tokens, acceptances, cache contents and lengths; in the simulator, the launches
it removes, counted by site; the GPU twin on the demo pair."""
from __future__ import annotations

import collections

import numpy as np
import pytest

import launch_counter
from kdtree_numba import compat
from kdtree_numba.engine import generate
from reference.ddtree import commit as ref
from test_dflash import parts2
from test_lean_round import _difference, switch_keeps_the_rounds, switch_keys_apart


def _slots_oracle(lengths, max_len, n):
    bs = len(lengths)
    rows = np.zeros((bs, n), np.int64)
    for b in range(bs):
        for j in range(n):
            rows[b, j] = b * max_len + int(lengths[b]) + j
    return rows


def _commit_case(rng, bs=3, W=6, L1=4, F=5):
    rows = rng.standard_normal((bs, W, F)).astype(np.float32)
    acc_len = rng.integers(1, L1 + 1, bs).astype(np.int32)
    acc_idx = np.full((bs, L1), -1, np.int32)
    for b in range(bs):
        acc_idx[b, :acc_len[b]] = np.sort(rng.choice(W, acc_len[b], replace=False))
        acc_idx[b, 0] = 0
    active = np.array([1, 0, 1][:bs], np.int32)
    next_roots = rng.integers(0, 100, bs).astype(np.int32)
    return rows, acc_idx, acc_len, active, next_roots


def _commit_oracle(rows, acc_idx, acc_len, active, next_roots, roots, lengths, block_lengths):
    bs, L1 = acc_idx.shape
    counts = np.array([int(acc_len[b]) * int(active[b]) for b in range(bs)], np.int32)
    gathered = np.stack([np.stack([rows[b, max(int(acc_idx[b, j]), 0)] for j in range(L1)])
                         for b in range(bs)])
    # a request the round did not run keeps its root (it continues from it when it runs)
    kept = np.array([next_roots[b] if active[b] else roots[b] for b in range(bs)], np.int32)
    return counts, lengths + counts, block_lengths + counts, kept, gathered


def test_the_reference_twins_give_the_oracles_integers():
    lengths, block_lengths = np.array([0, 7, 3], np.int32), np.array([0, 7, 3], np.int32)
    rows, block_rows, positions = ref.round_slots(lengths, 20, 5, block_lengths, 12, 4)
    np.testing.assert_array_equal(rows, _slots_oracle(lengths, 20, 5))
    np.testing.assert_array_equal(block_rows, _slots_oracle(block_lengths, 12, 4))
    assert rows.dtype == block_rows.dtype == np.int64 and positions.dtype == np.int32
    np.testing.assert_array_equal(positions, block_lengths[:, None] + np.arange(4))
    case = _commit_case(np.random.default_rng(0))
    lengths, block_lengths, roots = (np.array([4, 9, 2], np.int32), np.array([4, 9, 2], np.int32),
                                     np.array([101, 102, 103], np.int32))
    want = _commit_oracle(*case, roots, lengths, block_lengths)
    assert want[3][1] == 102                        # request 1 is not active: its root stays
    counts, gathered = ref.commit_round(*case, roots, lengths, block_lengths)
    for got, expected in zip((counts, lengths, block_lengths, roots, gathered), want):
        np.testing.assert_array_equal(got, expected)
    assert counts.dtype == lengths.dtype == np.int32
    # no rows, no second cache: the counts, lengths and roots alone
    counts, gathered = ref.commit_round(None, *case[1:], roots, lengths, None)
    assert gathered is None and lengths.tolist() == (want[1] + want[0]).tolist()


def test_the_kernels_give_the_reference_twins_bits(needs_kernels):
    from kdtree_numba.ddtree import commit_round, round_slots
    lengths, block_lengths = np.array([0, 7, 3], np.int32), np.array([5, 1, 3], np.int32)
    for got, want in zip(round_slots(lengths, 20, 5, block_lengths, 12, 4),
                         ref.round_slots(lengths, 20, 5, block_lengths, 12, 4)):
        got = got.copy_to_host()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    for F, block in ((5, True), (37, False), (None, True)):      # a few elements, many chunks
        case = _commit_case(np.random.default_rng(F or 1), F=F or 1)
        rows = None if F is None else case[0]
        grown = [np.array([4, 9, 2], np.int32), np.array([4, 9, 2], np.int32),
                 np.array([101, 102, 103], np.int32)]
        mine = [a.copy() for a in grown]
        ref_counts, ref_rows = ref.commit_round(rows, *case[1:], grown[2], grown[0],
                                                grown[1] if block else None)
        counts, gathered = commit_round(rows, *case[1:], mine[2], mine[0],
                                        mine[1] if block else None)
        np.testing.assert_array_equal(counts.copy_to_host(), ref_counts)
        for a, b in zip(mine, grown):                    # in place, as the twin
            np.testing.assert_array_equal(a, b)
        if F is None:
            assert gathered is None
        else:
            np.testing.assert_array_equal(gathered.copy_to_host().view(np.uint32),
                                          ref_rows.view(np.uint32))


def _reference_pair():
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    tcfg, tw, dcfg, dw, spec = parts2()
    target = Model(tcfg, tw, "reference")
    return target, DFlashDrafter(target, dcfg, dw, spec)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_device_rounds_with_the_epilogue_keep_tokens_caches_and_lengths(monkeypatch,
                                                                        temperature):
    """Reference backend, a ragged batch with one request stopping at eos, budgets 1 (a tree
    shallower than the block: the commit writes the block's first rows), 4 and 9 (wider than
    the block): the switch on gives the off run's tokens, rounds and acceptances, both caches'
    committed contents and lengths, and runs the two launches each round."""
    target, drafter = _reference_pair()
    ops = target.backend.ops
    calls = collections.Counter()
    for name in ("round_slots", "commit_round"):
        def counting(*args, _op=getattr(ops, name), _name=name, **kwargs):
            calls[_name] += 1
            return _op(*args, **kwargs)
        monkeypatch.setattr(ops, name, counting)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [1]]
    eos = generate(target, prompts, 10, temperature=temperature, seed=4).tokens[2][3]
    for budget in (1, 4, 9):
        runs = []
        for switch in ("0", "1"):
            monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", switch)
            calls.clear()
            res = generate(target, prompts, 12, method="ddtree", drafter=drafter,
                           budget=budget, temperature=temperature, seed=4, eos=eos,
                           device_rounds=True)
            cache, context = target.generation_cache, drafter.cache
            committed = [np.array(a[:, b, :int(n)]) for c in (cache, context)
                         for a in (c.c, c.k_pe) for b, n in enumerate(c.lengths)]
            runs.append((res, committed, cache.lengths.tolist(), context.lengths.tolist(),
                         np.asarray(cache.device_lengths).tolist(), dict(calls)))
        (off, off_caches, *off_lengths, off_calls), (on, on_caches, *on_lengths, on_calls) = runs
        assert on.tokens == off.tokens and on.stats.tau == off.stats.tau
        assert on.stats.rounds == off.stats.rounds
        assert on_lengths == off_lengths and on_lengths[0] == on_lengths[1] == on_lengths[2]
        for a, b in zip(on_caches, off_caches):
            np.testing.assert_array_equal(a.view(np.uint64), b.view(np.uint64))
        launched = on.stats.rounds + on.stats.rounds_dropped
        assert off_calls == {} and on_calls == {"round_slots": launched,
                                                "commit_round": launched}


def test_a_paged_cache_keeps_the_separate_glue(monkeypatch):
    """A paged target cache has no dense storage rows: the round keeps its own glue (the
    switch on, the same tokens, no commit launch)."""
    from kdtree_numba.dflash import DFlashDrafter
    from kdtree_numba.model import Model
    tcfg, tw, dcfg, dw, spec = parts2()
    target = Model(tcfg, tw, "reference", kv_layout="paged:3")
    drafter = DFlashDrafter(target, dcfg, dw, spec)
    monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", "1")
    monkeypatch.setattr(target.backend.ops, "commit_round", None)      # never called
    prompts = [[5, 6, 7], [1]]
    res = generate(target, prompts, 8, method="ddtree", drafter=drafter, budget=4,
                   device_rounds=True)
    assert res.tokens == generate(target, prompts, 8).tokens


def test_a_graph_of_the_separate_glue_is_never_replayed_with_the_epilogue(monkeypatch):
    """GraphCache.stored_key: a key held with the switch off is not held with it on."""
    switch_keys_apart(monkeypatch, "KDTREE_ROUND_EPILOGUE")


# the sites of one device round (budget 3, a 2-layer target capturing layers 0 and 1, a
# 2-layer drafter of block 3) whose launches the switch removes (+) or adds (-)
EPILOGUE_CUT = collections.Counter({
    "device_round.DeviceRounds._round: multiply": 1,       # counts = acc_len * active
    "device_round.DeviceRounds._round: not_equal": 1,      # roots = next_roots where active
    "device_round.DeviceRounds._round: where": 1,
    "device_round.DeviceRounds._round: setitem": 1,
    "kvcache.KVCache.add_on_device: add": 2,               # both caches' lengths
    "kvcache.KVCache.device_slots: add": 3,                # three forwards' storage rows
    "dflash.DFlashDrafter.draft: add": 1,                  # the block's positions
    "kvcache.KVCache.positions: add": 1,                   # the context's positions
    "steps.gather_phase.<locals>.run: maximum": 1,         # the accepted rows' gather
    "steps.gather_phase.<locals>.run: take": 1,
    "model.Model._compute: concatenate": 2,                # the features: the norms write them
    "ddtree.commit.round_slots: kernel commit._slots": -1,
    "ddtree.commit.commit_round: kernel commit.commit": -1,
})


@pytest.mark.skipif(not compat.SIMULATOR, reason="the launch counter wraps the CUDA simulator")
@pytest.mark.slow   # ~40-70 s on 2 cores: its kernels' bits and the rounds' tokens and caches
#                     are the tests above, in CI
def test_the_epilogue_gives_the_same_bits_with_fewer_launches(monkeypatch, needs_kernels):
    """The numba backend in the simulator, launches counted by site (tests/launch_counter.py):
    the switch on gives the same DDTree and AR tokens, the drafter's next logits, one more
    decode's logits and both caches' bits, and removes exactly EPILOGUE_CUT from a device
    round (on the GPU also CuPy's two index preparations of the take); an AR step keeps its
    launches."""
    runs = []
    with launch_counter.installed():
        for switch in ("0", "1"):
            monkeypatch.setenv("KDTREE_ROUND_EPILOGUE", switch)
            rnd, step, dd, ar, logits, caches = launch_counter.rounds_and_bits()
            runs.append((rnd, step, dd, ar, logits + caches))
    (off_round, off_step, off_dd, off_ar, off_bits), (on_round, on_step, on_dd, on_ar,
                                                      on_bits) = runs
    assert on_dd == off_dd == on_ar == off_ar
    for a, b in zip(on_bits, off_bits):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    assert _difference(off_round, on_round) == EPILOGUE_CUT
    assert _difference(off_step, on_step) == collections.Counter()


# ----------------------------------------------------------------------------- the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_round_epilogue_gives_the_default_rounds_tokens(monkeypatch, temperature):
    """The demo pair on the GPU with CUDA graphs, device rounds at budgets 8 and 16, the
    switch off and on: the same tokens and acceptances (AR's at T = 0), the drafter's context
    and the target's cache the same bits (tests/test_lean_round.py's check)."""
    switch_keeps_the_rounds(monkeypatch, "KDTREE_ROUND_EPILOGUE", temperature)


def graph_kernels(model, budget: int, epilogue: bool) -> collections.Counter:
    """The kernel nodes of the captured round graph at ``budget`` with the switch
    ``epilogue``, by label (CUDA's DOT dump of the graph: a kernel node is drawn as an
    octagon labelled with its number and the kernel's name; run 166's dump on an H100 had no
    "KERNEL" label).  The graph keys of the switch off carry "no_round_epilogue"
    (GraphCache.stored_key)."""
    import re
    dots = [entry.graph.debug_dot_str() for key, entry in model.graphs._graphs.items()
            if key[0] == "round" and key[1] == budget
            and ("no_round_epilogue" in key) != epilogue]
    assert len(dots) == 1, f"{len(dots)} round graphs of budget {budget} held"
    kernels = collections.Counter()
    for attributes in re.findall(r'"graph_\d+_node_\d+"\[([^\]]*)\]', dots[0]):
        if 'shape="octagon"' in attributes:
            label = re.search(r'label="(.*?)"', attributes, re.S)
            name = re.sub(r"^\d+(\\n|\s)*", "", label.group(1)) if label else "?"
            kernels[re.split(r"\\n|\n", name)[0].strip()[:80]] += 1
    assert kernels, dots[0][:2000]
    return kernels


@pytest.mark.gpu
def test_gpu_round_epilogue_graph_has_fewer_kernels(monkeypatch):
    """The demo pair, budget 16, T = 0, the switch explicitly off, then unset (the default:
    on) twice: the same tokens and caches, and the default's captured round graph holds 15
    kernels fewer than the switch off's: 14 CuPy glue kernels (7 adds, a multiply, a
    maximum, a take and its 2 index preparations, the active requests' roots' compare and
    where) for the two kernels of ddtree/commit.py, and the features' three copies, which
    the norms of the target's captured layers 1, 3 and 5 write instead (EPILOGUE_CUT's
    setitem of the roots is a copy node in the graph, not a kernel: runs 168 and 169 both
    counted 13 before the roots' where; run 176 15).  A failure names the kernels either
    side lacks."""
    from test_lean_round import assert_same_rounds, demo_pair, demo_runs
    model, drafter = demo_pair()
    runs = demo_runs(monkeypatch, model, drafter, "KDTREE_ROUND_EPILOGUE", ("0", None, None),
                     16, 0.0)
    assert_same_rounds(runs)
    off, on = graph_kernels(model, 16, False), graph_kernels(model, 16, True)
    n_off, n_on = sum(off.values()), sum(on.values())
    # in full on stdout (pytest cuts a long assertion message short without -vv)
    print(f"round graph kernels, budget 16: switch off {n_off}, default (on) {n_on}; only "
          f"off: {dict(off - on)}; only on: {dict(on - off)}")
    assert n_on < n_off and n_off - n_on == 15, (n_off, n_on, "only off:", dict(off - on),
                                                 "only on:", dict(on - off))

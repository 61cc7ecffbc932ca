"""KV layouts (kdtree_numba/kvlayout.py) and the cache's device-resident lengths.

The proof of the paged layout runs on the reference backend: attention over a paged pool
equals attention over the dense cache holding the same slots, bit for bit (Hypothesis, random
ragged lengths and page orders), paged compaction moves the rows dense compaction moves (across
page boundaries), latents written straight into a paged store (``KVCache.latent_store``, the
model's every write) land where the page lists say, and a tiny model over paged caches of page
sizes 1, 3 and 16 gives the dense layout's logits exactly and DDTree's greedy tokens equal
AR's.  The device lengths are checked
on the reference backend (pending commits, capacity bounds) and, under the CUDA simulator, on
the dense numba path: write slots, attention and compaction from device lengths give what the
host lengths gave before.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kdtree_numba import compat
from kdtree_numba.backends import bf16_bits, make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.drafter import ModelDrafter, NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.kvcache import CacheFullError, KVCache
from kdtree_numba.kvlayout import PagedLayout, layout_spec
from kdtree_numba.model import ForwardBatch, Model, causal_mask
from reference.attention import mla_attention, paged_mla_attention
from reference.ddtree import compact_kv, compact_kv_paged
from reference.paged import check_page_table
import reference.layers as rl

PAGE_SIZES = (1, 3, 16)


def paged_copy(denses, lengths, page_size, rng, spare=2):
    """Pools [..., n_pages, P, w] holding each of ``denses`` [..., bs, max_len, w]'s slots
    ``[0, lengths[b])`` on shuffled pages, and their one table (kv_indptr, kv_indices,
    kv_last_page_len), built slot by slot here (not through reference/paged.py)."""
    need = [-(-int(k) // page_size) for k in lengths]
    n_pages = sum(need) + spare
    order = rng.permutation(n_pages)
    pools = [np.zeros(d.shape[:-3] + (n_pages, page_size, d.shape[-1]), d.dtype)
             for d in denses]
    indptr, indices, last = [0], [], []
    for b, k in enumerate(need):
        mine = order[indptr[-1]:indptr[-1] + k]
        for t in range(int(lengths[b])):
            for pool, dense in zip(pools, denses):
                pool[..., mine[t // page_size], t % page_size, :] = dense[..., b, t, :]
        indptr.append(indptr[-1] + k)
        indices.extend(mine)
        last.append(int(lengths[b]) - (k - 1) * page_size if k else 0)
    return pools, tuple(np.array(a, np.int32) for a in (indptr, indices, last))


def dense_view(pool, table, lengths, max_len):
    """The dense [..., bs, max_len, w] of a pool, read slot by slot through ``table``."""
    indptr, indices, _ = table
    page_size = pool.shape[-2]
    out = np.zeros(pool.shape[:-3] + (len(lengths), max_len, pool.shape[-1]), pool.dtype)
    for b, k in enumerate(lengths):
        for t in range(int(k)):
            out[..., b, t, :] = pool[..., indices[indptr[b] + t // page_size], t % page_size, :]
    return out


# ----------------------------------------------------------------------------- reference ops

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bs=st.integers(1, 3), n=st.integers(1, 3),
       page_size=st.sampled_from([1, 2, 3, 5, 16]), bf16=st.booleans(), data=st.data())
def test_paged_attention_equals_dense_for_ragged_lengths(seed, bs, n, page_size, bf16, data):
    prefix = np.array(data.draw(st.lists(st.integers(0, 11), min_size=bs, max_size=bs)))
    rng = np.random.default_rng(seed)
    H, r, dr, max_len = 2, 8, 4, int(prefix.max()) + n + 2
    ckv, kpe = (rng.standard_normal((bs, max_len, w)).astype(np.float32) for w in (r, dr))
    if bf16:    # a bf16 cache: bit patterns, the same gather
        ckv, kpe = bf16_bits(np, ckv), bf16_bits(np, kpe)
    q_abs = rng.standard_normal((bs, n, H, r)).astype(np.float32)
    q_pe = rng.standard_normal((bs, n, H, dr)).astype(np.float32)
    visible = rng.random((bs, n, n)) < 0.5
    visible[:, np.arange(n), np.arange(n)] = True
    covered = prefix + n + rng.integers(0, 2, bs)       # a table may cover more slots
    (ckv_pool, kpe_pool), table = paged_copy([ckv, kpe], covered, page_size, rng)
    want = mla_attention(q_abs, q_pe, ckv, kpe, prefix, visible, 0.3, out_dtype=np.float64)
    got = paged_mla_attention(q_abs, q_pe, ckv_pool, kpe_pool, *table, prefix, visible, 0.3,
                              out_dtype=np.float64)
    assert got.tobytes() == want.tobytes()


def test_paged_attention_refuses_a_table_short_of_the_new_tokens():
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4, 2, 8)).astype(np.float32)
    table = (np.array([0, 1]), np.array([3]), np.array([2]))       # 2 slots
    with pytest.raises(ValueError, match="page table covers"):
        paged_mla_attention(np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 1, 4),
                            np.float32), pool, pool[..., :4], *table, np.array([1]),
                            np.ones((1, 2, 2), bool), 1.0)
    with pytest.raises(ValueError, match="distinct page ids"):
        check_page_table(4, 2, [0, 2], [1, 1], [2])
    with pytest.raises(ValueError, match="kv_last_page_len"):
        check_page_table(4, 2, [0, 1], [1], [3])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bs=st.integers(1, 3),
       page_size=st.sampled_from([1, 2, 3, 4]), data=st.data())
def test_paged_compaction_moves_the_rows_dense_compaction_moves(seed, bs, page_size, data):
    rng = np.random.default_rng(seed)
    width, tree = 6, 8
    past = np.array(data.draw(st.lists(st.integers(0, 7), min_size=bs, max_size=bs)))
    acc_idx = np.full((bs, tree), -1, np.int32)
    acc_len = np.zeros(bs, np.int32)
    for b in range(bs):
        path = np.sort(rng.choice(np.arange(1, tree), data.draw(st.integers(0, 5)), False))
        acc_len[b] = path.size + 1
        acc_idx[b, :acc_len[b]] = np.concatenate([[0], path])
    covered = past + tree
    dense = rng.standard_normal((2, bs, int(covered.max()), width)).astype(np.float32)
    for b in range(bs):
        dense[:, b, covered[b]:] = 0                    # slots no table covers
    (pool,), table = paged_copy([dense], covered, page_size, rng)
    compact_kv([dense], past, acc_idx, acc_len)
    compact_kv_paged([pool], *table, past, acc_idx, acc_len)
    assert dense_view(pool, table, covered, dense.shape[-2]).tobytes() == dense.tobytes()


def test_paged_compaction_across_page_boundaries_by_hand():
    # page size 3, request past 2: tree slots 0..7 are rows 2..9 on pages [5, 0, 3, 1]
    pool = np.zeros((6, 3, 1), np.int64)
    table = (np.array([0, 4]), np.array([5, 0, 3, 1]), np.array([1]))
    for t in range(10):
        pool[table[1][t // 3], t % 3, 0] = 100 + t
    compact_kv_paged(pool, *table, np.array([2]), np.array([[0, 2, 5, 7]]), np.array([4]))
    # rows 2, 4, 7, 9 (on pages 5, 0, 3, 1) now sit at rows 2..5 (pages 5, 0)
    assert pool[5, :, 0].tolist() == [100, 101, 102]
    assert pool[0, :, 0].tolist() == [104, 107, 109]
    with pytest.raises(ValueError, match="outside its 10 paged slots"):
        compact_kv_paged(pool, *table, np.array([3]), np.array([[0, 7]]), np.array([2]))


# ----------------------------------------------------------------------------- the cache

def test_pages_are_taken_as_requests_grow_and_freed_on_truncate():
    be = make_backend("reference")
    cache = KVCache(be, 1, 2, 12, 4, 2, layout=PagedLayout(2, 12, 3, n_pages=5))
    assert cache.c.shape == (1, 5, 3, 4) and cache.layout.slots == 15
    table = cache.reserve(4)                            # 4 slots each: 2 pages each
    assert table.kv_indptr.tolist() == [0, 2, 4] and table.kv_indices.tolist() == [0, 1, 2, 3]
    assert table.kv_last_page_len.tolist() == [1, 1]
    cache.advance([4, 1])
    with pytest.raises(CacheFullError, match="page pool full"):
        cache.reserve(6)                                # 10 and 7 slots: 3 more pages, 1 free
    cache.truncate([4, 0])                              # request 1's pages go back
    table = cache.reserve(3)
    assert cache.layout.pages == [[0, 1, 2], [3]] and cache.layout.free == [4]
    assert table.kv_indices.tolist() == [0, 1, 2, 3]
    assert table.kv_last_page_len.tolist() == [1, 3]
    assert cache.buffer_key()[0] == "paged:3" != KVCache(be, 1, 2, 12, 4, 2).buffer_key()[0]


def test_the_dense_layout_hands_the_kernels_the_arrays_they_always_got(monkeypatch):
    """The dense layout's calls: attention on the layer's [bs, max_len, w] arrays with the
    device lengths as its int32 prefix and the host's max_keys; compaction on the stacked
    arrays with int64 past lengths, the kernel specialisation the engine has always launched
    (so the same PTX runs); with the lean round (the default) the int32 lengths themselves."""
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "0")
    calls = {}
    ops = SimpleNamespace(mla_attention=lambda *a, **k: calls.setdefault("attention", (a, k)),
                          compact_kv=lambda *a: calls.setdefault("compaction", a))
    cache = KVCache(make_backend("reference"), 2, 2, 8, 4, 2)
    cache.advance([3, 1])
    slots = cache.write_slots(2)
    cache.attend(ops, 1, "q_abs", "q_pe", slots, "visible", 0.5, causal=True)
    args, hints = calls["attention"]
    assert args[:2] == ("q_abs", "q_pe") and args[5:] == ("visible", 0.5)
    assert args[2].shape == (2, 8, 4) and np.shares_memory(args[2], cache.c[1])
    assert args[3].shape == (2, 8, 2) and np.shares_memory(args[3], cache.k_pe[1])
    assert args[4] is cache.device_lengths and args[4].dtype == np.int32
    assert hints == dict(max_keys=5, prefill=False, causal=True, plans=None)
    cache.compact_tree(ops, "acc_idx", "acc_len")
    arrays, past, *rest = calls["compaction"]
    assert arrays[0] is cache.c and arrays[1] is cache.k_pe and rest == ["acc_idx", "acc_len"]
    assert past.dtype == np.int64 and past.tolist() == [3, 1]
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "1")
    calls.clear()
    cache.compact_tree(ops, "acc_idx", "acc_len")
    assert calls["compaction"][1] is cache.device_lengths


def test_the_numba_backend_refuses_a_paged_layout(needs_kernels):
    cfg = size_config("tiny", num_hidden_layers=1)
    with pytest.raises(NotImplementedError, match="reference backend only"):
        Model(cfg, {}, "numba", kv_layout="paged:4")
    with pytest.raises(NotImplementedError, match="no paged-KV kernels"):
        make_backend("numba").ops.paged_mla_attention()
    with pytest.raises(ValueError, match="'dense' or 'paged:P'"):
        layout_spec("paged:0")


def test_device_counts_leave_the_host_lengths_pending_with_a_safe_bound(monkeypatch):
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "0")       # the slots' rows (the lean's: None)
    be = make_backend("reference")
    cache = KVCache(be, 1, 2, 10, 4, 2)
    cache.advance([3, 1])
    assert cache.device_lengths.dtype == np.int32 and cache.device_lengths.tolist() == [3, 1]
    slots = cache.write_slots(4)                        # a verify of 4 tree slots
    assert slots.rows.tolist() == [[3, 4, 5, 6], [1, 2, 3, 4]] and slots.max_keys == 7
    cache.advance(np.array([2, 4], np.int32), device=True)      # acc_len, never read
    assert cache.pending and cache.lengths.tolist() == [7, 5]    # bounds: + the 4 written
    assert cache.device_lengths.tolist() == [5, 5]
    slots = cache.write_slots(2)                        # from the device lengths
    assert slots.rows.tolist() == [[5, 6], [5, 6]] and slots.prefix.tolist() == [5, 5]
    assert slots.max_keys == 9                          # the bound: a valid split hint
    with pytest.raises(CacheFullError, match="holds at most 7"):
        cache.check_room(4)                             # 5 + 4 fits, but the host can't know
    with pytest.raises(RuntimeError, match="pending"):
        cache.slot_inputs(1)
    cache.advance(1)                                    # a host count while pending: an add
    assert cache.device_lengths.tolist() == [6, 6] and cache.lengths.tolist() == [8, 6]
    with pytest.raises(ValueError, match="must lie between"):
        cache.confirm_lengths([7, 7])
    cache.confirm_lengths([6, 6])
    assert not cache.pending and cache.lengths.tolist() == [6, 6]
    cache.check_room(4)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bs=st.integers(1, 3), page_size=st.integers(1, 5),
       bf16=st.booleans(), data=st.data())
def test_latents_written_into_a_paged_store_land_where_its_pages_say(seed, bs, page_size,
                                                                     bf16, data):
    """What the model's attention does every layer: ``mla_latents(into=latent_store(...))``
    at the storage rows of a forward's slots.  Forwards of 1..4 tokens after ragged lengths
    that grow unevenly (so a request's pages interleave with the others' and its writes
    cross page boundaries), on a paged cache and a dense one: read slot by slot through the
    layout's own page lists, the pool holds what the dense cache holds at every slot any
    forward wrote (committed or not), bit for bit."""
    rng = np.random.default_rng(seed)
    be = make_backend("reference")
    rank, dr, max_len = 3, 2, 16
    dtype = "bfloat16" if bf16 else "float32"
    paged = KVCache(be, 2, bs, max_len, rank, dr, dtype, layout=f"paged:{page_size}")
    dense = KVCache(be, 2, bs, max_len, rank, dr, dtype)
    written = np.zeros(bs, np.int64)       # per request: the slots some forward wrote
    for _ in range(data.draw(st.integers(1, 4))):
        n = data.draw(st.integers(1, 4))
        if int(paged.lengths.max()) + n > max_len:
            break
        x = rng.standard_normal((bs * n, rank + dr)).astype(np.float32)
        positions = rng.integers(0, 50, bs * n).astype(np.int32)
        for cache in (paged, dense):
            slots = cache.write_slots(n)
            for layer in range(2):
                be.ops.mla_latents(x + layer, None, np.ones(rank), positions,
                                   rl.RopeSpec(1e4, dr, False), 1e-6, q_lora=0, rank=rank,
                                   into=cache.latent_store(layer, slots))
        written = np.maximum(written, paged.lengths + n)
        grow = [data.draw(st.integers(0, n)) for _ in range(bs)]
        for cache in (paged, dense):
            cache.advance(grow)
    for pool, want in ((paged.c, dense.c), (paged.k_pe, dense.k_pe)):
        for b, held in enumerate(paged.layout.pages):
            assert len(held) * page_size >= written[b]
            got = np.stack([pool[:, held[t // page_size], t % page_size]
                            for t in range(int(written[b]))], axis=1).reshape(
                                2, int(written[b]), -1)
            np.testing.assert_array_equal(got, want[:, b, :int(written[b])])
            assert np.any(got != 0) or written[b] == 0


# ----------------------------------------------------------------------------- the proof

@functools.lru_cache(maxsize=None)
def tiny(layout: str, drafter: bool = False) -> Model:
    if drafter:
        cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1,
                          hidden_size=32, intermediate_size=48)
        return Model(cfg, dict(random_weights(cfg, 101)), "reference", kv_layout=layout)
    cfg = size_config("tiny", num_hidden_layers=2)
    return Model(cfg, dict(random_weights(cfg, 1)), "reference", kv_layout=layout)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_paged_cache_gives_the_dense_caches_logits(page_size):
    paged, dense = tiny(f"paged:{page_size}"), tiny("dense")
    ids = [5, 17, 2, 99, 41, 7, 3, 3, 60, 11]
    assert paged.score(ids).tobytes() == dense.score(ids).tobytes()
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]            # ragged, then decodes
    got, want = [], []
    for model, out in ((paged, got), (dense, want)):
        cache = model.new_cache(2, 24)
        out.append(model.prefill(cache, prompts))
        for step in range(4):
            out.append(model.decode(cache, np.array([step, 7 * step])))
            cache.advance([1, step % 2])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_ddtree_greedy_equals_ar_over_a_paged_cache(page_size):
    model = tiny(f"paged:{page_size}")
    prompts = [[3, 9, 27, 81, 4], [8, 2]]
    ar = generate(tiny("dense"), prompts, 10)
    bushy = NoisyOracleDrafter(model, 4, 0.9, seed=1, sharpness=1.5)   # compaction moves rows
    dd = generate(model, prompts, 10, method="ddtree", drafter=bushy, budget=8)
    assert dd.tokens == ar.tokens == generate(model, prompts, 10).tokens
    assert model.generation_cache.layout.spec == f"paged:{page_size}"
    drafter = ModelDrafter(tiny(f"paged:{page_size}", drafter=True), 3)  # truncates its pages
    chain = generate(model, prompts, 10, method="ddtree", drafter=drafter, budget=6)
    assert chain.tokens == ar.tokens


def test_a_paged_generation_cache_is_reused_with_its_pool():
    model = tiny("paged:3")
    generate(model, [[1, 2, 3]], 3)
    cache = model.generation_cache
    generate(model, [[4, 5]], 3)
    assert model.generation_cache is cache
    assert len(cache.layout.free) + sum(map(len, cache.layout.pages)) == cache.layout.n_pages


@pytest.mark.parametrize("layout", ["dense", "paged:3"])
def test_a_round_committed_by_device_counts_continues_as_one_committed_by_host_counts(layout):
    """A verify, its compaction and a commit of acc_len left on the device (the host lengths
    pending), then the next forward: the logits of the host-count path, bit for bit."""
    model = tiny(layout)
    out = []
    for device in (False, True):
        cache = model.new_cache(2, 32)
        model.prefill(cache, [[3, 1, 4, 1, 5], [9, 2]])
        start = cache.lengths.copy()
        model.forward(ForwardBatch(
            np.arange(8).reshape(2, 4) + 7, start[:, None] + np.arange(4), causal_mask(4, 2),
            causal=True), cache)
        acc_idx = np.array([[0, 2, -1, -1], [0, 1, 3, -1]], np.int32)
        acc_len = np.array([2, 3], np.int32)
        cache.compact_tree(model.backend.ops, acc_idx, acc_len)
        cache.advance(acc_len, device=device)
        assert cache.pending == device
        assert cache.device_lengths.tolist() == (start + acc_len).tolist()
        out.append(model.forward(ForwardBatch(
            np.array([[5], [6]]), (start + acc_len)[:, None], np.ones((2, 1, 1), bool)), cache))
        if device:
            assert cache.lengths.tolist() == (start + 4).tolist()     # the bound
            cache.confirm_lengths(start + acc_len)
    assert out[0].tobytes() == out[1].tobytes()


# ----------------------------------------------------------------------------- simulator

@pytest.mark.skipif(not compat.SIMULATOR, reason="host arrays in and out: the numba backend "
                    "runs here only in the CUDA simulator (on a GPU: tests/test_engine_gpu.py)")
def test_device_lengths_drive_the_dense_numba_path_as_host_lengths_did(needs_kernels,
                                                                       monkeypatch):
    """Dense layout, numba kernels (simulator): the slots and attention of a cache whose
    lengths came from device counts equal those of host lengths, passed as before (host rows,
    an uploaded prefix), bit for bit; compaction from device lengths equals the reference's."""
    monkeypatch.setenv("KDTREE_LEAN_ROUND", "0")       # the slots' rows (the lean's: None)
    be = make_backend("numba")
    rng = np.random.default_rng(3)
    bs, n, H, r, dr = 2, 3, 2, 16, 8
    caches = [KVCache(be, 1, bs, 12, r, dr) for _ in range(2)]
    for cache in caches:
        cache.advance([2, 4])
        cache.write_slots(n)
    caches[0].advance([3, 1])                                   # host counts
    caches[1].advance(np.array([3, 1], np.int32), device=True)  # device counts (NumPy here)
    c_new = rng.standard_normal((bs, n, r)).astype(np.float32)
    k_new = rng.standard_normal((bs, n, dr)).astype(np.float32)
    q_abs = rng.standard_normal((bs, n, H, r)).astype(np.float32)
    q_pe = rng.standard_normal((bs, n, H, dr)).astype(np.float32)
    visible = causal_mask(n, bs)
    rows, prefix = caches[0].slot_inputs(n)                    # the host's, as before
    out = []
    for cache in caches:
        slots = cache.write_slots(n)
        assert slots.rows.tolist() == rows.tolist() and slots.prefix.tolist() == [5, 5]
        cache.write(0, c_new, k_new, slots)
        out.append(cache.attend(be.ops, 0, q_abs, q_pe, slots, visible, 0.25))
    before = be.ops.mla_attention(q_abs, q_pe, caches[0].c[0], caches[0].k_pe[0], prefix,
                                  visible, 0.25, max_keys=int(prefix.max()) + n)
    assert out[0].tobytes() == out[1].tobytes() == np.asarray(before).tobytes()
    acc_idx, acc_len = np.array([[0, 2, -1], [0, 1, 2]], np.int32), np.array([2, 3], np.int32)
    want = caches[0].c.copy()
    compact_kv([want], prefix, acc_idx, acc_len)
    caches[1].compact_tree(be.ops, acc_idx, acc_len)
    assert caches[1].c.tobytes() == want.tobytes()

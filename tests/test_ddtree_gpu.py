"""DDTree numba kernels against the reference at real shapes, on a real GPU (marker ``gpu``).

Run on the H200:  HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -m gpu tests/test_ddtree_gpu.py
Shapes: bs up to 256, L = 15, budgets up to 1024, vocabularies up to 163840 for top-K.
"""
from __future__ import annotations

import numpy as np
import pytest

from reference import ddtree as ref
from test_ddtree import (TREE_FIELDS, assert_trees_identical, check_vectors, make_logits,
                         random_accepts, targets_following, uniforms_off_boundaries)

pytestmark = pytest.mark.gpu

VOCAB = 163840
L = 15


@pytest.fixture(scope="module")
def gpu():
    from kdtree_numba import ddtree
    return ddtree


@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def assert_lp_close(got, want):
    err = np.abs(got - want)
    bound = ref.LP_ATOL + ref.LP_RTOL * np.abs(want)
    worst = float((err - bound).max())
    print(f"lp max |diff| {err.max():.3g} (bound slack {-worst:.3g})")
    assert worst <= 0


def tree_to_host(tree) -> ref.DraftTree:
    return ref.DraftTree(*(getattr(tree, f).copy_to_host() for f in TREE_FIELDS),
                         max_depth=tree.max_depth)


# ----------------------------------------------------------------------------- top-K

@pytest.fixture(scope="module")
def real_rows():
    """Logits [64, 15, 163840] and their reference top-1024: smaller k are its prefixes
    (the order is strict), so the slow reference runs once."""
    logits = make_logits(64, (64, L, VOCAB), "normal")
    return logits, ref.topk_logprobs(logits, 1024)


@pytest.mark.parametrize("k", [1, 64, 256, 1024])
def test_topk_real_shape_matches_reference(gpu, real_rows, k):
    logits, (lp, ids) = real_rows
    glp, gids = gpu.topk_logprobs(logits, k)
    np.testing.assert_array_equal(gids, ids[..., :k])
    assert_lp_close(glp, lp[..., :k])


@pytest.mark.parametrize("mode, k", [("ties", 1024), ("ties", 64), ("flat", 1024)])
def test_topk_real_shape_with_ties(gpu, mode, k):
    logits = make_logits(3, (4, L, VOCAB), mode)
    lp, ids = ref.topk_logprobs(logits, k)
    glp, gids = gpu.topk_logprobs(logits, k)
    np.testing.assert_array_equal(gids, ids)
    assert_lp_close(glp, lp)


@pytest.mark.parametrize("scale", [0.3, 12.0, 40.0])
def test_topk_logit_scales(gpu, scale):
    """Near-flat to very peaked rows (an LLM's top logit sits 20-40 above the bulk): the
    online logsumexp's rescaling and the threshold both see the extremes."""
    logits = make_logits(5, (8, L, VOCAB), "normal") * np.float32(scale / 3)
    lp, ids = ref.topk_logprobs(logits, 64)
    glp, gids = gpu.topk_logprobs(logits, 64)
    np.testing.assert_array_equal(gids, ids)
    assert_lp_close(glp, lp)


def test_topk_adversarial_ascending_rows(gpu):
    """Every element beats the running k-th best: compaction on every tile."""
    logits = np.broadcast_to(np.linspace(-5, 5, 20000, dtype=np.float32), (2, 3, 20000)).copy()
    logits[1] = logits[1, :, ::-1]
    lp, ids = ref.topk_logprobs(logits, 1000)
    glp, gids = gpu.topk_logprobs(logits, 1000)
    np.testing.assert_array_equal(gids, ids)
    assert_lp_close(glp, lp)


@pytest.mark.parametrize("config", [(8, 2, None), (4, 4, None), (8, 4, 2), (8, 8, None),
                                    (1, 1, 4), (32, 1, None), (2, 4, 8)])
def test_topk_other_configs(gpu, config):
    """(warps, vec, parts): the benchmark's variants and the extremes of each knob."""
    warps, vec, parts = config
    logits = make_logits(9, (3, 4, 50000), "normal")
    lp, ids = ref.topk_logprobs(logits, 64)
    glp, gids = gpu.topk_logprobs(logits, 64, warps=warps, vec=vec, parts=parts)
    np.testing.assert_array_equal(gids, ids)
    assert_lp_close(glp, lp)


@pytest.mark.parametrize("bs, vocab, k", [(1, VOCAB, 64), (4, VOCAB, 256), (2, VOCAB - 1, 64),
                                          (2, VOCAB, 2048)])
def test_topk_small_batches_split_rows(gpu, bs, vocab, k):
    """Few rows: the default splits each row over several blocks and merges the parts; an odd
    vocabulary takes the scalar-load path; k = MAX_GPU_TOPK fits its lists in shared memory."""
    logits = make_logits(bs + vocab, (bs, L, vocab), "normal")
    lp, ids = ref.topk_logprobs(logits, k)
    glp, gids = gpu.topk_logprobs(logits, k)
    np.testing.assert_array_equal(gids, ids)
    assert_lp_close(glp, lp)


def test_topk_misaligned_device_rows(gpu, cp):
    """A CuPy view 4 bytes past a 16-byte boundary: rows are not 16-byte aligned even though
    V % 4 == 0, so the kernel must use scalar loads (16-byte loads would fault)."""
    logits = make_logits(12, (2, L, 4096), "normal")
    flat = cp.empty(logits.size + 1, cp.float32)
    view = flat[1:].reshape(logits.shape)
    view[...] = cp.asarray(logits)
    assert view.data.ptr % 16 != 0
    glp, gids = gpu.topk_logprobs(view, 64)
    lp, ids = ref.topk_logprobs(logits, 64)
    np.testing.assert_array_equal(cp.asarray(gids).get(), ids)
    assert_lp_close(cp.asarray(glp).get(), lp)


def test_topk_keeps_cupy_input_on_the_device(gpu, cp):
    from numba import cuda
    logits = make_logits(5, (2, 3, 4096), "normal")
    lp, ids = gpu.topk_logprobs(cp.asarray(logits), 32)
    assert cuda.is_cuda_array(lp) and cuda.is_cuda_array(ids)
    rlp, rids = ref.topk_logprobs(logits, 32)
    np.testing.assert_array_equal(cp.asarray(ids).get(), rids)
    assert_lp_close(cp.asarray(lp).get(), rlp)


# ----------------------------------------------------------------------------- tree builder

@pytest.mark.parametrize("bs, budget", [(256, 64), (64, 256), (64, 1024), (8, 1000)])
def test_build_tree_real_shape_bit_identical(gpu, bs, budget):
    lp, ids = ref.topk_logprobs(make_logits(budget, (bs, L, 2 * budget), "normal"), budget)
    assert_trees_identical(gpu.build_tree(lp, ids, budget), ref.build_tree(lp, ids, budget))


@pytest.mark.parametrize("budget", [64, 1024])
def test_build_tree_tie_heavy_bit_identical(gpu, budget):
    lp, ids = ref.topk_logprobs(make_logits(7, (32, L, budget + 7), "ties"), budget)
    assert_trees_identical(gpu.build_tree(lp, ids, budget), ref.build_tree(lp, ids, budget))


def test_build_tree_device_in_device_out(gpu, cp):
    from numba import cuda
    lp, ids = ref.topk_logprobs(make_logits(2, (16, L, 300), "ties"), 64)
    tree = gpu.build_tree(cp.asarray(lp), cp.asarray(ids), 64)
    assert cuda.is_cuda_array(tree.token)
    assert_trees_identical(tree_to_host(tree), ref.build_tree(lp, ids, 64))


def test_whole_round_on_device_matches_reference(gpu, cp):
    """top-K -> build -> compile -> accept with device arrays end to end."""
    bs, budget = 8, 64
    logits = make_logits(11, (bs, L, 32000), "normal")
    d_lp, d_ids = gpu.topk_logprobs(cp.asarray(logits), budget)
    tree = gpu.build_tree(d_lp, d_ids, budget)
    lp, ids = d_lp.copy_to_host(), d_ids.copy_to_host()
    want = ref.build_tree(lp, ids, budget)   # same lp input: the tree must be bit-identical
    assert_trees_identical(tree_to_host(tree), want)
    target = targets_following(want, 1, 0.8)
    got = gpu.accept_greedy(tree, cp.asarray(target))
    for g, w in zip(got, ref.accept_greedy(want, target)):
        np.testing.assert_array_equal(g.copy_to_host(), w)


def test_round_replays_from_a_captured_cuda_graph(gpu, cp):
    """top-K -> build -> compile -> accept with preallocated outputs, captured once in a CUDA
    graph and replayed on new logits/targets written in place; equal to the reference."""
    from numba import cuda
    bs, budget, vocab = 4, 64, 5000
    dev = cuda.as_cuda_array

    def alloc(shape, dtype):
        return dev(cp.empty(shape, dtype))
    logits = cp.asarray(make_logits(20, (bs, L, vocab), "normal"))
    target = cp.zeros((bs, budget + 1), cp.int32)
    root, start = dev(cp.arange(bs, dtype=cp.int32)), dev(cp.full(bs, 7, cp.int32))
    lp, ids = alloc((bs, L, budget), np.float32), alloc((bs, L, budget), np.int32)
    tree = ref.DraftTree(alloc(bs, np.int32), *(alloc((bs, budget + 1), np.int32)
                                                for _ in range(4)),
                         alloc((bs, budget + 1), np.float64), max_depth=L)
    verify = ref.VerifyInput(alloc((bs, budget + 1), np.int32), alloc((bs, budget + 1), np.int32),
                             alloc((bs, budget + 1, L + 1), np.int32),
                             alloc((bs, budget + 1, budget + 1), np.bool_))
    acc = (alloc((bs, L + 1), np.int32), alloc(bs, np.int32), alloc(bs, np.int32))
    stream = cp.cuda.Stream(non_blocking=True)
    ns = cuda.external_stream(stream.ptr)

    def one_round():   # logits and target stay CuPy arrays: wrapped inside, without a sync
        gpu.topk_logprobs(logits, budget, stream=ns, out=(lp, ids))
        gpu.build_tree(lp, ids, budget, stream=ns, out=tree)
        gpu.compile_tree(tree, root, start, stream=ns, out=verify)
        gpu.accept_greedy(tree, target, stream=ns, out=acc)

    cp.cuda.Device().synchronize()   # the inputs above were made on the null stream
    one_round()            # compile and load every kernel outside the capture
    stream.synchronize()
    with stream:
        stream.begin_capture()
        one_round()
        graph = stream.end_capture()
    new_logits = make_logits(21, (bs, L, vocab), "normal")
    want_lp, want_ids = ref.topk_logprobs(new_logits, budget)
    with stream:           # writes ordered before the replay on the same stream
        logits[...] = cp.asarray(new_logits)
    graph.launch(stream)
    stream.synchronize()
    got_lp, got_ids = lp.copy_to_host(), ids.copy_to_host()
    np.testing.assert_array_equal(got_ids, want_ids)
    assert_lp_close(got_lp, want_lp)
    want_tree = ref.build_tree(got_lp, got_ids, budget)   # same lp: bit-identical tree
    assert_trees_identical(tree_to_host(tree), want_tree)
    new_target = targets_following(want_tree, 3, 0.9)
    with stream:
        target[...] = cp.asarray(new_target)
    graph.launch(stream)
    stream.synchronize()
    for got, want in zip(acc, ref.accept_greedy(want_tree, new_target)):
        np.testing.assert_array_equal(got.copy_to_host(), want)
    want_verify = ref.compile_tree(want_tree, np.arange(bs, dtype=np.int32),
                                   np.full(bs, 7, np.int32))
    for name in ("input_ids", "positions", "anc", "visible"):
        np.testing.assert_array_equal(getattr(verify, name).copy_to_host(),
                                      getattr(want_verify, name))


# ----------------------------------------------------------------------------- verify, accept

@pytest.mark.parametrize("bs, budget", [(64, 64), (16, 1024)])
def test_compile_tree_real_shape_bit_identical(gpu, bs, budget):
    lp, ids = ref.topk_logprobs(make_logits(4, (bs, L, budget + 3), "ties"), budget)
    tree = ref.build_tree(lp, ids, budget)
    root = np.arange(bs, dtype=np.int32)
    start = np.arange(bs, dtype=np.int32) * 100
    want, got = ref.compile_tree(tree, root, start), gpu.compile_tree(tree, root, start)
    for name in ("input_ids", "positions", "anc", "visible"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("bs, budget", [(256, 64), (64, 1024)])
def test_accept_greedy_real_shape_bit_identical(gpu, bs, budget):
    lp, ids = ref.topk_logprobs(make_logits(6, (bs, L, budget), "ties"), budget)
    tree = ref.build_tree(lp, ids, budget)
    target = targets_following(tree, 2, 0.9)
    got, want = gpu.accept_greedy(tree, target, True), ref.accept_greedy(tree, target, True)
    assert len(got) == len(want) == 4          # the packed committed tokens too
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_sampled_accept_real_vocab_matches_reference(gpu):
    bs, budget, temperature = 2, 16, 0.8
    lp, ids = ref.topk_logprobs(make_logits(8, (bs, L, 100), "normal"), budget)
    tree = ref.build_tree(lp, ids, budget)
    logits = make_logits(9, (bs, budget + 1, VOCAB), "normal")
    u = uniforms_off_boundaries(tree, logits, temperature, 10)
    np.testing.assert_array_equal(gpu.sample_targets(tree, logits, temperature, u),
                                  ref.sample_targets(tree, logits, temperature, u))


# ----------------------------------------------------------------------------- compaction

@pytest.mark.parametrize("dtype", [np.uint16, np.float32])
def test_compact_kv_61_layer_stack_bit_identical(gpu, dtype):
    bs, width, max_len = 64, 576, 48
    rng = np.random.default_rng(0)
    acc_idx, acc_len = random_accepts(1, bs, L + 1, 3)
    past_len = rng.integers(0, 8, size=bs).astype(np.int32)
    shape = (61, bs, max_len, width)   # random bit patterns (NaNs included): bytes must move
    stack = np.frombuffer(rng.bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize),
                          dtype).reshape(shape).copy()
    want = stack.copy()
    ref.compact_kv([want], past_len, acc_idx, acc_len)
    gpu.compact_kv([stack], past_len, acc_idx, acc_len)
    words = np.uint16 if dtype == np.uint16 else np.uint32
    np.testing.assert_array_equal(stack.view(words), want.view(words))


def test_compact_kv_list_of_device_layers(gpu, cp):
    bs, width, max_len = 16, 576, 64
    rng = np.random.default_rng(1)
    acc_idx, acc_len = random_accepts(2, bs, L + 1, 3)
    past_len = rng.integers(0, 10, size=bs).astype(np.int32)
    layers = [rng.integers(0, 2 ** 16, size=(bs, max_len, width)).astype(np.uint16)
              for _ in range(5)]
    want = [c.copy() for c in layers]
    ref.compact_kv(want, past_len, acc_idx, acc_len)
    d_layers = [cp.asarray(c) for c in layers]
    gpu.compact_kv(d_layers, cp.asarray(past_len), cp.asarray(acc_idx), cp.asarray(acc_len))
    for d, w in zip(d_layers, want):
        assert d.get().tobytes() == w.tobytes()


# ----------------------------------------------------------------------------- vectors

def test_numba_reproduces_every_committed_vector(gpu):
    assert check_vectors(gpu, lp_tolerance=True) == 28

"""Prompt lookup in DDTree's tree (reference/ddtree/lookup.py, its numba twin
kdtree_numba/ddtree/lookup.py): the reference against independent oracles (a brute-force
n-gram search, the full mixture over a small vocabulary), the shared argument checks, and the
numba twin against the reference (CUDA simulator, tiny shapes)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.ddtree import lookup as ref
from reference.ddtree import topk_logprobs
from reference.ddtree.checks import MAX_NGRAM

# a simulated launch costs ~0.05-0.2 s: the twin's property tests draw few examples
SIM_EXAMPLES = settings(max_examples=6, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])
V = 12                     # the mixture oracle's vocabulary


@pytest.fixture(scope="module")
def gpu():
    """The numba twin, or a skip where neither a GPU nor the simulator can run kernels (module
    scoped, so Hypothesis tests may use it; as tests/test_ddtree.py)."""
    from kdtree_numba import compat
    if not compat.kernels_runnable():
        pytest.skip("numba kernels need a GPU or NUMBA_ENABLE_CUDASIM=1")
    from kdtree_numba import ddtree
    return ddtree


def host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


# ----------------------------------------------------------------------------- lookup_path

def path_oracle(s, P, rows, max_n, min_n):
    """For n from max_n down to min_n: the latest end j < P of an earlier occurrence of the
    last n tokens s[P - n + 1 .. P]; the tokens after it up to the root."""
    s = [int(x) for x in s]
    out = [-1] * rows
    for n in range(max_n, min_n - 1, -1):
        ends = [j for j in range(n - 1, P) if s[j - n + 1:j + 1] == s[P - n + 1:P + 1]]
        if ends:
            follow = s[ends[-1] + 1:P + 1][:rows]
            out[:len(follow)] = follow
            break
    return out


@pytest.mark.parametrize("s, P, max_n, min_n, want", [
    ([4, 5, 6], 0, 3, 1, [-1] * 5),                       # P = 0: nothing before the root
    ([1, 2, 3, 4, 5], 4, 3, 1, [-1] * 5),                 # the root's token never seen
    ([5, 6, 7, 5, 6, 7, 5], 6, 8, 1, [6, 7, 5, -1, -1]),  # runs into the root, then -1
    ([7, 1, 2, 8, 5, 2, 9, 1, 2], 8, 2, 1, [8, 5, 2, 9, 1]),   # the longest suffix [1, 2]
    ([7, 1, 2, 8, 5, 2, 9, 1, 2], 8, 1, 1, [9, 1, 2, -1, -1]),  # max_n 1: the latest [2]
    ([7, 1, 2, 8, 5, 2, 9, 1, 2], 8, 3, 3, [-1] * 5),     # no 3-gram: min_n unmet
    ([3, 3, 3, 3, 0, 0], 3, 32, 1, [3, -1, -1, -1, -1]),  # j = 2, m = 3: stale past P unread
])
def test_lookup_path_named_cases(s, P, max_n, min_n, want):
    history = np.array([s], np.int32)
    got = ref.lookup_path(history, np.int32([P]), 5, max_n, min_n)
    assert got.dtype == np.int32 and got.tolist() == [want]
    assert path_oracle(s, P, 5, max_n, min_n) == want


@given(seed=st.integers(0, 2 ** 32 - 1), alphabet=st.integers(1, 4), H=st.integers(1, 24),
       rows=st.integers(0, 7), max_n=st.integers(1, 6), min_frac=st.floats(0, 1))
def test_lookup_path_is_the_brute_force_latest_longest_match(seed, alphabet, H, rows, max_n,
                                                             min_frac):
    rng = np.random.default_rng(seed)
    min_n = 1 + int(min_frac * (max_n - 1))
    history = rng.integers(0, alphabet, (3, H)).astype(np.int32)
    lengths = rng.integers(0, H, 3).astype(np.int32)
    got = ref.lookup_path(history, lengths, rows, max_n, min_n)
    for b in range(3):
        assert got[b].tolist() == path_oracle(history[b], int(lengths[b]), rows, max_n, min_n)


# ----------------------------------------------------------------------------- mix_lookup

def mix_oracle(logits_row, k, t, w, contract=False):
    """The top k of the full mixture (1 - w) p + w [token = t], float64: (log q, ids), by mass
    descending.  ``contract``: t's mass is w where t is outside p's top k, as the contract
    approximates it (its own (1 - w) p_t is not in the rows)."""
    x = logits_row.astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    outside = t not in np.argsort(-x, kind="stable")[:k]
    q = (1.0 - w) * p
    q[t] = w if contract and outside else q[t] + w
    order = np.argsort(-q, kind="stable")[:k]
    return np.log(q[order]), order


@given(seed=st.integers(0, 2 ** 32 - 1), k=st.integers(1, V), w=st.floats(0.01, 0.99))
def test_mix_lookup_is_the_top_k_of_the_full_mixture(seed, k, w):
    """Where t is in the row the contract is the mixture's top k exactly (to float32
    rounding).  Where it is not, the contract gives t the mass w (log w), below its true
    (1 - w) p_t + w: against the oracle with that mass, always; against the true mixture, the
    same ids wherever t's true mass takes the same place."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((2, 3, V)) * 2).astype(np.float32)
    lp, ids = topk_logprobs(logits, k)
    path = rng.integers(-1, V, (2, 4)).astype(np.int32)        # one row more than R
    before = lp.copy(), ids.copy()
    got_lp, got_ids = ref.mix_lookup(lp, ids, path, w)
    assert lp.tobytes() == before[0].tobytes() and ids.tobytes() == before[1].tobytes()
    assert got_lp.dtype == np.float32 and got_ids.dtype == np.int32
    for b in range(2):
        for d in range(3):
            t = int(path[b, d])
            if t < 0:
                assert got_lp[b, d].tobytes() == lp[b, d].tobytes()
                assert got_ids[b, d].tolist() == ids[b, d].tolist()
                continue
            want_lp, want_ids = mix_oracle(logits[b, d], k, t, w, contract=True)
            assert got_ids[b, d].tolist() == want_ids.tolist()
            np.testing.assert_allclose(got_lp[b, d], want_lp, rtol=1e-6, atol=1e-6)
            true_lp, true_ids = mix_oracle(logits[b, d], k, t, w)
            if t in ids[b, d]:
                assert true_ids.tolist() == want_ids.tolist()
                np.testing.assert_allclose(got_lp[b, d], true_lp, rtol=1e-6, atol=1e-6)
            elif t in got_ids[b, d]:
                at = got_ids[b, d].tolist().index(t)
                assert np.exp(np.float64(got_lp[b, d, at])) == pytest.approx(w, rel=1e-6)
                if t in true_ids and true_ids.tolist().index(t) == at:
                    assert true_ids.tolist() == got_ids[b, d].tolist()


def tie_cases():
    """(lp, ids, path, w, the ids the contract gives).  At w = 0.2 these masses tie exactly in
    float32: t's 0.2 (absent) and 0.8 * 0.25, t's 0.8 * 0.1 + 0.2 (in the row) and 0.8 * 0.35:
    t goes after the entry it ties, and an absent t tying the last entry stays out.  At w =
    1e-9 an in-row t's mixed value rounds to its own shifted one, so it moves down behind the
    entries it ties."""
    lp = np.float32(np.log([[[0.5, 0.25, 0.125], [0.5, 0.3, 0.25], [0.35, 0.2, 0.1]]]))
    ids = np.int32([[[0, 1, 2], [0, 1, 2], [0, 1, 2]]])
    down = np.float32(np.log([[[0.25, 0.25, 0.25, 0.1]]]))
    return [(lp, ids, np.int32([[9, 9, 2]]), 0.2, [[[0, 1, 9], [0, 1, 2], [0, 2, 1]]]),
            (down, np.int32([[[3, 4, 5, 6]]]), np.int32([[3]]), 1e-9, [[[4, 5, 3, 6]]])]


def test_mix_lookup_ties_keep_the_older_entry_first():
    for lp, ids, path, w, want in tie_cases():
        got_lp, got_ids = ref.mix_lookup(lp, ids, path, w)
        assert got_ids.tolist() == want
    lp, ids, path, w, _ = tie_cases()[0]
    got_lp, _ = ref.mix_lookup(lp, ids, path, w)
    assert got_lp[0, 0, 1] == got_lp[0, 0, 2] and got_lp[0, 2, 0] == got_lp[0, 2, 1]
    assert got_lp[0, 1, 2] == np.float32(np.log(0.2))       # the tie it did not win


# ----------------------------------------------------------------------------- argument errors

def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)


BAD_MIX = [({"weight": 0.0}, ValueError), ({"weight": 1.0}, ValueError),
           ({"weight": True}, TypeError), ({"weight": "a"}, TypeError),
           ({"lp": np.zeros((1, 2, 3), np.float64)}, TypeError),
           ({"ids": np.zeros((1, 2, 4), np.int32)}, ValueError),
           ({"path": np.zeros((1, 1), np.int32)}, ValueError),
           ({"path": np.zeros((1, 2), np.int64)}, TypeError)]
BAD_LOOKUP = [({"max_n": 0}, ValueError), ({"max_n": MAX_NGRAM + 1}, ValueError),
              ({"min_n": 4}, ValueError), ({"min_n": 0}, ValueError),
              ({"max_n": 2.0}, TypeError), ({"rows": -1}, ValueError),
              ({"history": np.zeros((1, 5), np.int64)}, TypeError),
              ({"history": np.zeros(5, np.int32)}, ValueError),
              ({"lengths": np.zeros(2, np.int32)}, ValueError)]


BAD_RECORD = [({"history": np.zeros((2, 5), np.float32)}, TypeError),
              ({"lengths": np.int32([0])}, ValueError),
              ({"packed": np.zeros((1, 4), np.int32)}, ValueError),
              ({"packed": np.zeros((2, 0), np.int32)}, ValueError),
              ({"active": np.float32([1, 1])}, TypeError)]


def _record_args(**change):
    args = {"history": np.zeros((2, 5), np.int32), "lengths": np.int32([0, 1]),
            "packed": np.zeros((2, 4), np.int32), "active": np.int32([1, 1])}
    return {**args, **change}


def _mix_args(**change):
    args = {"lp": np.zeros((1, 2, 3), np.float32), "ids": np.zeros((1, 2, 3), np.int32),
            "path": np.zeros((1, 2), np.int32), "weight": 0.5}
    return {**args, **change}


def _lookup_args(**change):
    args = {"history": np.zeros((1, 5), np.int32), "lengths": np.int32([2]), "rows": 3,
            "max_n": 3, "min_n": 1}
    return {**args, **change}


@pytest.mark.parametrize("change, error", BAD_MIX)
def test_mix_lookup_rejects_bad_arguments(change, error):
    with pytest.raises(error) as excinfo:
        ref.mix_lookup(**_mix_args(**change))
    _one_line(excinfo)


@pytest.mark.parametrize("change, error", BAD_LOOKUP)
def test_lookup_path_rejects_bad_arguments(change, error):
    with pytest.raises(error) as excinfo:
        ref.lookup_path(**_lookup_args(**change))
    _one_line(excinfo)
    with pytest.raises(ValueError, match="outside the history"):
        ref.lookup_path(**_lookup_args(lengths=np.int32([5])))


@pytest.mark.parametrize("change, error", BAD_RECORD)
def test_record_tokens_rejects_bad_arguments(change, error):
    args = _record_args(**change)
    before = np.array(args["history"])
    with pytest.raises(error) as excinfo:
        ref.record_tokens(**args)
    _one_line(excinfo)
    assert np.array_equal(args["history"], before)      # nothing written


def test_numba_twin_rejects_what_the_reference_rejects(gpu):
    for change, error in BAD_MIX:
        with pytest.raises(error):
            gpu.mix_lookup(**_mix_args(**change))
    for change, error in BAD_LOOKUP:
        with pytest.raises(error):
            gpu.lookup_path(**_lookup_args(**change))
    with pytest.raises(ValueError, match="outside the history"):   # NumPy lengths: checked
        gpu.lookup_path(**_lookup_args(lengths=np.int32([5])))
    for change, error in BAD_RECORD:
        with pytest.raises(error):
            gpu.record_tokens(**_record_args(**change))


# ----------------------------------------------------------------------------- the numba twin

@SIM_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), alphabet=st.integers(1, 3), H=st.integers(1, 20),
       max_n=st.integers(1, 5), min_frac=st.floats(0, 1))
def test_numba_lookup_path_is_the_references(gpu, seed, alphabet, H, max_n, min_frac):
    rng = np.random.default_rng(seed)
    min_n = 1 + int(min_frac * (max_n - 1))
    history = rng.integers(0, alphabet, (3, H)).astype(np.int32)
    lengths = rng.integers(0, H, 3).astype(np.int32)
    lengths[0] = 0
    rows = H + 2                                                # rows past every P
    got = gpu.lookup_path(history, lengths, rows, max_n, min_n)
    want = ref.lookup_path(history, lengths, rows, max_n, min_n)
    assert host(got).dtype == np.int32
    np.testing.assert_array_equal(host(got), want)


def test_numba_lookup_path_gives_minus_ones_past_the_promise_on_device(gpu):
    from numba import cuda
    history = np.int32([[1, 2, 1, 2], [1, 2, 1, 2]])
    got = gpu.lookup_path(cuda.to_device(history), cuda.to_device(np.int32([4, 3])), 3, 2, 1)
    np.testing.assert_array_equal(host(got), [[-1, -1, -1], [1, 2, -1]])


def _mix_case(seed, bs=3, R=4, k=5):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((bs, R, V)) * 2).astype(np.float32)
    lp, ids = topk_logprobs(logits, k)
    path = rng.integers(-1, V, (bs, R + 1)).astype(np.int32)
    return lp, ids, path


def _assert_mixed_like_the_reference(got_lp, got_ids, want_lp, want_ids, path):
    """ids exact; lp bit-identical but for the path token's (the device's log/exp)."""
    np.testing.assert_array_equal(got_ids, want_ids)
    is_t = want_ids == path[:, :want_ids.shape[1], None]
    assert got_lp[~is_t].tobytes() == want_lp[~is_t].tobytes()
    np.testing.assert_allclose(got_lp[is_t], want_lp[is_t], rtol=1e-6, atol=1e-6)


@SIM_EXAMPLES
@given(seed=st.integers(0, 2 ** 32 - 1), k=st.integers(1, V), w=st.floats(0.01, 0.99))
def test_numba_mix_lookup_is_the_references_in_place(gpu, seed, k, w):
    lp, ids, path = _mix_case(seed, k=k)
    want_lp, want_ids = ref.mix_lookup(lp, ids, path, w)
    got_lp, got_ids = gpu.mix_lookup(lp, ids, path, w)
    assert got_lp is lp and got_ids is ids                      # NumPy: copied back in place
    _assert_mixed_like_the_reference(lp, ids, want_lp, want_ids, path)


def test_numba_mix_lookup_ties_like_the_reference(gpu):
    for lp, ids, path, w, _ in tie_cases():
        want_lp, want_ids = ref.mix_lookup(lp, ids, path, w)
        gpu.mix_lookup(lp, ids, path, w)
        _assert_mixed_like_the_reference(lp, ids, want_lp, want_ids, path)


def test_numba_mix_lookup_writes_device_arrays_in_place(gpu):
    from numba import cuda
    lp, ids, path = _mix_case(7, bs=2, R=40, k=12)              # two chunks of rows
    want_lp, want_ids = ref.mix_lookup(lp, ids, path, 0.8)
    d_lp, d_ids = cuda.to_device(lp), cuda.to_device(ids)
    gpu.mix_lookup(d_lp, d_ids, cuda.to_device(path), 0.8)
    _assert_mixed_like_the_reference(d_lp.copy_to_host(), d_ids.copy_to_host(), want_lp,
                                     want_ids, path)


@pytest.mark.parametrize("active_dtype", [np.bool_, np.int32])
def test_numba_record_tokens_is_the_references(gpu, active_dtype):
    """Inactive requests untouched, writes clipped at H, an empty commit, on NumPy and device
    histories."""
    from numba import cuda
    rng = np.random.default_rng(3)
    bs, H, width = 4, 12, 6
    history = rng.integers(0, 50, (bs, H)).astype(np.int32)
    lengths = np.int32([2, 9, 4, 11])                           # 9, 11: clipped at H
    packed = np.full((bs, width), -1, np.int32)
    for b, m in enumerate([3, 5, 2, 0]):
        packed[b, 0] = m
        packed[b, 1:m + 1] = rng.integers(50, 99, m)
    active = np.array([1, 1, 0, 1], active_dtype)
    want = history.copy()
    ref.record_tokens(want, lengths, packed, active)
    got = history.copy()
    assert gpu.record_tokens(got, lengths, packed, active) is None
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(want, history)
    d_history = cuda.to_device(history)
    gpu.record_tokens(d_history, *(cuda.to_device(a) for a in (lengths, packed, active)))
    np.testing.assert_array_equal(d_history.copy_to_host(), want)

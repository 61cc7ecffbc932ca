"""The engine: one model forward for prefill/decode/verify, the KV cache, AR and DDTree decoding.

The central property is losslessness: at T = 0 DDTree must emit exactly the AR tokens for any
model, prompt, drafter and budget; at T > 0 every committed token must be a target sample
(checked by a chi-square statistic on the first tree-committed token, and, because both methods
draw the token at position p with the same uniform, by token equality with AR).
Everything here runs on the NumPy reference backend (exact float64 inside), except two tiny
cases on the numba kernels under the CUDA simulator.

The GPU's sync contract (docs/ENGINE.md, "Sync points") is counted here: every device-to-host
read goes through ``Backend.to_host`` or ``Backend.read_later``, which count them, so a test can
assert one read per round on any backend.
"""
from __future__ import annotations

import ctypes
import functools
import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kdtree_numba import compat
from kdtree_numba.backends import Backend, make_backend
from kdtree_numba.bundle import block_drafter_shapes, random_weights, size_config
from kdtree_numba.drafter import BlockDrafter, ModelDrafter, NoisyOracleDrafter
from kdtree_numba.drafting import TargetNeeds
from kdtree_numba.engine import generate, uniform_table
from kdtree_numba.kvcache import CacheFullError
from kdtree_numba.config import weight_shapes
from kdtree_numba.model import CACHE_BUCKET, ForwardBatch, Model, causal_mask, pad_ragged
from reference import ddtree as ref_ddtree

# Engine tests use a two-layer variant of the tiny config (one dense + one MoE layer, YaRN,
# n_group > 1): every code path at half the cost.
TINY2 = dict(num_hidden_layers=2)


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, **overrides) -> Model:
    cfg = size_config("tiny", **dict(TINY2, **overrides))
    return Model(cfg, dict(random_weights(cfg, seed)), "reference")


@functools.lru_cache(maxsize=None)
def tiny_drafter_model(seed: int = 0) -> Model:
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1, hidden_size=32,
                      intermediate_size=48)
    return Model(cfg, dict(random_weights(cfg, seed + 100)), "reference")


@functools.lru_cache(maxsize=None)
def tiny_block_drafter_parts(seed: int = 0):
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=1, hidden_size=32,
                      intermediate_size=48)
    shapes = dict(weight_shapes(cfg), **block_drafter_shapes(cfg, 64))
    weights = dict(random_weights(cfg, seed + 200, shapes))
    return (Model(cfg, weights, "reference"), weights["block/target_proj"],
            weights["block/mask_embedding"])


def make_drafter(kind: str, target: Model, block_len: int, seed: int):
    if kind == "model":
        return ModelDrafter(tiny_drafter_model(seed), block_len)
    if kind == "block":
        return BlockDrafter(*tiny_block_drafter_parts(seed), block_len=block_len)
    # sharpness 8 puts the budget into depth (chains); 1.5 leaves bushy trees whose accepted
    # paths skip slots, so compaction really moves rows
    agreement, sharpness = {"oracle0": (0.0, 8.0), "oracle_half": (0.5, 8.0),
                            "oracle1": (1.0, 8.0), "oracle_bushy": (0.9, 1.5)}[kind]
    return NoisyOracleDrafter(target, block_len, agreement, seed=seed, sharpness=sharpness)


def path_to(tree, b: int, node: int) -> list[int]:
    """Slots from the root's first child down to ``node`` (root excluded)."""
    path = []
    while node > 0:
        path.append(node)
        node = int(tree.parent[b, node])
    return path[::-1]


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("overrides", [
    {},                                                  # q_lora, YaRN, n_group 4, sigmoid
    {"q_lora_rank": None, "tie_word_embeddings": True, "rope_scaling": None},
    {"scoring_func": "softmax", "n_group": 1, "topk_group": 1, "rope_interleave": False,
     "n_shared_experts": 0, "first_k_dense_replace": 0},
])
def test_prefill_then_decode_equals_score(overrides):
    model = tiny_model(1, **overrides)
    prompts = [np.array([5, 9, 100, 3, 77, 1, 64]), np.array([42, 8, 8])]
    full = [np.concatenate([p, [11, 12, 13]]) for p in prompts]
    cache = model.new_cache(2, 16)
    n = max(p.size for p in prompts)
    tokens = np.zeros((2, n), np.int64)
    for b, p in enumerate(prompts):
        tokens[b, :p.size] = p
    logits = model.forward(ForwardBatch(
        tokens, np.tile(np.arange(n), (2, 1)), causal_mask(n, 2)), cache)
    cache.advance([p.size for p in prompts])
    rows = [[logits[b, :p.size]] for b, p in enumerate(prompts)]
    for step in range(3):
        tok = np.array([[11 + step], [11 + step]])
        out = model.forward(ForwardBatch(
            tok, cache.lengths[:, None].copy(), np.ones((2, 1, 1), bool)), cache)
        cache.advance(1)
        for b in range(2):
            rows[b].append(out[b])
    for b in range(2):
        want = model.score(full[b])
        got = np.concatenate(rows[b])
        # float64 inside, float32 out: only the final rounding of differently shaped sums differs
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_logit_rows_give_each_requests_row_of_the_full_forward_and_prefill_uses_them():
    """forward(logit_rows=r): logits [bs, 1, V] equal row r[b] of the full forward's (the
    reference computes rows independently: bit for bit); prefill takes each request's last
    token that way and returns what the full forward's last rows were.  Bad rows are a
    ValueError."""
    model = tiny_model(3)
    prompts = [np.array([5, 9, 100, 3, 77]), np.array([42, 8])]
    ids, lengths, visible = pad_ragged(prompts)
    positions = np.tile(np.arange(ids.shape[1]), (2, 1))
    full = model.forward(ForwardBatch(ids, positions, visible), model.new_cache(2, 8))
    picked = model.forward(ForwardBatch(
        ids, positions, visible, logit_rows=lengths - 1), model.new_cache(2, 8))
    assert picked.shape == (2, 1, model.vocab_size)
    for b in range(2):
        assert picked[b, 0].tobytes() == full[b, lengths[b] - 1].tobytes()
    last = model.prefill(model.new_cache(2, 8), prompts)
    assert last.tobytes() == picked[:, 0].tobytes()
    for bad in ([0], [0, 5], [-1, 0], [0.0, 1.0]):
        with pytest.raises(ValueError, match="logit_rows"):
            model.forward(ForwardBatch(
                ids, positions, visible, logit_rows=bad), model.new_cache(2, 8))


def test_logit_span_gives_those_rows_of_the_full_forward():
    """forward(logit_span=(a, b)): logits [bs, b - a, V] equal rows a..b-1 of the full
    forward's, bit for bit on the reference; a span out of range, empty, or with logit_rows
    is a ValueError."""
    model = tiny_model(3)
    ids, _, visible = pad_ragged([np.array([5, 9, 100, 3, 77]), np.array([42, 8, 1, 2, 3])])
    positions = np.tile(np.arange(5), (2, 1))
    full = model.forward(ForwardBatch(ids, positions, visible), model.new_cache(2, 8))
    part = model.forward(ForwardBatch(ids, positions, visible, logit_span=(1, 4)),
                         model.new_cache(2, 8))
    assert part.shape == (2, 3, model.vocab_size)
    assert part.tobytes() == np.ascontiguousarray(full[:, 1:4]).tobytes()
    for bad, rows in (((2, 2), None), ((0, 6), None), ((-1, 2), None), ((0, 1, 2), None),
                      ((0, 2), [0, 0])):
        with pytest.raises(ValueError, match="logit_span"):
            model.forward(ForwardBatch(ids, positions, visible, logit_span=bad,
                                       logit_rows=rows), model.new_cache(2, 8))


def test_score_leaves_no_state_and_depends_on_prefix():
    model = tiny_model(2)
    a = model.score([1, 2, 3, 4])
    b = model.score([1, 2, 3, 4])
    np.testing.assert_array_equal(a, b)
    c = model.score([7, 2, 3, 4])
    assert np.abs(c[-1] - a[-1]).max() > 1e-3        # attention really sees the prefix
    assert a.dtype == np.float32 and a.shape == (4, model.vocab_size)


def test_verify_rows_equal_sequential_paths_and_compaction_equals_prefill():
    """The DDTree invariant: row i of one tree-verify forward equals the logits of the plain
    sequence prefix + root->i; after compaction the cache equals a prefill of the accepted
    sequence."""
    model = tiny_model(3)
    rng = np.random.default_rng(0)
    prefix = np.array([4, 90, 17, 33, 2])
    root = 61
    lp, ids = ref_ddtree.topk_logprobs(rng.normal(size=(1, 3, model.vocab_size))
                                       .astype(np.float32) * 2, 4)
    tree = ref_ddtree.build_tree(lp, ids, 9)
    vin = ref_ddtree.compile_tree(tree, np.array([root]), np.array([prefix.size]))
    cache = model.new_cache(1, 32)
    model.forward(ForwardBatch(
        prefix[None], np.arange(prefix.size)[None], causal_mask(prefix.size)), cache)
    cache.advance(prefix.size)
    logits = model.forward(ForwardBatch(vin.input_ids, vin.positions, vin.visible), cache)
    for node in range(int(tree.n_nodes[0]) + 1):
        seq = np.concatenate([prefix, [root], tree.token[0, path_to(tree, 0, node)]])
        np.testing.assert_allclose(logits[0, node], model.score(seq)[-1], rtol=0, atol=2e-5)
    deepest = int(np.argmax(tree.depth[0]))
    acc = [0] + path_to(tree, 0, deepest)
    acc_idx = np.full((1, tree.max_depth + 1), -1, np.int32)
    acc_idx[0, :len(acc)] = acc
    acc_len = np.array([len(acc)], np.int32)
    cache.commit_tree(model.backend.ops, acc_idx, acc_len, acc_len)
    seq = np.concatenate([prefix, [root], tree.token[0, acc[1:]]])
    assert cache.lengths[0] == seq.size
    fresh = model.new_cache(1, 32)
    model.forward(ForwardBatch(seq[None], np.arange(seq.size)[None], causal_mask(seq.size)), fresh)
    np.testing.assert_allclose(cache.c[:, 0, :seq.size], fresh.c[:, 0, :seq.size], atol=1e-6)
    np.testing.assert_allclose(cache.k_pe[:, 0, :seq.size], fresh.k_pe[:, 0, :seq.size],
                               atol=1e-6)


def test_generation_cache_is_reused_by_the_next_generation():
    """generate() keeps its cache (capacity in CACHE_BUCKET steps) for the next call of the
    same batch size and bucket, emptied, so CUDA graphs captured against it replay; the
    tokens do not depend on it; a ModelDrafter reuses its own cache the same way."""
    model = tiny_model(0)
    drafter = ModelDrafter(tiny_model(3), 3)
    want = generate(model, [[1, 2, 3]], 6).tokens
    cache = model.generation_cache
    assert cache.max_len % CACHE_BUCKET == 0 and cache.max_len >= 3 + 6
    dd = generate(model, [[1, 2, 3]], 6, method="ddtree", drafter=drafter, budget=4)
    assert dd.tokens == want and model.generation_cache is cache
    assert dd.stats.graph_replays is None          # no CUDA graphs off the GPU
    drafter_cache = drafter.cache
    assert generate(model, [[1, 2, 3]], 6, method="ddtree", drafter=drafter,
                    budget=4).tokens == want
    assert model.generation_cache is cache and drafter.cache is drafter_cache
    generate(model, [[1, 2], [3]], 2)                       # another batch size: a new cache
    assert model.generation_cache is not cache and model.generation_cache.batch == 2
    big = generate(model, [[1]], CACHE_BUCKET + 1)       # a larger bucket: a new cache
    assert model.generation_cache.max_len == 2 * CACHE_BUCKET and len(big.tokens[0]) > 0


def test_generation_caches_are_kept_per_bucket_and_owner():
    """Prompts alternating between capacity buckets get back their bucket's cache each time
    (each cache's CUDA graphs replay only on it), the engine's and a drafter's caches never
    mix on one model, the least recently used goes beyond GENERATION_CACHES of an owner, and
    ``generation_cache = None`` drops them all."""
    from kdtree_numba.model import GENERATION_CACHES
    model = tiny_model(0)
    small, large = (model.cache_for_generation(1, n) for n in (10, CACHE_BUCKET + 10))
    assert small.max_len == CACHE_BUCKET and large.max_len == 2 * CACHE_BUCKET
    small.advance(np.array([5]))
    assert model.cache_for_generation(1, 20) is small and small.lengths.tolist() == [0]
    assert model.cache_for_generation(1, CACHE_BUCKET + 1) is large
    assert model.generation_cache is large
    mine = model.cache_for_generation(1, 10, owner="drafter")
    assert mine is not small and model.cache_for_generation(1, 10, owner="drafter") is mine
    more = [model.cache_for_generation(1, CACHE_BUCKET * k)
            for k in range(3, 3 + GENERATION_CACHES)]
    assert model.cache_for_generation(1, 10) is not small          # the oldest went
    assert model.cache_for_generation(1, 10, owner="drafter") is mine   # another owner's stays
    assert model.cache_for_generation(1, CACHE_BUCKET * (2 + GENERATION_CACHES)) is more[-1]
    model.generation_cache = None
    assert model.generation_cache is None
    assert model.cache_for_generation(1, 10, owner="drafter") is not mine


def test_cache_full_raises_naming_request_and_never_overwrites():
    model = tiny_model(0)
    cache = model.new_cache(2, 8)
    model.forward(ForwardBatch(
        np.zeros((2, 3), np.int64), np.tile(np.arange(3), (2, 1)), causal_mask(3, 2)), cache)
    cache.advance([3, 6])
    before = (cache.c.copy(), cache.k_pe.copy())
    with pytest.raises(CacheFullError, match=r"request 1 holds 6 tokens and needs 3 more.*"
                                             r"max_len is 8"):
        model.forward(ForwardBatch(
            np.ones((2, 3), np.int64), cache.lengths[:, None] + np.arange(3), causal_mask(3, 2)),
            cache)
    np.testing.assert_array_equal(cache.c, before[0])
    np.testing.assert_array_equal(cache.k_pe, before[1])
    assert cache.nbytes == before[0].nbytes + before[1].nbytes
    assert cache.bytes_per_token() == 4 * 2 * (32 + 8)   # 2 layers x (r + dr) float32


# ----------------------------------------------------------------------------- losslessness

prompt_lists = st.lists(st.lists(st.integers(0, 127), min_size=1, max_size=6),
                        min_size=1, max_size=2)


@settings(max_examples=20)
@given(seed=st.integers(0, 3), prompts=prompt_lists,
       drafter=st.sampled_from(["oracle0", "oracle_half", "oracle1", "oracle_bushy", "model",
                                "block"]),
       budget=st.sampled_from([1, 3, 8, 24]), block_len=st.integers(1, 4),
       max_new=st.integers(1, 9))
def test_ddtree_greedy_equals_ar(seed, prompts, drafter, budget, block_len, max_new):
    model = tiny_model(seed)
    ar = generate(model, prompts, max_new)
    dd = generate(model, prompts, max_new, method="ddtree",
                  drafter=make_drafter(drafter, model, block_len, seed), budget=budget)
    assert dd.tokens == ar.tokens
    assert all(len(t) == max_new for t in dd.tokens)
    assert all(1 <= a <= block_len + 1 for r in dd.stats.tau for a in r)


def test_perfect_and_zero_agreement_acceptance_lengths():
    model = tiny_model(0)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    L = 4
    ar = generate(model, prompts, 15)
    perfect = generate(model, prompts, 15, method="ddtree", budget=8,
                       drafter=make_drafter("oracle1", model, L, 0))
    zero = generate(model, prompts, 15, method="ddtree", budget=8,
                    drafter=make_drafter("oracle0", model, L, 0))
    assert perfect.tokens == ar.tokens == zero.tokens
    # perfect: every full round accepts the whole chain (L nodes + bonus); rounds that finish a
    # request can be cut short only by max_new_tokens
    assert all(a == L + 1 for a in perfect.stats.tau[0])
    assert perfect.stats.rounds == math.ceil((15 - 1) / (L + 1))
    # zero: the target's greedy token is never in the top-8 of a noisy row
    assert all(a == 1 for r in zero.stats.tau for a in r)
    assert zero.stats.rounds == 14


def test_eos_stops_one_request_while_the_batch_continues():
    model = tiny_model(1)
    prompts = [[10, 20, 30], [40, 50]]
    free = generate(model, prompts, 12).tokens
    eos = free[0][3]
    cut = free[0].index(eos) + 1
    for method, kw in (("ar", {}), ("ddtree", {"drafter": make_drafter("oracle_half", model,
                                                                       3, 1), "budget": 6})):
        out = generate(model, prompts, 12, method=method, eos=eos, **kw).tokens
        assert out[0] == free[0][:cut]
        want1 = free[1][:free[1].index(eos) + 1] if eos in free[1] else free[1]
        assert out[1] == want1


@settings(max_examples=4)
@given(seed=st.integers(0, 3), temperature=st.sampled_from([0.5, 1.0, 2.0]),
       drafter=st.sampled_from(["oracle_half", "oracle1", "model"]))
def test_sampled_ddtree_equals_sampled_ar_for_one_seed(seed, temperature, drafter):
    """Both methods draw the token at position p with U_b[p]: same tokens, any temperature."""
    model = tiny_model(seed)
    prompts = [[7, 7, 7], [1, 2, 3, 4]]
    ar = generate(model, prompts, 8, temperature=temperature, seed=seed)
    dd = generate(model, prompts, 8, method="ddtree", temperature=temperature, seed=seed,
                  drafter=make_drafter(drafter, model, 3, seed), budget=6)
    assert dd.tokens == ar.tokens
    other = generate(model, prompts, 8, temperature=temperature, seed=seed + 1)
    assert other.tokens != ar.tokens                  # the seed really drives the samples


def test_block_drafter_gets_the_hidden_state_that_chose_the_root():
    """The BlockDrafter's conditioning must be the target's final hidden state at the last
    committed position (the row whose logits picked the root), after prefill and after every
    round, whatever was accepted."""
    model = tiny_model(1)
    seen = []
    oracle = NoisyOracleDrafter(model, 3, agreement=0.9, seed=0, sharpness=1.5)

    class Spy(BlockDrafter):
        """Records the conditioning it is committed and the roots' positions it is asked
        about; drafts with the oracle (bushy, partly accepted trees), so it needs what both
        need."""
        needs = TargetNeeds(hidden=True, tokens=True)

        def start(self, batch, max_len):
            super().start(batch, max_len)
            oracle.start(batch, max_len)

        def on_commit(self, commit):
            super().on_commit(commit)
            oracle.on_commit(commit)

        def propose(self, ctx):
            seen.append((np.array(ctx.positions), np.array(self.hidden)))
            super().propose(ctx)
            return oracle.propose(ctx)

    mixed = Spy(*tiny_block_drafter_parts(0), block_len=3)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    res = generate(model, prompts, 10, method="ddtree", drafter=mixed, budget=8)
    assert res.tokens == generate(model, prompts, 10).tokens
    assert any(a > 1 for r in res.stats.tau for a in r)
    assert len(seen) == res.stats.rounds
    for positions, hidden in seen:
        for b, root_at in enumerate(positions):
            h = np.array(list(prompts[b]) + res.tokens[b])[:root_at + 1]   # up to the root
            if root_at + 1 - len(prompts[b]) >= 10:    # finished: no longer updated
                continue
            cache = model.new_cache(1, h.size)
            _, want = model.forward(ForwardBatch(
                h[None, :-1], np.arange(h.size - 1)[None], causal_mask(h.size - 1),
                return_hidden=True), cache)
            np.testing.assert_allclose(hidden[b], want[0, -1], rtol=0, atol=2e-5)


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic, pooling categories with expected count < 5 into one bin."""
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def _chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is p = 1e-4."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_first_tree_token_follows_the_target_distribution():
    """Chi-square of the first token committed by a DDTree round (position P + 1) over 600
    independent requests against the exact target marginal sum_t0 p(t0) p(t1 | t0)."""
    model = tiny_model(2)
    T, n_req = 1.0, 600
    prompt = [12, 5, 77]
    # a noisy drafter with a sharp greedy chain: trees of depth > 1 and many rejections
    drafter = NoisyOracleDrafter(model, 3, agreement=0.5, seed=4, sharpness=4.0)
    res = generate(model, [prompt] * n_req, 2, method="ddtree", drafter=drafter, budget=6,
                   temperature=T, seed=11)
    first = np.array([t[1] for t in res.tokens])
    V = model.vocab_size

    def softmax(x):
        z = np.exp((x - x.max(-1, keepdims=True)) / T)
        return z / z.sum(-1, keepdims=True)
    p0 = softmax(model.score(prompt)[-1].astype(np.float64))
    p1 = np.zeros(V)
    for t0 in range(V):
        p1 += p0[t0] * softmax(model.score(prompt + [t0])[-1].astype(np.float64))
    counts = np.bincount(first, minlength=V)
    stat, df = _chi_square(counts, p1)
    assert stat < _chi_square_critical(df), (stat, df)
    # the statistic can fail: the same samples against the position-P distribution do
    wrong, wdf = _chi_square(counts, p0)
    assert wrong > _chi_square_critical(wdf), (wrong, wdf)
    assert any(a > 1 for r in res.stats.tau for a in r)   # trees were accepted, not just roots


def test_uniform_tables_are_prefix_stable_per_request():
    a = uniform_table(5, 1, 100)
    np.testing.assert_array_equal(a[:40], uniform_table(5, 1, 40))
    assert not np.array_equal(a[:40], uniform_table(5, 0, 40))


def test_generate_rejects_bad_input():
    model = tiny_model(0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], 3)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 128]], 3)
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(model, [[1]], 3, method="ddtree")
    with pytest.raises(ValueError, match="method"):
        generate(model, [[1]], 3, method="beam")
    wrong_vocab = Model(size_config("tiny", vocab_size=64, num_hidden_layers=1),
                        dict(random_weights(size_config("tiny", vocab_size=64,
                                                        num_hidden_layers=1))), "reference")
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, [[1]], 3, method="ddtree", drafter=ModelDrafter(wrong_vocab, 2))
    assert generate(model, [[1, 2]], 0).tokens == [[]]


# ----------------------------------------------------------------------------- CLI

def test_cli_run_default_model_json(capsys):
    from kdtree_numba.cli import run_main
    assert run_main(["--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json",
                     "--backend", "reference"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert run_main(["--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json",
                     "--backend", "reference", "--method", "ddtree", "--budget", "4",
                     "--block-len", "3"]) == 0
    dd = json.loads(capsys.readouterr().out)
    assert len(ar["tokens"][0]) == 5 and dd["tokens"] == ar["tokens"]
    assert dd["stats"]["method"] == "ddtree" and dd["stats"]["rounds"] >= 1


def test_cli_make_model_then_run_with_drafter_bundle(tmp_path, capsys):
    from kdtree_numba.cli import make_model_main, run_main
    target, draft = str(tmp_path / "t.kdtr"), str(tmp_path / "d.kdtr")
    assert make_model_main([target, "--size", "tiny", "--seed", "3"]) == 0
    assert make_model_main([draft, "--size", "tiny", "--drafter", "--seed", "3"]) == 0
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("1,2,3\n4 5\n")
    common = ["--model", target, "--prompt-file", str(prompt_file), "--max-new-tokens", "4",
              "--backend", "reference"]
    assert run_main(common) == 0
    ar = capsys.readouterr().out.split()
    assert run_main(common + ["--method", "ddtree", "--drafter", draft, "--budget", "5"]) == 0
    assert capsys.readouterr().out.split() == ar and len(ar) == 2
    block = str(tmp_path / "b.kdtr")
    assert make_model_main([block, "--size", "tiny", "--block-drafter"]) == 0
    assert run_main(common + ["--method", "ddtree", "--drafter", block, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [",".join(map(str, t)) for t in out["tokens"]] == ar
    assert out["stats"]["block_len"] == 7
    assert run_main(["--model", str(tmp_path / "missing.kdtr")]) == 2


# ----------------------------------------------------------------------------- numba backend

@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba backend runs here only in the "
                    "CUDA simulator (the GPU twin of this test is in test_engine_gpu.py)")
def test_numba_backend_matches_reference_in_simulator(needs_kernels):
    """One very tiny model (one MoE layer) through the numba kernels: logits close to the
    reference, and a DDTree generation (prefill + one verify round) equal to reference AR.
    The simulator's forwards are the cost (mostly moe_ffn), so the drafter is an oracle over
    the *reference* model (same weights, NumPy arrays either way), and the MoE layer is narrow
    (D 16, V 32, 4 experts in 2 groups, a shared expert): ~7 s on 2 cores."""
    cfg = size_config("tiny", num_hidden_layers=1, first_k_dense_replace=0, vocab_size=32,
                      hidden_size=16, intermediate_size=16, moe_intermediate_size=16,
                      q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=8, num_attention_heads=2, n_routed_experts=4, n_group=2,
                      topk_group=1)
    weights = dict(random_weights(cfg, 0))
    ref = Model(cfg, weights, "reference")
    sim = Model(cfg, weights, "numba")
    seq = [3, 9, 27, 17]
    # float32 kernels vs the float64 reference, O(1) logits (measured 8e-7)
    np.testing.assert_allclose(sim.score(seq), ref.score(seq), rtol=0, atol=1e-4)
    dd, reads, syncs = counted([sim.backend], lambda: generate(
        sim, [seq], 3, method="ddtree", budget=2,
        drafter=NoisyOracleDrafter(ref, 2, agreement=1.0, sharpness=8.0)))
    assert dd.tokens == generate(ref, [seq], 3).tokens
    assert dd.stats.rounds == 1 and dd.stats.tau == [[3]]
    # greedy acceptance on the numba kernels' outputs: one read for prefill, one for the round
    # (the oracle reads too, but on the reference backend it drafts with)
    assert reads == 2 and syncs == 1


# ----------------------------------------------------------------------------- host syncs

def counted(backends, fn):
    """(fn(), device->host reads, full syncs) made by ``fn`` on the distinct ``backends``."""
    distinct = list({id(b): b for b in backends}.values())
    before = [(b.reads, b.syncs) for b in distinct]
    out = fn()
    reads = sum(b.reads - r for b, (r, _) in zip(distinct, before))
    syncs = sum(b.syncs - s for b, (_, s) in zip(distinct, before))
    return out, reads, syncs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("drafter", ["model", "block"])
def test_every_round_reads_the_device_once(drafter, temperature):
    """The GPU contract, counted: prefill reads its first tokens once, every DDTree round and
    every AR step reads once more (the packed acc_len + committed tokens), nothing else reads,
    and the only full synchronisation is the one that ends generate().  Ragged batch, a
    finished request riding along (eos), partly accepted trees."""
    model = tiny_model(1)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    ar, ar_reads, ar_syncs = counted([model.backend], lambda: generate(
        model, prompts, 9, temperature=temperature, seed=2))
    assert ar_reads == 1 + ar.stats.rounds and ar_syncs == 1
    eos = ar.tokens[1][2]                    # request 1 stops after 3 tokens
    want = generate(model, prompts, 9, temperature=temperature, seed=2, eos=eos).tokens
    d = make_drafter(drafter, model, 3, 0)
    dd, reads, syncs = counted([model.backend, d.model.backend], lambda: generate(
        model, prompts, 9, method="ddtree", drafter=d, budget=6, temperature=temperature,
        seed=2, eos=eos))
    assert dd.tokens == want
    assert dd.stats.rounds >= 3 and len(want[1]) < len(want[0])
    assert reads == 1 + dd.stats.rounds, (reads, dd.stats.rounds)
    assert syncs == 1


def test_ar_runs_one_step_ahead_and_rolls_back_the_step_eos_made_extra():
    """AR launches step j + 1 on step j's tokens before reading them (engine._ar_steps): the
    tokens are those of a one-step-at-a-time greedy loop over Model.forward; a request that
    eos finishes ran one step too many, whose cache slot is rolled back (the cache holds
    len(seq) - 1 tokens of every request), while one that max_new_tokens finishes runs no
    extra step."""
    model = tiny_model(1)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]

    def greedy(prompt, n):                     # the oracle: full forwards, no cache reuse
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(np.argmax(model.score(seq)[-1])))
        return seq[len(prompt):]

    full = generate(model, prompts, 9)
    assert full.tokens == [greedy(p, 9) for p in prompts]
    assert full.stats.rounds == 8                                 # max_new: nothing extra
    eos = full.tokens[1][2]
    stop = [toks[:toks.index(eos) + 1] if eos in toks else toks for toks in full.tokens]
    assert len(stop[1]) == 3
    res = generate(model, prompts, 9, eos=eos)
    assert res.tokens == stop
    cache = model.generation_cache
    assert cache.lengths.tolist() == [len(p) + len(t) - 1 for p, t in zip(prompts, stop)]
    one = generate(model, prompts[1:], 9, eos=eos)                # batch 1: eos at token 3
    assert one.tokens == stop[1:] and one.stats.rounds == 3       # steps 1, 2 and the extra
    assert model.generation_cache.lengths.tolist() == [len(prompts[1]) + 2]


def test_ddtree_reports_each_round_while_the_next_one_verifies():
    """A DDTree round's progress and stream calls come once the next round's verify is
    launched (the last round's after the loop): one per round plus the prefill's, each with
    the tokens committed by the end of its round."""
    model = tiny_model(0)
    events, seen = [], []
    forward = model.forward

    def spy_forward(batch, cache, **kw):
        if batch.causal and not batch.prefill:
            events.append("verify")
        return forward(batch, cache, **kw)
    model.forward = spy_forward
    res = generate(model, [[1, 2, 3], [4, 5]], 9, method="ddtree", budget=4,
                   drafter=make_drafter("oracle_half", model, 3, 1),
                   progress=lambda done, total: events.append(done),
                   stream=lambda tokens: seen.append([len(t) for t in tokens]))
    rounds = res.stats.rounds
    assert rounds >= 3 and events.count("verify") == rounds
    reports = [e for e in events if e != "verify"]
    lens, committed = [1, 1], [2]                  # the prefill commits one token each
    for taus in res.stats.tau:                     # acc_len of the requests still running
        running = [b for b in range(2) if lens[b] < 9]
        for b, tau in zip(running, taus):
            lens[b] = min(9, lens[b] + tau)
        committed.append(sum(lens))
    assert reports == committed and seen[-1] == [len(t) for t in res.tokens]
    # after the prefill's report: verify 1, verify 2, report 1, verify 3, report 2, ...
    assert events[:4] == [2, "verify", "verify", committed[1]]
    for r in range(2, rounds):
        at = events.index("verify", events.index(committed[r - 1]) + 1)
        assert events[at + 1] == committed[r]


def test_phase_times_cover_the_rounds():
    """Marker timing (no syncs) still splits the time: every phase of a DDTree round is
    charged, and the phases sum to at most the wall time."""
    model = tiny_model(0)
    res = generate(model, [[1, 2, 3]], 6, method="ddtree", budget=4,
                   drafter=make_drafter("model", model, 2, 0))
    t = res.stats.time
    assert all(t[p] > 0 for p in ("prefill", "draft", "tree_build", "verify", "accept",
                                  "compaction"))
    assert t["decode"] == 0 and sum(t.values()) <= res.stats.seconds


class _DeviceArray(np.ndarray):
    """A NumPy array with CuPy's ``data.ptr`` (FakeCupy's device arrays)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


class FakeCupy:
    """NumPy posing as CuPy, to run the GPU-only branches of Backend (event markers, asnumpy,
    read_later's pinned copy) on this machine.  Its events model the device's ordering: one
    recorded is unfinished until the host next waits (``asnumpy``, ``Device().synchronize()``,
    ``Event.synchronize()``), and timing an unfinished one fails, as ``cudaEventElapsedTime``
    does.  An asynchronous copy lands only then too, so a host that reads its pinned buffer
    before waiting reads zeros."""

    def __init__(self):
        self.events_made, self.unfinished, self.copies = 0, [], []
        fake = self

        class Event:
            def __init__(self, block=False, disable_timing=False):
                fake.events_made += 1
                self.t, self.done = None, False

            def record(self, stream=None):
                self.t, self.done = time.perf_counter(), False
                fake.unfinished.append(self)

            def synchronize(self):
                fake.drain()

        def get_elapsed_time(start, end):
            assert start.done and end.done, "timed an event the device had not reached"
            return 1e3 * (end.t - start.t)

        def memcpy_async(dst, src, nbytes, kind, stream):
            assert kind == 2 and stream == 0          # device to host, the legacy stream
            source = fake.sources[src]                # kept alive until the copy lands
            fake.copies.append(lambda: ctypes.memmove(dst, source.ctypes.data, nbytes))
        self.sources = {}
        runtime = SimpleNamespace(memcpyAsync=memcpy_async, memcpyDeviceToHost=2)
        self.cuda = SimpleNamespace(Event=Event, get_elapsed_time=get_elapsed_time,
                                    Device=lambda: SimpleNamespace(synchronize=self.drain),
                                    Stream=SimpleNamespace(null=0), runtime=runtime,
                                    alloc_pinned_memory=bytearray)

    def ascontiguousarray(self, a):
        out = np.ascontiguousarray(a).view(_DeviceArray)
        self.sources[out.ctypes.data] = out
        return out

    def drain(self):
        for copy in self.copies:
            copy()
        self.copies.clear()
        self.sources.clear()
        for event in self.unfinished:
            event.done = True
        self.unfinished.clear()

    def asnumpy(self, a):
        self.drain()
        return np.asarray(a)

    def __getattr__(self, name):
        return getattr(np, name)


def test_gpu_timing_path_reuses_a_few_events_and_never_waits():
    """The GPU branches of the marker clock on a fake device: phases are timed from events
    resolved only once the device has passed them (the fake fails otherwise), a handful of
    events serve 20+ rounds, and the sync budget holds."""
    fake = FakeCupy()
    be = Backend("reference", fake, make_backend("reference").ops, on_gpu=True)
    base = tiny_model(2)
    model = Model(base.config, dict(random_weights(base.config, 2)), be)
    drafter = ModelDrafter(Model(tiny_drafter_model(0).config,
                                 dict(random_weights(tiny_drafter_model(0).config, 100)), be), 3)
    prompts = [[4, 5, 6], [7]]
    res, reads, syncs = counted([be], lambda: generate(
        model, prompts, 24, method="ddtree", drafter=drafter, budget=5, temperature=0.5))
    assert res.tokens == generate(base, prompts, 24, temperature=0.5).tokens
    assert res.stats.rounds >= 10 and reads == 1 + res.stats.rounds and syncs == 1
    # a round's markers (5) are settled while the next round verifies: two rounds' worth,
    # plus the clock's last, are ever alive at once
    assert fake.events_made <= 2 * 5 + 1
    t = res.stats.time
    assert all(t[p] > 0 for p in ("prefill", "draft", "tree_build", "verify", "accept",
                                  "compaction"))
    assert sum(t.values()) <= res.stats.seconds


def test_ar_one_step_ahead_reads_each_steps_pinned_copy_after_waiting_for_it():
    """AR on the fake device, where read_later's copy lands only when the host waits (a read
    of the pinned buffer before its wait would see zeros): tokens, cache lengths and the
    read count equal the reference backend's, in a ragged batch that eos and max_new_tokens
    finish at different steps, at T = 0 and 0.7."""
    fake = FakeCupy()
    be = Backend("reference", fake, make_backend("reference").ops, on_gpu=True)
    base = tiny_model(1)
    model = Model(base.config, dict(random_weights(base.config, 1)), be)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], [3]]
    for temperature in (0.0, 0.7):
        full = generate(base, prompts, 8, temperature=temperature, seed=3)
        eos = full.tokens[1][2]
        want = generate(base, prompts, 8, temperature=temperature, seed=3, eos=eos)
        assert any(len(t) < 8 for t in want.tokens) and any(len(t) == 8 for t in want.tokens)
        got, reads, syncs = counted([be], lambda: generate(
            model, prompts, 8, temperature=temperature, seed=3, eos=eos))
        assert got.tokens == want.tokens
        assert model.generation_cache.lengths.tolist() == \
            base.generation_cache.lengths.tolist()
        assert reads == 1 + got.stats.rounds and syncs == 1


# One dense layer, one head, V 16, D 8, r 8: a cheap model for the simulator (its simulated
# blocks scale with the widths; tests/launch_counter.py's SMALL_TARGET runs the same widths).
SIM_TINY = dict(num_hidden_layers=1, first_k_dense_replace=1, vocab_size=16, hidden_size=8,
                intermediate_size=8, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, num_attention_heads=1)


@pytest.mark.skipif(not compat.SIMULATOR, reason="the numba backend runs here only in the "
                    "CUDA simulator (the GPU twin of this test is in test_engine_gpu.py)")
def test_numba_sampled_round_reads_the_device_once_in_simulator(needs_kernels):
    """The numba kernels' outputs (their dtypes and padding values) through the device-side
    packing, the uniform gather (T > 0) and a ModelDrafter whose greedy tokens never leave the
    device: one read for prefill, one for the round, and the reference model's AR tokens.
    Two new tokens make exactly one round: 4 simulated forwards, ~20 s.  (T = 0 on the numba
    kernels is counted in the test above; the drafter is greedy at any T; the multi-round
    drafter resync is covered on the reference backend above and on the GPU.)"""
    temperature = 0.8
    cfg = size_config("tiny", **SIM_TINY)
    weights = dict(random_weights(cfg, 0))
    backend = make_backend("numba")
    target = Model(cfg, weights, backend)
    drafter = ModelDrafter(Model(cfg, dict(random_weights(cfg, 1)), backend), 2)
    prompts = [[3, 9]]
    dd, reads, syncs = counted([backend], lambda: generate(
        target, prompts, 2, method="ddtree", drafter=drafter, budget=3,
        temperature=temperature, seed=1))
    want = generate(Model(cfg, weights, "reference"), prompts, 2, temperature=temperature,
                    seed=1).tokens
    assert dd.tokens == want and dd.stats.rounds == 1
    assert reads == 2 and syncs == 1


def test_a_model_owns_its_attention_plans_and_starts_fresh_ones_before_a_capture():
    """Plans (split counts, kernels, scratch) belong to the model that made them (no global
    cache to clear): the model's forwards fill its own PlanCache, a capture's hook gives it
    a new one, and the cache drops its least recently used plan past its capacity."""
    from kdtree_numba.attention import PlanCache
    model = tiny_model(0)
    first = model.attention_plans
    assert isinstance(first, PlanCache)
    model.fresh_attention_plans()
    assert model.attention_plans is not first and len(model.attention_plans) == 0
    plans = PlanCache(capacity=2)
    made = [plans.plan((1, n, 1, 8, 4, 16), 16, None, "pipe16x2", False, False, None, False)
            for n in (1, 2, 3)] if compat.kernels_runnable() else []
    if made:
        assert len(plans) == 2
        assert plans.plan((1, 3, 1, 8, 4, 16), 16, None, "pipe16x2", False, False, None,
                          False) is made[2]

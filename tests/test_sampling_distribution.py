"""Sampled generation follows the target's own distribution: AR, the chain and DDTree at T > 0,
with and without top-p and top-k, against the exact distribution of a tiny model's first three
new tokens (issue 37, item 3).

The exact distribution is enumerated from the model's own logits (``Model.score``) with the
truncation written here from its definition (docs/DDTREE.md, "Sampling"), not with the code
under test.  The samples are the three tokens of N requests of one batch (each request draws
with its own uniforms, ``uniform_table(seed, b)``: N independent samples from one
``generate``).  The check is Pearson's chi-square over the 3-token sequences, cells enumerated
as a tree: every prefix whose expected count is >= 5 is split by its next token, the rest of
each level's mass pooled into one cell, so every cell expects >= 5.

False-alarm rate: the threshold is the chi-square quantile at ``ALPHA`` = 1e-4 (Wilson-Hilferty
approximation, accurate to a few percent of alpha at these degrees of freedom), so a correct
sampler fails one configuration with probability ~1e-4 (the fast set's 8 checks, 2 of them
on the float32 CPU path: ~8e-4; the slow grid's 16: ~1.6e-3; the `gpu` set's 9, on the numba
backend: ~9e-4).  The seeds are fixed, so a passing run stays passing.  Power: the same
statistic must reject AR's top-p 0.9 samples against the untruncated distribution and its
T = 1 samples against T = 0.7's (``test_the_check_rejects_the_wrong_distribution``), so it
is not a check that cannot fail.
The model's lm_head is scaled by LOGIT_SCALE: random weights give a flat next-token
distribution whose mass sits in pooled cells, where the statistic sees little.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from kdtree_numba.backends import make_backend
from kdtree_numba.bundle import random_weights, size_config
from kdtree_numba.drafter import NoisyOracleDrafter
from kdtree_numba.engine import generate
from kdtree_numba.model import Model

ALPHA = 1e-4
Z_ALPHA = 3.719016          # the standard normal's 1 - ALPHA quantile
PROMPT = [5, 9, 2]
NEW = 3                      # tokens per sample: the prefill's, then tree rounds'
MIN_EXPECTED = 5.0


LOGIT_SCALE = 4.0   # random weights give a flat next-token distribution (top token ~7%);
                    # sharper logits put the mass in cells the test can see


@functools.lru_cache(maxsize=None)
def tiny(backend: str = "reference") -> Model:
    """The test model on ``backend``: a backend name, or "cpu" for the reference backend's
    float32 CPU path (kdtree_numba/cpu.py)."""
    cfg = size_config("tiny", num_hidden_layers=2)
    weights = dict(random_weights(cfg, 3))
    weights["lm_head"] = (weights["lm_head"] * LOGIT_SCALE).astype(weights["lm_head"].dtype)
    return Model(cfg, weights, make_backend("reference", precision="float32")
                 if backend == "cpu" else backend)


def truncated_probs(logits, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """The definition: softmax(x / T) over the tokens ranked by logit (ties: smaller id
    first); keep the first top_k (0: all), then the shortest prefix holding >= top_p of the
    kept mass (1: all); renormalise."""
    x = np.asarray(logits, np.float64)
    w = np.exp((x - x.max()) / temperature)
    order = sorted(range(x.size), key=lambda j: (-x[j], j))
    if top_k:
        order = order[:top_k]
    if top_p < 1:
        total, mass, kept = sum(w[j] for j in order), 0.0, []
        for j in order:
            if mass >= top_p * total:
                break
            kept.append(j)
            mass += w[j]
        order = kept
    p = np.zeros_like(w)
    p[order] = w[order]
    return p / p.sum()


def expected_cells(model, n: int, temperature, top_p, top_k):
    """({cell: expected count}, home) over 3-token sequences: the cells are full sequences,
    ``prefix + ("rest",)`` for the pooled remainder after a prefix, and ("rest",) for every
    remainder too small to stand alone (module docstring); ``home[prefix]`` is the cell that
    holds the remainder after a prefix that was split by its next token."""
    cells, home = {("rest",): 0.0}, {}
    frontier = [((), 1.0)]
    for _ in range(NEW):
        nxt = []
        for prefix, p_prefix in frontier:
            probs = truncated_probs(model.score(PROMPT + list(prefix))[-1], temperature, top_p,
                                    top_k)
            pooled = 0.0
            for tok in np.flatnonzero(probs):
                p = p_prefix * probs[tok]
                if n * p >= MIN_EXPECTED:
                    nxt.append((prefix + (int(tok),), p))
                else:
                    pooled += n * p
            home[prefix] = prefix + ("rest",) if pooled >= MIN_EXPECTED else ("rest",)
            cells[home[prefix]] = cells.get(home[prefix], 0.0) + pooled
        frontier = nxt
    cells.update({prefix: n * p for prefix, p in frontier})
    return cells, home


def observed_cells(samples, cells, home) -> dict:
    """Counts per cell: a sample follows its prefixes while they were split (in ``home``)."""
    counts = dict.fromkeys(cells, 0)
    for seq in samples:
        seq, prefix = tuple(seq), ()
        while len(prefix) < NEW:
            nxt = seq[:len(prefix) + 1]
            if nxt not in home and not (len(nxt) == NEW and nxt in cells):
                break
            prefix = nxt
        counts[prefix if len(prefix) == NEW else home[prefix]] += 1
    return counts


def chi_square_rejects(samples, cells) -> tuple[bool, float, float]:
    """(reject at ALPHA, statistic, threshold) for ``cells`` = expected_cells(...).  A global
    rest expecting under MIN_EXPECTED is merged with the smallest cell first."""
    expected, home = cells
    observed = observed_cells(samples, expected, home)
    expected = dict(expected)
    if expected[("rest",)] < MIN_EXPECTED:
        smallest = min((k for k in expected if k != ("rest",)), key=expected.get)
        expected[smallest] += expected.pop(("rest",))
        observed[smallest] += observed.pop(("rest",))
    stat = sum((observed[k] - e) ** 2 / e for k, e in expected.items())
    df = len(expected) - 1
    threshold = df * (1 - 2 / (9 * df) + Z_ALPHA * math.sqrt(2 / (9 * df))) ** 3
    return stat > threshold, stat, threshold


def samples(method: str, n: int, temperature, top_p, top_k, seed: int = 0,
            backend: str = "reference"):
    model = tiny(backend)
    drafter = None if method == "ar" else \
        NoisyOracleDrafter(model, 3, agreement=0.9, seed=seed, sharpness=1.5)
    out = generate(model, [PROMPT] * n, NEW, method=method, drafter=drafter, budget=6,
                   temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    return out.tokens


def check(method, n, temperature, top_p, top_k, backend="reference"):
    expected = expected_cells(tiny(), n, temperature, top_p, top_k)
    reject, stat, threshold = chi_square_rejects(
        samples(method, n, temperature, top_p, top_k, backend=backend), expected)
    assert not reject, (f"{method} T={temperature} top_p={top_p} top_k={top_k}: chi-square "
                        f"{stat:.1f} > {threshold:.1f} over {len(expected[0])} cells")


FAST = [(1.0, 0.9, 50), (0.7, 1.0, 0)]


@pytest.mark.parametrize("method", ["ar", "chain", "ddtree"])
@pytest.mark.parametrize("temperature, top_p, top_k", FAST)
def test_sampled_tokens_follow_the_target_distribution(method, temperature, top_p, top_k):
    check(method, 400, temperature, top_p, top_k)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["chain", "ddtree"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (0.9, 0), (1.0, 50), (0.9, 50)])
def test_sampled_tokens_follow_the_target_distribution_grid(method, temperature, top_p, top_k):
    check(method, 2000, temperature, top_p, top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ar", "chain", "ddtree"])
@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 0.9, 50), (0.7, 1.0, 0),
                                                       (1.0, 1.0, 50)])
def test_sampled_tokens_follow_the_target_distribution_on_the_gpu(method, temperature, top_p,
                                                                  top_k):
    """The numba backend's samples (its sampling kernel, its forwards) against the exact
    distribution of the same weights, enumerated on the reference."""
    check(method, 2000, temperature, top_p, top_k, backend="numba")


@pytest.mark.parametrize("temperature, top_p, top_k", FAST)
def test_the_cpu_paths_ddtree_samples_follow_the_target_distribution(temperature, top_p,
                                                                     top_k):
    """The float32 CPU path (kdtree-run's without a GPU): DDTree's samples, its acceptance
    drawing only the slots its walk visits, against the exact distribution enumerated on the
    float64 reference (the paths' logits differ by float32 rounding)."""
    check("ddtree", 400, temperature, top_p, top_k, backend="cpu")


def test_the_check_rejects_the_wrong_distribution():
    """Power: AR's top-p 0.9 samples are not the untruncated distribution's."""
    n = 400
    got = samples("ar", n, 1.0, 0.9, 0)
    assert not chi_square_rejects(got, expected_cells(tiny(), n, 1.0, 0.9, 0))[0]
    assert chi_square_rejects(got, expected_cells(tiny(), n, 1.0, 1.0, 0))[0]
    plain = samples("ar", n, 1.0, 1.0, 0)
    assert chi_square_rejects(plain, expected_cells(tiny(), n, 0.7, 1.0, 0))[0]

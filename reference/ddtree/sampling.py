"""What a sampled token is drawn from: temperature, top-k and top-p (nucleus) truncation, the
NumPy reference.  This docstring is the contract of ``Sampling``, ``kept_weights`` and
``inverse_cdf_sample``; every sampled choice of both backends (AR's token, DDTree's and the
chain's target sample at each node: reference/ddtree/accept.py) follows it.

``Sampling(temperature, top_p=1.0, top_k=0)``
    temperature T >= 0 (0: greedy, the argmax; top_p and top_k are then ignored), top_p in
    (0, 1] (1: off), top_k >= 0 (0: off).  Anything else is a TypeError or ValueError naming
    the field.  ``as_sampling(x)`` turns a bare temperature into ``Sampling(x)``.

``kept_weights(row, sampling) -> w`` float64 [V] (the truncated, unnormalised distribution)
    ``w_j = exp((f64(x_j) - f64(max x)) / T)``.  Rank the tokens by logit, largest first, ties
    by token id ascending (so the order is total).  top-k keeps the first k ranks (k >= V:
    all).  top-p then keeps the smallest prefix of the kept ranks whose mass is >= top_p
    times the kept mass: rank r stays iff ``sum of w over the kept ranks before r < top_p *
    Z_k`` (both sums float64, in rank order here; Z_k = the kept ranks' mass).  With top_p = 1
    the top-p step is skipped (so a weight that underflows the sum is not dropped).  Dropped
    tokens get w = 0.  The distribution sampled is w / sum(w): renormalised over what is kept.

``inverse_cdf_sample(row, sampling, u) -> token``
    ``token = min{t : sum_{j<=t} w_j > u * sum_j w_j}`` over token ids in ascending order (the
    last token with w_j > 0 if rounding leaves none), u in [0, 1).  With top_p = 1 and
    top_k = 0 this is exactly the plain temperature rule.

The numba twin (kdtree_numba/ddtree/accept.py) sums in other orders (float64 too), so the two
agree exactly unless ``u * sum w`` lies within ~1e-12 (relative) of a CDF boundary or a
prefix mass within ~1e-12 of ``top_p * Z_k``; tests keep away from both.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

__all__ = ["Sampling", "as_sampling", "kept_weights", "inverse_cdf_sample"]


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is chosen (module docstring): greedy at temperature 0, else a draw from
    the temperature softmax truncated by top_k (0: off) and top_p (1: off)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        t, p = _real("temperature", self.temperature), _real("top_p", self.top_p)
        if not (np.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {t}")
        if not 0 < p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1: off), got {p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p drops anything (the plain temperature rule otherwise)."""
        return self.top_k > 0 or self.top_p < 1


def as_sampling(value) -> Sampling:
    """A Sampling as it is; a bare number as ``Sampling(temperature=value)``."""
    return value if isinstance(value, Sampling) else Sampling(_real("temperature", value))


def kept_weights(row, sampling: Sampling) -> np.ndarray:
    """The truncated, unnormalised float64 weights of one logit row (module docstring)."""
    row = np.asarray(row)
    # float64 of (x - max x), one pass (the widening is exact, so the same values as widening
    # first); the division skipped at T = 1, where it changes no bit; exp in place
    x = np.subtract(row, row.max(), dtype=np.float64)
    if sampling.temperature != 1:
        np.divide(x, sampling.temperature, out=x)
    w = np.exp(x, out=x)
    if not sampling.truncates:
        return w
    # logit descending, then id ascending (the row's own order: widening keeps it)
    rank = np.lexsort((np.arange(row.size), -row.reshape(-1)))
    k = w.size if sampling.top_k == 0 else min(sampling.top_k, w.size)
    ranked = w[rank[:k]]
    if sampling.top_p < 1:
        before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
        k = int(np.count_nonzero(before < sampling.top_p * ranked.sum()))
    kept = np.zeros_like(w)
    kept[rank[:k]] = w[rank[:k]]
    return kept


def inverse_cdf_sample(row, sampling, u: float) -> int:
    """One inverse-CDF draw from the truncated softmax of ``row`` (module docstring);
    ``sampling`` a Sampling or a bare temperature."""
    w = kept_weights(row, as_sampling(sampling))
    cdf = np.cumsum(w)
    t = int(np.searchsorted(cdf, u * cdf[-1], side="right"))   # first cdf > u * total
    return t if t < w.size else int(np.flatnonzero(w > 0)[-1])

"""Statistics for comparing span durations of two arms. Pure: numpy only, no I/O.

Definitions (stated once, used everywhere):
- quantiles use numpy's default "linear" method (Hyndman-Fan type 7): for sorted x[0..n-1] the
  q-quantile is x[h] interpolated linearly at h = (n - 1) * q;
- a saving is control - candidate, so a positive saving means the candidate is faster;
- the Mann-Whitney U test is two-sided; its p-value is exact when the smaller sample has at most
  8 values and there are no ties (the same rule as scipy's method="auto"), otherwise the normal
  approximation with tie correction and continuity correction;
- the 95% interval of the median saving is a seeded percentile bootstrap: each arm is resampled
  with replacement independently, the saving of the resampled medians recorded, and the 2.5% and
  97.5% quantiles of those savings reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Exact U distribution is built as a polynomial of degree n1 * n2 with Python ints; above this
# size the normal approximation is both accurate and far cheaper.
_EXACT_MAX_CELLS = 100_000
# Bound on resample values held at once by the bootstrap (float64: 16 MB).
_BOOT_CHUNK_VALUES = 2_000_000


def quantile(xs: Sequence[float] | np.ndarray, q: float) -> float:
    a = np.asarray(xs, dtype=np.float64)
    if a.size == 0:
        raise ValueError("quantile of an empty sample")
    return float(np.quantile(a, q))


def median(xs: Sequence[float] | np.ndarray) -> float:
    return quantile(xs, 0.5)


def p90(xs: Sequence[float] | np.ndarray) -> float:
    return quantile(xs, 0.9)


@dataclass(frozen=True)
class MannWhitney:
    u_control: float  # U statistic of the first sample (control)
    p_value: float  # two-sided
    exact: bool


def _average_ranks(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks with ties given their average rank, and the size of each tie group."""
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    starts = np.r_[True, s[1:] != s[:-1]]
    group = np.cumsum(starts)  # 1-based group id of each sorted value
    bounds = np.r_[np.nonzero(starts)[0], a.size]  # group g spans sorted positions bounds[g-1]..bounds[g]-1
    ranks = np.empty(a.size)
    ranks[order] = 0.5 * (bounds[group - 1] + 1 + bounds[group])
    return ranks, np.diff(bounds)


def _exact_sf(u: int, m: int, n: int) -> float:
    """P(U >= u) under the null for samples of sizes m and n without ties.

    The number of arrangements with U = k is the coefficient of q^k in the Gaussian binomial
    [m+n choose m]_q = prod_{i=1..m} (1 - q^(n+i)) / (1 - q^i), computed as a power series
    truncated at degree m*n (exact: the product is a polynomial of that degree).
    """
    m, n = min(m, n), max(m, n)
    deg = m * n
    c = [0] * (deg + 1)
    c[0] = 1
    for i in range(1, m + 1):
        k = n + i
        for j in range(deg, k - 1, -1):  # multiply by (1 - q^k)
            c[j] -= c[j - k]
        for j in range(i, deg + 1):  # divide by (1 - q^i)
            c[j] += c[j - i]
    total = math.comb(m + n, m)
    return sum(c[max(u, 0) :]) / total


def mann_whitney(control: Sequence[float] | np.ndarray, candidate: Sequence[float] | np.ndarray) -> MannWhitney:
    x = np.asarray(control, dtype=np.float64)
    y = np.asarray(candidate, dtype=np.float64)
    n1, n2 = x.size, y.size
    if n1 == 0 or n2 == 0:
        raise ValueError("Mann-Whitney U needs at least one value in each sample")
    ranks, ties = _average_ranks(np.concatenate([x, y]))
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    u = max(u1, n1 * n2 - u1)  # two-sided: the larger U, survival function doubled
    has_ties = bool((ties > 1).any())
    if min(n1, n2) <= 8 and not has_ties and n1 * n2 <= _EXACT_MAX_CELLS:
        p = 2.0 * _exact_sf(int(round(u)), n1, n2)
        return MannWhitney(u1, min(p, 1.0), exact=True)
    n = n1 + n2
    tie_term = float((ties.astype(np.float64) ** 3 - ties).sum())
    var = n1 * n2 / 12.0 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0.0:  # every value equal: no evidence of any difference
        return MannWhitney(u1, 1.0, exact=False)
    z = (u - n1 * n2 / 2.0 - 0.5) / math.sqrt(var)
    p = 2.0 * 0.5 * math.erfc(z / math.sqrt(2.0))
    return MannWhitney(u1, min(max(p, 0.0), 1.0), exact=False)


def _boot_medians(a: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(n_boot)
    chunk = max(1, _BOOT_CHUNK_VALUES // a.size)
    for lo in range(0, n_boot, chunk):
        hi = min(n_boot, lo + chunk)
        idx = rng.integers(0, a.size, size=(hi - lo, a.size))
        out[lo:hi] = np.median(a[idx], axis=1)
    return out


def bootstrap_median_saving_ci(
    control: Sequence[float] | np.ndarray,
    candidate: Sequence[float] | np.ndarray,
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap interval of median(control) - median(candidate)."""
    x = np.asarray(control, dtype=np.float64)
    y = np.asarray(candidate, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        raise ValueError("bootstrap needs at least one value in each sample")
    if not 0.0 < confidence < 1.0 or n_boot < 1:
        raise ValueError("confidence must be in (0, 1) and n_boot >= 1")
    rng = np.random.default_rng(seed)
    savings = _boot_medians(x, n_boot, rng) - _boot_medians(y, n_boot, rng)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(savings, [tail, 1.0 - tail])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Comparison:
    """One span's durations compared across arms (ns). Savings are control - candidate."""

    span: str
    n_control: int
    n_candidate: int
    control_median: float
    candidate_median: float
    control_p90: float
    candidate_p90: float
    control_mean: float
    candidate_mean: float
    mann_whitney_p: float
    median_saving_ci95: tuple[float, float]

    @property
    def median_saving(self) -> float:
        return self.control_median - self.candidate_median

    @property
    def p90_saving(self) -> float:
        return self.control_p90 - self.candidate_p90

    @property
    def mean_saving(self) -> float:
        return self.control_mean - self.candidate_mean


def compare(
    span: str,
    control: Sequence[float] | np.ndarray,
    candidate: Sequence[float] | np.ndarray,
    *,
    seed: int = 0,
    n_boot: int = 2000,
) -> Comparison:
    x = np.asarray(control, dtype=np.float64)
    y = np.asarray(candidate, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        raise ValueError(f"span {span!r}: each arm needs at least one duration")
    return Comparison(
        span=span,
        n_control=int(x.size),
        n_candidate=int(y.size),
        control_median=median(x),
        candidate_median=median(y),
        control_p90=p90(x),
        candidate_p90=p90(y),
        control_mean=float(x.mean()),
        candidate_mean=float(y.mean()),
        mann_whitney_p=mann_whitney(x, y).p_value,
        median_saving_ci95=bootstrap_median_saving_ci(x, y, n_boot=n_boot, seed=seed),
    )

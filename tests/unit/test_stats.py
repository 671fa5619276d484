"""telemetry_svc.stats: hand-worked quantiles, U-test p-values against scipy, the bootstrap CI."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from telemetry_svc.stats import bootstrap_median_saving_ci, compare, mann_whitney, median, p90, quantile


@pytest.mark.parametrize(
    "xs, want_median, want_p90",
    [
        ([7], 7.0, 7.0),
        ([3, 1, 2], 2.0, 2.8),  # sorted [1,2,3]; p90 at h = 2*0.9 = 1.8 -> 2 + 0.8*(3-2)
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 5.5, 9.1),  # h = 9*0.9 = 8.1 -> 9 + 0.1*(10-9)
        ([10, 10, 10, 40], 10.0, 31.0),  # h = 2.7 -> 10 + 0.7*(40-10)
        ([100, 200], 150.0, 190.0),  # h = 0.9 -> 100 + 0.9*100
    ],
)
def test_quantiles_hand_worked(xs: list[int], want_median: float, want_p90: float) -> None:
    assert median(xs) == pytest.approx(want_median)
    assert p90(xs) == pytest.approx(want_p90)


def test_quantile_of_empty_sample_is_an_error() -> None:
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_exact_p_value_hand_worked() -> None:
    # Complete separation of 3 vs 3: only 1 of C(6,3)=20 arrangements gives U=9; two-sided p = 2/20.
    r = mann_whitney([4, 5, 6], [1, 2, 3])
    assert r.exact and r.u_control == 9.0 and r.p_value == pytest.approx(0.1)


def test_identical_values_give_p_one() -> None:
    assert mann_whitney([5] * 10, [5] * 12).p_value == 1.0


def _samples(rng: np.random.Generator, n1: int, n2: int, ties: bool, shift: float) -> tuple[np.ndarray, np.ndarray]:
    if ties:
        return rng.integers(0, 6, n1).astype(float), rng.integers(0, 6, n2) + shift
    return rng.normal(0, 1, n1), rng.normal(shift, 1, n2)


@pytest.mark.parametrize("n1, n2", [(1, 1), (2, 5), (3, 3), (5, 8), (8, 40), (9, 9), (30, 30), (12, 200)])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shift", [0.0, 0.7, 2.0])
def test_p_value_matches_scipy(n1: int, n2: int, ties: bool, shift: float) -> None:
    rng = np.random.default_rng(n1 * 1000 + n2 + int(ties) * 7 + int(shift * 10))
    x, y = _samples(rng, n1, n2, ties, shift)
    ours, ref = mann_whitney(x, y), mannwhitneyu(x, y, alternative="two-sided")
    assert ours.u_control == pytest.approx(ref.statistic)
    assert ours.p_value == pytest.approx(ref.pvalue, rel=1e-9, abs=1e-12)


def test_exact_path_is_fast_for_an_unbalanced_pair() -> None:
    rng = np.random.default_rng(3)
    x, y = rng.normal(0, 1, 8), rng.normal(0, 1, 3000)
    r = mann_whitney(x, y)
    assert r.exact
    assert r.p_value == pytest.approx(mannwhitneyu(x, y).pvalue, rel=1e-9)


def test_bootstrap_ci_is_seeded_and_covers_a_known_shift() -> None:
    rng = np.random.default_rng(11)
    control = rng.normal(1_000_000, 2_000, 200)
    candidate = control - 1_000 + rng.normal(0, 200, 200)
    a = bootstrap_median_saving_ci(control, candidate, seed=5)
    b = bootstrap_median_saving_ci(control, candidate, seed=5)
    assert a == b
    lo, hi = a
    assert lo <= 1_000 <= hi and lo < hi


def test_bootstrap_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        bootstrap_median_saving_ci([], [1.0])
    with pytest.raises(ValueError):
        bootstrap_median_saving_ci([1.0], [1.0], confidence=1.0)


def test_compare_fields_and_savings() -> None:
    c = compare("attention", [10, 20, 30, 40, 50], [5, 15, 25, 35, 45], n_boot=200)
    assert (c.n_control, c.n_candidate) == (5, 5)
    assert (c.control_median, c.candidate_median, c.median_saving) == (30.0, 25.0, 5.0)
    assert c.control_p90 == pytest.approx(46.0) and c.candidate_p90 == pytest.approx(41.0)
    assert c.p90_saving == pytest.approx(5.0) and c.mean_saving == pytest.approx(5.0)
    assert c.mann_whitney_p == pytest.approx(mannwhitneyu([10, 20, 30, 40, 50], [5, 15, 25, 35, 45]).pvalue)
    assert c.median_saving_ci95[0] <= c.median_saving_ci95[1]


def test_compare_needs_both_arms() -> None:
    with pytest.raises(ValueError, match="attention"):
        compare("attention", [1, 2], [])

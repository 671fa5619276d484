"""telemetry_svc.gates: the spec format, the default spec, and each kind's verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from telemetry_svc.gates import (
    Gate,
    GateKind,
    GateSpec,
    InvalidGateSpec,
    evaluate,
    evaluate_gate,
    load_default_spec,
    parse_gate_spec,
)
from telemetry_svc.stats import compare

SAVING = Gate("g", GateKind.POSITIVE_MEDIAN_SAVING, "attention")


def test_default_spec_reproduces_the_six_reference_gates() -> None:
    spec = load_default_spec()
    got = [(g.name, g.kind, g.span) for g in spec.gates]
    assert got == [
        ("positive_kv_view_prepare_median", GateKind.POSITIVE_MEDIAN_SAVING, "kv_view_prepare"),
        ("positive_attention_host_median", GateKind.POSITIVE_MEDIAN_SAVING, "attention"),
        ("positive_whole_replay_median", GateKind.POSITIVE_MEDIAN_SAVING, "worker_step"),
        ("positive_fresh_generation_wall", GateKind.POSITIVE_SAVING, "generation_wall"),
        ("whole_replay_p90_non_regression", GateKind.P90_NON_REGRESSION, "worker_step"),
        ("no_post_replay_sync_cost_transfer", GateKind.NO_COST_TRANSFER, "post_step_sync"),
    ]
    assert spec.min_samples_per_arm == 5
    assert all(g.alpha == 0.05 for g in spec.gates)


def test_spec_round_trips_and_its_hash_ignores_formatting() -> None:
    spec = load_default_spec()
    text = json.dumps(spec.to_json_obj())
    again = parse_gate_spec(text)
    assert again == spec
    assert parse_gate_spec(json.dumps(spec.to_json_obj(), indent=4)).sha256() == spec.sha256()


def test_bare_list_of_gates_is_accepted_with_defaults() -> None:
    spec = parse_gate_spec('[{"name": "a", "kind": "p90_non_regression", "span": "attention"}]')
    assert spec.gates == (Gate("a", GateKind.P90_NON_REGRESSION, "attention", 0.05, 0.0),)
    assert spec.min_samples_per_arm == 5


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "not JSON"),
        ('{"gates": 3}', "gates"),
        ('{"gates": []}', "at least one gate"),
        ('[{"name": "a", "kind": "faster", "span": "x"}]', "kind must be one of"),
        ('[{"name": "a", "kind": "positive_saving", "span": "x", "alpha": 1.5}]', "alpha"),
        ('[{"name": "a", "kind": "positive_saving", "span": "x", "alpha": "low"}]', "numbers"),
        ('[{"name": "a", "kind": "positive_saving", "span": "x", "tolerance": -1}]', "tolerance"),
        ('[{"name": "a", "kind": "positive_saving", "span": ""}]', "span"),
        ('[{"name": "a", "kind": "positive_saving", "span": "x", "colour": 1}]', "unknown fields"),
        (
            '[{"name": "a", "kind": "positive_saving", "span": "x"}, {"name": "a", "kind": "positive_saving", '
            '"span": "y"}]',
            "unique",
        ),  # fmt: skip
        ('{"schema": "other-v9", "gates": [{"name": "a", "kind": "positive_saving", "span": "x"}]}', "schema"),
        ('{"min_samples_per_arm": 1, "gates": [{"name": "a", "kind": "positive_saving", "span": "x"}]}', ">= 2"),
    ],
)
def test_bad_specs_are_rejected_with_a_reason(text: str, match: str) -> None:
    with pytest.raises(InvalidGateSpec, match=match):
        parse_gate_spec(text)


def _shifted(seed: int, shift: float, n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    control = rng.normal(50_000, 400, n)
    candidate = rng.normal(50_000 - shift, 400, n)
    return control, candidate


def test_constant_shift_of_1000ns_passes_the_saving_gate() -> None:
    control, candidate = _shifted(1, 1000.0)
    r = evaluate_gate(SAVING, compare("attention", control, candidate, n_boot=200), 5)
    assert r.passed is True, r.reason


def test_noisy_null_does_not_pass_the_saving_gate() -> None:
    control, candidate = _shifted(1, 0.0)
    r = evaluate_gate(SAVING, compare("attention", control, candidate, n_boot=50), 5)
    assert r.passed is False, r.reason
    # And over many nulls the false-pass rate stays near alpha/2 (a positive *and* significant saving).
    passes = sum(
        bool(evaluate_gate(SAVING, compare("attention", *_shifted(s, 0.0), n_boot=10), 5).passed) for s in range(200)
    )
    assert passes <= 10


def test_positive_but_insignificant_saving_fails() -> None:
    c = compare("attention", [100, 300, 200, 500, 400], [90, 290, 190, 505, 380], n_boot=50)
    assert c.median_saving > 0 and c.mann_whitney_p >= 0.05
    assert evaluate_gate(SAVING, c, 5).passed is False


def test_too_few_samples_gives_no_verdict() -> None:
    c = compare("attention", [5, 6, 7, 8], [1, 2, 3, 4, 5, 6], n_boot=50)
    r = evaluate_gate(SAVING, c, 5)
    assert r.passed is None and "n_control=4" in r.reason
    assert evaluate_gate(SAVING, None, 5).passed is None


def test_tolerance_is_a_fraction_of_the_control_median() -> None:
    control, candidate = _shifted(2, 1000.0)
    c = compare("attention", control, candidate, n_boot=50)
    assert evaluate_gate(Gate("g", GateKind.POSITIVE_MEDIAN_SAVING, "attention", tolerance=0.001), c, 5).passed
    assert not evaluate_gate(Gate("g", GateKind.POSITIVE_MEDIAN_SAVING, "attention", tolerance=0.05), c, 5).passed


def test_positive_saving_uses_the_mean() -> None:
    # Medians equal, but the candidate removes the slow outlier runs: the mean saving is positive.
    control = [100, 100, 100, 100, 100, 900, 900, 900]
    candidate = [100, 100, 100, 100, 100, 100, 100, 100]
    c = compare("generation_wall", control, candidate, n_boot=50)
    gate = Gate("w", GateKind.POSITIVE_SAVING, "generation_wall", alpha=0.2)
    # By hand: means 400 vs 100, so a mean saving of 300 ns; medians both 100.
    assert c.median_saving == 0 and c.mean_saving == 300
    # Mann-Whitney by hand: the three 900s beat all 8 candidates (24), the five 100s tie them
    # (40 ties, 20), so U = 44 of 64; ties 13 x 100 and 3 x 900 give var = 64/12 * (17 - 2208/240)
    # = 41.6; z = (44 - 32 - 0.5) / sqrt(41.6) = 1.783; two-sided p = erfc(z / sqrt 2) = 0.0746.
    assert c.mann_whitney_p == pytest.approx(0.0746, abs=5e-4)
    r = evaluate_gate(gate, c, 5)
    assert r.passed is True  # 300 > 0 and p 0.0746 < alpha 0.2
    assert r.reason == "mean saving 300 ns (need > 0), p=0.0746 < alpha=0.2"
    # the same saving is not significant at alpha 0.05, and a 40% tolerance (need > 160) is met
    assert evaluate_gate(Gate("w", GateKind.POSITIVE_SAVING, "generation_wall"), c, 5).passed is False
    tolerant = Gate("w", GateKind.POSITIVE_SAVING, "generation_wall", alpha=0.2, tolerance=0.4)
    assert evaluate_gate(tolerant, c, 5).passed is True
    too_tolerant = Gate("w", GateKind.POSITIVE_SAVING, "generation_wall", alpha=0.2, tolerance=0.8)  # need > 320
    assert evaluate_gate(too_tolerant, c, 5).passed is False
    # while a median gate on the same data fails: no median saving at all
    assert evaluate_gate(Gate("m", GateKind.POSITIVE_MEDIAN_SAVING, "generation_wall", alpha=0.2), c, 5).passed is False


def test_p90_non_regression_bound() -> None:
    gate = Gate("p", GateKind.P90_NON_REGRESSION, "worker_step", tolerance=0.02)
    base = list(range(100, 200, 10))
    assert evaluate_gate(gate, compare("worker_step", base, [v * 1.01 for v in base], n_boot=20), 5).passed
    assert not evaluate_gate(gate, compare("worker_step", base, [v * 1.05 for v in base], n_boot=20), 5).passed


def test_no_cost_transfer_fails_only_on_a_significant_regression() -> None:
    gate = Gate("t", GateKind.NO_COST_TRANSFER, "post_step_sync")
    control, candidate = _shifted(4, -2000.0)  # candidate 2000 ns slower
    assert evaluate_gate(gate, compare("post_step_sync", control, candidate, n_boot=20), 5).passed is False
    control, candidate = _shifted(4, 0.0)
    assert evaluate_gate(gate, compare("post_step_sync", control, candidate, n_boot=20), 5).passed is True


def test_evaluate_uses_per_gate_min_samples() -> None:
    spec = GateSpec(
        (Gate("a", GateKind.P90_NON_REGRESSION, "x", min_samples=3), Gate("b", GateKind.P90_NON_REGRESSION, "x"))
    )
    c = compare("x", [1, 2, 3], [1, 2, 3], n_boot=10)
    a, b = evaluate(spec, {"x": c})
    assert a.passed is True and b.passed is None

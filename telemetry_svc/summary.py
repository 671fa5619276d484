"""The A/B experiment summary document, built from span durations and artifacts. Pure.

Each comparison row is keyed by a span name; its statistics are over the durations of that
span's instances within each arm (e.g. row "attention" compares every `attention` span of the
control arm with every `attention` span of the candidate arm). Figures are ns rounded to the
nearest integer; savings are control - candidate of the rounded figures, so rows add up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from telemetry_svc.gates import GateResult, GateSpec, evaluate
from telemetry_svc.model import ARMS, Arm, Artifact, ArtifactKind, ExperimentData
from telemetry_svc.stats import Comparison, compare

SUMMARY_SCHEMA = "kvfleet-experiment-gate-summary-v1"
STEP_SPAN = "worker_step"


class Status(str, enum.Enum):
    AUTHORIZED = "authorized"
    NOT_AUTHORIZED = "not_authorized"
    INSUFFICIENT_SAMPLES = "insufficient_samples"
    INEXACT = "inexact"
    EXACTNESS_UNVERIFIED = "exactness_unverified"


@dataclass(frozen=True)
class SummaryOptions:
    step_span: str = STEP_SPAN  # the span that is one worker step (profile contract)
    seed: int = 0  # bootstrap seed: the same data gives the same document
    n_boot: int = 2000
    store_location: str = ""

    def __post_init__(self) -> None:
        if self.n_boot < 1:
            raise ValueError("n_boot must be >= 1")


def _ns(x: float) -> int:
    return int(round(x))


def comparisons_for(data: ExperimentData, spec: GateSpec, opts: SummaryOptions) -> dict[str, Comparison]:
    """Every span name of the spec, plus every name seen in both arms, where both arms have data."""
    seen = sorted(n for n, by_arm in data.durations.items() if all(by_arm.get(a) for a in ARMS))
    out: dict[str, Comparison] = {}
    for name in dict.fromkeys([*spec.spans, *seen]):
        control, candidate = data.samples(name, Arm.CONTROL), data.samples(name, Arm.CANDIDATE)
        if control and candidate:
            out[name] = compare(name, control, candidate, seed=opts.seed, n_boot=opts.n_boot)
    return out


def comparison_row(c: Comparison) -> dict[str, Any]:
    cm, km, cp, kp = _ns(c.control_median), _ns(c.candidate_median), _ns(c.control_p90), _ns(c.candidate_p90)
    cmean, kmean = _ns(c.control_mean), _ns(c.candidate_mean)
    return {
        "control_median": cm,
        "candidate_median": km,
        "median_saving": cm - km,
        "control_p90": cp,
        "candidate_p90": kp,
        "p90_saving": cp - kp,
        "control_mean": cmean,
        "candidate_mean": kmean,
        "mean_saving": cmean - kmean,
        "n_control": c.n_control,
        "n_candidate": c.n_candidate,
        "mann_whitney_p": c.mann_whitney_p,
        "median_saving_ci95": [_ns(c.median_saving_ci95[0]), _ns(c.median_saving_ci95[1])],
    }


def _artifact(artifacts: tuple[Artifact, ...], kind: ArtifactKind, arm: str = "") -> Artifact | None:
    # The store keeps one record per (experiment, arm, kind); the last one wins if repeated here.
    found = [a for a in artifacts if a.kind is kind and a.arm == arm]
    return found[-1] if found else None


def exactness(artifacts: tuple[Artifact, ...]) -> dict[str, Any]:
    """bitwise_exact is None until both arms' token hashes are recorded."""
    tok = {a.value: _artifact(artifacts, ArtifactKind.TOKENS, a.value) for a in ARMS}
    both = all(t is not None for t in tok.values())
    completion = {arm: (t.completion_tokens if t else None) for arm, t in tok.items()}
    cached = {arm: (t.cached_tokens if t else None) for arm, t in tok.items()}
    exact: bool | None = None
    if both:
        c, k = tok["control"], tok["candidate"]
        assert c is not None and k is not None
        exact = c.sha256 == k.sha256 and c.completion_tokens == k.completion_tokens

    def same(d: dict[str, int | None]) -> int | None:
        vals = set(d.values())
        return vals.pop() if both and len(vals) == 1 else None

    return {
        "bitwise_exact": exact,
        "completion_tokens_per_arm": same(completion),
        "cached_tokens_per_arm": same(cached),
        "completion_tokens_by_arm": completion,
        "cached_tokens_by_arm": cached,
    }


def profile_contract(data: ExperimentData, step_span: str) -> dict[str, Any]:
    counts = {a.value: {n: len(by[a]) for n, by in sorted(data.durations.items()) if by.get(a)} for a in ARMS}
    per_step: dict[str, dict[str, float]] = {}
    for arm, by_name in counts.items():
        steps = by_name.get(step_span, 0)
        per_step[arm] = {n: round(k / steps, 3) for n, k in by_name.items() if n != step_span} if steps else {}
    return {
        "step_span": step_span,
        "samples_per_arm": {arm: by_name.get(step_span, 0) for arm, by_name in counts.items()},
        "spans_per_arm": counts,
        "spans_per_step": per_step,
        "spans_per_step_consistent": per_step["control"] == per_step["candidate"],
    }


def _decide(exact: bool | None, results: tuple[GateResult, ...], treatment: str | None) -> tuple[Status, str]:
    missing = [r for r in results if r.passed is None]
    failed = [r for r in results if r.passed is False]
    if exact is False:
        return Status.INEXACT, (
            "fix exactness first: the arms generated different tokens, so no timing can authorize this lever"
        )
    if missing:
        need = "; ".join(r.reason for r in missing)
        extra = "; also record both arms' token hashes" if exact is None else ""
        return Status.INSUFFICIENT_SAMPLES, f"collect more samples ({need}){extra}"
    if exact is None:
        return Status.EXACTNESS_UNVERIFIED, (
            "record each arm's generated-token hash (RecordArtifact, kind TOKENS) and re-evaluate"
        )
    if not failed:
        return Status.AUTHORIZED, f"adopt {treatment or 'the candidate'}: every gate passed with bitwise-exact tokens"
    names = "; ".join(f"{r.gate.name} ({r.reason})" for r in failed)
    return Status.NOT_AUTHORIZED, f"stop this lever or rework it; failed gates: {names}"


def build_summary(data: ExperimentData, spec: GateSpec, opts: SummaryOptions = SummaryOptions()) -> dict[str, Any]:
    comps = comparisons_for(data, spec, opts)
    results = evaluate(spec, comps)
    exact = exactness(data.artifacts)
    treatment = _artifact(data.artifacts, ArtifactKind.TREATMENT)
    commit = _artifact(data.artifacts, ArtifactKind.PROJECT_COMMIT)
    workload = _artifact(data.artifacts, ArtifactKind.WORKLOAD)
    tokens = {a.value: _artifact(data.artifacts, ArtifactKind.TOKENS, a.value) for a in ARMS}
    status, next_action = _decide(exact["bitwise_exact"], results, treatment.value if treatment else None)
    return {
        "schema": SUMMARY_SCHEMA,
        "experiment_id": data.experiment_id,
        "status": status.value,
        "exactness": exact,
        "profile_contract": profile_contract(data, opts.step_span),
        "gates": {r.gate.name: r.passed for r in results},
        "gate_details": [
            {
                "name": r.gate.name,
                "kind": r.gate.kind.value,
                "span": r.gate.span,
                "passed": r.passed,
                "reason": r.reason,
            }
            for r in results
        ],
        "comparison_ns": {name: comparison_row(c) for name, c in comps.items()},
        "artifact_sha256": {
            "workload": workload.sha256 if workload else None,
            "tokens_control": tokens["control"].sha256 if tokens["control"] else None,
            "tokens_candidate": tokens["candidate"].sha256 if tokens["candidate"] else None,
            "gate_spec": spec.sha256(),
        },
        "provenance": {
            "project_commit": commit.value if commit else None,
            "sole_treatment": treatment.value if treatment else None,
            "span_store": opts.store_location,
            "methods": {**_METHODS, "bootstrap": f"percentile, {opts.n_boot} resamples, seed {opts.seed}"},
        },
        "decision": {"authorize": status is Status.AUTHORIZED, "next_action": next_action},
    }


_METHODS: Mapping[str, str] = {
    "units": "ns; durations are span end - start",
    "saving": "control - candidate (positive: candidate faster)",
    "quantiles": "numpy linear (Hyndman-Fan type 7)",
    "test": "Mann-Whitney U, two-sided; exact if min(n) <= 8 without ties, else normal approximation "
    "with tie and continuity correction",
}

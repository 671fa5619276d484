"""telemetry_svc.summary (and the report built from it): status, exactness, figures, decision."""

from __future__ import annotations

import json

import numpy as np
import pytest

from telemetry_svc.gates import GateSpec, load_default_spec
from telemetry_svc.model import Arm, Artifact, ArtifactKind, ExperimentData, token_sha256
from telemetry_svc.report import build_report
from telemetry_svc.summary import Status, SummaryOptions, build_summary

EXP = "exp-1"
OPTS = SummaryOptions(n_boot=200, store_location="/tmp/t.db")
TOK = token_sha256("[[1,2,3],[4,5]]")
OTHER = token_sha256("[[1,2,3],[4,6]]")

# Per-span (median, noise sd, count per arm) of the control arm; the candidate is shifted.
PROFILE = {
    "kv_view_prepare": (900_000, 10_000, 30),
    "attention": (4_000_000, 40_000, 60),
    "worker_step": (21_000_000, 200_000, 30),
    "post_step_sync": (9_000_000, 50_000, 30),
    "generation_wall": (2_000_000_000, 1_000_000, 6),
}


def _durations(shift: dict[str, float], seed: int = 0, n: int | None = None) -> dict[str, dict[Arm, tuple[int, ...]]]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, (mu, sd, count) in PROFILE.items():
        k = count if n is None else n
        control = tuple(int(v) for v in rng.normal(mu, sd, k))
        candidate = tuple(int(v) for v in rng.normal(mu - shift.get(name, 0.0), sd, k))
        out[name] = {Arm.CONTROL: control, Arm.CANDIDATE: candidate}
    return out


FASTER = {"kv_view_prepare": 300_000, "attention": 250_000, "worker_step": 600_000, "generation_wall": 30_000_000}


def _artifacts(candidate_sha: str = TOK, completion: int = 5) -> tuple[Artifact, ...]:
    return (
        Artifact(EXP, ArtifactKind.TOKENS, "control", TOK, completion_tokens=5),
        Artifact(EXP, ArtifactKind.TOKENS, "candidate", candidate_sha, completion_tokens=completion),
        Artifact(EXP, ArtifactKind.WORKLOAD, sha256="b" * 64),
        Artifact(EXP, ArtifactKind.TREATMENT, value="PERSISTENT_KV_VIEWS"),
        Artifact(EXP, ArtifactKind.PROJECT_COMMIT, value="abc123"),
    )


def _summary(durations: dict, artifacts: tuple[Artifact, ...], spec: GateSpec | None = None) -> dict:
    return build_summary(ExperimentData(EXP, durations, artifacts), spec or load_default_spec(), OPTS)


def test_a_real_saving_with_exact_tokens_is_authorized() -> None:
    s = _summary(_durations(FASTER), _artifacts())
    assert s["status"] == Status.AUTHORIZED.value
    assert all(s["gates"].values()), s["gate_details"]
    assert s["decision"]["authorize"] is True
    assert "PERSISTENT_KV_VIEWS" in s["decision"]["next_action"]
    assert s["exactness"]["bitwise_exact"] is True
    assert s["exactness"]["completion_tokens_per_arm"] == 5
    assert s["artifact_sha256"]["tokens_control"] == TOK
    assert s["artifact_sha256"]["workload"] == "b" * 64
    assert s["artifact_sha256"]["gate_spec"] == load_default_spec().sha256()
    assert s["provenance"]["project_commit"] == "abc123"
    assert s["provenance"]["sole_treatment"] == "PERSISTENT_KV_VIEWS"
    assert s["provenance"]["span_store"] == "/tmp/t.db"


def test_comparison_rows_hold_the_exact_figures() -> None:
    durations = {
        "attention": {Arm.CONTROL: (10, 20, 30, 40, 50, 60), Arm.CANDIDATE: (5, 15, 25, 35, 45, 55)},
    }
    row = _summary(durations, _artifacts())["comparison_ns"]["attention"]
    # medians 35 and 30; p90 at h = 5*0.9 = 4.5: 50 + 0.5*10 = 55 and 45 + 0.5*10 = 50.
    assert (row["control_median"], row["candidate_median"], row["median_saving"]) == (35, 30, 5)
    assert (row["control_p90"], row["candidate_p90"], row["p90_saving"]) == (55, 50, 5)
    assert (row["n_control"], row["n_candidate"]) == (6, 6)
    lo, hi = row["median_saving_ci95"]
    assert lo <= hi
    assert 0.0 < row["mann_whitney_p"] <= 1.0


def test_rows_are_self_consistent_for_every_span() -> None:
    s = _summary(_durations(FASTER), _artifacts())
    assert set(s["comparison_ns"]) == set(PROFILE)
    for row in s["comparison_ns"].values():
        assert row["median_saving"] == row["control_median"] - row["candidate_median"]
        assert row["p90_saving"] == row["control_p90"] - row["candidate_p90"]


def test_too_few_samples_is_not_a_verdict() -> None:
    s = _summary(_durations(FASTER, n=3), _artifacts())
    assert s["status"] == Status.INSUFFICIENT_SAMPLES.value
    assert s["decision"]["authorize"] is False
    assert s["decision"]["next_action"].startswith("collect more samples")
    assert all(v is None for v in s["gates"].values())


def test_missing_span_counts_as_too_few_samples() -> None:
    durations = _durations(FASTER)
    del durations["post_step_sync"]
    s = _summary(durations, _artifacts())
    assert s["status"] == Status.INSUFFICIENT_SAMPLES.value
    assert s["gates"]["no_post_replay_sync_cost_transfer"] is None
    assert "post_step_sync" in s["decision"]["next_action"]


@pytest.mark.parametrize("candidate_sha, completion", [(OTHER, 5), (TOK, 6)])
def test_inexact_tokens_never_authorize(candidate_sha: str, completion: int) -> None:
    s = _summary(_durations(FASTER), _artifacts(candidate_sha, completion))
    assert all(s["gates"].values())  # the timing alone would authorize
    assert s["status"] == Status.INEXACT.value
    assert s["exactness"]["bitwise_exact"] is False
    assert s["decision"]["authorize"] is False


def test_inexact_wins_over_insufficient_samples() -> None:
    s = _summary(_durations(FASTER, n=2), _artifacts(OTHER))
    assert s["status"] == Status.INEXACT.value and s["decision"]["authorize"] is False


def test_unrecorded_tokens_leave_exactness_unverified() -> None:
    arts = tuple(a for a in _artifacts() if a.kind is not ArtifactKind.TOKENS)
    s = _summary(_durations(FASTER), arts)
    assert s["exactness"]["bitwise_exact"] is None
    assert s["status"] == Status.EXACTNESS_UNVERIFIED.value
    assert s["decision"]["authorize"] is False


def test_no_saving_is_not_authorized_and_names_the_failed_gates() -> None:
    s = _summary(_durations({}), _artifacts())
    assert s["status"] == Status.NOT_AUTHORIZED.value
    assert s["decision"]["authorize"] is False
    failed = [n for n, v in s["gates"].items() if v is False]
    assert "positive_kv_view_prepare_median" in failed
    assert all(n in s["decision"]["next_action"] for n in failed)


def test_profile_contract_counts_spans_per_step() -> None:
    pc = _summary(_durations(FASTER), _artifacts())["profile_contract"]
    assert pc["samples_per_arm"] == {"control": 30, "candidate": 30}
    assert pc["spans_per_step"]["control"]["attention"] == 2.0
    assert pc["spans_per_step_consistent"] is True


def test_summary_is_deterministic_json() -> None:
    a = _summary(_durations(FASTER), _artifacts())
    b = _summary(_durations(FASTER), _artifacts())
    assert json.dumps(a) == json.dumps(b)


def test_report_is_self_contained_html() -> None:
    data = ExperimentData(EXP, _durations(FASTER), _artifacts())
    html = build_report(build_summary(data, load_default_spec(), OPTS), data)
    assert html.startswith("<!DOCTYPE html>")
    assert html.count("<svg") == len(PROFILE)
    assert "<script" not in html and "src=" not in html and "href=" not in html
    assert "positive_kv_view_prepare_median" in html and "authorized" in html

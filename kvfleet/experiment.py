"""A/B experiments on a lever: the same workload under both arms, interleaved, against live
workers; every span tagged with experiment.id and experiment.arm; the telemetry service judges."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from kvfleet.client import SchedulerClient
from kvfleet.progress import Progress
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import telemetry_pb2 as tpb
from kvfleet.v1 import telemetry_pb2_grpc as tpb_grpc
from kvfleet_common import security

ARMS = ("control", "candidate")


@dataclass(frozen=True)
class ExperimentSpec:
    lever: str = "persistent_kv_views"
    repeats: int = 6  # per arm; the wall-clock gate needs >= 5
    sessions: int = 8
    prompt_len: int = 16
    max_new_tokens: int = 32
    concurrency: int = 8
    seed: int = 0
    experiment_id: str = ""  # empty: a fresh id

    def __post_init__(self) -> None:
        for name in ("repeats", "sessions", "prompt_len", "max_new_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def _workload(spec: ExperimentSpec, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(spec.seed)
    return [rng.integers(0, vocab, size=spec.prompt_len).tolist() for _ in range(spec.sessions)]


def _request(spec: ExperimentSpec, prompts, experiment_id: str, arm: str) -> spb.WorkloadRequest:
    req = spb.WorkloadRequest(
        policy=spb.WorkloadPolicy(max_running=spec.concurrency),
        experiment=spb.Experiment(id=experiment_id, arm=arm, lever=spec.lever),
    )
    for p in prompts:
        req.sessions.add(prompt_ids=spb.TokenIds(ids=p), max_new_tokens=spec.max_new_tokens, ignore_eos=True)
    return req


# The scheduler's scheduler_svc.experiments.EXPERIMENT_TOKEN_HEADER (the client may not import it).
EXPERIMENT_TOKEN_HEADER = "x-kvfleet-experiment-token"


def new_experiment_id(lever: str) -> str:
    """The lever's name and 128 random bits: nobody can guess a running experiment's id, and two
    runs never share one (artifacts are write-once per id)."""
    return f"{lever}-{secrets.token_hex(16)}"


def experiment_metadata(client: SchedulerClient, experiment_token: str) -> tuple[tuple[str, str], ...]:
    """The client's own metadata plus the experiment-writer token the scheduler may require
    (scheduler_svc.experiments.ExperimentWriters); "" sends none."""
    extra = ((EXPERIMENT_TOKEN_HEADER, experiment_token),) if experiment_token else ()
    return (*client._md, *extra)


def _run_arm(
    client: SchedulerClient, request: spb.WorkloadRequest, n: int, metadata: tuple[tuple[str, str], ...]
) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in range(n)]
    for ev in client.stub.SubmitWorkload(request, metadata=metadata):
        if ev.HasField("event"):
            outputs[ev.session_index].extend(ev.event.token_ids)
    return outputs


def _project_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _wait_for_spans(
    stub: tpb_grpc.TelemetryStub, experiment_id: str, quiet_s: float = 1.5, timeout_s: float = 60.0, metadata=None
) -> None:
    """Spans arrive in export batches; wait until the stored counts stop growing."""
    end = time.monotonic() + timeout_s
    last, stable_since = None, time.monotonic()
    while time.monotonic() < end:
        counts = None
        for e in stub.ListExperiments(tpb.ListExperimentsRequest(), metadata=metadata, timeout=10).experiments:
            if e.experiment_id == experiment_id:
                counts = (e.control_spans, e.candidate_spans)
        if counts != last:
            last, stable_since = counts, time.monotonic()
        elif counts and time.monotonic() - stable_since >= quiet_s:
            return
        time.sleep(0.25)


def _check_unused(stub: tpb_grpc.TelemetryStub, experiment_id: str, metadata) -> None:
    """Artifacts are write-once and spans would mix: refuse a used id before running anything."""
    listed = stub.ListExperiments(tpb.ListExperimentsRequest(), metadata=metadata, timeout=10).experiments
    if any(e.experiment_id == experiment_id for e in listed):
        raise RuntimeError(
            f"experiment id {experiment_id!r} already has data in the telemetry store; "
            "choose a new id (or leave it empty for a fresh one)"
        )


def run_experiment(
    client: SchedulerClient,
    telemetry_address: str,
    spec: ExperimentSpec,
    progress: Progress | None = None,
    telemetry_token: str | None = None,
) -> tuple[dict, str]:
    """Returns (summary document, HTML report). telemetry_token: the telemetry service's write
    token (default $KVFLEET_TELEMETRY_TOKEN; empty for an open service)."""
    progress = progress or Progress.silent()
    progress.set_total(spec.repeats * len(ARMS))
    workers = client.list_workers()
    if not workers:
        raise RuntimeError("the scheduler lists no workers")
    experiment_id = spec.experiment_id or new_experiment_id(spec.lever)
    writer = experiment_metadata(client, os.environ.get("KVFLEET_EXPERIMENT_TOKEN", ""))
    token = os.environ.get("KVFLEET_TELEMETRY_TOKEN", "") if telemetry_token is None else telemetry_token
    auth = security.token_metadata(token) if token else None
    with security.channel(telemetry_address) as channel:
        _check_unused(tpb_grpc.TelemetryStub(channel), experiment_id, auth)
    prompts = _workload(spec, workers[0].vocab_size)
    tokens: dict[str, list[list[int]]] = {arm: [] for arm in ARMS}
    for r in range(spec.repeats):
        for arm in ARMS:  # ABAB...: drift on a shared machine hits both arms alike
            tokens[arm].extend(_run_arm(client, _request(spec, prompts, experiment_id, arm), len(prompts), writer))
            progress.advance(message=f"repeat {r + 1}/{spec.repeats}: {arm}")
    workload_doc = json.dumps(
        {"prompts": prompts, **asdict(spec), "model": workers[0].model}, sort_keys=True, separators=(",", ":")
    )
    with security.channel(telemetry_address) as channel:
        stub = tpb_grpc.TelemetryStub(channel)

        def record(request: tpb.ArtifactRequest, timeout: float) -> None:
            try:
                stub.RecordArtifact(request, metadata=auth, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                raise RuntimeError(f"telemetry refused an artifact of {experiment_id!r}: {exc.details()}") from None

        for arm in ARMS:
            record(
                tpb.ArtifactRequest(
                    experiment_id=experiment_id,
                    arm=arm,
                    kind=tpb.ARTIFACT_KIND_TOKENS,
                    tokens_json=json.dumps(tokens[arm], separators=(",", ":")),
                    completion_tokens=sum(map(len, tokens[arm])),
                ),
                timeout=10,
            )
        record(
            tpb.ArtifactRequest(
                experiment_id=experiment_id,
                kind=tpb.ARTIFACT_KIND_WORKLOAD,
                sha256=hashlib.sha256(workload_doc.encode()).hexdigest(),
            ),
            timeout=10,
        )
        record(
            tpb.ArtifactRequest(experiment_id=experiment_id, kind=tpb.ARTIFACT_KIND_TREATMENT, value=spec.lever),
            timeout=10,
        )
        commit = _project_commit()
        if commit:
            record(
                tpb.ArtifactRequest(experiment_id=experiment_id, kind=tpb.ARTIFACT_KIND_PROJECT_COMMIT, value=commit),
                timeout=10,
            )
        progress("waiting for the spans to reach the telemetry service")
        _wait_for_spans(stub, experiment_id, metadata=auth)
        summary = json.loads(
            stub.GetSummary(tpb.SummaryRequest(experiment_id=experiment_id), metadata=auth, timeout=60).json
        )
        html = stub.GetReport(tpb.ReportRequest(experiment_id=experiment_id), metadata=auth, timeout=60).html
    return summary, html


def format_summary(doc: dict) -> str:
    lines = [f"experiment {doc.get('experiment_id', '?')}: status {doc.get('status')}"]
    ex = doc.get("exactness", {})
    lines.append(
        f"exactness: bitwise_exact={ex.get('bitwise_exact')} "
        f"completion_tokens_per_arm={ex.get('completion_tokens_per_arm')}"
    )
    lines.append(f"{'span':<22}{'control_med':>14}{'cand_med':>14}{'saving':>12}{'p':>10}")
    for name, row in sorted(doc.get("comparison_ns", {}).items()):
        if "control_median" in row:
            lines.append(
                f"{name:<22}{row['control_median']:>14}{row['candidate_median']:>14}"
                f"{row['median_saving']:>12}{row.get('mann_whitney_p', float('nan')):>10.3g}"
            )
    for gate, ok in doc.get("gates", {}).items():
        lines.append(f"gate {gate}: {ok}")
    decision = doc.get("decision", {})
    lines.append(f"decision: authorize={decision.get('authorize')} — {decision.get('next_action')}")
    return "\n".join(lines)

"""The real telemetry server on a loopback port with a temporary SQLite store.

Spans arrive through the stock OTLP exporter (what the scheduler and workers use); malformed
and oversized traffic arrives through raw channels. The grpc.aio server runs on its own event
loop in a background thread; the test talks to it with ordinary blocking clients.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import set_span_in_context

from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from telemetry_svc.model import token_sha256
from telemetry_svc.server import STATUS_DETAILS_KEY, TelemetryConfig
from telemetry_svc.store import SqliteSpanStore
from tests.helpers.telemetry_server import (
    EXPORT,
    RunningServer,
    export_request,
    health_status,
    otlp_export,
    raw_span,
)

EXP = "exp-int"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RunningServer]:
    srv = RunningServer(TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db")))
    yield srv
    srv.stop()


# --- spans through the stock SDK exporter ---------------------------------------------------

# Durations (ns) per step i = 0..5; the candidate saves a fixed amount on three phases.
STEPS = 6
WALLS = 5


def _phase_durations(arm: str) -> dict[str, list[int]]:
    faster = arm == "candidate"
    return {
        "kv_view_prepare": [5_000 + 37 * i - (1_500 if faster else 0) for i in range(STEPS)],
        "attention": [40_000 + 101 * i - (4_000 if faster else 0) for i in range(2 * STEPS)],  # 2 per step
        "post_step_sync": [9_000 + 13 * i for i in range(STEPS)],  # identical: no cost transfer
        "generation_wall": [3_000_000 + 7_919 * i - (500_000 if faster else 0) for i in range(WALLS)],
    }


def _send_arm(port: int, arm: str, *, arm_on_resource: bool) -> dict[str, list[int]]:
    """Emit one arm's spans with explicit times; returns durations by span name as sent."""
    attrs = {"experiment.id": EXP, "experiment.arm": arm}
    resource = Resource.create({"service.name": f"worker-{arm}", **(attrs if arm_on_resource else {})})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)))
    tracer = provider.get_tracer("test")
    span_attrs = {} if arm_on_resource else attrs
    phases = _phase_durations(arm)
    sent: dict[str, list[int]] = {name: [] for name in [*phases, "worker_step"]}
    t = 1_700_000_000_000_000_000
    for i in range(STEPS):
        step = tracer.start_span("worker_step", start_time=t, attributes=span_attrs)
        ctx = set_span_in_context(step)
        t0 = t
        for name, d in (("kv_view_prepare", phases["kv_view_prepare"][i]), ("attention", phases["attention"][2 * i]),
                        ("attention", phases["attention"][2 * i + 1]), ("post_step_sync", phases["post_step_sync"][i])):  # fmt: skip
            child = tracer.start_span(name, context=ctx, start_time=t, attributes=span_attrs)
            child.end(end_time=t + d)
            sent[name].append(d)
            t += d
        step.end(end_time=t)
        sent["worker_step"].append(t - t0)
        t += 1_000
    for d in phases["generation_wall"]:
        wall = tracer.start_span("generation_wall", start_time=t, attributes=span_attrs)
        wall.end(end_time=t + d)
        sent["generation_wall"].append(d)
        t += d
    assert provider.force_flush(10_000)
    provider.shutdown()
    return sent


def _record_tokens(stub: Any, arm: str, tokens: str) -> str:
    req = telemetry_pb2.ArtifactRequest(
        experiment_id=EXP, arm=arm, kind=telemetry_pb2.ARTIFACT_KIND_TOKENS, tokens_json=tokens, completion_tokens=5
    )
    return stub.RecordArtifact(req, timeout=5).sha256


def test_spans_from_the_stock_exporter_are_stored_and_summarized(server: RunningServer) -> None:
    sent = {
        "control": _send_arm(server.port, "control", arm_on_resource=True),
        "candidate": _send_arm(server.port, "candidate", arm_on_resource=False),
    }
    # Stored rows equal what was sent: names, arms, durations, services, parentage.
    rows = server.server.store.spans(EXP)
    assert len(rows) == 2 * (STEPS * 5 + WALLS)
    for arm, by_name in sent.items():
        for name, durations in by_name.items():
            got = sorted(r.duration_ns for r in rows if r.arm == arm and r.name == name)
            assert got == sorted(durations), (arm, name)
    assert {r.service for r in rows} == {"worker-control", "worker-candidate"}
    steps = {r.span_id for r in rows if r.name == "worker_step"}
    assert all(r.parent_span_id in steps for r in rows if r.name in ("attention", "kv_view_prepare"))
    assert all(len(r.trace_id) == 32 and len(r.span_id) == 16 for r in rows)

    stub = telemetry_pb2_grpc.TelemetryStub(server.channel)
    sha = _record_tokens(stub, "control", "[[1, 2, 3], [4, 5]]")
    assert sha == token_sha256("[[1,2,3],[4,5]]") == _record_tokens(stub, "candidate", "[[1,2,3],[4,5]]")
    stub.RecordArtifact(telemetry_pb2.ArtifactRequest(experiment_id=EXP, kind=telemetry_pb2.ARTIFACT_KIND_TREATMENT,
                                                      value="PERSISTENT_KV_VIEWS"), timeout=5)  # fmt: skip

    summary = json.loads(stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id=EXP), timeout=30).json)
    for name in ("kv_view_prepare", "attention", "worker_step", "post_step_sync", "generation_wall"):
        row = summary["comparison_ns"][name]
        c, k = sent["control"][name], sent["candidate"][name]
        assert row["control_median"] == round(float(np.median(c))), name
        assert row["candidate_median"] == round(float(np.median(k))), name
        assert row["control_p90"] == round(float(np.percentile(c, 90))), name
        assert row["candidate_p90"] == round(float(np.percentile(k, 90))), name
        assert (row["n_control"], row["n_candidate"]) == (len(c), len(k))
    assert summary["comparison_ns"]["kv_view_prepare"]["median_saving"] == 1_500
    assert summary["exactness"]["bitwise_exact"] is True
    assert summary["status"] == "authorized", summary["gate_details"]
    assert summary["decision"]["authorize"] is True
    assert summary["profile_contract"]["spans_per_step"]["control"]["attention"] == 2.0

    timings = stub.GetTimings(telemetry_pb2.TimingsRequest(experiment_id=EXP, span_name="attention"), timeout=5)
    by_arm = {t.arm: t for t in timings.timings}
    assert set(by_arm) == {"control", "candidate"}
    assert by_arm["control"].count == 2 * STEPS
    assert by_arm["control"].median_ns == round(float(np.median(sent["control"]["attention"])))
    assert by_arm["control"].p99_ns == round(float(np.percentile(sent["control"]["attention"], 99)))
    all_names = stub.GetTimings(telemetry_pb2.TimingsRequest(), timeout=5).timings
    assert {t.arm for t in all_names} == {""} and len(all_names) == 5

    (info,) = stub.ListExperiments(telemetry_pb2.ListExperimentsRequest(), timeout=5).experiments
    assert (info.experiment_id, info.control_spans, info.candidate_spans) == (EXP, 35, 35)
    assert list(info.artifact_kinds) == ["tokens/candidate", "tokens/control", "treatment"]

    html = stub.GetReport(telemetry_pb2.ReportRequest(experiment_id=EXP), timeout=30).html
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html


def test_summary_errors_map_to_precise_codes(server: RunningServer) -> None:
    stub = telemetry_pb2_grpc.TelemetryStub(server.channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    stub.RecordArtifact(telemetry_pb2.ArtifactRequest(experiment_id="e", kind=telemetry_pb2.ARTIFACT_KIND_WORKLOAD,
                                                      sha256="c" * 64), timeout=5)  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id="e", gate_spec_json="[{"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in err.value.details()
    summary = json.loads(stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id="e"), timeout=5).json)
    assert summary["status"] == "insufficient_samples" and summary["artifact_sha256"]["workload"] == "c" * 64
    bad = [
        telemetry_pb2.ArtifactRequest(
            experiment_id="e", kind=telemetry_pb2.ARTIFACT_KIND_TOKENS, arm="blue", sha256="a" * 64
        ),
        telemetry_pb2.ArtifactRequest(experiment_id="e", arm="control", sha256="a" * 64),
        telemetry_pb2.ArtifactRequest(
            experiment_id="e",
            arm="control",
            kind=telemetry_pb2.ARTIFACT_KIND_TOKENS,
            tokens_json="[1,2]",
            sha256="a" * 64,
        ),  # fmt: skip
        telemetry_pb2.ArtifactRequest(kind=telemetry_pb2.ARTIFACT_KIND_TREATMENT, value="x"),
    ]
    for req in bad:
        with pytest.raises(grpc.RpcError) as err:
            stub.RecordArtifact(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req


# --- malformed OTLP through a raw channel ----------------------------------------------------


def test_malformed_spans_are_rejected_and_counted(server: RunningServer) -> None:
    spans = [
        raw_span("good"),
        raw_span("no_trace", trace_id=b""),
        raw_span("zero_span", span_id=b"\x00" * 8),
        raw_span("backwards", span_id=b"\x03" * 8, start=5_000, end=4_000),
        raw_span("bad_arm", span_id=b"\x04" * 8, arm="treatment"),
    ]
    resp = otlp_export(server.channel)(export_request(spans), timeout=5)
    assert resp.partial_success.rejected_spans == 4
    msg = resp.partial_success.error_message
    assert "trace_id is 0 bytes" in msg and "span_id is all zero" in msg and "end before start" in msg
    assert "and 1 more" in msg
    rows = server.server.store.spans("raw")
    assert [(r.name, r.duration_ns, r.arm) for r in rows] == [("good", 1_000, "control")]


def test_garbage_bytes_get_invalid_argument_and_service_stays_healthy(server: RunningServer) -> None:
    raw = server.channel.unary_unary(EXPORT)  # no serializers: bytes on the wire as given
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\x0a\xff\xff\xff\xff\x0f garbage", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert health_status(server.channel) == health_pb2.HealthCheckResponse.SERVING
    trace_service = "opentelemetry.proto.collector.trace.v1.TraceService"
    assert health_status(server.channel, trace_service) == health_pb2.HealthCheckResponse.SERVING
    assert (
        otlp_export(server.channel)(export_request([raw_span("after")]), timeout=5).partial_success.rejected_spans == 0
    )


def test_reflection_lists_every_service(server: RunningServer) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    (resp,) = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    )
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvfleet.v1.Telemetry", "opentelemetry.proto.collector.trace.v1.TraceService",
            "grpc.health.v1.Health"} <= names  # fmt: skip


# --- overload and shutdown -------------------------------------------------------------------


class BlockingStore(SqliteSpanStore):
    """Holds every add_spans until released, so exports pile up as pending."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.entered = threading.Event()
        self.release = threading.Event()

    def add_spans(self, rows: Any) -> int:
        self.entered.set()
        assert self.release.wait(timeout=20)
        return super().add_spans(rows)


def test_overload_answers_unavailable_with_retry_info(tmp_path: Any) -> None:
    store = BlockingStore(str(tmp_path / "slow.db"))
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path="unused", max_pending_spans=2, retry_after_s=0.25)
    srv = RunningServer(config, store)
    try:
        export = otlp_export(srv.channel)
        first = export.future(
            export_request([raw_span("a", span_id=b"\x05" * 8), raw_span("b", span_id=b"\x06" * 8)]), timeout=20
        )
        assert store.entered.wait(timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            export(export_request([raw_span("c", span_id=b"\x07" * 8)]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = dict(err.value.trailing_metadata())[STATUS_DETAILS_KEY]
        status = status_pb2.Status.FromString(details)
        assert status.code == grpc.StatusCode.UNAVAILABLE.value[0]
        info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(info)
        assert info.retry_delay.ToNanoseconds() == 250_000_000
        store.release.set()
        assert first.result(timeout=10).partial_success.rejected_spans == 0
        export(export_request([raw_span("c", span_id=b"\x07" * 8)]), timeout=5)  # admitted once the backlog drained
        assert sorted(r.name for r in store.spans("raw")) == ["a", "b", "c"]
    finally:
        store.release.set()
        srv.stop()


def test_stop_drains_and_flushes_the_store(tmp_path: Any) -> None:
    path = str(tmp_path / "t.db")
    srv = RunningServer(TelemetryConfig(host="127.0.0.1", port=0, db_path=path))
    otlp_export(srv.channel)(export_request([raw_span("kept")]), timeout=5)
    watcher = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    srv.stop()
    with pytest.raises(grpc.RpcError):
        health_status(watcher)  # the server is gone, not half-serving
    watcher.close()
    reopened = SqliteSpanStore(path)
    assert [r.name for r in reopened.spans()] == ["kept"]
    reopened.close()
    assert not (tmp_path / "t.db-wal").exists() or (tmp_path / "t.db-wal").stat().st_size == 0


def test_entry_point_serves_and_stops_cleanly_on_sigterm(tmp_path: Any) -> None:
    db = tmp_path / "main.db"
    cmd = [
        sys.executable,
        "-m",
        "telemetry_svc",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--db",
        str(db),
        "--metrics-port",
        "0",
        "--http-port",
        "0",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()  # type: ignore[union-attr]
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
            assert line or proc.poll() is None, "server exited before listening"
        assert port, "no listening line in the log"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert health_status(ch) == health_pb2.HealthCheckResponse.SERVING
            otlp_export(ch)(export_request([raw_span("via_main")]), timeout=5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        # No token and no allowed clients configured: it runs open, and says so.
        assert "telemetry is OPEN" in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    store = SqliteSpanStore(str(db))
    assert [r.name for r in store.spans()] == ["via_main"]
    store.close()

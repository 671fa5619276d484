"""The telemetry service closed and bounded: token / mutual-TLS authorization of writes,
write-once artifacts, retention with its metrics, paged timings, a receive limit that fits the
collector's batches. Real servers on loopback ports; spans through the stock OTLP exporter."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from kvfleet.local_cluster import free_port
from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from kvfleet_common.security import TlsConfig
from telemetry_svc.auth import AuthPolicy
from telemetry_svc.retention import RetentionPolicy
from telemetry_svc.server import MAX_EXPORT_BYTES, TelemetryConfig
from tests.helpers.prometheus import scrape, value
from tests.helpers.telemetry_server import RunningServer, export_request, health_status, otlp_export, raw_span

TOKEN = "telemetry-s3cret"
BEARER = (("authorization", f"Bearer {TOKEN}"),)


def _config(tmp_path: Any, **kw: Any) -> TelemetryConfig:
    return TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), **kw)


@pytest.fixture
def guarded(tmp_path: Any) -> Iterator[RunningServer]:
    srv = RunningServer(_config(tmp_path, auth=AuthPolicy(token=TOKEN)))
    yield srv
    srv.stop()


class _Verdicts(SpanExporter):
    """Passes spans to the real exporter and keeps what each export call returned."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner, self.results = inner, []

    def export(self, spans: Any) -> SpanExportResult:
        result = self.inner.export(spans)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def _sdk_export(port: int, name: str, headers: str | None, monkeypatch: pytest.MonkeyPatch) -> bool:
    """One span through the stock SDK exporter, configured only by the standard environment;
    True when the server accepted the export (the exporter's own SUCCESS)."""
    if headers is None:
        monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS", raising=False)
    else:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", headers)
    provider = TracerProvider(resource=Resource.create({"service.name": "kvfleet-worker"}))
    verdicts = _Verdicts(OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=5))
    provider.add_span_processor(SimpleSpanProcessor(verdicts))
    provider.get_tracer("t").start_span(name, attributes={"experiment.id": "auth"}).end()
    provider.shutdown()
    assert len(verdicts.results) == 1, verdicts.results  # the span really went to the exporter
    return verdicts.results[0] is SpanExportResult.SUCCESS


def _artifact(arm: str = "control", sha: str = "a" * 64, n: int = 5) -> telemetry_pb2.ArtifactRequest:
    return telemetry_pb2.ArtifactRequest(experiment_id="wo", arm=arm, kind=telemetry_pb2.ARTIFACT_KIND_TOKENS,
                                         sha256=sha, completion_tokens=n)  # fmt: skip


# --- authorization ------------------------------------------------------------------------------


def test_writes_need_the_token_and_otlp_exporters_send_it_from_the_environment(
    guarded: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not _sdk_export(guarded.port, "anonymous", None, monkeypatch)
    assert not _sdk_export(guarded.port, "wrong", "authorization=Bearer nope", monkeypatch)
    assert _sdk_export(guarded.port, "signed", f"authorization=Bearer {TOKEN}", monkeypatch)
    assert [r.name for r in guarded.server.store.spans()] == ["signed"]

    with pytest.raises(grpc.RpcError) as err:
        otlp_export(guarded.channel)(export_request([raw_span("raw")]), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in err.value.details()
    stub = telemetry_pb2_grpc.TelemetryStub(guarded.channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.RecordArtifact(_artifact(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.RecordArtifact(_artifact(), metadata=BEARER, timeout=5).sha256 == "a" * 64
    # Reads stay open unless asked otherwise; health never needs a token.
    assert stub.ListExperiments(telemetry_pb2.ListExperimentsRequest(), timeout=5).experiments
    assert health_status(guarded.channel) == 1
    metrics = guarded.server.metrics.registry
    export = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    assert metrics.get_sample_value("kvfleet:telemetry_unauthorized_requests_total", {"method": export}) == 3


def test_protected_reads_need_the_token_too(tmp_path: Any) -> None:
    srv = RunningServer(_config(tmp_path, auth=AuthPolicy(token=TOKEN, protect_reads=True)))
    try:
        stub = telemetry_pb2_grpc.TelemetryStub(srv.channel)
        for call, req in ((stub.GetTimings, telemetry_pb2.TimingsRequest()),
                          (stub.ListExperiments, telemetry_pb2.ListExperimentsRequest()),
                          (stub.GetReport, telemetry_pb2.ReportRequest(experiment_id="x"))):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not stub.GetTimings(telemetry_pb2.TimingsRequest(), metadata=BEARER, timeout=5).timings
        assert health_status(srv.channel) == 1
    finally:
        srv.stop()


def test_mutual_tls_writes_only_from_allowed_client_certificates(tmp_path: Any, certs: Path) -> None:
    tls = TlsConfig(cert=str(certs / "telemetry.pem"), key=str(certs / "telemetry.key"), ca=str(certs / "ca.pem"),
                    client_auth=True, allowed_clients=frozenset({"kvfleet-worker"}))  # fmt: skip
    srv = RunningServer(_config(tmp_path, tls=tls, auth=AuthPolicy(allowed_clients=tls.allowed_clients)))

    def dial(ident: str) -> grpc.Channel:
        creds = TlsConfig(cert=str(certs / f"{ident}.pem"), key=str(certs / f"{ident}.key"),
                          ca=str(certs / "ca.pem")).channel_credentials()  # fmt: skip
        return grpc.secure_channel(f"localhost:{srv.port}", creds)

    try:
        with dial("client") as user, dial("worker") as worker:
            with pytest.raises(grpc.RpcError) as err:
                otlp_export(user)(export_request([raw_span("from_user")]), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "kvfleet-client" in err.value.details()
            otlp_export(worker)(export_request([raw_span("from_worker")]), timeout=10)
            stub = telemetry_pb2_grpc.TelemetryStub(user)
            timings = stub.GetTimings(telemetry_pb2.TimingsRequest(), timeout=10).timings  # reads: any valid cert
            assert [t.span_name for t in timings] == ["from_worker"]
    finally:
        srv.stop()


# --- write-once artifacts -------------------------------------------------------------------------


def test_artifacts_are_write_once_and_a_retry_is_ok(guarded: RunningServer) -> None:
    stub = telemetry_pb2_grpc.TelemetryStub(guarded.channel)
    for arm in ("control", "candidate"):
        stub.RecordArtifact(_artifact(arm), metadata=BEARER, timeout=5)
    stub.RecordArtifact(_artifact("control"), metadata=BEARER, timeout=5)  # identical: idempotent
    before = stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id="wo"), timeout=10).json
    for forged in (_artifact("control", sha="b" * 64), _artifact("candidate", n=6)):
        with pytest.raises(grpc.RpcError) as err:
            stub.RecordArtifact(forged, metadata=BEARER, timeout=5)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and "write-once" in err.value.details()
    after = stub.GetSummary(telemetry_pb2.SummaryRequest(experiment_id="wo"), timeout=10).json
    assert after == before and '"bitwise_exact": true' in after


# --- paged timings ----------------------------------------------------------------------------------


def test_timings_are_paged_with_a_bounded_default(server: RunningServer) -> None:
    spans = [raw_span(f"s{i:03d}", span_id=(i + 1).to_bytes(8, "big")) for i in range(150)]
    otlp_export(server.channel)(export_request(spans), timeout=10)
    stub = telemetry_pb2_grpc.TelemetryStub(server.channel)
    first = stub.GetTimings(telemetry_pb2.TimingsRequest(), timeout=10)
    assert len(first.timings) == 100 and first.next_page_token
    rest = stub.GetTimings(telemetry_pb2.TimingsRequest(page_token=first.next_page_token), timeout=10)
    assert len(rest.timings) == 50 and rest.next_page_token == ""
    assert [t.span_name for t in [*first.timings, *rest.timings]] == [f"s{i:03d}" for i in range(150)]
    small = stub.GetTimings(telemetry_pb2.TimingsRequest(page_size=7), timeout=10)
    assert [t.span_name for t in small.timings] == [f"s{i:03d}" for i in range(7)]
    for bad in (telemetry_pb2.TimingsRequest(page_token="garbage"), telemetry_pb2.TimingsRequest(page_size=-1)):
        with pytest.raises(grpc.RpcError) as err:
            stub.GetTimings(bad, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def server(tmp_path: Any) -> Iterator[RunningServer]:
    srv = RunningServer(_config(tmp_path))
    yield srv
    srv.stop()


# --- receive limit -------------------------------------------------------------------------------------


def _big_request(n_spans: int, pad: int) -> Any:
    spans = []
    for i in range(n_spans):
        s = raw_span("batched", span_id=(i + 1).to_bytes(8, "big"))
        s.attributes.append(common_pb2.KeyValue(key="pad", value=common_pb2.AnyValue(string_value="x" * pad)))
        spans.append(s)
    return export_request(spans)


def test_a_full_collector_batch_fits_and_beyond_the_limit_is_refused(server: RunningServer) -> None:
    # The collector's default batch: 8192 spans; at 2.5 KiB each that is ~20 MiB, far past gRPC's
    # 4 MiB default and the shared 16 MiB.
    req = _big_request(8192, 2_500)
    assert 16 * 2**20 < req.ByteSize() < MAX_EXPORT_BYTES
    resp = otlp_export(server.channel)(req, timeout=60)
    assert resp.partial_success.rejected_spans == 0
    assert len(server.server.store.spans("raw")) == 8192
    too_big = _big_request(2, MAX_EXPORT_BYTES // 2)
    with pytest.raises(grpc.RpcError) as err:
        otlp_export(server.channel)(too_big, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- retention and its metrics ---------------------------------------------------------------------------


def test_retention_runs_in_the_background_and_is_exported_as_metrics(tmp_path: Any) -> None:
    port = free_port()
    policy = RetentionPolicy(max_age_s=0.5, max_bytes=64 * 2**20, interval_s=0.2)
    srv = RunningServer(_config(tmp_path, retention=policy, metrics_port=port))
    try:
        spans = [raw_span(f"old{i}", span_id=(i + 1).to_bytes(8, "big")) for i in range(5)]
        otlp_export(srv.channel)(export_request(spans), timeout=5)
        deadline = time.monotonic() + 15
        while srv.server.store.spans() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.server.store.spans() == []
        deleted = 'kvfleet:telemetry_spans_deleted_total{reason="age"} 5.0'
        text = ""
        while deleted not in text and time.monotonic() < deadline:
            text = scrape(port)
            time.sleep(0.1)
        assert deleted in text
        assert "kvfleet:telemetry_store_max_bytes 6.7108864e+07" in text
        assert "kvfleet:telemetry_store_bytes " in text and "kvfleet:telemetry_spans_accepted_total 5.0" in text
    finally:
        srv.stop()


def test_size_retention_deletes_the_oldest_artifacts_and_counts_them(tmp_path: Any) -> None:
    """Artifacts alone past --max-db-mb: the service's retention deletes the oldest, and
    kvfleet:telemetry_artifacts_deleted_total counts exactly those gone (README, "Artifact limits")."""
    port = free_port()
    policy = RetentionPolicy(max_age_s=3600, max_bytes=1 * 2**20, interval_s=0.2)
    srv = RunningServer(_config(tmp_path, retention=policy, metrics_port=port))
    try:
        stub = telemetry_pb2_grpc.TelemetryStub(srv.channel)
        recorded = [f"x{i:03d}" for i in range(200)]  # ~2 MB of 10 KB treatments, oldest first
        for name in recorded:
            kind = telemetry_pb2.ARTIFACT_KIND_TREATMENT
            stub.RecordArtifact(telemetry_pb2.ArtifactRequest(experiment_id=name, kind=kind, value=name + "v" * 10_000),
                                timeout=5)  # fmt: skip

        def state() -> tuple[float, list[str], int]:
            kept = sorted(e.experiment_id for e in srv.server.store.experiments())
            deleted = value(scrape(port), "kvfleet:telemetry_artifacts_deleted_total")
            return deleted, kept, srv.server.store.live_bytes()

        # Retention runs every 0.2 s, also while the artifacts came: wait for a run after the last.
        # The three reads are not one snapshot: read before a pass, `kept` (all 200) and the count
        # (0) agree, and a size read after it is under the bound; so a state counts only once
        # something was deleted (that torn read ended the wait once, and the test failed).
        deadline = time.monotonic() + 20

        def settled(deleted: float, kept: list[str], size: int) -> bool:
            return deleted > 0 and size <= policy.max_bytes and len(kept) == len(recorded) - deleted

        deleted, kept, size = state()
        while not settled(deleted, kept, size) and time.monotonic() < deadline:
            time.sleep(0.1)
            deleted, kept, size = state()
        assert size <= policy.max_bytes and deleted > 0, (size, deleted)
        assert len(kept) == len(recorded) - deleted, (deleted, len(kept))
        assert kept == recorded[-len(kept) :]  # the newest kept, the oldest gone first
    finally:
        srv.stop()


def test_kvfleet_services_send_the_token_from_a_file(
    guarded: RunningServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As compose hands it over: KVFLEET_TELEMETRY_TOKEN_FILE, read by the services' own tracing
    setup (kvfleet_common.tracing) and sent as the bearer token; a wrong file's spans are refused."""
    from kvfleet_common.tracing import setup_tracing, shutdown_tracing

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS", raising=False)
    monkeypatch.delenv("KVFLEET_TELEMETRY_TOKEN", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{guarded.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    for name, token in (("from-file", TOKEN), ("wrong-file", "not-the-token-at-all")):
        path = tmp_path / name
        path.write_text(token + "\n")
        monkeypatch.setenv("KVFLEET_TELEMETRY_TOKEN_FILE", str(path))
        provider = setup_tracing("kvfleet-worker", set_global=False)
        assert provider is not None
        provider.get_tracer("t").start_span(name).end()
        shutdown_tracing(provider)
    assert [r.name for r in guarded.server.store.spans()] == ["from-file"]

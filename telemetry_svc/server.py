"""The telemetry gRPC server: OTLP trace receiver + Telemetry service, on the shared scaffold
(kvfleet_common.grpcutil: health, reflection, drain, error mapping), with write authorization
(telemetry_svc.auth) and store retention (telemetry_svc.retention) running beside it, and
Jaeger's query API over the same store on an HTTP port (telemetry_svc.http_api).

Thin adapters only: protobuf in, domain objects to the pure core (otlp conversion, store,
summary, report), protobuf out. Store and CPU-heavy work run in worker threads
(asyncio.to_thread) so the event loop keeps answering health checks while a summary is built.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from kvfleet_common import grpcutil
from kvfleet_common.metrics import serve_metrics
from kvfleet_common.security import TlsConfig
from telemetry_svc import http_api
from telemetry_svc.auth import AuthInterceptor, AuthPolicy
from telemetry_svc.forward import OtlpForwarder, names_itself
from telemetry_svc.gates import GateSpec, InvalidGateSpec, load_default_spec, parse_gate_spec
from telemetry_svc.metrics import TelemetryMetrics
from telemetry_svc.model import (
    Artifact,
    ArtifactConflict,
    ArtifactKind,
    ArtifactTooLarge,
    ExperimentData,
    InvalidArtifact,
    InvalidPageToken,
    UnknownExperiment,  # fmt: skip
    token_sha256,
)
from telemetry_svc.otlp import convert, count_spans
from telemetry_svc.report import build_report
from telemetry_svc.retention import RetentionPolicy, enforce
from telemetry_svc.scheduler_link import SchedulerLink
from telemetry_svc.store import SpanStore, SqliteSpanStore
from telemetry_svc.summary import SummaryOptions, build_summary

logger = logging.getLogger(__name__)

TRACE_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
TELEMETRY_SERVICE = telemetry_pb2.DESCRIPTOR.services_by_name["Telemetry"].full_name
SERVICE_NAMES = (TRACE_SERVICE, TELEMETRY_SERVICE)
STATUS_DETAILS_KEY = "grpc-status-details-bin"

# The largest Export we accept. The compose collector (deploy/otel-collector/config.yaml) uses
# the batch processor's defaults: send_batch_size 8192 spans and send_batch_max_size 0 (no
# cap), so one batch is up to 8191 spans plus one whole incoming request (its receiver keeps
# gRPC's 4 MiB limit). 8192 spans x 3 KiB (a kvfleet span with its gen_ai.* attributes is a
# few hundred bytes) + 4 MiB = 28 MiB; 32 MiB leaves headroom. gRPC's default 4 MiB would
# refuse an ordinary full batch, and the shared 16 MiB (grpcutil.MAX_MESSAGE_BYTES) a batch of
# large spans.
MAX_EXPORT_BYTES = 32 * 1024 * 1024
DEFAULT_TIMINGS_PAGE = 100
MAX_TIMINGS_PAGE = 1000
# One artifact request, tokens_json included (hashed, never stored): an experiment of 64 sessions
# x 2048 tokens x 6 repeats per arm is ~4 MB of JSON. Larger ones send sha256 alone.
DEFAULT_MAX_ARTIFACT_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class TelemetryConfig:
    host: str = "127.0.0.1"  # in a compose network pass --host 0.0.0.0
    port: int = 4317  # the OTLP/gRPC default, so exporters need only the host
    db_path: str = "telemetry.db"
    max_pending_spans: int = 100_000  # spans received but not yet written; above it: UNAVAILABLE
    retry_after_s: float = 1.0  # the RetryInfo delay sent with UNAVAILABLE
    grace_s: float = 5.0  # how long in-flight RPCs may finish on SIGTERM
    tls: Any = None  # kvfleet_common.security.TlsConfig; None = plain TCP
    auth: AuthPolicy = field(default_factory=AuthPolicy)  # nothing configured: open (dev only)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    metrics_port: int = 0  # Prometheus /metrics; 0 = off (the entry point defaults to 9402)
    max_receive_bytes: int = MAX_EXPORT_BYTES
    max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES  # a RecordArtifact request, serialized
    # Pass every Export received on to this OTLP/gRPC endpoint too ("" = none): see forward.py.
    forward_otlp: str = ""
    # Jaeger's query API over the store (http_api.py): None = off, 0 = any free port (the entry
    # point defaults to 16686, Jaeger's query port).
    http_port: int | None = None
    # The scheduler the trace UI's live snapshot asks (host:port; "" = none: the page says so).
    scheduler: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"ports must be in [0, 65535], got {self.port} and {self.metrics_port}")
        if self.http_port is not None:
            if not 0 <= self.http_port <= 65535:
                raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
            if self.http_port and self.http_port in (self.port, self.metrics_port):
                raise ValueError(f"http_port {self.http_port} is also the gRPC or the metrics port")
        if self.max_pending_spans < 1:
            raise ValueError("max_pending_spans must be >= 1")
        if self.retry_after_s <= 0 or self.grace_s < 0:
            raise ValueError("retry_after_s must be > 0 and grace_s >= 0")
        if not self.db_path:
            raise ValueError("db_path must not be empty")
        if self.max_receive_bytes < 4 * 1024 * 1024:
            raise ValueError("max_receive_bytes below gRPC's own 4 MiB default makes no sense")
        if self.forward_otlp:
            from telemetry_svc.forward import parse_endpoint

            parse_endpoint(self.forward_otlp)  # a bad endpoint is a start-up error
        if not 1024 <= self.max_artifact_bytes <= self.max_receive_bytes:
            raise ValueError(
                f"max_artifact_bytes must be in 1 KiB..max_receive_bytes ({self.max_receive_bytes}), "
                f"got {self.max_artifact_bytes}"
            )


class Overloaded(Exception):
    """Too many spans pending; the client should retry after the given delay."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def status_details(code: grpc.StatusCode, message: str, retry_after_s: float) -> bytes:
    """A serialized google.rpc.Status carrying RetryInfo, for the grpc-status-details-bin trailer."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    rpc_code = getattr(code_pb2, code.name)
    return bytes(status_pb2.Status(code=rpc_code, message=message, details=[detail]).SerializeToString())


def _retry_info(exc: Exception, code: grpc.StatusCode) -> tuple[tuple[str, bytes], ...]:
    if isinstance(exc, Overloaded):
        return ((STATUS_DETAILS_KEY, status_details(code, str(exc), exc.retry_after_s)),)
    return ()


# The one place domain exceptions become gRPC status codes; anything else is a bug (INTERNAL).
mapped_errors = grpcutil.mapped_errors(
    (
        (UnknownExperiment, grpc.StatusCode.NOT_FOUND),
        (InvalidGateSpec, grpc.StatusCode.INVALID_ARGUMENT),
        (InvalidArtifact, grpc.StatusCode.INVALID_ARGUMENT),
        (InvalidPageToken, grpc.StatusCode.INVALID_ARGUMENT),
        (ArtifactConflict, grpc.StatusCode.ALREADY_EXISTS),
        (ArtifactTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Overloaded, grpc.StatusCode.UNAVAILABLE),
    ),
    _retry_info,
)


class Admission:
    """Bounds spans in flight between receipt and commit. Used from the event loop only."""

    def __init__(self, max_pending: int, retry_after_s: float) -> None:
        self._max = max_pending
        self._retry = retry_after_s
        self.pending = 0
        self.draining = False

    def admit(self, n: int) -> None:
        if self.draining:
            raise Overloaded("telemetry service is shutting down; retry against its replacement", self._retry)
        # A request larger than the bound is still admitted when nothing is pending, so no batch
        # size can be refused forever; the bound limits concurrent backlog, not one request.
        if self.pending and self.pending + n > self._max:
            raise Overloaded(f"{self.pending} spans pending (max {self._max}); retry later", self._retry)
        self.pending += n

    def release(self, n: int) -> None:
        self.pending -= n


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC TraceService. Registered with raw-bytes deserialization (see export_bytes)."""

    def __init__(
        self, store: SpanStore, admission: Admission, metrics: TelemetryMetrics, forwarder: OtlpForwarder | None = None
    ) -> None:
        self._store = store
        self._admission = admission
        self._metrics = metrics
        self._forwarder = forwarder

    async def export_bytes(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        # grpc's own deserializer turns a bad payload into INTERNAL; parsing here lets us answer
        # INVALID_ARGUMENT, which is what it is.
        try:
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not an ExportTraceServiceRequest: {exc}")
        response = await self.Export(request, context)
        if self._forwarder is not None:  # what was accepted here goes on as received
            self._forwarder.offer(raw, count_spans(request))
        return response

    @mapped_errors
    async def Export(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = count_spans(request)
        self._admission.admit(n)
        try:
            conv = await asyncio.to_thread(self._ingest, request)
        finally:
            self._admission.release(n)
        self._metrics.spans_accepted.inc(len(conv.rows))
        self._metrics.spans_rejected.inc(conv.rejected)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if conv.rejected:
            logger.info("OTLP export: %s", conv.error_message)
            response.partial_success.rejected_spans = conv.rejected
            response.partial_success.error_message = conv.error_message
        return response

    def _ingest(self, request: Any) -> Any:
        conv = convert(request)
        if conv.rows:
            self._store.add_spans(conv.rows)
        return conv


_KINDS = {
    telemetry_pb2.ARTIFACT_KIND_TOKENS: ArtifactKind.TOKENS,
    telemetry_pb2.ARTIFACT_KIND_WORKLOAD: ArtifactKind.WORKLOAD,
    telemetry_pb2.ARTIFACT_KIND_TREATMENT: ArtifactKind.TREATMENT,
    telemetry_pb2.ARTIFACT_KIND_PROJECT_COMMIT: ArtifactKind.PROJECT_COMMIT,
}


def artifact_from_pb(req: Any) -> Artifact:
    kind = _KINDS.get(req.kind)
    if kind is None:
        raise InvalidArtifact("kind must be set (ARTIFACT_KIND_TOKENS, _WORKLOAD, _TREATMENT, _PROJECT_COMMIT)")
    sha = req.sha256.lower()
    if req.tokens_json:
        if kind is not ArtifactKind.TOKENS:
            raise InvalidArtifact("tokens_json is only for ARTIFACT_KIND_TOKENS")
        computed = token_sha256(req.tokens_json)
        if sha and sha != computed:
            raise InvalidArtifact(f"sha256 {sha} does not match tokens_json (canonical digest {computed})")
        sha = computed
    return Artifact(req.experiment_id, kind, req.arm, sha, req.value, req.completion_tokens, req.cached_tokens)


async def experiment_summary(store: SpanStore, experiment_id: str,
                             spec: GateSpec | None = None) -> tuple[dict[str, Any], ExperimentData]:  # fmt: skip
    """The gate-and-decision summary of one experiment (GetSummary's document, the trace UI's
    experiment page) and the data it was built from; the store read and the statistics run in
    worker threads. UnknownExperiment: no span or artifact of it (or no id)."""
    if not experiment_id:
        raise UnknownExperiment("experiment_id is required")
    data = await asyncio.to_thread(store.experiment_data, experiment_id)
    opts = SummaryOptions(store_location=store.location)
    return await asyncio.to_thread(build_summary, data, spec or load_default_spec(), opts), data


class TelemetryService(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(
        self, store: SpanStore, max_artifact_bytes: int = DEFAULT_MAX_ARTIFACT_BYTES, metrics: Any = None
    ) -> None:
        self._store = store
        self._max_artifact_bytes = max_artifact_bytes
        self._metrics = metrics

    def _spec(self, text: str) -> GateSpec:
        return parse_gate_spec(text) if text.strip() else load_default_spec()

    async def _summary(self, experiment_id: str, spec_json: str) -> tuple[dict[str, Any], ExperimentData]:
        return await experiment_summary(self._store, experiment_id, self._spec(spec_json))

    @mapped_errors
    async def GetSummary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        summary, _ = await self._summary(request.experiment_id, request.gate_spec_json)
        return telemetry_pb2.SummaryResponse(json=json.dumps(summary, indent=2))

    @mapped_errors
    async def GetReport(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        summary, data = await self._summary(request.experiment_id, request.gate_spec_json)
        html = await asyncio.to_thread(build_report, summary, data)
        return telemetry_pb2.ReportResponse(html=html)

    @mapped_errors
    async def ListExperiments(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        infos = await asyncio.to_thread(self._store.experiments)
        return telemetry_pb2.ListExperimentsResponse(
            experiments=[
                telemetry_pb2.ExperimentInfo(
                    experiment_id=i.experiment_id,
                    control_spans=i.spans_per_arm.get("control", 0),
                    candidate_spans=i.spans_per_arm.get("candidate", 0),
                    other_spans=i.spans_per_arm.get("", 0),
                    artifact_kinds=list(i.artifact_kinds),
                )
                for i in infos
            ]
        )

    @mapped_errors
    async def GetTimings(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        exp, name = request.experiment_id or None, request.span_name or None
        if request.page_size < 0:
            raise InvalidPageToken(f"page_size must be >= 0, got {request.page_size}")
        size = min(request.page_size or DEFAULT_TIMINGS_PAGE, MAX_TIMINGS_PAGE)
        page = await asyncio.to_thread(self._store.timings, exp, name, size, request.page_token)
        timings = [
            telemetry_pb2.SpanTiming(span_name=t.span_name, arm=t.arm, count=t.count, median_ns=round(t.quantiles_ns[0]),
                                     p90_ns=round(t.quantiles_ns[1]), p99_ns=round(t.quantiles_ns[2]))
            for t in page.timings
        ]  # fmt: skip
        return telemetry_pb2.TimingsResponse(timings=timings, next_page_token=page.next_page_token)

    @mapped_errors
    async def RecordArtifact(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        size = request.ByteSize()
        if size > self._max_artifact_bytes:  # before any JSON is parsed or hashed
            if self._metrics is not None:
                self._metrics.artifacts_refused.inc()
            raise ArtifactTooLarge(
                f"the artifact request is {size} bytes; this service takes at most {self._max_artifact_bytes} "
                "(--max-artifact-kb): send the tokens' sha256 instead of tokens_json, or raise the limit"
            )
        artifact = artifact_from_pb(request)
        stored = await asyncio.to_thread(self._store.add_artifact, artifact)
        logger.info("artifact %s/%s %s %s", artifact.experiment_id, artifact.kind.value, artifact.arm or "-",
                    "recorded" if stored else "already recorded (identical)")  # fmt: skip
        return telemetry_pb2.ArtifactResponse(sha256=artifact.sha256)


class TelemetryServer:
    """The grpc.aio server, its health servicer, store and retention task; stop() drains all."""

    def __init__(self, server: grpc.aio.Server, health_servicer: Any, store: SpanStore, admission: Admission,
                 config: TelemetryConfig, metrics: TelemetryMetrics,
                 forwarder: OtlpForwarder | None = None) -> None:  # fmt: skip
        self.grpc_server = server
        self.forwarder = forwarder
        self.health = health_servicer
        self.store = store
        self.metrics = metrics
        self.metrics_port: int | None = None
        self.http_port: int | None = None  # the Jaeger query API's, once started
        self._http: Any = None  # its aiohttp AppRunner
        self._scheduler: SchedulerLink | None = None  # what the UI's live snapshot asks
        self._admission = admission
        self._config = config
        self._stopping = asyncio.Event()
        self._retention: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.grpc_server.start()
        if self.forwarder is not None:
            self.forwarder.start()
            logger.info("forwarding every OTLP export to %s", self.forwarder.endpoint)
        self._retention = asyncio.create_task(self._retention_loop(), name="telemetry-retention")
        try:
            self.metrics_port = serve_metrics(self.metrics.registry, self._config.host, self._config.metrics_port)
        except OSError as exc:
            # Losing our own /metrics must not stop the cluster's traces from being received.
            logger.error(
                "telemetry metrics port %d unavailable (%s); running without /metrics", self._config.metrics_port, exc
            )
        if self._config.http_port is not None:
            await self._start_http_api(self._config.http_port)

    async def _start_http_api(self, port: int) -> None:
        self._scheduler = SchedulerLink(self._config.scheduler, self._config.tls) if self._config.scheduler else None
        app = http_api.create_app(
            self.store,
            self._config.auth,
            lambda route: self.metrics.unauthorized.labels(method=route).inc(),
            summarize=lambda experiment_id: experiment_summary(self.store, experiment_id),
            scheduler=self._scheduler,
        )
        try:
            self._http, self.http_port = await http_api.start(app, self._config.host, port, self._config.tls,
                                                              self._config.grace_s)  # fmt: skip
        except OSError as exc:
            # Like /metrics: a taken port must not stop the cluster's traces from being received.
            logger.error("telemetry trace API port %d unavailable (%s); running without it", port, exc)

    async def enforce_retention(self) -> None:
        """One retention pass in a worker thread (the store batches its deletes)."""
        result = await asyncio.to_thread(enforce, self.store, self._config.retention, time.time_ns())
        self.metrics.retention(result)
        if result.deleted_by_age or result.deleted_by_size or result.artifacts_deleted_by_size:
            logger.info(
                "retention deleted %d spans by age, %d spans and %d artifacts by size; store %.1f MB, %d spans",
                result.deleted_by_age,
                result.deleted_by_size,
                result.artifacts_deleted_by_size,
                result.live_bytes / 2**20,
                result.spans,
            )

    async def _retention_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.enforce_retention()
            except Exception:  # a failed pass is retried next interval; the receiver keeps going
                logger.exception("retention pass failed")
            try:
                await asyncio.wait_for(self._stopping.wait(), self._config.retention.interval_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING, refuse new exports, let in-flight RPCs finish within grace, finish the
        running retention pass, close the store."""
        self._admission.draining = True
        self._stopping.set()
        await grpcutil.drain(self.grpc_server, self.health, SERVICE_NAMES, grace)
        if self._retention is not None:
            await self._retention  # ends after its current pass: never closes the store under it
        if self.forwarder is not None:
            await self.forwarder.close(min(grace or 0.0, 2.0))
        if self._http is not None:  # its reads in flight finish (within the grace) before the store closes
            await self._http.cleanup()
        if self._scheduler is not None:
            await self._scheduler.close()
        await asyncio.to_thread(self.store.close)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


def create_server(config: TelemetryConfig, store: SpanStore | None = None) -> tuple[TelemetryServer, int]:
    """Build and bind (not start) the server; call it inside the running event loop. The server
    takes ownership of `store` (default: SQLite at config.db_path) and closes it on stop().
    Returns the server and the bound port (useful with port 0)."""
    store = store if store is not None else SqliteSpanStore(config.db_path)
    admission = Admission(config.max_pending_spans, config.retry_after_s)
    metrics = TelemetryMetrics(config.retention)
    auth = AuthInterceptor(config.auth, lambda method: metrics.unauthorized.labels(method=method).inc())
    server = grpc.aio.server(options=grpcutil.server_options(config.max_receive_bytes), interceptors=[auth])
    forwarder = None
    if config.forward_otlp:
        forwarder = OtlpForwarder(
            config.forward_otlp, on_drop=metrics.forward_dropped.inc, on_sent=metrics.forwarded.inc
        )
    receiver = TraceReceiver(store, admission, metrics, forwarder)
    export = grpc.unary_unary_rpc_method_handler(
        receiver.export_bytes,
        request_deserializer=None,
        response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRACE_SERVICE, {"Export": export}),))
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(
        TelemetryService(store, config.max_artifact_bytes, metrics), server
    )
    health_servicer = grpcutil.add_health_and_reflection(server, SERVICE_NAMES)
    port = grpcutil.bind(server, config.host, config.port, config.tls or TlsConfig())
    if forwarder is not None and names_itself(config.forward_otlp, config.host, port):
        raise ValueError(
            f"--forward-otlp {config.forward_otlp} is this telemetry service's own address ({config.host}:{port}): "
            "every export would come back for ever; name another collector, or none"
        )
    return TelemetryServer(server, health_servicer, store, admission, config, metrics, forwarder), port


async def serve(config: TelemetryConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain (see TelemetryServer.stop)."""
    srv, port = create_server(config)
    await srv.start()
    logger.info("telemetry listening on %s:%d (store %s, metrics port %s, Jaeger query API port %s)", config.host,
                port, srv.store.location, srv.metrics_port, srv.http_port)  # fmt: skip
    if not config.auth.configured:
        logger.warning(
            "telemetry is OPEN: anyone who can reach port %d may export spans and record artifacts; "
            "set KVFLEET_TELEMETRY_TOKEN (or --api-token) and/or KVFLEET_TLS_ALLOWED_CLIENTS",
            port,
        )
    await grpcutil.wait_for_termination_signal()
    logger.info("shutting down: draining for up to %.1f s", config.grace_s)
    await srv.stop(config.grace_s)
    logger.info("telemetry stopped; store flushed")

"""The telemetry gRPC server: OTLP trace receiver + Telemetry service + health + reflection.

Thin adapters only: protobuf in, domain objects to the pure core (otlp conversion, store,
summary, report), protobuf out. Store and CPU-heavy work run in worker threads
(asyncio.to_thread) so the event loop keeps answering health checks while a summary is built.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from telemetry_svc.gates import GateSpec, InvalidGateSpec, load_default_spec, parse_gate_spec
from telemetry_svc.model import Artifact, ArtifactKind, InvalidArtifact, UnknownExperiment, token_sha256
from telemetry_svc.otlp import convert, count_spans
from telemetry_svc.report import build_report
from telemetry_svc.stats import quantile
from telemetry_svc.store import SpanStore, SqliteSpanStore
from telemetry_svc.summary import SummaryOptions, build_summary

logger = logging.getLogger(__name__)

TRACE_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
TELEMETRY_SERVICE = telemetry_pb2.DESCRIPTOR.services_by_name["Telemetry"].full_name
STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class TelemetryConfig:
    host: str = "127.0.0.1"  # in a compose network pass --host 0.0.0.0
    port: int = 4317  # the OTLP/gRPC default, so exporters need only the host
    db_path: str = "telemetry.db"
    max_pending_spans: int = 100_000  # spans received but not yet written; above it: UNAVAILABLE
    retry_after_s: float = 1.0  # the RetryInfo delay sent with UNAVAILABLE
    grace_s: float = 5.0  # how long in-flight RPCs may finish on SIGTERM
    tls: Any = None  # kvfleet_common.security.TlsConfig; None = plain TCP

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_pending_spans < 1:
            raise ValueError("max_pending_spans must be >= 1")
        if self.retry_after_s <= 0 or self.grace_s < 0:
            raise ValueError("retry_after_s must be > 0 and grace_s >= 0")
        if not self.db_path:
            raise ValueError("db_path must not be empty")


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


_ERROR_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (UnknownExperiment, grpc.StatusCode.NOT_FOUND),
    (InvalidGateSpec, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidArtifact, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.UNAVAILABLE),
)

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def mapped_errors(method: Handler[R]) -> Handler[R]:
    """The one place domain exceptions become gRPC status codes; anything else is a bug (INTERNAL)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            for exc_type, code in _ERROR_CODES:
                if isinstance(exc, exc_type):
                    trailer: tuple[tuple[str, bytes], ...] = ()
                    if isinstance(exc, Overloaded):
                        trailer = ((STATUS_DETAILS_KEY, status_details(code, str(exc), exc.retry_after_s)),)
                    await context.abort(code, str(exc), trailing_metadata=trailer)
            logger.exception("bug in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the telemetry service log")
        raise AssertionError("unreachable")  # abort() always raises

    return wrapper


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

    def __init__(self, store: SpanStore, admission: Admission) -> None:
        self._store = store
        self._admission = admission

    async def export_bytes(self, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        # grpc's own deserializer turns a bad payload into INTERNAL; parsing here lets us answer
        # INVALID_ARGUMENT, which is what it is.
        try:
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not an ExportTraceServiceRequest: {exc}")
        return await self.Export(request, context)

    @mapped_errors
    async def Export(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        n = count_spans(request)
        self._admission.admit(n)
        try:
            conv = await asyncio.to_thread(self._ingest, request)
        finally:
            self._admission.release(n)
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


class TelemetryService(telemetry_pb2_grpc.TelemetryServicer):
    def __init__(self, store: SpanStore) -> None:
        self._store = store

    def _spec(self, text: str) -> GateSpec:
        return parse_gate_spec(text) if text.strip() else load_default_spec()

    async def _summary(self, experiment_id: str, spec_json: str) -> tuple[dict[str, Any], Any]:
        if not experiment_id:
            raise UnknownExperiment("experiment_id is required")
        spec = self._spec(spec_json)
        data = await asyncio.to_thread(self._store.experiment_data, experiment_id)
        opts = SummaryOptions(store_location=self._store.location)
        return await asyncio.to_thread(build_summary, data, spec, opts), data

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
        groups = await asyncio.to_thread(self._store.durations, exp, name)
        if exp is None:  # across experiments arms mean nothing: group by name only
            merged: dict[tuple[str, str], list[int]] = {}
            for (n, _arm), ds in groups.items():
                merged.setdefault((n, ""), []).extend(ds)
            groups = merged
        timings = [
            telemetry_pb2.SpanTiming(
                span_name=n, arm=arm, count=len(ds), median_ns=round(quantile(ds, 0.5)),
                p90_ns=round(quantile(ds, 0.9)), p99_ns=round(quantile(ds, 0.99)),
            )
            for (n, arm), ds in sorted(groups.items())
        ]  # fmt: skip
        return telemetry_pb2.TimingsResponse(timings=timings)

    @mapped_errors
    async def RecordArtifact(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        artifact = artifact_from_pb(request)
        await asyncio.to_thread(self._store.add_artifact, artifact)
        logger.info("artifact %s/%s %s recorded", artifact.experiment_id, artifact.kind.value, artifact.arm or "-")
        return telemetry_pb2.ArtifactResponse(sha256=artifact.sha256)


class TelemetryServer:
    """The grpc.aio server with its health servicer and store; stop() drains and closes all."""

    def __init__(self, server: grpc.aio.Server, health_servicer: Any, store: SpanStore, admission: Admission):
        self.grpc_server = server
        self.health = health_servicer
        self.store = store
        self._admission = admission

    async def start(self) -> None:
        await self.grpc_server.start()
        for name in ("", TRACE_SERVICE, TELEMETRY_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING, refuse new exports, let in-flight RPCs finish within grace, close the store."""
        self._admission.draining = True
        await self.health.enter_graceful_shutdown()
        await self.grpc_server.stop(grace)
        await asyncio.to_thread(self.store.close)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


def create_server(config: TelemetryConfig, store: SpanStore | None = None) -> tuple[TelemetryServer, int]:
    """Build and bind (not start) the server; call it inside the running event loop. The server
    takes ownership of `store` (default: SQLite at config.db_path) and closes it on stop().
    Returns the server and the bound port (useful with port 0)."""
    store = store if store is not None else SqliteSpanStore(config.db_path)
    admission = Admission(config.max_pending_spans, config.retry_after_s)
    server = grpc.aio.server()
    receiver = TraceReceiver(store, admission)
    export = grpc.unary_unary_rpc_method_handler(
        receiver.export_bytes,
        request_deserializer=None,
        response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRACE_SERVICE, {"Export": export}),))
    telemetry_pb2_grpc.add_TelemetryServicer_to_server(TelemetryService(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (TRACE_SERVICE, TELEMETRY_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)  # fmt: skip
    reflection.enable_server_reflection(names, server)
    from kvfleet_common.grpcutil import bind
    from kvfleet_common.security import TlsConfig

    port = bind(server, config.host, config.port, config.tls or TlsConfig())
    return TelemetryServer(server, health_servicer, store, admission), port


async def serve(config: TelemetryConfig) -> None:
    """Run until SIGTERM or SIGINT, then drain (see TelemetryServer.stop)."""
    srv, port = create_server(config)
    await srv.start()
    logger.info("telemetry listening on %s:%d (store %s)", config.host, port, srv.store.location)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: draining for up to %.1f s", config.grace_s)
    await srv.stop(config.grace_s)
    logger.info("telemetry stopped; store flushed")

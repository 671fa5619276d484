"""The real telemetry server on a loopback port, run on its own event loop in a background thread
so that a test talks to it with ordinary blocking clients; and raw OTLP traffic for it (spans
built by hand, sent without the SDK exporter's checks)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry_svc.server import TelemetryConfig, create_server

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class RunningServer:
    def __init__(self, config: TelemetryConfig, store: Any = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = self._call(self._start(config, store))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    async def _start(self, config: TelemetryConfig, store: Any) -> Any:
        srv, port = create_server(config, store)
        await srv.start()
        return srv, port

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def stop(self) -> None:
        self.channel.close()
        self._call(self.server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def health_status(channel: grpc.Channel, service: str = "") -> int:
    """The health service's status for `service` ("" for the server as a whole)."""
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def raw_span(name: str, trace_id: bytes = b"\x01" * 16, span_id: bytes = b"\x02" * 8, start: int = 1_000,
             end: int = 2_000, arm: str | None = "control") -> trace_pb2.Span:  # fmt: skip
    """An OTLP span of experiment "raw" (and `arm`, unless None), as given: no checks."""
    attrs = [common_pb2.KeyValue(key="experiment.id", value=common_pb2.AnyValue(string_value="raw"))]
    if arm is not None:
        attrs.append(common_pb2.KeyValue(key="experiment.arm", value=common_pb2.AnyValue(string_value=arm)))
    return trace_pb2.Span(trace_id=trace_id, span_id=span_id, name=name, start_time_unix_nano=start,
                          end_time_unix_nano=end, attributes=attrs)  # fmt: skip


def export_request(spans: list[trace_pb2.Span]) -> trace_service_pb2.ExportTraceServiceRequest:
    """`spans` in one resource and scope, as an OTLP Export request."""
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]
    )


def otlp_export(channel: grpc.Channel) -> Any:
    """The OTLP trace Export method on `channel`, as a callable."""
    return channel.unary_unary(
        EXPORT,
        request_serializer=trace_service_pb2.ExportTraceServiceRequest.SerializeToString,
        response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
    )

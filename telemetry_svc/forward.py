"""OTLP fan-out: every Export the telemetry service receives is passed on, as received, to another
OTLP/gRPC endpoint (an existing collector, Tempo, Jaeger), so kvfleet's store is not the only
place traces can go.

Bounded: requests wait in a queue of ``max_queue``; when it is full, or the endpoint refuses or
does not answer within ``timeout_s``, the request is dropped and its spans counted
(``kvfleet:telemetry_forward_dropped_spans_total``). Forwarding never slows or fails the export
that kvfleet's own store takes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from kvfleet_common import grpcutil

log = logging.getLogger(__name__)
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def parse_endpoint(endpoint: str) -> tuple[bool, str]:
    """(TLS?, host:port) of an OTLP/gRPC endpoint as the OTLP exporters write it: host:port,
    http://host:port (plain), or https://host:port (TLS with the system's roots)."""
    scheme, sep, rest = endpoint.partition("://")
    target = (rest if sep else endpoint).rstrip("/")
    host, colon, port = target.rpartition(":")
    if not (host and colon and port.isdigit()) or (sep and scheme not in ("http", "https")) or "/" in target:
        raise ValueError(f"forward endpoint must be host:port, http://host:port or https://host:port, got {endpoint!r}")
    return bool(sep) and scheme == "https", target


_LOCAL = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0", ""}


def names_itself(endpoint: str, host: str, port: int) -> bool:
    """Whether ``endpoint`` is this service's own address (host, port): forwarding there would
    send every export back to itself, for ever."""
    _, target = parse_endpoint(endpoint)
    ep_host, _, ep_port = target.rpartition(":")
    return int(ep_port) == port and (ep_host == host or (ep_host in _LOCAL and host in _LOCAL))


def channel_for(endpoint: str) -> grpc.aio.Channel:
    tls, target = parse_endpoint(endpoint)
    if tls:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=grpcutil.CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(target, options=grpcutil.CHANNEL_OPTIONS)


class OtlpForwarder:
    def __init__(
        self,
        endpoint: str,
        on_drop: Callable[[int], None] = lambda spans: None,
        on_sent: Callable[[int], None] = lambda spans: None,
        max_queue: int = 256,
        timeout_s: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self._channel = channel_for(endpoint)
        self._export = self._channel.unary_unary(EXPORT, request_serializer=None, response_deserializer=None)
        self._queue: asyncio.Queue[tuple[bytes, int]] = asyncio.Queue(max_queue)
        self._on_drop = on_drop
        self._on_sent = on_sent
        self._timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        self.forwarded = 0  # requests passed on

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="otlp-forward")

    def offer(self, raw: bytes, spans: int) -> None:
        """Queue one received Export (its bytes, as received); drop it when the queue is full."""
        try:
            self._queue.put_nowait((raw, spans))
        except asyncio.QueueFull:
            self._on_drop(spans)

    async def _run(self) -> None:
        while True:
            raw, spans = await self._queue.get()
            try:
                await self._export(raw, timeout=self._timeout_s)
                self.forwarded += 1
                self._on_sent(spans)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "forwarding %d spans to %s failed: %s %s", spans, self.endpoint, exc.code().name, exc.details()
                )
                self._on_drop(spans)
            finally:
                self._queue.task_done()

    async def close(self, grace_s: float = 2.0) -> None:
        """Send what waits (for up to grace_s), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self._queue.join(), grace_s)
            except asyncio.TimeoutError:
                pass
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()

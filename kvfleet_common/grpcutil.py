"""Pieces every kvfleet gRPC server shares: health, reflection, graceful drain, error mapping."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvfleet_common.listen import cannot_listen

log = logging.getLogger(__name__)

# Large enough for a long prompt's token ids or a batch of OTLP spans, small enough to bound memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# Connection lifetime. The server pings every connection each KEEPALIVE_TIME_MS and drops it
# when no answer comes within KEEPALIVE_TIMEOUT_MS: a vanished peer's streams (and the sessions
# behind them) end within ~80 s instead of when TCP gives up (hours).
KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# A connection that carried no RPC for this long is closed (its client reconnects on the next call).
MAX_CONNECTION_IDLE_MS = 5 * 60_000
# How age and grace interact: at MAX_CONNECTION_AGE_MS (gRPC adds +-10 % jitter) the server sends
# GOAWAY, so new calls go to a new connection (and a rebalanced server), while calls in flight
# keep MAX_CONNECTION_AGE_GRACE_MS to finish before the connection is closed under them. So a
# stream is guaranteed MAX_STREAM_S (the grace) whenever it starts, and no stream - not even one
# whose client stopped reading - outlives its connection's age + grace (at most ~2.6 h).
MAX_STREAM_S = 2 * 3600
MAX_CONNECTION_AGE_MS = 30 * 60_000
MAX_CONNECTION_AGE_GRACE_MS = MAX_STREAM_S * 1000
# Clients may ping (keepalive) as often as every 10 s, with or without calls in flight; a client
# pinging faster is told GOAWAY after MAX_PING_STRIKES offences (so pings cannot be a flood).
MIN_CLIENT_PING_INTERVAL_MS = 10_000
MAX_PING_STRIKES = 2


def server_options(
    max_receive_bytes: int = MAX_MESSAGE_BYTES, keepalive_time_ms: int = KEEPALIVE_TIME_MS
) -> list[tuple[str, int]]:
    """Every kvfleet server's channel arguments: message size limits, keepalive, connection
    idle/age limits and the ping policy. `max_receive_bytes` for a server whose peers batch more
    than MAX_MESSAGE_BYTES into one message (an OTLP receiver behind a collector);
    `keepalive_time_ms` for tests that need to see pings within seconds."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]


SERVER_OPTIONS = server_options()
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # gRPC's transparent retries only (no retry policy is set, so a call the server saw is never
    # sent twice): a call or stream started as its server sends GOAWAY (at each connection's max
    # age) is refused unseen, and is sent again on a fresh connection rather than failing
    # UNAVAILABLE (tests/integration/test_goaway_race.py). A client's own retries stay its own.
    ("grpc.enable_retries", 1),
    # A restarted worker should be dialled again within seconds, not after gRPC's default
    # reconnect backoff (which grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> health.HealthServicer:
    """The stock health service (every service SERVING) and server reflection."""
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    for name in names + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names + [reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    return health_servicer


def set_not_serving(health_servicer: health.HealthServicer, service_names: Iterable[str]) -> None:
    for name in list(service_names) + [""]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def bind(server: grpc.aio.Server, host: str, port: int, tls=None, what: str = "gRPC", flag: str = "--port") -> int:
    """Listen on host:port, with TLS when `tls` (a kvfleet_common.security.TlsConfig) has a
    certificate. listen.CannotListen (one line: why, and ``flag`` to move it) if it cannot."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None and tls.serves_tls:
            bound = server.add_secure_port(address, tls.server_credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc >= 1.5x raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise cannot_listen(what, host, port, flag)
    return bound


async def wait_for_termination_signal() -> None:
    """Return on SIGTERM or SIGINT (Ctrl-C)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def check_health(address: str, timeout: float = 1.0, tls=None) -> bool:
    """tls: a kvfleet_common.security.TlsConfig; None = from the environment."""
    from kvfleet_common.security import aio_channel

    async with aio_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


async def drain(
    server: grpc.aio.Server, health_servicer: health.HealthServicer, service_names: Iterable[str], grace_s: float | None
) -> None:
    """Report NOT_SERVING (load balancers stop sending), then let in-flight RPCs finish within
    grace_s before the server stops. Stop admitting work before calling this."""
    set_not_serving(health_servicer, service_names)
    await server.stop(grace_s)


ErrorTable = Sequence[tuple[type[Exception], grpc.StatusCode]]
Trailers = Callable[[Exception, grpc.StatusCode], Sequence[tuple[str, str | bytes]]]
_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])


def mapped_errors(table: ErrorTable, trailers: Trailers | None = None) -> Callable[[_Handler], _Handler]:
    """Decorator for async unary servicer methods (self, request, context): the one place domain
    exceptions become precise status codes (the first matching row of `table` wins; `trailers`
    may add trailing metadata such as RetryInfo). Anything else is a bug: logged with its
    traceback and answered INTERNAL without leaking the message."""

    def decorate(method: _Handler) -> _Handler:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await method(self, request, context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:
                for exc_type, code in table:
                    if isinstance(exc, exc_type):
                        extra = tuple(trailers(exc, code)) if trailers else ()
                        await context.abort(code, str(exc), trailing_metadata=extra)
                log.exception("bug in %s", method.__name__)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the service log")
            raise AssertionError("unreachable")  # abort() always raises

        return wrapper  # type: ignore[return-value]

    return decorate

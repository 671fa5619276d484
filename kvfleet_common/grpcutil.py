"""Pieces every kvfleet gRPC server shares: health, reflection, graceful drain, error mapping."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Large enough for a long prompt's token ids or a batch of OTLP spans, small enough to bound memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
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


def bind(server: grpc.aio.Server, host: str, port: int, tls=None) -> int:
    """Listen on host:port, with TLS when `tls` (a kvfleet_common.security.TlsConfig) has a certificate."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls is not None and tls.serves_tls:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}; is the port in use?")
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

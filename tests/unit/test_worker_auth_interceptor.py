"""The worker's auth interceptor gates the Worker's unary and bidirectional methods and refuses
to hand out any other kind ungated (fail closed): a method it cannot wrap is an error at call
time, never an open door. (The gate's effect on real calls: tests/integration/test_worker_secret.py.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from kvfleet_common.security import WORKER_SECRET_HEADER, TlsConfig, WorkerAuthInterceptor

SERVICE = "kvfleet.v1.Worker"
SECRET = "a-secret-of-sixteen-chars"


def _intercept(handler: grpc.RpcMethodHandler, method: str = f"/{SERVICE}/M") -> grpc.RpcMethodHandler:
    gate = WorkerAuthInterceptor(SERVICE, TlsConfig(), SECRET)

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return handler

    return asyncio.run(gate.intercept_service(continuation, SimpleNamespace(method=method)))


async def _bidi(requests, context):  # type: ignore[no-untyped-def]
    return None


async def _bidi_generator(requests, context):  # type: ignore[no-untyped-def]
    yield None


async def _server_stream(request, context):  # type: ignore[no-untyped-def]
    yield request


class _Refused(Exception):
    pass


class _Context:
    """The part of a servicer context the gate reads: metadata, and abort."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Refused(details)


@pytest.mark.parametrize("kind", ["unary", "bidirectional"])
def test_unary_and_bidirectional_methods_are_gated(kind: str) -> None:
    called: list[str] = []

    async def unary(request, context):  # type: ignore[no-untyped-def]
        called.append("unary")

    async def bidi(requests, context):  # type: ignore[no-untyped-def]
        called.append("bidi")

    if kind == "unary":
        inner = _intercept(grpc.unary_unary_rpc_method_handler(unary)).unary_unary
    else:
        inner = _intercept(grpc.stream_stream_rpc_method_handler(bidi)).stream_stream
    assert inner is not None
    without = _Context(())
    with pytest.raises(_Refused, match=WORKER_SECRET_HEADER):
        asyncio.run(inner(None, without))
    assert without.code == grpc.StatusCode.UNAUTHENTICATED and called == []
    asyncio.run(inner(None, _Context(((WORKER_SECRET_HEADER, SECRET),))))
    assert called == ["unary" if kind == "unary" else "bidi"]


@pytest.mark.parametrize(
    "handler",
    [
        grpc.unary_stream_rpc_method_handler(_server_stream),
        grpc.stream_unary_rpc_method_handler(_bidi),
        grpc.stream_stream_rpc_method_handler(_bidi_generator),
    ],
    ids=["unary-stream", "stream-unary", "bidirectional generator"],
)
def test_a_method_it_cannot_gate_is_refused_not_served(handler: grpc.RpcMethodHandler) -> None:
    with pytest.raises(TypeError, match="WorkerAuthInterceptor gates"):
        _intercept(handler)


def test_other_services_pass_ungated() -> None:
    handler = grpc.unary_stream_rpc_method_handler(_server_stream)
    assert _intercept(handler, "/grpc.health.v1.Health/Watch") is handler

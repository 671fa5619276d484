"""The gateway's side of the scheduler's public gRPC API: generation calls, served models, health."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.errors import ApiError, from_grpc, model_not_found
from gateway_svc.openai_schema import Endpoint, GenerationRequest
from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.security import aio_channel

log = logging.getLogger(__name__)


def to_pb(req: GenerationRequest) -> spb.GenerateRequest:
    """The scheduler request for a validated OpenAI request."""
    prompt: str | Sequence[int] | list[dict]
    prompt = req.chat_messages if req.endpoint is Endpoint.CHAT else req.prompt  # type: ignore[assignment]
    # OpenAI without a seed samples differently each time; the scheduler's seed 0 is a fixed seed.
    seed = req.seed if req.seed is not None else secrets.randbits(64)
    return build_request(
        prompt,
        req.max_tokens,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=seed,
        stop=req.stop,
        ignore_eos=req.ignore_eos,
    )


Auth = tuple[tuple[str, str], ...]  # the scheduler's bearer-token metadata of one call, or ()


@dataclass(frozen=True)
class HealthReport:
    scheduler: str  # the gRPC health status name, or why it could not be asked
    live_workers: int | None  # None: the scheduler wants a token the gateway does not hold

    @property
    def ok(self) -> bool:
        return self.scheduler == "SERVING" and (self.live_workers is None or self.live_workers > 0)


class Upstream:
    """One grpc.aio channel to the scheduler, shared by every request. Each call carries the
    bearer token the gateway chose for it (`auth`): its own, or the caller's passed through."""

    def __init__(self, address: str, models_ttl_s: float = 5.0, health_timeout_s: float = 2.0) -> None:
        self.address = address
        # TLS from KVFLEET_TLS_*.
        self._channel = aio_channel(address, options=grpcutil.CHANNEL_OPTIONS)
        self._stub = spb_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._models_ttl_s = models_ttl_s
        self._health_timeout_s = health_timeout_s
        self._models: tuple[float, frozenset[str]] | None = None  # (monotonic time, names)

    async def close(self) -> None:
        await self._channel.close()

    async def _workers(self, auth: Auth) -> list[spb.WorkerState]:
        try:
            resp = await self._stub.ListWorkers(spb.ListWorkersRequest(), timeout=self._health_timeout_s, metadata=auth)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc
        return list(resp.workers)

    async def served_models(self, auth: Auth, refresh: bool = False) -> frozenset[str]:
        """The distinct models of the workers the scheduler knows (live or not: a model whose
        workers are all down is still served, and answers 503 rather than 404). refresh: ask the
        scheduler now, with `auth`, rather than reuse a list that another caller's token got."""
        now = time.monotonic()
        if refresh or self._models is None or now - self._models[0] > self._models_ttl_s:
            names = frozenset(w.model for w in await self._workers(auth) if w.model)
            self._models = (now, names)
        return self._models[1]

    async def require_model(self, name: str, auth: Auth, refresh: bool = False) -> None:
        if name in await self.served_models(auth, refresh):
            return
        served = await self.served_models(auth, refresh=True)  # a model added since the last look
        if name not in served:
            raise model_not_found(name, sorted(served))

    async def health(self, auth: Auth) -> HealthReport:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._health_timeout_s)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as exc:
            return HealthReport(f"unreachable ({exc.code().name})", 0)
        try:
            live: int | None = sum(w.live for w in await self._workers(auth))
        except ApiError as err:
            live = None if err.status == 401 else 0  # 401: the gateway holds no token to ask with
        return HealthReport(status, live)

    def generate(
        self, req: GenerationRequest, metadata: Sequence[tuple[str, str]], auth: Auth, timeout_s: float
    ) -> grpc.aio.UnaryStreamCall:
        return self._stub.Generate(to_pb(req), metadata=tuple(metadata) + auth, timeout=timeout_s)


async def events(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[spb.GenerateEvent]:
    """The call's events up to the finished one; a failed call raises the client's ApiError."""
    try:
        async for ev in call:
            yield ev
            if ev.finished:
                return
    except grpc.aio.AioRpcError as exc:
        raise from_grpc(exc) from exc
    raise ApiError(502, "the scheduler ended the stream before the session finished", type="server_error")

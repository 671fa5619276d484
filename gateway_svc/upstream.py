"""The gateway's side of the scheduler's public gRPC API: generation calls, the served model,
tokenizing, health."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.errors import HTTP_NAMES, ApiError, from_grpc, model_not_found
from gateway_svc.openai_responses import Delta, TokenLogprob, TopToken, Usage, finish_reason
from gateway_svc.openai_schema import ChatMessage, Endpoint, GenerationRequest
from kvfleet.client import finish_name
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.security import aio_channel

log = logging.getLogger(__name__)


def to_pb(req: GenerationRequest) -> spb.GenerateRequest:
    """The scheduler request for a validated OpenAI request (the targets of openai_schema.FIELDS)."""
    s = req.sampling
    # OpenAI without a seed samples differently each time; the scheduler's seed 0 is a fixed seed.
    seed = s.seed if s.seed is not None else secrets.randbits(64)
    pb = spb.GenerateRequest(
        max_new_tokens=req.max_tokens,
        sampling=spb.SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            min_p=s.min_p,
            logit_bias=dict(s.logit_bias),
        ),
        stop=list(req.stop),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        request_id=req.request_id,
        n=req.n,
        echo=req.echo,
        tools_json=req.tools_json,
    )
    if req.response_format is not None:
        kind, schema = req.response_format
        pb.response_format.CopyFrom(spb.ResponseFormat(type=kind, json_schema=schema))
    if isinstance(req.prompt, str):
        pb.text = req.prompt
    elif req.endpoint is Endpoint.CHAT:
        pb.chat.messages.extend(
            spb.ChatMessage(
                role=m.role, content=m.content, tool_call_id=m.tool_call_id, tool_calls_json=m.tool_calls_json
            )
            for m in req.prompt
            if isinstance(m, ChatMessage)
        )
    else:
        pb.prompt_ids.ids.extend(int(t) for t in req.prompt if isinstance(t, int))
    return pb


def to_delta(ev: spb.GenerateEvent) -> Delta:
    """What a scheduler event adds to its choice, in the response builder's terms."""
    finish = finish_reason(finish_name(ev.finish_reason)) if ev.finished else None
    usage = Usage(ev.usage.input_tokens, ev.usage.output_tokens, ev.usage.cached_tokens) if ev.finished else None
    return Delta(
        index=ev.index,
        text=ev.text,
        logprobs=tuple(
            TokenLogprob(t.text, t.logprob, tuple(TopToken(a.text, a.logprob) for a in t.top)) for t in ev.logprobs
        ),
        prompt_text=ev.prompt_text,
        finish=finish,
        usage=usage,
    )


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int | None  # None: an older scheduler without GetModelInfo


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
        self._model: tuple[float, ModelInfo] | None = None  # (monotonic time, the served model)

    async def close(self) -> None:
        await self._channel.close()

    async def _workers(self, auth: Auth) -> list[spb.WorkerState]:
        try:
            resp = await self._stub.ListWorkers(spb.ListWorkersRequest(), timeout=self._health_timeout_s, metadata=auth)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc
        return list(resp.workers)

    async def _model_info(self, auth: Auth) -> ModelInfo:
        try:
            info = await self._stub.GetModelInfo(spb.ModelInfoRequest(), timeout=self._health_timeout_s, metadata=auth)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise from_grpc(exc) from exc
            # A scheduler from before GetModelInfo: its workers' model is the one served.
            names = sorted({w.model for w in await self._workers(auth) if w.model})
            return ModelInfo(names[0] if names else "", None)
        return ModelInfo(info.model_id, info.max_context_length or None)

    async def served_model(self, auth: Auth, refresh: bool = False) -> ModelInfo:
        """The scheduler's model (GetModelInfo: its name and context length). refresh: ask now,
        with `auth`, rather than reuse what another caller's token got."""
        now = time.monotonic()
        if refresh or self._model is None or now - self._model[0] > self._models_ttl_s:
            self._model = (now, await self._model_info(auth))
        return self._model[1]

    async def require_model(self, name: str, auth: Auth, refresh: bool = False) -> ModelInfo:
        """The served model when `name` is it; a 404 naming the served one otherwise."""
        info = await self.served_model(auth, refresh)
        if name != info.name:
            info = await self.served_model(auth, refresh=True)  # a restart with another model since
            if name != info.name:
                raise model_not_found(name, [info.name] if info.name else [])
        return info

    async def tokenize(self, request: spb.TokenizeRequest, auth: Auth) -> spb.TokenizeResponse:
        try:
            return await self._stub.Tokenize(request, timeout=self._health_timeout_s * 5, metadata=auth)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc

    async def detokenize(self, request: spb.DetokenizeRequest, auth: Auth) -> spb.DetokenizeResponse:
        try:
            return await self._stub.Detokenize(request, timeout=self._health_timeout_s * 5, metadata=auth)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc) from exc

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


async def events(
    call: grpc.aio.UnaryStreamCall, n: int = 1, names: Mapping[str, tuple[str, str]] = HTTP_NAMES
) -> AsyncIterator[spb.GenerateEvent]:
    """The call's events until all n choices finished; a failed call raises the client's ApiError
    (``names``: the body's names for the request's fields, GenerationRequest.http_names)."""
    finished = 0
    try:
        async for ev in call:
            yield ev
            finished += ev.finished
            if finished >= n:
                return
    except grpc.aio.AioRpcError as exc:
        raise from_grpc(exc, names=names) from exc
    raise ApiError(502, "the scheduler ended the stream before the session finished", type="server_error")

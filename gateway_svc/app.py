"""The HTTP server: OpenAI-compatible endpoints in front of the scheduler's gRPC API (aiohttp).

One request is one trace: the gateway's span (GenAI conventions) is the parent of the
scheduler's session span (`{operation} {model}`, kvfleet.span=session), its context sent in the
Generate call's metadata. GET /metrics serves the gateway's own Prometheus metrics. A client that
goes away mid-request has its handler cancelled (handler_cancellation), which cancels the
Generate call, and the scheduler frees the session. Besides /v1/*, vLLM's server routes:
GET /version, POST /tokenize and POST /detokenize (the scheduler's Tokenize/Detokenize).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway_svc.config import AuthMode, GatewayConfig
from gateway_svc.errors import ApiError, bad_request, internal_error, unauthorized
from gateway_svc.metrics import CONTENT_TYPE_LATEST, GatewayMetrics, RequestMeter
from gateway_svc.openai_responses import SSE_DONE, ResponseBuilder, model_card, model_list, new_response_id, sse
from gateway_svc.openai_schema import Endpoint, GenerationRequest, SchemaError, parse_request
from gateway_svc.tokenize_api import detokenize_request, tokenize_request, tokenize_response
from gateway_svc.tool_calls import declared_tool_names
from gateway_svc.upstream import Auth, ModelInfo, Upstream, events, to_delta
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_common.listen import cannot_listen
from kvfleet_common.security import token_metadata
from kvfleet_common.tracing import extract_context, inject_metadata
from kvfleet_common.version import kvfleet_version

log = logging.getLogger(__name__)

PROVIDER = "kvfleet"  # gen_ai.provider.name, as the scheduler's spans say
# A body this size or more is parsed in a thread: a megabyte of JSON takes milliseconds.
THREAD_PARSE_BYTES = 64 * 1024
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}  # no proxy buffering of the stream


def _json(payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=encode_json(payload), status=status, headers=headers, content_type="application/json")


def encode_json(payload: Any) -> bytes:
    """UTF-8 JSON; ASCII escapes when a string cannot be UTF-8 (an error message quoting a
    caller's lone surrogate), so quoting the caller never fails the response."""
    text = json.dumps(payload, ensure_ascii=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(payload).encode()


def error_response(err: ApiError) -> web.Response:
    return _json(err.body(), err.status, err.headers())


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves in the OpenAI shape; a bug is a 500 with its traceback in the log."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:  # unknown route, wrong method, body too large
        if exc.status < 400:
            raise
        why = exc.reason
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            why = f"{exc.text} (about 4x the prompt limit, --max-prompt-bytes)"
        return error_response(
            ApiError(
                exc.status,
                f"{request.method} {request.path}: {why}",
                type="invalid_request_error" if exc.status < 500 else "server_error",
            )
        )
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(internal_error())


# request[_AUTH_KEY]: the token metadata this request's scheduler calls carry
_AUTH_KEY = web.RequestKey("scheduler_auth", tuple)
# The routes that reach the scheduler with a token, hence need the caller's key.
_KEYED_PATHS = ("/tokenize", "/detokenize")


def _bearer(request: web.Request) -> str:
    """The caller's bearer token, checked only for form (the scheduler judges it)."""
    given = request.headers.get("Authorization", "")
    if not given:
        raise unauthorized("no API key given; send the header 'Authorization: Bearer <key>'")
    scheme, _, token = given.partition(" ")
    # gRPC metadata carries printable ASCII only; anything else cannot be the scheduler's token
    if scheme.lower() != "bearer" or not token or not all("!" <= ch <= "~" for ch in token):
        raise unauthorized("the API key is not valid; send the header 'Authorization: Bearer <key>'")
    return token


def _auth(config: GatewayConfig):
    """Who may call /v1/*, and with which token each request reaches the scheduler."""
    mode = config.auth_mode
    own: Auth = tuple(token_metadata(config.scheduler_token))
    expected = f"Bearer {config.api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        request[_AUTH_KEY] = own
        if request.path.startswith("/v1/") or request.path in _KEYED_PATHS:
            # Two headers leave it open which one a check (here, a proxy, the scheduler) reads.
            if len(request.headers.getall("Authorization", [])) > 1:
                raise unauthorized("more than one Authorization header; send exactly one 'Authorization: Bearer <key>'")
            if mode is AuthMode.PASS_THROUGH:
                request[_AUTH_KEY] = tuple(token_metadata(_bearer(request)))
            elif mode is AuthMode.OWN_KEY:
                given = request.headers.get("Authorization", "")
                if not given:
                    raise unauthorized("no API key given; send the header 'Authorization: Bearer <key>'")
                if not hmac.compare_digest(given.encode(), expected):
                    raise unauthorized("the API key is not valid")
        return await handler(request)

    return check


async def _body(request: web.Request) -> Any:
    raw = await request.read()  # at most the app's client_max_size, else a 413
    if len(raw) >= THREAD_PARSE_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


def parse_json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # the parser's own depth limit, about a thousand levels
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() takes (sys.get_int_max_str_digits)
        raise bad_request(f"the request body has a number out of range: {exc}") from None


def _request_attributes(request: web.Request, req: GenerationRequest) -> dict[str, Any]:
    # No gen_ai.request.model: the model name is the caller's until the scheduler is found to
    # serve it (_run sets it then, and names the span after it).
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": req.endpoint.value,
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.max_tokens": req.max_tokens,
        "gen_ai.request.temperature": req.temperature,
        "gen_ai.request.top_p": req.top_p,
        "kvfleet.request.stream": req.stream,
    }
    # server.*: the address the caller reached us at (its Host header), as HTTP servers report it
    if request.url.host:
        attrs["server.address"] = request.url.host
    if request.url.port:
        attrs["server.port"] = request.url.port
    if req.top_k:  # 0 = off: no attribute
        attrs["gen_ai.request.top_k"] = float(req.top_k)  # a double in the conventions
    if req.seed is not None:
        attrs["gen_ai.request.seed"] = req.seed
    if req.n != 1:
        attrs["gen_ai.request.choice.count"] = req.n
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req.sampling, name):
            attrs[f"gen_ai.request.{name}"] = getattr(req.sampling, name)
    if req.stop:
        attrs["gen_ai.request.stop_sequences"] = list(req.stop)
    return attrs


class Gateway:
    def __init__(self, config: GatewayConfig, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self.draining = False
        self._started = int(time.time())
        self._tracer = trace.get_tracer("kvfleet.gateway")
        self.metrics = GatewayMetrics()

    # ---- generation ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        meter = self.metrics.start(endpoint.value)
        status = 500
        try:
            resp = await self._traced(request, endpoint, meter)
            status = resp.status  # a stream that failed after its headers still answered 200
            return resp
        except ApiError as err:
            status = err.status
            raise
        except web.HTTPException as exc:  # a body over the size limit
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            meter.done(status)

    async def _traced(self, request: web.Request, endpoint: Endpoint, meter: RequestMeter) -> web.StreamResponse:
        try:
            req = parse_request(endpoint, await _body(request), chat_max_tokens=self.config.chat_max_tokens)
        except SchemaError as exc:
            raise bad_request(exc.message, exc.param) from None
        # The caller's own trace context (a `traceparent` header), if any, parents our span. Its
        # name is fixed until the model is known: a name from the caller would let anyone mint
        # span names (and rows of every per-name view) at will.
        parent = extract_context(request.headers.items())
        with self._tracer.start_as_current_span(
            endpoint.value,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=_request_attributes(request, req),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                return await self._run(request, req, span, meter)
            except ApiError as err:
                _end_with_error(span, err.status, err.code or err.type, err.message)
                raise
            except asyncio.CancelledError:
                _end_with_error(span, 499, "client_disconnected", "the client went away")
                raise
            except Exception as exc:
                span.record_exception(exc)
                _end_with_error(span, 500, type(exc).__qualname__, str(exc))
                raise

    async def _run(
        self, request: web.Request, req: GenerationRequest, span: Span, meter: RequestMeter
    ) -> web.StreamResponse:
        auth = request[_AUTH_KEY]
        await self.upstream.require_model(req.model, auth, refresh=self._per_caller_models)
        # From here on req.model is a model the cluster serves, not just what the caller wrote.
        meter.model_name = req.model
        span.update_name(f"{req.endpoint.value} {req.model}")
        builder = ResponseBuilder(
            req.endpoint,
            new_response_id(req.endpoint, req.request_id),
            int(time.time()),
            req.model,
            include_usage=req.include_usage,
            logprobs=req.logprobs,
            echo=req.echo,
            tool_names=declared_tool_names(req.tools_json),  # none when tool_choice is "none"
        )
        span.set_attributes(
            {"gen_ai.request.model": req.model, "gen_ai.response.id": builder.id, "gen_ai.response.model": req.model}
        )
        # inject_metadata() carries the current span, ours, so the scheduler's span is its child.
        call = self.upstream.generate(req, inject_metadata(), auth, self.config.request_timeout_s)
        try:
            stream = events(call, req.n, req.http_names())
            # Wait for the first event before answering, so a rejection (queue full, bad prompt,
            # no worker, tools on a template without them) is an HTTP status and not an error
            # event inside a 200 stream.
            first = await anext(stream)
            meter.first_event()
            if req.stream:
                return await self._stream(request, builder, first, stream, span)
            builder.add(to_delta(first))
            async for ev in stream:
                builder.add(to_delta(ev))
            _record_finish(builder, span)
            return _json(builder.response())
        finally:
            call.cancel()  # a no-op once finished; otherwise the scheduler frees the session

    async def _stream(
        self, request: web.Request, builder: ResponseBuilder, first: spb.GenerateEvent, stream, span: Span
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        span.set_attribute("http.response.status_code", 200)
        try:
            for chunk in builder.add(to_delta(first)):
                await resp.write(sse(chunk))
            async for ev in stream:
                for chunk in builder.add(to_delta(ev)):
                    await resp.write(sse(chunk))
            _record_finish(builder, span)
            if builder.include_usage:
                await resp.write(sse(builder.usage_chunk()))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ApiError as err:
            # Headers are gone: the error travels as an event, which the openai client raises.
            _end_with_error(span, err.status, err.code or err.type, err.message)
            await resp.write(sse(err.body()))
        except ConnectionResetError:
            # The client went away between our writes (before its handler was cancelled).
            _end_with_error(span, 499, "client_disconnected", "the client went away")
        return resp

    # ---- vLLM's utility routes ---------------------------------------------------------------

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": kvfleet_version()})

    async def _checked_model(self, request: web.Request, body: Any) -> ModelInfo:
        """The served model; a body naming another one is a 404 (no model named is fine)."""
        auth = request[_AUTH_KEY]
        name = body.get("model") if isinstance(body, dict) else None
        if name is None:
            return await self.upstream.served_model(auth, refresh=self._per_caller_models)
        if not isinstance(name, str):
            raise bad_request("model must be a string", "model")
        return await self.upstream.require_model(name, auth, refresh=self._per_caller_models)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            pb = tokenize_request(body)
        except SchemaError as exc:
            raise bad_request(exc.message, exc.param) from None
        info = await self._checked_model(request, body)
        resp = await self.upstream.tokenize(pb, request[_AUTH_KEY])
        return _json(tokenize_response(body, resp, info.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            pb = detokenize_request(body)
        except SchemaError as exc:
            raise bad_request(exc.message, exc.param) from None
        await self._checked_model(request, body)
        resp = await self.upstream.detokenize(pb, request[_AUTH_KEY])
        return _json({"prompt": resp.text})

    # ---- models and health ----------------------------------------------------------------

    @property
    def _per_caller_models(self) -> bool:
        """Callers' own tokens reach the scheduler: the model list one of them got is not for the next."""
        return self.config.auth_mode is AuthMode.PASS_THROUGH

    async def models(self, request: web.Request) -> web.Response:
        info = await self.upstream.served_model(request[_AUTH_KEY], refresh=self._per_caller_models)
        cards = [model_card(info.name, self._started, info.max_model_len)] if info.name else []
        return _json(model_list(cards))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        info = await self.upstream.require_model(name, request[_AUTH_KEY], refresh=True)
        return _json(model_card(info.name, self._started, info.max_model_len))

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        report = await self.upstream.health(request[_AUTH_KEY])
        ok = report.ok and not self.draining
        body = {
            "status": "ok" if ok else "unavailable",
            "scheduler": report.scheduler,
            "live_workers": report.live_workers,
            "draining": self.draining,
        }
        return _json(body, 200 if ok else 503)


def _record_finish(builder: ResponseBuilder, span: Span) -> None:
    usage = builder.usage()
    span.set_attributes(
        {
            "gen_ai.response.finish_reasons": builder.finish_reasons(),
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
        }
    )


def _end_with_error(span: Span, status: int, error_type: str, message: str) -> None:
    span.set_attributes({"http.response.status_code": status, "error.type": error_type})
    span.set_status(Status(StatusCode.ERROR, message[:500]))  # a 404 quotes the caller's model


def create_app(config: GatewayConfig, upstream: Upstream) -> tuple[web.Application, Gateway]:
    gateway = Gateway(config, upstream)
    app = web.Application(middlewares=[_errors, _auth(config)], client_max_size=config.max_body_bytes)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/v1/models/{model}", gateway.model)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.prometheus)
    app.router.add_get("/version", gateway.version)
    app.router.add_post("/tokenize", gateway.tokenize)
    app.router.add_post("/detokenize", gateway.detokenize)
    return app, gateway


class RunningGateway:
    """Handles for a started gateway, for a graceful stop."""

    def __init__(self, runner: web.AppRunner, gateway: Gateway) -> None:
        self.runner = runner
        self.gateway = gateway

    async def stop(self) -> None:
        """Drain: /health answers 503, the listener closes, in-flight requests get the grace."""
        self.gateway.draining = True
        await self.runner.cleanup()
        await self.gateway.upstream.close()


async def create_server(config: GatewayConfig) -> tuple[RunningGateway, int]:
    """Build and start the HTTP server. Returns (handles, bound port)."""
    upstream = Upstream(config.scheduler, models_ttl_s=config.models_ttl_s)
    app, gateway = create_app(config, upstream)
    # handler_cancellation: a client that disconnects cancels its handler, hence its gRPC call.
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.drain_grace_s,
        access_log=logging.getLogger("gateway_svc.access"),
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise cannot_listen("the OpenAI-compatible HTTP API", config.host, config.port, "--port", exc) from None
    port = runner.addresses[0][1]
    log.info(
        "gateway serving on http://%s:%d in front of the scheduler at %s (callers: %s)",
        config.host,
        port,
        config.scheduler,
        config.auth_mode.value,
    )
    if config.auth_mode is AuthMode.ANONYMOUS:
        log.warning("--allow-anonymous: anyone who reaches this port generates with the scheduler's token")
    return RunningGateway(runner, gateway), port

"""The telemetry service's --http-port (aiohttp): Jaeger's query HTTP API over the telemetry
store, so that Grafana's Jaeger data source (or anything else that reads Jaeger's /api/*) reads
kvfleet's traces without a Jaeger, the experiments' summaries as JSON, and the trace UI that reads
both (static files shipped in telemetry_svc/ui/, no build step):

  GET /api/services                          service names
  GET /api/services/{service}/operations     a service's span names
  GET /api/traces?service=&operation=&tags=&start=&end=&minDuration=&maxDuration=&limit=
  GET /api/traces?traceID=ID&traceID=ID      those traces
  GET /api/traces/{traceID}                  one trace (404: none)
  GET /api/dependencies?endTs=&lookback=     service -> service call counts
  GET /api/experiments                       every experiment: spans per arm, artifacts recorded
  GET /api/experiments/{id}/summary          its gate-and-decision summary (GetSummary's document)
  GET /  and  GET /ui/{file}                 the trace UI's page and its script and style sheet

Thin: parameters parsed and rows shaped by telemetry_svc.jaeger, store reads in a worker thread,
Jaeger's envelope out, errors as Jaeger's error envelope (400 naming the parameter, 404, 401/403).
With --protect-reads the API asks what the gRPC reads ask (telemetry_svc.auth): the bearer token
as `Authorization: Bearer <token>` and/or, under TLS, an allowed client certificate. The UI's
page and files hold no data, so they load without one (its script asks for the token and sends
it with every read); a strict Content-Security-Policy keeps any markup that a span smuggles into
the page from running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from aiohttp import web

from telemetry_svc import jaeger
from telemetry_svc.auth import AuthPolicy
from telemetry_svc.model import UnknownExperiment
from telemetry_svc.scheduler_link import SchedulerLink, SchedulerUnreachable
from telemetry_svc.store import ExperimentInfo, SpanStore

logger = logging.getLogger(__name__)

JAEGER_QUERY_PORT = 16686  # Jaeger's own query port, so a data source's usual URL fits
_HTTP_TOKEN_HINT = "send the header 'Authorization: Bearer <token>' (Grafana: a custom HTTP header on the data source)"
_STATUS = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Refused = Callable[[str], None]
Summarize = Callable[[str], Awaitable[tuple[dict[str, Any], Any]]]  # experiment id -> (summary, its data)

UI_DIR = Path(__file__).with_name("ui")
_UI_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
_UI_ROUTES = frozenset({"ui-page", "ui-file"})  # no data in them: served without the read token
# Only the UI's own script and style run; spans' names and attributes are text (app.js builds
# the DOM with textContent), and this stops any markup that got through from loading or running.
_UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _json(payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    body = json.dumps(payload, allow_nan=False).encode()  # jaeger.py turns NaN / inf into strings
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json(jaeger.error_envelope(status, message), status, headers)


def _params(request: web.Request) -> dict[str, list[str]]:
    return {k: request.query.getall(k) for k in request.query.keys()}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in Jaeger's error envelope; a bug is a 500 with its traceback logged."""
    try:
        return await handler(request)
    except jaeger.InvalidQuery as exc:
        return _error(400, str(exc))
    except (jaeger.TraceNotFound, UnknownExperiment) as exc:
        return _error(404, str(exc))
    except web.HTTPException as exc:  # an unknown route, a wrong method
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except Exception:
        logger.exception("trace API %s %s failed", request.method, request.path_qs)
        return _error(500, "internal error; the telemetry service's log has the details")


def _peer_names(request: web.Request) -> set[str]:
    """Common names of the client certificate TLS verified (none over plain HTTP)."""
    cert = request.transport.get_extra_info("peercert") if request.transport is not None else None
    return {v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"}


def _guard(policy: AuthPolicy, on_refused: Refused) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.route.name in _UI_ROUTES:  # the matched route, whatever the path's spelling
            return await handler(request)
        metadata = [("authorization", v) for v in request.headers.getall("Authorization", [])]
        refusal = policy.refusal(metadata, _peer_names(request), token_hint=_HTTP_TOKEN_HINT, action="read")
        if refusal is None:
            return await handler(request)
        code, message = refusal
        route = request.match_info.route.resource
        on_refused(f"{request.method} {route.canonical if route is not None else request.path}")
        status = _STATUS.get(code, 403)
        return _error(status, message, {"WWW-Authenticate": "Bearer"} if status == 401 else None)

    return check


class JaegerApi:
    """The handlers: each parses with jaeger.py, reads the store in a thread, answers its JSON."""

    def __init__(self, store: SpanStore, now_ns: Callable[[], int] = time.time_ns) -> None:
        self._store = store
        self._now_ns = now_ns

    async def services(self, request: web.Request) -> web.Response:
        names = sorted(jaeger.service_name(s) for s in await asyncio.to_thread(self._store.services))
        return _json(jaeger.envelope(names, total=len(names)))

    async def operations(self, request: web.Request) -> web.Response:
        service = jaeger.stored_service(request.match_info["service"])
        names = await asyncio.to_thread(self._store.operations, service)
        return _json(jaeger.envelope(names, total=len(names)))

    async def traces(self, request: web.Request) -> web.Response:
        query = jaeger.parse_trace_query(_params(request))
        traces, errors = await asyncio.to_thread(self._search, query)
        return _json(jaeger.envelope(traces, errors=errors or None))

    def _search(self, q: jaeger.TraceQuery) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        errors = []
        if q.trace_ids:
            ids = q.trace_ids
        else:
            found = self._store.search_traces(
                jaeger.stored_service(q.service),
                operation=q.operation,
                start_min_ns=q.start_min_ns,
                start_max_ns=q.start_max_ns,
                min_duration_ns=q.min_duration_ns,
                max_duration_ns=q.max_duration_ns,
                limit=q.limit,
                matches=(lambda span: jaeger.span_matches(span, q.tags)) if q.tags else None,
            )
            ids = found.trace_ids
            if found.scan_limited:
                errors.append({"msg": "the search read its most spans before finding 'limit' traces; "
                                      "older matches may exist: narrow 'start' and 'end'"})  # fmt: skip
        traces, budget = [], jaeger.MAX_RESPONSE_SPANS
        for i, trace_id in enumerate(ids):
            if budget <= 0:
                errors.append({"msg": f"{len(ids) - i} more traces left out: the response holds at most "
                                      f"{jaeger.MAX_RESPONSE_SPANS} spans; lower 'limit'"})  # fmt: skip
                break
            got = self._store.trace(trace_id, min(jaeger.MAX_TRACE_SPANS, budget))
            if got.spans:
                traces.append(jaeger.trace_json(got.spans, got.total))
                budget -= len(got.spans)
            else:  # a traceID asked for and not stored (or gone to retention since the search)
                errors.append({"msg": "trace not found", "traceID": trace_id})
        return traces, errors

    async def trace(self, request: web.Request) -> web.Response:
        trace_id = jaeger.parse_trace_id(request.match_info["traceID"])
        got = await asyncio.to_thread(self._store.trace, trace_id, jaeger.MAX_TRACE_SPANS)
        if not got.spans:
            raise jaeger.TraceNotFound(f"trace not found: no span of trace {trace_id} in the store")
        return _json(jaeger.envelope([jaeger.trace_json(got.spans, got.total)]))

    async def dependencies(self, request: web.Request) -> web.Response:
        q = jaeger.parse_dependency_query(_params(request), self._now_ns())
        calls = await asyncio.to_thread(self._store.service_calls, q.start_ns, q.end_ns)
        return _json(jaeger.envelope(jaeger.dependency_links(calls, q.service)))


def experiment_json(info: ExperimentInfo) -> dict[str, Any]:
    """One experiment as ListExperiments answers it."""
    arms = info.spans_per_arm
    return {"experiment_id": info.experiment_id, "control_spans": arms.get("control", 0),
            "candidate_spans": arms.get("candidate", 0), "other_spans": arms.get("", 0),
            "artifact_kinds": list(info.artifact_kinds)}  # fmt: skip


class ExperimentsApi:
    """The experiments, for the UI: the list, and one experiment's summary, built by the code that
    builds GetSummary's (telemetry_svc.server.experiment_summary, passed in as `summarize`)."""

    def __init__(self, store: SpanStore, summarize: Summarize) -> None:
        self._store = store
        self._summarize = summarize

    async def experiments(self, request: web.Request) -> web.Response:
        infos = await asyncio.to_thread(self._store.experiments)
        return _json(jaeger.envelope([experiment_json(i) for i in infos], total=len(infos)))

    async def summary(self, request: web.Request) -> web.Response:
        summary, _ = await self._summarize(request.match_info["experimentID"])
        return _json(jaeger.envelope(summary))


class TraceUi:
    """The UI's files, read once from the package (a wheel ships them: pyproject's package-data)."""

    def __init__(self, folder: Path = UI_DIR) -> None:
        self._files = {name: (folder.joinpath(name).read_bytes(), kind) for name, kind in _UI_FILES.items()}

    def _file(self, name: str) -> web.Response:
        if name not in self._files:
            raise web.HTTPNotFound(reason=f"no UI file {name!r}")
        body, kind = self._files[name]
        return web.Response(body=body, content_type=kind, charset="utf-8", headers=_UI_HEADERS)

    async def page(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def file(self, request: web.Request) -> web.Response:
        return self._file(request.match_info["name"])


class SchedulerApi:
    """GET /api/scheduler: the scheduler's live snapshot (telemetry and workers), asked now."""

    def __init__(self, link: SchedulerLink | None) -> None:
        self._link = link

    async def snapshot(self, request: web.Request) -> web.Response:
        if self._link is None:
            return _error(404, "no scheduler to ask: start the telemetry service with --scheduler HOST:PORT")
        try:
            data = await self._link.snapshot()
        except SchedulerUnreachable as exc:
            return _error(502, str(exc))
        return _json({"data": data, "total": 1, "limit": 0, "offset": 0, "errors": None})


def create_app(store: SpanStore, policy: AuthPolicy, on_refused: Refused = lambda route: None,
               now_ns: Callable[[], int] = time.time_ns, summarize: Summarize | None = None,
               ui: TraceUi | None = None, scheduler: SchedulerLink | None = None) -> web.Application:  # fmt: skip
    """The routes above; without `summarize` no experiment routes, without `ui` the package's UI;
    without `scheduler` the live snapshot answers 404 saying how to configure it."""
    middlewares = [_errors]
    if policy.protect_reads:  # (AuthPolicy refuses protect_reads without a token or a client list)
        middlewares.append(_guard(policy, on_refused))
    app = web.Application(middlewares=middlewares)
    api = JaegerApi(store, now_ns)
    app.router.add_get("/api/services", api.services)
    app.router.add_get("/api/services/{service}/operations", api.operations)
    app.router.add_get("/api/traces", api.traces)
    app.router.add_get("/api/traces/{traceID}", api.trace)
    app.router.add_get("/api/dependencies", api.dependencies)
    if summarize is not None:
        experiments = ExperimentsApi(store, summarize)
        app.router.add_get("/api/experiments", experiments.experiments)
        app.router.add_get("/api/experiments/{experimentID}/summary", experiments.summary)
    app.router.add_get("/api/scheduler", SchedulerApi(scheduler).snapshot)
    ui = ui or TraceUi()
    app.router.add_get("/", ui.page, name="ui-page")
    app.router.add_get("/ui/{name}", ui.file, name="ui-file")
    return app


def server_ssl(tls: Any) -> ssl.SSLContext | None:
    """The gRPC port's TLS for this port too (kvfleet_common.security.TlsConfig): its certificate,
    and client certificates checked against its CA (required under KVFLEET_TLS_CLIENT_AUTH)."""
    if tls is None or not tls.serves_tls:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.load_verify_locations(tls.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.client_auth else ssl.CERT_OPTIONAL
    return ctx


async def start(app: web.Application, host: str, port: int, tls: Any = None,
                grace_s: float = 5.0) -> tuple[web.AppRunner, int]:  # fmt: skip
    """Serve `app` on host:port (0: any free port); returns the runner (cleanup() stops it,
    letting requests in flight finish within grace_s) and the bound port. OSError: cannot bind."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=server_ssl(tls)).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]

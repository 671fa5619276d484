"""Jaeger's query HTTP API on a real telemetry service: spans exported over OTLP/gRPC by the
stock OpenTelemetry SDK, then each route read over HTTP with urllib, as Grafana's Jaeger data
source reads them; shapes checked against Jaeger's model (tests/helpers/jaeger_shapes.py)."""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context

from kvfleet_common.security import TlsConfig
from telemetry_svc import jaeger
from telemetry_svc.auth import AuthPolicy
from telemetry_svc.server import TelemetryConfig
from tests.helpers.jaeger_shapes import assert_dependency, assert_envelope, assert_error_envelope, assert_trace
from tests.helpers.telemetry_server import RunningServer, export_request, otlp_export, raw_span

TOKEN = "telemetry-s3cret-for-reads"
T0 = time.time_ns() - 60 * 10**9  # a minute ago: inside /api/dependencies' default 24 h


def _get(port: int, path: str, headers: dict[str, str] | None = None, scheme: str = "http",
         context: ssl.SSLContext | None = None) -> tuple[int, dict[str, Any], Any]:  # fmt: skip
    """(status, headers, JSON body) of GET path, errors included."""
    req = urllib.request.Request(f"{scheme}://localhost:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def _query(**params: Any) -> str:
    return urllib.parse.urlencode(params, doseq=True)


class Sent:
    """What _export sent: the request's trace and its spans' ids, and the tick's trace."""

    trace_id = tick_trace_id = ""
    ids: dict[str, str] = {}


def _export(port: int, headers: dict[str, str] | None = None) -> Sent:
    """A request as kvfleet traces one: the scheduler's session span (server) with `queue` and a
    `step_decode` linked to a tick of its own trace; the worker's `worker_step` under it, with an
    event and an error status. Explicit times, so durations are known."""
    sent = Sent()
    providers = {}
    for service, instance in (("kvfleet-scheduler", "scheduler-0"), ("kvfleet-worker", "worker-0")):
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, headers=headers)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        providers[service] = provider
    sched = providers["kvfleet-scheduler"].get_tracer("kvfleet")
    worker = providers["kvfleet-worker"].get_tracer("kvfleet")
    tick = sched.start_span("tick", start_time=T0)
    tick.end(end_time=T0 + 3_000_000)
    root = sched.start_span("text_completion tiny", kind=SpanKind.SERVER, start_time=T0,
                            attributes={"kvfleet.session.id": "s-42", "gen_ai.request.top_k": 40,
                                        "gen_ai.request.top_p": 0.9, "kvfleet.span": "session"})  # fmt: skip
    ctx = set_span_in_context(root)
    queue = sched.start_span("queue", context=ctx, start_time=T0 + 1_000)
    queue.end(end_time=T0 + 501_000)  # 500 µs
    step = sched.start_span("step_decode", context=ctx, start_time=T0 + 600_000,
                            links=[Link(tick.get_span_context())], attributes={"kvfleet.position": 7})  # fmt: skip
    ws = worker.start_span("worker_step", context=set_span_in_context(step), start_time=T0 + 700_000)
    ws.add_event("cache_miss", {"blocks": 4}, timestamp=T0 + 800_000)
    ws.set_status(Status(StatusCode.ERROR, "kv view failed"))
    ws.end(end_time=T0 + 2_700_000)  # 2 ms
    step.end(end_time=T0 + 2_900_000)
    root.end(end_time=T0 + 12_000_000)  # 12 ms
    for provider in providers.values():
        assert provider.force_flush(10_000)
        provider.shutdown()
    sent.trace_id = format(root.get_span_context().trace_id, "032x")
    sent.tick_trace_id = format(tick.get_span_context().trace_id, "032x")
    sent.ids = {s.name: format(s.get_span_context().span_id, "016x") for s in (root, queue, step, ws, tick)}
    return sent


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, Sent]]:
    db = tmp_path_factory.mktemp("jaeger") / "t.db"
    srv = RunningServer(TelemetryConfig(host="127.0.0.1", port=0, db_path=str(db), http_port=0))
    try:
        yield srv, _export(srv.port)
    finally:
        srv.stop()


def _http(srv: RunningServer) -> int:
    port = srv.server.http_port
    assert port, "the trace API did not start"
    return port


def test_services_and_operations(served: tuple[RunningServer, Sent]) -> None:
    srv, _ = served
    status, headers, body = _get(_http(srv), "/api/services")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert_envelope(body)
    assert body["data"] == ["kvfleet-scheduler", "kvfleet-worker"] and body["total"] == 2
    assert body["errors"] is None
    status, _, body = _get(_http(srv), "/api/services/kvfleet-scheduler/operations")
    assert status == 200
    assert body["data"] == ["queue", "step_decode", "text_completion tiny", "tick"] and body["total"] == 4
    _, _, body = _get(_http(srv), "/api/services/nobody/operations")
    assert body["data"] == [] and body["total"] == 0


def _one_trace(body: Any) -> dict[str, Any]:
    assert_envelope(body)
    (trace,) = body["data"]
    assert_trace(trace)
    return trace


def test_a_trace_has_jaegers_shape_with_both_services_processes(served: tuple[RunningServer, Sent]) -> None:
    srv, sent = served
    status, _, body = _get(_http(srv), f"/api/traces/{sent.trace_id}")
    assert status == 200 and body["errors"] is None
    trace = _one_trace(body)
    assert trace["traceID"] == sent.trace_id
    spans = {s["operationName"]: s for s in trace["spans"]}
    assert set(spans) == {"text_completion tiny", "queue", "step_decode", "worker_step"}  # the tick is its own trace
    root, queue, step, ws = (spans[n] for n in ("text_completion tiny", "queue", "step_decode", "worker_step"))
    assert (root["spanID"], root["startTime"], root["duration"]) == (sent.ids["text_completion tiny"], T0 // 1000,
                                                                     12_000)  # fmt: skip
    assert (queue["startTime"], queue["duration"]) == ((T0 + 1_000) // 1000, 500)
    assert root["references"] == []
    assert queue["references"] == [{"refType": "CHILD_OF", "traceID": sent.trace_id, "spanID": root["spanID"]}]
    assert step["references"] == [
        {"refType": "CHILD_OF", "traceID": sent.trace_id, "spanID": root["spanID"]},
        {"refType": "FOLLOWS_FROM", "traceID": sent.tick_trace_id, "spanID": sent.ids["tick"]},
    ]
    assert ws["references"] == [{"refType": "CHILD_OF", "traceID": sent.trace_id, "spanID": step["spanID"]}]
    tags = {t["key"]: (t["type"], t["value"]) for t in root["tags"]}
    assert tags == {
        "gen_ai.request.top_k": ("int64", 40),
        "gen_ai.request.top_p": ("float64", 0.9),
        "kvfleet.session.id": ("string", "s-42"),
        "kvfleet.span": ("string", "session"),
        "span.kind": ("string", "server"),
    }
    assert {t["key"]: t["value"] for t in ws["tags"]} == {
        "otel.status_code": "ERROR",
        "otel.status_description": "kv view failed",
        "error": True,
    }
    assert ws["logs"] == [{"timestamp": (T0 + 800_000) // 1000, "fields": [
        {"key": "event", "type": "string", "value": "cache_miss"},
        {"key": "blocks", "type": "int64", "value": 4},
    ]}]  # fmt: skip
    procs = trace["processes"]
    assert len(procs) == 2
    assert {procs[s["processID"]]["serviceName"] for s in (root, queue, step)} == {"kvfleet-scheduler"}
    assert procs[ws["processID"]]["serviceName"] == "kvfleet-worker"
    worker_tags = {t["key"]: t["value"] for t in procs[ws["processID"]]["tags"]}
    assert worker_tags["service.instance.id"] == "worker-0" and worker_tags["telemetry.sdk.language"] == "python"
    assert "service.name" not in worker_tags


def test_unknown_and_malformed_trace_ids(served: tuple[RunningServer, Sent]) -> None:
    srv, _ = served
    status, _, body = _get(_http(srv), "/api/traces/" + "ab" * 16)
    assert status == 404 and "not found" in assert_error_envelope(body, 404)
    status, _, body = _get(_http(srv), "/api/traces/not-hex")
    assert status == 400 and "'traceID'" in assert_error_envelope(body, 400)


def _search(srv: RunningServer, **params: Any) -> list[dict[str, Any]]:
    status, _, body = _get(_http(srv), "/api/traces?" + _query(**params))
    assert status == 200, body
    assert_envelope(body)
    for trace in body["data"]:
        assert_trace(trace)
    return body["data"]


def test_search_as_grafana_asks(served: tuple[RunningServer, Sent]) -> None:
    srv, sent = served
    start, end = T0 // 1000 - 1_000_000, T0 // 1000 + 60_000_000  # µs, as Grafana sends its time range
    grafana = {"service": "kvfleet-scheduler", "start": start, "end": end, "limit": 20, "lookback": "custom"}
    found = _search(srv, **grafana)
    assert sorted(t["traceID"] for t in found) == sorted([sent.trace_id, sent.tick_trace_id])
    assert [t["traceID"] for t in found] == [sent.trace_id, sent.tick_trace_id]  # the newest match first
    # whole traces, not the matching spans only: the worker's span comes along
    assert {s["operationName"] for s in found[0]["spans"]} == {"text_completion tiny", "queue", "step_decode",
                                                               "worker_step"}  # fmt: skip
    assert [t["traceID"] for t in _search(srv, **{**grafana, "limit": 1})] == [sent.trace_id]
    by_tag = _search(srv, **grafana, tags=json.dumps({"kvfleet.session.id": "s-42"}))
    assert [t["traceID"] for t in by_tag] == [sent.trace_id]
    assert _search(srv, **grafana, tags=json.dumps({"kvfleet.session.id": "s-43"})) == []
    assert [t["traceID"] for t in _search(srv, **grafana, operation="tick")] == [sent.tick_trace_id]
    # worker_step lasted 2 ms: found by its own service's spans within the bounds, and error=true
    worker = {**grafana, "service": "kvfleet-worker"}
    assert [t["traceID"] for t in _search(srv, **worker, minDuration="1.5ms", maxDuration="2ms")] == [sent.trace_id]
    assert _search(srv, **worker, minDuration="2001us") == []
    assert [t["traceID"] for t in _search(srv, **worker, tags='{"error":"true"}')] == [sent.trace_id]
    assert _search(srv, **worker, tags='{"error":"false"}') == []
    # by start time (µs): the window after the request started holds none of its spans
    assert _search(srv, service="kvfleet-scheduler", start=T0 // 1000 + 13_000) == []
    assert _search(srv, service="kvfleet-scheduler", end=T0 // 1000 - 1) == []


def test_search_by_trace_ids_names_the_missing_ones(served: tuple[RunningServer, Sent]) -> None:
    srv, sent = served
    missing = "cd" * 16
    status, _, body = _get(_http(srv), "/api/traces?" + _query(traceID=[sent.trace_id, missing]))
    assert status == 200
    assert [t["traceID"] for t in body["data"]] == [sent.trace_id]
    assert body["errors"] == [{"msg": "trace not found", "traceID": missing}]


def test_a_search_response_is_bounded_in_spans(
    served: tuple[RunningServer, Sent], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, sent = served
    monkeypatch.setattr(jaeger, "MAX_RESPONSE_SPANS", 3)
    status, _, body = _get(_http(srv), "/api/traces?" + _query(service="kvfleet-scheduler"))
    assert status == 200
    (trace,) = body["data"]  # the newest match, cut to the 3 spans left of the budget
    assert trace["traceID"] == sent.trace_id and len(trace["spans"]) == 3
    assert trace["warnings"] == ["this trace has 4 spans; showing the first 3 by start time"]
    assert body["errors"] == [{"msg": "1 more traces left out: the response holds at most 3 spans; lower 'limit'"}]


@pytest.mark.parametrize(
    "params,param",
    [
        ({}, "service"),
        ({"service": "kvfleet-scheduler", "start": "yesterday"}, "start"),
        ({"service": "kvfleet-scheduler", "end": "1e9"}, "end"),
        ({"service": "kvfleet-scheduler", "minDuration": "10parsecs"}, "minDuration"),
        ({"service": "kvfleet-scheduler", "maxDuration": "-1s"}, "maxDuration"),
        ({"service": "kvfleet-scheduler", "tags": "{not json"}, "tags"),
        ({"service": "kvfleet-scheduler", "limit": "0"}, "limit"),
        ({"traceID": "xyz"}, "traceID"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(
    served: tuple[RunningServer, Sent], params: dict[str, str], param: str
) -> None:
    srv, _ = served
    status, _, body = _get(_http(srv), "/api/traces?" + _query(**params))
    assert status == 400
    assert f"'{param}'" in assert_error_envelope(body, 400)


def test_dependencies_count_the_calls_between_services(served: tuple[RunningServer, Sent]) -> None:
    srv, _ = served
    status, _, body = _get(_http(srv), "/api/dependencies")
    assert status == 200
    assert_envelope(body)
    for link in body["data"]:
        assert_dependency(link)
    assert body["data"] == [{"parent": "kvfleet-scheduler", "child": "kvfleet-worker", "callCount": 1}]
    # endTs and lookback in ms: a window that ends before the request started holds no call
    _, _, body = _get(_http(srv), "/api/dependencies?" + _query(endTs=T0 // 10**6 - 1, lookback=3_600_000))
    assert body["data"] == []
    _, _, body = _get(_http(srv), "/api/dependencies?" + _query(endTs=T0 // 10**6 + 1_000, lookback=10_000))
    assert len(body["data"]) == 1
    status, _, body = _get(_http(srv), "/api/dependencies?lookback=1h")
    assert status == 400 and "'lookback'" in assert_error_envelope(body, 400)


def test_unknown_routes_answer_in_the_error_envelope(served: tuple[RunningServer, Sent]) -> None:
    srv, _ = served
    status, _, body = _get(_http(srv), "/api/nothing")
    assert status == 404
    assert_error_envelope(body, 404)


def test_a_resource_without_a_service_name_is_jaegers_placeholder(tmp_path: Path) -> None:
    srv = RunningServer(TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0))
    try:
        otlp_export(srv.channel)(export_request([raw_span("bare", arm=None)]), timeout=5)
        _, _, body = _get(_http(srv), "/api/services")
        assert body["data"] == [jaeger.NO_SERVICE_NAME]
        traces = _search(srv, service=jaeger.NO_SERVICE_NAME)
        assert [s["operationName"] for t in traces for s in t["spans"]] == ["bare"]
        assert traces[0]["processes"] == {"p1": {"serviceName": jaeger.NO_SERVICE_NAME, "tags": []}}
    finally:
        srv.stop()


def test_the_live_scheduler_snapshot_says_why_when_there_is_none(
    served: tuple[RunningServer, Sent], tmp_path: Path
) -> None:
    """No --scheduler: 404 saying how to set one; a scheduler that does not answer: 502 naming it.
    (The snapshot of a real scheduler is read in test_trace_ui.py, through kvfleet's cluster.)"""
    srv, _ = served
    status, _, body = _get(_http(srv), "/api/scheduler")
    assert status == 404 and "--scheduler" in assert_error_envelope(body, 404)
    from kvfleet.local_cluster import free_port

    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0, scheduler=nobody)
    down = RunningServer(config)
    try:
        status, _, body = _get(_http(down), "/api/scheduler")
        message = assert_error_envelope(body, 502)
        assert status == 502 and nobody in message and "UNAVAILABLE" in message, message
    finally:
        down.stop()


def test_no_http_port_no_trace_api(tmp_path: Path) -> None:
    srv = RunningServer(TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db")))
    try:
        assert srv.server.http_port is None
    finally:
        srv.stop()


# --- reads guarded as the gRPC reads are ---------------------------------------------------------


def test_protected_reads_need_the_bearer_token(tmp_path: Path) -> None:
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0,
                             auth=AuthPolicy(token=TOKEN, protect_reads=True))  # fmt: skip
    srv = RunningServer(config)
    try:
        sent = _export(srv.port, headers={"authorization": f"Bearer {TOKEN}"})
        port = _http(srv)
        for path in ("/api/services", f"/api/traces/{sent.trace_id}", "/api/traces?service=kvfleet-worker",
                     "/api/dependencies", "/api/services/kvfleet-worker/operations"):  # fmt: skip
            status, headers, body = _get(port, path)
            assert status == 401 and headers.get("WWW-Authenticate") == "Bearer", (path, status)
            assert "Authorization: Bearer" in assert_error_envelope(body, 401)
            status, _, body = _get(port, path, {"Authorization": "Bearer wrong"})
            assert status == 401 and "wrong bearer token" in assert_error_envelope(body, 401)
            status, _, body = _get(port, path, {"Authorization": f"Bearer {TOKEN}"})
            assert status == 200 and body["data"], (path, body)
        refused = srv.server.metrics.registry.get_sample_value(
            "kvfleet:telemetry_unauthorized_requests_total", {"method": "GET /api/services"}
        )
        assert refused == 2
    finally:
        srv.stop()


def test_reads_stay_open_when_only_writes_are_guarded(tmp_path: Path) -> None:
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0,
                             auth=AuthPolicy(token=TOKEN))  # fmt: skip
    srv = RunningServer(config)
    try:
        _export(srv.port, headers={"authorization": f"Bearer {TOKEN}"})
        status, _, body = _get(_http(srv), "/api/services")
        assert status == 200 and body["data"] == ["kvfleet-scheduler", "kvfleet-worker"]
    finally:
        srv.stop()


def test_under_tls_the_api_serves_https_and_protected_reads_check_the_certificate(tmp_path: Path, certs: Path) -> None:
    tls = TlsConfig(cert=str(certs / "telemetry.pem"), key=str(certs / "telemetry.key"), ca=str(certs / "ca.pem"),
                    client_auth=True, allowed_clients=frozenset({"kvfleet-worker"}))  # fmt: skip
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0, tls=tls,
                             auth=AuthPolicy(allowed_clients=tls.allowed_clients, protect_reads=True))  # fmt: skip
    srv = RunningServer(config)

    def context(ident: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        if ident:
            ctx.load_cert_chain(str(certs / f"{ident}.pem"), str(certs / f"{ident}.key"))
        return ctx

    try:
        port = _http(srv)
        status, _, body = _get(port, "/api/services", scheme="https", context=context("worker"))
        assert status == 200 and body["data"] == []
        status, _, body = _get(port, "/api/services", scheme="https", context=context("client"))
        assert status == 403 and "kvfleet-client" in assert_error_envelope(body, 403)
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):  # no certificate: no TLS
            _get(port, "/api/services", scheme="https", context=context(None))
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # and no plain HTTP beside it
            _get(port, "/api/services")
    finally:
        srv.stop()


# --- kvfleet up -----------------------------------------------------------------------------------


def test_kvfleet_up_serves_a_requests_trace_on_the_trace_api_it_prints(tmp_path: Path) -> None:
    """`kvfleet up` starts telemetry with the trace API (and UI) and names it in its banner; a session's
    trace is there (tags from the scheduler's spans), and the scheduler's ticks call the worker."""
    from kvfleet.client import SchedulerClient, build_request
    from tests.helpers.up import Up

    up = Up(["--model", "tiny", "--workers", "1", "--no-gateway"], tmp_path / "up.err", start_timeout_s=60)
    try:
        url = re.search(r"trace UI at (http://\S+?)/[\s,(]", up.banner).group(1)
        port = int(url.rsplit(":", 1)[1])
        with urllib.request.urlopen(url + "/", timeout=10) as resp:  # the UI on the same port
            assert resp.headers["Content-Type"].startswith("text/html") and b"/ui/app.js" in resp.read()
        with SchedulerClient(up.scheduler) as client:
            session = client.generate(build_request([1, 2, 3], 4, ignore_eos=True)).session_id
        tags = json.dumps({"kvfleet.session.id": session})
        deadline = time.monotonic() + 30
        while True:  # spans reach the store in batches
            status, _, body = _get(port, "/api/traces?" + _query(service="kvfleet-scheduler", tags=tags))
            assert status == 200, body
            if body["data"]:
                break
            assert time.monotonic() < deadline, "no trace of the session reached the trace API"
            time.sleep(0.3)
        trace = _one_trace(body)
        names = {s["operationName"] for s in trace["spans"]}
        assert "queue" in names and "step_decode" in names, names
        # Each process exports in its own batches: the worker's may land after the scheduler's.
        while True:
            _, _, services = _get(port, "/api/services")
            _, _, deps = _get(port, "/api/dependencies")
            links = [{k: link[k] for k in ("parent", "child")} for link in deps["data"]]
            if (
                "kvfleet-worker" in services["data"]
                and {"parent": "kvfleet-scheduler", "child": "kvfleet-worker"} in links
            ):
                break
            assert time.monotonic() < deadline, f"the worker's spans never reached the trace API: {services}, {links}"
            time.sleep(0.3)
        assert "kvfleet-scheduler" in services["data"]
    finally:
        assert up.stop() == 0, up.stderr()

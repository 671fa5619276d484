"""The trace UI (telemetry_svc/ui, served on telemetry's --http-port) in a real headless browser:
Debian's chromium, driven by Playwright pointed at that executable (no browser download). A tiny
cluster as `kvfleet up` starts it (kvfleet.local_cluster) serves a real request, whose spans its
telemetry stores; an experiment's spans and artifacts are sent to the same telemetry. Every page
loads without a console error; the screenshots are saved under pytest's tmp_path (paths printed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from telemetry_svc.auth import AuthPolicy
from telemetry_svc.server import TelemetryConfig
from tests.helpers.telemetry_server import RunningServer, otlp_export

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI") == "true"
EXP = "ui-exp"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"
TOKEN = "ui-read-s3cret"


def _missing() -> str:
    """Why the browser cannot run here ("" when it can). `make test` installs both."""
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (the test extra: pip install -e '.[test]')"
    if CHROMIUM is None:
        return "Debian's chromium is not installed (`make test` installs it; or apt-get install -y chromium)"
    return ""


# Outside CI a machine without the browser skips, saying why; in CI (CI=true) it fails (the browser fixture).
pytestmark = pytest.mark.skipif(bool(_missing()) and not IN_CI, reason=_missing() or "-")


# --- what the UI shows: a real request's trace, an experiment, a hostile span -------------------------


def _get(url: str, headers: dict[str, str] | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        return json.loads(resp.read())


def _attr(key: str, value: str | int) -> common_pb2.KeyValue:
    any_value = (
        common_pb2.AnyValue(string_value=value) if isinstance(value, str) else common_pb2.AnyValue(int_value=value)
    )
    return common_pb2.KeyValue(key=key, value=any_value)


def _export(address: str, service: str, spans: list[trace_pb2.Span], token: str = "") -> None:
    resource = resource_pb2.Resource(attributes=[_attr("service.name", service)])
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(resource=resource, scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]
    )
    with grpc.insecure_channel(address) as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        otlp_export(channel)(request, timeout=10, metadata=metadata)


def _experiment_spans() -> list[trace_pb2.Span]:
    """Both arms of EXP: 8 worker steps each (the candidate's phases faster) and 6 generation walls."""
    spans, t, n = [], time.time_ns() - 10**9, 0
    for arm in ("control", "candidate"):
        slow = 0 if arm == "candidate" else 1
        attrs = [_attr("experiment.id", EXP), _attr("experiment.arm", arm)]
        for i in range(8):
            n += 1
            trace_id, step_id = n.to_bytes(16, "big"), (n << 8).to_bytes(8, "big")
            phases = [("kv_view_prepare", 4_000 + 1_500 * slow + 37 * i), ("attention", 36_000 + 4_000 * slow + 101 * i),
                      ("attention", 36_050 + 4_000 * slow + 101 * i), ("post_step_sync", 9_000 + 13 * i)]  # fmt: skip
            t0 = t
            for j, (name, d) in enumerate(phases):
                spans.append(trace_pb2.Span(trace_id=trace_id, span_id=((n << 8) + j + 1).to_bytes(8, "big"),
                                            parent_span_id=step_id, name=name, start_time_unix_nano=t,
                                            end_time_unix_nano=t + d, attributes=attrs))  # fmt: skip
                t += d
            spans.append(trace_pb2.Span(trace_id=trace_id, span_id=step_id, name="worker_step", start_time_unix_nano=t0,
                                        end_time_unix_nano=t, attributes=attrs))  # fmt: skip
            t += 1_000
        for i in range(6):
            n += 1
            d = 3_000_000 + 500_000 * slow + 7_919 * i
            spans.append(trace_pb2.Span(trace_id=n.to_bytes(16, "big"), span_id=(n << 8).to_bytes(8, "big"),
                                        name="generation_wall", start_time_unix_nano=t, end_time_unix_nano=t + d,
                                        attributes=attrs))  # fmt: skip
            t += d
    return spans


def _record_artifacts(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = telemetry_pb2_grpc.TelemetryStub(channel)
        for arm in ("control", "candidate"):
            stub.RecordArtifact(telemetry_pb2.ArtifactRequest(experiment_id=EXP, arm=arm, tokens_json="[[1, 2, 3]]",
                                kind=telemetry_pb2.ARTIFACT_KIND_TOKENS, completion_tokens=3), timeout=10)  # fmt: skip
        stub.RecordArtifact(telemetry_pb2.ArtifactRequest(experiment_id=EXP, kind=telemetry_pb2.ARTIFACT_KIND_TREATMENT,
                                                          value="PERSISTENT_KV_VIEWS"), timeout=10)  # fmt: skip


@dataclass
class Served:
    url: str  # the UI, http://host:port
    telemetry: str  # its OTLP/gRPC address
    session_id: str
    trace: dict[str, Any]  # the request's trace as the Jaeger API answers it
    scheduler: str  # the cluster's scheduler, for a request sent during a test


def _settled_trace(url: str, session_id: str, timeout_s: float = 30) -> dict[str, Any]:
    """The session's trace once its spans stopped arriving (scheduler and worker export apart)."""
    tags = urllib.parse.quote(json.dumps({"kvfleet.session.id": session_id}))
    deadline, last, same = time.monotonic() + timeout_s, -1, 0
    while True:
        found = _get(f"{url}/api/traces?service=kvfleet-scheduler&tags={tags}")["data"]
        names = {s["operationName"] for t in found for s in t["spans"]}
        count = sum(len(t["spans"]) for t in found)
        same = same + 1 if count == last and "attention" in names else 0
        if same >= 3:
            (trace,) = found
            return trace
        assert time.monotonic() < deadline, f"the session's trace did not settle: {sorted(names)}"
        last = count
        time.sleep(0.25)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from kvfleet.client import SchedulerClient, build_request
    from kvfleet.local_cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(workers=1, model="tiny", extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    with LocalCluster(spec, log_dir=tmp_path_factory.mktemp("cluster")) as cluster:
        with SchedulerClient(cluster.scheduler_address) as client:
            session = client.generate(build_request([1, 2, 3], 4, ignore_eos=True)).session_id
        _export(cluster.telemetry_address, "kvfleet-worker-ui-experiment", _experiment_spans())
        _record_artifacts(cluster.telemetry_address)
        hostile = trace_pb2.Span(trace_id=b"\xee" * 16, span_id=b"\xef" * 8, name=HOSTILE, start_time_unix_nano=10**18,
                                 end_time_unix_nano=10**18 + 5_000, attributes=[_attr("note", "<b>not bold</b>")])  # fmt: skip
        _export(cluster.telemetry_address, "evil<script>", [hostile])
        yield Served(cluster.trace_api_url, cluster.telemetry_address, session,
                     _settled_trace(cluster.trace_api_url, session), cluster.scheduler_address)  # fmt: skip


# --- the browser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if _missing():  # only in CI: elsewhere the module is skipped
        pytest.fail(f"CI=true and the trace UI's browser test cannot run: {_missing()}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


class Page:
    """A page of the browser with its console errors and uncaught exceptions kept."""

    def __init__(self, browser: Any, shots: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.shots = shots

    def open(self, url: str) -> None:
        """Go to url and wait until app.js has rendered that route (body[data-loaded])."""
        hash_ = urllib.parse.urlsplit(url).fragment
        self.page.goto(url)
        self.loaded("#" + hash_ if hash_ else "#/traces")

    def loaded(self, hash_: str) -> None:
        self.page.wait_for_function("h => document.body.dataset.loaded === h", arg=hash_, timeout=15_000)

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        return path


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Page]:
    p = Page(browser, tmp_path)
    try:
        yield p
    finally:
        p.page.close()


# --- traces --------------------------------------------------------------------------------------


def _tree(trace: dict[str, Any]) -> dict[str, tuple[str, int, str]]:
    """span id -> (name, depth, parent id) by Jaeger's rule: the parent is the first CHILD_OF."""
    spans = {s["spanID"]: s for s in trace["spans"]}

    def parent(s: dict[str, Any]) -> str:
        ref = next((r for r in s["references"] if r["refType"] == "CHILD_OF"), None)
        return ref["spanID"] if ref and ref["spanID"] in spans else ""

    def depth(s: dict[str, Any]) -> int:
        p = parent(s)
        return 0 if not p else 1 + depth(spans[p])

    return {i: (s["operationName"], depth(s), parent(s)) for i, s in spans.items()}


def test_a_search_finds_the_request_and_its_waterfall_has_its_spans(served: Served, page: Page) -> None:
    page.open(served.url + "/")  # the latest traces of kvfleet-scheduler, then a search by the session's tag
    assert page.page.input_value("#search-service") == "kvfleet-scheduler"
    page.page.fill("#search-tags", f"kvfleet.session.id={served.session_id}")
    page.page.click("#search-button")
    page.page.wait_for_function(
        "() => location.hash.includes('search=1') && document.body.dataset.loaded === location.hash"
    )
    rows = page.page.locator(".trace-row")
    assert rows.count() == 1 and rows.first.get_attribute("data-trace-id") == served.trace["traceID"]
    assert "text_completion tiny" in rows.first.inner_text()
    page.shot("search")

    rows.first.click()
    page.loaded(f"#/trace/{served.trace['traceID']}")
    got = page.page.eval_on_selector_all(
        "#waterfall .span-row",
        "rows => rows.map(r => [r.dataset.spanId, r.querySelector('.span-name').textContent, +r.dataset.depth,"
        " r.dataset.parentId])",
    )
    want = _tree(served.trace)
    assert len(got) == len(want) == int(page.page.text_content("#span-count") or 0)
    assert {i: (name, depth, parent) for i, name, depth, parent in got} == want
    order = [i for i, *_ in got]
    assert all(order.index(parent) < order.index(i) for i, _, _, parent in got if parent)  # a parent above its children
    # The request as kvfleet traces it: its session span, queue and one step span per tick under it,
    # each tick's worker_step (another service) under the tick, the step's phases under that.
    names = {depth: sorted({n for n, d, _ in want.values() if d == depth}) for depth in range(4)}
    assert got[0][1:3] == ["text_completion tiny", 0] and names[0] == ["text_completion tiny"]
    assert {"queue", "step_prefill", "step_decode", "tick"} <= set(names[1])
    assert names[2] == ["worker_step"]
    assert {"attention", "kv_view_prepare", "kv_write", "post_step_sync"} <= set(names[3])
    ticks = [n for n, d, _ in want.values() if n == "tick"]
    assert len(ticks) == sum(1 for n, _, _ in want.values() if n == "worker_step") >= 2

    page.page.locator("#waterfall .span-row").first.click()  # the session span's attributes
    detail = page.page.locator(".span-detail").inner_text()
    assert "kvfleet.session.id" in detail and served.session_id in detail and "kvfleet-scheduler" in detail
    page.shot("waterfall")
    assert page.errors == []


def test_a_search_by_duration_and_limit_finds_what_the_api_finds(served: Served, page: Page) -> None:
    """README: the Traces page searches by durations and limit too. The experiment's service has
    16 worker-step traces of about 0.1 ms and 12 generation walls of 3-3.5 ms."""
    service = "kvfleet-worker-ui-experiment"

    def search(**fields: str) -> list[str]:
        page.open(served.url + "/#/traces?" + urllib.parse.urlencode({"service": service}))
        for selector, value in fields.items():
            page.page.fill(selector, value)
        page.page.click("#search-button")
        page.page.wait_for_function(
            "() => location.hash.includes('search=1') && document.body.dataset.loaded === location.hash"
        )
        return sorted(r.get_attribute("data-trace-id") or "" for r in page.page.locator(".trace-row").all())

    def found(**params: str) -> list[str]:
        body = _get(f"{served.url}/api/traces?" + urllib.parse.urlencode({"service": service, **params}))
        return sorted(t["traceID"] for t in body["data"])

    long = search(**{"#search-min": "1ms", "#search-limit": "50"})
    assert long == found(minDuration="1ms", limit="50") and len(long) == 12
    short = search(**{"#search-max": "1ms", "#search-limit": "50"})
    assert short == found(maxDuration="1ms", limit="50") and len(short) == 16
    assert len(search(**{"#search-min": "1ms", "#search-limit": "5"})) == 5
    assert page.errors == []


def test_span_text_from_a_sender_stays_text(served: Served, page: Page) -> None:
    page.open(served.url + "/#/traces?" + urllib.parse.urlencode({"service": "evil<script>"}))
    page.page.wait_for_selector(".trace-row")
    assert page.page.locator(".trace-row a").first.text_content() == HOSTILE
    page.page.locator(".trace-row").first.click()
    page.loaded("#/trace/" + "ee" * 16)
    assert page.page.text_content(".span-name") == HOSTILE
    page.page.locator(".span-row").first.click()
    assert "<b>not bold</b>" in page.page.locator(".span-detail").inner_text()
    assert page.page.locator("main img, main b:text('not bold')").count() == 0  # no element made of them
    assert page.page.title() == "kvfleet telemetry"
    assert page.errors == []


def test_the_pages_policy_stops_markup_from_running(served: Served, page: Page) -> None:
    """README: the UI is served with a Content-Security-Policy under which only its own script
    runs, so markup that got into the page could not run anything: a real browser holds it."""
    with urllib.request.urlopen(served.url + "/", timeout=10) as resp:
        policy = resp.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
    page.open(served.url + "/#/traces")
    ran = page.page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.injected = 1';"
        " document.body.appendChild(s); return window.injected === 1; }"
    )
    assert ran is False
    assert any("Content Security Policy" in e for e in page.errors), page.errors  # the browser says why


# --- experiments ---------------------------------------------------------------------------------


def test_the_experiment_page_shows_the_gate_and_decision_summary(served: Served, page: Page) -> None:
    api = _get(f"{served.url}/api/experiments/{EXP}/summary")["data"]
    with grpc.insecure_channel(served.telemetry) as channel:  # the UI's summary is GetSummary's document
        grpc_summary = telemetry_pb2_grpc.TelemetryStub(channel).GetSummary(
            telemetry_pb2.SummaryRequest(experiment_id=EXP), timeout=30
        )
    assert api == json.loads(grpc_summary.json)

    page.open(served.url + "/#/experiments")
    row = page.page.locator(f'.experiment-row[data-experiment-id="{EXP}"]')
    cells = row.locator("td").all_inner_texts()
    assert cells[:4] == [EXP, "46", "46", "0"]  # per arm: 8 steps of 5 spans, 6 generation walls
    page.shot("experiments")
    row.click()
    page.loaded(f"#/experiment/{EXP}")
    assert page.page.text_content("#decision-status") == api["status"].replace("_", " ")
    assert api["decision"]["next_action"] in page.page.inner_text("#decision")
    gates = page.page.locator(".gate-row")
    assert gates.count() == len(api["gate_details"]) == 6
    for g in api["gate_details"]:
        verdict = {True: "pass", False: "fail", None: "not evaluated"}[g["passed"]]
        assert verdict in page.page.locator(f'.gate-row[data-gate="{g["name"]}"]').inner_text()
    assert json.loads(page.page.text_content("#summary-json") or "") == api
    page.shot("experiment")
    assert page.errors == []


def test_the_experiment_summary_downloads_as_the_json_getsummary_answers(served: Served, page: Page) -> None:
    page.open(served.url + f"/#/experiment/{EXP}")
    with page.page.expect_download() as got:
        page.page.click("#summary-download")
    download = got.value
    assert download.suggested_filename == f"{EXP}-summary.json"
    assert json.loads(Path(download.path()).read_text()) == _get(f"{served.url}/api/experiments/{EXP}/summary")["data"]
    assert page.errors == []


# --- the scheduler -------------------------------------------------------------------------------


def test_the_scheduler_page_shows_the_latest_exported_ticks(served: Served, page: Page) -> None:
    body = _get(f"{served.url}/api/traces?service=kvfleet-scheduler&operation=tick&limit=40")
    ticks = [s for t in body["data"] for s in t["spans"] if s["operationName"] == "tick"]
    latest = max(ticks, key=lambda s: s["startTime"])
    number = next(t["value"] for t in latest["tags"] if t["key"] == "kvfleet.tick")
    live = _get(f"{served.url}/api/scheduler")["data"]  # the scheduler's own answer, asked now
    assert live["telemetry"]["live_workers"] == 1 and live["telemetry"]["ticks"] >= int(number)
    assert [w["worker_id"] for w in live["workers"]] == ["worker-0"] and live["workers"][0]["live"] is True
    page.open(served.url + "/#/scheduler")
    assert page.page.locator("#latest-tick .card .v").first.text_content() == str(number)
    assert page.page.locator(".tick-row").count() == len({s["spanID"] for s in ticks})
    assert page.page.text_content("#live-workers") == "1"
    assert page.page.locator('.worker-row[data-worker="worker-0"][data-live="true"]').count() == 1
    assert page.page.locator("#no-live").count() == 0
    page.shot("scheduler")
    assert page.errors == []


def test_the_scheduler_page_refreshes_itself_every_5_s(served: Served, page: Page) -> None:
    """A tick exported after the page loaded shows up on it without a reload: the page's clock
    (Playwright's) is moved 5 s on once the tick is in the store."""
    from kvfleet.client import SchedulerClient, build_request

    page.page.clock.install()
    page.open(served.url + "/#/scheduler")
    shown = page.page.locator("#latest-tick .card .v").first
    before = int(shown.text_content() or 0)
    with SchedulerClient(served.scheduler) as client:
        client.generate(build_request([3, 1, 4], 4, ignore_eos=True))
    deadline = time.monotonic() + 30
    while _latest_tick(served.url) <= before:
        assert time.monotonic() < deadline, "the request's ticks never reached the store"
        time.sleep(0.2)
    assert int(shown.text_content() or 0) == before  # nothing moves until the page's 5 s are up
    page.page.clock.run_for(5_000)
    page.page.wait_for_function(
        "n => +document.querySelector('#latest-tick .card .v').textContent > n", arg=before, timeout=15_000
    )
    # The request's ticks reach the store over more than one export, so the page's refresh may
    # have read the store between two of them: it shows one of this request's ticks, never one
    # that is not stored yet.
    assert before < int(shown.text_content() or 0) <= _latest_tick(served.url)
    assert page.errors == []


def _latest_tick(url: str) -> int:
    body = _get(f"{url}/api/traces?service=kvfleet-scheduler&operation=tick&limit=40")
    ticks = [s for t in body["data"] for s in t["spans"] if s["operationName"] == "tick"]
    latest = max(ticks, key=lambda s: s["startTime"])
    return int(next(t["value"] for t in latest["tags"] if t["key"] == "kvfleet.tick"))


# --- reads guarded as the API's are --------------------------------------------------------------


def test_with_protected_reads_the_ui_asks_for_the_token(tmp_path: Path, page: Page) -> None:
    config = TelemetryConfig(host="127.0.0.1", port=0, db_path=str(tmp_path / "t.db"), http_port=0,
                             auth=AuthPolicy(token=TOKEN, protect_reads=True))  # fmt: skip
    srv = RunningServer(config)
    try:
        span = trace_pb2.Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="guarded", start_time_unix_nano=1_000,
                              end_time_unix_nano=2_000)  # fmt: skip
        _export(f"127.0.0.1:{srv.port}", "kvfleet-scheduler", [span], token=TOKEN)
        page.open(f"http://127.0.0.1:{srv.server.http_port}/")  # the page itself needs no token
        assert "protects its reads" in page.page.inner_text("[role=alert]")
        assert page.errors and all("401" in e for e in page.errors), page.errors  # the refused reads, only
        page.errors.clear()
        page.page.fill("#token", TOKEN)
        page.page.click("#token-form button")
        page.page.wait_for_selector(".trace-row")
        assert page.page.locator(".trace-row a").first.text_content() == "guarded"
        assert page.errors == []
    finally:
        srv.stop()

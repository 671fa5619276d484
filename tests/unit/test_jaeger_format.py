"""telemetry_svc.jaeger: store rows -> Jaeger's query-API JSON, checked field by field against
Jaeger's model (tests/helpers/jaeger_shapes.py) and the OpenTelemetry-to-Jaeger mapping: ids,
microseconds, references, processes, typed tags, logs; the query parameters; dependencies; and
the store's queries behind them (SqliteSpanStore on a temporary file)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest

from telemetry_svc import jaeger
from telemetry_svc.model import ServiceCall, SpanRecord
from telemetry_svc.store import SqliteSpanStore
from tests.helpers.jaeger_shapes import assert_dependency, assert_envelope, assert_error_envelope, assert_trace

T0 = 1_700_000_000_123_456_789  # ns: not a whole microsecond, so truncation shows
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER_TRACE = "00000000000000000000000000000abc"


def _span(span_id: str, parent: str = "", name: str = "op", service: str = "kvfleet-scheduler", start: int = T0,
          dur: int = 2_345_678, attrs: dict[str, Any] | None = None, detail: dict[str, Any] | None = None,
          trace: str = TRACE) -> SpanRecord:  # fmt: skip
    return SpanRecord(trace, span_id, parent, name, service, start, start + dur, attributes=attrs or {},
                      detail=detail or {})  # fmt: skip


FULL = _span(
    "00f067aa0ba902b7",
    parent="53995c3f42cd8ad8",
    name="text_completion tiny",
    attrs={
        "gen_ai.request.top_k": 40,
        "gen_ai.request.top_p": 0.9,
        "kvfleet.stream": True,
        "server.address": "127.0.0.1",
        "big": 2**60,
        "ids": [1, 2],
        "m": {"a": 1},
        "none": None,
        "error": "the attribute's, overridden",
    },  # fmt: skip
    detail={
        "kind": "server",
        "status": {"code": "error", "message": "worker w0 failed"},
        "events": [
            {"time_ns": T0 + 1_999, "name": "admitted", "attributes": {"blocks": 4}},
            {"time_ns": T0 + 5_000, "name": "ignored", "attributes": {"event": "preempted", "why": "kv"}},
        ],
        "links": [
            {"trace_id": OTHER_TRACE, "span_id": "0000000000000def", "attributes": {"tick": 3}},
            {"trace_id": "", "span_id": "", "attributes": {}},
        ],  # fmt: skip
        "resource": {"service.name": "kvfleet-scheduler", "service.instance.id": "s0", "host.cores": 16},
        "dropped": {"events": 2, "attributes": 1},
    },
)


def _tags(span_json: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    return {t["key"]: (t["type"], t["value"]) for t in span_json["tags"]}


def test_a_span_has_jaegers_fields_in_microseconds_with_typed_tags() -> None:
    trace = jaeger.trace_json([FULL])
    assert_trace(trace)
    (s,) = trace["spans"]
    assert (trace["traceID"], s["traceID"], s["spanID"]) == (TRACE, TRACE, "00f067aa0ba902b7")
    assert s["operationName"] == "text_completion tiny"
    assert s["startTime"] == 1_700_000_000_123_456  # ns // 1000, as Jaeger truncates
    assert s["duration"] == 2_345
    assert s["warnings"] is None and trace["warnings"] is None
    assert _tags(s) == {
        "gen_ai.request.top_k": ("int64", 40),
        "gen_ai.request.top_p": ("float64", 0.9),
        "kvfleet.stream": ("bool", True),
        "server.address": ("string", "127.0.0.1"),
        "big": ("int64", str(2**60)),  # beyond JavaScript's exact integers: a string, as Jaeger sends it
        "ids": ("string", "[1,2]"),  # arrays and maps as their JSON (the OpenTelemetry mapping)
        "m": ("string", '{"a":1}'),
        "none": ("string", ""),
        "span.kind": ("string", "server"),
        "otel.status_code": ("string", "ERROR"),
        "otel.status_description": ("string", "worker w0 failed"),
        "error": ("bool", True),  # an error status overrides an `error` attribute
        "otel.dropped_attributes_count": ("int64", 1),
        "otel.dropped_events_count": ("int64", 2),
    }
    assert len(s["tags"]) == len(_tags(s))  # no key twice


def test_the_parent_is_the_first_reference_and_links_follow_from() -> None:
    (s,) = jaeger.trace_json([FULL])["spans"]
    assert s["references"] == [
        {"refType": "CHILD_OF", "traceID": TRACE, "spanID": "53995c3f42cd8ad8"},
        {"refType": "FOLLOWS_FROM", "traceID": OTHER_TRACE, "spanID": "0000000000000def"},
    ]  # the link without ids is left out
    (root,) = jaeger.trace_json([_span("53995c3f42cd8ad8")])["spans"]
    assert root["references"] == []


def test_events_are_logs_with_the_event_field_first() -> None:
    (s,) = jaeger.trace_json([FULL])["spans"]
    assert s["logs"] == [
        {"timestamp": (T0 + 1_999) // 1000, "fields": [{"key": "event", "type": "string", "value": "admitted"},
                                                       {"key": "blocks", "type": "int64", "value": 4}]},
        # an `event` attribute wins over the event's name
        {"timestamp": (T0 + 5_000) // 1000, "fields": [{"key": "event", "type": "string", "value": "preempted"},
                                                       {"key": "why", "type": "string", "value": "kv"}]},
    ]  # fmt: skip


def test_an_internal_span_without_status_carries_its_attributes_only() -> None:
    plain = _span("1111111111111111", attrs={"error": "kept: no error status"}, detail={"kind": "internal"})
    (s,) = jaeger.trace_json([plain])["spans"]
    assert _tags(s) == {"error": ("string", "kept: no error status")}  # no span.kind for internal
    assert s["logs"] == [] and s["references"] == []
    ok = _span("2222222222222222", detail={"kind": "client", "status": {"code": "ok", "message": ""}})
    (s,) = jaeger.trace_json([ok])["spans"]
    assert _tags(s) == {"span.kind": ("string", "client"), "otel.status_code": ("string", "OK")}


def test_non_finite_floats_become_strings_so_the_body_is_json() -> None:
    odd = _span("3333333333333333", attrs={"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")})
    trace = jaeger.trace_json([odd])
    assert _tags(trace["spans"][0]) == {"nan": ("string", "NaN"), "inf": ("string", "+Inf"),
                                        "ninf": ("string", "-Inf")}  # fmt: skip
    json.dumps(trace, allow_nan=False)  # raises on NaN


def test_one_process_per_service_and_resource_in_order_of_appearance() -> None:
    def res(service: str, instance: str) -> dict[str, Any]:
        return {"resource": {"service.name": service, "service.instance.id": instance}}

    spans = [
        _span("a000000000000001", service="kvfleet-scheduler", detail=res("kvfleet-scheduler", "s0")),
        _span("a000000000000002", service="kvfleet-worker", detail=res("kvfleet-worker", "worker-0")),
        _span("a000000000000003", service="kvfleet-worker", detail=res("kvfleet-worker", "worker-1")),
        _span("a000000000000004", service="kvfleet-scheduler", detail=res("kvfleet-scheduler", "s0")),
        _span("a000000000000005", service=""),  # a resource without service.name
    ]
    trace = jaeger.trace_json(spans)
    assert_trace(trace)
    assert [s["processID"] for s in trace["spans"]] == ["p1", "p2", "p3", "p1", "p4"]
    assert trace["processes"] == {
        "p1": {"serviceName": "kvfleet-scheduler",
               "tags": [{"key": "service.instance.id", "type": "string", "value": "s0"}]},
        "p2": {"serviceName": "kvfleet-worker",
               "tags": [{"key": "service.instance.id", "type": "string", "value": "worker-0"}]},
        "p3": {"serviceName": "kvfleet-worker",
               "tags": [{"key": "service.instance.id", "type": "string", "value": "worker-1"}]},
        "p4": {"serviceName": jaeger.NO_SERVICE_NAME, "tags": []},
    }  # fmt: skip
    assert jaeger.trace_json([FULL])["processes"]["p1"]["tags"] == [
        {"key": "service.instance.id", "type": "string", "value": "s0"},
        {"key": "host.cores", "type": "int64", "value": 16},
    ]  # service.name is the process's serviceName, not a tag


def test_a_cut_trace_says_so_in_its_warnings() -> None:
    trace = jaeger.trace_json([FULL], total_spans=12_000)
    assert trace["warnings"] == ["this trace has 12000 spans; showing the first 1 by start time"]
    assert jaeger.trace_json([FULL], total_spans=1)["warnings"] is None
    with pytest.raises(ValueError):
        jaeger.trace_json([])


def test_envelopes() -> None:
    body = jaeger.envelope(["a", "b"], total=2)
    assert_envelope(body)
    assert body == {"data": ["a", "b"], "total": 2, "limit": 0, "offset": 0, "errors": None}
    err = jaeger.error_envelope(400, "unable to parse param 'start'")
    assert assert_error_envelope(err, 400) == "unable to parse param 'start'"


# --- the query parameters ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,ns",
    [("0", 0), ("10ms", 10_000_000), ("1.5s", 1_500_000_000), ("1h30m", 5_400 * 10**9), ("250us", 250_000),
     ("250µs", 250_000), ("250μs", 250_000), ("+2m", 120 * 10**9), (".5s", 500_000_000), ("5.s", 5 * 10**9),
     ("1m0.5s", 60_500_000_000), ("7ns", 7)],
)  # fmt: skip
def test_go_durations_parse_to_nanoseconds(text: str, ns: int) -> None:
    assert jaeger.parse_duration(text, "minDuration") == ns


@pytest.mark.parametrize("text", ["10", "ms", "-5ms", "1d", "1.2.3s", ".s", "10 ms", "1e3ms", "s10", "99999999999h"])
def test_bad_durations_name_the_parameter(text: str) -> None:
    with pytest.raises(jaeger.InvalidQuery) as err:
        jaeger.parse_duration(text, "maxDuration")
    assert err.value.param == "maxDuration" and "'maxDuration'" in str(err.value)


def test_a_search_query_in_the_apis_units() -> None:
    q = jaeger.parse_trace_query({
        "service": ["kvfleet-scheduler"], "operation": ["queue"], "tags": ['{"kvfleet.session.id":"s-1"}'],
        "tag": ["http.route:/v1/x:y"], "start": ["1700000000000000"], "end": ["1700000001000000"],
        "minDuration": ["10ms"], "maxDuration": ["2s"], "limit": ["20"], "lookback": ["custom"],
    })  # fmt: skip
    assert q == jaeger.TraceQuery(
        service="kvfleet-scheduler",
        operation="queue",
        tags={"kvfleet.session.id": "s-1", "http.route": "/v1/x:y"},
        start_min_ns=1_700_000_000_000_000_000,
        start_max_ns=1_700_000_001_000_000_999,  # the whole of the end microsecond
        min_duration_ns=10_000_000,
        max_duration_ns=2_000_000_000,
        limit=20,
    )
    assert jaeger.parse_trace_query({"service": ["s"]}) == jaeger.TraceQuery(service="s", limit=jaeger.DEFAULT_LIMIT)
    by_id = jaeger.parse_trace_query({"traceID": ["ABC", TRACE]})  # no service needed
    assert by_id.trace_ids == (OTHER_TRACE, TRACE)


@pytest.mark.parametrize(
    "params,param",
    [
        ({}, "service"),
        ({"service": [""]}, "service"),
        ({"service": ["s"], "start": ["soon"]}, "start"),
        ({"service": ["s"], "end": ["1.5"]}, "end"),
        ({"service": ["s"], "start": ["20"], "end": ["10"]}, "end"),
        ({"service": ["s"], "limit": ["0"]}, "limit"),
        ({"service": ["s"], "limit": ["1501"]}, "limit"),
        ({"service": ["s"], "limit": ["ten"]}, "limit"),
        ({"service": ["s"], "minDuration": ["10parsecs"]}, "minDuration"),
        ({"service": ["s"], "minDuration": ["2s"], "maxDuration": ["1s"]}, "maxDuration"),
        ({"service": ["s"], "tags": ["{not json"]}, "tags"),
        ({"service": ["s"], "tags": ['{"code": 200}']}, "tags"),  # Jaeger's map of strings
        ({"service": ["s"], "tags": ['["a"]']}, "tags"),
        ({"service": ["s"], "tag": ["nocolon"]}, "tag"),
        ({"traceID": ["xyz"]}, "traceID"),
        ({"traceID": ["1" * 33]}, "traceID"),
        ({"service": ["s"], "start": ["99999999999999999999"]}, "start"),
        ({"service": ["s"], "end": ["9300000000000000"]}, "end"),  # µs beyond the store's int64 ns
    ],
)
def test_bad_search_parameters_are_refused_naming_them(params: dict[str, list[str]], param: str) -> None:
    with pytest.raises(jaeger.InvalidQuery) as err:
        jaeger.parse_trace_query(params)
    assert err.value.param == param and f"'{param}'" in str(err.value), str(err.value)


def test_trace_ids_are_the_stores_32_lower_case_digits() -> None:
    assert jaeger.parse_trace_id(TRACE.upper()) == TRACE
    assert jaeger.parse_trace_id("abc") == OTHER_TRACE  # Jaeger's short (64-bit) ids
    for bad in ("", "g" * 32, "1" * 33, "12 34"):
        with pytest.raises(jaeger.InvalidQuery):
            jaeger.parse_trace_id(bad)


def test_a_dependency_query_in_milliseconds() -> None:
    now = 1_700_000_000_000_000_000
    q = jaeger.parse_dependency_query({}, now)
    assert (q.end_ns, q.start_ns, q.service) == (now, now - 24 * 3600 * 10**9, "")
    q = jaeger.parse_dependency_query({"endTs": ["1700000000000"], "lookback": ["60000"], "service": ["w"]}, 0)
    assert (q.end_ns, q.start_ns, q.service) == (now, now - 60 * 10**9, "w")
    for params, param in (({"endTs": ["x"]}, "endTs"), ({"lookback": ["0"]}, "lookback"),
                          ({"lookback": ["1h"]}, "lookback"), ({"lookback": ["9300000000000"]}, "lookback"),
                          ({"endTs": ["-9300000000000"]}, "endTs")):  # fmt: skip
        with pytest.raises(jaeger.InvalidQuery) as err:
            jaeger.parse_dependency_query(params, now)
        assert err.value.param == param


# --- tag search and dependencies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tags,hit",
    [
        ({}, True),
        ({"gen_ai.request.top_k": "40"}, True),  # compared as text, whatever the tag's type
        ({"gen_ai.request.top_k": "41"}, False),
        ({"gen_ai.request.top_p": "0.9"}, True),
        ({"kvfleet.stream": "true"}, True),
        ({"span.kind": "server"}, True),
        ({"otel.status_code": "ERROR"}, True),
        ({"error": "true"}, True),
        ({"error": "false"}, False),
        ({"service.instance.id": "s0"}, True),  # the process's tags
        ({"why": "kv"}, True),  # a log's fields
        ({"event": "admitted"}, True),
        ({"gen_ai.request.top_k": "40", "why": "kv"}, True),
        ({"gen_ai.request.top_k": "40", "why": "oom"}, False),  # every tag, on the same span
        ({"absent": ""}, False),
    ],
)
def test_a_span_matches_tags_as_jaeger_searches(tags: dict[str, str], hit: bool) -> None:
    assert jaeger.span_matches(FULL, tags) is hit


def test_error_false_finds_the_spans_without_an_error_status() -> None:
    plain = _span("1111111111111111")
    assert jaeger.span_matches(plain, {"error": "false"}) and not jaeger.span_matches(plain, {"error": "true"})


def test_dependency_links_count_calls_between_services() -> None:
    calls = [ServiceCall("kvfleet-gateway", "kvfleet-scheduler", 3), ServiceCall("kvfleet-scheduler",
             "kvfleet-worker", 40), ServiceCall("kvfleet-scheduler", "kvfleet-scheduler", 99),
             ServiceCall("", "kvfleet-worker", 2), ServiceCall("kvfleet-scheduler", "kvfleet-worker", 2)]  # fmt: skip
    links = jaeger.dependency_links(calls)
    for link in links:
        assert_dependency(link)
    assert links == [
        {"parent": jaeger.NO_SERVICE_NAME, "child": "kvfleet-worker", "callCount": 2},
        {"parent": "kvfleet-gateway", "child": "kvfleet-scheduler", "callCount": 3},
        {"parent": "kvfleet-scheduler", "child": "kvfleet-worker", "callCount": 42},
    ]  # a service's own child spans are no dependency; one link per pair
    assert jaeger.dependency_links(calls, "kvfleet-gateway") == [links[1]]


# --- the store's queries behind the API ----------------------------------------------------------


@pytest.fixture
def store(tmp_path: Any) -> Iterator[SqliteSpanStore]:
    s = SqliteSpanStore(str(tmp_path / "s.db"))
    yield s
    s.close()


def _trace(i: int, start: int, dur: int = 1_000_000) -> list[SpanRecord]:
    """A request's trace: a scheduler root, a scheduler child, a worker grandchild."""
    t = f"{i + 1:032x}"
    return [
        _span(f"{i + 1:08x}00000001", name="text_completion tiny", start=start, dur=dur, trace=t,
              attrs={"kvfleet.session.id": f"s-{i}"}),
        _span(f"{i + 1:08x}00000002", f"{i + 1:08x}00000001", name="queue", start=start + 10, dur=100, trace=t),
        _span(f"{i + 1:08x}00000003", f"{i + 1:08x}00000001", name="worker_step", service="kvfleet-worker",
              start=start + 200, dur=dur // 2, trace=t),
    ]  # fmt: skip


def test_services_and_operations_come_sorted(store: SqliteSpanStore) -> None:
    assert store.services() == [] and store.operations("kvfleet-worker") == []
    for i in range(3):
        store.add_spans(_trace(i, T0 + i * 10**9))
    store.add_spans([_span("ffffffffffffffff", service="", trace="f" * 32)])
    assert store.services() == ["", "kvfleet-scheduler", "kvfleet-worker"]
    assert store.operations("kvfleet-scheduler") == ["queue", "text_completion tiny"]
    assert store.operations("kvfleet-worker") == ["worker_step"]


def test_a_search_finds_the_newest_traces_within_its_bounds(store: SqliteSpanStore) -> None:
    for i in range(5):  # trace i starts at T0 + i s and lasts (i + 1) ms
        store.add_spans(_trace(i, T0 + i * 10**9, dur=(i + 1) * 1_000_000))
    ids = [f"{i + 1:032x}" for i in range(5)]
    assert store.search_traces("kvfleet-scheduler", limit=3).trace_ids == (ids[4], ids[3], ids[2])
    assert store.search_traces("kvfleet-worker", limit=100).trace_ids == tuple(reversed(ids))
    assert store.search_traces("kvfleet-scheduler", start_min_ns=T0 + 10**9, start_max_ns=T0 + 3 * 10**9,
                               operation="text_completion tiny").trace_ids == (ids[3], ids[2], ids[1])  # fmt: skip
    # durations: the root spans of traces 1 and 2 (2 and 3 ms), the queue spans never (100 ns)
    assert store.search_traces("kvfleet-scheduler", min_duration_ns=2_000_000,
                               max_duration_ns=3_000_000).trace_ids == (ids[2], ids[1])  # fmt: skip
    got = store.search_traces(
        "kvfleet-scheduler", matches=lambda s: jaeger.span_matches(s, {"kvfleet.session.id": "s-3"})
    )
    assert got.trace_ids == (ids[3],) and not got.scan_limited
    assert store.search_traces("nobody").trace_ids == ()
    # a bounded scan says where it stopped: 2 spans read (trace 4's root and queue) of 10
    cut = store.search_traces("kvfleet-scheduler", matches=lambda s: False, max_scanned=2)
    assert cut == type(cut)((), scan_limited=True)


def test_a_trace_comes_in_start_order_cut_at_max_spans_with_its_count(store: SqliteSpanStore) -> None:
    store.add_spans(_trace(0, T0))
    got = store.trace(f"{1:032x}", 10)
    assert [s.name for s in got.spans] == ["text_completion tiny", "queue", "worker_step"] and got.total == 3
    cut = store.trace(f"{1:032x}", 2)
    assert len(cut.spans) == 2 and cut.total == 3
    assert store.trace(OTHER_TRACE, 10) == type(got)((), 0)
    assert_trace(jaeger.trace_json(got.spans, got.total))


def test_service_calls_join_child_spans_to_their_parents_within_the_window(store: SqliteSpanStore) -> None:
    for i in range(4):
        store.add_spans(_trace(i, T0 + i * 10**9))
    store.add_spans([_span("eeeeeeeeeeeeeeee", "0123456789abcdef", service="kvfleet-worker", trace="e" * 32)])
    calls = store.service_calls(T0, T0 + 10 * 10**9)
    assert sorted(calls, key=lambda c: (c.parent, c.child)) == [
        ServiceCall("kvfleet-scheduler", "kvfleet-scheduler", 4),
        ServiceCall("kvfleet-scheduler", "kvfleet-worker", 4),
    ]  # the orphan (its parent not stored) is no call
    # by the child's start: traces 1 and 2 only
    window = store.service_calls(T0 + 10**9, T0 + 2 * 10**9 + 500)
    assert jaeger.dependency_links(window) == [{"parent": "kvfleet-scheduler", "child": "kvfleet-worker",
                                                "callCount": 2}]  # fmt: skip

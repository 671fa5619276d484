"""telemetry_svc.otlp: OTLP protobufs to rows, and which spans are rejected."""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from telemetry_svc.otlp import attributes, convert, count_spans


def _kv(key: str, **value: object) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(**value))  # type: ignore[arg-type]


def _span(**kw: object) -> Span:
    base: dict[str, object] = dict(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="attention",
                                   start_time_unix_nano=100, end_time_unix_nano=250)  # fmt: skip
    base.update(kw)
    return Span(**base)  # type: ignore[arg-type]


def _req(spans: list[Span], resource: list[KeyValue] | None = None) -> ExportTraceServiceRequest:
    rs = ResourceSpans(resource=Resource(attributes=resource or []), scope_spans=[ScopeSpans(spans=spans)])
    return ExportTraceServiceRequest(resource_spans=[rs])


def test_resource_experiment_attributes_apply_and_span_attributes_win() -> None:
    res = [_kv("service.name", string_value="worker-0"), _kv("experiment.id", string_value="e1"),
           _kv("experiment.arm", string_value="control")]  # fmt: skip
    spans = [_span(), _span(span_id=b"\x03" * 8, attributes=[_kv("experiment.arm", string_value="candidate")])]
    conv = convert(_req(spans, res))
    assert conv.rejected == 0 and conv.error_message == ""
    a, b = conv.rows
    assert (a.service, a.experiment_id, a.arm, a.duration_ns) == ("worker-0", "e1", "control", 150)
    assert (b.arm, b.span_id, b.trace_id) == ("candidate", "03" * 8, "01" * 16)


def test_any_values_convert_to_json_friendly_python() -> None:
    kvs = [
        _kv("s", string_value="x"), _kv("b", bool_value=True), _kv("i", int_value=7), _kv("d", double_value=0.5),
        _kv("a", array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="y")])),
        _kv("m", kvlist_value=KeyValueList(values=[_kv("k", int_value=2)])), _kv("by", bytes_value=b"\xab"),
        _kv("none"),
    ]  # fmt: skip
    assert attributes(kvs) == {"s": "x", "b": True, "i": 7, "d": 0.5, "a": [1, "y"], "m": {"k": 2}, "by": "ab",
                               "none": None}  # fmt: skip


@pytest.mark.parametrize(
    "span, problem",
    [
        (_span(trace_id=b""), "trace_id is 0 bytes"),
        (_span(trace_id=b"\x00" * 16), "trace_id is all zero"),
        (_span(span_id=b"\x01" * 7), "span_id is 7 bytes"),
        (_span(parent_span_id=b"\x01" * 3), "parent_span_id is 3 bytes"),
        (_span(name=""), "name is empty"),
        (_span(start_time_unix_nano=0, end_time_unix_nano=0), "start_time_unix_nano is zero"),
        (_span(end_time_unix_nano=99), "end before start"),
        (_span(end_time_unix_nano=2**63), "beyond int64"),
        (
            _span(attributes=[_kv("experiment.id", string_value="e"), _kv("experiment.arm", string_value="B")]),
            "is not 'control' or 'candidate'",
        ),  # fmt: skip
        (_span(attributes=[_kv("experiment.arm", string_value="control")]), "without experiment.id"),
    ],
)
def test_invalid_spans_are_rejected_and_the_rest_kept(span: Span, problem: str) -> None:
    good = _span(span_id=b"\x09" * 8)
    conv = convert(_req([span, good]))
    assert conv.rejected == 1 and [r.span_id for r in conv.rows] == ["09" * 8]
    assert problem in conv.error_message


def test_error_message_names_the_first_problems_and_counts_the_rest() -> None:
    conv = convert(_req([_span(name="") for _ in range(5)]))
    assert conv.rejected == 5 and len(conv.problems) == 3
    assert conv.error_message.startswith("rejected 5 span(s)") and conv.error_message.endswith("and 2 more")
    assert count_spans(_req([_span(), _span()])) == 2


def test_kind_status_events_links_and_resource_are_kept_and_bounded() -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    from telemetry_svc.otlp import MAX_EVENTS, MAX_RESOURCE_ATTRIBUTES

    events = [
        Span.Event(time_unix_nano=120 + i, name=f"e{i}", attributes=[_kv("i", int_value=i)])
        for i in range(MAX_EVENTS + 3)
    ]
    link = Span.Link(trace_id=b"\x05" * 16, span_id=b"\x06" * 8, attributes=[_kv("kvfleet.link", string_value="tick")])
    span = _span(
        kind=Span.SPAN_KIND_SERVER,
        status=Status(code=Status.STATUS_CODE_ERROR, message="dropped: no worker"),
        events=events,
        links=[link],
        dropped_attributes_count=2,
    )
    res = [_kv("service.name", string_value="kvfleet-scheduler")]
    res += [_kv(f"r{i}", int_value=i) for i in range(MAX_RESOURCE_ATTRIBUTES + 1)]
    (row,) = convert(_req([span], res)).rows
    d = row.detail
    assert d["kind"] == "server" and d["status"] == {"code": "error", "message": "dropped: no worker"}
    assert len(d["events"]) == MAX_EVENTS and d["events"][1] == {"time_ns": 121, "name": "e1", "attributes": {"i": 1}}
    assert d["links"] == [{"trace_id": "05" * 16, "span_id": "06" * 8, "attributes": {"kvfleet.link": "tick"}}]
    assert d["resource"]["service.name"] == "kvfleet-scheduler" and len(d["resource"]) == MAX_RESOURCE_ATTRIBUTES
    assert d["dropped"] == {"events": 3, "attributes": 2, "resource_attributes": 2}
    # A plain span carries nothing it did not send.
    (plain,) = convert(_req([_span()])).rows
    assert plain.detail == {}


def test_spans_of_equal_plain_details_share_one_and_it_is_each_ones_detail() -> None:
    """A tick's step spans carry the same kind, status and link: convert builds that detail once
    (the store encodes it once); a span with more (events, link attributes) gets its own."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    from telemetry_svc.otlp import detail

    tick = Span.Link(trace_id=b"\x01" * 16, span_id=b"\x09" * 8)
    spans = [_span(span_id=bytes([3 + k]) * 8, kind=Span.SPAN_KIND_INTERNAL, links=[tick]) for k in range(3)] + [
        _span(
            span_id=b"\x07" * 8,
            links=[Span.Link(trace_id=b"\x01" * 16, span_id=b"\x09" * 8, attributes=[_kv("a", int_value=1)])],
        ),
        _span(span_id=b"\x08" * 8, links=[tick], events=[Span.Event(time_unix_nano=5, name="e")]),
        _span(span_id=b"\x0a" * 8, links=[tick], status=Status(code=Status.STATUS_CODE_ERROR, message="x")),
    ]
    req = _req(spans, [_kv("service.name", string_value="s")])
    rows = convert(req).rows
    res = {"service.name": "s"}
    assert [r.detail for r in rows] == [detail(s, res) for s in spans]
    assert rows[0].detail is rows[1].detail is rows[2].detail
    assert len({id(r.detail) for r in rows[2:]}) == 4

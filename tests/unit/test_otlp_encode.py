"""otlp_encode.SpanEncoder: the bytes the SDK's OTLP encoder would send, for every kind of span."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from kvfleet_common.finished_spans import FinishedSpans
from kvfleet_common.otlp_encode import FastOtlpSpanExporter, SpanEncoder


def _spans() -> list:
    exporter = InMemorySpanExporter()
    spans = []
    for service in ("kvfleet-scheduler", "kvfleet-worker"):
        provider = TracerProvider(resource=Resource.create({"service.name": service, "n": 3}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("kvfleet.scheduler")
        other = provider.get_tracer("other", "1.2", schema_url="https://example.com/s")
        root = tracer.start_span("text_completion tiny", kind=SpanKind.SERVER, attributes={"a": 1, "b": "x"})
        tick = tracer.start_span("tick", context=set_span_in_context(root), attributes={"f": 0.5, "t": True})
        tick.end()
        steps = FinishedSpans("kvfleet.scheduler", provider)
        for i in range(3):  # the same attribute values and link again: the cached parts
            steps.child(
                root.get_span_context(),
                "step_decode",
                {"kvfleet.tick": i % 2, "kvfleet.worker.id": "worker-0", "on": i == 1},
                (Link(tick.get_span_context()),),
                1000 + i,
                2000 + i,
            )
        remote = SpanContext(7, 9, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
        with other.start_as_current_span("remote child", context=set_span_in_context(NonRecordingSpan(remote))) as s:
            s.add_event("an event", {"e": 1})  # events: the SDK's own path
        # A remote parent (flags) with a trace state, on this encoder's own path.
        other.start_span("remote plain", context=set_span_in_context(NonRecordingSpan(remote))).end()
        odd = tracer.start_span(
            "odd",
            links=[Link(remote), Link(tick.get_span_context(), {"why": "attr"})],
            attributes={"list": [1, 2], "empty": ""},
        )
        odd.set_status(Status(StatusCode.ERROR, "it broke"))
        odd.end()
        ok = tracer.start_span("ok", kind=SpanKind.CLIENT, links=[Link(remote)], attributes={"big": 2**40, "neg": -3})
        ok.set_status(Status(StatusCode.OK))
        ok.end()
        tracer.start_span("", attributes={"z": 0, "u": "ünïcode"}).end()
        root.end()
        spans = list(exporter.get_finished_spans())
    return spans


def test_the_same_bytes_as_the_sdk() -> None:
    spans = _spans()
    assert len({s.resource.attributes["service.name"] for s in spans}) == 2  # two resources, two scopes
    encoder = SpanEncoder()
    for batch in (spans, spans[:5], spans[3:], spans):  # reused caches across batches
        assert encoder.encode(batch) == encode_spans(batch).SerializeToString()


def test_the_exporter_sends_the_sdk_request() -> None:
    spans = _spans()
    exporter = FastOtlpSpanExporter(endpoint="127.0.0.1:1", insecure=True)
    try:
        assert exporter._translate_data(spans) == encode_spans(spans)
    finally:
        exporter.shutdown(timeout_millis=100)

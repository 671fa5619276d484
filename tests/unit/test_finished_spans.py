"""FinishedSpans: a span born finished is the span the SDK's start_span/end would have exported."""

from __future__ import annotations

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import INVALID_SPAN_CONTEXT, Link, SpanContext, set_span_in_context

from kvfleet_common.finished_spans import FinishedSpans


def _provider(sampler: Sampler) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}), sampler=sampler)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _fields(span) -> dict:
    return {
        "name": span.name,
        "trace_id": span.context.trace_id,
        "parent": span.parent.span_id,
        "attributes": dict(span.attributes),
        "links": [(lk.context.trace_id, lk.context.span_id) for lk in span.links],
        "times": (span.start_time, span.end_time),
        "resource": dict(span.resource.attributes),
        "scope": span.instrumentation_scope.name,
        "kind": span.kind,
        "status": span.status.status_code,
    }


def test_fast_span_equals_the_sdk_span() -> None:
    provider, exporter = _provider(ParentBased(ALWAYS_ON))
    tracer = provider.get_tracer("kvfleet.scheduler")
    root, tick = tracer.start_span("session"), tracer.start_span("tick")
    attrs = {"kvfleet.tick": 3, "kvfleet.worker.id": "w0", "kvfleet.step.position": 7}
    links = (Link(tick.get_span_context()),)
    tracer.start_span(
        "step_decode", context=set_span_in_context(root), links=links, attributes=attrs, start_time=100
    ).end(end_time=250)
    writer = FinishedSpans("kvfleet.scheduler", provider)
    writer.child(root.get_span_context(), "step_decode", attrs, links, 100, 250)
    writer.child(root.get_span_context(), "step_decode", attrs, links, 100, 250)
    sdk, fast, again = exporter.get_finished_spans()
    assert writer._fast  # the path under test was taken
    assert _fields(fast) == _fields(sdk)
    assert fast.parent.span_id == root.get_span_context().span_id and fast.links[0].context == tick.get_span_context()
    ids = {sdk.context.span_id, fast.context.span_id, again.context.span_id}
    assert len(ids) == 3 and 0 not in ids  # fresh, valid span ids
    assert fast.context.trace_flags.sampled and not fast.context.is_remote
    # The OTLP exporter's encoder takes it as it takes the SDK's span.
    encoded = encode_spans([sdk, fast]).resource_spans[0].scope_spans[0].spans
    assert [s.name for s in encoded] == ["step_decode"] * 2
    assert encoded[0].attributes == encoded[1].attributes and encoded[0].links == encoded[1].links
    assert encoded[1].parent_span_id == root.get_span_context().span_id.to_bytes(8, "big")


def test_children_of_an_unsampled_parent_are_dropped() -> None:
    provider, exporter = _provider(ParentBased(ALWAYS_OFF))
    root = provider.get_tracer("x").start_span("session")
    FinishedSpans("x", provider).child(root.get_span_context(), "step_decode", {}, (), 1, 2)
    assert exporter.get_finished_spans() == ()


def test_another_sampler_takes_the_sdk_path() -> None:
    provider, exporter = _provider(TraceIdRatioBased(1.0))
    root = provider.get_tracer("x").start_span("session")
    writer = FinishedSpans("x", provider)
    writer.child(root.get_span_context(), "step_prefill", {"kvfleet.step.tokens": 4}, (), 5, 9)
    (span,) = exporter.get_finished_spans()
    assert not writer._fast
    assert (span.name, span.parent.span_id, span.start_time, span.end_time) == (
        "step_prefill",
        root.get_span_context().span_id,
        5,
        9,
    )
    assert dict(span.attributes) == {"kvfleet.step.tokens": 4}


def test_a_remote_parent_and_a_child_of_the_written_span() -> None:
    """A worker's step: a child of the scheduler's tick (remote, from the traceparent), and the
    step's phases children of the step span just written."""
    provider, exporter = _provider(ParentBased(ALWAYS_ON))
    tick = provider.get_tracer("s").start_span("tick").get_span_context()
    remote = SpanContext(tick.trace_id, tick.span_id, is_remote=True, trace_flags=tick.trace_flags)
    writer = FinishedSpans("kvfleet.worker", provider)
    step = writer.child(remote, "worker_step", {"a": 1}, (), 10, 20)
    phase = writer.child(step, "attention", {"kvfleet.phase.calls": 30}, (), 10, 15)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["worker_step"].parent == remote and spans["worker_step"].context == step
    assert spans["attention"].parent.span_id == step.span_id and spans["attention"].context == phase
    assert {s.context.trace_id for s in spans.values()} == {tick.trace_id}
    # No parent (a step sent without a traceparent): a root span of a trace of its own.
    root = writer.child(INVALID_SPAN_CONTEXT, "worker_step", {}, (), 1, 2)
    (alone,) = [s for s in exporter.get_finished_spans() if s.context == root]
    assert alone.parent is None and root.is_valid and root.trace_id != tick.trace_id


def test_children_are_the_spans_child_writes() -> None:
    """children(): a tick's spans at once, each what child() writes; an unsampled parent's dropped."""
    for sampler in (ParentBased(ALWAYS_ON), TraceIdRatioBased(1.0)):  # the fast path and the SDK's
        provider, exporter = _provider(sampler)
        tracer = provider.get_tracer("kvfleet.scheduler")
        a, b, tick = tracer.start_span("a"), tracer.start_span("b"), tracer.start_span("tick")
        unsampled = SpanContext(5, 6, is_remote=False)  # trace flags 0: not sampled
        links = (Link(tick.get_span_context()),)
        writer = FinishedSpans("kvfleet.scheduler", provider)
        items = [
            (a.get_span_context(), "step_prefill", {"kvfleet.step.tokens": 4}),
            (unsampled, "step_decode", {"kvfleet.step.position": 1}),
            (b.get_span_context(), "step_decode", {"kvfleet.step.position": 9}),
        ]
        for parent, name, attrs in items:
            writer.child(parent, name, attrs, links, 10, 20)
        writer.children(items, links, 10, 20)
        spans = exporter.get_finished_spans()
        # Parent-based: the unsampled parent's child is dropped either way; the ratio sampler keeps it.
        assert len(spans) == (4 if writer._fast else 6)
        half = len(spans) // 2
        assert [_fields(s) for s in spans[:half]] == [_fields(s) for s in spans[half:]]

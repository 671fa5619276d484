"""Spans recorded after the fact: their start and end are known when they are written.

The scheduler writes one `step_prefill` / `step_decode` span per session per tick: 64 a tick at
64 sessions; a worker writes five a step (`worker_step` and its phases). Through the SDK's `start_span(...).end()` each costs about 16 us on the Xeon (the
sampler, attribute cleaning, a lock, the span's own bookkeeping), which made these spans about a
third of the scheduler's CPU at c=64. Born finished, a span needs none of that: it is built as the
SDK's `ReadableSpan` and handed straight to the tracer's span processor (the one `end()` would
reach), about 5x cheaper. What the export carries is the same.

The fast path is taken only where it is exact: an SDK tracer whose sampler is parent-based (the
SDK's default: a child of a sampled span is sampled, of an unsampled one is not). Any other
tracer or sampler gets the SDK's own path. Span processors' `on_start` is not called for these
spans (they start and end in one call).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import INVALID_SPAN_CONTEXT, Link, NonRecordingSpan, SpanContext

Attributes = Mapping[str, str | int | float | bool]


class FinishedSpans:
    """Writes finished child spans for one instrumentation scope. `provider`: the tracer provider
    to write to (None: the global one, looked up on each write, so a provider set after this is
    made is found)."""

    def __init__(self, scope: str, provider: trace.TracerProvider | None = None) -> None:
        self._name = scope
        self._scope = InstrumentationScope(scope)
        self._fixed = provider
        self._provider: trace.TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        self._fast = False

    def _resolve(self) -> trace.Tracer:
        provider = self._fixed or trace.get_tracer_provider()
        if provider is not self._provider:
            self._provider = provider
            self._tracer = provider.get_tracer(self._name)
            self._fast = isinstance(self._tracer, SdkTracer) and isinstance(self._tracer.sampler, ParentBased)
            if isinstance(self._tracer, SdkTracer):
                # The tracer's own scope, field for field, so that the exporter groups these
                # spans with the tracer's others (it groups by equal scopes).
                info = self._tracer.instrumentation_info
                self._scope = InstrumentationScope(self._name, info.version, info.schema_url)
        assert self._tracer is not None
        return self._tracer

    def child(
        self,
        parent: SpanContext,
        name: str,
        attributes: Attributes,
        links: Sequence[Link],
        start_ns: int,
        end_ns: int,
    ) -> SpanContext:
        """A span `name` under `parent` (a local or a remote span's context; an invalid one: the
        span is a root), from start_ns to end_ns (epoch nanoseconds); its context, to parent
        others (invalid where it was not sampled)."""
        tracer = self._resolve()
        if not self._fast or not parent.is_valid:  # no parent: a root, which the root sampler decides
            span = tracer.start_span(
                name,
                context=trace.set_span_in_context(NonRecordingSpan(parent), Context()),
                links=links,
                attributes=attributes,
                start_time=start_ns,
            )
            span.end(end_time=end_ns)
            return span.get_span_context()
        assert isinstance(tracer, SdkTracer)
        if not parent.trace_flags.sampled:
            return INVALID_SPAN_CONTEXT  # parent-based sampling drops the children of an unsampled parent
        own = SpanContext(
            parent.trace_id,
            tracer.id_generator.generate_span_id(),
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
        tracer.span_processor.on_end(
            ReadableSpan(
                name,
                context=own,
                parent=parent,
                resource=tracer.resource,
                attributes=dict(attributes),
                links=tuple(links),
                instrumentation_scope=self._scope,
                start_time=start_ns,
                end_time=end_ns,
            )
        )
        return own

    def children(
        self,
        items: Iterable[tuple[SpanContext, str, Attributes]],
        links: Sequence[Link],
        start_ns: int,
        end_ns: int,
    ) -> None:
        """`child` for each (parent, name, attributes), all with the same links and times (a
        tick's per-session spans: the tracer and its parts looked up once, not per span)."""
        tracer = self._resolve()
        if not self._fast:
            for parent, name, attributes in items:
                self.child(parent, name, attributes, links, start_ns, end_ns)
            return
        assert isinstance(tracer, SdkTracer)
        on_end, new_id = tracer.span_processor.on_end, tracer.id_generator.generate_span_id
        resource, scope, links = tracer.resource, self._scope, tuple(links)
        for parent, name, attributes in items:
            if not parent.is_valid:
                self.child(parent, name, attributes, links, start_ns, end_ns)
                continue
            if not parent.trace_flags.sampled:
                continue
            own = SpanContext(
                parent.trace_id,
                new_id(),
                is_remote=False,
                trace_flags=parent.trace_flags,
                trace_state=parent.trace_state,
            )
            on_end(
                ReadableSpan(
                    name,
                    context=own,
                    parent=parent,
                    resource=resource,
                    attributes=dict(attributes),
                    links=links,
                    instrumentation_scope=scope,
                    start_time=start_ns,
                    end_time=end_ns,
                )
            )

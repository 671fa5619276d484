"""kvfleet_common.tracing: on/off from the environment, and trace context through gRPC metadata."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvfleet_common.tracing import extract_context, inject_metadata, setup_tracing, shutdown_tracing, tracing_enabled


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "TRUE"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_enabled_follows_the_otel_environment(env: dict[str, str], on: bool) -> None:
    assert tracing_enabled(env) is on


def test_off_returns_none_and_leaves_the_global_provider_alone() -> None:
    before = trace.get_tracer_provider()
    assert setup_tracing("svc", env={}) is None
    assert trace.get_tracer_provider() is before
    shutdown_tracing(None)  # a no-op


def test_on_builds_a_provider_with_the_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing listens; never exported
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    provider = setup_tracing("worker", {"experiment.id": "e", "experiment.arm": "control"}, set_global=False)
    assert isinstance(provider, TracerProvider)
    attrs = provider.resource.attributes
    assert (attrs["service.name"], attrs["experiment.id"], attrs["experiment.arm"]) == ("worker", "e", "control")
    provider.shutdown()


def test_trace_context_round_trips_through_metadata() -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    assert inject_metadata() == []  # no active span: nothing to send
    with tracer.start_as_current_span("caller") as span:
        md = inject_metadata()
    assert [k for k, _ in md] == ["traceparent"]
    md.append(("x-bin", b"\x00"))  # binary metadata is ignored
    parent = trace.get_current_span(extract_context(md)).get_span_context()
    assert parent.trace_id == span.get_span_context().trace_id
    assert parent.span_id == span.get_span_context().span_id and parent.is_remote
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid

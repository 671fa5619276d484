"""The worker's step spans: the whole step and its phases, under the scheduler's tick span.

Phase spans (kv_view_prepare, attention, kv_write, post_step_sync) each stand for the *total*
time of that phase in the step, summed over layers: they start with the step and last that
total (attribute kvfleet.phase.calls says how many calls were summed). The phases are
interleaved layer by layer, so no honest single interval exists; a total is what the
experiment compares.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context

from worker_svc.engine import StepProfile


def emit_step_spans(
    parent: Context, start_ns: int, profile: StepProfile, layers: int, attrs: dict[str, str | int]
) -> None:
    """start_ns: wall-clock (epoch) ns when the step began."""
    tracer = trace.get_tracer("kvfleet.worker")
    step = tracer.start_span("worker_step", context=parent, start_time=start_ns, attributes=attrs)
    ctx = trace.set_span_in_context(step, parent)
    phases = (
        ("kv_view_prepare", profile.kv_view_prepare_ns, layers),
        ("attention", profile.attention_ns, layers),
        ("kv_write", profile.kv_write_ns, layers),
        ("post_step_sync", profile.post_step_sync_ns, 1),
    )
    for name, total_ns, calls in phases:
        span = tracer.start_span(
            name, context=ctx, start_time=start_ns, attributes={**attrs, "kvfleet.phase.calls": calls}
        )
        span.end(end_time=start_ns + total_ns)
    step.end(end_time=start_ns + profile.step_ns)

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

from kvfleet_common.finished_spans import FinishedSpans
from worker_svc.engine import StepProfile

# Five spans a step, each known only once the step is done: written born finished (the cheap path).
_SPANS = FinishedSpans("kvfleet.worker")


def emit_step_spans(
    parent: Context, start_ns: int, profile: StepProfile, layers: int, attrs: dict[str, str | int]
) -> None:
    """start_ns: wall-clock (epoch) ns when the step began."""
    up = trace.get_current_span(parent).get_span_context()
    step = _SPANS.child(up, "worker_step", attrs, (), start_ns, start_ns + profile.step_ns)
    phases = (
        ("kv_view_prepare", profile.kv_view_prepare_ns, layers),
        ("attention", profile.attention_ns, layers),
        ("kv_write", profile.kv_write_ns, layers),
        ("post_step_sync", profile.post_step_sync_ns, 1),
    )
    for name, total_ns, calls in phases:
        _SPANS.child(step, name, {**attrs, "kvfleet.phase.calls": calls}, (), start_ns, start_ns + total_ns)

"""The scheduler's OpenTelemetry spans.

A session's root span follows the GenAI conventions: named `{operation} {model}` (`text_completion
tiny`, `chat smollm2-135m`), with the stable attribute `kvfleet.span=session` for code that looks
session spans up without knowing the model, and `kvfleet.request.id` when the caller sent a
request_id. `queue` covers its wait for admission. A
workload's root span `generation_wall` covers its whole generation and parents its
sessions. A `tick` span covers one tick's dispatch; its W3C context travels to the workers in
gRPC metadata, so their `worker_step` spans join the trace. A tick that serves one trace (one
workload, or one lone session) is a child of that trace's root; a tick shared by several is a
root of its own, linked to each of them.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode

from kvfleet_common.finished_spans import FinishedSpans
from scheduler_svc.core.plan import TickPlan
from scheduler_svc.core.types import Sampling, SessionRequest
from scheduler_svc.experiments import ExperimentArm
from scheduler_svc.observers import SessionObserver
from scheduler_svc.output import Usage

log = logging.getLogger(__name__)

PROVIDER = "kvfleet"  # gen_ai.provider.name
SESSION_SPAN = "session"  # the value of kvfleet.span on a session's root span
REQUEST_ID = "kvfleet.request.id"  # the caller's GenerateRequest.request_id, on the session span


@dataclass
class _SessionSpans:
    root: Span
    queue: Span | None


class SchedulerSpans(SessionObserver):
    def __init__(self, model_name: str, provider: trace.TracerProvider | None = None, step_spans: bool = True) -> None:
        """provider: where the spans go (None: the global tracer provider); step_spans: whether
        each session gets a span for each tick it took part in (SchedulerConfig.step_spans)."""
        self._step_spans = step_spans
        self._tracer = trace.get_tracer("kvfleet.scheduler", tracer_provider=provider)
        self._steps = FinishedSpans("kvfleet.scheduler", provider)  # tens a tick: the cheap path
        self._model = model_name
        self._sessions: dict[str, _SessionSpans] = {}
        self._workloads: dict[str, Span] = {}
        self._session_workload: dict[str, str] = {}
        self._server: dict[str, str | int] = {}
        # What a tick's answers leave to write (its sessions' step spans, its own end), written by
        # write_pending once the next tick's steps are out: off the path from one tick's answers
        # to the next tick's steps, where at c=64 they were about a tenth of the scheduler's CPU.
        self._pending: deque[Callable[[], None]] = deque()

    def serving_at(self, host: str, port: int) -> None:
        """The scheduler's listening address, for server.address / server.port (a wildcard bind
        names the machine instead)."""
        address = socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
        self._server = {"server.address": address, "server.port": port}

    # ---- roots ------------------------------------------------------------------------------

    def start_workload(self, workload_id: str, sessions: int, arm: ExperimentArm | None) -> None:
        attrs: dict[str, str | int] = {"kvfleet.workload.id": workload_id, "kvfleet.workload.sessions": sessions}
        if arm is not None:
            attrs.update(arm.attributes())
        self._workloads[workload_id] = self._tracer.start_span(
            "generation_wall", kind=SpanKind.SERVER, attributes=attrs
        )

    def end_workload(self, workload_id: str) -> None:
        span = self._workloads.pop(workload_id, None)
        if span is not None:
            span.end()

    def start_session(
        self,
        session_id: str,
        operation: str,
        max_tokens: int,
        sampling: Sampling,
        workload_id: str | None = None,
        parent: Context | None = None,
        arm: ExperimentArm | None = None,
    ) -> None:
        attrs: dict[str, str | int | float] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self._model,
            "gen_ai.request.max_tokens": max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            **self._server,
            "kvfleet.span": SESSION_SPAN,
            "kvfleet.session.id": session_id,
        }
        if sampling.top_k:  # 0 = off: no attribute rather than a value that means "none"
            attrs["gen_ai.request.top_k"] = float(sampling.top_k)  # a double in the conventions
        if sampling.top_p < 1.0:
            attrs["gen_ai.request.top_p"] = sampling.top_p
        if workload_id is not None:
            self._session_workload[session_id] = workload_id
            parent = trace.set_span_in_context(self._workloads[workload_id])
        if arm is not None:
            attrs.update(arm.attributes())
        root = self._tracer.start_span(
            f"{operation} {self._model}", context=parent, kind=SpanKind.SERVER, attributes=attrs
        )
        queue = self._tracer.start_span(
            "queue",
            context=trace.set_span_in_context(root),
            attributes={k: v for k, v in attrs.items() if k.startswith("experiment.")},
        )
        self._sessions[session_id] = _SessionSpans(root, queue)

    def set_request_id(self, session_id: str, request_id: str) -> None:
        """Tag a session's root span with the caller's request_id (kvfleet.request.id)."""
        spans = self._sessions.get(session_id)
        if spans is not None:
            spans.root.set_attribute(REQUEST_ID, request_id)

    def admitted(self, session_id: str) -> None:
        spans = self._sessions.get(session_id)
        if spans is not None and spans.queue is not None:
            spans.queue.end()
            spans.queue = None

    def finished(self, session_id: str, reason: str, input_tokens: int, output_tokens: int) -> None:
        spans = self._sessions.pop(session_id, None)
        self._session_workload.pop(session_id, None)
        if spans is None:
            return
        if spans.queue is not None:
            spans.queue.end()
        spans.root.set_attributes(
            {
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": [reason],
            }
        )
        spans.root.end()

    def failed(self, session_id: str, message: str) -> None:
        spans = self._sessions.get(session_id)
        if spans is not None:
            spans.root.set_status(Status(StatusCode.ERROR, message))

    # ---- the runtime's events (SessionObserver) ------------------------------------------------

    def workload_started(self, workload_id: str, sessions: int, arm: ExperimentArm | None) -> None:
        self.start_workload(workload_id, sessions, arm)

    def workload_ended(self, workload_id: str) -> None:
        self.end_workload(workload_id)

    def session_arrived(
        self,
        session_id: str,
        request: SessionRequest,
        operation: str,
        workload_id: str | None,
        parent: Context | None,
        arm: ExperimentArm | None,
    ) -> None:
        self.start_session(
            session_id,
            operation,
            request.max_new_tokens,
            request.sampling,
            workload_id=workload_id,
            parent=parent,
            arm=arm,
        )

    def session_admitted(self, session_id: str) -> None:
        self.admitted(session_id)

    def session_ended(self, session_id: str, reason: str, usage: Usage) -> None:
        self.finished(session_id, reason, usage.input_tokens, usage.output_tokens)

    def session_failed(self, session_id: str, why: str) -> None:
        self.failed(session_id, why)

    # ---- ticks --------------------------------------------------------------------------------

    def _root_of(self, session_id: str) -> Span | None:
        wid = self._session_workload.get(session_id)
        if wid is not None and wid in self._workloads:
            return self._workloads[wid]
        spans = self._sessions.get(session_id)
        return spans.root if spans is not None else None

    def start_tick(
        self, tick: int, session_ids: list[str], prefill_tokens: int, decode_batch: int, arm: ExperimentArm | None
    ) -> Span:
        roots = {id(r): r for r in (self._root_of(s) for s in session_ids) if r is not None}
        attrs: dict[str, int | str] = {
            "kvfleet.tick": tick,
            "kvfleet.tick.prefill_tokens": prefill_tokens,
            "kvfleet.tick.decode_batch": decode_batch,
        }
        if arm is not None:
            attrs.update(arm.attributes())
        if len(roots) == 1:
            parent = trace.set_span_in_context(next(iter(roots.values())))
            return self._tracer.start_span("tick", context=parent, attributes=attrs)
        links = [Link(r.get_span_context()) for r in roots.values()]
        return self._tracer.start_span("tick", context=Context(), links=links, attributes=attrs)

    def session_steps(self, tick: Span, plan: TickPlan, start_ns: int, end_ns: int) -> None:
        """Each session's part of a tick, in the session's own trace: a `step_prefill` (a prompt
        chunk) or `step_decode` child of its session span, over the tick's dispatch, linked to
        the tick span (which, for a tick of several sessions, is a trace of its own). Written by
        write_pending; the sessions' span contexts are taken now, while each still has its spans."""
        if not self._step_spans:
            return
        items = list(self._step_items(plan))
        link = (Link(tick.get_span_context()),)
        self._pending.append(lambda: self._steps.children(items, link, start_ns, end_ns))

    def end_tick(self, tick: Span) -> None:
        """The tick span ends now; it is written (handed to the exporter) by write_pending."""
        end_ns = time.time_ns()
        self._pending.append(lambda: tick.end(end_time=end_ns))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def write_pending(self) -> None:
        """Write what session_steps and end_tick left, in the order they were called. A write
        that fails is logged and skipped: spans never hold up the tokens delivered after them."""
        while self._pending:
            try:
                self._pending.popleft()()
            except Exception:
                log.exception("writing a tick's spans failed; they are lost")

    def _step_items(self, plan: TickPlan) -> Iterator[tuple[SpanContext, str, dict[str, int | str]]]:
        tick = plan.tick
        for work in plan.prefill:
            spans = self._sessions.get(work.session_id)
            if spans is not None:
                attrs: dict[str, int | str] = {
                    "kvfleet.tick": tick,
                    "kvfleet.worker.id": work.worker_id,
                    "kvfleet.step.tokens": len(work.token_ids),
                    "kvfleet.step.start_position": work.start_position,
                }
                yield spans.root.get_span_context(), "step_prefill", attrs
        for d in plan.decode:
            spans = self._sessions.get(d.session_id)
            if spans is not None:
                attrs = {"kvfleet.tick": tick, "kvfleet.worker.id": d.worker_id, "kvfleet.step.position": d.position}
                yield spans.root.get_span_context(), "step_decode", attrs

"""What the runtime tells those who watch its sessions and ticks (spans, metrics): one
interface, each event reported once, where it happens. Every method is a no-op here, so an
observer overrides what it records and the runtime never calls spans and metrics apart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.context import Context

from scheduler_svc.core import SessionRequest
from scheduler_svc.experiments import ExperimentArm
from scheduler_svc.output import Usage


class SessionObserver:
    # ---- workloads and sessions -----------------------------------------------------------
    def workload_started(self, workload_id: str, sessions: int, arm: ExperimentArm | None) -> None:
        pass

    def workload_ended(self, workload_id: str) -> None:
        pass

    def session_arrived(
        self,
        session_id: str,
        request: SessionRequest,
        operation: str,
        workload_id: str | None,
        parent: Context | None,
        arm: ExperimentArm | None,
    ) -> None:
        pass

    def session_admitted(self, session_id: str) -> None:
        """Its first prefill chunk goes to a worker (once: a recompute is not an admission)."""

    def session_token(self, session_id: str) -> None:
        pass

    def session_tokens(self, session_ids: Sequence[str]) -> None:
        """One token each for these sessions, delivered together (a tick's); an observer may
        take them at once (one clock read), or one by one as here."""
        for sid in session_ids:
            self.session_token(sid)

    def session_ended(self, session_id: str, reason: str, usage: Usage) -> None:
        """Finished (reason: a finish reason) or given up on (reason: the drop's cause)."""

    def session_failed(self, session_id: str, why: str) -> None:
        """Given up on unfinished (before its session_ended)."""

    def stream_cut_off(self) -> None:
        pass

    def rejections_changed(self, by_reason: Mapping[str, int]) -> None:
        pass

    # ---- ticks and workers -----------------------------------------------------------------
    def tick_answered(self, prefill_tokens: int, decode_tokens: int) -> None:
        """One tick's steps came back with these tokens processed."""

    def outcomes_delivered(self, prefill_tokens: int, decode_tokens: int) -> None:
        """The pending outcomes reached the streams, with these tokens processed."""

    def worker_failed(self, worker_id: str) -> None:
        """A step got no answer: the worker was marked dead."""

    def step_failed(self, worker_id: str) -> None:
        """A worker answered that a whole step failed; the worker is kept."""

    def item_errors(self, worker_id: str, count: int) -> None:
        """Items of a step the worker rejected or failed alone."""


class Observers(SessionObserver):
    """Several observers as one, each told every event in order."""

    def __init__(self, members: Sequence[SessionObserver]) -> None:
        self.members = tuple(members)

    def workload_started(self, workload_id: str, sessions: int, arm: ExperimentArm | None) -> None:
        for m in self.members:
            m.workload_started(workload_id, sessions, arm)

    def workload_ended(self, workload_id: str) -> None:
        for m in self.members:
            m.workload_ended(workload_id)

    def session_arrived(
        self,
        session_id: str,
        request: SessionRequest,
        operation: str,
        workload_id: str | None,
        parent: Context | None,
        arm: ExperimentArm | None,
    ) -> None:
        for m in self.members:
            m.session_arrived(session_id, request, operation, workload_id, parent, arm)

    def session_admitted(self, session_id: str) -> None:
        for m in self.members:
            m.session_admitted(session_id)

    def session_token(self, session_id: str) -> None:
        for m in self.members:
            m.session_token(session_id)

    def session_tokens(self, session_ids: Sequence[str]) -> None:
        for m in self.members:
            m.session_tokens(session_ids)

    def session_ended(self, session_id: str, reason: str, usage: Usage) -> None:
        for m in self.members:
            m.session_ended(session_id, reason, usage)

    def session_failed(self, session_id: str, why: str) -> None:
        for m in self.members:
            m.session_failed(session_id, why)

    def stream_cut_off(self) -> None:
        for m in self.members:
            m.stream_cut_off()

    def rejections_changed(self, by_reason: Mapping[str, int]) -> None:
        for m in self.members:
            m.rejections_changed(by_reason)

    def tick_answered(self, prefill_tokens: int, decode_tokens: int) -> None:
        for m in self.members:
            m.tick_answered(prefill_tokens, decode_tokens)

    def outcomes_delivered(self, prefill_tokens: int, decode_tokens: int) -> None:
        for m in self.members:
            m.outcomes_delivered(prefill_tokens, decode_tokens)

    def worker_failed(self, worker_id: str) -> None:
        for m in self.members:
            m.worker_failed(worker_id)

    def step_failed(self, worker_id: str) -> None:
        for m in self.members:
            m.step_failed(worker_id)

    def item_errors(self, worker_id: str, count: int) -> None:
        for m in self.members:
            m.item_errors(worker_id, count)

"""The runtime's outbox: events still queued for a session whose stream has ended are delivered,
never dropped, and never break a tick (the soak's lost token and hung stream)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from scheduler_svc.core import SchedulerCore, SessionRequest, StepResult
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, PrefillWork
from scheduler_svc.core.types import StepStatus, WorkerSpec
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.observers import SessionObserver
from scheduler_svc.output import Usage
from scheduler_svc.runtime import SchedulerRuntime
from scheduler_svc.spans import SchedulerSpans


class _Worker:
    """A worker of one layer's test: every sampled item gets token 7."""

    worker_id = "w0"
    step_ns = 0  # (WorkerClient.step_ns: no step timed)

    async def step(
        self, prefill: Sequence[PrefillWork], decode: Sequence[DecodeWork], release, arm, span, timeout
    ) -> Mapping[str, StepResult]:
        out = {}
        for p in prefill:
            kv = p.start_position + len(p.token_ids)
            out[p.session_id] = StepResult(p.session_id, StepStatus.OK, 7 if p.last_chunk else None, kv)
        for d in decode:
            out[d.session_id] = StepResult(d.session_id, StepStatus.OK, 7, d.position + 1)
        return out

    async def close(self) -> None:
        return None


def test_events_of_a_session_finished_as_its_stream_ended_are_delivered_not_lost():
    async def scenario() -> None:
        core = SchedulerCore(SchedulerLimits())
        core.add_worker(WorkerSpec("w0", capacity_tokens=4096, block_size=16, kv_bytes_per_token=64), 48, 2048)
        rt = SchedulerRuntime(core, [_Worker()], SchedulerSpans("tiny"), SchedulerMetrics("tiny", 2048))  # type: ignore[list-item]
        sub = rt.submit([SessionRequest(prompt_ids=(1, 2, 3), max_new_tokens=2)], ["text_completion"])
        sid = sub.session_ids[0]
        # Tick by tick as the loop does, stopping where the race bit: the session has finished in
        # the core, its last token and finish still queued in the outbox.
        for _ in range(2):
            plan = core.schedule()
            rt._emit(await rt._run_tick(plan))
        assert rt._outbox, "the final tick's events wait for delivery"
        rt.end_stream(sub)  # the client went away (it cancelled after its first token)
        rt._deliver()  # the next tick's delivery: nothing left that names a forgotten session
        events = []
        while not sub.events.empty():
            events.append(sub.events.get_nowait())
        assert [e.token for e in events if e.token is not None] == [7, 7]
        assert [e.finish.value for e in events if e.finish is not None] == ["length"]
        assert all(e.session_id == sid for e in events)
        assert core.snapshot().active_sessions == 0

    asyncio.run(scenario())


class _Recorder(SessionObserver):
    """An observer that keeps what it is told, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def session_arrived(self, session_id, request, operation, workload_id, parent, arm) -> None:  # type: ignore[no-untyped-def]
        self.seen.append(("arrived", session_id, operation))

    def session_admitted(self, session_id: str) -> None:
        self.seen.append(("admitted", session_id))

    def session_token(self, session_id: str) -> None:
        self.seen.append(("token", session_id))

    def session_ended(self, session_id: str, reason: str, usage: Usage) -> None:
        self.seen.append(("ended", session_id, reason, usage))

    def tick_answered(self, prefill_tokens: int, decode_tokens: int) -> None:
        self.seen.append(("tick", prefill_tokens, decode_tokens))


def test_observers_hear_each_event_once_in_order_with_the_usage_at_the_end():
    async def scenario() -> None:
        core = SchedulerCore(SchedulerLimits())
        core.add_worker(WorkerSpec("w0", capacity_tokens=4096, block_size=16, kv_bytes_per_token=64), 48, 2048)
        recorder = _Recorder()
        rt = SchedulerRuntime(
            core,
            [_Worker()],  # type: ignore[list-item]
            SchedulerSpans("tiny"),
            SchedulerMetrics("tiny", 2048),
            observers=[recorder],
        )
        sub = rt.submit([SessionRequest(prompt_ids=(1, 2, 3), max_new_tokens=2)], ["text_completion"])
        sid = sub.session_ids[0]
        for _ in range(2):
            plan = core.schedule()
            rt._emit(await rt._run_tick(plan), sum(len(w.token_ids) for w in plan.prefill), len(plan.decode))
        rt._deliver()
        assert recorder.seen == [
            ("arrived", sid, "text_completion"),
            ("admitted", sid),
            ("tick", 3, 0),
            ("token", sid),
            ("tick", 0, 1),
            ("token", sid),
            ("ended", sid, "length", Usage(input_tokens=3, output_tokens=2, cached_tokens=0)),
        ]

    asyncio.run(scenario())

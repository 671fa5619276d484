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
from scheduler_svc.runtime import SchedulerRuntime
from scheduler_svc.spans import SchedulerSpans


class _Worker:
    """A worker of one layer's test: every sampled item gets token 7."""

    worker_id = "w0"

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

    async def release(self, session_ids, timeout) -> None:
        return None

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

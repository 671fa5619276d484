"""The one owner of the scheduler core: it runs the linear tick (schedule -> dispatch: one Step
RPC per worker, through the fleet (fleet.py) -> update -> publish), feeds the streams (through
the output processor: text, stop strings, logprob text, usage), spans and metrics, and serves
the servicer's calls.

Every effect on a session (tokens, finishes, drops) leaves the core as a TickOutcome and enters
one FIFO, the outbox; `_deliver` drains it into the streams and metrics. The tick loop calls it
once per tick, after the next tick's steps have gone out (so the workers compute meanwhile), and
out-of-band calls (cancel, finish) call it at once; the FIFO keeps every stream's events in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.trace import Span

from scheduler_svc.core import (
    FinishReason,
    NotSessionOwner,
    SchedulerCore,
    SessionRequest,
    TickOutcome,
    TickPlan,
    WorkerSpec,
    WorkloadPolicy,
)
from scheduler_svc.core.served_model import ServedModel
from scheduler_svc.core.session import Phase
from scheduler_svc.core.stats import TelemetrySnapshot, WorkloadStats
from scheduler_svc.core.types import RejectReason
from scheduler_svc.experiments import ExperimentArm, ExperimentArms
from scheduler_svc.fleet import Answers, WorkerFleet
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.observers import Observers, SessionObserver
from scheduler_svc.output import OutputProcessor, Usage
from scheduler_svc.prompts import NoText
from scheduler_svc.spans import SchedulerSpans
from scheduler_svc.streams import SessionEvent, Submission
from scheduler_svc.workers import WorkerClient, WorkerView

if TYPE_CHECKING:
    from kvfleet.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

# When sessions wait but nothing can run (no live worker), re-plan this often.
_IDLE_REPLAN_S = 0.05


@dataclass(frozen=True)
class RuntimeConfig:
    step_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    no_worker_wait_s: float = 30.0
    stats_interval_s: float = 10.0  # how often live workers' memory (GetStats) is read
    # Plan and send tick N+1 while tick N computes (see _run_overlapped); off: one tick at a time.
    # The service sets it from SchedulerConfig.overlap_scheduling (on by default).
    overlap: bool = False


class SchedulerRuntime:
    def __init__(
        self,
        core: SchedulerCore,
        clients: Sequence[WorkerClient],
        spans: SchedulerSpans,
        metrics: SchedulerMetrics,
        config: RuntimeConfig = RuntimeConfig(),
        output: OutputProcessor | None = None,
        observers: Sequence[SessionObserver] = (),
        served_model: ServedModel | None = None,
    ) -> None:
        """served_model: the model the workers agreed on at startup, which a worker coming back
        must serve to be used again (None, in tests of the loop alone: not compared)."""
        self._core = core
        # Without one (tests of the loop alone): no text, as for a model without a tokenizer.
        self._output = output if output is not None else OutputProcessor(lambda request: NoText(), lambda token: "")
        self._spans = spans  # also for each tick's span, the trace context its steps carry
        self._metrics = metrics
        # Every session and tick event goes to both through one interface.
        self._observe = Observers([spans, metrics, *observers])
        self._fleet = WorkerFleet(clients, core, self._observe, config.step_timeout_s, served_model)
        self._config = config
        self._arms = ExperimentArms()
        self._subscribers: dict[str, asyncio.Queue[SessionEvent]] = {}
        self._outbox: deque[tuple[TickOutcome, int, int]] = deque()  # (outcome, prefill, decode tokens)
        self._wake = asyncio.Event()
        self._tick_done = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._no_worker_since: float | None = None
        # Sessions whose stream ended before they finished: forgotten when their finish is delivered.
        self._orphans: set[str] = set()
        # The n sessions of one Generate call, by each of their ids: cancelling one cancels all.
        self._choices: dict[str, tuple[str, ...]] = {}

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._run(), name="tick-loop"),
            asyncio.create_task(
                self._fleet.watch(
                    self._worker_back,
                    self._worker_lost,
                    self._config.health_interval_s,
                    self._config.stats_interval_s,
                    lambda: self._stopping,
                ),
                name="worker-probe",
            ),
        ]

    async def drain(self, grace_s: float) -> None:
        end = time.monotonic() + grace_s
        while self._core.has_work() and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._spans.write_pending()  # the last ticks' spans are not lost
        await self._fleet.close()

    @property
    def metrics(self) -> SchedulerMetrics:
        return self._metrics

    @property
    def output(self) -> OutputProcessor:
        return self._output

    # ---- the servicer's calls --------------------------------------------------------------

    def generate(
        self, request: SessionRequest, n: int, operation: str, parent: Context | None = None, request_id: str = ""
    ) -> tuple[Submission, tuple[SessionRequest, ...]]:
        """Admit the n choices of one Generate call (all or none; see SessionRequest.choices);
        returns them with their requests. Cancelling one cancels all. Raises AdmissionRejected."""
        choices = request.choices(n, secrets.token_hex(8))
        k = len(choices)
        sub = self.submit(choices, [operation] * k, parent=parent, request_ids=[request_id] * k)
        log.debug(
            "session %s: %d prompt tokens, up to %d new%s",
            ", ".join(sub.session_ids),
            len(request.prompt_ids),
            request.max_new_tokens,
            f", {n} choices" if n > 1 else "",
            # (The servicer binds the session to its call's log lines only once this returns.)
            extra={"session_id": sub.session_ids[0], **({"request_id": request_id} if request_id else {})},
        )
        return sub, choices

    def submit(
        self,
        requests: Sequence[SessionRequest],
        operations: Sequence[str],
        policy: WorkloadPolicy | None = None,
        arm: ExperimentArm | None = None,
        parent: Context | None = None,
        request_ids: Sequence[str] = (),
    ) -> Submission:
        """Admit the sessions of one call (policy None: one, or the n choices of a Generate) or a
        workload; all or none. `request_ids`: the caller's, by session, for their spans ("" for
        none). Raises AdmissionRejected."""
        if policy is None:
            workload_id, ids = None, self._core.submit_group(requests)
        else:
            workload_id, ids = self._core.submit_workload(requests, policy)
            self._arms.start(workload_id, arm)
            self._observe.workload_started(workload_id, len(ids), arm)
        if policy is None and len(ids) > 1:
            for sid in ids:
                self._choices[sid] = tuple(ids)
        for sid, req, op in zip(ids, requests, operations):
            self._output.open(sid, req)
            self._observe.session_arrived(sid, req, op, workload_id, parent, arm)
            log.debug(
                "session %s queued (%s)",
                sid,
                f"workload {workload_id}" if workload_id else "alone",
                extra={"session_id": sid},
            )
        for sid, rid in zip(ids, request_ids):
            if rid:
                self._spans.set_request_id(sid, rid)
        # Bounded: a client that stops reading is cut off (see _publish), not buffered for ever.
        events: asyncio.Queue[SessionEvent] = asyncio.Queue(self._core.limits.max_stream_backlog * len(ids))
        for sid in ids:
            self._subscribers[sid] = events
        self._wake.set()
        return Submission(workload_id, tuple(ids), events)

    def end_stream(self, submission: Submission) -> None:
        """The client's stream is over: cancel what is unfinished and forget the sessions."""
        # A session may have finished in the core with its last events still in the outbox (the
        # client cancelled as its final token was decoded): deliver them first, so that nothing
        # queued names a session that is about to be forgotten.
        self._deliver()
        for sid in submission.session_ids:
            if not self._finished(sid):
                self.cancel(sid)  # the client went away: free its slot or KV
                self._orphans.add(sid)  # forgotten once its cancel settles (_forget_orphan)
            self._subscribers.pop(sid, None)
            self._choices.pop(sid, None)
            self._output.close(sid)
            self._core.forget_session(sid)
        if submission.workload_id is not None:
            self._observe.workload_ended(submission.workload_id)
            self._arms.end(submission.workload_id)

    def _finished(self, session_id: str) -> bool:
        try:
            return self._core.session(session_id).phase == Phase.FINISHED
        except KeyError:
            return True

    def cancel(self, session_id: str, caller: str | None = None) -> str:
        """Cancel a session (by its owner when `caller` is given), and the other choices of its
        Generate call; returns the state it was in."""
        state, out = self._core.cancel(session_id, caller)
        log.debug("session %s cancelled while %s", session_id, state, extra={"session_id": session_id})
        self._emit(out)
        for other in self._choices.get(session_id, ()):
            if other != session_id:
                with contextlib.suppress(KeyError, NotSessionOwner):
                    self._emit(self._core.cancel(other, caller)[1])
        self._deliver()
        self._wake.set()
        return state

    def record_rejection(self, reason: RejectReason) -> None:
        self._core.record_rejection(reason)
        self._observe.rejections_changed(self._core.rejections)

    def rejections_changed(self) -> None:
        self._observe.rejections_changed(self._core.rejections)

    def snapshot(self) -> TelemetrySnapshot:
        return self._core.snapshot()

    def has_workload(self, workload_id: str) -> bool:
        return self._core.has_workload(workload_id)

    def workload_stats(self, workload_id: str) -> WorkloadStats | None:
        return self._core.workload_stats(workload_id)

    async def telemetry(self, workload_id: str, at_tick: int, timeout: float | None) -> TelemetrySnapshot:
        """The live snapshot, or with both a workload and a tick the one that workload captured at
        that tick (waiting for it up to `timeout`). KeyError: no such workload; LookupError: it
        captured none (it was not asked to); ValueError: only one of the two was given."""
        if not at_tick and not workload_id:
            return self._core.snapshot()
        if not (at_tick and workload_id):
            raise ValueError("workload_id and at_tick go together; send both or neither")
        if not self._core.has_workload(workload_id):
            raise KeyError(f"no workload {workload_id!r}")
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            snap = self._core.workload_snapshot(workload_id)
            if snap is not None:
                return snap
            if self._core.workload_stats(workload_id) is not None:  # it ended without capturing one
                raise LookupError(
                    f"workload {workload_id} captured no snapshot at tick {at_tick}; "
                    f"submit it with snapshot_at_tick={at_tick}"
                )
            wait = None if end is None else max(end - time.monotonic(), 0.0)
            self._tick_done.clear()
            await asyncio.wait_for(self._tick_done.wait(), wait)

    def workers(self) -> list[WorkerView]:
        return self._fleet.views()

    def worker_info(self) -> wpb.WorkerInfo | None:
        """The GetInfo answer of the served model's worker (see WorkerFleet.model_info)."""
        return self._fleet.model_info()

    @property
    def overlapped(self) -> bool:
        """Whether ticks are planned while the one before computes (their counts then differ)."""
        return self._config.overlap

    def served_context(self) -> int | None:
        """The longest sequence every worker serves, which admission holds sessions to (workers'
        --max-model-len may differ; one that came back with a shorter one lowers it)."""
        return self._core.max_position

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        if self._config.overlap:
            await self._run_overlapped()
            return
        while not self._stopping:
            if not self._core.has_work():
                await self._idle(None)
                continue
            plan = self._core.schedule()
            self._emit(_settled(plan))
            if plan.empty:
                self._drop_if_no_worker_for_too_long()
                await self._idle(_IDLE_REPLAN_S)
                continue
            self._no_worker_since = None
            try:
                out = await self._run_tick(plan)
            except Exception:  # a bug, not a worker fault: log it and keep serving
                log.exception("tick %d failed", plan.tick)
                await asyncio.sleep(_IDLE_REPLAN_S)
                continue
            self._emit(out, sum(len(w.token_ids) for w in plan.prefill), len(plan.decode))
            self._tick_done.set()

    async def _run_overlapped(self) -> None:
        """Overlapped scheduling: tick N+1 is planned from the state tick N is expected to leave
        and its steps sent before N answers, so a worker finds its next step waiting when it
        finishes one (each worker runs them in the order sent). A decode planned so carries no
        token: the worker uses the one it sampled last. Once N+1 is out, N-1's events are
        delivered (in the workers' shadow), then N's answers are awaited and applied.

        A session that tick N ends (EOS, a stop token, an item error) had one more item in N+1:
        its result is stale and discarded (the session's epoch moved on), and its KV is freed
        with tick N+2's steps, which run after N+1 on that worker. A stop string is found when
        N's events are delivered, after N+2 went out: both extra tokens are not taken."""
        out_now: _Flight | None = None
        try:
            while not self._stopping:
                if out_now is None and not self._core.has_work():
                    await self._idle(None)
                    continue
                sent = None
                try:
                    plan = self._core.schedule()
                    self._emit(_settled(plan))
                    if not plan.empty:
                        sent = self._launch(plan)
                        self._no_worker_since = None
                        await asyncio.sleep(0)  # let its steps go out: the rest is in their shadow
                except Exception:  # a bug, not a worker fault: log it and keep serving
                    log.exception("planning a tick failed")
                    await asyncio.sleep(_IDLE_REPLAN_S)
                try:
                    self._deliver()
                except Exception:  # a bug: log it, but the ticks out must still be applied
                    log.exception("delivering the events of tick %d failed", self._core.tick)
                if out_now is not None:
                    await self._land(out_now)
                elif sent is None:
                    self._drop_if_no_worker_for_too_long()
                    await self._idle(_IDLE_REPLAN_S)
                out_now = sent
        finally:
            if out_now is not None:  # stopping: its answers are not wanted
                out_now.calls.cancel()

    def _start_tick(self, plan: TickPlan) -> tuple[Span, int]:
        """A tick about to be sent: its admissions observed, its span started; (span, start ns)."""
        for work in plan.prefill:
            if work.start_position == 0:
                self._observe.session_admitted(work.session_id)
        sessions = [w.session_id for w in plan.prefill + plan.decode]
        span = self._spans.start_tick(
            plan.tick, sessions, sum(len(w.token_ids) for w in plan.prefill), len(plan.decode), self._arm_of(sessions)
        )
        return span, time.time_ns()

    def _launch(self, plan: TickPlan) -> _Flight:
        """Send a tick's steps now; its results are taken by _land."""
        span, start_ns = self._start_tick(plan)
        ids, gathered = self._fleet.send(plan, span, self._arm_of)
        return _Flight(plan, span, start_ns, ids, gathered)

    async def _land(self, flight: _Flight) -> None:
        """A sent tick's answers, applied to the core; its events are delivered once the next
        tick's steps are out."""
        plan = flight.plan
        try:
            results, failed, failed_steps = self._fleet.answers(plan, flight.workers, await flight.calls)
            self._core.steps_timed(self._fleet.step_times(flight.workers))
            self._spans.session_steps(flight.span, plan, flight.start_ns, time.time_ns())
            out = self._core.update(plan, results, failed, failed_steps)
        except Exception:  # a bug, not a worker fault: log it and keep serving
            log.exception("tick %d failed", plan.tick)
            await asyncio.sleep(_IDLE_REPLAN_S)
            return
        finally:
            self._spans.end_tick(flight.span)
        self._emit(out, sum(len(w.token_ids) for w in plan.prefill), len(plan.decode))
        self._tick_done.set()

    async def _idle(self, timeout: float | None) -> None:
        """Nothing to step: deliver what is pending, free what waits to be freed, then wait for
        new work (or `timeout`)."""
        self._deliver()
        await self._flush_releases()
        self._wake.clear()
        if timeout is None and self._core.has_work():
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _run_tick(self, plan: TickPlan) -> TickOutcome:
        span, start_ns = self._start_tick(plan)
        try:
            results, failed, failed_steps = await self._dispatch(plan, span)
            self._spans.session_steps(span, plan, start_ns, time.time_ns())
            return self._core.update(plan, results, failed, failed_steps)
        finally:
            self._spans.end_tick(span)

    def _arm_of(self, session_ids: Iterable[str]) -> ExperimentArm | None:
        if not self._arms:  # no experiment running (twice a tick, over every session otherwise)
            return None
        return self._arms.shared(self._core.session(s).workload_id for s in session_ids)

    async def _dispatch(self, plan: TickPlan, span: Span) -> Answers:
        """Send each worker its step; returns the items' results, the workers that did not answer
        (marked dead by update) and, by worker, why a step failed on a worker that did answer.
        The outbox is delivered while the workers compute."""
        ids, gathered = self._fleet.send(plan, span, self._arm_of)
        if self._outbox or self._spans.pending:
            await asyncio.sleep(0)  # let the steps go out first: the workers compute meanwhile
            try:
                self._deliver()
            except Exception:  # a bug: log it, but this tick's steps are out and must be applied
                log.exception("delivering tick %d's events failed", plan.tick - 1)
        answers = self._fleet.answers(plan, ids, await gathered)
        self._core.steps_timed(self._fleet.step_times(ids))
        return answers

    # ---- the outbox ---------------------------------------------------------------------------

    def _emit(self, out: TickOutcome, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        """Queue an outcome's events for delivery; its releases ride on the next steps."""
        self._fleet.forget_later(out.release)
        if out.tokens or out.finished or out.dropped or prefill_tokens or decode_tokens:
            self._outbox.append((out, prefill_tokens, decode_tokens))

    def _deliver(self) -> None:
        """Write the answered ticks' spans, then send every pending outcome's events to the
        streams, in order, and update the metrics."""
        self._spans.write_pending()  # first: a session's last step span before its end
        if not self._outbox:
            return
        prefill = decode = 0
        while self._outbox:
            out, p, d = self._outbox.popleft()
            prefill += p
            decode += d
            if p or d:  # a tick's answers (settled-only outcomes carry no tokens)
                self._observe.tick_answered(p, d)
            if out.tokens:
                self._observe.session_tokens([sid for sid, _ in out.tokens])
            for sid, token in out.tokens:
                produced = self._output.token(sid, token, out.logprobs.get(sid))
                self._publish(
                    SessionEvent(
                        sid,
                        token=token,
                        text=produced.text,
                        logprob=produced.logprob,
                        worker_id=self._core.session(sid).worker_id or "",
                    )
                )
                if produced.stop_hit:
                    # An input to the next schedule(), which finishes the session and frees its KV.
                    self._core.finish(sid, FinishReason.STOP)
                    self._wake.set()
            for sid, reason in out.finished:
                usage = self._ended(sid, reason.value)
                self._publish(SessionEvent(sid, text=self._output.finish(sid), finish=reason, usage=usage))
                self._forget_orphan(sid)
            for sid, why, cause in out.dropped:
                self._observe.session_failed(sid, why)
                self._ended(sid, cause.value)
                self._output.close(sid)
                self._publish(SessionEvent(sid, dropped=why, drop_cause=cause))
                self._forget_orphan(sid)
        self._observe.outcomes_delivered(prefill, decode)

    def _ended(self, session_id: str, reason: str) -> Usage:
        s = self._core.session(session_id)
        # Cached tokens: prompt tokens whose KV came from a worker's prefix cache.
        usage = Usage(s.prompt_len, len(s.generated), min(s.cached_tokens, s.prompt_len))
        self._observe.session_ended(session_id, reason, usage)
        return usage

    def _publish(self, event: SessionEvent) -> None:
        queue = self._subscribers.get(event.session_id)
        if queue is not None:
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self._cut_off(queue)

    def _cut_off(self, queue: asyncio.Queue[SessionEvent]) -> None:
        """A stream's client stopped reading (gRPC flow control holds its writes, so its events
        pile up here): cancel its sessions, so their KV is freed with the next tick, drop what
        waits, and leave one event that ends the stream with RESOURCE_EXHAUSTED."""
        sids = [sid for sid, q in self._subscribers.items() if q is queue]
        for sid in sids:
            del self._subscribers[sid]
            if not self._finished(sid):
                # Not self.cancel(): that delivers now, inside the delivery under way; the
                # outcome joins the outbox this very _deliver is draining.
                self._emit(self._core.cancel(sid)[1])
        while not queue.empty():
            queue.get_nowait()
        waited = queue.maxsize
        log.warning("sessions %s cut off: their client left %d events unread", ", ".join(sids), waited)
        self._observe.stream_cut_off()
        queue.put_nowait(
            SessionEvent(
                sids[0],
                cut_off=f"the client stopped reading its stream: {waited} events waited unread "
                f"(max_stream_backlog is {self._core.limits.max_stream_backlog} per session); the sessions "
                f"were cancelled and their KV freed. Read a stream as it arrives",
            )
        )
        self._wake.set()

    def _forget_orphan(self, session_id: str) -> None:
        if session_id in self._orphans:
            self._orphans.discard(session_id)
            self._core.forget_session(session_id)

    def holds(self, session_id: str) -> bool:
        """Whether the runtime still keeps anything of a session (its request and prompt, a stream)."""
        if session_id in self._subscribers or session_id in self._orphans:
            return True
        try:
            self._core.session(session_id)
        except KeyError:
            return False
        return True

    def _drop_if_no_worker_for_too_long(self) -> None:
        """Sessions wait for a worker to come back, but not for ever: after no_worker_wait_s
        with no live worker, the waiting ones end with UNAVAILABLE."""
        if self._core.workers.live:
            self._no_worker_since = None
            return
        now = time.monotonic()
        if self._no_worker_since is None:
            self._no_worker_since = now
            return
        wait = self._config.no_worker_wait_s
        if now - self._no_worker_since >= wait:
            self._emit(
                self._core.drop_queued(
                    f"no live worker for {wait:.0f}s; the session was dropped unfinished; retry when a worker is up"
                )
            )

    # ---- releases and dead workers -------------------------------------------------------------

    async def _flush_releases(self) -> None:
        await self._fleet.flush_releases()

    def _worker_lost(self, worker_id: str, why: str) -> None:
        """A live worker found dead or restarted between steps: one that holds no session is
        marked dead now (ListWorkers says so, nothing is placed there, and it is taken back as
        any dead worker: reset, its model compared, its bounds read). One that holds sessions is
        left to its next step, whose failure moves them."""
        slot = self._core.workers.get(worker_id)
        if not slot.live or slot.sessions:
            return
        log.warning("worker %s holds no session and %s: marked dead until it answers again", worker_id, why)
        self._emit(self._core.worker_failed(worker_id, why))  # (nothing to move; emitted as any outcome)
        self._observe.worker_failed(worker_id)
        self._wake.set()

    def _worker_back(self, spec: WorkerSpec, vocab_size: int, max_position: int) -> None:
        """A worker marked dead answers again and has forgotten every session: use it again."""
        self._core.worker_recovered(spec, vocab_size, max_position)
        self._wake.set()


@dataclass
class _Flight:
    """A tick whose steps are out (overlapped scheduling)."""

    plan: TickPlan
    span: Span
    start_ns: int
    workers: list[str]  # the workers stepped, in the order of the calls' answers
    calls: asyncio.Future[list[Any]]  # every step and release call of the tick, gathered


def _settled(plan: TickPlan) -> TickOutcome:
    """What schedule() settled while planning (cancellations, preemptions), as an outcome."""
    return TickOutcome(
        tick=plan.tick,
        finished=list(plan.finished),
        requeued=list(plan.requeued),
        release={w: list(s) for w, s in plan.release.items()},
    )

"""Runs the core tick by tick: one batched Step RPC per worker per tick, all workers concurrently."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvfleet.v1 import worker_pb2 as wpb
from scheduler_svc import convert
from scheduler_svc.core import FinishReason, SchedulerCore, StepResult, TickOutcome, TickPlan
from scheduler_svc.core.session import Phase
from scheduler_svc.core.stats import TelemetrySnapshot
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.spans import SchedulerSpans
from scheduler_svc.workers import WorkerClient

log = logging.getLogger(__name__)

# When sessions wait but nothing can run (no live worker), re-plan this often.
_IDLE_REPLAN_S = 0.05


@dataclass(frozen=True)
class SessionEvent:
    session_id: str
    token: int | None = None
    finish: FinishReason | None = None
    worker_id: str = ""
    unavailable: str = ""      # the session was dropped: no live worker for too long (the reason)


class TickLoop:
    def __init__(self, core: SchedulerCore, clients: list[WorkerClient], spans: SchedulerSpans,
                 metrics: SchedulerMetrics, step_timeout_s: float, health_interval_s: float = 1.0,
                 no_worker_wait_s: float = 30.0) -> None:
        self._no_worker_wait_s = no_worker_wait_s
        self._no_worker_since: float | None = None
        self._core = core
        self._spans = spans
        self._metrics = metrics
        self._clients = {c.worker_id: c for c in clients}
        self._step_timeout_s = step_timeout_s
        self._health_interval_s = health_interval_s
        self._subscribers: dict[str, asyncio.Queue[SessionEvent]] = {}
        self._wake = asyncio.Event()
        self._tick_done = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # Sessions moved off a worker that failed; released there if it comes back.
        self._stale: dict[str, set[str]] = {}
        # Sessions to free on each worker: sent with that worker's next step (or a Release
        # alongside the next tick's steps), so freeing costs no round trip of its own.
        self._pending_release: dict[str, list[str]] = {}
        # The last tick's outcome (and its prefill/decode token counts), delivered to the
        # streams while the next tick's steps run (see ``_run``).
        self._post_tick: tuple[TickOutcome, int, int] | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name="tick-loop"),
                       asyncio.create_task(self._probe_dead_workers(), name="worker-probe")]

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
        await asyncio.gather(*(c.close() for c in self._clients.values()), return_exceptions=True)

    # ---- subscriptions (the servicer's side) -----------------------------------------------

    def subscribe(self, session_id: str) -> asyncio.Queue[SessionEvent]:
        return self.subscribe_many([session_id])

    def subscribe_many(self, session_ids: list[str]) -> asyncio.Queue[SessionEvent]:
        queue: asyncio.Queue[SessionEvent] = asyncio.Queue()
        for sid in session_ids:
            self._subscribers[sid] = queue
        self._wake.set()
        return queue

    def unsubscribe(self, session_id: str) -> None:
        self._subscribers.pop(session_id, None)
        self._core.forget_session(session_id)

    def finished(self, session_id: str) -> bool:
        try:
            return self._core.session(session_id).phase == Phase.FINISHED
        except KeyError:
            return True

    def cancel(self, session_id: str) -> str:
        self._flush_post_tick()   # keep each stream's events in order
        state = self._core.cancel(session_id)
        if state == "queued":
            session = self._core.session(session_id)
            self._spans.finished(session_id, FinishReason.CANCELLED.value, session.prompt_len, 0)
            self._metrics.finished_session(session_id, FinishReason.CANCELLED.value)
            self._metrics.tick(self._core.snapshot(), 0, 0)
            self._publish(SessionEvent(session_id, finish=FinishReason.CANCELLED))
        self._wake.set()
        return state

    def finish(self, session_id: str, reason: FinishReason) -> None:
        """End a session now (a stop string); its KV is released with the next step."""
        self._flush_post_tick()   # keep each stream's events in order
        out = self._core.finish(session_id, reason)
        self._deliver(out)
        self._queue_release(out.release)
        self._wake.set()

    async def wait_for_snapshot(self, workload_id: str, timeout: float | None) -> TelemetrySnapshot | None:
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            snap = self._core.workload_snapshot(workload_id)
            if snap is not None or self._core.workload_stats(workload_id) is not None:
                return snap
            wait = None if end is None else max(end - time.monotonic(), 0.0)
            self._tick_done.clear()
            await asyncio.wait_for(self._tick_done.wait(), wait)

    def clients(self) -> list[WorkerClient]:
        return list(self._clients.values())

    def held_tokens(self, worker_id: str) -> int:
        slot = self._core.workers.get(worker_id)
        return sum(self._core.session(s).kv_tokens for s in slot.sessions)

    # ---- the loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            if not self._core.has_work():
                self._flush_post_tick()
                await self._flush_releases()
                self._wake.clear()
                if not self._core.has_work():
                    await self._wake.wait()
                continue
            plan, early = self._core.plan_tick()
            if early.tokens or early.finished:
                self._flush_post_tick()   # the last tick's events go out before these
                self._deliver(early)
                if early.finished:
                    self._metrics.tick(self._core.snapshot(), 0, 0)
            self._queue_release(early.release)
            if plan.empty:
                self._flush_post_tick()
                await self._flush_releases()
                self._drop_if_no_worker_for_too_long()
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), _IDLE_REPLAN_S)
                except asyncio.TimeoutError:
                    pass
                continue
            self._no_worker_since = None
            for work in plan.prefill:
                if work.start_position == 0:
                    self._spans.admitted(work.session_id)
            tick_span = self._spans.start_tick(
                plan.tick, [w.session_id for w in plan.prefill + plan.decode],
                sum(len(w.token_ids) for w in plan.prefill), len(plan.decode))
            try:
                results, failed = await self._dispatch(plan, tick_span)
                for worker_id in failed:
                    self._stale.setdefault(worker_id, set()).update(self._core.workers.get(worker_id).sessions)
                out = self._core.complete_tick(plan, results, failed)
            except Exception:  # a bug, not a worker fault: log it and keep serving
                log.exception("tick %d failed", plan.tick)
                await asyncio.sleep(_IDLE_REPLAN_S)
                continue
            finally:
                tick_span.end()
            self._queue_release(out.release)
            # The outcome is in the core, so the next tick can be planned at once; the event
            # streams and metrics of this one are served while the next tick's steps run.
            self._post_tick = (out, sum(len(w.token_ids) for w in plan.prefill), len(plan.decode))
            self._tick_done.set()

    def _flush_post_tick(self) -> None:
        """Deliver the last tick's tokens and finishes and update the metrics (once)."""
        if self._post_tick is None:
            return
        out, prefill_tokens, decode_tokens = self._post_tick
        self._post_tick = None
        self._deliver(out)
        self._metrics.tick(self._core.snapshot(), prefill_tokens, decode_tokens)

    async def _dispatch(self, plan: TickPlan, tick_span) -> tuple[dict[str, StepResult], set[str]]:
        by_worker = plan.by_worker()
        ids = list(by_worker)
        metadata = self._spans.metadata(tick_span)
        calls = []
        for w in ids:
            request = convert.step_request(*by_worker[w])
            request.release_session_ids.extend(self._pending_release.pop(w, ()))
            arm = self._spans.arm_of([x.session_id for x in by_worker[w][0] + by_worker[w][1]])
            if arm is not None:
                request.kv_views = arm.kv_views
                request.experiment_id = arm.experiment_id
                request.experiment_arm = arm.arm
            calls.append(self._clients[w].stub.Step(request, timeout=self._step_timeout_s,
                                                    metadata=metadata))
        others = self._pending_release
        self._pending_release = {}
        gathered = asyncio.gather(*calls, self._release(others), return_exceptions=True)
        if self._post_tick is not None:
            await asyncio.sleep(0)   # let the steps go out first: the workers compute meanwhile
            self._flush_post_tick()
        responses = await gathered
        responses = responses[:len(ids)]
        results: dict[str, StepResult] = {}
        failed: set[str] = set()
        for worker_id, resp in zip(ids, responses):
            if isinstance(resp, grpc.aio.AioRpcError):
                log.warning("worker %s failed its step (%s: %s); moving its sessions",
                            worker_id, resp.code().name, resp.details())
                failed.add(worker_id)
            elif isinstance(resp, BaseException):
                raise resp
            else:
                results.update(convert.step_results(resp))
        return results, failed

    def _deliver(self, out: TickOutcome) -> None:
        for sid, token in out.tokens:
            self._metrics.token(sid)
            worker = self._core.session(sid).worker_id or ""
            self._publish(SessionEvent(sid, token=token, worker_id=worker))
        for sid, reason in out.finished:
            session = self._core.session(sid)
            self._spans.finished(sid, reason.value, session.prompt_len, len(session.generated))
            self._metrics.finished_session(sid, reason.value)
            self._publish(SessionEvent(sid, finish=reason))

    def _publish(self, event: SessionEvent) -> None:
        queue = self._subscribers.get(event.session_id)
        if queue is not None:
            queue.put_nowait(event)

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
        if now - self._no_worker_since < self._no_worker_wait_s:
            return
        reason = (f"no live worker for {self._no_worker_wait_s:.0f}s; the session was dropped "
                  f"unfinished; retry when a worker is up")
        for sid in self._core.queued_ids():
            self._core.cancel(sid)
            self._spans.failed(sid, reason)
            self._spans.finished(sid, "unavailable", self._core.session(sid).prompt_len,
                                 len(self._core.session(sid).generated))
            self._metrics.finished_session(sid, "unavailable")
            self._publish(SessionEvent(sid, unavailable=reason))

    def _queue_release(self, release: dict[str, list[str]]) -> None:
        for worker_id, sids in release.items():
            self._pending_release.setdefault(worker_id, []).extend(sids)

    async def _flush_releases(self) -> None:
        if self._pending_release:
            pending, self._pending_release = self._pending_release, {}
            await self._release(pending)

    async def _release(self, release: dict[str, list[str]]) -> None:
        calls = []
        for worker_id, sids in release.items():
            client = self._clients.get(worker_id)
            if client is not None and self._core.workers.get(worker_id).live:
                calls.append(client.stub.Release(wpb.ReleaseRequest(session_ids=sids),
                                                 timeout=self._step_timeout_s))
        for res in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(res, BaseException):
                log.warning("release failed: %s", res)

    async def _probe_dead_workers(self) -> None:
        """A worker marked dead is used again once it answers GetInfo (it holds none of our KV)."""
        while not self._stopping:
            await asyncio.sleep(self._health_interval_s)
            for worker_id, client in self._clients.items():
                if self._core.workers.get(worker_id).live:
                    continue
                try:
                    await client.fetch_info(timeout=min(self._health_interval_s, 2.0))
                except grpc.aio.AioRpcError:
                    continue
                self._core.worker_recovered(worker_id)
                await self._release({worker_id: sorted(self._stale.pop(worker_id, set()))})
                log.info("worker %s is back", worker_id)
                self._wake.set()

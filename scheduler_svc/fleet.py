"""The workers as the runtime talks to them: a tick's Step calls (each worker's numbered in the
order sent, carrying the releases that wait for it), releases alone, the answers sorted into
results, workers that did not answer and steps that failed; dead workers probed until they
answer again, live workers' memory read for ListWorkers.

The fleet reads the core (which workers are live, which items are stale, what a worker holds)
and never changes it: the runtime, the core's one owner, applies what the fleet reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span

from scheduler_svc.core import SchedulerCore, StepResult, StepStatus, TickPlan, WorkerSpec
from scheduler_svc.core.served_model import ServedModel, returned_mismatch
from scheduler_svc.experiments import ExperimentArm
from scheduler_svc.observers import Observers
from scheduler_svc.workers import WorkerCallFailed, WorkerClient, WorkerView

if TYPE_CHECKING:
    from kvfleet.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)

# A tick's answers: results by session, workers that did not answer, worker -> why its step failed.
Answers = tuple[dict[str, StepResult], set[str], dict[str, str]]


class WorkerFleet:
    def __init__(
        self,
        clients: Sequence[WorkerClient],
        core: SchedulerCore,
        observe: Observers,
        step_timeout_s: float,
        model: ServedModel | None = None,
    ) -> None:
        """model: the one the workers agreed on at startup (scheduler_svc.server); a worker that
        comes back serving another is kept out (None: not compared)."""
        self._clients = {c.worker_id: c for c in clients}
        self._core = core  # read only
        self._observe = observe
        self._step_timeout_s = step_timeout_s
        # Sessions for each worker to forget: sent with that worker's next step (or an empty step
        # alongside the next tick's steps), so forgetting costs no round trip of its own. Their
        # blocks are free at once: the core owns them.
        self._pending_release: dict[str, list[str]] = {}
        self._rss_bytes: dict[str, tuple[int, int]] = {}  # each worker's (RSS, its own part), from its GetStats
        self._model = model
        self._refused_instances: set[str] = set()  # instances kept out, their refusal logged once

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()), return_exceptions=True)

    # ---- steps ---------------------------------------------------------------------------------

    def forget_later(self, release: Mapping[str, Sequence[str]]) -> None:
        """Sessions each worker is to forget, with its next step."""
        for worker_id, sids in release.items():
            self._pending_release.setdefault(worker_id, []).extend(sids)

    def send(
        self, plan: TickPlan, span: Span, arm_of: Callable[[Iterable[str]], ExperimentArm | None]
    ) -> tuple[list[str], asyncio.Future[list[Any]]]:
        """Start every worker's step call now (each numbered in the order sent), and the releases
        of workers with no step; returns the workers stepped and all the calls gathered (the
        steps' answers first, in that order)."""
        by_worker = plan.by_worker()
        ids = list(by_worker)
        steps: list[Awaitable[object]] = []
        for w in ids:
            prefill, decode = by_worker[w]
            steps.append(
                self._clients[w].step(
                    prefill,
                    decode,
                    self._pending_release.pop(w, ()),
                    arm_of(x.session_id for x in prefill + decode),
                    span,
                    self._step_timeout_s,
                )
            )
        others, self._pending_release = self._pending_release, {}
        if others:  # (most ticks release nothing apart: no task for it then)
            steps.append(self._release(others))
        return ids, asyncio.gather(*steps, return_exceptions=True)

    def answers(self, plan: TickPlan, ids: list[str], gathered: list[Any]) -> Answers:
        """The step calls' answers (`gathered`: one per worker in `ids`, then the releases'), by
        item, with the workers that did not answer and the steps that failed. An item error of
        a stale item (its session ended or moved meanwhile: the extra item overlapped scheduling
        sent) is not reported: the session's worker freed it, and update() ignores it."""
        stale = {w.session_id for w in plan.prefill + plan.decode if self._core.stale(w)}
        responses = gathered[: len(ids)]
        results: dict[str, StepResult] = {}
        failed: set[str] = set()
        failed_steps: dict[str, str] = {}
        for worker_id, resp in zip(ids, responses):
            if isinstance(resp, WorkerCallFailed) and resp.worker_unreachable:
                log.warning(
                    "worker %s failed its step (%s: %s); moving its sessions", worker_id, resp.code.name, resp.details
                )
                failed.add(worker_id)
                self._observe.worker_failed(worker_id)
            elif isinstance(resp, WorkerCallFailed):
                log.warning(
                    "worker %s answered that its step failed (%s: %s); recomputing the step's sessions",
                    worker_id,
                    resp.code.name,
                    resp.details,
                )
                failed_steps[worker_id] = f"{resp.code.name}: {resp.details}"
                self._observe.step_failed(worker_id)
            elif isinstance(resp, BaseException):
                raise resp
            elif resp is not None:
                results.update(resp)
                errors = [
                    r
                    for r in resp.values()
                    if r.status in (StepStatus.REJECTED, StepStatus.FAILED) and r.session_id not in stale
                ]
                for r in errors:
                    log.warning("worker %s: session %s %s: %s", worker_id, r.session_id, r.status.value, r.error)
                if errors:
                    self._observe.item_errors(worker_id, len(errors))
        return results, failed, failed_steps

    def step_times(self, ids: Iterable[str]) -> dict[str, int]:
        """The step time (ns, on the worker) each of these workers answered with since the last
        call: for SchedulerCore.steps_timed."""
        times = {}
        for w in ids:
            client = self._clients[w]
            if client.step_ns:
                times[w], client.step_ns = client.step_ns, 0
        return times

    # ---- releases alone ----------------------------------------------------------------------------

    async def flush_releases(self) -> None:
        if self._pending_release:
            pending, self._pending_release = self._pending_release, {}
            await self._release(pending)

    def _release(self, release: Mapping[str, Sequence[str]]) -> Awaitable[None]:
        """Tell workers with no step this tick which sessions to forget (a step with no items):
        the calls start now, in order with the steps; await the result. A dead worker is not
        told: its books start empty when it is taken back."""
        calls = [
            self._clients[w].step((), (), sids, None, None, self._step_timeout_s)
            for w, sids in release.items()
            if w in self._clients and self._core.workers.get(w).live
        ]
        return self._released(calls)

    @staticmethod
    async def _released(calls: Sequence[Awaitable[object]]) -> None:
        for res in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(res, BaseException):
                log.warning("release failed: %s", res)

    # ---- health ------------------------------------------------------------------------------------

    async def watch(
        self,
        on_back: Callable[[WorkerSpec, int, int], None],
        on_lost: Callable[[str, str], None],
        health_interval_s: float,
        stats_interval_s: float,
        stopping: Callable[[], bool],
    ) -> None:
        """A worker marked dead is used again once it answers GetInfo, with fresh books (its
        first step tells it to forget every session): `on_back` is told its spec, vocabulary size
        and served context. One that comes back serving another model stays dead. Live workers'
        memory is read every stats_interval_s for ListWorkers; one that does not answer, or
        answers as another instance (it restarted), is reported to `on_lost` with why. Each
        worker's read runs apart, from the others' and from the probes: a hung worker holds its
        own read up to the step timeout, and nothing else waits for it."""
        interval = health_interval_s
        next_stats = 0.0
        reads: dict[str, asyncio.Task[None]] = {}
        try:
            while not stopping():
                if time.monotonic() >= next_stats:
                    next_stats = time.monotonic() + stats_interval_s
                    for w in self._clients:
                        if self._core.workers.get(w).live and (w not in reads or reads[w].done()):
                            reads[w] = asyncio.ensure_future(self._check_live(w, on_lost))
                await asyncio.sleep(interval)
                await self._probe_dead(on_back, interval)
        finally:
            for read in reads.values():
                read.cancel()

    async def _probe_dead(self, on_back: Callable[[WorkerSpec, int, int], None], interval: float) -> None:
        """Each dead worker that answers GetInfo, serves the fleet's model and takes its reset is
        handed to `on_back`."""
        for worker_id, client in self._clients.items():
            if self._core.workers.get(worker_id).live:
                continue
            if not await client.answers(timeout=min(interval, 2.0)):
                continue
            if self._another_model(client):
                continue
            # Whatever it still holds is stale now (its sessions moved): it forgets it all
            # at once, before it is used again, so that nothing waits on a next step there.
            client.reset_pending = True
            try:
                await client.step((), (), (), None, None, self._step_timeout_s)
            except WorkerCallFailed as exc:
                log.warning("worker %s answers again but its reset failed: %s", worker_id, exc)
                continue
            assert client.info is not None  # answers() read it
            on_back(client.spec(), client.info.model.vocab_size, client.info.model.max_position)
            log.info("worker %s is back (instance %s)", worker_id, client.info.instance_id)

    def _another_model(self, client: WorkerClient) -> bool:
        """Whether a worker that answers again serves another model than the fleet's."""
        if self._model is None or client.info is None:
            return False
        why = returned_mismatch(client.worker_id, self._model, client.served_model())
        if why and client.info.instance_id not in self._refused_instances:
            self._refused_instances.add(client.info.instance_id)
            log.error("%s", why)
        return bool(why)

    async def _check_live(self, worker_id: str, on_lost: Callable[[str, str], None]) -> None:
        """A live worker's memory (GetStats), and what no step may show: a worker that holds no
        session gets none, so its death or restart would go unseen until one is placed there."""
        client = self._clients[worker_id]
        known = client.info.instance_id if client.info is not None else ""
        try:
            held = await client.held(timeout=self._step_timeout_s)
        except WorkerCallFailed as exc:
            if self._read_is_stale(worker_id, known):
                return
            if exc.worker_unreachable:
                on_lost(worker_id, f"it does not answer GetStats ({exc.code.name}: {exc.details})")
            else:
                log.warning("could not read worker %s's stats: %s", worker_id, exc)
            return
        except Exception:  # a bug: this read is lost, the next one is taken
            log.exception("reading worker %s's stats failed", worker_id)
            return
        if self._read_is_stale(worker_id, known):
            return
        if held.instance_id and known and held.instance_id != known:
            on_lost(worker_id, f"it restarted (instance {held.instance_id}, was {known})")
            return
        self._rss_bytes[worker_id] = (held.rss_bytes, held.private_bytes)

    def _read_is_stale(self, worker_id: str, known: str) -> bool:
        """Whether the worker was marked dead, or taken back as another instance, while its read
        was out (the reads run apart from the steps and the probes): what it said is old news."""
        info = self._clients[worker_id].info
        return (info.instance_id if info is not None else "") != known or not self._core.workers.get(worker_id).live

    # ---- views ---------------------------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        views = []
        for client in self._clients.values():
            wid = client.worker_id
            slot = self._core.workers.get(wid) if wid in self._core.workers else None
            if slot is None:
                views.append(WorkerView(client, False, 0, 0, 0))
                continue
            held = sum(self._core.session(s).kv_tokens for s in slot.sessions)
            rss, own = self._rss_bytes.get(wid, (0, 0))
            views.append(
                WorkerView(
                    client, slot.live, len(slot.sessions), held, slot.reserved_tokens, rss, own, slot.step_ms or 0.0
                )
            )
        return views

    def model_info(self) -> wpb.WorkerInfo | None:
        """A live worker's GetInfo answer (any known worker's when none is live): the model
        served, as GetModelInfo and Tokenize report it. None before any worker answered."""
        views = [v for v in self.views() if v.client.info is not None]
        live = [v for v in views if v.live]
        return (live or views)[0].client.info if views else None

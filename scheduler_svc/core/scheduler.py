"""The tick rules, around three calls: `plan() -> TickPlan`, `apply(plan)` and
`update(plan, results) -> TickOutcome` (`schedule()` is plan then apply).

One tick is linear: the planner (planner.py) decides on a draft of the core's state (state.py):
finishes asked for since the last tick (cancels, stop strings), preemptions, chunked prefills,
the decode batch and admissions; `apply` commits that draft; the runtime dispatches the plan's
steps; `update` applies the workers' answers (tokens, finishes, faults); the runtime publishes the
outcome. A session's KV is released in one place (`CoreState._leave_worker`), whichever way it
leaves its worker.

Admission checks live in admission.py, the KV books (each worker's block tables and prefix
hashes: the workers write where the plan says) and preemption victims in kv_reservations.py,
and every figure the scheduler reports in accounting.py, which only observes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TypeVar

from scheduler_svc.core import admission
from scheduler_svc.core.accounting import Accounting, Gauges, TickTally, WorkloadTally
from scheduler_svc.core.admission import ModelBounds, WorkloadCaps
from scheduler_svc.core.kv_reservations import KvReservations
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, Dropped, PrefillWork, TickOutcome, TickPlan
from scheduler_svc.core.planner import plan_tick
from scheduler_svc.core.session import Phase, Session
from scheduler_svc.core.state import CoreState
from scheduler_svc.core.stats import BatchCounters, TelemetrySnapshot, WorkloadStats
from scheduler_svc.core.types import (
    AdmissionRejected,
    DropCause,
    FinishReason,
    NotSessionOwner,
    RejectReason,
    SessionRequest,
    StepResult,
    StepStatus,
    TokenLogprob,
    WorkerSpec,
    WorkloadPolicy,
)

_T = TypeVar("_T")


def random_id(prefix: str) -> str:
    """128 random bits: an id nobody can guess, and that a restarted scheduler never reissues."""
    return f"{prefix}-{secrets.token_hex(16)}"


class SchedulerCore:
    def __init__(
        self,
        limits: SchedulerLimits,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[str], str] = random_id,
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._new_id = new_id
        self.kv = KvReservations(limits.kv_budget_bytes, limits.cache_aware_routing, limits.pack_step_ms)
        self.accounting = Accounting(limits.max_running)
        self._bounds = ModelBounds()
        self._worker_bounds: dict[str, tuple[int, int]] = {}  # worker -> (vocab_size, max_position)
        self._sessions: dict[str, Session] = {}
        # The queue, the running sessions, the finishes asked for, the work still out, the KV:
        # what a tick is planned from (on a draft of it) and changes.
        self._state = CoreState(self.kv, self._sessions)
        self._groups: dict[str, list[str]] = {}  # prefix group -> its sessions (SessionRequest.prefix_group)
        self._caps: dict[str, WorkloadCaps] = {}  # workloads not yet finished
        self._seq = 0

    # ---- workers -------------------------------------------------------------------------

    @property
    def workers(self) -> KvReservations:
        return self.kv

    def add_worker(self, spec: WorkerSpec, vocab_size: int, max_position: int) -> None:
        self._state.changed()
        self.kv.add(spec)
        self._set_bounds(spec.worker_id, vocab_size, max_position)

    @property
    def max_position(self) -> int | None:
        """The longest sequence (prompt + generated) every worker serves: what admission allows
        and what clients are told (None before any worker)."""
        return self._bounds.max_position

    def _set_bounds(self, worker_id: str, vocab_size: int, max_position: int) -> None:
        """Admission takes the smallest of every worker's bounds (a session may go to any)."""
        self._worker_bounds[worker_id] = (vocab_size, max_position)
        bounds = ModelBounds()
        for vocab, position in self._worker_bounds.values():
            bounds = bounds.merged(vocab, position)
        self._bounds = bounds

    def worker_failed(self, worker_id: str, why: str = "") -> TickOutcome:
        """Mark a worker dead and send its sessions back to the queue to be recomputed elsewhere
        (each at most max_moves times: see ``_move``)."""
        self._state.changed()
        self.kv.get(worker_id).live = False
        out = TickOutcome(tick=self._state.tick)
        for sid in [sid for sid in self._state.running if self._sessions[sid].worker_id == worker_id]:
            self._move(self._sessions[sid], f"worker {worker_id} failed ({why or 'no answer'})", out)
        self._close_workloads()
        return out

    def _move(self, session: Session, why: str, out: TickOutcome) -> None:
        """Recompute a session whose worker or step failed, unless it has been moved max_moves
        times already: then it ends, so that a session that fails everywhere cannot bounce for ever."""
        session.moves += 1
        if session.moves > self.limits.max_moves:
            self._close(session, None, out)
            out.dropped.append(
                Dropped(
                    session.session_id,
                    f"the session was recomputed {session.moves - 1} times after failures and failed "
                    f"again ({why}); it was stopped unfinished (max_moves is {self.limits.max_moves}). "
                    "Retry it later; the scheduler's log names the failures",
                )
            )
            return
        out.requeued.append(session.session_id)
        self._state.requeue(session, out)

    def steps_timed(self, step_ns: Mapping[str, int]) -> None:
        """How long each worker's step of a tick took on it (StepResponse.step_ns): what
        placement packs by (SchedulerLimits.pack_step_ms)."""
        for worker_id, ns in step_ns.items():
            self.kv.step_timed(worker_id, ns)

    def worker_recovered(self, spec: WorkerSpec, vocab_size: int, max_position: int) -> None:
        """A worker marked dead answers again (as `spec` and its model's bounds say now): it is
        used with fresh books, since it may have restarted; the adapter has told it to forget
        every session. A restart with a shorter --max-model-len lowers the admission bound at
        once; sessions already admitted beyond it are refused by the worker, with its reason."""
        self._state.changed()
        self.kv.add(spec)
        self._set_bounds(spec.worker_id, vocab_size, max_position)

    # ---- admission -----------------------------------------------------------------------

    def record_rejection(self, reason: RejectReason) -> None:
        """A request refused before it reached the core (e.g. a prompt the adapter cannot read)."""
        self.accounting.rejected(reason.value)

    def submit(self, request: SessionRequest) -> str:
        return self._enqueue([request], None)[0]

    def submit_group(self, requests: Sequence[SessionRequest]) -> list[str]:
        """Several independent sessions of one call (the n choices of a Generate), admitted
        together or not at all; unlike a workload they keep no shared stats or caps."""
        return self._enqueue(requests, None)

    def submit_workload(
        self, requests: Sequence[SessionRequest], policy: WorkloadPolicy = WorkloadPolicy()
    ) -> tuple[str, list[str]]:
        """Validate every request, then enqueue all of them (or none) before the next tick."""
        caps = self._checked(lambda: admission.workload_caps(len(requests), policy, self.limits))
        workload_id = self._new_id("w")
        ids = self._enqueue(requests, workload_id)
        self._caps[workload_id] = caps
        self.accounting.open_workload(workload_id, ids, caps.max_running, policy.snapshot_at_tick)
        return workload_id, ids

    def _checked(self, check: Callable[[], _T]) -> _T:
        """Run an admission check; a rejection is counted, then raised to the caller."""
        try:
            return check()
        except AdmissionRejected as exc:
            self.accounting.rejected(exc.reason.value)
            raise

    def _check_all(self, requests: Sequence[SessionRequest]) -> None:
        for i, req in enumerate(requests):
            where = f"session {i}: " if len(requests) > 1 else ""
            admission.check_request(req, self.limits, self._bounds, where)
            admission.check_capacity(req, self.kv, where)
        admission.check_queue_room(len(self._state.queue), len(requests), self.limits)
        for owner in {r.owner for r in requests}:  # one caller per call; checked per owner all the same
            arriving = sum(1 for r in requests if r.owner == owner)
            admission.check_caller_room(self._queued_by(owner), arriving, owner, self.limits)

    def _queued_by(self, owner: str) -> int:
        """Sessions of this caller waiting in the queue (O(queue), at most max_queue_depth)."""
        return sum(1 for _, _, sid in self._state.queue if self._sessions[sid].request.owner == owner)

    def _enqueue(self, requests: Sequence[SessionRequest], workload_id: str | None) -> list[str]:
        self._state.changed()
        self._checked(lambda: self._check_all(requests))
        ids = []
        for req in requests:
            sid = self._new_id("s")
            self._seq += 1
            session = Session(session_id=sid, request=req, workload_id=workload_id, seq=self._seq)
            self._sessions[sid] = session
            self._state.enqueue(session)
            if req.prefix_group:
                self._groups.setdefault(req.prefix_group, []).append(sid)
            ids.append(sid)
        return ids

    def cancel(self, session_id: str, caller: str | None = None) -> tuple[str, TickOutcome]:
        """Cancel a session; returns the state it was in and what that settled now. A queued one
        finishes at once; a running one is finished and freed at the next `schedule()`.
        With `caller`, only the session's owner may cancel it (NotSessionOwner otherwise)."""
        self._state.changed()
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        if caller is not None and caller != session.request.owner:
            raise NotSessionOwner(session_id)
        out = TickOutcome(tick=self._state.tick)
        state = session.phase.value
        if session.phase == Phase.QUEUED:
            self._state.dequeue(session)
            self._close(session, FinishReason.CANCELLED, out)
            self._close_workloads()
        elif session.running:
            self._state.finish_requested.setdefault(session_id, FinishReason.CANCELLED)
        return state, out

    def drop_queued(self, why: str) -> TickOutcome:
        """Give up on every waiting session (e.g. no live worker for too long)."""
        self._state.changed()
        out = TickOutcome(tick=self._state.tick)
        for _, _, sid in list(self._state.queue):
            session = self._sessions[sid]
            self._state.dequeue(session)
            self._close(session, None, out)
            out.dropped.append(Dropped(sid, why))
        self._close_workloads()
        return out

    # ---- the tick: schedule ------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._state.running or self._state.queue or self._state.finish_requested)

    def plan(self, now: float | None = None) -> TickPlan:
        """The next tick's plan, a pure function of the core's state (and `now`, the tick's start:
        the core's clock by default): nothing changes until it is applied. Two plans from one
        state are equal."""
        return plan_tick(
            self._state,
            self.limits,
            self._caps,
            self._groups,
            tuple(self.accounting.active_workloads()),
            self._clock() if now is None else now,
        )

    def apply(self, plan: TickPlan) -> None:
        """Commit a plan made from the core's current state: its finishes, preemptions and
        admissions happen, its steps are out (their results come back through `update`)."""
        assert plan.draft is not None, "a plan from plan()"
        self._state.commit(plan.draft)
        # The accounting hears of the plan's decisions now, as it hears of update()'s.
        self.accounting.finished(sid for sid, _ in plan.finished)
        if plan.requeued:
            self.accounting.preempted(len(plan.requeued))
        if plan.empty:
            self._close_workloads()  # e.g. every remaining session was cancelled

    def schedule(self) -> TickPlan:
        """Plan the next tick and apply the plan: its steps' results come back through `update`."""
        plan = self.plan()
        self.apply(plan)
        return plan

    # ---- the tick: update --------------------------------------------------------------------

    def update(
        self,
        plan: TickPlan,
        results: Mapping[str, StepResult],
        failed_workers: Set[str] = frozenset(),
        failed_steps: Mapping[str, str] | None = None,
    ) -> TickOutcome:
        """Apply the workers' answers to a scheduled tick.

        failed_workers: workers that did not answer (a transport error or a timeout): marked dead,
        their sessions moved. failed_steps: worker -> why, for workers that answered that the whole
        step failed: they stay in use, and the step's sessions are freed there and recomputed.
        An item the worker REJECTED or FAILED ends its session alone, with the worker's message.
        """
        self._state.changed()
        failed_steps = failed_steps or {}
        out = TickOutcome(tick=plan.tick)
        if plan.empty:
            return out
        tallies = {wid: _Tally() for wid in plan.workloads}
        total = _Tally()
        for work in plan.prefill + plan.decode:  # first, so that nothing below can leave them
            if self._state.ahead.get(work.session_id) is work:
                del self._state.ahead[work.session_id]
        for work in plan.prefill + plan.decode:
            if self.stale(work):
                continue  # it left its worker since (closed, requeued): the result is not taken
            session = self._sessions[work.session_id]
            if work.worker_id in failed_workers or session.phase == Phase.FINISHED:
                continue
            if self._state.finish_requested.get(session.session_id) == FinishReason.STOP:
                continue  # ended by its text: settled (and freed) by the next schedule()
            if work.worker_id in failed_steps:
                self._move(session, f"its step on worker {work.worker_id} failed: {failed_steps[work.worker_id]}", out)
                continue
            wl = tallies.get(session.workload_id or "")
            result = results.get(work.session_id)
            if result is not None and result.status in (StepStatus.REJECTED, StepStatus.FAILED):
                self._end_on_item_error(session, result, out)
                continue
            if result is None or result.status != StepStatus.OK:
                # The worker did not hold the session as the books say (a bug, or a restart not
                # yet seen): recompute it, as after a failed step.
                total.misses += 1
                if wl is not None:
                    wl.misses += 1
                status = result.status.value if result is not None else "no result"
                self._move(
                    session, f"worker {work.worker_id} did not hold its KV as the scheduler's books say ({status})", out
                )
                continue
            session.kv_tokens = result.kv_tokens
            self.kv.written(session.session_id, result.kv_tokens, session.tokens)
            if isinstance(work, PrefillWork):
                total.prefill += len(work.token_ids)
                if wl is not None:
                    wl.prefill += len(work.token_ids)
                if not work.last_chunk:
                    continue
                session.phase = Phase.DECODE
            else:
                total.decode += 1
                if wl is not None:
                    wl.decode += 1
            if result.token_id is None:
                raise ValueError(f"worker {work.worker_id} returned no token for {work.session_id}")
            self._accept_token(session, result, out)
        for worker_id in sorted(failed_workers):
            if worker_id in self.kv and self.kv.get(worker_id).live:
                moved = self.worker_failed(worker_id)
                out.requeued.extend(moved.requeued)
                out.dropped.extend(moved.dropped)
                for w, sids in moved.release.items():
                    out.release.setdefault(w, []).extend(sids)

        held = self._held_kv_bytes()
        tally = TickTally(
            started=plan.started,
            ended=self._clock(),
            prefill_tokens=total.prefill,
            decode_tokens=total.decode,
            cache_misses=total.misses,
            kv_bytes=sum(held.values()),
            by_workload={
                wid: WorkloadTally(t.prefill, t.decode, t.misses, held.get(wid, 0)) for wid, t in tallies.items()
            },
        )
        self.accounting.record_tick(tally, self._gauges)
        self._close_workloads()
        return out

    def stale(self, work: PrefillWork | DecodeWork) -> bool:
        """Whether the session left its worker (closed, requeued) after this work was planned:
        with overlapped scheduling, the extra item of a session that the tick before ended."""
        session = self._sessions.get(work.session_id)
        return session is None or work.epoch != session.epoch

    def _end_on_item_error(self, session: Session, result: StepResult, out: TickOutcome) -> None:
        """The worker refused or failed this session's item alone (it freed the session there):
        the session ends with the worker's message; the rest of the step stands."""
        worker = session.worker_id
        rejected = result.status == StepStatus.REJECTED
        self._close(session, None, out)
        what = "refused the request" if rejected else "failed on this session"
        out.dropped.append(
            Dropped(
                session.session_id,
                f"worker {worker} {what}: {result.error or result.status.value}",
                DropCause.REJECTED if rejected else DropCause.FAILED,
            )
        )

    def _accept_token(self, session: Session, result: StepResult, out: TickOutcome) -> None:
        token = result.token_id
        assert token is not None
        session.generated.append(token)
        out.tokens.append((session.session_id, token))
        if result.logprob is not None:
            out.logprobs[session.session_id] = TokenLogprob(token, result.logprob, result.top_logprobs)
        req = session.request
        if token in req.stop_token_ids:
            reason: FinishReason | None = FinishReason.STOP
        elif token in req.eos_token_ids:
            reason = FinishReason.EOS
        elif result.constraint_done:
            reason = FinishReason.STOP  # the constrained output is a complete value
        elif session.done_generating:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is not None:
            self._close(session, reason, out)

    def finish(self, session_id: str, reason: FinishReason) -> None:
        """Ask for a session to end (a stop string the output processor found): an input to the
        next schedule(), which finishes it as it does a cancelled one. Meanwhile a token of a
        step already under way is not taken: the text had ended before it."""
        self._state.changed()
        session = self._sessions[session_id]
        if session.running or session.phase == Phase.QUEUED:
            self._state.finish_requested.setdefault(session_id, reason)

    # ---- state changes -----------------------------------------------------------------------

    def _close(self, session: Session, reason: FinishReason | None, out: TickOutcome) -> None:
        """Finish a session (reason None: dropped), releasing its KV where it ran."""
        self._state.close(session, reason, out)
        self.accounting.finished([session.session_id])

    def _close_workloads(self) -> None:
        """Close the workloads whose sessions have all finished; forget the oldest closed ones."""
        for sid in self.accounting.close_finished():
            self._sessions.pop(sid, None)
        for wid in [w for w in self._caps if self.accounting.workload_stats(w) is not None]:
            del self._caps[wid]

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session whose stream has ended, its prompt with it. A workload's too:
        its figures live on in the accounting (workload_stats), which keeps only ids."""
        self._state.changed()
        session = self._sessions.get(session_id)
        if session is not None and session.phase == Phase.FINISHED:
            del self._sessions[session_id]
            group = session.request.prefix_group
            if group in self._groups:
                self._groups[group] = [s for s in self._groups[group] if s != session_id]
                if not self._groups[group]:
                    del self._groups[group]

    # ---- reads ---------------------------------------------------------------------------

    def _held_kv_bytes(self) -> dict[str | None, int]:
        """KV bytes held by running sessions, by workload (None: sessions of no workload)."""
        held: dict[str | None, int] = {}
        for sid in self._state.running:
            s = self._sessions[sid]
            assert s.worker_id is not None
            held[s.workload_id] = held.get(s.workload_id, 0) + s.kv_tokens * self.kv.bytes_per_token(s.worker_id)
        return held

    def _gauges(self, workload_id: str | None = None) -> Gauges:
        if workload_id is None:
            mine = [self._sessions[sid] for sid in self._state.running]
            queued = len(self._state.queue)
        else:
            members = [s for s in self._sessions.values() if s.workload_id == workload_id]
            mine = [s for s in members if s.running]
            queued = sum(1 for s in members if s.phase == Phase.QUEUED)
        kv = sum(s.kv_tokens * self.kv.bytes_per_token(s.worker_id) for s in mine if s.worker_id)
        if workload_id is None:
            reserved = self.kv.reserved_bytes()
        else:
            reserved = sum(
                self.kv.reserved(s.session_id) * self.kv.bytes_per_token(s.worker_id) for s in mine if s.worker_id
            )
        live = self.kv.live
        return Gauges(
            running=len(mine),
            queued=queued,
            kv_bytes=kv,
            reserved_bytes=reserved,
            live_workers=len(live),
            weight_bytes=sum(w.spec.weight_bytes for w in live),
            kv_budget_bytes=self.kv.budget_bytes(),
        )

    def snapshot(self, workload_id: str | None = None) -> TelemetrySnapshot:
        """The live state; with a workload id, totals, gauges and rates of that workload alone."""
        return self.accounting.snapshot(self._gauges(workload_id), workload_id)

    def session(self, session_id: str) -> Session:
        return self._sessions[session_id]

    def workload_stats(self, workload_id: str) -> WorkloadStats | None:
        return self.accounting.workload_stats(workload_id)

    def workload_snapshot(self, workload_id: str) -> TelemetrySnapshot | None:
        return self.accounting.workload_snapshot(workload_id)

    def has_workload(self, workload_id: str) -> bool:
        return self.accounting.has_workload(workload_id)

    @property
    def counters(self) -> BatchCounters:
        return self.accounting.counters

    @property
    def preemptions(self) -> int:
        return self.accounting.preemptions

    @property
    def rejections(self) -> Mapping[str, int]:
        return self.accounting.rejections

    @property
    def tick(self) -> int:
        return self._state.tick

    def queued_ids(self) -> list[str]:
        return [sid for _, _, sid in self._state.queue]

    @property
    def queue_depth(self) -> int:
        return len(self._state.queue)

    @property
    def running_count(self) -> int:
        return len(self._state.running)


class _Tally:
    __slots__ = ("prefill", "decode", "misses")

    def __init__(self) -> None:
        self.prefill = self.decode = self.misses = 0

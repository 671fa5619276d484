"""The tick rules, around two calls: `schedule() -> TickPlan` and `update(plan, results) -> TickOutcome`.

One tick (see the README's scheduling rules):
  1. cancelled sessions are finished and their KV released;
  2. sessions part-way through a chunked prefill continue, first come first served, within the
     tick's prefill token budget;
  3. waiting sessions are admitted FCFS (lower priority value first) while fewer than
     `max_running` run, the budget has room and their KV fits; each admitted session
     prefills its first chunk in this tick, and the chunk that completes a prompt yields the
     session's first new token;
  4. every session prefilled in an earlier tick decodes one token: together they are the
     tick's decode batch;
  5. a session that reaches max_new_tokens (or a stop/EOS token) finishes in the tick and its KV
     is freed in the tick. KV is counted at the tick's end, after frees.

Admission checks live in admission.py, the KV books (each worker's block tables and prefix
hashes: the workers write where the plan says) and preemption victims in kv_reservations.py,
and every figure the scheduler reports in accounting.py, which only observes.
"""

from __future__ import annotations

import bisect
import secrets
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TypeVar

from scheduler_svc.core import admission
from scheduler_svc.core.accounting import Accounting, Gauges, TickTally, WorkloadTally
from scheduler_svc.core.admission import ModelBounds, WorkloadCaps
from scheduler_svc.core.budget import PrefillBudget
from scheduler_svc.core.kv_reservations import KvReservations, VictimCandidate, choose_victim
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, Dropped, PrefillWork, TickOutcome, TickPlan
from scheduler_svc.core.session import Phase, Session
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
        self.kv = KvReservations(limits.kv_budget_bytes, limits.cache_aware_routing)
        self.accounting = Accounting(limits.kv_budget_bytes, limits.max_running)
        self._bounds = ModelBounds()
        self._sessions: dict[str, Session] = {}
        self._queue: list[tuple[int, int, str]] = []  # (priority, seq, session id), sorted
        self._groups: dict[str, list[str]] = {}  # prefix group -> its sessions (SessionRequest.prefix_group)
        self._running: list[str] = []  # admission order
        self._caps: dict[str, WorkloadCaps] = {}  # workloads not yet finished
        # Running sessions to finish at the next schedule(): cancelled by their client, or ended
        # by a stop string the output processor found (first request wins).
        self._finish_requested: dict[str, FinishReason] = {}
        self._seq = 0
        self._tick = 0
        # Each running session's work in a planned tick not yet updated. With overlapped
        # scheduling schedule() plans tick N+1 while tick N is out: it plans from the state N is
        # expected to leave (see _expected), at most one tick ahead of update().
        self._ahead: dict[str, PrefillWork | DecodeWork] = {}

    # ---- workers -------------------------------------------------------------------------

    @property
    def workers(self) -> KvReservations:
        return self.kv

    def add_worker(self, spec: WorkerSpec, vocab_size: int, max_position: int) -> None:
        self.kv.add(spec)
        self._bounds = self._bounds.merged(vocab_size, max_position)

    def worker_failed(self, worker_id: str, why: str = "") -> TickOutcome:
        """Mark a worker dead and send its sessions back to the queue to be recomputed elsewhere
        (each at most max_moves times: see ``_move``)."""
        self.kv.get(worker_id).live = False
        out = TickOutcome(tick=self._tick)
        for sid in [sid for sid in self._running if self._sessions[sid].worker_id == worker_id]:
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
        self._requeue(session)

    def worker_recovered(self, spec: WorkerSpec) -> None:
        """A worker marked dead answers again (as `spec` says now): it is used with fresh books,
        since it may have restarted; the adapter has told it to forget every session."""
        self.kv.add(spec)

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
        admission.check_queue_room(len(self._queue), len(requests), self.limits)
        for owner in {r.owner for r in requests}:  # one caller per call; checked per owner all the same
            arriving = sum(1 for r in requests if r.owner == owner)
            admission.check_caller_room(self._queued_by(owner), arriving, owner, self.limits)

    def _queued_by(self, owner: str) -> int:
        """Sessions of this caller waiting in the queue (O(queue), at most max_queue_depth)."""
        return sum(1 for _, _, sid in self._queue if self._sessions[sid].request.owner == owner)

    def _enqueue(self, requests: Sequence[SessionRequest], workload_id: str | None) -> list[str]:
        self._checked(lambda: self._check_all(requests))
        ids = []
        for req in requests:
            sid = self._new_id("s")
            self._seq += 1
            session = Session(session_id=sid, request=req, workload_id=workload_id, seq=self._seq)
            self._sessions[sid] = session
            bisect.insort(self._queue, (req.priority, session.seq, sid))
            if req.prefix_group:
                self._groups.setdefault(req.prefix_group, []).append(sid)
            ids.append(sid)
        return ids

    def cancel(self, session_id: str, caller: str | None = None) -> tuple[str, TickOutcome]:
        """Cancel a session; returns the state it was in and what that settled now. A queued one
        finishes at once; a running one is finished and freed at the next `schedule()`.
        With `caller`, only the session's owner may cancel it (NotSessionOwner otherwise)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        if caller is not None and caller != session.request.owner:
            raise NotSessionOwner(session_id)
        out = TickOutcome(tick=self._tick)
        state = session.phase.value
        if session.phase == Phase.QUEUED:
            self._dequeue(session)
            self._close(session, FinishReason.CANCELLED, out)
            self._close_workloads()
        elif session.running:
            self._finish_requested.setdefault(session_id, FinishReason.CANCELLED)
        return state, out

    def drop_queued(self, why: str) -> TickOutcome:
        """Give up on every waiting session (e.g. no live worker for too long)."""
        out = TickOutcome(tick=self._tick)
        for _, _, sid in list(self._queue):
            session = self._sessions[sid]
            self._dequeue(session)
            self._close(session, None, out)
            out.dropped.append(Dropped(sid, why))
        self._close_workloads()
        return out

    # ---- the tick: schedule ------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._running or self._queue or self._finish_requested)

    def schedule(self) -> TickPlan:
        """Decide this tick's work. Cancellations and preemptions are settled here and travel in
        the plan; the steps' results come back through `update`."""
        tick = self._tick + 1
        started = self._clock()
        settled = TickOutcome(tick=tick)
        self._settle_finishes(settled)
        preempted: set[str] = set()
        if self.limits.kv_policy == "preempt":
            preempted = self._make_room_for_decodes(settled)

        workloads = tuple(self.accounting.active_workloads())
        budget = PrefillBudget(
            self.limits.prefill_token_budget, {w: self._caps[w].prefill_token_budget for w in workloads}
        )
        decode: list[DecodeWork] = []
        prefill: list[PrefillWork] = []
        for sid in self._running:
            session = self._sessions[sid]
            phase, _, generated = self._expected(session)
            if phase == Phase.DECODE:
                # Decode batch: sessions whose prefill finished in an earlier tick (one still out
                # counts as done), unless the tick still out gives them their last token.
                if generated < session.request.max_new_tokens:
                    decode.append(self._decode_work(session))
            else:
                # Chunked prefills already under way go first.
                chunk = self._prefill_chunk(session, budget)
                if chunk is not None:
                    prefill.append(chunk)
        prefill += self._admit(tick, budget, preempted)
        if prefill or decode:
            self._tick = tick
            self._ahead.update((w.session_id, w) for w in prefill)
            self._ahead.update((w.session_id, w) for w in decode)
        else:
            self._close_workloads()  # e.g. every remaining session was cancelled
        return TickPlan(
            tick=tick,
            prefill=tuple(prefill),
            decode=tuple(decode),
            finished=tuple(settled.finished),
            requeued=tuple(settled.requeued),
            release={w: tuple(s) for w, s in settled.release.items()},
            started=started,
            workloads=workloads,
        )

    def _expected(self, session: Session) -> tuple[Phase, int, int]:
        """(phase, tokens in its KV, tokens generated) once its work in a tick still out is done as
        planned: the state the next tick is planned from. Without one: as it is."""
        work = self._ahead.get(session.session_id)
        if work is None:
            return session.phase, session.kv_tokens, len(session.generated)
        if isinstance(work, DecodeWork):
            return Phase.DECODE, work.position + 1, work.generated_so_far + 1
        end = work.start_position + len(work.token_ids)
        if work.last_chunk:
            return Phase.DECODE, end, work.generated_so_far + 1
        return Phase.PREFILL, end, work.generated_so_far

    def _settle_finishes(self, out: TickOutcome) -> None:
        """The finishes asked for since the last tick (cancels, stop strings), in arrival order."""
        for sid, reason in sorted(self._finish_requested.items(), key=lambda kv: self._sessions[kv[0]].seq):
            session = self._sessions[sid]
            if session.running:
                self._close(session, reason, out)
            elif session.phase == Phase.QUEUED:
                # Requeued (worker fault, cache miss) after the finish was asked for.
                self._dequeue(session)
                self._close(session, reason, out)
        self._finish_requested.clear()

    def _admit(self, tick: int, budget: PrefillBudget, preempted: Set[str]) -> list[PrefillWork]:
        """Admission, first come first served, within max_running, the budget and the KV."""
        work: list[PrefillWork] = []
        running_by_wl = self._running_by_workload()
        for _, _, sid in list(self._queue):
            if len(self._running) >= self.limits.max_running or budget.exhausted:
                break
            session = self._sessions[sid]
            wid = session.workload_id
            if (
                wid is not None
                and wid in self._caps
                and (running_by_wl.get(wid, 0) >= self._caps[wid].max_running or budget.room(wid) <= 0)
            ):
                continue  # this workload is at its own cap; it does not block others
            if sid in preempted:
                continue  # not back in the tick that preempted it
            if self._sibling_computes_the_prompt(session):
                continue  # it follows once the shared prompt's KV exists (the prefix cache)
            if not self._try_place(session, tick):
                break  # strict FCFS on KV: a large head-of-line request is not starved
            self._dequeue(session)
            if wid is not None:
                running_by_wl[wid] = running_by_wl.get(wid, 0) + 1
            chunk = self._prefill_chunk(session, budget)
            if chunk is not None:
                work.append(chunk)
        return work

    def _running_by_workload(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for sid in self._running:
            wid = self._sessions[sid].workload_id
            if wid is not None:
                counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _siblings(self, session: Session) -> list[Session]:
        group = session.request.prefix_group
        if not group:
            return []
        return [
            self._sessions[s] for s in self._groups.get(group, ()) if s != session.session_id and s in self._sessions
        ]

    def _sibling_computes_the_prompt(self, session: Session) -> bool:
        """A session of a prefix group waits while a sibling's prefill is under way and none has
        finished one yet; after that every sibling goes (all in one tick, if they fit)."""
        siblings = self._siblings(session)
        computing = any(s.running and s.phase == Phase.PREFILL for s in siblings)
        computed = any(s.generated or s.phase in (Phase.DECODE, Phase.FINISHED) for s in siblings)
        return computing and not computed

    def _try_place(self, session: Session, tick: int) -> bool:
        need = session.worst_case_tokens
        if self.limits.kv_policy == "preempt":
            # The prompt (plus what it generated before a preemption) and the first decode.
            need = min(need, session.prompt_len + len(session.generated) + 1)
        # Where the longest prefix of it is cached (a prefix group's sibling's, say), if it has room.
        placed = self.kv.reserve(session.session_id, need, session.next_prefill(), session.salt)
        if placed is None:
            return False
        session.worker_id = placed.worker_id
        session.admitted_tick = tick
        session.start_prefill(placed.cached_tokens)
        self._running.append(session.session_id)
        return True

    def _make_room_for_decodes(self, out: TickOutcome) -> set[str]:
        """Preempt mode: every decode adds one token; grow reservations block by block, and
        where a worker (or the KV budget) is full, preempt the least urgent, most recently
        admitted session on that worker until the growth fits. Returns the preempted ids."""
        preempted: set[str] = set()
        for sid in list(self._running):  # oldest first get room first
            session = self._sessions[sid]
            phase, kv_tokens, generated = self._expected(session)
            if phase != Phase.DECODE or sid in preempted or generated >= session.request.max_new_tokens:
                continue
            worker_id = session.worker_id
            assert worker_id is not None
            while not self.kv.grow(sid, kv_tokens + 1):
                victim = self._sessions[
                    choose_victim(
                        [
                            VictimCandidate(s, self._sessions[s].request.priority, i)
                            for i, s in enumerate(self._running)
                            if self._sessions[s].worker_id == worker_id
                        ]
                    )
                ]
                out.free(worker_id, victim.session_id)
                out.requeued.append(victim.session_id)
                preempted.add(victim.session_id)
                self.accounting.preempted()
                self._requeue(victim)
                if victim is session:
                    break
        return preempted

    def _prefill_chunk(self, session: Session, budget: PrefillBudget) -> PrefillWork | None:
        room = budget.room(session.workload_id)
        if room <= 0:
            return None
        _, start, _ = self._expected(session)
        # The first chunk carries the cached prefix too (the worker's sampling history wants
        # every prompt token); only the tokens to compute spend the budget.
        cached = session.cached_tokens if start == 0 else 0
        chunk = session.prefill_target[start : start + cached + room]
        budget.spend(session.workload_id, len(chunk) - cached)
        last = start + len(chunk) == len(session.prefill_target)
        return PrefillWork(
            session_id=session.session_id,
            worker_id=session.worker_id or "",
            token_ids=chunk,
            start_position=start,
            last_chunk=last,
            sampling=session.request.sampling,
            generated_so_far=len(session.generated),
            block_ids=self.kv.new_blocks(session.session_id),
            cached_tokens=cached,
            epoch=session.epoch,
        )

    def _decode_work(self, session: Session) -> DecodeWork:
        _, position, generated = self._expected(session)
        ahead = session.session_id in self._ahead  # its latest token is still being sampled
        return DecodeWork(
            session_id=session.session_id,
            worker_id=session.worker_id or "",
            token_id=0 if ahead else session.generated[-1],
            position=position,
            sampling=session.request.sampling,
            generated_so_far=generated,
            block_ids=self.kv.new_blocks(session.session_id),
            epoch=session.epoch,
            last_sampled=ahead,
        )

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
        failed_steps = failed_steps or {}
        out = TickOutcome(tick=plan.tick)
        if plan.empty:
            return out
        tallies = {wid: _Tally() for wid in plan.workloads}
        total = _Tally()
        for work in plan.prefill + plan.decode:  # first, so that nothing below can leave them
            if self._ahead.get(work.session_id) is work:
                del self._ahead[work.session_id]
        for work in plan.prefill + plan.decode:
            if self.stale(work):
                continue  # it left its worker since (closed, requeued): the result is not taken
            session = self._sessions[work.session_id]
            if work.worker_id in failed_workers or session.phase == Phase.FINISHED:
                continue
            if self._finish_requested.get(session.session_id) == FinishReason.STOP:
                continue  # ended by its text: settled (and freed) by the next schedule()
            if work.worker_id in failed_steps:
                self._move(session, f"its step on worker {work.worker_id} failed: {failed_steps[work.worker_id]}", out)
                if session.phase == Phase.QUEUED:  # (ended, _close freed it already)
                    out.free(work.worker_id, session.session_id)
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
                if session.phase == Phase.QUEUED:
                    out.free(work.worker_id, session.session_id)
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
        session = self._sessions[session_id]
        if session.running or session.phase == Phase.QUEUED:
            self._finish_requested.setdefault(session_id, reason)

    # ---- state changes -----------------------------------------------------------------------

    def _dequeue(self, session: Session) -> None:
        self._queue.remove((session.request.priority, session.seq, session.session_id))

    def _close(self, session: Session, reason: FinishReason | None, out: TickOutcome) -> None:
        """Finish a session (reason None: dropped), freeing its KV where it ran."""
        if session.running:
            assert session.worker_id is not None
            out.free(session.worker_id, session.session_id)
            self._running.remove(session.session_id)
            self._unreserve(session)
        self._left_worker(session)
        session.phase = Phase.FINISHED
        session.finish_reason = reason
        session.kv_tokens = 0
        if reason is not None:
            out.finished.append((session.session_id, reason))
        self.accounting.finished([session.session_id])

    def _unreserve(self, session: Session) -> None:
        self.kv.release(session.session_id)
        session.worker_id = None

    def _left_worker(self, session: Session) -> None:
        """Whatever of it is still out on a worker is stale from now on."""
        session.epoch += 1
        self._ahead.pop(session.session_id, None)

    def _requeue(self, session: Session) -> None:
        self._running.remove(session.session_id)
        self._unreserve(session)
        self._left_worker(session)
        session.phase = Phase.QUEUED
        session.kv_tokens = 0
        bisect.insort(self._queue, (session.request.priority, session.seq, session.session_id))

    def _close_workloads(self) -> None:
        """Close the workloads whose sessions have all finished; forget the oldest closed ones."""
        for sid in self.accounting.close_finished():
            self._sessions.pop(sid, None)
        for wid in [w for w in self._caps if self.accounting.workload_stats(w) is not None]:
            del self._caps[wid]

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session whose stream has ended, its prompt with it. A workload's too:
        its figures live on in the accounting (workload_stats), which keeps only ids."""
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
        for sid in self._running:
            s = self._sessions[sid]
            assert s.worker_id is not None
            held[s.workload_id] = held.get(s.workload_id, 0) + s.kv_tokens * self.kv.bytes_per_token(s.worker_id)
        return held

    def _gauges(self, workload_id: str | None = None) -> Gauges:
        if workload_id is None:
            mine = [self._sessions[sid] for sid in self._running]
            queued = len(self._queue)
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
        return self._tick

    def queued_ids(self) -> list[str]:
        return [sid for _, _, sid in self._queue]

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running_count(self) -> int:
        return len(self._running)


class _Tally:
    __slots__ = ("prefill", "decode", "misses")

    def __init__(self) -> None:
        self.prefill = self.decode = self.misses = 0

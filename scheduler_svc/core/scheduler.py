"""The tick rules: admission, chunked prefill under a token budget, continuous decode batching.

One tick (see shared/reference/README.md):
  1. cancelled sessions are finished and their KV released;
  2. sessions part-way through a chunked prefill continue, first come first served, within the
     tick's prefill token budget;
  3. waiting sessions are admitted FCFS (lower priority value first) while fewer than
     `max_running` run, the budget has room and their worst-case KV fits; each admitted session
     prefills its first chunk in this tick, and the chunk that completes a prompt yields the
     session's first new token;
  4. every session prefilled in an earlier tick decodes one token: together they are the
     tick's decode batch;
  5. a session that reaches max_new_tokens (or a stop/EOS token) finishes in the tick and its KV
     is freed in the tick. KV is counted at the tick's end, after frees.
"""
from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.placement import WorkerPool
from scheduler_svc.core.plan import DecodeWork, PrefillWork, TickOutcome, TickPlan
from scheduler_svc.core.session import Phase, Session
from scheduler_svc.core.stats import (
    BatchCounters, RateWindow, RejectionCounts, TelemetrySnapshot, WorkloadStats,
)
from scheduler_svc.core.types import (
    AdmissionRejected, FinishReason, RejectReason, SessionRequest, StepStatus, StepResult,
    WorkerSpec, WorkloadPolicy,
)

# Finished workloads kept for late GetTelemetry/stat reads.
_FINISHED_WORKLOADS_KEPT = 64


@dataclass
class _Workload:
    workload_id: str
    session_ids: list[str]
    max_running: int
    prefill_token_budget: int
    snapshot_at_tick: int
    rejected_at_start: dict[str, int]
    counters: BatchCounters = field(default_factory=BatchCounters)
    rates: RateWindow = field(default_factory=RateWindow)
    snapshot: TelemetrySnapshot | None = None
    stats: WorkloadStats | None = None      # set when every session has finished


class SchedulerCore:
    def __init__(self, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self.workers = WorkerPool()
        self._sessions: dict[str, Session] = {}
        self._queue: list[tuple[int, int, str]] = []     # (priority, seq, session id), sorted
        self._running: list[str] = []                     # admission order
        self._workloads: dict[str, _Workload] = {}
        self._finished_workloads: list[str] = []
        self._cancel_requested: set[str] = set()
        self._next_session = 0
        self._next_workload = 0
        self._tick = 0
        self._tick_started = 0.0
        self.counters = BatchCounters()
        self.rejections = RejectionCounts()
        self.completed = 0
        self.preemptions = 0
        self._rates = RateWindow()
        self._tick_workloads: list[_Workload] = []   # workloads present at the planned tick's start
        self.vocab_size: int | None = None
        self.max_position: int | None = None

    # ---- workers -------------------------------------------------------------------------

    def add_worker(self, spec: WorkerSpec, vocab_size: int, max_position: int) -> None:
        self.workers.add(spec)
        self.vocab_size = vocab_size if self.vocab_size is None else min(self.vocab_size, vocab_size)
        self.max_position = max_position if self.max_position is None else min(self.max_position, max_position)

    def worker_failed(self, worker_id: str) -> list[str]:
        """Mark a worker dead and send its sessions back to the queue to be recomputed elsewhere."""
        slot = self.workers.get(worker_id)
        slot.live = False
        moved = [sid for sid in self._running if self._sessions[sid].worker_id == worker_id]
        for sid in moved:
            self._requeue(self._sessions[sid])
        return moved

    def worker_recovered(self, worker_id: str) -> None:
        self.workers.get(worker_id).live = True

    # ---- admission -----------------------------------------------------------------------

    def submit(self, request: SessionRequest) -> str:
        return self._enqueue([request], None)[0]

    def submit_workload(self, requests: Sequence[SessionRequest],
                        policy: WorkloadPolicy = WorkloadPolicy()) -> tuple[str, list[str]]:
        """Validate every request, then enqueue all of them (or none) before the next tick."""
        if not requests:
            self._reject(RejectReason.INVALID_REQUEST, "a workload needs at least one session")
        max_running = self._cap("max_running", policy.max_running, self.limits.max_running)
        budget = self._cap("prefill_token_budget", policy.prefill_token_budget,
                           self.limits.prefill_token_budget)
        workload_id = f"w{self._next_workload}"
        ids = self._enqueue(requests, workload_id)
        self._next_workload += 1
        self._workloads[workload_id] = _Workload(
            workload_id=workload_id, session_ids=ids, max_running=max_running,
            prefill_token_budget=budget, snapshot_at_tick=policy.snapshot_at_tick,
            rejected_at_start=dict(self.rejections.by_reason))
        for sid in ids:
            self._sessions[sid].workload_id = workload_id
        return workload_id, ids

    def _cap(self, name: str, asked: int | None, limit: int) -> int:
        if asked is None or asked == 0:
            return limit
        if asked < 0 or asked > limit:
            self._reject(RejectReason.INVALID_REQUEST,
                         f"workload {name} {asked} is outside 1..{limit}, the scheduler's limit")
        return asked

    def _enqueue(self, requests: Sequence[SessionRequest], workload_id: str | None) -> list[str]:
        for i, req in enumerate(requests):
            self._validate(req, f"session {i}: " if len(requests) > 1 else "")
        if len(self._queue) + len(requests) > self.limits.max_queue_depth:
            self._reject(RejectReason.QUEUE_FULL,
                         f"the queue holds {len(self._queue)} of {self.limits.max_queue_depth} "
                         f"sessions and cannot take {len(requests)} more; retry later or send fewer")
        ids = []
        for req in requests:
            sid = f"s{self._next_session}"
            self._next_session += 1
            session = Session(session_id=sid, request=req, workload_id=workload_id, seq=self._next_session)
            self._sessions[sid] = session
            bisect.insort(self._queue, (req.priority, session.seq, sid))
            ids.append(sid)
        return ids

    def _reject(self, reason: RejectReason, message: str) -> None:
        self.rejections.add(reason.value)
        raise AdmissionRejected(reason, message)

    def _validate(self, req: SessionRequest, where: str) -> None:
        bad = RejectReason.INVALID_REQUEST
        if not req.prompt_ids:
            self._reject(bad, f"{where}the prompt is empty; send at least one token")
        if req.max_new_tokens < 1:
            self._reject(bad, f"{where}max_new_tokens must be at least 1, got {req.max_new_tokens}")
        if req.max_new_tokens > self.limits.max_new_tokens:
            self._reject(bad, f"{where}max_new_tokens {req.max_new_tokens} exceeds the limit "
                              f"{self.limits.max_new_tokens}")
        s = req.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0:
            self._reject(bad, f"{where}temperature must be >= 0 (0 = greedy), got {s.temperature}")
        if not math.isfinite(s.top_p) or not 0 < s.top_p <= 1:
            self._reject(bad, f"{where}top_p must be in (0, 1], got {s.top_p}")
        if s.top_k < 0:
            self._reject(bad, f"{where}top_k must be >= 0 (0 = off), got {s.top_k}")
        if self.vocab_size is not None:
            out = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
            if out:
                self._reject(bad, f"{where}prompt token id {out[0]} is outside the vocabulary "
                                  f"0..{self.vocab_size - 1}")
        if len(req.prompt_ids) > self.limits.max_prompt_tokens:
            self._reject(RejectReason.PROMPT_TOO_LONG,
                         f"{where}the prompt has {len(req.prompt_ids)} tokens; the limit is "
                         f"{self.limits.max_prompt_tokens}")
        total = len(req.prompt_ids) + req.max_new_tokens
        if self.max_position is not None and total > self.max_position:
            self._reject(RejectReason.PROMPT_TOO_LONG,
                         f"{where}prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) "
                         f"= {total} exceeds the model's context of {self.max_position} tokens; "
                         f"shorten the prompt or lower max_new_tokens")
        if not self.workers.live:
            self._reject(RejectReason.NO_WORKER, "no live worker is registered; retry when one is up")
        worst = len(req.prompt_ids) + req.max_new_tokens - 1
        if not self.workers.could_ever_fit(worst, self.limits.kv_budget_bytes):
            worst_bytes = worst * self._kv_bytes_per_token()
            self._reject(RejectReason.KV_BUDGET,
                         f"{where}prompt + max_new_tokens needs up to {worst} tokens of KV "
                         f"({worst_bytes} bytes before rounding to whole blocks), more than the KV "
                         f"budget ({self.limits.kv_budget_bytes} bytes) or any worker's cache holds; "
                         f"lower max_new_tokens or shorten the prompt")

    def _kv_bytes_per_token(self) -> int:
        return max((w.spec.kv_bytes_per_token for w in self.workers.live), default=0)

    def cancel(self, session_id: str) -> str:
        """Cancel a session; returns the state it was in. A running one is freed at the next tick."""
        session = self._sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        state = session.phase.value
        if session.phase == Phase.QUEUED:
            self._queue.remove((session.request.priority, session.seq, session_id))
            self._finish_bookkeeping(session, FinishReason.CANCELLED)
            if session.workload_id in self._workloads:
                self._maybe_close_workload(self._workloads[session.workload_id])
        elif session.running:
            self._cancel_requested.add(session_id)
        return state

    # ---- the tick ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._running or self._queue or self._cancel_requested)

    def plan_tick(self) -> tuple[TickPlan, TickOutcome]:
        """Decide this tick's work. The outcome already holds the tick's cancellations."""
        tick = self._tick + 1
        self._tick_started = self._clock()
        early = TickOutcome(tick=tick)
        for sid in sorted(self._cancel_requested, key=lambda s: self._sessions[s].seq):
            session = self._sessions[sid]
            if session.running:
                early.release.setdefault(session.worker_id, []).append(sid)  # type: ignore[arg-type]
                self._finish(session, FinishReason.CANCELLED, early)
            elif session.phase == Phase.QUEUED:
                # Requeued (worker fault, cache miss) after the cancel was asked for.
                self._queue.remove((session.request.priority, session.seq, sid))
                self._finish_bookkeeping(session, FinishReason.CANCELLED)
                early.finished.append((sid, FinishReason.CANCELLED))
        self._cancel_requested.clear()
        preempted: set[str] = set()
        if self.limits.kv_policy == "preempt":
            preempted = self._make_room_for_decodes(early)

        self._tick_workloads = self._active_workloads()
        budget = self.limits.prefill_token_budget
        wl_budget = {w.workload_id: w.prefill_token_budget for w in self._tick_workloads}
        prefill: list[PrefillWork] = []
        # Decode batch: sessions whose prefill finished in an earlier tick.
        decode = [self._decode_work(self._sessions[sid]) for sid in self._running
                  if self._sessions[sid].phase == Phase.DECODE]
        # Chunked prefills already under way go first.
        for sid in self._running:
            session = self._sessions[sid]
            if session.phase == Phase.PREFILL and budget > 0:
                work, used = self._prefill_chunk(session, budget, wl_budget)
                if work is not None:
                    prefill.append(work)
                    budget -= used
        # Admission, first come first served.
        running_by_wl = self._running_by_workload()
        for priority, seq, sid in list(self._queue):
            if len(self._running) >= self.limits.max_running or budget <= 0:
                break
            session = self._sessions[sid]
            wl = self._workloads.get(session.workload_id) if session.workload_id else None
            if wl is not None and (running_by_wl.get(wl.workload_id, 0) >= wl.max_running
                                   or wl_budget[wl.workload_id] <= 0):
                continue   # this workload is at its own cap; it does not block others
            if sid in preempted:
                continue   # not back in the tick that preempted it: that would only thrash
            if not self._try_admit(session, tick):
                break      # strict FCFS on KV: a large head-of-line request is not starved
            self._queue.remove((priority, seq, sid))
            if wl is not None:
                running_by_wl[wl.workload_id] = running_by_wl.get(wl.workload_id, 0) + 1
            work, used = self._prefill_chunk(session, budget, wl_budget)
            if work is not None:
                prefill.append(work)
                budget -= used
        if prefill or decode:
            self._tick = tick
        else:
            for wl in self._tick_workloads:   # e.g. every remaining session was cancelled
                self._maybe_close_workload(wl)
        return TickPlan(tick=tick, prefill=tuple(prefill), decode=tuple(decode)), early

    def _active_workloads(self) -> list[_Workload]:
        return [w for w in self._workloads.values() if w.stats is None]

    def _running_by_workload(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for sid in self._running:
            wid = self._sessions[sid].workload_id
            if wid is not None:
                counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _try_admit(self, session: Session, tick: int) -> bool:
        need = session.worst_case_tokens
        if self.limits.kv_policy == "preempt":
            # The prompt (plus what it generated before a preemption) and the first decode.
            need = min(need, session.prompt_len + len(session.generated) + 1)
        worker_id = self.workers.place(need)
        if worker_id is None:
            return False
        bpt = self.workers.get(worker_id).spec.kv_bytes_per_token
        if self._reserved_bytes() + self.workers.footprint(worker_id, need) * bpt > self.limits.kv_budget_bytes:
            return False
        session.reserved_tokens = self.workers.reserve(worker_id, session.session_id, need)
        session.worker_id = worker_id
        session.admitted_tick = tick
        session.start_prefill()
        self._running.append(session.session_id)
        return True

    def _make_room_for_decodes(self, out: TickOutcome) -> set[str]:
        """Preempt mode: every decode adds one token; grow reservations block by block, and
        where a worker (or the KV budget) is full, preempt the least urgent, most recently
        admitted session on that worker until the growth fits. Returns the preempted ids."""
        preempted: set[str] = set()
        for sid in list(self._running):                    # oldest first get room first
            session = self._sessions[sid]
            if session.phase != Phase.DECODE or sid in preempted:
                continue
            worker_id = session.worker_id
            assert worker_id is not None
            extra = self.workers.footprint(worker_id, session.kv_tokens + 1) - session.reserved_tokens
            bpt = self.workers.get(worker_id).spec.kv_bytes_per_token
            while extra > 0:
                fits_budget = self._reserved_bytes() + extra * bpt <= self.limits.kv_budget_bytes
                if fits_budget and self.workers.grow(worker_id, extra):
                    session.reserved_tokens += extra
                    break
                victim = self._preemption_victim(worker_id)
                out.release.setdefault(worker_id, []).append(victim.session_id)
                out.requeued.append(victim.session_id)
                preempted.add(victim.session_id)
                self.preemptions += 1
                self._requeue(victim)
                if victim is session:
                    break
        return preempted

    def _preemption_victim(self, worker_id: str) -> Session:
        on_worker = [(i, self._sessions[s]) for i, s in enumerate(self._running)
                     if self._sessions[s].worker_id == worker_id]
        # Highest priority value (least urgent) first, then the most recently admitted.
        return max(on_worker, key=lambda pair: (pair[1].request.priority, pair[0]))[1]

    def _reserved_bytes(self) -> int:
        return sum(w.reserved_tokens * w.spec.kv_bytes_per_token for w in self.workers)

    def _prefill_chunk(self, session: Session, budget: int,
                       wl_budget: dict[str, int]) -> tuple[PrefillWork | None, int]:
        if session.workload_id in wl_budget:
            budget = min(budget, wl_budget[session.workload_id])
        if budget <= 0:
            return None, 0
        start = session.kv_tokens
        chunk = session.prefill_target[start:start + budget]
        if session.workload_id in wl_budget:
            wl_budget[session.workload_id] -= len(chunk)
        last = start + len(chunk) == len(session.prefill_target)
        work = PrefillWork(session_id=session.session_id, worker_id=session.worker_id or "",
                           token_ids=chunk, start_position=start, last_chunk=last,
                           sampling=session.request.sampling,
                           generated_so_far=len(session.generated))
        return work, len(chunk)

    @staticmethod
    def _decode_work(session: Session) -> DecodeWork:
        return DecodeWork(session_id=session.session_id, worker_id=session.worker_id or "",
                          token_id=session.generated[-1], position=session.kv_tokens,
                          sampling=session.request.sampling,
                          generated_so_far=len(session.generated))

    def complete_tick(self, plan: TickPlan, results: Mapping[str, StepResult],
                      failed_workers: Set[str] = frozenset(),
                      outcome: TickOutcome | None = None) -> TickOutcome:
        """Apply the workers' answers to a planned tick."""
        out = outcome if outcome is not None else TickOutcome(tick=plan.tick)
        if plan.empty:
            return out
        wl_prefill: dict[str, int] = {}
        wl_decode: dict[str, int] = {}
        wl_misses: dict[str, int] = {}
        present = self._tick_workloads
        prefill_total = decode_total = 0
        for work in plan.prefill + plan.decode:
            session = self._sessions[work.session_id]
            if work.worker_id in failed_workers or session.phase == Phase.FINISHED:
                continue
            result = results.get(work.session_id)
            if result is None or result.status != StepStatus.OK:
                # The worker did not hold what we thought: recompute the session elsewhere.
                self.counters.cache_misses += 1
                if session.workload_id:
                    wl_misses[session.workload_id] = wl_misses.get(session.workload_id, 0) + 1
                out.release.setdefault(work.worker_id, []).append(work.session_id)
                out.requeued.append(work.session_id)
                self._requeue(session)
                continue
            session.kv_tokens = result.kv_tokens
            wid = session.workload_id
            if isinstance(work, PrefillWork):
                n = len(work.token_ids)
                prefill_total += n
                if wid:
                    wl_prefill[wid] = wl_prefill.get(wid, 0) + n
                if not work.last_chunk:
                    continue
                session.phase = Phase.DECODE
            else:
                decode_total += 1
                if wid:
                    wl_decode[wid] = wl_decode.get(wid, 0) + 1
            if result.token_id is None:
                raise ValueError(f"worker {work.worker_id} returned no token for {work.session_id}")
            self._accept_token(session, result.token_id, out)
        for worker_id in sorted(failed_workers):
            if worker_id in self.workers and self.workers.get(worker_id).live:
                out.requeued.extend(self.worker_failed(worker_id))

        self.counters.record_tick(prefill_total, decode_total, self._held_kv_bytes(None))
        end = self._clock()
        self._rates.add(self._tick_started, end, prefill_total, decode_total)
        for wl in present:
            c = wl.counters
            c.record_tick(wl_prefill.get(wl.workload_id, 0), wl_decode.get(wl.workload_id, 0),
                          self._held_kv_bytes(wl.workload_id))
            c.cache_misses += wl_misses.get(wl.workload_id, 0)
            wl.rates.add(self._tick_started, end, wl_prefill.get(wl.workload_id, 0),
                         wl_decode.get(wl.workload_id, 0))
            if wl.snapshot_at_tick and c.ticks == wl.snapshot_at_tick:
                wl.snapshot = self.snapshot(wl.workload_id)
            self._maybe_close_workload(wl)
        return out

    def _accept_token(self, session: Session, token: int, out: TickOutcome) -> None:
        session.generated.append(token)
        out.tokens.append((session.session_id, token))
        req = session.request
        if token in req.stop_token_ids:
            reason: FinishReason | None = FinishReason.STOP
        elif token in req.eos_token_ids:
            reason = FinishReason.EOS
        elif session.done_generating:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is not None:
            out.release.setdefault(session.worker_id, []).append(session.session_id)  # type: ignore[arg-type]
            self._finish(session, reason, out)

    def finish(self, session_id: str, reason: FinishReason) -> TickOutcome:
        """End a session outside the tick rules (a stop string seen by the adapter)."""
        session = self._sessions[session_id]
        out = TickOutcome(tick=self._tick)
        if session.running:
            out.release.setdefault(session.worker_id, []).append(session_id)  # type: ignore[arg-type]
            self._finish(session, reason, out)
        elif session.phase == Phase.QUEUED:
            self.cancel(session_id)
        return out

    def _finish(self, session: Session, reason: FinishReason, out: TickOutcome) -> None:
        self._running.remove(session.session_id)
        self._unreserve(session)
        self._finish_bookkeeping(session, reason)
        out.finished.append((session.session_id, reason))

    def _finish_bookkeeping(self, session: Session, reason: FinishReason) -> None:
        session.phase = Phase.FINISHED
        session.finish_reason = reason
        session.kv_tokens = 0
        self.completed += 1

    def _unreserve(self, session: Session) -> None:
        if session.worker_id is not None:
            self.workers.unreserve(session.worker_id, session.session_id, session.reserved_tokens)
        session.worker_id = None
        session.reserved_tokens = 0

    def _requeue(self, session: Session) -> None:
        self._running.remove(session.session_id)
        self._unreserve(session)
        session.phase = Phase.QUEUED
        session.kv_tokens = 0
        bisect.insort(self._queue, (session.request.priority, session.seq, session.session_id))

    def _held_kv_bytes(self, workload_id: str | None) -> int:
        total = 0
        for sid in self._running:
            s = self._sessions[sid]
            if workload_id is None or s.workload_id == workload_id:
                total += s.kv_tokens * self.workers.get(s.worker_id).spec.kv_bytes_per_token  # type: ignore[arg-type]
        return total

    def _maybe_close_workload(self, wl: _Workload) -> None:
        if wl.stats is not None:
            return
        if all(self._sessions[sid].phase == Phase.FINISHED for sid in wl.session_ids):
            wl.counters.rejected = sum(self._rejections_since(wl).values())
            wl.stats = WorkloadStats.from_counters(len(wl.session_ids), wl.counters)
            self._finished_workloads.append(wl.workload_id)
            while len(self._finished_workloads) > _FINISHED_WORKLOADS_KEPT:
                old = self._workloads.pop(self._finished_workloads.pop(0))
                for sid in old.session_ids:
                    self._sessions.pop(sid, None)

    def _rejections_since(self, wl: _Workload) -> dict[str, int]:
        now = self.rejections.by_reason
        return {r: n - wl.rejected_at_start.get(r, 0) for r, n in now.items()
                if n - wl.rejected_at_start.get(r, 0) > 0}

    # ---- reads ---------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        return self._sessions[session_id]

    def workload_stats(self, workload_id: str) -> WorkloadStats | None:
        return self._workloads[workload_id].stats

    def workload_snapshot(self, workload_id: str) -> TelemetrySnapshot | None:
        return self._workloads[workload_id].snapshot

    def has_workload(self, workload_id: str) -> bool:
        return workload_id in self._workloads

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session that belongs to no workload (its stream has ended)."""
        session = self._sessions.get(session_id)
        if session is not None and session.phase == Phase.FINISHED and session.workload_id is None:
            del self._sessions[session_id]

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

    def snapshot(self, workload_id: str | None = None) -> TelemetrySnapshot:
        """The live state; with a workload id, totals, gauges and rates of that workload alone."""
        wl = self._workloads[workload_id] if workload_id is not None else None
        active = self._active_workloads()
        slots = self.limits.max_running
        if wl is not None:
            c, rates = wl.counters, wl.rates
            mine = [self._sessions[sid] for sid in wl.session_ids]
            running = sum(1 for m in mine if m.running)
            queued = sum(1 for m in mine if m.phase == Phase.QUEUED)
            completed = sum(1 for m in mine if m.phase == Phase.FINISHED)
            kv_bytes = self._held_kv_bytes(wl.workload_id)
            reserved = sum(m.reserved_tokens * self.workers.get(m.worker_id).spec.kv_bytes_per_token
                           for m in mine if m.worker_id is not None)
            by_reason = self._rejections_since(wl)
            slots = min(slots, wl.max_running)
        else:
            c, rates = self.counters, self._rates
            running, queued, completed = len(self._running), len(self._queue), self.completed
            kv_bytes, reserved = self._held_kv_bytes(None), self._reserved_bytes()
            by_reason = dict(self.rejections.by_reason)
            if active:
                slots = min(slots, sum(w.max_running for w in active))
        prefill_rate, decode_rate = rates.rates()
        return TelemetrySnapshot(
            active_sessions=running,
            batch_occupancy_avg=round(c.avg_batch_occupancy, 4),
            batch_occupancy_last=c.last_batch_occupancy,
            batch_occupancy_max=c.max_batch_occupancy,
            completed_sessions=completed,
            decode_tokens_per_sec=round(decode_rate, 3),
            decode_tokens_total=c.decode_tokens,
            kv_budget_bytes=self.limits.kv_budget_bytes,
            kv_pressure=round(kv_bytes / self.limits.kv_budget_bytes, 4),
            kv_total_bytes=kv_bytes,
            prefill_tokens_per_sec=round(prefill_rate, 3),
            prefill_tokens_total=c.prefill_tokens,
            queue_depth=queued,
            rejected_admissions_total=sum(by_reason.values()),
            rejected_by_reason=by_reason,
            scratch_budget_bytes=slots,
            scratch_pressure=round(running / slots, 4) if slots else 0.0,
            scratch_used_bytes=running,
            ticks=c.ticks,
            weight_bytes=sum(w.spec.weight_bytes for w in self.workers.live),
            kv_reserved_bytes=reserved,
            cache_misses_total=c.cache_misses,
            live_workers=len(self.workers.live),
            preemptions_total=self.preemptions,
        )

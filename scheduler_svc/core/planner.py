"""Planning one tick: a pure function of the core's state (`plan_tick`), run on a draft of it.

The rules, in order (the README's scheduling rules):
  1. the finishes asked for since the last tick (cancels, stop strings) are settled;
  2. in preempt mode, every decode that cannot grow its KV preempts a victim on its worker;
  3. running sessions decode one token, or continue their chunked prefill within the tick's
     prefill token budget (first come first served);
  4. waiting sessions are admitted FCFS (lower priority value first) within `max_running`, the
     budget and the KV; each admitted session prefills its first chunk in this tick.
What the rules decide travels in the `TickPlan`; the draft they changed becomes the core's state
when the core applies the plan (`SchedulerCore.apply`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from scheduler_svc.core.admission import WorkloadCaps
from scheduler_svc.core.budget import PrefillBudget
from scheduler_svc.core.kv_reservations import VictimCandidate, choose_victim
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, PrefillWork, TickOutcome, TickPlan
from scheduler_svc.core.session import Phase, Session
from scheduler_svc.core.state import CoreState


def plan_tick(
    state: CoreState,
    limits: SchedulerLimits,
    caps: Mapping[str, WorkloadCaps],
    groups: Mapping[str, Sequence[str]],
    workloads: tuple[str, ...],
    started: float,
) -> TickPlan:
    """The next tick's plan; `state` is left as it is (the plan carries the draft it changed).

    caps: each active workload's own limits; groups: prefix group -> its sessions; workloads:
    the active workloads (their figures are tallied when the tick is updated); started: the
    tick's start on the core's clock."""
    draft = state.draft()
    return _Planner(draft, limits, caps, groups).plan(draft.tick + 1, started, workloads)


class _Planner:
    def __init__(
        self,
        draft: CoreState,
        limits: SchedulerLimits,
        caps: Mapping[str, WorkloadCaps],
        groups: Mapping[str, Sequence[str]],
    ) -> None:
        self._st = draft
        self._limits = limits
        self._caps = caps
        self._groups = groups

    def plan(self, tick: int, started: float, workloads: tuple[str, ...]) -> TickPlan:
        st = self._st
        settled = TickOutcome(tick=tick)
        self._settle_finishes(settled)
        preempted: set[str] = set()
        if self._limits.kv_policy == "preempt":
            preempted = self._make_room_for_decodes(settled)

        budget = PrefillBudget(
            self._limits.prefill_token_budget, {w: self._caps[w].prefill_token_budget for w in workloads}
        )
        decode: list[DecodeWork] = []
        prefill: list[PrefillWork] = []
        for sid in st.running:
            session = st.sessions[sid]
            phase, position, generated = st.expected(session)
            if phase == Phase.DECODE:
                # Decode batch: sessions whose prefill finished in an earlier tick (one still out
                # counts as done), unless the tick still out gives them their last token.
                if generated < session.request.max_new_tokens:
                    decode.append(self._decode_work(session, position, generated))
            else:
                # Chunked prefills already under way go first.
                chunk = self._prefill_chunk(session, budget)
                if chunk is not None:
                    prefill.append(chunk)
        admitted = self._admit(tick, budget, preempted)
        prefill += admitted
        if prefill or decode:
            st.tick = tick
            st.ahead.update((w.session_id, w) for w in prefill)
            st.ahead.update((w.session_id, w) for w in decode)
        return TickPlan(
            tick=tick,
            prefill=tuple(prefill),
            decode=tuple(decode),
            finished=tuple(settled.finished),
            requeued=tuple(settled.requeued),
            release={w: tuple(s) for w, s in settled.release.items()},
            started=started,
            workloads=workloads,
            admitted=tuple(w.session_id for w in admitted),
            draft=st,
        )

    def _settle_finishes(self, out: TickOutcome) -> None:
        """The finishes asked for since the last tick (cancels, stop strings), in arrival order."""
        st = self._st
        for sid, reason in sorted(st.finish_requested.items(), key=lambda kv: st.sessions[kv[0]].seq):
            session = st.sessions[sid]
            if session.running:
                st.close(session, reason, out)
            elif session.phase == Phase.QUEUED:
                # Requeued (worker fault, cache miss) after the finish was asked for.
                st.dequeue(session)
                st.close(session, reason, out)
        st.finish_requested.clear()

    def _make_room_for_decodes(self, out: TickOutcome) -> set[str]:
        """Preempt mode: every decode adds one token; grow reservations block by block, and
        where a worker (or the KV budget) is full, preempt the least urgent, most recently
        admitted session on that worker until the growth fits. Returns the preempted ids."""
        st = self._st
        preempted: set[str] = set()
        for sid in list(st.running):  # oldest first get room first
            session = st.sessions[sid]
            phase, kv_tokens, generated = st.expected(session)
            if phase != Phase.DECODE or sid in preempted or generated >= session.request.max_new_tokens:
                continue
            worker_id = session.worker_id
            assert worker_id is not None
            while not st.kv.grow(sid, kv_tokens + 1):
                victim = st.sessions[
                    choose_victim(
                        [
                            VictimCandidate(s, st.sessions[s].request.priority, i)
                            for i, s in enumerate(st.running)
                            if st.sessions[s].worker_id == worker_id
                        ]
                    )
                ]
                out.requeued.append(victim.session_id)
                preempted.add(victim.session_id)
                st.requeue(victim, out)
                if victim.session_id == sid:
                    break
        return preempted

    def _admit(self, tick: int, budget: PrefillBudget, preempted: Set[str]) -> list[PrefillWork]:
        """Admission, first come first served, within max_running, the budget and the KV."""
        st = self._st
        work: list[PrefillWork] = []
        running_by_wl = self._running_by_workload()
        for _, _, sid in list(st.queue):
            if len(st.running) >= self._limits.max_running or budget.exhausted:
                break
            session = st.sessions[sid]
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
            placed = self._try_place(session, tick)
            if placed is None:
                break  # strict FCFS on KV: a large head-of-line request is not starved
            st.dequeue(placed)
            if wid is not None:
                running_by_wl[wid] = running_by_wl.get(wid, 0) + 1
            chunk = self._prefill_chunk(placed, budget)
            if chunk is not None:
                work.append(chunk)
        return work

    def _running_by_workload(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for sid in self._st.running:
            wid = self._st.sessions[sid].workload_id
            if wid is not None:
                counts[wid] = counts.get(wid, 0) + 1
        return counts

    def _sibling_computes_the_prompt(self, session: Session) -> bool:
        """A session of a prefix group waits while a sibling's prefill is under way and none has
        finished one yet; after that every sibling goes (all in one tick, if they fit)."""
        group = session.request.prefix_group
        if not group:
            return False
        sessions = self._st.sessions
        siblings = [sessions[s] for s in self._groups.get(group, ()) if s != session.session_id and s in sessions]
        computing = any(s.running and s.phase == Phase.PREFILL for s in siblings)
        computed = any(s.generated or s.phase in (Phase.DECODE, Phase.FINISHED) for s in siblings)
        return computing and not computed

    def _try_place(self, session: Session, tick: int) -> Session | None:
        """Reserve its KV on a worker and start its prefill; the session as changed (in the
        draft), or None when no worker has room."""
        need = session.worst_case_tokens
        if self._limits.kv_policy == "preempt":
            # The prompt (plus what it generated before a preemption) and the first decode.
            need = min(need, session.prompt_len + len(session.generated) + 1)
        # Where the longest prefix of it is cached (a prefix group's sibling's, say), if it has room.
        placed = self._st.kv.reserve(session.session_id, need, session.next_prefill(), session.salt)
        if placed is None:
            return None
        session = self._st.writable(session)
        session.worker_id = placed.worker_id
        session.admitted_tick = tick
        session.start_prefill(placed.cached_tokens)
        self._st.running.append(session.session_id)
        return session

    def _prefill_chunk(self, session: Session, budget: PrefillBudget) -> PrefillWork | None:
        room = budget.room(session.workload_id)
        if room <= 0:
            return None
        _, start, _ = self._st.expected(session)
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
            block_ids=self._st.kv.new_blocks(session.session_id),
            cached_tokens=cached,
            epoch=session.epoch,
        )

    def _decode_work(self, session: Session, position: int, generated: int) -> DecodeWork:
        """(position, generated: as `CoreState.expected` has them for the session.)"""
        ahead = session.session_id in self._st.ahead  # its latest token is still being sampled
        return DecodeWork(
            session_id=session.session_id,
            worker_id=session.worker_id or "",
            token_id=0 if ahead else session.generated[-1],
            position=position,
            sampling=session.request.sampling,
            generated_so_far=generated,
            block_ids=self._st.kv.new_blocks(session.session_id),
            epoch=session.epoch,
            last_sampled=ahead,
        )

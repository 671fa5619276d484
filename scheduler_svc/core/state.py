"""The scheduler core's mutable books in one object, and the few state changes a session goes
through (queued, placed, closed, requeued), shared by the tick's planning and by `update`.

A tick is planned on a *draft* of the books (`draft()`): the plan is a pure function of the core's
state, and `commit()` makes the draft the state once the plan is applied. Drafts are cheap: the
lists are copied, a session is copied when the planner first reads it, the KV books on write.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping

from scheduler_svc.core.kv_reservations import KvReservations
from scheduler_svc.core.plan import DecodeWork, PrefillWork, TickOutcome
from scheduler_svc.core.session import Phase, Session
from scheduler_svc.core.types import FinishReason


class DraftSessions(Mapping[str, Session]):
    """The sessions as a draft sees them: the core's own until the draft changes one, which it
    does on a copy (`writable`), so the core's sessions stay as they are (`CoreState.commit`
    writes the copies back). A tick changes few sessions: those it admits, finishes, preempts."""

    def __init__(self, base: Mapping[str, Session]) -> None:
        self._base = base
        self.copies: dict[str, Session] = {}

    def __getitem__(self, session_id: str) -> Session:
        return self.copies.get(session_id) or self._base[session_id]

    def writable(self, session_id: str) -> Session:
        session = self.copies.get(session_id)
        if session is None:
            # Shallow: `generated` and the request are shared; planning changes neither.
            session = self.copies[session_id] = self._base[session_id].copy()
        return session

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._base

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


class CoreState:
    """Sessions, the queue, the running list, the finishes asked for, the work still out and
    the KV books: everything a tick is planned from and changes."""

    def __init__(self, kv: KvReservations, sessions: Mapping[str, Session]) -> None:
        self.kv = kv
        self.sessions = sessions
        self.queue: list[tuple[int, int, str]] = []  # (priority, seq, session id), sorted
        self.running: list[str] = []  # admission order
        # Running sessions to finish at the next schedule(): cancelled by their client, or ended
        # by a stop string the output processor found (first request wins).
        self.finish_requested: dict[str, FinishReason] = {}
        # Each running session's work in a planned tick not yet updated. With overlapped
        # scheduling the next tick is planned while one is out: from the state that tick is
        # expected to leave (see `expected`), at most one tick ahead of update().
        self.ahead: dict[str, PrefillWork | DecodeWork] = {}
        self.tick = 0  # the last tick planned with work
        self.version = 0  # bumped by every change the core makes; a draft is of one version
        self._base: CoreState | None = None  # a draft's origin

    # ---- drafts --------------------------------------------------------------------------------

    def draft(self) -> CoreState:
        """A copy to plan a tick on; this state is left as it is."""
        new = CoreState(self.kv.draft(), DraftSessions(self.sessions))
        new.queue, new.running = list(self.queue), list(self.running)
        new.finish_requested, new.ahead = dict(self.finish_requested), dict(self.ahead)
        new.tick, new.version, new._base = self.tick, self.version, self
        return new

    def commit(self, draft: CoreState) -> None:
        """Make a draft of this state (unchanged since) the state."""
        if draft._base is not self or draft.version != self.version:
            raise ValueError("the plan is stale: the core changed after it was planned, or it was applied already")
        assert isinstance(draft.sessions, DraftSessions)
        for sid, planned in draft.sessions.copies.items():
            vars(self.sessions[sid]).update(vars(planned))  # the core's sessions keep their identity
        self.queue, self.running = draft.queue, draft.running
        self.finish_requested, self.ahead = draft.finish_requested, draft.ahead
        self.kv.adopt(draft.kv)
        self.tick = draft.tick
        self.version += 1
        draft._base = None  # spent

    def changed(self) -> None:
        """The core changed the state outside a plan: a draft made before is stale."""
        self.version += 1

    # ---- a session's changes ---------------------------------------------------------------------

    def writable(self, session: Session) -> Session:
        """The session to change: in a draft its copy (read it from there on), else itself."""
        if isinstance(self.sessions, DraftSessions):
            return self.sessions.writable(session.session_id)
        return session

    def enqueue(self, session: Session) -> None:
        bisect.insort(self.queue, (session.request.priority, session.seq, session.session_id))

    def dequeue(self, session: Session) -> None:
        self.queue.remove((session.request.priority, session.seq, session.session_id))

    def close(self, session: Session, reason: FinishReason | None, out: TickOutcome) -> None:
        """Finish a session (reason None: dropped), releasing its KV where it ran. The caller
        counts it (the accounting hears of a planned finish when the plan is applied)."""
        session = self.writable(session)
        if session.running:
            self.running.remove(session.session_id)
        self._leave_worker(session, out)
        session.phase = Phase.FINISHED
        session.finish_reason = reason
        session.kv_tokens = 0
        if reason is not None:
            out.finished.append((session.session_id, reason))

    def requeue(self, session: Session, out: TickOutcome) -> None:
        """Send a running session back to the queue, to be recomputed from its prompt and what it
        generated (preempted, or its worker or step failed)."""
        session = self.writable(session)
        self.running.remove(session.session_id)
        self._leave_worker(session, out)
        session.phase = Phase.QUEUED
        session.kv_tokens = 0
        self.enqueue(session)

    def _leave_worker(self, session: Session, out: TickOutcome) -> None:
        """The one place a session's KV is released: its blocks go back to the books, its worker
        (if live: a dead one's books were dropped) is told to forget it with its next step, and
        whatever of it is still out on the worker is stale from now on (its epoch moves on)."""
        worker_id = session.worker_id
        if worker_id is not None:
            if self.kv.get(worker_id).live:
                out.free(worker_id, session.session_id)
            self.kv.release(session.session_id)
            session.worker_id = None
        session.epoch += 1
        self.ahead.pop(session.session_id, None)

    # ---- reads ---------------------------------------------------------------------------------

    def expected(self, session: Session) -> tuple[Phase, int, int]:
        """(phase, tokens in its KV, tokens generated) once its work in a tick still out is done as
        planned: the state the next tick is planned from. Without one: as it is."""
        work = self.ahead.get(session.session_id)
        if work is None:
            return session.phase, session.kv_tokens, len(session.generated)
        if isinstance(work, DecodeWork):
            return Phase.DECODE, work.position + 1, work.generated_so_far + 1
        end = work.start_position + len(work.token_ids)
        if work.last_chunk:
            return Phase.DECODE, end, work.generated_so_far + 1
        return Phase.PREFILL, end, work.generated_so_far

"""The KV books: which worker holds which session's KV, how much each session has reserved, and
who gives way when a worker is full. Placement, the byte budget and preemption victims live here;
the tick rules (scheduler.py) decide when to ask."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from scheduler_svc.core.types import WorkerSpec


def round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


@dataclass
class WorkerSlot:
    spec: WorkerSpec
    live: bool = True
    reserved_tokens: int = 0  # sum of its sessions' reservations (block-rounded)
    sessions: set[str] = field(default_factory=set)

    @property
    def free_tokens(self) -> int:
        return self.spec.capacity_tokens - self.reserved_tokens

    @property
    def load(self) -> float:
        return self.reserved_tokens / self.spec.capacity_tokens


@dataclass(frozen=True)
class Reservation:
    worker_id: str
    tokens: int  # block-rounded


@dataclass(frozen=True)
class VictimCandidate:
    session_id: str
    priority: int  # lower = more urgent
    admission_index: int  # position in admission order (higher = admitted later)


def choose_victim(candidates: Sequence[VictimCandidate]) -> str:
    """The least urgent (highest priority value), then the most recently admitted, gives way."""
    return max(candidates, key=lambda c: (c.priority, c.admission_index)).session_id


class KvReservations:
    """Places sessions on the least KV-loaded live worker that can hold what they need, within a
    byte budget over all workers, and keeps each session's reservation."""

    def __init__(self, kv_budget_bytes: int) -> None:
        self.kv_budget_bytes = kv_budget_bytes
        self._workers: dict[str, WorkerSlot] = {}
        self._by_session: dict[str, Reservation] = {}

    # ---- workers ---------------------------------------------------------------------------

    def add(self, spec: WorkerSpec) -> None:
        if spec.capacity_tokens <= 0 or spec.block_size <= 0 or spec.kv_bytes_per_token <= 0:
            raise ValueError(f"worker {spec.worker_id} reports no KV capacity: {spec}")
        old = self._workers.get(spec.worker_id)
        if old is not None and old.sessions:
            raise ValueError(f"worker {spec.worker_id} re-added while it still holds sessions")
        self._workers[spec.worker_id] = WorkerSlot(spec=spec)

    def get(self, worker_id: str) -> WorkerSlot:
        return self._workers[worker_id]

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(self._workers.values())

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    @property
    def live(self) -> list[WorkerSlot]:
        return [w for w in self._workers.values() if w.live]

    def bytes_per_token(self, worker_id: str) -> int:
        return self._workers[worker_id].spec.kv_bytes_per_token

    def max_bytes_per_token(self) -> int:
        return max((w.spec.kv_bytes_per_token for w in self.live), default=0)

    def footprint(self, worker_id: str, tokens: int) -> int:
        return round_up(tokens, self._workers[worker_id].spec.block_size)

    def could_ever_fit(self, tokens: int) -> bool:
        """Whether some live worker could hold `tokens` (block-rounded) within the byte budget."""
        for w in self.live:
            footprint = round_up(tokens, w.spec.block_size)
            if footprint <= w.spec.capacity_tokens and footprint * w.spec.kv_bytes_per_token <= self.kv_budget_bytes:
                return True
        return False

    # ---- reservations ------------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        return sum(w.reserved_tokens * w.spec.kv_bytes_per_token for w in self._workers.values())

    def reserved(self, session_id: str) -> int:
        r = self._by_session.get(session_id)
        return r.tokens if r is not None else 0

    def worker_of(self, session_id: str) -> str | None:
        r = self._by_session.get(session_id)
        return r.worker_id if r is not None else None

    def _fits_budget(self, extra_tokens: int, worker_id: str) -> bool:
        extra = extra_tokens * self.bytes_per_token(worker_id)
        return self.reserved_bytes() + extra <= self.kv_budget_bytes

    def reserve(self, session_id: str, tokens: int, prefer: str | None = None) -> str | None:
        """Reserve `tokens` for a session on the least loaded live worker with room (`prefer`,
        when it has room); None when no worker has room or the byte budget would be exceeded."""
        assert session_id not in self._by_session, f"{session_id} already holds a reservation"
        candidates = [w for w in self.live if round_up(tokens, w.spec.block_size) <= w.free_tokens]
        if not candidates:
            return None
        preferred = [w for w in candidates if w.spec.worker_id == prefer]
        slot = preferred[0] if preferred else min(candidates, key=lambda w: (w.load, w.spec.worker_id))
        worker_id = slot.spec.worker_id
        footprint = round_up(tokens, slot.spec.block_size)
        if not self._fits_budget(footprint, worker_id):
            return None
        slot.reserved_tokens += footprint
        slot.sessions.add(session_id)
        self._by_session[session_id] = Reservation(worker_id, footprint)
        return worker_id

    def grow(self, session_id: str, tokens: int) -> bool:
        """Make a placed session's reservation cover `tokens`, if its worker and the budget have
        room; False (and nothing changed) otherwise."""
        r = self._by_session[session_id]
        extra = self.footprint(r.worker_id, tokens) - r.tokens
        if extra <= 0:
            return True
        slot = self._workers[r.worker_id]
        if extra > slot.free_tokens or not self._fits_budget(extra, r.worker_id):
            return False
        slot.reserved_tokens += extra
        self._by_session[session_id] = Reservation(r.worker_id, r.tokens + extra)
        return True

    def release(self, session_id: str) -> None:
        r = self._by_session.pop(session_id, None)
        if r is None:
            return
        slot = self._workers[r.worker_id]
        slot.reserved_tokens -= r.tokens
        slot.sessions.discard(session_id)
        assert slot.reserved_tokens >= 0, "reservation accounting went negative"

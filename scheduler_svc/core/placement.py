"""Which worker holds which session's KV, and how much each has reserved."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.types import WorkerSpec


def round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


@dataclass
class WorkerSlot:
    spec: WorkerSpec
    live: bool = True
    reserved_tokens: int = 0       # worst-case tokens of sessions placed here, block-rounded
    sessions: set[str] = field(default_factory=set)

    @property
    def free_tokens(self) -> int:
        return self.spec.capacity_tokens - self.reserved_tokens

    @property
    def load(self) -> float:
        return self.reserved_tokens / self.spec.capacity_tokens


class WorkerPool:
    """Places sessions on the least KV-loaded live worker that can hold their worst case."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerSlot] = {}

    def add(self, spec: WorkerSpec) -> None:
        if spec.capacity_tokens <= 0 or spec.block_size <= 0 or spec.kv_bytes_per_token <= 0:
            raise ValueError(f"worker {spec.worker_id} reports no KV capacity: {spec}")
        old = self._workers.get(spec.worker_id)
        self._workers[spec.worker_id] = WorkerSlot(spec=spec)
        if old is not None and old.sessions:
            raise ValueError(f"worker {spec.worker_id} re-added while it still holds sessions")

    def get(self, worker_id: str) -> WorkerSlot:
        return self._workers[worker_id]

    def __iter__(self):
        return iter(self._workers.values())

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    @property
    def live(self) -> list[WorkerSlot]:
        return [w for w in self._workers.values() if w.live]

    def footprint(self, worker_id: str, tokens: int) -> int:
        return round_up(tokens, self._workers[worker_id].spec.block_size)

    def could_ever_fit(self, tokens: int, budget_bytes: int) -> bool:
        """Whether some live worker could hold `tokens` (block-rounded) within the byte budget."""
        for w in self.live:
            footprint = round_up(tokens, w.spec.block_size)
            if footprint <= w.spec.capacity_tokens and footprint * w.spec.kv_bytes_per_token <= budget_bytes:
                return True
        return False

    def place(self, tokens: int) -> str | None:
        candidates = [w for w in self.live if round_up(tokens, w.spec.block_size) <= w.free_tokens]
        if not candidates:
            return None
        best = min(candidates, key=lambda w: (w.load, w.spec.worker_id))
        return best.spec.worker_id

    def reserve(self, worker_id: str, session_id: str, tokens: int) -> int:
        slot = self._workers[worker_id]
        footprint = round_up(tokens, slot.spec.block_size)
        if footprint > slot.free_tokens:
            raise ValueError(f"worker {worker_id} cannot reserve {footprint} tokens")
        slot.reserved_tokens += footprint
        slot.sessions.add(session_id)
        return footprint

    def grow(self, worker_id: str, extra_tokens: int) -> bool:
        """Add to a placed session's reservation if the worker has room."""
        slot = self._workers[worker_id]
        if extra_tokens > slot.free_tokens:
            return False
        slot.reserved_tokens += extra_tokens
        return True

    def unreserve(self, worker_id: str, session_id: str, footprint: int) -> None:
        slot = self._workers[worker_id]
        slot.reserved_tokens -= footprint
        slot.sessions.discard(session_id)
        assert slot.reserved_tokens >= 0, "reservation accounting went negative"

"""The KV books: per worker, the block tables of its sessions and the hashes of its reusable
prefix blocks (``kvfleet_common.kv_blocks.BlockTables``); where a new session goes, within a byte
budget over all workers, and who gives way when a worker is full. What a session reserves is the
blocks it holds: blocks shared through the prefix cache count once. The tick rules
(scheduler.py) decide when to ask."""

from __future__ import annotations

import copy
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvfleet_common.kv_blocks import BlockTables, OutOfBlocks, TokenRange
from scheduler_svc.core.types import WorkerSpec

RECENT_STEPS = 8  # a worker's step times that packing takes the median of
# Packing stops at half a worker's KV: past it the worker is placed on by load, so that packing
# never crowds one worker's blocks (preempting, in the preempt policy) while another's are idle.
PACK_MAX_LOAD = 0.5


def round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


@dataclass
class WorkerSlot:
    spec: WorkerSpec
    live: bool = True
    tables: BlockTables = field(init=False)
    sessions: set[str] = field(default_factory=set)
    # Its last steps' times in ms (SchedulerCore.steps_timed); their median is what packing goes by.
    recent_steps_ms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def __post_init__(self) -> None:
        self.tables = BlockTables(self.spec.num_blocks, self.spec.block_size, self.spec.prefix_caching)

    def draft(self) -> WorkerSlot:
        """A copy whose books change independently (see KvReservations.draft)."""
        new = copy.copy(self)
        new.tables, new.sessions = self.tables.copy(), set(self.sessions)
        return new

    @property
    def reserved_tokens(self) -> int:
        """Tokens of the blocks its sessions hold (a shared block once)."""
        return self.tables.allocator.num_used * self.spec.block_size

    @property
    def free_tokens(self) -> int:
        return self.spec.capacity_tokens - self.reserved_tokens

    @property
    def step_ms(self) -> float | None:
        """The median of its last steps' times (None: none timed yet): a step slowed by the
        machine now and then (a VM's hiccup, a collection) does not move it."""
        return statistics.median(self.recent_steps_ms) if self.recent_steps_ms else None

    @property
    def load(self) -> float:
        return self.reserved_tokens / self.spec.capacity_tokens


@dataclass(frozen=True)
class Placement:
    worker_id: str
    cached_tokens: int  # leading prompt tokens whose KV the worker's prefix cache holds


@dataclass(frozen=True)
class VictimCandidate:
    session_id: str
    priority: int  # lower = more urgent
    admission_index: int  # position in admission order (higher = admitted later)


def choose_victim(candidates: Sequence[VictimCandidate]) -> str:
    """The least urgent (highest priority value), then the most recently admitted, gives way."""
    return max(candidates, key=lambda c: (c.priority, c.admission_index)).session_id


class KvReservations:
    """Places sessions on the live worker that holds the longest cached prefix of their prompt
    (then one whose steps are cheap enough to pack more onto, the fullest first, then the least
    KV-loaded) and has room for what they need, within a byte budget over all workers, and keeps
    each worker's block tables."""

    def __init__(self, kv_budget_bytes: int, cache_aware: bool = True, pack_step_ms: float = 0.0) -> None:
        self.kv_budget_bytes = kv_budget_bytes
        self.cache_aware = cache_aware  # False: the least loaded worker only (a session still
        # reuses what it finds cached where it lands)
        self.pack_step_ms = pack_step_ms  # see SchedulerLimits.pack_step_ms
        self._workers: dict[str, WorkerSlot] = {}
        self._by_session: dict[str, str] = {}  # session -> its worker

    def draft(self) -> KvReservations:
        """Books equal to these that a tick is planned on; `adopt` takes them back once the
        plan is applied. Cheap: the block tables are copied on write."""
        new = KvReservations(self.kv_budget_bytes, self.cache_aware, self.pack_step_ms)
        new._workers = {wid: slot.draft() for wid, slot in self._workers.items()}
        new._by_session = dict(self._by_session)
        return new

    def adopt(self, draft: KvReservations) -> None:
        """Take a draft's books as these (the slots keep their identity: callers hold them)."""
        assert draft._workers.keys() == self._workers.keys(), "workers changed while a tick was planned"
        for wid, planned in draft._workers.items():
            slot = self._workers[wid]
            slot.tables, slot.sessions, slot.live = planned.tables, planned.sessions, planned.live
            slot.tables.claim()  # the books it was drafted from go with this
        self._by_session = draft._by_session

    # ---- workers ---------------------------------------------------------------------------

    def add(self, spec: WorkerSpec) -> None:
        if spec.capacity_tokens <= 0 or spec.block_size <= 0 or spec.kv_bytes_per_token <= 0:
            raise ValueError(f"worker {spec.worker_id} reports no KV capacity: {spec}")
        old = self._workers.get(spec.worker_id)
        if old is not None and old.sessions:
            raise ValueError(f"worker {spec.worker_id} re-added while it still holds sessions")
        # Fresh books (a worker taken back may have restarted: its cached prefixes are gone).
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

    def budget_bytes(self) -> int:
        """The byte budget in force: the configured one, or (0 configured) the live workers'
        caches together."""
        if self.kv_budget_bytes:
            return self.kv_budget_bytes
        return sum(w.spec.capacity_tokens * w.spec.kv_bytes_per_token for w in self.live)

    def could_ever_fit(self, tokens: int) -> bool:
        """Whether some live worker could hold `tokens` (block-rounded) within the byte budget."""
        for w in self.live:
            footprint = round_up(tokens, w.spec.block_size)
            in_budget = not self.kv_budget_bytes or footprint * w.spec.kv_bytes_per_token <= self.kv_budget_bytes
            if footprint <= w.spec.capacity_tokens and in_budget:
                return True
        return False

    # ---- reservations ------------------------------------------------------------------------

    def reserved_bytes(self) -> int:
        return sum(w.reserved_tokens * w.spec.kv_bytes_per_token for w in self._workers.values())

    def reserved(self, session_id: str) -> int:
        """Tokens of the blocks the session holds (shared ones included)."""
        wid = self._by_session.get(session_id)
        return self._workers[wid].tables.room(session_id) if wid is not None else 0

    def tables(self, session_id: str) -> BlockTables:
        return self._workers[self._by_session[session_id]].tables

    def _fits_budget(self, blocks: int, worker_id: str) -> bool:
        if not self.kv_budget_bytes:  # the workers' caches are the budget: their free blocks say
            return True
        spec = self._workers[worker_id].spec
        return self.reserved_bytes() + blocks * spec.block_size * spec.kv_bytes_per_token <= self.kv_budget_bytes

    def reserve(self, session_id: str, tokens: int, prompt: Sequence[int] = (), salt: bytes = b"") -> Placement | None:
        """Place a session that needs room for `tokens` and starts with `prompt`: on the live
        worker with room whose prefix cache holds the longest part of the prompt; then on one
        whose steps took less than `pack_step_ms` and whose KV is under PACK_MAX_LOAD, the fullest
        (then the first) of them; then the least loaded. None when no worker has room or the byte
        budget would be exceeded."""
        assert session_id not in self._by_session, f"{session_id} already holds a reservation"
        best: tuple[tuple[int, int, float, str], WorkerSlot] | None = None
        for w in self.live:
            cached, taken = w.tables.placement_cost(prompt, tokens, salt)
            if taken > w.tables.allocator.num_free or not self._fits_budget(taken, w.spec.worker_id):
                continue
            # Packing: the workers with cheap steps by fullness (-sessions), the others by load.
            ms = w.step_ms if self.pack_step_ms else None
            cheap = ms is not None and ms < self.pack_step_ms and w.load < PACK_MAX_LOAD
            fill = (0, -len(w.sessions)) if cheap else (1, w.load)
            key = (-cached if self.cache_aware else 0, *fill, w.spec.worker_id)
            if best is None or key < best[0]:
                best = (key, w)
        if best is None:
            return None
        slot = best[1]
        worker_id = slot.spec.worker_id
        cached = slot.tables.place(session_id, prompt, tokens, salt)
        slot.sessions.add(session_id)
        self._by_session[session_id] = worker_id
        return Placement(worker_id, cached)

    def step_timed(self, worker_id: str, step_ns: int) -> None:
        """A step of the worker's took `step_ns` (an unknown worker's is ignored)."""
        slot = self._workers.get(worker_id)
        if slot is not None:
            slot.recent_steps_ms.append(step_ns / 1e6)

    def grow(self, session_id: str, tokens: int) -> bool:
        """Make a placed session's blocks hold `tokens`, if its worker and the budget have room;
        False (and nothing changed) otherwise."""
        worker_id = self._by_session[session_id]
        tables = self._workers[worker_id].tables
        need = tables.blocks_to_grow(session_id, tokens)
        if need == 0:
            return True
        if need > tables.allocator.num_free or not self._fits_budget(need, worker_id):
            return False
        try:
            tables.grow(session_id, tokens)
        except OutOfBlocks:  # (checked above)
            return False
        return True

    def new_blocks(self, session_id: str) -> tuple[int, ...]:
        """Blocks of the session its worker has not been told of; told of from now on."""
        return self.tables(session_id).unsent(session_id)

    def written(self, session_id: str, upto: int, tokens: TokenRange) -> None:
        """The session's first `upto` tokens are in its worker's KV: its full blocks among them
        may be shared from now on."""
        self.tables(session_id).written(session_id, upto, tokens)

    def release(self, session_id: str) -> None:
        worker_id = self._by_session.pop(session_id, None)
        if worker_id is None:
            return
        slot = self._workers[worker_id]
        slot.tables.free(session_id)
        slot.sessions.discard(session_id)

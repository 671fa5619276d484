"""What one tick asks the workers to do, and what came of it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvfleet_common.records import record
from scheduler_svc.core.types import DropCause, FinishReason, Sampling, TokenLogprob

if TYPE_CHECKING:
    from scheduler_svc.core.state import CoreState


@record
class PrefillWork:
    session_id: str
    worker_id: str
    token_ids: tuple[int, ...]  # this tick's chunk
    start_position: int  # tokens of the session already in the worker's KV
    last_chunk: bool  # the worker samples the next token after this chunk
    sampling: Sampling
    generated_so_far: int  # index of the token to sample
    block_ids: tuple[int, ...] = ()  # blocks added to the session's table since its last step
    cached_tokens: int = 0  # leading tokens of the chunk whose KV those blocks hold already
    epoch: int = 0  # the session's epoch when planned: a result for an older one is stale


@record
class DecodeWork:
    session_id: str
    worker_id: str
    token_id: int  # the session's latest token, entering the KV now
    position: int
    sampling: Sampling
    generated_so_far: int
    block_ids: tuple[int, ...] = ()  # blocks added to the session's table since its last step
    epoch: int = 0  # the session's epoch when planned: a result for an older one is stale
    # Planned while the step that samples the session's latest token was still out (overlapped
    # scheduling): token_id is unknown here; the worker uses the token it sampled last.
    last_sampled: bool = False


@dataclass(frozen=True)
class TickPlan:
    """What the planner decided (`SchedulerCore.plan()`): the steps to run, and what it settled
    while deciding (asked-for finishes, preempted sessions requeued, the KV both free on
    workers). Nothing of it has happened until the core applies it (`apply`)."""

    tick: int
    prefill: tuple[PrefillWork, ...]  # continued chunked prefills, then the admitted sessions' first chunks
    decode: tuple[DecodeWork, ...]
    finished: tuple[tuple[str, FinishReason], ...] = ()  # the finishes asked for (cancels, stop strings)
    requeued: tuple[str, ...] = ()  # preempted (preempt mode)
    release: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # worker -> sessions
    started: float = 0.0  # the core's clock when planned (the tick's start, for its figures)
    workloads: tuple[str, ...] = ()  # the workloads active when it was planned
    admitted: tuple[str, ...] = ()  # sessions taken from the queue (their first chunk is in prefill)
    # The core's books as they stand once the decisions are applied: the planner's draft, which
    # `apply` commits (only to the state it was planned from).
    draft: CoreState | None = field(default=None, compare=False, repr=False)

    @property
    def empty(self) -> bool:
        """No step to run (there may still be finishes and releases to deliver)."""
        return not self.prefill and not self.decode

    def by_worker(self) -> dict[str, tuple[list[PrefillWork], list[DecodeWork]]]:
        out: dict[str, tuple[list[PrefillWork], list[DecodeWork]]] = defaultdict(lambda: ([], []))
        for p in self.prefill:
            out[p.worker_id][0].append(p)
        for d in self.decode:
            out[d.worker_id][1].append(d)
        return dict(out)


class Dropped(NamedTuple):
    session_id: str
    why: str  # what the caller is told
    cause: DropCause = DropCause.UNAVAILABLE


@dataclass
class TickOutcome:
    """What came of a tick's steps (`update()`), or of a finish outside the tick rules."""

    tick: int
    tokens: list[tuple[str, int]] = field(default_factory=list)  # (session, token) in order
    # The logprobs of this outcome's tokens, for sessions that asked (a session has at most
    # one token in an outcome).
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    finished: list[tuple[str, FinishReason]] = field(default_factory=list)
    release: dict[str, list[str]] = field(default_factory=dict)  # worker -> sessions to free
    requeued: list[str] = field(default_factory=list)  # sessions to recompute
    # Sessions given up on: the stream ends with an error, nothing is recomputed.
    dropped: list[Dropped] = field(default_factory=list)

    def free(self, worker_id: str, session_id: str) -> None:
        self.release.setdefault(worker_id, []).append(session_id)

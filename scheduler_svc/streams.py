"""What a caller's stream carries, before any protobuf: the runtime puts each session's events
(tokens with their text, a finish with its usage, a drop, a cut-off) on its submission's queue;
`batches` reads them as the servicer streams them, ending a stream that was given up on with a
domain error the servicer maps to a status code."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvfleet_common.records import record
from scheduler_svc.core import DropCause, FinishReason
from scheduler_svc.output import LogprobText, Usage


@record
class SessionEvent:
    session_id: str
    token: int | None = None
    text: str = ""  # the text the token (or, with finish, the end of the output) adds
    logprob: LogprobText | None = None  # the token's, when the session asked for logprobs
    finish: FinishReason | None = None
    usage: Usage | None = None  # with finish
    worker_id: str = ""
    dropped: str = ""  # the session was given up on, unfinished (the reason)
    drop_cause: DropCause = DropCause.UNAVAILABLE  # with dropped: what kind of error the caller gets
    cut_off: str = ""  # the stream's client stopped reading; its sessions were cancelled (the reason)


@dataclass(frozen=True)
class Submission:
    workload_id: str | None
    session_ids: tuple[str, ...]
    events: asyncio.Queue[SessionEvent]


class SessionDropped(Exception):
    """The scheduler gave up on a session (no live worker for too long, KV lost too often, moved
    too often), or a worker refused or failed it alone."""

    def __init__(self, why: str, cause: DropCause) -> None:
        super().__init__(why)
        self.cause = cause


class StreamCutOff(Exception):
    """The stream's client stopped reading; the runtime cancelled its sessions."""


async def batches(
    events: asyncio.Queue[SessionEvent], time_remaining: Callable[[], float | None]
) -> AsyncIterator[list[SessionEvent]]:
    """Every event waiting in the queue at once, within the client's deadline (`time_remaining`:
    seconds, None for none; past it, asyncio.TimeoutError). A drop or a cut-off ends the stream
    with SessionDropped or StreamCutOff."""
    while True:
        remaining = time_remaining()
        if remaining is None:
            first = await events.get()
        else:
            first = await asyncio.wait_for(events.get(), max(remaining, 0.0))
        batch = [first]
        while not events.empty():
            batch.append(events.get_nowait())
        cut_off = [ev.cut_off for ev in batch if ev.cut_off]
        if cut_off:
            raise StreamCutOff(cut_off[0])
        dropped = [ev for ev in batch if ev.dropped]
        if dropped:
            raise SessionDropped(dropped[0].dropped, dropped[0].drop_cause)
        yield batch


def by_session(batch: list[SessionEvent]) -> dict[str, list[SessionEvent]]:
    """A batch's events by session, each session's in order (one message each)."""
    out: dict[str, list[SessionEvent]] = {}
    for ev in batch:
        out.setdefault(ev.session_id, []).append(ev)
    return out

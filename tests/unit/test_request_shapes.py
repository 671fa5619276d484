"""What moved out of the servicer: a Generate's n choices (SessionRequest.choices) and the event
batches a stream reads (scheduler_svc.streams), each without gRPC."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.core import DropCause, FinishReason, Sampling, SessionRequest
from scheduler_svc.streams import SessionDropped, SessionEvent, StreamCutOff, batches


def test_one_choice_is_the_request_itself():
    req = SessionRequest(prompt_ids=(1, 2), max_new_tokens=3)
    assert req.choices(1, "g") == (req,) and req.choices(0, "g") == (req,)


def test_n_choices_share_a_prefix_group_and_are_seeded_seed_plus_index():
    req = SessionRequest(prompt_ids=(1, 2), max_new_tokens=3, sampling=Sampling(temperature=1.0, seed=2**64 - 2))
    choices = req.choices(3, "g1")
    assert [c.prefix_group for c in choices] == ["g1"] * 3
    assert [c.sampling.seed for c in choices] == [2**64 - 2, 2**64 - 1, 0]  # mod 2**64
    assert all(c.prompt_ids == req.prompt_ids and c.sampling.temperature == 1.0 for c in choices)


def _drain(events: list[SessionEvent]) -> list[list[SessionEvent]]:
    async def run() -> list[list[SessionEvent]]:
        queue: asyncio.Queue[SessionEvent] = asyncio.Queue()
        for ev in events:
            queue.put_nowait(ev)
        out = []
        async for batch in batches(queue, lambda: None):
            out.append(batch)
            if any(ev.finish is not None for ev in batch):
                break
        return out

    return asyncio.run(run())


def test_a_batch_is_every_event_waiting():
    events = [SessionEvent("s", token=1), SessionEvent("s", token=2), SessionEvent("s", finish=FinishReason.EOS)]
    assert _drain(events) == [events]


def test_a_drop_or_a_cut_off_ends_the_stream_with_its_error():
    with pytest.raises(SessionDropped) as drop:
        _drain([SessionEvent("s", token=1), SessionEvent("s", dropped="gone", drop_cause=DropCause.FAILED)])
    assert str(drop.value) == "gone" and drop.value.cause == DropCause.FAILED
    with pytest.raises(StreamCutOff, match="slow"):
        _drain([SessionEvent("s", cut_off="slow")])


def test_the_deadline_ends_the_wait():
    async def run() -> None:
        async for _ in batches(asyncio.Queue(), lambda: 0.0):
            pass

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(run())

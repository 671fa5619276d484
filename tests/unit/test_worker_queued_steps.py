"""With a step executor (one thread, as an in-process cluster gives each worker), the worker
queues each step there as it comes: a step sent ahead (overlapped scheduling) starts the moment
the one before it ends, without the event loop; one cancelled while queued never runs; one
cancelled while running marks the worker busy until it returns. The engine's step is replaced by
a recorder that can hold a step (this layer only)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

import pytest

from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.config import WorkerConfig
from worker_svc.convert import StepCall
from worker_svc.engine import Engine, EngineConfig
from worker_svc.server import WorkerServicer

WAIT_S = 30.0  # only reached when the behaviour is wrong


class Recorder:
    """Stands in for Engine.step: records each step's number and holds those asked to."""

    def __init__(self) -> None:
        self.ran: list[int] = []
        self.started = {n: threading.Event() for n in range(1, 5)}
        self.release = {n: threading.Event() for n in range(1, 5)}
        self.hold: set[int] = set()
        self.thread_ids: set[int] = set()

    def step(self, prefill, decode, kv_views=None):  # type: ignore[no-untyped-def]
        n = len(decode)  # the tests number a step by its "decode" list's length
        self.thread_ids.add(threading.get_ident())
        self.ran.append(n)
        self.started[n].set()
        if n in self.hold:
            assert self.release[n].wait(WAIT_S)
        return f"out-{n}"


def _call(n: int) -> StepCall:
    return StepCall(
        prefill=[], decode=[None] * n, kv_views=None, release_session_ids=(), experiment_id="", experiment_arm=""
    )  # type: ignore[list-item]


@pytest.fixture
def compute() -> Iterator[Executor]:
    executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
    yield executor
    executor.shutdown(wait=True)


def _servicer(executor: Executor, recorder: Recorder) -> WorkerServicer:
    engine = Engine(GQA_CFG, tiny_weights(GQA_CFG, seed=5), EngineConfig(block_size=4, num_blocks=16))
    servicer = WorkerServicer(WorkerConfig(model="tiny"), GQA_CFG, engine, executor=executor)
    engine.step = recorder.step  # type: ignore[method-assign]
    servicer.metrics.observe_step = lambda *a: None  # type: ignore[method-assign]
    return servicer


def _held_first(compute: Executor) -> tuple[Recorder, WorkerServicer]:
    """A servicer whose first step (numbered 1) holds until ``recorder.release[1]`` is set."""
    recorder = Recorder()
    recorder.hold = {1}
    return recorder, _servicer(compute, recorder)


async def _running_and_queued(servicer: WorkerServicer, recorder: Recorder) -> tuple[asyncio.Task, asyncio.Task]:
    """Step 1 running (held), then step 2 sent: its handler has run up to its await."""
    first = asyncio.create_task(servicer._locked_step(_call(1)))
    await asyncio.to_thread(recorder.started[1].wait, WAIT_S)
    second = asyncio.create_task(servicer._locked_step(_call(2)))
    await asyncio.sleep(0)
    return first, second


def test_a_step_sent_ahead_starts_when_the_one_before_ends_without_the_event_loop(compute) -> None:
    recorder, servicer = _held_first(compute)

    async def run() -> list:
        first, second = await _running_and_queued(servicer, recorder)
        recorder.release[1].set()
        # The event loop is blocked here: were the second step waiting for the loop (a lock
        # released by the first's handler), it could not start.
        started = recorder.started[2].wait(10.0)
        assert started, "the queued step waited for the event loop"
        return [await first, await second]

    outs = asyncio.run(run())
    assert [o[0] for o in outs] == ["out-1", "out-2"]
    assert recorder.ran == [1, 2]
    assert recorder.thread_ids == {compute_thread_id(compute)}


def compute_thread_id(executor: Executor) -> int:
    return executor.submit(threading.get_ident).result(WAIT_S)


def test_a_step_cancelled_while_queued_never_runs(compute) -> None:
    recorder, servicer = _held_first(compute)

    async def run() -> None:
        first, second = await _running_and_queued(servicer, recorder)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        recorder.release[1].set()
        await first
        await servicer._locked_step(_call(3))
        assert servicer._abandoned is None  # nothing of it ran: the worker is not busy

    asyncio.run(run())
    assert recorder.ran == [1, 3]


def test_a_step_cancelled_while_running_keeps_the_worker_busy_until_it_returns(compute) -> None:
    recorder, servicer = _held_first(compute)

    async def run() -> None:
        first = asyncio.create_task(servicer._locked_step(_call(1)))
        await asyncio.to_thread(recorder.started[1].wait, WAIT_S)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert servicer._abandoned is not None  # GetInfo answers UNAVAILABLE meanwhile
        queued = asyncio.create_task(servicer._locked_step(_call(2)))  # waits for it on the thread
        await asyncio.sleep(0.05)
        assert recorder.ran == [1]
        recorder.release[1].set()
        assert (await queued)[0] == "out-2"
        assert servicer._abandoned is None

    asyncio.run(run())
    assert recorder.ran == [1, 2]


def test_steps_inline_and_an_executor_are_refused_together(compute) -> None:
    engine = Engine(GQA_CFG, tiny_weights(GQA_CFG, seed=5), EngineConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="not both"):
        WorkerServicer(WorkerConfig(model="tiny"), GQA_CFG, engine, steps_inline=True, executor=compute)

"""A Step whose deadline expires must not corrupt the worker.

At the deadline the step is cancelled (a Step call's handler by grpc.aio; a streamed step by the
scheduler cancelling its stream), but the step's thread cannot be stopped: until it
returns, the worker must not run another mutation of its KV books (a Release, another Step),
and must not tell the scheduler's dead-worker probe that it is ready again.

Slowness is injected in the model's forward, only for the first few big steps: a sleep that
outlives the scheduler's short step timeout by a known margin, or, where the test must act while
the step still runs, a gate the forward waits at until the test opens it, so that what happens
"while the step runs" does not depend on the machine's load. Everything else is real: gRPC
servers on loopback ports, the tiny model, the scheduler's own timeout and probe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.helpers.worker_stats import worker_stats
from tests.helpers.worker_steps import prefill_item
from tests.integration.inproc import InProcessCluster
from worker_svc.config import WorkerConfig
from worker_svc.engine import Engine
from worker_svc.model.llama import LlamaModel
from worker_svc.server import WorkerServicer

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


class MutationWatch:
    """Wraps Engine.step / Engine.release (every engine in the process) and records whether two
    threads were ever inside one engine's at once; optionally makes big forwards slow. (The
    in-process workers share one event loop thread, so engines are told apart.)

    ``order`` lists, as they happen: "forward in" / "forward out" around each slow forward,
    "release" when an engine's release starts and "release step" when the worker's Step handler
    is entered for a step that only releases."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.overlaps = 0
        self.slow_s = 0.0  # extra seconds for a forward of >= slow_min_tokens tokens
        self.slow_min_tokens = 1
        self.slow_left = 0  # how many forwards are made slow
        self.gate: threading.Event | None = None  # set by gate_forward: slow forwards wait for it
        self.entered = threading.Event()  # a slow forward has started
        self.order: list[str] = []
        self.inside: dict[tuple[int, int], int] = {}  # (engine, thread) -> nesting depth
        self._guard = threading.Lock()
        watch = self
        step, release = Engine.step, Engine.release
        forward, whole_step = LlamaModel.forward, LlamaModel.whole_step
        step_rpc = WorkerServicer.Step

        def watched(fn, name: str = ""):
            def call(self, *args, **kwargs):
                watch._enter(id(self))
                if name:
                    watch.order.append(name)
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    watch._leave(id(self))

            return call

        def slowed(fn, tokens_of):  # a model's forward: its per-op path, or a whole step
            def call(self, *args, **kwargs):
                if watch._take_slow(tokens_of(*args)):
                    watch.order.append("forward in")
                    watch.entered.set()
                    if watch.gate is not None:
                        assert watch.gate.wait(60), "the test never opened the gate"
                    else:
                        time.sleep(watch.slow_s)
                    try:
                        return fn(self, *args, **kwargs)
                    finally:
                        watch.order.append("forward out")
                return fn(self, *args, **kwargs)

            return call

        async def counted_step_rpc(self, request, context):
            if not request.prefill and not request.decode and not request.HasField("decode_columns"):
                watch.order.append("release step")
            return await step_rpc(self, request, context)

        monkeypatch.setattr(Engine, "step", watched(step))
        monkeypatch.setattr(Engine, "release", watched(release, "release"))
        monkeypatch.setattr(LlamaModel, "forward", slowed(forward, lambda st, *a: int(st.tokens.shape[0])))
        monkeypatch.setattr(LlamaModel, "whole_step", slowed(whole_step, lambda cache, rows, *a: rows.rows))
        monkeypatch.setattr(WorkerServicer, "Step", counted_step_rpc)

    def gate_forward(self) -> None:
        """The next forward waits until ``open`` instead of sleeping."""
        self.gate, self.slow_left = threading.Event(), 1

    def open(self) -> None:
        if self.gate is not None:
            self.gate.set()

    def _enter(self, engine: int) -> None:
        me = (engine, threading.get_ident())
        with self._guard:
            if any(e == engine and t != me[1] for e, t in self.inside):
                self.overlaps += 1
            self.inside[me] = self.inside.get(me, 0) + 1

    def _leave(self, engine: int) -> None:
        me = (engine, threading.get_ident())
        with self._guard:
            self.inside[me] -= 1
            if not self.inside[me]:
                del self.inside[me]

    def _take_slow(self, tokens: int) -> bool:
        with self._guard:
            if self.slow_left > 0 and tokens >= self.slow_min_tokens:
                self.slow_left -= 1
                return True
            return False


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[MutationWatch]:
    w = MutationWatch(monkeypatch)
    yield w
    w.open()


def _prompt(n: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt + 1) % CFG.vocab_size for i in range(n)]


def test_timed_out_steps_never_corrupt_the_worker(watch: MutationWatch) -> None:
    """Long prompts against a short --step-timeout: the first big steps outlive it, the
    scheduler marks both workers dead, probes them and recomputes. Every session still gets
    the clean run's greedy tokens, no two engine mutations ever overlap, and the workers end
    holding nothing, with used + free blocks equal to the total."""
    watch.slow_s, watch.slow_min_tokens, watch.slow_left = 1.0, 128, 2
    prompts = [_prompt(300, s) for s in range(4)]
    num_blocks = 256
    with (
        InProcessCluster(workers=2, step_timeout_s=0.25, num_blocks=num_blocks) as c,
        SchedulerClient(c.address) as client,
    ):
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: client.generate(build_request(p, 12), timeout=60), prompts))
        deadline = time.monotonic() + 10
        while True:
            stats = [worker_stats(a, timeout=10) for a in c.worker_addresses]
            if all(s.used_blocks == 0 and s.active_sessions == 0 for s in stats) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert watch.slow_left == 0, "the injected slow steps never ran: the test proved nothing"
    for p, r in zip(prompts, results):
        assert list(r.token_ids) == reference_generate(CFG, WEIGHTS, p, 12)
    assert watch.overlaps == 0, "two engine mutations ran at once"
    for s in stats:
        assert s.used_blocks + s.free_blocks == num_blocks
        assert (s.used_blocks, s.active_sessions) == (0, 0), s


async def _with_worker(body, watch: MutationWatch, inline_step_s: float = 0.0):
    """Run ``body(stub)`` against a real worker server on a loopback port; the watch's gate is
    opened before the server stops, so that no forward is left waiting."""
    from worker_svc.server import create_server

    config = WorkerConfig(port=0, metrics_port=0, num_blocks=64, block_size=16, inline_step_s=inline_step_s)
    server, port, _ = await create_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await body(wpb_grpc.WorkerStub(ch))
    finally:
        watch.open()
        await server.stop(0)


def _prefill(sid: str, n: int) -> wpb.StepRequest:
    first = {"a": 0, "b": 16}.get(sid, 32)  # blocks of their own, as the scheduler would give
    return wpb.StepRequest(prefill=[prefill_item(sid, _prompt(n, 1), first_block=first)])


ABANDONED = "a step's RPC was cancelled while it ran"  # worker_svc.server's warning


async def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"{what}: not within {timeout_s:.0f}s"
        await asyncio.sleep(0.01)


async def _step_abandoned_at_its_deadline(
    stub: wpb_grpc.WorkerStub, watch: MutationWatch, caplog: pytest.LogCaptureFixture, sid: str
) -> None:
    """A Step whose forward waits at the watch's gate: its deadline expires while it runs, on any
    machine. Returns once the worker has said it abandoned the RPC (its warning), the forward
    still waiting. A deadline that expired before the step even started (a loaded machine) is
    retried with a longer one."""
    watch.gate_forward()
    for deadline in (0.2, 1.0, 5.0):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(_prefill(sid, 40), timeout=deadline)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if await asyncio.to_thread(watch.entered.wait, 10):
            break
    else:
        pytest.fail("the step never started before its deadline")
    await _until(lambda: ABANDONED in caplog.text, "the worker's warning that it abandoned the step")
    assert watch.order == ["forward in"] and not watch.gate.is_set()


def test_release_after_a_cancelled_step_waits_for_it(watch: MutationWatch, caplog) -> None:
    """The Step's deadline expires mid-forward; a release (a step with no items) that reaches the
    worker while that step's thread still runs does not run until the thread has returned, and
    then frees what the step admitted. (The forward waits at a gate, so the order is the same on
    any machine.)"""

    async def body(stub: wpb_grpc.WorkerStub) -> None:
        await _step_abandoned_at_its_deadline(stub, watch, caplog, "a")
        release = asyncio.ensure_future(stub.Step(wpb.StepRequest(release_session_ids=["a"]), timeout=60))
        await _until(lambda: "release step" in watch.order, "the release reaching the worker")
        # Deterministic while the gate is shut: the abandoned step holds the worker's lock.
        done, _ = await asyncio.wait({release}, timeout=0.5)
        assert not done, "a release ran while an abandoned step still ran"
        watch.open()
        await release
        stats = await stub.GetStats(wpb.GetStatsRequest(), timeout=10)
        # The step had admitted "a" (its 3 blocks) before the release forgot it.
        assert (stats.used_blocks, stats.free_blocks, stats.active_sessions) == (0, 64, 0)

    with caplog.at_level(logging.WARNING, logger="worker_svc.server"):
        asyncio.run(_with_worker(body, watch))
    assert watch.order == ["forward in", "release step", "forward out", "release"], watch.order
    assert watch.overlaps == 0


def test_worker_is_unavailable_to_the_probe_until_an_abandoned_step_returns(watch: MutationWatch, caplog) -> None:
    """GetInfo (the scheduler's dead-worker probe) answers UNAVAILABLE while a timed-out step
    still runs, and answers again once it has returned; a new Step then runs normally."""

    async def body(stub: wpb_grpc.WorkerStub) -> None:
        await _step_abandoned_at_its_deadline(stub, watch, caplog, "a")
        for _ in range(3):  # as often as asked, while the step runs
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetInfo(wpb.GetInfoRequest(), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        watch.open()
        end = time.monotonic() + 60
        while True:
            try:
                await stub.GetInfo(wpb.GetInfoRequest(), timeout=30)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < end
                await asyncio.sleep(0.05)
        assert watch.order == ["forward in", "forward out"]  # answered only once the step returned
        out = await stub.Step(_prefill("b", 8), timeout=30)
        assert out.results[0].status == wpb.ITEM_OK and out.results[0].kv_tokens == 8

    with caplog.at_level(logging.WARNING, logger="worker_svc.server"):
        asyncio.run(_with_worker(body, watch))
    assert watch.overlaps == 0

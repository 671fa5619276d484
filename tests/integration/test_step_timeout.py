"""A Step whose deadline expires must not corrupt the worker.

grpc.aio cancels the handler at the deadline, but the step's thread cannot be stopped: until it
returns, the worker must not run another mutation of its KV books (a Release, another Step),
and must not tell the scheduler's dead-worker probe that it is ready again.

Slowness is injected (a sleep in the model's forward, only for the first few big steps) so that
a step outlives a short deadline by a known margin on any machine; everything else is real:
gRPC servers on loopback ports, the tiny model, the scheduler's own timeout and probe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
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
from tests.integration.inproc import InProcessCluster
from worker_svc.config import WorkerConfig
from worker_svc.engine import Engine
from worker_svc.model.llama import LlamaModel

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


class MutationWatch:
    """Wraps Engine.step / Engine.release (every engine in the process) and records whether two
    threads were ever inside one engine's at once; optionally makes big forwards slow. (The
    in-process workers share one event loop thread, so engines are told apart.)"""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.overlaps = 0
        self.slow_s = 0.0  # extra seconds for a forward of >= slow_min_tokens tokens
        self.slow_min_tokens = 1
        self.slow_left = 0  # how many forwards are made slow
        self.inside: dict[tuple[int, int], int] = {}  # (engine, thread) -> nesting depth
        self._guard = threading.Lock()
        watch = self
        step, release, forward = Engine.step, Engine.release, LlamaModel.forward

        def watched(fn):
            def call(self, *args, **kwargs):
                watch._enter(id(self))
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    watch._leave(id(self))

            return call

        def slow_forward(self, st, *args, **kwargs):
            if watch._take_slow(int(st.tokens.shape[0])):
                time.sleep(watch.slow_s)
            return forward(self, st, *args, **kwargs)

        monkeypatch.setattr(Engine, "step", watched(step))
        monkeypatch.setattr(Engine, "release", watched(release))
        monkeypatch.setattr(LlamaModel, "forward", slow_forward)

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
    yield MutationWatch(monkeypatch)


def _stats(address: str) -> wpb.WorkerStats:
    with grpc.insecure_channel(address) as ch:
        return wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=10)


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
            stats = [_stats(a) for a in c.worker_addresses]
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


async def _with_worker(body, inline_step_s: float = 0.0):
    """Run ``body(stub)`` against a real worker server on a loopback port."""
    from worker_svc.server import create_server

    config = WorkerConfig(port=0, metrics_port=0, num_blocks=64, block_size=16, inline_step_s=inline_step_s)
    server, port, _ = await create_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await body(wpb_grpc.WorkerStub(ch))
    finally:
        await server.stop(0)


def _prefill(sid: str, n: int) -> wpb.StepRequest:
    return wpb.StepRequest(prefill=[wpb.PrefillItem(session_id=sid, token_ids=_prompt(n, 1), last_chunk=True)])


def test_release_after_a_cancelled_step_waits_for_it(watch: MutationWatch) -> None:
    """The Step's deadline expires mid-forward; a Release sent at once runs only after the
    abandoned step's thread has returned, so it frees what that step admitted."""
    watch.slow_s, watch.slow_left = 0.8, 1

    async def body(stub: wpb_grpc.WorkerStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(_prefill("a", 40), timeout=0.2)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        released = await stub.Release(wpb.ReleaseRequest(session_ids=["a"]), timeout=10)
        assert released.released == 1  # the step had admitted "a" before it was freed
        stats = await stub.GetStats(wpb.GetStatsRequest(), timeout=10)
        assert (stats.used_blocks, stats.free_blocks, stats.active_sessions) == (0, 64, 0)

    asyncio.run(_with_worker(body))
    assert watch.slow_left == 0
    assert watch.overlaps == 0


def test_worker_is_unavailable_to_the_probe_until_an_abandoned_step_returns(watch: MutationWatch) -> None:
    """GetInfo (the scheduler's dead-worker probe) answers UNAVAILABLE while a timed-out step
    still runs, and answers again once it has returned; a new Step then runs normally."""
    watch.slow_s, watch.slow_left = 0.8, 1

    async def body(stub: wpb_grpc.WorkerStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Step(_prefill("a", 40), timeout=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetInfo(wpb.GetInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        end = time.monotonic() + 10
        while True:
            try:
                await stub.GetInfo(wpb.GetInfoRequest(), timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < end
                await asyncio.sleep(0.05)
        out = await stub.Step(_prefill("b", 8), timeout=10)
        assert out.results[0].status == wpb.ITEM_OK and out.results[0].kv_tokens == 8

    asyncio.run(_with_worker(body))
    assert watch.overlaps == 0

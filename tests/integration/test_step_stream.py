"""Steps over one StepStream keep a Step call's contract: the same answers, token-exact; a step's
own error fails that step only; the trace context reaches the worker's spans; a step past its
deadline fails as DEADLINE_EXCEEDED, the steps behind it are cancelled and never run, and the
worker stays busy until the running one returns; a worker without the stream is served by Step.

Real gRPC servers (tiny-model workers) on loopback ports and the scheduler's own WorkerClient;
only the engine's step is wrapped where a test must hold a step running."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common import grpcutil
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.convert import step_request, step_results
from scheduler_svc.core import DecodeWork, PrefillWork, Sampling
from scheduler_svc.workers import WorkerCallFailed, WorkerClient
from worker_svc import server as worker_server
from worker_svc.config import WorkerConfig

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10], [4, 5]]
NEW_TOKENS = 12
WAIT_S = 30.0  # only reached when the behaviour is wrong


@asynccontextmanager
async def _worker(wrap_step: Callable[[Any], Any] | None = None) -> AsyncIterator[tuple[str, Any]]:
    """A tiny-model worker on a loopback port with a step thread (as a worker process has);
    ``wrap_step`` replaces its engine's step with a wrapper of it."""
    config = WorkerConfig(host="127.0.0.1", port=0, model="tiny", metrics_port=0, num_blocks=64, block_size=16)
    cfg, engine = worker_server.build_engine(config, (CFG, WEIGHTS))
    if wrap_step is not None:
        engine.step = wrap_step(engine.step)
    executor = ThreadPoolExecutor(1, thread_name_prefix="steps")
    server, port, _ = await worker_server.create_server(config, (cfg, engine), executor)
    try:
        yield f"127.0.0.1:{port}", server
    finally:
        await server.stop(0.5)
        executor.shutdown(wait=False)


async def _client(address: str, stream_steps: bool) -> WorkerClient:
    client = WorkerClient.open(address, stream_steps=stream_steps)
    await client.wait_ready(10)
    return client


class Hold:
    """Wraps an engine's step: records each step's prefill count, and holds a step with prefill
    items at a gate until the test sets ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.ran: list[int] = []

    def __call__(self, step):  # type: ignore[no-untyped-def]
        def held(prefill, decode, kv_views=None):  # type: ignore[no-untyped-def]
            self.ran.append(len(prefill))
            if prefill:
                self.entered.set()
                assert self.gate.wait(WAIT_S)
            return step(prefill, decode, kv_views=kv_views)

        return held

    async def running(self) -> None:
        """Return once a held step has started."""
        assert await asyncio.to_thread(self.entered.wait, WAIT_S)


@asynccontextmanager
async def _connected(
    stream_steps: bool = True, wrap_step: Callable[[Any], Any] | None = None
) -> AsyncIterator[tuple[WorkerClient, Any]]:
    """The scheduler's client of a fresh worker (see ``_worker``), and the worker's server."""
    async with _worker(wrap_step) as (address, server):
        client = await _client(address, stream_steps)
        try:
            yield client, server
        finally:
            await client.close()


def _prefill(sid: str, prompt: list[int]) -> PrefillWork:
    blocks = tuple(range(int(sid) * 4, int(sid) * 4 + 4))  # 64 tokens a session at most
    return PrefillWork(sid, "w", tuple(prompt), 0, True, Sampling(), 0, blocks)


async def _generate(client: WorkerClient, span: Any = None) -> list[list[int]]:
    """Every prompt prefilled in one step, then decoded step by step (one step per call)."""
    out = await client.step([_prefill(str(i), p) for i, p in enumerate(PROMPTS)], [], [], None, span, 10)
    tokens = [[out[str(i)].token_id] for i in range(len(PROMPTS))]
    for n in range(1, NEW_TOKENS):
        decode = [DecodeWork(str(i), "w", t[-1], len(PROMPTS[i]) + n - 1, Sampling(), n) for i, t in enumerate(tokens)]
        out = await client.step([], decode, [], None, span, 10)
        for i, t in enumerate(tokens):
            t.append(out[str(i)].token_id)
    return tokens


def test_streamed_steps_answer_token_exact_as_step_calls_do() -> None:
    expected = [reference_generate(CFG, WEIGHTS, p, NEW_TOKENS) for p in PROMPTS]

    async def main() -> None:
        for stream_steps in (True, False):
            async with _connected(stream_steps) as (client, _):
                assert client.info is not None and client.info.step_stream
                assert await _generate(client) == expected, stream_steps
                # The stream is the path taken, and one stream served every step.
                assert (client._stream is not None) == stream_steps
                if stream_steps:
                    assert client._stream is not None and client._stream.broken is None

    asyncio.run(main())


def test_the_worker_answers_as_columns_when_asked_and_as_messages_otherwise() -> None:
    """The same prefill, once as each asks: the same result, in the form asked for."""

    async def main() -> None:
        async with _worker() as (address, _), grpc.aio.insecure_channel(address) as channel:
            stub = wpb_grpc.WorkerStub(channel)
            answers = []
            for sid, columns in (("1", False), ("2", True)):
                req = step_request([_prefill(sid, PROMPTS[0])], [])
                assert req.result_columns  # the scheduler asks for columns
                req.result_columns = columns
                answers.append(await stub.Step(req, timeout=10))
            as_messages, as_columns = answers
            assert len(as_messages.results) == 1 and not as_messages.HasField("columns")
            assert list(as_columns.columns.session_ids) == ["2"] and not as_columns.results
            first, second = step_results(as_messages)["1"], step_results(as_columns)["2"]
            assert first.token_id == reference_generate(CFG, WEIGHTS, PROMPTS[0], 1)[0]
            assert replace(first, session_id="2") == second

    asyncio.run(main())


def test_a_worker_without_the_stream_is_served_by_step_calls() -> None:
    """A worker from before StepStream (WorkerInfo.step_stream unset) gets Step calls."""

    async def main() -> None:
        async with _connected() as (client, _):
            assert client.info is not None
            client.info.step_stream = False
            assert len((await _generate(client))[0]) == NEW_TOKENS
            assert client._stream is None

    asyncio.run(main())


def test_a_step_s_own_error_fails_that_step_and_the_stream_goes_on() -> None:
    async def main() -> None:
        async with _connected() as (client, _):
            await client.step([_prefill("0", PROMPTS[0])], [], [], None, None, 10)
            stream = client._stream
            twice = [_prefill("1", PROMPTS[1]), _prefill("1", PROMPTS[1])]
            with pytest.raises(WorkerCallFailed) as refused:
                await client.step(twice, [], [], None, None, 10)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "same session twice" in refused.value.details
            assert not refused.value.worker_unreachable  # the worker stays in use ...
            decode = [DecodeWork("0", "w", 5, len(PROMPTS[0]), Sampling(), 1)]
            out = await client.step([], decode, [], None, None, 10)  # ... on the same stream
            assert out["0"].token_id is not None and client._stream is stream and stream is not None
            assert stream.broken is None

    asyncio.run(main())


def test_the_trace_context_travels_with_each_streamed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    parents: list[SpanContext] = []
    emit = worker_server.emit_step_spans

    def record(parent, *args, **kw):  # type: ignore[no-untyped-def]
        parents.append(trace.get_current_span(parent).get_span_context())
        return emit(parent, *args, **kw)

    monkeypatch.setattr(worker_server, "emit_step_spans", record)
    tick = SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))

    async def main() -> None:
        async with _connected() as (client, _):
            await _generate(client, NonRecordingSpan(tick))
            assert client._stream is not None

    asyncio.run(main())
    assert len(parents) == NEW_TOKENS
    assert {(p.trace_id, p.span_id) for p in parents} == {(tick.trace_id, tick.span_id)}


def test_a_step_of_only_releases_or_a_reset_writes_no_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler frees finished sessions with a step of releases alone when it is idle, and
    takes a worker back with a step that only resets: no model work, no tick to hang under. Their
    spans were a five-span trace of their own per request (half of `kvfleet traces`' list)."""
    written: list[int] = []
    emit = worker_server.emit_step_spans

    def record(parent, start_ns, profile, layers, attrs):  # type: ignore[no-untyped-def]
        written.append(int(attrs["kvfleet.step.prefill_items"]) + int(attrs["kvfleet.step.decode_items"]))
        return emit(parent, start_ns, profile, layers, attrs)

    monkeypatch.setattr(worker_server, "emit_step_spans", record)

    async def main() -> None:
        async with _connected() as (client, _):
            out = await client.step([_prefill("0", PROMPTS[0])], [], [], None, None, 10)
            assert out["0"].status.name == "OK"
            assert await client.step([], [], ["0"], None, None, 10) == {}  # releases alone
            client.reset_pending = True
            assert await client.step([], [], [], None, None, 10) == {}  # a reset alone
            await client.step([_prefill("1", PROMPTS[1])], [], [], None, None, 10)

    asyncio.run(main())
    assert written == [1, 1]  # the two steps with an item each, and nothing for the other two


def test_a_step_past_its_deadline_cancels_the_stream_and_the_steps_behind_it_never_run() -> None:
    hold = Hold()

    async def main() -> None:
        async with _connected(wrap_step=hold) as (client, _):
            try:
                held = asyncio.ensure_future(client.step([_prefill("0", PROMPTS[0])], [], [], None, None, 0.5))
                await hold.running()
                behind = client.step([], [], ["9"], None, None, 30)  # a release queued behind it
                got = await asyncio.gather(held, behind, return_exceptions=True)
                assert [type(g) for g in got] == [WorkerCallFailed, WorkerCallFailed], got
                assert got[0].code == grpc.StatusCode.DEADLINE_EXCEEDED, got[0]
                assert got[1].code == grpc.StatusCode.CANCELLED, got[1]
                assert all(g.worker_unreachable for g in got)  # the scheduler moves the sessions
                # The worker is busy while the held step runs: its probe answers UNAVAILABLE.
                with pytest.raises(grpc.aio.AioRpcError) as busy:
                    await client.fetch_info(timeout=10)
                assert busy.value.code() == grpc.StatusCode.UNAVAILABLE
                hold.gate.set()
                await client.wait_ready(WAIT_S)
                assert hold.ran == [1]  # the step queued behind the held one never ran
                # Taken back with a reset, over a new stream.
                client.reset_pending = True
                out = await client.step([_prefill("1", PROMPTS[1])], [], [], None, None, 10)
                assert out["1"].token_id is not None and client._stream is not None and client._stream.broken is None
                assert hold.ran == [1, 1]
            finally:
                hold.gate.set()

    asyncio.run(main())


def test_a_stream_broken_by_the_worker_s_end_fails_its_steps_as_unreachable() -> None:
    hold = Hold()

    async def main() -> None:
        async with _connected(wrap_step=hold) as (client, server):
            try:
                pending = asyncio.ensure_future(client.step([_prefill("0", PROMPTS[0])], [], [], None, None, 30))
                await hold.running()
                # The worker's server stops (as its process ending would) with the step unanswered.
                stopping = asyncio.ensure_future(server.stop(0))
                with pytest.raises(WorkerCallFailed) as gone:
                    await pending
                assert gone.value.worker_unreachable, gone.value
                hold.gate.set()
                await stopping
            finally:
                hold.gate.set()

    asyncio.run(main())


def test_a_draining_worker_answers_the_steps_it_took_refuses_new_ones_and_ends_the_stream() -> None:
    hold = Hold()

    async def main() -> None:
        config = WorkerConfig(host="127.0.0.1", port=0, model="tiny", metrics_port=0, num_blocks=64, block_size=16)
        cfg, engine = worker_server.build_engine(config, (CFG, WEIGHTS))
        engine.step = hold(engine.step)
        executor = ThreadPoolExecutor(1, thread_name_prefix="steps")
        server, port, _, servicer = await worker_server.start_worker(config, (cfg, engine), executor)  # type: ignore[arg-type]
        client = await _client(f"127.0.0.1:{port}", True)
        try:
            taken = asyncio.ensure_future(client.step([_prefill("0", PROMPTS[0])], [], [], None, None, 60))
            await hold.running()
            servicer.drain()
            stopping = asyncio.ensure_future(server.stop(300))  # a grace far beyond the wait below
            with pytest.raises(WorkerCallFailed) as refused:
                await client.step([], [], ["9"], None, None, 60)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE and refused.value.worker_unreachable
            assert refused.value.details == worker_server.DRAINING
            hold.gate.set()
            assert (await taken)["0"].token_id is not None  # the step it took still answers
            await asyncio.wait_for(stopping, 60)  # and the stream ends: the stop does not wait its grace
            assert hold.ran == [1]  # the refused step never ran
        finally:
            hold.gate.set()
            await client.close()
            executor.shutdown(wait=False)

    asyncio.run(main())


def _short_lived_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker servers started from now on send GOAWAY at a connection's age of 0.5 s (+-10 %) and
    cut its streams 2 s later (grpcutil's are 30 min and 2 h)."""
    short = {"grpc.max_connection_age_ms": 500, "grpc.max_connection_age_grace_ms": 2000}
    options = [(k, short.get(k, v)) for k, v in grpcutil.SERVER_OPTIONS]
    monkeypatch.setattr(grpcutil, "SERVER_OPTIONS", options)


@pytest.mark.parametrize("rotate", [True, False], ids=["retired-in-time", "kept-too-long"])
def test_a_stream_is_retired_before_the_worker_cuts_its_connection(
    monkeypatch: pytest.MonkeyPatch, rotate: bool
) -> None:
    """Steps for 4 s against a worker whose connections age fast: a client that retires its
    stream in time (here at 0.5 s; by default at MAX_STREAM_S / 12) loses no step and every
    round is token-exact; one that keeps its stream sees it cut under a step (the failure the
    retirement prevents, which would mark a healthy worker dead)."""
    _short_lived_connections(monkeypatch)
    expected = [reference_generate(CFG, WEIGHTS, p, NEW_TOKENS) for p in PROMPTS]

    async def main() -> tuple[int, int, WorkerCallFailed | None]:
        async with _connected() as (client, _):
            client.stream_max_age_s = 0.5 if rotate else float("inf")
            streams: set[int] = set()
            rounds, end = 0, time.monotonic() + 4
            try:
                while time.monotonic() < end:
                    client.reset_pending = True  # each round starts the worker's books afresh
                    assert await _generate(client) == expected
                    streams.add(id(client._stream))
                    rounds += 1
            except WorkerCallFailed as exc:
                return rounds, len(streams), exc
            for _ in range(100):  # the retired streams end once their steps have answered
                if not client._retired:
                    break
                await asyncio.sleep(0.05)
            assert not client._retired
            return rounds, len(streams), None

    rounds, streams, failed = asyncio.run(main())
    if rotate:
        assert failed is None, failed
        assert rounds > 10 and streams >= 5, (rounds, streams)
    else:
        assert failed is not None and failed.code == grpc.StatusCode.UNAVAILABLE, failed
        assert failed.worker_unreachable and streams == 1

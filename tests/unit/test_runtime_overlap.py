"""The runtime's overlapped loop (issue 23 point 4) against a worker that keeps each session's
last sampled token, as a real one does: tick N+1 goes out before tick N is applied, and a
session that tick N ends (EOS, a stop string the output processor finds, an item error) had an
extra item in N+1 whose token must never reach its stream. The oracle: the same sessions run
one tick at a time give the same streams; the worker is told to forget every session."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from scheduler_svc.core import SchedulerCore, SessionRequest, StepResult
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, PrefillWork
from scheduler_svc.core.types import FinishReason, StepStatus, WorkerSpec
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.output import OutputProcessor
from scheduler_svc.runtime import RuntimeConfig, SchedulerRuntime, SessionEvent
from scheduler_svc.spans import SchedulerSpans
from tests.unit.sim import fake_token


class _Worker:
    """Answers a step only when the test lets it (so that the next one is planned meanwhile),
    runs steps in the order they were sent, and samples fake_token(session, index)."""

    worker_id = "w0"
    step_ns = 0  # (WorkerClient.step_ns: no step timed)

    def __init__(self, fail_at: Mapping[str, int]) -> None:
        self.kv: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.fail_at = fail_at  # session -> the index whose sampling fails (an item error)
        self.planned_ahead = 0  # decodes that came without their token (last_sampled)
        self._turn: asyncio.Lock | None = None

    async def _run(self, prefill, decode, release) -> Mapping[str, StepResult]:
        assert self._turn is not None
        async with self._turn:  # one at a time, in the order sent, as StepOrder makes a worker
            await asyncio.sleep(0)  # let the scheduler plan the next tick meanwhile
            for sid in release:
                self.kv.pop(sid, None)
                self.last.pop(sid, None)
            out = {}
            for p in prefill:
                self.kv[p.session_id] = p.start_position + len(p.token_ids)
                tok = self._sample(p.session_id, p.generated_so_far) if p.last_chunk else None
                out[p.session_id] = StepResult(p.session_id, StepStatus.OK, tok, self.kv[p.session_id])
            for d in decode:
                sid = d.session_id
                if d.last_sampled:
                    self.planned_ahead += 1
                if self.kv.get(sid) != d.position or (d.last_sampled and sid not in self.last):
                    out[sid] = StepResult(sid, StepStatus.CACHE_MISS, None, self.kv.get(sid, 0))
                    continue
                if d.generated_so_far == self.fail_at.get(sid):
                    self.kv.pop(sid)  # the worker frees a session whose item failed
                    self.last.pop(sid, None)
                    out[sid] = StepResult(sid, StepStatus.FAILED, None, 0, error="injected")
                    continue
                self.kv[sid] += 1
                out[sid] = StepResult(sid, StepStatus.OK, self._sample(sid, d.generated_so_far), self.kv[sid])
            return out

    def _sample(self, sid: str, index: int) -> int:
        self.last[sid] = fake_token(sid, index)
        return self.last[sid]

    def step(self, prefill: Sequence[PrefillWork], decode: Sequence[DecodeWork], release, arm, span, timeout):
        if self._turn is None:
            self._turn = asyncio.Lock()
        return asyncio.ensure_future(self._run(prefill, decode, tuple(release)))

    async def close(self) -> None:
        return None


class _Text:
    """A text stream: each token's text is its id and a space; a stop string is found when a
    token's text is one of the request's stop strings."""

    def __init__(self, request: SessionRequest) -> None:
        self._stop = set(request.stop_strings)
        self._stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        self._stopped = str(token) in self._stop
        return f"{token} ", self._stopped

    def flush(self) -> str:
        return ""


def _new_id(ids: list[str]):
    it = iter(ids)
    return lambda prefix: next(it)


@pytest.mark.parametrize("seed", range(4))
def test_overlap_streams_what_one_tick_at_a_time_streams(seed):
    ids = [f"s{i}" for i in range(6)]
    # Each session's ending is known in advance: an EOS token, a stop string, an item error (the
    # worker fails its sampling), or its length; each at an index that varies with the seed.
    ends = {sid: 2 + (i + seed) % 4 for i, sid in enumerate(ids)}
    kinds = {sid: ("eos", "stop", "error", "length")[(i + seed) % 4] for i, sid in enumerate(ids)}
    requests = [
        SessionRequest(
            prompt_ids=tuple(range(1, 3 + i)),
            max_new_tokens=9,
            eos_token_ids=(fake_token(sid, ends[sid]),) if kinds[sid] == "eos" else (),
            stop_strings=(str(fake_token(sid, ends[sid])),) if kinds[sid] == "stop" else (),
        )
        for i, sid in enumerate(ids)
    ]
    fail_at = {sid: ends[sid] for sid in ids if kinds[sid] == "error"}
    results = {}
    for overlap in (False, True):
        streams, worker = _run(overlap, requests, fail_at, ids)
        results[overlap] = streams
        if overlap:
            assert worker.planned_ahead > 0, "the test must plan decodes ahead"
        assert not worker.kv, f"the worker was not told to forget {sorted(worker.kv)}"
    for sid in ids:
        plain, ahead = results[False][sid], results[True][sid]
        assert [(e.token, e.text, e.finish, e.dropped) for e in ahead] == [
            (e.token, e.text, e.finish, e.dropped) for e in plain
        ], sid
        tokens = [e.token for e in ahead if e.token is not None]
        first = [fake_token(sid, i) for i in range(9)]
        assert tokens == first[: len(tokens)]
        # Nothing after the token that ended it: the extra one planned ahead was not streamed.
        end = ahead[-1]
        if kinds[sid] == "error":
            assert end.dropped and len(tokens) == ends[sid], sid
        elif kinds[sid] == "length":
            assert end.finish == FinishReason.LENGTH and len(tokens) == 9
        else:
            # The first token whose id (eos) or text (stop) is the one that ends it.
            cut = first.index(first[ends[sid]]) + 1
            assert len(tokens) == cut, (sid, tokens)
            assert end.finish == (FinishReason.EOS if kinds[sid] == "eos" else FinishReason.STOP)


def _run(overlap: bool, requests: list[SessionRequest], fail_at: Mapping[str, int], ids: list[str]):
    async def scenario():
        core = SchedulerCore(SchedulerLimits(max_running=8), new_id=_new_id(list(ids)))
        core.add_worker(WorkerSpec("w0", capacity_tokens=4096, block_size=4, kv_bytes_per_token=64), 48, 2048)
        worker = _Worker(fail_at)
        rt = SchedulerRuntime(
            core,
            [worker],  # type: ignore[list-item]
            SchedulerSpans("tiny"),
            SchedulerMetrics("tiny", 2048),
            RuntimeConfig(overlap=overlap),
            OutputProcessor(_Text, str),
        )
        rt.start()
        subs = [rt.submit([r], ["text_completion"]) for r in requests]
        streams: dict[str, list[SessionEvent]] = {}
        for sub in subs:
            (sid,) = sub.session_ids
            events = streams.setdefault(sid, [])
            while not (events and (events[-1].finish is not None or events[-1].dropped)):
                events.append(await asyncio.wait_for(sub.events.get(), 10))
        for sub in subs:
            rt.end_stream(sub)
        await rt.stop()
        # What is still to forget would ride on the next step, or the idle loop's flush.
        await rt._flush_releases()
        return streams, worker

    return asyncio.run(scenario())


class _Logged(SpanExporter):
    """Appends each span exported to the test's log, beside the worker's steps."""

    def __init__(self, log: list[tuple[str, int, str]], parents: dict[int, int]) -> None:
        self.log = log
        self.parents = parents  # log index of a span -> its parent's span id
        self.ids: dict[int, int] = {}  # span id -> the log index of the span

    def export(self, spans) -> SpanExportResult:
        for s in spans:
            self.ids[s.context.span_id] = len(self.log)
            if s.parent is not None:
                self.parents[len(self.log)] = s.parent.span_id
            self.log.append(("span", s.attributes.get("kvfleet.tick", -1), s.name))
        return SpanExportResult.SUCCESS


class _Refuses(SpanProcessor):
    """A span processor that fails on every step_decode span it is handed."""

    def on_end(self, span) -> None:
        if span.name == "step_decode":
            raise RuntimeError("this processor refuses step_decode")


def _traced_run(
    step_spans: bool, failing: bool = False
) -> tuple[list[tuple[str, int, str]], dict[int, int], _Logged, dict[int, int]]:
    """Three sessions through the overlapped loop with spans to a log beside the worker's steps:
    (log, parents, the exporter, items sent by tick). failing: a second span processor raises on
    every step_decode span (ahead of the log's: those spans never reach it)."""
    log: list[tuple[str, int, str]] = []
    parents: dict[int, int] = {}
    exporter = _Logged(log, parents)
    provider = TracerProvider()
    if failing:
        provider.add_span_processor(_Refuses())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    items: dict[int, int] = {}  # tick -> the items sent in it

    class Worker(_Worker):
        def step(self, prefill, decode, release, arm, span, timeout):
            tick = span.attributes["kvfleet.tick"]
            log.append(("sent", tick, ""))
            items[tick] = len(prefill) + len(decode)
            return super().step(prefill, decode, release, arm, span, timeout)

    ids = [f"s{i}" for i in range(3)]

    async def scenario():
        core = SchedulerCore(SchedulerLimits(max_running=8), new_id=_new_id(list(ids)))
        core.add_worker(WorkerSpec("w0", capacity_tokens=4096, block_size=4, kv_bytes_per_token=64), 48, 2048)
        rt = SchedulerRuntime(
            core,
            [Worker({})],  # type: ignore[list-item]
            SchedulerSpans("tiny", provider, step_spans=step_spans),
            SchedulerMetrics("tiny", 2048),
            RuntimeConfig(overlap=True),
            OutputProcessor(_Text, str),
        )
        rt.start()
        subs = [rt.submit([SessionRequest(prompt_ids=(1, 2, 3), max_new_tokens=6)], ["text_completion"]) for _ in ids]
        for sub in subs:
            while (await asyncio.wait_for(sub.events.get(), 10)).finish is None:
                pass
            rt.end_stream(sub)
        await rt.stop()

    asyncio.run(scenario())
    return log, parents, exporter, items


def test_a_tick_s_spans_are_written_after_the_next_tick_s_steps_go_out_and_none_is_lost():
    """The step spans of tick N (one per session item) and N's own span are written once the
    steps of the tick planned from N's answers are out, not on the way from those answers to
    that tick's steps; and every one is written."""
    log, parents, exporter, items = _traced_run(step_spans=True)
    sent_at = {tick: i for i, (kind, tick, _) in enumerate(log) if kind == "sent"}
    assert len(sent_at) >= 6, "the sessions decode over several ticks"
    # Tick N+1 went out before N's answers came (overlap); N+2 is the first tick planned from them.
    for i, (kind, tick, name) in enumerate(log):
        if kind == "span" and name in ("tick", "step_prefill", "step_decode") and tick + 2 in sent_at:
            assert sent_at[tick + 2] < i, f"{name} of tick {tick} was written before tick {tick + 2}'s steps went out"
    steps = [tick for kind, tick, name in log if kind == "span" and name.startswith("step_")]
    assert {t: steps.count(t) for t in items} == items, "a step span per item sent, for every tick"
    assert sorted(t for kind, t, name in log if name == "tick") == sorted(items)
    # In time too: a session's step spans are all written before its own span ends.
    sessions = [i for i, (_, _, name) in enumerate(log) if name == "text_completion tiny"]
    assert len(sessions) == 3
    for i, (_, _, name) in enumerate(log):
        if name.startswith("step_"):
            assert exporter.ids[parents[i]] > i, f"{name} written after its session's span ended"


def test_without_step_spans_a_session_s_trace_keeps_its_own_spans_and_every_tick():
    log, _, _, items = _traced_run(step_spans=False)
    names = [name for kind, _, name in log if kind == "span"]
    assert not [n for n in names if n.startswith("step_")]
    assert names.count("text_completion tiny") == 3 and names.count("queue") == 3
    assert sorted(t for kind, t, name in log if name == "tick") == sorted(items)


def test_a_span_write_that_fails_holds_up_no_token_and_no_other_span():
    log, _, _, items = _traced_run(step_spans=True, failing=True)  # every stream still finished
    names = [name for kind, _, name in log if kind == "span"]
    assert "step_decode" not in names and "step_prefill" in names
    assert names.count("text_completion tiny") == 3
    assert sorted(t for kind, t, name in log if name == "tick") == sorted(items)

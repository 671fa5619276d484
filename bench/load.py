"""A closed-loop load generator over the scheduler's gRPC API, timed on the client side.

``concurrency`` tasks each stream one session at a time (``Generate``) and take the next as
soon as theirs finishes. Every streamed event's arrival time is recorded: time to first token
is the first token's arrival minus the request's send time; inter-token latency is the gap
between consecutive tokens of a session (an event carrying k tokens gives one gap and k - 1
zeros: the client saw them at once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from bench.workload import Session
from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil


@dataclass
class SessionTiming:
    send_ns: int
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (perf ns, tokens)
    finish_reason: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


@dataclass(frozen=True)
class LoadResult:
    concurrency: int
    timings: list[SessionTiming]
    wall_s: float
    start_epoch_ns: int  # wall clock, to find the run's spans in the telemetry store
    end_epoch_ns: int

    @property
    def output_tokens(self) -> int:
        return sum(t.tokens for t in self.timings)


async def _run(
    address: str, sessions: Sequence[Session], concurrency: int, timeout_s: float, progress: Callable[[str], None]
) -> LoadResult:
    timings: list[SessionTiming | None] = [None] * len(sessions)
    next_index = 0

    async with grpc.aio.insecure_channel(address, options=grpcutil.CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.SchedulerStub(channel)

        async def client() -> None:
            nonlocal next_index
            while next_index < len(sessions):
                i = next_index
                next_index += 1
                s = sessions[i]
                req = build_request(list(s.prompt), s.max_new_tokens, ignore_eos=True)
                t = SessionTiming(send_ns=time.perf_counter_ns())
                async for ev in stub.Generate(req, timeout=timeout_s):
                    if ev.token_ids:
                        t.arrivals.append((time.perf_counter_ns(), len(ev.token_ids)))
                    if ev.finished:
                        t.finish_reason = ev.finish_reason
                timings[i] = t

        async def report() -> None:
            while True:
                await asyncio.sleep(10.0)
                done = sum(1 for t in timings if t is not None)
                progress(f"{done}/{len(sessions)} sessions done, {time.perf_counter() - t0:.0f} s")

        start_epoch, t0 = time.time_ns(), time.perf_counter()
        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(client() for _ in range(min(concurrency, len(sessions)))))
        finally:
            reporter.cancel()
        wall = time.perf_counter() - t0
    assert all(t is not None for t in timings)
    return LoadResult(concurrency, timings, wall, start_epoch, time.time_ns())  # type: ignore[arg-type]


def run_load(
    address: str,
    sessions: Sequence[Session],
    concurrency: int,
    timeout_s: float = 900.0,
    progress: Callable[[str], None] = lambda m: None,
) -> LoadResult:
    return asyncio.run(_run(address, sessions, concurrency, timeout_s, progress))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(result: LoadResult, sessions: Sequence[Session]) -> dict:
    """Throughput and client-side latencies (milliseconds) of one load run."""
    ttft, itl = [], []
    for t in result.timings:
        if not t.arrivals:
            continue
        ttft.append((t.arrivals[0][0] - t.send_ns) / 1e6)
        prev = t.arrivals[0][0]
        for arrived, n in t.arrivals[1:]:
            itl.append((arrived - prev) / 1e6)
            itl.extend([0.0] * (n - 1))
            prev = arrived
        itl.extend([0.0] * (t.arrivals[0][1] - 1))
    expected = sum(s.max_new_tokens for s in sessions)
    return {
        "concurrency": result.concurrency,
        "sessions": len(result.timings),
        "output_tokens": result.output_tokens,
        "expected_output_tokens": expected,
        "wall_s": round(result.wall_s, 3),
        "output_tokens_per_s": round(result.output_tokens / result.wall_s, 3),
        "ttft_ms_p50": _pct(ttft, 50),
        "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50),
        "itl_ms_p99": _pct(itl, 99),
        "itl_ms_mean": float(np.mean(itl)) if itl else None,
    }

"""Counters the scheduler keeps while it runs: global telemetry and per-workload figures."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Rates are taken over the ticks that ended within this window.
RATE_WINDOW_S = 5.0


@dataclass
class BatchCounters:
    """Tick and batch figures, kept both for the whole scheduler and for each workload."""

    ticks: int = 0
    decode_batches: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    max_batch_occupancy: int = 0
    last_batch_occupancy: int = 0
    peak_kv_bytes: int = 0
    cache_misses: int = 0
    rejected: int = 0

    def record_tick(self, prefill_tokens: int, decode_batch: int, kv_bytes: int) -> None:
        self.ticks += 1
        self.prefill_tokens += prefill_tokens
        if decode_batch:
            self.decode_batches += 1
            self.decode_tokens += decode_batch
            self.max_batch_occupancy = max(self.max_batch_occupancy, decode_batch)
        self.last_batch_occupancy = decode_batch
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes)

    @property
    def avg_batch_occupancy(self) -> float:
        return self.decode_tokens / self.decode_batches if self.decode_batches else 0.0

    @property
    def tokens_per_tick(self) -> float:
        return (self.prefill_tokens + self.decode_tokens) / self.ticks if self.ticks else 0.0


@dataclass(frozen=True)
class WorkloadStats:
    sessions: int
    ticks: int
    decode_batches: int
    decode_tokens: int
    prefill_tokens: int
    avg_batch_occupancy: float
    max_batch_occupancy: int
    peak_kv_bytes: int
    tokens_per_tick: float
    rejected_admissions: int
    cache_misses: int

    @classmethod
    def from_counters(cls, sessions: int, c: BatchCounters) -> "WorkloadStats":
        return cls(
            sessions=sessions,
            ticks=c.ticks,
            decode_batches=c.decode_batches,
            decode_tokens=c.decode_tokens,
            prefill_tokens=c.prefill_tokens,
            avg_batch_occupancy=c.avg_batch_occupancy,
            max_batch_occupancy=c.max_batch_occupancy,
            peak_kv_bytes=c.peak_kv_bytes,
            tokens_per_tick=c.tokens_per_tick,
            rejected_admissions=c.rejected,
            cache_misses=c.cache_misses,
        )


@dataclass(frozen=True)
class TelemetrySnapshot:
    """The scheduler's live state; field meanings are documented in protos/kvfleet/v1/scheduler.proto."""

    active_sessions: int
    batch_occupancy_avg: float
    batch_occupancy_last: int
    batch_occupancy_max: int
    completed_sessions: int
    decode_tokens_per_sec: float
    decode_tokens_total: int
    kv_budget_bytes: int
    kv_pressure: float
    kv_total_bytes: int
    prefill_tokens_per_sec: float
    prefill_tokens_total: int
    queue_depth: int
    rejected_admissions_total: int
    rejected_by_reason: dict[str, int]
    scratch_budget_bytes: int
    scratch_pressure: float
    scratch_used_bytes: int
    ticks: int
    weight_bytes: int
    kv_reserved_bytes: int
    cache_misses_total: int
    live_workers: int
    preemptions_total: int = 0


@dataclass
class RateWindow:
    """Token rates over the ticks that ended in the last RATE_WINDOW_S seconds. The window's
    token sums are kept as ticks come and go: rates() is read after every tick, and summing a
    window of a thousand ticks each time was a tenth of the scheduler's CPU at batch 1."""

    # (tick start, tick end, prefill tokens, decode tokens)
    ticks: deque[tuple[float, float, int, int]] = field(default_factory=deque)
    prefill: int = 0  # the window's sums
    decode: int = 0

    def add(self, start: float, end: float, prefill: int, decode: int) -> None:
        self.ticks.append((start, end, prefill, decode))
        self.prefill += prefill
        self.decode += decode
        while self.ticks and end - self.ticks[0][1] > RATE_WINDOW_S:
            _, _, p, d = self.ticks.popleft()
            self.prefill -= p
            self.decode -= d

    def rates(self) -> tuple[float, float]:
        if not self.ticks:
            return 0.0, 0.0
        span = self.ticks[-1][1] - self.ticks[0][0]
        if span <= 0:
            return 0.0, 0.0
        return self.prefill / span, self.decode / span

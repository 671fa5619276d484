"""Counting what the scheduler did: global and per-workload tick figures, rates, rejections,
finishes, workload stats and the live snapshot.

An observer: the core feeds it each tick's tally (from the plan and its outcome), finishes,
rejections and preemptions; it never decides anything and the core never reads policy from it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from scheduler_svc.core.stats import (
    BatchCounters,
    RateWindow,
    TelemetrySnapshot,
    WorkloadStats,
)

# Finished workloads kept for late GetTelemetry/stat reads.
FINISHED_WORKLOADS_KEPT = 64


@dataclass(frozen=True)
class WorkloadTally:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cache_misses: int = 0
    kv_bytes: int = 0  # held at the tick's end, after frees


@dataclass(frozen=True)
class TickTally:
    """One tick's figures, as the core counted them from its plan and outcome."""

    started: float
    ended: float
    prefill_tokens: int
    decode_tokens: int
    cache_misses: int
    kv_bytes: int  # held at the tick's end, after frees
    by_workload: Mapping[str, WorkloadTally]  # every workload present at the tick's start


@dataclass(frozen=True)
class Gauges:
    """The live state a snapshot shows (for the whole scheduler or one workload)."""

    running: int
    queued: int
    kv_bytes: int
    reserved_bytes: int
    live_workers: int
    weight_bytes: int
    kv_budget_bytes: int  # the budget in force (KvReservations.budget_bytes)


@dataclass
class _Workload:
    session_ids: tuple[str, ...]
    max_running: int
    snapshot_at_tick: int
    rejected_at_start: dict[str, int]
    done: set[str] = field(default_factory=set)
    counters: BatchCounters = field(default_factory=BatchCounters)
    rates: RateWindow = field(default_factory=RateWindow)
    snapshot: TelemetrySnapshot | None = None
    stats: WorkloadStats | None = None  # set when every session has finished


class Accounting:
    def __init__(self, max_running: int) -> None:
        self._max_running = max_running
        self.counters = BatchCounters()
        self.rates = RateWindow()
        self.rejections: Counter[str] = Counter()
        self.completed = 0
        self.preemptions = 0
        self._workloads: dict[str, _Workload] = {}
        self._finished_order: list[str] = []
        self._workload_of: dict[str, str] = {}

    # ---- fed by the core ---------------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self.rejections[reason] += 1

    def preempted(self, n: int = 1) -> None:
        self.preemptions += n

    def open_workload(
        self, workload_id: str, session_ids: Iterable[str], max_running: int, snapshot_at_tick: int
    ) -> None:
        ids = tuple(session_ids)
        self._workloads[workload_id] = _Workload(
            session_ids=ids,
            max_running=max_running,
            snapshot_at_tick=snapshot_at_tick,
            rejected_at_start=dict(self.rejections),
        )
        for sid in ids:
            self._workload_of[sid] = workload_id

    def finished(self, session_ids: Iterable[str]) -> None:
        for sid in session_ids:
            self.completed += 1
            wid = self._workload_of.get(sid)
            if wid is not None and wid in self._workloads:
                self._workloads[wid].done.add(sid)

    def record_tick(self, tally: TickTally, gauges_of: Callable[[str], Gauges]) -> None:
        """Count a tick and take the snapshots workloads asked for at this tick. The core then
        closes the workloads that finished (close_finished)."""
        self.counters.record_tick(tally.prefill_tokens, tally.decode_tokens, tally.kv_bytes)
        self.counters.cache_misses += tally.cache_misses
        self.rates.add(tally.started, tally.ended, tally.prefill_tokens, tally.decode_tokens)
        for wid, t in tally.by_workload.items():
            wl = self._workloads.get(wid)
            if wl is None or wl.stats is not None:
                continue
            c = wl.counters
            c.record_tick(t.prefill_tokens, t.decode_tokens, t.kv_bytes)
            c.cache_misses += t.cache_misses
            wl.rates.add(tally.started, tally.ended, t.prefill_tokens, t.decode_tokens)
            if wl.snapshot_at_tick and c.ticks == wl.snapshot_at_tick:
                wl.snapshot = self.snapshot(gauges_of(wid), wid)

    def close_finished(self) -> list[str]:
        """Close every workload whose sessions have all finished; returns the session ids of
        workloads dropped from memory (the oldest beyond FINISHED_WORKLOADS_KEPT)."""
        dropped: list[str] = []
        for wid, wl in self._workloads.items():
            if wl.stats is None and len(wl.done) == len(wl.session_ids):
                wl.counters.rejected = sum(self._rejections_since(wl).values())
                wl.stats = WorkloadStats.from_counters(len(wl.session_ids), wl.counters)
                self._finished_order.append(wid)
        while len(self._finished_order) > FINISHED_WORKLOADS_KEPT:
            old = self._workloads.pop(self._finished_order.pop(0))
            for sid in old.session_ids:
                self._workload_of.pop(sid, None)
            dropped.extend(old.session_ids)
        return dropped

    # ---- reads -------------------------------------------------------------------------------

    def has_workload(self, workload_id: str) -> bool:
        return workload_id in self._workloads

    def workload_stats(self, workload_id: str) -> WorkloadStats | None:
        return self._workloads[workload_id].stats

    def workload_snapshot(self, workload_id: str) -> TelemetrySnapshot | None:
        return self._workloads[workload_id].snapshot

    def active_workloads(self) -> list[str]:
        return [wid for wid, wl in self._workloads.items() if wl.stats is None]

    def _rejections_since(self, wl: _Workload) -> dict[str, int]:
        return {
            r: n - wl.rejected_at_start.get(r, 0)
            for r, n in self.rejections.items()
            if n - wl.rejected_at_start.get(r, 0) > 0
        }

    def snapshot(self, g: Gauges, workload_id: str | None = None) -> TelemetrySnapshot:
        """The live state; with a workload id, totals, gauges and rates of that workload alone."""
        slots = self._max_running
        if workload_id is not None:
            wl = self._workloads[workload_id]
            c, rates = wl.counters, wl.rates
            completed = len(wl.done)
            by_reason = self._rejections_since(wl)
            slots = min(slots, wl.max_running)
        else:
            c, rates = self.counters, self.rates
            completed = self.completed
            by_reason = dict(self.rejections)
            active = [self._workloads[w] for w in self.active_workloads()]
            if active:
                slots = min(slots, sum(w.max_running for w in active))
        prefill_rate, decode_rate = rates.rates()
        return TelemetrySnapshot(
            active_sessions=g.running,
            batch_occupancy_avg=round(c.avg_batch_occupancy, 4),
            batch_occupancy_last=c.last_batch_occupancy,
            batch_occupancy_max=c.max_batch_occupancy,
            completed_sessions=completed,
            decode_tokens_per_sec=round(decode_rate, 3),
            decode_tokens_total=c.decode_tokens,
            kv_budget_bytes=g.kv_budget_bytes,
            kv_pressure=round(g.kv_bytes / g.kv_budget_bytes, 4) if g.kv_budget_bytes else 0.0,
            kv_total_bytes=g.kv_bytes,
            prefill_tokens_per_sec=round(prefill_rate, 3),
            prefill_tokens_total=c.prefill_tokens,
            queue_depth=g.queued,
            rejected_admissions_total=sum(by_reason.values()),
            rejected_by_reason=by_reason,
            # The decode batch slot table, in slots (the reference format's names).
            scratch_budget_bytes=slots,
            scratch_pressure=round(g.running / slots, 4) if slots else 0.0,
            scratch_used_bytes=g.running,
            ticks=c.ticks,
            weight_bytes=g.weight_bytes,
            kv_reserved_bytes=g.reserved_bytes,
            cache_misses_total=c.cache_misses,
            live_workers=g.live_workers,
            preemptions_total=self.preemptions,
        )

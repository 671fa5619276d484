"""The scheduler's Prometheus metrics, named after vLLM's where the meaning is the same."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvfleet_common.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, GaugeCollector
from scheduler_svc.core.stats import TelemetrySnapshot


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("kvfleet:time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvfleet:inter_token_latency_seconds", "Time between consecutive tokens of a session",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvfleet:e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.rejections = Counter("kvfleet:request_rejections", "Sessions refused at admission, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens = Counter("kvfleet:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("kvfleet:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("kvfleet:request_success", "Sessions finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.orphans = Counter("kvfleet:orphan_sessions_released", "Sessions a worker held that the "
                               "scheduler had not placed there, freed by reconciliation", registry=r)
        self._snapshot: TelemetrySnapshot | None = None
        self._seen_rejections: dict[str, int] = {}
        self._seen_preemptions = 0
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        r.register(GaugeCollector(self._gauges))

    # ---- fed by the tick loop (the event loop's thread) -------------------------------------

    def arrived(self, session_id: str) -> None:
        self._arrival[session_id] = time.monotonic()

    def token(self, session_id: str) -> None:
        now = time.monotonic()
        last = self._last_token.get(session_id)
        if last is None:
            arrival = self._arrival.get(session_id)
            if arrival is not None:
                self.ttft.observe(now - arrival)
        else:
            self.itl.observe(now - last)
        self._last_token[session_id] = now

    def finished_session(self, session_id: str, reason: str) -> None:
        arrival = self._arrival.pop(session_id, None)
        self._last_token.pop(session_id, None)
        if arrival is not None:
            self.e2e.observe(time.monotonic() - arrival)
        self.finished.labels(finished_reason=reason).inc()

    def orphans_released(self, n: int) -> None:
        self.orphans.inc(n)

    def tick(self, snapshot: TelemetrySnapshot, prefill_tokens: int, decode_tokens: int) -> None:
        self._snapshot = snapshot
        self.prompt_tokens.inc(prefill_tokens)
        self.generation_tokens.inc(decode_tokens)
        self.update_rejections(snapshot.rejected_by_reason)

    def update_rejections(self, by_reason: dict[str, int]) -> None:
        for reason, n in by_reason.items():
            delta = n - self._seen_rejections.get(reason, 0)
            if delta > 0:
                self.rejections.labels(reason=reason).inc(delta)
                self._seen_rejections[reason] = n

    # ---- read at scrape time (the HTTP thread): only the last immutable snapshot ----------------

    def _gauges(self) -> dict[str, tuple[str, float]]:
        s = self._snapshot
        if s is None:
            return {}
        return {
            "kvfleet:num_requests_running": ("Sessions admitted and not finished", s.active_sessions),
            "kvfleet:num_requests_waiting": ("Sessions waiting for admission", s.queue_depth),
            "kvfleet:kv_cache_usage_perc": ("KV held / KV budget (0..1)", s.kv_pressure),
            "kvfleet:kv_cache_bytes": ("KV bytes held on all workers", s.kv_total_bytes),
            "kvfleet:batch_occupancy": ("The last tick's decode batch size", s.batch_occupancy_last),
            "kvfleet:decode_tokens_per_second": ("Decode tokens per second (recent ticks)", s.decode_tokens_per_sec),
            "kvfleet:num_preemptions_total": ("Sessions preempted under KV pressure", s.preemptions_total),
            "kvfleet:live_workers": ("Workers answering their steps", s.live_workers),
            "kvfleet:ticks_total": ("Scheduler ticks run", s.ticks),
        }

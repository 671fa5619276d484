"""The worker's Prometheus metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvfleet_common.metrics import ITL_BUCKETS, GaugeCollector
from worker_svc.engine import Engine


class WorkerMetrics:
    def __init__(self, engine: Engine, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        self._engine = engine
        self._worker_id = worker_id
        self.step = Histogram("kvfleet:worker_step_seconds", "Wall time of one batched step",
                              buckets=ITL_BUCKETS, registry=self.registry)
        self.tokens = Counter("kvfleet:worker_tokens", "Tokens processed, by phase", ["phase"],
                              registry=self.registry)
        self._stats = engine.stats()
        self.registry.register(GaugeCollector(self._gauges))

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.step.observe(seconds)
        self.tokens.labels(phase="prefill").inc(prefill_tokens)
        self.tokens.labels(phase="decode").inc(decode_tokens)
        self._stats = self._engine.stats()   # read here, in the serving thread, not at scrape time

    def refresh(self) -> None:
        self._stats = self._engine.stats()

    def _gauges(self) -> dict[str, tuple[str, float]]:
        s = self._stats
        total = s.used_blocks + s.free_blocks
        return {
            "kvfleet:worker_kv_blocks_used": ("KV blocks holding sessions", s.used_blocks),
            "kvfleet:worker_kv_blocks_total": ("KV blocks in the cache", total),
            "kvfleet:kv_cache_usage_perc": ("Used / total KV blocks (0..1)", s.used_blocks / total if total else 0.0),
            "kvfleet:worker_sessions": ("Sessions whose KV the worker holds", s.active_sessions),
            "kvfleet:worker_cache_misses_total": ("Items naming KV the worker did not hold", s.cache_misses),
            "kvfleet:worker_steps_total": ("Steps run", s.steps),
        }

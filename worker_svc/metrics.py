"""The worker's Prometheus metrics.

Its KV usage is `kvfleet:worker_kv_cache_usage_perc` (of this worker's blocks), never to be
confused with the scheduler's `kvfleet:scheduler_kv_usage_perc` (of its budget over all workers).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvfleet_common.metrics import ITL_BUCKETS, Kind, Reading, SnapshotCollector
from kvfleet_common.procinfo import resident_bytes
from worker_svc.engine import Engine


class WorkerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self._engine = engine
        self.step = Histogram(
            "kvfleet:worker_step_seconds", "Wall time of one batched step", buckets=ITL_BUCKETS, registry=self.registry
        )
        self.tokens = Counter("kvfleet:worker_tokens", "Tokens processed, by phase", ["phase"], registry=self.registry)
        # The two phases' children, looked up once rather than twice a step.
        self._prefill_tokens, self._decode_tokens = (
            self.tokens.labels(phase="prefill"),
            self.tokens.labels(phase="decode"),
        )
        self._stats = engine.stats()
        self.registry.register(SnapshotCollector(self._readings))

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int) -> None:
        self.step.observe(seconds)
        self._prefill_tokens.inc(prefill_tokens)
        self._decode_tokens.inc(decode_tokens)
        self._stats = self._engine.stats()  # read here, in the serving thread, not at scrape time

    def refresh(self) -> None:
        self._stats = self._engine.stats()

    def _readings(self) -> Iterator[Reading]:
        s = self._stats
        total = s.used_blocks + s.free_blocks
        yield Reading("kvfleet:worker_kv_blocks_used", "KV blocks holding sessions", s.used_blocks)
        yield Reading("kvfleet:worker_kv_blocks", "KV blocks in the cache (its capacity)", total)
        yield Reading(
            "kvfleet:worker_kv_cache_usage_perc",
            "Used / all KV blocks of this worker (0..1)",
            s.used_blocks / total if total else 0.0,
        )
        yield Reading("kvfleet:worker_sessions", "Sessions whose KV the worker holds", s.active_sessions)
        yield Reading(
            "kvfleet:worker_resident_memory_bytes", "The worker process's resident memory (RSS)", resident_bytes()
        )
        # The engine's own cumulative counts: counters, mirrored at scrape time.
        yield Reading(
            "kvfleet:worker_cache_misses", "Items naming KV the worker did not hold", s.cache_misses, Kind.COUNTER
        )
        yield Reading("kvfleet:worker_steps", "Steps run", s.steps, Kind.COUNTER)
        yield Reading(
            "kvfleet:worker_item_errors",
            "Step items rejected or failed alone (their sessions ended; the rest of the step ran)",
            s.item_errors,
            Kind.COUNTER,
        )
        # Prefix caching (the scheduler finds the hits; the worker skips computing them):
        # hit rate = hits / queries.
        yield Reading(
            "kvfleet:worker_prefix_cache_queries",
            "Prompt tokens of prefill chunks, with prefix caching on",
            s.prefix_cache_queries,
            Kind.COUNTER,
        )
        yield Reading(
            "kvfleet:worker_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache (reused, not computed)",
            s.prefix_cache_hits,
            Kind.COUNTER,
        )

"""The telemetry service's Prometheus metrics (one registry per server; no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvfleet_common.metrics import GaugeCollector
from telemetry_svc.retention import RetentionPolicy, RetentionResult


class TelemetryMetrics:
    def __init__(self, policy: RetentionPolicy) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.spans_accepted = Counter("kvfleet:telemetry_spans_accepted", "Spans stored from OTLP exports",
                                      registry=r)  # fmt: skip
        self.spans_rejected = Counter("kvfleet:telemetry_spans_rejected", "Malformed spans refused (partial success)",
                                      registry=r)  # fmt: skip
        self.spans_deleted = Counter("kvfleet:telemetry_spans_deleted", "Spans removed by retention, by reason",
                                     ["reason"], registry=r)  # fmt: skip
        self.artifacts_deleted = Counter("kvfleet:telemetry_artifacts_deleted",
                                         "Artifacts removed by retention for the store's size", registry=r)  # fmt: skip
        self.artifacts_refused = Counter("kvfleet:telemetry_artifacts_refused",
                                         "Artifacts refused for their size (--max-artifact-kb)", registry=r)  # fmt: skip
        self.unauthorized = Counter("kvfleet:telemetry_unauthorized_requests",
                                    "Calls refused for a missing/wrong token or client certificate", ["method"],
                                    registry=r)  # fmt: skip
        self.forward_dropped = Counter("kvfleet:telemetry_forward_dropped_spans",
                                       "Spans not passed on to --forward-otlp (queue full, or it refused or "
                                       "did not answer)", registry=r)  # fmt: skip
        self.forwarded = Counter("kvfleet:telemetry_forwarded_spans", "Spans passed on to --forward-otlp",
                                 registry=r)  # fmt: skip
        self._policy = policy
        self._last: RetentionResult | None = None
        r.register(GaugeCollector(self._gauges))

    def retention(self, result: RetentionResult) -> None:
        self.spans_deleted.labels(reason="age").inc(result.deleted_by_age)
        self.spans_deleted.labels(reason="size").inc(result.deleted_by_size)
        self.artifacts_deleted.inc(result.artifacts_deleted_by_size)
        self._last = result

    def _gauges(self) -> dict[str, tuple[str, float]]:
        g = {
            "kvfleet:telemetry_store_max_bytes": ("Size the store is trimmed to (--max-db-mb)",
                                                  float(self._policy.max_bytes)),
            "kvfleet:telemetry_retention_seconds": ("Age after which spans are deleted (--retention-hours)",
                                                    self._policy.max_age_s),
        }  # fmt: skip
        if self._last is not None:  # unknown until the first retention run
            g["kvfleet:telemetry_store_bytes"] = ("Bytes of the span store in use", float(self._last.live_bytes))
            g["kvfleet:telemetry_stored_spans"] = ("Spans held in the store", float(self._last.spans))
        return g

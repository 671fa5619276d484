"""Prometheus /metrics over HTTP on a separate port, one registry per service (no globals)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvfleet_common.listen import cannot_listen

log = logging.getLogger(__name__)

# Latency buckets (seconds) as vLLM uses for time to first token and inter-token latency.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
# Queue, prefill and decode time of a request: from milliseconds (an idle cluster, a short
# prompt) to minutes (a long queue on CPU workers), so finer at the low end than E2E_BUCKETS.
PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
# Tokens a tick (one batched step) processes, prefill chunks plus decode slots.
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (a model's context length), then `limit` itself:
    per-request prompt and generation lengths."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= limit:
                return (*out, float(limit))
            out.append(float(m * scale))
        scale *= 10


class Kind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # a cumulative count kept elsewhere (an engine's, a core's): never falls


@dataclass(frozen=True)
class Reading:
    """One sample read at scrape time. A counter's name has no `_total`: the exposition adds it."""

    name: str
    help: str
    value: float
    kind: Kind = Kind.GAUGE
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind is Kind.COUNTER and self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r}: give the name without _total")
        if self.kind is Kind.GAUGE and self.name.endswith("_total"):
            raise ValueError(f"gauge {self.name!r}: a _total name promises a counter")


class SnapshotCollector(Collector):
    """Gauges and counters read at scrape time from a callable returning Readings: for values
    another object already keeps (a snapshot, an engine's stats), without copying them into
    Gauge/Counter objects on every change. Readings of one name form one family and must agree
    on kind, help and label names."""

    def __init__(self, read: Callable[[], Iterable[Reading]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for r in self._read():
            fam = families.get(r.name)
            if fam is None:
                cls = CounterMetricFamily if r.kind is Kind.COUNTER else GaugeMetricFamily
                fam = families[r.name] = cls(r.name, r.help, labels=list(r.labels))
            fam.add_metric(list(r.labels.values()), r.value)
        return list(families.values())


class GaugeCollector(Collector):
    """Gauges read at scrape time from a callable returning {name: (help, value)}."""

    def __init__(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, (help_text, value) in self._read().items():
            yield GaugeMetricFamily(name, help_text, value=value)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int | None:
    """Start the /metrics HTTP server in a daemon thread; port 0 = off. Returns the port.
    listen.CannotListen (naming --metrics-port) where the port cannot be bound."""
    if port == 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise cannot_listen("Prometheus /metrics", host, port, "--metrics-port", exc) from None
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound

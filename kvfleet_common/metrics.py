"""Prometheus /metrics over HTTP on a separate port, one registry per service (no globals)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Latency buckets (seconds) as vLLM uses for time to first token and inter-token latency.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)


class GaugeCollector(Collector):
    """Gauges read at scrape time from a callable returning {name: (help, value)}."""

    def __init__(self, read: Callable[[], dict[str, tuple[str, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, (help_text, value) in self._read().items():
            yield GaugeMetricFamily(name, help_text, value=value)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> int | None:
    """Start the /metrics HTTP server in a daemon thread; port 0 = off. Returns the port."""
    if port == 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound

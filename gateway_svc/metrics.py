"""The gateway's own Prometheus metrics, served at GET /metrics on its HTTP port (as vLLM's
OpenAI server does): what callers see, gateway and scheduler together.

`model_name` is the served model once the request was found to name it, and "" before (a 400,
a 401, a 404 for an unknown model): a label taken from the caller would let anyone mint series.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvfleet_common.metrics import E2E_BUCKETS, TTFT_BUCKETS

__all__ = ["CONTENT_TYPE_LATEST", "GatewayMetrics", "RequestMeter"]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvfleet:gateway_requests",
            "Generation requests answered, by HTTP status",
            ["endpoint", "model_name", "status_code"],
            registry=r,
        )
        self.latency = Histogram(
            "kvfleet:gateway_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            ["endpoint", "model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvfleet:gateway_time_to_first_token_seconds",
            "Time from a request's arrival to the scheduler's first event",
            ["endpoint", "model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("kvfleet:gateway_requests_in_flight", "Generation requests being served", registry=r)

    def start(self, endpoint: str) -> RequestMeter:
        return RequestMeter(self, endpoint)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestMeter:
    """One generation request, from arrival to its answer's end."""

    def __init__(self, metrics: GatewayMetrics, endpoint: str) -> None:
        self._m = metrics
        self._endpoint = endpoint
        self._start = time.monotonic()
        self.model_name = ""  # set once the cluster is known to serve the requested model
        metrics.in_flight.inc()

    def first_event(self) -> None:
        self._m.ttft.labels(self._endpoint, self.model_name).observe(time.monotonic() - self._start)

    def done(self, status_code: int) -> None:
        self._m.in_flight.dec()
        self._m.requests.labels(self._endpoint, self.model_name, str(status_code)).inc()
        self._m.latency.labels(self._endpoint, self.model_name).observe(time.monotonic() - self._start)

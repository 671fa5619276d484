"""Prometheus /metrics on the scheduler and the workers, over real HTTP."""
import urllib.request

import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


@pytest.fixture(scope="module")
def metered():
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False)) as cluster:
        yield cluster


def test_scheduler_metrics_follow_the_traffic(metered):
    with SchedulerClient(metered.scheduler_address) as client:
        for _ in range(3):
            client.generate(build_request([1, 2, 3], 6))
        with pytest.raises(Exception):
            client.generate(build_request([1], 0))
    text = _scrape(metered.metrics_ports["scheduler"])
    assert _value(text, "kvfleet:time_to_first_token_seconds_count") == 3
    assert _value(text, "kvfleet:inter_token_latency_seconds_count") == 3 * 5
    assert _value(text, "kvfleet:e2e_request_latency_seconds_count") == 3
    assert _value(text, "kvfleet:generation_tokens_total") == 3 * 5   # decode tokens
    assert 'kvfleet:request_rejections_total{reason="invalid_request"} 1.0' in text
    assert _value(text, "kvfleet:num_requests_running") == 0
    assert _value(text, "kvfleet:num_requests_waiting") == 0
    assert _value(text, "kvfleet:kv_cache_usage_perc") == 0
    assert "kvfleet:num_preemptions_total" in text


def test_worker_metrics(metered):
    import time

    with SchedulerClient(metered.scheduler_address) as client:
        client.generate(build_request([4, 5], 4))
    # The finished session's KV is released on the worker within a tick of the last token.
    deadline = time.monotonic() + 5
    while True:
        text = _scrape(metered.metrics_ports["worker-0"])
        if _value(text, "kvfleet:worker_sessions") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert _value(text, "kvfleet:worker_steps_total") >= 4
    assert _value(text, "kvfleet:worker_step_seconds_count") >= 4
    assert _value(text, "kvfleet:worker_kv_blocks_total") == 4096
    assert _value(text, "kvfleet:worker_sessions") == 0

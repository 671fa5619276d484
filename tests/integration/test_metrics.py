"""Prometheus /metrics on the scheduler, the workers and the gateway, over real HTTP."""

import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _scrape(port: int) -> str:
    return _get(f"http://127.0.0.1:{port}/metrics")


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def _families(text: str) -> dict[str, str]:
    """{family: type}, a counter's family without _total (the TYPE line has it or not by version)."""
    return {
        re.sub(r"_total$", "", n) if t == "counter" else n: t
        for n, t in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    }


def _assert_totals_are_counters(text: str) -> None:
    families = _families(text)
    for family, kind in families.items():
        assert not family.endswith("_total"), f"{family} is a {kind} named like a counter"
    for name in set(re.findall(r"^(kvfleet:[a-z0-9_]+)[{ ]", text, re.M)):
        if name.endswith("_total"):
            assert families.get(name[: -len("_total")]) == "counter", name


@pytest.fixture(scope="module")
def metered():
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False, gateway=True)) as cluster:
        yield cluster


def test_scheduler_metrics_follow_the_traffic(metered):
    with SchedulerClient(metered.scheduler_address) as client:
        for _ in range(3):
            client.generate(build_request([1, 2, 3], 6))
        with pytest.raises(grpc.RpcError):
            client.generate(build_request([1], 0))
    text = _scrape(metered.metrics_ports["scheduler"])
    assert _value(text, "kvfleet:time_to_first_token_seconds_count") == 3
    assert _value(text, "kvfleet:inter_token_latency_seconds_count") == 3 * 5
    assert _value(text, "kvfleet:e2e_request_latency_seconds_count") == 3
    for phase in ("queue", "prefill", "decode"):
        assert _value(text, f"kvfleet:request_{phase}_time_seconds_count") == 3, phase
    assert _value(text, "kvfleet:request_prompt_tokens_sum") == 3 * 3
    assert _value(text, "kvfleet:request_generation_tokens_sum") == 3 * 6
    assert _value(text, "kvfleet:generation_tokens_total") == 3 * 5  # decode tokens
    # every tick's tokens are either prefilled prompt or decoded: the two counters add up to it
    assert _value(text, "kvfleet:iteration_tokens_sum") == _value(text, "kvfleet:prompt_tokens_total") + _value(
        text, "kvfleet:generation_tokens_total"
    )
    assert _value(text, "kvfleet:iteration_tokens_count") >= 6
    assert 'kvfleet:request_rejections_total{model_name="tiny",reason="invalid_request"} 1.0' in text
    assert 'kvfleet:request_success_total{finished_reason="length",model_name="tiny"} 3.0' in text
    assert _value(text, "kvfleet:num_requests_running") == 0
    assert _value(text, "kvfleet:num_requests_waiting") == 0
    assert _value(text, "kvfleet:scheduler_kv_usage_perc") == 0
    assert _value(text, "kvfleet:ticks_total") >= 6
    assert _families(text)["kvfleet:num_preemptions"] == "counter"
    assert "kvfleet:kv_cache_usage_perc" not in text
    samples = [ln for ln in text.splitlines() if ln.startswith("kvfleet:") and "_created" not in ln]
    assert samples and all('model_name="tiny"' in ln for ln in samples), [
        ln for ln in samples if 'model_name="tiny"' not in ln
    ]
    _assert_totals_are_counters(text)


def test_worker_metrics(metered):
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
    assert _value(text, "kvfleet:worker_kv_blocks") == 4096
    assert _value(text, "kvfleet:worker_kv_cache_usage_perc") == 0
    assert _value(text, "kvfleet:worker_sessions") == 0
    families = _families(text)
    assert families["kvfleet:worker_steps"] == families["kvfleet:worker_cache_misses"] == "counter"
    assert "kvfleet:kv_cache_usage_perc" not in text
    _assert_totals_are_counters(text)


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_gateway_serves_its_own_metrics(metered):
    base = metered.gateway_url
    assert _post(base + "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3}) == 200
    assert _post(base + "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "stream": True}) == 200
    assert _post(base + "/v1/completions", {"model": "no-such-model", "prompt": [1], "max_tokens": 2}) == 404
    text = _get(base + "/metrics")
    ok = 'kvfleet:gateway_requests_total{endpoint="text_completion",model_name="tiny",status_code="200"} 2.0'
    assert ok in text
    # the unknown model's name is the caller's: it never becomes a label
    assert 'kvfleet:gateway_requests_total{endpoint="text_completion",model_name="",status_code="404"} 1.0' in text
    assert "no-such-model" not in text
    assert (
        _value(text, 'kvfleet:gateway_time_to_first_token_seconds_count{endpoint="text_completion",model_name="tiny"}')
        == 2
    )
    assert (
        _value(text, 'kvfleet:gateway_request_duration_seconds_count{endpoint="text_completion",model_name="tiny"}')
        == 2
    )
    assert _value(text, "kvfleet:gateway_requests_in_flight") == 0
    _assert_totals_are_counters(text)

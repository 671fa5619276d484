"""Prometheus /metrics on the scheduler, the workers and the gateway, over real HTTP."""

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from tests.helpers.prometheus import samples, scrape, types, value


def _assert_totals_are_counters(text: str) -> None:
    families = types(text)
    for family, kind in families.items():
        assert not family.endswith("_total"), f"{family} is a {kind} named like a counter"
    for name in {s.name for s in samples(text) if s.name.startswith("kvfleet:")}:
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
    text = scrape(metered.metrics_ports["scheduler"])
    assert value(text, "kvfleet:time_to_first_token_seconds_count") == 3
    assert value(text, "kvfleet:inter_token_latency_seconds_count") == 3 * 5
    assert value(text, "kvfleet:e2e_request_latency_seconds_count") == 3
    for phase in ("queue", "prefill", "decode"):
        assert value(text, f"kvfleet:request_{phase}_time_seconds_count") == 3, phase
    assert value(text, "kvfleet:request_prompt_tokens_sum") == 3 * 3
    assert value(text, "kvfleet:request_generation_tokens_sum") == 3 * 6
    assert value(text, "kvfleet:generation_tokens_total") == 3 * 5  # decode tokens
    # every tick's tokens are either prefilled prompt or decoded: the two counters add up to it
    assert value(text, "kvfleet:iteration_tokens_sum") == value(text, "kvfleet:prompt_tokens_total") + value(
        text, "kvfleet:generation_tokens_total"
    )
    assert value(text, "kvfleet:iteration_tokens_count") >= 6
    assert 'kvfleet:request_rejections_total{model_name="tiny",reason="invalid_request"} 1.0' in text
    assert 'kvfleet:request_success_total{finished_reason="length",model_name="tiny"} 3.0' in text
    assert value(text, "kvfleet:num_requests_running") == 0
    assert value(text, "kvfleet:num_requests_waiting") == 0
    assert value(text, "kvfleet:scheduler_kv_usage_perc") == 0
    assert value(text, "kvfleet:ticks_total") >= 6
    assert types(text)["kvfleet:num_preemptions"] == "counter"
    assert "kvfleet:kv_cache_usage_perc" not in text
    ours = [s for s in samples(text) if s.name.startswith("kvfleet:") and "_created" not in s.name]
    assert ours and all(s.labels.get("model_name") == "tiny" for s in ours), [
        s for s in ours if s.labels.get("model_name") != "tiny"
    ]
    _assert_totals_are_counters(text)


def test_worker_metrics(metered):
    with SchedulerClient(metered.scheduler_address) as client:
        client.generate(build_request([4, 5], 4))
    # The finished session's KV is released on the worker within a tick of the last token.
    deadline = time.monotonic() + 5
    while True:
        text = scrape(metered.metrics_ports["worker-0"])
        if value(text, "kvfleet:worker_sessions") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert value(text, "kvfleet:worker_steps_total") >= 4
    assert value(text, "kvfleet:worker_step_seconds_count") >= 4
    assert value(text, "kvfleet:worker_kv_blocks") == 4096
    assert value(text, "kvfleet:worker_kv_cache_usage_perc") == 0
    assert value(text, "kvfleet:worker_sessions") == 0
    families = types(text)
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
    text = scrape(base + "/metrics")
    ok = 'kvfleet:gateway_requests_total{endpoint="text_completion",model_name="tiny",status_code="200"} 2.0'
    assert ok in text
    # the unknown model's name is the caller's: it never becomes a label
    assert 'kvfleet:gateway_requests_total{endpoint="text_completion",model_name="",status_code="404"} 1.0' in text
    assert "no-such-model" not in text
    assert (
        value(
            text,
            "kvfleet:gateway_time_to_first_token_seconds_count",
            {"endpoint": "text_completion", "model_name": "tiny"},
        )
        == 2
    )
    assert (
        value(
            text,
            "kvfleet:gateway_request_duration_seconds_count",
            {"endpoint": "text_completion", "model_name": "tiny"},
        )
        == 2
    )
    assert value(text, "kvfleet:gateway_requests_in_flight") == 0
    _assert_totals_are_counters(text)


def test_every_metric_the_readme_names_is_served(metered):
    """Each `kvfleet:` metric README's "Metrics" section lists (up to its "Renamed:" note, which
    names the old ones) is served by the scheduler, a worker or the gateway: by its sample name,
    or by its family's (a labelled counter or a histogram with no sample yet is its TYPE line)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0].split("\nRenamed:", 1)[0]
    listed = set(re.findall(r"kvfleet:[a-z0-9_]+", section))
    assert len(listed) > 30, listed
    with SchedulerClient(metered.scheduler_address) as client:
        client.generate(build_request([1, 2, 3], 3))
    texts = [scrape(metered.metrics_ports[n]) for n in ("scheduler", "worker-0")]
    with urllib.request.urlopen(metered.gateway_url + "/metrics", timeout=30) as resp:
        texts.append(resp.read().decode())
    served = set()
    for text in texts:
        served |= {s.name for s in samples(text)} | set(types(text))
    missing = sorted(n for n in listed if n not in served and n.removesuffix("_total") not in served)
    assert not missing, f"README names metrics no service serves: {missing}"

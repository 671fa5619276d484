"""The services' Prometheus families as text: a `_total` family is a counter, the scheduler's
request timings follow a session's milestones, and the KV gauges say whose KV they measure."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest

from kvfleet_common.metrics import Kind, Reading, SnapshotCollector, token_buckets
from scheduler_svc.metrics import SchedulerMetrics


def _types(text: str) -> dict[str, str]:
    """{family: type}; a counter's family without its _total (prometheus_client writes the TYPE
    line with or without it, depending on its version)."""
    return {
        re.sub(r"_total$", "", name) if kind == "counter" else name: kind
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
    }


def _sample_names(text: str) -> set[str]:
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))


def _sample(text: str, name: str) -> float:
    (value,) = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(value)


def test_snapshot_collector_emits_counters_as_counters_and_groups_labels() -> None:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    reg.register(
        SnapshotCollector(
            lambda: [
                Reading("x:steps", "steps", 7, Kind.COUNTER),
                Reading("x:used", "used", 0.5, labels={"w": "a"}),
                Reading("x:used", "used", 0.25, labels={"w": "b"}),
            ]
        )
    )
    text = generate_latest(reg).decode()
    assert _types(text) == {"x:steps": "counter", "x:used": "gauge"}
    assert "x:steps_total 7.0" in text
    assert 'x:used{w="a"} 0.5' in text and 'x:used{w="b"} 0.25' in text


@pytest.mark.parametrize(
    "reading",
    [
        lambda: Reading("x:steps_total", "a counter named with its suffix", 1, Kind.COUNTER),
        lambda: Reading("x:blocks_total", "a gauge that claims to be a counter", 1),
    ],
)
def test_a_total_name_is_refused_where_it_would_mislead(reading) -> None:
    with pytest.raises(ValueError):
        reading()


def test_token_buckets_end_at_the_context_length() -> None:
    assert token_buckets(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 2048)
    assert token_buckets(10) == (1, 2, 5, 10)
    assert token_buckets(1) == (1,)


def _scheduler_text(metrics: SchedulerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_request_timings_follow_a_sessions_milestones() -> None:
    m = SchedulerMetrics("tiny", 64)
    m.arrived("a")
    m.admitted("a")
    m.token("a")  # first token: ttft and prefill time
    m.admitted("a")  # prefilled again after a preemption: not queued again
    for _ in range(3):
        m.token("a")  # three inter-token gaps
    m.iteration(5, 0)
    m.iteration(0, 1)
    m.finished_session("a", "length", 5, 4)
    m.arrived("b")  # cancelled while waiting: never admitted, no token
    m.finished_session("b", "abort", 3, 0)
    text = _scheduler_text(m)
    types = _types(text)
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "iteration_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert types[f"kvfleet:{name}"] == "histogram", name
    assert _sample(text, "kvfleet:request_queue_time_seconds_count") == 1
    assert _sample(text, "kvfleet:request_prefill_time_seconds_count") == 1
    assert _sample(text, "kvfleet:request_decode_time_seconds_count") == 1
    assert _sample(text, "kvfleet:time_to_first_token_seconds_count") == 1
    assert _sample(text, "kvfleet:inter_token_latency_seconds_count") == 3
    assert _sample(text, "kvfleet:e2e_request_latency_seconds_count") == 2
    assert _sample(text, "kvfleet:request_prompt_tokens_sum") == 8
    assert _sample(text, "kvfleet:request_generation_tokens_sum") == 4
    assert _sample(text, "kvfleet:iteration_tokens_sum") == 6
    assert _sample(text, "kvfleet:iteration_tokens_count") == 2
    assert 'kvfleet:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text


def test_every_scheduler_family_has_model_name_and_only_counters_end_in_total() -> None:
    from scheduler_svc.core.limits import SchedulerLimits
    from scheduler_svc.core.scheduler import SchedulerCore

    m = SchedulerMetrics("smollm2-135m", 2048)
    m.show(SchedulerCore(SchedulerLimits()).snapshot())
    m.tick(4, 2)
    m.update_rejections({"queue_full": 2})
    text = _scheduler_text(m)
    types = _types(text)
    for family, kind in types.items():
        assert not family.endswith("_total"), f"{family} is a {kind} named like a counter"
    for name in _sample_names(text):
        if name.endswith("_total"):
            assert types.get(name[: -len("_total")]) == "counter", name
    for kind_of, name in (
        ("counter", "kvfleet:num_preemptions"),
        ("counter", "kvfleet:ticks"),
        ("counter", "kvfleet:prompt_tokens"),
        ("counter", "kvfleet:request_rejections"),
        ("gauge", "kvfleet:scheduler_kv_usage_perc"),
        ("gauge", "kvfleet:num_requests_running"),
    ):
        assert types.get(name) == kind_of, name
    assert "kvfleet:kv_cache_usage_perc" not in text  # it meant two things; each owner names its own now
    samples = [ln for ln in text.splitlines() if ln.startswith("kvfleet:") and "_created" not in ln]
    assert samples
    for line in samples:
        assert 'model_name="smollm2-135m"' in line, line


def test_a_scrape_reads_the_core_s_state_now_on_the_loop_s_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """No snapshot is taken per tick: a scrape from another thread (the HTTP server's) has the
    loop read the state and shows it; a loop that is busy or gone leaves the last state read."""
    import asyncio
    import dataclasses
    import threading
    import time

    from scheduler_svc import metrics as metrics_mod
    from scheduler_svc.core.limits import SchedulerLimits
    from scheduler_svc.core.scheduler import SchedulerCore

    base = SchedulerCore(SchedulerLimits()).snapshot()
    state = {"running": 3}
    read_on: list[int] = []

    def read():
        read_on.append(threading.get_ident())
        return dataclasses.replace(base, active_sessions=state["running"])

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    m = SchedulerMetrics("tiny", 64)
    m.show(base)
    loop.call_soon_threadsafe(m.read_live, read, loop)  # from the loop, as the server calls it
    running = "kvfleet:num_requests_running"
    deadline = time.monotonic() + 5
    while m._live is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _sample(_scheduler_text(m), running) == 3
    state["running"] = 5  # the core moved on: the next scrape sees it
    assert _sample(_scheduler_text(m), running) == 5
    assert set(read_on) == {thread.ident}

    # The loop's own thread reads at once (a wait for itself would never end).
    async def scrape_on_loop():
        return _scheduler_text(m)

    state["running"] = 6
    assert _sample(asyncio.run_coroutine_threadsafe(scrape_on_loop(), loop).result(5), running) == 6

    # A busy loop: the scrape waits LIVE_READ_S, then shows the last state read.
    monkeypatch.setattr(metrics_mod, "LIVE_READ_S", 0.2)
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait, 5)
    state["running"] = 7
    reads = len(read_on)
    t0 = time.monotonic()
    assert _sample(_scheduler_text(m), running) == 6
    assert time.monotonic() - t0 < 2
    release.set()
    # The loop, free again, runs the late read (7). Stopped only once it has: a stop queued
    # beside the read's task could end the loop first (the test raced so before).
    deadline = time.monotonic() + 5
    while len(read_on) == reads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(read_on) == reads + 1, "the late read never ran"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
    # Closed, the loop leaves the last state read: the late one.
    assert _sample(_scheduler_text(m), running) == 7


def test_a_read_that_fails_leaves_the_last_state_and_every_other_family() -> None:
    import asyncio
    import dataclasses

    from scheduler_svc.core.limits import SchedulerLimits
    from scheduler_svc.core.scheduler import SchedulerCore

    def broken():
        raise ZeroDivisionError("a bug in the read")

    m = SchedulerMetrics("tiny", 64)
    m.show(dataclasses.replace(SchedulerCore(SchedulerLimits()).snapshot(), active_sessions=4))
    m.iteration(5, 0)
    loop = asyncio.new_event_loop()
    try:
        m.read_live(broken, loop)  # this thread is "the loop's": the scrape reads at once
        text = _scheduler_text(m)
    finally:
        loop.close()
    assert _sample(text, "kvfleet:num_requests_running") == 4
    assert _sample(text, "kvfleet:iteration_tokens_count") == 1

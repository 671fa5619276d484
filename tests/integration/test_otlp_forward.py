"""OTLP fan-out (telemetry_svc/forward.py): a telemetry service given --forward-otlp passes every
export it accepts on to another OTLP endpoint, as received; when that endpoint is gone its own
store still takes everything and the lost spans are counted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from telemetry_svc.forward import parse_endpoint
from telemetry_svc.server import TelemetryConfig
from tests.helpers.telemetry_server import RunningServer, export_request, otlp_export, raw_span


def _config(path: Path, **kw: object) -> TelemetryConfig:
    return TelemetryConfig(host="127.0.0.1", port=0, db_path=str(path), **kw)  # type: ignore[arg-type]


def _wait(predicate, what: str, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def test_exports_reach_the_forward_endpoint_and_losses_are_counted(tmp_path: Path) -> None:
    collector = RunningServer(_config(tmp_path / "collector.db"))
    front = RunningServer(_config(tmp_path / "front.db", forward_otlp=f"http://127.0.0.1:{collector.port}"))
    try:
        spans = [raw_span(f"s{i}", span_id=bytes([i + 1]) * 8) for i in range(3)]
        otlp_export(front.channel)(export_request(spans), timeout=10)
        names = _wait(lambda: sorted(r.name for r in collector.server.store.spans()), "the collector's spans")
        assert names == ["s0", "s1", "s2"]
        assert sorted(r.name for r in front.server.store.spans()) == names  # and kept here too
        metrics = front.server.metrics.registry
        # counted once the collector's answer is back in the front, which may be after the
        # collector stored them (a race that failed this test on a loaded machine)
        forwarded = "kvfleet:telemetry_forwarded_spans_total"
        _wait(lambda: metrics.get_sample_value(forwarded) == 3, "the forwarded count")
        time.sleep(0.2)
        assert metrics.get_sample_value(forwarded) == 3  # and not more
        collector.stop()
        collector = None
        otlp_export(front.channel)(export_request([raw_span("late", span_id=b"\x09" * 8)]), timeout=10)
        _wait(lambda: metrics.get_sample_value("kvfleet:telemetry_forward_dropped_spans_total") == 1, "the drop")
        assert "late" in {r.name for r in front.server.store.spans()}
    finally:
        front.stop()
        if collector is not None:
            collector.stop()


@pytest.mark.parametrize("bad", ["", "collector", "ftp://c:4317", "http://c", "http://c:4317/v1/traces"])
def test_a_bad_forward_endpoint_is_refused_at_start(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError, match="forward endpoint must be"):
        parse_endpoint(bad)
    if bad:
        with pytest.raises(ValueError, match="forward endpoint must be"):
            _config(tmp_path / "t.db", forward_otlp=bad)
    assert parse_endpoint("https://tempo.example:4317") == (True, "tempo.example:4317")
    assert parse_endpoint("collector:4317") == (False, "collector:4317")


def test_kvfleet_up_forwards_to_the_users_otlp_endpoint(tmp_path: Path) -> None:
    """With OTEL_EXPORTER_OTLP_ENDPOINT set, `kvfleet up`'s services still export to its own
    telemetry (which stores them) and that endpoint gets every span too."""
    from kvfleet.client import SchedulerClient, build_request
    from tests.helpers.up import Up

    collector = RunningServer(_config(tmp_path / "collector.db"))
    endpoint = f"http://127.0.0.1:{collector.port}"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    up = Up(["--model", "tiny", "--workers", "1", "--no-gateway"], tmp_path / "up.err", start_timeout_s=60, env=env)
    try:
        assert f"traces also go to {endpoint}" in up.banner, up.banner
        with SchedulerClient(up.scheduler) as client:
            assert client.generate(build_request([1, 2, 3], 4, ignore_eos=True)).token_ids
        services = _wait(
            lambda: (
                {"kvfleet-scheduler", "kvfleet-worker"} <= (s := {r.service for r in collector.server.store.spans()})
                and s
            ),
            "the cluster's spans at the user's endpoint",
        )
        assert {"kvfleet-scheduler", "kvfleet-worker"} <= services

        from tests.helpers.telemetry_db import wait_for_rows

        wait_for_rows(up.log_dir / "telemetry.db", "SELECT 1 FROM spans WHERE service = 'kvfleet-scheduler'",
                      what="the cluster's own store keeping the spans too")  # fmt: skip
    finally:
        assert up.stop() == 0, up.stderr()
        collector.stop()


def test_forwarding_to_itself_is_refused_and_kvfleet_up_skips_its_own_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfleet.cli import _forward_endpoint
    from telemetry_svc.forward import names_itself
    from telemetry_svc.server import create_server

    assert names_itself("http://localhost:4317", "127.0.0.1", 4317)
    assert names_itself("127.0.0.1:4317", "0.0.0.0", 4317)
    assert not names_itself("http://localhost:4318", "127.0.0.1", 4317)
    assert not names_itself("collector:4317", "127.0.0.1", 4317)

    import socket

    with socket.socket() as s:  # a free port to bind to and to name
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TelemetryConfig(host="127.0.0.1", port=port, db_path=str(tmp_path / "t.db"),
                             forward_otlp=f"http://127.0.0.1:{port}")  # fmt: skip

    import asyncio

    async def build() -> None:
        create_server(config)

    with pytest.raises(ValueError, match="own address"):
        asyncio.run(build())
    for var in (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
    assert _forward_endpoint(4317) == ""  # kvfleet up's own telemetry: nothing to forward
    assert _forward_endpoint(0) == "http://localhost:4317"  # (a free port was asked for)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318/v1/traces")
    assert _forward_endpoint(4317) == ""  # not an OTLP/gRPC address: kvfleet up starts without
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert _forward_endpoint(4317) == ""

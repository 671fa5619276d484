"""Each entry point's flag defaults are its config dataclass's: parsing no flags builds a config
equal to the dataclass's defaults, field by field, except the differences listed with why."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import gateway_svc.__main__ as gateway_main
import scheduler_svc.__main__ as scheduler_main
import telemetry_svc.__main__ as telemetry_main
import worker_svc.__main__ as worker_main
from gateway_svc.config import GatewayConfig
from kvfleet.cli import _spec, build_parser
from kvfleet.local_cluster import ClusterSpec
from kvfleet_common.security import TlsConfig
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.limits import SchedulerLimits
from telemetry_svc.http_api import JAEGER_QUERY_PORT
from telemetry_svc.server import TelemetryConfig
from tests.helpers.environment import clear_kvfleet_env, no_service_logging
from worker_svc.config import WorkerConfig


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags fall back on KVFLEET_* variables: none may be set, nor logging configured."""
    clear_kvfleet_env(monkeypatch)
    no_service_logging(monkeypatch)


def _differences(got: Any, want: Any) -> dict[str, tuple[Any, Any]]:
    return {
        f.name: (getattr(got, f.name), getattr(want, f.name))
        for f in dataclasses.fields(want)
        if getattr(got, f.name) != getattr(want, f.name)
    }


def test_worker_flags_default_to_worker_config() -> None:
    assert _differences(worker_main.parse_args([]), WorkerConfig()) == {}


def test_scheduler_flags_default_to_scheduler_config() -> None:
    # Deliberate: the scheduler has no default worker address (SchedulerConfig refuses none), so
    # both sides are given one; everything else is the defaults.
    got = scheduler_main.parse_args(["--workers", "w:1"])
    assert _differences(got, SchedulerConfig(workers=("w:1",))) == {}
    assert _differences(got.limits, SchedulerLimits()) == {}


def test_gateway_flags_default_to_gateway_config() -> None:
    config, _ = gateway_main.parse_args([])
    assert _differences(config, GatewayConfig()) == {}


# Deliberate differences of `python -m telemetry_svc` from TelemetryConfig(), each with its reason.
TELEMETRY_DIFFERENCES = {
    # The service exports /metrics on 9402 (beside the scheduler's 9400 and the workers' 9401);
    # a TelemetryConfig built in-process (tests, `kvfleet up`) opens no metrics port unless asked.
    "metrics_port": (telemetry_main.DEFAULT_METRICS_PORT, 0),
    # Likewise Jaeger's query API on 16686 (Jaeger's own query port, where Grafana's Jaeger data
    # source looks); a TelemetryConfig opens no HTTP port unless asked.
    "http_port": (JAEGER_QUERY_PORT, None),
    # The entry point reads TLS from the environment (plain TCP without KVFLEET_TLS_*); the
    # dataclass's None is plain TCP as well.
    "tls": (TlsConfig(), None),
}


def test_telemetry_flags_default_to_telemetry_config() -> None:
    config, _ = telemetry_main.parse_args([])
    assert _differences(config, TelemetryConfig()) == TELEMETRY_DIFFERENCES
    assert not config.tls.serves_tls


def test_telemetry_http_port_0_turns_the_trace_api_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """README: `--http-port` (KVFLEET_TELEMETRY_HTTP_PORT) 0 = off, where a TelemetryConfig's 0
    would take a free port: the entry point hands the service None for it."""
    monkeypatch.delenv("KVFLEET_TELEMETRY_HTTP_PORT", raising=False)
    assert telemetry_main.parse_args(["--http-port", "0"])[0].http_port is None
    assert telemetry_main.parse_args(["--http-port", "16700"])[0].http_port == 16700
    monkeypatch.setenv("KVFLEET_TELEMETRY_HTTP_PORT", "0")
    assert telemetry_main.parse_args([])[0].http_port is None
    assert telemetry_main.parse_args(["--http-port", "16701"])[0].http_port == 16701  # the flag wins


# Deliberate differences of `kvfleet up` from ClusterSpec(), each with its reason.
UP_DIFFERENCES = {
    # `kvfleet up` serves the scheduler on its own default port, where a ClusterSpec (a library
    # cluster, the tests') takes a free one.
    "scheduler_port": (SchedulerConfig.port, 0),
    # `kvfleet up` has logging flags of its own and hands their values to every process; a
    # ClusterSpec's "" leaves each process its own default, which is the same (text, INFO).
    "log_format": ("text", ""),
    "log_level": ("INFO", ""),
    # The settings LocalCluster passes no flag for when they are 0 or "" reach its processes as
    # their variables instead, at the values `kvfleet up` found, so that the caller's variable
    # cannot override a flag there (tests/unit/test_up_environment.py).
    "extra_env": (
        {
            "KVFLEET_KV_BUDGET_BYTES": "0",
            "KVFLEET_KV_CACHE_MEMORY": "",
            "KVFLEET_MAX_MODEL_LEN": "0",
            "KVFLEET_WORKER_THREADS": "0",
        },
        {},
    ),
}


def test_kvfleet_up_flags_default_to_cluster_spec() -> None:
    a = build_parser().parse_args(["up"])
    assert _differences(_spec(a, a.port), ClusterSpec()) == UP_DIFFERENCES
    assert (a.telemetry_port, a.trace_api_port, a.gateway_port, a.drain_grace) == (
        TelemetryConfig.port,
        JAEGER_QUERY_PORT,  # what `python -m telemetry_svc` serves it on
        GatewayConfig.port,
        ClusterSpec().drain_grace_s,
    )


def test_cluster_spec_defaults_are_the_services() -> None:
    spec, worker, limits = ClusterSpec(), WorkerConfig(), SchedulerLimits()
    assert (spec.model, spec.device, spec.dtype, spec.quant, spec.num_blocks, spec.block_size, spec.kv_views) == (
        worker.model,
        worker.device,
        worker.dtype,
        worker.quant,
        worker.num_blocks,
        worker.block_size,
        worker.kv_views.value,
    )
    assert (spec.max_running, spec.prefill_token_budget) == (limits.max_running, limits.prefill_token_budget)
    assert spec.pack_step_ms == limits.pack_step_ms
    assert spec.drain_grace_s == SchedulerConfig(workers=("w:1",)).drain_grace_s
    assert spec.overlap_scheduling == SchedulerConfig(workers=("w:1",)).overlap_scheduling


def test_kvfleet_sweep_runs_one_tick_at_a_time_unless_asked() -> None:
    # Its figures are compared with the reference's, which are one tick at a time.
    assert _spec(build_parser().parse_args(["sweep"])).overlap_scheduling is False
    assert _spec(build_parser().parse_args(["sweep", "--overlap-scheduling"])).overlap_scheduling is True
    assert _spec(build_parser().parse_args(["up"])).overlap_scheduling is SchedulerConfig.overlap_scheduling


def test_the_demos_sweep_is_kvfleet_sweeps_reference_run() -> None:
    """`make demo` ends with the concurrency sweep: the same run as `kvfleet sweep` with its
    defaults (whose figures test_cli checks against the reference's), one tick at a time."""
    from kvfleet.cli import _demo_sweep

    demo = vars(_demo_sweep(build_parser().parse_args(["demo"])))
    sweep = vars(build_parser().parse_args(["sweep"]))
    keys = ("scheduler", "model", "sessions", "prompt_len", "max_new_tokens", "prefill_budget", "seed")
    assert {k: demo[k] for k in keys} == {k: sweep[k] for k in keys}
    assert tuple(demo["concurrency"]) == tuple(sweep["concurrency"])
    assert demo["overlap_scheduling"] is sweep["overlap_scheduling"] is False
    cluster = ("workers", "max_running", "num_blocks", "block_size")
    assert {k: demo.get(k) for k in cluster} == {k: sweep.get(k) for k in cluster}


@pytest.mark.parametrize(
    "switch, field, variable",
    [("step-stream", "step_stream", "KVFLEET_STEP_STREAM"), ("step-spans", "step_spans", "KVFLEET_STEP_SPANS")],
)
def test_a_scheduler_switch_on_by_default_is_turned_off_by_its_flag_or_its_variable(
    monkeypatch: pytest.MonkeyPatch, switch: str, field: str, variable: str
) -> None:
    """The scheduler's, and `kvfleet up`'s, which passes it on."""
    assert getattr(SchedulerConfig(workers=("w:1",)), field) is True
    assert getattr(scheduler_main.parse_args(["--workers", "w:1", f"--no-{switch}"]), field) is False
    assert getattr(_spec(build_parser().parse_args(["up"])), field) is True
    assert getattr(_spec(build_parser().parse_args(["up", f"--no-{switch}"])), field) is False
    monkeypatch.setenv(variable, "false")
    assert getattr(scheduler_main.parse_args(["--workers", "w:1"]), field) is False
    assert getattr(scheduler_main.parse_args(["--workers", "w:1", f"--{switch}"]), field) is True


def test_no_cache_aware_routing_reaches_the_core_s_limits() -> None:
    """--no-cache-aware-routing: placement by load alone (its effect: test_scheduler_blocks)."""
    assert scheduler_main.parse_args(["--workers", "w:1"]).limits.cache_aware_routing is True
    assert (
        scheduler_main.parse_args(["--workers", "w:1", "--no-cache-aware-routing"]).limits.cache_aware_routing is False
    )


def test_pack_step_ms_reaches_the_core_s_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """--pack-step-ms (its effect: test_scheduler_blocks), from the scheduler's flag, its
    variable, and `kvfleet up`'s flag and variable."""
    assert scheduler_main.parse_args(["--workers", "w:1", "--pack-step-ms", "0"]).limits.pack_step_ms == 0
    assert _spec(build_parser().parse_args(["up", "--pack-step-ms", "0.5"])).pack_step_ms == 0.5
    monkeypatch.setenv("KVFLEET_PACK_STEP_MS", "5")
    assert scheduler_main.parse_args(["--workers", "w:1"]).limits.pack_step_ms == 5
    assert _spec(build_parser().parse_args(["up"])).pack_step_ms == 5
    with pytest.raises(ValueError, match="pack_step_ms must be 0"):
        scheduler_main.parse_args(["--workers", "w:1", "--pack-step-ms", "-1"])


@pytest.mark.parametrize("address", ["localhost", ":50061", "host:99999", "host:0", "host:port"])
def test_a_worker_address_without_a_host_and_a_port_is_refused(address: str) -> None:
    """host:99999 used to be taken, and the scheduler waited a minute for a worker there."""
    with pytest.raises(ValueError, match=r"must be host:port, the port a number in 1\.\.65535$"):
        SchedulerConfig(workers=(address,))
    SchedulerConfig(workers=("[::1]:50061", "w:1", "host:65535"))

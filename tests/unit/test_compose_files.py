"""The compose files, the dashboards profile's configs and the TLS overlay, read as data (no
Docker here; tests/e2e renders them with docker-compose and runs the stacks)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from scheduler_svc.config import SchedulerConfig
from tests.helpers.certs import SCRIPT as CERTS_SCRIPT
from tests.helpers.certs import make_dev_certs
from worker_svc.config import WorkerConfig

REPO = Path(__file__).resolve().parents[2]
CORE = ("telemetry", "worker-0", "worker-1", "scheduler", "gateway")
DASHBOARDS = ("otel-collector", "prometheus", "grafana")


def _load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


@pytest.fixture(scope="module")
def base() -> dict:
    return _load("docker-compose.yml")["services"]


@pytest.fixture(scope="module")
def tls() -> dict:
    return _load("docker-compose.tls.yml")["services"]


def test_core_services_check_health_over_grpc_and_wait_for_healthy_dependencies(base: dict) -> None:
    assert set(CORE) | set(DASHBOARDS) | {"worker-secret"} == set(base)
    for name in CORE:
        svc = base[name]
        assert "profiles" not in svc, name
        assert svc["healthcheck"]["test"][:3] == ["CMD", "python", "-m"], name
        assert svc["healthcheck"]["test"][3] == "kvfleet.healthcheck", name
        for dep, cond in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if dep == "worker-secret" else "service_healthy"
            assert cond == {"condition": want}, (name, dep)
    assert set(base["scheduler"]["depends_on"]) == {"worker-secret", "telemetry", "worker-0", "worker-1"}
    assert base["telemetry"]["volumes"] == ["telemetry-data:/data", "telemetry-token:/run/kvfleet-telemetry:ro"]
    for name in ("worker-0", "worker-1", "scheduler", "gateway"):
        assert base[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith("telemetry:4317}"), name


def test_dashboards_profile_fans_traces_out_and_scrapes_every_metrics_port(base: dict) -> None:
    for name in DASHBOARDS:
        assert base[name]["profiles"] == ["dashboards"], name
        for vol in base[name].get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (REPO / src).exists(), (name, src)
    collector = yaml.safe_load((REPO / "deploy/otel-collector/config.yaml").read_text())
    exporters = collector["service"]["pipelines"]["traces"]["exporters"]
    endpoints = {collector["exporters"][e]["endpoint"] for e in exporters if e in collector["exporters"]}
    assert endpoints == {"telemetry:4317"}  # Grafana reads the traces from telemetry: no Jaeger to feed
    # session spans are named `{operation} {model}`: span metrics find them by this attribute
    dimensions = {d["name"] for d in collector["connectors"]["spanmetrics"]["dimensions"]}
    assert "kvfleet.span" in dimensions
    prom = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"scheduler:{SchedulerConfig(workers=('w:1',)).metrics_port}" in targets
    assert {f"worker-{i}:{WorkerConfig().metrics_port}" for i in (0, 1)} <= targets
    # the gateway serves its /metrics on its API port
    assert f"gateway:{base['gateway']['environment']['KVFLEET_GATEWAY_PORT']}" in targets


def test_grafana_dashboard_shows_what_operators_need() -> None:
    dash = json.loads((REPO / "deploy/grafana/dashboards/kvfleet.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    for metric in (
        "kvfleet:num_requests_running",
        "kvfleet:num_requests_waiting",
        "kvfleet:batch_occupancy",
        "kvfleet:scheduler_kv_usage_perc",
        "kvfleet:worker_kv_cache_usage_perc",
        "kvfleet:generation_tokens_total",
        "kvfleet:num_preemptions_total",
        "kvfleet:time_to_first_token_seconds_bucket",
        "kvfleet:inter_token_latency_seconds_bucket",
        "kvfleet:request_queue_time_seconds_bucket",
        "kvfleet:request_prefill_time_seconds_bucket",
        "kvfleet:request_decode_time_seconds_bucket",
        "kvfleet:request_prompt_tokens_bucket",
        "kvfleet:request_generation_tokens_bucket",
        "kvfleet:iteration_tokens_bucket",
        "kvfleet:gateway_requests_total",
        "kvfleet:gateway_request_duration_seconds_bucket",
    ):
        assert metric in exprs, metric
    assert re.search(r"sum by \(reason\) \(rate\(kvfleet:request_rejections_total", exprs)
    # one name, one meaning: the scheduler's budget and a worker's blocks are named apart
    assert "kvfleet:kv_cache_usage_perc" not in exprs
    # a counter is charted as a rate, never as its raw running total
    for expr in (t["expr"] for p in dash["panels"] for t in p.get("targets", [])):
        for m in re.finditer(r"[a-z_:]+_total\b", expr):
            assert re.search(r"(rate|increase)\($", expr[: m.start()]), expr
    # session spans are found by kvfleet.span, their names being `{operation} {model}`
    assert 'span_name="session"' not in exprs and 'kvfleet_span="session"' in exprs
    # the model filter the scheduler's families carry (model_name) is a dashboard variable
    assert [v["name"] for v in dash["templating"]["list"]] == ["model_name"]
    sources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/datasources.yaml").read_text())
    uids = {d["uid"] for d in sources["datasources"]}
    used = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert used <= uids
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_grafanas_jaeger_data_source_reads_telemetrys_own_trace_api(
    base: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Jaeger: Grafana's Jaeger data source points at the telemetry service's Jaeger query API,
    on the port the telemetry entry point serves it by default and compose publishes."""
    import telemetry_svc.__main__ as telemetry_main
    from telemetry_svc.http_api import JAEGER_QUERY_PORT

    sources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/datasources.yaml").read_text())
    (source,) = [d for d in sources["datasources"] if d["type"] == "jaeger"]
    assert source["url"] == f"http://telemetry:{JAEGER_QUERY_PORT}" and source["access"] == "proxy"
    assert "telemetry" in base["grafana"]["depends_on"]
    assert not any("jaeger" in str(svc.get("image", "")) for svc in base.values())
    assert [p for p in base["telemetry"]["ports"] if p.endswith(f":{JAEGER_QUERY_PORT}")]
    for k in [k for k in os.environ if k.startswith("KVFLEET_")]:
        monkeypatch.delenv(k)
    config, _ = telemetry_main.parse_args(["--host", "0.0.0.0", "--db", "/data/telemetry.db"])  # the container's
    assert config.http_port == JAEGER_QUERY_PORT and config.host == "0.0.0.0"


def _tls_mounts(svc: dict) -> list[str]:
    return [v.rsplit(":", 2)[0] for v in svc["volumes"] if v.endswith(":/tls:ro")]


def test_tls_overlay_covers_every_core_service(tls: dict) -> None:
    assert set(tls) == set(CORE)
    certs = CERTS_SCRIPT.read_text()
    issued = set(re.findall(r"^issue (\w+) ", certs, re.M))
    for name, svc in tls.items():
        env = svc["environment"]
        ident = Path(env["KVFLEET_TLS_CERT"]).stem
        assert ident in issued and env["KVFLEET_TLS_KEY"] == f"/tls/{ident}.key", name
        assert env.get("KVFLEET_TLS_CA") == "/tls/ca.pem", name
        if name != "telemetry":  # the others export spans to telemetry over mutual TLS
            assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "false", name
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("${KVFLEET_OTLP_ENDPOINT:-https://"), name
            assert env["OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"] == env["KVFLEET_TLS_CERT"], name
    for worker in ("worker-0", "worker-1"):
        env = tls[worker]["environment"]
        assert env["KVFLEET_TLS_CLIENT_AUTH"] == "true"
        assert env["KVFLEET_TLS_ALLOWED_CLIENTS"] == "kvfleet-scheduler"
    assert tls["telemetry"]["environment"]["KVFLEET_TLS_CLIENT_AUTH"] == "true"


def test_tls_overlay_mounts_each_service_its_own_key_only(tls: dict) -> None:
    """Not the whole folder: a gateway or worker that is broken into must not hand out the
    scheduler's key (the one identity workers obey) nor the CA's (any identity at all)."""
    for name, svc in tls.items():
        ident = Path(svc["environment"]["KVFLEET_TLS_CERT"]).stem
        (source,) = _tls_mounts(svc)
        assert source.startswith("${KVFLEET_TLS_DIR:?") and source.endswith("}/" + ident), (name, source)
        for key, path in ((k, v) for k, v in svc["environment"].items() if str(v).startswith("/tls/")):
            assert Path(path).name in {"ca.pem", f"{ident}.pem", f"{ident}.key"}, (name, key, path)


def test_tls_overlay_mounts_folders_the_cert_script_makes_with_the_files_named(tls: dict, tmp_path: Path) -> None:
    make_dev_certs(tmp_path)
    for name, svc in tls.items():
        (source,) = _tls_mounts(svc)
        folder = tmp_path / source.rsplit("}/", 1)[1]
        files = {p.name for p in folder.iterdir()}
        assert "ca.key" not in files and not any(f.endswith(".key") and f != f"{folder.name}.key" for f in files)
        for path in (v for v in svc["environment"].values() if str(v).startswith("/tls/")):
            assert Path(path).name in files, (name, path)


def test_tls_overlay_requires_the_token_and_the_gateway_passes_callers_keys_through(
    tls: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway_svc.__main__ import parse_args
    from gateway_svc.config import AuthMode

    assert tls["scheduler"]["environment"]["KVFLEET_API_TOKEN"].startswith("${KVFLEET_API_TOKEN:?")
    gateway = tls["gateway"]["environment"]
    # The gateway holds no token of the scheduler's: it cannot serve a caller the scheduler refuses.
    assert "KVFLEET_API_TOKEN" not in gateway and gateway["KVFLEET_GATEWAY_ALLOW_ANONYMOUS"] == "false"
    assert tls["scheduler"]["environment"]["KVFLEET_SCHEDULER_ALLOW_ANONYMOUS"] == "false"
    for k in [k for k in os.environ if k.startswith("KVFLEET_")]:
        monkeypatch.delenv(k)
    for k, v in gateway.items():
        if k.startswith("KVFLEET_GATEWAY_"):
            monkeypatch.setenv(k, v)
    config, _ = parse_args([])
    assert config.auth_mode is AuthMode.PASS_THROUGH


def test_workers_and_scheduler_share_a_generated_secret_and_nothing_else_reads_it(base: dict) -> None:
    """The scheduler<->worker secret: made once per volume by the one-shot worker-secret service,
    mounted read-only into the scheduler and the workers only, and read from the file."""
    init = base["worker-secret"]
    assert init["restart"] == "no"
    assert init["volumes"] == ["worker-secret:/run/kvfleet", "telemetry-token:/run/kvfleet-telemetry"]
    script = init["command"][-1]
    assert "secrets.token_urlsafe(32)" in script and "chmod 0400" in script and "umask 077" in script
    for name in ("worker-0", "worker-1", "scheduler"):
        svc = base[name]
        assert "worker-secret:/run/kvfleet:ro" in svc["volumes"], name
        assert svc["environment"]["KVFLEET_WORKER_SECRET_FILE"] == "/run/kvfleet/worker-secret", name
        assert svc["depends_on"]["worker-secret"] == {"condition": "service_completed_successfully"}, name
    for name in ("telemetry", "gateway", *DASHBOARDS):
        assert not any("worker-secret" in str(v) for v in base[name].get("volumes", [])), name
        assert "KVFLEET_WORKER_SECRET_FILE" not in base[name].get("environment", {}), name
    # The telemetry write token: its own volume, into telemetry and every service exporting spans.
    assert "test -s $$t/telemetry-token" in script and "collector-auth.yaml" in script
    for name in ("telemetry", "worker-0", "worker-1", "scheduler", "gateway", "otel-collector"):
        assert "telemetry-token:/run/kvfleet-telemetry:ro" in base[name]["volumes"], name
    for name in ("telemetry", "worker-0", "worker-1", "scheduler", "gateway"):
        assert base[name]["environment"]["KVFLEET_TELEMETRY_TOKEN_FILE"] == "/run/kvfleet-telemetry/telemetry-token"


def test_every_published_port_binds_loopback_unless_the_operator_says_otherwise(base: dict) -> None:
    published = {name: svc["ports"] for name, svc in base.items() if "ports" in svc}
    assert set(published) == {"telemetry", "scheduler", "gateway", "prometheus", "grafana"}
    for name, ports in published.items():
        for port in ports:
            assert port.startswith(("127.0.0.1:", "${KVFLEET_BIND:-127.0.0.1}:")), (name, port)
    # reads need no token (the Telemetry API's, the trace API's): never opened
    assert len(base["telemetry"]["ports"]) == 2
    assert all(p.startswith("127.0.0.1:") for p in base["telemetry"]["ports"])
    # open only because the ports are loopback; the operator who widens them turns this off
    assert base["scheduler"]["environment"]["KVFLEET_SCHEDULER_ALLOW_ANONYMOUS"] == "${KVFLEET_ANONYMOUS:-true}"
    assert base["gateway"]["environment"]["KVFLEET_GATEWAY_ALLOW_ANONYMOUS"] == "${KVFLEET_ANONYMOUS:-true}"
    grafana = base["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana


def test_compose_services_start_with_their_environment(
    base: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each service's configuration, parsed as its container would (host 0.0.0.0 as the image's
    entrypoint sets it), starts; without the secret a worker, and without --allow-anonymous the
    scheduler, refuse to, which is what makes the compose settings above necessary."""
    from scheduler_svc.__main__ import parse_args as scheduler_args
    from worker_svc.__main__ import parse_args as worker_args

    secret = tmp_path / "worker-secret"
    secret.write_text("s" * 43 + "\n")

    def environ(name: str, drop: str = "") -> None:
        for k in [k for k in os.environ if k.startswith("KVFLEET_")]:
            monkeypatch.delenv(k)
        for k, v in base[name]["environment"].items():
            if k.startswith("KVFLEET_") and k != drop:
                value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))  # compose's defaults
                monkeypatch.setenv(k, str(secret) if k == "KVFLEET_WORKER_SECRET_FILE" else value)

    environ("worker-0")
    assert worker_args(["--host", "0.0.0.0", "--model", "tiny"]).worker_secret == "s" * 43
    environ("worker-0", drop="KVFLEET_WORKER_SECRET_FILE")
    with pytest.raises(ValueError, match="beyond loopback"):
        worker_args(["--host", "0.0.0.0", "--model", "tiny"])
    environ("scheduler")
    config = scheduler_args(["--host", "0.0.0.0"])
    assert config.worker_secret == "s" * 43 and config.allow_anonymous
    environ("scheduler", drop="KVFLEET_SCHEDULER_ALLOW_ANONYMOUS")
    with pytest.raises(ValueError, match="beyond loopback"):
        scheduler_args(["--host", "0.0.0.0"])

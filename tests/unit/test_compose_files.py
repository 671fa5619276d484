"""The compose files, the dashboards profile's configs and the TLS overlay, read as data (no
Docker here; tests/e2e renders them with docker-compose and runs the stacks)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from scheduler_svc.config import SchedulerConfig
from tests.helpers.certs import SCRIPT as CERTS_SCRIPT
from tests.helpers.certs import make_dev_certs
from tests.helpers.environment import clear_kvfleet_env
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


# ---- the header's settings, the services' variables and their defaults --------------------------

SETTING = re.compile(r"^#   (KVFLEET_\w+) ", re.M)  # an entry of the header's settings list
DEFAULT = re.compile(r"^\$\{(KVFLEET_\w+):-([^}]*)\}$")  # a value that is one setting with its default
# Settings of compose itself (the image, its build, the host side of published ports), not of a service.
COMPOSE_LEVEL = {"KVFLEET_IMAGE", "KVFLEET_BASE_IMAGE", "KVFLEET_BUILD_NETWORK", "KVFLEET_BIND"}
# Compose's own choices, said so in its header: the real model rather than tiny, anonymous while loopback.
COMPOSE_CHOICES = {"KVFLEET_MODEL", "KVFLEET_ANONYMOUS"}
# Variables the services read outside their flag parsers (kvfleet_common.security, tracing): TLS
# and the span exporters' token file everywhere, then each service's own.
READ_DIRECTLY = {
    "KVFLEET_TLS_CERT",
    "KVFLEET_TLS_KEY",
    "KVFLEET_TLS_CA",
    "KVFLEET_TLS_CLIENT_AUTH",
    "KVFLEET_TLS_ALLOWED_CLIENTS",
    "KVFLEET_TELEMETRY_TOKEN_FILE",
}
READ_DIRECTLY_BY = {
    "scheduler": {"KVFLEET_API_TOKEN", "KVFLEET_WORKER_SECRET_FILE"},
    "worker": {"KVFLEET_WORKER_SECRET_FILE"},
    "gateway": {"KVFLEET_API_TOKEN"},  # its scheduler_token
    "telemetry": {"KVFLEET_API_TOKEN"},  # its live scheduler snapshot's calls
}
# What each entry point needs to parse at all (the container passes the same).
ARGV = {"scheduler": ["--workers", "worker-0:50061"], "telemetry": ["--db", "/data/telemetry.db"]}
ONE_HOST = "One host: docker compose"


def _entry_points() -> dict[str, Callable[[list[str]], object]]:
    from gateway_svc.__main__ import parse_args as gateway
    from scheduler_svc.__main__ import parse_args as scheduler
    from telemetry_svc.__main__ import parse_args as telemetry
    from worker_svc.__main__ import parse_args as worker

    return {"telemetry": telemetry, "worker-0": worker, "worker-1": worker, "scheduler": scheduler, "gateway": gateway}


def _help(parse: Callable[[list[str]], object], monkeypatch: pytest.MonkeyPatch, capsys) -> str:
    clear_kvfleet_env(monkeypatch)
    monkeypatch.setenv("COLUMNS", "1000")  # one line a flag: no name split by wrapping
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse(["--help"])
    return capsys.readouterr().out


def _flag_variables(parse: Callable[[list[str]], object], monkeypatch: pytest.MonkeyPatch, capsys) -> set[str]:
    """The variables of a parser's flags, as its --help names them ("[env KVFLEET_...]")."""
    return set(re.findall(r"\[env\s+(KVFLEET_\w+)\]", _help(parse, monkeypatch, capsys)))


def _header() -> str:
    text = (REPO / "docker-compose.yml").read_text()
    return "\n".join(line for line in text.split("\n\n", 1)[0].splitlines() if line.startswith("#"))


def _uses(svc: dict) -> dict[str, set[str]]:
    """{KVFLEET_* setting: the service's keys (environment, ports, image, ...) that interpolate it}"""
    out: dict[str, set[str]] = {}

    def walk(key: str, value: object) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(key, v)
        elif isinstance(value, list):
            for v in value:
                walk(key, v)
        else:
            for var in re.findall(r"\$\{(KVFLEET_\w+)", str(value)):
                out.setdefault(var, set()).add(key)

    for key, value in svc.items():
        walk(key, value)
    return out


def _readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n### {title}\n")
    return text[start : text.find("\n### ", start + 1)]


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", " ".join(text.split()))


def test_every_setting_the_header_lists_reaches_a_service_and_none_goes_unlisted(base: dict) -> None:
    listed = set(SETTING.findall(_header()))
    where: dict[str, set[str]] = {}
    for svc in base.values():
        for var, keys in _uses(svc).items():
            where.setdefault(var, set()).update(keys)
    assert listed - set(where) == set(), "listed in the header, but no service receives it"
    assert set(where) - listed == set(), "used by a service, but not in the header's list"
    for var in sorted(listed):
        compose_level = var in COMPOSE_LEVEL or var.startswith("KVFLEET_PUBLISH_")
        assert where[var] & ({"image", "build", "ports"} if compose_level else {"environment"}), (var, where[var])


@pytest.mark.parametrize("overlay", [False, True], ids=["base", "tls"])
def test_each_service_gets_only_variables_it_reads(
    base: dict, tls: dict, overlay: bool, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A variable no parser reads would be a setting that silently does nothing."""
    for name, parse in _entry_points().items():
        known = _flag_variables(parse, monkeypatch, capsys) | READ_DIRECTLY | READ_DIRECTLY_BY[name.split("-")[0]]
        env = {**base[name]["environment"], **(tls[name]["environment"] if overlay else {})}
        assert sorted(k for k in env if k.startswith("KVFLEET_") and k not in known) == [], name


def test_compose_defaults_are_the_services_own(base: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting a variable to compose's default parses to the same configuration as leaving it
    unset: an unset setting means the service's own default (an empty string is a value, not
    "unset", for the flag parser: a choice such as --kv-dtype refuses it)."""
    checked = set()
    for name, parse in _entry_points().items():
        argv = ARGV.get(name, [])
        for key, value in base[name]["environment"].items():
            m = DEFAULT.match(str(value))
            if not key.startswith("KVFLEET_") or not m or m[1] in COMPOSE_CHOICES:
                continue
            clear_kvfleet_env(monkeypatch)
            own = parse(argv)
            monkeypatch.setenv(key, m[2])
            assert parse(argv) == own, (name, key, m[2])
            checked.add(m[1])
    assert {"KVFLEET_NUM_BLOCKS", "KVFLEET_KV_CACHE_MEMORY", "KVFLEET_KV_DTYPE", "KVFLEET_QUANT"} <= checked


def test_readme_states_composes_defaults(base: dict) -> None:
    defaults = {
        m[1]: m[2] for svc in base.values() for v in svc.get("environment", {}).values() if (m := DEFAULT.match(str(v)))
    }
    stated = re.findall(r"`(KVFLEET_\w+)` \(default ([^\s:;,)]+)", " ".join(_readme_section(ONE_HOST).split()))
    assert stated
    for var, value in stated:
        assert defaults[var] == value, (var, value)


def test_without_the_overlay_anonymous_false_refuses_to_start_and_the_docs_say_so(
    base: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The base file gives the scheduler and gateway no token: with anonymous callers off they
    have nothing to know callers by, beyond loopback (0.0.0.0 in their containers), and refuse
    to start. Tokens come with the TLS overlay; the header and README must not promise otherwise."""
    entry = _entry_points()
    secret = tmp_path / "worker-secret"
    secret.write_text("s" * 43 + "\n")
    for name in ("scheduler", "gateway"):
        env = base[name]["environment"]
        assert not {"KVFLEET_API_TOKEN", "KVFLEET_GATEWAY_API_KEY"} & set(env), name
        clear_kvfleet_env(monkeypatch)
        for k, v in env.items():
            if k.startswith("KVFLEET_"):
                # compose's defaults, but KVFLEET_ANONYMOUS=false
                value = re.sub(
                    r"\$\{(\w+):-([^}]*)\}", lambda m: "false" if m[1] == "KVFLEET_ANONYMOUS" else m[2], str(v)
                )
                monkeypatch.setenv(k, value)
        monkeypatch.setenv("KVFLEET_WORKER_SECRET_FILE", str(secret))
        with pytest.raises(ValueError, match="beyond loopback"):
            entry[name]([*ARGV.get(name, []), "--host", "0.0.0.0"])
    header_entries = re.split(r"\n(?=#   KVFLEET_\w+ )", _header())
    readme = (REPO / "README.md").read_text()
    (security,) = [p for p in readme.split("\n\n") if p.startswith("To open compose's scheduler and gateway")]
    said = [s for text in (*header_entries, security) for s in _sentences(text.replace("#", ""))]
    said = [s for s in said if "KVFLEET_ANONYMOUS=false" in s]
    assert said
    for sentence in said:
        assert "refuse" in sentence and "overlay" in sentence, sentence


def test_tls_overlay_gives_telemetry_the_token_its_scheduler_snapshot_needs(
    base: dict, tls: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the overlay the scheduler's client API wants the token for every call, the trace
    UI's live snapshot (GetTelemetry, ListWorkers) included; telemetry's link sends
    $KVFLEET_API_TOKEN over TLS with its own certificate."""
    from kvfleet_common.security import TlsConfig, token_metadata

    assert base["telemetry"]["environment"]["KVFLEET_TELEMETRY_SCHEDULER"] == "scheduler:50051"
    env = tls["telemetry"]["environment"]
    assert env["KVFLEET_API_TOKEN"] == tls["scheduler"]["environment"]["KVFLEET_API_TOKEN"]
    assert TlsConfig.from_env(env).dials_tls
    clear_kvfleet_env(monkeypatch)
    monkeypatch.setenv("KVFLEET_API_TOKEN", "t")
    assert token_metadata() == [("authorization", "Bearer t")]


def test_a_mounted_model_reaches_every_service_that_reads_kvfleet_model(
    base: dict, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The scheduler tokenizes with the model, the workers run it: the README's override mounts
    the model folder into exactly the services that read KVFLEET_MODEL."""
    readers = {
        n for n, parse in _entry_points().items() if "KVFLEET_MODEL" in _flag_variables(parse, monkeypatch, capsys)
    }
    assert readers == {"scheduler", "worker-0", "worker-1"}
    assert {n for n in CORE if "KVFLEET_MODEL" in base[n]["environment"]} == readers
    (block,) = re.findall(r"```yaml\n(.*?)```", _readme_section(ONE_HOST), re.S)
    override = yaml.safe_load(block)["services"]
    assert {n for n, svc in override.items() if any(v.split(":")[1] == "/models" for v in svc["volumes"])} == readers


def test_the_header_and_k8s_name_every_quant_and_kv_dtype_choice(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from worker_svc.__main__ import parse_args as worker_args

    usage = _help(worker_args, monkeypatch, capsys)
    entries = {SETTING.match(e)[1]: e for e in re.split(r"\n(?=#   KVFLEET_\w+ )", _header()) if SETTING.match(e)}
    k8s = (REPO / "deploy/k8s/workers.yaml").read_text()
    for flag, var in (("--quant", "KVFLEET_QUANT"), ("--kv-dtype", "KVFLEET_KV_DTYPE")):
        choices = re.search(rf"{flag} \{{([^}}]+)\}}", usage)[1].split(",")
        assert set(choices) <= set(re.findall(r"\w+", entries[var])), (var, choices)
    (quant,) = [line for line in k8s.splitlines() if "name: KVFLEET_QUANT" in line]
    choices = re.search(r"--quant \{([^}]+)\}", usage)[1].split(",")
    assert set(choices) <= set(re.findall(r"\w+", quant.split("#", 1)[1])), quant

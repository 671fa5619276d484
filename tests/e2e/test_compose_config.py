"""docker-compose renders every way the README starts the stack: plain, with the dashboards
profile (whose images cannot be pulled on a machine without registry access, so it is checked
here as far as docker-compose goes), with the TLS overlay, and with the README's override that
mounts a model of one's own. Needs docker-compose only."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml

from tests.e2e.conftest import REPO, _compose_command

pytestmark = pytest.mark.e2e


def _config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    return subprocess.run(
        [*_compose_command(), *args, "config"],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plain_and_dashboards_profile_render() -> None:
    plain = _config("-f", "docker-compose.yml")
    assert plain.returncode == 0, plain.stderr
    services = yaml.safe_load(plain.stdout)["services"]
    # docker-compose 1.x lists profiled services in `config` too; they carry their profile
    core = {n for n, s in services.items() if not s.get("profiles")}
    assert core == {"worker-secret", "telemetry", "worker-0", "worker-1", "scheduler", "gateway"}
    # as docker-compose renders them: every published port on loopback unless KVFLEET_BIND says so
    for name, svc in services.items():
        for port in svc.get("ports", []):
            host = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host == "127.0.0.1", (name, port)
    opened = _config("-f", "docker-compose.yml", env={"KVFLEET_BIND": "0.0.0.0"})
    assert opened.returncode == 0, opened.stderr
    gateway_ports = yaml.safe_load(opened.stdout)["services"]["gateway"]["ports"]
    assert [p.get("host_ip") if isinstance(p, dict) else str(p).split(":")[0] for p in gateway_ports] == ["0.0.0.0"]
    dash = _config(
        "-f",
        "docker-compose.yml",
        "--profile",
        "dashboards",
        env={"KVFLEET_OTLP_ENDPOINT": "http://otel-collector:4317"},
    )
    assert dash.returncode == 0, dash.stderr
    rendered = yaml.safe_load(dash.stdout)["services"]
    assert {n for n, s in rendered.items() if s.get("profiles") == ["dashboards"]} == {
        "otel-collector",
        "prometheus",
        "grafana",
    }  # no Jaeger: Grafana's Jaeger data source reads telemetry's trace API
    assert rendered["scheduler"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def test_tls_overlay_renders_and_says_what_it_needs(tmp_path) -> None:
    files = ("-f", "docker-compose.yml", "-f", "docker-compose.tls.yml")
    missing = _config(*files, env={"KVFLEET_API_TOKEN": "t"})
    assert missing.returncode != 0 and "KVFLEET_TLS_DIR" in missing.stderr, missing.stderr
    no_token = _config(*files, env={"KVFLEET_TLS_DIR": str(tmp_path)})
    assert no_token.returncode != 0 and "KVFLEET_API_TOKEN" in no_token.stderr, no_token.stderr
    ok = _config(*files, env={"KVFLEET_TLS_DIR": str(tmp_path), "KVFLEET_API_TOKEN": "t"})
    assert ok.returncode == 0, ok.stderr
    services = yaml.safe_load(ok.stdout)["services"]
    for name in ("telemetry", "worker-0", "worker-1", "scheduler", "gateway"):
        env = services[name]["environment"]
        assert env["KVFLEET_TLS_CERT"].startswith("/tls/"), name
        # its own folder only, whichever syntax this docker-compose renders volumes in
        own = f"{tmp_path}/{name.split('-')[0]}"
        mounts = [str(m) for m in services[name]["volumes"] if "/tls" in str(m)]
        assert len(mounts) == 1 and own in mounts[0] and f"'{tmp_path}'" not in mounts[0], (name, mounts)
    assert services["worker-1"]["environment"]["KVFLEET_TLS_ALLOWED_CLIENTS"] == "kvfleet-scheduler"
    assert services["worker-1"]["environment"]["KVFLEET_WORKER_ID"] == "worker-1"  # base env kept
    assert services["scheduler"]["environment"]["KVFLEET_API_TOKEN"] == "t"
    gateway = services["gateway"]["environment"]
    assert gateway["KVFLEET_GATEWAY_PASS_THROUGH_KEY"] == "true" and "KVFLEET_API_TOKEN" not in gateway


def test_every_span_writer_gets_the_telemetry_token_and_only_the_scheduler_and_workers_the_secret() -> None:
    plain = _config("-f", "docker-compose.yml", "--profile", "dashboards")
    assert plain.returncode == 0, plain.stderr
    services = yaml.safe_load(plain.stdout)["services"]
    token_file = "/run/kvfleet-telemetry/telemetry-token"

    def mounts(name: str) -> str:
        return " ".join(str(v) for v in services[name].get("volumes", []))

    for name in ("telemetry", "worker-0", "worker-1", "scheduler", "gateway"):
        assert services[name]["environment"]["KVFLEET_TELEMETRY_TOKEN_FILE"] == token_file, name
        assert "telemetry-token" in mounts(name) and "/run/kvfleet-telemetry" in mounts(name), name
        secret_holder = name not in ("telemetry", "gateway")
        assert ("worker-secret" in mounts(name)) == secret_holder, (name, mounts(name))
        assert ("KVFLEET_WORKER_SECRET_FILE" in services[name]["environment"]) == secret_holder, name
        if name != "gateway":  # (it starts after the scheduler, which waits for worker-secret)
            assert "worker-secret" in services[name]["depends_on"], name
    # The collector forwards to kvfleet-telemetry with the token, from the file worker-secret wrote.
    collector = services["otel-collector"]
    assert "--config=file:/run/kvfleet-telemetry/collector-auth.yaml" in collector["command"]
    assert "telemetry-token" in " ".join(str(v) for v in collector["volumes"])


def test_the_readmes_model_override_mounts_it_beside_each_services_own_volumes(tmp_path) -> None:
    """The README's docker-compose.override.yml: the scheduler (its tokenizer) and both workers
    get the model folder, and keep their secret, token (and TLS) mounts, which compose merges by
    their path in the container."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("\n### One host: docker compose\n")
    (block,) = re.findall(r"```yaml\n(.*?)```", readme[start : readme.find("\n### ", start + 1)], re.S)
    override = tmp_path / "docker-compose.override.yml"
    override.write_text(block)
    tls = ("-f", "docker-compose.tls.yml")
    for overlay, env in (((), {}), (tls, {"KVFLEET_TLS_DIR": str(tmp_path), "KVFLEET_API_TOKEN": "t"})):
        files = ("-f", "docker-compose.yml", *overlay, "-f", str(override))
        out = _config(*files, env={"KVFLEET_MODEL": "/models/x.gguf", **env})
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        for name in ("scheduler", "worker-0", "worker-1"):
            mounts = " ".join(str(v) for v in services[name]["volumes"])
            wanted = ["/models", "/run/kvfleet", "/run/kvfleet-telemetry", *(["/tls"] if overlay else [])]
            assert all(f"{m}:" in mounts or f"'{m}'" in mounts for m in wanted), (name, mounts)
            assert services[name]["environment"]["KVFLEET_MODEL"] == "/models/x.gguf", name

"""The gateway in front of a scheduler that wants a bearer token (tiny model, real processes on
loopback): it must not lend that token to callers who show no key, and the spans it writes are
named from what it validated, not from what a caller typed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from kvfleet.local_cluster import ClusterSpec, LocalCluster, free_port
from tests.helpers.gateway import GatewayProcess, http
from tests.helpers.telemetry_db import wait_for_rows

TOKEN = "scheduler-s3cret"
BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVFLEET_API_TOKEN", "KVFLEET_GATEWAY_"))}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(ClusterSpec(workers=1, model="tiny", api_token=TOKEN)) as c:
        yield c


@pytest.fixture()
def gateways(cluster):
    started: list[GatewayProcess] = []

    def start(name: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> GatewayProcess:
        g = GatewayProcess(
            cluster.scheduler_address,
            cluster.log_dir,
            name=name,
            args=args,
            env={"KVFLEET_API_TOKEN": "", "KVFLEET_GATEWAY_API_KEY": "", **(env or {})},
        )
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


def test_a_gateway_holding_the_schedulers_token_refuses_to_start_without_a_key(cluster):
    """Before: it started and generated for anyone with the scheduler's token."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway_svc",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--scheduler",
            cluster.scheduler_address,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**_clean_env(), "KVFLEET_API_TOKEN": TOKEN},
    )
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        served = http("POST", f"http://127.0.0.1:{port}/v1/completions", BODY)[0]
        pytest.fail(
            f"the gateway started open in front of a token-protected scheduler (a keyless completion answered {served})"
        )
    assert proc.returncode != 0
    assert "--allow-anonymous" in out and "KVFLEET_GATEWAY_API_KEY" in out and "--pass-through-key" in out, out


def test_with_its_own_key_the_gateway_lends_its_token_to_key_holders_only(gateways):
    g = gateways("gateway-own-key", env={"KVFLEET_API_TOKEN": TOKEN, "KVFLEET_GATEWAY_API_KEY": "gw-key"})
    url = g.url + "/v1/completions"
    assert http("POST", url, BODY)[0] == 401
    assert http("POST", url, BODY, _bearer(TOKEN))[0] == 401  # the scheduler's token is not the key
    status, out, _ = http("POST", url, BODY, _bearer("gw-key"))
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    assert http("GET", g.url + "/health")[1]["live_workers"] == 1  # its own token asks for workers


def test_passing_the_key_through_lets_the_scheduler_judge_each_caller(gateways):
    g = gateways("gateway-pass-through", args=("--pass-through-key",))
    url = g.url + "/v1/completions"
    status, err, _ = http("POST", url, BODY)
    assert status == 401 and "Authorization: Bearer" in err["error"]["message"]
    for bad in ("Bearer wrong-token", "Bearer ", "Basic " + TOKEN, "Bearer tok\u00e9n"):
        status, err, _ = http("POST", url, BODY, {"Authorization": bad.encode("utf-8").decode("latin-1")})
        assert (status, err["error"]["code"]) == (401, "invalid_api_key"), (bad, err)
    assert http("GET", g.url + "/v1/models", headers=_bearer("wrong-token"))[0] == 401  # no model list either
    status, out, _ = http("POST", url, BODY, _bearer(TOKEN))
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    status, models, _ = http("GET", g.url + "/v1/models", headers=_bearer(TOKEN))
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny"]
    # The gateway holds no token: /health says the scheduler serves, and cannot count workers.
    status, health, _ = http("GET", g.url + "/health")
    assert (status, health["scheduler"], health["live_workers"]) == (200, "SERVING", None)


def test_allow_anonymous_serves_keyless_callers_only_when_said(gateways):
    g = gateways("gateway-anonymous", args=("--allow-anonymous",), env={"KVFLEET_API_TOKEN": TOKEN})
    status, out, _ = http("POST", g.url + "/v1/completions", BODY)
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    assert "--allow-anonymous: anyone who reaches this port" in g.log_path.read_text()


def _gateway_spans(cluster, since_ns: int, count: int) -> list[tuple[str, dict]]:
    """The gateway's spans since `since_ns`, once there are `count` of them."""
    rows = wait_for_rows(
        cluster.log_dir / "telemetry.db",
        "SELECT name, attributes FROM spans WHERE service = 'kvfleet-gateway' AND start_ns >= ?",
        (since_ns,),
        until=lambda rows: len(rows) >= count,
        what=f"{count} gateway spans",
        timeout=20,
    )
    return [(name, json.loads(attrs)) for name, attrs in rows]


def test_span_names_come_from_validated_values_only(cluster, gateways):
    """Before: a request for model X made a span named "text_completion X", whatever X was."""
    g = gateways(
        "gateway-spans",
        env={
            "KVFLEET_API_TOKEN": TOKEN,
            "KVFLEET_GATEWAY_API_KEY": "gw-key",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{cluster.telemetry_address}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        },
    )
    since = time.time_ns()
    bogus = f"made-up-{uuid.uuid4().hex}"
    for model in (bogus, bogus + "-2"):
        status, err, _ = http("POST", g.url + "/v1/completions", {**BODY, "model": model}, _bearer("gw-key"))
        assert (status, err["error"]["code"]) == (404, "model_not_found")
    assert http("POST", g.url + "/v1/chat/completions", {"model": bogus, "messages": []}, _bearer("gw-key"))[0] == 400
    assert http("POST", g.url + "/v1/completions", BODY, _bearer("gw-key"))[0] == 200
    spans = _gateway_spans(cluster, since, 3)
    assert sorted(name for name, _ in spans) == ["text_completion", "text_completion", "text_completion tiny"], spans
    for name, attrs in spans:
        assert bogus not in name and bogus not in json.dumps(attrs), (name, attrs)
        assert attrs["gen_ai.provider.name"] == "kvfleet" and "gen_ai.system" not in attrs
        if name == "text_completion tiny":
            assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "tiny"
        else:
            assert "gen_ai.request.model" not in attrs and attrs["http.response.status_code"] == 404


def test_kvfleet_up_with_a_token_starts_a_gateway_that_passes_callers_keys_through(monkeypatch):
    # The path `kvfleet up` takes (LocalCluster with api_token and the gateway): the gateway
    # starts (it does not hold the token), and only callers with the token are served.
    for k in [k for k in os.environ if k.startswith(("KVFLEET_API_TOKEN", "KVFLEET_GATEWAY_"))]:
        monkeypatch.delenv(k)
    with LocalCluster(ClusterSpec(workers=1, model="tiny", api_token=TOKEN, gateway=True)) as c:
        url = c.gateway_url + "/v1/completions"
        status, body, _ = http("POST", url, BODY)
        assert status == 401, body
        status, _, _ = http("POST", url, BODY, _bearer("wrong"))
        assert status == 401
        status, body, _ = http("POST", url, BODY, _bearer(TOKEN))
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body


def _post_with_headers(url: str, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """A POST carrying exactly these headers, repeats included (urllib merges a repeated name)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        body = json.dumps(BODY).encode()
        conn.putrequest("POST", u.path)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["own-key", "pass-through"])
def test_two_authorization_headers_are_refused_even_when_one_is_right(gateways, mode):
    """A proxy in front may read the first and the gateway the last: neither may decide alone."""
    if mode == "own-key":
        g = gateways("gateway-dup-own", env={"KVFLEET_API_TOKEN": TOKEN, "KVFLEET_GATEWAY_API_KEY": "gw-key"})
        right = "Bearer gw-key"
    else:
        g = gateways("gateway-dup-pass", args=("--pass-through-key",))
        right = f"Bearer {TOKEN}"
    url = g.url + "/v1/completions"
    assert _post_with_headers(url, [("Authorization", right)])[0] == 200  # one header: served
    for pair in ([right, "Bearer wrong"], ["Bearer wrong", right], [right, right]):
        status, err = _post_with_headers(url, [("Authorization", v) for v in pair])
        assert status == 401 and "more than one Authorization header" in err["error"]["message"], (pair, err)

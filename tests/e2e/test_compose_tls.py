"""The compose deployment with TLS on (docker-compose.yml + docker-compose.tls.yml): each
container mounts its own folder of deploy/tls/make_dev_certs.sh's output (its key and the CA
certificate, never another's key nor the CA's), TLS and a bearer token on the published scheduler
port, the gateway passing each caller's bearer token through, mutual TLS towards the workers (the
scheduler's certificate only) and towards telemetry, server certificates naming their own service
only, healthchecks over TLS. The tiny model keeps this second stack quick; the real model is
exercised by test_compose.py. Needs Docker; see conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from kvfleet_common.security import TlsConfig, channel
from tests.e2e.conftest import Stack, run_stack
from tests.helpers.certs import make_dev_certs

pytestmark = pytest.mark.e2e

TOKEN = "e2e-secret-token"


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvfleet-e2e-tls-"))
    # The containers' user (uid 10001) must read its key: own it (as root), or make it readable.
    key_access = {"KVFLEET_KEY_OWNER": "10001"} if os.geteuid() == 0 else {"KVFLEET_KEY_MODE": "644"}
    try:
        make_dev_certs(d, **key_access)
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_stack(certs: Path) -> Iterator[Stack]:
    with run_stack(
        "kvfleet-e2e-tls",
        ("docker-compose.yml", "docker-compose.tls.yml"),
        {"KVFLEET_TLS_DIR": str(certs), "KVFLEET_API_TOKEN": TOKEN},
        model="tiny",
    ) as s:
        yield s


def _client_tls(certs: Path, identity: str | None = None) -> TlsConfig:
    if identity is None:
        return TlsConfig(ca=str(certs / "ca.pem"))
    return TlsConfig(ca=str(certs / "ca.pem"), cert=str(certs / f"{identity}.pem"), key=str(certs / f"{identity}.key"))


def _generate(stack: Stack, tls: TlsConfig, token: str):
    with SchedulerClient(stack.scheduler_address, tls=tls, token=token) as client:
        return client.generate(build_request([1, 2, 3, 4], 6, ignore_eos=True), timeout=120)


def test_sessions_need_tls_and_the_token(tls_stack: Stack, certs: Path) -> None:
    c = _generate(tls_stack, _client_tls(certs), TOKEN)
    assert len(c.token_ids) == 6 and c.finish_reason == "length", c
    with pytest.raises(grpc.RpcError) as no_token:
        _generate(tls_stack, _client_tls(certs), "")
    assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED, no_token.value
    with pytest.raises(grpc.RpcError) as wrong_token:
        _generate(tls_stack, _client_tls(certs), "not-the-token")
    assert wrong_token.value.code() == grpc.StatusCode.UNAUTHENTICATED, wrong_token.value
    with pytest.raises(grpc.RpcError) as plaintext:  # a plaintext client gets no connection
        _generate(tls_stack, TlsConfig(), TOKEN)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE, plaintext.value


def test_each_container_holds_its_own_key_and_not_the_cas(tls_stack: Stack) -> None:
    listing = "import os; print(' '.join(sorted(os.listdir('/tls'))))"
    for service in ("telemetry", "worker-0", "worker-1", "scheduler", "gateway"):
        ident = service.split("-")[0]
        res = tls_stack.container(service).exec_run(["python", "-c", listing])
        assert res.exit_code == 0, res.output.decode()
        assert res.output.decode().split() == sorted(["ca.pem", f"{ident}.key", f"{ident}.pem"]), service


# Run inside the gateway container: a call on worker-0 as some identity, whose certificate and
# key come as PEM text in the environment (the container has the gateway's own files only).
_WORKER_CALL = textwrap.dedent("""
    import os, sys, grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from kvfleet.v1 import worker_pb2, worker_pb2_grpc
    what, name = sys.argv[1], sys.argv[2]   # getinfo|health, the name the worker is dialled as
    if os.environ.get("CERT_PEM") == "plain":
        ch = grpc.insecure_channel("worker-0:50061")
    else:
        creds = grpc.ssl_channel_credentials(open("/tls/ca.pem", "rb").read(), os.environ["KEY_PEM"].encode(),
                                             os.environ["CERT_PEM"].encode())
        ch = grpc.secure_channel("worker-0:50061", creds, [("grpc.ssl_target_name_override", name)])
    with ch:
        try:
            if what == "health":
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
                print("OK")
            else:
                secret = os.environ.get("WORKER_SECRET")
                md = [("x-kvfleet-worker-secret", secret)] if secret else []
                info = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=20, metadata=md)
                print("OK", info.worker_id)
        except grpc.RpcError as e:
            print(e.code().name)
""")


def _worker_call(
    stack: Stack, certs: Path, identity: str, what: str = "getinfo", name: str = "worker-0", secret: str = ""
) -> str:
    env = (
        {"CERT_PEM": "plain"}
        if identity == "plain"
        else {
            "CERT_PEM": (certs / identity / f"{identity}.pem").read_text(),
            "KEY_PEM": (certs / identity / f"{identity}.key").read_text(),
        }
    )
    if secret:
        env["WORKER_SECRET"] = secret
    res = stack.container("gateway").exec_run(["python", "-c", _WORKER_CALL, what, name], environment=env)
    assert res.exit_code == 0, res.output.decode()
    return res.output.decode().strip().splitlines()[-1]


def test_workers_accept_only_the_scheduler(tls_stack: Stack, certs: Path) -> None:
    # The scheduler's certificate and the scheduler<->worker secret (kept under TLS too) let it in ...
    secret = tls_stack.container("worker-0").exec_run(["cat", "/run/kvfleet/worker-secret"]).output.decode().strip()
    assert len(secret) >= 16
    assert _worker_call(tls_stack, certs, "scheduler", secret=secret) == "OK worker-0"
    # ... the certificate alone does not (a stolen key is not enough), nor does the secret alone
    assert _worker_call(tls_stack, certs, "scheduler") == "UNAUTHENTICATED"
    assert _worker_call(tls_stack, certs, "gateway", secret=secret) == "PERMISSION_DENIED"
    assert _worker_call(tls_stack, certs, "gateway") == "PERMISSION_DENIED"  # same CA, but not the scheduler
    assert _worker_call(tls_stack, certs, "client") == "PERMISSION_DENIED"
    assert _worker_call(tls_stack, certs, "plain") == "UNAVAILABLE"  # no TLS, no connection


def test_a_workers_certificate_names_the_workers_only(tls_stack: Stack, certs: Path) -> None:
    """Its key cannot pass for the scheduler or telemetry: TLS to it under their names fails."""
    assert _worker_call(tls_stack, certs, "gateway", "health", "worker-0") == "OK"
    assert _worker_call(tls_stack, certs, "gateway", "health", "scheduler") == "UNAVAILABLE"
    assert _worker_call(tls_stack, certs, "gateway", "health", "telemetry") == "UNAVAILABLE"


def test_spans_reach_telemetry_over_mutual_tls(tls_stack: Stack, certs: Path) -> None:
    _generate(tls_stack, _client_tls(certs), TOKEN)

    def timings(tls: TlsConfig) -> dict[str, int]:
        with channel(tls_stack.telemetry_address, tls) as ch:
            resp = telemetry_pb2_grpc.TelemetryStub(ch).GetTimings(telemetry_pb2.TimingsRequest(), timeout=10)
        return {t.span_name: t.count for t in resp.timings}

    deadline = time.monotonic() + 60
    while True:  # the exporters send every second
        counts = timings(_client_tls(certs, "client"))
        # the scheduler's session span is named `{operation} {model}`
        if counts.get(f"text_completion {tls_stack.model}") and counts.get("worker_step"):
            break
        assert time.monotonic() < deadline, f"no session and worker_step spans stored over TLS: {counts}"
        time.sleep(1)
    with pytest.raises(grpc.RpcError) as no_cert:  # mutual TLS: a client without a certificate
        timings(_client_tls(certs))
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE, no_cert.value
    # A certificate of the CA reads, but only the services' own certificates write, and only with
    # the write token: without it UNAUTHENTICATED, with it but another certificate PERMISSION_DENIED.
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    res = tls_stack.container("telemetry").exec_run(["cat", "/run/kvfleet-telemetry/telemetry-token"])
    token = res.output.decode().strip()
    assert res.exit_code == 0 and len(token) >= 32, res.output
    codes = []
    for md in ((), (("authorization", f"Bearer {token}"),)):
        with channel(tls_stack.telemetry_address, _client_tls(certs, "client")) as ch:
            with pytest.raises(grpc.RpcError) as forged:
                trace_service_pb2_grpc.TraceServiceStub(ch).Export(
                    trace_service_pb2.ExportTraceServiceRequest(), timeout=10, metadata=md
                )
        codes.append(forged.value.code())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED], codes


def test_telemetry_serves_the_schedulers_live_snapshot_with_the_token(tls_stack: Stack, certs: Path) -> None:
    """The trace UI's Scheduler page under TLS: telemetry's HTTP port is HTTPS wanting a
    certificate of the CA, and its calls to the scheduler carry the overlay's token (without it
    the scheduler refuses them and the page gets a 502)."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    url = f"https://127.0.0.1:{tls_stack.trace_api_port}/api/scheduler"
    try:
        with urllib.request.urlopen(url, timeout=30, context=ctx) as resp:
            status, body = resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        status, body = err.code, json.load(err)
    assert status == 200, body
    workers = {w["worker_id"]: w["live"] for w in body["data"]["workers"]}
    assert workers == {"worker-0": True, "worker-1": True}, body


def _gateway_completion(stack: Stack, key: str | None) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"{stack.gateway_url}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_gateway_reaches_the_scheduler_over_tls_for_token_holders_only(tls_stack: Stack) -> None:
    status, out = _gateway_completion(tls_stack, TOKEN)
    assert status == 200 and 1 <= out["usage"]["completion_tokens"] <= 5, out
    # The scheduler's token stays the scheduler's: the gateway lends it to nobody.
    for key in (None, "not-the-token"):
        status, out = _gateway_completion(tls_stack, key)
        assert (status, out["error"]["code"]) == (401, "invalid_api_key"), (key, out)

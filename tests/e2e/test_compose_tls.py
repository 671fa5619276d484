"""The compose deployment with TLS on (docker-compose.yml + docker-compose.tls.yml): certificates
from deploy/tls/make_dev_certs.sh mounted into every container, TLS and a bearer token on the
published scheduler port, mutual TLS towards the workers (the scheduler's certificate only) and
towards telemetry, healthchecks over TLS. The tiny model keeps this second stack quick; the
real model is exercised by test_compose.py. Needs Docker; see conftest.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet_common.security import TlsConfig, channel
from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from tests.e2e.conftest import REPO, Stack, run_stack

pytestmark = pytest.mark.e2e

TOKEN = "e2e-secret-token"


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvfleet-e2e-tls-"))
    try:
        subprocess.run(["bash", str(REPO / "deploy" / "tls" / "make_dev_certs.sh"), str(d)], check=True,
                       capture_output=True, env={**os.environ, "KVFLEET_KEY_MODE": "644"}, timeout=120)
        d.chmod(0o755)   # mounted at /tls: the containers' user (uid 10001) reads it
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_stack(certs: Path) -> Iterator[Stack]:
    with run_stack("kvfleet-e2e-tls", ("docker-compose.yml", "docker-compose.tls.yml"),
                   {"KVFLEET_TLS_DIR": str(certs), "KVFLEET_API_TOKEN": TOKEN}, model="tiny") as s:
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
    with pytest.raises(grpc.RpcError) as plaintext:   # a plaintext client gets no connection
        _generate(tls_stack, TlsConfig(), TOKEN)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE, plaintext.value


# Run inside the gateway container: GetInfo on worker-0 with the given identity's certificate.
_WORKER_CALL = textwrap.dedent("""
    import sys, grpc
    from kvfleet_common.security import TlsConfig, channel
    from kvfleet.v1 import worker_pb2, worker_pb2_grpc
    who = sys.argv[1]
    tls = TlsConfig() if who == "plain" else TlsConfig(ca="/tls/ca.pem", cert=f"/tls/{who}.pem", key=f"/tls/{who}.key")
    with channel("worker-0:50061", tls) as ch:
        try:
            info = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=20)
            print("OK", info.worker_id)
        except grpc.RpcError as e:
            print(e.code().name)
""")


def test_workers_accept_only_the_scheduler(tls_stack: Stack) -> None:
    gateway = tls_stack.container("gateway")

    def call(identity: str) -> str:
        res = gateway.exec_run(["python", "-c", _WORKER_CALL, identity])
        assert res.exit_code == 0, res.output.decode()
        return res.output.decode().strip().splitlines()[-1]

    assert call("scheduler") == "OK worker-0"       # the scheduler's certificate is let in
    assert call("gateway") == "PERMISSION_DENIED"   # signed by the same CA, but not the scheduler
    assert call("plain") == "UNAVAILABLE"           # no TLS, no connection


def test_spans_reach_telemetry_over_mutual_tls(tls_stack: Stack, certs: Path) -> None:
    _generate(tls_stack, _client_tls(certs), TOKEN)

    def timings(tls: TlsConfig) -> dict[str, int]:
        with channel(tls_stack.telemetry_address, tls) as ch:
            resp = telemetry_pb2_grpc.TelemetryStub(ch).GetTimings(telemetry_pb2.TimingsRequest(), timeout=10)
        return {t.span_name: t.count for t in resp.timings}

    deadline = time.monotonic() + 60
    while True:   # the exporters send every second
        counts = timings(_client_tls(certs, "client"))
        if counts.get("session") and counts.get("worker_step"):
            break
        assert time.monotonic() < deadline, f"no session and worker_step spans stored over TLS: {counts}"
        time.sleep(1)
    with pytest.raises(grpc.RpcError) as no_cert:    # mutual TLS: a client without a certificate
        timings(_client_tls(certs))
    assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE, no_cert.value


def test_gateway_reaches_the_scheduler_over_tls(tls_stack: Stack) -> None:
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0}).encode()
    req = urllib.request.Request(f"{tls_stack.gateway_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.load(resp)
    assert 1 <= out["usage"]["completion_tokens"] <= 5, out

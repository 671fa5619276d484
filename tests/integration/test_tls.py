"""TLS everywhere, mutual TLS towards workers and telemetry, and the client API's bearer token."""

import asyncio
import os
from pathlib import Path

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common import security
from kvfleet_common.security import TlsConfig
from tests.helpers.telemetry_db import wait_for_rows

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls_cluster(certs):
    spec = ClusterSpec(workers=1, model="tiny", tls_dir=str(certs), api_token=TOKEN)
    with LocalCluster(spec) as cluster:
        yield cluster


def test_a_tls_client_with_the_token_is_served(tls_cluster, certs):
    trust_only = TlsConfig(ca=str(certs / "ca.pem"))  # server-side TLS; no client cert needed
    with SchedulerClient(tls_cluster.scheduler_address, trust_only, TOKEN) as client:
        assert client.generate(build_request([1, 2, 3], 5)).finish_reason == "length"


def test_without_the_token_the_api_says_unauthenticated(tls_cluster, certs):
    with SchedulerClient(tls_cluster.scheduler_address, TlsConfig(ca=str(certs / "ca.pem")), "") as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(build_request([1, 2, 3], 5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer" in info.value.details()


def test_plaintext_clients_cannot_talk_to_a_tls_port(tls_cluster):
    with SchedulerClient(tls_cluster.scheduler_address, TlsConfig(), TOKEN) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(build_request([1], 2), timeout=5)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_workers_accept_only_the_scheduler(tls_cluster, certs):
    worker = tls_cluster.worker_addresses[0]
    # A valid certificate of the same CA, but not the scheduler's: refused by name.
    as_client = TlsConfig(cert=str(certs / "client.pem"), key=str(certs / "client.key"), ca=str(certs / "ca.pem"))
    with security.channel(worker, as_client) as ch:
        with pytest.raises(grpc.RpcError) as info:
            wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "kvfleet-scheduler" in info.value.details()
    # No client certificate at all: the TLS handshake fails.
    with security.channel(worker, TlsConfig(ca=str(certs / "ca.pem"))) as ch:
        with pytest.raises(grpc.RpcError) as info:
            wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # The scheduler's identity is accepted.
    as_scheduler = TlsConfig(
        cert=str(certs / "scheduler.pem"), key=str(certs / "scheduler.key"), ca=str(certs / "ca.pem")
    )
    with security.channel(worker, as_scheduler) as ch:
        assert wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5).model.name == "tiny"


def test_spans_reach_telemetry_over_mutual_tls(tls_cluster, certs):
    with SchedulerClient(tls_cluster.scheduler_address, TlsConfig(ca=str(certs / "ca.pem")), TOKEN) as client:
        client.generate(build_request([7, 7, 7], 3))
    wanted = {"text_completion tiny", "worker_step"}  # the session span is `{operation} {model}`
    wait_for_rows(
        tls_cluster.log_dir / "telemetry.db",
        "SELECT DISTINCT name FROM spans",
        until=lambda rows: wanted <= {n for (n,) in rows},
        what=f"spans {sorted(wanted)} over TLS",
        timeout=15,
    )


def _identity(certs: Path, name: str) -> TlsConfig:
    return TlsConfig(cert=str(certs / f"{name}.pem"), key=str(certs / f"{name}.key"), ca=str(certs / "ca.pem"))


def _get_info_as(certs: Path, worker_tls: TlsConfig, callers: list[str]) -> dict[str, str]:
    """Start a worker with `worker_tls` on a loopback port; GetInfo as each caller identity:
    {identity: "OK" or the status code's name}."""
    from worker_svc.config import WorkerConfig
    from worker_svc.server import create_server

    async def run() -> dict[str, str]:
        config = WorkerConfig(host="127.0.0.1", port=0, model="tiny", num_blocks=64, metrics_port=0, tls=worker_tls)
        server, port, _ = await create_server(config)
        got = {}
        try:
            for who in callers:
                async with security.aio_channel(f"127.0.0.1:{port}", _identity(certs, who)) as ch:
                    try:
                        await wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5)
                        got[who] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        got[who] = exc.code().name
        finally:
            await server.stop(0)
        return got

    return asyncio.run(run())


def test_a_worker_under_mutual_tls_admits_only_the_scheduler_unless_told(certs):
    """No KVFLEET_TLS_ALLOWED_CLIENTS: a certificate of the CA is not enough to drive a worker."""
    env = {
        "KVFLEET_TLS_CERT": str(certs / "worker.pem"),
        "KVFLEET_TLS_KEY": str(certs / "worker.key"),
        "KVFLEET_TLS_CA": str(certs / "ca.pem"),
        "KVFLEET_TLS_CLIENT_AUTH": "true",
    }
    callers = ["scheduler", "gateway", "client", "telemetry", "worker"]
    assert _get_info_as(certs, TlsConfig.from_env(env), callers) == {
        "scheduler": "OK",
        "gateway": "PERMISSION_DENIED",
        "client": "PERMISSION_DENIED",
        "telemetry": "PERMISSION_DENIED",
        "worker": "PERMISSION_DENIED",
    }
    # Configured otherwise: named clients, or any certificate of the CA.
    named = TlsConfig.from_env({**env, "KVFLEET_TLS_ALLOWED_CLIENTS": "kvfleet-scheduler,kvfleet-client"})
    assert _get_info_as(certs, named, ["client", "gateway"]) == {"client": "OK", "gateway": "PERMISSION_DENIED"}
    anyone = TlsConfig.from_env({**env, "KVFLEET_TLS_ALLOWED_CLIENTS": "*"})
    assert _get_info_as(certs, anyone, ["gateway"]) == {"gateway": "OK"}


def test_a_worker_under_tls_without_client_certificates_admits_nobody(certs):
    """Server-only TLS cannot tell the scheduler from anyone else: closed, with a hint."""
    tls = TlsConfig(cert=str(certs / "worker.pem"), key=str(certs / "worker.key"), ca=str(certs / "ca.pem"))
    assert _get_info_as(certs, tls, ["scheduler"]) == {"scheduler": "PERMISSION_DENIED"}


@pytest.mark.parametrize(
    "serving,dialled_as,ok",
    [
        ("worker", "worker-0", True),
        ("worker", "kvfleet-worker-1.kvfleet-worker", True),
        ("scheduler", "scheduler", True),
        ("telemetry", "telemetry", True),
        ("worker", "scheduler", False),  # a worker's key cannot pass for the scheduler
        ("telemetry", "worker-0", False),  # nor telemetry's for a worker
        ("scheduler", "telemetry", False),
        ("worker", "telemetry", False),
    ],
)
def test_server_certificates_carry_only_their_own_service_names(certs, serving, dialled_as, ok):
    """A server on loopback with `serving`'s certificate; a client that dials it by the name
    `dialled_as` (as the compose network or Kubernetes would resolve it) must trust it only if
    the certificate is that service's."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", _identity(certs, serving).server_credentials())
    server.start()
    try:
        options = [("grpc.ssl_target_name_override", dialled_as)]
        with security.channel(f"127.0.0.1:{port}", TlsConfig(ca=str(certs / "ca.pem")), options) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                answered = True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                answered = False
    finally:
        server.stop(0)
    assert answered is ok


def test_tls_files_are_checked_at_start_up_naming_the_variable(certs, tmp_path):
    """A missing or wrong certificate, key or CA used to surface as a traceback, or as grpc failing
    to bind the port ("the bind failed"); a typo in KVFLEET_TLS_CLIENT_AUTH turned the check off."""
    import subprocess
    import sys

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    ok = TlsConfig(cert=str(certs / "worker.pem"), key=str(certs / "worker.key"), ca=str(certs / "ca.pem"))
    assert ok.checked() is ok
    cases = [
        (TlsConfig(cert=str(tmp_path / "no.pem"), key=str(certs / "worker.key")),
         f"cannot read the TLS certificate {tmp_path / 'no.pem'} (KVFLEET_TLS_CERT): No such file or directory"),
        (TlsConfig(cert=str(garbage), key=str(garbage)),
         f"the TLS certificate {garbage} (KVFLEET_TLS_CERT) and key {garbage} (KVFLEET_TLS_KEY) are not a PEM "
         "certificate and its private key"),
        (TlsConfig(cert=str(certs / "worker.pem"), key=str(certs / "client.key")), "KEY_VALUES_MISMATCH"),
        (TlsConfig(ca=str(garbage)), f"the TLS CA {garbage} (KVFLEET_TLS_CA) holds no PEM certificate"),
    ]  # fmt: skip
    for tls, said in cases:
        with pytest.raises(ValueError) as err:
            tls.checked()
        assert said in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="^KVFLEET_TLS_CLIENT_AUTH: expected true or false, got 'maybe'$"):
        TlsConfig.from_env({"KVFLEET_TLS_CLIENT_AUTH": "maybe"})
    assert not TlsConfig.from_env({"KVFLEET_TLS_CLIENT_AUTH": "False"}).client_auth
    # A service says it in one line, before anything else.
    env = {**os.environ, "KVFLEET_TLS_CERT": str(garbage), "KVFLEET_TLS_KEY": str(garbage)}
    proc = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", "tiny", "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith(f"worker: the TLS certificate {garbage} (KVFLEET_TLS_CERT)"), proc.stderr

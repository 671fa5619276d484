"""TLS everywhere, mutual TLS towards workers and telemetry, and the client API's bearer token."""
import sqlite3
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from kvfleet_common import security
from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet_common.security import TlsConfig
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(ROOT / "deploy/tls/make_dev_certs.sh"), str(out)], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def tls_cluster(certs):
    spec = ClusterSpec(workers=1, model="tiny", tls_dir=str(certs), api_token=TOKEN)
    with LocalCluster(spec) as cluster:
        yield cluster


def test_a_tls_client_with_the_token_is_served(tls_cluster, certs):
    trust_only = TlsConfig(ca=str(certs / "ca.pem"))       # server-side TLS; no client cert needed
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
    as_scheduler = TlsConfig(cert=str(certs / "scheduler.pem"), key=str(certs / "scheduler.key"),
                             ca=str(certs / "ca.pem"))
    with security.channel(worker, as_scheduler) as ch:
        assert wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=5).model.name == "tiny"


def test_spans_reach_telemetry_over_mutual_tls(tls_cluster, certs):
    with SchedulerClient(tls_cluster.scheduler_address, TlsConfig(ca=str(certs / "ca.pem")), TOKEN) as client:
        client.generate(build_request([7, 7, 7], 3))
    db = tls_cluster.log_dir / "telemetry.db"
    for _ in range(60):
        if db.exists():
            names = {n for (n,) in sqlite3.connect(db).execute("SELECT DISTINCT name FROM spans")}
            if {"session", "worker_step"} <= names:
                return
        time.sleep(0.25)
    pytest.fail("no spans arrived over TLS")

"""The README's "Plain Docker on several hosts" recipe, each host's containers run as the recipe
says (`docker run --network host` of the kvfleet image, `worker` on each worker host with a
unique KVFLEET_WORKER_ID, the scheduler on the control host naming them in KVFLEET_WORKERS). The
hosts are this one, the workers on ports of their own. With TLS: make_dev_certs.sh's folders,
each container mounting only its own, the workers requiring client certificates (they admit only
the scheduler's). Without TLS: one KVFLEET_WORKER_SECRET; a worker with neither refuses to start.
The tiny model keeps it quick. Needs Docker; see conftest.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import free_port
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common.security import TlsConfig, channel
from tests.e2e.conftest import built_image
from tests.helpers.certs import make_dev_certs

pytestmark = pytest.mark.e2e

TOKEN = "plain-docker-token"
SECRET = "plain-docker-worker-secret-0123456789"
LABEL = "kvfleet-e2e-plain"  # every container of this module, removed after it (and before: leftovers)


class Hosts:
    """Containers run with --network host; removed, their logs kept, when the module ends."""

    def __init__(self, client: Any, image: str) -> None:
        self.client, self.image = client, image
        self.containers: list[Any] = []

    def run(self, name: str, service: str, env: dict[str, str], certs: Path | None = None) -> Any:
        volumes = {str(certs): {"bind": "/certs", "mode": "ro"}} if certs is not None else {}
        container = self.client.containers.run(
            self.image,
            [service],
            name=f"{LABEL}-{name}",
            labels={LABEL: "1"},
            environment={"KVFLEET_METRICS_PORT": "0", "KVFLEET_MODEL": "tiny", **env},
            network_mode="host",
            volumes=volumes,
            detach=True,
        )
        self.containers.append(container)
        return container

    def remove_all(self) -> None:
        for c in self.client.containers.list(all=True, filters={"label": LABEL}):
            c.remove(force=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    client, image, _ = built_image()
    h = Hosts(client, image)
    h.remove_all()
    try:
        yield h
    finally:
        h.remove_all()


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvfleet-e2e-plain-"))
    key_access = {"KVFLEET_KEY_OWNER": "10001"} if os.geteuid() == 0 else {"KVFLEET_KEY_MODE": "644"}
    try:
        make_dev_certs(d, **key_access)  # server certificates name 127.0.0.1: the hosts here
        d.chmod(0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _tls_env(name: str, client_auth: bool = False) -> dict[str, str]:
    env = {
        "KVFLEET_TLS_CERT": f"/certs/{name}.pem",
        "KVFLEET_TLS_KEY": f"/certs/{name}.key",
        "KVFLEET_TLS_CA": "/certs/ca.pem",
    }
    return {**env, "KVFLEET_TLS_CLIENT_AUTH": "true"} if client_auth else env


def _scheduler(
    hosts: Hosts, name: str, ports: dict[str, int], env: dict[str, str], certs: Path | None = None
) -> tuple[str, Any]:
    """The control host's scheduler naming the workers at `ports` (KVFLEET_WORKERS), with the API
    token and `env`; (its address, its container)."""
    port = free_port()
    workers = ",".join(f"127.0.0.1:{p}" for p in ports.values())
    env = {"KVFLEET_WORKERS": workers, "KVFLEET_SCHEDULER_PORT": str(port), "KVFLEET_API_TOKEN": TOKEN, **env}
    return f"127.0.0.1:{port}", hosts.run(name, "scheduler", env, certs)


def _serving(address: str, tls: TlsConfig, token: str, containers: list[Any], timeout_s: float = 180.0) -> None:
    """Until the scheduler lists every worker live; a container that exits fails it with its log."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for c in containers:
            c.reload()
            if c.status == "exited":
                raise AssertionError(f"{c.name} exited:\n{c.logs().decode()[-3000:]}")
        try:
            with SchedulerClient(address, tls, token=token) as client:
                workers = client.list_workers()
            if len(workers) == 2 and all(w.live for w in workers):
                return
            last = str(workers)
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        time.sleep(1)
    logs = "\n".join(f"--- {c.name}\n{c.logs().decode()[-2000:]}" for c in containers)
    raise AssertionError(f"the scheduler never listed both workers live ({last}):\n{logs}")


def test_workers_on_their_hosts_behind_a_scheduler_over_mutual_tls(hosts: Hosts, certs: Path) -> None:
    ports = {"worker-a": free_port(), "worker-b": free_port()}
    workers = [
        hosts.run(wid, "worker", {"KVFLEET_WORKER_ID": wid, "KVFLEET_WORKER_PORT": str(port),
                                  **_tls_env("worker", client_auth=True)}, certs / "worker")
        for wid, port in ports.items()
    ]  # fmt: skip
    address, scheduler = _scheduler(hosts, "scheduler", ports, _tls_env("scheduler"), certs / "scheduler")
    tls = TlsConfig(ca=str(certs / "ca.pem"))
    _serving(address, tls, TOKEN, [*workers, scheduler])
    with SchedulerClient(address, tls, token=TOKEN) as client:
        assert sorted(w.worker_id for w in client.list_workers()) == ["worker-a", "worker-b"]
        got = [client.generate(build_request([k, 2, 3], 8, ignore_eos=True)) for k in range(4)]
        assert [len(r.token_ids) for r in got] == [8] * 4
    # The workers admit the scheduler's certificate only: another of the same CA is refused.
    other = TlsConfig(cert=str(certs / "client.pem"), key=str(certs / "client.key"), ca=str(certs / "ca.pem"))
    with channel(f"127.0.0.1:{ports['worker-a']}", other) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=10)
    assert refused.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def test_workers_on_their_hosts_share_the_scheduler_s_secret_and_one_with_neither_refuses(hosts: Hosts) -> None:
    # A worker on every interface with neither mutual TLS nor the secret does not start.
    bare = hosts.run("bare", "worker", {"KVFLEET_WORKER_ID": "bare", "KVFLEET_WORKER_PORT": str(free_port())})
    assert bare.wait(timeout=120)["StatusCode"] != 0
    assert "with neither mutual TLS nor a worker secret" in bare.logs().decode()

    ports = {"worker-a": free_port(), "worker-b": free_port()}
    secret = {"KVFLEET_WORKER_SECRET": SECRET}
    workers = [
        hosts.run(f"s-{wid}", "worker", {"KVFLEET_WORKER_ID": wid, "KVFLEET_WORKER_PORT": str(port), **secret})
        for wid, port in ports.items()
    ]
    address, scheduler = _scheduler(hosts, "s-scheduler", ports, secret)
    _serving(address, TlsConfig(), TOKEN, [*workers, scheduler])
    with SchedulerClient(address, TlsConfig(), token=TOKEN) as client:
        got = [client.generate(build_request([k, 5, 1], 8, ignore_eos=True)) for k in range(4)]
        assert [len(r.token_ids) for r in got] == [8] * 4
    # Without the secret a worker answers nothing.
    with channel(f"127.0.0.1:{ports['worker-b']}", TlsConfig()) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            wpb_grpc.WorkerStub(ch).GetInfo(wpb.GetInfoRequest(), timeout=10)
    assert refused.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)

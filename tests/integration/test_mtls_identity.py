"""Under mutual TLS a caller is its client certificate (with its bearer token, where it sends one):
on a real scheduler and worker (TLS everywhere, the scheduler requiring client certificates and
holding no API token), a session is cancelled only by the certificate that started it, even
among callers sending one shared token, and the prefix cache is partitioned by certificate. That
scheduler listens on every interface, which mutual TLS alone allows; it lets only the certificate
named in KVFLEET_EXPERIMENT_WRITERS tag a workload with an experiment, and it refuses a call that
carries `authorization` twice."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import security
from kvfleet_common.security import TlsConfig
from kvfleet_models.config import tiny_config

VOCAB = tiny_config().vocab_size
BS = 16  # the workers' block size (their default): the prefix cache reuses whole blocks
SYSTEM = [(11 * i + 5) % VOCAB for i in range(200)]  # 12 full blocks shared by both prompts
FIRST, SECOND = SYSTEM + [1, 2, 3], SYSTEM + [4, 5, 6, 7]
NEW = 8


@pytest.fixture(scope="module")
def mtls_cluster(certs: Path) -> Iterator[LocalCluster]:
    """One tiny worker and a scheduler on 0.0.0.0 requiring client certificates, no API token.
    LocalCluster gives the scheduler TLS but not client auth (the variable set here; the worker
    has it anyway), and its --host comes first on the command line, so the later one wins."""
    spec = ClusterSpec(
        workers=1,
        model="tiny",
        tls_dir=str(certs),
        telemetry=False,
        # the certificate kvfleet-client may tag a workload with an experiment; no other caller
        extra_env={"KVFLEET_TLS_CLIENT_AUTH": "true", "KVFLEET_EXPERIMENT_WRITERS": "kvfleet-client"},
        scheduler_args=("--host", "0.0.0.0"),
    )
    with LocalCluster(spec) as cluster:
        yield cluster


def _as(certs: Path, name: str) -> TlsConfig:
    """Dial as the identity `name` of make_dev_certs.sh (kvfleet-`name` is its common name)."""
    return TlsConfig(cert=str(certs / f"{name}.pem"), key=str(certs / f"{name}.key"), ca=str(certs / "ca.pem"))


def _client(cluster: LocalCluster, certs: Path, name: str) -> SchedulerClient:
    # token="": no bearer token, whatever KVFLEET_API_TOKEN says; the certificate is the identity
    return SchedulerClient(cluster.scheduler_address, _as(certs, name), token="")


def test_only_the_certificate_that_started_a_session_may_cancel_it(mtls_cluster, certs):
    with _client(mtls_cluster, certs, "client") as alice, _client(mtls_cluster, certs, "gateway") as mallory:
        stream = alice.stream(build_request([1, 2, 3], 500, ignore_eos=True), timeout=60)
        first = next(iter(stream))
        with pytest.raises(grpc.RpcError) as refused:
            mallory.cancel(first.session_id)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        assert "started by another caller" in refused.value.details()
        # The owner is its certificate, not its connection: a new channel with it may cancel.
        with _client(mtls_cluster, certs, "client") as alice_again:
            assert alice_again.cancel(first.session_id).cancelled
        last = list(stream)[-1]
    assert last.finished and last.finish_reason == spb.FINISH_CANCELLED


def test_callers_sharing_a_bearer_token_are_still_told_apart_by_their_certificates(mtls_cluster, certs):
    """Token and certificate both make the identity: two certificate holders sending the same
    bearer token (one API token shared by every client, as a deployment hands out) are two
    callers, and the token cannot make one the other."""
    shared = "the-one-api-token"
    alice = SchedulerClient(mtls_cluster.scheduler_address, _as(certs, "client"), token=shared)
    mallory = SchedulerClient(mtls_cluster.scheduler_address, _as(certs, "gateway"), token=shared)
    with alice, mallory:
        stream = alice.stream(build_request([1, 2, 3], 500, ignore_eos=True), timeout=60)
        first = next(iter(stream))
        with pytest.raises(grpc.RpcError) as refused:
            mallory.cancel(first.session_id)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        with _client(mtls_cluster, certs, "client") as no_token:  # the certificate alone: another caller too
            with pytest.raises(grpc.RpcError):
                no_token.cancel(first.session_id)
        assert alice.cancel(first.session_id).cancelled
        list(stream)


def test_the_prefix_cache_is_partitioned_by_client_certificate(mtls_cluster, certs):
    def run(name: str, prompt: list[int]) -> tuple[list[int], int]:
        """(tokens, Usage.cached_tokens) of one greedy session, on a connection of its own."""
        with _client(mtls_cluster, certs, name) as client:
            events = list(client.stream(build_request(prompt, NEW), timeout=60))
        assert events[-1].finished
        return [t for e in events for t in e.token_ids], events[-1].usage.cached_tokens

    shared = len(SYSTEM) // BS * BS  # the full blocks of the system prompt: 192 tokens
    assert run("client", FIRST)[1] == 0
    tokens, alice_hit = run("client", SECOND)
    assert alice_hit == shared  # the same certificate, a new connection: its own cache
    assert run("gateway", SECOND) == (tokens, 0)  # another certificate: computed anew, same tokens
    assert run("gateway", SECOND)[1] == (len(SECOND) - 1) // BS * BS  # ... and now its own hit


def _non_loopback_ipv4() -> str | None:
    """An address of this machine beyond loopback: the one of its default route (a UDP connect
    looks the route up and sends nothing), else one its host name resolves to."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: never answered, only routed
            found = [s.getsockname()[0]]
        except OSError:
            found = []
    try:
        found += [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in found if not ipaddress.ip_address(a).is_loopback), None)


def test_mutual_tls_alone_lets_the_scheduler_listen_beyond_loopback(mtls_cluster, certs):
    """Served over a non-loopback address with no token; the same TLS settings without client
    certificates refuse to start (the plaintext, tokenless refusal: tests/unit/test_secure_defaults)."""
    assert mtls_cluster.procs["scheduler"].poll() is None
    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to dial the scheduler on")
    port = mtls_cluster.scheduler_address.rsplit(":", 1)[1]
    # The server certificate names localhost and 127.0.0.1, not this address.
    options = [("grpc.ssl_target_name_override", "localhost")]
    with security.channel(f"{host}:{port}", _as(certs, "client"), options) as ch:
        events = list(spb_grpc.SchedulerStub(ch).Generate(build_request([1, 2, 3], 4), timeout=30))
    assert events[-1].finish_reason == spb.FINISH_LENGTH

    # The same certificates, but without client certificates required: refused before serving.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLEET_")}
    env.update(
        KVFLEET_TLS_CERT=str(certs / "scheduler.pem"),
        KVFLEET_TLS_KEY=str(certs / "scheduler.key"),
        KVFLEET_TLS_CA=str(certs / "ca.pem"),
    )
    argv = ["--host", "0.0.0.0", "--port", "0", "--metrics-port", "0", "--workers", "127.0.0.1:1"]
    try:  # it refuses in its flags' parsing, well within a second
        refused = subprocess.run(
            [sys.executable, "-m", "scheduler_svc", *argv], env=env, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a scheduler on 0.0.0.0 with TLS but no client certificates and no token started: {exc}")
    assert refused.returncode != 0 and "beyond loopback" in refused.stderr, refused.stderr


@pytest.mark.parametrize("second", ["Bearer one", "Bearer two"], ids=["same-value", "other-value"])
def test_a_call_carrying_authorization_twice_is_refused(mtls_cluster, certs, second):
    twice = (("authorization", "Bearer one"), ("authorization", second))
    with _client(mtls_cluster, certs, "client") as client:
        # Once is fine: this scheduler wants no token, so any single one passes.
        once = client.stub.Generate(build_request([1, 2], 2), metadata=twice[:1], timeout=30)
        assert list(once)[-1].finished
        calls = {
            "Generate": lambda: list(client.stub.Generate(build_request([1, 2], 2), metadata=twice, timeout=30)),
            "Cancel": lambda: client.stub.Cancel(spb.CancelRequest(session_id="s-0"), metadata=twice, timeout=30),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, refused.value)
            assert "more than one 'authorization'" in refused.value.details(), name


def test_only_a_certificate_named_an_experiment_writer_may_tag_a_workload(mtls_cluster, certs):
    """README ("Artifact limits and experiment writers"): KVFLEET_EXPERIMENT_WRITERS names the
    certificates that may tag a workload with an experiment (its spans decide an A/B test)."""
    request = spb.WorkloadRequest(
        sessions=[build_request([1, 2, 3], 2)],
        experiment=spb.Experiment(id="mtls-writers", arm="control", lever="persistent_kv_views"),
    )
    with _client(mtls_cluster, certs, "client") as writer, _client(mtls_cluster, certs, "gateway") as other:
        events = list(writer.submit_workload(request, timeout=60))
        assert events[-1].done and events[-1].stats.sessions == 1, events[-1]
        with pytest.raises(grpc.RpcError) as refused:
            list(other.submit_workload(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        untagged = spb.WorkloadRequest(sessions=[build_request([1, 2, 3], 2)])
        assert list(other.submit_workload(untagged, timeout=60))[-1].done  # no experiment: served

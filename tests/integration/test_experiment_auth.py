"""Experiment tags need an experiment writer, on a real scheduler: a workload tagged with an
experiment is refused PERMISSION_DENIED (before anything runs) unless its caller sends the
configured experiment token; untagged workloads are unaffected."""

from __future__ import annotations

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.experiment import EXPERIMENT_TOKEN_HEADER, new_experiment_id
from kvfleet.v1 import scheduler_pb2 as spb
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import create_server
from tests.integration.inproc import InProcessCluster

TOKEN = "experiment-writer-token-0123456789"


@pytest.fixture(scope="module")
def cluster():
    with InProcessCluster(workers=1, stats_interval_s=3600) as c:
        yield c


@pytest.fixture(scope="module")
def guarded(cluster):
    """A second scheduler on the same worker, with an experiment token configured."""
    config = SchedulerConfig(
        host="127.0.0.1",
        port=0,
        workers=tuple(cluster.worker_addresses),
        model="tiny",
        metrics_port=0,
        health_interval_s=0.2,
        stats_interval_s=3600,
        experiment_token=TOKEN,
    )
    _, port, running = cluster.run(create_server(config))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        cluster.run(running.stop(1.0))


def _workload(experiment: bool) -> spb.WorkloadRequest:
    req = spb.WorkloadRequest(sessions=[build_request([1, 2, 3], 3, ignore_eos=True)] * 2)
    if experiment:
        req.experiment.CopyFrom(
            spb.Experiment(id=new_experiment_id("persistent_kv_views"), arm="control", lever="persistent_kv_views")
        )
    return req


def _run(client: SchedulerClient, req: spb.WorkloadRequest, extra=()) -> list[spb.WorkloadEvent]:
    return list(client.stub.SubmitWorkload(req, metadata=(*client._md, *extra), timeout=60))


@pytest.mark.parametrize(
    "extra, why",
    [((), "no experiment credential"), (((EXPERIMENT_TOKEN_HEADER, "x" * 34),), "a wrong experiment token")],
)
def test_a_tag_without_the_experiment_token_is_refused(guarded, extra, why):
    with SchedulerClient(guarded) as client:
        before = client.telemetry().completed_sessions
        with pytest.raises(grpc.RpcError) as info:
            _run(client, _workload(True), extra)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details().startswith(why) and EXPERIMENT_TOKEN_HEADER in info.value.details()
        assert client.telemetry().completed_sessions == before, "a refused workload ran"


def test_the_experiment_token_lets_a_tag_through(guarded):
    with SchedulerClient(guarded) as client:
        events = _run(client, _workload(True), ((EXPERIMENT_TOKEN_HEADER, TOKEN),))
        assert events[-1].done and events[-1].stats.sessions == 2


def test_untagged_workloads_need_no_experiment_token(guarded):
    with SchedulerClient(guarded) as client:
        assert _run(client, _workload(False))[-1].done


def test_a_loopback_scheduler_without_writers_takes_tags(cluster):
    """`kvfleet up`'s case: one host, nothing configured; experiments work as before."""
    with SchedulerClient(cluster.address) as client:
        assert _run(client, _workload(True))[-1].done

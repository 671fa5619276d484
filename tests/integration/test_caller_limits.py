"""Per-caller queue share on a real scheduler: callers told apart by their bearer tokens; one
that fills its share is refused with RESOURCE_EXHAUSTED naming the limit, another is admitted."""

from __future__ import annotations

import time

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import scheduler_pb2 as spb
from scheduler_svc.core import SchedulerLimits
from tests.integration.inproc import InProcessCluster

SHARE = 2
LONG = build_request([1, 2], 500, ignore_eos=True)  # holds the one running slot until cancelled


@pytest.fixture(scope="module")
def cluster():
    limits = SchedulerLimits(max_running=1, max_queued_per_caller=SHARE, max_queue_depth=16)
    with InProcessCluster(workers=1, limits=limits) as c:
        yield c


def _wait_queue_depth(client: SchedulerClient, depth: int) -> None:
    deadline = time.monotonic() + 30
    while client.telemetry().queue_depth != depth:
        if time.monotonic() > deadline:
            pytest.fail(f"the queue never held {depth} sessions: {client.telemetry()}")
        time.sleep(0.02)


def test_one_caller_cannot_fill_the_queue_for_all(cluster):
    with (
        SchedulerClient(cluster.address, token="blocker") as blocker,
        SchedulerClient(cluster.address, token="alice") as alice,
        SchedulerClient(cluster.address, token="bob") as bob,
    ):
        running = blocker.stream(LONG, timeout=120)
        sid = next(running).session_id
        before = alice.telemetry().rejected_by_reason.get("queue_full", 0)
        # Alice queues her share (behind the running session) ...
        queued = [alice.stream(build_request([3, 4], 4), timeout=120) for _ in range(SHARE)]
        _wait_queue_depth(alice, SHARE)
        # ... and one more is refused, whole, with the limit named.
        with pytest.raises(grpc.RpcError) as info:
            list(alice.submit_workload(spb.WorkloadRequest(sessions=[build_request([3, 4], 4)])))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_per_caller is 2" in info.value.details(), info.value.details()
        assert alice.telemetry().rejected_by_reason["queue_full"] == before + 1
        # Bob is still admitted (the queue itself has room).
        bobs = bob.stream(build_request([3, 4], 4), timeout=120)
        _wait_queue_depth(bob, SHARE + 1)
        blocker.cancel(sid)
        for call in [*queued, bobs]:
            events = list(call)
            assert events[-1].finished and sum(len(e.token_ids) for e in events) == 4
        assert list(running)[-1].finish_reason == spb.FINISH_CANCELLED
        # Once her sessions have run, Alice has her share back.
        assert alice.generate(build_request([3, 4], 4)).finish_reason == "length"

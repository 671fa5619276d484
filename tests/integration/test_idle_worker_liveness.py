"""A worker that holds no session gets no step, so no failed step tells the scheduler that it
died or restarted: the scheduler's periodic GetStats of its live workers does (every
stats_interval_s). One that does not answer is marked dead at once (ListWorkers says so, nothing
is placed there) and one that answers as another instance is taken back as a restarted worker is
(reset, its model compared, its bounds read). In-process servers on loopback ports."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvfleet.client import SchedulerClient
from scheduler_svc.core import SchedulerLimits
from tests.helpers.placement import workload_placement
from tests.helpers.waiting import wait_for
from tests.integration.inproc import InProcessCluster


@pytest.fixture
def cluster() -> Iterator[InProcessCluster]:
    # Spread from the first session (no packing): a workload of a few sessions uses both.
    with InProcessCluster(workers=2, stats_interval_s=0.3, limits=SchedulerLimits(pack_step_ms=0)) as c:
        yield c


def _live(client: SchedulerClient) -> dict[str, bool]:
    return {w.worker_id: w.live for w in client.list_workers()}


def test_an_idle_worker_that_stops_is_marked_dead_before_any_session_is_sent(cluster):
    with SchedulerClient(cluster.address) as client:
        assert _live(client) == {"worker-0": True, "worker-1": True}
        cluster.stop_worker(1)
        wait_for("worker-1 marked dead", lambda: _live(client) == {"worker-0": True, "worker-1": False})
        assert workload_placement(client, [[k, 3, 5] for k in range(4)], 20) == ({"worker-0"}, [20] * 4)


def test_an_idle_worker_that_restarts_is_taken_back_as_its_new_instance(cluster, caplog):
    caplog.set_level(logging.INFO, logger="scheduler_svc")
    with SchedulerClient(cluster.address) as client:
        cluster.stop_worker(1)
        new = cluster.start_worker(1)  # at once: the scheduler may see the new instance, or no answer first
        back = f"worker worker-1 is back (instance {new})"
        wait_for("the new instance taken back", lambda: back in caplog.text)
        lost = [r.getMessage() for r in caplog.records if "worker-1 holds no session" in r.getMessage()]
        assert lost and ("it restarted (instance " in lost[0] or "it does not answer GetStats" in lost[0]), lost
        assert _live(client) == {"worker-0": True, "worker-1": True}
        # Served there again: the sessions spread over both.
        assert workload_placement(client, [[k, 2, 9] for k in range(6)], 20) == ({"worker-0", "worker-1"}, [20] * 6)


def test_a_hung_worker_does_not_hold_up_taking_back_another(caplog):
    """Each worker's stats read runs apart, from the others' and from the probes of dead workers:
    while worker-1 hangs (its read waits for the step timeout, a minute here), worker-0's death is
    still found and, restarted, it is taken back."""
    caplog.set_level(logging.INFO, logger="scheduler_svc")
    with (
        InProcessCluster(workers=2, stats_interval_s=0.3, step_timeout_s=60) as c,
        SchedulerClient(c.address) as client,
    ):
        release = c.hold_worker(1)
        try:
            c.stop_worker(0)
            wait_for("worker-0 marked dead", lambda: not _live(client)["worker-0"])
            new = c.start_worker(0)
            wait_for("worker-0 taken back", lambda: f"worker worker-0 is back (instance {new})" in caplog.text)
        finally:
            release.set()

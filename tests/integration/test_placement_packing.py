"""Packing on real workers: the step times a worker answers with reach the scheduler's books
(and ListWorkers), and a worker with cheap steps takes a workload's sessions before an idle worker is used (the
policy itself: tests/unit/test_scheduler_blocks.py)."""

from __future__ import annotations

from kvfleet.client import SchedulerClient, build_request
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.core import SchedulerLimits
from tests.helpers.placement import workload_placement
from tests.integration.inproc import InProcessCluster


def test_a_workload_packs_onto_the_worker_whose_steps_are_cheap():
    # 50 ms: far above a tiny-model step even on a loaded machine, so the test does not hang on
    # the machine's speed; the default (2 ms) is measured in bench/README.
    with (
        InProcessCluster(workers=2, limits=SchedulerLimits(pack_step_ms=50.0)) as c,
        SchedulerClient(c.address) as client,
    ):
        books = c.scheduler.runtime._core.workers
        assert books.get("worker-0").step_ms is None  # nothing timed yet
        cfg = tiny_config()
        assert client.generate(build_request([4, 5], 6)).token_ids == reference_generate(
            cfg, tiny_weights(cfg, seed=0), [4, 5], 6
        )
        timed = books.get("worker-0").step_ms
        assert timed is not None and 0 < timed < 50.0, timed  # the worker's own step_ns, in ms
        assert books.get("worker-1").step_ms is None
        # ListWorkers shows what packing goes by (0: none timed yet).
        shown = {w.worker_id: w.step_ms for w in client.list_workers()}
        assert shown == {"worker-0": round(timed, 3), "worker-1": 0.0}
        # Six sessions at once: all on worker-0 (cheap), none on the idle worker-1.
        assert workload_placement(client, [[k, 3, 5] for k in range(6)], 12) == ({"worker-0"}, [12] * 6)

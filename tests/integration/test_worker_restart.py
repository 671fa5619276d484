"""The scheduler owns the block tables; a worker restarted under it (its KV gone) is found by its
instance id, and the sessions placed there are recomputed: nothing a client was promised is lost.
A worker told to reset forgets every session (what a scheduler that restarted, or took the worker
back, sends first)."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.helpers.worker_stats import worker_stats
from tests.helpers.worker_steps import prefill_item
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


def test_a_step_for_another_instance_is_refused_and_a_reset_forgets_every_session() -> None:
    with InProcessCluster(workers=1) as c, grpc.insecure_channel(c.worker_addresses[0]) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        instance = stub.GetInfo(wpb.GetInfoRequest(), timeout=10).instance_id
        assert len(instance) == 16
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(wpb.StepRequest(instance_id="0123456789abcdef"), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "restarted" in info.value.details() and instance in info.value.details()
        # Sessions of our own (block ids far from the scheduler's, which has placed nothing yet).
        step = wpb.StepRequest(
            prefill=[prefill_item("x1", [1, 2, 3], first_block=900), prefill_item("x2", [4] * 20, first_block=910)],
            instance_id=instance,
        )
        assert [r.status for r in stub.Step(step, timeout=10).results] == [wpb.ITEM_OK] * 2
        stats = worker_stats(c.worker_addresses[0])
        assert (stats.active_sessions, stats.used_blocks) == (2, 3)
        stub.Step(wpb.StepRequest(reset=True, instance_id=instance), timeout=10)
        stats = worker_stats(c.worker_addresses[0])
        assert (stats.active_sessions, stats.used_blocks) == (0, 0)
        # What it forgot is gone: a decode of it is a miss, not a read of stale KV.
        miss = stub.Step(wpb.StepRequest(decode=[wpb.DecodeItem(session_id="x1", token_id=5, position=3)]), timeout=10)
        assert miss.results[0].status == wpb.ITEM_CACHE_MISS


@pytest.mark.parametrize("overlap", [False, True], ids=["one-tick", "overlap"])
def test_sessions_survive_their_worker_restarting_in_place(overlap: bool) -> None:
    """With overlap a second step is out when the worker goes: both fail, nothing is applied twice."""
    from worker_svc.server import create_server as create_worker

    prompts = [[i + 1, (3 * i) % 48, 7] for i in range(4)]
    new = 60
    with (
        InProcessCluster(workers=1, step_timeout_s=5, overlap=overlap) as c,
        SchedulerClient(c.address) as client,
    ):
        streams = [client.stream(build_request(p, new, ignore_eos=True)) for p in prompts]
        got = [list(next(s).token_ids) for s in streams]
        # The worker process restarts on its address: same worker id, a new instance, empty KV.
        before = client.list_workers()[0]
        port = int(c.worker_addresses[0].rsplit(":", 1)[1])

        async def restart() -> None:
            await c.worker_servers[0].stop(0)
            server, _, _ = await create_worker(replace(c.worker_config, worker_id="worker-0", port=port))
            c.worker_servers[0] = server

        c.run(restart())
        for tokens, s in zip(got, streams):
            for ev in s:
                tokens.extend(ev.token_ids)
        for p, tokens in zip(prompts, got):
            assert tokens == reference_generate(CFG, WEIGHTS, p, new)
        deadline = time.monotonic() + 30
        while not client.list_workers()[0].live:
            assert time.monotonic() < deadline, "the restarted worker was not taken back"
            time.sleep(0.1)
        assert before.worker_id == client.list_workers()[0].worker_id == "worker-0"
        # Its books start empty, and new sessions run there.
        again = client.generate(build_request(prompts[0], 8, ignore_eos=True))
        assert list(again.token_ids) == reference_generate(CFG, WEIGHTS, prompts[0], 8)
        assert c.scheduler.runtime.metrics.worker_failures._value.get() >= 1

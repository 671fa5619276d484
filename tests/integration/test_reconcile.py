"""KV a worker holds for sessions the scheduler never placed there (a drain timeout, a restarted
scheduler, a lost Release) is found through GetStats and freed, so placement gets its room back."""

import grpc

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.helpers.worker_stats import wait_for_worker_stats
from tests.integration.inproc import InProcessCluster

BLOCK = 16


def _orphan(stub, session_id: str, tokens: int) -> None:
    req = wpb.StepRequest()
    req.prefill.add(
        session_id=session_id,
        token_ids=[1 + i % 40 for i in range(tokens)],
        start_position=0,
        last_chunk=True,
        generated_so_far=0,
    )
    resp = stub.Step(req, timeout=10)
    assert resp.results[0].status == wpb.ITEM_OK


def test_orphaned_kv_is_freed_and_its_room_used_again():
    # One worker, 8 blocks of 16 = 128 tokens. Orphans fill 7 blocks; a session that needs
    # 6 blocks (prompt 40 + 50 new) can only run once they are freed.
    with InProcessCluster(workers=1, num_blocks=8, block_size=BLOCK, reconcile_interval_s=0.3) as c:
        with grpc.insecure_channel(c.worker_addresses[0]) as ch:
            stub = wpb_grpc.WorkerStub(ch)
            for i in range(7):
                _orphan(stub, f"left-over-{i}", BLOCK)
            stats = wait_for_worker_stats(
                c.worker_addresses[0], lambda s: not s.session_ids, what="its orphaned sessions to be freed", timeout=10
            )
            assert list(stats.session_ids) == [] and stats.used_blocks == 0
        prompt = [1 + i % 40 for i in range(40)]
        with SchedulerClient(c.address) as client:
            result = client.generate(build_request(prompt, 50, ignore_eos=True), timeout=60)
        cfg = tiny_config()
        assert result.token_ids == reference_generate(cfg, tiny_weights(cfg, seed=0), prompt, 50)

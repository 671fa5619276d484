"""Nothing a client was promised is lost: worker faults, cancellation, deadlines."""

import threading
import time

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.core import SchedulerLimits
from tests.helpers.worker_stats import worker_stats
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


def test_sessions_move_to_a_live_worker_when_theirs_dies():
    with InProcessCluster(workers=2, step_timeout_s=5) as c, SchedulerClient(c.address) as client:
        prompts = [[i, i + 1, (i * 5) % 48] for i in range(6)]
        streams = [client.stream(build_request(p, 40)) for p in prompts]
        got = [[] for _ in prompts]
        # Read a few tokens of every stream, then kill worker-0 while they are mid-generation.
        for i, s in enumerate(streams):
            got[i].extend(next(s).token_ids)
        c.run(c.worker_servers[0].stop(0))
        for i, s in enumerate(streams):
            for ev in s:
                got[i].extend(ev.token_ids)
        for p, tokens in zip(prompts, got):
            assert tokens == reference_generate(CFG, WEIGHTS, p, 40)
        live = {w.worker_id: w.live for w in client.list_workers()}
        assert live == {"worker-0": False, "worker-1": True}


def test_seeded_sampling_survives_a_move():
    req = build_request([3, 4, 5], 30, temperature=0.9, top_k=20, seed=1234)
    with InProcessCluster(workers=2, step_timeout_s=5) as c, SchedulerClient(c.address) as client:
        undisturbed = client.generate(req).token_ids
        stream = client.stream(req)
        first = next(stream)
        tokens = list(first.token_ids)
        c.run(c.worker_servers[int(first.worker_id[-1])].stop(0))
        for ev in stream:
            tokens.extend(ev.token_ids)
    assert tokens == undisturbed


def test_client_cancel_frees_the_session_within_a_tick(cluster):
    with SchedulerClient(cluster.address) as client:
        call = client.stream(build_request([1, 2, 3], 400))
        first = next(call)
        worker = first.worker_id
        call.cancel()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            snap = client.telemetry()
            if snap.active_sessions == 0 and snap.kv_total_bytes == 0:
                break
            time.sleep(0.02)
        assert snap.active_sessions == 0 and snap.kv_total_bytes == 0
        address = cluster.worker_addresses[int(worker[-1])]
        while time.monotonic() < deadline and worker_stats(address).active_sessions:
            time.sleep(0.02)
        assert worker_stats(address).active_sessions == 0


def test_deadline_ends_only_that_session(cluster):
    with SchedulerClient(cluster.address) as client:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", client.generate(build_request([7, 8], 60))))
        t.start()
        with pytest.raises(grpc.RpcError) as info:
            client.generate(build_request([1, 2], 400), timeout=0.3)
        t.join(30)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert result["r"].token_ids == reference_generate(CFG, WEIGHTS, [7, 8], 60)
        deadline = time.monotonic() + 5
        while client.telemetry().kv_total_bytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.telemetry().kv_total_bytes == 0


def test_preemption_under_kv_pressure_keeps_tokens_exact():
    from scheduler_svc.core import SchedulerLimits

    # 8 blocks of 4 tokens per worker: 32 tokens, far less than 6 sessions x 27 tokens.
    limits = SchedulerLimits(kv_policy="preempt", max_running=6, prefill_token_budget=64)
    with (
        InProcessCluster(workers=1, limits=limits, num_blocks=8, block_size=4) as c,
        SchedulerClient(c.address) as client,
    ):
        import concurrent.futures as cf

        prompts = [[i, i + 2, i + 4] for i in range(6)]
        with cf.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda p: client.generate(build_request(p, 24)), prompts))
        snap = client.telemetry()
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(CFG, WEIGHTS, p, 24)
    assert snap.preemptions_total > 0 and snap.kv_total_bytes == 0


def test_with_no_live_worker_sessions_wait_bounded_then_unavailable():
    cluster = InProcessCluster(workers=1, step_timeout_s=2, no_worker_wait_s=1.0, stats_interval_s=3600)
    with cluster as c, SchedulerClient(c.address) as client:
        c.wait_first_stats()  # then the worker's death is found by the session's step
        c.stop_worker(0)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            client.generate(build_request([1, 2], 4), timeout=30)
        waited = time.monotonic() - started
        # Bounded: the scheduler gave up (UNAVAILABLE) before the client's 30 s deadline would
        # have (DEADLINE_EXCEEDED); and not before no_worker_wait_s, whose clock starts once the
        # scheduler has found no live worker for this session (so after the call began).
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "no live worker for 1s" in info.value.details()
        assert waited >= 1.0
        assert client.retries == 0  # a serving scheduler's own refusal before any event: not re-sent
        snap = client.telemetry()
        assert snap.queue_depth == 0 and snap.active_sessions == 0


def test_a_worker_that_comes_back_is_used_again():
    from dataclasses import replace

    from worker_svc.server import create_server as create_worker

    # Spread from the first session (no packing), so that sessions land on the dead worker.
    spread = SchedulerLimits(pack_step_ms=0)
    with InProcessCluster(workers=2, step_timeout_s=2, limits=spread) as c, SchedulerClient(c.address) as client:
        c.run(c.worker_servers[1].stop(0))
        # Concurrent sessions spread over both; those on the dead one mark it dead and move.
        import concurrent.futures as cf

        first = [[1, 2], [3, 4], [5, 6], [7, 8]]
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.generate(build_request(p, 6)), first))
        for p, r in zip(first, got):
            assert r.token_ids == reference_generate(CFG, WEIGHTS, p, 6)
        assert {w.worker_id: w.live for w in client.list_workers()}["worker-1"] is False
        port = int(c.worker_addresses[1].rsplit(":", 1)[1])
        server, _, _ = c.run(create_worker(replace(c.worker_config, worker_id="worker-1", port=port)))
        c.worker_servers[1] = server
        deadline = time.monotonic() + 30
        while not {w.worker_id: w.live for w in client.list_workers()}["worker-1"]:
            assert time.monotonic() < deadline, "the restarted worker was not taken back"
            time.sleep(0.1)
        prompts = [[i, 7] for i in range(8)]
        with cf.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: client.generate(build_request(p, 20)), prompts))
        assert "worker-1" in {r.worker_id for r in results}
        for p, r in zip(prompts, results):
            assert r.token_ids == reference_generate(CFG, WEIGHTS, p, 20)

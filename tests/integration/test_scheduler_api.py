"""The client API over real gRPC: streaming, concurrency, rejections with their status codes."""

import asyncio
import concurrent.futures as cf
import time

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.core import SchedulerLimits
from scheduler_svc.runtime import SchedulerRuntime
from scheduler_svc.workers import WorkerClient
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


def test_generate_streams_reference_tokens(cluster):
    with SchedulerClient(cluster.address) as client:
        result = client.generate(build_request([5, 6, 7], 12))
    assert result.token_ids == reference_generate(CFG, WEIGHTS, [5, 6, 7], 12)
    assert result.finish_reason == "length"
    assert result.prompt_token_ids == [5, 6, 7]
    assert result.worker_id.startswith("worker-")


def test_concurrent_clients_get_their_own_tokens(cluster, monkeypatch):
    """Twelve clients at once: each gets its own tokens, and the sessions are spread over both
    workers (placement by load: packing, which puts the tiny model's cheap steps on one worker,
    is turned off for this test; test_scheduler_blocks tests it). So that "at once" holds on a
    loaded machine too (where each short session could otherwise end before the next arrives,
    all on the first worker), no worker step goes out until all twelve have been submitted."""
    prompts = [[i % 48, (3 * i) % 48, (7 * i + 1) % 48][: 1 + i % 3] for i in range(12)]
    submitted: list[int] = []
    submit, step = SchedulerRuntime.submit, WorkerClient.step

    def counted_submit(self, reqs, *args, **kwargs):
        sub = submit(self, reqs, *args, **kwargs)
        submitted.append(len(reqs))
        return sub

    async def gated_step(self, *args, **kwargs):
        end = time.monotonic() + 60  # a bound, so that a broken submit fails the test, not hangs it
        while sum(submitted) < len(prompts) and time.monotonic() < end:
            await asyncio.sleep(0.005)
        return await step(self, *args, **kwargs)

    monkeypatch.setattr(SchedulerRuntime, "submit", counted_submit)
    monkeypatch.setattr(WorkerClient, "step", gated_step)
    monkeypatch.setattr(cluster.scheduler.runtime._core.kv, "pack_step_ms", 0.0)  # by load
    with SchedulerClient(cluster.address) as client, cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: client.generate(build_request(p, 6 + len(p)), timeout=120), prompts))
    assert sum(submitted) == len(prompts)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(CFG, WEIGHTS, p, 6 + len(p))
    workers = {r.worker_id for r in results}
    assert len(workers) == 2, "sessions should be spread over both workers"


def test_stop_token_ends_the_session(cluster):
    expected = reference_generate(CFG, WEIGHTS, [1, 2], 10)
    stop = expected[3]
    first = expected.index(stop)
    with SchedulerClient(cluster.address) as client:
        r = client.generate(build_request([1, 2], 10, stop_token_ids=[stop]))
    assert r.token_ids == expected[: first + 1]
    assert r.finish_reason == "stop"


def test_usage_in_the_final_event(cluster):
    with SchedulerClient(cluster.address) as client:
        events = list(client.stream(build_request([1, 2, 3], 5)))
    assert events[-1].finished
    assert events[-1].usage.input_tokens == 3 and events[-1].usage.output_tokens == 5


def _code(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


REJECTIONS = [
    (build_request([], 4), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
    (build_request([1, 2], 0), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
    (build_request([1, 99], 4), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
    (build_request([1], 4, temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
    (build_request([1], 4, top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "invalid_request"),
    (build_request("some text", 4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids"),
    (build_request([1] * 40, 4), grpc.StatusCode.INVALID_ARGUMENT, "prompt_too_long"),
    (build_request([1] * 10, 30), grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_budget"),
]


@pytest.fixture(scope="module")
def small_cluster():
    # 20 prompt tokens max; KV budget of 32 tokens (1536 B each); queue of 2.
    limits = SchedulerLimits(
        max_running=1,
        prefill_token_budget=8,
        kv_budget_bytes=32 * 1536,
        max_queue_depth=2,
        max_prompt_tokens=20,
        max_new_tokens=64,
    )
    with InProcessCluster(workers=1, limits=limits) as c:
        yield c


@pytest.mark.parametrize("request_, code, reason", REJECTIONS)
def test_each_rejection_has_its_status_and_reason(small_cluster, request_, code, reason):
    with SchedulerClient(small_cluster.address) as client:
        got_code, details = _code(lambda: client.generate(request_))
    assert got_code == code
    assert reason in details
    with SchedulerClient(small_cluster.address) as client:
        # The service keeps serving normal requests.
        assert client.generate(build_request([1, 2], 3)).finish_reason == "length"


def test_queue_full_is_resource_exhausted_and_counted(small_cluster):
    with SchedulerClient(small_cluster.address) as client:
        before = client.telemetry().rejected_by_reason.get("queue_full", 0)
        # A workload larger than the queue depth (2) is refused whole.
        req = spb.WorkloadRequest(sessions=[build_request([1], 2) for _ in range(3)])
        code, details = _code(lambda: list(client.submit_workload(req)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue_full" in details
        assert client.telemetry().rejected_by_reason["queue_full"] == before + 1


def test_workload_policy_above_limit_is_invalid(small_cluster):
    with SchedulerClient(small_cluster.address) as client:
        req = spb.WorkloadRequest(sessions=[build_request([1], 2)], policy=spb.WorkloadPolicy(max_running=5))
        code, details = _code(lambda: list(client.submit_workload(req)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_running" in details


def test_no_worker_is_unavailable():
    limits = SchedulerLimits()
    with InProcessCluster(workers=1, limits=limits, step_timeout_s=2, stats_interval_s=3600) as c:
        c.wait_first_stats()  # then the worker's death is found by the first session's step
        c.stop_worker(0)
        with SchedulerClient(c.address) as client:
            # The first session finds the worker gone: the worker is marked dead, the session waits.
            fut = cf.ThreadPoolExecutor(1).submit(client.generate, build_request([1], 2), 3)
            with pytest.raises(grpc.RpcError) as info:
                fut.result(10)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            code, details = _code(lambda: client.generate(build_request([1], 2)))
        assert code == grpc.StatusCode.UNAVAILABLE and "no_worker" in details


def test_batched_workload_events_are_the_events_one_by_one(cluster):
    """WorkloadRequest.batch_events: a delivery's events in one message (kvfleet's client asks for
    it and unpacks); a client that does not ask gets them one per message, the same events."""
    sessions = [build_request([3 + k, 1, 4], 5, ignore_eos=True, request_id=f"r{k}") for k in range(4)]
    with SchedulerClient(cluster.address) as client:

        def events(batch: bool) -> tuple[list[spb.WorkloadEvent], list[tuple[int, list[int], str]]]:
            raw = list(client.stub.SubmitWorkload(spb.WorkloadRequest(sessions=sessions, batch_events=batch)))
            flat = [e for ev in raw for e in (ev.batch or [ev])]
            tokens: dict[int, list[int]] = {}
            for e in flat[:-1]:
                assert not e.batch and e.event.request_id == f"r{e.session_index}"
                tokens.setdefault(e.session_index, []).extend(e.event.token_ids)
            assert flat[-1].done and flat[-1].stats.sessions == 4
            return raw, sorted((i, t, f"r{i}") for i, t in tokens.items())

        raw_one, one = events(False)
        raw_batched, batched = events(True)
        assert batched == one and all(len(t) == 5 for _, t, _ in one)
        assert len(raw_batched) < len(raw_one)  # several sessions' events per message
        assert any(len(ev.batch) > 1 for ev in raw_batched)
        unpacked = list(client.submit_workload(spb.WorkloadRequest(sessions=sessions)))
        assert all(not ev.batch for ev in unpacked) and unpacked[-1].done


def test_cancel_unknown_session_is_not_found(cluster):
    with SchedulerClient(cluster.address) as client:
        code, details = _code(lambda: client.cancel("s-nope"))
    assert code == grpc.StatusCode.NOT_FOUND and "s-nope" in details


def test_list_workers(cluster):
    with SchedulerClient(cluster.address) as client:
        workers = client.list_workers()
    assert sorted(w.worker_id for w in workers) == ["worker-0", "worker-1"]
    assert all(w.live and w.model == "tiny" and w.kv_capacity_tokens > 0 for w in workers)

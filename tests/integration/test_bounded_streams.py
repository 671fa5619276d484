"""Bounded resources per client, on a real tiny-model cluster: a client that stops reading its
stream is cut off with RESOURCE_EXHAUSTED and its KV freed while others are served; a workload's
sessions and prompts are dropped as soon as its stream ends (its stats stay); and a stream
outlives many keepalive periods."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from scheduler_svc.core import SchedulerLimits
from tests.helpers.prometheus import value
from tests.helpers.worker_stats import wait_for_worker_stats
from tests.integration.inproc import InProcessCluster

BACKLOG = 4  # events per session a stream may hold unread
SESSIONS = 8
# 8 sessions x 480 tokens = 3840 messages of ~80 bytes: several times the 64 KiB HTTP/2 window of
# a client without BDP probing, so the server's writes block once the client stops reading.
MAX_NEW = 480
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def cluster():
    limits = SchedulerLimits(max_stream_backlog=BACKLOG, max_running=64)
    with InProcessCluster(workers=1, limits=limits, stats_interval_s=3600) as c:
        yield c


def _stalled_stub(address: str):
    # BDP probing off: the window stays at 64 KiB instead of growing to many MiB, so a client
    # that stops reading holds the server's writes within a few hundred events.
    channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    return channel, spb_grpc.SchedulerStub(channel)


def _open_stalled(stub, kind: str):
    """Open a stream of SESSIONS long sessions and read only its first message."""
    if kind == "generate":
        call = stub.Generate(build_request(PROMPT, MAX_NEW, ignore_eos=True, n=SESSIONS), timeout=300)
    else:
        req = spb.WorkloadRequest(sessions=[build_request(PROMPT, MAX_NEW, ignore_eos=True)] * SESSIONS)
        call = stub.SubmitWorkload(req, timeout=300)
    next(call)
    return call


def _holds(cluster: InProcessCluster, session_ids) -> list[str]:
    async def check() -> list[str]:
        return [s for s in session_ids if cluster.scheduler.runtime.holds(s)]

    return cluster.run(check())


def _cut_off(cluster: InProcessCluster) -> float:
    text = generate_latest(cluster.scheduler.runtime.metrics.registry).decode()
    return value(text, "kvfleet:streams_cut_off_total")


@pytest.mark.parametrize("kind", ["generate", "workload"])
def test_a_client_that_stops_reading_is_cut_off_and_its_kv_freed(cluster, kind):
    worker = cluster.worker_addresses[0]
    cut_before = _cut_off(cluster)
    with SchedulerClient(cluster.address, token="other-caller") as other:
        reference = other.generate(build_request([7, 7, 2], 24, ignore_eos=True)).token_ids
        before = other.telemetry()
        channel, stub = _stalled_stub(cluster.address)
        try:
            call = _open_stalled(stub, kind)
            # The stream's sessions are cancelled by the scheduler while its client still holds
            # the stream open and reads nothing: every KV block goes back to the worker.
            wait_for_worker_stats(
                worker, lambda s: s.active_sessions == 0, what="the stalled stream's sessions freed", timeout=120
            )
            # Meanwhile (and after) another caller is served, token-exact.
            for _ in range(3):
                assert other.generate(build_request([7, 7, 2], 24, ignore_eos=True)).token_ids == reference
            after = other.telemetry()
            assert after.active_sessions == 0 and after.queue_depth == 0
            stalled_tokens = after.decode_tokens_total - before.decode_tokens_total - 3 * 23
            assert stalled_tokens < SESSIONS * (MAX_NEW - 1), "the stalled sessions ran to their end"
            # The stalled client, reading again, learns why its stream ended.
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert "stopped reading" in info.value.details() and "max_stream_backlog" in info.value.details()
            assert _cut_off(cluster) == cut_before + 1  # kvfleet:streams_cut_off_total
        finally:
            channel.close()
        assert other.generate(build_request([7, 7, 2], 24, ignore_eos=True)).token_ids == reference


def test_a_finished_workload_keeps_only_its_stats(cluster):
    with SchedulerClient(cluster.address) as client:
        req = spb.WorkloadRequest(sessions=[build_request([5, 4, 3, 2], 6, ignore_eos=True)] * 3, snapshot_at_tick=1)
        events = list(client.submit_workload(req))
        done = events[-1]
        assert done.done and done.stats.sessions == 3
        sids = {ev.event.session_id for ev in events if ev.HasField("event")}
        assert len(sids) == 3
        assert _holds(cluster, sids) == [], "a closed workload's sessions (and prompts) are still held"
        # Its figures still answer.
        snap = client.stub.GetTelemetry(spb.TelemetryRequest(workload_id=done.workload_id, at_tick=1), timeout=10)
        assert snap.ticks == 1
        # A workload asked for no snapshot: asking for one says how to get it.
        plain = list(client.submit_workload(spb.WorkloadRequest(sessions=[build_request([5, 4], 2)])))[-1]
        with pytest.raises(grpc.RpcError) as info:
            client.stub.GetTelemetry(spb.TelemetryRequest(workload_id=plain.workload_id, at_tick=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "captured no snapshot at tick 2" in info.value.details() and "snapshot_at_tick=2" in info.value.details()


def test_a_workload_whose_client_left_is_dropped_once_its_sessions_settle(cluster):
    worker = cluster.worker_addresses[0]
    with SchedulerClient(cluster.address) as client:
        req = spb.WorkloadRequest(sessions=[build_request(PROMPT, MAX_NEW, ignore_eos=True)] * 3)
        call = client.stub.SubmitWorkload(req, timeout=300)
        first = next(call)
        wid = first.workload_id
        sids = {first.event.session_id}
        for ev in call:  # until every session has shown its id
            sids.add(ev.event.session_id)
            if len(sids) == 3:
                break
        call.cancel()
        wait_for_worker_stats(worker, lambda s: s.active_sessions == 0, what="the left workload's KV freed")
        deadline = time.monotonic() + 30
        while _holds(cluster, sids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _holds(cluster, sids) == [], "sessions of a workload whose client left are still held"
        assert client.telemetry().active_sessions == 0
        # The stats of the closed workload are kept (the scheduler answers for it).
        assert cluster.run(_has_workload(cluster, wid))


async def _has_workload(cluster: InProcessCluster, workload_id: str) -> bool:
    return cluster.scheduler.runtime.has_workload(workload_id)


def test_a_stream_outlives_many_keepalive_periods():
    """A server with the shared options and a 100 ms keepalive: a Watch stream open for ten
    keepalive periods still delivers (the client answers the pings; nothing strikes it out)."""

    async def run() -> list[int]:
        server = grpc.aio.server(options=grpcutil.server_options(keepalive_time_ms=100))
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("x", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="x"))
                seen = [(await asyncio.wait_for(call.read(), 10)).status]
                await asyncio.sleep(1.0)  # ten keepalive periods with the stream idle
                await servicer.set("x", health_pb2.HealthCheckResponse.NOT_SERVING)
                seen.append((await asyncio.wait_for(call.read(), 10)).status)
                call.cancel()
                return seen
        finally:
            await server.stop(0)

    assert asyncio.run(run()) == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]

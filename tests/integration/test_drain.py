"""SIGTERM drains: NOT_SERVING, new sessions refused with UNAVAILABLE, running ones finish."""

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from worker_svc.config import WorkerConfig


def test_scheduler_drains_on_sigterm():
    """The session must still be running while the drain is checked, on any machine: its worker
    is stopped (SIGSTOP) after the first event and continued (SIGCONT) once the checks are done,
    so its step cannot finish in between. The drain grace is long, so that only the session
    ending (not the grace running out under load) ends the drain."""
    cfg = tiny_config()
    spec = ClusterSpec(workers=1, model="tiny", telemetry=False, scheduler_args=("--drain-grace", "300"))
    with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        result = {}
        stream = client.stream(build_request([1, 2, 3], 300))
        first = next(stream)
        worker = cluster.procs["worker-0"]
        worker.send_signal(signal.SIGSTOP)
        try:
            assert client.telemetry().active_sessions == 1, "the session ended before its worker was stopped"

            def finish():
                tokens = list(first.token_ids)
                for ev in stream:
                    tokens.extend(ev.token_ids)
                result["tokens"] = tokens

            reader = threading.Thread(target=finish)
            reader.start()
            proc = cluster.procs["scheduler"]
            proc.send_signal(signal.SIGTERM)
            # While it drains: health says NOT_SERVING and new sessions are refused clearly.
            with grpc.insecure_channel(cluster.scheduler_address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                deadline = time.monotonic() + 60
                while True:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
                    if status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                client.generate(build_request([4, 5], 3), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in info.value.details()
            assert client.retries == 0  # health NOT_SERVING: "go elsewhere", never re-sent here
            assert proc.poll() is None and reader.is_alive(), "the drain ended before the session did"
        finally:
            worker.send_signal(signal.SIGCONT)
        reader.join(120)
        assert result["tokens"] == reference_generate(cfg, tiny_weights(cfg), [1, 2, 3], 300)
        assert proc.wait(60) == 0


def test_worker_and_telemetry_exit_cleanly_on_sigterm():
    """The worker's step stream from the scheduler is open (a session ran): it ends once its steps
    have answered, rather than holding the worker's stop for the whole grace."""
    with LocalCluster(ClusterSpec(workers=1, model="tiny")) as cluster:
        with SchedulerClient(cluster.scheduler_address) as client:
            assert client.generate(build_request([1, 2, 3], 4, ignore_eos=True)).token_ids
        for name, within_s in (("worker-0", WorkerConfig.drain_grace_s - 3), ("telemetry", 30)):
            proc = cluster.procs[name]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(within_s) == 0, name

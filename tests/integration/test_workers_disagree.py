"""Workers that do not serve one model, on real processes: a scheduler refuses to start over
them and says which worker serves what; a worker restarted with a shorter --max-model-len lowers
the scheduler's admission bound, and a session admitted under the old bound is refused by that
worker (its item REJECTED, INVALID_ARGUMENT with the worker's reason at the client) while the
service goes on; a worker that comes back serving another model is kept out until it serves the
fleet's model again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvfleet.client import NO_RETRY, SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster, free_port
from tests.helpers.environment import clear_kvfleet_env
from tests.helpers.models import write_small_hf_model
from tests.helpers.placement import workload_placement
from tests.helpers.waiting import wait_for

LONG_PROMPT = [(5 * i + 1) % 48 for i in range(100)]  # fits the tiny model's 512, not 64


@pytest.fixture
def other_model(tmp_path: Path) -> Path:
    """A second small Llama: vocabulary 64 and 2 layers against the tiny model's 48 and 6."""
    return write_small_hf_model(tmp_path / "other-model")


def _worker(model: str, worker_id: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["--model", model, "--port", str(port), "--metrics-port", "0", "--worker-id", worker_id]
    proc = subprocess.Popen([sys.executable, "-m", "worker_svc", *args], stderr=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{port}"


def test_a_scheduler_over_workers_of_two_models_refuses_to_start_naming_them(other_model, monkeypatch):
    clear_kvfleet_env(monkeypatch)
    workers = [_worker("tiny", "w-tiny"), _worker(str(other_model), "w-other")]
    try:
        addresses = ",".join(address for _, address in workers)
        proc = subprocess.run(
            [sys.executable, "-m", "scheduler_svc", "--workers", addresses, "--port", "0", "--metrics-port", "0"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
        )
    finally:
        for p, _ in workers:
            p.kill()
            p.wait()
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("scheduler: the workers serve different models: w-tiny at "), proc.stderr
    assert "w-other at " in line and "serves 'other-model'" in line
    assert "vocab_size 48 vs 64" in line and "num_layers 6 vs 2" in line
    assert "start every worker of a scheduler with the same --model" in line
    assert "Traceback" not in proc.stderr


@pytest.fixture
def one_tiny_worker(monkeypatch) -> Iterator[LocalCluster]:
    clear_kvfleet_env(monkeypatch)
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False)) as cluster:
        yield cluster


def _queued(client: SchedulerClient, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.telemetry().queue_depth < n:
        assert time.monotonic() < deadline, "the session never reached the scheduler's queue"
        time.sleep(0.05)


def test_a_worker_restarted_with_a_shorter_context_refuses_what_no_longer_fits(one_tiny_worker):
    cluster = one_tiny_worker
    with SchedulerClient(cluster.scheduler_address, retry=NO_RETRY) as client:
        assert client.model_info().max_model_len == 512
        cluster.kill_worker(0)
        # Admitted under the bound of 512, it waits for a live worker...
        stream = client.stream(build_request(LONG_PROMPT, 8, ignore_eos=True), timeout=60)
        _queued(client, 1)
        # ... which comes back serving 64 positions: the worker refuses the session's prefill.
        cluster.restart_worker(0, ["--max-model-len", "64"])
        with pytest.raises(grpc.RpcError) as refused:
            list(stream)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "positions up to 100 exceed the served context of 64 tokens" in refused.value.details()
        # The scheduler took the worker's new bound: such a prompt is refused at admission now.
        with pytest.raises(grpc.RpcError) as too_long:
            client.generate(build_request(LONG_PROMPT, 8, ignore_eos=True), timeout=30)
        assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the model's context of 64 tokens" in too_long.value.details()
        assert client.model_info().max_model_len == 64
        # And what fits is served, on the same worker.
        assert len(client.generate(build_request([1, 2, 3], 8, ignore_eos=True), timeout=30).token_ids) == 8


def test_clients_are_told_the_context_every_worker_serves(monkeypatch):
    """GetModelInfo's max_model_len is what admission holds sessions to, the smallest of the
    workers' (it was the first live worker's: 512 here while a prompt of 100 was refused)."""
    clear_kvfleet_env(monkeypatch)
    with (
        LocalCluster(ClusterSpec(workers=2, model="tiny", telemetry=False, pack_step_ms=0)) as cluster,
        SchedulerClient(cluster.scheduler_address, retry=NO_RETRY) as client,
    ):
        assert client.model_info().max_model_len == 512
        cluster.kill_worker(1)
        cluster.restart_worker(1, ["--max-model-len", "64"])
        # Sessions spread over both find worker-1 restarted (moved, served); it is taken back.
        assert workload_placement(client, [[k, 1, 2] for k in range(6)], 8)[1] == [8] * 6
        wait_for("worker-1 back", lambda: all(w.live for w in client.list_workers()))
        info = client.model_info()
        assert (info.max_model_len, info.max_context_length, info.model_max_position) == (64, 64, 512)
        with pytest.raises(grpc.RpcError) as too_long:
            client.generate(build_request(LONG_PROMPT, 8, ignore_eos=True), timeout=30)
        assert "exceeds the model's context of 64 tokens" in too_long.value.details()


def test_a_worker_back_with_another_model_is_kept_out_until_it_serves_the_fleet_s(other_model, monkeypatch):
    clear_kvfleet_env(monkeypatch)
    # Spread from the first session (no packing): a workload of a few sessions uses both.
    spec = ClusterSpec(workers=2, model="tiny", telemetry=False, pack_step_ms=0)
    with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        cluster.kill_worker(1)
        cluster.restart_worker(1, ["--model", str(other_model)])
        # The scheduler learns of the restart from a step there (refused: another instance), the
        # sessions sent together being spread over both workers; they are served all the same
        # (moved to worker-0), and worker-1 is probed until it answers.
        assert workload_placement(client, [[k, k + 1, 7] for k in range(6)], 20) == ({"worker-0"}, [20] * 6)
        log = cluster.log_dir / "scheduler.log"
        wait_for("the scheduler's refusal", lambda: "answers again but serves 'other-model'" in log.read_text())
        assert "not the fleet's 'tiny' (vocab_size 48 vs 64" in log.read_text()
        (back,) = [w for w in client.list_workers() if w.worker_id == "worker-1"]
        assert (back.live, back.model, back.vocab_size) == (False, "other-model", 64)
        # Every session goes to the fleet's model meanwhile.
        assert workload_placement(client, [[k, k + 1, 7] for k in range(4)], 6) == ({"worker-0"}, [6] * 4)
        # Restarted on the fleet's model (the later --model wins), it is taken back.
        cluster.kill_worker(1)
        cluster.restart_worker(1, ["--model", "tiny"])
        wait_for("worker-1 back", lambda: all(w.live for w in client.list_workers()))
        assert workload_placement(client, [[k, 2, 9] for k in range(6)], 6) == ({"worker-0", "worker-1"}, [6] * 6)

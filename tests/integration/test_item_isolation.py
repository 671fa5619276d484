"""One bad item hurts only its own session: a poisoned session in a batch of six on a real
cluster (gRPC scheduler and workers, the tiny model), its fault injected on the worker with a
failpoint (worker_svc/failpoints.py) — the five others finish token-exact, no worker is marked
dead, and the worker's books hold nothing afterwards."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import generate_latest

from kvfleet.client import SchedulerClient, build_request
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from scheduler_svc.core import SchedulerLimits
from tests.helpers.prometheus import value
from tests.helpers.worker_stats import wait_for_worker_stats
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)
POISON_SEED = 666
NEW = 24


def _counter(cluster: InProcessCluster, name: str) -> float:
    text = generate_latest(cluster.scheduler.runtime.metrics.registry).decode()
    return value(text, name)


def test_a_sampling_fault_fails_its_session_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_FAILPOINTS", f"worker.sample:seed={POISON_SEED}")
    prompts = [[i + 1, (3 * i) % 40 + 2, (7 * i) % 45 + 1] for i in range(6)]
    # One worker: every step then batches the poisoned item with the others' work.
    with InProcessCluster(workers=1) as c, SchedulerClient(c.address) as client:
        streams = []
        for i, p in enumerate(prompts):
            # Session 3 samples on the host (temperature) with the poisoned seed; the rest are greedy.
            req = build_request(p, NEW, temperature=0.7, seed=POISON_SEED) if i == 3 else build_request(p, NEW)
            streams.append(client.stream(req))
        got: dict[int, list[int]] = {}
        for i, s in enumerate(streams):
            if i == 3:
                with pytest.raises(grpc.RpcError) as info:
                    list(s)
                continue
            events = list(s)
            got[i] = [t for ev in events for t in ev.token_ids]
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "failed on this session" in info.value.details()
        assert "FailpointHit" in info.value.details()
        for i, tokens in got.items():
            assert tokens == reference_generate(CFG, WEIGHTS, prompts[i], NEW), f"session {i}"
        assert all(w.live for w in client.list_workers())
        assert _counter(c, "kvfleet:worker_failures_total") == 0
        assert _counter(c, "kvfleet:step_failures_total") == 0
        assert _counter(c, "kvfleet:item_errors_total") == 1
        for address in c.worker_addresses:  # the books: nothing held once every stream is over
            wait_for_worker_stats(address, lambda s: s.active_sessions == 0 and s.used_blocks == 0, what="empty books")
        assert c.scheduler.runtime.output.held() == 0  # nor output state, the failed session's included
        # The cluster keeps serving, token-exact.
        again = client.generate(build_request(prompts[0], NEW)).token_ids
        assert list(again) == got[0]


def test_a_failing_step_keeps_its_worker_and_ends_the_session_after_max_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVFLEET_FAILPOINTS", f"worker.forward:seed={POISON_SEED}")
    limits = SchedulerLimits(max_moves=2)
    with InProcessCluster(workers=2, limits=limits) as c, SchedulerClient(c.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(build_request([1, 2, 3], NEW, temperature=0.7, seed=POISON_SEED))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details()
        assert "recomputed 2 times" in details and "max_moves is 2" in details and "INTERNAL" in details
        assert _counter(c, "kvfleet:step_failures_total") == 3  # the first try and two recomputes
        assert _counter(c, "kvfleet:worker_failures_total") == 0
        assert all(w.live for w in client.list_workers())
        for address in c.worker_addresses:
            wait_for_worker_stats(address, lambda s: s.active_sessions == 0, what="no session held")
        prompt = [4, 5, 6]
        assert list(client.generate(build_request(prompt, NEW)).token_ids) == reference_generate(
            CFG, WEIGHTS, prompt, NEW
        )

"""A call that starts just as the server sends GOAWAY (every connection's max age, grpcutil) is
refused by it unseen; kvfleet's channels have gRPC's transparent retries on, so such a call is
sent again on a fresh connection instead of failing UNAVAILABLE. (No retry policy is set: a call
the server saw is never sent twice.) Here the scheduler's connections age in 0.3 s and a client
without retries of its own sends call after call for 4 s: every one is answered, token-exact."""

from __future__ import annotations

import time

import pytest

from kvfleet.client import NO_RETRY, SchedulerClient, build_request
from kvfleet_common import grpcutil
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights
from tests.integration.inproc import InProcessCluster


def test_calls_at_a_connection_s_goaway_are_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    short = {"grpc.max_connection_age_ms": 300, "grpc.max_connection_age_grace_ms": 5000}
    monkeypatch.setattr(grpcutil, "SERVER_OPTIONS", [(k, short.get(k, v)) for k, v in grpcutil.SERVER_OPTIONS])
    cfg = tiny_config()
    expected = reference_generate(cfg, tiny_weights(cfg, seed=0), [1, 2, 3], 2)
    with InProcessCluster(workers=1) as cluster, SchedulerClient(cluster.address, retry=NO_RETRY) as client:
        calls, end = 0, time.monotonic() + 4
        while time.monotonic() < end:
            got = client.generate(build_request([1, 2, 3], 2, ignore_eos=True), timeout=30)
            assert list(got.token_ids) == expected
            calls += 1
    assert calls > 20, calls

"""A worker's GetStats over its gRPC port (insecure, as in-process and local clusters serve it)."""

from __future__ import annotations

import time
from typing import Callable

import grpc
import pytest

from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc


def worker_stats(address: str, timeout: float = 5.0) -> wpb.WorkerStats:
    """The worker's stats now."""
    with grpc.insecure_channel(address) as ch:
        return wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=timeout)


def wait_for_worker_stats(
    address: str,
    until: Callable[[wpb.WorkerStats], bool],
    *,
    what: str,
    timeout: float = 10.0,
    interval: float = 0.1,
) -> wpb.WorkerStats:
    """Poll GetStats until `until(stats)` holds and return those stats; past `timeout` seconds
    the test fails, naming `what` it waited for and the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(address)
        if until(stats):
            return stats
        if time.monotonic() >= deadline:
            pytest.fail(f"worker {address}: waited {timeout:g}s for {what} in vain; last stats: {stats}")
        time.sleep(interval)

"""Which failed worker calls make the worker unreachable (its sessions recomputed elsewhere and
the worker probed), and which are its own answer that a call failed."""

from __future__ import annotations

import grpc
import pytest

from scheduler_svc.worker_errors import WorkerCallFailed, connection_status


@pytest.mark.parametrize(
    "code, details, unreachable",
    [
        # A connection cut in the middle of a write: grpc core's words, seen on a step stream in
        # a CI run (test_step_stream's kept-too-long case); the same loss as UNAVAILABLE.
        (grpc.StatusCode.INTERNAL, "Internal error from Core", True),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True),
        # The worker's own answer: the step failed there, and the worker stays in use.
        (grpc.StatusCode.INTERNAL, "the step failed on the worker: RuntimeError: boom", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "a step names the same session twice", False),
    ],
)
def test_a_cut_connection_is_the_worker_unreachable(code: grpc.StatusCode, details: str, unreachable: bool) -> None:
    failed = WorkerCallFailed("w:1", *connection_status(code, details))
    assert failed.worker_unreachable is unreachable
    assert details in str(failed)  # grpc's own words are kept

"""How a call to a worker failed, and whether that makes the worker dead."""

from __future__ import annotations

import grpc

# The codes of a call that did not reach a worker that could serve it: down or unreachable,
# timed out, or refusing the scheduler's credentials (until it answers GetInfo again). Any other
# code is the worker's answer that this call failed, and the worker stays in use.
UNREACHABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        # The worker restarted (a new instance id): the KV the books place there is gone.
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


class WorkerCallFailed(Exception):
    """A worker did not answer a call (down, timed out, or refused it)."""

    def __init__(self, worker_id: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"worker {worker_id}: {code.name} {details}")
        self.code = code
        self.details = details

    @property
    def worker_unreachable(self) -> bool:
        """The worker is to be marked dead (see UNREACHABLE), not just this call failed."""
        return self.code in UNREACHABLE

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


# Where a worker's connection is cut in the middle of a write, grpc core ends the call with INTERNAL
# "Internal error from Core" (seen on a step stream in a CI run, session 33) rather than
# UNAVAILABLE: the same loss. A worker's own INTERNAL (a step that failed on it) says otherwise.
_CUT_IN_A_WRITE = "Internal error from Core"


def connection_status(code: grpc.StatusCode, details: str) -> tuple[grpc.StatusCode, str]:
    """A failed worker call's status as the worker's reachability reads it (UNREACHABLE)."""
    if code is grpc.StatusCode.INTERNAL and details.startswith(_CUT_IN_A_WRITE):
        return grpc.StatusCode.UNAVAILABLE, f"the connection was cut under the call (grpc: {details})"
    return code, details


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

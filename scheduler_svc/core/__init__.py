"""The scheduler's pure core: admission, tick-by-tick batching policy, KV bookkeeping, counters.

No grpc, protobuf or sockets here; scheduler_svc.runtime drives it, for the servicer (scheduler_svc.servicer).
"""

from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.plan import DecodeWork, Dropped, PrefillWork, TickOutcome, TickPlan
from scheduler_svc.core.scheduler import SchedulerCore
from scheduler_svc.core.types import (
    AdmissionRejected,
    DropCause,
    FinishReason,
    NotSessionOwner,
    RejectReason,
    Sampling,
    SessionRequest,
    StepResult,
    StepStatus,
    TokenLogprob,
    WorkerSpec,
    WorkloadPolicy,
)

__all__ = [
    "AdmissionRejected",
    "DecodeWork",
    "DropCause",
    "Dropped",
    "FinishReason",
    "NotSessionOwner",
    "PrefillWork",
    "RejectReason",
    "Sampling",
    "SchedulerCore",
    "SchedulerLimits",
    "SessionRequest",
    "StepResult",
    "StepStatus",
    "TickOutcome",
    "TickPlan",
    "TokenLogprob",
    "WorkerSpec",
    "WorkloadPolicy",
]

"""Value types that cross the core's boundary."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from kvfleet_common.records import record


class RejectReason(str, Enum):
    QUEUE_FULL = "queue_full"
    KV_BUDGET = "kv_budget"
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_REQUEST = "invalid_request"
    NO_WORKER = "no_worker"


class AdmissionRejected(Exception):
    """A request the scheduler will not take, with the reason and what the caller should change."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class NotSessionOwner(Exception):
    """A caller asked to act on a session it did not start."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} belongs to another caller")
        self.session_id = session_id


class FinishReason(str, Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    presence_penalty: float = 0.0  # over generated tokens, in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # over generated tokens, in [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # over prompt + generated tokens, > 0; 1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), by id
    logprobs: bool = False  # report each token's log-probability
    top_logprobs: int = 0  # and this many alternatives (needs logprobs)
    constraint: str = ""  # "" | "json_object" | "json_schema" (from response_format)
    constraint_schema: str = ""  # the JSON schema's text (json_schema)


@dataclass(frozen=True)
class SessionRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()  # filled by the adapter unless ignore_eos
    priority: int = 0
    owner: str = ""  # who may cancel it: the caller's identity, as the adapter saw it
    # Sessions of one group share their prompt (the n choices of a Generate): the first computes
    # it, the others are admitted once its prefill is done, and placement sends them where its
    # blocks are (the prefix cache) instead of computing the same prompt n times.
    prefix_group: str = ""
    # Text that ends the session when the output contains it (the output processor watches;
    # the core never reads text).
    stop_strings: tuple[str, ...] = ()
    # The prompt as text when the caller asked for it back (echo): on each choice's first event.
    echo_text: str | None = None

    def choices(self, n: int, group: str) -> tuple[SessionRequest, ...]:
        """The n choices of one request: the same prompt, choice i seeded seed + i (mod 2**64);
        with n > 1 they form prefix group `group`, so the prompt is computed once."""
        if n <= 1:
            return (self,)
        first = replace(self, prefix_group=group)
        return (first,) + tuple(
            replace(first, sampling=replace(self.sampling, seed=(self.sampling.seed + i) % 2**64)) for i in range(1, n)
        )


@dataclass(frozen=True)
class WorkloadPolicy:
    """Per-workload caps; None means the scheduler's own limit."""

    max_running: int | None = None
    prefill_token_budget: int | None = None
    snapshot_at_tick: int = 0


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    capacity_tokens: int  # block_size x num_blocks
    block_size: int
    kv_bytes_per_token: int
    weight_bytes: int = 0
    prefix_caching: bool = True  # whether full blocks of equal prefixes may be shared there

    @property
    def num_blocks(self) -> int:
        return self.capacity_tokens // self.block_size


class StepStatus(str, Enum):
    OK = "ok"
    CACHE_MISS = "cache_miss"  # the worker did not hold the session as the books say (a bug)
    REJECTED = "rejected"  # the worker will not run this session as sent (error says why)
    FAILED = "failed"  # the session's sampling faulted on the worker (error says how)


class DropCause(str, Enum):
    """Why a session was given up on unfinished: what its stream's error says to the caller."""

    UNAVAILABLE = "unavailable"  # the cluster could not run it (no worker, KV lost, moved too often): retry
    REJECTED = "rejected"  # a worker refused it as sent: change the request
    FAILED = "failed"  # it faulted on a worker, alone


@record
class StepResult:
    """What a worker said about one item of a step."""

    session_id: str
    status: StepStatus
    token_id: int | None
    kv_tokens: int
    logprob: float | None = None  # when the session asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    constraint_done: bool = False  # the constraint allows nothing more: finish with STOP
    error: str = ""  # why, for REJECTED and FAILED


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its place."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

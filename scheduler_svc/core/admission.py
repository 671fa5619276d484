"""Whether a request may enter the queue: pure checks that raise AdmissionRejected with the reason
and what the caller should change. Nothing here mutates state; the core counts the rejections."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from scheduler_svc.core.kv_reservations import KvReservations
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.types import AdmissionRejected, RejectReason, Sampling, SessionRequest, WorkloadPolicy

_BAD = RejectReason.INVALID_REQUEST
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
CONSTRAINTS = ("json_object", "json_schema")


@dataclass(frozen=True)
class ModelBounds:
    """What the live workers' model allows (the smallest over all workers); None = not known yet."""

    vocab_size: int | None = None
    max_position: int | None = None

    def merged(self, vocab_size: int, max_position: int) -> "ModelBounds":
        return ModelBounds(
            vocab_size if self.vocab_size is None else min(self.vocab_size, vocab_size),
            max_position if self.max_position is None else min(self.max_position, max_position),
        )


@dataclass(frozen=True)
class WorkloadCaps:
    max_running: int
    prefill_token_budget: int


def _reject(reason: RejectReason, message: str) -> AdmissionRejected:
    return AdmissionRejected(reason, message)


def workload_caps(requests_count: int, policy: WorkloadPolicy, limits: SchedulerLimits) -> WorkloadCaps:
    """A workload's own caps (0 or None = the scheduler's limit; more than the limit is refused)."""
    if requests_count == 0:
        raise _reject(_BAD, "a workload needs at least one session")
    return WorkloadCaps(
        max_running=_cap("max_running", policy.max_running, limits.max_running),
        prefill_token_budget=_cap("prefill_token_budget", policy.prefill_token_budget, limits.prefill_token_budget),
    )


def _cap(name: str, asked: int | None, limit: int) -> int:
    if asked is None or asked == 0:
        return limit
    if asked < 0 or asked > limit:
        raise _reject(_BAD, f"workload {name} {asked} is outside 1..{limit}, the scheduler's limit")
    return asked


def check_request(req: SessionRequest, limits: SchedulerLimits, bounds: ModelBounds, where: str = "") -> None:
    """The request's own shape: prompt, lengths, sampling, priority, token ids, context."""
    if not req.prompt_ids:
        raise _reject(_BAD, f"{where}the prompt is empty; send at least one token")
    if req.max_new_tokens < 1:
        raise _reject(_BAD, f"{where}max_new_tokens must be at least 1, got {req.max_new_tokens}")
    if req.max_new_tokens > limits.max_new_tokens:
        raise _reject(_BAD, f"{where}max_new_tokens {req.max_new_tokens} exceeds the limit {limits.max_new_tokens}")
    s = req.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise _reject(_BAD, f"{where}temperature must be >= 0 (0 = greedy), got {s.temperature}")
    if not math.isfinite(s.top_p) or not 0 < s.top_p <= 1:
        raise _reject(_BAD, f"{where}top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise _reject(_BAD, f"{where}top_k must be >= 0 (0 = off), got {s.top_k}")
    check_sampling(s, bounds, where)
    if abs(req.priority) > limits.max_priority:
        raise _reject(
            _BAD,
            f"{where}priority must be in -{limits.max_priority}..{limits.max_priority} "
            f"(lower runs first, 0 = default), got {req.priority}",
        )
    if bounds.vocab_size is not None:
        out = [t for t in req.prompt_ids if not 0 <= t < bounds.vocab_size]
        if out:
            raise _reject(_BAD, f"{where}prompt token id {out[0]} is outside the vocabulary 0..{bounds.vocab_size - 1}")
    if len(req.prompt_ids) > limits.max_prompt_tokens:
        raise _reject(
            RejectReason.PROMPT_TOO_LONG,
            f"{where}the prompt has {len(req.prompt_ids)} tokens; the limit is {limits.max_prompt_tokens}",
        )
    total = len(req.prompt_ids) + req.max_new_tokens
    if bounds.max_position is not None and total > bounds.max_position:
        raise _reject(
            RejectReason.PROMPT_TOO_LONG,
            f"{where}prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) "
            f"= {total} exceeds the model's context of {bounds.max_position} tokens; "
            f"shorten the prompt or lower max_new_tokens",
        )


def check_sampling(s: Sampling, bounds: ModelBounds, where: str = "") -> None:
    """Penalties, min_p, logit_bias, logprobs and the response format: every value a worker
    would refuse is refused here, naming the field (a worker's refusal fails its whole step)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise _reject(_BAD, f"{where}{name} must be in [-2, 2] (0 = off), got {value}")
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise _reject(_BAD, f"{where}repetition_penalty must be > 0 (1 or 0 = off), got {s.repetition_penalty}")
    if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
        raise _reject(_BAD, f"{where}min_p must be in [0, 1] (0 = off), got {s.min_p}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise _reject(_BAD, f"{where}logit_bias has {len(s.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token, bias in s.logit_bias:
        if token < 0 or (bounds.vocab_size is not None and token >= bounds.vocab_size):
            top = "" if bounds.vocab_size is None else f" 0..{bounds.vocab_size - 1}"
            raise _reject(_BAD, f"{where}logit_bias token id {token} is outside the vocabulary{top}")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise _reject(_BAD, f"{where}logit_bias for token {token} must be in [-100, 100], got {bias}")
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise _reject(_BAD, f"{where}top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {s.top_logprobs}")
    if s.top_logprobs and not s.logprobs:
        raise _reject(_BAD, f"{where}top_logprobs needs logprobs set to true")
    if s.constraint and s.constraint not in CONSTRAINTS:
        raise _reject(
            _BAD, f"{where}response_format.type {s.constraint!r} is not one of 'text', 'json_object', 'json_schema'"
        )
    if s.constraint == "json_schema":
        try:
            schema = json.loads(s.constraint_schema)
        except json.JSONDecodeError as exc:
            raise _reject(_BAD, f"{where}response_format.json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _reject(_BAD, f"{where}response_format.json_schema must be a JSON object (a schema)")
    elif s.constraint_schema:
        raise _reject(_BAD, f"{where}response_format.json_schema is set; it needs response_format.type 'json_schema'")


def check_capacity(req: SessionRequest, kv: KvReservations, where: str = "") -> None:
    """Whether some live worker could ever hold the request's worst-case KV within the budget."""
    if not kv.live:
        raise _reject(RejectReason.NO_WORKER, "no live worker is registered; retry when one is up")
    worst = len(req.prompt_ids) + req.max_new_tokens - 1
    if not kv.could_ever_fit(worst):
        worst_bytes = worst * kv.max_bytes_per_token()
        raise _reject(
            RejectReason.KV_BUDGET,
            f"{where}prompt + max_new_tokens needs up to {worst} tokens of KV "
            f"({worst_bytes} bytes before rounding to whole blocks), more than the KV "
            f"budget ({kv.kv_budget_bytes} bytes) or any worker's cache holds; "
            f"lower max_new_tokens or shorten the prompt",
        )


def check_queue_room(queued: int, arriving: int, limits: SchedulerLimits) -> None:
    if queued + arriving > limits.max_queue_depth:
        raise _reject(
            RejectReason.QUEUE_FULL,
            f"the queue holds {queued} of {limits.max_queue_depth} sessions and cannot "
            f"take {arriving} more; retry later or send fewer",
        )


def check_caller_room(queued: int, arriving: int, caller: str, limits: SchedulerLimits) -> None:
    """One caller's share of the queue (max_queued_per_caller), so others still find room."""
    if queued + arriving > limits.max_queued_per_caller:
        who = "anonymous callers (no token, no certificate)" if not caller else "this caller"
        raise _reject(
            RejectReason.QUEUE_FULL,
            f"{who} already {'have' if not caller else 'has'} {queued} sessions queued and cannot add {arriving}: "
            f"max_queued_per_caller is {limits.max_queued_per_caller} (--max-queued-per-caller); "
            f"wait for some to start, or send fewer at once",
        )

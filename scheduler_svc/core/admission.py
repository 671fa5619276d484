"""Whether a request may enter the queue: pure checks that raise AdmissionRejected with the reason
and what the caller should change. Nothing here mutates state; the core counts the rejections."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_common import sampling_rules
from kvfleet_common.sampling_rules import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS  # the cheap checks' limit too
from scheduler_svc.core.kv_reservations import KvReservations
from scheduler_svc.core.limits import SchedulerLimits
from scheduler_svc.core.types import AdmissionRejected, RejectReason, Sampling, SessionRequest, WorkloadPolicy

_BAD = RejectReason.INVALID_REQUEST


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
    check_sampling(req.sampling, bounds, where)
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
        # An id the model can never sample would never stop anything: a mistake, said so.
        out = sorted(t for t in req.stop_token_ids if not 0 <= t < bounds.vocab_size)
        if out:
            raise _reject(_BAD, f"{where}stop token id {out[0]} is outside the vocabulary 0..{bounds.vocab_size - 1}")
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
    """The sampling rules every layer applies (kvfleet_common.sampling_rules), with the live
    vocabulary: every value a worker would refuse is refused here, naming the field as the
    request does (a worker's refusal fails its whole step)."""
    try:
        sampling_rules.validate(s, bounds.vocab_size)
    except sampling_rules.SamplingRuleError as exc:
        raise _reject(_BAD, where + exc.named(sampling_rules.REQUEST_NAMES)) from None


def check_capacity(req: SessionRequest, kv: KvReservations, where: str = "") -> None:
    """Whether some live worker could ever hold the request's worst-case KV within the budget."""
    if not kv.live:
        raise _reject(RejectReason.NO_WORKER, "no live worker is registered; retry when one is up")
    worst = len(req.prompt_ids) + req.max_new_tokens - 1
    if not kv.could_ever_fit(worst):
        worst_bytes = worst * kv.max_bytes_per_token()
        budget = f"the KV budget ({kv.kv_budget_bytes} bytes) or " if kv.kv_budget_bytes else ""
        raise _reject(
            RejectReason.KV_BUDGET,
            f"{where}prompt + max_new_tokens needs up to {worst} tokens of KV "
            f"({worst_bytes} bytes before rounding to whole blocks), more than {budget}any "
            f"worker's cache holds; lower max_new_tokens or shorten the prompt",
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

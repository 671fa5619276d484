"""Protobuf <-> core value conversion for the scheduler (core types never see pb)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet_common.sampling_rules import unset_to_off
from scheduler_svc.core import (
    DecodeWork,
    FinishReason,
    PrefillWork,
    Sampling,
    SessionRequest,
    StepResult,
    StepStatus,
    WorkloadPolicy,
)
from scheduler_svc.core.stats import TelemetrySnapshot, WorkloadStats
from scheduler_svc.experiments import ExperimentArm

if TYPE_CHECKING:  # (each imports this module, or one that does)
    from scheduler_svc.output import LogprobText
    from scheduler_svc.streams import SessionEvent
    from scheduler_svc.workers import WorkerView

ARCHITECTURE = "llama"  # the one model family the workers run (worker_svc/model/llama.py)

FINISH_TO_PB = {
    FinishReason.LENGTH: spb.FINISH_LENGTH,
    FinishReason.EOS: spb.FINISH_EOS,
    FinishReason.STOP: spb.FINISH_STOP,
    FinishReason.CANCELLED: spb.FINISH_CANCELLED,
}
_STATUS = {
    wpb.ITEM_OK: StepStatus.OK,
    wpb.ITEM_CACHE_MISS: StepStatus.CACHE_MISS,
    wpb.ITEM_REJECTED: StepStatus.REJECTED,
    wpb.ITEM_FAILED: StepStatus.FAILED,
}


def sampling_from_pb(s: spb.SamplingParams) -> Sampling:
    """The SamplingParams alone (no logprobs, no constraint: see `sampling_from_request`)."""
    top_p, repetition_penalty = unset_to_off(s.top_p, s.repetition_penalty)
    return Sampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=top_p,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=repetition_penalty,
        min_p=s.min_p,
        logit_bias=tuple(sorted(s.logit_bias.items())),
    )


def sampling_from_request(req: spb.GenerateRequest) -> Sampling:
    """A GenerateRequest's sampling: its SamplingParams, logprobs and response_format. The
    values are checked at admission (core/admission.py), which names the field to fix."""
    kind = req.response_format.type
    return replace(
        sampling_from_pb(req.sampling),
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        constraint="" if kind in ("", "text") else kind,
        constraint_schema=req.response_format.json_schema,
    )


@functools.lru_cache(maxsize=4096)  # per distinct sampling, not per item per tick (read-only)
def _sampling_to_wpb(s: Sampling) -> wpb.Sampling:
    return wpb.Sampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias),
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        constraint=s.constraint,
        constraint_schema=s.constraint_schema,
    )


def arm_from_pb(req: spb.WorkloadRequest) -> ExperimentArm | None:
    """The workload's experiment arm (None: no experiment); ValueError for one out of the rules."""
    if not req.HasField("experiment"):
        return None
    return ExperimentArm(req.experiment.id, req.experiment.arm, req.experiment.lever)


def policy_from_pb(req: spb.WorkloadRequest) -> WorkloadPolicy:
    return WorkloadPolicy(
        max_running=req.policy.max_running or None,
        prefill_token_budget=req.policy.prefill_token_budget or None,
        snapshot_at_tick=req.snapshot_at_tick,
    )


def step_request(prefill: Sequence[PrefillWork], decode: Sequence[DecodeWork]) -> wpb.StepRequest:
    req = wpb.StepRequest(result_columns=True)  # the answer as columns: see step_results
    for p in prefill:
        req.prefill.add(
            session_id=p.session_id,
            token_ids=p.token_ids,
            start_position=p.start_position,
            last_chunk=p.last_chunk,
            sampling=_sampling_to_wpb(p.sampling),
            generated_so_far=p.generated_so_far,
            block_ids=p.block_ids,
            cached_tokens=p.cached_tokens,
        )
    if decode:  # as columns (DecodeColumns): at 64 items a fraction of the messages' cost
        index: dict[Sampling, int] = {}  # a step has few distinct samplings: each sent once
        which = []
        for d in decode:
            k = index.get(d.sampling)
            if k is None:
                k = index[d.sampling] = len(index)
                req.samplings.append(_sampling_to_wpb(d.sampling))
            which.append(k)
        cols = req.decode_columns
        cols.session_ids.extend([d.session_id for d in decode])
        cols.token_ids.extend([d.token_id for d in decode])
        cols.positions.extend([d.position for d in decode])
        cols.generated_so_far.extend([d.generated_so_far for d in decode])
        cols.last_sampled.extend([d.last_sampled for d in decode])
        cols.sampling.extend(which)
        if any(d.block_ids for d in decode):
            cols.block_counts.extend([len(d.block_ids) for d in decode])
            cols.block_ids.extend([b for d in decode for b in d.block_ids])
    return req


def step_results(resp: wpb.StepResponse) -> dict[str, StepResult]:
    """A step's results by session, from its columns (the worker answers so when asked, as
    step_request asks) or its ItemResult messages. ValueError: columns that do not line up."""
    if resp.HasField("columns"):
        return _from_columns(resp.columns)
    return {
        r.session_id: StepResult(
            session_id=r.session_id,
            status=_STATUS.get(r.status, StepStatus.CACHE_MISS),
            token_id=r.token_id if r.has_token else None,
            kv_tokens=r.kv_tokens,
            logprob=r.logprob if r.has_logprob else None,
            top_logprobs=tuple((t.token_id, t.logprob) for t in r.top_logprobs) if r.top_logprobs else (),
            constraint_done=r.constraint_done,
            error=r.error,
        )
        for r in resp.results
    }


def _from_columns(c: wpb.ResultColumns) -> dict[str, StepResult]:
    ids = list(c.session_ids)
    n = len(ids)
    if not (len(c.statuses) == len(c.token_ids) == len(c.kv_tokens) == n):
        raise ValueError(
            f"the step's result columns do not line up: {n} session ids, {len(c.statuses)} statuses, "
            f"{len(c.token_ids)} token ids, {len(c.kv_tokens)} kv_tokens"
        )
    miss = StepStatus.CACHE_MISS  # a status this scheduler does not know (a newer worker's)
    out = {
        sid: StepResult(sid, _STATUS.get(st, miss), tok if tok >= 0 else None, kv)
        for sid, st, tok, kv in zip(ids, c.statuses, c.token_ids, c.kv_tokens)
    }
    for e in c.extras:
        if e.index >= n:
            raise ValueError(f"a result extra names result {e.index} of {n}")
        sid = ids[e.index]
        out[sid] = replace(
            out[sid],
            logprob=e.logprob if e.has_logprob else None,
            top_logprobs=tuple((t.token_id, t.logprob) for t in e.top_logprobs),
            constraint_done=e.constraint_done,
            error=e.error,
        )
    return out


def snapshot_to_pb(s: TelemetrySnapshot) -> spb.TelemetrySnapshot:
    return spb.TelemetrySnapshot(**{k: v for k, v in s.__dict__.items()})


def workload_stats_to_pb(s: WorkloadStats) -> spb.WorkloadStats:
    return spb.WorkloadStats(**s.__dict__)


def fill_event(
    msg: spb.GenerateEvent, batch: Iterable[SessionEvent], first: SessionRequest | None = None, prompt_ids: bool = False
) -> bool:
    """One session's batch of events as one message; whether the session finished. `first`:
    the session's request, when this is its first message, which carries the prompt's text
    (when echo asked for it) and, with `prompt_ids`, its ids."""
    if first is not None:
        if prompt_ids:
            msg.prompt_token_ids.extend(first.prompt_ids)
        if first.echo_text is not None:
            msg.prompt_text = first.echo_text
    finished = False
    for ev in batch:
        if ev.token is not None:
            msg.token_ids.append(ev.token)
            if ev.logprob is not None:
                msg.logprobs.append(logprob_to_pb(ev.logprob))
        msg.text += ev.text
        if ev.finish is not None:
            finished = True
            msg.finished = True
            msg.finish_reason = FINISH_TO_PB[ev.finish]
            if ev.usage is not None:
                u = ev.usage
                msg.usage.input_tokens, msg.usage.output_tokens, msg.usage.cached_tokens = (
                    u.input_tokens,
                    u.output_tokens,
                    u.cached_tokens,
                )
    if ev.worker_id:
        msg.worker_id = ev.worker_id
    return finished


def logprob_to_pb(lp: LogprobText) -> spb.TokenLogprob:
    return spb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        text=lp.text,
        top=[spb.TopLogprob(token_id=t, logprob=v, text=text) for t, v, text in lp.top],
    )


def add_worker_pb(resp: spb.ListWorkersResponse, view: WorkerView) -> None:
    """One worker's entry in ListWorkers (its address alone until it has answered GetInfo)."""
    info = view.client.info
    if info is None:
        resp.workers.add(address=view.client.address, live=False)
        return
    resp.workers.add(
        worker_id=info.worker_id,
        address=view.client.address,
        live=view.live,
        model=info.model.name,
        device=info.device,
        dtype=info.dtype,
        quant=info.quant or "none",
        kernels=info.kernels,
        kv_dtype=info.kv_dtype,
        sessions=view.sessions,
        kv_tokens=view.kv_tokens,
        kv_capacity_tokens=info.kv_capacity_tokens,
        reserved_tokens=view.reserved_tokens,
        vocab_size=info.model.vocab_size,
        weight_bytes=info.weight_bytes,
        kv_bytes_per_token=info.kv_bytes_per_token,
        rss_bytes=view.rss_bytes,
        private_bytes=view.private_bytes,
        step_ms=round(view.step_ms, 3),
    )


def model_info_to_pb(
    info: wpb.WorkerInfo,
    model_id: str,
    tokenizer: Any,
    eos_token_ids: Iterable[int],
    supports_tools: bool,
    version: str,
    max_model_len: int,
) -> spb.ModelInfo:
    """GetModelInfo: the served model as a worker reported it, with the scheduler's tokenizer;
    max_model_len: the context every worker serves (the admission bound)."""
    msg = spb.ModelInfo(
        model_id=model_id,
        architecture=ARCHITECTURE,
        max_context_length=max_model_len,
        vocab_size=info.model.vocab_size,
        eos_token_ids=sorted(eos_token_ids),
        dtype=info.dtype,
        quant=info.quant or "none",
        version=version,
        chat_template=bool(tokenizer is not None and tokenizer.chat_template),
        supports_tools=supports_tools,
        max_model_len=max_model_len,
        # a worker from before the field reports 0: its max_position was the model's
        model_max_position=info.model.model_max_position or info.model.max_position,
        kv_block_size=info.block_size,
        kv_num_blocks=info.num_blocks,
        kv_capacity_tokens=info.kv_capacity_tokens,
        kv_bytes_per_token=info.kv_bytes_per_token,
        kv_pool_bytes=info.kv_capacity_tokens * info.kv_bytes_per_token,
    )
    if tokenizer is not None:
        if tokenizer.bos_token_id is not None:
            msg.bos_token_id = tokenizer.bos_token_id
        msg.special_token_ids.update(tokenizer.special_tokens())
    return msg

"""Protobuf <-> core value conversion for the scheduler (core types never see pb)."""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import worker_pb2 as wpb
from scheduler_svc.core import (
    DecodeWork,
    FinishReason,
    PrefillWork,
    Sampling,
    StepResult,
    StepStatus,
    WorkloadPolicy,
)
from scheduler_svc.core.stats import TelemetrySnapshot, WorkloadStats

FINISH_TO_PB = {
    FinishReason.LENGTH: spb.FINISH_LENGTH,
    FinishReason.EOS: spb.FINISH_EOS,
    FinishReason.STOP: spb.FINISH_STOP,
    FinishReason.CANCELLED: spb.FINISH_CANCELLED,
}
_STATUS = {
    wpb.ITEM_OK: StepStatus.OK,
    wpb.ITEM_CACHE_MISS: StepStatus.CACHE_MISS,
    wpb.ITEM_OUT_OF_BLOCKS: StepStatus.OUT_OF_BLOCKS,
}


def sampling_from_pb(s: spb.SamplingParams) -> Sampling:
    # proto3 cannot tell an unset top_p from 0; 0 means "off", i.e. 1.
    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=1.0 if s.top_p == 0 else s.top_p, seed=s.seed)


def _sampling_to_wpb(s: Sampling) -> wpb.Sampling:
    return wpb.Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)


def policy_from_pb(req: spb.WorkloadRequest) -> WorkloadPolicy:
    return WorkloadPolicy(
        max_running=req.policy.max_running or None,
        prefill_token_budget=req.policy.prefill_token_budget or None,
        snapshot_at_tick=req.snapshot_at_tick,
    )


def step_request(prefill: Sequence[PrefillWork], decode: Sequence[DecodeWork]) -> wpb.StepRequest:
    req = wpb.StepRequest()
    for p in prefill:
        req.prefill.add(
            session_id=p.session_id,
            token_ids=p.token_ids,
            start_position=p.start_position,
            last_chunk=p.last_chunk,
            sampling=_sampling_to_wpb(p.sampling),
            generated_so_far=p.generated_so_far,
        )
    for d in decode:
        req.decode.add(
            session_id=d.session_id,
            token_id=d.token_id,
            position=d.position,
            sampling=_sampling_to_wpb(d.sampling),
            generated_so_far=d.generated_so_far,
        )
    return req


def step_results(resp: wpb.StepResponse) -> dict[str, StepResult]:
    return {
        r.session_id: StepResult(
            session_id=r.session_id,
            status=_STATUS.get(r.status, StepStatus.CACHE_MISS),
            token_id=r.token_id if r.has_token else None,
            kv_tokens=r.kv_tokens,
        )
        for r in resp.results
    }


def snapshot_to_pb(s: TelemetrySnapshot) -> spb.TelemetrySnapshot:
    return spb.TelemetrySnapshot(**{k: v for k, v in s.__dict__.items()})


def workload_stats_to_pb(s: WorkloadStats) -> spb.WorkloadStats:
    return spb.WorkloadStats(**s.__dict__)

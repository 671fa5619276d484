"""A small synchronous client of the scheduler's gRPC API."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvfleet_common import grpcutil
from kvfleet_common.security import TlsConfig, channel, token_metadata
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc


@dataclass
class Completion:
    session_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    worker_id: str = ""


def finish_name(value: int) -> str:
    return spb.FinishReason.Name(value).removeprefix("FINISH_").lower()


def build_request(prompt: str | Sequence[int] | list[dict], max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  stop_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                  ignore_eos: bool = False) -> spb.GenerateRequest:
    req = spb.GenerateRequest(max_new_tokens=max_new_tokens,
                              sampling=spb.SamplingParams(temperature=temperature, top_k=top_k,
                                                          top_p=top_p, seed=seed),
                              stop_token_ids=list(stop_token_ids), stop=list(stop), ignore_eos=ignore_eos)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(spb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)  # type: ignore[index]
    else:
        req.prompt_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return req


class SchedulerClient:
    def __init__(self, address: str, tls: TlsConfig | None = None, token: str | None = None) -> None:
        """TLS and the bearer token default to KVFLEET_TLS_* and KVFLEET_API_TOKEN (kvfleet_common.security)."""
        self.address = address
        self._channel = channel(address, tls, options=grpcutil.CHANNEL_OPTIONS)
        self.stub = spb_grpc.SchedulerStub(self._channel)
        self._md = tuple(token_metadata(token))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SchedulerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, request: spb.GenerateRequest, timeout: float | None = None) -> Iterator[spb.GenerateEvent]:
        return self.stub.Generate(request, timeout=timeout, metadata=self._md)

    def generate(self, request: spb.GenerateRequest, timeout: float | None = None) -> Completion:
        result: Completion | None = None
        for ev in self.stream(request, timeout):
            if result is None:
                result = Completion(session_id=ev.session_id, prompt_token_ids=list(ev.prompt_token_ids))
            result.token_ids.extend(ev.token_ids)
            result.text += ev.text
            result.worker_id = ev.worker_id or result.worker_id
            if ev.finished:
                result.finish_reason = finish_name(ev.finish_reason)
        assert result is not None, "the scheduler closed the stream without an event"
        return result

    def submit_workload(self, request: spb.WorkloadRequest, timeout: float | None = None) -> Iterator[spb.WorkloadEvent]:
        return self.stub.SubmitWorkload(request, timeout=timeout, metadata=self._md)

    def telemetry(self, workload_id: str = "", at_tick: int = 0, timeout: float | None = 30.0) -> spb.TelemetrySnapshot:
        return self.stub.GetTelemetry(spb.TelemetryRequest(workload_id=workload_id, at_tick=at_tick),
                                      timeout=timeout, metadata=self._md)

    def telemetry_future(self, workload_id: str, at_tick: int, timeout: float = 60.0):
        return self.stub.GetTelemetry.future(spb.TelemetryRequest(workload_id=workload_id, at_tick=at_tick),
                                             timeout=timeout, metadata=self._md)

    def cancel(self, session_id: str) -> spb.CancelResponse:
        return self.stub.Cancel(spb.CancelRequest(session_id=session_id), timeout=10, metadata=self._md)

    def list_workers(self) -> list[spb.WorkerState]:
        return list(self.stub.ListWorkers(spb.ListWorkersRequest(), timeout=10, metadata=self._md).workers)

"""A small synchronous client of the scheduler's gRPC API, which rides out a scheduler restart.

`events()` (and `generate()`, built on it) retries a session that failed with UNAVAILABLE while
the scheduler was unreachable or restarting, with backoff and a bounded number of attempts:
- before any event arrived nothing was generated for the client, so sending it again is idempotent;
- after some events, a greedy (temperature 0) or seeded session is sent again and the tokens
  already delivered are skipped; the output is deterministic, so the result is token-exact, and
  the skipped tokens are checked against the delivered ones (`ResumeMismatch` if they differ).
A scheduler that answers its health check with NOT_SERVING is draining: its UNAVAILABLE is final,
and so is an UNAVAILABLE before any event from one that is up (its own refusal, e.g. no live worker).
`stream()` is the raw single call (cancellable), with no retry.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.security import TlsConfig, channel, token_metadata

log = logging.getLogger(__name__)


@dataclass
class Completion:
    session_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    worker_id: str = ""
    prompt_text: str = ""  # with echo
    request_id: str = ""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8  # calls in all, the first included (1 = never retry)
    first_backoff_s: float = 0.25  # doubled after each failed attempt ...
    max_backoff_s: float = 4.0  # ... up to this
    probe_timeout_s: float = 1.0  # the health check that tells a refusal from an outage

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < first_backoff_s <= max_backoff_s")

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait after the failures-th failed attempt (1-based)."""
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (failures - 1))


NO_RETRY = RetryPolicy(attempts=1)


class ResumeMismatch(RuntimeError):
    """A resumed session did not reproduce the tokens already delivered (not deterministic)."""


def not_grpc(exc: grpc.RpcError) -> bool:
    """The address answered, but not in gRPC (an HTTP/1 server, such as the gateway's OpenAI
    API): grpc's UNAVAILABLE then says its first frame was no HTTP/2 one. Retrying cannot help."""
    details = str(exc.details() or "")  # type: ignore[attr-defined]
    return "Failed parsing HTTP/2" in details or "Expected SETTINGS frame" in details


def resumable(request: spb.GenerateRequest) -> bool:
    """Greedy or explicitly seeded output is the same on every run, so it can be regenerated.
    Not for n > 1: the choices' events interleave, and resuming splices one stream."""
    return request.n <= 1 and (request.sampling.temperature == 0 or request.sampling.seed != 0)


def finish_name(value: int) -> str:
    return spb.FinishReason.Name(value).removeprefix("FINISH_").lower()


def build_request(
    prompt: str | Sequence[int] | list[dict],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    n: int = 1,
    echo: bool = False,
    tools_json: str = "",
) -> spb.GenerateRequest:
    """A GenerateRequest for text, token ids or chat messages (dicts with role and content, and
    optionally tool_call_id, and tool_calls as a list or as JSON text)."""
    req = spb.GenerateRequest(
        max_new_tokens=max_new_tokens,
        sampling=spb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
        stop_token_ids=list(stop_token_ids),
        stop=list(stop),
        ignore_eos=ignore_eos,
        request_id=request_id,
        n=n,
        echo=echo,
        tools_json=tools_json,
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(_chat_message(m) for m in prompt)  # type: ignore[arg-type]
    else:
        req.prompt_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return req


def _chat_message(m: dict) -> spb.ChatMessage:
    calls = m.get("tool_calls") or ""
    return spb.ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        tool_call_id=m.get("tool_call_id") or "",
        tool_calls_json=calls if isinstance(calls, str) else json.dumps(calls),
    )


class _Splice:
    """Drops the part of a re-sent session's events that the caller already has, checking that
    the tokens are the same (they are, for deterministic output) so the joined stream is exact."""

    def __init__(self, tokens: list[int], text_len: int) -> None:
        self._tokens = list(tokens)
        self._pos = 0  # tokens of the re-sent session matched so far
        self._text_left = text_len  # characters of its text still to drop

    def trim(self, ev: spb.GenerateEvent) -> spb.GenerateEvent | None:
        """The event's new part; None when nothing in it is new."""
        ids = list(ev.token_ids)
        n = min(len(ids), len(self._tokens) - self._pos)
        if ids[:n] != self._tokens[self._pos : self._pos + n] or (ev.finished and self._pos + n < len(self._tokens)):
            raise ResumeMismatch(
                f"session re-sent after an outage diverged from the {len(self._tokens)} "
                f"tokens already delivered (at token {self._pos})"
            )
        self._pos += n
        t = min(len(ev.text), self._text_left)
        self._text_left -= t
        out = spb.GenerateEvent()
        out.CopyFrom(ev)
        del out.token_ids[:n]
        out.text = ev.text[t:]
        out.ClearField("prompt_token_ids")  # the caller had them with its first event
        out.ClearField("prompt_text")
        if not (out.token_ids or out.text or out.finished):
            return None
        return out


def _unbatched(events: Iterator[spb.WorkloadEvent]) -> Iterator[spb.WorkloadEvent]:
    """A workload's events one by one, each batch (WorkloadEvent.batch) unpacked in order."""
    for ev in events:
        if ev.batch:
            yield from ev.batch
        else:
            yield ev


class SchedulerClient:
    def __init__(
        self,
        address: str,
        tls: TlsConfig | None = None,
        token: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """TLS and the bearer token default to KVFLEET_TLS_* and KVFLEET_API_TOKEN (kvfleet_common.security)."""
        self.address = address
        self.retry = retry
        self._sleep = sleep
        self._channel = channel(address, tls, options=grpcutil.CHANNEL_OPTIONS)
        self.stub = spb_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._md = tuple(token_metadata(token))
        self.retries = 0  # attempts re-sent by events(), for callers and tests

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "SchedulerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, request: spb.GenerateRequest, timeout: float | None = None) -> Iterator[spb.GenerateEvent]:
        return self.stub.Generate(request, timeout=timeout, metadata=self._md)

    def events(self, request: spb.GenerateRequest, timeout: float | None = None) -> Iterator[spb.GenerateEvent]:
        """The session's events, as `stream()` gives them, across scheduler restarts (see the
        module docstring). `timeout` bounds the whole session, retries included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delivered: list[int] = []  # tokens the caller already has
        text_len = 0  # characters of text the caller already has
        started = False  # the caller has had an event
        failures = 0
        while True:
            splice = _Splice(delivered, text_len) if started else None
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self.stub.Generate(request, timeout=remaining, metadata=self._md)  # stream(), cancellable
            try:
                for ev in call:
                    if splice is not None:
                        trimmed = splice.trim(ev)
                        if trimmed is None:
                            continue
                        ev = trimmed
                    started = True
                    delivered.extend(ev.token_ids)
                    text_len += len(ev.text)
                    yield ev
                return
            except grpc.RpcError as exc:
                failures += 1
                if not self._should_retry(exc, request, started, failures, deadline):
                    raise
                wait = self.retry.backoff_s(failures)
                # Said as it happens (the CLI shows it on stderr): by default the attempts take about 16 s.
                log.warning(
                    "the scheduler at %s is unreachable (%s); trying again in %g s (attempt %d of %d)",
                    self.address,
                    exc.code().name,  # type: ignore[attr-defined]
                    wait,
                    failures + 1,
                    self.retry.attempts,
                )
                self._sleep(wait)
                self.retries += 1
            finally:
                call.cancel()  # a no-op once it ended; frees the session if the caller stopped early

    def _should_retry(
        self, exc: grpc.RpcError, request: spb.GenerateRequest, started: bool, failures: int, deadline: float | None
    ) -> bool:
        if exc.code() != grpc.StatusCode.UNAVAILABLE or failures >= self.retry.attempts:  # type: ignore[attr-defined]
            return False
        if not_grpc(exc):
            return False
        if started and not resumable(request):
            return False  # a fresh sampling would not continue what the caller has
        if deadline is not None and time.monotonic() + self.retry.backoff_s(failures) >= deadline:
            return False
        state = self._probe()
        if state == health_pb2.HealthCheckResponse.NOT_SERVING:
            return False  # draining: it said "retry against another scheduler"
        # Up and serving, and the session never started: that UNAVAILABLE was its own refusal
        # (no live worker, after waiting for one). Unreachable: it died or restarts; try again.
        return not (state == health_pb2.HealthCheckResponse.SERVING and not started)

    def _probe(self) -> int:
        """The scheduler's health status, or UNKNOWN when it does not answer."""
        try:
            return self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=self.retry.probe_timeout_s, metadata=self._md
            ).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN

    def generate(
        self,
        request: spb.GenerateRequest,
        timeout: float | None = None,
        on_event: Callable[[spb.GenerateEvent], None] | None = None,
    ) -> Completion:
        """The whole session; on_event sees each event as it arrives (e.g. to print a stream).
        One choice only: for n > 1 use `choices()`."""
        if request.n > 1:
            raise ValueError(f"generate() returns one completion; for n={request.n} use choices()")
        result: Completion | None = None
        for ev in self.events(request, timeout):
            if on_event is not None:
                on_event(ev)
            if result is None:
                result = Completion(
                    session_id=ev.session_id,
                    prompt_token_ids=list(ev.prompt_token_ids),
                    prompt_text=ev.prompt_text,
                    request_id=ev.request_id,
                )
            result.session_id = ev.session_id  # a new one if the session was re-sent
            result.token_ids.extend(ev.token_ids)
            result.text += ev.text
            result.worker_id = ev.worker_id or result.worker_id
            if ev.finished:
                result.finish_reason = finish_name(ev.finish_reason)
        assert result is not None, "the scheduler closed the stream without an event"
        return result

    def choices(self, request: spb.GenerateRequest, timeout: float | None = None) -> list[Completion]:
        """Every choice of an n >= 1 request, by index (no resume across a scheduler restart)."""
        out: dict[int, Completion] = {}
        for ev in self.stream(request, timeout):
            c = out.get(ev.index)
            if c is None:
                c = out[ev.index] = Completion(
                    session_id=ev.session_id,
                    prompt_token_ids=list(ev.prompt_token_ids),
                    prompt_text=ev.prompt_text,
                    request_id=ev.request_id,
                )
            c.token_ids.extend(ev.token_ids)
            c.text += ev.text
            c.worker_id = ev.worker_id or c.worker_id
            if ev.finished:
                c.finish_reason = finish_name(ev.finish_reason)
        return [out[i] for i in sorted(out)]

    def model_info(self, timeout: float | None = 10.0) -> spb.ModelInfo:
        return self.stub.GetModelInfo(spb.ModelInfoRequest(), timeout=timeout, metadata=self._md)

    def tokenize(
        self, prompt: str | list[dict], add_special_tokens: bool = False, timeout: float | None = 30.0
    ) -> spb.TokenizeResponse:
        """Token ids of text, or of chat messages rendered by the model's chat template."""
        req = spb.TokenizeRequest(add_special_tokens=add_special_tokens)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.chat.messages.extend(_chat_message(m) for m in prompt)
        return self.stub.Tokenize(req, timeout=timeout, metadata=self._md)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False, timeout: float | None = 30.0) -> str:
        req = spb.DetokenizeRequest(token_ids=list(ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, timeout=timeout, metadata=self._md).text

    def submit_workload(
        self, request: spb.WorkloadRequest, timeout: float | None = None
    ) -> Iterator[spb.WorkloadEvent]:
        """The workload's events one by one. They are asked for in batches (a tick's events in
        one message: WorkloadRequest.batch_events, far cheaper for the scheduler) and unpacked."""
        batched = spb.WorkloadRequest()
        batched.CopyFrom(request)
        batched.batch_events = True
        return _unbatched(self.stub.SubmitWorkload(batched, timeout=timeout, metadata=self._md))

    def telemetry(self, workload_id: str = "", at_tick: int = 0, timeout: float | None = 30.0) -> spb.TelemetrySnapshot:
        return self.stub.GetTelemetry(
            spb.TelemetryRequest(workload_id=workload_id, at_tick=at_tick), timeout=timeout, metadata=self._md
        )

    def telemetry_future(self, workload_id: str, at_tick: int, timeout: float = 60.0):
        return self.stub.GetTelemetry.future(
            spb.TelemetryRequest(workload_id=workload_id, at_tick=at_tick), timeout=timeout, metadata=self._md
        )

    def cancel(self, session_id: str) -> spb.CancelResponse:
        return self.stub.Cancel(spb.CancelRequest(session_id=session_id), timeout=10, metadata=self._md)

    def list_workers(self) -> list[spb.WorkerState]:
        return list(self.stub.ListWorkers(spb.ListWorkersRequest(), timeout=10, metadata=self._md).workers)

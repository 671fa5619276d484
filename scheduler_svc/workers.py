"""gRPC clients of the workers the scheduler dispatches to: typed calls in core values, with the
tick's trace context carried in the metadata."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span

from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.security import TlsConfig, aio_channel, worker_secret_metadata
from kvfleet_common.tracing import inject_metadata
from scheduler_svc import convert
from scheduler_svc.core import DecodeWork, PrefillWork, StepResult, WorkerSpec
from scheduler_svc.core.served_model import ServedModel
from scheduler_svc.experiments import ExperimentArm
from scheduler_svc.step_stream import StepStream
from scheduler_svc.worker_errors import WorkerCallFailed, connection_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldSessions:
    """What a worker says it holds (GetStats)."""

    sessions: int
    used_blocks: int
    free_blocks: int
    rss_bytes: int = 0  # the worker process's resident memory
    private_bytes: int = 0  # of which its own (RSS less shared library pages)
    instance_id: str = ""  # the instance that answered ("" from a worker from before the field)


@dataclass(frozen=True)
class WorkerView:
    """One worker as ListWorkers shows it."""

    client: WorkerClient
    live: bool
    sessions: int
    kv_tokens: int
    reserved_tokens: int
    rss_bytes: int = 0  # as the worker last reported it (0: not yet)
    private_bytes: int = 0  # the same, its own part
    step_ms: float = 0.0  # the median of its last steps' times (0: none timed yet)


@dataclass
class WorkerClient:
    address: str
    channel: grpc.aio.Channel
    stub: wpb_grpc.WorkerStub
    info: wpb.WorkerInfo | None = None
    # The scheduler<->worker secret (KVFLEET_WORKER_SECRET) as metadata, sent on every call.
    auth: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # The next step tells the worker to forget every session: the scheduler's books for it
    # start empty (at start-up, and when a worker marked dead is taken back).
    reset_pending: bool = True
    # The number of the last step sent (StepRequest.seq): the worker runs them in this order,
    # since a step may go out before the last one answered (overlapped scheduling). It starts at
    # the client's creation time in microseconds, above any number an earlier scheduler process
    # sent, and only rises (see worker_svc.step_order).
    sent_steps: int = field(default_factory=lambda: time.time_ns() // 1000)
    # Steps go over one StepStream when the worker serves it (WorkerInfo.step_stream), else as
    # Step calls; the stream is opened by the first step and again after it broke.
    stream_steps: bool = True
    # The time on the worker of its last answered step with items (StepResponse.step_ns), until
    # the fleet takes it for placement (0: none since).
    step_ns: int = 0
    # A stream older than this is retired for a new one at the next step: the worker's server
    # cuts a connection's streams MAX_STREAM_S after its age (see step_stream).
    stream_max_age_s: float = grpcutil.MAX_STREAM_S / 12
    _stream: StepStream | None = field(default=None, repr=False)
    _retired: set[StepStream] = field(default_factory=set, repr=False)  # still answering

    @classmethod
    def open(
        cls, address: str, tls: TlsConfig | None = None, secret: str = "", stream_steps: bool = True
    ) -> "WorkerClient":
        channel = aio_channel(address, tls or TlsConfig(), options=grpcutil.CHANNEL_OPTIONS)
        return cls(
            address=address,
            channel=channel,
            stub=wpb_grpc.WorkerStub(channel),
            auth=tuple(worker_secret_metadata(secret)),
            stream_steps=stream_steps,
        )

    @property
    def worker_id(self) -> str:
        assert self.info is not None
        return self.info.worker_id

    def spec(self) -> WorkerSpec:
        assert self.info is not None
        i = self.info
        return WorkerSpec(
            worker_id=i.worker_id,
            capacity_tokens=i.kv_capacity_tokens,
            block_size=i.block_size,
            kv_bytes_per_token=i.kv_bytes_per_token,
            weight_bytes=i.weight_bytes,
            prefix_caching=i.prefix_caching,
        )

    def served_model(self) -> ServedModel:
        """The model this worker said it serves, as the core compares workers' models."""
        assert self.info is not None
        m = self.info.model
        return ServedModel(
            name=m.name,
            vocab_size=m.vocab_size,
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.intermediate_size,
            # a worker from before the field reports 0: its max_position was the model's
            model_max_position=m.model_max_position or m.max_position,
            eos_token_ids=tuple(sorted(m.eos_token_ids)),
        )

    async def fetch_info(self, timeout: float = 5.0) -> wpb.WorkerInfo:
        self.info = await self.stub.GetInfo(wpb.GetInfoRequest(), timeout=timeout, metadata=self.auth)
        return self.info

    async def answers(self, timeout: float) -> bool:
        """Whether the worker answers GetInfo now (a dead one probed for its return)."""
        try:
            await self.fetch_info(timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def wait_ready(self, deadline_s: float) -> wpb.WorkerInfo:
        """Retry GetInfo until the worker answers or the deadline passes."""
        end = time.monotonic() + deadline_s
        delay = 0.1
        while True:
            try:
                return await self.fetch_info()
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() + delay > end:
                    raise ConnectionError(
                        f"worker at {self.address} did not answer within "
                        f"{deadline_s:.0f}s: {exc.code().name} {exc.details()}"
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def step(
        self,
        prefill: Sequence[PrefillWork],
        decode: Sequence[DecodeWork],
        release: Sequence[str],
        arm: ExperimentArm | None,
        span: Span | None,
        timeout: float,
    ) -> Awaitable[Mapping[str, StepResult]]:
        """One tick's work on this worker (a reset and releases first), in one round trip. The
        call is numbered and started now, in the order of these calls; await its answer."""
        request = convert.step_request(prefill, decode)
        request.release_session_ids.extend(release)
        timed = bool(prefill or decode)  # (a release alone is no step to time)
        # Cleared as it is sent, not when it answers: a second step may go out meanwhile, and it
        # must not forget what the first placed. (A worker that fails it is taken back with a reset.)
        request.reset, self.reset_pending = self.reset_pending, False
        self.sent_steps += 1
        request.seq = self.sent_steps
        if self.info is not None:
            request.instance_id = self.info.instance_id
        if arm is not None:
            request.kv_views = arm.kv_views
            request.experiment_id = arm.experiment_id
            request.experiment_arm = arm.arm
        trace_md = inject_metadata(trace.set_span_in_context(span)) if span is not None else ()
        if not (self.stream_steps and self.info is not None and self.info.step_stream):
            return self._answer(self.stub.Step(request, timeout=timeout, metadata=(*self.auth, *trace_md)), timed)
        request.timeout_ms = max(1, round(timeout * 1000))
        request.trace_context.update(trace_md)
        stream = self._stream
        if stream is None or stream.broken is not None or stream.age_s > self.stream_max_age_s:
            if stream is not None and stream.broken is None:
                stream.retire()
                self._retired.add(stream)
                stream.ended.add_done_callback(functools.partial(self._forget_retired, stream))
            self._stream = stream = StepStream(self.stub, self.auth, self.address)
        return self._streamed(stream.send(request, timeout), timed)

    def _forget_retired(self, stream: StepStream, _: object) -> None:
        self._retired.discard(stream)

    async def _answer(self, call: Awaitable[wpb.StepResponse], timed: bool) -> Mapping[str, StepResult]:
        try:
            resp = await call
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallFailed(self.address, *connection_status(exc.code(), exc.details() or "")) from exc
        if timed:
            self.step_ns = resp.step_ns
        return convert.step_results(resp)

    async def _streamed(self, answer: Awaitable[wpb.StepResponse], timed: bool) -> Mapping[str, StepResult]:
        resp = await answer
        if timed:
            self.step_ns = resp.step_ns
        return convert.step_results(resp)

    async def held(self, timeout: float) -> HeldSessions:
        try:
            s = await self.stub.GetStats(wpb.GetStatsRequest(), timeout=timeout, metadata=self.auth)
        except grpc.aio.AioRpcError as exc:
            raise WorkerCallFailed(self.address, *connection_status(exc.code(), exc.details() or "")) from exc
        return HeldSessions(
            s.active_sessions, s.used_blocks, s.free_blocks, s.rss_bytes, s.private_bytes, s.instance_id
        )

    async def close(self) -> None:
        for stream in (*self._retired, *([self._stream] if self._stream is not None else [])):
            await stream.close()
        await self.channel.close()

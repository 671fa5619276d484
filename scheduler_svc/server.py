"""The scheduler's gRPC adapter: requests -> core, the tick loop -> worker RPCs, tokens -> streams."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import grpc
from opentelemetry import context as otel_context

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.logs import bind_session
from kvfleet_common.security import authorize_token
from kvfleet_common.tracing import extract_context
from scheduler_svc import convert
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import (
    AdmissionRejected,
    FinishReason,
    NotSessionOwner,
    RejectReason,
    SchedulerCore,
    SessionRequest,
)
from scheduler_svc.experiments import ExperimentArm
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.prompts import PromptError, PromptResolver, TextStream
from scheduler_svc.runtime import RuntimeConfig, SchedulerRuntime, SessionEvent, Submission
from scheduler_svc.spans import SchedulerSpans
from scheduler_svc.workers import WorkerClient

log = logging.getLogger(__name__)
SERVICE_NAME = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name

REJECT_STATUS = {
    RejectReason.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.KV_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.PROMPT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
}


class SchedulerServicer(spb_grpc.SchedulerServicer):
    """protobuf -> runtime calls -> protobuf; policy lives in the core, effects in the runtime."""

    def __init__(self, runtime: SchedulerRuntime, prompts: PromptResolver, api_token: str = "") -> None:
        self._api_token = api_token
        self._runtime = runtime
        self._prompts = prompts
        self.draining = False

    # ---- helpers ------------------------------------------------------------------------

    async def _gate(self, context) -> None:
        await authorize_token(context, self._api_token)
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the scheduler is shutting down and takes no new sessions; retry against another scheduler",
            )

    async def _session_request(self, req: spb.GenerateRequest, context, owner: str, where: str = "") -> SessionRequest:
        try:
            return await self._prompts.resolve(req, owner)
        except PromptError as exc:
            self._runtime.record_rejection(RejectReason.INVALID_REQUEST)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}{exc}")
            raise  # unreachable: abort raises

    async def _submit(self, context, submit: Callable[[], Submission]) -> Submission:
        try:
            return submit()
        except AdmissionRejected as exc:
            self._runtime.rejections_changed()
            await context.abort(REJECT_STATUS[exc.reason], f"{exc.reason.value}: {exc.message}")
            raise  # unreachable: abort raises

    # ---- RPCs ---------------------------------------------------------------------------

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateEvent]:
        await self._gate(context)
        parent = extract_context(context.invocation_metadata())
        # The caller's trace context and the session id stay current for the rest of this call
        # (its own task), so its log lines carry trace_id/span_id and session_id. Never detached:
        # the task's context ends with the call.
        otel_context.attach(parent)
        sreq = await self._session_request(request, context, caller_identity(context))
        sub = await self._submit(context, lambda: self._runtime.submit([sreq], [_operation(request)], parent=parent))
        bind_session(sub.session_ids[0])
        log.debug(
            "session %s: %d prompt tokens, up to %d new", sub.session_ids[0], len(sreq.prompt_ids), sreq.max_new_tokens
        )
        label = f"session {sub.session_ids[0]}"
        async with contextlib.aclosing(self._stream(sub, [sreq], [request], context, label, True)) as events:
            async for _, msg in events:
                yield msg

    async def SubmitWorkload(self, request, context) -> AsyncIterator[spb.WorkloadEvent]:
        await self._gate(context)
        owner = caller_identity(context)
        reqs = [
            await self._session_request(r, context, owner, f"session {i}: ") for i, r in enumerate(request.sessions)
        ]
        arm = None
        if request.HasField("experiment"):
            try:
                arm = ExperimentArm(request.experiment.id, request.experiment.arm, request.experiment.lever)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sub = await self._submit(
            context,
            lambda: self._runtime.submit(
                reqs, [_operation(r) for r in request.sessions], convert.policy_from_pb(request), arm
            ),
        )
        wid = sub.workload_id or ""
        async with contextlib.aclosing(
            self._stream(sub, reqs, list(request.sessions), context, f"workload {wid}", False)
        ) as events:
            async for index, msg in events:
                yield spb.WorkloadEvent(workload_id=wid, session_index=index, event=msg)
        stats = self._runtime.workload_stats(wid)
        assert stats is not None, "a workload whose sessions all finished has its stats"
        yield spb.WorkloadEvent(workload_id=wid, done=True, stats=convert.workload_stats_to_pb(stats))

    async def _stream(
        self,
        sub: Submission,
        sreqs: Sequence[SessionRequest],
        requests: Sequence[spb.GenerateRequest],
        context,
        label: str,
        echo_prompt: bool,
    ) -> AsyncGenerator[tuple[int, spb.GenerateEvent], None]:
        """The events of a submission's sessions, one message per session per batch of events,
        until every session has finished; (session index, message). Shared by Generate and
        SubmitWorkload: the client's deadline, dropped sessions and a client that goes away
        are handled here, once."""
        index = {sid: i for i, sid in enumerate(sub.session_ids)}
        texts = {sid: self._prompts.stream(sreqs[i], list(requests[i].stop)) for sid, i in index.items()}
        unseen = set(sub.session_ids) if echo_prompt else set()
        open_ids = set(sub.session_ids)
        try:
            async for batch in _batches(sub.events, context):
                by_session: dict[str, list[SessionEvent]] = {}
                for ev in batch:
                    by_session.setdefault(ev.session_id, []).append(ev)
                for sid, evs in by_session.items():
                    msg = spb.GenerateEvent(session_id=sid)
                    if sid in unseen:
                        msg.prompt_token_ids.extend(sreqs[index[sid]].prompt_ids)
                        unseen.discard(sid)
                    if self._fill_event(msg, evs, texts[sid], sid):
                        open_ids.discard(sid)
                    yield index[sid], msg
                if not open_ids:
                    return
        except asyncio.TimeoutError:
            for sid in open_ids:
                self._runtime.cancel(sid)
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"{label} did not finish before the client's deadline"
            )
        except SessionDropped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{label}: {exc}")
        finally:
            self._runtime.end_stream(sub)

    def _fill_event(self, msg: spb.GenerateEvent, batch: list[SessionEvent], text: TextStream, sid: str) -> bool:
        finished = False
        for ev in batch:
            if ev.token is not None:
                msg.token_ids.append(ev.token)
                delta, stop_hit = text.push(ev.token)
                msg.text += delta
                if stop_hit and not finished:
                    self._runtime.finish(sid, FinishReason.STOP)
            if ev.finish is not None:
                finished = True
                msg.finished = True
                msg.finish_reason = convert.FINISH_TO_PB[ev.finish]
                msg.text += text.flush()
        if ev.worker_id:
            msg.worker_id = ev.worker_id
        if finished:
            msg.usage.input_tokens, msg.usage.output_tokens = self._runtime.usage(sid)
        return finished

    async def Cancel(self, request, context):
        await authorize_token(context, self._api_token)
        if not request.session_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty; pass the id from the session's first event"
            )
        try:
            state = self._runtime.cancel(request.session_id, caller_identity(context))
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r}; it may have finished already"
            )
        except NotSessionOwner:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"session {request.session_id!r} was started by another caller; "
                f"only its owner (the same token or client certificate) may cancel it",
            )
        return spb.CancelResponse(cancelled=state in ("queued", "prefill", "decode"), state=state)

    async def GetTelemetry(self, request, context):
        await authorize_token(context, self._api_token)
        if request.at_tick and request.workload_id:
            if not self._runtime.has_workload(request.workload_id):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no workload {request.workload_id!r}")
            snap = await self._runtime.wait_for_snapshot(request.workload_id, context.time_remaining())
            if snap is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"workload {request.workload_id} captured no snapshot at tick "
                    f"{request.at_tick}; submit it with snapshot_at_tick={request.at_tick}",
                )
            return convert.snapshot_to_pb(snap)
        if request.at_tick or request.workload_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "workload_id and at_tick go together; send both or neither"
            )
        return convert.snapshot_to_pb(self._runtime.snapshot())

    async def ListWorkers(self, request, context):
        await authorize_token(context, self._api_token)
        resp = spb.ListWorkersResponse()
        for view in self._runtime.workers():
            info = view.client.info
            if info is None:
                resp.workers.add(address=view.client.address, live=False)
                continue
            resp.workers.add(
                worker_id=info.worker_id,
                address=view.client.address,
                live=view.live,
                model=info.model.name,
                device=info.device,
                dtype=info.dtype,
                quant=info.quant or "none",
                sessions=view.sessions,
                kv_tokens=view.kv_tokens,
                kv_capacity_tokens=info.kv_capacity_tokens,
                reserved_tokens=view.reserved_tokens,
                vocab_size=info.model.vocab_size,
                weight_bytes=info.weight_bytes,
                kv_bytes_per_token=info.kv_bytes_per_token,
            )
        return resp


def caller_identity(context) -> str:
    """Who is calling, as far as the transport tells: the bearer token (hashed), else the client
    certificate's name, else "" (anonymous). A session may be cancelled only by the same caller."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value:
            return "token:" + hashlib.sha256(value.encode()).hexdigest()[:32]
    names = (context.auth_context() or {}).get("x509_common_name")
    if names:
        return "peer:" + names[0].decode(errors="replace")
    return ""


def _operation(req: spb.GenerateRequest) -> str:
    return "chat" if req.WhichOneof("prompt") == "chat" else "text_completion"


async def _batches(events: asyncio.Queue, context) -> AsyncIterator[list[SessionEvent]]:
    """Yield every event waiting in the queue at once, honouring the client's deadline."""
    while True:
        remaining = context.time_remaining()
        if remaining is None:
            first = await events.get()
        else:
            first = await asyncio.wait_for(events.get(), max(remaining, 0.0))
        batch = [first]
        while not events.empty():
            batch.append(events.get_nowait())
        dropped = [ev.dropped for ev in batch if ev.dropped]
        if dropped:
            raise SessionDropped(dropped[0])
        yield batch


class SessionDropped(Exception):
    """The scheduler gave up on a session (no live worker for too long, KV lost too often)."""


async def create_server(config: SchedulerConfig):
    """Connect to the workers, then build and start the server. Returns (server, port, service)."""
    core = SchedulerCore(config.limits)
    clients = [WorkerClient.open(a, config.tls) for a in config.workers]
    infos = await asyncio.gather(*(c.wait_ready(config.worker_connect_timeout_s) for c in clients))
    for client, info in zip(clients, infos):
        core.add_worker(client.spec(), info.model.vocab_size, info.model.max_position)
        log.info(
            "worker %s at %s: %s on %s, %d KV tokens",
            info.worker_id,
            client.address,
            info.model.name,
            info.device,
            info.kv_capacity_tokens,
        )
    prompts = PromptResolver.for_model(config.model or infos[0].model.name, infos[0].model, config.prompt_limits)
    spans = SchedulerSpans(prompts.model_name)
    metrics = SchedulerMetrics(prompts.model_name, infos[0].model.max_position)
    runtime = SchedulerRuntime(
        core,
        clients,
        spans,
        metrics,
        RuntimeConfig(
            step_timeout_s=config.step_timeout_s,
            health_interval_s=config.health_interval_s,
            no_worker_wait_s=config.no_worker_wait_s,
            reconcile_interval_s=config.reconcile_interval_s,
        ),
    )
    servicer = SchedulerServicer(runtime, prompts, config.api_token)
    server = grpc.aio.server(options=grpcutil.SERVER_OPTIONS)
    spb_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = grpcutil.add_health_and_reflection(server, [SERVICE_NAME])
    port = grpcutil.bind(server, config.host, config.port, config.tls)
    spans.serving_at(config.host, port)
    await server.start()
    runtime.start()
    from kvfleet_common.metrics import serve_metrics

    metrics.tick(core.snapshot(), 0, 0)
    metrics_port = serve_metrics(metrics.registry, config.host, config.metrics_port)
    log.info(
        "scheduler serving on %s:%d with %d workers (metrics port %s)", config.host, port, len(clients), metrics_port
    )
    return server, port, RunningScheduler(server, servicer, runtime, health)


class RunningScheduler:
    """Handles for a started scheduler, for a graceful stop."""

    def __init__(self, server: grpc.aio.Server, servicer: SchedulerServicer, runtime: SchedulerRuntime, health) -> None:
        self.server = server
        self.servicer = servicer
        self.runtime = runtime
        self.health = health

    async def stop(self, grace_s: float) -> None:
        """Drain: NOT_SERVING, refuse new sessions, let running ones finish, then stop."""
        self.servicer.draining = True
        grpcutil.set_not_serving(self.health, [SERVICE_NAME])
        await self.runtime.drain(grace_s)
        await self.server.stop(grace_s)
        await self.runtime.stop()


async def _serve(config: SchedulerConfig) -> None:
    server, port, running = await create_server(config)
    log.info("scheduler listening on %s:%d", config.host, port)  # a log line, so JSON logs stay JSON
    await grpcutil.wait_for_termination_signal()
    log.info("scheduler draining (grace %.1fs)", config.drain_grace_s)
    await running.stop(config.drain_grace_s)


async def serve(config) -> None:
    """Serve with tracing on when the OTEL_* environment asks for it; flush spans at exit."""
    from kvfleet_common.tracing import run_traced

    await run_traced("kvfleet-scheduler", _serve(config))

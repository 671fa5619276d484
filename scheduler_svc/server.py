"""The scheduler's gRPC adapter: requests -> core, the tick loop -> worker RPCs, tokens -> streams."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvfleet_common import grpcutil
from kvfleet_common.security import authorize_token
from kvfleet_common.tracing import extract_context
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from scheduler_svc import convert
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import (
    AdmissionRejected, FinishReason, RejectReason, SchedulerCore, SessionRequest,
)
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.prompts import PromptError, PromptResolver
from scheduler_svc.spans import ExperimentArm, SchedulerSpans
from scheduler_svc.tick_loop import SessionEvent, TickLoop
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
    def __init__(self, core: SchedulerCore, loop: TickLoop, prompts: PromptResolver,
                 spans: SchedulerSpans, metrics: SchedulerMetrics, api_token: str = "") -> None:
        self._api_token = api_token
        self._core = core
        self._metrics = metrics
        self._loop = loop
        self._prompts = prompts
        self._spans = spans
        self.draining = False

    # ---- helpers ------------------------------------------------------------------------

    async def _session_request(self, req: spb.GenerateRequest, context, where: str = "") -> SessionRequest:
        try:
            return self._prompts.session_request(req)
        except PromptError as exc:
            self._core.rejections.add(RejectReason.INVALID_REQUEST.value)
            self._metrics.update_rejections(self._core.rejections.by_reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}{exc}")
            raise  # unreachable: abort raises

    async def _refuse_if_draining(self, context) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the scheduler is shutting down and takes no new sessions; "
                                "retry against another scheduler")

    async def _admit(self, context, fn):
        try:
            return fn()
        except AdmissionRejected as exc:
            self._metrics.update_rejections(self._core.rejections.by_reason)
            await context.abort(REJECT_STATUS[exc.reason], f"{exc.reason.value}: {exc.message}")

    # ---- RPCs ---------------------------------------------------------------------------

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateEvent]:
        await authorize_token(context, self._api_token)
        await self._refuse_if_draining(context)
        sreq = await self._session_request(request, context)
        sid = await self._admit(context, lambda: self._core.submit(sreq))
        self._metrics.arrived(sid)
        self._spans.start_session(sid, _operation(request), sreq.max_new_tokens,
                                  sreq.sampling.temperature,
                                  parent=extract_context(context.invocation_metadata()))
        events = self._loop.subscribe(sid)
        stream = self._prompts.stream(sreq, list(request.stop))
        first = True
        try:
            async for batch in _batches(events, context):
                msg = spb.GenerateEvent(session_id=sid)
                if first:
                    msg.prompt_token_ids.extend(sreq.prompt_ids)
                    first = False
                finished = self._fill_event(msg, batch, stream, sid)
                yield msg
                if finished:
                    return
        except asyncio.TimeoutError:
            self._loop.cancel(sid)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"session {sid} did not finish before the client's deadline")
        except SessionDropped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"session {sid}: {exc}")
        finally:
            if not self._loop.finished(sid):
                self._loop.cancel(sid)   # the client went away: free its slot or KV
            self._loop.unsubscribe(sid)

    def _fill_event(self, msg: spb.GenerateEvent, batch: list[SessionEvent], stream, sid: str) -> bool:
        finished = False
        for ev in batch:
            if ev.token is not None:
                msg.token_ids.append(ev.token)
                delta, stop_hit = stream.push(ev.token)
                msg.text += delta
                if stop_hit and not finished:
                    self._loop.finish(sid, FinishReason.STOP)
            if ev.finish is not None:
                finished = True
                msg.finished = True
                msg.finish_reason = convert.FINISH_TO_PB[ev.finish]
                msg.text += stream.flush()
        if ev.worker_id:
            msg.worker_id = ev.worker_id
        if finished:
            session = self._core.session(sid)
            msg.usage.input_tokens = session.prompt_len
            msg.usage.output_tokens = len(session.generated)
        return finished

    async def SubmitWorkload(self, request, context) -> AsyncIterator[spb.WorkloadEvent]:
        await authorize_token(context, self._api_token)
        await self._refuse_if_draining(context)
        reqs = [await self._session_request(r, context, f"session {i}: ")
                for i, r in enumerate(request.sessions)]
        policy = convert.policy_from_pb(request)
        arm = None
        if request.HasField("experiment"):
            try:
                arm = ExperimentArm(request.experiment.id, request.experiment.arm, request.experiment.lever)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        workload_id, ids = await self._admit(context, lambda: self._core.submit_workload(reqs, policy))
        self._spans.start_workload(workload_id, len(ids), arm)
        for sid in ids:
            self._metrics.arrived(sid)
        for sid, r, sreq in zip(ids, request.sessions, reqs):
            self._spans.start_session(sid, _operation(r), sreq.max_new_tokens, sreq.sampling.temperature,
                                      workload_id=workload_id)
        index = {sid: i for i, sid in enumerate(ids)}
        events = self._loop.subscribe_many(ids)
        open_ids = set(ids)
        streams = {sid: self._prompts.stream(reqs[index[sid]], list(request.sessions[index[sid]].stop))
                   for sid in ids}
        try:
            async for batch in _batches(events, context):
                by_session: dict[str, list[SessionEvent]] = {}
                for ev in batch:
                    by_session.setdefault(ev.session_id, []).append(ev)
                for sid, evs in by_session.items():
                    msg = spb.GenerateEvent(session_id=sid)
                    if self._fill_event(msg, evs, streams[sid], sid):
                        open_ids.discard(sid)
                    yield spb.WorkloadEvent(workload_id=workload_id, session_index=index[sid], event=msg)
                if not open_ids:
                    self._spans.end_workload(workload_id)
                    stats = self._core.workload_stats(workload_id)
                    yield spb.WorkloadEvent(workload_id=workload_id, done=True,
                                            stats=convert.workload_stats_to_pb(stats))
                    return
        except asyncio.TimeoutError:
            for sid in open_ids:
                self._loop.cancel(sid)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"workload {workload_id} did not finish before the client's deadline")
        except SessionDropped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"workload {workload_id}: {exc}")
        finally:
            for sid in ids:
                if not self._loop.finished(sid):
                    self._loop.cancel(sid)
                self._loop.unsubscribe(sid)
            self._spans.end_workload(workload_id)

    async def Cancel(self, request, context):
        await authorize_token(context, self._api_token)
        if not request.session_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "session_id is empty; pass the id from the session's first event")
        try:
            state = self._loop.cancel(request.session_id)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no session {request.session_id!r}; it may have finished already")
        return spb.CancelResponse(cancelled=state in ("queued", "prefill", "decode"), state=state)

    async def GetTelemetry(self, request, context):
        await authorize_token(context, self._api_token)
        if request.at_tick and request.workload_id:
            if not self._core.has_workload(request.workload_id):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no workload {request.workload_id!r}")
            snap = await self._loop.wait_for_snapshot(request.workload_id, context.time_remaining())
            if snap is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"workload {request.workload_id} captured no snapshot at tick "
                                    f"{request.at_tick}; submit it with snapshot_at_tick={request.at_tick}")
            return convert.snapshot_to_pb(snap)
        if request.at_tick or request.workload_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "workload_id and at_tick go together; send both or neither")
        return convert.snapshot_to_pb(self._core.snapshot())

    async def ListWorkers(self, request, context):
        await authorize_token(context, self._api_token)
        resp = spb.ListWorkersResponse()
        for client in self._loop.clients():
            if client.info is None:
                resp.workers.add(address=client.address, live=False)
                continue
            wid = client.worker_id
            slot = self._core.workers.get(wid) if wid in self._core.workers else None
            held = self._loop.held_tokens(wid)
            resp.workers.add(worker_id=wid, address=client.address, live=bool(slot and slot.live),
                             model=client.info.model.name, device=client.info.device,
                             dtype=client.info.dtype, sessions=len(slot.sessions) if slot else 0,
                             kv_tokens=held, kv_capacity_tokens=client.info.kv_capacity_tokens,
                             reserved_tokens=slot.reserved_tokens if slot else 0,
                             vocab_size=client.info.model.vocab_size,
                             weight_bytes=client.info.weight_bytes,
                             kv_bytes_per_token=client.info.kv_bytes_per_token)
        return resp


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
        dropped = [ev.unavailable for ev in batch if ev.unavailable]
        if dropped:
            raise SessionDropped(dropped[0])
        yield batch


class SessionDropped(Exception):
    """The scheduler gave up on a session (no live worker for too long)."""


async def create_server(config: SchedulerConfig):
    """Connect to the workers, then build and start the server. Returns (server, port, service)."""
    core = SchedulerCore(config.limits)
    clients = [WorkerClient.open(a, config.tls) for a in config.workers]
    infos = await asyncio.gather(*(c.wait_ready(config.worker_connect_timeout_s) for c in clients))
    for client, info in zip(clients, infos):
        core.add_worker(client.spec(), info.model.vocab_size, info.model.max_position)
        log.info("worker %s at %s: %s on %s, %d KV tokens", info.worker_id, client.address,
                 info.model.name, info.device, info.kv_capacity_tokens)
    prompts = PromptResolver.for_model(config.model or infos[0].model.name, infos[0].model)
    spans = SchedulerSpans(prompts.model_name)
    metrics = SchedulerMetrics()
    loop = TickLoop(core, clients, spans, metrics, step_timeout_s=config.step_timeout_s,
                    health_interval_s=config.health_interval_s, no_worker_wait_s=config.no_worker_wait_s)
    servicer = SchedulerServicer(core, loop, prompts, spans, metrics, config.api_token)
    server = grpc.aio.server(options=grpcutil.SERVER_OPTIONS)
    spb_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = grpcutil.add_health_and_reflection(server, [SERVICE_NAME])
    port = grpcutil.bind(server, config.host, config.port, config.tls)
    await server.start()
    loop.start()
    from kvfleet_common.metrics import serve_metrics

    metrics.tick(core.snapshot(), 0, 0)
    metrics_port = serve_metrics(metrics.registry, config.host, config.metrics_port)
    log.info("scheduler serving on %s:%d with %d workers (metrics port %s)", config.host, port,
             len(clients), metrics_port)
    return server, port, RunningScheduler(server, servicer, loop, health)


class RunningScheduler:
    """Handles for a started scheduler, for a graceful stop."""

    def __init__(self, server: grpc.aio.Server, servicer: SchedulerServicer, loop: TickLoop, health) -> None:
        self.server = server
        self.servicer = servicer
        self.loop = loop
        self.health = health

    async def stop(self, grace_s: float) -> None:
        """Drain: NOT_SERVING, refuse new sessions, let running ones finish, then stop."""
        self.servicer.draining = True
        grpcutil.set_not_serving(self.health, [SERVICE_NAME])
        await self.loop.drain(grace_s)
        await self.server.stop(grace_s)
        await self.loop.stop()


async def _serve(config: SchedulerConfig) -> None:
    server, port, running = await create_server(config)
    print(f"scheduler listening on {config.host}:{port}", flush=True)
    await grpcutil.wait_for_termination_signal()
    log.info("scheduler draining (grace %.1fs)", config.drain_grace_s)
    await running.stop(config.drain_grace_s)


async def serve(config) -> None:
    """Serve with tracing on when the OTEL_* environment asks for it; flush spans at exit."""
    from kvfleet_common.tracing import run_traced

    await run_traced("kvfleet-scheduler", _serve(config))

"""The scheduler's gRPC adapter: requests -> core, the tick loop -> worker RPCs, tokens -> streams."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

import grpc
from opentelemetry import context as otel_context

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.logs import bind_request, bind_session
from kvfleet_common.security import authorize_token, peer_common_names
from kvfleet_common.tracing import extract_context
from scheduler_svc import convert
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import (
    AdmissionRejected,
    DropCause,
    NotSessionOwner,
    RejectReason,
    SchedulerCore,
    SessionRequest,
)
from scheduler_svc.experiments import ExperimentArm, ExperimentWriters
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.output import LogprobText, OutputProcessor
from scheduler_svc.prompts import NoTokenizer, PromptError, PromptRejected, PromptResolver
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

    def __init__(
        self,
        runtime: SchedulerRuntime,
        prompts: PromptResolver,
        api_token: str = "",
        spans: SchedulerSpans | None = None,
        served_model: str = "",
        experiments: ExperimentWriters | None = None,
    ) -> None:
        self._api_token = api_token
        self._experiments = experiments or ExperimentWriters()
        self._runtime = runtime
        self._prompts = prompts
        self._spans = spans
        self._served_model = served_model or prompts.model_name
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
            await self._refuse(exc, context, where)
            raise  # unreachable: abort raises

    async def _precheck(self, req: spb.GenerateRequest, context, where: str) -> None:
        """The cheap checks alone (counts, sizes): a workload's every session passes them before
        any session is tokenized."""
        try:
            self._prompts.precheck(req)
        except PromptError as exc:
            await self._refuse(exc, context, where)

    async def _refuse(self, exc: PromptError, context, where: str) -> None:
        if isinstance(exc, PromptRejected):  # the core's own refusal, made early: the core's wording
            self._runtime.record_rejection(exc.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason.value}: {where}{exc}")
        self._runtime.record_rejection(RejectReason.INVALID_REQUEST)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{where}{exc}")

    async def _submit(self, context, submit: Callable[[], Submission]) -> Submission:
        try:
            return submit()
        except AdmissionRejected as exc:
            self._runtime.rejections_changed()
            await context.abort(REJECT_STATUS[exc.reason], f"{exc.reason.value}: {exc.message}")
            raise  # unreachable: abort raises

    # ---- RPCs ---------------------------------------------------------------------------

    async def _echo_text(self, request: spb.GenerateRequest, sreq: SessionRequest, context) -> str | None:
        """The prompt's text when the request asks for echo (rendered off the event loop)."""
        if not request.echo:
            return None
        try:
            return await asyncio.to_thread(self._prompts.prompt_text, request, sreq)
        except PromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateEvent]:
        await self._gate(context)
        parent = extract_context(context.invocation_metadata())
        # The caller's trace context and the session id stay current for the rest of this call
        # (its own task), so its log lines carry trace_id/span_id and session_id. Never detached:
        # the task's context ends with the call.
        otel_context.attach(parent)
        bind_request(request.request_id)  # on this call's log lines from here on (validated below)
        sreq = await self._session_request(request, context, caller_identity(context))
        echo = await self._echo_text(request, sreq, context)
        n = max(request.n, 1)
        if n > 1:  # the choices share their prompt's prefill (see SessionRequest.prefix_group)
            sreq = dataclasses.replace(sreq, prefix_group=secrets.token_hex(8))
        sreqs = [_choice(sreq, i) for i in range(n)]
        # The n choices are admitted together or not at all.
        sub = await self._submit(context, lambda: self._runtime.submit(sreqs, [_operation(request)] * n, parent=parent))
        rid = request.request_id
        bind_session(sub.session_ids[0])
        if rid and self._spans is not None:
            for sid in sub.session_ids:
                self._spans.set_request_id(sid, rid)
        log.debug(
            "session %s: %d prompt tokens, up to %d new%s",
            ", ".join(sub.session_ids),
            len(sreq.prompt_ids),
            sreq.max_new_tokens,
            f", {n} choices" if n > 1 else "",
            extra={"request_id": rid} if rid else None,
        )
        label = f"session {sub.session_ids[0]}" if n == 1 else f"sessions {', '.join(sub.session_ids)}"
        echoed: set[int] = set()
        try:
            async with contextlib.aclosing(self._stream(sub, sreqs, [request] * n, context, label, True)) as events:
                async for index, msg in events:
                    msg.request_id = rid
                    msg.index = index
                    if echo is not None and index not in echoed:
                        msg.prompt_text = echo
                        echoed.add(index)
                    yield msg
        finally:
            if rid:
                log.debug("request %s done", rid, extra={"request_id": rid})

    async def SubmitWorkload(self, request, context) -> AsyncIterator[spb.WorkloadEvent]:
        await self._gate(context)
        owner = caller_identity(context)
        if request.HasField("experiment"):  # before any prompt is read: a refusal costs nothing
            refusal = self._experiments.refusal(context.invocation_metadata(), peer_common_names(context))
            if refusal is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        for i, r in enumerate(request.sessions):
            if r.n > 1:
                self._runtime.record_rejection(RejectReason.INVALID_REQUEST)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"session {i}: n is {r.n}; a workload lists its sessions one by one, so send n <= 1 "
                    f"and repeat the session with the seeds you want",
                )
        for i, r in enumerate(request.sessions):
            await self._precheck(r, context, f"session {i}: ")
        reqs = [
            await self._session_request(r, context, owner, f"session {i}: ") for i, r in enumerate(request.sessions)
        ]
        echoes = [await self._echo_text(r, sreq, context) for r, sreq in zip(request.sessions, reqs)]
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
        if self._spans is not None:
            for sid, r in zip(sub.session_ids, request.sessions):
                if r.request_id:
                    self._spans.set_request_id(sid, r.request_id)
        async with contextlib.aclosing(
            self._stream(sub, reqs, list(request.sessions), context, f"workload {wid}", False)
        ) as events:
            async for index, msg in events:
                msg.request_id = request.sessions[index].request_id
                echo = echoes[index]
                if echo is not None:
                    msg.prompt_text = echo
                    echoes[index] = None  # on the session's first event only
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
                    if _fill_event(msg, evs):
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
            await context.abort(_DROP_CODE[exc.cause], f"{label}: {exc}")
        except StreamCutOff as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{label}: {exc}")
        finally:
            self._runtime.end_stream(sub)

    async def Cancel(self, request, context):
        await authorize_token(context, self._api_token)
        if not request.session_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "session_id is empty; pass the id from the session's first event"
            )
        caller = caller_identity(context)
        try:
            state = self._runtime.cancel(request.session_id, caller)  # with its other choices (n > 1)
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
                rss_bytes=view.rss_bytes,
            )
        return resp

    def _worker_info(self):
        """A live worker's GetInfo answer (any known worker's when none is live); None before any."""
        views = [v for v in self._runtime.workers() if v.client.info is not None]
        live = [v for v in views if v.live]
        return (live or views)[0].client.info if views else None

    async def GetModelInfo(self, request, context):
        await authorize_token(context, self._api_token)
        info = self._worker_info()
        if info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "no worker has reported its model yet; retry once a worker is up"
            )
        tokenizer = self._prompts.tokenizer
        msg = spb.ModelInfo(
            model_id=self._served_model,
            architecture=ARCHITECTURE,
            max_context_length=info.model.max_position,
            vocab_size=info.model.vocab_size,
            eos_token_ids=sorted(self._prompts.eos_token_ids),
            dtype=info.dtype,
            quant=info.quant or "none",
            version=kvfleet_version(),
            chat_template=bool(tokenizer is not None and tokenizer.chat_template),
            supports_tools=self._prompts.supports_tools,
            max_model_len=info.model.max_position,
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

    async def Tokenize(self, request, context):
        await authorize_token(context, self._api_token)
        try:
            ids, tokens = await asyncio.to_thread(self._prompts.tokenize, request)
        except NoTokenizer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        info = self._worker_info()
        return spb.TokenizeResponse(
            token_ids=ids, tokens=tokens, max_context_length=info.model.max_position if info is not None else 0
        )

    async def Detokenize(self, request, context):
        await authorize_token(context, self._api_token)
        try:
            text = await asyncio.to_thread(
                self._prompts.detokenize, list(request.token_ids), request.skip_special_tokens
            )
        except NoTokenizer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return spb.DetokenizeResponse(text=text)


ARCHITECTURE = "llama"  # the one model family the workers run (worker_svc/model/llama.py)


def kvfleet_version() -> str:
    """kvfleet's installed version, as `kvfleet --version` reports it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvfleet")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _choice(sreq: SessionRequest, index: int) -> SessionRequest:
    """Choice `index` of an n > 1 request: the same prompt, seeded seed + index (mod 2**64)."""
    if index == 0:
        return sreq
    seed = (sreq.sampling.seed + index) % 2**64
    return dataclasses.replace(sreq, sampling=dataclasses.replace(sreq.sampling, seed=seed))


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
        cut_off = [ev.cut_off for ev in batch if ev.cut_off]
        if cut_off:
            raise StreamCutOff(cut_off[0])
        dropped = [ev for ev in batch if ev.dropped]
        if dropped:
            raise SessionDropped(dropped[0].dropped, dropped[0].drop_cause)
        yield batch


def _fill_event(msg: spb.GenerateEvent, batch: list[SessionEvent]) -> bool:
    """One session's batch of events as one message; whether the session finished."""
    finished = False
    for ev in batch:
        if ev.token is not None:
            msg.token_ids.append(ev.token)
            if ev.logprob is not None:
                msg.logprobs.append(_logprob_pb(ev.logprob))
        msg.text += ev.text
        if ev.finish is not None:
            finished = True
            msg.finished = True
            msg.finish_reason = convert.FINISH_TO_PB[ev.finish]
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


def _logprob_pb(lp: LogprobText) -> spb.TokenLogprob:
    return spb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        text=lp.text,
        top=[spb.TopLogprob(token_id=t, logprob=v, text=text) for t, v, text in lp.top],
    )


class SessionDropped(Exception):
    """The scheduler gave up on a session (no live worker for too long, KV lost too often, moved
    too often), or a worker refused or failed it alone."""

    def __init__(self, why: str, cause: DropCause) -> None:
        super().__init__(why)
        self.cause = cause


# What a dropped session's stream ends with: retry later, change the request, or a fault.
_DROP_CODE = {
    DropCause.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    DropCause.REJECTED: grpc.StatusCode.INVALID_ARGUMENT,
    DropCause.FAILED: grpc.StatusCode.INTERNAL,
}


class StreamCutOff(Exception):
    """The stream's client stopped reading; the runtime cancelled its sessions."""


async def create_server(config: SchedulerConfig):
    """Connect to the workers, then build and start the server. Returns (server, port, service)."""
    core = SchedulerCore(config.limits)
    clients = [WorkerClient.open(a, config.tls, config.worker_secret) for a in config.workers]
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
    # A token-id prompt over the core's limit is refused by its length, before its ids are read.
    prompt_limits = dataclasses.replace(
        config.prompt_limits, max_prompt_ids=min(config.prompt_limits.max_prompt_ids, config.limits.max_prompt_tokens)
    )
    prompts = PromptResolver.for_model(config.model or infos[0].model.name, infos[0].model, prompt_limits)
    # The name clients see (GetModelInfo, spans, metrics): --served-model-name, else the workers' own.
    served = config.served_model_name or infos[0].model.name
    spans = SchedulerSpans(served)
    metrics = SchedulerMetrics(served, infos[0].model.max_position)
    runtime = SchedulerRuntime(
        core,
        clients,
        spans,
        metrics,
        RuntimeConfig(
            step_timeout_s=config.step_timeout_s,
            health_interval_s=config.health_interval_s,
            no_worker_wait_s=config.no_worker_wait_s,
            stats_interval_s=config.stats_interval_s,
            overlap=config.overlap_scheduling,
        ),
        OutputProcessor(prompts.stream, prompts.token_text),
    )
    servicer = SchedulerServicer(runtime, prompts, config.api_token, spans, served, config.experiments)
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

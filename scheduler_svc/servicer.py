"""The scheduler's gRPC servicer: protobuf -> domain values (prompts.py, convert.py) -> the
runtime -> protobuf, with each refusal mapped to its status code here. Policy lives in the core,
effects and streams in the runtime, the server's assembly in server.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TypeVar

import grpc
from opentelemetry import context as otel_context

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common.logs import bind_request, bind_session
from kvfleet_common.security import authorize_token, caller_identity, peer_common_names
from kvfleet_common.tracing import extract_context
from kvfleet_common.version import kvfleet_version
from scheduler_svc import convert
from scheduler_svc.core import AdmissionRejected, DropCause, NotSessionOwner, RejectReason, SessionRequest
from scheduler_svc.experiments import ExperimentWriters
from scheduler_svc.prompts import NoTokenizer, PromptError, PromptRejected, PromptResolver
from scheduler_svc.runtime import SchedulerRuntime
from scheduler_svc.streams import SessionDropped, StreamCutOff, Submission, batches, by_session

log = logging.getLogger(__name__)
_T = TypeVar("_T")
SERVICE_NAME = spb.DESCRIPTOR.services_by_name["Scheduler"].full_name

REJECT_STATUS = {
    RejectReason.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.KV_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.PROMPT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.NO_WORKER: grpc.StatusCode.UNAVAILABLE,
}
# What a dropped session's stream ends with: retry later, change the request, or a fault.
_DROP_CODE = {
    DropCause.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    DropCause.REJECTED: grpc.StatusCode.INVALID_ARGUMENT,
    DropCause.FAILED: grpc.StatusCode.INTERNAL,
}


class SchedulerServicer(spb_grpc.SchedulerServicer):
    """protobuf -> runtime calls -> protobuf; policy lives in the core, effects in the runtime."""

    def __init__(
        self,
        runtime: SchedulerRuntime,
        prompts: PromptResolver,
        api_token: str = "",
        served_model: str = "",
        experiments: ExperimentWriters | None = None,
    ) -> None:
        self._api_token = api_token
        self._experiments = experiments or ExperimentWriters()
        self._runtime = runtime
        self._prompts = prompts
        self._served_model = served_model or prompts.model_name
        self.draining = False

    # ---- refusals ---------------------------------------------------------------------------

    async def _gate(self, context) -> None:
        await authorize_token(context, self._api_token)
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the scheduler is shutting down and takes no new sessions; retry against another scheduler",
            )

    async def _refuse(self, exc: PromptError, context) -> None:
        """A prompt refused (exc.where: which of a workload's sessions) as INVALID_ARGUMENT."""
        if isinstance(exc, PromptRejected):  # the core's own refusal, made early: the core's wording
            self._runtime.record_rejection(exc.reason)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason.value}: {exc.where}{exc}")
        self._runtime.record_rejection(RejectReason.INVALID_REQUEST)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.where}{exc}")

    async def _submit(self, context, submit: Callable[[], _T]) -> _T:
        try:
            return submit()
        except AdmissionRejected as exc:
            self._runtime.rejections_changed()
            await context.abort(REJECT_STATUS[exc.reason], f"{exc.reason.value}: {exc.message}")
            raise  # unreachable: abort raises

    # ---- sessions ---------------------------------------------------------------------------

    async def Generate(self, request, context) -> AsyncIterator[spb.GenerateEvent]:
        await self._gate(context)
        parent = extract_context(context.invocation_metadata())
        # The caller's trace context and the session id stay current for the rest of this call
        # (its own task), so its log lines carry trace_id/span_id and session_id. Never detached:
        # the task's context ends with the call.
        otel_context.attach(parent)
        bind_request(request.request_id)  # on this call's log lines from here on (validated below)
        try:
            sreq = await self._prompts.resolve(request, caller_identity(context))
        except PromptError as exc:
            await self._refuse(exc, context)
        n = max(request.n, 1)
        sub, choices = await self._submit(
            context, lambda: self._runtime.generate(sreq, n, _operation(request), parent, request.request_id)
        )
        rid = request.request_id
        bind_session(sub.session_ids[0])
        label = f"session {sub.session_ids[0]}" if n == 1 else f"sessions {', '.join(sub.session_ids)}"
        try:
            async with contextlib.aclosing(self._stream(sub, choices, context, label, True)) as batches:
                async for batch in batches:
                    for index, msg in batch:
                        msg.request_id, msg.index = rid, index
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
        try:  # every session's cheap checks before any session is tokenized
            reqs = await self._prompts.resolve_workload(request.sessions, owner)
        except PromptError as exc:
            await self._refuse(exc, context)
        try:
            arm = convert.arm_from_pb(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        operations = [_operation(r) for r in request.sessions]
        policy = convert.policy_from_pb(request)
        rids = [r.request_id for r in request.sessions]
        sub = await self._submit(context, lambda: self._runtime.submit(reqs, operations, policy, arm, None, rids))
        wid = sub.workload_id or ""
        async with contextlib.aclosing(self._stream(sub, reqs, context, f"workload {wid}", False)) as batches:
            async for batch in batches:
                if request.batch_events:  # one message for the batch (see WorkloadRequest.batch_events)
                    out = spb.WorkloadEvent(workload_id=wid)
                    for i, msg in batch:
                        msg.request_id = rids[i]  # (indexing request.sessions builds a wrapper each time)
                        out.batch.add(workload_id=wid, session_index=i).event.CopyFrom(msg)  # one copy
                    yield out
                else:
                    for i, msg in batch:
                        msg.request_id = rids[i]
                        yield spb.WorkloadEvent(workload_id=wid, session_index=i, event=msg)
        stats = self._runtime.workload_stats(wid)
        assert stats is not None, "a workload whose sessions all finished has its stats"
        done = convert.workload_stats_to_pb(stats)
        done.overlapped = self._runtime.overlapped
        yield spb.WorkloadEvent(workload_id=wid, done=True, stats=done)

    async def _stream(
        self, sub: Submission, sreqs: Sequence[SessionRequest], context, label: str, prompt_ids: bool
    ) -> AsyncGenerator[list[tuple[int, spb.GenerateEvent]], None]:
        """The events of a submission's sessions, one message per session per batch of events,
        until every session has finished; per batch [(session index, message)], a session's first
        with the prompt's text when it was asked for (echo) and its ids when `prompt_ids`. Shared by Generate and SubmitWorkload: the client's deadline,
        dropped sessions and a client that goes away are handled here, once."""
        index = {sid: i for i, sid in enumerate(sub.session_ids)}
        unseen = set(sub.session_ids)
        open_ids = set(sub.session_ids)
        try:
            async for batch in batches(sub.events, context.time_remaining):
                out = []
                for sid, evs in by_session(batch).items():
                    first = sreqs[index[sid]] if sid in unseen else None  # the first carries the prompt
                    unseen.discard(sid)
                    msg = spb.GenerateEvent(session_id=sid)
                    if convert.fill_event(msg, evs, first, prompt_ids):
                        open_ids.discard(sid)
                    out.append((index[sid], msg))
                yield out
                if not open_ids:
                    return
        except asyncio.TimeoutError:  # (end_stream cancels the unfinished sessions)
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
        try:
            state = self._runtime.cancel(request.session_id, caller_identity(context))  # with its other choices
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

    # ---- reads ------------------------------------------------------------------------------

    async def GetTelemetry(self, request, context):
        await authorize_token(context, self._api_token)
        try:
            snap = await self._runtime.telemetry(request.workload_id, request.at_tick, context.time_remaining())
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, exc.args[0])
        except LookupError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.args[0])
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return convert.snapshot_to_pb(snap)

    async def ListWorkers(self, request, context):
        await authorize_token(context, self._api_token)
        resp = spb.ListWorkersResponse()
        for view in self._runtime.workers():
            convert.add_worker_pb(resp, view)
        return resp

    async def GetModelInfo(self, request, context):
        await authorize_token(context, self._api_token)
        info = self._runtime.worker_info()
        if info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "no worker has reported its model yet; retry once a worker is up"
            )
        assert info is not None  # (abort raised)
        p = self._prompts
        context = self._runtime.served_context() or info.model.max_position
        return convert.model_info_to_pb(
            info, self._served_model, p.tokenizer, p.eos_token_ids, p.supports_tools, kvfleet_version(), context
        )

    async def Tokenize(self, request, context):
        ids, tokens = await self._tokenizer_call(context, self._prompts.tokenize, request)
        return spb.TokenizeResponse(
            token_ids=ids, tokens=tokens, max_context_length=self._runtime.served_context() or 0
        )

    async def Detokenize(self, request, context):
        ids = list(request.token_ids)
        text = await self._tokenizer_call(context, self._prompts.detokenize, ids, request.skip_special_tokens)
        return spb.DetokenizeResponse(text=text)

    async def _tokenizer_call(self, context, fn: Callable[..., _T], *args) -> _T:
        """A tokenizer's work, off the event loop, with its refusals as status codes."""
        await authorize_token(context, self._api_token)
        try:
            return await asyncio.to_thread(fn, *args)
        except NoTokenizer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        raise AssertionError("unreachable: abort raises")


def _operation(req: spb.GenerateRequest) -> str:
    return "chat" if req.WhichOneof("prompt") == "chat" else "text_completion"

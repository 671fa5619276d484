"""One worker's open StepStream: the steps written in the order sent, each reply handed to the
step with its seq.

A unary Step call costs grpc aio a call set-up each way (on the 2-core Xeon about 280 us of the
caller's CPU and 650 us of wall time for a 2 KB round trip, against 160 and 280 us as a message
each way on an open stream; bench/README.md). The stream keeps a Step call's contract: each step
has its own deadline, and a step that passes it fails with DEADLINE_EXCEEDED as its call would.
Then the whole stream is cancelled, which the worker treats as every unanswered step's call
cancelled (a queued step never runs; a running one keeps the worker busy until it returns): the
scheduler marks the worker dead on that code anyway and recomputes its sessions elsewhere. A
stream that breaks (the worker gone) fails every unanswered step with the stream's status.

A stream is not kept for ever: the worker's server closes a connection at its age plus a grace
(kvfleet_common.grpcutil: a stream is sure of MAX_STREAM_S), and a stream cut so would fail the
steps in flight and mark a healthy worker dead. The client opens a new stream before then and
retires the old one (``retire``): it takes no more steps, and ends once those it took answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from scheduler_svc.worker_errors import WorkerCallFailed, connection_status

_CODES = {c.value[0]: c for c in grpc.StatusCode}  # a StepReply's code -> the status


class StepStream:
    def __init__(self, stub: wpb_grpc.WorkerStub, metadata: Sequence[tuple[str, str]], address: str) -> None:
        self._call = stub.StepStream(metadata=tuple(metadata))
        self._address = address  # for the errors
        self._loop = asyncio.get_running_loop()
        # seq -> the step's answer to come, and its deadline's timer
        self._waiting: dict[int, tuple[asyncio.Future[wpb.StepResponse], asyncio.TimerHandle]] = {}
        self._outbox: asyncio.Queue[wpb.StepRequest | None] = asyncio.Queue()  # None: retired
        self.broken: WorkerCallFailed | None = None  # set once: the stream takes no more steps
        self.opened = self._loop.time()
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())

    @property
    def age_s(self) -> float:
        return self._loop.time() - self.opened

    @property
    def ended(self) -> asyncio.Future[None]:
        """Done once the worker's replies stopped coming (the stream over, or broken)."""
        return self._reader

    def retire(self) -> None:
        """Take no more steps; close the sending side once those queued are written: the worker
        ends the stream once they have answered, and their replies still come here."""
        if self.broken is None:
            self.broken = self._failed(grpc.StatusCode.UNAVAILABLE, "the step stream was retired for a new one")
            self._outbox.put_nowait(None)

    def send(self, request: wpb.StepRequest, timeout: float) -> asyncio.Future[wpb.StepResponse]:
        """Queue the step (numbered: its seq is unique on the stream) to be written after those
        sent before it; its answer, or WorkerCallFailed with the status its call would have had."""
        answer: asyncio.Future[wpb.StepResponse] = self._loop.create_future()
        if self.broken is not None:
            answer.set_exception(self.broken)
            return answer
        timer = self._loop.call_later(timeout, self._expired, request.seq, timeout)
        self._waiting[request.seq] = (answer, timer)
        self._outbox.put_nowait(request)
        return answer

    async def _write(self) -> None:
        try:
            while (request := await self._outbox.get()) is not None:
                await self._call.write(request)
            await self._call.done_writing()
        except grpc.aio.AioRpcError as exc:
            self._fail(self._failed(*connection_status(exc.code(), exc.details() or "the step stream failed")))
        except asyncio.InvalidStateError:  # the call is over; the reader says why
            pass

    async def _read(self) -> None:
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    break
                entry = self._waiting.pop(reply.seq, None)
                if entry is not None:
                    answer, timer = entry
                    timer.cancel()
                    if answer.done():
                        pass
                    elif reply.code:  # the worker refused this step alone
                        code = _CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
                        answer.set_exception(self._failed(code, reply.details))
                    else:
                        answer.set_result(reply.response)
        except grpc.aio.AioRpcError as exc:
            self._fail(self._failed(*connection_status(exc.code(), exc.details() or "the step stream failed")))
            return
        self._fail(self._failed(grpc.StatusCode.UNAVAILABLE, "the worker ended the step stream"))

    def _expired(self, seq: int, timeout: float) -> None:
        entry = self._waiting.pop(seq, None)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(
                self._failed(grpc.StatusCode.DEADLINE_EXCEEDED, f"step {seq} got no answer within {timeout:g} s")
            )
        self._fail(
            self._failed(
                grpc.StatusCode.CANCELLED, f"step {seq} on the same stream passed its deadline ({timeout:g} s)"
            )
        )

    def _failed(self, code: grpc.StatusCode, details: str) -> WorkerCallFailed:
        return WorkerCallFailed(self._address, code, details)

    def _fail(self, why: WorkerCallFailed) -> None:
        """The stream takes no more steps: every unanswered one fails with ``why``."""
        if self.broken is None:
            self.broken = why
        waiting, self._waiting = self._waiting, {}
        for answer, timer in waiting.values():
            timer.cancel()
            if not answer.done():
                answer.set_exception(why)
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._writer, self._reader):
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        self._fail(self._failed(grpc.StatusCode.CANCELLED, "the scheduler closed the step stream"))
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

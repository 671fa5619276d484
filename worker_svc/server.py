"""The worker's gRPC adapter: pb -> engine values -> Engine.step -> pb."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvfleet.v1 import worker_pb2 as pb
from kvfleet.v1 import worker_pb2_grpc as pb_grpc
from kvfleet_common import grpcutil
from kvfleet_common.procinfo import private_bytes, resident_bytes
from kvfleet_common.security import WorkerAuthInterceptor, authorize_peer
from kvfleet_common.tracing import extract_context
from kvfleet_models.config import LlamaConfig
from kvfleet_models.gguf_blocks import BlockTensor
from worker_svc import convert
from worker_svc.config import WorkerConfig
from worker_svc.engine import Engine, EngineConfig, StepOutput
from worker_svc.metrics import WorkerMetrics
from worker_svc.spans import emit_step_spans
from worker_svc.step_order import StaleStep, StepOrder

if TYPE_CHECKING:
    from kvfleet_models.grammar import GrammarConstraint

log = logging.getLogger(__name__)
DRAINING = "the worker is shutting down: it takes no new steps; use another worker"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name


class StepRefused(Exception):
    """A step ends with this status (a Step call's abort; a StepReply's code on a stream)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def runs_inline(last_s: float, last_tokens: int, tokens: int, limit_s: float) -> bool:
    """Run a step on the event loop when the last one took under ``limit_s`` and this one has
    at most twice its tokens: health checks and other RPCs then wait about that long at most."""
    return last_s < limit_s and tokens <= 2 * max(last_tokens, 1)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        config: WorkerConfig,
        cfg: LlamaConfig,
        engine: Engine,
        metrics: WorkerMetrics | None = None,
        steps_inline: bool = False,
        executor: Executor | None = None,
    ) -> None:
        self._config = config
        # Where steps run: with ``steps_inline`` every one on the event loop's own thread under
        # the lock (``python -m worker_svc``, whose loop is the process's initial thread:
        # ``serve_on_main_thread``); else on ``executor``, one thread that runs them (and stats
        # reads) one at a time in the order queued (in-process clusters: one per worker); else
        # under the lock a step expected to be short on the loop, a longer one in a thread of
        # asyncio's default pool (servers built in-process).
        if steps_inline and executor is not None:
            raise ValueError("steps run inline or on an executor, not both")
        self._steps_inline = steps_inline
        self._executor = executor
        self.metrics = metrics or WorkerMetrics(engine)
        self._cfg = cfg
        self._engine = engine
        # One mutation of the engine (step, release) at a time: its KV books and views are not
        # thread-safe. Stats are read under it too, so they are never seen half-updated.
        self._lock = asyncio.Lock()
        self._order = StepOrder()  # numbered steps run in the scheduler's order
        # The thread of a step whose RPC was cancelled (deadline expired, client gone). A
        # thread cannot be stopped: the steps after it wait until it returns, and meanwhile GetInfo,
        # the scheduler's dead-worker probe, answers UNAVAILABLE so that the scheduler does not
        # take the worker back (and queue releases with short deadlines) before it is idle.
        self._abandoned: asyncio.Future[Any] | None = None
        # The last step's seconds and tokens: a step expected to be short runs on the event
        # loop itself, since handing it to a thread and back costs as much as a tiny step.
        self._last_step = (float("inf"), 0)
        # Changes at each start of the process: the scheduler's books are for one instance.
        self.instance_id = secrets.token_hex(8)
        self._draining = False  # see drain()
        self._drain_hooks: set[Callable[[], None]] = set()  # each open step stream's wake-up

    async def GetInfo(self, request, context):
        await authorize_peer(context, self._config.tls)
        if self._abandoned is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the worker is finishing a step whose deadline expired; retry shortly"
            )
        return convert.info_to_pb(
            self._config.worker_id,
            self._cfg,
            self._engine,
            self._config.block_size,
            self._engine.config.num_blocks,
            self.instance_id,
        )

    async def Step(self, request, context):
        await authorize_peer(context, self._config.tls)
        try:
            return await self._step(request, context.time_remaining(), context.invocation_metadata())
        except StepRefused as exc:
            await context.abort(exc.code, exc.details)

    async def StepStream(self, requests: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext) -> None:
        """Steps over one stream, each answered by a StepReply as it ends (see worker.proto). Each
        step runs as a Step call of its own would, in its own task; cancelling the stream (the
        caller gone, or its step deadline passed) cancels the steps not yet answered. Once the
        worker drains (``drain``), steps that come are refused as new calls are (UNAVAILABLE),
        and the stream ends when those it took have answered."""
        await authorize_peer(context, self._config.tls)
        replies: asyncio.Queue[pb.StepReply | None] = asyncio.Queue()  # None: look at the counts
        tasks: set[asyncio.Task[None]] = set()
        unanswered = 0  # steps taken whose reply is not queued yet
        closed = False  # the caller closed its side

        def answer(reply: pb.StepReply) -> None:
            nonlocal unanswered
            unanswered -= 1
            replies.put_nowait(reply)

        def refuse(seq: int, code: grpc.StatusCode, details: str) -> None:
            answer(pb.StepReply(seq=seq, code=code.value[0], details=details))

        async def one(request: pb.StepRequest) -> None:
            timeout = request.timeout_ms / 1000 if request.timeout_ms else None
            try:
                resp = await self._step(request, timeout, request.trace_context.items())
            except StepRefused as exc:
                refuse(request.seq, exc.code, exc.details)
            except Exception as exc:  # a fault of this adapter: the step still gets its answer
                log.exception("a streamed step failed")
                refuse(request.seq, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            else:
                answer(pb.StepReply(seq=request.seq, response=resp))

        async def read() -> None:
            nonlocal unanswered, closed
            # Tasks start in the order they are made, so the steps reach StepOrder in the order sent.
            async for request in requests:
                unanswered += 1
                if self._draining:
                    refuse(request.seq, grpc.StatusCode.UNAVAILABLE, DRAINING)
                    continue
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            closed = True
            replies.put_nowait(None)

        wake = functools.partial(replies.put_nowait, None)
        self._drain_hooks.add(wake)
        reader = asyncio.ensure_future(read())
        try:
            while True:
                reply = await replies.get()
                if reply is not None:
                    await context.write(reply)
                if unanswered == 0 and replies.empty() and (closed or self._draining):
                    break  # every step taken has its answer written
        finally:
            self._drain_hooks.discard(wake)
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    def drain(self) -> None:
        """The server is stopping: open step streams take no more steps, and end once the steps
        they took have answered (a stream kept open would hold the stop for its whole grace)."""
        self._draining = True
        for wake in list(self._drain_hooks):
            wake()

    async def _step(
        self, request: pb.StepRequest, time_remaining: float | None, trace_carrier: Iterable[tuple[str, str]]
    ) -> pb.StepResponse:
        """One step, for Step and StepStream alike; StepRefused says with what status it ends."""
        if request.instance_id and request.instance_id != self.instance_id:
            # Before its turn: a step for the instance before a restart would wait for a
            # predecessor this instance never saw.
            raise StepRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this worker restarted (instance {self.instance_id}; the step is for {request.instance_id}): "
                "the KV it held is gone; read GetInfo again and recompute its sessions",
            )
        try:
            # In the scheduler's order (it may send a step before the last one answered). From
            # here to queueing for the engine nothing awaits, so the order holds there.
            await self._order.turn(request.seq, request.reset, time_remaining)
        except StaleStep as exc:
            raise StepRefused(grpc.StatusCode.FAILED_PRECONDITION, f"stale step: {exc}; it was not run") from None
        except TimeoutError:
            raise StepRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"step {request.seq} came but step {request.seq - 1} of this scheduler never did: the steps "
                "cannot run in order; recompute this step's sessions",
            ) from None
        try:
            call = convert.step_from_pb(request)
        except ValueError as exc:
            raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            out, step_ns, wall_start, inline = await self._locked_step(call)
        except ValueError as exc:
            raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except Exception as exc:  # the batched forward failed; the engine freed the step's sessions
            log.exception("a step failed")
            raise StepRefused(
                grpc.StatusCode.INTERNAL, f"the step failed on the worker: {type(exc).__name__}: {exc}"
            ) from None
        if not inline:
            # A step queued behind this one (overlapped scheduling) takes the lock and goes to
            # its thread first: this one's spans and answer are built while it runs. After an
            # inline step nothing awaits before the answer is handed to gRPC: a step sent behind
            # it could otherwise block the loop first, and the scheduler would plan the tick
            # after that one a step late, the engine idle meanwhile.
            await asyncio.sleep(0)
        if not call.prefill and not call.decode:
            # Only a reset or releases (the scheduler frees finished sessions so when idle): no
            # model work to show, and no tick to hang under: written, each was a trace of its own.
            return convert.step_to_pb(out, step_ns, call.result_columns)
        kv_views = call.kv_views or self._config.kv_views
        attrs: dict[str, str | int] = {
            "kvfleet.worker.id": self._config.worker_id,
            "kvfleet.kv_views": kv_views.value,
            "kvfleet.step.prefill_items": len(call.prefill),
            "kvfleet.step.decode_items": len(call.decode),
        }
        if call.experiment_id:
            attrs["experiment.id"] = call.experiment_id
            attrs["experiment.arm"] = call.experiment_arm
        emit_step_spans(extract_context(trace_carrier), wall_start, out.profile, self._cfg.num_layers, attrs)
        return convert.step_to_pb(out, step_ns, call.result_columns)

    async def _locked_step(self, call: convert.StepCall) -> tuple[StepOutput, int, int, bool]:
        """Run the step; returns its output, wall ns, start (epoch ns: once it runs, so that
        a step queued behind another, as overlapped scheduling sends them, does not count its
        wait as work in its span) and whether it ran inline.

        It runs holding the lock, inline (on the event loop's thread) or in a thread. Waiting
        for the lock may be cancelled (nothing has changed yet). Once the step runs in a thread,
        a cancellation no longer releases the lock: ``_abandon`` keeps it until the thread
        returns. An inline step cannot be interrupted, being synchronous.
        """
        if self._executor is not None:
            return (*await self._queued_step(self._executor, call), False)
        await self._lock.acquire()
        handed_over = False
        try:
            wall_start, start = time.time_ns(), time.perf_counter_ns()
            inline = self._steps_inline or runs_inline(*self._last_step, call.tokens, self._config.inline_step_s)
            if inline:
                out = self._apply(call)
            else:
                thread = self._run_step(call)
                try:
                    out = await asyncio.shield(thread)
                except asyncio.CancelledError:
                    self._abandon(thread, start, call.tokens)
                    handed_over = True
                    raise
            step_ns = time.perf_counter_ns() - start
            self._ran(call, step_ns)
            return out, step_ns, wall_start, inline
        finally:
            if not handed_over:
                self._lock.release()

    async def _queued_step(self, executor: Executor, call: convert.StepCall) -> tuple[StepOutput, int, int]:
        """The step queued on the executor's thread, which runs its calls one at a time in the
        order they came. A step sent ahead (overlapped scheduling) is queued while the one before
        it runs and starts the moment that one ends, without this event loop.

        Cancelled while queued, the step never runs. Cancelled once running, it cannot be
        stopped: ``_abandon`` marks the worker busy until it returns (the steps queued behind it
        wait for it on the thread)."""
        queued = executor.submit(self._timed_apply, call)
        running = asyncio.wrap_future(queued)
        try:
            out, step_ns, wall_start = await asyncio.shield(running)
        except asyncio.CancelledError:
            if not queued.cancel():  # it runs (or just ran)
                self._abandon(running, time.perf_counter_ns(), call.tokens, release_lock=False)
            raise
        self._ran(call, step_ns)
        return out, step_ns, wall_start

    def _timed_apply(self, call: convert.StepCall) -> tuple[StepOutput, int, int]:
        wall_start, start = time.time_ns(), time.perf_counter_ns()
        out = self._apply(call)
        return out, time.perf_counter_ns() - start, wall_start

    def _ran(self, call: convert.StepCall, step_ns: int) -> None:
        """A step that ran: its time for the next inline choice, and the metrics."""
        self._last_step = (step_ns / 1e9, call.tokens)
        prefill_tokens = sum(len(p.token_ids) for p in call.prefill)
        self.metrics.observe_step(step_ns / 1e9, prefill_tokens, len(call.decode))

    def _run_step(self, call: convert.StepCall) -> asyncio.Future[StepOutput]:
        """The step (after its releases) in a thread (servers built in-process: tests)."""
        return asyncio.ensure_future(asyncio.to_thread(self._apply, call))

    def _apply(self, call: convert.StepCall) -> StepOutput:
        """Reset and releases, then the step itself."""
        if call.reset:
            dropped = self._engine.reset()
            if dropped:
                log.info("reset by the scheduler: forgot %d sessions", dropped)
        if call.release_session_ids:
            self._engine.release(call.release_session_ids)
        return self._engine.step(call.prefill, call.decode, kv_views=call.kv_views)

    def _abandon(self, thread: asyncio.Future[Any], start_ns: int, tokens: int, release_lock: bool = True) -> None:
        """The RPC of a running step was cancelled: the worker is busy (and, without an
        executor, holds the lock) until its thread returns."""
        log.warning("a step's RPC was cancelled while it ran; the worker waits for it to end")
        self._abandoned = thread

        def done(f: asyncio.Future[Any]) -> None:
            self._abandoned = None
            self._last_step = ((time.perf_counter_ns() - start_ns) / 1e9, tokens)
            self.metrics.refresh()
            if release_lock:
                self._lock.release()
            if not f.cancelled() and f.exception() is not None:
                log.warning("the abandoned step failed: %s", f.exception())

        thread.add_done_callback(done)

    async def GetStats(self, request, context):
        await authorize_peer(context, self._config.tls)
        if self._executor is not None:  # between two steps, where they run
            s = await asyncio.wrap_future(self._executor.submit(self._engine.stats))
        else:
            async with self._lock:  # between two steps
                s = self._engine.stats()
        return pb.WorkerStats(
            steps=s.steps,
            prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens,
            cache_misses=s.cache_misses,
            active_sessions=s.active_sessions,
            used_blocks=s.used_blocks,
            free_blocks=s.free_blocks,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            rss_bytes=resident_bytes(),
            private_bytes=private_bytes(),
            instance_id=self.instance_id,
        )


def build_engine(
    config: WorkerConfig, model: tuple[LlamaConfig, Mapping[str, np.ndarray | BlockTensor]] | None = None
) -> tuple[LlamaConfig, Engine]:
    """An engine for ``config``; ``model``: its config and weights already loaded (several
    in-process workers share one load; each engine prepares its own copy of the weights)."""
    from kvfleet_models.registry import load_model, load_model_blocks

    weights: Mapping[str, np.ndarray | BlockTensor]
    if model is not None:
        cfg, weights = model
    elif config.quant == "gguf":  # the file's own blocks, not floats
        cfg, weights = load_model_blocks(config.model)
    else:
        cfg, weights = load_model(config.model)
    from worker_svc.kv_memory import plan_pool
    from worker_svc.memory import MemoryPlan, release_freed_memory
    from worker_svc.platform import DTYPES, kv_cache_dtype, resolve_device

    # The pool is sized in the cache's own element type (float16 in the reduced-precision CPU modes).
    kv_dtype = kv_cache_dtype(resolve_device(config.device), DTYPES[config.dtype], config.quant, config.kv_dtype)
    elem = kv_dtype.itemsize
    kv = plan_pool(config.num_blocks, config.kv_cache_memory, config.block_size, cfg.kv_bytes_per_token(elem))
    engine = Engine(
        cfg,
        weights,
        EngineConfig(
            device=config.device,
            dtype=config.dtype,
            block_size=config.block_size,
            num_blocks=kv.num_blocks,
            kv_views=config.kv_views,
            num_threads=config.num_threads,
            quant=config.quant,
            prefix_caching=config.prefix_caching,
            max_model_len=config.max_model_len,
            kv_dtype=config.kv_dtype,
        ),
        constraint_factory=grammar_factory(config.model, cfg),
    )
    del weights, model  # the checkpoint's arrays: the engine holds its own (a caller's load is its own)
    release_freed_memory()
    weight_format = config.quant if config.quant != "none" else config.dtype
    plan = MemoryPlan(engine.weight_bytes, weight_format, kv, engine.kv_dtype_name)
    log.info(
        "memory: %s; resident now %.0f MB, of which its own %.0f MB",
        plan.describe(),
        resident_bytes() / 1e6,
        private_bytes() / 1e6,
    )
    return cfg, engine


def grammar_factory(model: str, cfg: LlamaConfig) -> Callable[[str, str], GrammarConstraint] | None:
    """Constrained decoding (response_format) over the model's vocabulary; None for a model
    without a tokenizer (tiny) or without an end-of-sequence id (a value could never end),
    whose sessions with a constraint are then refused (the scheduler refuses them first)."""
    from kvfleet_models.errors import ModelLoadError
    from kvfleet_models.grammar import constraint_eos, constraint_factory
    from kvfleet_models.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.for_model(model)
    except ModelLoadError:
        return None
    eos = constraint_eos(cfg.eos_token_ids, tokenizer.eos_token_ids)
    if not eos:
        log.info("model %s has no end-of-sequence id: constrained decoding (response_format) is off", cfg.name)
        return None
    return constraint_factory(tokenizer, cfg.vocab_size, eos)


async def create_server(
    config: WorkerConfig,
    loaded: tuple[LlamaConfig, Engine] | None = None,
    executor: Executor | None = None,
    steps_inline: bool = False,
):
    """Build and start the worker server; returns (server, port, health servicer).
    executor, steps_inline: where steps run (see ``WorkerServicer``)."""
    server, port, health, _ = await start_worker(config, loaded, executor, steps_inline)
    return server, port, health


async def start_worker(
    config: WorkerConfig,
    loaded: tuple[LlamaConfig, Engine] | None = None,
    executor: Executor | None = None,
    steps_inline: bool = False,
):
    """Build and start the worker server; returns (server, port, health servicer, worker
    servicer): call the last one's ``drain`` before stopping the server."""
    cfg, engine = loaded if loaded is not None else build_engine(config)
    # Every Worker RPC passes the TLS peer check and the scheduler's secret before it is handled.
    gate = WorkerAuthInterceptor(SERVICE_NAME, config.tls, config.worker_secret)
    server = grpc.aio.server(options=grpcutil.SERVER_OPTIONS, interceptors=[gate])
    servicer = WorkerServicer(config, cfg, engine, steps_inline=steps_inline, executor=executor)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health = grpcutil.add_health_and_reflection(server, [SERVICE_NAME])
    port = grpcutil.bind(server, config.host, config.port, config.tls)
    await server.start()
    from kvfleet_common.metrics import serve_metrics

    serve_metrics(servicer.metrics.registry, config.host, config.metrics_port)
    log.info(
        "worker %s serving %s on %s:%d (device %s, dtype %s, quant %s%s, fused CPU ops %s, whole steps %s, %s, "
        "%d %s KV blocks of %d)",
        config.worker_id,
        cfg.name,
        config.host,
        port,
        engine.device,
        engine.dtype_name,
        engine.quant,
        f" on {engine.model.kernel_level} kernels" if engine.model.kernel_level else "",
        f"on ({engine.model.fused.origin.value})" if engine.model.fused is not None else "off",
        "on" if engine.model.decode_stack is not None else "off",
        f"{engine.num_threads} thread{'s' if engine.num_threads != 1 else ''}",
        engine.config.num_blocks,
        engine.kv_dtype_name,
        config.block_size,
    )
    return server, port, health, servicer


async def _serve(config: WorkerConfig, loaded: tuple[LlamaConfig, Engine]) -> None:
    """Serve until SIGTERM or SIGINT, every step inline on this loop; then drain."""
    server, port, health, servicer = await start_worker(config, loaded, steps_inline=True)
    log.info("worker %s listening on %s:%d", config.worker_id, config.host, port)
    await grpcutil.wait_for_termination_signal()
    log.info("worker %s draining", config.worker_id)
    grpcutil.set_not_serving(health, [SERVICE_NAME])
    servicer.drain()
    await server.stop(config.drain_grace_s)


def serve_on_main_thread(config: WorkerConfig, loaded: tuple[LlamaConfig, Engine]) -> None:
    """Serve until SIGTERM or SIGINT, the event loop on this thread (the process's initial one,
    which loaded the model) and every step inline on it.

    torch's CPU kernels ran 1.5-2.5x slower called from any thread but the process's first, and
    once a second thread had run torch work the first one's were slow too (two OpenMP pools on
    the same cores; bench/README "Every mode"), so every torch call stays on this thread. The
    loop on the same thread (rather than a second thread handing each step over) saves the
    hand-overs between them and the GIL passing back and forth in every step: on the tiny
    sweep about 0.2 ms of the worker's CPU a tick (bench/README, session 21). The price: while
    a step runs the worker answers nothing else (GetInfo, health, GetStats wait for its end;
    steps sent ahead are read then), as a step could not be interrupted before either.
    """
    from kvfleet_common.tracing import run_traced

    asyncio.run(run_traced("kvfleet-worker", _serve(config, loaded)))

"""The scheduler service put together: its workers' clients, the core, the runtime that owns
it, the servicer (servicer.py), the gRPC server with health and reflection, the metrics port;
and its graceful stop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet_common import grpcutil
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.served_model import WorkersDisagree, fleet_mismatch
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.output import OutputProcessor
from scheduler_svc.prompts import PromptResolver
from scheduler_svc.runtime import RuntimeConfig, SchedulerRuntime
from scheduler_svc.servicer import SERVICE_NAME, SchedulerServicer
from scheduler_svc.spans import SchedulerSpans
from scheduler_svc.workers import WorkerClient

log = logging.getLogger(__name__)


async def create_server(config: SchedulerConfig):
    """Connect to the workers, then build and start the server. Returns (server, port, service)."""
    core = SchedulerCore(config.limits)
    clients = [WorkerClient.open(a, config.tls, config.worker_secret, config.step_stream) for a in config.workers]
    infos = await asyncio.gather(*(c.wait_ready(config.worker_connect_timeout_s) for c in clients))
    models = {f"{c.worker_id} at {c.address}": c.served_model() for c in clients}
    mismatch = fleet_mismatch(models)
    if mismatch:
        await asyncio.gather(*(c.close() for c in clients))
        raise WorkersDisagree(mismatch)
    if len({m.name for m in models.values()}) > 1:
        log.warning(
            "the workers name their (equal) model differently: %s",
            ", ".join(f"{w}: {m.name}" for w, m in models.items()),
        )
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
    spans = SchedulerSpans(served, step_spans=config.step_spans)
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
        served_model=next(iter(models.values())),
    )
    servicer = SchedulerServicer(runtime, prompts, config.api_token, served, config.experiments)
    server = grpc.aio.server(options=grpcutil.SERVER_OPTIONS)
    spb_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = grpcutil.add_health_and_reflection(server, [SERVICE_NAME])
    port = grpcutil.bind(server, config.host, config.port, config.tls)
    spans.serving_at(config.host, port)
    await server.start()
    runtime.start()
    from kvfleet_common.metrics import serve_metrics

    metrics.show(core.snapshot())
    metrics.read_live(core.snapshot, asyncio.get_running_loop())
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

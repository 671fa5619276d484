"""python -m scheduler_svc: run the scheduler in front of running workers."""

from __future__ import annotations

import asyncio
import os
import sys

from kvfleet_common.flags import FlagParser, add_switch
from kvfleet_common.logs import setup_logging
from kvfleet_common.parent_watch import exit_with_parent
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import SchedulerLimits
from scheduler_svc.prompts import PromptLimits


def parse_args(argv: list[str] | None = None) -> SchedulerConfig:
    env = os.environ.get
    d = SchedulerLimits()
    # Every flag's default is the config's. SchedulerConfig() itself cannot be built without a
    # worker address, so its defaults are read from the class (a dataclass keeps them there).
    c = SchedulerConfig
    p = FlagParser(prog="python -m scheduler_svc", description="kvfleet scheduler")
    p.add_argument("--host", env="KVFLEET_SCHEDULER_HOST", default=c.host)
    p.add_argument("--port", type=int, env="KVFLEET_SCHEDULER_PORT", default=c.port)
    p.add_argument("--workers", env="KVFLEET_WORKERS", default="", help="comma-separated worker addresses host:port")
    p.add_argument("--model", env="KVFLEET_MODEL", default=c.model, help="model name for the tokenizer")
    p.add_argument(
        "--served-model-name",
        env="KVFLEET_SERVED_MODEL_NAME",
        default=c.served_model_name,
        help="the model id clients see (GetModelInfo, spans, metrics); default: the workers' model name",
    )
    p.add_argument("--max-running", type=int, env="KVFLEET_MAX_RUNNING", default=d.max_running)
    p.add_argument(
        "--prefill-token-budget", type=int, env="KVFLEET_PREFILL_TOKEN_BUDGET", default=d.prefill_token_budget
    )
    p.add_argument(
        "--kv-budget-bytes",
        type=int,
        env="KVFLEET_KV_BUDGET_BYTES",
        default=d.kv_budget_bytes,
        help="KV bytes reserved across all workers at most (0 = no cap of the scheduler's: the workers' caches)",
    )
    p.add_argument("--max-queue-depth", type=int, env="KVFLEET_MAX_QUEUE_DEPTH", default=d.max_queue_depth)
    p.add_argument(
        "--max-queued-per-caller",
        type=int,
        env="KVFLEET_MAX_QUEUED_PER_CALLER",
        default=d.max_queued_per_caller,
        help="sessions one caller (token, certificate, or all anonymous callers together) may have queued",
    )
    p.add_argument("--max-prompt-tokens", type=int, env="KVFLEET_MAX_PROMPT_TOKENS", default=d.max_prompt_tokens)
    p.add_argument("--max-new-tokens", type=int, env="KVFLEET_MAX_NEW_TOKENS", default=d.max_new_tokens)
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        env="KVFLEET_MAX_PROMPT_BYTES",
        default=PromptLimits().max_prompt_bytes,
        help="text or chat prompt size limit in UTF-8 bytes, checked before tokenizing",
    )
    p.add_argument(
        "--max-priority",
        type=int,
        env="KVFLEET_MAX_PRIORITY",
        default=d.max_priority,
        help="priorities run from -N (most urgent) to N; 0 is the default",
    )
    p.add_argument(
        "--kv-policy",
        env="KVFLEET_KV_POLICY",
        default=d.kv_policy,
        choices=["reserve", "preempt"],
        help="reserve worst-case KV at admission, or preempt under KV pressure",
    )
    add_switch(
        p,
        "cache-aware-routing",
        d.cache_aware_routing,
        "place a session on the worker holding the longest cached prefix of its prompt (default on)",
        "place sessions on the least loaded worker only",
        env="KVFLEET_CACHE_AWARE_ROUTING",
    )
    p.add_argument(
        "--pack-step-ms",
        type=float,
        env="KVFLEET_PACK_STEP_MS",
        default=d.pack_step_ms,
        help="a worker whose steps take less than this (ms, the median of its last 8) takes new sessions "
        "before an idle one is used (0 = spread by load from the first session)",
    )
    add_switch(
        p,
        "overlap-scheduling",
        c.overlap_scheduling,
        "plan and send tick N+1 while tick N computes (tokens are the same; ticks differ)",
        "run one tick at a time: plan, step, apply (the reference's tick figures)",
        env="KVFLEET_OVERLAP_SCHEDULING",
    )
    add_switch(
        p,
        "step-stream",
        c.step_stream,
        "send each worker its steps over one open stream (where the worker serves it)",
        "send each step as a Step call of its own",
        env="KVFLEET_STEP_STREAM",
    )
    add_switch(
        p,
        "step-spans",
        c.step_spans,
        "with tracing on, a span per session per tick in the session's trace (its every step)",
        "no per-session step spans: a session's trace has its own spans, ticks link to it",
        env="KVFLEET_STEP_SPANS",
    )
    p.add_argument("--step-timeout", type=float, env="KVFLEET_STEP_TIMEOUT_S", default=c.step_timeout_s)
    p.add_argument(
        "--no-worker-wait",
        type=float,
        env="KVFLEET_NO_WORKER_WAIT_S",
        default=c.no_worker_wait_s,
        help="seconds sessions wait for a live worker before failing with UNAVAILABLE",
    )
    p.add_argument("--drain-grace", type=float, env="KVFLEET_DRAIN_GRACE_S", default=c.drain_grace_s)
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        env="KVFLEET_SCHEDULER_ALLOW_ANONYMOUS",
        help="listen beyond loopback without KVFLEET_API_TOKEN (anyone who reaches the port may generate); "
        "without this the scheduler refuses to start so",
    )
    p.add_argument(
        "--experiment-writers",
        env="KVFLEET_EXPERIMENT_WRITERS",
        default="",
        help="comma-separated client certificate names that may tag workloads with an experiment "
        "(as may callers sending $KVFLEET_EXPERIMENT_TOKEN as x-kvfleet-experiment-token)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        env="KVFLEET_METRICS_PORT",
        default=c.metrics_port,
        help="Prometheus /metrics port (0 = off)",
    )
    p.add_logging_flags()
    a = p.parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    limits = SchedulerLimits(
        max_running=a.max_running,
        prefill_token_budget=a.prefill_token_budget,
        kv_budget_bytes=a.kv_budget_bytes,
        max_queue_depth=a.max_queue_depth,
        max_queued_per_caller=a.max_queued_per_caller,
        max_prompt_tokens=a.max_prompt_tokens,
        max_new_tokens=a.max_new_tokens,
        kv_policy=a.kv_policy,
        max_priority=a.max_priority,
        cache_aware_routing=a.cache_aware_routing,
        pack_step_ms=a.pack_step_ms,
    )
    workers = tuple(w.strip() for w in a.workers.split(",") if w.strip())
    from kvfleet_common.security import TlsConfig, worker_secret_from_env

    return SchedulerConfig(
        tls=TlsConfig.from_env().checked(),
        api_token=env("KVFLEET_API_TOKEN", ""),
        worker_secret=worker_secret_from_env(),
        allow_anonymous=a.allow_anonymous,
        experiment_token=env("KVFLEET_EXPERIMENT_TOKEN", ""),
        experiment_writers=frozenset(n.strip() for n in a.experiment_writers.split(",") if n.strip()),
        host=a.host,
        port=a.port,
        workers=workers,
        limits=limits,
        model=a.model,
        served_model_name=a.served_model_name,
        prompt_limits=PromptLimits(max_prompt_bytes=a.max_prompt_bytes),
        step_timeout_s=a.step_timeout,
        drain_grace_s=a.drain_grace,
        metrics_port=a.metrics_port,
        no_worker_wait_s=a.no_worker_wait,
        overlap_scheduling=a.overlap_scheduling,
        step_stream=a.step_stream,
        step_spans=a.step_spans,
    )


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        sys.exit(f"scheduler: {exc}")
    from kvfleet_common.listen import CannotListen, check_ports
    from kvfleet_models.errors import ModelLoadError
    from scheduler_svc.core.served_model import WorkersDisagree
    from scheduler_svc.server import serve

    exit_with_parent()
    try:
        # Now, not after the wait for the workers (up to a minute) that comes before the binds.
        check_ports(
            config.host,
            (("gRPC", config.port, "--port"), ("Prometheus /metrics", config.metrics_port, "--metrics-port")),
        )
        asyncio.run(serve(config))
    except (ConnectionError, WorkersDisagree, CannotListen) as exc:
        sys.exit(f"scheduler: {exc}")
    except ModelLoadError as exc:  # the model's tokenizer is there but unreadable
        sys.exit(f"scheduler: cannot load the model's tokenizer: {exc}")


if __name__ == "__main__":
    main()

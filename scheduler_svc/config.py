"""Scheduler settings, built once in the entry point from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_common.security import TlsConfig, check_worker_secret, is_loopback
from scheduler_svc.core import SchedulerLimits
from scheduler_svc.experiments import ExperimentWriters
from scheduler_svc.prompts import PromptLimits


@dataclass(frozen=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    workers: tuple[str, ...] = ()  # worker addresses host:port
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    prompt_limits: PromptLimits = field(default_factory=PromptLimits)
    model: str | None = None  # for the tokenizer; None = ask the workers
    served_model_name: str = ""  # the model id clients see (GetModelInfo, spans); "" = the workers' model name
    step_timeout_s: float = 30.0  # a worker step slower than this marks the worker dead
    worker_connect_timeout_s: float = 60.0  # how long start-up waits for the workers
    health_interval_s: float = 1.0  # how often dead workers are probed
    no_worker_wait_s: float = 30.0  # sessions wait this long for a live worker, then UNAVAILABLE
    stats_interval_s: float = 10.0  # how often workers' memory (GetStats) is read for ListWorkers
    # Plan and send tick N+1 while tick N computes (scheduler_svc.runtime). On: it measured ahead
    # or level at every batch, most at large ones (bench/README.md, bench.control_plane). Off: one
    # tick at a time, the tick figures of the sweep reference (the tokens are the same either way).
    overlap_scheduling: bool = True
    # Each worker's steps over one StepStream, where the worker serves it (scheduler_svc.step_stream):
    # about half the RPC's CPU a step. Off: a unary Step call a step.
    step_stream: bool = True
    # A step_prefill / step_decode span per session per tick (with tracing on): a request's own
    # trace shows every step it took part in. They are most of the spans at high concurrency: at
    # c=64 on the tiny model, ticks/s were 1.4-1.9x higher without them (bench/README).
    step_spans: bool = True
    drain_grace_s: float = 10.0
    metrics_port: int = 9400  # Prometheus /metrics; 0 = off
    tls: TlsConfig = field(default_factory=TlsConfig)  # serving, and dialling the workers
    api_token: str = ""  # clients must send "authorization: Bearer <token>"
    # Sent on every worker call (KVFLEET_WORKER_SECRET); "" = none. repr=False: kept out of logs.
    worker_secret: str = field(default="", repr=False)
    # Serve beyond loopback without a token (callers share one identity): only when told so.
    allow_anonymous: bool = False
    # Who may tag workloads with an experiment (see scheduler_svc.experiments.ExperimentWriters):
    # callers sending this token as x-kvfleet-experiment-token (KVFLEET_EXPERIMENT_TOKEN) ...
    experiment_token: str = field(default="", repr=False)
    # ... and callers whose client certificate has one of these common names (KVFLEET_EXPERIMENT_WRITERS).
    experiment_writers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.workers:
            raise ValueError("the scheduler needs at least one worker address (--workers host:port,...)")
        for a in self.workers:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"worker address {a!r} must be host:port, the port a number in 1..65535")
        if len(self.served_model_name) > 256 or not self.served_model_name.isprintable():
            raise ValueError("served_model_name must be at most 256 printable characters")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive")
        check_worker_secret(self.worker_secret)
        ExperimentWriters(self.experiment_token, self.experiment_writers)  # refuses a short token
        identified = bool(self.api_token) or (self.tls.serves_tls and self.tls.client_auth)
        if not is_loopback(self.host) and not identified and not self.allow_anonymous:
            raise ValueError(
                f"listening on {self.host or 'every interface'} (beyond loopback) without a token would let "
                "anyone who reaches the port generate, and cancel other anonymous callers' sessions: set "
                "KVFLEET_API_TOKEN, or require client certificates (KVFLEET_TLS_CLIENT_AUTH=true with TLS), "
                "or --allow-anonymous (KVFLEET_SCHEDULER_ALLOW_ANONYMOUS=true) if an open scheduler is meant, "
                "or listen on 127.0.0.1"
            )

    @property
    def experiments(self) -> ExperimentWriters:
        return ExperimentWriters(self.experiment_token, self.experiment_writers, is_loopback(self.host))

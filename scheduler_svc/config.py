"""Scheduler settings, built once in the entry point from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_common.security import TlsConfig
from scheduler_svc.core import SchedulerLimits
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
    reconcile_interval_s: float = 10.0  # how often workers' held sessions are checked for orphans
    drain_grace_s: float = 10.0
    metrics_port: int = 9400  # Prometheus /metrics; 0 = off
    tls: TlsConfig = field(default_factory=TlsConfig)  # serving, and dialling the workers
    api_token: str = ""  # clients must send "authorization: Bearer <token>"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.workers:
            raise ValueError("the scheduler needs at least one worker address (--workers host:port,...)")
        for a in self.workers:
            if ":" not in a:
                raise ValueError(f"worker address {a!r} must be host:port")
        if len(self.served_model_name) > 256 or not self.served_model_name.isprintable():
            raise ValueError("served_model_name must be at most 256 printable characters")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive")

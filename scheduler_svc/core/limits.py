"""The scheduler's configurable limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int = 64  # concurrency: sessions admitted and not finished
    prefill_token_budget: int = 512  # prompt tokens prefilled per tick (longer prompts chunk)
    # KV bytes the scheduler reserves across all workers at most; 0: no cap of its own, the live
    # workers' caches are the budget (64 MiB, the reference sweep's, would hold 5 SmolLM2 sessions
    # of 256 tokens and refuse any request of more than 1,456 tokens on workers of 65,536).
    kv_budget_bytes: int = 0
    max_queue_depth: int = 1024
    # Sessions one caller (token, certificate or anonymous: see the servicer's caller_identity) may
    # have waiting at once, so one caller cannot fill the queue for all. Half the default queue;
    # at or above max_queue_depth it has no effect.
    max_queued_per_caller: int = 512
    # Events a stream may hold unread, per session of the stream (a Generate's n choices, a
    # workload's sessions share one stream). A client that stops reading lets gRPC's flow-control
    # window fill, then this backlog; past it the stream ends with RESOURCE_EXHAUSTED and its
    # sessions are cancelled (their KV freed) instead of buffering for ever.
    max_stream_backlog: int = 1024
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 2048
    # "reserve": admission reserves each session's worst-case KV, so no step ever runs out.
    # "preempt": admission reserves what the prompt needs; when a decode step cannot grow, the
    # least urgent, most recently admitted session on that worker is preempted (recomputed later).
    kv_policy: str = "reserve"
    # Priorities run from -max_priority (most urgent) to +max_priority; 0 is the default.
    max_priority: int = 10
    # A session whose worker fails (a transport error, a timeout or a restart: it moves to another
    # worker), whose whole step fails (the worker stays in use), or that its worker did not hold
    # as the books say, is recomputed at most this many times;
    # then it ends with UNAVAILABLE and a message that says so, rather than bounce for ever.
    max_moves: int = 3
    # Place a session on the worker whose prefix cache holds the longest part of its prompt
    # (then the least loaded); False = the least loaded only (the A/B peer of bench.prefix_cache).
    cache_aware_routing: bool = True
    # Packing: a worker whose recent steps took less than this (milliseconds, the median of the
    # last 8 step times it reported) takes new sessions before an idle worker is used (after the
    # cached prefix; the fullest such worker first, until half its KV is held; then the least
    # loaded). Every worker a tick uses costs the tick a step round trip (about 0.5-1 ms of CPU
    # on the scheduler's and the worker's side here) and a wait on the slowest, so spreading
    # steps shorter than that buys nothing; longer steps (SmolLM2's on a CPU, 40 ms) spread,
    # their compute in parallel.
    # 0 = spread from the first session (the least loaded). bench/README: "Packing cheap steps".
    pack_step_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.kv_policy not in ("reserve", "preempt"):
            raise ValueError(f"kv_policy must be 'reserve' or 'preempt', got {self.kv_policy!r}")
        for name in (
            "max_running",
            "prefill_token_budget",
            "max_queue_depth",
            "max_queued_per_caller",
            "max_stream_backlog",
            "max_prompt_tokens",
            "max_new_tokens",
            "max_priority",
            "max_moves",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.pack_step_ms, int | float) or not 0 <= self.pack_step_ms < float("inf"):
            raise ValueError(f"pack_step_ms must be 0 (no packing) or a positive number, got {self.pack_step_ms!r}")
        if not isinstance(self.kv_budget_bytes, int) or self.kv_budget_bytes < 0:
            raise ValueError(
                f"kv_budget_bytes must be 0 (the workers' caches) or positive, got {self.kv_budget_bytes!r}"
            )

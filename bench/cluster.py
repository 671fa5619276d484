"""A benchmark cluster: scheduler + N workers + telemetry as local processes, sized for the
workload, and the measurements taken through it."""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.load import run_load, summarize
from bench.ticks import tick_breakdown, wait_for_spans
from bench.workload import Session
from kvfleet.local_cluster import ClusterSpec, LocalCluster

# Admission's KV budget is bookkeeping on the scheduler; the workers' caches are the real limit.
_KV_BUDGET_BYTES = 64 * 1024**3


@dataclass(frozen=True)
class ClusterOptions:
    workers: int
    worker_threads: int          # intra-op threads of each worker process (OMP_NUM_THREADS)
    model: str
    device: str
    dtype: str
    kv_views: str
    prefill_token_budget: int
    max_concurrency: int
    max_session_tokens: int      # longest prompt + output of the workload
    block_size: int = 16

    @property
    def name(self) -> str:
        return f"cluster-{self.workers}w"

    def spec(self) -> ClusterSpec:
        per_session = -(-self.max_session_tokens // self.block_size)
        # Any worker may be given every session at once; a little slack for the warm-up.
        num_blocks = per_session * self.max_concurrency + 64
        env = {"OMP_NUM_THREADS": str(self.worker_threads),
               "MKL_NUM_THREADS": str(self.worker_threads),
               "KVFLEET_KV_BUDGET_BYTES": str(_KV_BUDGET_BYTES)}
        return ClusterSpec(workers=self.workers, model=self.model, device=self.device,
                           dtype=self.dtype, max_running=max(64, self.max_concurrency),
                           prefill_token_budget=self.prefill_token_budget, num_blocks=num_blocks,
                           block_size=self.block_size, kv_views=self.kv_views, telemetry=True,
                           extra_env=env)


class BenchCluster:
    def __init__(self, options: ClusterOptions, progress: Callable[[str], None]) -> None:
        self.options = options
        self.progress = progress
        self.cluster = LocalCluster(options.spec())

    def start(self, warm: Sequence[Session]) -> "BenchCluster":
        self.cluster.start()
        # One short session per worker (placement spreads them) so that first-step costs
        # (page faults on fresh cache pages, lazy initialisation) are not in the measurements.
        run_load(self.cluster.scheduler_address, warm, len(warm))
        return self

    def stop(self) -> None:
        self.cluster.stop()

    def run(self, sessions: Sequence[Session], concurrency: int, breakdown: bool) -> dict:
        name = self.options.name
        result = run_load(self.cluster.scheduler_address, sessions, concurrency,
                          progress=lambda m: self.progress(f"{name} c={concurrency}: {m}"))
        row = summarize(result, sessions)
        if breakdown:
            db = self.cluster.log_dir / "telemetry.db"
            wait_for_spans(db)
            row["tick_breakdown"] = tick_breakdown(db, result.start_epoch_ns, result.end_epoch_ns)
        return row


def default_worker_threads(device: str, workers: int) -> int:
    """One intra-op thread per worker on a CPU: see bench/README.md for the measurements."""
    del workers
    return 1 if device == "cpu" else max(1, (os.cpu_count() or 1))

"""A benchmark cluster: scheduler + N workers + telemetry as local processes, sized for the
workload, and the measurements taken through it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.load import run_load, summarize
from bench.memory import worker_memory
from bench.ticks import tick_breakdown, wait_for_spans
from bench.workload import Session
from kvfleet.local_cluster import ClusterSpec, LocalCluster

# Admission's KV budget is bookkeeping on the scheduler; the workers' caches are the real limit.
_KV_BUDGET_BYTES = 64 * 1024**3


@dataclass(frozen=True)
class ClusterOptions:
    workers: int
    worker_threads: int  # intra-op threads of each worker process (OMP_NUM_THREADS)
    model: str
    device: str
    dtype: str
    kv_views: str
    prefill_token_budget: int
    max_concurrency: int
    max_session_tokens: int  # longest prompt + output of the workload
    block_size: int = 16
    quant: str = "none"
    kv_dtype: str = "auto"  # workers' --kv-dtype
    mode: str = ""  # the engine mode's name where a run measures several side by side

    @property
    def name(self) -> str:
        return f"cluster-{self.workers}w" + (f"-{self.mode}" if self.mode else "")

    @property
    def num_blocks(self) -> int:
        # Any worker may be given every session at once; a little slack for the warm-up.
        return -(-self.max_session_tokens // self.block_size) * self.max_concurrency + 64

    def spec(self) -> ClusterSpec:
        env = {
            "OMP_NUM_THREADS": str(self.worker_threads),
            "MKL_NUM_THREADS": str(self.worker_threads),
            "KVFLEET_KV_BUDGET_BYTES": str(_KV_BUDGET_BYTES),
        }
        return ClusterSpec(
            workers=self.workers,
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            quant=self.quant,
            max_running=max(64, self.max_concurrency),
            prefill_token_budget=self.prefill_token_budget,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            kv_views=self.kv_views,
            kv_dtype=self.kv_dtype,
            telemetry=True,
            extra_env=env,
        )


class BenchCluster:
    def __init__(self, options: ClusterOptions, progress: Callable[[str], None]) -> None:
        self.options = options
        self.progress = progress
        self.cluster = LocalCluster(options.spec())
        self.idle_memory: list[dict] = []

    def start(self, warm: Sequence[Session]) -> "BenchCluster":
        self.cluster.start()
        # One short session per worker (placement spreads them) so that first-step costs
        # (page faults on fresh cache pages, lazy initialisation) are not in the measurements.
        run_load(self.cluster.scheduler_address, warm, len(warm))
        self.idle_memory = self.memory()  # after the warm-up, before any measured load
        return self

    def memory(self) -> list[dict]:
        """Each worker's RSS now beside issue 25's bound (bench.memory)."""
        return [worker_memory(a, f"worker-{i}").row() for i, a in enumerate(self.cluster.worker_addresses)]

    def stop(self) -> None:
        self.cluster.stop()

    def worker_memory(self) -> dict[str, dict[str, int]]:
        """Each worker process's resident memory now and its peak (VmRSS, VmHWM), in bytes."""
        out = {}
        for name, proc in self.cluster.procs.items():
            if not name.startswith("worker-"):
                continue
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines() if ":" in line
            )
            out[name] = {str(k): int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM") if k in fields}
        return out

    def run(self, sessions: Sequence[Session], concurrency: int, breakdown: bool) -> dict:
        name = self.options.name
        result = run_load(
            self.cluster.scheduler_address,
            sessions,
            concurrency,
            progress=lambda m: self.progress(f"{name} c={concurrency}: {m}"),
        )
        row = summarize(result, sessions)
        row["worker_memory"] = self.memory()  # just after the load: its sessions' KV released
        if breakdown:
            db = self.cluster.log_dir / "telemetry.db"
            wait_for_spans(db)
            row["tick_breakdown"] = tick_breakdown(db, result.start_epoch_ns, result.end_epoch_ns)
        return row


def default_worker_threads(device: str, workers: int, cores: int, probe: dict | None) -> int:
    """Intra-op threads per worker when not given.

    On a CPU, one thread per worker unless this run's engine probe found the cores a worker would
    get faster than one thread for a prefill chunk (by over 15 %: the compute-bound work that
    dominates batched steps) without making batch-1 decode over 10 % slower. On the shared
    2-core machine which wins changes with the other tenants: with any other process running, a
    second thread waits at barriers for a core (batch-1 decode 18.2 vs 2.5 tok/s, the peer's
    short batch 0.6 vs 14.6 s); on an idle machine two threads multiply ~1.8x faster.
    """
    if device != "cpu":
        return max(1, cores // workers)
    per_worker = max(1, cores // workers)
    if probe and per_worker > 1:
        decode = {int(k): v for k, v in probe.get("tok_s_by_threads", {}).items()}
        prefill = {int(k): v for k, v in probe.get("prefill_tok_s_by_threads", {}).items()}
        if (
            1 in prefill
            and per_worker in prefill
            and prefill[per_worker] > 1.15 * prefill[1]
            and decode.get(per_worker, 0.0) >= 0.9 * decode.get(1, 0.0)
        ):
            return per_worker
    return 1

"""Ticks per second of the tiny-model concurrency sweep (`kvfleet sweep`) through a LocalCluster.

The sweep's own workload (8 sessions, 4-token prompts, 8 new tokens, prefill budget 4, at
concurrency 1, 2, 4, 8) on the default two-worker cluster; the rate is the ticks the scheduler
reports in the sweep results over the client's wall time for them, repeated to steady it; with
it each process's CPU milliseconds per tick and the rate they allow (``bench.cpu_time``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench import cpu_time
from kvfleet.client import SchedulerClient
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.sweep import SweepSpec, make_prompts, run_one


def sweep_ticks_per_s(
    repeats: int = 5,
    workers: int = 2,
    extra_env: dict[str, str] | None = None,
    progress: Callable[[str], None] = lambda m: None,
    overlap: bool = ClusterSpec.overlap_scheduling,
    step_spans: bool = ClusterSpec.step_spans,
) -> dict:
    spec = SweepSpec()
    cluster_spec = ClusterSpec(
        workers=workers,
        model="tiny",
        extra_env=dict(extra_env or {}),
        overlap_scheduling=overlap,
        step_spans=step_spans,
    )
    with LocalCluster(cluster_spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        prompts = make_prompts(spec, client.list_workers()[0].vocab_size)
        run_one(client, spec, prompts, spec.concurrency[-1])  # warm-up
        pids = {name: cluster.pid(name) for name in cluster.procs}
        runs, cpu_runs = [], []
        for r in range(repeats):
            ticks, wall = 0, 0.0
            cpu_before = cpu_time.snapshot(pids)
            for c in spec.concurrency:
                t0 = time.perf_counter()
                _, stats, _ = run_one(client, spec, prompts, c)
                wall += time.perf_counter() - t0
                ticks += stats.ticks
            runs.append(ticks / wall)
            cpu_runs.append(cpu_time.per_tick_ms(cpu_before, cpu_time.snapshot(pids), ticks))
            progress(f"sweep repeat {r + 1}/{repeats}: {ticks} ticks, {ticks / wall:.0f} ticks/s")
    runs.sort()
    cpu = {name: round(statistics.median(r[name] for r in cpu_runs), 3) for name in cpu_runs[0]}
    return {
        "ticks_per_sweep": ticks,
        "repeats": repeats,
        "workers": workers,
        "overlap_scheduling": overlap,
        "ticks_per_s_median": round(runs[len(runs) // 2], 1),
        "ticks_per_s_best": round(runs[-1], 1),
        "cpu_ms_per_tick": cpu,
        "ticks_per_s_ceiling": cpu_time.tick_ceiling(cpu["total"]),
    }

"""Ticks per second of the tiny-model concurrency sweep (`kvfleet sweep`) through a LocalCluster.

The sweep's own workload (8 sessions, 4-token prompts, 8 new tokens, prefill budget 4, at
concurrency 1, 2, 4, 8) on the default two-worker cluster; the rate is the ticks the scheduler
reports in the sweep results over the client's wall time for them, repeated to steady it; with
it each process's CPU milliseconds per tick and the rate they allow (``bench.cpu_time``), and
the rate the workers' steps alone allow: from each repeat's spans (``bench.ticks``), the mean of
a tick's slowest ``worker_step``, and 1000 / that. A control plane that cost nothing would run
the sweep at that rate, so it bounds what control-plane work can reach on the machine (the
steps are the cluster's own, slowed as they are by the processes beside them). Beside it, the
same for the rest of a tick (its period less that step: the scheduler and the RPCs where they
do not overlap the step): the rate an engine that cost nothing would allow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench import cpu_time
from bench.ticks import tick_breakdown, wait_for_spans
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
    pack_step_ms: float = ClusterSpec.pack_step_ms,
) -> dict:
    spec = SweepSpec()
    cluster_spec = ClusterSpec(
        workers=workers,
        model="tiny",
        extra_env=dict(extra_env or {}),
        overlap_scheduling=overlap,
        step_spans=step_spans,
        pack_step_ms=pack_step_ms,
    )
    with LocalCluster(cluster_spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        prompts = make_prompts(spec, client.list_workers()[0].vocab_size)
        run_one(client, spec, prompts, spec.concurrency[-1])  # warm-up
        pids = {name: cluster.pid(name) for name in cluster.procs}
        runs, cpu_runs, step_ms, rest_ms = [], [], [], []
        db = cluster.log_dir / "telemetry.db"
        for r in range(repeats):
            ticks, wall = 0, 0.0
            start_ns = time.time_ns()
            cpu_before = cpu_time.snapshot(pids)
            for c in spec.concurrency:
                t0 = time.perf_counter()
                _, stats, _ = run_one(client, spec, prompts, c)
                wall += time.perf_counter() - t0
                ticks += stats.ticks
            runs.append(ticks / wall)
            cpu_runs.append(cpu_time.per_tick_ms(cpu_before, cpu_time.snapshot(pids), ticks))
            if cluster_spec.telemetry:  # the spans settle between repeats, outside the timed part
                wait_for_spans(db)
                brk = tick_breakdown(db, start_ns, time.time_ns())
                step_ms.append(brk.get("worker_step_ms"))
                rest_ms.append(brk.get("scheduler_rpc_ms"))
            progress(f"sweep repeat {r + 1}/{repeats}: {ticks} ticks, {ticks / wall:.0f} ticks/s")
    runs.sort()
    cpu = {name: round(statistics.median(r[name] for r in cpu_runs), 3) for name in cpu_runs[0]}
    step_median, rest_median = _median(step_ms), _median(rest_ms)
    return {
        "ticks_per_sweep": ticks,
        "repeats": repeats,
        "workers": workers,
        "overlap_scheduling": overlap,
        "pack_step_ms": pack_step_ms,
        "ticks_per_s_median": round(runs[len(runs) // 2], 1),
        "ticks_per_s_best": round(runs[-1], 1),
        "cpu_ms_per_tick": cpu,
        "ticks_per_s_ceiling": cpu_time.tick_ceiling(cpu["total"]),
        # The slowest worker step of a tick and the rest of its period (means over a repeat;
        # medians of repeats), and the rate each alone allows: None without telemetry's spans.
        "worker_step_ms": step_median,
        "ticks_per_s_engine_bound": round(1000 / step_median, 1) if step_median else None,
        "scheduler_rpc_ms": rest_median,
        "ticks_per_s_control_plane_bound": round(1000 / rest_median, 1) if rest_median else None,
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v]
    return round(statistics.median(known), 3) if known else None

"""Ticks per second of the tiny-model concurrency sweep (`kvfleet sweep`) through a LocalCluster.

The sweep's own workload (8 sessions, 4-token prompts, 8 new tokens, prefill budget 4, at
concurrency 1, 2, 4, 8) on the default two-worker cluster; the rate is the ticks the scheduler
reports in the sweep results over the client's wall time for them, repeated to steady it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfleet.client import SchedulerClient
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.sweep import SweepSpec, make_prompts, run_one


def sweep_ticks_per_s(
    repeats: int = 5,
    workers: int = 2,
    extra_env: dict[str, str] | None = None,
    progress: Callable[[str], None] = lambda m: None,
    overlap: bool = ClusterSpec.overlap_scheduling,
) -> dict:
    spec = SweepSpec()
    cluster_spec = ClusterSpec(
        workers=workers, model="tiny", extra_env=dict(extra_env or {}), overlap_scheduling=overlap
    )
    with LocalCluster(cluster_spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        prompts = make_prompts(spec, client.list_workers()[0].vocab_size)
        run_one(client, spec, prompts, spec.concurrency[-1])  # warm-up
        runs = []
        for r in range(repeats):
            ticks, wall = 0, 0.0
            for c in spec.concurrency:
                t0 = time.perf_counter()
                _, stats, _ = run_one(client, spec, prompts, c)
                wall += time.perf_counter() - t0
                ticks += stats.ticks
            runs.append(ticks / wall)
            progress(f"sweep repeat {r + 1}/{repeats}: {ticks} ticks, {ticks / wall:.0f} ticks/s")
    runs.sort()
    return {
        "ticks_per_sweep": ticks,
        "repeats": repeats,
        "workers": workers,
        "overlap_scheduling": overlap,
        "ticks_per_s_median": round(runs[len(runs) // 2], 1),
        "ticks_per_s_best": round(runs[-1], 1),
    }

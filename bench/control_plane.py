"""python -m bench.control_plane: how much of a tick the control plane (the scheduler and the
Step round trip) takes, against the engine alone in the same run.

Tiny model, one worker, concurrency c in ``--concurrency`` (1, 64, 256): c sessions of 4-token
prompts decode ``--new-tokens`` tokens each as one workload (prefill budget 4c, so all start in
one tick). Per c: ticks/s through the cluster (the workload's ticks over its wall time), the
engine's own steps/s on the same batch driven in-process (``LocalSteps``: no scheduler, no RPC),
their ratio, and from the spans the cluster exported: the worker's idle gap between steps
(start of a ``worker_step`` - end of the previous one; median and p90) and the scheduler + RPC
share of a tick (``bench.ticks``). Then SmolLM2 at batch 1 (``--smollm2-tokens``; skipped with
``--no-smollm2``): the same share, where a step is a real model's decode.

The issue's targets: idle gap median <= 0.5 ms at c=64, scheduler + RPC <= 5 % at batch 1 on
SmolLM2, >= 500 ticks/s on the tiny sweep (``bench.sweep_rate``) -- all with overlapped
scheduling, which kvfleet does not do yet: this measures where it stands without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

from bench.ticks import _rows, tick_breakdown, wait_for_spans  # noqa: E402
from kvfleet.client import SchedulerClient  # noqa: E402
from kvfleet.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from kvfleet.v1 import scheduler_pb2 as spb  # noqa: E402


def _prompts(c: int, vocab: int) -> list[list[int]]:
    return [[(7 * k + i) % vocab for i in range(4)] for k in range(c)]


def worker_gaps(db: Path, start_ns: int, end_ns: int) -> dict:
    """The worker's idle time between consecutive steps in the window (one worker)."""
    steps = _rows(
        db,
        "SELECT start_ns, end_ns FROM spans WHERE name = 'worker_step' AND start_ns >= ? AND start_ns <= ? "
        "ORDER BY start_ns",
        (start_ns, end_ns),
    )
    gaps = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    if not gaps:
        return {"steps": len(steps)}
    gaps.sort()
    return {
        "steps": len(steps),
        "idle_gap_ms_median": round(statistics.median(gaps) / 1e6, 3),
        "idle_gap_ms_p90": round(gaps[int(0.9 * (len(gaps) - 1))] / 1e6, 3),
    }


def cluster_run(client: SchedulerClient, db: Path, c: int, new_tokens: int, vocab: int) -> dict[str, Any]:
    req = spb.WorkloadRequest(policy=spb.WorkloadPolicy(max_running=c, prefill_token_budget=4 * c))
    for p in _prompts(c, vocab):
        req.sessions.add(prompt_ids=spb.TokenIds(ids=p), max_new_tokens=new_tokens, ignore_eos=True)
    start_ns, t0 = time.time_ns(), time.perf_counter()
    stats = None
    for ev in client.submit_workload(req):
        if ev.done:
            stats = ev.stats
    wall = time.perf_counter() - t0
    end_ns = time.time_ns()
    if stats is None:
        raise RuntimeError("the workload ended without its stats")
    wait_for_spans(db)
    row: dict[str, Any] = {"ticks": stats.ticks, "ticks_per_s": round(stats.ticks / wall, 1)}
    row.update(worker_gaps(db, start_ns, end_ns))
    brk = tick_breakdown(db, start_ns, end_ns)
    row["worker_step_ms"] = brk.get("worker_step_ms")
    row["scheduler_rpc_ms"] = brk.get("scheduler_rpc_ms")
    row["scheduler_rpc_share"] = brk.get("scheduler_rpc_share")
    return row


def _token(token_id: int | None) -> int:
    if token_id is None:
        raise RuntimeError("the engine sampled no token for a decode")
    return token_id


def engine_steps_per_s(model: str, c: int, new_tokens: int, threads: int) -> float:
    """The same batch on the engine alone: c prefills in one step, then lockstep decodes."""
    from kvfleet_models.registry import load_model
    from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
    from worker_svc.local import LocalSteps

    cfg, weights = load_model(model)
    engine = Engine(cfg, weights, EngineConfig(num_blocks=max(64, c * 4), num_threads=threads))
    steps = LocalSteps(engine, prefix_caching=False)
    greedy = SamplingSpec()
    prompts = _prompts(c, cfg.vocab_size)
    t0 = time.perf_counter()
    out = steps.step([PrefillItem(f"s{k}", tuple(p), 0, True, greedy) for k, p in enumerate(prompts)], [])
    last = [_token(r.token_id) for r in out.results]
    n = 1
    for i in range(1, new_tokens):
        decode = [DecodeItem(f"s{k}", last[k], len(p) + i - 1, greedy, i) for k, p in enumerate(prompts)]
        last = [_token(r.token_id) for r in steps.step([], decode).results]
        n += 1
    return n / (time.perf_counter() - t0)


def measure(concurrency: list[int], new_tokens: int, smollm2_tokens: int, threads: int) -> dict:
    rows = []
    spec = ClusterSpec(
        workers=1,
        model="tiny",
        max_running=max(concurrency),
        prefill_token_budget=4 * max(concurrency),
        num_blocks=max(1024, 4 * max(concurrency)),
    )
    with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        db = cluster.log_dir / "telemetry.db"
        vocab = client.model_info().vocab_size
        cluster_run(client, db, min(concurrency), 4, vocab)  # warm-up
        for c in concurrency:
            row = {"model": "tiny", "concurrency": c, **cluster_run(client, db, c, new_tokens, vocab)}
            engine = engine_steps_per_s("tiny", c, new_tokens, threads)
            row["engine_steps_per_s"] = round(engine, 1)
            row["cluster_over_engine"] = round(row["ticks_per_s"] / engine, 3)
            rows.append(row)
    if smollm2_tokens:
        spec = ClusterSpec(workers=1, model="smollm2-135m", num_blocks=256)
        with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
            db = cluster.log_dir / "telemetry.db"
            vocab = client.model_info().vocab_size
            cluster_run(client, db, 1, 4, vocab)  # warm-up
            row = {"model": "smollm2-135m", "concurrency": 1, **cluster_run(client, db, 1, smollm2_tokens, vocab)}
            engine = engine_steps_per_s("smollm2-135m", 1, smollm2_tokens, threads)
            row["engine_steps_per_s"] = round(engine, 1)
            row["cluster_over_engine"] = round(row["ticks_per_s"] / engine, 3)
            rows.append(row)
    return {"rows": rows, "load_avg_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,64,256", help="comma-separated tiny-model concurrencies")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--smollm2-tokens", type=int, default=48, help="SmolLM2 batch-1 decode tokens")
    p.add_argument("--no-smollm2", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="the in-process engine's CPU threads (0 = torch's)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if not conc or min(conc) < 1 or a.new_tokens < 2:
        p.error("--concurrency needs positive integers and --new-tokens at least 2")
    out = measure(conc, a.new_tokens, 0 if a.no_smollm2 else a.smollm2_tokens, a.threads)
    cols = [
        "model",
        "concurrency",
        "ticks_per_s",
        "engine_steps_per_s",
        "cluster_over_engine",
        "idle_gap_ms_median",
        "idle_gap_ms_p90",
        "worker_step_ms",
        "scheduler_rpc_ms",
        "scheduler_rpc_share",
    ]
    print(" | ".join(cols))
    for row in out["rows"]:
        print(" | ".join(str(row.get(c)) for c in cols))
    print(f"load {out['load_avg_1m']} on {out['cpu_count']} CPUs")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

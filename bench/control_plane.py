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

Then the tiny sweep's ticks/s (``bench.sweep_rate``, ``--sweep-repeats``; 0 skips it).

Every figure is taken for each arm of ``--overlap`` (default ``on,off``: the scheduler's
``--overlap-scheduling`` and ``--no-overlap-scheduling``) in the same run: one cluster per arm,
all up at once, the arms taking turns ``--repeats`` times per batch (medians shown), so that
the machine's load falls on both; the engine-alone figure is measured once per batch and shared.
With overlap a tick's span also covers the step before it, so the scheduler + RPC share from
``bench.ticks`` (tick period - worker step) is the fair figure there, and the worker's idle share
(its gaps over its busy window) says the same from the worker's side. Each process's CPU time
per tick (``bench.cpu_time``; the machine's load barely moves it) and the ceiling it sets,
cores x 1000 / total ms, say what a tick rate is bound by on this machine. The issue's targets, with
overlapped scheduling on: idle gap median <= 0.5 ms at c=64, scheduler + RPC <= 5 % at batch 1
on SmolLM2, >= 500 ticks/s on the tiny sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

from bench import cpu_time  # noqa: E402
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
    # The share of the worker's time from its first step to its last spent waiting for the next
    # step: the control plane's share as the worker sees it (it holds with ticks overlapped too,
    # where a tick's span also covers the step before it).
    idle_share = sum(gaps) / max(steps[-1][1] - steps[0][0], 1)
    gaps.sort()
    return {
        "steps": len(steps),
        "worker_idle_share": round(idle_share, 4),
        "idle_gap_ms_median": round(statistics.median(gaps) / 1e6, 3),
        "idle_gap_ms_p90": round(gaps[int(0.9 * (len(gaps) - 1))] / 1e6, 3),
    }


def cluster_run(
    client: SchedulerClient, db: Path, c: int, new_tokens: int, vocab: int, pids: Mapping[str, int] | None = None
) -> dict[str, Any]:
    req = spb.WorkloadRequest(policy=spb.WorkloadPolicy(max_running=c, prefill_token_budget=4 * c))
    for p in _prompts(c, vocab):
        req.sessions.add(prompt_ids=spb.TokenIds(ids=p), max_new_tokens=new_tokens, ignore_eos=True)
    cpu_before = cpu_time.snapshot(pids or {})
    start_ns, t0 = time.time_ns(), time.perf_counter()
    stats = None
    for ev in client.submit_workload(req):
        if ev.done:
            stats = ev.stats
    wall = time.perf_counter() - t0
    end_ns = time.time_ns()
    cpu_after = cpu_time.snapshot(pids or {})
    if stats is None:
        raise RuntimeError("the workload ended without its stats")
    wait_for_spans(db)
    row: dict[str, Any] = {"ticks": stats.ticks, "ticks_per_s": round(stats.ticks / wall, 1)}
    row.update(worker_gaps(db, start_ns, end_ns))
    brk = tick_breakdown(db, start_ns, end_ns)
    row["worker_step_ms"] = brk.get("worker_step_ms")
    row["scheduler_rpc_ms"] = brk.get("scheduler_rpc_ms")
    row["scheduler_rpc_share"] = brk.get("scheduler_rpc_share")
    if pids:
        cpu = cpu_time.per_tick_ms(cpu_before, cpu_after, stats.ticks)
        row.update({f"cpu_ms_per_tick_{name}": ms for name, ms in cpu.items()})
        row["ticks_per_s_ceiling"] = cpu_time.tick_ceiling(cpu["total"])
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
    per_session = -(-(4 + new_tokens) // EngineConfig.block_size)  # a 4-token prompt and its tokens
    engine = Engine(cfg, weights, EngineConfig(num_blocks=max(64, c * per_session), num_threads=threads))
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


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs (the runs' other fields from the first)."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        if isinstance(value, (int, float)) and len(numbers) == len(values):
            row[key] = round(statistics.median(numbers), 4)
    row["repeats"] = len(runs)
    return row


def _interleaved(
    specs: dict[bool, ClusterSpec], batches: list[int], new_tokens: int, repeats: int
) -> dict[tuple[bool, int], dict[str, Any]]:
    """Every arm's cluster up at once; per batch the arms take turns (ABBA...), so that a change
    in the machine's load falls on both. Returns each (arm, batch)'s median row."""
    with contextlib.ExitStack() as stack:
        up = {}
        for arm, spec in specs.items():
            cluster = stack.enter_context(LocalCluster(spec))
            client = stack.enter_context(SchedulerClient(cluster.scheduler_address))
            vocab = client.model_info().vocab_size
            pids = {name: cluster.pid(name) for name in cluster.procs}
            cluster_run(client, cluster.log_dir / "telemetry.db", min(batches), 4, vocab)  # warm-up
            up[arm] = (client, cluster.log_dir / "telemetry.db", vocab, pids)
        runs: dict[tuple[bool, int], list[dict[str, Any]]] = {}
        for c in batches:
            for r in range(repeats):
                for arm in list(specs) if r % 2 == 0 else list(specs)[::-1]:
                    client, db, vocab, pids = up[arm]
                    runs.setdefault((arm, c), []).append(cluster_run(client, db, c, new_tokens, vocab, pids))
    return {key: _median_row(rs) for key, rs in runs.items()}


def measure(
    concurrency: list[int],
    new_tokens: int,
    smollm2_tokens: int,
    threads: int,
    arms: list[bool],
    sweep_repeats: int,
    repeats: int = 3,
    step_spans: bool = True,
) -> dict:
    rows: list[dict[str, Any]] = []

    def add(model: str, c: int, tokens: int, got: dict[tuple[bool, int], dict[str, Any]]) -> None:
        engine = engine_steps_per_s(model, c, tokens, threads)  # shared by the arms
        for arm in arms:
            row = {"model": model, "overlap": arm, "concurrency": c, **got[(arm, c)]}
            row["engine_steps_per_s"] = round(engine, 1)
            row["cluster_over_engine"] = round(row["ticks_per_s"] / engine, 3)
            rows.append(row)

    tiny = {
        arm: ClusterSpec(
            workers=1,
            model="tiny",
            max_running=max(concurrency),
            prefill_token_budget=4 * max(concurrency),
            num_blocks=max(1024, 4 * max(concurrency)),
            overlap_scheduling=arm,
            step_spans=step_spans,
        )
        for arm in arms
    }
    got = _interleaved(tiny, concurrency, new_tokens, repeats)
    for c in concurrency:
        add("tiny", c, new_tokens, got)
    if smollm2_tokens:
        smol = {
            arm: ClusterSpec(
                workers=1, model="smollm2-135m", num_blocks=256, overlap_scheduling=arm, step_spans=step_spans
            )
            for arm in arms
        }
        add("smollm2-135m", 1, smollm2_tokens, _interleaved(smol, [1], smollm2_tokens, repeats))
    sweeps = []
    if sweep_repeats:
        from bench.sweep_rate import sweep_ticks_per_s

        sweeps = [sweep_ticks_per_s(repeats=sweep_repeats, overlap=overlap, step_spans=step_spans) for overlap in arms]
    return {
        "rows": rows,
        "tiny_sweep": sweeps,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.control_plane", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,64,256", help="comma-separated tiny-model concurrencies")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--smollm2-tokens", type=int, default=48, help="SmolLM2 batch-1 decode tokens")
    p.add_argument("--no-smollm2", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="the in-process engine's CPU threads (0 = torch's)")
    p.add_argument("--overlap", default="on,off", help="the scheduler's overlapped scheduling, per arm: on, off")
    p.add_argument("--sweep-repeats", type=int, default=3, help="tiny sweep repeats per arm (0: no sweep)")
    p.add_argument(
        "--no-step-spans",
        action="store_true",
        help="the scheduler without its per-session step spans (--no-step-spans): what they cost",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per arm and batch, interleaved; medians shown")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if not conc or min(conc) < 1 or a.new_tokens < 2:
        p.error("--concurrency needs positive integers and --new-tokens at least 2")
    arms = [x.strip() for x in a.overlap.split(",") if x.strip()]
    if not arms or any(x not in ("on", "off") for x in arms):
        p.error("--overlap takes on, off or both (on,off)")
    out = measure(
        conc,
        a.new_tokens,
        0 if a.no_smollm2 else a.smollm2_tokens,
        a.threads,
        [x == "on" for x in arms],
        a.sweep_repeats,
        max(a.repeats, 1),
        not a.no_step_spans,
    )
    cols = [
        "model",
        "overlap",
        "concurrency",
        "ticks_per_s",
        "engine_steps_per_s",
        "cluster_over_engine",
        "idle_gap_ms_median",
        "idle_gap_ms_p90",
        "worker_idle_share",
        "worker_step_ms",
        "scheduler_rpc_ms",
        "scheduler_rpc_share",
        "cpu_ms_per_tick_scheduler",
        "cpu_ms_per_tick_worker-0",
        "cpu_ms_per_tick_telemetry",
        "cpu_ms_per_tick_total",
        "ticks_per_s_ceiling",
    ]
    print(" | ".join(cols))
    for row in out["rows"]:
        print(" | ".join(str(row.get(c)) for c in cols))
    for sweep in out["tiny_sweep"]:
        print(
            f"tiny sweep, overlap {'on' if sweep['overlap_scheduling'] else 'off'}: "
            f"{sweep['ticks_per_s_median']} ticks/s median (best {sweep['ticks_per_s_best']}, {sweep['repeats']} repeats); "
            f"CPU ms per tick {sweep['cpu_ms_per_tick']}, ceiling {sweep['ticks_per_s_ceiling']} ticks/s; "
            f"a tick's slowest worker step {sweep['worker_step_ms']} ms, which alone allows "
            f"{sweep['ticks_per_s_engine_bound']} ticks/s; the rest of a tick {sweep['scheduler_rpc_ms']} ms, "
            f"which alone allows {sweep['ticks_per_s_control_plane_bound']} ticks/s"
        )
    print(f"load {out['load_avg_1m']} on {out['cpu_count']} CPUs")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

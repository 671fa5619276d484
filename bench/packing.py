"""python -m bench.packing: the scheduler's packing (``--pack-step-ms``, a worker whose steps are
cheap takes new sessions before an idle worker is used) against placement by load alone
(``--pack-step-ms 0``), in the same run.

1. The tiny sweep (``bench.sweep_rate``: `kvfleet sweep`'s workload on the default two-worker
   cluster): ``--pairs`` pairs of runs, packing on and off, the order alternating from pair to
   pair; each run's ticks/s (the median of its repeats), the workers' CPU a tick (which says
   where the sessions ran), the medians of each arm and their ratio.
2. SmolLM2 on two workers (skipped with ``--smollm2-tokens 0``): c sessions at once for each c
   in ``--smollm2-concurrency``, both arms' clusters up at once and taking turns; tokens/s, the
   workers that served the sessions, and whether both arms generated the same tokens. Its CPU
   steps take tens of milliseconds, past the default limit, so packing should leave it as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TQDM_DISABLE", "1")

from bench.sweep_rate import sweep_ticks_per_s  # noqa: E402
from kvfleet.client import SchedulerClient  # noqa: E402
from kvfleet.local_cluster import ClusterSpec, LocalCluster  # noqa: E402
from kvfleet.v1 import scheduler_pb2 as spb  # noqa: E402
from scheduler_svc.core import SchedulerLimits  # noqa: E402


def arm_order(pair: int, on: float) -> list[float]:
    """The pair's two arms, packing (`on` ms) first in even pairs, by load (0) first in odd ones."""
    return [on, 0.0] if pair % 2 == 0 else [0.0, on]


def ratio_of_medians(on: list[float], off: list[float]) -> float | None:
    if not on or not off or statistics.median(off) == 0:
        return None
    return round(statistics.median(on) / statistics.median(off), 3)


def sweep_pairs(pairs: int, repeats: int, on: float, progress=print) -> dict[str, Any]:
    runs: dict[float, list[dict[str, Any]]] = {on: [], 0.0: []}
    for pair in range(pairs):
        for arm in arm_order(pair, on):
            got = sweep_ticks_per_s(repeats=repeats, pack_step_ms=arm)
            runs[arm].append(got)
            progress(
                f"sweep pair {pair + 1}/{pairs}, pack_step_ms {arm:g}: {got['ticks_per_s_median']} ticks/s "
                f"(CPU ms a tick: {got['cpu_ms_per_tick']})"
            )
    on_rates = [r["ticks_per_s_median"] for r in runs[on]]
    off_rates = [r["ticks_per_s_median"] for r in runs[0.0]]
    return {
        "pack_step_ms": on,
        "packed_ticks_per_s": on_rates,
        "by_load_ticks_per_s": off_rates,
        "packed_median": round(statistics.median(on_rates), 1) if on_rates else None,
        "by_load_median": round(statistics.median(off_rates), 1) if off_rates else None,
        "ratio_of_medians": ratio_of_medians(on_rates, off_rates),
        "cpu_ms_per_tick": {f"{arm:g}": [r["cpu_ms_per_tick"] for r in rs] for arm, rs in runs.items()},
    }


def _workload(c: int, new_tokens: int) -> spb.WorkloadRequest:
    req = spb.WorkloadRequest()
    for k in range(c):
        ids = [100 + k, 200, 300 + k, 400, 500]
        req.sessions.add(prompt_ids=spb.TokenIds(ids=ids), max_new_tokens=new_tokens, ignore_eos=True)
    return req


def _serve(client: SchedulerClient, c: int, new_tokens: int) -> tuple[float, list[str], list[list[int]]]:
    """(tokens/s, the workers that served, each session's tokens) of one workload of c sessions."""
    tokens: list[list[int]] = [[] for _ in range(c)]
    workers: set[str] = set()
    t0 = time.perf_counter()
    for ev in client.submit_workload(_workload(c, new_tokens), timeout=900):
        if ev.done:
            continue
        tokens[ev.session_index] += ev.event.token_ids
        if ev.event.worker_id:
            workers.add(ev.event.worker_id)
    return c * new_tokens / (time.perf_counter() - t0), sorted(workers), tokens


def smollm2_arms(concurrency: list[int], new_tokens: int, repeats: int, on: float, progress=print) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as stack:
        clients = {}
        for arm in (on, 0.0):
            spec = ClusterSpec(workers=2, model="smollm2-135m", num_blocks=256, telemetry=False, pack_step_ms=arm)
            cluster = stack.enter_context(LocalCluster(spec))
            clients[arm] = stack.enter_context(SchedulerClient(cluster.scheduler_address))
            _serve(clients[arm], 2, 2)  # warm-up: both workers step, their step times are known
        for c in concurrency:
            got: dict[float, list[tuple[float, list[str], list[list[int]]]]] = {on: [], 0.0: []}
            for r in range(repeats):
                for arm in arm_order(r, on):
                    got[arm].append(_serve(clients[arm], c, new_tokens))
            row: dict[str, Any] = {"concurrency": c}
            for arm, name in ((on, "packed"), (0.0, "by_load")):
                row[f"{name}_tokens_per_s"] = round(statistics.median(g[0] for g in got[arm]), 1)
                row[f"{name}_workers"] = sorted({w for g in got[arm] for w in g[1]})
            row["ratio"] = ratio_of_medians([g[0] for g in got[on]], [g[0] for g in got[0.0]])
            row["tokens_equal"] = all(g[2] == got[0.0][0][2] for arm in got for g in got[arm])
            progress(f"smollm2 c={c}: {row}")
            rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.splitlines()[0])
    p.add_argument("--pack-step-ms", type=float, default=SchedulerLimits.pack_step_ms, help="the packing arm's limit")
    p.add_argument("--pairs", type=int, default=3, help="tiny sweep pairs (0: no sweep)")
    p.add_argument("--sweep-repeats", type=int, default=3, help="sweep repeats in each run")
    p.add_argument("--smollm2-tokens", type=int, default=24, help="new tokens per SmolLM2 session (0: skipped)")
    p.add_argument("--smollm2-concurrency", default="2,4")
    p.add_argument("--repeats", type=int, default=2, help="SmolLM2 runs per arm and concurrency (medians)")
    p.add_argument("--json", metavar="FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.pack_step_ms <= 0:
        p.error("--pack-step-ms must be positive: the packing arm is compared with 0")
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    out: dict[str, Any] = {"cpu_count": os.cpu_count()}
    if a.pairs:
        out["tiny_sweep"] = sweep_pairs(a.pairs, a.sweep_repeats, a.pack_step_ms, progress)
        s = out["tiny_sweep"]
        print(
            f"tiny sweep, ticks/s: packed (pack_step_ms {a.pack_step_ms:g}) {s['packed_ticks_per_s']} "
            f"median {s['packed_median']}; by load {s['by_load_ticks_per_s']} median {s['by_load_median']}; "
            f"ratio of medians {s['ratio_of_medians']}"
        )
    if a.smollm2_tokens:
        conc = [int(x) for x in a.smollm2_concurrency.split(",") if x.strip()]
        out["smollm2"] = smollm2_arms(conc, a.smollm2_tokens, a.repeats, a.pack_step_ms, progress)
        for row in out["smollm2"]:
            print(
                f"smollm2-135m, 2 workers, c={row['concurrency']}: packed {row['packed_tokens_per_s']} tokens/s "
                f"on {row['packed_workers']}, by load {row['by_load_tokens_per_s']} on {row['by_load_workers']}; "
                f"ratio {row['ratio']}; tokens equal: {row['tokens_equal']}"
            )
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

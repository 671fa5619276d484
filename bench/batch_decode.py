"""Decode steps of a full batch in a real worker: `python -m bench.batch_decode`.

A local cluster (one worker process, the scheduler, telemetry) with the workers' default
flags; ``--batch`` sessions of ``--context``-token prompts sent at once as one workload (all
running together whatever the machine's load), ``--new-tokens`` each (EOS ignored); the
median and p10 of the worker's own `worker_step` spans over the steps that decoded every
session at once (no prefill beside them). What a worker process does, which an
engine-alone loop (`bench.modes`) only approximates: its threads, its allocator, its gRPC loop
beside the step. Nothing is asserted: this prints figures to quote (bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import time

from bench.ticks import wait_for_spans
from kvfleet.client import SchedulerClient
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb


def full_batch_steps(db_path, batch: int) -> list[float]:
    """Milliseconds of the worker_step spans that decoded ``batch`` sessions and prefilled none."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT duration_ns, attributes FROM spans WHERE name = 'worker_step'").fetchall()
    out = []
    for duration_ns, attributes in rows:
        attrs = json.loads(attributes)
        if attrs.get("kvfleet.step.decode_items") == batch and attrs.get("kvfleet.step.prefill_items") == 0:
            out.append(duration_ns / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="none", choices=["none", "int8", "gguf"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=208, help="prompt tokens per session")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--num-blocks", type=int, default=1024, help="the worker's KV blocks (of 16 tokens)")
    a = p.parse_args(argv)
    spec = ClusterSpec(workers=1, model=a.model, quant=a.quant, num_blocks=a.num_blocks)
    with LocalCluster(spec) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        vocab = client.list_workers()[0].vocab_size
        low = min(100, vocab // 4)  # clear of the special tokens at the start of a real vocabulary
        # One workload, every session admitted at once (its prompts prefilled over the first
        # ticks, a prefill budget at a time): separate calls could reach the scheduler too far
        # apart to overlap on a loaded machine.
        req = spb.WorkloadRequest(policy=spb.WorkloadPolicy(max_running=a.batch))
        for k in range(a.batch):
            prompt = [low + (7 * k + 3 * j) % (vocab - low) for j in range(a.context)]
            req.sessions.add(prompt_ids=spb.TokenIds(ids=prompt), max_new_tokens=a.new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        tokens = sum(len(ev.event.token_ids) for ev in client.submit_workload(req) if ev.HasField("event"))
        wall = time.perf_counter() - t0
        db = cluster.log_dir / "telemetry.db"
        wait_for_spans(db)  # the last spans' export (the worker's batch processor)
        steps = sorted(full_batch_steps(db, a.batch))
    if not steps:
        print(
            f"no step decoded all {a.batch} sessions at once: raise --num-blocks, or --new-tokens past the "
            "ticks that prefill the prompts (the scheduler's prefill budget a tick)"
        )
        return 1
    print(
        f"{a.model} quant={a.quant}, batch {a.batch} x {a.context}-token prompts: {len(steps)} full-batch "
        f"decode steps, median {statistics.median(steps):.1f} ms, p10 {steps[len(steps) // 10]:.1f} ms; "
        f"{tokens} tokens in {wall:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

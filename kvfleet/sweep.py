"""The concurrency sweep: one workload through the scheduler at several concurrencies.

Every figure in `results` is the scheduler's own WorkloadStats of the real run over gRPC.
`reference_outputs` come from the pure-numpy model, unbatched; `corruption_free` compares them
with what the cluster generated at every concurrency, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfleet.client import SchedulerClient
from kvfleet.progress import Progress
from kvfleet.proto_json import message_dict
from kvfleet.v1 import scheduler_pb2 as spb

# The smallest concurrency reaching this share of the best tokens_per_tick is the saturation point.
SATURATION_SHARE = 0.95


@dataclass(frozen=True)
class SweepSpec:
    sessions: int = 8
    prompt_len: int = 4
    max_new_tokens: int = 8
    prefill_budget: int = 4
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    snapshot_concurrency: int = 4
    snapshot_tick: int = 6

    def __post_init__(self) -> None:
        for name in ("sessions", "prompt_len", "max_new_tokens", "prefill_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency needs one or more values >= 1")


def make_prompts(spec: SweepSpec, vocab_size: int) -> list[list[int]]:
    """Prompt token ids, deterministic from the seed."""
    rng = np.random.default_rng(spec.seed)
    return [rng.integers(0, vocab_size, size=spec.prompt_len).tolist() for _ in range(spec.sessions)]


def reference_outputs(model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    from kvfleet_models.reference import reference_generate
    from kvfleet_models.registry import load_model

    cfg, weights = load_model(model)
    return [list(reference_generate(cfg, weights, list(p), max_new_tokens)) for p in prompts]


def _workload_request(spec: SweepSpec, prompts, concurrency: int, snapshot: bool) -> spb.WorkloadRequest:
    req = spb.WorkloadRequest(
        policy=spb.WorkloadPolicy(max_running=concurrency, prefill_token_budget=spec.prefill_budget),
        snapshot_at_tick=spec.snapshot_tick if snapshot else 0,
    )
    for p in prompts:
        # Greedy, no EOS: every session runs to max_new_tokens, as the tick rules assume.
        req.sessions.add(prompt_ids=spb.TokenIds(ids=p), max_new_tokens=spec.max_new_tokens, ignore_eos=True)
    return req


def run_one(client: SchedulerClient, spec: SweepSpec, prompts, concurrency: int):
    """Run the workload once; returns (outputs per session, stats, live snapshot or None)."""
    snapshot_wanted = concurrency == spec.snapshot_concurrency
    outputs: list[list[int]] = [[] for _ in prompts]
    stats = None
    future = None
    for ev in client.submit_workload(_workload_request(spec, prompts, concurrency, snapshot_wanted)):
        if snapshot_wanted and future is None:
            # Asked while the run is in flight; the scheduler captured it at the tick's end.
            future = client.telemetry_future(ev.workload_id, spec.snapshot_tick)
        if ev.done:
            stats = ev.stats
        elif ev.HasField("event"):
            outputs[ev.session_index].extend(ev.event.token_ids)
    snapshot = future.result() if future is not None else None
    if stats is None:
        raise RuntimeError("the workload stream ended without its final stats")
    return outputs, stats, snapshot


def result_row(concurrency: int, s: spb.WorkloadStats) -> dict:
    return {
        "avg_batch_occupancy": round(s.avg_batch_occupancy, 4),
        "cache_misses": s.cache_misses,
        "concurrency": concurrency,
        "decode_batches": s.decode_batches,
        "decode_tokens": s.decode_tokens,
        "max_batch_occupancy": s.max_batch_occupancy,
        "peak_kv_bytes": s.peak_kv_bytes,
        "prefill_tokens": s.prefill_tokens,
        "rejected_admissions": s.rejected_admissions,
        "ticks": s.ticks,
        "tokens_per_tick": round(s.tokens_per_tick, 4),
    }


def saturation(rows: list[dict]) -> int:
    best = max(r["tokens_per_tick"] for r in rows)
    return min(r["concurrency"] for r in rows if r["tokens_per_tick"] >= SATURATION_SHARE * best)


def snapshot_dict(snap: spb.TelemetrySnapshot) -> dict:
    """The snapshot's fields in name order, its 64-bit counts as JSON numbers."""
    return dict(sorted(message_dict(snap).items()))


def run_sweep(client: SchedulerClient, spec: SweepSpec, progress: Progress | None = None) -> dict:
    progress = progress or Progress.silent()
    progress.set_total(len(spec.concurrency))
    workers = client.list_workers()
    if not workers:
        raise RuntimeError("the scheduler lists no workers")
    model_name = workers[0].model
    from kvfleet_models.registry import load_model

    cfg, _ = load_model(model_name)
    prompts = make_prompts(spec, cfg.vocab_size)
    progress(f"reference outputs from the numpy model ({model_name})")
    reference = reference_outputs(model_name, prompts, spec.max_new_tokens)
    rows, exact, snapshot, overlapped = [], True, None, False
    for c in spec.concurrency:
        outputs, stats, snap = run_one(client, spec, prompts, c)
        exact = exact and outputs == reference
        overlapped = overlapped or stats.overlapped
        rows.append(result_row(c, stats))
        progress.advance(message=f"concurrency {c}: {stats.ticks} ticks, {stats.tokens_per_tick:.2f} tokens/tick")
        if snap is not None:
            snapshot = snap
    doc = {
        "concurrency_sweep": {
            "corruption_free": exact,
            "reference_outputs": {f"s{i}": out for i, out in enumerate(reference)},
            # Ticks planned ahead (a scheduler with --overlap-scheduling): the same tokens, other
            # tick counts than the reference's one tick at a time.
            "overlap_scheduling": overlapped,
            "results": rows,
            "saturation_concurrency": saturation(rows),
            "schema_version": 1,
        },
        "evidence_kind": "synthetic-unit" if model_name == "tiny" else "real-model",
        "model": {
            "hidden": cfg.hidden_size,
            "n_heads": cfg.num_heads,
            "n_kv_heads": cfg.num_kv_heads,
            "n_layers": cfg.num_layers,
            "vocab": cfg.vocab_size,
            "name": model_name,
            "reference": "pure-numpy KV-cached dense Llama, unbatched (kvfleet_models/reference.py)",
        },
        "prompts": {f"s{i}": p for i, p in enumerate(prompts)},
        "schema_version": 1,
        "workload": {
            "max_new_tokens": spec.max_new_tokens,
            "prompt_len": spec.prompt_len,
            "sessions": spec.sessions,
            "prefill_token_budget": spec.prefill_budget,
            "seed": spec.seed,
        },
    }
    if snapshot is not None:
        doc[f"mid_run_telemetry_concurrency_{spec.snapshot_concurrency}"] = {
            "at_tick": spec.snapshot_tick,
            **snapshot_dict(snapshot),
        }
    return doc


def format_table(doc: dict) -> str:
    cols = [
        "concurrency",
        "ticks",
        "decode_batches",
        "decode_tokens",
        "prefill_tokens",
        "avg_batch_occupancy",
        "max_batch_occupancy",
        "peak_kv_bytes",
        "tokens_per_tick",
        "rejected_admissions",
        "cache_misses",
    ]
    heads = [
        "conc",
        "ticks",
        "batches",
        "decode",
        "prefill",
        "avg_occ",
        "max_occ",
        "peak_kv_B",
        "tok/tick",
        "rejected",
        "misses",
    ]
    rows = doc["concurrency_sweep"]["results"]
    widths = [max(len(h), *(len(str(r[c])) for r in rows)) for h, c in zip(heads, cols)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    sweep = doc["concurrency_sweep"]
    lines.append(
        f"corruption_free: {sweep['corruption_free']}   saturation_concurrency: {sweep['saturation_concurrency']}"
    )
    if sweep.get("overlap_scheduling"):
        lines.append(
            "note: this scheduler overlaps its ticks (--overlap-scheduling): the tokens are those of one tick "
            "at a time, the tick figures are not the reference's (a sweep's own cluster runs with it off)"
        )
    return "\n".join(lines)

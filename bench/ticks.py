"""Where a tick's time goes, from the spans the cluster exported to its telemetry store.

The scheduler's ``tick`` span covers a tick's dispatch: the Step RPCs to every worker and
applying their answers. Planning the next tick, delivering tokens to the streams and releasing
finished sessions happen between ``tick`` spans. Each worker's ``worker_step`` (a child of the
tick) is its engine step; its phase children (``attention``, ``kv_view_prepare``,
``kv_write``, ``post_step_sync``) are totals over layers.

Per tick: period = start of the next tick - start of this one (the tick's whole cost);
worker step = the slowest worker's step (workers run concurrently); scheduler + RPC = period -
worker step (gRPC both ways, protobuf, the worker's servicer, the scheduler's planning and
bookkeeping, the event streams). Sampling is ``post_step_sync`` (argmax and the copy of the
sampled ids to the host).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

PHASES = ("attention", "kv_view_prepare", "kv_write", "post_step_sync")


def _rows(db: Path, sql: str, args: tuple) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10.0)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def wait_for_spans(db: Path, settle_s: float = 1.5, limit_s: float = 30.0) -> None:
    """Wait until the store's span count stops growing (exports are batched every 200 ms)."""
    deadline = time.monotonic() + limit_s
    last = -1
    while time.monotonic() < deadline:
        if db.exists():
            count = _rows(db, "SELECT COUNT(*) FROM spans", ())[0][0]
            if count == last:
                return
            last = count
        time.sleep(settle_s)


def tick_breakdown(db: Path, start_epoch_ns: int, end_epoch_ns: int) -> dict:
    """Mean per-tick milliseconds and shares over the ticks that started in the window."""
    ticks = _rows(
        db,
        "SELECT span_id, start_ns, end_ns FROM spans WHERE name = 'tick' "
        "AND start_ns >= ? AND start_ns <= ? ORDER BY start_ns",
        (start_epoch_ns, end_epoch_ns),
    )
    if len(ticks) < 2:
        return {"ticks": len(ticks), "error": "too few tick spans in the store"}
    ids = {t[0] for t in ticks}
    steps: dict[str, list[tuple[str, int]]] = {}
    for parent, span_id, dur in _rows(
        db,
        "SELECT parent_span_id, span_id, duration_ns FROM spans WHERE name = 'worker_step' "
        "AND start_ns >= ? AND start_ns <= ?",
        (start_epoch_ns, end_epoch_ns),
    ):
        if parent in ids:
            steps.setdefault(parent, []).append((span_id, dur))
    phase: dict[tuple[str, str], int] = {}
    for parent, name, dur in _rows(
        db,
        f"SELECT parent_span_id, name, duration_ns FROM spans WHERE name IN "
        f"({','.join('?' * len(PHASES))}) AND start_ns >= ? AND start_ns <= ?",
        (*PHASES, start_epoch_ns, end_epoch_ns),
    ):
        phase[(parent, name)] = dur
    period_ns = tick_ns = step_ns = 0
    phase_ns = dict.fromkeys(PHASES, 0)
    used = 0
    gaps = sorted(n[1] - t[2] for t, n in zip(ticks, ticks[1:]))
    # A gap far above the usual one is the scheduler idle (waiting for requests), not its work.
    idle_ns = max(20 * gaps[len(gaps) // 2], 50_000_000)
    for (tid, start, end), (_, next_start, _) in zip(ticks, ticks[1:]):
        if tid not in steps or next_start - end > idle_ns:
            continue
        step_id, slowest = max(steps[tid], key=lambda s: s[1])
        period_ns += next_start - start
        tick_ns += end - start
        step_ns += slowest
        for name in PHASES:
            phase_ns[name] += phase.get((step_id, name), 0)
        used += 1
    if not used or not period_ns:
        return {"ticks": len(ticks), "error": "no tick had a worker_step child"}
    ms = 1e-6 / used
    out = {
        "ticks": used,
        "tick_period_ms": round(period_ns * ms, 3),
        "tick_span_ms": round(tick_ns * ms, 3),
        "worker_step_ms": round(step_ns * ms, 3),
        "scheduler_rpc_ms": round((period_ns - step_ns) * ms, 3),
        "scheduler_rpc_share": round((period_ns - step_ns) / period_ns, 4),
        "rpc_in_tick_ms": round((tick_ns - step_ns) * ms, 3),
        "between_ticks_ms": round((period_ns - tick_ns) * ms, 3),
    }
    for name in PHASES:
        out[f"{name}_ms"] = round(phase_ns[name] * ms, 3)
    out["sampling_ms"] = out["post_step_sync_ms"]
    other = step_ns - sum(phase_ns.values())
    out["step_other_ms"] = round(other * ms, 3)  # projections, MLP, norms, host-side prep
    return out

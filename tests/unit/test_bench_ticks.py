"""bench.ticks reads a tick's cost from the spans in a telemetry store: per tick, the period to
the next tick, and the slowest of its workers' steps (the workers run at once), which is what
the sweep's engine-bound rate (bench.sweep_rate) is made of."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ticks import tick_breakdown
from telemetry_svc.model import SpanRecord
from telemetry_svc.store import SqliteSpanStore

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000


def _span(trace: int, span: int, parent: int, name: str, start_ms: float, end_ms: float) -> SpanRecord:
    return SpanRecord(
        f"{trace:032x}",
        f"{span:016x}",
        f"{parent:016x}" if parent else "",
        name,
        "kvfleet-scheduler" if name == "tick" else "kvfleet-worker",
        T0 + int(start_ms * MS),
        T0 + int(end_ms * MS),
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Three ticks 4 ms apart, then a fourth that only closes the third's period:
    tick 1: steps of 1 and 3 ms on two workers; tick 2: one of 2 ms; tick 3: none (a tick of
    releases only writes no step); each step with an attention phase of a quarter of it."""
    path = tmp_path / "telemetry.db"
    store = SqliteSpanStore(str(path))
    rows = []
    for k, (start, steps) in enumerate([(0.0, (1.0, 3.0)), (4.0, (2.0,)), (8.0, ()), (12.0, (1.0,))], start=1):
        rows.append(_span(k, 100 * k, 0, "tick", start, start + 3.5))
        for w, ms in enumerate(steps):
            step = 100 * k + 10 * (w + 1)
            rows.append(_span(k, step, 100 * k, "worker_step", start + 0.2, start + 0.2 + ms))
            rows.append(_span(k, step + 1, step, "attention", start + 0.2, start + 0.2 + ms / 4))
    store.add_spans(rows)
    store.close()
    return path


def test_a_tick_costs_its_period_and_its_slowest_step(db: Path) -> None:
    got = tick_breakdown(db, T0, T0 + 20 * MS)
    # Ticks 1 and 2 have steps and a next tick; tick 3 has no step, tick 4 no next tick.
    assert got["ticks"] == 2
    assert got["tick_period_ms"] == pytest.approx(4.0)
    assert got["worker_step_ms"] == pytest.approx((3.0 + 2.0) / 2)  # the slower worker of tick 1
    assert got["scheduler_rpc_ms"] == pytest.approx(4.0 - 2.5)
    assert got["attention_ms"] == pytest.approx((0.75 + 0.5) / 2)  # the slowest step's phase


def test_ticks_outside_the_window_are_not_counted(db: Path) -> None:
    got = tick_breakdown(db, T0 + 3 * MS, T0 + 20 * MS)
    assert got["ticks"] == 1 and got["worker_step_ms"] == pytest.approx(2.0)

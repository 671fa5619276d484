"""`kvfleet traces` (kvfleet/traces.py) on a telemetry store written by the real store class."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.traces import recent, spans_of, trace_of_session, waterfall
from telemetry_svc.model import SpanRecord
from telemetry_svc.store import SqliteSpanStore

T1, T2 = "a" * 32, "b" * 32


def _store(path: Path) -> Path:
    store = SqliteSpanStore(str(path))
    ms = 1_000_000
    store.add_spans(
        [
            SpanRecord(
                T1, "1" * 16, "", "chat m", "kvfleet-scheduler", 0, 10 * ms, attributes={"kvfleet.session.id": "s-x"}
            ),
            SpanRecord(T1, "2" * 16, "1" * 16, "queue", "kvfleet-scheduler", 0, 2 * ms),
            SpanRecord(T1, "3" * 16, "1" * 16, "step_prefill", "kvfleet-scheduler", 2 * ms, 6 * ms),
            SpanRecord(T1, "4" * 16, "3" * 16, "worker_step", "kvfleet-worker", 3 * ms, 5 * ms),
            SpanRecord(T1, "5" * 16, "1" * 16, "step_decode", "kvfleet-scheduler", 6 * ms, 10 * ms),
            SpanRecord(T2, "6" * 16, "", "tick", "kvfleet-scheduler", 20 * ms, 21 * ms),
        ]
    )
    store.close()
    return path


def test_recent_traces_newest_first_with_their_root(tmp_path: Path) -> None:
    db = _store(tmp_path / "t.db")
    assert [(t, root, n) for t, root, n, _, _ in recent(db)] == [(T2, "tick", 1), (T1, "chat m", 5)]


def test_a_sessions_trace_as_an_indented_waterfall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = _store(tmp_path / "t.db")
    assert trace_of_session(db, "s-x") == T1
    lines = waterfall(spans_of(db, T1)).splitlines()
    assert lines[0] == f"trace {T1}: 5 spans, 10.00 ms"
    names = [ln.split(" (")[0] for ln in lines[1:]]
    assert names == ["chat m", "  queue", "  step_prefill", "    worker_step", "  step_decode"]
    assert "    4.00 ms |" in lines[3] and lines[3].endswith("|      #############             |")
    assert main(["traces", "--db", str(db), "--session", "s-x"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == lines


def test_missing_store_session_or_trace_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no telemetry store"):
        recent(tmp_path / "none.db")
    db = _store(tmp_path / "t.db")
    with pytest.raises(ValueError, match="no span of session s-y"):
        trace_of_session(db, "s-y")
    with pytest.raises(ValueError, match="no trace"):
        spans_of(db, "c" * 32)


def test_spans_that_start_together_are_listed_by_name() -> None:
    """A worker step's phase spans all start with it (each its phase's total): the same order
    every time, however the store returns them, and the trace UI's (telemetry_svc/ui/app.js)."""
    ms = 1_000_000
    phases = [("kv_write", 3), ("post_step_sync", 1), ("attention", 2), ("kv_view_prepare", 1)]
    step = SpanRecord(T1, "1" * 16, "", "worker_step", "kvfleet-worker", 0, 4 * ms)
    spans = [step] + [
        SpanRecord(T1, f"{i + 2:016x}", "1" * 16, name, "kvfleet-worker", 0, n * ms)
        for i, (name, n) in enumerate(phases)
    ]
    for order in (spans, spans[::-1]):
        names = [ln.split(" (")[0].strip() for ln in waterfall(order).splitlines()[1:]]
        assert names == ["worker_step", "attention", "kv_view_prepare", "kv_write", "post_step_sync"]


def test_a_file_that_is_no_store_is_said_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was sqlite3's traceback, "file is not a database"."""
    bad = tmp_path / "notes.txt"
    bad.write_text("not sqlite\n" * 100)
    assert main(["traces", "--db", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvfleet: {bad} is no telemetry store (file is not a database); `kvfleet up` prints its logs folder, "
        "which holds telemetry.db"
    )

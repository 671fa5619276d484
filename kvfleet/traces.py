"""`kvfleet traces`: the telemetry store's traces in the terminal, read straight from its SQLite
file (read-only; `kvfleet up` prints where its logs, telemetry.db included, are): the recent
traces, or one as an indented waterfall with durations."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from telemetry_svc.model import SpanRecord

BAR = 32  # characters of the waterfall's timeline


def _connect(db: Path) -> sqlite3.Connection:
    if not db.exists():
        raise ValueError(f"no telemetry store at {db}; `kvfleet up` prints its logs folder, which holds telemetry.db")
    conn = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        conn.execute("SELECT 1 FROM spans LIMIT 1").fetchall()
    except sqlite3.Error as exc:
        conn.close()
        raise ValueError(
            f"{db} is no telemetry store ({exc}); `kvfleet up` prints its logs folder, which holds telemetry.db"
        ) from None
    return conn


def recent(db: Path, limit: int = 20) -> list[tuple[str, str, int, int, int]]:
    """(trace id, root span name, spans, start ns, duration ns) of the latest traces, newest first."""
    with _connect(db) as conn:
        rows = conn.execute(
            "SELECT trace_id, COUNT(*), MIN(start_ns), MAX(end_ns) FROM spans GROUP BY trace_id "
            "ORDER BY MIN(start_ns) DESC LIMIT ?",
            (limit,),
        ).fetchall()
        out = []
        for trace_id, count, start, end in rows:
            root = conn.execute(
                "SELECT name FROM spans WHERE trace_id = ? ORDER BY parent_span_id != '', start_ns LIMIT 1", (trace_id,)
            ).fetchone()
            out.append((trace_id, root[0] if root else "", count, start, end - start))
    return out


def trace_of_session(db: Path, session_id: str) -> str:
    """The trace id of a session's span; ValueError when the store has none."""
    with _connect(db) as conn:
        row = conn.execute(
            "SELECT trace_id FROM spans WHERE json_extract(attributes, '$.\"kvfleet.session.id\"') = ? LIMIT 1",
            (session_id,),
        ).fetchone()
    if row is None:
        raise ValueError(f"no span of session {session_id} in the store (yet: spans are exported in batches)")
    return str(row[0])


def spans_of(db: Path, trace_id: str) -> list[SpanRecord]:
    with _connect(db) as conn:
        rows = conn.execute(
            "SELECT trace_id, span_id, parent_span_id, name, service, start_ns, end_ns, attributes FROM spans "
            "WHERE trace_id = ? ORDER BY start_ns",
            (trace_id,),
        ).fetchall()
    if not rows:
        raise ValueError(f"no trace {trace_id} in the store")
    return [
        SpanRecord(t, s, p, name, svc, int(start), int(end), attributes=json.loads(attrs))
        for (t, s, p, name, svc, start, end, attrs) in rows
    ]


def waterfall(spans: list[SpanRecord]) -> str:
    """Each span under its parent (in start order; spans that start together, as a step's phase
    spans all do, by name, as the trace UI lists them), with its duration and a bar on the
    trace's timeline; a span whose parent is not in the trace is shown at the top level."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        children.setdefault(s.parent_span_id if s.parent_span_id in ids else "", []).append(s)
    t0 = min(s.start_ns for s in spans)
    total = max(max(s.end_ns for s in spans) - t0, 1)
    lines = [f"trace {spans[0].trace_id}: {len(spans)} spans, {total / 1e6:.2f} ms"]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.name)):
            a = int((s.start_ns - t0) / total * BAR)
            b = max(int((s.end_ns - t0) / total * BAR), a + 1)
            bar = " " * a + "#" * (b - a) + " " * (BAR - b)
            label = f"{'  ' * depth}{s.name} ({s.service})"
            lines.append(f"{label:<48} {(s.end_ns - s.start_ns) / 1e6:9.2f} ms |{bar}|")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)

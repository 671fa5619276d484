"""Reading the telemetry service's SQLite store (`telemetry.db`) from a test, while the service
writes it: read-only connections, and polling until the spans a test waits for have arrived."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

Rows = list[tuple[Any, ...]]


def _connect(db_path: Path | str) -> sqlite3.Connection:
    # mode=ro: a test never writes the store, nor creates an empty file where the service has
    # yet to make one. The store is in WAL mode: readers do not block the writer, and the busy
    # timeout rides out the moments (a checkpoint, the schema being made) it is locked.
    return sqlite3.connect(f"{Path(db_path).resolve().as_uri()}?mode=ro", uri=True, timeout=5)


def query(db_path: Path | str, sql: str, params: Sequence[Any] = ()) -> Rows:
    """One read-only query's rows, now; any error raises."""
    db = _connect(db_path)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def wait_for_rows(
    db_path: Path | str,
    sql: str,
    params: Sequence[Any] = (),
    *,
    until: Callable[[Rows], bool] = bool,
    what: str,
    timeout: float = 20.0,
    interval: float = 0.25,
) -> Rows:
    """Run `sql` (read-only) every `interval` seconds until `until(rows)` holds, and return those
    rows; by default, until there are any. While the file or its tables do not exist yet, or the
    store is locked, that is "not yet". Past `timeout` seconds the test fails, naming `what` it
    waited for and the last rows (or error) it saw."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rows = query(db_path, sql, params)
            last: object = rows
            if until(rows):
                return rows
        except sqlite3.OperationalError as exc:  # no file / no table yet, or locked
            last = exc
        if time.monotonic() >= deadline:
            pytest.fail(f"{db_path}: waited {timeout:g}s for {what} in vain; last saw {last!r:.2000}")
        time.sleep(interval)


def wait_for_session_span(db_path: Path | str, key: str, value: str, timeout: float = 30.0) -> dict[str, Any]:
    """The attributes of the session span (kvfleet.span = session) whose attribute `key` is
    `value` (kvfleet.session.id, kvfleet.request.id), once it is in the store."""
    import json

    def found(rows: Rows) -> list[dict[str, Any]]:
        attrs = (json.loads(r[0]) for r in rows)
        return [a for a in attrs if a.get("kvfleet.span") == "session" and a.get(key) == value]

    rows = wait_for_rows(
        db_path,
        "SELECT attributes FROM spans WHERE attributes LIKE ?",
        (f'%"{value}"%',),
        until=lambda rows: bool(found(rows)),
        what=f"the session span with {key} = {value}",
        timeout=timeout,
        interval=0.3,
    )
    return found(rows)[0]

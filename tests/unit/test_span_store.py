"""telemetry_svc.store.SqliteSpanStore: rows round-trip, duplicates, artifacts, threads, close."""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import numpy as np
import pytest

from telemetry_svc.model import (
    Arm,
    Artifact,
    ArtifactConflict,
    ArtifactKind,
    InvalidPageToken,
    SpanRecord,
    UnknownExperiment,  # fmt: skip
)
from telemetry_svc.store import SqliteSpanStore


def _row(i: int, name: str = "attention", arm: str = "control", exp: str = "e", dur: int = 100) -> SpanRecord:
    return SpanRecord(f"{i:032x}", f"{i + 1:016x}", "", name, "worker", 1_000 * i, 1_000 * i + dur, exp, arm,
                      {"layer": i, "tags": ["a"]})  # fmt: skip


@pytest.fixture
def store(tmp_path: Any) -> Any:
    s = SqliteSpanStore(str(tmp_path / "s.db"))
    yield s
    s.close()


def test_rows_round_trip_in_start_order(store: SqliteSpanStore) -> None:
    rows = [_row(3), _row(1, arm="candidate"), _row(2, name="worker_step")]
    assert store.add_spans(rows) == 3
    got = store.spans("e")
    assert [r.start_ns for r in got] == [1_000, 2_000, 3_000]
    assert got[0] == rows[1]
    assert store.spans("e", "worker_step") == [rows[2]]
    assert store.durations("e", None) == {("attention", "candidate"): [100], ("worker_step", "control"): [100],
                                          ("attention", "control"): [100]}  # fmt: skip


def test_a_retried_batch_is_not_double_counted(store: SqliteSpanStore) -> None:
    rows = [_row(i) for i in range(5)]
    assert store.add_spans(rows) == 5
    assert store.add_spans(rows + [_row(9)]) == 1
    assert len(store.spans()) == 6


def test_wal_mode_and_index(tmp_path: Any, store: SqliteSpanStore) -> None:
    con = sqlite3.connect(store.location)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    partial = {r[1]: r[4] for r in con.execute("PRAGMA index_list(spans)")}  # name -> is partial
    assert {"spans_in_experiment_arm_name", "spans_name_duration", "spans_in_experiment_name_arm_duration",
            "spans_received"} <= partial.keys()  # fmt: skip
    # The experiment indexes hold experiment spans only (serving spans skip their inserts).
    assert partial["spans_in_experiment_arm_name"] == partial["spans_in_experiment_name_arm_duration"] == 1
    assert partial["spans_name_duration"] == 0
    con.close()


def test_queries_by_experiment_read_the_experiment_indexes() -> None:
    """SQLite takes a partial index only for a query repeating its WHERE term: the queries by
    experiment must, or they scan every span."""
    mem = SqliteSpanStore(":memory:")  # one connection, so every query is seen
    mem.add_spans([_row(1), _row(2, arm="candidate"), _row(3, exp="", arm="")])
    queries: list[str] = []  # as run, their parameters in place
    con = mem._db()
    con.set_trace_callback(lambda sql: queries.append(sql) if sql.startswith("SELECT") else None)
    try:
        assert mem.durations("e", None)
        assert mem.timings("e", None, 10, "").timings
        assert mem.experiment_data("e").durations
        assert [i.experiment_id for i in mem.experiments()] == ["e"]
    finally:
        con.set_trace_callback(None)
    by_experiment = [q for q in queries if "experiment_id" in q and "FROM spans" in q]
    assert len(by_experiment) >= 6, queries
    for q in by_experiment:
        plan = " / ".join(d for *_, d in con.execute(f"EXPLAIN QUERY PLAN {q}"))
        assert "spans_in_experiment" in plan, (q, plan)
    # The spans of no experiment are still found by experiment "" (without those indexes).
    assert list(mem.durations("", None)) == [("attention", "")]
    mem.close()


def test_a_store_of_the_full_experiment_indexes_gets_the_partial_ones(tmp_path: Any) -> None:
    path = str(tmp_path / "old.db")
    SqliteSpanStore(path).close()
    con = sqlite3.connect(path)
    con.executescript("DROP INDEX spans_in_experiment_arm_name; DROP INDEX spans_in_experiment_name_arm_duration;"
                      "CREATE INDEX spans_experiment_arm_name ON spans (experiment_id, arm, name);"
                      "CREATE INDEX spans_experiment_name_arm_duration ON spans (experiment_id, name, arm, duration_ns);")  # fmt: skip
    con.close()
    SqliteSpanStore(path).close()
    con = sqlite3.connect(path)
    names = {r[1] for r in con.execute("PRAGMA index_list(spans)")}
    con.close()
    assert {"spans_in_experiment_arm_name", "spans_in_experiment_name_arm_duration"} <= names
    assert not {"spans_experiment_arm_name", "spans_experiment_name_arm_duration"} & names


def test_experiment_data_and_artifacts(store: SqliteSpanStore) -> None:
    store.add_spans([_row(1, dur=10), _row(2, dur=20), _row(3, arm="candidate", dur=5), _row(4, arm="", dur=7)])
    first = Artifact("e", ArtifactKind.TOKENS, "control", "a" * 64, completion_tokens=3)
    assert store.add_artifact(first) is True
    assert store.add_artifact(first) is False  # a retry of the same record is not an error
    data = store.experiment_data("e")
    assert data.samples("attention", Arm.CONTROL) == (10, 20)
    assert data.samples("attention", Arm.CANDIDATE) == (5,)
    assert data.artifacts == (first,)
    (info,) = store.experiments()
    assert dict(info.spans_per_arm) == {"control": 2, "candidate": 1, "": 1}
    assert info.artifact_kinds == ("tokens/control",)
    with pytest.raises(UnknownExperiment):
        store.experiment_data("other")


def test_concurrent_writers_lose_nothing(store: SqliteSpanStore) -> None:
    def write(base: int) -> None:
        for k in range(20):
            store.add_spans([_row(base + 10 * k + j) for j in range(10)])

    threads = [threading.Thread(target=write, args=(10_000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.spans()) == 4 * 20 * 10


def test_close_is_idempotent_and_final(tmp_path: Any) -> None:
    s = SqliteSpanStore(str(tmp_path / "c.db"))
    s.add_spans([_row(1)])
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.spans()
    again = SqliteSpanStore(str(tmp_path / "c.db"))
    assert len(again.spans()) == 1
    again.close()


# --- write-once artifacts ----------------------------------------------------------------------


@pytest.mark.parametrize("second", [
    Artifact("e", ArtifactKind.TOKENS, "control", "b" * 64, completion_tokens=3),  # other tokens
    Artifact("e", ArtifactKind.TOKENS, "control", "a" * 64, completion_tokens=4),  # other count
])  # fmt: skip
def test_a_conflicting_artifact_is_refused_and_the_first_stays(store: SqliteSpanStore, second: Artifact) -> None:
    first = Artifact("e", ArtifactKind.TOKENS, "control", "a" * 64, completion_tokens=3)
    store.add_artifact(first)
    with pytest.raises(ArtifactConflict, match="write-once"):
        store.add_artifact(second)
    assert store.experiment_data("e").artifacts == (first,)
    # Another arm or kind of the same experiment is a different record, not a conflict.
    assert store.add_artifact(Artifact("e", ArtifactKind.TOKENS, "candidate", "b" * 64)) is True


# --- paged timings without the store lock -------------------------------------------------------


def _timing_rows(n_names: int) -> list[SpanRecord]:
    rows, i = [], 0
    for k in range(n_names):
        for j in range(k + 1):  # name k has k + 1 spans of growing durations, over two arms
            rows.append(_row(i, name=f"span{k:03d}", arm=("control", "candidate")[j % 2], dur=10 * j + k))
            i += 1
    return rows


def test_timings_pages_cover_every_name_once_with_numpy_quantiles(store: SqliteSpanStore) -> None:
    rows = _timing_rows(23)
    store.add_spans(rows)
    seen, token, pages = [], "", 0
    while True:
        page = store.timings(None, None, 5, token)
        assert len({t.span_name for t in page.timings}) <= 5
        seen.extend(page.timings)
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert pages == 5 and [t.span_name for t in seen] == [f"span{k:03d}" for k in range(23)]
    for t in seen:
        ds = [r.duration_ns for r in rows if r.name == t.span_name]
        assert t.arm == "" and t.count == len(ds)
        assert t.quantiles_ns == tuple(float(np.quantile(ds, q)) for q in (0.5, 0.9, 0.99))
    by_arm = store.timings("e", "span004", 10, "").timings
    assert [(t.arm, t.count) for t in by_arm] == [("candidate", 2), ("control", 3)]
    ctl = [r.duration_ns for r in rows if r.name == "span004" and r.arm == "control"]
    assert by_arm[1].quantiles_ns[1] == float(np.quantile(ctl, 0.9))
    assert store.timings("other", None, 10, "").timings == ()


def test_a_forged_page_token_is_refused(store: SqliteSpanStore) -> None:
    for bad in ("not base64!", "eyJ4IjogMX0=", "W10="):  # garbage, {"x": 1}, []
        with pytest.raises(InvalidPageToken):
            store.timings(None, None, 5, bad)


def test_reads_do_not_wait_for_the_write_lock(store: SqliteSpanStore) -> None:
    """A long scan must not stall ingestion, and a long write must not stall dashboards: reads
    use their own WAL snapshot instead of the writers' lock."""
    store.add_spans(_timing_rows(4))
    done = threading.Event()
    result: list[Any] = []

    def read() -> None:
        result.append(store.timings(None, None, 100, ""))
        result.append(store.experiments())
        result.append(store.experiment_data("e"))
        done.set()

    with store._lock:  # a writer holding the lock (e.g. a big Export transaction)
        threading.Thread(target=read, daemon=True).start()
        assert done.wait(timeout=10), "reads blocked on the write lock"
    assert len(result[0].timings) == 4


def test_span_detail_round_trips_and_an_older_store_is_migrated(tmp_path: Any) -> None:
    import dataclasses

    detail = {"kind": "client", "status": {"code": "ok", "message": ""}, "events": [{"name": "x", "time_ns": 5}]}
    path = str(tmp_path / "old.db")
    # A store as written before span detail was kept: no detail column.
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE spans (trace_id TEXT NOT NULL, span_id TEXT NOT NULL, parent_span_id TEXT NOT NULL, "
        "name TEXT NOT NULL, service TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, "
        "duration_ns INTEGER NOT NULL, experiment_id TEXT NOT NULL, arm TEXT NOT NULL, attributes TEXT NOT NULL, "
        "received_ns INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (trace_id, span_id));"
        "INSERT INTO spans VALUES ('" + "a" * 32 + "', '" + "b" * 16 + "', '', 'old', 's', 1, 2, 1, '', '', '{}', 3);"
    )
    old.commit()
    old.close()
    store = SqliteSpanStore(path)
    try:
        store.add_spans([dataclasses.replace(_row(1), detail=detail)])
        by_name = {r.name: r for r in store.spans()}
        assert by_name["old"].detail == {} and by_name["attention"].detail == detail
    finally:
        store.close()


@pytest.mark.parametrize("make", ["not a database", "missing folder", "a folder"])
def test_a_path_that_cannot_be_a_store_is_said_naming_db(tmp_path, make: str) -> None:
    """sqlite3's own errors used to end the telemetry service in a traceback."""
    from telemetry_svc.store import StoreUnusable

    path = {"not a database": tmp_path / "t.db", "missing folder": tmp_path / "no" / "t.db", "a folder": tmp_path}[make]
    if make == "not a database":
        path.write_text("not sqlite\n" * 100)
    with pytest.raises(
        StoreUnusable, match=rf"^cannot keep spans in {path} \(--db\): .+; name a kvfleet telemetry\.db"
    ):
        SqliteSpanStore(str(path))

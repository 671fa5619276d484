"""telemetry_svc.store.SqliteSpanStore: rows round-trip, duplicates, artifacts, threads, close."""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

import pytest

from telemetry_svc.model import Arm, Artifact, ArtifactKind, SpanRecord, UnknownExperiment
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
    idx = {r[1] for r in con.execute("PRAGMA index_list(spans)")}
    assert "spans_experiment_arm_name" in idx
    con.close()


def test_experiment_data_and_artifacts(store: SqliteSpanStore) -> None:
    store.add_spans([_row(1, dur=10), _row(2, dur=20), _row(3, arm="candidate", dur=5), _row(4, arm="", dur=7)])
    store.add_artifact(Artifact("e", ArtifactKind.TOKENS, "control", "a" * 64, completion_tokens=3))
    store.add_artifact(Artifact("e", ArtifactKind.TOKENS, "control", "b" * 64, completion_tokens=4))  # replaces
    data = store.experiment_data("e")
    assert data.samples("attention", Arm.CONTROL) == (10, 20)
    assert data.samples("attention", Arm.CANDIDATE) == (5,)
    assert data.artifacts == (Artifact("e", ArtifactKind.TOKENS, "control", "b" * 64, completion_tokens=4),)
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

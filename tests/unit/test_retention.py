"""telemetry_svc.retention over a real SqliteSpanStore: age, size, artifacts, policy checks."""

from __future__ import annotations

import time
from typing import Any

import pytest

from telemetry_svc.model import Artifact, ArtifactKind, SpanRecord
from telemetry_svc.retention import RetentionPolicy, enforce
from telemetry_svc.store import SqliteSpanStore

HOUR_NS = 3600 * 10**9


def _rows(start: int, n: int, pad: int = 0, exp: str = "e") -> list[SpanRecord]:
    return [SpanRecord(f"{start + i:032x}", f"{start + i + 1:016x}", "", "attention", "worker", 1_000, 2_000, exp,
                       "control", {"pad": "x" * pad}) for i in range(n)]  # fmt: skip


@pytest.fixture
def store(tmp_path: Any) -> Any:
    s = SqliteSpanStore(str(tmp_path / "r.db"))
    yield s
    s.close()


def test_spans_and_artifacts_older_than_the_retention_go(store: SqliteSpanStore) -> None:
    store.add_spans(_rows(0, 50, exp="old"))
    store.add_artifact(Artifact("old", ArtifactKind.TREATMENT, value="lever"))
    received = time.time_ns()
    store.add_spans(_rows(1_000, 20, exp="new"))
    policy = RetentionPolicy(max_age_s=1.0, max_bytes=1 << 30)
    assert enforce(store, policy, received).deleted_by_age == 0  # nothing is a second old yet
    result = enforce(store, policy, received + HOUR_NS)  # an hour later everything is
    assert result.deleted_by_age == 70 and result.spans == 0
    assert store.experiments() == []  # the artifact aged out with its spans


def test_age_is_by_receipt_not_by_the_span_own_clock(store: SqliteSpanStore) -> None:
    # Spans stamped in 1970 (start 1 µs) were received now: a week's retention keeps them.
    store.add_spans(_rows(0, 10))
    result = enforce(store, RetentionPolicy(), time.time_ns())
    assert (result.deleted_by_age, result.spans) == (0, 10)


def test_the_oldest_spans_go_while_the_store_is_over_its_size(store: SqliteSpanStore) -> None:
    for batch in range(6):  # ~6 x 400 KB, received in order
        store.add_spans(_rows(batch * 1_000, 200, pad=2_000, exp=f"b{batch}"))
    before = store.live_bytes()
    assert before > 2 * 2**20
    policy = RetentionPolicy(max_age_s=3600, max_bytes=1 * 2**20)
    result = enforce(store, policy, time.time_ns())
    assert result.deleted_by_size > 0 and result.live_bytes <= policy.max_bytes
    assert result.spans == 1_200 - result.deleted_by_size
    kept = {i.experiment_id for i in store.experiments()}
    assert "b5" in kept and "b0" not in kept  # the newest survive, the oldest went first


def test_under_the_limits_nothing_is_deleted(store: SqliteSpanStore) -> None:
    store.add_spans(_rows(0, 100))
    result = enforce(store, RetentionPolicy(), time.time_ns())
    assert (result.deleted_by_age, result.deleted_by_size, result.spans) == (0, 0, 100)


@pytest.mark.parametrize("hours, mb", [(0, 1024), (-1, 1024), (1, 0.5)])
def test_a_nonsensical_policy_is_refused(hours: float, mb: float) -> None:
    with pytest.raises(ValueError):
        RetentionPolicy.from_flags(hours, mb)


def test_artifacts_count_toward_the_size_and_the_oldest_go(store: SqliteSpanStore) -> None:
    # Only artifacts, ~2.4 MB of them, recorded in order: spans alone could never bring this down.
    for i in range(240):
        store.add_artifact(Artifact(f"x{i:03d}", ArtifactKind.TREATMENT, value=f"{i}" + "v" * 10_000))
    assert store.live_bytes() > 2 * 2**20
    policy = RetentionPolicy(max_age_s=3600, max_bytes=1 * 2**20)
    result = enforce(store, policy, time.time_ns())
    assert result.artifacts_deleted_by_size > 0 and result.live_bytes <= policy.max_bytes
    kept = sorted(i.experiment_id for i in store.experiments())
    assert kept and len(kept) == 240 - result.artifacts_deleted_by_size
    assert kept[-1] == "x239" and "x000" not in kept  # the newest survive, the oldest went first


def test_size_retention_takes_spans_and_artifacts_oldest_first(store: SqliteSpanStore) -> None:
    store.add_artifact(Artifact("old", ArtifactKind.TREATMENT, value="o" * 200_000))
    for batch in range(6):
        store.add_spans(_rows(batch * 1_000, 200, pad=2_000, exp=f"b{batch}"))
    store.add_artifact(Artifact("new", ArtifactKind.TREATMENT, value="n" * 200_000))
    result = enforce(store, RetentionPolicy(max_age_s=3600, max_bytes=1 * 2**20), time.time_ns())
    assert result.live_bytes <= 1 * 2**20
    kinds = {i.experiment_id: i.artifact_kinds for i in store.experiments()}
    assert "old" not in kinds, "the artifact older than every span outlived them"
    assert kinds.get("new") == ("treatment",), "the newest artifact went before older spans"
    assert result.artifacts_deleted_by_size == 1

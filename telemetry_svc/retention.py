"""How long and how much the span store keeps. Pure policy over the store's retention methods:
no clock (the caller passes `now_ns`), no threads, no metrics.

Age first (spans and artifacts received more than max_age_s ago), then size: while the pages in
use exceed max_bytes, the earliest-received data goes, in batches sized from the average row.
Artifacts count like spans (their bytes are pages of the same file) and go oldest first too: a
round deletes artifacts when the oldest row of the store is an artifact (those recorded before
every remaining span), else spans. So no kind of write can grow the store past its bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_RETENTION_HOURS = 168.0  # a week: long enough to compare this week's runs with last week's
DEFAULT_MAX_DB_MB = 1024
_MIN_BATCH = 256
_MAX_ROUNDS = 1_000  # a safety stop: each round deletes at least _MIN_BATCH spans


class RetentionStore(Protocol):
    def delete_received_before(self, cutoff_ns: int) -> int: ...
    def delete_oldest_spans(self, n: int) -> int: ...
    def delete_oldest_artifacts(self, n: int, not_after_ns: int | None = None) -> int: ...
    def oldest_received(self) -> tuple[int | None, int | None]: ...
    def artifact_count(self) -> int: ...
    def live_bytes(self) -> int: ...
    def span_count(self) -> int: ...
    def reclaim(self) -> None: ...


@dataclass(frozen=True)
class RetentionPolicy:
    max_age_s: float = DEFAULT_RETENTION_HOURS * 3600
    max_bytes: int = DEFAULT_MAX_DB_MB * 1024 * 1024
    interval_s: float = 60.0  # between enforcement runs

    def __post_init__(self) -> None:
        if self.max_age_s <= 0:
            raise ValueError(f"retention must be > 0 hours, got {self.max_age_s / 3600:g}")
        if self.max_bytes < 1024 * 1024:
            raise ValueError(f"max DB size must be >= 1 MB, got {self.max_bytes} bytes")
        if self.interval_s <= 0:
            raise ValueError("retention interval must be > 0 s")

    @classmethod
    def from_flags(cls, retention_hours: float, max_db_mb: float, interval_s: float = 60.0) -> "RetentionPolicy":
        return cls(retention_hours * 3600, int(max_db_mb * 1024 * 1024), interval_s)


@dataclass(frozen=True)
class RetentionResult:
    deleted_by_age: int
    deleted_by_size: int
    live_bytes: int  # after enforcement
    spans: int  # after enforcement
    artifacts_deleted_by_size: int = 0


def enforce(store: RetentionStore, policy: RetentionPolicy, now_ns: int) -> RetentionResult:
    by_age = store.delete_received_before(now_ns - int(policy.max_age_s * 1e9))
    by_size = artifacts_by_size = 0
    size, count, artifacts = store.live_bytes(), store.span_count(), store.artifact_count()
    for _ in range(_MAX_ROUNDS):
        if size <= policy.max_bytes or count + artifacts == 0:
            break
        # Overshoot a little (10 %) so one round usually suffices; pages only free up when whole.
        per_row = size / (count + artifacts)
        rows = int((size - policy.max_bytes) / per_row * 1.1)
        oldest_span, oldest_artifact = store.oldest_received()
        if oldest_artifact is not None and (oldest_span is None or oldest_artifact <= oldest_span):
            # No batch floor here: artifacts are few and large, and each one is an experiment's record.
            deleted = store.delete_oldest_artifacts(max(1, rows), oldest_span)
            artifacts_by_size += deleted
        else:
            deleted = store.delete_oldest_spans(max(_MIN_BATCH, rows))
            by_size += deleted
        size, count, artifacts = store.live_bytes(), store.span_count(), store.artifact_count()
        if deleted == 0:
            break
    if by_age or by_size or artifacts_by_size:
        store.reclaim()
        size = store.live_bytes()
    return RetentionResult(by_age, by_size, size, count, artifacts_by_size)

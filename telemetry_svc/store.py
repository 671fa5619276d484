"""Span and artifact storage: a `SpanStore` protocol and its SQLite implementation.

SQLite in WAL mode so dashboards can read the file while the receiver writes it; one
transaction per Export batch; (trace_id, span_id) is the primary key, so an exporter that
retries a batch after a lost response does not double-count spans.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from telemetry_svc.model import ARMS, Arm, Artifact, ArtifactKind, ExperimentData, SpanRecord, UnknownExperiment

_SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    parent_span_id TEXT NOT NULL,
    name TEXT NOT NULL,
    service TEXT NOT NULL,
    start_ns INTEGER NOT NULL,
    end_ns INTEGER NOT NULL,
    duration_ns INTEGER NOT NULL,
    experiment_id TEXT NOT NULL,
    arm TEXT NOT NULL,
    attributes TEXT NOT NULL,
    PRIMARY KEY (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_experiment_arm_name ON spans (experiment_id, arm, name);
CREATE INDEX IF NOT EXISTS spans_name ON spans (name);
CREATE TABLE IF NOT EXISTS artifacts (
    experiment_id TEXT NOT NULL,
    arm TEXT NOT NULL,
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    value TEXT NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    PRIMARY KEY (experiment_id, arm, kind)
);
"""

_SPAN_COLUMNS = (
    "trace_id, span_id, parent_span_id, name, service, start_ns, end_ns, duration_ns, experiment_id, arm, attributes"
)


@dataclass(frozen=True)
class ExperimentInfo:
    experiment_id: str
    spans_per_arm: Mapping[str, int]  # "control" | "candidate" | "" (no arm) -> span count
    artifact_kinds: tuple[str, ...]  # "tokens/control", "workload", ... sorted


class SpanStore(Protocol):
    @property
    def location(self) -> str: ...
    def add_spans(self, rows: Sequence[SpanRecord]) -> int: ...
    def add_artifact(self, artifact: Artifact) -> None: ...
    def spans(self, experiment_id: str | None = None, name: str | None = None) -> list[SpanRecord]: ...
    def durations(self, experiment_id: str | None, name: str | None) -> dict[tuple[str, str], list[int]]: ...
    def experiment_data(self, experiment_id: str) -> ExperimentData: ...
    def experiments(self) -> list[ExperimentInfo]: ...
    def close(self) -> None: ...


def _where(experiment_id: str | None, name: str | None) -> tuple[str, list[str]]:
    clauses, args = [], []
    if experiment_id is not None:
        clauses.append("experiment_id = ?")
        args.append(experiment_id)
    if name is not None:
        clauses.append("name = ?")
        args.append(name)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


class SqliteSpanStore:
    """Thread-safe: one connection guarded by a lock (calls arrive via asyncio.to_thread)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; fine for telemetry
        self._conn.executescript(_SCHEMA)

    @property
    def location(self) -> str:
        return self._path

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("span store is closed")
        return self._conn

    def add_spans(self, rows: Sequence[SpanRecord]) -> int:
        """Store rows in one transaction; returns how many were new (duplicates are ignored)."""
        values = [
            (r.trace_id, r.span_id, r.parent_span_id, r.name, r.service, r.start_ns, r.end_ns, r.duration_ns,
             r.experiment_id, r.arm, json.dumps(dict(r.attributes), sort_keys=True))
            for r in rows
        ]  # fmt: skip
        with self._lock:
            db = self._db()
            before = db.total_changes
            db.execute("BEGIN")
            try:
                db.executemany(f"INSERT OR IGNORE INTO spans ({_SPAN_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)", values)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return db.total_changes - before

    def add_artifact(self, artifact: Artifact) -> None:
        a = artifact
        with self._lock:
            self._db().execute(
                "INSERT OR REPLACE INTO artifacts VALUES (?,?,?,?,?,?,?)",
                (a.experiment_id, a.arm, a.kind.value, a.sha256, a.value, a.completion_tokens, a.cached_tokens),
            )

    def spans(self, experiment_id: str | None = None, name: str | None = None) -> list[SpanRecord]:
        where, args = _where(experiment_id, name)
        with self._lock:
            rows = self._db().execute(f"SELECT {_SPAN_COLUMNS} FROM spans{where} ORDER BY start_ns", args).fetchall()
        return [
            SpanRecord(t, s, p, n, svc, st, en, experiment_id=e, arm=arm, attributes=json.loads(attrs))
            for (t, s, p, n, svc, st, en, _dur, e, arm, attrs) in rows
        ]

    def durations(self, experiment_id: str | None, name: str | None) -> dict[tuple[str, str], list[int]]:
        """(span name, arm) -> durations in start order."""
        where, args = _where(experiment_id, name)
        out: dict[tuple[str, str], list[int]] = defaultdict(list)
        with self._lock:
            cur = self._db().execute(f"SELECT name, arm, duration_ns FROM spans{where} ORDER BY start_ns", args)
            for n, arm, d in cur:
                out[(n, arm)].append(d)
        return dict(out)

    def _artifacts(self, experiment_id: str) -> tuple[Artifact, ...]:
        rows = self._db().execute(
            "SELECT experiment_id, kind, arm, sha256, value, completion_tokens, cached_tokens"
            " FROM artifacts WHERE experiment_id = ? ORDER BY kind, arm",
            (experiment_id,),
        ).fetchall()
        return tuple(Artifact(e, ArtifactKind(k), arm, sha, v, ct, ca) for e, k, arm, sha, v, ct, ca in rows)

    def experiment_data(self, experiment_id: str) -> ExperimentData:
        by_name: dict[str, dict[Arm, list[int]]] = defaultdict(lambda: defaultdict(list))
        for (name, arm), ds in self.durations(experiment_id, None).items():
            if arm in (a.value for a in ARMS):
                by_name[name][Arm(arm)].extend(ds)
        with self._lock:
            artifacts = self._artifacts(experiment_id)
        if not by_name and not artifacts and not self._has_spans(experiment_id):
            raise UnknownExperiment(f"no spans or artifacts for experiment {experiment_id!r}")
        durations = {n: {a: tuple(ds) for a, ds in by_arm.items()} for n, by_arm in by_name.items()}
        return ExperimentData(experiment_id, durations, artifacts)

    def _has_spans(self, experiment_id: str) -> bool:
        with self._lock:
            q = "SELECT 1 FROM spans WHERE experiment_id = ? LIMIT 1"
            return self._db().execute(q, (experiment_id,)).fetchone() is not None

    def experiments(self) -> list[ExperimentInfo]:
        with self._lock:
            db = self._db()
            counts = db.execute(
                "SELECT experiment_id, arm, COUNT(*) FROM spans WHERE experiment_id != '' GROUP BY experiment_id, arm"
            ).fetchall()
            kinds = db.execute("SELECT experiment_id, kind, arm FROM artifacts").fetchall()
        per_arm: dict[str, dict[str, int]] = defaultdict(dict)
        for e, arm, n in counts:
            per_arm[e][arm] = n
        art: dict[str, list[str]] = defaultdict(list)
        for e, kind, arm in kinds:
            art[e].append(f"{kind}/{arm}" if arm else kind)
        ids = sorted(set(per_arm) | set(art))
        return [ExperimentInfo(e, dict(per_arm.get(e, {})), tuple(sorted(art.get(e, [])))) for e in ids]

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close; later calls are no-ops."""
        with self._lock:
            if self._conn is None:
                return
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.close()
            self._conn = None


"""Span and artifact storage: a `SpanStore` protocol and its SQLite implementation.

SQLite in WAL mode so readers never wait for the writer: writes (one transaction per Export
batch, artifacts, retention deletes) go through one connection under a lock; reads open their
own short-lived read-only connection and take no lock, so a long scan cannot stall ingestion.
(trace_id, span_id) is the primary key, so an exporter that retries a batch after a lost
response does not double-count spans. Artifacts are write-once per (experiment, arm, kind).
"""

from __future__ import annotations

import base64
import binascii
import json
import sqlite3
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from telemetry_svc.model import (
    ARMS,
    Arm,
    Artifact,
    ArtifactConflict,
    ArtifactKind,
    ExperimentData,
    InvalidPageToken,  # fmt: skip
    ServiceCall,
    SpanRecord,
    TraceSearch,
    TraceSpans,
    UnknownExperiment,
)
from telemetry_svc.stats import quantile

_TABLES = """
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
    received_ns INTEGER NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (trace_id, span_id)
);
CREATE TABLE IF NOT EXISTS artifacts (
    experiment_id TEXT NOT NULL,
    arm TEXT NOT NULL,
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    value TEXT NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL,
    recorded_ns INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (experiment_id, arm, kind)
);
"""
# Retention ages by receipt time, not span time: exporters' clocks (and replayed traces) can be
# anywhere, but what we must bound is how long we have been holding the data.
# (name, duration_ns) and (experiment_id, name, arm, duration_ns) let GetTimings read counts and
# quantiles straight off an index (ORDER BY duration_ns LIMIT 2 OFFSET k) without loading spans.
# (service, start_ns) and (service, name, start_ns) serve the Jaeger API (telemetry_svc/jaeger.py):
# a service's or an operation's latest spans first, its services and operations by seeks.
# The two experiment indexes hold experiment spans only: serving traffic, most of the spans, skips
# two of the six index inserts (measured: 21 -> 17.6 us to store a span). SQLite uses a partial
# index only for a query that repeats its WHERE term, so every query by experiment does
# (``_by_experiment``). The full indexes of earlier versions are dropped.
_IN_EXPERIMENT = "experiment_id != ''"
_INDEXES = f"""
DROP INDEX IF EXISTS spans_experiment_arm_name;
DROP INDEX IF EXISTS spans_experiment_name_arm_duration;
CREATE INDEX IF NOT EXISTS spans_in_experiment_arm_name ON spans (experiment_id, arm, name) WHERE {_IN_EXPERIMENT};
CREATE INDEX IF NOT EXISTS spans_in_experiment_name_arm_duration ON spans (experiment_id, name, arm, duration_ns)
    WHERE {_IN_EXPERIMENT};
CREATE INDEX IF NOT EXISTS spans_name_duration ON spans (name, duration_ns);
CREATE INDEX IF NOT EXISTS spans_received ON spans (received_ns);
CREATE INDEX IF NOT EXISTS spans_service_start ON spans (service, start_ns);
CREATE INDEX IF NOT EXISTS spans_service_name_start ON spans (service, name, start_ns);
DROP INDEX IF EXISTS spans_name;
"""

# json.dumps(value, sort_keys=True), without building an encoder for each call (two a span).
_json = json.JSONEncoder(sort_keys=True).encode

_SPAN_COLUMNS = (
    "trace_id, span_id, parent_span_id, name, service, start_ns, end_ns, duration_ns, experiment_id, arm, attributes, "
    "detail"
)
_ARTIFACT_COLUMNS = "experiment_id, kind, arm, sha256, value, completion_tokens, cached_tokens"
TIMING_QUANTILES = (0.5, 0.9, 0.99)
# Spans one trace search reads at most (~a second of SQLite and JSON): a tag filter that matches
# nothing must not read a whole store.
MAX_SEARCH_SCAN = 200_000


@dataclass(frozen=True)
class ExperimentInfo:
    experiment_id: str
    spans_per_arm: Mapping[str, int]  # "control" | "candidate" | "" (no arm) -> span count
    artifact_kinds: tuple[str, ...]  # "tokens/control", "workload", ... sorted


@dataclass(frozen=True)
class SpanTiming:
    span_name: str
    arm: str  # "" when grouped by name only
    count: int
    quantiles_ns: tuple[float, ...]  # at TIMING_QUANTILES, numpy "linear"


@dataclass(frozen=True)
class TimingsPage:
    timings: tuple[SpanTiming, ...]  # sorted by (span_name, arm)
    next_page_token: str  # "" on the last page


class SpanStore(Protocol):
    @property
    def location(self) -> str: ...
    def add_spans(self, rows: Sequence[SpanRecord]) -> int: ...
    def add_artifact(self, artifact: Artifact) -> bool: ...
    def spans(self, experiment_id: str | None = None, name: str | None = None) -> list[SpanRecord]: ...
    def timings(self, experiment_id: str | None, name: str | None, page_size: int, page_token: str) -> TimingsPage: ...
    def experiment_data(self, experiment_id: str) -> ExperimentData: ...
    def experiments(self) -> list[ExperimentInfo]: ...
    def services(self) -> list[str]: ...
    def operations(self, service: str) -> list[str]: ...
    def search_traces(self, service: str, *, operation: str = "", start_min_ns: int | None = None,
                      start_max_ns: int | None = None, min_duration_ns: int | None = None,
                      max_duration_ns: int | None = None, limit: int = 100,
                      matches: Callable[[SpanRecord], bool] | None = None,
                      max_scanned: int = MAX_SEARCH_SCAN) -> TraceSearch: ...  # fmt: skip
    def trace(self, trace_id: str, max_spans: int) -> TraceSpans: ...
    def service_calls(self, start_ns: int, end_ns: int) -> list[ServiceCall]: ...
    def delete_received_before(self, cutoff_ns: int) -> int: ...
    def delete_oldest_spans(self, n: int) -> int: ...
    def delete_oldest_artifacts(self, n: int, not_after_ns: int | None = None) -> int: ...
    def oldest_received(self) -> tuple[int | None, int | None]: ...
    def artifact_count(self) -> int: ...
    def live_bytes(self) -> int: ...
    def reclaim(self) -> None: ...
    def span_count(self) -> int: ...
    def close(self) -> None: ...


def _by_experiment(experiment_id: str) -> str:
    """The WHERE terms for one experiment's spans ("": the spans of none), with the experiment
    indexes' own term where they hold them."""
    return f"experiment_id = ? AND {_IN_EXPERIMENT}" if experiment_id else "experiment_id = ?"


def _where(experiment_id: str | None, name: str | None) -> tuple[str, list[str]]:
    clauses, args = [], []
    if experiment_id is not None:
        clauses.append(_by_experiment(experiment_id))
        args.append(experiment_id)
    if name is not None:
        clauses.append("name = ?")
        args.append(name)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def _distinct(db: sqlite3.Connection, column: str, where: str, args: list[Any]) -> list[str]:
    """The distinct values of an indexed column, sorted, by one MIN() seek each: O(values x log n)
    however many spans hold them."""
    out: list[str] = []
    (value,) = db.execute(f"SELECT MIN({column}) FROM spans WHERE 1{where}", args).fetchone()
    while value is not None:
        out.append(value)
        (value,) = db.execute(f"SELECT MIN({column}) FROM spans WHERE {column} > ?{where}", [value, *args]).fetchone()
    return out


def encode_page_token(after_name: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": after_name}).encode()).decode()


def decode_page_token(token: str) -> str:
    """The span name the previous page ended with ("" for the first page)."""
    if not token:
        return ""
    try:
        after = json.loads(base64.urlsafe_b64decode(token.encode()))["after"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise InvalidPageToken("page_token is not one this service issued; start again without it") from None
    if not isinstance(after, str):
        raise InvalidPageToken("page_token is not one this service issued; start again without it")
    return after


def _record(row: Sequence[Any]) -> SpanRecord:
    """A row of _SPAN_COLUMNS as a SpanRecord."""
    t, s, p, n, svc, st, en, _dur, e, arm, attrs, det = row
    return SpanRecord(t, s, p, n, svc, st, en, experiment_id=e, arm=arm, attributes=json.loads(attrs),
                      detail=json.loads(det))  # fmt: skip


def _quantile_at(db: sqlite3.Connection, where: str, args: Sequence[object], n: int, q: float) -> float:
    # numpy's linear quantile needs the sorted values at floor(h) and floor(h) + 1, h = (n - 1) q;
    # the index hands them over without materializing the other n - 2 durations.
    h = (n - 1) * q
    lo = int(h)
    pair = [d for (d,) in db.execute(f"SELECT duration_ns FROM spans{where} ORDER BY duration_ns LIMIT 2 OFFSET ?",
                                     (*args, lo))]  # fmt: skip
    if len(pair) == 1:
        return float(pair[0])
    return quantile(pair, h - lo)  # the same interpolation numpy does between those two


class StoreUnusable(ValueError):
    """The path given for the store cannot be one (not a database, no such folder, no rights)."""


class SqliteSpanStore:
    """Thread-safe: writes share one connection under a lock; reads use their own connection."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._memory = path == ":memory:"
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            # Only takes effect on a new file: lets retention hand freed pages back to the OS.
            self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; fine for telemetry
            self._conn.executescript(_TABLES)
            self._migrate()
            self._conn.executescript(_INDEXES)
        except sqlite3.Error as exc:
            if self._conn is not None:
                self._conn.close()
            raise StoreUnusable(
                f"cannot keep spans in {path} (--db): {exc}; name a kvfleet telemetry.db, or a new file in a folder "
                "that exists and can be written"
            ) from None

    def _migrate(self) -> None:
        """Stores written before retention existed: their rows count as received now; before
        span detail was kept: their spans have none ({})."""
        db = self._db()
        now = time.time_ns()
        for table, column in (("spans", "received_ns"), ("artifacts", "recorded_ns")):
            have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} INTEGER NOT NULL DEFAULT {int(now)}")
        if "detail" not in {r[1] for r in db.execute("PRAGMA table_info(spans)")}:
            db.execute("ALTER TABLE spans ADD COLUMN detail TEXT NOT NULL DEFAULT '{}'")

    @property
    def location(self) -> str:
        return self._path

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("span store is closed")
        return self._conn

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """A read-only connection of its own (WAL: sees the last commit, blocks no writer)."""
        self._db()  # a closed store stays closed for readers too
        if self._memory:  # an in-memory database has no second connection
            with self._lock:
                yield self._db()
            return
        conn = sqlite3.connect(Path(self._path).resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False)
        try:
            yield conn
        finally:
            conn.close()

    def add_spans(self, rows: Sequence[SpanRecord]) -> int:
        """Store rows in one transaction; returns how many were new (duplicates are ignored)."""
        now = time.time_ns()
        details: dict[int, str] = {}  # by id: rows may share one detail (otlp.convert)

        def detail_json(d: Mapping[str, Any]) -> str:
            got = details.get(id(d))
            if got is None:
                got = details[id(d)] = _json(dict(d))
            return got

        values = [
            (r.trace_id, r.span_id, r.parent_span_id, r.name, r.service, r.start_ns, r.end_ns, r.duration_ns,
             r.experiment_id, r.arm, _json(dict(r.attributes)), detail_json(r.detail), now)
            for r in rows
        ]  # fmt: skip
        with self._lock:
            db = self._db()
            before = db.total_changes
            db.execute("BEGIN")
            try:
                db.executemany(
                    f"INSERT OR IGNORE INTO spans ({_SPAN_COLUMNS}, received_ns) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    values,
                )
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return db.total_changes - before

    def add_artifact(self, artifact: Artifact) -> bool:
        """Record once. Returns True when stored now, False when the identical artifact was already
        there (a retry); raises ArtifactConflict when different content is already recorded."""
        a = artifact
        row = (a.experiment_id, a.kind.value, a.arm, a.sha256, a.value, a.completion_tokens, a.cached_tokens)
        with self._lock:
            db = self._db()
            cur = db.execute(f"INSERT OR IGNORE INTO artifacts ({_ARTIFACT_COLUMNS}, recorded_ns) "
                             "VALUES (?,?,?,?,?,?,?,?)", (*row, time.time_ns()))  # fmt: skip
            if cur.rowcount == 1:
                return True
            existing = db.execute(f"SELECT {_ARTIFACT_COLUMNS} FROM artifacts WHERE experiment_id = ? AND kind = ?"
                                  " AND arm = ?", (a.experiment_id, a.kind.value, a.arm)).fetchone()  # fmt: skip
        if tuple(existing) == row:
            return False
        what = f"{a.kind.value}/{a.arm}" if a.arm else a.kind.value
        raise ArtifactConflict(
            f"experiment {a.experiment_id!r} already has a different {what} artifact "
            f"(sha256 {existing[3] or '-'}, value {existing[4]!r}); artifacts are write-once, "
            "so run the experiment again under a new experiment id"
        )

    def spans(self, experiment_id: str | None = None, name: str | None = None) -> list[SpanRecord]:
        where, args = _where(experiment_id, name)
        with self._reading() as db:
            rows = db.execute(f"SELECT {_SPAN_COLUMNS} FROM spans{where} ORDER BY start_ns", args).fetchall()
        return [_record(r) for r in rows]

    def durations(self, experiment_id: str | None, name: str | None) -> dict[tuple[str, str], list[int]]:
        """(span name, arm) -> durations in start order."""
        where, args = _where(experiment_id, name)
        out: dict[tuple[str, str], list[int]] = defaultdict(list)
        with self._reading() as db:
            for n, arm, d in db.execute(f"SELECT name, arm, duration_ns FROM spans{where} ORDER BY start_ns", args):
                out[(n, arm)].append(d)
        return dict(out)

    def timings(self, experiment_id: str | None, name: str | None, page_size: int, page_token: str) -> TimingsPage:
        """One page of per-name timings (grouped by arm when an experiment is given), names after
        the token's, at most page_size names. Counts and quantiles come from the indexes."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        after = decode_page_token(page_token)
        exp_clause = f" AND {_by_experiment(experiment_id)}" if experiment_id is not None else ""
        exp_args = [experiment_id] if experiment_id is not None else []
        out: list[SpanTiming] = []
        with self._reading() as db:
            names: list[str] = []
            cursor = after
            while len(names) <= page_size:  # one more than the page, to know whether there is more
                # MIN(name) over an index is a seek, not a scan: O(page * log n) however many spans.
                (nxt,) = db.execute(f"SELECT MIN(name) FROM spans WHERE name > ?{exp_clause}"
                                    + (" AND name = ?" if name is not None else ""),
                                    [cursor, *exp_args, *([name] if name is not None else [])]).fetchone()  # fmt: skip
                if nxt is None:
                    break
                names.append(nxt)
                cursor = nxt
            more, names = len(names) > page_size, names[:page_size]
            for n in names:
                if experiment_id is None:
                    (count,) = db.execute("SELECT COUNT(*) FROM spans WHERE name = ?", (n,)).fetchone()
                    groups = [("", count, " WHERE name = ?", [n])]
                else:
                    by_exp = _by_experiment(experiment_id)
                    by_arm = db.execute(f"SELECT arm, COUNT(*) FROM spans WHERE {by_exp} AND name = ?"
                                        " GROUP BY arm ORDER BY arm", (experiment_id, n)).fetchall()  # fmt: skip
                    where = f" WHERE {by_exp} AND name = ? AND arm = ?"
                    groups = [(arm, count, where, [experiment_id, n, arm]) for arm, count in by_arm]
                for arm, count, where, args in groups:
                    qs = tuple(_quantile_at(db, where, args, count, q) for q in TIMING_QUANTILES)
                    out.append(SpanTiming(n, arm, count, qs))
        return TimingsPage(tuple(out), encode_page_token(names[-1]) if more else "")

    def _artifacts(self, db: sqlite3.Connection, experiment_id: str) -> tuple[Artifact, ...]:
        rows = db.execute(
            f"SELECT {_ARTIFACT_COLUMNS} FROM artifacts WHERE experiment_id = ? ORDER BY kind, arm", (experiment_id,)
        ).fetchall()
        return tuple(Artifact(e, ArtifactKind(k), arm, sha, v, ct, ca) for e, k, arm, sha, v, ct, ca in rows)

    def experiment_data(self, experiment_id: str) -> ExperimentData:
        by_name: dict[str, dict[Arm, list[int]]] = defaultdict(lambda: defaultdict(list))
        for (name, arm), ds in self.durations(experiment_id, None).items():
            if arm in (a.value for a in ARMS):
                by_name[name][Arm(arm)].extend(ds)
        with self._reading() as db:
            artifacts = self._artifacts(db, experiment_id)
            has_spans = db.execute(
                f"SELECT 1 FROM spans WHERE {_by_experiment(experiment_id)} LIMIT 1", (experiment_id,)
            ).fetchone()
        if not by_name and not artifacts and has_spans is None:
            raise UnknownExperiment(f"no spans or artifacts for experiment {experiment_id!r}")
        durations = {n: {a: tuple(ds) for a, ds in by_arm.items()} for n, by_arm in by_name.items()}
        return ExperimentData(experiment_id, durations, artifacts)

    def experiments(self) -> list[ExperimentInfo]:
        with self._reading() as db:
            counts = db.execute(
                f"SELECT experiment_id, arm, COUNT(*) FROM spans WHERE {_IN_EXPERIMENT} GROUP BY experiment_id, arm"
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

    # --- traces (the Jaeger API: telemetry_svc/jaeger.py, http_api.py) ------------------------

    def services(self) -> list[str]:
        """Every service with a span, sorted ("" for spans whose resource named none)."""
        with self._reading() as db:
            return _distinct(db, "service", "", [])

    def operations(self, service: str) -> list[str]:
        """The span names of one service, sorted."""
        with self._reading() as db:
            return _distinct(db, "name", " AND service = ?", [service])

    def search_traces(self, service: str, *, operation: str = "", start_min_ns: int | None = None,
                      start_max_ns: int | None = None, min_duration_ns: int | None = None,
                      max_duration_ns: int | None = None, limit: int = 100,
                      matches: Callable[[SpanRecord], bool] | None = None,
                      max_scanned: int = MAX_SEARCH_SCAN) -> TraceSearch:  # fmt: skip
        """The traces of the latest spans of `service` (and `operation`) that pass the bounds and
        `matches`, newest span first, at most `limit` traces. Reads at most `max_scanned` spans,
        off the (service[, name], start_ns) index, so a filter that matches nothing stays bounded."""
        clauses: list[str] = ["service = ?"]
        args: list[object] = [service]
        for clause, value in (("name = ?", operation or None), ("start_ns >= ?", start_min_ns),
                              ("start_ns <= ?", start_max_ns), ("duration_ns >= ?", min_duration_ns),
                              ("duration_ns <= ?", max_duration_ns)):  # fmt: skip
            if value is not None:
                clauses.append(clause)
                args.append(value)
        columns = _SPAN_COLUMNS if matches is not None else "trace_id"  # no JSON decoded without a filter
        sql = f"SELECT {columns} FROM spans WHERE {' AND '.join(clauses)} ORDER BY start_ns DESC"
        found: dict[str, None] = {}  # insertion-ordered set
        scanned = 0
        with self._reading() as db:
            for row in db.execute(sql, args):
                scanned += 1
                if row[0] not in found and (matches is None or matches(_record(row))):
                    found[row[0]] = None
                    if len(found) >= limit:
                        break
                if scanned >= max_scanned:
                    return TraceSearch(tuple(found), scan_limited=True)
        return TraceSearch(tuple(found))

    def trace(self, trace_id: str, max_spans: int) -> TraceSpans:
        """A trace's first max_spans spans by start time (none: no such trace) and its span count."""
        with self._reading() as db:
            rows = db.execute(f"SELECT {_SPAN_COLUMNS} FROM spans WHERE trace_id = ? ORDER BY start_ns, span_id"
                              " LIMIT ?", (trace_id, max_spans)).fetchall()  # fmt: skip
            total = len(rows)
            if total == max_spans:
                (total,) = db.execute("SELECT COUNT(*) FROM spans WHERE trace_id = ?", (trace_id,)).fetchone()
        return TraceSpans(tuple(_record(r) for r in rows), int(total))

    def service_calls(self, start_ns: int, end_ns: int) -> list[ServiceCall]:
        """Per (parent's service, child's service): child spans that started in [start_ns, end_ns]
        and whose parent span is stored. One indexed range per child service."""
        out = []
        with self._reading() as db:
            for child in _distinct(db, "service", "", []):
                rows = db.execute(
                    "SELECT p.service, COUNT(*) FROM spans AS c JOIN spans AS p ON p.trace_id = c.trace_id"
                    " AND p.span_id = c.parent_span_id WHERE c.service = ? AND c.start_ns >= ? AND c.start_ns <= ?"
                    " AND c.parent_span_id != '' GROUP BY p.service ORDER BY p.service",
                    (child, start_ns, end_ns),
                ).fetchall()
                out += [ServiceCall(parent, child, int(n)) for parent, n in rows]
        return out

    # --- retention (see telemetry_svc/retention.py for the policy) ---------------------------

    def _delete_batch(self, sql: str, args: Sequence[object]) -> int:
        # Batches keep each lock hold short, so exports interleave with a large purge.
        with self._lock:
            return self._db().execute(sql, args).rowcount

    def delete_received_before(self, cutoff_ns: int, batch: int = 5_000) -> int:
        """Delete spans and artifacts received before cutoff_ns; returns the spans deleted."""
        total = 0
        while n := self._delete_batch("DELETE FROM spans WHERE rowid IN (SELECT rowid FROM spans"
                                      " WHERE received_ns < ? ORDER BY received_ns LIMIT ?)", (cutoff_ns, batch)):  # fmt: skip
            total += n
        self._delete_batch("DELETE FROM artifacts WHERE recorded_ns < ?", (cutoff_ns,))
        return total

    def delete_oldest_spans(self, n: int) -> int:
        """Delete the n earliest-received spans; returns how many went."""
        return self._delete_batch("DELETE FROM spans WHERE rowid IN (SELECT rowid FROM spans"
                                  " ORDER BY received_ns, rowid LIMIT ?)", (n,))  # fmt: skip

    def delete_oldest_artifacts(self, n: int, not_after_ns: int | None = None) -> int:
        """Delete the n earliest-recorded artifacts (only those recorded at or before not_after_ns
        when given); returns how many went."""
        cutoff = not_after_ns if not_after_ns is not None else 2**63 - 1
        return self._delete_batch("DELETE FROM artifacts WHERE rowid IN (SELECT rowid FROM artifacts"
                                  " WHERE recorded_ns <= ? ORDER BY recorded_ns, rowid LIMIT ?)", (cutoff, n))  # fmt: skip

    def oldest_received(self) -> tuple[int | None, int | None]:
        """When the oldest span was received and the oldest artifact recorded (None: there is none)."""
        with self._reading() as db:
            (span,) = db.execute("SELECT MIN(received_ns) FROM spans").fetchone()
            (artifact,) = db.execute("SELECT MIN(recorded_ns) FROM artifacts").fetchone()
        return span, artifact

    def artifact_count(self) -> int:
        with self._reading() as db:
            return int(db.execute("SELECT COUNT(*) FROM artifacts").fetchone()[0])

    def live_bytes(self) -> int:
        """Bytes of pages in use (the file minus its free pages): what retention bounds."""
        with self._lock:
            db = self._db()
            pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
            return int(pages * db.execute("PRAGMA page_size").fetchone()[0])

    def reclaim(self) -> None:
        """Give free pages back to the OS (new stores only: see auto_vacuum above)."""
        with self._lock:
            self._db().execute("PRAGMA incremental_vacuum").fetchall()  # frees a page per step

    def span_count(self) -> int:
        with self._reading() as db:
            return int(db.execute("SELECT COUNT(*) FROM spans").fetchone()[0])

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close; later calls are no-ops."""
        with self._lock:
            if self._conn is None:
                return
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.close()
            self._conn = None

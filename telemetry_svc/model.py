"""Domain types shared by the telemetry core and its adapters (no grpc, no protobuf)."""

from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class Arm(str, enum.Enum):
    CONTROL = "control"
    CANDIDATE = "candidate"


ARMS: tuple[Arm, Arm] = (Arm.CONTROL, Arm.CANDIDATE)


class ArtifactKind(str, enum.Enum):
    TOKENS = "tokens"
    WORKLOAD = "workload"
    TREATMENT = "treatment"
    PROJECT_COMMIT = "project_commit"


class InvalidArtifact(ValueError):
    """An artifact record that cannot be stored; the message names the field."""


class ArtifactTooLarge(ValueError):
    """An artifact request over the service's size limit (TelemetryConfig.max_artifact_bytes)."""


class UnknownExperiment(LookupError):
    """No span and no artifact carries this experiment id."""


class ArtifactConflict(Exception):
    """An artifact is already recorded for this (experiment, arm, kind) with different content.

    Artifacts are write-once: the decision of an experiment follows from them, so a later writer
    must not be able to flip it. Recording identical content again is not a conflict.
    """


class InvalidPageToken(ValueError):
    """A page token this service did not issue (or issued for other filters)."""


@dataclass(frozen=True)
class SpanRecord:
    """One stored span. Ids are lower-case hex; parent_span_id is "" for a root span.

    experiment_id and arm are "" when the span belongs to no experiment / no arm.
    """

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    experiment_id: str = ""
    arm: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)
    # The rest of what OTLP sends, as JSON-friendly values (see otlp.detail):
    # {"kind": "server", "status": {"code": "error", "message": ...}, "events": [...],
    #  "links": [...], "resource": {...}, "dropped": {...}}; {} for a span stored before.
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class TraceSpans:
    """A trace's first spans by start time, and how many it has in all (>= len(spans))."""

    spans: tuple[SpanRecord, ...]
    total: int


@dataclass(frozen=True)
class TraceSearch:
    """Trace ids a search found, newest match first; scan_limited: it stopped at its bound on the
    spans it reads before finding `limit` traces, so older matches may exist."""

    trace_ids: tuple[str, ...]
    scan_limited: bool = False


@dataclass(frozen=True)
class ServiceCall:
    """Spans of `child` whose parent span is of `parent`, counted."""

    parent: str
    child: str
    count: int


@dataclass(frozen=True)
class Artifact:
    """One registered artifact of an experiment (see ArtifactKind for which fields apply)."""

    experiment_id: str
    kind: ArtifactKind
    arm: str = ""
    sha256: str = ""
    value: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.experiment_id:
            raise InvalidArtifact("experiment_id is required")
        if self.kind is ArtifactKind.TOKENS:
            if self.arm not in (Arm.CONTROL.value, Arm.CANDIDATE.value):
                raise InvalidArtifact(f"arm must be 'control' or 'candidate' for tokens, got {self.arm!r}")
        elif self.arm:
            raise InvalidArtifact(f"arm must be empty for a {self.kind.value} artifact")
        if self.kind in (ArtifactKind.TOKENS, ArtifactKind.WORKLOAD) and not self.sha256:
            raise InvalidArtifact(f"sha256 is required for a {self.kind.value} artifact")
        if self.sha256 and not _HEX64.match(self.sha256):
            raise InvalidArtifact("sha256 must be 64 lower-case hex characters")
        if self.kind in (ArtifactKind.TREATMENT, ArtifactKind.PROJECT_COMMIT) and not self.value:
            raise InvalidArtifact(f"value is required for a {self.kind.value} artifact")
        if self.completion_tokens < 0 or self.cached_tokens < 0:
            raise InvalidArtifact("token counts must be non-negative")


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def token_sha256(tokens_json: str) -> str:
    """SHA-256 of the canonical JSON of token ids (a list of ints or a list of lists of ints).

    Canonical form: json.dumps(obj, separators=(",", ":")), UTF-8, so the digest does not depend
    on the sender's whitespace.
    """
    try:
        obj = json.loads(tokens_json)
    except json.JSONDecodeError as exc:
        raise InvalidArtifact(f"tokens_json is not JSON: {exc.msg}") from None
    if not (_is_ids(obj) or (isinstance(obj, list) and all(_is_ids(r) for r in obj))):
        raise InvalidArtifact("tokens_json must be a list of ints or a list of lists of ints")
    canonical = json.dumps(obj, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ExperimentData:
    """What a summary is built from: durations per span name and arm, and the artifacts."""

    experiment_id: str
    # durations[span_name][arm] -> span durations in ns, in start order
    durations: Mapping[str, Mapping[Arm, tuple[int, ...]]]
    artifacts: tuple[Artifact, ...] = ()

    def samples(self, span: str, arm: Arm) -> tuple[int, ...]:
        return tuple(self.durations.get(span, {}).get(arm, ()))

"""OTLP trace protobufs -> store rows, with validation (adapter: the only protobuf-aware part
of ingestion).

A span is rejected (and counted in partial_success.rejected_spans) when its trace id is not 16
bytes or is all zero, its span id is not 8 bytes or is all zero, its parent span id is neither
empty nor 8 bytes, its name is empty, its start time is zero, its end is before its start, a
time does not fit in a signed 64-bit integer, or it carries an `experiment.arm` other than
"control" / "candidate" (or an arm without an `experiment.id`). The other spans of the same
request are stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from telemetry_svc.model import ARMS, SpanRecord

EXPERIMENT_ID_ATTR = "experiment.id"
EXPERIMENT_ARM_ATTR = "experiment.arm"
SERVICE_NAME_ATTR = "service.name"
_MAX_NS = 2**63 - 1  # SQLite INTEGER is signed 64-bit
_MAX_PROBLEMS = 3  # problems named in error_message; the count covers all
# What a span may keep of its events, links and its resource's attributes: the first of each,
# the rest counted in detail["dropped"] (an exporter's spans stay bounded in the store).
MAX_EVENTS = 128
MAX_LINKS = 128
MAX_RESOURCE_ATTRIBUTES = 128
_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {1: "ok", 2: "error"}
_ARM_VALUES = tuple(a.value for a in ARMS)


def any_value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


_SCALARS = frozenset({"string_value", "int_value", "double_value", "bool_value"})


def attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    out = {}
    for kv in kvs:  # a scalar read in place (nearly every attribute): no call per value
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind in _SCALARS else any_value(value)
    return out


@dataclass(frozen=True)
class Conversion:
    rows: tuple[SpanRecord, ...]
    rejected: int
    problems: tuple[str, ...]  # the first _MAX_PROBLEMS reasons

    @property
    def error_message(self) -> str:
        if not self.rejected:
            return ""
        more = "" if self.rejected <= len(self.problems) else f"; and {self.rejected - len(self.problems)} more"
        return f"rejected {self.rejected} span(s): " + "; ".join(self.problems) + more


def _id_problem(label: str, raw: bytes, size: int, optional: bool = False) -> str | None:
    if optional and not raw:
        return None
    if len(raw) != size:
        return f"{label} is {len(raw)} bytes, want {size}"
    if raw == bytes(size):
        return f"{label} is all zero"
    return None


def _problem(span: Span, experiment_id: str, arm: Any) -> str | None:
    checks = (
        _id_problem("trace_id", span.trace_id, 16),
        _id_problem("span_id", span.span_id, 8),
        _id_problem("parent_span_id", span.parent_span_id, 8, optional=True),
        "name is empty" if not span.name else None,
        "start_time_unix_nano is zero" if span.start_time_unix_nano == 0 else None,
        "end before start" if span.end_time_unix_nano < span.start_time_unix_nano else None,
        "time beyond int64" if span.end_time_unix_nano > _MAX_NS else None,
        f"experiment.arm {arm!r} is not 'control' or 'candidate'" if arm not in ("", *_ARM_VALUES) else None,
        "experiment.arm without experiment.id" if arm and not experiment_id else None,
    )
    return next((c for c in checks if c), None)


_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


def _valid(span: Span, experiment_id: str, arm: Any) -> bool:
    """_problem(...) is None, checked in one expression (every span is checked)."""
    parent = span.parent_span_id
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    return bool(
        len(span.trace_id) == 16
        and span.trace_id != _ZERO_TRACE
        and len(span.span_id) == 8
        and span.span_id != _ZERO_SPAN
        and (not parent or (len(parent) == 8 and parent != _ZERO_SPAN))
        and span.name
        and start
        and start <= end <= _MAX_NS
        and (arm == "" or (arm in _ARM_VALUES and experiment_id))
    )


def _bounded_resource(resource: dict[str, Any]) -> dict[str, Any]:
    return dict(list(resource.items())[:MAX_RESOURCE_ATTRIBUTES])


def detail(span: Span, resource: dict[str, Any], bounded: dict[str, Any] | None = None) -> dict[str, Any]:
    """Kind, status, events, links and the resource's attributes, bounded (see MAX_*);
    `bounded`: the resource's attributes bounded already (one resource, many spans)."""
    out: dict[str, Any] = {}
    kind = _KINDS.get(span.kind)
    if kind is not None:
        out["kind"] = kind
    status = span.status
    if status.code in _STATUS:
        out["status"] = {"code": _STATUS[status.code], "message": status.message}
    n_events, n_links = len(span.events), len(span.links)
    if n_events:
        out["events"] = [
            {"time_ns": e.time_unix_nano, "name": e.name, "attributes": attributes(e.attributes)}
            for e in span.events[:MAX_EVENTS]
        ]
    if n_links:
        out["links"] = [
            {
                "trace_id": link.trace_id.hex(),
                "span_id": link.span_id.hex(),
                "attributes": attributes(link.attributes) if link.attributes else {},
            }
            for link in span.links[:MAX_LINKS]
        ]
    if resource:
        out["resource"] = dict(bounded) if bounded is not None else _bounded_resource(resource)
    dropped = (
        ("events", span.dropped_events_count + max(n_events - MAX_EVENTS, 0)),
        ("links", span.dropped_links_count + max(n_links - MAX_LINKS, 0)),
        ("attributes", span.dropped_attributes_count),
        ("resource_attributes", max(len(resource) - MAX_RESOURCE_ATTRIBUTES, 0)),
    )
    if any(n for _, n in dropped):
        out["dropped"] = {k: n for k, n in dropped if n}
    return out


def _plain_detail_key(span: Span) -> tuple | None:
    """What a span's detail is made of when that is only its kind, status and links without
    attributes (a tick's step spans: one shared detail), else None (detail() builds it)."""
    if span.events or span.dropped_events_count or span.dropped_links_count or span.dropped_attributes_count:
        return None
    links = span.links
    if len(links) > MAX_LINKS:
        return None
    ids = []
    for link in links:  # one pass: a link with attributes has a detail of its own
        if link.attributes:
            return None
        ids.append((link.trace_id, link.span_id))
    status = span.status
    return span.kind, status.code, status.message, tuple(ids)


def count_spans(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def convert(request: ExportTraceServiceRequest) -> Conversion:
    rows: list[SpanRecord] = []
    problems: list[str] = []
    rejected = 0
    for rs in request.resource_spans:
        res = attributes(rs.resource.attributes)
        service = str(res.get(SERVICE_NAME_ATTR, ""))
        res_exp, res_arm = res.get(EXPERIMENT_ID_ATTR, ""), res.get(EXPERIMENT_ARM_ATTR, "")
        bounded = _bounded_resource(res)
        # Spans of equal plain details share one dict (the store then encodes it once).
        shared: dict[tuple, dict[str, Any]] = {}
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = attributes(span.attributes)
                exp = attrs.get(EXPERIMENT_ID_ATTR, res_exp)
                arm = attrs.get(EXPERIMENT_ARM_ATTR, res_arm)
                problem = None if _valid(span, str(exp), arm) else _problem(span, str(exp), arm)
                if problem:
                    rejected += 1
                    if len(problems) < _MAX_PROBLEMS:
                        problems.append(f"span {span.name!r} ({span.span_id.hex() or '-'}): {problem}")
                    continue
                key = _plain_detail_key(span)
                if key is None:
                    span_detail = detail(span, res, bounded)
                else:
                    span_detail = shared.get(key) or shared.setdefault(key, detail(span, res, bounded))
                rows.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        service=service,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        experiment_id=str(exp),
                        arm=str(arm),
                        attributes=attrs,
                        detail=span_detail,
                    )
                )
    return Conversion(tuple(rows), rejected, tuple(problems))

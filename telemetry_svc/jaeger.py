"""Store rows -> the JSON of Jaeger's query API, and that API's query parameters (pure: no
sockets, no aiohttp; telemetry_svc/http_api.py serves it).

Jaeger's model (its internal/uimodel): a trace is {traceID, spans, processes, warnings}; a span
{traceID, spanID, operationName, references, startTime, duration, tags, logs, processID,
warnings} with times in microseconds since the epoch, truncated as Jaeger truncates; a tag
{key, type, value} with type string | bool | int64 | float64. OTLP maps onto it as the
OpenTelemetry-to-Jaeger translation says: the parent is the first reference (CHILD_OF) and links
follow it (FOLLOWS_FROM); the kind is the `span.kind` tag (none for internal spans); the status is
`otel.status_code` / `otel.status_description`, and an error status adds `error=true`; events are
logs whose `event` field is the event's name; a resource's attributes are its process's tags.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence

from telemetry_svc.model import ServiceCall, SpanRecord

# What Jaeger's OTLP receiver names a resource without service.name (a raw OTLP exporter's);
# the SDKs themselves send "unknown_service" then, a name like any other.
NO_SERVICE_NAME = "OTLPResourceNoServiceName"
SERVICE_NAME_ATTR = "service.name"
DEFAULT_LIMIT = 100  # traces a search returns without `limit` (Jaeger's default)
MAX_LIMIT = 1500  # the most Jaeger's UI offers
MAX_TRACE_SPANS = 10_000  # spans of one trace in a response; the rest are named in its warnings
MAX_RESPONSE_SPANS = 200_000  # spans of one search response (~100 MB of JSON); later traces are left out
DEFAULT_DEPENDENCY_LOOKBACK_MS = 24 * 3600 * 1000  # Jaeger's default
_JS_MAX_SAFE_INT = 2**53 - 1  # larger ints travel as strings, as Jaeger sends them
_INT64 = 2**63
_INT = re.compile(r"[+-]?[0-9]+")
_HEX = re.compile(r"[0-9a-fA-F]{1,32}")
# Go's time.ParseDuration: a sequence of decimal numbers, each with a unit ("1h30m", "1.5s", "300us").
_DURATION_PART = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "μs": 1_000, "ms": 1_000_000, "s": 10**9, "m": 60 * 10**9,
            "h": 3600 * 10**9}  # fmt: skip
_GO_TRUE = {"1", "t", "T", "TRUE", "true", "True"}  # strconv.ParseBool
_GO_FALSE = {"0", "f", "F", "FALSE", "false", "False"}
# OTLP's dropped counts -> the span tags the OpenTelemetry mapping to non-OTLP formats names
_DROPPED_TAGS = (("attributes", "otel.dropped_attributes_count"), ("events", "otel.dropped_events_count"),
                 ("links", "otel.dropped_links_count"))  # fmt: skip

Params = Mapping[str, Sequence[str]]  # a query string: each name with its values, in order


class InvalidQuery(ValueError):
    """A query parameter this API cannot use (HTTP 400); the message names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class TraceNotFound(LookupError):
    """No span of this trace id is in the store (HTTP 404)."""


# --- rows -> Jaeger JSON -------------------------------------------------------------------------


def _micros(ns: int) -> int:
    return ns // 1000


def _tag(key: str, value: Any) -> dict[str, Any]:
    """One typed Jaeger tag. Arrays and maps travel as their JSON (the OpenTelemetry mapping's
    rule); ints beyond JavaScript's exact range as decimal strings, as Jaeger sends them."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value if abs(value) <= _JS_MAX_SAFE_INT else str(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"key": key, "type": "float64", "value": value}
        text = "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")  # not JSON numbers
        return {"key": key, "type": "string", "value": text}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    if value is None:
        return {"key": key, "type": "string", "value": ""}
    return {"key": key, "type": "string", "value": json.dumps(value, separators=(",", ":"), sort_keys=True)}


def tag_text(tag: Mapping[str, Any]) -> str:
    """A tag's value as Jaeger's searches compare it (its KeyValue.AsString)."""
    value = tag["value"]
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.10g}"  # Go's strconv.FormatFloat(v, 'g', 10, 64)
    return str(value)


def _is_error(span: SpanRecord) -> bool:
    return (span.detail.get("status") or {}).get("code") == "error"


def span_tags(span: SpanRecord) -> list[dict[str, Any]]:
    """Attributes, then what OTLP says beside them: kind, status, error, dropped counts."""
    detail, error = span.detail, _is_error(span)
    # an error status sets error=true, which overrides an `error` attribute (the mapping allows it)
    tags = [_tag(k, v) for k, v in span.attributes.items() if not (error and k == "error")]
    kind = detail.get("kind")
    if kind and kind != "internal":
        tags.append(_tag("span.kind", kind))
    status = detail.get("status") or {}
    if status.get("code"):
        tags.append(_tag("otel.status_code", str(status["code"]).upper()))
    if status.get("message"):
        tags.append(_tag("otel.status_description", status["message"]))
    if error:
        tags.append(_tag("error", True))
    dropped = detail.get("dropped") or {}
    tags += [_tag(name, int(dropped[ours])) for ours, name in _DROPPED_TAGS if dropped.get(ours)]
    return tags


def span_logs(span: SpanRecord) -> list[dict[str, Any]]:
    """Each event a log at its time: an `event` field with its name (unless one of its
    attributes is named `event`, which wins), then its attributes."""
    logs = []
    for event in span.detail.get("events") or ():
        attrs = event.get("attributes") or {}
        fields = [] if "event" in attrs else [_tag("event", event.get("name", ""))]
        fields += [_tag(k, v) for k, v in attrs.items()]
        logs.append({"timestamp": _micros(int(event.get("time_ns", 0))), "fields": fields})
    return logs


def span_references(span: SpanRecord) -> list[dict[str, str]]:
    """The parent first (CHILD_OF: Grafana and Jaeger's UI take the first as the parent), then
    each link (FOLLOWS_FROM; a link may point into another trace)."""
    refs = []
    if span.parent_span_id:
        refs.append({"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_span_id})
    for link in span.detail.get("links") or ():
        if link.get("trace_id") and link.get("span_id"):
            refs.append({"refType": "FOLLOWS_FROM", "traceID": link["trace_id"], "spanID": link["span_id"]})
    return refs


def service_name(stored: str) -> str:
    return stored or NO_SERVICE_NAME


def stored_service(name: str) -> str:
    """The store's service for a name this API shows (see NO_SERVICE_NAME)."""
    return "" if name == NO_SERVICE_NAME else name


def process_of(span: SpanRecord) -> dict[str, Any]:
    """The span's process: its service and its resource's other attributes as tags."""
    resource = span.detail.get("resource") or {}
    tags = [_tag(k, v) for k, v in resource.items() if k != SERVICE_NAME_ATTR]
    return {"serviceName": service_name(span.service), "tags": tags}


def trace_json(spans: Sequence[SpanRecord], total_spans: int | None = None) -> dict[str, Any]:
    """One trace. Processes are p1, p2, ... in the order spans first name them, one per distinct
    service and resource (two instances of a service with their own resource attributes are two,
    as in Jaeger). total_spans > len(spans): the trace was cut to `spans`, which its warnings say."""
    if not spans:
        raise ValueError("a trace has at least one span")
    processes: dict[str, dict[str, Any]] = {}
    ids: dict[str, str] = {}  # a process's canonical JSON -> its id
    out = []
    for s in spans:
        process = process_of(s)
        key = json.dumps(process, sort_keys=True)
        if key not in ids:
            ids[key] = f"p{len(ids) + 1}"
            processes[ids[key]] = process
        out.append({
            "traceID": s.trace_id,
            "spanID": s.span_id,
            "operationName": s.name,
            "references": span_references(s),
            "startTime": _micros(s.start_ns),
            "duration": _micros(s.duration_ns),
            "tags": span_tags(s),
            "logs": span_logs(s),
            "processID": ids[key],
            "warnings": None,
        })  # fmt: skip
    warnings = None
    if total_spans is not None and total_spans > len(spans):
        warnings = [f"this trace has {total_spans} spans; showing the first {len(spans)} by start time"]
    return {"traceID": spans[0].trace_id, "spans": out, "processes": processes, "warnings": warnings}


def dependency_links(calls: Iterable[ServiceCall], service: str = "") -> list[dict[str, Any]]:
    """Jaeger's dependency links: calls from a span of one service to a child span of another,
    counted per (parent, child) pair; a service's calls to itself are not dependencies. With
    `service`, only the links it is a side of."""
    counts: dict[tuple[str, str], int] = {}
    for c in calls:
        parent, child = service_name(c.parent), service_name(c.child)
        if parent == child or (service and service not in (parent, child)):
            continue
        counts[(parent, child)] = counts.get((parent, child), 0) + c.count
    return [{"parent": p, "child": c, "callCount": n} for (p, c), n in sorted(counts.items())]


def envelope(data: Any, total: int = 0, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Jaeger's response envelope (its structuredResponse)."""
    return {"data": data, "total": total, "limit": 0, "offset": 0, "errors": errors}


def error_envelope(code: int, message: str) -> dict[str, Any]:
    return envelope(None, errors=[{"code": code, "msg": message}])


# --- the query parameters ------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceQuery:
    """GET /api/traces. Times in ns (the API's are µs); None: no bound. A span must satisfy every
    filter for its trace to be found; trace_ids given: those traces, the filters unused."""

    service: str = ""  # as the API names it (see stored_service)
    operation: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)
    start_min_ns: int | None = None
    start_max_ns: int | None = None
    min_duration_ns: int | None = None
    max_duration_ns: int | None = None
    limit: int = DEFAULT_LIMIT
    trace_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class DependencyQuery:
    """GET /api/dependencies: calls by child spans that started in [start_ns, end_ns]."""

    end_ns: int
    lookback_ns: int
    service: str = ""

    @property
    def start_ns(self) -> int:
        return self.end_ns - self.lookback_ns


def _first(params: Params, name: str) -> str:
    values = params.get(name) or ()
    return values[0] if values else ""


def _int_param(params: Params, name: str, unit: str, ns_per_unit: int = 1) -> int | None:
    """An integer parameter; with ns_per_unit, one that must fit the store's int64 ns once scaled."""
    text = _first(params, name)
    if not text:
        return None
    if not _INT.fullmatch(text):
        raise InvalidQuery(name, f"unable to parse param '{name}': {text!r} is not an integer ({unit})")
    if abs(int(text)) * ns_per_unit >= _INT64:
        raise InvalidQuery(name, f"unable to parse param '{name}': {text} {unit} is out of range")
    return int(text)


def parse_duration(text: str, param: str) -> int:
    """A Go duration ("10ms", "1.5s", "1h30m", "250us") in ns; negative ones are refused."""
    if text == "0":
        return 0
    body = text[1:] if text[:1] == "+" else text
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body or any(n in ("", ".") for n, _ in parts):
        why = "a negative duration" if text.startswith("-") else "not a duration"
        raise InvalidQuery(param, f"unable to parse param '{param}': {text!r} is {why} (e.g. 10ms, 1.5s, 2m, 1h)")
    ns = int(sum(Fraction(n) * _UNIT_NS[u] for n, u in parts))
    if ns >= _INT64:
        raise InvalidQuery(param, f"unable to parse param '{param}': {text!r} is too long a duration")
    return ns


def parse_tags(simple: Sequence[str], json_maps: Sequence[str]) -> dict[str, str]:
    """`tag=key:value` (repeated) and `tags={"key":"value",...}` (JSON, as Grafana sends them)."""
    tags: dict[str, str] = {}
    for t in simple:
        key, sep, value = t.partition(":")
        if not sep or not key:
            raise InvalidQuery("tag", f"malformed 'tag' parameter, expecting key:value, received: {t!r}")
        tags[key] = value
    for text in json_maps:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise InvalidQuery("tags", f"malformed 'tags' parameter, cannot unmarshal JSON: {exc}") from None
        if not isinstance(obj, dict) or not all(isinstance(v, str) for v in obj.values()):
            raise InvalidQuery("tags", "malformed 'tags' parameter: want a JSON object of strings, "
                                       'e.g. {"http.status_code":"200"}')  # fmt: skip
        tags.update(obj)
    return tags


def parse_trace_id(text: str, param: str = "traceID") -> str:
    """A trace id of 1 to 32 hex digits (Jaeger's short ids too), as the store keeps it: 32
    lower-case digits."""
    if not _HEX.fullmatch(text):
        raise InvalidQuery(param, f"unable to parse param '{param}': {text!r} is not a trace id (1 to 32 hex digits)")
    return text.lower().rjust(32, "0")


def parse_trace_query(params: Params) -> TraceQuery:
    trace_ids = tuple(parse_trace_id(t) for t in params.get("traceID") or ())
    service = _first(params, "service")
    if not service and not trace_ids:
        raise InvalidQuery("service", "parameter 'service' is required")
    start = _int_param(params, "start", "µs since the epoch", 1000)
    end = _int_param(params, "end", "µs since the epoch", 1000)
    if start is not None and end is not None and end < start:
        raise InvalidQuery("end", "'end' is before 'start'")
    limit = _int_param(params, "limit", "traces")
    if limit is not None and not 1 <= limit <= MAX_LIMIT:
        raise InvalidQuery("limit", f"'limit' must be in 1..{MAX_LIMIT}, got {limit}")
    bounds = {}
    for name in ("minDuration", "maxDuration"):
        text = _first(params, name)
        bounds[name] = parse_duration(text, name) if text else None
    lo, hi = bounds["minDuration"], bounds["maxDuration"]
    if lo is not None and hi is not None and hi < lo:
        raise InvalidQuery("maxDuration", "'maxDuration' should be greater than 'minDuration'")
    return TraceQuery(
        service=service,
        operation=_first(params, "operation"),
        tags=parse_tags(params.get("tag") or (), params.get("tags") or ()),
        start_min_ns=None if start is None else start * 1000,
        start_max_ns=None if end is None else min(end * 1000 + 999, _INT64 - 1),  # the whole of the end µs
        min_duration_ns=lo,
        max_duration_ns=hi,
        limit=DEFAULT_LIMIT if limit is None else limit,
        trace_ids=trace_ids,
    )


def parse_dependency_query(params: Params, now_ns: int) -> DependencyQuery:
    """endTs and lookback in ms (Jaeger's): default now and 24 h."""
    end = _int_param(params, "endTs", "ms since the epoch", 10**6)
    lookback = _int_param(params, "lookback", "ms", 10**6)
    if lookback is not None and lookback < 1:
        raise InvalidQuery("lookback", f"'lookback' must be a positive number of ms, got {lookback}")
    return DependencyQuery(
        end_ns=now_ns if end is None else end * 1_000_000,
        lookback_ns=(DEFAULT_DEPENDENCY_LOOKBACK_MS if lookback is None else lookback) * 1_000_000,
        service=_first(params, "service"),
    )


def span_matches(span: SpanRecord, tags: Mapping[str, str]) -> bool:
    """Whether one span has every tag, as Jaeger searches: among its tags, its process's tags and
    its logs' fields, compared as text. `error=false` finds the spans without an error status."""
    if not tags:
        return True
    every = [*span_tags(span), *process_of(span)["tags"], *(f for log in span_logs(span) for f in log["fields"])]
    seen = {(t["key"], tag_text(t)) for t in every}
    for key, want in tags.items():
        if key == "error" and want in _GO_TRUE | _GO_FALSE:
            if _is_error(span) != (want in _GO_TRUE):
                return False
        elif (key, want) not in seen:
            return False
    return True

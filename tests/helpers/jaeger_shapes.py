"""Jaeger's query-API JSON, field by field, as its model declares it (jaegertracing/jaeger
internal/uimodel/model.go, the structs the query service marshals, and cmd/query's
structuredResponse): which keys each object has and what type each value is. Optional keys
(`omitempty` there: a span's flags, parentSpanID, process) may be absent; nothing else may be."""

from __future__ import annotations

import re
from typing import Any

HEX_TRACE_ID = re.compile(r"^[0-9a-f]{16}$|^[0-9a-f]{32}$")
HEX_SPAN_ID = re.compile(r"^[0-9a-f]{16}$")
ENVELOPE = {"data", "total", "limit", "offset", "errors"}
TRACE = {"traceID": str, "spans": list, "processes": dict, "warnings": (list, type(None))}
SPAN = {
    "traceID": str,
    "spanID": str,
    "operationName": str,
    "references": list,
    "startTime": int,  # microseconds since the epoch
    "duration": int,  # microseconds
    "tags": list,
    "logs": list,
    "processID": str,
    "warnings": (list, type(None)),
}
SPAN_OPTIONAL = {"flags": int, "parentSpanID": str, "process": dict}
REFERENCE = {"refType": str, "traceID": str, "spanID": str}
REF_TYPES = {"CHILD_OF", "FOLLOWS_FROM"}
PROCESS = {"serviceName": str, "tags": list}
LOG = {"timestamp": int, "fields": list}
KEY_VALUE = {"key": str, "type": str, "value": object}
VALUE_TYPES = {"string": (str,), "bool": (bool,), "int64": (int, str), "float64": (float, int), "binary": (str,)}
DEPENDENCY = {"parent": str, "child": str, "callCount": int}
ERROR = {"code": int, "msg": str}


def _fields(obj: Any, want: dict[str, Any], what: str, optional: dict[str, Any] | None = None) -> None:
    assert isinstance(obj, dict), f"{what} is {type(obj).__name__}, not an object"
    optional = optional or {}
    assert set(want) <= set(obj) <= set(want) | set(optional), f"{what} keys {sorted(obj)}, want {sorted(want)}"
    for key, kind in {**want, **optional}.items():
        if key in obj:
            value = obj[key]
            assert isinstance(value, kind), f"{what}.{key} = {value!r} is not {kind}"
            if kind is int or kind == (int, str):
                assert not isinstance(value, bool), f"{what}.{key} = {value!r} is a bool"


def assert_key_value(kv: Any, what: str) -> None:
    _fields(kv, KEY_VALUE, what)
    assert kv["type"] in VALUE_TYPES, f"{what}.type {kv['type']!r}"
    assert isinstance(kv["value"], VALUE_TYPES[kv["type"]]), f"{what}: {kv!r}"
    if kv["type"] == "bool" or kv["type"] == "string":
        return
    assert not isinstance(kv["value"], bool), f"{what}: {kv!r}"
    if kv["type"] == "int64" and isinstance(kv["value"], str):  # beyond 2**53: a decimal string
        assert re.fullmatch(r"-?[0-9]+", kv["value"]) and abs(int(kv["value"])) > 2**53 - 1, kv


def assert_envelope(body: Any) -> None:
    _fields(body, {k: object for k in ENVELOPE}, "envelope")
    assert isinstance(body["total"], int) and body["limit"] == 0 and body["offset"] == 0, body
    assert body["errors"] is None or isinstance(body["errors"], list), body


def assert_error_envelope(body: Any, code: int) -> str:
    """The error's message."""
    assert_envelope(body)
    assert body["data"] is None, body
    (err,) = body["errors"]
    _fields(err, ERROR, "error")
    assert err["code"] == code, err
    return str(err["msg"])


def assert_trace(trace: Any) -> None:
    _fields(trace, TRACE, "trace")
    assert HEX_TRACE_ID.match(trace["traceID"]), trace["traceID"]
    assert trace["spans"], "a trace has spans"
    for pid, process in trace["processes"].items():
        _fields(process, PROCESS, f"process {pid}")
        for i, kv in enumerate(process["tags"]):
            assert_key_value(kv, f"process {pid} tag {i}")
    for span in trace["spans"]:
        what = f"span {span.get('spanID')}"
        _fields(span, SPAN, what, SPAN_OPTIONAL)
        assert span["traceID"] == trace["traceID"], what
        assert HEX_SPAN_ID.match(span["spanID"]), what
        assert span["startTime"] >= 0 and span["duration"] >= 0, what
        assert span["processID"] in trace["processes"], what
        for ref in span["references"]:
            _fields(ref, REFERENCE, f"{what} reference")
            assert ref["refType"] in REF_TYPES and HEX_TRACE_ID.match(ref["traceID"]), ref
            assert HEX_SPAN_ID.match(ref["spanID"]), ref
        for i, kv in enumerate(span["tags"]):
            assert_key_value(kv, f"{what} tag {i}")
        for log in span["logs"]:
            _fields(log, LOG, f"{what} log")
            for i, kv in enumerate(log["fields"]):
                assert_key_value(kv, f"{what} log field {i}")


def assert_dependency(link: Any) -> None:
    _fields(link, DEPENDENCY, "dependency link")
    assert not isinstance(link["callCount"], bool) and link["callCount"] > 0, link

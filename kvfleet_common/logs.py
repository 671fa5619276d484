"""Log setup shared by the services: plain text (the default) or one JSON object per line.

A JSON line carries the trace and span ids of the OpenTelemetry span current when it was logged
(so a log line can be found from a trace, and back), and the session id: the record's own
`session_id` (`log.info(..., extra={"session_id": sid})`) or, failing that, the one bound to the
current task by `bind_session`; likewise the client's `request_id` (`bind_request`).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TextIO

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A contextvar, not a global: each gRPC call runs in its own asyncio task with its own copy.
_SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvfleet_session_id", default=None)
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvfleet_request_id", default=None)

# Attributes every LogRecord has; whatever else a record carries came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def bind_session(session_id: str | None) -> None:
    """Name the session the current task (or thread) is handling, for the log lines it writes."""
    _SESSION_ID.set(session_id)


def bind_request(request_id: str | None) -> None:
    """Name the client's request id (GenerateRequest.request_id) the current task is serving."""
    _REQUEST_ID.set(request_id or None)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, message, trace_id/span_id (hex, when a
    span is current), session_id and request_id (when known), exc_info (the traceback), and any other `extra`."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            doc["trace_id"] = format(ctx.trace_id, "032x")
            doc["span_id"] = format(ctx.span_id, "016x")
        session = getattr(record, "session_id", None) or _SESSION_ID.get()
        if session:
            doc["session_id"] = session
        request = getattr(record, "request_id", None) or _REQUEST_ID.get()
        if request:
            doc["request_id"] = request
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False)


@dataclass(frozen=True)
class LogSettings:
    """A service's --log-level and --log-format, parsed with its flags and applied in main()."""

    level: str = "INFO"
    format: str = "text"

    def apply(self, stream: TextIO | None = None) -> None:
        setup_logging(self.level, self.format, stream)


def setup_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger once, at a process's start: one handler on stderr (or `stream`),
    in `fmt` ("text" or "json"). Replaces handlers set up before, so calling it twice is harmless."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

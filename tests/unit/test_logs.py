"""The log formats: JSON lines carry the current span's ids and the session id; text stays as it was."""

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from kvfleet_common.logs import JsonFormatter, LogSettings, bind_request, bind_session, setup_logging


def _record(msg: str = "hello %s", args=("world",), **extra) -> logging.LogRecord:
    rec = logging.LogRecord("kvfleet.test", logging.WARNING, __file__, 1, msg, args, None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


@pytest.fixture(autouse=True)
def _no_session():
    bind_session(None)
    bind_request(None)
    yield
    bind_session(None)
    bind_request(None)


def test_json_line_has_the_basic_fields_and_no_trace_outside_a_span():
    doc = json.loads(JsonFormatter().format(_record()))
    assert doc["message"] == "hello world" and doc["level"] == "WARNING" and doc["logger"] == "kvfleet.test"
    assert doc["ts"].endswith("+00:00")
    assert "trace_id" not in doc and "span_id" not in doc and "session_id" not in doc


def test_json_line_carries_the_current_span_ids():
    tracer = TracerProvider().get_tracer("test")  # not global: no exporter, nothing leaks
    with tracer.start_as_current_span("outer"):
        with tracer.start_as_current_span("inner") as span:
            doc = json.loads(JsonFormatter().format(_record()))
            ctx = span.get_span_context()
    assert doc["trace_id"] == f"{ctx.trace_id:032x}" and len(doc["trace_id"]) == 32
    assert doc["span_id"] == f"{ctx.span_id:016x}" and len(doc["span_id"]) == 16


def test_session_id_from_the_context_and_from_extra_which_wins():
    bind_session("s-bound")
    assert json.loads(JsonFormatter().format(_record()))["session_id"] == "s-bound"
    assert json.loads(JsonFormatter().format(_record(session_id="s-extra")))["session_id"] == "s-extra"


def test_request_id_from_the_context_and_from_extra():
    assert "request_id" not in json.loads(JsonFormatter().format(_record()))
    bind_request("req-7")
    assert json.loads(JsonFormatter().format(_record()))["request_id"] == "req-7"
    assert json.loads(JsonFormatter().format(_record(request_id="req-8")))["request_id"] == "req-8"
    bind_request("")  # an empty request_id is none
    assert "request_id" not in json.loads(JsonFormatter().format(_record()))


def test_other_extras_and_the_traceback_are_kept():
    try:
        raise KeyError("boom")
    except KeyError:
        import sys

        rec = _record(worker="worker-1", blocks=3, obj=object())
        rec.exc_info = sys.exc_info()
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["worker"] == "worker-1" and doc["blocks"] == 3 and doc["obj"].startswith("<object")
    assert "KeyError: 'boom'" in doc["exc_info"]


def test_setup_logging_json_and_text_through_the_root_logger():
    out = io.StringIO()
    LogSettings("DEBUG", "json").apply(out)
    logging.getLogger("kvfleet.a").debug("one %d", 1, extra={"session_id": "s-1"})
    line = json.loads(out.getvalue().splitlines()[-1])
    assert line["message"] == "one 1" and line["session_id"] == "s-1"

    out = io.StringIO()
    setup_logging("info", "text", out)
    logging.getLogger("kvfleet.b").debug("hidden")
    logging.getLogger("kvfleet.b").info("shown")
    text = out.getvalue()
    assert "hidden" not in text and text.rstrip().endswith("INFO kvfleet.b: shown")
    assert not text.lstrip().startswith("{")
    assert len(logging.getLogger().handlers) == 1  # replaced, not stacked
    setup_logging("WARNING", "text")


@pytest.mark.parametrize("level, fmt", [("INFO", "xml"), ("LOUD", "text")])
def test_setup_logging_rejects_unknown_values(level, fmt):
    with pytest.raises(ValueError):
        setup_logging(level, fmt, io.StringIO())

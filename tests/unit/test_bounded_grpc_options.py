"""Every kvfleet server's connection limits, as data: keepalive, idle and age limits, the ping
policy, and an age grace long enough for the longest stream a client may count on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvfleet_common import grpcutil

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = (
    "grpc.keepalive_time_ms",
    "grpc.keepalive_timeout_ms",
    "grpc.keepalive_permit_without_calls",
    "grpc.max_connection_idle_ms",
    "grpc.max_connection_age_ms",
    "grpc.max_connection_age_grace_ms",
    "grpc.http2.min_ping_interval_without_data_ms",
    "grpc.http2.max_ping_strikes",
)


@pytest.mark.parametrize("options", [grpcutil.SERVER_OPTIONS, grpcutil.server_options(64 * 1024 * 1024)])
def test_server_options_bound_connections(options: list[tuple[str, int]]) -> None:
    opts = dict(options)
    assert len(opts) == len(options), "an option given twice: gRPC takes whichever comes last"
    missing = [k for k in REQUIRED if k not in opts]
    assert not missing, f"server options lack {missing}"
    assert opts["grpc.keepalive_timeout_ms"] < opts["grpc.keepalive_time_ms"]
    # A stream that starts just before the connection's GOAWAY still gets the whole grace.
    assert opts["grpc.max_connection_age_grace_ms"] >= grpcutil.MAX_STREAM_S * 1000
    assert opts["grpc.max_connection_idle_ms"] > 0 and opts["grpc.max_connection_age_ms"] > 0
    # Our own clients' channels (which send no keepalive pings) are never struck out.
    assert opts["grpc.http2.min_ping_interval_without_data_ms"] <= opts["grpc.keepalive_time_ms"]


def test_server_options_keep_the_receive_limit_asked_for() -> None:
    opts = dict(grpcutil.server_options(64 * 1024 * 1024))
    assert opts["grpc.max_receive_message_length"] == 64 * 1024 * 1024
    assert dict(grpcutil.SERVER_OPTIONS)["grpc.max_receive_message_length"] == grpcutil.MAX_MESSAGE_BYTES


@pytest.mark.parametrize("path", ["scheduler_svc/server.py", "worker_svc/server.py", "telemetry_svc/server.py"])
def test_every_server_is_built_with_the_shared_options(path: str) -> None:
    """Each service's grpc.aio.server(...) call passes grpcutil's options (not its own list)."""
    tree = ast.parse((ROOT / path).read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "server"
    ]
    assert calls, f"{path} builds no grpc.aio.server"
    for call in calls:
        options = next((k.value for k in call.keywords if k.arg == "options"), None)
        assert options is not None, f"{path}: grpc.aio.server without options"
        text = ast.unparse(options)
        assert text.startswith("grpcutil.SERVER_OPTIONS") or text.startswith("grpcutil.server_options("), text

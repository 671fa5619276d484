"""A port a service cannot have is one line: where, what for, why, and the flag that moves it."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Iterator

import grpc
import pytest

from kvfleet_common import grpcutil
from kvfleet_common.listen import CannotListen, bind_error, cannot_listen, check_ports
from kvfleet_common.metrics import serve_metrics


@pytest.fixture
def held() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_in_use_is_named_with_its_flag(held: int) -> None:
    with pytest.raises(CannotListen) as err:
        check_ports("127.0.0.1", [("the metrics", 0, "--off"), ("OTLP", held, "--telemetry-port")])
    assert str(err.value) == (
        f"cannot listen on 127.0.0.1:{held} (OTLP): the port is in use (another kvfleet service, or a second "
        "`kvfleet up`?); free it or choose another with --telemetry-port"
    )
    assert err.value.flag == "--telemetry-port" and isinstance(err.value, OSError)


def test_a_free_port_and_port_0_pass(held: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    check_ports("127.0.0.1", [("a", free, "--a"), ("b", 0, "--b")])
    assert bind_error("127.0.0.1", free) is None
    assert bind_error("127.0.0.1", held).errno == errno.EADDRINUSE  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "host, why, todo",
    [
        ("192.0.2.1", "the host is not an address of this machine", "listen on one of its addresses (--host)"),
        ("no-such-host.invalid", "the host 'no-such-host.invalid' does not resolve", "(--host)"),
    ],
)
def test_a_host_that_is_not_this_machine_s_says_so(host: str, why: str, todo: str) -> None:
    err = cannot_listen("gRPC", host, 5000, "--port")
    assert f"cannot listen on {host}:5000 (gRPC): {why}" in str(err) and str(err).endswith(todo)


@pytest.mark.parametrize("port", [-3, 65536, 70000])
def test_a_number_that_is_no_port_says_so(port: int) -> None:
    with pytest.raises(CannotListen) as err:
        check_ports("127.0.0.1", [("the OpenAI-compatible API", port, "--gateway-port")])
    assert str(err.value) == (
        f"cannot listen on 127.0.0.1:{port} (the OpenAI-compatible API): not a port number (0..65535); "
        "choose another with --gateway-port"
    )


@pytest.mark.parametrize(
    "cause, want",
    [
        (
            OSError(errno.EACCES, "Permission denied"),
            "permission denied; a port below 1024 needs root: choose another with --p",
        ),
        (
            OSError(errno.ENOBUFS, "No buffer space available"),
            "No buffer space available; choose another address or port (--p)",
        ),
        (None, "the bind failed; choose another address or port (--p)"),
    ],
)
def test_other_causes_keep_their_own_words(cause: OSError | None, want: str) -> None:
    assert str(CannotListen("x", "::1", 80, "--p", cause)) == f"cannot listen on [::1]:80 (x): {want}"


def test_grpc_bind_of_a_taken_port_is_cannot_listen(held: int) -> None:
    """grpc itself raises a RuntimeError that names neither the cause nor a flag."""

    async def bind() -> None:
        server = grpc.aio.server()
        try:
            grpcutil.bind(server, "127.0.0.1", held, what="OTLP/gRPC", flag="--port")
        finally:
            await server.stop(None)

    with pytest.raises(CannotListen, match=rf"127.0.0.1:{held} \(OTLP/gRPC\): the port is in use.*with --port$"):
        asyncio.run(bind())


def test_metrics_on_a_taken_port_names_metrics_port(held: int) -> None:
    from prometheus_client import CollectorRegistry

    with pytest.raises(CannotListen, match=r"\(Prometheus /metrics\): the port is in use.*--metrics-port$"):
        serve_metrics(CollectorRegistry(), "127.0.0.1", held)

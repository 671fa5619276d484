"""What the CLI says when its gRPC call fails: one line naming the status, and what to do."""

from __future__ import annotations

import pytest

from kvfleet.cli import main
from kvfleet.local_cluster import free_port


@pytest.mark.parametrize("command", [["workers"], ["telemetry"]])
def test_no_scheduler_at_the_address_is_said_with_how_to_start_one(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main([*command, "--scheduler", address]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvfleet: UNAVAILABLE: failed to connect"), err
    assert err.endswith(f"(is a scheduler running at {address}? `kvfleet up` starts one)"), err
    assert len(err.splitlines()) == 1


def test_each_retry_of_an_unreachable_scheduler_is_said_as_it_happens(caplog: pytest.LogCaptureFixture) -> None:
    """The client's retries of a scheduler that does not answer take about 16 s by default: each
    is logged (the CLI shows it on stderr) with where, why, the wait and the attempt."""
    import grpc

    from kvfleet.client import RetryPolicy, SchedulerClient, build_request

    address = f"127.0.0.1:{free_port()}"
    waits: list[float] = []
    policy = RetryPolicy(attempts=3, first_backoff_s=0.25, probe_timeout_s=0.2)
    with (
        caplog.at_level("WARNING", logger="kvfleet.client"),
        SchedulerClient(address, retry=policy, sleep=waits.append) as c,
    ):
        with pytest.raises(grpc.RpcError) as failed:
            c.generate(build_request([1, 2, 3], 4))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert waits == [0.25, 0.5]
    assert [r.getMessage() for r in caplog.records] == [
        f"the scheduler at {address} is unreachable (UNAVAILABLE); trying again in 0.25 s (attempt 2 of 3)",
        f"the scheduler at {address} is unreachable (UNAVAILABLE); trying again in 0.5 s (attempt 3 of 3)",
    ]


def test_the_cli_writes_the_client_s_retry_lines_as_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from kvfleet.cli import _client_retries_said

    client_log = logging.getLogger("kvfleet.client")
    before = (list(client_log.handlers), client_log.propagate)
    with _client_retries_said():
        client_log.warning("the scheduler at %s is unreachable", "h:1")
    assert capsys.readouterr().err == "kvfleet: the scheduler at h:1 is unreachable\n"
    assert (client_log.handlers, client_log.propagate) == before  # as it was once the command ends


def test_summary_without_a_telemetry_service_names_that_service(capsys: pytest.CaptureFixture[str]) -> None:
    """`summary` asks the telemetry service alone: the hint used to name a scheduler at None."""
    address = f"127.0.0.1:{free_port()}"
    assert main(["summary", "e1", "--telemetry", address]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"(is the telemetry service running at {address}? `kvfleet up` starts one)"), err


@pytest.mark.parametrize(
    "command",
    [
        ["sweep", "--scheduler", "127.0.0.1:1"],
        ["experiment", "--scheduler", "127.0.0.1:1", "--telemetry", "127.0.0.1:1"],
        ["summary", "e1", "--telemetry", "127.0.0.1:1"],
        ["demo"],
    ],
)
def test_an_out_that_cannot_be_written_is_said_before_any_work(
    command: list[str], tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep used to run to its end and then die in a traceback writing --out (its results
    lost); now nothing is started (here nothing even listens at the addresses given)."""
    missing = tmp_path / "no-such-folder" / "out.json"
    assert main([*command, "--out", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvfleet: cannot write --out {missing}: the folder {missing.parent} does not exist; create it first"
    assert main([*command, "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"kvfleet: --out {tmp_path} is a directory; name a file in it (e.g. {tmp_path / 'out.json'})"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sessions", "-1"], "sessions must be at least 1, got -1"),
        (["--concurrency", "0"], "concurrency must be at least 1, got 0"),
        (
            ["--max-new-tokens", "2"],
            "--max-new-tokens must be at least 4 (each soak session decodes 4 of them or more), got 2",
        ),
    ],
)
def test_a_soak_that_cannot_run_is_refused_before_it_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`soak --sessions -1` used to load the model, start a cluster and report a soak of nothing."""
    assert main(["soak", "--model", "tiny", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"kvfleet: {message}"


@pytest.fixture
def http_server():
    """An HTTP/1 server (as the gateway's OpenAI API is), where a gRPC address was meant."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # its lines would mix with the CLI's stderr
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("command", [["generate", "hi"], ["workers"]])
def test_an_http_port_given_for_the_scheduler_is_said_at_once(
    command: list[str], http_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to be retried for about 16 s (8 attempts), then said only gRPC's "Failed parsing
    HTTP/2" and asked whether a scheduler was running there."""
    assert main([*command, "--scheduler", http_server]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trying again" not in err, err
    assert err.startswith(f"kvfleet: UNAVAILABLE: {http_server} answers, but not in gRPC (an HTTP port?"), err


def test_token_ids_that_are_not_numbers_are_said(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "1,x", "--token-ids", "--scheduler", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvfleet: with --token-ids the prompt is token ids joined by commas (1,2,3), got '1,x'"
    )

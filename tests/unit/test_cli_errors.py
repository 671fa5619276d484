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

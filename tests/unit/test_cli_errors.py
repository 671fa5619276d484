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

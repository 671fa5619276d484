"""A command that starts a local cluster (`sweep` with no --scheduler), stopped by Ctrl-C or
SIGTERM as a user or a job runner stops it: it says so in one line and exits with 130, every
process it started is stopped, and its logs folder is removed (nothing failed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import running, wait_for_children


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_command_stops_its_local_cluster_and_leaves_nothing(tmp_path: Path, sig: int):
    err = tmp_path / "err"
    temp = tmp_path / "tmp"  # the cluster's logs folder is made here
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfleet.cli", "sweep", "--model", "tiny", "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=open(err, "wb"),
        env={**os.environ, "TMPDIR": str(temp)},
        cwd=tmp_path,  # were it to finish, its sweep.json would go there
    )
    started: list[int] = []
    try:
        # Its telemetry is up and its two workers are loading (seconds: each imports torch).
        started = wait_for_children(proc, 3, 60, err.read_text)
        assert list(temp.glob("kvfleet-*")), "no logs folder made: nothing to see removed"
        proc.send_signal(sig)
        assert proc.wait(30) == 130, err.read_text()
        text = err.read_text()
        assert text.rstrip().endswith("kvfleet: interrupted") and "Traceback" not in text, text
        assert "scheduler at" not in text, "the cluster had finished starting: not the case meant"
        assert [p for p in started if running(p)] == []
        assert list(temp.glob("kvfleet-*")) == []
    finally:
        for pid in started:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

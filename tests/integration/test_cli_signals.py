"""A command that starts a local cluster (`sweep` with no --scheduler), stopped by Ctrl-C or
SIGTERM as a user or a job runner stops it: it says so in one line and exits with 130, every
process it started is stopped, and its logs folder is removed (nothing failed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import children, running


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
    )
    started: list[int] = []
    try:
        end = time.monotonic() + 60
        # Its telemetry is up and its two workers are loading (seconds: each imports torch).
        while len(started := children(proc.pid)) < 3:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < end, f"no workers started within 60 s:\n{err.read_text()}"
            time.sleep(0.02)
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

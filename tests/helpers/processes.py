"""Processes the tests started and lost sight of (an orphan is reparented to init)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's exit may wait for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (read from /proc: no psutil in the project)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited while the folder was read
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def wait_for_children(proc: subprocess.Popen, count: int, timeout_s: float, log: Callable[[], str]) -> list[int]:
    """Wait until ``proc`` has ``count`` live children (a cluster starting: its telemetry first, then
    its workers, which load for seconds); returns them. Fails, showing ``log()``, if it exits first
    or does not get there within ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while len(found := children(proc.pid)) < count:
        assert proc.poll() is None, log()
        assert time.monotonic() < end, f"fewer than {count} child processes within {timeout_s} s:\n{log()}"
        time.sleep(0.02)
    return found

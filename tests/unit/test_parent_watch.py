"""A process started with KVFLEET_PARENT_PID naming its parent stops (its own SIGTERM) once that
parent is gone; without the variable, or with one that is not its parent, nothing is watched.
Real processes: a middle one starts the watched child, then is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfleet_common.parent_watch import PARENT_PID_ENV
from tests.helpers.processes import running

ROOT = Path(__file__).resolve().parents[2]
CHILD = (
    "import time\n"
    "from kvfleet_common.parent_watch import exit_with_parent\n"
    "watching = exit_with_parent(interval_s=0.05)\n"
    "print('watching' if watching else 'not watching', flush=True)\n"
    "time.sleep(60)\n"
)
MIDDLE = (
    "import os, subprocess, sys, time\n"
    "env = dict(os.environ)\n"
    f"env.pop({PARENT_PID_ENV!r}, None)\n"
    f"if sys.argv[1] == 'watch': env[{PARENT_PID_ENV!r}] = str(os.getpid())\n"
    "child = subprocess.Popen([sys.executable, '-c', sys.argv[2]], env=env, stdout=subprocess.PIPE, text=True)\n"
    "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
    "time.sleep(60)\n"
)


def test_nothing_is_watched_without_the_variable_or_with_one_not_naming_the_parent() -> None:
    """In a process of its own: were the parent check broken, the watch would stop the process
    that ran it at once (here that child, not the test run)."""
    code = (
        "import logging, os\n"
        "from kvfleet_common.parent_watch import PARENT_PID_ENV, exit_with_parent\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "got = [exit_with_parent({}), exit_with_parent({PARENT_PID_ENV: 'pid'}),\n"
        "       exit_with_parent({PARENT_PID_ENV: str(os.getpid())})]\n"
        "print(got, os.getpid(), os.getppid(), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got, pid, ppid = run.stdout.rsplit(" ", 2)
    assert got == "[None, None, None]"
    assert "'pid' is not a process id" in run.stderr
    assert f"{pid} is not this process's parent ({ppid.strip()})" in run.stderr


@pytest.mark.parametrize("watch", [True, False], ids=["watched", "unwatched"])
def test_a_watched_process_stops_once_its_parent_is_killed(watch: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, "watch" if watch else "no", CHILD], env=env, stdout=subprocess.PIPE, text=True
    )
    pid_text, said = middle.stdout.readline().split(maxsplit=1)  # type: ignore[union-attr]
    child = int(pid_text)
    try:
        assert said.strip() == ("watching" if watch else "not watching")
        middle.kill()
        middle.wait()
        end = time.monotonic() + (10 if watch else 1.5)
        while running(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert running(child) is not watch  # watched: gone; unwatched: an orphan still running
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)
        if middle.poll() is None:
            middle.kill()

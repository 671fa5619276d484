"""`kvfleet up` as a user runs it: a subprocess, its banner read for addresses and pids."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvfleet.client import SchedulerClient


class Up:
    """A `kvfleet up` process: its scheduler address and its children's pids, read from its banner."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        start_timeout_s: float,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        """With ``wait=False`` it returns once the process is started, before its banner."""
        self.stderr_path = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvfleet.cli",
                "up",
                "--port",
                "0",
                "--telemetry-port",
                "0",
                "--trace-api-port",
                "0",
                "--gateway-port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=open(log, "wb"),
            env=None if env is None else {**os.environ, **env},
        )
        if not wait:
            return
        banner = self._read_until("pids: ", start_timeout_s)
        self.banner = banner
        self.scheduler = re.search(r"scheduler at (\S+?)[,\s]", banner).group(1)
        self.pids = {n: int(p) for n, p in re.findall(r"([\w-]+)=(\d+)", banner.split("pids: ")[1])}
        logs = re.search(r"logs in (\S+?)\)", banner)
        assert logs is not None, banner
        self.log_dir = Path(logs.group(1))  # its processes' logs and telemetry.db

    def _read_until(self, marker: str, timeout_s: float) -> str:
        text, end = "", time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        while marker not in text or not text.endswith("\n"):
            assert self.proc.poll() is None, f"kvfleet up exited:\n{text}\n{self.stderr()}"
            assert time.monotonic() < end, f"kvfleet up not up within {timeout_s}s:\n{text}"
            if sel.select(0.5):  # raw reads: a buffered readline could hide a line from select
                text += os.read(self.proc.stdout.fileno(), 65536).decode()
        return text

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def wait_live(client: SchedulerClient, worker: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not {w.worker_id: w.live for w in client.list_workers()}.get(worker):
        assert time.monotonic() < end, f"{worker} was not taken back within {timeout_s}s"
        time.sleep(0.2)

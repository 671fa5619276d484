"""The gateway as a subprocess (`python -m gateway_svc`) and a small HTTP client for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from kvfleet.local_cluster import free_port


class GatewayProcess:
    """`python -m gateway_svc` on a free port, its output in log_dir/name.log."""

    def __init__(
        self,
        scheduler: str,
        log_dir: Path,
        name: str = "gateway",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        out = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway_svc",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--scheduler",
                scheduler,
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        end = time.monotonic() + 30
        while http("GET", self.url + "/health")[0] == 0:
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"gateway did not start:\n{self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def http(
    method: str, url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request; status 0 when nothing answered."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)
    except (urllib.error.URLError, ConnectionError):
        return 0, {}, {}

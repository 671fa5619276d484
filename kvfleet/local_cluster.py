"""Starts a scheduler and N workers as local processes, waits for health, stops them by SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_common.grpcutil import check_health
from kvfleet_common.security import TlsConfig

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterSpec:
    workers: int = 2
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    scheduler_port: int = 0            # 0 = a free port
    max_running: int = 64
    prefill_token_budget: int = 512
    num_blocks: int = 4096
    block_size: int = 16
    kv_views: str = "rebuild"
    telemetry: bool = True             # start a telemetry service and send traces to it
    telemetry_port: int = 0            # 0 = a free port
    extra_env: dict[str, str] = field(default_factory=dict)
    scheduler_args: tuple[str, ...] = ()   # more flags for python -m scheduler_svc
    tls_dir: str = ""                  # certificates from deploy/tls/make_dev_certs.sh: TLS everywhere,
                                       # mutual TLS towards workers and telemetry
    api_token: str = ""                # the scheduler's client API wants this bearer token
    gateway: bool = False              # also start the OpenAI-compatible HTTP gateway
    gateway_port: int = 0              # 0 = a free port
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"a cluster needs at least one worker, got {self.workers}")


class LocalCluster:
    def __init__(self, spec: ClusterSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvfleet-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.worker_addresses: list[str] = []
        self.scheduler_address = ""
        self.telemetry_address = ""
        self.metrics_ports: dict[str, int] = {}
        self.gateway_url = ""

    @property
    def client_tls(self) -> TlsConfig:
        """How this process (and tests) dial the cluster's services."""
        d = self.spec.tls_dir
        if not d:
            return TlsConfig()
        return TlsConfig(cert=f"{d}/client.pem", key=f"{d}/client.key", ca=f"{d}/ca.pem")

    def _tls_env(self, name: str) -> dict[str, str]:
        d = self.spec.tls_dir
        if not d:
            return {}
        ident = name.split("-")[0]           # worker-0 -> worker
        env = {"KVFLEET_TLS_CERT": f"{d}/{ident}.pem", "KVFLEET_TLS_KEY": f"{d}/{ident}.key",
               "KVFLEET_TLS_CA": f"{d}/ca.pem",
               "OTEL_EXPORTER_OTLP_CERTIFICATE": f"{d}/ca.pem",
               "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": f"{d}/{ident}.pem",
               "OTEL_EXPORTER_OTLP_CLIENT_KEY": f"{d}/{ident}.key"}
        if ident == "worker":                # only the scheduler may drive a worker
            env.update(KVFLEET_TLS_CLIENT_AUTH="true", KVFLEET_TLS_ALLOWED_CLIENTS="kvfleet-scheduler")
        if ident == "telemetry":             # only cluster services may send spans
            env.update(KVFLEET_TLS_CLIENT_AUTH="true")
        return env

    def _env(self, name: str = "") -> dict[str, str]:
        env = dict(self.spec.extra_env)
        env.update(self._tls_env(name))
        if self.spec.api_token and name in ("scheduler", "gateway"):
            env["KVFLEET_API_TOKEN"] = self.spec.api_token
        if self.telemetry_address:
            scheme = "https" if self.spec.tls_dir else "http"
            env.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", f"{scheme}://{self.telemetry_address}")
            env.setdefault("OTEL_EXPORTER_OTLP_INSECURE", "false" if self.spec.tls_dir else "true")
            # Short export delay so a finished run's spans reach the store within a second.
            env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
            env.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "65536")
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab")
        env = {**os.environ, **self._env(name)}
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start(self) -> "LocalCluster":
        s = self.spec
        try:
            if s.telemetry:
                port = s.telemetry_port or free_port(s.host)
                self.telemetry_address = f"{s.host}:{port}"
                self._spawn("telemetry", ["-m", "telemetry_svc", "--host", s.host, "--port", str(port),
                                          "--db", str(self.log_dir / "telemetry.db")])
                self._wait_healthy([self.telemetry_address])
            for i in range(s.workers):
                self.worker_addresses.append(f"{s.host}:{free_port(s.host)}")
                self._spawn_worker(i)
            self._wait_healthy(self.worker_addresses)
            port = s.scheduler_port or free_port(s.host)
            self.scheduler_address = f"{s.host}:{port}"
            self.metrics_ports["scheduler"] = free_port(s.host)
            self._spawn("scheduler", ["-m", "scheduler_svc", "--host", s.host, "--port", str(port),
                                      "--metrics-port", str(self.metrics_ports["scheduler"]),
                                      "--workers", ",".join(self.worker_addresses), "--model", s.model,
                                      "--max-running", str(s.max_running),
                                      "--prefill-token-budget", str(s.prefill_token_budget),
                                      *s.scheduler_args])
            self._wait_healthy([self.scheduler_address])
            if s.gateway:
                port = s.gateway_port or free_port(s.host)
                self.gateway_url = f"http://{s.host}:{port}"
                self._spawn("gateway", ["-m", "gateway_svc", "--host", s.host, "--port", str(port),
                                        "--scheduler", self.scheduler_address])
                self._wait_http("gateway", self.gateway_url + "/health")
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn_worker(self, i: int) -> None:
        s = self.spec
        port = self.worker_addresses[i].rsplit(":", 1)[1]
        metrics = self.metrics_ports.setdefault(f"worker-{i}", free_port(s.host))
        self._spawn(f"worker-{i}", ["-m", "worker_svc", "--host", s.host, "--port", port,
                                    "--metrics-port", str(metrics),
                                    "--worker-id", f"worker-{i}", "--model", s.model,
                                    "--device", s.device, "--dtype", s.dtype,
                                    "--num-blocks", str(s.num_blocks),
                                    "--block-size", str(s.block_size), "--kv-views", s.kv_views])

    def kill_worker(self, i: int) -> None:
        """SIGKILL: a crash, not a drain."""
        proc = self.procs.pop(f"worker-{i}")
        proc.kill()
        proc.wait()

    def restart_worker(self, i: int) -> None:
        """Start worker i again on its old address and wait until it is healthy."""
        self._spawn_worker(i)
        self._wait_healthy([self.worker_addresses[i]])

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def _wait_healthy(self, addresses: list[str]) -> None:
        end = time.monotonic() + self.spec.start_timeout_s
        pending = list(addresses)
        while pending:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
            pending = [a for a in pending if not asyncio.run(check_health(a, 1.0, self.client_tls))]
            if pending and time.monotonic() > end:
                raise TimeoutError(f"not healthy within {self.spec.start_timeout_s:.0f}s: {pending} "
                                   f"(logs in {self.log_dir})")
            if pending:
                time.sleep(0.2)

    def _wait_http(self, name: str, url: str) -> None:
        end = time.monotonic() + self.spec.start_timeout_s
        while True:
            proc = self.procs[name]
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass   # an HTTPError (503 until a worker is live) is a URLError too
            if time.monotonic() > end:
                raise TimeoutError(f"{name} not healthy within {self.spec.start_timeout_s:.0f}s "
                                   f"(logs in {self.log_dir})")
            time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        # Scheduler first, so it drains before its workers go; telemetry last, to get their spans.
        order = {"gateway": -1, "scheduler": 0, "telemetry": 2}
        for name in sorted(self.procs, key=lambda n: order.get(n, 1)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

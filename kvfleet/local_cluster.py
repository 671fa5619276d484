"""Starts a scheduler and N workers as local processes, waits for health, stops them by SIGTERM.

`Supervisor` keeps them up (what `kvfleet up` runs): a process that exits is started again on
its old address after a backoff; only a scheduler that keeps crashing stops the cluster.

The processes run in their own session, so a Ctrl-C at the terminal reaches only the caller,
which stops them in order (the scheduler drains while its workers still serve). Each is told
this process's id (KVFLEET_PARENT_PID) and stops by itself if this process dies without
stopping it (kvfleet_common/parent_watch.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet_common.grpcutil import check_health
from kvfleet_common.listen import CannotListen, check_ports
from kvfleet_common.parent_watch import PARENT_PID_ENV
from kvfleet_common.security import TlsConfig
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.limits import SchedulerLimits
from worker_svc.config import WorkerConfig

log = logging.getLogger(__name__)

# Beyond a process's drain: its exit (tracing flushed, channels closed) on a loaded machine.
STOP_MARGIN_S = 5.0
_SECRET_VARS = ("KVFLEET_WORKER_SECRET", "KVFLEET_WORKER_SECRET_FILE")


_handed_out: set[int] = set()
_LOWEST_PICKED = 10000  # free_port picks from here up to the OS's own range


def ephemeral_range() -> tuple[int, int]:
    """The ports the OS hands out for a bind to port 0 and as outgoing connections' source ports."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, never one this process handed out before, and picked below the OS's
    ephemeral range: a cluster's processes bind theirs later (a worker its metrics port once its
    model is loaded, seconds on), and a port in that range can meanwhile become the source port
    of any outgoing connection on the machine, failing the bind (seen in the suite: a worker of
    `kvfleet up` exited with EADDRINUSE). Where that range leaves no room, a port of its own."""
    low, _ = ephemeral_range()
    if low - _LOWEST_PICKED >= 1000:
        for _ in range(200):
            port = random.randrange(_LOWEST_PICKED, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@dataclass(frozen=True)
class ClusterSpec:
    # The services' settings default to their configs' defaults (read from the dataclasses,
    # which keep them as class attributes), so a cluster runs what `python -m ...` would.
    workers: int = 2
    model: str = WorkerConfig.model
    device: str = WorkerConfig.device
    dtype: str = WorkerConfig.dtype
    quant: str = WorkerConfig.quant  # workers' --quant: none | int8 | gguf
    host: str = WorkerConfig.host
    scheduler_port: int = 0  # 0 = a free port
    max_running: int = SchedulerLimits.max_running
    prefill_token_budget: int = SchedulerLimits.prefill_token_budget
    # The scheduler's --kv-budget-bytes; 0: not passed (the scheduler's default, the workers' caches)
    kv_budget_bytes: int = SchedulerLimits.kv_budget_bytes
    # The scheduler's --pack-step-ms (a worker with steps shorter than this takes new sessions first).
    pack_step_ms: float = SchedulerLimits.pack_step_ms
    # The scheduler's --overlap-scheduling (plan tick N+1 while tick N computes).
    overlap_scheduling: bool = SchedulerConfig.overlap_scheduling
    step_stream: bool = SchedulerConfig.step_stream  # the scheduler's --step-stream
    step_spans: bool = SchedulerConfig.step_spans  # the scheduler's --step-spans
    num_blocks: int = WorkerConfig.num_blocks
    kv_cache_memory: str = WorkerConfig.kv_cache_memory  # each worker's KV pool by memory (wins)
    kv_dtype: str = WorkerConfig.kv_dtype  # workers' --kv-dtype: auto | float32 | float16
    block_size: int = WorkerConfig.block_size
    max_model_len: int = WorkerConfig.max_model_len  # workers' --max-model-len (0 = the model's own)
    kv_views: str = WorkerConfig.kv_views.value
    # CPU threads per worker's step; 0 = this machine's cores shared out among the workers (two
    # workers with a thread pool each of every core oversubscribe them: on 2 cores each step of
    # 2 SmolLM2 workers ran up to 20x slower, OpenMP's threads waiting on descheduled peers).
    threads: int = 0
    telemetry: bool = True  # start a telemetry service and send traces to it
    telemetry_port: int = 0  # 0 = a free port
    trace_api_port: int = 0  # telemetry's Jaeger query HTTP API; 0 = a free port
    extra_env: dict[str, str] = field(default_factory=dict)
    scheduler_args: tuple[str, ...] = ()  # more flags for python -m scheduler_svc
    tls_dir: str = ""  # certificates from deploy/tls/make_dev_certs.sh: TLS everywhere,
    # mutual TLS towards workers and telemetry
    api_token: str = ""  # the scheduler's client API wants this bearer token
    gateway: bool = False  # also start the OpenAI-compatible HTTP gateway
    gateway_port: int = 0  # 0 = a free port
    log_format: str = ""  # --log-format for every process ("": theirs, i.e. text or $KVFLEET_LOG_FORMAT)
    log_level: str = ""  # --log-level likewise
    start_timeout_s: float = 180.0
    # The scheduler<->worker secret, handed to those processes only through their environment
    # (never a flag: the process list shows flags); "" = none. `kvfleet up` makes one per run.
    worker_secret: str = field(default="", repr=False)
    drain_grace_s: float = SchedulerConfig.drain_grace_s  # the scheduler's and gateway's --drain-grace
    # The telemetry service also passes every export on to this OTLP/gRPC endpoint ("" = none).
    forward_otlp: str = ""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"a cluster needs at least one worker, got {self.workers}")
        if self.drain_grace_s <= 0:
            raise ValueError(f"drain_grace_s must be positive, got {self.drain_grace_s}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0 (0 = the model's own), got {self.max_model_len}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = the cores shared out among the workers), got {self.threads}")

    @property
    def worker_threads(self) -> int:
        """Each worker's --threads: as given, else for CPU workers the cores shared out (at least
        one each; 0, i.e. the worker's own default, where one worker has them all or the
        workers are not on the CPU)."""
        if self.threads or self.workers == 1 or not self.device.startswith("cpu"):
            return self.threads
        return max(1, len(os.sched_getaffinity(0)) // self.workers)

    @property
    def stop_timeout_s(self) -> float:
        """How long `stop` waits for a process after SIGTERM before it kills it: the scheduler's
        drain lets running sessions finish (up to the grace), then gives the server the grace
        again to close its streams (scheduler_svc.server.RunningScheduler.stop), then exits."""
        return 2 * self.drain_grace_s + STOP_MARGIN_S


# The clusters of this process that are starting (start() running): what a signal stops.
_STARTING: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


def interrupt_starts() -> bool:
    """For a signal handler: every cluster of this process now starting gives up at its next safe
    point (``LocalCluster.interrupt``). False when none is starting."""
    starting = list(_STARTING)
    for cluster in starting:
        cluster.interrupt()
    return bool(starting)


class LocalCluster:
    """The processes' logs (and telemetry's database) go to ``log_dir``: a folder of the caller's
    is left as it is; without one, a temporary folder is made and removed by ``stop``, except
    after a failure (a start that failed, an exception out of the ``with`` body, or the
    Supervisor's ClusterDown; a KeyboardInterrupt is no failure): then it is kept, since the
    errors point to it ("logs in ...")."""

    def __init__(self, spec: ClusterSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvfleet-"))
        self.failed = False  # set on a failure: stop() then keeps a temporary log folder
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, list[str]] = {}  # name -> its arguments, to start it again
        self.started_at: dict[str, float] = {}  # name -> time.monotonic() of its last start
        self.worker_addresses: list[str] = []
        self.scheduler_address = ""
        self.telemetry_address = ""
        self.trace_api_url = ""  # telemetry's Jaeger query API (Grafana's Jaeger data source URL)
        self.metrics_ports: dict[str, int] = {}
        self.gateway_url = ""
        # Told each part of start() as it answers, with the seconds since start() began (`kvfleet
        # up` writes them on stderr: a model's load is seconds of otherwise silent waiting).
        self.on_ready: Callable[[str], None] | None = None
        self._interrupted = False  # see interrupt()

    def interrupt(self) -> None:
        """Stop waiting: a start (or a worker's restart) waiting for a process raises
        KeyboardInterrupt at its next check, within about a second, and start() then stops what it
        had started. Only a flag is set, so a signal handler may call it. A KeyboardInterrupt raised
        by the signal itself could land anywhere: between a process's start and its record here
        (that process then never stopped), or inside grpc's channel finalizer, which drops it."""
        self._interrupted = True

    def _check_interrupted(self) -> None:
        if self._interrupted:
            raise KeyboardInterrupt

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
        ident = name.split("-")[0]  # worker-0 -> worker
        env = {
            "KVFLEET_TLS_CERT": f"{d}/{ident}.pem",
            "KVFLEET_TLS_KEY": f"{d}/{ident}.key",
            "KVFLEET_TLS_CA": f"{d}/ca.pem",
            "OTEL_EXPORTER_OTLP_CERTIFICATE": f"{d}/ca.pem",
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": f"{d}/{ident}.pem",
            "OTEL_EXPORTER_OTLP_CLIENT_KEY": f"{d}/{ident}.key",
        }
        if ident == "worker":  # only the scheduler may drive a worker
            env.update(KVFLEET_TLS_CLIENT_AUTH="true", KVFLEET_TLS_ALLOWED_CLIENTS="kvfleet-scheduler")
        if ident == "telemetry":  # only cluster services may send spans
            env.update(KVFLEET_TLS_CLIENT_AUTH="true")
        return env

    def _env(self, name: str = "") -> dict[str, str]:
        env = dict(self.spec.extra_env)
        env.update(self._tls_env(name))
        if self.spec.worker_secret and (name == "scheduler" or name.startswith("worker-")):
            env["KVFLEET_WORKER_SECRET"] = self.spec.worker_secret
        if self.spec.api_token and name in ("scheduler", "telemetry"):  # (telemetry asks the scheduler)
            env["KVFLEET_API_TOKEN"] = self.spec.api_token
        if self.telemetry_address:
            scheme = "https" if self.spec.tls_dir else "http"
            env.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", f"{scheme}://{self.telemetry_address}")
            env.setdefault("OTEL_EXPORTER_OTLP_INSECURE", "false" if self.spec.tls_dir else "true")
            # Short export delay so a finished run's spans reach the store within a second.
            env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
            env.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "65536")
        return env

    def _log_args(self) -> list[str]:
        s = self.spec
        return [
            *(["--log-format", s.log_format] if s.log_format else []),
            *(["--log-level", s.log_level] if s.log_level else []),
        ]

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "ab")
        env = dict(os.environ)
        # The worker secret reaches the scheduler and workers only; the spec's replaces one inherited.
        if self.spec.worker_secret or not (name == "scheduler" or name.startswith("worker-")):
            for var in _SECRET_VARS:
                env.pop(var, None)
        if self.telemetry_address:
            # The services export to this cluster's telemetry (which forwards where the user's
            # OTEL_EXPORTER_OTLP_ENDPOINT says: spec.forward_otlp), not past it.
            for var in (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ):
                env.pop(var, None)
        env.update(self._env(name))
        env[PARENT_PID_ENV] = str(os.getpid())  # the service stops when this process is gone
        proc = subprocess.Popen(
            [sys.executable, *args, *self._log_args()],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # see the module docstring: Ctrl-C is the caller's to handle
        )
        out.close()  # the child holds its own descriptor
        self.procs[name] = proc
        self.commands[name] = list(args)
        self.started_at[name] = time.monotonic()
        self._check_interrupted()  # recorded first, so that stop() stops it
        return proc

    def respawn(self, name: str, extra_args: Sequence[str] = ()) -> subprocess.Popen:
        """Start a process again with its old arguments (so on its old address), then
        ``extra_args`` (a flag given again there wins: a worker restarted with another
        --max-model-len, say); does not wait."""
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.pid})")
        return self._spawn(name, [*self.commands[name], *extra_args])

    def start(self) -> "LocalCluster":
        _STARTING.add(self)
        try:
            return self._start()
        finally:
            _STARTING.discard(self)

    def _start(self) -> "LocalCluster":
        s = self.spec
        # The ports asked for are checked before anything starts (a model loads for seconds; a
        # second `kvfleet up` would otherwise fail at its telemetry service), named by up's flags.
        try:
            check_ports(
                s.host,
                (
                    ("the scheduler's gRPC API", s.scheduler_port, "--port"),
                    ("telemetry's OTLP", s.telemetry_port if s.telemetry else 0, "--telemetry-port"),
                    ("the trace UI and Jaeger API", s.trace_api_port if s.telemetry else 0, "--trace-api-port"),
                    ("the OpenAI-compatible API", s.gateway_port if s.gateway else 0, "--gateway-port"),
                ),
            )
        except CannotListen:
            self.stop()  # nothing ran: its log folder, empty, goes too
            raise
        began = time.monotonic()

        def ready(what: str) -> None:
            if self.on_ready is not None:
                self.on_ready(f"{what} ready ({time.monotonic() - began:.1f} s)")

        try:
            # Chosen first: telemetry's trace UI asks the scheduler for its live snapshot.
            scheduler_port = s.scheduler_port or free_port(s.host)
            if s.telemetry:
                port = s.telemetry_port or free_port(s.host)
                self.telemetry_address = f"{s.host}:{port}"
                http_port = s.trace_api_port or free_port(s.host)
                self.trace_api_url = f"{'https' if s.tls_dir else 'http'}://{s.host}:{http_port}"
                self._spawn(
                    "telemetry",
                    [
                        "-m",
                        "telemetry_svc",
                        "--host",
                        s.host,
                        "--port",
                        str(port),
                        "--db",
                        str(self.log_dir / "telemetry.db"),
                        "--http-port",
                        str(http_port),
                        "--scheduler",
                        f"{s.host}:{scheduler_port}",
                        *(["--forward-otlp", s.forward_otlp] if s.forward_otlp else []),
                    ],
                )
                self._wait_healthy([self.telemetry_address])
                ready("telemetry")
            for i in range(s.workers):
                self.worker_addresses.append(f"{s.host}:{free_port(s.host)}")
                self._spawn_worker(i)
            self._wait_healthy(self.worker_addresses)
            ready(f"{s.workers} worker{'s' if s.workers != 1 else ''} ({s.model})")
            port = scheduler_port
            self.scheduler_address = f"{s.host}:{port}"
            self.metrics_ports["scheduler"] = free_port(s.host)
            self._spawn(
                "scheduler",
                [
                    "-m",
                    "scheduler_svc",
                    "--host",
                    s.host,
                    "--port",
                    str(port),
                    "--metrics-port",
                    str(self.metrics_ports["scheduler"]),
                    "--workers",
                    ",".join(self.worker_addresses),
                    "--model",
                    s.model,
                    "--max-running",
                    str(s.max_running),
                    "--prefill-token-budget",
                    str(s.prefill_token_budget),
                    "--drain-grace",
                    str(s.drain_grace_s),
                    "--pack-step-ms",
                    str(s.pack_step_ms),
                    "--overlap-scheduling" if s.overlap_scheduling else "--no-overlap-scheduling",
                    "--step-stream" if s.step_stream else "--no-step-stream",
                    "--step-spans" if s.step_spans else "--no-step-spans",
                    # 0 leaves the scheduler's own setting (its default, or KVFLEET_KV_BUDGET_BYTES)
                    *(("--kv-budget-bytes", str(s.kv_budget_bytes)) if s.kv_budget_bytes else ()),
                    *s.scheduler_args,
                ],
            )
            self._wait_healthy([self.scheduler_address])
            ready("scheduler")
            if s.gateway:
                port = s.gateway_port or free_port(s.host)
                self.gateway_url = f"http://{s.host}:{port}"
                # With a scheduler token, the gateway holds none: each caller's bearer goes through.
                token = s.api_token or os.environ.get("KVFLEET_API_TOKEN")
                own_key = os.environ.get("KVFLEET_GATEWAY_API_KEY")
                self._spawn(
                    "gateway",
                    [
                        "-m",
                        "gateway_svc",
                        "--host",
                        s.host,
                        "--port",
                        str(port),
                        "--scheduler",
                        self.scheduler_address,
                        "--drain-grace",
                        str(s.drain_grace_s),
                        *(["--pass-through-key"] if token and not own_key else []),
                    ],
                )
                self._wait_http("gateway", self.gateway_url + "/health")
                ready("gateway")
        except BaseException as exc:
            self.failed = self.failed or isinstance(exc, Exception)  # not on Ctrl-C
            self.stop()
            raise
        return self

    def _spawn_worker(self, i: int) -> None:
        s = self.spec
        port = self.worker_addresses[i].rsplit(":", 1)[1]
        metrics = self.metrics_ports.setdefault(f"worker-{i}", free_port(s.host))
        self._spawn(
            f"worker-{i}",
            [
                "-m",
                "worker_svc",
                "--host",
                s.host,
                "--port",
                port,
                "--metrics-port",
                str(metrics),
                "--worker-id",
                f"worker-{i}",
                "--model",
                s.model,
                "--device",
                s.device,
                "--dtype",
                s.dtype,
                "--quant",
                s.quant,
                "--num-blocks",
                str(s.num_blocks),
                "--block-size",
                str(s.block_size),
                "--kv-views",
                s.kv_views,
                "--kv-dtype",
                s.kv_dtype,
                *(["--kv-cache-memory", s.kv_cache_memory] if s.kv_cache_memory else []),
                *(["--max-model-len", str(s.max_model_len)] if s.max_model_len else []),
                *(["--threads", str(s.worker_threads)] if s.worker_threads else []),
            ],
        )

    def kill_worker(self, i: int) -> None:
        """SIGKILL: a crash, not a drain."""
        proc = self.procs.pop(f"worker-{i}")
        proc.kill()
        proc.wait()

    def restart_worker(self, i: int, extra_args: Sequence[str] = ()) -> None:
        """Start worker i again on its old address (see ``respawn``) and wait until it is healthy."""
        self.respawn(f"worker-{i}", extra_args)
        self._wait_healthy([self.worker_addresses[i]])

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def _wait_healthy(self, addresses: list[str]) -> None:
        end = time.monotonic() + self.spec.start_timeout_s
        pending = list(addresses)
        while pending:
            self._check_interrupted()
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
            pending = [a for a in pending if not asyncio.run(check_health(a, 1.0, self.client_tls))]
            if pending and time.monotonic() > end:
                raise TimeoutError(
                    f"not healthy within {self.spec.start_timeout_s:.0f}s: {pending} (logs in {self.log_dir})"
                )
            if pending:
                time.sleep(0.2)

    def _wait_http(self, name: str, url: str) -> None:
        end = time.monotonic() + self.spec.start_timeout_s
        while True:
            self._check_interrupted()
            proc = self.procs[name]
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass  # an HTTPError (503 until a worker is live) is a URLError too
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{name} not healthy within {self.spec.start_timeout_s:.0f}s (logs in {self.log_dir})"
                )
            time.sleep(0.2)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM each process in order and wait up to ``grace_s`` (default: the spec's
        stop_timeout_s, which covers the scheduler's whole drain) before killing it."""
        grace_s = self.spec.stop_timeout_s if grace_s is None else grace_s
        # Scheduler first, so it drains before its workers go; telemetry last, to get their spans.
        order = {"gateway": -1, "scheduler": 0, "telemetry": 2}
        for name in sorted(self.procs, key=lambda n: order.get(n, 1)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs of SIGTERM; killing it", name, grace_s)
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        # Only the folder made here, and only when nothing failed (see the class docstring).
        if self._own_log_dir and not self.failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and issubclass(exc_type, Exception):  # not on Ctrl-C
            self.failed = True
        self.stop()


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5  # wait before the first restart, doubled for each crash in a row ...
    max_delay_s: float = 30.0  # ... up to this
    stable_after_s: float = 30.0  # up this long: its next crash counts as the first again
    max_restarts: int = 0  # restarts in a row; the crash after them ends the cluster (0 = never)

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")

    def delay_s(self, crashes: int) -> float:
        """Backoff before restarting after the crashes-th crash in a row (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (crashes - 1))


# The scheduler holds every session: if it cannot stay up, nothing can be served. Workers,
# telemetry and the gateway are retried for as long as the cluster runs (capped backoff).
DEFAULT_POLICIES = {"scheduler": RestartPolicy(max_restarts=5)}


class ClusterDown(RuntimeError):
    """A process the cluster cannot run without kept crashing."""


class Supervisor:
    """Restarts a LocalCluster's processes that exit. `poll()` is one pass and never blocks: a
    crashed process is due again after its backoff, so one slow start holds up no other restart.
    Processes the caller removed from `cluster.procs` (e.g. `kill_worker`) are left alone."""

    def __init__(
        self, cluster: LocalCluster, policies: dict[str, RestartPolicy] | None = None, clock=time.monotonic
    ) -> None:
        self.cluster = cluster
        self.policies = {**DEFAULT_POLICIES, **(policies or {})}
        self.clock = clock
        self.crashes: dict[str, int] = {}  # name -> crashes in a row
        self.restarts: dict[str, int] = {}  # name -> restarts in all
        self._due: dict[str, float] = {}  # name -> when to start it again

    def policy(self, name: str) -> RestartPolicy:
        return self.policies.get(name.split("-")[0], RestartPolicy())  # worker-1 -> worker

    def poll(self) -> None:
        """Notice exits, start again those whose backoff has passed; ClusterDown to give up."""
        now = self.clock()
        for name, proc in list(self.cluster.procs.items()):
            if name in self._due or proc.poll() is None:
                continue
            policy = self.policy(name)
            up_for = now - self.cluster.started_at.get(name, now)
            crashes = 1 if up_for >= policy.stable_after_s else self.crashes.get(name, 0) + 1
            self.crashes[name] = crashes
            if policy.max_restarts and crashes > policy.max_restarts:
                self.cluster.failed = True  # its logs are kept: the message points to them
                raise ClusterDown(
                    f"{name} exited {crashes} times in a row (last code {proc.returncode}); "
                    f"logs in {self.cluster.log_dir}"
                )
            delay = policy.delay_s(crashes)
            log.warning(
                "%s exited with code %s after %.1fs; restarting in %.1fs (crash %d in a row)",
                name,
                proc.returncode,
                up_for,
                delay,
                crashes,
            )
            self._due[name] = now + delay
        for name, due in list(self._due.items()):
            if now >= due:
                del self._due[name]
                proc = self.cluster.respawn(name)
                self.restarts[name] = self.restarts.get(name, 0) + 1
                log.warning("%s restarted (pid %d)", name, proc.pid)

"""Real gRPC servers (workers + scheduler) on loopback ports, in one background event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import SchedulerLimits
from worker_svc.config import WorkerConfig


class InProcessCluster:
    def __init__(
        self,
        workers: int = 2,
        model: str = "tiny",
        limits: SchedulerLimits | None = None,
        num_blocks: int = 1024,
        block_size: int = 16,
        kv_views: str = "rebuild",
        step_timeout_s: float = 30.0,
        no_worker_wait_s: float = 30.0,
        stats_interval_s: float = 10.0,
        loaded_model: tuple | None = None,
        device: str | None = None,
        max_model_len: int = 0,
        overlap: bool | None = None,
    ) -> None:
        """loaded_model: (config, weights) already loaded for ``model`` (a session fixture's).
        device: the workers' torch device; default KVFLEET_TEST_WORKER_DEVICE, else cpu (the GPU
        check, bench/gpu_session.sh, runs the cluster tests with cuda). overlap: the scheduler's
        overlapped scheduling; default on, as the service runs (KVFLEET_TEST_OVERLAP_SCHEDULING=0:
        off, one tick at a time); a test that compares with the reference's tick figures passes
        overlap=False."""
        if overlap is None:
            overlap = os.environ.get("KVFLEET_TEST_OVERLAP_SCHEDULING", "1") != "0"
        self.overlap = overlap
        self.loaded_model = loaded_model
        self.stats_interval_s = stats_interval_s
        self.no_worker_wait_s = no_worker_wait_s
        self.n_workers = workers
        self.model = model
        self.limits = limits or SchedulerLimits()
        self.worker_config = WorkerConfig(
            host="127.0.0.1",
            port=0,
            model=model,
            device=device or os.environ.get("KVFLEET_TEST_WORKER_DEVICE", "cpu"),
            num_blocks=num_blocks,
            block_size=block_size,
            kv_views=kv_views,
            metrics_port=0,
            max_model_len=max_model_len,
            # The cores shared out among the workers, as LocalCluster does for its processes.
            num_threads=0 if workers == 1 else max(1, len(os.sched_getaffinity(0)) // workers),
        )
        self.step_timeout_s = step_timeout_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.worker_servers: list = []
        # Each worker's steps on one thread of its own, as a worker process runs them on its
        # compute thread: steps spread over asyncio's pool would give each of its threads an
        # OpenMP pool of its own, and those oversubscribe the cores (steps ran 3-4x slower).
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"worker-{i}-steps") for i in range(workers)]
        self.worker_addresses: list[str] = []
        self.scheduler = None
        self.address = ""

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "InProcessCluster":
        from kvfleet_models.registry import load_model
        from scheduler_svc.server import create_server as create_scheduler
        from worker_svc.server import build_engine
        from worker_svc.server import create_server as create_worker

        self._thread.start()
        # One load of the weights for every worker; each worker's engine (and KV cache) its own.
        self.loaded_model = self.loaded_model or load_model(self.model)
        for i in range(self.n_workers):
            cfg = replace(self.worker_config, worker_id=f"worker-{i}")
            server, port, _ = self.run(create_worker(cfg, build_engine(cfg, self.loaded_model), self._executors[i]))
            self.worker_servers.append(server)
            self.worker_addresses.append(f"127.0.0.1:{port}")
        config = SchedulerConfig(
            host="127.0.0.1",
            port=0,
            workers=tuple(self.worker_addresses),
            limits=self.limits,
            model=self.model,
            step_timeout_s=self.step_timeout_s,
            health_interval_s=0.2,
            worker_connect_timeout_s=10,
            metrics_port=0,
            no_worker_wait_s=self.no_worker_wait_s,
            stats_interval_s=self.stats_interval_s,
            overlap_scheduling=self.overlap,
        )
        _, port, self.scheduler = self.run(create_scheduler(config))
        self.address = f"127.0.0.1:{port}"
        return self

    def wait_first_stats(self, timeout_s: float = 20.0) -> None:
        """Until the scheduler's first reading of its workers' memory, made as it starts, is in:
        the next comes stats_interval_s later, so a worker stopped now is found gone by its next
        step, not by a reading (which marks an idle worker dead at once)."""
        import time

        from kvfleet.client import SchedulerClient

        deadline = time.monotonic() + timeout_s
        with SchedulerClient(self.address) as client:
            while not all(w.rss_bytes for w in client.list_workers()):
                if time.monotonic() > deadline:
                    raise TimeoutError("the scheduler never read its workers' memory")
                time.sleep(0.02)

    def hold_worker(self, i: int) -> threading.Event:
        """Worker i's compute thread kept busy until the returned event is set: its steps and its
        stats reads wait meanwhile, as a hung worker's would."""
        release = threading.Event()
        self._executors[i].submit(release.wait)
        return release

    def stop_worker(self, i: int) -> None:
        """Worker i's server stops at once (a crash, as the scheduler sees it)."""
        self.run(self.worker_servers[i].stop(0))

    def start_worker(self, i: int) -> str:
        """Worker i anew on its old port (a fresh engine: a restart); returns its instance id."""
        from worker_svc.server import build_engine, start_worker

        port = int(self.worker_addresses[i].rsplit(":", 1)[1])
        cfg = replace(self.worker_config, worker_id=f"worker-{i}", port=port)
        server, _, _, servicer = self.run(start_worker(cfg, build_engine(cfg, self.loaded_model), self._executors[i]))
        self.worker_servers[i] = server
        return servicer.instance_id

    def stop(self) -> None:
        if self.scheduler is not None:
            self.run(self.scheduler.stop(1.0))
        for server in self.worker_servers:
            self.run(server.stop(0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        for executor in self._executors:
            executor.shutdown(wait=False)

    def __enter__(self) -> "InProcessCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

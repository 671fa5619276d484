"""python -m worker_svc: run one worker."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from worker_svc.config import WorkerConfig
from worker_svc.kv_views_mode import KVViewsMode


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m worker_svc", description="kvfleet worker")
    p.add_argument("--host", default=env("KVFLEET_WORKER_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("KVFLEET_WORKER_PORT", "50061")))
    p.add_argument("--worker-id", default=env("KVFLEET_WORKER_ID", "worker-0"))
    p.add_argument("--model", default=env("KVFLEET_MODEL", "tiny"))
    p.add_argument("--device", default=env("KVFLEET_DEVICE", "cpu"))
    p.add_argument("--dtype", default=env("KVFLEET_DTYPE", "float32"))
    p.add_argument("--block-size", type=int, default=int(env("KVFLEET_BLOCK_SIZE", "16")))
    p.add_argument("--num-blocks", type=int, default=int(env("KVFLEET_NUM_BLOCKS", "4096")))
    p.add_argument("--kv-views", default=env("KVFLEET_KV_VIEWS", "rebuild"),
                   choices=[m.value for m in KVViewsMode])
    p.add_argument("--metrics-port", type=int, default=int(env("KVFLEET_METRICS_PORT", "9401")),
                   help="Prometheus /metrics port (0 = off)")
    p.add_argument("--threads", type=int, default=int(env("KVFLEET_WORKER_THREADS", "0")),
                   help="CPU threads per step (0 = torch's setting, i.e. OMP_NUM_THREADS or the cores)")
    p.add_argument("--inline-step-ms", type=float, default=float(env("KVFLEET_INLINE_STEP_MS", "5")),
                   help="steps expected under this many ms run on the event loop (0 = never)")
    p.add_argument("--log-level", default=env("KVFLEET_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvfleet_common.security import TlsConfig

    return WorkerConfig(tls=TlsConfig.from_env(), host=a.host, port=a.port, worker_id=a.worker_id, model=a.model,
                        device=a.device, dtype=a.dtype, block_size=a.block_size,
                        num_blocks=a.num_blocks, kv_views=KVViewsMode.parse(a.kv_views),
                        metrics_port=a.metrics_port,
                        num_threads=a.threads, inline_step_s=a.inline_step_ms / 1000)


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        sys.exit(f"worker: {exc}")
    from kvfleet_models.errors import ModelLoadError
    from worker_svc.server import serve

    try:
        asyncio.run(serve(config))
    except ModelLoadError as exc:
        sys.exit(f"worker: cannot load model: {exc}")


if __name__ == "__main__":
    main()

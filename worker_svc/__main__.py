"""python -m worker_svc: run one worker."""

from __future__ import annotations

import sys

from kvfleet_common.flags import FlagParser, add_switch
from kvfleet_common.logs import setup_logging
from kvfleet_common.parent_watch import exit_with_parent
from worker_svc.config import WorkerConfig
from worker_svc.kv_memory import DEFAULT_POOL_TEXT, KV_DTYPES
from worker_svc.kv_views_mode import KVViewsMode


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    d = WorkerConfig()  # every flag's default is the config's
    p = FlagParser(prog="python -m worker_svc", description="kvfleet worker")
    p.add_argument("--host", env="KVFLEET_WORKER_HOST", default=d.host)
    p.add_argument("--port", type=int, env="KVFLEET_WORKER_PORT", default=d.port)
    p.add_argument("--worker-id", env="KVFLEET_WORKER_ID", default=d.worker_id)
    p.add_argument("--model", env="KVFLEET_MODEL", default=d.model)
    p.add_argument("--device", env="KVFLEET_DEVICE", default=d.device)
    p.add_argument("--dtype", env="KVFLEET_DTYPE", default=d.dtype)
    p.add_argument(
        "--quant",
        env="KVFLEET_QUANT",
        default=d.quant,
        choices=["none", "int8", "gguf"],
        help="weight quantization (CPU, float32): int8 = weight-only int8 blocks of 32; gguf = a GGUF model's "
        "own quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept as they are",
    )
    p.add_argument("--block-size", type=int, env="KVFLEET_BLOCK_SIZE", default=d.block_size)
    p.add_argument(
        "--num-blocks",
        type=int,
        env="KVFLEET_NUM_BLOCKS",
        default=d.num_blocks,
        help=f"KV blocks (0 = the default pool: {DEFAULT_POOL_TEXT})",
    )
    p.add_argument(
        "--kv-cache-memory",
        env="KVFLEET_KV_CACHE_MEMORY",
        default=d.kv_cache_memory,
        help="size the KV pool by memory instead of --num-blocks: 2GiB, 512MB, or 0.25 (of the available memory)",
    )
    p.add_argument(
        "--kv-dtype",
        env="KVFLEET_KV_DTYPE",
        default=d.kv_dtype,
        choices=list(KV_DTYPES),
        help="the KV cache's element type: auto = float32 for float32 weights, float16 for the reduced-precision "
        "CPU modes (bfloat16, int8, gguf; half the bytes a decode step's attention reads), the weights' dtype "
        "off a CPU",
    )
    p.add_argument(
        "--kv-views", env="KVFLEET_KV_VIEWS", default=d.kv_views.value, choices=[m.value for m in KVViewsMode]
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        env="KVFLEET_METRICS_PORT",
        default=d.metrics_port,
        help="Prometheus /metrics port (0 = off)",
    )
    p.add_argument(
        "--threads",
        type=int,
        env="KVFLEET_WORKER_THREADS",
        default=d.num_threads,
        help="CPU threads per step (0 = torch's setting, i.e. OMP_NUM_THREADS or the cores; "
        "one for a model too small to gain from more)",
    )
    p.add_argument(
        "--inline-step-ms",
        type=float,
        env="KVFLEET_INLINE_STEP_MS",
        default=d.inline_step_s * 1000,
        help=(
            "in-process servers only: steps expected under this many ms run on the event loop "
            "(0 = never); python -m worker_svc runs every step on its event loop, which is the "
            "process's initial thread"
        ),
    )
    add_switch(
        p,
        "prefix-caching",
        d.prefix_caching,
        "let the scheduler reuse the KV of prompt prefixes earlier sessions computed on this worker (default on)",
        "turn prefix caching off",
        env="KVFLEET_PREFIX_CACHING",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        env="KVFLEET_MAX_MODEL_LEN",
        default=d.max_model_len,
        help="longest prompt + generated tokens served (0 = the model's own context; at most that)",
    )
    p.add_logging_flags()
    a = p.parse_args(argv)
    setup_logging(a.log_level, a.log_format)
    from kvfleet_common.security import TlsConfig, worker_secret_from_env

    return WorkerConfig(
        tls=TlsConfig.from_env().checked(),
        worker_secret=worker_secret_from_env(),
        host=a.host,
        port=a.port,
        worker_id=a.worker_id,
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        quant=a.quant,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        kv_cache_memory=a.kv_cache_memory,
        kv_dtype=a.kv_dtype,
        kv_views=KVViewsMode.parse(a.kv_views),
        metrics_port=a.metrics_port,
        num_threads=a.threads,
        inline_step_s=a.inline_step_ms / 1000,
        prefix_caching=a.prefix_caching,
        max_model_len=a.max_model_len,
    )


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        sys.exit(f"worker: {exc}")
    from kvfleet_common.listen import CannotListen, check_ports

    exit_with_parent()
    try:
        # Ports it cannot have are a line at once: before torch loads (about 2 s), not after it.
        check_ports(
            config.host,
            (("gRPC", config.port, "--port"), ("Prometheus /metrics", config.metrics_port, "--metrics-port")),
        )
    except CannotListen as exc:
        sys.exit(f"worker: {exc}")
    from kvfleet_models.errors import ModelLoadError
    from worker_svc.platform import resolve_device
    from worker_svc.server import build_engine, serve_on_main_thread

    try:
        resolve_device(config.device)  # before the model loads: a device that is not there is a line
        loaded = build_engine(config)  # on this thread, which then runs every step
    except ModelLoadError as exc:
        sys.exit(f"worker: cannot load model: {exc}")
    except (ValueError, CannotListen) as exc:
        sys.exit(f"worker: {exc}")
    try:
        serve_on_main_thread(config, loaded)
    except CannotListen as exc:  # taken since the check
        sys.exit(f"worker: {exc}")


if __name__ == "__main__":
    main()

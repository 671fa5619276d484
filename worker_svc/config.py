"""Worker settings, built once in the entry point from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet_common.security import TlsConfig, check_worker_secret, is_loopback
from worker_svc.kv_memory import KV_DTYPES
from worker_svc.kv_views_mode import KVViewsMode


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 50061  # 0 = any free port
    worker_id: str = "worker-0"
    model: str = "tiny"  # a known name, a .gguf file or a Hugging Face directory
    device: str = "cpu"  # cpu | cuda | cuda:N | xpu | auto
    dtype: str = "float32"  # float32 | bfloat16 | float16
    block_size: int = 16
    num_blocks: int = 0  # 0 = the default pool: at most 1 GiB, a quarter of free memory (kv_memory)
    # Instead of num_blocks: as many blocks as fit in this much memory ("2GiB", "512MB", or a
    # fraction of the available memory such as "0.25"); "" = num_blocks. See kv_memory.
    kv_cache_memory: str = ""
    # REBUILD (control) | PERSISTENT (candidate); a string naming one is parsed on construction.
    kv_views: KVViewsMode = KVViewsMode.REBUILD
    drain_grace_s: float = 10.0
    num_threads: int = 0  # CPU threads per step; 0 = torch's setting (OMP_NUM_THREADS), 1 for a tiny model
    # A step expected to take less than this runs on the event loop, not in a thread (a tiny
    # step costs about what the hand-off does); 0 = always in a thread.
    inline_step_s: float = 0.005
    metrics_port: int = 9401  # Prometheus /metrics; 0 = off
    quant: str = "none"  # none | int8 | gguf (CPU, float32 only; gguf: a GGUF model; see EngineConfig)
    prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (see EngineConfig)
    max_model_len: int = 0  # longest prompt + generated served; 0 = the model's own (see EngineConfig)
    kv_dtype: str = "auto"  # auto | float32 | float16: the KV cache's element type (see EngineConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Calls must carry this (KVFLEET_WORKER_SECRET); "" = no secret check. repr=False: kept out of logs.
    worker_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0 (0 = the default pool), got {self.num_blocks}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        object.__setattr__(self, "kv_views", KVViewsMode.parse(self.kv_views))  # frozen
        if self.num_threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = torch's setting), got {self.num_threads}")
        if self.quant not in ("none", "int8", "gguf"):
            raise ValueError(f"quant must be none, int8 or gguf, got {self.quant!r}")
        if self.quant != "none" and self.dtype != "float32":
            raise ValueError(f"quant={self.quant} needs dtype float32 (the activations), got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype not in ("auto", self.dtype) and self.device not in ("cpu", "auto"):
            # before the model's load (kv_cache_dtype says the same for --device auto, after it)
            raise ValueError(
                f"kv dtype {self.kv_dtype} on {self.device}: the KV cache there is the weights' dtype "
                f"({self.dtype}); use auto"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max-model-len must be >= 0 (0 = the model's own context), got {self.max_model_len}")
        if self.inline_step_s < 0:
            raise ValueError(f"inline step time must be >= 0, got {self.inline_step_s}")
        if self.kv_cache_memory:
            from worker_svc.kv_memory import parse_memory

            parse_memory(self.kv_cache_memory)  # a bad size is a start-up error, before any load
        check_worker_secret(self.worker_secret)
        if not is_loopback(self.host) and not self.worker_secret and not self.mutual_tls:
            raise ValueError(
                f"listening on {self.host or 'every interface'} (beyond loopback) with neither mutual TLS "
                "nor a worker secret would let anyone who reaches the port drive this worker (list, free "
                "and probe other users' sessions): set KVFLEET_WORKER_SECRET (or KVFLEET_WORKER_SECRET_FILE) "
                "to the scheduler's secret, or serve mutual TLS (KVFLEET_TLS_CERT/KEY/CA with "
                "KVFLEET_TLS_CLIENT_AUTH=true), or listen on 127.0.0.1"
            )

    @property
    def mutual_tls(self) -> bool:
        """Clients must show a certificate of the CA (authorize_peer then names who may call)."""
        return self.tls.serves_tls and self.tls.client_auth

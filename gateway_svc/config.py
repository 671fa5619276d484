"""Gateway settings, built once in the entry point from flags and environment."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000                      # 0 = any free port
    scheduler: str = "localhost:50051"    # the scheduler's gRPC address host:port
    api_key: str | None = None            # when set, /v1/* needs "Authorization: Bearer <key>"
    request_timeout_s: float = 600.0      # the gRPC deadline of one generation (-> 504)
    chat_max_tokens: int = 256            # chat's max_tokens when the request gives none
    models_ttl_s: float = 5.0             # how long the served-model list from ListWorkers is reused
    drain_grace_s: float = 10.0           # on SIGTERM, how long in-flight requests may finish

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if ":" not in self.scheduler:
            raise ValueError(f"scheduler address {self.scheduler!r} must be host:port")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a key or leave it unset for no authentication")
        for name in ("request_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.models_ttl_s < 0:
            raise ValueError(f"models_ttl_s must not be negative, got {self.models_ttl_s}")
        if self.chat_max_tokens < 1:
            raise ValueError(f"chat_max_tokens must be at least 1, got {self.chat_max_tokens}")

"""Gateway settings, built once in the entry point from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvfleet_common.security import is_loopback

BODY_EXTRA_BYTES = 256 * 1024  # a request body's room beyond its prompt (see max_body_bytes)


class AuthMode(Enum):
    """Who may generate through the gateway, and with which token it calls the scheduler."""

    OPEN = "open"  # anyone; the scheduler wants no token (the gateway holds none)
    OWN_KEY = "own_key"  # callers show the gateway's key; the gateway sends its token
    PASS_THROUGH = "pass_through"  # callers' bearer goes to the scheduler, which checks it
    ANONYMOUS = "anonymous"  # anyone, with the gateway's token: only when told so


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    scheduler: str = "localhost:50051"  # the scheduler's gRPC address host:port
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    # The scheduler's bearer token (KVFLEET_API_TOKEN). Holding one means the scheduler wants it,
    # so the gateway must not hand it to every caller: it needs api_key or pass_through_key,
    # or allow_anonymous to say that an open gateway is meant.
    scheduler_token: str = ""
    pass_through_key: bool = False  # forward the caller's "Authorization: Bearer" to the scheduler
    # serve callers without a key although the scheduler wants one, or beyond loopback at all
    allow_anonymous: bool = False
    request_timeout_s: float = 600.0  # the gRPC deadline of one generation (-> 504)
    chat_max_tokens: int = 256  # chat's max_tokens when the request gives none
    models_ttl_s: float = 5.0  # how long the served-model list from ListWorkers is reused
    drain_grace_s: float = 10.0  # on SIGTERM, how long in-flight requests may finish
    # The scheduler's --max-prompt-bytes (the same KVFLEET_MAX_PROMPT_BYTES); the body limit
    # follows from it (max_body_bytes), so a body the scheduler would refuse is not read whole.
    max_prompt_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if ":" not in self.scheduler:
            raise ValueError(f"scheduler address {self.scheduler!r} must be host:port")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; give a key or leave it unset for no authentication")
        if self.api_key is not None and self.pass_through_key:
            raise ValueError(
                "give the gateway its own key (KVFLEET_GATEWAY_API_KEY) or pass the callers' "
                "key through (KVFLEET_GATEWAY_PASS_THROUGH_KEY), not both: callers send one"
            )
        if self.scheduler_token and self.auth_mode is AuthMode.OPEN:
            raise ValueError(
                "the scheduler wants a token (KVFLEET_API_TOKEN is set), and a gateway without a "
                "key would hand it to every caller: set KVFLEET_GATEWAY_API_KEY, or "
                "--pass-through-key to forward each caller's own bearer token, or "
                "--allow-anonymous if an open gateway is what you want"
            )
        if self.auth_mode is AuthMode.OPEN and not is_loopback(self.host) and not self.allow_anonymous:
            raise ValueError(
                f"listening on {self.host or 'every interface'} (beyond loopback) with no key would let anyone "
                "who reaches the port generate: set KVFLEET_GATEWAY_API_KEY, or --pass-through-key with a "
                "scheduler that wants KVFLEET_API_TOKEN, or --allow-anonymous "
                "(KVFLEET_GATEWAY_ALLOW_ANONYMOUS=true) if an open gateway is meant, or listen on 127.0.0.1"
            )
        for name in ("request_timeout_s", "drain_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.models_ttl_s < 0:
            raise ValueError(f"models_ttl_s must not be negative, got {self.models_ttl_s}")
        if self.chat_max_tokens < 1:
            raise ValueError(f"chat_max_tokens must be at least 1, got {self.chat_max_tokens}")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"max_prompt_bytes must be at least 1, got {self.max_prompt_bytes}")

    @property
    def max_body_bytes(self) -> int:
        """The largest request body read (then 413). JSON escapes grow a prompt: non-ASCII text
        sent as \\uXXXX is 2-3x its UTF-8 size, so 4x the prompt limit, plus room for the
        rest (a response_format schema is up to 64 KiB, the other fields a few KiB)."""
        return 4 * self.max_prompt_bytes + BODY_EXTRA_BYTES

    @property
    def auth_mode(self) -> AuthMode:
        if self.pass_through_key:
            return AuthMode.PASS_THROUGH
        if self.api_key is not None:
            return AuthMode.OWN_KEY
        if self.scheduler_token and self.allow_anonymous:
            return AuthMode.ANONYMOUS
        return AuthMode.OPEN

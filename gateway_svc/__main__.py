"""python -m gateway_svc: the OpenAI-compatible HTTP gateway in front of a running scheduler."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from gateway_svc.config import GatewayConfig
from kvfleet_common.flags import FlagParser
from kvfleet_common.logs import LogSettings
from kvfleet_common.parent_watch import exit_with_parent


def parse_args(argv: list[str] | None = None) -> tuple[GatewayConfig, LogSettings]:
    env = os.environ.get
    d = GatewayConfig()
    p = FlagParser(prog="python -m gateway_svc", description="kvfleet OpenAI-compatible gateway")
    p.add_argument("--host", env="KVFLEET_GATEWAY_HOST", default=d.host)
    p.add_argument("--port", type=int, env="KVFLEET_GATEWAY_PORT", default=d.port)
    p.add_argument(
        "--scheduler",
        env="KVFLEET_GATEWAY_SCHEDULER",
        default=d.scheduler,
        help="the scheduler's gRPC address host:port",
    )
    p.add_argument(
        "--api-key",
        env="KVFLEET_GATEWAY_API_KEY",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1/* (prefer the environment variable: "
        "a flag shows in the process list)",
    )
    p.add_argument(
        "--pass-through-key",
        action="store_true",
        env="KVFLEET_GATEWAY_PASS_THROUGH_KEY",
        help="require 'Authorization: Bearer <token>' on /v1/* and send that token to the scheduler, "
        "which checks it (its KVFLEET_API_TOKEN); the gateway holds no key",
    )
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        env="KVFLEET_GATEWAY_ALLOW_ANONYMOUS",
        help="serve callers without a key even though KVFLEET_API_TOKEN (the scheduler's token) is set, "
        "or on a host beyond loopback; without this, the gateway refuses to start so",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        env="KVFLEET_GATEWAY_REQUEST_TIMEOUT_S",
        default=d.request_timeout_s,
        help="seconds one generation may take (then 504)",
    )
    p.add_argument(
        "--chat-max-tokens",
        type=int,
        env="KVFLEET_GATEWAY_CHAT_MAX_TOKENS",
        default=d.chat_max_tokens,
        help="max_tokens of a chat request that gives none",
    )
    p.add_argument("--drain-grace", type=float, env="KVFLEET_GATEWAY_DRAIN_GRACE_S", default=d.drain_grace_s)
    p.add_argument(
        "--max-prompt-bytes",
        type=int,
        env="KVFLEET_MAX_PROMPT_BYTES",
        default=d.max_prompt_bytes,
        help="the scheduler's prompt size limit in UTF-8 bytes; request bodies over about 4x it are refused (413)",
    )
    p.add_logging_flags()
    a = p.parse_args(argv)
    config = GatewayConfig(
        host=a.host,
        port=a.port,
        scheduler=a.scheduler,
        api_key=a.api_key or None,
        scheduler_token=env("KVFLEET_API_TOKEN", ""),
        pass_through_key=a.pass_through_key,
        allow_anonymous=a.allow_anonymous,
        request_timeout_s=a.request_timeout,
        chat_max_tokens=a.chat_max_tokens,
        drain_grace_s=a.drain_grace,
        max_prompt_bytes=a.max_prompt_bytes,
    )
    return config, LogSettings(a.log_level, a.log_format)


async def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT, with tracing on when the OTEL_* environment asks for it."""
    from gateway_svc.app import create_server
    from kvfleet_common.grpcutil import wait_for_termination_signal
    from kvfleet_common.tracing import run_traced

    log = logging.getLogger("gateway_svc")

    async def run() -> None:
        running, _ = await create_server(config)
        await wait_for_termination_signal()
        log.info("gateway draining (grace %.1fs)", config.drain_grace_s)
        await running.stop()

    await run_traced("kvfleet-gateway", run())


def main(argv: list[str] | None = None) -> None:
    from kvfleet_common.security import TlsConfig

    try:
        config, logs = parse_args(argv)
        TlsConfig.from_env().checked()  # what it dials the scheduler with (Upstream's channel)
    except ValueError as exc:
        sys.exit(f"gateway: {exc}")
    logs.apply()
    exit_with_parent()
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # the port is taken, say
        sys.exit(f"gateway: {exc}")


if __name__ == "__main__":
    main()

"""python -m gateway_svc: the OpenAI-compatible HTTP gateway in front of a running scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from gateway_svc.config import GatewayConfig


def _flag(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


def parse_args(argv: list[str] | None = None) -> tuple[GatewayConfig, str]:
    env = os.environ.get
    d = GatewayConfig()
    p = argparse.ArgumentParser(prog="python -m gateway_svc", description="kvfleet OpenAI-compatible gateway")
    p.add_argument("--host", default=env("KVFLEET_GATEWAY_HOST", d.host))
    p.add_argument("--port", type=int, default=int(env("KVFLEET_GATEWAY_PORT", d.port)))
    p.add_argument("--scheduler", default=env("KVFLEET_GATEWAY_SCHEDULER", d.scheduler),
                   help="the scheduler's gRPC address host:port")
    p.add_argument("--api-key", default=env("KVFLEET_GATEWAY_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (prefer the environment variable: "
                        "a flag shows in the process list)")
    p.add_argument("--pass-through-key", action="store_true", default=_flag(env("KVFLEET_GATEWAY_PASS_THROUGH_KEY")),
                   help="require 'Authorization: Bearer <token>' on /v1/* and send that token to the scheduler, "
                        "which checks it (its KVFLEET_API_TOKEN); the gateway holds no key")
    p.add_argument("--allow-anonymous", action="store_true", default=_flag(env("KVFLEET_GATEWAY_ALLOW_ANONYMOUS")),
                   help="serve callers without a key even though KVFLEET_API_TOKEN (the scheduler's token) is set; "
                        "without this, the gateway refuses to start so")
    p.add_argument("--request-timeout", type=float,
                   default=float(env("KVFLEET_GATEWAY_REQUEST_TIMEOUT_S", d.request_timeout_s)),
                   help="seconds one generation may take (then 504)")
    p.add_argument("--chat-max-tokens", type=int,
                   default=int(env("KVFLEET_GATEWAY_CHAT_MAX_TOKENS", d.chat_max_tokens)),
                   help="max_tokens of a chat request that gives none")
    p.add_argument("--drain-grace", type=float, default=float(env("KVFLEET_GATEWAY_DRAIN_GRACE_S", d.drain_grace_s)))
    p.add_argument("--log-level", default=env("KVFLEET_LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)
    config = GatewayConfig(host=a.host, port=a.port, scheduler=a.scheduler, api_key=a.api_key,
                           scheduler_token=env("KVFLEET_API_TOKEN", ""), pass_through_key=a.pass_through_key,
                           allow_anonymous=a.allow_anonymous,
                           request_timeout_s=a.request_timeout, chat_max_tokens=a.chat_max_tokens,
                           drain_grace_s=a.drain_grace)
    return config, a.log_level


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
    try:
        config, level = parse_args(argv)
    except ValueError as exc:
        sys.exit(f"gateway: {exc}")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except OSError as exc:   # the port is taken, say
        sys.exit(f"gateway: {exc}")


if __name__ == "__main__":
    main()

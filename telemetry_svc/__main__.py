"""`python -m telemetry_svc`: the OTLP receiver and experiment judge."""

from __future__ import annotations

import argparse
import asyncio
import logging

from telemetry_svc.server import TelemetryConfig, serve


def parse_args(argv: list[str] | None = None) -> tuple[TelemetryConfig, str]:
    d = TelemetryConfig()
    p = argparse.ArgumentParser(prog="python -m telemetry_svc", description=__doc__)
    p.add_argument("--host", default=d.host, help="interface to listen on (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=d.port, help="OTLP/gRPC and Telemetry port")
    p.add_argument("--db", default=d.db_path, help="SQLite span store path")
    p.add_argument("--max-pending-spans", type=int, default=d.max_pending_spans,
                   help="spans in flight before exports get UNAVAILABLE with RetryInfo")  # fmt: skip
    p.add_argument("--grace", type=float, default=d.grace_s, help="seconds to drain on SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    a = p.parse_args(argv)
    from kvfleet_common.security import TlsConfig

    config = TelemetryConfig(a.host, a.port, a.db, max_pending_spans=a.max_pending_spans, grace_s=a.grace,
                             tls=TlsConfig.from_env())
    return config, a.log_level


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()

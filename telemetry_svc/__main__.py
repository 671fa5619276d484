"""`python -m telemetry_svc`: the OTLP receiver and experiment judge."""

from __future__ import annotations

import asyncio
import os
import sys

from kvfleet_common.flags import FlagParser
from kvfleet_common.listen import CannotListen, check_ports
from kvfleet_common.logs import LogSettings
from kvfleet_common.parent_watch import exit_with_parent
from telemetry_svc.auth import AuthPolicy
from telemetry_svc.http_api import JAEGER_QUERY_PORT
from telemetry_svc.retention import DEFAULT_MAX_DB_MB, DEFAULT_RETENTION_HOURS, RetentionPolicy
from telemetry_svc.server import TelemetryConfig, serve
from telemetry_svc.store import StoreUnusable

DEFAULT_METRICS_PORT = 9402  # scheduler 9400, workers 9401


def parse_args(argv: list[str] | None = None) -> tuple[TelemetryConfig, LogSettings]:
    d = TelemetryConfig()
    p = FlagParser(prog="python -m telemetry_svc", description=__doc__)
    p.add_argument("--host", default=d.host, help="interface to listen on (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=d.port, help="OTLP/gRPC and Telemetry port")
    p.add_argument("--db", default=d.db_path, help="SQLite span store path")
    p.add_argument("--max-pending-spans", type=int, default=d.max_pending_spans,
                   help="spans in flight before exports get UNAVAILABLE with RetryInfo")  # fmt: skip
    p.add_argument("--grace", type=float, default=d.grace_s, help="seconds to drain on SIGTERM")
    p.add_argument("--api-token", env="KVFLEET_TELEMETRY_TOKEN", default="",
                   help="bearer token writes must carry (prefer the variable: a flag "
                        "shows in ps). Mutual TLS: $KVFLEET_TLS_ALLOWED_CLIENTS")  # fmt: skip
    p.add_argument("--protect-reads", action="store_true", env="KVFLEET_TELEMETRY_PROTECT_READS",
                   help="reads (summaries, reports, timings, experiments, the trace API) need the token/certificate too")  # fmt: skip
    p.add_argument("--retention-hours", type=float, default=DEFAULT_RETENTION_HOURS,
                   help="delete spans and artifacts received longer ago than this")  # fmt: skip
    p.add_argument("--max-db-mb", type=float, default=DEFAULT_MAX_DB_MB,
                   help="delete the oldest spans while the store holds more than this")  # fmt: skip
    p.add_argument("--max-artifact-kb", type=int, env="KVFLEET_TELEMETRY_MAX_ARTIFACT_KB",
                   default=d.max_artifact_bytes // 1024,
                   help="largest RecordArtifact request accepted (tokens_json included); larger: RESOURCE_EXHAUSTED")  # fmt: skip
    p.add_argument("--forward-otlp", env="KVFLEET_TELEMETRY_FORWARD_OTLP", default=d.forward_otlp,
                   help="also pass every OTLP export received on to this endpoint (a collector, Tempo, "
                        "Jaeger): host:port, http://host:port or https://host:port")  # fmt: skip
    p.add_argument("--scheduler", env="KVFLEET_TELEMETRY_SCHEDULER", default=d.scheduler,
                   help="the scheduler (host:port) the trace UI's live snapshot asks ($KVFLEET_API_TOKEN "
                        "if it wants one); empty: the page says there is none")  # fmt: skip
    p.add_argument("--metrics-port", type=int, env="KVFLEET_METRICS_PORT", default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics port (0 = off)")  # fmt: skip
    p.add_argument("--http-port", type=int, env="KVFLEET_TELEMETRY_HTTP_PORT", default=JAEGER_QUERY_PORT,
                   help="Jaeger's query HTTP API over the store, for Grafana's Jaeger data source (0 = off)")  # fmt: skip
    p.add_logging_flags()
    a = p.parse_args(argv)
    from kvfleet_common.security import TlsConfig, telemetry_token_from_env

    try:
        tls = TlsConfig.from_env().checked()
        if not a.api_token:  # the flag's variable, else KVFLEET_TELEMETRY_TOKEN_FILE
            a.api_token = telemetry_token_from_env(
                {"KVFLEET_TELEMETRY_TOKEN_FILE": os.environ.get("KVFLEET_TELEMETRY_TOKEN_FILE", "")}
            )
        config = TelemetryConfig(a.host, a.port, a.db, max_pending_spans=a.max_pending_spans, grace_s=a.grace, tls=tls,
                                 auth=AuthPolicy(a.api_token, frozenset(tls.allowed_clients or ()), a.protect_reads),
                                 retention=RetentionPolicy.from_flags(a.retention_hours, a.max_db_mb),
                                 metrics_port=a.metrics_port, max_artifact_bytes=a.max_artifact_kb * 1024,
                                 forward_otlp=a.forward_otlp, http_port=a.http_port or None,
                                 scheduler=a.scheduler)  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    return config, LogSettings(a.log_level, a.log_format)


def main(argv: list[str] | None = None) -> None:
    config, logs = parse_args(argv)
    logs.apply()
    exit_with_parent()
    try:
        # Its OTLP port; it runs without its /metrics and trace API ports if it cannot have them.
        check_ports(config.host, (("OTLP/gRPC", config.port, "--port"),))
        asyncio.run(serve(config))
    except (CannotListen, StoreUnusable) as exc:
        sys.exit(f"telemetry: {exc}")


if __name__ == "__main__":
    main()

"""`python -m kvfleet.healthcheck HOST:PORT | URL`: exit 0 when the server says it is serving.

For container healthchecks (docker-compose `healthcheck:`), where no grpc_health_probe binary
is at hand. HOST:PORT asks the stock gRPC health service (grpc.health.v1), over TLS when the
process's KVFLEET_TLS_* variables say so (kvfleet_common.security), so the same check works in a TLS
deployment; an http(s):// URL (the gateway's /health) must answer 200. Exit codes: 0 serving;
1 answered but not serving (NOT_SERVING while draining, UNKNOWN, an HTTP error status);
2 no answer (no connection, deadline). Kubernetes has its own `grpc:` and `httpGet:` probes.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet_common import security

SERVING, NOT_SERVING_EXIT, UNREACHABLE_EXIT = 0, 1, 2


def check_grpc(address: str, service: str = "", timeout_s: float = 3.0) -> int:
    """The exit code for one Check of `service` ("" = the whole server) at `address`."""
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return UNREACHABLE_EXIT
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}", file=sys.stderr)
        return NOT_SERVING_EXIT
    return SERVING


def check_http(url: str, timeout_s: float = 3.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return SERVING if resp.status == 200 else NOT_SERVING_EXIT
    except urllib.error.HTTPError as exc:  # answered, with an error status (503 while draining)
        print(f"{url}: HTTP {exc.code}", file=sys.stderr)
        return NOT_SERVING_EXIT
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return UNREACHABLE_EXIT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("target", help="HOST:PORT of a kvfleet gRPC server, or an http(s):// URL")
    p.add_argument("--service", default="", help="gRPC service name to check (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    a = p.parse_args(argv)
    if a.target.startswith(("http://", "https://")):
        return check_http(a.target, a.timeout)
    try:
        return check_grpc(a.target, a.service, a.timeout)
    except ValueError as exc:  # unreadable KVFLEET_TLS_* files
        print(f"healthcheck: {exc}", file=sys.stderr)
        return UNREACHABLE_EXIT


if __name__ == "__main__":
    sys.exit(main())

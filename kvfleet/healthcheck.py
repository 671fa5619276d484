"""`python -m kvfleet.healthcheck HOST:PORT`: exit 0 when the server's gRPC health service says SERVING.

For container healthchecks (docker-compose `healthcheck:`), where no grpc_health_probe binary
is at hand. Exit codes: 0 SERVING; 1 any other status (NOT_SERVING while draining, UNKNOWN,
SERVICE_UNKNOWN); 2 the check could not be made (no connection, deadline). Kubernetes has its
own `grpc:` probe and does not need this.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING, NOT_SERVING_EXIT, UNREACHABLE_EXIT = 0, 1, 2


def check(address: str, service: str = "", timeout_s: float = 3.0) -> int:
    """The exit code for one Check of `service` ("" = the whole server) at `address`."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return UNREACHABLE_EXIT
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{address}: {status}", file=sys.stderr)
        return NOT_SERVING_EXIT
    return SERVING


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfleet.healthcheck", description=__doc__.splitlines()[0])
    p.add_argument("address", help="HOST:PORT of a kvfleet server")
    p.add_argument("--service", default="", help="service name to check (default: the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    a = p.parse_args(argv)
    return check(a.address, a.service, a.timeout)


if __name__ == "__main__":
    sys.exit(main())

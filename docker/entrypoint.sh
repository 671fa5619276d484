#!/bin/sh
# kvfleet image entry point: the first argument picks the service, the rest are its flags.
#   scheduler [flags]   python -m scheduler_svc   (listens on 0.0.0.0:50051)
#   worker [flags]      python -m worker_svc      (listens on 0.0.0.0:50061)
#   telemetry [flags]   python -m telemetry_svc   (listens on 0.0.0.0:4317 and :16686, SQLite in /data)
#   gateway [flags]     python -m gateway_svc     (OpenAI-compatible HTTP on 0.0.0.0:8000)
#   healthcheck H:P|URL python -m kvfleet.healthcheck (gRPC health, or HTTP 200)
#   kvfleet ...         the CLI (python -m kvfleet.cli), e.g. `kvfleet workers --scheduler scheduler:50051`
# `exec` makes the service PID 1, so `docker stop`'s SIGTERM reaches its graceful drain.
set -e
cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    scheduler)
        export KVFLEET_SCHEDULER_HOST="${KVFLEET_SCHEDULER_HOST:-0.0.0.0}"
        exec python -m scheduler_svc "$@" ;;
    worker)
        export KVFLEET_WORKER_HOST="${KVFLEET_WORKER_HOST:-0.0.0.0}"
        exec python -m worker_svc "$@" ;;
    telemetry)
        # telemetry_svc takes flags only; these defaults suit a container.
        exec python -m telemetry_svc --host 0.0.0.0 --db /data/telemetry.db "$@" ;;
    gateway)
        export KVFLEET_GATEWAY_HOST="${KVFLEET_GATEWAY_HOST:-0.0.0.0}"
        exec python -m gateway_svc "$@" ;;
    healthcheck)
        exec python -m kvfleet.healthcheck "$@" ;;
    kvfleet)
        exec python -m kvfleet.cli "$@" ;;
    -h|--help|help|"")
        sed -n '2,9p' "$0"; exit 0 ;;
    *)
        # anything else runs as a command (python, sh, ...)
        exec "$cmd" "$@" ;;
esac

"""The `kvfleet` command: start a local cluster, send sessions, run the sweep, read telemetry."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from kvfleet_common.flags import FlagParser, add_switch
from kvfleet_common.listen import CannotListen
from kvfleet_common.version import kvfleet_version

DEFAULT_SCHEDULER = "localhost:50051"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


# The scheduler's KV budget in the sweep's reference example (its snapshot's kv_budget_bytes):
# what `kvfleet sweep` and the demo's sweep give the scheduler of their cluster.
REFERENCE_KV_BUDGET_BYTES = 64 * 1024 * 1024


def _add_cluster_flags(
    p: FlagParser, model: str | None = None, overlap: bool | None = None, environment: bool = False
) -> None:
    """overlap: the local cluster's overlapped scheduling by default (None: the scheduler's).

    environment: each flag also reads the variable that the service it configures reads for the
    same setting (`kvfleet up`: KVFLEET_MAX_RUNNING=3 is 3 there as under `python -m
    scheduler_svc`). The measurement commands leave it off: their runs are their flags' alone."""
    from kvfleet.local_cluster import ClusterSpec
    from worker_svc.kv_memory import DEFAULT_POOL_TEXT, KV_DTYPES
    from worker_svc.kv_views_mode import KVViewsMode

    def var(name: str) -> str | None:
        return name if environment else None

    d = ClusterSpec()  # every flag's default is the cluster's (which are the services')
    p.add_argument(
        "--model",
        default=model or d.model,
        env=var("KVFLEET_MODEL"),
        help="tiny | smollm2-135m | a .gguf file | a HF directory",
    )
    # No variable: the scheduler's KVFLEET_WORKERS is its list of worker addresses, not a count.
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes to start")
    p.add_argument("--device", default=d.device, env=var("KVFLEET_DEVICE"), help="cpu | cuda | cuda:N | xpu | auto")
    p.add_argument("--dtype", default=d.dtype, env=var("KVFLEET_DTYPE"), choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quant",
        default=d.quant,
        env=var("KVFLEET_QUANT"),
        choices=["none", "int8", "gguf"],
        help="workers' weight quantization (CPU, float32): int8 = weight-only int8 blocks of 32; gguf = a GGUF's "
        "own quantized blocks",
    )
    p.add_argument("--max-running", type=int, default=d.max_running, env=var("KVFLEET_MAX_RUNNING"))
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=d.prefill_token_budget,
        env=var("KVFLEET_PREFILL_TOKEN_BUDGET"),
    )
    p.add_argument(
        "--kv-budget-bytes",
        type=int,
        default=d.kv_budget_bytes,
        env=var("KVFLEET_KV_BUDGET_BYTES"),
        help="the scheduler's cap on KV bytes reserved across workers (0 = none: the workers' caches)",
    )
    p.add_argument(
        "--pack-step-ms",
        type=float,
        default=d.pack_step_ms,
        env=var("KVFLEET_PACK_STEP_MS"),
        help="a worker whose steps take less than this (ms) takes new sessions before an idle one "
        "is used (0 = spread by load from the first session)",
    )
    add_switch(
        p,
        "overlap-scheduling",
        d.overlap_scheduling if overlap is None else overlap,
        "the scheduler plans and sends tick N+1 while tick N computes (the same tokens, other tick counts)",
        "the scheduler runs one tick at a time (the tick figures of tests/data's sweep reference)",
        env=var("KVFLEET_OVERLAP_SCHEDULING"),
    )
    add_switch(
        p,
        "step-stream",
        d.step_stream,
        "the scheduler sends each worker its steps over one open stream (default on)",
        "the scheduler sends each step as a Step call of its own",
        env=var("KVFLEET_STEP_STREAM"),
    )
    add_switch(
        p,
        "step-spans",
        d.step_spans,
        "with tracing on, each request's trace has a span for each step it took part in (default on)",
        "no per-request step spans (at 64 sessions they were most of the cluster's tracing cost)",
        env=var("KVFLEET_STEP_SPANS"),
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        env=var("KVFLEET_NUM_BLOCKS"),
        help=f"KV blocks per worker (of 16 tokens; 0 = the worker's default pool: {DEFAULT_POOL_TEXT})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        env=var("KVFLEET_BLOCK_SIZE"),
        help="tokens per KV block on every worker (the scheduler plans in the workers' blocks)",
    )
    p.add_argument(
        "--kv-views",
        default=d.kv_views,
        env=var("KVFLEET_KV_VIEWS"),
        choices=[m.value for m in KVViewsMode],
        help="how the workers' attention gets contiguous K/V: rebuild (gathered every layer) or persistent "
        "(per-session rows kept across steps)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        env=var("KVFLEET_WORKER_THREADS"),
        help="CPU threads per worker (0 = the machine's cores shared out among the CPU workers)",
    )
    p.add_argument(
        "--kv-cache-memory",
        default=d.kv_cache_memory,
        env=var("KVFLEET_KV_CACHE_MEMORY"),
        help="each worker's KV pool by memory instead of --num-blocks: 2GiB, 512MB, or 0.25 (of the available memory)",
    )
    p.add_argument(
        "--kv-dtype",
        default=d.kv_dtype,
        env=var("KVFLEET_KV_DTYPE"),
        choices=list(KV_DTYPES),
        help="workers' KV cache element type: auto = float32 for float32 weights, float16 for bfloat16, int8 "
        "and gguf on a CPU",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        env=var("KVFLEET_MAX_MODEL_LEN"),
        help="longest prompt + generated tokens served (0 = the model's own context; at most that)",
    )


def _spec(a: argparse.Namespace, port: int = 0):
    """The cluster the flags describe. LocalCluster gives a worker no --max-model-len,
    --kv-cache-memory or --threads, and the scheduler no --kv-budget-bytes, where the value is 0
    or "" (the service's own default); the service would then read its variable from the
    environment it inherits. So each process gets that variable set to the value found here:
    else `KVFLEET_MAX_MODEL_LEN=2048 kvfleet up --max-model-len 0` ran 2048, and the caller's
    shell reached a sweep's workers."""
    from kvfleet.local_cluster import ClusterSpec

    return ClusterSpec(
        workers=a.workers,
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        quant=a.quant,
        scheduler_port=port,
        max_running=a.max_running,
        prefill_token_budget=a.prefill_token_budget,
        kv_budget_bytes=a.kv_budget_bytes,
        pack_step_ms=a.pack_step_ms,
        overlap_scheduling=a.overlap_scheduling,
        step_stream=a.step_stream,
        step_spans=a.step_spans,
        num_blocks=a.num_blocks,
        block_size=a.block_size,
        kv_views=a.kv_views,
        threads=a.threads,
        kv_cache_memory=a.kv_cache_memory,
        kv_dtype=a.kv_dtype,
        max_model_len=a.max_model_len,
        log_format=getattr(a, "log_format", ""),
        log_level=getattr(a, "log_level", ""),
        extra_env={
            "KVFLEET_KV_BUDGET_BYTES": str(a.kv_budget_bytes),
            "KVFLEET_KV_CACHE_MEMORY": a.kv_cache_memory,
            "KVFLEET_MAX_MODEL_LEN": str(a.max_model_len),
            # Left out only where it is 0 (ClusterSpec.worker_threads), the worker's own default.
            "KVFLEET_WORKER_THREADS": str(a.threads),
        },
    )


@contextlib.contextmanager
def _cluster(a: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """(scheduler, telemetry) addresses: the ones given, or a local cluster started (and
    stopped) for this command."""
    telemetry = getattr(a, "telemetry", None) or ""
    if a.scheduler:
        yield a.scheduler, telemetry
        return
    from kvfleet.local_cluster import LocalCluster

    print(f"starting a local cluster ({a.workers} workers, model {a.model}) ...", file=sys.stderr)
    with LocalCluster(_spec(a)) as cluster:
        print(f"scheduler at {cluster.scheduler_address}, telemetry at {cluster.telemetry_address}", file=sys.stderr)
        yield cluster.scheduler_address, telemetry or cluster.telemetry_address


@contextlib.contextmanager
def _scheduler(a: argparse.Namespace) -> Iterator[str]:
    with _cluster(a) as (scheduler, _):
        yield scheduler


def _forward_endpoint(telemetry_port: int) -> str:
    """The user's own OTLP endpoint, if the environment names one: `kvfleet up`'s services export
    to its telemetry service, which passes everything on there (OTLP/gRPC only; not when it is
    that telemetry service's own address, a habit with localhost:4317)."""
    from telemetry_svc.forward import names_itself

    env = os.environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    if endpoint and protocol != "grpc":
        print(
            f"not forwarding traces to {endpoint}: only OTLP/gRPC is forwarded (protocol {protocol})", file=sys.stderr
        )
        return ""
    try:
        if endpoint and telemetry_port and names_itself(endpoint, "127.0.0.1", telemetry_port):
            return ""  # the user's endpoint is kvfleet up's own telemetry: nothing to forward
    except ValueError as exc:  # not an address kvfleet can forward to: it starts without
        print(f"not forwarding traces to {endpoint}: {exc}", file=sys.stderr)
        return ""
    return endpoint


def cmd_up(a: argparse.Namespace) -> int:
    """Start the cluster and keep it up: a process that dies is restarted (with backoff, logged);
    Ctrl-C or SIGTERM drains and stops everything, and so does a scheduler that keeps crashing.
    The workers obey only this run's scheduler: a fresh secret, in their environment only."""
    import dataclasses
    import secrets

    from kvfleet.local_cluster import ClusterDown, LocalCluster, Supervisor
    from kvfleet_common.logs import setup_logging

    setup_logging(a.log_level, a.log_format)
    spec = _spec(a, a.port)
    if not a.no_gateway:
        spec = dataclasses.replace(spec, gateway=True, gateway_port=a.gateway_port)
    spec = dataclasses.replace(
        spec,
        telemetry_port=a.telemetry_port,
        trace_api_port=a.trace_api_port,
        worker_secret=secrets.token_urlsafe(32),
        drain_grace_s=a.drain_grace,
        forward_otlp=_forward_endpoint(a.telemetry_port),
    )
    cluster = LocalCluster(spec)
    cluster.on_ready = lambda what: print(f"kvfleet: {what}", file=sys.stderr, flush=True)
    # The children run in sessions of their own (they never see the terminal's Ctrl-C), so this
    # process must stop them however it is told to stop, at any moment. A stop signal only sets
    # flags: a start gives up at its next check (start() stops what it started), after it the loop
    # below ends and the cluster drains. (A KeyboardInterrupt raised by the signal itself could
    # land inside grpc's channel finalizer, which drops it, or between a child's start and its
    # record: see LocalCluster.interrupt.)
    stop: list[int] = []

    def on_stop_signal(*_) -> None:
        stop.append(1)
        cluster.interrupt()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # Ctrl-C, a stop, the terminal closed
        signal.signal(sig, on_stop_signal)
    print(
        f"starting {a.workers} workers ({a.model} on {a.device}), the scheduler, telemetry"
        f"{' and the HTTP gateway' if spec.gateway else ''} ...",
        flush=True,
    )
    try:
        cluster.start()
    except KeyboardInterrupt:
        print("kvfleet: stopped while starting; every process it had started is stopped", file=sys.stderr, flush=True)
        return 130
    code = 0
    try:
        gateway = f", OpenAI API at {cluster.gateway_url}/v1" if cluster.gateway_url else ""
        # The UI and Jaeger's query API share the port: the API's URL is Grafana's data source URL.
        traces = f", trace UI at {cluster.trace_api_url}/ (Jaeger API under /api)" if cluster.trace_api_url else ""
        print(
            f"kvfleet is up: scheduler at {cluster.scheduler_address}{gateway}, telemetry (OTLP) at "
            f"{cluster.telemetry_address}{traces} (workers {', '.join(cluster.worker_addresses)}; "
            f"metrics ports {cluster.metrics_ports}; logs in {cluster.log_dir}). Ctrl-C drains and stops.",
            flush=True,
        )
        if spec.forward_otlp:
            print(f"traces also go to {spec.forward_otlp} (OTEL_EXPORTER_OTLP_ENDPOINT), through kvfleet's telemetry")
        print("pids: " + ", ".join(f"{n}={p.pid}" for n, p in cluster.procs.items()), flush=True)
        supervisor = Supervisor(cluster)
        while not stop:
            supervisor.poll()
            time.sleep(0.2)
    except KeyboardInterrupt:  # a restart the stop signal interrupted (its process recorded): drain
        pass
    except ClusterDown as exc:
        print(f"kvfleet: {exc}; stopping", file=sys.stderr, flush=True)
        code = 1
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts the drain
    try:
        print(f"draining (up to {spec.stop_timeout_s:.0f}s; Ctrl-C again to kill now) ...", flush=True)
        cluster.stop()
    except KeyboardInterrupt:
        print("killing ...", flush=True)
        cluster.stop(grace_s=0)
    return code


def _request_from_args(a: argparse.Namespace, prompt):
    from kvfleet.client import build_request

    return build_request(
        prompt,
        a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop=a.stop or (),
        ignore_eos=a.ignore_eos,
    )


def _run_generate(a: argparse.Namespace, prompt) -> int:
    from kvfleet.client import SchedulerClient

    def show(ev) -> None:
        print(ev.text if ev.text else " ".join(map(str, ev.token_ids)) + " " * bool(ev.token_ids), end="", flush=True)

    with _scheduler(a) as address, SchedulerClient(address) as client:
        result = client.generate(_request_from_args(a, prompt), timeout=a.timeout, on_event=None if a.json else show)
    if a.json:
        print(
            json.dumps(
                {
                    "session_id": result.session_id,
                    "prompt_token_ids": result.prompt_token_ids,
                    "token_ids": result.token_ids,
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    else:
        print(f"\n[{result.finish_reason}, {len(result.token_ids)} tokens]", file=sys.stderr)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    if not a.token_ids:
        return _run_generate(a, a.prompt)
    try:
        ids = [int(t) for t in a.prompt.split(",")]
    except ValueError:
        raise ValueError(
            f"with --token-ids the prompt is token ids joined by commas (1,2,3), got {a.prompt!r}"
        ) from None
    return _run_generate(a, ids)


def cmd_chat(a: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": a.system}] if a.system else []
    messages.append({"role": "user", "content": a.message})
    return _run_generate(a, messages)


def cmd_sweep(a: argparse.Namespace) -> int:
    from kvfleet.client import SchedulerClient
    from kvfleet.sweep import SweepSpec, format_table, run_sweep

    spec = SweepSpec(
        sessions=a.sessions,
        prompt_len=a.prompt_len,
        max_new_tokens=a.max_new_tokens,
        prefill_budget=a.prefill_budget,
        concurrency=a.concurrency,
        seed=a.seed,
    )
    _check_out(a.out)
    from kvfleet.progress import for_terminal

    with _scheduler(a) as address, SchedulerClient(address) as client, for_terminal("sweep") as progress:
        doc = run_sweep(client, spec, progress=progress)
    print(format_table(doc))
    if a.out:
        from kvfleet.sweep_plot import plot_sweep

        Path(a.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        png, svg = plot_sweep(doc, a.out)
        print(f"wrote {a.out}, {png} and {svg}", file=sys.stderr)
    return 0 if doc["concurrency_sweep"]["corruption_free"] else 1


def cmd_experiment(a: argparse.Namespace) -> int:
    from kvfleet.client import SchedulerClient
    from kvfleet.experiment import ExperimentSpec, format_summary, run_experiment

    spec = ExperimentSpec(
        lever=a.lever,
        repeats=a.repeats,
        sessions=a.sessions,
        prompt_len=a.prompt_len,
        max_new_tokens=a.max_new_tokens,
        concurrency=a.concurrency,
        seed=a.seed,
        experiment_id=a.experiment_id,
    )
    if a.scheduler and not a.telemetry:
        raise ValueError("with --scheduler, also give --telemetry HOST:PORT (where its spans go)")
    _check_out(a.out)
    from kvfleet.progress import for_terminal

    with (
        _cluster(a) as (scheduler, telemetry),
        SchedulerClient(scheduler) as client,
        for_terminal("experiment") as progress,
    ):
        doc, html = run_experiment(client, telemetry, spec, progress=progress)
    print(format_summary(doc))
    _write_outputs(doc, html, a.out)
    return 0


def _check_out(out: str) -> None:
    """Before the work: an --out that could not be written is said now, not after a whole run."""
    if not out:
        return
    path = Path(out)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"--out {out} is a directory; name a file in it (e.g. {path / 'out.json'})")
    if not folder.is_dir():
        raise ValueError(f"cannot write --out {out}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"cannot write --out {out}: permission denied")


def _write_outputs(doc: dict, html: str, out: str) -> None:
    if not out:
        return
    Path(out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    report = Path(out).with_suffix(".html")
    report.write_text(html)
    print(f"wrote {out} and {report}", file=sys.stderr)


def cmd_summary(a: argparse.Namespace) -> int:
    from kvfleet.experiment import format_summary
    from kvfleet.v1 import telemetry_pb2 as tpb
    from kvfleet.v1 import telemetry_pb2_grpc as tpb_grpc

    spec_json = Path(a.gates).read_text() if a.gates else ""
    _check_out(a.out)
    from kvfleet_common.security import channel as open_channel

    with open_channel(a.telemetry) as channel:
        stub = tpb_grpc.TelemetryStub(channel)
        doc = json.loads(
            stub.GetSummary(tpb.SummaryRequest(experiment_id=a.experiment, gate_spec_json=spec_json), timeout=60).json
        )
        html = stub.GetReport(tpb.ReportRequest(experiment_id=a.experiment, gate_spec_json=spec_json), timeout=60).html
    print(format_summary(doc))
    _write_outputs(doc, html, a.out)
    return 0


def cmd_soak(a: argparse.Namespace) -> int:
    from kvfleet.local_cluster import LocalCluster
    from kvfleet.progress import for_terminal
    from kvfleet.soak import SoakSpec, engine_reference, run_soak

    if a.max_new_tokens < 4:
        raise ValueError(
            f"--max-new-tokens must be at least 4 (each soak session decodes 4 of them or more), got {a.max_new_tokens}"
        )
    spec = SoakSpec(
        sessions=a.sessions,
        concurrency=a.concurrency,
        seed=a.seed,
        new_tokens=(4, a.max_new_tokens),
        restart_after_s=a.restart_after,
    )
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"soak: {spec.sessions} sessions, {spec.concurrency} concurrent streams, model {a.model}")
    reference = engine_reference(a.model)
    with LocalCluster(_spec(a)) as cluster, for_terminal("soak", line_every=50) as progress:
        report = run_soak(cluster, spec, reference, progress=progress)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_traces(a: argparse.Namespace) -> int:
    from kvfleet import traces

    db = Path(a.db)
    if a.trace or a.session:
        trace_id = a.trace or traces.trace_of_session(db, a.session)
        print(traces.waterfall(traces.spans_of(db, trace_id)))
        return 0
    for trace_id, root, count, start_ns, duration_ns in traces.recent(db, a.limit):
        stamp = time.strftime("%H:%M:%S", time.localtime(start_ns / 1e9))
        print(f"{stamp}  {trace_id}  {duration_ns / 1e6:10.2f} ms  {count:5d} spans  {root}")
    return 0


def cmd_telemetry(a: argparse.Namespace) -> int:
    from kvfleet.client import SchedulerClient
    from kvfleet.sweep import snapshot_dict

    with SchedulerClient(a.scheduler) as client:
        print(json.dumps(snapshot_dict(client.telemetry()), indent=2))
    return 0


def cmd_workers(a: argparse.Namespace) -> int:
    from kvfleet.client import SchedulerClient
    from kvfleet.proto_json import message_dict
    from worker_svc.memory import RSS_HEADROOM_BYTES

    with SchedulerClient(a.scheduler) as client:
        for w in client.list_workers():
            row = message_dict(w)
            # Issue 25's idle bound beside the RSS and the worker's own part of it (private_bytes),
            # which the bound holds: weights in their format + KV pool + headroom.
            pool = w.kv_bytes_per_token * w.kv_capacity_tokens
            row.update(kv_pool_bytes=pool, rss_bound_bytes=w.weight_bytes + pool + RSS_HEADROOM_BYTES)
            print(json.dumps(row))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    """The main job, locally: the cluster on the real model streams a completion and a chat
    answer; then the tiny-model concurrency sweep runs through its own cluster."""
    from kvfleet.client import SchedulerClient, build_request
    from kvfleet.local_cluster import LocalCluster

    _check_out(a.out)  # the sweep's, written at the end
    print(
        f"== starting a local cluster: {a.workers} workers on {a.model} (loading the model takes a little while) ...",
        flush=True,
    )
    cluster = LocalCluster(_spec(a))
    cluster.on_ready = lambda what: print(f"   {what}", flush=True)  # the load, part by part
    with cluster, SchedulerClient(cluster.scheduler_address) as client:
        print(f"scheduler at {cluster.scheduler_address}, telemetry at {cluster.telemetry_address}")
        for title, prompt in (
            ("completion", "The capital of France is"),
            ("chat", [{"role": "user", "content": "Name three primary colors."}]),
        ):
            shown = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            print(f"\n== {title}: {shown!r}\n", flush=True)
            result = client.generate(
                build_request(prompt, a.max_new_tokens), on_event=lambda ev: print(ev.text, end="", flush=True)
            )
            print(
                f"\n[{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} "
                f"generated, finish: {result.finish_reason}]"
            )
    print("\n== the concurrency sweep on the tiny model\n", flush=True)
    return cmd_sweep(_demo_sweep(a))


def _demo_sweep(a: argparse.Namespace) -> argparse.Namespace:
    """The demo's sweep: the reference workload on the tiny model through a cluster of its own,
    one tick at a time as the reference's rules count ticks (as `kvfleet sweep` does)."""
    a.scheduler, a.model = None, "tiny"
    a.sessions, a.prompt_len, a.max_new_tokens, a.prefill_budget = 8, 4, 8, 4
    a.concurrency, a.seed = (1, 2, 4, 8), 0
    a.overlap_scheduling = False
    a.kv_budget_bytes = REFERENCE_KV_BUDGET_BYTES
    return a


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet", description="kvfleet LLM-serving cluster")
    p.add_argument("--version", action="version", version=f"kvfleet {kvfleet_version()}")
    # Every subcommand takes --config FILE (keys: its flag names); see kvfleet_common/flags.py.
    sub = p.add_subparsers(dest="command", required=True, parser_class=FlagParser)

    from gateway_svc.config import GatewayConfig
    from kvfleet.local_cluster import ClusterSpec
    from scheduler_svc.config import SchedulerConfig
    from telemetry_svc.http_api import JAEGER_QUERY_PORT
    from telemetry_svc.server import TelemetryConfig

    up = sub.add_parser("up", help="start a local cluster (scheduler + workers); Ctrl-C drains and stops")
    _add_cluster_flags(up, environment=True)
    up.add_logging_flags()
    # `kvfleet up` serves on each service's own default port (a ClusterSpec takes free ones).
    up.add_argument("--port", type=int, default=SchedulerConfig.port, help="the scheduler's client port")
    up.add_argument(
        "--telemetry-port", type=int, default=TelemetryConfig.port, help="the telemetry service's OTLP port"
    )
    up.add_argument(
        "--trace-api-port",
        type=int,
        default=JAEGER_QUERY_PORT,
        help="telemetry's Jaeger query HTTP API, which Grafana's Jaeger data source reads",
    )
    up.add_argument(
        "--gateway-port",
        type=int,
        default=GatewayConfig.port,
        help="the OpenAI-compatible HTTP gateway's port (key: env KVFLEET_GATEWAY_API_KEY)",
    )
    up.add_argument("--no-gateway", action="store_true", help="start no HTTP gateway")
    up.add_argument(
        "--drain-grace",
        type=float,
        env="KVFLEET_DRAIN_GRACE_S",
        default=ClusterSpec.drain_grace_s,
        help="seconds the scheduler lets running sessions finish on Ctrl-C (each process is killed "
        "only after twice this plus a margin)",
    )
    up.set_defaults(fn=cmd_up)

    for name, fn, helptext in (
        ("generate", cmd_generate, "send one session and stream its tokens"),
        ("chat", cmd_chat, "send chat messages and stream the answer"),
    ):
        g = sub.add_parser(name, help=helptext)
        if name == "generate":
            g.add_argument("prompt", help="prompt text (or comma-separated ids with --token-ids)")
            g.add_argument("--token-ids", action="store_true", help="the prompt is token ids")
        else:
            g.add_argument("message")
            g.add_argument("--system", default="")
        g.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
        g.add_argument("--max-new-tokens", type=int, default=64)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--stop", action="append", help="a stop string (repeatable)")
        g.add_argument("--ignore-eos", action="store_true")
        g.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
        g.add_argument("--json", action="store_true", help="print one JSON object at the end")
        g.set_defaults(fn=fn)

    sw = sub.add_parser("sweep", help="run the concurrency sweep and write its JSON")
    sw.add_argument("--scheduler", default=None, help="HOST:PORT of a running cluster (else a local one)")
    # Off by default: the sweep reproduces the reference's tick figures (tests/data), which are
    # those of one tick at a time; --overlap-scheduling measures the default scheduler instead.
    _add_cluster_flags(sw, overlap=False)
    sw.add_argument("--sessions", type=int, default=8)
    sw.add_argument("--prompt-len", type=int, default=4)
    sw.add_argument("--max-new-tokens", type=int, default=8)
    sw.add_argument("--prefill-budget", type=int, default=4)
    sw.add_argument("--concurrency", type=_ints, default=(1, 2, 4, 8))
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--out", default="sweep.json")
    # The reference's KV budget, so the snapshot's budget and pressure read as the example's.
    sw.set_defaults(fn=cmd_sweep, kv_budget_bytes=REFERENCE_KV_BUDGET_BYTES)

    ex = sub.add_parser("experiment", help="run an A/B experiment on a lever and print its summary")
    ex.add_argument("--lever", default="persistent_kv_views", choices=["persistent_kv_views"])
    ex.add_argument("--repeats", type=int, default=6, help="runs per arm, interleaved ABAB")
    ex.add_argument("--scheduler", default=None, help="HOST:PORT of a running cluster (else a local one)")
    ex.add_argument("--telemetry", default=None, help="HOST:PORT of its telemetry service")
    _add_cluster_flags(ex)
    ex.add_argument("--sessions", type=int, default=8)
    ex.add_argument("--prompt-len", type=int, default=16)
    ex.add_argument("--max-new-tokens", type=int, default=32)
    ex.add_argument("--concurrency", type=int, default=8)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--experiment-id", default="")
    ex.add_argument("--out", default="experiment.json", help="summary JSON (the HTML report beside it)")
    ex.set_defaults(fn=cmd_experiment)

    su = sub.add_parser("summary", help="fetch an experiment's summary from the telemetry service")
    su.add_argument("experiment")
    su.add_argument("--telemetry", default="localhost:4317")
    su.add_argument("--gates", default="", help="a gate spec JSON file (default: the service's)")
    su.add_argument("--out", default="", help="write the summary JSON (and the HTML report beside it)")
    su.set_defaults(fn=cmd_summary)

    so = sub.add_parser("soak", help="a bounded load test with cancels, deadlines and a worker crash")
    _add_cluster_flags(so, model="smollm2-135m")
    so.add_argument("--sessions", type=int, default=300)
    so.add_argument("--concurrency", type=int, default=64)
    so.add_argument("--max-new-tokens", type=int, default=40)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument(
        "--restart-after", type=float, default=3.0, help="seconds between killing a worker and restarting it"
    )
    so.set_defaults(fn=cmd_soak)

    tr = sub.add_parser("traces", help="recent traces, or one as a waterfall, from a telemetry store")
    tr.add_argument("--db", required=True, help="the telemetry store (kvfleet up: telemetry.db in its logs folder)")
    tr.add_argument("--trace", default="", help="show this trace (its id, 32 hex digits)")
    tr.add_argument("--session", default="", help="show the trace of this session (its id, s-...)")
    tr.add_argument("--limit", type=int, default=20, help="traces to list")
    tr.set_defaults(fn=cmd_traces)

    te = sub.add_parser("telemetry", help="print the scheduler's live telemetry snapshot")
    te.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    te.set_defaults(fn=cmd_telemetry)

    wo = sub.add_parser("workers", help="list the scheduler's workers")
    wo.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    wo.set_defaults(fn=cmd_workers)

    de = sub.add_parser("demo", help="serve real requests on the real model, then run the sweep")
    _add_cluster_flags(de, model="smollm2-135m")
    de.add_argument("--max-new-tokens", type=int, default=48)
    de.add_argument("--out", default="sweep.json")
    de.set_defaults(fn=cmd_demo)
    return p


@contextlib.contextmanager
def _client_retries_said() -> Iterator[None]:
    """While a command runs, the client library's retry lines (kvfleet.client logs one per retry
    of an unreachable scheduler) on stderr, as the CLI's other lines are written (not through
    the root logger's handlers, or Python's bare last-resort one). `up` sets up logging its own way."""
    client_log = logging.getLogger("kvfleet.client")
    handler, propagate = _StderrLines(), client_log.propagate
    client_log.addHandler(handler)
    client_log.propagate = False
    try:
        yield
    finally:
        client_log.removeHandler(handler)
        client_log.propagate = propagate


class _StderrLines(logging.Handler):
    """`kvfleet: <message>` on whatever sys.stderr is when the line is written."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"kvfleet: {record.getMessage()}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """Ctrl-C and SIGTERM (a cancelled job, `timeout`) end a command alike: a local cluster it is
    starting gives up at its next check and stops what it started; otherwise KeyboardInterrupt,
    and the `with LocalCluster` it runs in stops the cluster (its logs folder removed) rather than
    leaving its processes to notice their parent gone. On the main thread only (signal handlers
    live there); restored after, since tests call ``main`` in their own process."""
    import threading

    from kvfleet.local_cluster import interrupt_starts

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(*_) -> None:
        if not interrupt_starts():
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.fn is cmd_up:  # up handles its own signals: a drain
            return args.fn(args)
        with _client_retries_said(), _stop_signals():
            return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what the command started is stopped by now
        print("kvfleet: interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as exc:
        from kvfleet.client import not_grpc

        code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
        timeout = getattr(args, "timeout", None)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            # gRPC's own words ("Deadline Exceeded", "Stream removed") do not name the flag.
            details = f"no complete answer within --timeout {timeout:g} s ({details})"
        elif code == grpc.StatusCode.UNAVAILABLE and not_grpc(exc):
            where = getattr(args, "scheduler", None) or getattr(args, "telemetry", None)
            details = (
                f"{where} answers, but not in gRPC (an HTTP port? the gateway's OpenAI API at :8000 is for "
                f"HTTP clients; kvfleet's commands talk to the scheduler's gRPC port, 50051 by default) ({details})"
            )
        elif code == grpc.StatusCode.UNAVAILABLE and str(details).startswith("failed to connect"):
            # Nothing listens there (gRPC's words for it); a scheduler that answers is not so.
            # `summary` talks to the telemetry service alone.
            if getattr(args, "scheduler", None) is None and getattr(args, "telemetry", None):
                what, where = "the telemetry service", args.telemetry
            else:
                what, where = "a scheduler", getattr(args, "scheduler", None)
            details = f"{details} (is {what} running at {where}? `kvfleet up` starts one)"
        print(f"kvfleet: {code.name}: {details}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, ValueError, CannotListen) as exc:
        print(f"kvfleet: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The docker-compose deployment end to end: real sessions through the published ports (gRPC and
the OpenAI-compatible gateway), spans in the telemetry store, Prometheus metrics, and a worker
container stopped mid-run. Needs Docker; see conftest.py.

The tests share one stack and run in file order; the last one stops (and restarts) a worker.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvfleet.client import Completion, SchedulerClient, build_request
from kvfleet.v1 import telemetry_pb2, telemetry_pb2_grpc
from tests.e2e.conftest import REPO, Stack
from tests.helpers.prometheus import samples
from tests.helpers.prometheus import types as family_types

pytestmark = pytest.mark.e2e

WORKERS = ("worker-0", "worker-1")


# Generous: on a 2-core machine shared with other work, 8 sessions on one worker have been seen
# to take 270 s (18 s when the machine is otherwise idle).
SESSION_TIMEOUT_S = 600


def _generate(stack: Stack, prompt, max_new_tokens: int, **kw) -> Completion:
    with SchedulerClient(stack.scheduler_address) as client:
        return client.generate(build_request(prompt, max_new_tokens, **kw), timeout=SESSION_TIMEOUT_S)


def _workers(stack: Stack) -> dict[str, bool]:
    with SchedulerClient(stack.scheduler_address) as client:
        return {w.worker_id or w.address: w.live for w in client.list_workers()}


def _span_rows(stack: Stack, sql: str) -> list[list]:
    """Rows of a read-only query on the telemetry SQLite file, run inside its container."""
    script = (
        "import json, sqlite3, sys; c = sqlite3.connect('file:/data/telemetry.db?mode=ro', uri=True); "
        "print(json.dumps(c.execute(sys.argv[1]).fetchall()))"
    )
    res = stack.container("telemetry").exec_run(["python", "-c", script, sql])
    assert res.exit_code == 0, res.output.decode()
    return json.loads(res.output)


def _timings(stack: Stack) -> dict[str, int]:
    with grpc.insecure_channel(stack.telemetry_address) as ch:
        resp = telemetry_pb2_grpc.TelemetryStub(ch).GetTimings(telemetry_pb2.TimingsRequest(), timeout=10)
    return {t.span_name: t.count for t in resp.timings}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(1)


# what each service's compose healthcheck asks, from inside its container
HEALTH_TARGETS = {
    "telemetry": "127.0.0.1:4317",
    "worker-0": "127.0.0.1:50061",
    "worker-1": "127.0.0.1:50061",
    "scheduler": "127.0.0.1:50051",
    "gateway": "http://127.0.0.1:8000/health",
}


def test_every_service_is_healthy_and_both_workers_live(stack: Stack) -> None:
    for service, target in HEALTH_TARGETS.items():
        assert stack.health(service) == "healthy", service
        res = stack.container(service).exec_run(["python", "-m", "kvfleet.healthcheck", target])
        assert res.exit_code == 0, (service, res.output.decode())
    # and a port nothing listens on is reported as unreachable (exit 2), not as healthy
    res = stack.container("scheduler").exec_run(["python", "-m", "kvfleet.healthcheck", "127.0.0.1:1"])
    assert res.exit_code == 2, res.output.decode()
    assert _workers(stack) == {"worker-0": True, "worker-1": True}


def test_token_id_sessions_complete_through_the_published_port(stack: Stack) -> None:
    prompts = [[1, 2, 3, 4 + i] for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: _generate(stack, p, 12, ignore_eos=True), prompts))
    for prompt, c in zip(prompts, done):
        assert c.prompt_token_ids == prompt
        assert len(c.token_ids) == 12 and c.finish_reason == "length", c
    # greedy decoding is deterministic: the same prompt again gives the same tokens
    again = _generate(stack, prompts[0], 12, ignore_eos=True)
    assert again.token_ids == done[0].token_ids


def test_text_session_streams_text(stack: Stack) -> None:
    if stack.model != "smollm2-135m":
        pytest.skip(f"text prompts need a real tokenizer; the stack serves {stack.model}")
    c = _generate(stack, [{"role": "user", "content": "Name three colours."}], 24)
    assert c.token_ids and c.text.strip(), c
    assert c.finish_reason in ("length", "eos", "stop"), c


def test_openai_completion_through_the_published_gateway(stack: Stack) -> None:
    body = json.dumps({"model": stack.model, "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{stack.gateway_url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        out = json.load(resp)
    assert out["object"] == "text_completion" and out["model"] == stack.model, out
    assert 1 <= out["usage"]["completion_tokens"] <= 8, out
    assert out["choices"][0]["finish_reason"] in ("length", "stop"), out
    with urllib.request.urlopen(f"{stack.gateway_url}/v1/models", timeout=30) as resp:
        assert stack.model in [m["id"] for m in json.load(resp)["data"]]


_INTRUDER = """
import grpc
from kvfleet.v1 import worker_pb2 as wpb, worker_pb2_grpc as wpb_grpc
with grpc.insecure_channel("worker-0:50061") as ch:
    try:
        wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=20)
    except grpc.RpcError as exc:
        print(exc.code().name, exc.details())
    else:
        print("ANSWERED")
"""


def test_a_worker_answers_no_one_but_the_scheduler_on_the_compose_network(stack: Stack) -> None:
    """The gateway's container reaches worker-0 on the compose network but has no secret."""
    res = stack.container("gateway").exec_run(["python", "-c", _INTRUDER])
    out = res.output.decode()
    assert res.exit_code == 0 and out.startswith("UNAUTHENTICATED"), out
    # the one-shot service made the secret and the workers read it (they are healthy with it)
    secret = stack.container("worker-0").exec_run(["sh", "-c", "stat -c '%u %a %s' /run/kvfleet/worker-secret"])
    assert secret.output.decode().split()[:2] == ["10001", "400"], secret.output.decode()


def _scrape(stack: Stack, service: str, port: int) -> str:
    script = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    res = stack.container(service).exec_run(["python", "-c", script])
    assert res.exit_code == 0, res.output.decode()
    return res.output.decode()


def test_prometheus_metrics_serve_every_name_the_dashboard_uses(stack: Stack) -> None:
    # the gateway serves its own /metrics on its API port (the earlier tests sent it requests)
    scraped = _scrape(stack, "scheduler", 9400) + _scrape(stack, "worker-0", 9401) + _scrape(stack, "gateway", 8000)
    finished = samples(
        scraped, "kvfleet:request_success_total", {"finished_reason": "length", "model_name": stack.model}
    )
    assert finished and finished[0].value >= 1, "no finished sessions counted"
    served = samples(
        scraped,
        "kvfleet:gateway_requests_total",
        {"endpoint": "text_completion", "model_name": stack.model, "status_code": "200"},
    )
    assert served and served[0].value >= 1, "no gateway requests counted"
    dashboard = (REPO / "deploy" / "grafana" / "dashboards" / "kvfleet.json").read_text()
    used = set(re.findall(r"kvfleet:[a-z0-9_]+", dashboard))
    assert used, "the dashboard names no kvfleet metric"
    # {family: type}; a counter's family without _total, whatever its TYPE line said (by client version)
    types = {name: kind for name, kind in family_types(scraped).items() if name.startswith("kvfleet:")}
    # what each sample suffix promises: _total a counter, _bucket/_sum/_count a histogram
    wrong = {}
    for m in used:
        suffix = re.search(r"_(bucket|total|sum|count)$", m)
        family = m[: suffix.start()] if suffix else m
        want = {"total": "counter", None: "gauge"}.get(suffix and suffix[1], "histogram")
        if types.get(family) != want:
            wrong[m] = types.get(family, "not served")
    assert not wrong, f"dashboard metrics no service serves as the dashboard reads them: {wrong}"
    # one meaning per name: the scheduler's budget and a worker's blocks are named apart
    assert "kvfleet:kv_cache_usage_perc" not in types


def test_telemetry_writes_need_the_stacks_token(stack: Stack) -> None:
    """The published telemetry port takes spans only with the write token that worker-secret made
    for this volume (the services send it); reads stay open."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    res = stack.container("telemetry").exec_run(["cat", "/run/kvfleet-telemetry/telemetry-token"])
    token = res.output.decode().strip()
    assert res.exit_code == 0 and len(token) >= 32, res.output
    export = trace_service_pb2.ExportTraceServiceRequest()
    with grpc.insecure_channel(stack.telemetry_address) as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        for md in ((), (("authorization", "Bearer not-the-token"),)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Export(export, timeout=10, metadata=md)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
        stub.Export(export, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
    assert isinstance(_timings(stack), dict)  # reads need nothing
    # the gateway never sees the worker secret
    res = stack.container("gateway").exec_run(["sh", "-c", "ls /run/kvfleet 2>&1; ls /run/kvfleet-telemetry"])
    assert b"worker-secret" not in res.output and b"telemetry-token" in res.output, res.output


def test_telemetry_stored_spans_from_scheduler_and_workers(stack: Stack) -> None:
    # One lone session: its tick serves a single trace, so the workers' spans join its trace.
    _generate(stack, [5, 6, 7, 8], 4, ignore_eos=True)
    session = f"text_completion {stack.model}"  # the session span is named `{operation} {model}`
    counts = _wait_for(
        lambda: (t := _timings(stack)).get(session) and t.get("worker_step") and t,
        30,
        "session and worker_step spans in GetTimings",
    )
    assert counts[session] >= 1 and counts["tick"] >= 1 and counts["worker_step"] >= 1, counts

    # every service exports in its own batches (OTEL_BSP_SCHEDULE_DELAY=1 s): wait for all three
    expected = {"kvfleet-scheduler", "kvfleet-worker", "kvfleet-gateway"}

    def services() -> set[str]:
        return {row[0] for row in _span_rows(stack, "SELECT DISTINCT service FROM spans")}

    try:
        _wait_for(lambda: expected <= services(), 30, f"spans from {sorted(expected)}")
    except AssertionError:
        pytest.fail(f"spans stored from {sorted(services())}, expected {sorted(expected)}")

    # Trace context crossed the container boundary: a worker span shares a trace with a session.
    def joined() -> int:
        return _span_rows(
            stack,
            "SELECT COUNT(DISTINCT w.trace_id) FROM spans w JOIN spans s ON w.trace_id = "
            "s.trace_id WHERE w.name = 'worker_step' AND s.service = 'kvfleet-scheduler' "
            'AND s.attributes LIKE \'%"kvfleet.span": "session"%\'',
        )[0][0]

    _wait_for(lambda: joined() >= 1, 30, "a worker_step span in the trace of a session")


def test_telemetry_serves_the_schedulers_live_snapshot(stack: Stack) -> None:
    """The trace UI's Scheduler page: telemetry asks the scheduler (KVFLEET_TELEMETRY_SCHEDULER)
    for its telemetry and workers, through the published trace API port."""
    url = f"http://127.0.0.1:{stack.trace_api_port}/api/scheduler"
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        data = json.load(resp)["data"]
    assert data["scheduler"] == "scheduler:50051", data
    assert {w["worker_id"]: w["live"] for w in data["workers"]} == {"worker-0": True, "worker-1": True}, data
    assert data["telemetry"], data


def test_stopped_worker_is_reported_and_sessions_finish_on_the_other(stack: Stack) -> None:
    n, new_tokens = 6, 48
    victim = "worker-1"
    stopped = threading.Event()
    results: list[Completion] = []

    def stop_victim_once_running() -> None:
        # Wait until sessions are placed on both workers, so the victim holds KV when it goes.
        def placed_on_victim() -> bool:
            with SchedulerClient(stack.scheduler_address) as client:
                return any(w.worker_id == victim and w.sessions > 0 for w in client.list_workers())

        _wait_for(placed_on_victim, 60, f"a session on {victim}")
        stack.container(victim).stop(timeout=20)
        stopped.set()

    with ThreadPoolExecutor(n + 1) as pool:
        stopper = pool.submit(stop_victim_once_running)
        futures = [pool.submit(_generate, stack, [9, 10, 11, 12 + i], new_tokens, ignore_eos=True) for i in range(n)]
        results = [f.result() for f in futures]
        stopper.result()
    assert stopped.is_set()

    # Every session still completed in full, the moved ones on the surviving worker.
    for c in results:
        assert len(c.token_ids) == new_tokens and c.finish_reason == "length", c
    assert {c.worker_id for c in results} == {"worker-0"}, [c.worker_id for c in results]
    # The scheduler marked the stopped worker dead after its failed step.
    assert _workers(stack) == {"worker-0": True, "worker-1": False}
    assert stack.container(victim).status == "exited"
    assert f"worker {victim} failed its step" in stack.container("scheduler").logs().decode()

    # New sessions keep working with one worker ...
    assert len(_generate(stack, [1, 2, 3], 6, ignore_eos=True).token_ids) == 6
    # ... and the restarted worker is probed back into service.
    stack.container(victim).start()
    stack.wait_healthy((victim,))
    # The scheduler re-probes a dead worker every second, but through its gRPC channel, whose
    # reconnect backoff grows while the worker is away (gRPC's default cap is 120 s).
    _wait_for(lambda: _workers(stack) == {"worker-0": True, "worker-1": True}, 150, f"{victim} live again")

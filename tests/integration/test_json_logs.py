"""A real scheduler started with --log-format json and a --config file: its log is JSON lines, and
those written while it handles a traced request carry the caller's trace id and the session id."""

import json
import secrets

import grpc

from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc


def test_scheduler_json_logs_carry_trace_and_session(tmp_path):
    config = tmp_path / "scheduler.toml"
    # The session lines are DEBUG: only the file turns them on, so they prove it was read.
    config.write_text('log-level = "DEBUG"\nmax-queue-depth = 17\n')
    spec = ClusterSpec(workers=1, telemetry=False, log_format="json", scheduler_args=("--config", str(config)))
    trace_id, parent_span = secrets.token_hex(16), secrets.token_hex(8)
    with LocalCluster(spec, log_dir=tmp_path) as cluster:
        with grpc.insecure_channel(cluster.scheduler_address) as ch:
            req = spb.GenerateRequest(prompt_ids=spb.TokenIds(ids=[1, 2, 3]), max_new_tokens=3)
            events = list(
                spb_grpc.SchedulerStub(ch).Generate(
                    req, metadata=[("traceparent", f"00-{trace_id}-{parent_span}-01")], timeout=60
                )
            )
    session_id = events[0].session_id
    lines = (tmp_path / "scheduler.log").read_text().splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]  # every line is JSON
    assert any(d["message"].startswith("scheduler serving on") for d in docs)
    traced = [d for d in docs if d.get("trace_id") == trace_id]
    assert traced, f"no line with trace id {trace_id}: {lines[-10:]}"
    assert {d["span_id"] for d in traced} == {parent_span}  # the calling span (README, "Logs")
    mine = [d for d in traced if d.get("session_id") == session_id]
    assert any(d["level"] == "DEBUG" and "prompt tokens" in d["message"] for d in mine), traced
    assert any(d.get("session_id") == session_id and "queued" in d["message"] for d in docs)
    # Lines outside any request carry no trace.
    assert "trace_id" not in next(d for d in docs if d["message"].startswith("scheduler serving on"))

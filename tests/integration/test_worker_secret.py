"""The workers of a plain `kvfleet up` (no TLS) obey only their scheduler: a second local client
that dials a worker port directly - even one that knows the live session ids - gets
UNAUTHENTICATED on every Worker RPC and learns nothing, while the streams running meanwhile
finish token-exact."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.client import NO_RETRY, SchedulerClient, build_request
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_common.security import WORKER_SECRET_HEADER
from tests.helpers.up import Up


def _probe(address: str, session_ids: list[str], metadata: tuple = ()) -> list[grpc.RpcError]:
    """Every Worker RPC an intruder would try, each with the session ids it could have learnt."""
    with grpc.insecure_channel(address) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        decode = [wpb.DecodeItem(session_id=s, token_id=1, position=3) for s in session_ids]
        calls = [
            lambda: stub.GetInfo(wpb.GetInfoRequest(), timeout=10, metadata=metadata),
            lambda: stub.GetStats(wpb.GetStatsRequest(), timeout=10, metadata=metadata),
            lambda: stub.Step(wpb.StepRequest(release_session_ids=session_ids), timeout=10, metadata=metadata),
            lambda: stub.Step(wpb.StepRequest(decode=decode), timeout=10, metadata=metadata),
            lambda: list(stub.StepStream(iter([wpb.StepRequest(decode=decode)]), timeout=10, metadata=metadata)),
        ]
        errors = []
        for call in calls:
            try:
                call()
            except grpc.RpcError as exc:
                errors.append(exc)
            else:
                raise AssertionError("a Worker RPC without the scheduler's secret was answered")
        return errors


def test_workers_of_kvfleet_up_answer_only_their_scheduler(tmp_path: Path) -> None:
    from kvfleet_models.config import tiny_config
    from kvfleet_models.reference import reference_generate
    from kvfleet_models.tiny import tiny_weights

    cfg = tiny_config()
    weights = tiny_weights(cfg, seed=0)
    prompts = [[i, i + 1, (i * 5) % 48] for i in range(6)]
    new_tokens = 160
    solo = [reference_generate(cfg, weights, p, new_tokens) for p in prompts]
    up = Up(["--model", "tiny", "--workers", "2"], tmp_path / "up.err", start_timeout_s=60)
    try:
        # The secret travels in the children's environment only, never on a command line.
        for name, pid in up.pids.items():
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            assert "secret" not in cmdline.lower(), (name, cmdline)
        with SchedulerClient(up.scheduler, retry=NO_RETRY) as client:
            workers = {w.worker_id: w.address for w in client.list_workers()}
            assert len(workers) == 2
            streams = [client.stream(build_request(p, new_tokens, ignore_eos=True)) for p in prompts]
            firsts = [next(s) for s in streams]
            ids = [f.session_id for f in firsts]
            for address in workers.values():
                for metadata in ((), ((WORKER_SECRET_HEADER, "a-guess-of-sixteen-chars-or-more"),)):
                    for exc in _probe(address, ids, metadata):
                        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
                        details = exc.details() or ""
                        assert WORKER_SECRET_HEADER in details, details  # says what to fix ...
                        assert not any(i in details for i in ids), details  # ... and nothing else
                with grpc.insecure_channel(address) as ch:  # health stays open: probes need no secret
                    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                    assert health.status == health_pb2.HealthCheckResponse.SERVING
            got = [list(f.token_ids) + [t for ev in s for t in ev.token_ids] for f, s in zip(firsts, streams)]
            for p, tokens, expected in zip(prompts, got, solo):
                assert tokens == expected, p
            # The workers are healthy and serving still: new sessions finish.
            again = client.generate(build_request(prompts[0], 8, ignore_eos=True))
            assert list(again.token_ids) == solo[0][:8]
    finally:
        code = up.stop()
    assert code == 0, up.stderr()

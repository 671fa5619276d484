"""Bad input across the client API, the worker API and the OTLP receiver: each gets a precise
status and a message that says what to fix, and afterwards every service is healthy and answers
a normal request correctly."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from kvfleet.client import build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from kvfleet.v1 import telemetry_pb2 as tpb
from kvfleet.v1 import telemetry_pb2_grpc as tpb_grpc
from kvfleet.v1 import worker_pb2 as wpb
from kvfleet.v1 import worker_pb2_grpc as wpb_grpc
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights

C = grpc.StatusCode


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # scheduler | worker | telemetry
    call: Callable  # (stub) -> response
    code: grpc.StatusCode | None  # None: the call succeeds; `check` inspects the response
    says: str = ""  # the message names what to fix
    check: Callable | None = None


def _gen(req):
    return lambda stub: list(stub.Generate(req, timeout=10))


def _workload(**kw):
    return lambda stub: list(stub.SubmitWorkload(spb.WorkloadRequest(**kw), timeout=10))


def _step(**kw):
    return lambda stub: stub.Step(wpb.StepRequest(**kw), timeout=10)


def _span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, start=1_000, end=2_000, attrs=()):
    return trace_pb2.Span(
        trace_id=trace_id,
        span_id=span_id,
        name="x",
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        attributes=[common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v)) for k, v in attrs],
    )


def _export(*spans):
    req = otlp.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=list(spans))])]
    )
    return lambda stub: stub.Export(req, timeout=10)


def _rejected(n):
    return lambda resp: resp.partial_success.rejected_spans == n and resp.partial_success.error_message


def _item_rejected(says: str) -> Callable:
    """The step ran; its one item was refused alone, with a message naming what to fix."""

    def check(resp) -> bool:
        (r,) = resp.results
        return r.status == wpb.ITEM_REJECTED and says in r.error and not r.has_token and r.kv_tokens == 0

    return check


def _item_failed(says: str) -> Callable:
    """The step ran; its one item failed alone (its blocks cannot hold it), saying why."""

    def check(resp) -> bool:
        (r,) = resp.results
        return r.status == wpb.ITEM_FAILED and says in r.error and not r.has_token and r.kv_tokens == 0

    return check


def _miss(resp):
    return resp.results[0].status == wpb.ITEM_CACHE_MISS


SAMPLING_OK = spb.SamplingParams()
CASES = [
    # ---- the client API -------------------------------------------------------------------
    Case("empty prompt", "scheduler", _gen(build_request([], 4)), C.INVALID_ARGUMENT, "prompt is empty"),
    Case("no prompt at all", "scheduler", _gen(spb.GenerateRequest(max_new_tokens=4)), C.INVALID_ARGUMENT, "no prompt"),
    Case(
        "prompt longer than the context",
        "scheduler",
        _gen(build_request([1] * 600, 4)),
        C.INVALID_ARGUMENT,
        "shorten the prompt",
    ),
    Case(
        "prompt + max_new_tokens beyond context",
        "scheduler",
        _gen(build_request([1] * 400, 200)),
        C.INVALID_ARGUMENT,
        "context",
    ),
    Case("max_new_tokens 0", "scheduler", _gen(build_request([1], 0)), C.INVALID_ARGUMENT, "max_new_tokens"),
    Case("max_new_tokens huge", "scheduler", _gen(build_request([1], 4_000_000)), C.INVALID_ARGUMENT, "max_new_tokens"),
    Case("token id out of vocab", "scheduler", _gen(build_request([1, 48], 4)), C.INVALID_ARGUMENT, "vocabulary"),
    Case(
        "temperature < 0", "scheduler", _gen(build_request([1], 4, temperature=-0.5)), C.INVALID_ARGUMENT, "temperature"
    ),
    Case(
        "temperature NaN",
        "scheduler",
        _gen(build_request([1], 4, temperature=float("nan"))),
        C.INVALID_ARGUMENT,
        "temperature",
    ),
    Case("top_p > 1", "scheduler", _gen(build_request([1], 4, top_p=1.5)), C.INVALID_ARGUMENT, "top_p"),
    Case("top_p < 0", "scheduler", _gen(build_request([1], 4, top_p=-0.1)), C.INVALID_ARGUMENT, "top_p"),
    Case(
        "text prompt to a token-id model",
        "scheduler",
        _gen(build_request("hello", 4)),
        C.INVALID_ARGUMENT,
        "prompt_ids",
    ),
    Case(
        "stop strings on a token-id model",
        "scheduler",
        _gen(build_request([1], 4, stop=["x"])),
        C.INVALID_ARGUMENT,
        "stop",
    ),
    Case("KV budget can never fit", "scheduler", _gen(build_request([1] * 10, 400)), C.RESOURCE_EXHAUSTED, "kv_budget"),
    Case("empty workload", "scheduler", _workload(), C.INVALID_ARGUMENT, "at least one session"),
    Case(
        "workload concurrency above the limit",
        "scheduler",
        _workload(sessions=[build_request([1], 2)], policy=spb.WorkloadPolicy(max_running=10_000)),
        C.INVALID_ARGUMENT,
        "max_running",
    ),
    Case(
        "workload with one bad session",
        "scheduler",
        _workload(sessions=[build_request([1], 2), build_request([], 2)]),
        C.INVALID_ARGUMENT,
        "session 1",
    ),
    Case(
        "experiment with an unknown lever",
        "scheduler",
        _workload(sessions=[build_request([1], 2)], experiment=spb.Experiment(id="e", arm="control", lever="warp")),
        C.INVALID_ARGUMENT,
        "lever",
    ),
    Case(
        "experiment with an unknown arm",
        "scheduler",
        _workload(
            sessions=[build_request([1], 2)],
            experiment=spb.Experiment(id="e", arm="treatment", lever="persistent_kv_views"),
        ),
        C.INVALID_ARGUMENT,
        "control or candidate",
    ),
    Case(
        "cancel an unknown session",
        "scheduler",
        lambda s: s.Cancel(spb.CancelRequest(session_id="s-404"), timeout=5),
        C.NOT_FOUND,
        "s-404",
    ),
    Case(
        "cancel with no session id",
        "scheduler",
        lambda s: s.Cancel(spb.CancelRequest(), timeout=5),
        C.INVALID_ARGUMENT,
        "session_id",
    ),
    Case(
        "telemetry of an unknown workload",
        "scheduler",
        lambda s: s.GetTelemetry(spb.TelemetryRequest(workload_id="w-404", at_tick=3), timeout=5),
        C.NOT_FOUND,
        "w-404",
    ),
    Case(
        "telemetry with a workload but no tick",
        "scheduler",
        lambda s: s.GetTelemetry(spb.TelemetryRequest(workload_id="w0"), timeout=5),
        C.INVALID_ARGUMENT,
        "at_tick",
    ),
    Case(
        "oversize message",
        "scheduler",
        _gen(build_request("x" * (17 * 1024 * 1024), 1)),  # a 17 MiB text: no 17M-id list built at import
        C.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    # ---- the worker API -------------------------------------------------------------------
    Case(
        "step names a session twice",
        "worker",
        _step(decode=[wpb.DecodeItem(session_id="a", token_id=1), wpb.DecodeItem(session_id="a", token_id=1)]),
        C.INVALID_ARGUMENT,
        "twice",
    ),
    Case(
        "step item without a session id",
        "worker",
        _step(decode=[wpb.DecodeItem(token_id=1)]),
        C.INVALID_ARGUMENT,
        "session_id",
    ),
    Case(
        "sampling outside the rules (a temperature of -1)",
        "worker",
        _step(
            prefill=[
                wpb.PrefillItem(
                    session_id="t", token_ids=[1, 2], last_chunk=True, sampling=wpb.Sampling(temperature=-1.0)
                )
            ]
        ),
        None,
        check=_item_rejected("temperature must be in"),
    ),
    Case(
        "prefill token out of vocab",
        "worker",
        _step(prefill=[wpb.PrefillItem(session_id="b", token_ids=[999], last_chunk=True)]),
        None,
        check=_item_rejected("vocab"),
    ),
    Case(
        "empty prefill chunk",
        "worker",
        _step(prefill=[wpb.PrefillItem(session_id="c", last_chunk=True)]),
        None,
        check=_item_rejected("empty"),
    ),
    Case(
        "position beyond the model's context",
        "worker",
        _step(decode=[wpb.DecodeItem(session_id="d", token_id=1, position=100_000)]),
        None,
        check=_item_rejected("max_position"),
    ),
    Case(
        "unknown kv_views mode",
        "worker",
        _step(prefill=[wpb.PrefillItem(session_id="e", token_ids=[1], last_chunk=True)], kv_views="sideways"),
        C.INVALID_ARGUMENT,
        "kv_views",
    ),
    Case(
        "decode of a session the worker does not hold",
        "worker",
        _step(decode=[wpb.DecodeItem(session_id="ghost", token_id=1, position=5)]),
        None,
        check=_miss,
    ),
    Case(
        "block ids outside the worker's cache",
        "worker",
        _step(prefill=[wpb.PrefillItem(session_id="f", token_ids=[1, 2], last_chunk=True, block_ids=[10**6])]),
        None,
        check=_item_failed("outside the cache"),
    ),
    Case(
        "too few blocks for the chunk",
        "worker",
        _step(prefill=[wpb.PrefillItem(session_id="g", token_ids=[1] * 17, last_chunk=True, block_ids=[0])]),
        None,
        check=_item_failed("cannot hold 17 tokens"),
    ),
    Case(
        "a step for another instance of the worker (it restarted)",
        "worker",
        _step(
            prefill=[wpb.PrefillItem(session_id="h", token_ids=[1], last_chunk=True, block_ids=[0])], instance_id="x"
        ),
        C.FAILED_PRECONDITION,
        "this worker restarted",
    ),
    # ---- the OTLP receiver and telemetry API ----------------------------------------------
    Case("span without ids", "telemetry", _export(_span(trace_id=b"", span_id=b"")), None, check=_rejected(1)),
    Case("span ending before it starts", "telemetry", _export(_span(start=5_000, end=1_000)), None, check=_rejected(1)),
    Case(
        "span with an unknown arm",
        "telemetry",
        _export(_span(attrs=[("experiment.id", "e1"), ("experiment.arm", "treatment")])),
        None,
        check=_rejected(1),
    ),
    Case(
        "summary of an unknown experiment",
        "telemetry",
        lambda s: tpb_grpc.TelemetryStub(s._channel).GetSummary(tpb.SummaryRequest(experiment_id="nope"), timeout=5),
        C.NOT_FOUND,
        "nope",
    ),
    Case(
        "malformed gate spec",
        "telemetry",
        lambda s: tpb_grpc.TelemetryStub(s._channel).GetSummary(
            tpb.SummaryRequest(experiment_id="nope", gate_spec_json="{not json"), timeout=5
        ),
        C.INVALID_ARGUMENT,
        "gate spec is not JSON",
    ),
]


class _OtlpStub(otlp_grpc.TraceServiceStub):
    def __init__(self, channel):
        super().__init__(channel)
        self._channel = channel


@pytest.fixture(scope="module")
def services():
    # A KV budget of 160 tokens, so "can never fit" is reachable on the tiny model.
    spec = ClusterSpec(workers=1, model="tiny", scheduler_args=("--kv-budget-bytes", str(160 * 1536)))
    with LocalCluster(spec) as cluster:
        addresses = {
            "scheduler": cluster.scheduler_address,
            "worker": cluster.worker_addresses[0],
            "telemetry": cluster.telemetry_address,
        }
        channels = {k: grpc.insecure_channel(a) for k, a in addresses.items()}
        stubs = {
            "scheduler": spb_grpc.SchedulerStub(channels["scheduler"]),
            "worker": wpb_grpc.WorkerStub(channels["worker"]),
            "telemetry": _OtlpStub(channels["telemetry"]),
        }
        yield addresses, stubs
        for ch in channels.values():
            ch.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_a_precise_status(services, case: Case):
    _, stubs = services
    if case.code is None:
        assert case.check(case.call(stubs[case.target])), case.name
        return
    assert case.says, f"{case.name}: name the words its error message must contain"
    with pytest.raises(grpc.RpcError) as info:
        case.call(stubs[case.target])
    assert info.value.code() == case.code, info.value.details()
    assert case.says in (info.value.details() or ""), info.value.details()


@pytest.mark.parametrize("target", ["scheduler", "worker", "telemetry"])
def test_non_grpc_bytes_on_each_port_leave_it_serving(services, target):
    addresses, _ = services
    host, port = addresses[target].rsplit(":", 1)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x00\xff" * 512):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(junk)
            try:
                sock.recv(1024)
            except OSError:
                pass
    with grpc.insecure_channel(addresses[target]) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_after_all_of_it_a_normal_request_is_answered_correctly(services):
    addresses, stubs = services
    for case in CASES:  # run the whole table again, in one go, then ask for real work
        try:
            case.call(stubs[case.target])
        except grpc.RpcError:
            pass
    cfg = tiny_config()
    events = list(stubs["scheduler"].Generate(build_request([3, 1, 4, 1, 5], 10), timeout=30))
    tokens = [t for ev in events for t in ev.token_ids]
    assert tokens == reference_generate(cfg, tiny_weights(cfg), [3, 1, 4, 1, 5], 10)
    for address in addresses.values():
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING

"""Hypothesis-driven fuzzing of the request messages against a live scheduler: every request is
either served or refused with a client-error status; never INTERNAL/UNKNOWN, never a hang; and
afterwards a fixed greedy request returns exactly the tokens it returned before the fuzz.
(tests/integration/test_gateway_fuzz.py does the same for the gateway's JSON bodies.)"""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc

U32 = st.integers(min_value=0, max_value=2**32 - 1)
SMALL_IDS = st.integers(min_value=0, max_value=60)  # vocab is 48: some are out of range
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)

sampling = st.builds(
    spb.SamplingParams,
    temperature=FLOATS,
    top_k=st.one_of(st.just(0), U32),
    top_p=FLOATS,
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    logit_bias=st.dictionaries(st.one_of(SMALL_IDS, U32), FLOATS, max_size=3),
)
prompt_kwargs = st.one_of(
    st.builds(lambda ids: {"prompt_ids": spb.TokenIds(ids=ids)}, st.lists(st.one_of(SMALL_IDS, U32), max_size=40)),
    st.builds(lambda t: {"text": t}, st.text(max_size=30)),
    st.builds(
        lambda msgs: {"chat": spb.ChatMessages(messages=msgs)},
        st.lists(
            st.builds(
                spb.ChatMessage, role=st.sampled_from(["user", "system", "bot", ""]), content=st.text(max_size=10)
            ),
            max_size=3,
        ),
    ),
    st.just({}),
)
requests = st.builds(
    lambda prompt, n, s, stops, strs, eos, prio, extra: spb.GenerateRequest(
        **prompt,
        max_new_tokens=n,
        sampling=s,
        stop_token_ids=stops,
        stop=strs,
        ignore_eos=eos,
        priority=prio,
        **extra,
    ),
    prompt_kwargs,
    st.one_of(st.integers(min_value=0, max_value=6), U32),
    sampling,
    st.lists(U32, max_size=3),
    st.lists(st.text(max_size=5), max_size=2),
    st.booleans(),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.fixed_dictionaries(
        {},
        optional={
            "n": st.one_of(st.integers(min_value=0, max_value=3), U32),
            "logprobs": st.booleans(),
            "top_logprobs": st.one_of(st.integers(min_value=0, max_value=3), U32),
            "echo": st.booleans(),
            "request_id": st.text(max_size=8),
            "tools_json": st.sampled_from(["", "[]", "[1]", "{", "[" * 2000]),
            "response_format": st.builds(
                spb.ResponseFormat,
                type=st.sampled_from(["", "text", "json_object", "json_schema", "xml"]),
                json_schema=st.sampled_from(["", "{}", '{"type": "integer"}', "[" * 2000, "nope"]),
            ),
        },
    ),
)

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def _greedy_tokens(address: str) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        events = list(spb_grpc.SchedulerStub(ch).Generate(build_request([5, 6, 7], 24, ignore_eos=True), timeout=30))
    return [t for ev in events for t in ev.token_ids]


def test_fuzzed_requests_are_served_or_refused_cleanly(cluster):
    before = _greedy_tokens(cluster.address)
    assert len(before) == 24

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=requests)
    def fuzz(request):
        with grpc.insecure_channel(cluster.address) as ch:
            stub = spb_grpc.SchedulerStub(ch)
            try:
                events = list(stub.Generate(request, timeout=30))
            except grpc.RpcError as exc:
                assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
                assert exc.details()
                return
            assert events and events[-1].finished
            n = max(request.n, 1)
            assert sum(len(e.token_ids) for e in events) <= request.max_new_tokens * n

    fuzz()
    assert _greedy_tokens(cluster.address) == before  # still serving, and token-exact


def test_scheduler_is_healthy_after_fuzzing(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        snap = spb_grpc.SchedulerStub(ch).GetTelemetry(spb.TelemetryRequest(), timeout=5)
    assert snap.active_sessions == 0 and snap.queue_depth == 0

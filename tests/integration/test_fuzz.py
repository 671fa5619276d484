"""Hypothesis-driven fuzzing of the request messages against a live scheduler: every request is
either served or refused with a client-error status; never INTERNAL/UNKNOWN, never a hang."""

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    lambda prompt, n, s, stops, strs, eos, prio: spb.GenerateRequest(
        **prompt, max_new_tokens=n, sampling=s, stop_token_ids=stops, stop=strs, ignore_eos=eos, priority=prio
    ),
    prompt_kwargs,
    st.one_of(st.integers(min_value=0, max_value=6), U32),
    sampling,
    st.lists(U32, max_size=3),
    st.lists(st.text(max_size=5), max_size=2),
    st.booleans(),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
)

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=requests)
def test_fuzzed_requests_are_served_or_refused_cleanly(cluster, request):
    with grpc.insecure_channel(cluster.address) as ch:
        stub = spb_grpc.SchedulerStub(ch)
        try:
            events = list(stub.Generate(request, timeout=30))
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
            assert exc.details()
            return
        assert events and events[-1].finished
        assert sum(len(e.token_ids) for e in events) <= request.max_new_tokens


def test_scheduler_is_healthy_after_fuzzing(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        snap = spb_grpc.SchedulerStub(ch).GetTelemetry(spb.TelemetryRequest(), timeout=5)
    assert snap.active_sessions == 0 and snap.queue_depth == 0

"""The client library rides out a scheduler crash: a real scheduler process SIGKILLed and started
again on its address; greedy sessions cut mid-stream resume token-exact, unsent ones are re-sent."""

import threading
import time

import grpc
import pytest

from kvfleet.client import ResumeMismatch, SchedulerClient, _Splice, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_generate
from kvfleet_models.tiny import tiny_weights

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def local():
    with LocalCluster(ClusterSpec(workers=1, model="tiny", telemetry=False)) as cluster:
        yield cluster


def _crash_scheduler(cluster: LocalCluster, restart_after_s: float) -> threading.Thread:
    """SIGKILL the scheduler now; start it again on its address after a while (in a thread)."""
    proc = cluster.procs["scheduler"]
    proc.kill()
    proc.wait()

    def restart():
        time.sleep(restart_after_s)
        cluster.respawn("scheduler")
        cluster._wait_healthy([cluster.scheduler_address])

    t = threading.Thread(target=restart)
    t.start()
    return t


def test_a_greedy_session_cut_mid_stream_resumes_token_exact(local):
    prompt, n = [1, 2, 3], 400
    with SchedulerClient(local.scheduler_address) as client:
        events = client.events(build_request(prompt, n))
        first = next(events)
        restarter = _crash_scheduler(local, 1.0)
        rest = list(events)
        restarter.join(60)
    tokens = list(first.token_ids) + [t for ev in rest for t in ev.token_ids]
    assert client.retries >= 1, "the session finished before the crash; nothing was tested"
    assert tokens == reference_generate(CFG, WEIGHTS, prompt, n)
    assert list(first.prompt_token_ids) == prompt
    assert all(not ev.prompt_token_ids for ev in rest)  # given once, not again on resume
    assert rest[-1].finished and rest[-1].usage.output_tokens == n


def test_a_session_sent_while_the_scheduler_is_down_is_served_once_it_is_back(local):
    with SchedulerClient(local.scheduler_address) as client:
        client.generate(build_request([5], 2))  # connected before the crash
        restarter = _crash_scheduler(local, 1.5)
        result = client.generate(build_request([4, 5, 6], 12), timeout=60)
        restarter.join(60)
    assert client.retries >= 1
    assert result.token_ids == reference_generate(CFG, WEIGHTS, [4, 5, 6], 12)


def test_an_unseeded_sampled_session_cut_mid_stream_is_not_spliced(local):
    # temperature > 0 without a seed: a re-sent session is not a continuation, so the error stays.
    req = build_request([7, 8], 400, temperature=0.9)
    with SchedulerClient(local.scheduler_address) as client:
        events = client.events(req)
        next(events)
        restarter = _crash_scheduler(local, 0.5)
        with pytest.raises(grpc.RpcError) as info:
            list(events)
        restarter.join(60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert client.retries == 0


def test_a_resumed_session_that_diverges_is_an_error_not_a_splice():
    splice = _Splice([10, 11, 12], text_len=0)
    assert splice.trim(spb.GenerateEvent(token_ids=[10, 11])) is None  # all already delivered
    assert list(splice.trim(spb.GenerateEvent(token_ids=[12, 13])).token_ids) == [13]
    with pytest.raises(ResumeMismatch):
        _Splice([10, 11, 12], text_len=0).trim(spb.GenerateEvent(token_ids=[10, 99]))
    with pytest.raises(ResumeMismatch):  # finished before reproducing what was delivered
        _Splice([10, 11, 12], text_len=0).trim(spb.GenerateEvent(token_ids=[10], finished=True))

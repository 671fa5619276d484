"""n choices, echo and tool refusal through the scheduler's real gRPC API (in-process clusters)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models.registry import SMOLLM2_135M
from kvfleet_models.tokenizer import Tokenizer
from scheduler_svc.core import SchedulerLimits
from tests.integration.inproc import InProcessCluster

QUEUE = 8  # the tiny cluster's queue depth, so that an n above it cannot be admitted


@pytest.fixture(scope="module")
def tiny():
    limits = dataclasses.replace(SchedulerLimits(), max_queue_depth=QUEUE)
    with InProcessCluster(workers=2, limits=limits) as c, SchedulerClient(c.address) as client:
        yield client


@pytest.fixture(scope="module")
def smol(smollm2_cluster):
    with SchedulerClient(smollm2_cluster.address) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


def _by_index(events: list[spb.GenerateEvent]) -> dict[int, list[spb.GenerateEvent]]:
    out: dict[int, list[spb.GenerateEvent]] = {}
    for ev in events:
        out.setdefault(ev.index, []).append(ev)
    return out


# ---- n -----------------------------------------------------------------------------------------


def test_n_choices_are_the_seeds_seed_plus_index(tiny):
    prompt, seed = [4, 8, 15, 16], 1234
    req = build_request(prompt, 10, temperature=1.0, seed=seed, n=3, request_id="n3")
    events = list(tiny.stream(req))
    choices = _by_index(events)
    assert sorted(choices) == [0, 1, 2]
    assert all(ev.request_id == "n3" for ev in events)
    for i, evs in choices.items():
        assert [ev.finished for ev in evs].count(True) == 1 and evs[-1].finished, f"choice {i}: one final event"
        assert evs[-1].usage.output_tokens == 10
        assert list(evs[0].prompt_token_ids) == prompt
        assert len({ev.session_id for ev in evs}) == 1
        alone = tiny.generate(build_request(prompt, 10, temperature=1.0, seed=seed + i))
        assert [t for ev in evs for t in ev.token_ids] == alone.token_ids, f"choice {i} is seed {seed + i}"
    assert len({evs[0].session_id for evs in choices.values()}) == 3
    tokens = [tuple(c.token_ids) for c in tiny.choices(req)]
    assert len(set(tokens)) > 1, "different seeds drew different samples"


def test_greedy_n_gives_identical_choices(tiny):
    got = tiny.choices(build_request([1, 2, 3], 8, n=4))
    assert len(got) == 4
    assert all(c.token_ids == got[0].token_ids and c.finish_reason == "length" for c in got)
    assert got[0].token_ids == tiny.generate(build_request([1, 2, 3], 8)).token_ids


def test_n_choices_share_the_prompts_prefill_through_the_prefix_cache(tiny):
    """Two workers, yet the choices go where the first one computed the prompt, and reuse its
    full KV blocks: 40 prompt tokens are two 16-token blocks (the last token is always computed)."""
    prompt = [(7 * i) % 40 + 5 for i in range(40)]
    events = list(tiny.stream(build_request(prompt, 6, temperature=1.0, seed=9, n=3)))
    finals = {ev.index: ev for ev in events if ev.finished}
    workers = {ev.worker_id for ev in events if ev.worker_id}
    assert sorted(finals) == [0, 1, 2] and len(workers) == 1, workers
    assert finals[0].usage.cached_tokens == 0
    assert finals[1].usage.cached_tokens == finals[2].usage.cached_tokens == 32


def test_n_is_admitted_all_or_nothing(tiny):
    before = tiny.telemetry()
    with pytest.raises(grpc.RpcError) as info:
        list(tiny.stream(build_request([1, 2], 4, n=QUEUE + 1)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue_full" in info.value.details()
    after = tiny.telemetry()
    assert after.completed_sessions == before.completed_sessions, "no choice was admitted, so none finished"
    assert after.active_sessions == 0 and after.queue_depth == 0
    assert len(tiny.choices(build_request([1, 2], 4, n=QUEUE))) == QUEUE


def test_cancelling_one_choice_cancels_them_all(tiny):
    req = build_request([7, 7, 7], 400, n=3, ignore_eos=True)
    stream = tiny.stream(req)
    first = next(stream)
    assert tiny.cancel(first.session_id).cancelled
    events = [first, *stream]
    finals = {ev.index: ev.finish_reason for ev in events if ev.finished}
    assert finals == {i: spb.FINISH_CANCELLED for i in range(3)}
    assert sum(len(ev.token_ids) for ev in events) < 3 * 400
    assert tiny.telemetry().active_sessions == 0


def test_n_in_a_workload_is_invalid(tiny):
    wl = spb.WorkloadRequest(sessions=[build_request([1], 2), build_request([1], 2, n=2)])
    with pytest.raises(grpc.RpcError) as info:
        list(tiny.submit_workload(wl))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session 1: n is 2" in info.value.details()


def test_n_above_16_is_invalid(tiny):
    with pytest.raises(grpc.RpcError) as info:
        list(tiny.stream(build_request([1], 2, n=17)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16" in info.value.details()


def test_workload_sessions_echo_their_request_ids(tiny):
    wl = spb.WorkloadRequest(sessions=[build_request([1, 2], 3, request_id=f"w-{i}") for i in range(3)])
    events = [e for e in tiny.submit_workload(wl) if not e.done]
    assert {(e.session_index, e.event.request_id) for e in events} == {(i, f"w-{i}") for i in range(3)}


def test_echo_of_token_ids_on_a_model_without_tokenizer_is_empty(tiny):
    events = list(tiny.stream(build_request([3, 1, 4], 3, echo=True)))
    assert list(events[0].prompt_token_ids) == [3, 1, 4]
    assert all(ev.prompt_text == "" for ev in events)


# ---- echo (SmolLM2) ---------------------------------------------------------------------------


def test_echo_text_prompt_on_the_first_event_of_each_choice(smol):
    text = "Once upon a time"
    events = list(smol.stream(build_request(text, 4, n=2, temperature=0.8, seed=5, echo=True)))
    for i, evs in _by_index(events).items():
        assert evs[0].prompt_text == text, f"choice {i}"
        assert all(ev.prompt_text == "" for ev in evs[1:])
    plain = list(smol.stream(build_request(text, 2)))
    assert all(ev.prompt_text == "" for ev in plain), "no echo unless asked"


def test_echo_chat_is_the_rendered_template(smol, tokenizer):
    chat = [{"role": "user", "content": "Say hi."}]
    got = smol.generate(build_request(chat, 2, echo=True))
    assert got.prompt_text == tokenizer.render_chat(chat)
    assert "<|im_start|>assistant\n" in got.prompt_text


def test_echo_token_ids_is_their_text(smol, tokenizer):
    ids = tokenizer.encode("The sea is blue")
    assert smol.generate(build_request(ids, 2, echo=True)).prompt_text == "The sea is blue"


# ---- tools (SmolLM2's template has none) -------------------------------------------------------


TOOL = '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'
CALLS = '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'


@pytest.mark.parametrize(
    "req",
    [
        build_request([{"role": "user", "content": "hi"}], 2, tools_json=TOOL),
        build_request([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "4"}], 2),
        build_request([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": CALLS}], 2),
    ],
    ids=["tools_json", "tool message", "assistant tool calls"],
)
def test_tools_on_a_template_without_tool_support_are_refused(smol, req):
    plain = build_request([{"role": "user", "content": "hi"}], 1, ignore_eos=True)
    before = smol.generate(plain)
    with pytest.raises(grpc.RpcError) as info:
        list(smol.stream(req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"model '{SMOLLM2_135M}': its chat template has no tool support" in info.value.details()
    # still serving, and the refusal left nothing behind: the same greedy answer as before it
    after = smol.generate(plain)
    assert after.finish_reason == "length" and len(after.token_ids) == 1
    assert (after.token_ids, after.text) == (before.token_ids, before.text)

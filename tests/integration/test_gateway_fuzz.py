"""Hypothesis-driven fuzzing of the gateway's JSON bodies over HTTP, against a real gateway in
front of a tiny-model cluster: every POST route, bodies plausible (OpenAI's fields with values
of the right and wrong types, huge integers, unicode, lone surrogates) and malformed (any JSON
value, nested junk, bytes that are not JSON). Every answer is 2xx, or 4xx with an OpenAI error
body; never a 5xx. Afterwards the gateway and the scheduler still serve, token-exact: a fixed
greedy request answers exactly as before the fuzz."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from tests.helpers.gateway import http

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
HUGE = st.integers(min_value=2**31, max_value=10**40) | st.integers(min_value=-(10**40), max_value=-1)
SMALL = st.integers(min_value=-3, max_value=8)  # max_tokens stays small: the fuzz's budget is time
TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "<|im_start|>system", "\x00", "é" * 5])
SCALAR = st.none() | st.booleans() | SMALL | HUGE | st.floats(allow_nan=True, allow_infinity=True) | TEXT
JUNK = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bot"]) | JUNK},
    optional={
        "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3) | JUNK,
        "tool_call_id": TEXT | JUNK,
        "tool_calls": st.lists(JUNK, max_size=2) | JUNK,
        "name": TEXT,
    },
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function") | JUNK, "function": st.fixed_dictionaries({"name": TEXT}) | JUNK}
)
# OpenAI's fields and kvfleet's, each with values of the right shape and of any other.
FIELDS = {
    "model": st.just("tiny") | TEXT | JUNK,
    "prompt": st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=8) | TEXT | JUNK,
    "messages": st.lists(MESSAGE, max_size=3) | JUNK,
    "max_tokens": SMALL | HUGE | JUNK,
    "max_completion_tokens": SMALL | HUGE | JUNK,
    "temperature": st.floats(min_value=0, max_value=2) | JUNK,
    "top_p": st.floats(min_value=0, max_value=1) | JUNK,
    "top_k": SMALL | HUGE | JUNK,
    "min_p": JUNK,
    "seed": st.integers(min_value=-(2**64), max_value=2**65) | JUNK,
    "n": SMALL | HUGE | JUNK,
    "stop": st.lists(TEXT, max_size=3) | TEXT | JUNK,
    "logit_bias": st.dictionaries(st.integers(min_value=0, max_value=2**33).map(str) | TEXT, JUNK, max_size=3),
    "logprobs": st.booleans() | SMALL | HUGE | JUNK,
    "top_logprobs": SMALL | HUGE | JUNK,
    "echo": st.booleans() | JUNK,
    "stream": st.booleans() | JUNK,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JUNK}) | JUNK,
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"]) | JUNK},
        optional={"json_schema": st.fixed_dictionaries({"name": TEXT, "schema": JUNK}) | JUNK},
    )
    | JUNK,
    "tools": st.lists(TOOL, max_size=3) | JUNK,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JUNK,
    "presence_penalty": JUNK,
    "repetition_penalty": JUNK,
    "ignore_eos": st.booleans() | JUNK,
    "request_id": TEXT | JUNK,
    "best_of": JUNK,
    "user": JUNK,
    "tokens": st.lists(st.integers(min_value=-1, max_value=2**33), max_size=5) | JUNK,
    "add_special_tokens": JUNK,
}
IDS = st.lists(st.integers(min_value=0, max_value=47), min_size=1, max_size=8)  # the tiny model's vocabulary
# Bodies the tiny model serves (or refuses for what it lacks: text, chat, a tokenizer), each
# field at a value in its range: what a mutation below starts from.
SERVED = {
    "max_tokens": st.integers(min_value=1, max_value=8),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=5),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
    "n": st.integers(min_value=1, max_value=3),
    "logit_bias": st.dictionaries(st.integers(0, 47).map(str), st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "request_id": st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=16),
}
GOOD = {
    "/v1/completions": st.fixed_dictionaries(
        {"model": st.just("tiny"), "prompt": IDS},
        optional={**SERVED, "logprobs": st.integers(0, 5), "echo": st.booleans()},
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=2)},
        optional={**SERVED, "logprobs": st.booleans(), "tools": st.lists(TOOL, max_size=2)},
    ),
    "/tokenize": st.fixed_dictionaries({"model": st.just("tiny"), "prompt": TEXT}),
    "/detokenize": st.fixed_dictionaries({"model": st.just("tiny"), "tokens": IDS}),
}


def _mutated(route: str) -> st.SearchStrategy[dict]:
    """A good body with up to three fields set to anything (any known field, or a new one)."""
    names = st.sampled_from(sorted(FIELDS)) | TEXT
    changes = st.dictionaries(names, JUNK | st.sampled_from(list(FIELDS.values())).flatmap(lambda v: v), max_size=3)
    return st.builds(lambda good, bad: {**good, **bad}, GOOD[route], changes)


PLAUSIBLE = st.sampled_from(ROUTES).flatmap(
    lambda route: st.tuples(st.just(route), GOOD[route] | _mutated(route) | _mutated(route))
)
MALFORMED = (
    JUNK.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=40)
    | st.sampled_from([b"", b"{", b"[" * 3000, b'{"model": 1e999999}', b'{"prompt": ' + b"9" * 5000 + b"}"])
)
# (route, body bytes); json.dumps writes NaN, Infinity and \ud800 escapes as they come.
REQUESTS = PLAUSIBLE.map(lambda rb: (rb[0], json.dumps(rb[1]).encode())) | st.tuples(st.sampled_from(ROUTES), MALFORMED)


def _post(url: str, body: bytes) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


def _check_answer(status: int, raw: bytes, content_type: str) -> None:
    assert status < 500, (status, raw[:500])
    if content_type.startswith("text/event-stream"):  # a 200 stream: each event JSON, none a server error
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                assert event.get("error", {}).get("type") != "server_error", event
        return
    answer = json.loads(raw)
    if status >= 400:
        assert isinstance(answer["error"]["message"], str) and answer["error"]["message"], answer


def _reference(cluster, gateway) -> tuple:
    """A fixed greedy request, through the scheduler (token ids) and the gateway (its answer
    with logprobs: the tiny model has no text, so the logprobs and usage stand for the tokens)."""
    with grpc.insecure_channel(cluster.address) as ch:
        events = list(spb_grpc.SchedulerStub(ch).Generate(build_request([5, 6, 7], 24, ignore_eos=True), timeout=30))
    tokens = [t for ev in events for t in ev.token_ids]
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 24, "temperature": 0, "logprobs": 2}
    status, answer, _ = http("POST", gateway.url + "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return tokens, choice["logprobs"]["token_logprobs"], choice["finish_reason"], answer["usage"]


def test_fuzzed_bodies_are_served_or_refused_and_the_service_stays_exact(tiny_gateway) -> None:
    cluster, gateway = tiny_gateway
    before = _reference(cluster, gateway)
    assert len(before[0]) == 24

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=REQUESTS)
    def fuzz(request: tuple[str, bytes]) -> None:
        route, body = request
        _check_answer(*_post(gateway.url + route, body))

    fuzz()
    assert _reference(cluster, gateway) == before
    status, health, _ = http("GET", gateway.url + "/health")
    assert status == 200 and health["status"] == "ok", health

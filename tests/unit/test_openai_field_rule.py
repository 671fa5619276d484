"""The field rule: every field of the openai package's request types for /v1/completions and
/v1/chat/completions is in openai_schema.FIELDS; a refused one is a 400 naming it; an
implemented one reaches the scheduler's GenerateRequest (or, for the few the gateway does
itself, the HTTP answer). The gateway runs for real here (aiohttp on a loopback port) in front
of a fake scheduler that records what it is sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from gateway_svc.app import create_app
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import model_not_found
from gateway_svc.openai_schema import FIELDS, Endpoint, Kind, SchemaError, parse_request
from gateway_svc.upstream import ModelInfo, to_pb
from kvfleet.v1 import scheduler_pb2 as spb

C, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def openai_fields(endpoint: Endpoint) -> set[str]:
    """Every key of the openai package's request TypedDicts (streaming and not) for the endpoint."""
    module = chat_params if endpoint is CHAT else completion_params
    keys: set[str] = set()
    for typed in (module.CompletionCreateParamsStreaming, module.CompletionCreateParamsNonStreaming):
        keys |= typed.__required_keys__ | typed.__optional_keys__
    return keys


def base(endpoint: Endpoint) -> dict[str, Any]:
    if endpoint is C:
        return {"model": "m", "prompt": [1, 2]}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# A value that sets each implemented field, and what the base request needs alongside it.
SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "prompt": ("hello", {}),
    "messages": ([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], {}),
    "max_tokens": (5, {}),
    "max_completion_tokens": (5, {}),
    "temperature": (0.5, {}),
    "top_p": (0.5, {}),
    "seed": (12345, {}),
    "stop": (["."], {}),
    "presence_penalty": (1.5, {}),
    "frequency_penalty": (-1.0, {}),
    "logit_bias": ({"5": -100}, {}),
    "logprobs": (None, {}),  # per endpoint, below
    "top_logprobs": (3, {"logprobs": True}),
    "n": (3, {}),
    "echo": (True, {}),
    "response_format": ({"type": "json_object"}, {}),
    "tools": ([TOOL], {}),
    "tool_choice": ("none", {"tools": [TOOL]}),
    "top_k": (5, {}),
    "min_p": (0.1, {}),
    "repetition_penalty": (1.2, {}),
    "ignore_eos": (True, {}),
    "request_id": ("req-1", {}),
}
# A value that each refused (or default-only) field refuses.
REFUSED_SAMPLES: dict[str, Any] = {
    "best_of": 2,
    "suffix": "and so on",
    "parallel_tool_calls": False,
    "store": True,
    "modalities": ["text", "audio"],
    "service_tier": "flex",
    "prompt_cache_retention": "24h",
    "audio": {"voice": "alloy", "format": "wav"},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"mode": "explicit"},
}
IGNORED_SAMPLES: dict[str, Any] = {
    "user": "u-1",
    "safety_identifier": "s-1",
    "metadata": {"k": "v"},
    "prompt_cache_key": "k",
}


def _fields(kind: Kind) -> list[tuple[Endpoint, str]]:
    return [(e, n) for e in (C, CHAT) for n in sorted(openai_fields(e)) if n in FIELDS and FIELDS[n].kind is kind]


# ---- the table covers the schema -------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [C, CHAT])
def test_every_openai_field_is_classified(endpoint):
    fields = openai_fields(endpoint)
    assert len(fields) > 10, "the openai package's request types were not found"
    missing = sorted(n for n in fields if n not in FIELDS or endpoint not in FIELDS[n].endpoints)
    assert not missing, f"OpenAI fields the gateway's table does not classify for {endpoint.path}: {missing}"
    # and nothing in the table claims an OpenAI field the schema does not have
    ours = {n for n, f in FIELDS.items() if endpoint in f.endpoints and not f.extension}
    extra = ours - fields
    assert extra <= {"response_format"}, extra  # taken on completions too, as vLLM's server does


def test_every_classification_says_why():
    for name, rule in FIELDS.items():
        assert rule.why, name
        if rule.kind is Kind.DEFAULT_ONLY:
            assert rule.accepted, name
        if rule.grpc:
            assert rule.kind is Kind.IMPLEMENTED, name


def test_every_field_has_a_sample_here():
    # A field added to the table (or to the openai package) needs a sample in this test.
    samples = {Kind.IMPLEMENTED: SAMPLES, Kind.IGNORED: IGNORED_SAMPLES}
    for name, rule in FIELDS.items():
        if rule.kind in samples:
            assert name in samples[rule.kind] or not rule.grpc, name
        else:
            assert name in REFUSED_SAMPLES, name


# ---- refused fields: 400 naming them ----------------------------------------------------------


@pytest.mark.parametrize("endpoint, name", _fields(Kind.REFUSED) + _fields(Kind.DEFAULT_ONLY))
def test_refused_fields_are_a_400_naming_them(endpoint, name):
    with pytest.raises(SchemaError) as info:
        parse_request(endpoint, {**base(endpoint), name: REFUSED_SAMPLES[name]})
    assert info.value.param == name and info.value.message.startswith(name)
    assert "not supported" in info.value.message
    # null means "not given": accepted, as OpenAI's API reads it
    parse_request(endpoint, {**base(endpoint), name: None})


@pytest.mark.parametrize("endpoint, name", _fields(Kind.IGNORED))
def test_ignored_fields_are_accepted_and_change_nothing(endpoint, name):
    plain = to_pb(parse_request(endpoint, {**base(endpoint), "seed": 1}))
    assert to_pb(parse_request(endpoint, {**base(endpoint), "seed": 1, name: IGNORED_SAMPLES[name]})) == plain


@pytest.mark.parametrize("endpoint", [C, CHAT])
def test_unknown_fields_are_a_400_naming_them(endpoint):
    with pytest.raises(SchemaError) as info:
        parse_request(endpoint, {**base(endpoint), "frobnicate": 1})
    assert info.value.param == "frobnicate" and "unknown field 'frobnicate'" in info.value.message


# ---- implemented fields reach the GenerateRequest ----------------------------------------------


def _path(pb: spb.GenerateRequest, path: str) -> Any:
    value: Any = pb
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(
    "endpoint, name",
    [(e, n) for e, n in _fields(Kind.IMPLEMENTED) if FIELDS[n].grpc]
    + [(e, n) for n, f in FIELDS.items() if f.extension for e in sorted(f.endpoints, key=lambda e: e.value)],
)
def test_implemented_fields_reach_the_grpc_request(endpoint, name):
    value, extra = SAMPLES[name]
    if name == "logprobs":
        value = 2 if endpoint is C else True
    without = to_pb(parse_request(endpoint, {**base(endpoint), "seed": 1, **extra}))
    given = to_pb(parse_request(endpoint, {**base(endpoint), "seed": 1, **extra, name: value}))
    changed = [p for p in FIELDS[name].grpc if _path(given, p) != _path(without, p)]
    assert changed, f"{name}={value!r} changed none of GenerateRequest.{FIELDS[name].grpc}"


def test_values_arrive_as_sent():
    pb = to_pb(
        parse_request(
            C,
            {
                "model": "m",
                "prompt": "x",
                "seed": 9,
                "logit_bias": {"5": -100, "17": 3},
                "presence_penalty": 0.5,
                "logprobs": 4,
                "n": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
            },
        )
    )
    assert pb.sampling.seed == 9 and dict(pb.sampling.logit_bias) == {5: -100.0, 17: 3.0}
    assert pb.sampling.presence_penalty == pytest.approx(0.5)
    assert (pb.logprobs, pb.top_logprobs, pb.n) == (True, 4, 2)
    assert (pb.response_format.type, json.loads(pb.response_format.json_schema)) == ("json_schema", {"type": "object"})


def test_unseeded_requests_get_a_drawn_seed():
    body = {**base(C), "temperature": 1}
    assert len({to_pb(parse_request(C, body)).sampling.seed for _ in range(4)}) > 1


# ---- over HTTP, through the gateway's app, a fake scheduler behind it ----------------------------


class FakeCall:
    def __init__(self, events: list[spb.GenerateEvent]) -> None:
        self._events = events

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        for ev in self._events:
            yield ev

    def cancel(self) -> bool:
        return False


class FakeUpstream:
    """The scheduler's side as the app uses it: one model, each choice answers "ok" in 2 tokens."""

    def __init__(self) -> None:
        self.requests: list[spb.GenerateRequest] = []
        self.info = ModelInfo("m", 2048)

    async def require_model(self, name, auth, refresh=False):
        if name != self.info.name:
            raise model_not_found(name, [self.info.name])
        return self.info

    async def served_model(self, auth, refresh=False):
        return self.info

    def generate(self, req, metadata, auth, timeout_s):
        pb = to_pb(req)
        self.requests.append(pb)
        events = []
        for i in range(max(pb.n, 1)):
            events.append(spb.GenerateEvent(index=i, token_ids=[7], text="o", prompt_text="P" if pb.echo else ""))
            events.append(
                spb.GenerateEvent(
                    index=i,
                    token_ids=[8],
                    text="k",
                    finished=True,
                    finish_reason=spb.FINISH_LENGTH,
                    usage=spb.Usage(input_tokens=2, output_tokens=2, cached_tokens=1),
                )
            )
        return FakeCall(events)

    async def close(self) -> None:
        pass


async def _post_all(requests: list[tuple[str, dict[str, Any]]]) -> tuple[list[tuple[int, Any]], FakeUpstream]:
    upstream = FakeUpstream()
    app, _ = create_app(GatewayConfig(port=0), upstream)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        out = []
        for path, body in requests:
            resp = await client.post(path, json=body)
            text = await resp.text()
            out.append((resp.status, json.loads(text) if resp.content_type == "application/json" else text))
    return out, upstream


def test_refused_fields_over_http_are_openai_errors_naming_them():
    cases = [(e, n) for e, n in _fields(Kind.REFUSED) + _fields(Kind.DEFAULT_ONLY)]
    cases += [(C, "frobnicate"), (CHAT, "echo")]
    requests = [(e.path, {**base(e), n: REFUSED_SAMPLES.get(n, 1)}) for e, n in cases]
    answers, upstream = asyncio.run(_post_all(requests))
    for (_, name), (status, body) in zip(cases, answers, strict=True):
        assert status == 400, (name, body)
        assert body["error"]["param"] == name and name in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"
    assert upstream.requests == [], "a refused request reached the scheduler"


def test_gateway_fields_model_stream_and_stream_options():
    answers, upstream = asyncio.run(
        _post_all(
            [
                (C.path, {**base(C), "model": "other"}),
                (C.path, {**base(C), "n": 2, "echo": True}),
                (CHAT.path, {**base(CHAT), "stream": True, "stream_options": {"include_usage": True}, "n": 2}),
            ]
        )
    )
    (missing, wrong), (ok, whole), (streamed, sse) = answers
    assert missing == 404 and wrong["error"]["param"] == "model"
    assert ok == 200 and [c["text"] for c in whole["choices"]] == ["Pok", "Pok"]
    assert whole["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert streamed == 200
    chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    assert sse.rstrip().endswith("data: [DONE]")
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert len(upstream.requests) == 2


def test_tokenize_and_version_routes_refuse_unknown_fields():
    answers, _ = asyncio.run(
        _post_all([("/tokenize", {"model": "m", "prompt": "x", "frob": 1}), ("/detokenize", {"tokens": ["a"]})])
    )
    assert answers[0][0] == 400 and answers[0][1]["error"]["param"] == "frob"
    assert answers[1][0] == 400 and answers[1][1]["error"]["param"] == "tokens"

"""gateway_svc.openai_schema and openai_responses: request validation and response/chunk
shapes, table-driven. The field rule itself (every OpenAI field classified) is
test_openai_field_rule.py."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway_svc.errors import HTTP_NAMES, from_grpc
from gateway_svc.openai_responses import (
    SSE_DONE,
    Delta,
    ResponseBuilder,
    TokenLogprob,
    TopToken,
    Usage,
    finish_reason,
    model_card,
    model_list,
    new_response_id,
    sse,
)
from gateway_svc.openai_schema import ChatMessage, Endpoint, SchemaError, parse_request

C, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
USER = [{"role": "user", "content": "hi"}]
_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


# ---- valid requests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint, body, field, want",
    [
        # defaults: OpenAI's max_tokens 16 for completions, the gateway's cap for chat; temperature 1
        (C, {"model": "m", "prompt": "x"}, "max_tokens", 16),
        (CHAT, {"model": "m", "messages": USER}, "max_tokens", 256),
        (C, {"model": "m", "prompt": "x"}, "temperature", 1.0),
        (C, {"model": "m", "prompt": "x"}, "top_p", 1.0),
        (C, {"model": "m", "prompt": "x"}, "seed", None),
        (C, {"model": "m", "prompt": "x"}, "stop", ()),
        (C, {"model": "m", "prompt": "x"}, "stream", False),
        # null means "not given"
        (C, {"model": "m", "prompt": "x", "max_tokens": None, "temperature": None, "n": None}, "max_tokens", 16),
        # given values
        (C, {"model": "m", "prompt": "x", "max_tokens": 3}, "max_tokens", 3),
        (CHAT, {"model": "m", "messages": USER, "max_tokens": 7}, "max_tokens", 7),
        (CHAT, {"model": "m", "messages": USER, "max_tokens": 7, "max_completion_tokens": 9}, "max_tokens", 9),
        (C, {"model": "m", "prompt": "x", "temperature": 0}, "temperature", 0.0),
        (C, {"model": "m", "prompt": "x", "temperature": 2}, "temperature", 2.0),
        (C, {"model": "m", "prompt": "x", "top_p": 0.5}, "top_p", 0.5),
        (C, {"model": "m", "prompt": "x", "seed": 42}, "seed", 42),
        (C, {"model": "m", "prompt": "x", "seed": -1}, "seed", (1 << 64) - 1),  # wrapped into uint64
        (C, {"model": "m", "prompt": "x", "top_k": -1}, "top_k", 0),
        (C, {"model": "m", "prompt": "x", "top_k": 5}, "top_k", 5),
        (C, {"model": "m", "prompt": "x", "stop": "."}, "stop", (".",)),
        (C, {"model": "m", "prompt": "x", "stop": [".", "\n"]}, "stop", (".", "\n")),
        (C, {"model": "m", "prompt": "x", "ignore_eos": True}, "ignore_eos", True),
        # prompts: text, token ids, and a batch of one of either
        (C, {"model": "m", "prompt": "hello"}, "prompt", "hello"),
        (C, {"model": "m", "prompt": [1, 2, 3]}, "prompt", (1, 2, 3)),
        (C, {"model": "m", "prompt": ["hello"]}, "prompt", "hello"),
        (C, {"model": "m", "prompt": [[4, 5]]}, "prompt", (4, 5)),
        # chat messages: developer is system, text parts are joined, assistant content may be null
        (
            CHAT,
            {"model": "m", "messages": [{"role": "developer", "content": "be brief"}] + USER},
            "prompt",
            (ChatMessage("system", "be brief"), ChatMessage("user", "hi")),
        ),
        (
            CHAT,
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
                ],
            },
            "prompt",
            (ChatMessage("user", "a\nb"),),
        ),
        (
            CHAT,
            {"model": "m", "messages": USER + [{"role": "assistant", "content": None}]},
            "prompt",
            (ChatMessage("user", "hi"), ChatMessage("assistant", "")),
        ),
        # include_usage only counts for a stream
        (
            C,
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
            "include_usage",
            True,
        ),
        (C, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "include_usage", False),
        # identifiers that change no output are accepted; refused fields at their "off" value too
        (C, {"model": "m", "prompt": "x", "user": "u", "best_of": 1, "suffix": None}, "model", "m"),
        (CHAT, {"model": "m", "messages": USER, "store": False, "service_tier": "auto"}, "model", "m"),
        (CHAT, {"model": "m", "messages": USER, "audio": None, "functions": None}, "model", "m"),
        # sampling
        (C, {"model": "m", "prompt": "x", "presence_penalty": 0.5}, "sampling.presence_penalty", 0.5),
        (C, {"model": "m", "prompt": "x", "frequency_penalty": -2}, "sampling.frequency_penalty", -2.0),
        (C, {"model": "m", "prompt": "x", "repetition_penalty": 1.3}, "sampling.repetition_penalty", 1.3),
        (C, {"model": "m", "prompt": "x", "min_p": 0.1}, "sampling.min_p", 0.1),
        (
            C,
            {"model": "m", "prompt": "x", "logit_bias": {"7": -100, "3": 2.5}},
            "sampling.logit_bias",
            ((3, 2.5), (7, -100.0)),
        ),
        # choices, logprobs, echo
        (C, {"model": "m", "prompt": "x", "n": 16}, "n", 16),
        (C, {"model": "m", "prompt": "x", "logprobs": 0}, "logprobs", True),
        (C, {"model": "m", "prompt": "x", "logprobs": 3}, "top_logprobs", 3),
        (C, {"model": "m", "prompt": "x", "logprobs": None}, "logprobs", False),
        (CHAT, {"model": "m", "messages": USER, "logprobs": True, "top_logprobs": 2}, "top_logprobs", 2),
        (CHAT, {"model": "m", "messages": USER, "logprobs": False}, "logprobs", False),
        (C, {"model": "m", "prompt": "x", "echo": True}, "echo", True),
        # response formats
        (CHAT, {"model": "m", "messages": USER, "response_format": {"type": "text"}}, "response_format", None),
        (
            CHAT,
            {"model": "m", "messages": USER, "response_format": {"type": "json_object"}},
            "response_format",
            ("json_object", ""),
        ),
        (
            C,
            {
                "model": "m",
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
            },
            "response_format",
            ("json_schema", '{"type": "object"}'),
        ),
        # tools: forwarded, unless tool_choice "none"; tool messages carry their call id
        (CHAT, {"model": "m", "messages": USER, "tools": [_TOOL]}, "tools_json", json.dumps([_TOOL])),
        (CHAT, {"model": "m", "messages": USER, "tools": [_TOOL], "tool_choice": "none"}, "tools_json", ""),
        (CHAT, {"model": "m", "messages": USER, "tool_choice": "none"}, "tools_json", ""),
        (
            CHAT,
            {
                "model": "m",
                "messages": USER
                + [
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ],
            },
            "prompt",
            (
                ChatMessage("user", "hi"),
                ChatMessage("assistant", "", tool_calls_json='[{"id": "c1"}]'),
                ChatMessage("tool", "42", tool_call_id="c1"),
            ),
        ),
        (C, {"model": "m", "prompt": "x", "request_id": "abc"}, "request_id", "abc"),
    ],
)
def test_valid_requests(endpoint, body, field, want):
    req = parse_request(endpoint, body)
    value = req
    for part in field.split("."):
        value = getattr(value, part)
    assert value == want
    assert req.endpoint is endpoint


def test_chat_default_cap_is_configurable():
    assert parse_request(CHAT, {"model": "m", "messages": USER}, chat_max_tokens=64).max_tokens == 64


# ---- refused requests: 400 naming the field -------------------------------------------------


@pytest.mark.parametrize(
    "endpoint, body, param, words",
    [
        (C, [], None, "JSON object"),
        (C, {"prompt": "x"}, "model", "model is required"),
        (C, {"model": 3, "prompt": "x"}, "model", "string"),
        (C, {"model": "m"}, "prompt", "prompt is required"),
        (C, {"model": "m", "prompt": ""}, "prompt", "empty"),
        (C, {"model": "m", "prompt": []}, "prompt", "empty"),
        (C, {"model": "m", "prompt": 5}, "prompt", "got an integer"),
        (C, {"model": "m", "prompt": ["a", "b"]}, "prompt", "batched prompts"),
        (C, {"model": "m", "prompt": [1, "a"]}, "prompt", "token ids"),
        (C, {"model": "m", "prompt": [1, True]}, "prompt", "token ids"),
        (C, {"model": "m", "prompt": [1, -2]}, "prompt", "in 0..4294967295, got -2"),
        (C, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer, got a string"),
        (C, {"model": "m", "prompt": "x", "max_tokens": 5.0}, "max_tokens", "integer, got a number"),
        (C, {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "integer, got a boolean"),
        (C, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "in 1..4294967295, got 0"),
        (
            CHAT,
            {"model": "m", "messages": USER, "max_completion_tokens": -3},
            "max_completion_tokens",
            "in 1..4294967295, got -3",
        ),
        (C, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "number"),
        (C, {"model": "m", "prompt": "x", "temperature": 2.5}, "temperature", "[0, 2]"),
        (C, {"model": "m", "prompt": "x", "temperature": -0.1}, "temperature", "[0, 2]"),
        (C, {"model": "m", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        (C, {"model": "m", "prompt": "x", "top_p": 1.1}, "top_p", "(0, 1]"),
        (C, {"model": "m", "prompt": "x", "seed": "7"}, "seed", "integer"),
        (C, {"model": "m", "prompt": "x", "seed": 1 << 64}, "seed", "in -9223372036854775808..18446744073709551615"),
        (C, {"model": "m", "prompt": "x", "stop": 3}, "stop", "string or an array"),
        (C, {"model": "m", "prompt": "x", "stop": [".", 3]}, "stop", "string or an array"),
        (C, {"model": "m", "prompt": "x", "stop": [""]}, "stop", "empty"),
        (C, {"model": "m", "prompt": "x", "stream": "yes"}, "stream", "boolean"),
        (C, {"model": "m", "prompt": "x", "stream": True, "stream_options": []}, "stream_options", "object"),
        (
            C,
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "boolean",
        ),
        (C, {"model": "m", "prompt": "x", "n": 17}, "n", "in 1..16, got 17"),
        (CHAT, {"model": "m", "messages": USER, "n": 0}, "n", "in 1..16, got 0"),
        (C, {"model": "m", "prompt": "x", "n": "1"}, "n", "integer"),
        (C, {"model": "m", "prompt": "x", "best_of": 2}, "best_of", "best_of=2 is not supported"),
        (C, {"model": "m", "prompt": "x", "best_of": True}, "best_of", "not supported"),
        (C, {"model": "m", "prompt": "x", "suffix": "end"}, "suffix", "not supported"),
        (C, {"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, "echo", "prompt tokens' logprobs"),
        (C, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs", "in 0..20, got 21"),
        (C, {"model": "m", "prompt": "x", "logprobs": True}, "logprobs", "integer"),
        (CHAT, {"model": "m", "messages": USER, "logprobs": 2}, "logprobs", "boolean"),
        (CHAT, {"model": "m", "messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        (C, {"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        (C, {"model": "m", "prompt": "x", "min_p": -0.1}, "min_p", "[0, 1]"),
        (C, {"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        (C, {"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        (C, {"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        (C, {"model": "m", "prompt": "x", "logit_bias": [1]}, "logit_bias", "object"),
        (C, {"model": "m", "prompt": "x", "whatever": [1]}, "whatever", "unknown field 'whatever'"),
        (CHAT, {"model": "m", "messages": USER, "echo": True}, "echo", "/v1/completions"),
        (C, {"model": "m", "prompt": "x", "messages": USER}, "messages", "/v1/chat/completions"),
        (CHAT, {"model": "m", "messages": USER, "store": True}, "store", "stores no completions"),
        (CHAT, {"model": "m", "messages": USER, "modalities": ["text", "audio"]}, "modalities", "text only"),
        (CHAT, {"model": "m", "messages": USER, "reasoning_effort": "low"}, "reasoning_effort", "not supported"),
        (CHAT, {"model": "m", "messages": USER, "response_format": {"type": "xml"}}, "response_format.type", "json"),
        (
            CHAT,
            {"model": "m", "messages": USER, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "schema must be an object",
        ),
        (CHAT, {"model": "m", "messages": USER, "tools": {}}, "tools", "array"),
        (CHAT, {"model": "m", "messages": USER, "tools": [{"type": "web"}]}, "tools[0]", "function"),
        (CHAT, {"model": "m", "messages": USER, "tools": [_TOOL], "tool_choice": "required"}, "tool_choice", "auto"),
        (
            C,
            {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "not supported",
        ),
        (CHAT, {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "required"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": "bob"}]},
            "messages[0].name",
            "not supported",
        ),
        (CHAT, {"model": "m"}, "messages", "messages is required"),
        (CHAT, {"model": "m", "messages": "hi"}, "messages", "array"),
        (CHAT, {"model": "m", "messages": []}, "messages", "empty"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]", "object"),
        (CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
        (CHAT, {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role", "one of"),
        (CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "required"),
        (CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
        (
            CHAT,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
            "only text",
        ),
    ],
)
def test_invalid_requests_name_the_field(endpoint, body, param, words):
    with pytest.raises(SchemaError) as info:
        parse_request(endpoint, body)
    assert info.value.param == param
    assert words in info.value.message


# ---- responses --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kvfleet, openai", [("length", "length"), ("eos", "stop"), ("stop", "stop"), ("cancelled", "cancelled")]
)
def test_finish_reasons(kvfleet, openai):
    assert finish_reason(kvfleet) == openai


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(ValueError):
        finish_reason("unspecified")


@pytest.mark.parametrize("endpoint, prefix", [(C, "cmpl-"), (CHAT, "chatcmpl-")])
def test_response_ids(endpoint, prefix):
    a, b = new_response_id(endpoint), new_response_id(endpoint)
    assert a.startswith(prefix) and b.startswith(prefix) and a != b
    assert new_response_id(endpoint, "mine-1") == prefix + "mine-1"  # the caller's request_id


def test_usage_totals():
    assert Usage(5, 7, cached_tokens=4).to_dict() == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def _builder(endpoint, **kw):
    return ResponseBuilder(endpoint, "id-1", 1700000000, "m", **kw)


_USAGE = Usage(5, 2)


def _done(text="", finish="stop", usage=_USAGE, index=0, **kw):
    return Delta(index=index, text=text, finish=finish, usage=usage, **kw)


def test_completion_response():
    b = _builder(C)
    b.add(Delta(text="Par"))
    b.add(_done("is."))
    assert b.response() == {
        "id": "id-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": "Paris.", "logprobs": None, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_chat_response():
    b = _builder(CHAT)
    b.add(_done("Hi!", "length", Usage(30, 4)))
    body = b.response()
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 34


def test_n_choices_in_order_with_the_prompt_counted_once():
    b = _builder(CHAT)
    b.add(Delta(index=1, text="b"))
    b.add(Delta(index=0, text="a"))
    b.add(_done(index=1, usage=Usage(10, 3, cached_tokens=10)))
    assert b.finished == 1
    b.add(_done(index=0, finish="length", usage=Usage(10, 4, cached_tokens=2)))
    body = b.response()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"),
        (1, "b", "stop"),
    ]
    assert body["usage"]["prompt_tokens"] == 10 and body["usage"]["completion_tokens"] == 7
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}  # the first choice's
    assert b.finish_reasons() == ["length", "stop"]


_LP = (
    TokenLogprob("Hé", -0.5, (TopToken("Hé", -0.5), TopToken("A", -1.5))),
    TokenLogprob("!", -0.25, (TopToken("!", -0.25), TopToken(".", -2.0))),
)


def test_chat_logprobs():
    b = _builder(CHAT, logprobs=True)
    b.add(_done("Hé!", logprobs=_LP))
    lp = b.response()["choices"][0]["logprobs"]
    assert lp["refusal"] is None
    assert lp["content"][0] == {
        "token": "Hé",
        "logprob": -0.5,
        "bytes": [72, 195, 169],
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
            {"token": "A", "logprob": -1.5, "bytes": [65]},
        ],
    }
    assert [e["token"] for e in lp["content"]] == ["Hé", "!"]


def test_completion_logprobs_with_echo_offsets():
    b = _builder(C, logprobs=True, echo=True)
    b.add(Delta(text="Hé", logprobs=_LP[:1], prompt_text="Say: "))
    b.add(_done("!", logprobs=_LP[1:]))
    choice = b.response()["choices"][0]
    assert choice["text"] == "Say: Hé!"
    assert choice["logprobs"] == {
        "tokens": ["Hé", "!"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hé": -0.5, "A": -1.5}, {"!": -0.25, ".": -2.0}],
        "text_offset": [5, 7],
    }


def test_echo_is_a_completions_thing():
    b = _builder(CHAT, echo=True)
    b.add(_done("x", prompt_text="prompt"))
    assert b.response()["choices"][0]["message"]["content"] == "x"


def test_completion_stream_chunks():
    b = _builder(C, logprobs=True, echo=True)
    first = b.add(Delta(text="Hé", logprobs=_LP[:1], prompt_text="Say: "))
    last = b.add(_done("!", "length", logprobs=_LP[1:]))
    assert [c["choices"][0]["text"] for c in first + last] == ["Say: Hé", "!"]
    assert [c["choices"][0]["finish_reason"] for c in first + last] == [None, "length"]
    assert last[0]["choices"][0]["logprobs"]["text_offset"] == [7]  # continues from the first chunk
    assert all(c["object"] == "text_completion" and "usage" not in c for c in first + last)


def test_chat_stream_chunks_open_each_choice_with_its_role():
    b = _builder(CHAT)
    chunks = b.add(Delta(index=0, text="a")) + b.add(Delta(index=1, text="b")) + b.add(_done("c", index=0))
    assert [c["choices"][0] for c in chunks] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
    ]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_chunks_with_include_usage_carry_null_usage_then_the_counts():
    b = _builder(CHAT, include_usage=True)
    assert all(c["usage"] is None for c in b.add(_done("x", usage=Usage(3, 4))))
    last = b.usage_chunk()
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 7
    assert last["object"] == "chat.completion.chunk"


def test_model_list_is_sorted_and_cards_say_the_context_length():
    assert model_list([model_card("b", 9), model_card("a", 9, 2048)]) == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 9, "owned_by": "kvfleet", "max_model_len": 2048},
            {"id": "b", "object": "model", "created": 9, "owned_by": "kvfleet"},
        ],
    }


def test_sse_framing():
    event = sse({"text": "é\n"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: ") :]) == {"text": "é\n"}
    assert event.count(b"\n") == 2  # a newline inside the payload is escaped, never a frame break
    assert SSE_DONE == b"data: [DONE]\n\n"


# ---- gRPC status -> HTTP error ------------------------------------------------------------------


class _Rpc(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    "code, details, status, err_code",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "prompt_too_long: 5000 tokens", 400, "prompt_too_long"),
        (grpc.StatusCode.INVALID_ARGUMENT, "stop strings need a tokenizer", 400, None),
        (grpc.StatusCode.FAILED_PRECONDITION, "model 'tiny' has no tokenizer", 400, None),
        (grpc.StatusCode.PERMISSION_DENIED, "not an experiment writer", 403, "permission_denied"),
        (grpc.StatusCode.UNAUTHENTICATED, "who are you", 401, "invalid_api_key"),
        (grpc.StatusCode.NOT_FOUND, "no session", 404, None),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full: the queue holds 1 of 1", 429, "queue_full"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_budget: lower max_new_tokens", 429, "kv_budget"),
        (grpc.StatusCode.UNAVAILABLE, "no_worker: no live worker is registered", 503, "no_worker"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", 503, "unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504, "timeout"),
        (grpc.StatusCode.INTERNAL, "boom", 500, None),
        (grpc.StatusCode.UNKNOWN, "boom", 500, None),
    ],
)
def test_grpc_errors_map_to_http(code, details, status, err_code):
    err = from_grpc(_Rpc(code, details))
    assert (err.status, err.code) == (status, err_code)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if status in (400, 429):  # the scheduler's reason and advice, whole, in the body's terms
        assert body["message"] == details.replace("max_new_tokens", "max_tokens")
    if status == 429:
        assert err.headers() == {"Retry-After": "1"}


@pytest.mark.parametrize(
    "details, names, message, param",
    [
        (
            "invalid_request: max_new_tokens 5000 exceeds the limit 2048",
            HTTP_NAMES,
            "invalid_request: max_tokens 5000 exceeds the limit 2048",
            "max_tokens",
        ),
        (
            "prompt_too_long: prompt (4) + max_new_tokens (9000) = 9004 exceeds the model's context",
            parse_request(CHAT, {"model": "m", "messages": USER, "max_completion_tokens": 9000}).http_names(),
            "prompt_too_long: prompt (4) + max_completion_tokens (9000) = 9004 exceeds the model's context",
            "max_completion_tokens",
        ),
        (
            "model 'm': its chat template has no tool support; send no tools_json, no 'tool' role messages and no "
            "assistant tool_calls_json to this model",
            HTTP_NAMES,
            "model 'm': its chat template has no tool support; send no tools, no 'tool' role messages and no "
            "assistant tool_calls to this model",
            "tools",
        ),
        (
            "message 2: tool_calls_json is not valid JSON",
            HTTP_NAMES,
            "message 2: tool_calls is not valid JSON",
            "messages",
        ),
        (
            "model 'tiny' has no tokenizer: send prompt_ids instead of text",
            HTTP_NAMES,
            "model 'tiny' has no tokenizer: send token ids as the prompt instead of text",
            "prompt",
        ),
        # Names inside other words, and a message naming none, stay as they are.
        ("my_max_new_tokens_x and prompt_idsx", HTTP_NAMES, "my_max_new_tokens_x and prompt_idsx", None),
        ("queue_full: the queue holds 1 of 1", HTTP_NAMES, "queue_full: the queue holds 1 of 1", None),
    ],
)
def test_scheduler_rejections_read_in_the_body_s_terms(details, names, message, param):
    """A scheduler rejection names its gRPC request's fields; the HTTP client is told the names
    it sent (max_tokens or max_completion_tokens, tools, tool_calls, a token-id prompt), and the
    first of them is the error's param."""
    err = from_grpc(_Rpc(grpc.StatusCode.INVALID_ARGUMENT, details), names=names)
    assert (err.body()["error"]["message"], err.param) == (message, param)
    assert parse_request(C, {"model": "m", "prompt": "x"}).http_names() == HTTP_NAMES

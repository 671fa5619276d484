"""gateway_svc.openai_schema: request validation and response/chunk shapes, table-driven."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway_svc.errors import from_grpc
from gateway_svc.openai_schema import (
    SSE_DONE,
    ChatMessage,
    Endpoint,
    ResponseBuilder,
    SchemaError,
    Usage,
    finish_reason,
    model_list,
    new_response_id,
    parse_request,
    sse,
)

C, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
USER = [{"role": "user", "content": "hi"}]


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
        # unknown and unsupported-but-harmless fields are ignored
        (C, {"model": "m", "prompt": "x", "user": "u", "presence_penalty": 0.5, "whatever": [1]}, "model", "m"),
        (C, {"model": "m", "prompt": "x", "n": 1, "best_of": 1, "echo": False, "logprobs": None}, "model", "m"),
    ],
)
def test_valid_requests(endpoint, body, field, want):
    req = parse_request(endpoint, body)
    assert getattr(req, field) == want
    assert req.endpoint is endpoint


def test_chat_default_cap_is_configurable():
    assert parse_request(CHAT, {"model": "m", "messages": USER}, chat_max_tokens=64).max_tokens == 64


def test_chat_messages_are_the_scheduler_dicts():
    req = parse_request(CHAT, {"model": "m", "messages": [{"role": "system", "content": "s"}] + USER})
    assert req.chat_messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]


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
        (C, {"model": "m", "prompt": [1, -2]}, "prompt", "negative"),
        (C, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer, got a string"),
        (C, {"model": "m", "prompt": "x", "max_tokens": 5.0}, "max_tokens", "integer, got a number"),
        (C, {"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens", "integer, got a boolean"),
        (C, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        (CHAT, {"model": "m", "messages": USER, "max_completion_tokens": -3}, "max_completion_tokens", "at least 1"),
        (C, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "number"),
        (C, {"model": "m", "prompt": "x", "temperature": 2.5}, "temperature", "[0, 2]"),
        (C, {"model": "m", "prompt": "x", "temperature": -0.1}, "temperature", "[0, 2]"),
        (C, {"model": "m", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        (C, {"model": "m", "prompt": "x", "top_p": 1.1}, "top_p", "(0, 1]"),
        (C, {"model": "m", "prompt": "x", "seed": "7"}, "seed", "integer"),
        (C, {"model": "m", "prompt": "x", "seed": 1 << 64}, "seed", "64 bits"),
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
        (C, {"model": "m", "prompt": "x", "n": 2}, "n", "only n=1"),
        (CHAT, {"model": "m", "messages": USER, "n": 3}, "n", "only n=1"),
        (C, {"model": "m", "prompt": "x", "n": "1"}, "n", "integer"),
        (C, {"model": "m", "prompt": "x", "best_of": 2}, "best_of", "best_of=1"),
        (C, {"model": "m", "prompt": "x", "echo": True}, "echo", "not supported"),
        (C, {"model": "m", "prompt": "x", "logprobs": 2}, "logprobs", "not supported"),
        (CHAT, {"model": "m", "messages": USER, "logprobs": True}, "logprobs", "not supported"),
        (CHAT, {"model": "m"}, "messages", "messages is required"),
        (CHAT, {"model": "m", "messages": "hi"}, "messages", "array"),
        (CHAT, {"model": "m", "messages": []}, "messages", "empty"),
        (CHAT, {"model": "m", "messages": ["hi"]}, "messages[0]", "object"),
        (CHAT, {"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "one of"),
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


def test_usage_totals():
    assert Usage(5, 7).to_dict() == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def _builder(endpoint, include_usage=False):
    return ResponseBuilder(endpoint, "id-1", 1700000000, "m", include_usage=include_usage)


def test_completion_response():
    assert _builder(C).response("Paris.", "stop", Usage(5, 2)) == {
        "id": "id-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": "Paris.", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def test_chat_response():
    body = _builder(CHAT).response("Hi!", "length", Usage(30, 4))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"]["total_tokens"] == 34


@pytest.mark.parametrize(
    "endpoint, kwargs, choice",
    [
        (C, {"text": "ab"}, {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}),
        (C, {"text": "c", "finish": "length"}, {"index": 0, "text": "c", "logprobs": None, "finish_reason": "length"}),
        (
            CHAT,
            {"text": "", "role": True},
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        ),
        (CHAT, {"text": "ab"}, {"index": 0, "delta": {"content": "ab"}, "logprobs": None, "finish_reason": None}),
        (CHAT, {"finish": "stop"}, {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}),
    ],
)
def test_chunks(endpoint, kwargs, choice):
    body = _builder(endpoint).chunk(**kwargs)
    assert body["object"] == ("text_completion" if endpoint is C else "chat.completion.chunk")
    assert (body["id"], body["created"], body["model"]) == ("id-1", 1700000000, "m")
    assert body["choices"] == [choice]
    assert "usage" not in body


def test_chunks_with_include_usage_carry_null_usage_then_the_counts():
    b = _builder(CHAT, include_usage=True)
    assert b.chunk(text="x")["usage"] is None
    last = b.usage_chunk(Usage(3, 4))
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert last["object"] == "chat.completion.chunk"


def test_model_list_is_distinct_and_sorted():
    assert model_list(["b", "a", "b"], 9) == {
        "object": "list",
        "data": [
            {"id": "a", "object": "model", "created": 9, "owned_by": "kvfleet"},
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
    if status in (400, 429):
        assert body["message"] == details  # the scheduler's reason and advice, whole
    if status == 429:
        assert err.headers() == {"Retry-After": "1"}

"""Tool calls read out of a chat model's text (gateway_svc.tool_calls) and the OpenAI response
and stream built from them (openai_responses.ResponseBuilder), fed with scheduler events
through the same parse_request / to_delta path the gateway takes."""

from __future__ import annotations

import json
import re

import pytest

from gateway_svc.openai_responses import Delta, ResponseBuilder, TokenLogprob, Usage
from gateway_svc.openai_schema import Endpoint, parse_request
from gateway_svc.tool_calls import declared_tool_names, held_from, parse_tool_calls
from gateway_svc.upstream import to_delta
from kvfleet.v1 import scheduler_pb2 as spb

NAMES = frozenset({"get_weather", "add"})
ID = re.compile(r"call_[0-9a-f]{24}")


def _fn(call):
    assert ID.fullmatch(call["id"]) and call["type"] == "function"
    return call["function"]["name"], json.loads(call["function"]["arguments"])


# ---- the parser ----------------------------------------------------------------------------


def test_one_call():
    content, calls = parse_tool_calls(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', NAMES
    )
    assert content is None
    assert [_fn(c) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_two_calls_in_order_with_their_own_ids():
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call> {"name": "get_weather", "arguments": {"city": "Bergen"}} </tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [_fn(c) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Bergen"})]
    assert calls[0]["id"] != calls[1]["id"]


def test_arguments_as_a_json_string_pass_through_and_missing_ones_are_empty():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call><tool_call>{"name": "add"}</tool_call>'
    _, calls = parse_tool_calls(text, NAMES)
    assert [c["function"]["arguments"] for c in calls] == ['{"a": 1}', "{}"]


def test_text_around_the_calls_is_the_content():
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\nOne moment.'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check.\n\nOne moment."
    assert len(calls) == 1


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # JSON cut short
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>["add"]</tool_call>',  # not an object
        '<tool_call>{"name": "add", "arguments": 3}</tool_call>',  # arguments neither object nor string
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # a tool the request did not declare
    ],
)
def test_a_block_that_is_no_call_stays_content_word_for_word(block):
    text = f"Before {block} after"
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_bad_block_next_to_a_good_one_stays_in_the_content():
    bad = '<tool_call>{"name": "rm_rf"}</tool_call>'
    content, calls = parse_tool_calls(bad + '<tool_call>{"name": "add", "arguments": {}}</tool_call>', NAMES)
    assert content == bad and [_fn(c) for c in calls] == [("add", {})]


def test_a_last_block_cut_before_its_closing_tag_counts_when_its_json_is_whole():
    assert _fn(parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)[1][0]) == ("add", {"a": 1})
    assert parse_tool_calls('<tool_call>{"name": "add", "argu', NAMES) == ('<tool_call>{"name": "add", "argu', [])


def test_plain_text_comes_back_unchanged():
    assert parse_tool_calls("  Just text.\n", NAMES) == ("  Just text.\n", [])
    assert parse_tool_calls("", NAMES) == ("", [])


@pytest.mark.parametrize(
    "text, at",
    [("Hello", 5), ("Hello <", 6), ("Hello <tool_ca", 6), ("a<tool_call>{", 1), ("<b>", 3), ("x <tool_call", 2)],
)
def test_held_from_is_where_a_call_could_start(text, at):
    assert held_from(text) == at


def test_declared_tool_names_come_from_the_request():
    assert declared_tool_names("") == frozenset()
    req = parse_request(Endpoint.CHAT, _body(tools=[_tool("add"), _tool("get_weather")]))
    assert declared_tool_names(req.tools_json) == NAMES
    req = parse_request(Endpoint.CHAT, _body(tools=[_tool("add")], tool_choice="none"))
    assert declared_tool_names(req.tools_json) == frozenset()  # tool_choice "none": no calls read


# ---- responses, fed the way the gateway feeds them -----------------------------------------


def _tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def _body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], **kw}


def _builder(**kw):
    req = parse_request(Endpoint.CHAT, _body(**kw))
    return ResponseBuilder(Endpoint.CHAT, "id-1", 1, "m", tool_names=declared_tool_names(req.tools_json))


def _events(*texts, finish=spb.FINISH_EOS, index=0):
    """Scheduler events carrying these text deltas; the last one finishes the choice."""
    evs = [spb.GenerateEvent(text=t, index=index) for t in texts]
    evs.append(
        spb.GenerateEvent(
            finished=True, finish_reason=finish, usage=spb.Usage(input_tokens=9, output_tokens=5), index=index
        )
    )
    return evs


CALL_TEXT = (
    "I'll look.",
    "\n<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Oslo"}}\n</tool_call>',
)
TOOLS = {"tools": [_tool("get_weather")]}


def test_a_call_in_a_whole_response():
    b = _builder(**TOOLS)
    for ev in _events(*CALL_TEXT):
        b.add(to_delta(ev))
    (choice,) = b.response()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == "I'll look."
    assert [_fn(c) for c in message["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
    assert b.finish_reasons() == ["tool_calls"]


def test_a_response_that_is_only_a_call_has_null_content():
    b = _builder(**TOOLS)
    for ev in _events(*CALL_TEXT[1:]):
        b.add(to_delta(ev))
    assert b.response()["choices"][0]["message"]["content"] is None


def test_a_response_without_a_call_is_plain_text_even_with_tools():
    b = _builder(**TOOLS)
    for ev in _events("It is ", "<b>sunny</b>."):
        b.add(to_delta(ev))
    (choice,) = b.response()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "It is <b>sunny</b>."}
    assert choice["finish_reason"] == "stop"


def _stream(b, events):
    chunks = [c for ev in events for c in b.add(to_delta(ev))]
    assert all(len(c["choices"]) == 1 for c in chunks)
    return [c["choices"][0] for c in chunks]


def test_a_streamed_call_holds_its_text_and_ends_with_the_call():
    b = _builder(**TOOLS)
    choices = _stream(b, _events(*CALL_TEXT))
    deltas = [c["delta"] for c in choices]
    content = "".join(d.get("content", "") for d in deltas)
    assert "<tool" not in content and content.strip() == "I'll look."
    (call_delta,) = [d for d in deltas if "tool_calls" in d]
    (call,) = call_delta["tool_calls"]
    assert call["index"] == 0 and _fn(call) == ("get_weather", {"city": "Oslo"})
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    # the call's chunk comes after every content chunk and just before the finish
    assert deltas.index(call_delta) == len(deltas) - 2


def test_two_streamed_calls_carry_their_indexes():
    b = _builder(tools=[_tool("add"), _tool("get_weather")])
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    choices = _stream(b, _events(*[text[i : i + 7] for i in range(0, len(text), 7)]))
    calls = [call for c in choices for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add"), (1, "get_weather")]
    assert not any(c["delta"].get("content") for c in choices)


def test_held_text_without_a_call_is_streamed_at_the_end_as_it_was():
    b = _builder(**TOOLS)
    texts = ("Use ", "<tool", "_call> tags", " like <tool_call>oops</tool_call>")
    choices = _stream(b, _events(*texts))
    assert "".join(c["delta"].get("content", "") for c in choices) == "".join(texts)
    assert not any("tool_calls" in c["delta"] for c in choices)
    assert choices[-1]["finish_reason"] == "stop"
    # "Use " went out as it came; the rest waited from "<tool" on
    assert choices[1]["delta"] == {"content": "Use "}


def test_streamed_text_is_held_only_while_it_could_start_a_call():
    b = _builder(**TOOLS)
    first = _stream(b, [spb.GenerateEvent(text="a <")])
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "a "}]
    assert [c["delta"] for c in _stream(b, [spb.GenerateEvent(text="b")])] == [{"content": "<b"}]


def test_held_logprobs_go_with_the_text_that_was_held():
    req = parse_request(Endpoint.CHAT, _body(**TOOLS, logprobs=True))
    b = ResponseBuilder(
        Endpoint.CHAT, "i", 1, "m", logprobs=req.logprobs, tool_names=declared_tool_names(req.tools_json)
    )

    def lp(token):
        return (TokenLogprob(token, -1.0),)

    chunks = b.add(Delta(text="<", logprobs=lp("<"))) + b.add(Delta(text="x", logprobs=lp("x")))
    chunks += b.add(Delta(finish="stop", usage=Usage(1, 2)))
    sent = [(c["choices"][0]["delta"].get("content"), c["choices"][0]["logprobs"]) for c in chunks]
    assert sent[1][0] == "<x" and [e["token"] for e in sent[1][1]["content"]] == ["<", "x"]


# ---- requests without tools are untouched --------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"tools": [_tool("get_weather")], "tool_choice": "none"}])
def test_without_tools_a_call_shaped_text_is_plain_content(kw):
    whole = _builder(**kw)
    plain = ResponseBuilder(Endpoint.CHAT, "id-1", 1, "m")  # as the gateway built it before tools
    events = _events(*CALL_TEXT)
    for ev in events:
        for b in (whole, plain):
            b.add(to_delta(ev))
    assert whole.response()["choices"][0] == plain.response()["choices"][0]
    assert whole.response()["choices"][0]["message"]["content"] == "".join(CALL_TEXT)
    fresh, reference = _builder(**kw), ResponseBuilder(Endpoint.CHAT, "id-1", 1, "m")
    got = [c for ev in events for c in fresh.add(to_delta(ev))]
    want = [c for ev in events for c in reference.add(to_delta(ev))]
    assert got == want  # chunk for chunk: each text delta as it came, finish "stop"
    assert [c["choices"][0]["delta"].get("content") for c in got][1:-1] == list(CALL_TEXT)


def test_completions_never_read_tool_calls():
    b = ResponseBuilder(Endpoint.COMPLETIONS, "id", 1, "m", tool_names=NAMES)
    b.add(Delta(text=CALL_TEXT[1] + "".join(CALL_TEXT[2:]), finish="stop", usage=Usage(1, 1)))
    assert b.response()["choices"][0]["text"].startswith("\n<tool_call>")

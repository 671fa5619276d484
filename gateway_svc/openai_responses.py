"""The OpenAI response format, pure: whole responses and streamed chunks, built as plain dicts.

The HTTP adapter turns each scheduler event into a `Delta` (no protobuf here) and feeds it to
one request's `ResponseBuilder`, which keeps each choice's text, logprobs and finish: streamed,
`add` returns the chunks to send for it; not streamed, `response` builds the body at the end.
A chat request that declared tools has each choice's finished text read for tool calls
(tool_calls.py); streamed, the text from a possible `<tool_call>` on is held until the end.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway_svc.openai_schema import Endpoint
from gateway_svc.tool_calls import held_from, parse_tool_calls

# kvfleet finish names (kvfleet.client.finish_name) -> the OpenAI finish_reason. EOS and a stop
# token or string are both "stop" in the OpenAI API. A session cancelled on the scheduler (by
# Cancel or a drain) has no OpenAI name; "cancelled" says what happened rather than pretending.
FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "cancelled": "cancelled"}

SSE_DONE = b"data: [DONE]\n\n"


def finish_reason(kvfleet_name: str) -> str:
    """The OpenAI finish_reason for a kvfleet finish name ("length", "eos", "stop", "cancelled")."""
    try:
        return FINISH_REASONS[kvfleet_name]
    except KeyError:
        raise ValueError(f"unknown finish reason {kvfleet_name!r}") from None


def new_response_id(endpoint: Endpoint, request_id: str = "") -> str:
    """The response's `id`: the caller's request_id after the endpoint's prefix, as vLLM does
    (`cmpl-<request_id>`), so the caller's id comes back; else a random one."""
    return endpoint.id_prefix + (request_id or secrets.token_hex(12))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from a worker's prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True)
class TopToken:
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's text and log-probability, and the likeliest alternatives at its place."""

    token: str
    logprob: float
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True)
class Delta:
    """What one scheduler event adds to one choice."""

    index: int = 0
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_text: str = ""  # the prompt's text, on a choice's first event when echo was asked
    finish: str | None = None  # the OpenAI finish_reason, on a choice's last event
    usage: Usage | None = None  # with finish


def chat_logprobs(tokens: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
    """choices[].logprobs of a chat response: one entry per token, bytes as UTF-8 values."""

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(a.token, a.logprob) for a in t.top]} for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int) -> dict[str, Any]:
    """choices[].logprobs of a completion: parallel lists; text_offset counts characters of the
    choice's text (echoed prompt included) from `offset`, where the first token starts."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens],
        "text_offset": offsets,
    }


@dataclass
class _Choice:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: str | None = None
    usage: Usage | None = None
    started: bool = False  # a chat stream sent its role chunk
    start: int = 0  # completions: text_offset of the first token (after an echoed prompt)
    offset: int = 0  # completions: text_offset of the next token
    sent: int = 0  # chat with tools: how much of text has been streamed as content
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the text not yet streamed
    content: str | None = None  # chat with tools, once finished: the text outside the calls
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ResponseBuilder:
    """One request's response, or its stream of chunks, sharing id/created/model."""

    def __init__(
        self,
        endpoint: Endpoint,
        id: str,
        created: int,
        model: str,
        *,
        include_usage: bool = False,  # streamed chunks carry "usage": null, a last one the counts
        logprobs: bool = False,  # the request asked for logprobs
        echo: bool = False,  # completions: each choice's text starts with the prompt's
        tool_names: frozenset[str] = frozenset(),  # chat: the declared tools whose calls are read
    ) -> None:
        self.endpoint, self.id, self.created, self.model = endpoint, id, created, model
        self.include_usage, self.logprobs, self.echo = include_usage, logprobs, echo
        self.tool_names = tool_names if endpoint is Endpoint.CHAT else frozenset()
        self._choices: dict[int, _Choice] = {}

    @property
    def chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def _logprobs(self, tokens: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return chat_logprobs(tokens) if self.chat else completion_logprobs(tokens, offset)

    # ---- accumulating ----------------------------------------------------------------------

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        """Record a delta; returns the chunks that stream it (ignore them when not streaming)."""
        c = self._choices.setdefault(delta.index, _Choice())
        text = delta.text
        if self.echo and delta.prompt_text and not self.chat:
            text = delta.prompt_text + text
            c.start = c.offset = len(delta.prompt_text)  # the first token starts after the echo
        offset = c.offset
        c.text += text
        c.logprobs.extend(delta.logprobs)
        c.offset += sum(len(t.token) for t in delta.logprobs)
        if delta.finish is not None:
            c.finish, c.usage = delta.finish, delta.usage
            if self.tool_names:
                c.content, c.tool_calls = parse_tool_calls(c.text, self.tool_names)
                if c.tool_calls:
                    c.finish = "tool_calls"
        chunks = []
        if self.tool_names:
            chunks = self._tool_chunks(delta.index, c, delta)
        elif self.chat:
            if not c.started:
                c.started = True
                chunks.append(self.chunk(delta.index, text="", role=True))
            if text or delta.logprobs:
                chunks.append(self.chunk(delta.index, text=text, logprobs=list(delta.logprobs), offset=offset))
            if delta.finish is not None:
                chunks.append(self.chunk(delta.index, finish=delta.finish))
        elif text or delta.logprobs or delta.finish is not None:
            chunks.append(
                self.chunk(delta.index, text=text, finish=delta.finish, logprobs=list(delta.logprobs), offset=offset)
            )
        return chunks

    def _tool_chunks(self, index: int, c: _Choice, delta: Delta) -> list[dict[str, Any]]:
        """A chat choice's chunks when tools were declared: content up to where a call could
        start; at the finish, the rest as content, or the calls with the text outside them."""
        chunks = []
        if not c.started:
            c.started = True
            chunks.append(self.chunk(index, text="", role=True))
        c.held_logprobs.extend(delta.logprobs)
        if delta.finish is None:
            upto = c.sent + held_from(c.text[c.sent :])
            # Held logprobs go with the next content sent (a token is not split over chunks).
            if upto > c.sent or (upto == len(c.text) and c.held_logprobs):
                text = c.text[c.sent : upto]
                chunks.append(self.chunk(index, text=text, logprobs=c.held_logprobs))
                c.sent, c.held_logprobs = upto, []
            return chunks
        # Finished: the held part has no call (sent as it is) or has them all, since nothing from
        # a `<tool_call>` on was sent: then the unsent text outside them, and the calls found in add.
        rest = parse_tool_calls(c.text[c.sent :], self.tool_names)[0] if c.tool_calls else c.text[c.sent :]
        if rest or c.held_logprobs:
            chunks.append(self.chunk(index, text=rest or "", logprobs=c.held_logprobs))
        c.sent, c.held_logprobs = len(c.text), []
        if c.tool_calls:
            calls = [{"index": i, **call} for i, call in enumerate(c.tool_calls)]
            chunks.append(self.chunk(index, tool_calls=calls))
        chunks.append(self.chunk(index, finish=c.finish))
        return chunks

    @property
    def finished(self) -> int:
        """How many choices have finished."""
        return sum(c.finish is not None for c in self._choices.values())

    def finish_reasons(self) -> list[str]:
        return [c.finish for _, c in sorted(self._choices.items()) if c.finish is not None]

    def usage(self) -> Usage:
        """The request's usage: the prompt once, the completions of every choice summed."""
        usages = [c.usage for _, c in sorted(self._choices.items()) if c.usage is not None]
        if not usages:
            return Usage(0, 0)
        return Usage(
            prompt_tokens=max(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=usages[0].cached_tokens,  # the first choice's: the prompt counts once
        )

    # ---- building --------------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        """The whole, non-streamed response from every delta added."""
        body = self._head(self.endpoint.object_name)
        choices = []
        for index, c in sorted(self._choices.items()):
            logprobs = self._logprobs(c.logprobs, c.start)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    message = {"role": "assistant", "content": c.content, "tool_calls": c.tool_calls}
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish})
            else:
                choices.append({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish})
        body["choices"] = choices
        body["usage"] = self.usage().to_dict()
        return body

    def chunk(
        self,
        index: int = 0,
        text: str | None = None,
        finish: str | None = None,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of one choice: a text delta and/or the finish reason; `role` opens a
        chat choice; `tool_calls` are a chat choice's calls, each with its index among them.
        `offset`: completions' text_offset of the chunk's first token."""
        body = self._head(self.endpoint.chunk_object_name)
        lp = self._logprobs(logprobs, offset) if logprobs else None
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the counts."""
        body = self._head(self.endpoint.chunk_object_name)
        body["choices"] = []
        body["usage"] = self.usage().to_dict()
        return body


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": sorted(cards, key=lambda c: c["id"])}


def model_card(name: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "kvfleet"}
    if max_model_len:
        card["max_model_len"] = max_model_len  # as vLLM's server reports it
    return card


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

"""The OpenAI wire format, pure: request validation and response/chunk building as plain dicts.

No network, no grpc, no protobuf: the HTTP adapter (app.py) parses a JSON body with
`parse_request`, turns the result into a scheduler request, and builds what it sends back with
`ResponseBuilder`. Everything here is table-tested in tests/unit/test_openai_schema.py.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any

# The roles the scheduler's chat template takes; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_UINT64 = 1 << 64

# kvfleet finish names (kvfleet.client.finish_name) -> the OpenAI finish_reason. EOS and a stop
# token or string are both "stop" in the OpenAI API. A session cancelled on the scheduler (by
# Cancel or a drain) has no OpenAI name; "cancelled" says what happened rather than pretending.
FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "cancelled": "cancelled"}

SSE_DONE = b"data: [DONE]\n\n"


class Endpoint(Enum):
    """The two generation endpoints; the value is the GenAI gen_ai.operation.name."""

    COMPLETIONS = "text_completion"
    CHAT = "chat"

    @property
    def id_prefix(self) -> str:
        return "cmpl-" if self is Endpoint.COMPLETIONS else "chatcmpl-"

    @property
    def object_name(self) -> str:
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion"

    @property
    def chunk_object_name(self) -> str:
        # Streamed completions keep "text_completion"; chat chunks have their own object name.
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion.chunk"


class SchemaError(ValueError):
    """A request the gateway refuses with 400; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


Prompt = str | tuple[int, ...] | tuple[ChatMessage, ...]


@dataclass(frozen=True)
class GenerationRequest:
    """One validated completions or chat request, in the scheduler's terms."""

    endpoint: Endpoint
    model: str
    prompt: Prompt  # text, token ids (completions) or messages (chat)
    max_tokens: int
    temperature: float  # 0 = greedy on the scheduler
    top_p: float
    top_k: int  # 0 = off (an extension, as vLLM has it)
    seed: int | None  # None: the adapter draws one, so unseeded requests vary
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage
    ignore_eos: bool  # an extension, as vLLM has it

    @property
    def chat_messages(self) -> list[dict[str, str]]:
        assert self.endpoint is Endpoint.CHAT
        return [{"role": m.role, "content": m.content} for m in self.prompt]  # type: ignore[union-attr]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


# ---- request validation --------------------------------------------------------------------


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def _get_int(body: dict[str, Any], name: str, default: int | None, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise SchemaError(f"{name} must be an integer, got {_type_name(value)}", name)
    if minimum is not None and value < minimum:
        raise SchemaError(f"{name} must be at least {minimum}, got {value}", name)
    return int(value)


def _get_number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not (_is_int(value) or isinstance(value, float)):
        raise SchemaError(f"{name} must be a number, got {_type_name(value)}", name)
    if not (low < value <= high if low_open else low <= value <= high):
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise SchemaError(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SchemaError(f"{name} must be a boolean, got {_type_name(value)}", name)
    return value


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    if not all(_is_int(v) for v in values):
        raise SchemaError(f"{param} must be a string or an array of integer token ids", param)
    if any(v < 0 for v in values):
        raise SchemaError(f"{param} token ids must not be negative", param)
    return tuple(values)


def _parse_prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    """A string or token ids; a batch of exactly one of either is unwrapped."""
    prompt = body.get("prompt")
    if prompt is None:
        raise SchemaError("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise SchemaError("prompt is empty; send some text or token ids", "prompt")
        return prompt
    if not isinstance(prompt, list):
        raise SchemaError(f"prompt must be a string or an array of token ids, got {_type_name(prompt)}", "prompt")
    if not prompt:
        raise SchemaError("prompt is empty; send some text or token ids", "prompt")
    if all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise SchemaError(
                f"batched prompts are not supported (got {len(prompt)}); send one prompt per request", "prompt"
            )
        return _parse_prompt({"prompt": prompt[0]})
    return _token_ids(prompt, "prompt")


def _content(message: dict[str, Any], i: int, role: str) -> str:
    content = message.get("content")
    param = f"messages[{i}].content"
    if content is None:
        if role == "assistant":  # an assistant turn that only called tools
            return ""
        raise SchemaError(f"{param} is required", param)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SchemaError(f"{param} must be a string or an array of text parts, got {_type_name(content)}", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise SchemaError(
                f'{param}[{j}] must be a text part {{"type": "text", "text": ...}}; only text content is supported',
                f"{param}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if messages is None:
        raise SchemaError("messages is required", "messages")
    if not isinstance(messages, list):
        raise SchemaError(f"messages must be an array, got {_type_name(messages)}", "messages")
    if not messages:
        raise SchemaError("messages is empty; send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SchemaError(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise SchemaError(
                f"messages[{i}].role must be one of system, developer, user, assistant; got {role!r}",
                f"messages[{i}].role",
            )
        out.append(ChatMessage(_ROLES[role], _content(m, i, role)))
    return tuple(out)


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise SchemaError("stop must be a string or an array of strings", "stop")
    if any(not s for s in stop):
        raise SchemaError("stop strings must not be empty", "stop")
    return tuple(stop)


def _refuse_unsupported(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Fields that would change the response's shape: refused, rather than silently ignored."""
    n = _get_int(body, "n", 1)
    if n != 1:
        raise SchemaError(f"only n=1 is supported (got n={n}); send one request per completion", "n")
    if endpoint is Endpoint.COMPLETIONS:
        best_of = _get_int(body, "best_of", 1)
        if best_of != 1:
            raise SchemaError(f"only best_of=1 is supported (got {best_of})", "best_of")
        if _get_bool(body, "echo", False):
            raise SchemaError("echo is not supported", "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        raise SchemaError("logprobs are not supported", "logprobs")


def parse_request(endpoint: Endpoint, body: Any, *, chat_max_tokens: int = 256) -> GenerationRequest:
    """Validate a decoded JSON body. Unknown fields are ignored; a wrong one raises SchemaError."""
    if not isinstance(body, dict):
        raise SchemaError(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise SchemaError("model is required and must be a non-empty string", "model")
    _refuse_unsupported(body, endpoint)
    prompt: Prompt
    if endpoint is Endpoint.COMPLETIONS:
        prompt = _parse_prompt(body)
        max_tokens = _get_int(body, "max_tokens", 16, minimum=1)  # OpenAI's default for completions
    else:
        prompt = _parse_messages(body)
        # max_completion_tokens is the current name, max_tokens the deprecated one.
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get_int(body, name, chat_max_tokens, minimum=1)
    seed = _get_int(body, "seed", None)
    if seed is not None and not -(1 << 63) <= seed < _UINT64:
        raise SchemaError(f"seed must fit in 64 bits, got {seed}", "seed")
    top_k = _get_int(body, "top_k", 0, minimum=-1)  # -1 = off, as vLLM has it
    stream = _get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise SchemaError(f"stream_options must be an object, got {_type_name(options)}", "stream_options")
    include_usage = False
    if options:
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise SchemaError(
                f"stream_options.include_usage must be a boolean, got {_type_name(value)}",
                "stream_options.include_usage",
            )
        include_usage = bool(value) and stream
    assert max_tokens is not None
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_get_number(body, "temperature", 1.0, 0.0, 2.0),  # OpenAI's default is 1
        top_p=_get_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(top_k or 0, 0),
        seed=None if seed is None else seed % _UINT64,
        stop=_parse_stop(body),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_get_bool(body, "ignore_eos", False),
    )


# ---- responses -----------------------------------------------------------------------------


def finish_reason(kvfleet_name: str) -> str:
    """The OpenAI finish_reason for a kvfleet finish name ("length", "eos", "stop", "cancelled")."""
    try:
        return FINISH_REASONS[kvfleet_name]
    except KeyError:
        raise ValueError(f"unknown finish reason {kvfleet_name!r}") from None


def new_response_id(endpoint: Endpoint) -> str:
    return endpoint.id_prefix + secrets.token_hex(12)


@dataclass(frozen=True)
class ResponseBuilder:
    """Builds one request's response, or its stream of chunks, sharing id/created/model."""

    endpoint: Endpoint
    id: str
    created: int  # unix seconds
    model: str
    include_usage: bool = False  # streamed chunks carry "usage": null, the last one the counts

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def response(self, text: str, finish: str, usage: Usage) -> dict[str, Any]:
        """The whole, non-streamed response. `finish` is an OpenAI finish_reason."""
        body = self._head(self.endpoint.object_name)
        if self.endpoint is Endpoint.COMPLETIONS:
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        body["choices"] = [choice]
        body["usage"] = usage.to_dict()
        return body

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        """One streamed chunk: a text delta, and/or the finish reason; `role` opens a chat stream."""
        body = self._head(self.endpoint.chunk_object_name)
        if self.endpoint is Endpoint.COMPLETIONS:
            choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        else:
            delta: dict[str, str] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the counts."""
        body = self._head(self.endpoint.chunk_object_name)
        body["choices"] = []
        body["usage"] = usage.to_dict()
        return body


def model_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(n, created) for n in sorted(set(names))]}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvfleet"}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

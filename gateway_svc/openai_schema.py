"""The OpenAI request format, pure: the field rule and request validation, as plain values.

No network, no grpc, no protobuf: the HTTP adapter (app.py) parses a JSON body with
`parse_request`; upstream.py turns the result into the scheduler's GenerateRequest, and
openai_responses.py builds what goes back.

The field rule: every field of OpenAI's request types for /v1/completions and
/v1/chat/completions is in FIELDS, either implemented (mapped to a GenerateRequest field),
accepted only at the value that means "off", accepted and ignored (with the reason that makes
ignoring it honest), or refused. A request that sets a refused field, or a field FIELDS does
not know, is a 400 naming it: nothing is silently dropped. tests/unit/test_openai_field_rule.py
walks the openai package's own request types against this table.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from gateway_svc.errors import HTTP_NAMES
from kvfleet_common import sampling_rules
from kvfleet_common.sampling_rules import MAX_LOGIT_BIAS, UINT32_MAX, SamplingRuleError


class Endpoint(Enum):
    """The two generation endpoints; the value is the GenAI gen_ai.operation.name."""

    COMPLETIONS = "text_completion"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"

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


# ---- the field rule --------------------------------------------------------------------------


class Kind(Enum):
    IMPLEMENTED = "implemented"  # sets the GenerateRequest fields in `grpc` (or, with none, the gateway does it)
    DEFAULT_ONLY = "default_only"  # refused unless null or one of `accepted` (the values that change nothing)
    IGNORED = "ignored"  # accepted; `why` says why ignoring it changes nothing the caller gets
    REFUSED = "refused"  # a 400 whenever it is set (not null); `why` says why


C, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
_BOTH = frozenset({C, CHAT})
_CHAT = frozenset({CHAT})
_COMPLETIONS = frozenset({C})


@dataclass(frozen=True)
class Field:
    kind: Kind
    endpoints: frozenset[Endpoint]
    why: str  # how it is implemented, or why it is refused or ignored
    grpc: tuple[str, ...] = ()  # IMPLEMENTED: the GenerateRequest fields it sets ("sampling.seed")
    accepted: tuple[Any, ...] = ()  # DEFAULT_ONLY: the values taken as "not set"
    extension: bool = False  # not OpenAI's: a vLLM-style extra field


def _impl(grpc: str, endpoints: frozenset[Endpoint] = _BOTH, extension: bool = False) -> Field:
    return Field(
        Kind.IMPLEMENTED, endpoints, f"sets GenerateRequest.{grpc}", tuple(grpc.split(", ")), extension=extension
    )


def _gateway(how: str, endpoints: frozenset[Endpoint] = _BOTH) -> Field:
    """Implemented by the gateway itself, not by a GenerateRequest field."""
    return Field(Kind.IMPLEMENTED, endpoints, how)


def _only(accepted: tuple[Any, ...], why: str, endpoints: frozenset[Endpoint] = _BOTH) -> Field:
    return Field(Kind.DEFAULT_ONLY, endpoints, why, accepted=accepted)


def _refused(why: str, endpoints: frozenset[Endpoint] = _CHAT) -> Field:
    return Field(Kind.REFUSED, endpoints, why)


def _ignored(why: str, endpoints: frozenset[Endpoint] = _BOTH) -> Field:
    return Field(Kind.IGNORED, endpoints, why)


# Every field of openai.types.chat.completion_create_params.CompletionCreateParams* and
# openai.types.completion_create_params.CompletionCreateParams*, plus kvfleet's extensions.
FIELDS: dict[str, Field] = {
    # -- implemented, both endpoints
    "model": _gateway("must be the served model (GetModelInfo.model_id); any other name is a 404"),
    "stream": _gateway("the answer comes as server-sent events"),
    "stream_options": _gateway("include_usage: a last chunk carries the usage"),
    "max_tokens": _impl("max_new_tokens"),
    "temperature": _impl("sampling.temperature"),
    "top_p": _impl("sampling.top_p"),
    "seed": _impl("sampling.seed"),
    "stop": _impl("stop"),
    "presence_penalty": _impl("sampling.presence_penalty"),
    "frequency_penalty": _impl("sampling.frequency_penalty"),
    "logit_bias": _impl("sampling.logit_bias"),
    "logprobs": _impl("logprobs, top_logprobs"),  # completions: the int is top_logprobs
    "n": _impl("n"),
    # -- implemented, one endpoint
    "prompt": _impl("text, prompt_ids", _COMPLETIONS),
    "echo": _impl("echo", _COMPLETIONS),
    "messages": _impl("chat", _CHAT),
    "max_completion_tokens": _impl("max_new_tokens", _CHAT),
    "top_logprobs": _impl("top_logprobs", _CHAT),
    # a chat field in OpenAI's types; vLLM's server takes it on completions too, and so does kvfleet
    "response_format": _impl("response_format"),
    "tools": _impl("tools_json", _CHAT),
    # "none": the tools are not sent (the model answers in text); "auto": sent; others refused
    "tool_choice": _impl("tools_json", _CHAT),
    # -- accepted only at the value that changes nothing
    "best_of": _only((1,), "the server draws no candidates to pick from; use n for several choices", _COMPLETIONS),
    "suffix": _only(("",), "kvfleet does not insert text before a suffix", _COMPLETIONS),
    "parallel_tool_calls": _only((True,), "kvfleet cannot hold the model to one tool call", _CHAT),
    "store": _only((False,), "kvfleet stores no completions", _CHAT),
    "modalities": _only((["text"],), "kvfleet's models answer in text only", _CHAT),
    "service_tier": _only(("auto", "default"), "kvfleet has one tier", _CHAT),
    "prompt_cache_retention": _only(
        ("in_memory",), "the prefix cache lives in the workers' memory and keeps no entry for a set time", _CHAT
    ),
    # -- accepted and ignored: identifiers and hints that change no output
    "user": _ignored("an end-user identifier for the provider's abuse monitoring; it changes no output"),
    "safety_identifier": _ignored("an end-user identifier like user; it changes no output", _CHAT),
    "metadata": _ignored("tags for stored completions (see store); it changes no output", _CHAT),
    "prompt_cache_key": _ignored(
        "a routing hint for the provider's prompt cache; kvfleet's prefix cache matches the tokens themselves", _CHAT
    ),
    # -- refused whenever set
    "audio": _refused("kvfleet's models answer in text only"),
    "functions": _refused("the deprecated functions API is not served; send tools"),
    "function_call": _refused("the deprecated functions API is not served; send tool_choice"),
    "prediction": _refused("predicted outputs are not implemented"),
    "reasoning_effort": _refused("the served models do not reason in a separate channel"),
    "verbosity": _refused("the served models take no verbosity setting"),
    "web_search_options": _refused("kvfleet does not search the web"),
    "moderation": _refused("kvfleet runs no moderation"),
    "prompt_cache_options": _refused("the prefix cache takes no breakpoints or lifetimes"),
    # -- kvfleet's extensions, named as vLLM's server names them (top level of the body)
    "top_k": _impl("sampling.top_k", extension=True),
    "min_p": _impl("sampling.min_p", extension=True),
    "repetition_penalty": _impl("sampling.repetition_penalty", extension=True),
    "ignore_eos": _impl("ignore_eos", extension=True),
    "request_id": _impl("request_id", extension=True),
}
EXTENSIONS = tuple(sorted(name for name, f in FIELDS.items() if f.extension))


def check_fields(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Apply the field rule to a body's top-level keys: a 400 for the first one it refuses."""
    for name, value in body.items():
        rule = FIELDS.get(name)
        if rule is None or endpoint not in rule.endpoints:
            where = "" if rule is None else f"; it belongs to {next(iter(rule.endpoints)).path}"
            raise SchemaError(
                f"unknown field {name!r}: {endpoint.path} takes OpenAI's fields and kvfleet's extensions "
                f"({', '.join(EXTENSIONS)}){where}",
                name,
            )
        if value is None or rule.kind in (Kind.IMPLEMENTED, Kind.IGNORED):
            continue  # null is "not given" in OpenAI's API
        if rule.kind is Kind.REFUSED:
            raise SchemaError(f"{name} is not supported: {rule.why}; remove it from the request", name)
        if value not in rule.accepted or isinstance(value, bool) is not isinstance(rule.accepted[0], bool):
            allowed = " or ".join(json.dumps(a) for a in rule.accepted)
            raise SchemaError(
                f"{name}={_show(value)} is not supported: {rule.why}; leave it unset or send {allowed}", name
            )


# ---- the validated request -------------------------------------------------------------------

# The roles the scheduler's chat template takes; "developer" is OpenAI's newer name for "system".
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id"}
_UINT64 = 1 << 64
# UINT32_MAX (from sampling_rules) is also the widest integer most GenerateRequest fields hold.
MAX_N = 16  # the scheduler's limit on GenerateRequest.n
# Array and map sizes, checked before an element is read; each as the scheduler's own limit
# (PromptLimits, sampling_rules.MAX_LOGIT_BIAS), or OpenAI's (128 tools), so none refuses what
# the scheduler would serve. Token ids: PromptLimits.max_prompt_ids before the scheduler lowers it.
MAX_PROMPT_IDS = 64 * 1024
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024
MAX_STOP = 16
MAX_TOOLS = 128


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_call_id: str = ""  # role "tool": the call it answers
    tool_calls_json: str = ""  # role "assistant": the tool_calls it made, as JSON


Prompt = str | tuple[int, ...] | tuple[ChatMessage, ...]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # OpenAI's default; 0 = greedy on the scheduler
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the adapter draws one, so unseeded requests vary
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id


@dataclass(frozen=True)
class GenerationRequest:
    """One validated completions or chat request, in the scheduler's terms."""

    endpoint: Endpoint
    model: str
    prompt: Prompt  # text, token ids (completions) or messages (chat)
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False  # completions: the prompt's text before each choice's text
    response_format: tuple[str, str] | None = None  # (type, JSON schema text); None = plain text
    tools_json: str = ""  # the tools array, as JSON, when they go to the scheduler
    request_id: str = ""
    max_tokens_name: str = "max_tokens"  # the body's name for it (chat: or max_completion_tokens)

    def http_names(self) -> dict[str, tuple[str, str]]:
        """errors.HTTP_NAMES as this body names them: the scheduler's rejections in its terms."""
        return {**HTTP_NAMES, "max_new_tokens": (self.max_tokens_name, self.max_tokens_name)}

    # The sampling fields, as flat names, for callers that read them (spans, tests).
    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def top_k(self) -> int:
        return self.sampling.top_k

    @property
    def seed(self) -> int | None:
        return self.sampling.seed


# ---- value checks ------------------------------------------------------------------------------


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


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _show(value: Any) -> str:
    """A caller's value for an error message: JSON, cut short (a value may be megabytes)."""
    if _is_int(value) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = f"({_type_name(value)})"
    return text if len(text) <= 80 else text[:77] + "..."


def unicode_text(value: str, param: str) -> str:
    """`value`, refused if it cannot be UTF-8 (a lone surrogate escape like "\\ud800"): gRPC
    strings are UTF-8, so such a string would fail the call, not the caller."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise SchemaError(
                f"{param} is not valid Unicode: a lone surrogate at character {exc.start}", param
            ) from None
    return value


def check_count(values: list[Any] | dict[str, Any], limit: int, param: str, what: str) -> None:
    if len(values) > limit:
        raise SchemaError(f"{param} has {len(values)} {what}; at most {limit} are allowed", param)


def _dumps(value: Any, param: str) -> str:
    """`value` as JSON for the scheduler (ASCII, so no string in it can fail to encode)."""
    try:
        return json.dumps(value)
    except (ValueError, RecursionError):  # NaN is written, so: nested past the encoder's depth
        raise SchemaError(f"{param} is nested too deeply", param) from None


def _get_int(
    body: dict[str, Any], name: str, default: int | None, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise SchemaError(f"{name} must be an integer, got {_type_name(value)}", name)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else str(minimum)
        high = "" if maximum is None else str(maximum)
        raise SchemaError(f"{name} must be in {low}..{high}, got {_show(value)}", name)
    return int(value)


def _get_number(body: dict[str, Any], name: str, default: float) -> float:
    """A number's type only: its range is sampling_rules', checked on the whole Sampling."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise SchemaError(f"{name} must be a number, got {_type_name(value)}", name)
    return float(value)


def _get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SchemaError(f"{name} must be a boolean, got {_type_name(value)}", name)
    return value


def _get_object(body: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise SchemaError(f"{name} must be an object, got {_type_name(value)}", name)
    return value


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    check_count(values, MAX_PROMPT_IDS, param, "token ids")
    if not all(_is_int(v) for v in values):
        raise SchemaError(f"{param} must be a string or an array of integer token ids", param)
    if any(not 0 <= v <= UINT32_MAX for v in values):
        bad = next(v for v in values if not 0 <= v <= UINT32_MAX)
        raise SchemaError(f"{param} token ids must be in 0..{UINT32_MAX}, got {_show(bad)}", param)
    return tuple(values)


# ---- prompts and messages ----------------------------------------------------------------------


def _parse_prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    """A string or token ids; a batch of exactly one of either is unwrapped."""
    prompt = body.get("prompt")
    if prompt is None:
        raise SchemaError("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise SchemaError("prompt is empty; send some text or token ids", "prompt")
        return unicode_text(prompt, "prompt")
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
        return unicode_text(content, param)
    if not isinstance(content, list):
        raise SchemaError(f"{param} must be a string or an array of text parts, got {_type_name(content)}", param)
    check_count(content, MAX_CONTENT_PARTS, param, "parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise SchemaError(
                f'{param}[{j}] must be a text part {{"type": "text", "text": ...}}; only text content is supported',
                f"{param}[{j}]",
            )
        texts.append(unicode_text(part["text"], f"{param}[{j}].text"))
    return "\n".join(texts)


def _message(m: Any, i: int) -> ChatMessage:
    if not isinstance(m, dict):
        raise SchemaError(f"messages[{i}] must be an object, got {_type_name(m)}", f"messages[{i}]")
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise SchemaError(
            f"messages[{i}].role must be one of system, developer, user, assistant, tool; got {role!r}",
            f"messages[{i}].role",
        )
    for key, value in m.items():
        if key not in _MESSAGE_KEYS and value is not None:
            # e.g. name: the chat templates render no participant names, so it would be dropped
            raise SchemaError(
                f"messages[{i}].{key} is not supported: a message takes role, content, tool_calls "
                "(assistant) and tool_call_id (tool)",
                f"messages[{i}].{key}",
            )
    tool_call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise SchemaError(
                f"messages[{i}].tool_call_id is required on a tool message: the id of the call it answers",
                f"messages[{i}].tool_call_id",
            )
        unicode_text(tool_call_id, f"messages[{i}].tool_call_id")
    elif tool_call_id is not None:
        raise SchemaError(f"messages[{i}].tool_call_id belongs to tool messages", f"messages[{i}].tool_call_id")
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise SchemaError(
            f"messages[{i}].tool_calls must be an array, on an assistant message", f"messages[{i}].tool_calls"
        )
    return ChatMessage(
        _ROLES[role],
        _content(m, i, role),
        tool_call_id=tool_call_id or "",
        tool_calls_json=_dumps(calls, f"messages[{i}].tool_calls") if calls else "",
    )


def parse_messages(body: dict[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if messages is None:
        raise SchemaError("messages is required", "messages")
    if not isinstance(messages, list):
        raise SchemaError(f"messages must be an array, got {_type_name(messages)}", "messages")
    if not messages:
        raise SchemaError("messages is empty; send at least one message", "messages")
    check_count(messages, MAX_MESSAGES, "messages", "messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise SchemaError("stop must be a string or an array of strings", "stop")
    check_count(stop, MAX_STOP, "stop", "strings")
    if not all(isinstance(s, str) for s in stop):
        raise SchemaError("stop must be a string or an array of strings", "stop")
    if any(not s for s in stop):
        raise SchemaError("stop strings must not be empty", "stop")
    return tuple(unicode_text(s, "stop") for s in stop)


# ---- sampling, logprobs, formats, tools --------------------------------------------------------

_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _parse_logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = _get_object(body, "logit_bias")
    if not bias:
        return ()
    check_count(bias, MAX_LOGIT_BIAS, "logit_bias", "entries")  # before reading a key
    out = []
    for key, value in bias.items():
        # JSON object keys are strings: OpenAI sends token ids as "50256".
        if not _TOKEN_ID.fullmatch(key) or int(key) > UINT32_MAX:
            raise SchemaError(
                f"logit_bias keys must be token ids (decimal integers in 0..{UINT32_MAX}), got {_show(key)}",
                "logit_bias",
            )
        if not _is_number(value):
            raise SchemaError(f"logit_bias[{key!r}] must be a number, got {_type_name(value)}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _parse_sampling(body: dict[str, Any]) -> Sampling:
    """The sampling fields' types; their ranges are checked by `_check_sampling`.

    Two inputs are wider than the rule, as OpenAI's and vLLM's servers take them: any 64-bit
    seed, signed or not (a negative one is taken mod 2**64), and top_k -1 for "off".
    """
    seed = _get_int(body, "seed", None, minimum=-(1 << 63), maximum=sampling_rules.SEED.high)
    top_k = _get_int(body, "top_k", 0, minimum=-1, maximum=sampling_rules.TOP_K.high)
    return Sampling(
        temperature=_get_number(body, "temperature", 1.0),
        top_p=_get_number(body, "top_p", 1.0),
        top_k=max(top_k or 0, 0),
        min_p=_get_number(body, "min_p", 0.0),
        seed=None if seed is None else seed % _UINT64,
        presence_penalty=_get_number(body, "presence_penalty", 0.0),
        frequency_penalty=_get_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_get_number(body, "repetition_penalty", 1.0),
        logit_bias=_parse_logit_bias(body),
    )


def _parse_logprobs(endpoint: Endpoint, body: dict[str, Any]) -> tuple[bool, int]:
    """(logprobs wanted, how many alternatives per token); the count's range is the rule's."""
    if endpoint is Endpoint.COMPLETIONS:
        # completions: logprobs is the number of alternatives (0 = the sampled token's only)
        top = _get_int(body, "logprobs", None)
        return top is not None, top or 0
    wanted = _get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise SchemaError("top_logprobs needs logprobs: true", "top_logprobs")
    return wanted, top or 0


def _check_sampling(
    endpoint: Endpoint, s: Sampling, logprobs: bool, top_logprobs: int, response_format: tuple[str, str] | None
) -> None:
    """The sampling rules the scheduler and the workers apply too (kvfleet_common.sampling_rules)."""
    kind, schema = response_format or ("", "")
    values = sampling_rules.SamplingValues(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed or 0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        logit_bias=s.logit_bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        constraint=kind,
        constraint_schema=schema,
    )
    try:
        sampling_rules.validate(values)
    except SamplingRuleError as exc:
        names = dict(sampling_rules.REQUEST_NAMES)
        if endpoint is Endpoint.COMPLETIONS:
            names["top_logprobs"] = "logprobs"  # the completions API's name for the count
        param = names.get(exc.field, exc.field)
        raise SchemaError(exc.named(names), param) from None


def _parse_response_format(body: dict[str, Any]) -> tuple[str, str] | None:
    fmt = _get_object(body, "response_format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", "")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise SchemaError(
                'response_format.json_schema.schema must be an object: {"type": "json_schema", '
                '"json_schema": {"name": ..., "schema": {...}}}',
                "response_format.json_schema",
            )
        return ("json_schema", _dumps(schema, "response_format.json_schema"))
    raise SchemaError(
        f"response_format.type must be text, json_object or json_schema; got {kind!r}", "response_format.type"
    )


def _parse_tools(body: dict[str, Any]) -> str:
    """The tools array as JSON for the scheduler, or "" when none go (none given, or tool_choice "none")."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise SchemaError(f"tools must be an array, got {_type_name(tools)}", "tools")
        check_count(tools, MAX_TOOLS, "tools", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
                raise SchemaError(
                    f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                    f"tools[{i}]",
                )
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        # "required" or a named function would need the output forced into a call.
        raise SchemaError(
            f'tool_choice={_show(choice)} is not supported: kvfleet does not force a tool call; send "auto" or "none"',
            "tool_choice",
        )
    if not tools or choice == "none":
        return ""
    return _dumps(tools, "tools")


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = _get_object(body, "stream_options")
    if not options:
        return False
    for key, value in options.items():
        param = f"stream_options.{key}"
        if key not in ("include_usage", "include_obfuscation"):
            raise SchemaError(f"unknown field {param!r}: stream_options takes include_usage", param)
        if value is not None and not isinstance(value, bool):
            raise SchemaError(f"{param} must be a boolean, got {_type_name(value)}", param)
    if options.get("include_obfuscation"):
        raise SchemaError(
            "stream_options.include_obfuscation is not supported: kvfleet pads no chunks; leave it unset or false",
            "stream_options.include_obfuscation",
        )
    return bool(options.get("include_usage")) and stream


def parse_request(endpoint: Endpoint, body: Any, *, chat_max_tokens: int = 256) -> GenerationRequest:
    """Validate a decoded JSON body against the field rule and each field's type and range."""
    if not isinstance(body, dict):
        raise SchemaError(f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise SchemaError("model is required and must be a non-empty string", "model")
    unicode_text(model, "model")
    check_fields(endpoint, body)
    prompt: Prompt
    if endpoint is Endpoint.COMPLETIONS:
        prompt = _parse_prompt(body)
        name = "max_tokens"
        max_tokens = _get_int(body, name, 16, minimum=1, maximum=UINT32_MAX)  # OpenAI's default: 16
    else:
        prompt = parse_messages(body)
        # max_completion_tokens is the current name, max_tokens the deprecated one.
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get_int(body, name, chat_max_tokens, minimum=1, maximum=UINT32_MAX)
    assert max_tokens is not None
    stream = _get_bool(body, "stream", False)
    sampling = _parse_sampling(body)
    logprobs, top_logprobs = _parse_logprobs(endpoint, body)
    response_format = _parse_response_format(body)
    _check_sampling(endpoint, sampling, logprobs, top_logprobs, response_format)
    echo = _get_bool(body, "echo", False)
    if echo and logprobs:
        raise SchemaError("echo with logprobs is not supported: the prompt tokens' logprobs are not computed", "echo")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise SchemaError(f"request_id must be a string, got {_type_name(request_id)}", "request_id")
    if request_id is not None:
        unicode_text(request_id, "request_id")
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=_parse_stop(body),
        stream=stream,
        include_usage=_include_usage(body, stream),
        ignore_eos=_get_bool(body, "ignore_eos", False),
        n=_get_int(body, "n", 1, minimum=1, maximum=MAX_N) or 1,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo=echo,
        response_format=response_format,
        tools_json=_parse_tools(body) if endpoint is Endpoint.CHAT else "",
        request_id=request_id or "",
        max_tokens_name=name,
    )

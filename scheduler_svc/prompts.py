"""Turning a GenerateRequest's prompt (token ids, text or chat) into token ids, and tokens back
into streamed text. The tokenizer lives here, at the front door, so prompt lengths are known
before admission."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from jinja2 import TemplateError

from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models import grammar
from kvfleet_models.errors import ModelLoadError
from scheduler_svc import convert
from scheduler_svc.core import RejectReason, SessionRequest
from scheduler_svc.core.admission import MAX_LOGIT_BIAS

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the scheduler cannot turn into token ids; the message says what to fix, and
    `where` which of a workload's sessions it is ("session 3: "; "" for a lone request)."""

    where = ""


class NoTokenizer(PromptError):
    """The served model takes token ids only (e.g. "tiny"): there is no text to map to or from."""


class PromptRejected(PromptError):
    """A refusal the core would also make, made before the expensive work; it carries the
    core's reason, so the status details and the rejection counters read the same."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# A token-id prompt longer than this is converted and range-checked in a thread, not on the loop.
INLINE_PROMPT_IDS = 1024


MAX_REQUEST_ID = 128
MAX_CHOICES = 16  # GenerateRequest.n


def check_options(req: spb.GenerateRequest) -> None:
    """The per-request options that are not about the prompt's size: request_id and n."""
    rid = req.request_id
    if len(rid) > MAX_REQUEST_ID or not all(" " <= c <= "~" for c in rid):
        raise PromptError(
            f"request_id must be at most {MAX_REQUEST_ID} printable ASCII characters "
            f"(got {len(rid)} characters{'' if rid.isascii() and rid.isprintable() else ', some not printable ASCII'})"
        )
    if req.n > MAX_CHOICES:
        raise PromptError(f"n is {req.n}; at most {MAX_CHOICES} choices per request (0 or 1 = one)")


def check_workload_session(req: spb.GenerateRequest) -> None:
    """A workload's session is one choice: its n choices would have no seeds of their own."""
    if req.n > 1:
        raise PromptError(
            f"n is {req.n}; a workload lists its sessions one by one, so send n <= 1 "
            f"and repeat the session with the seeds you want"
        )


@dataclass(frozen=True)
class PromptLimits:
    """Bounds checked before any tokenizing, so one request cannot stall the others."""

    max_prompt_bytes: int = 256 * 1024  # text, or all chat contents together (UTF-8)
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # each stop string (UTF-8)
    max_stop_token_ids: int = 256
    max_schema_bytes: int = 64 * 1024  # response_format.json_schema (UTF-8)
    # prompt_ids entries; the server lowers it to the core's max_prompt_tokens, so an oversized
    # id list is refused by its length before any id in it is read
    max_prompt_ids: int = 64 * 1024

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, req: spb.GenerateRequest) -> None:
        """Counts and sizes only (each O(1) or one pass over lengths): nothing here reads a token id,
        tokenizes, renders a template or compiles a grammar."""
        if len(req.sampling.logit_bias) > MAX_LOGIT_BIAS:
            raise PromptError(
                f"logit_bias has {len(req.sampling.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
            )
        if len(req.stop) > self.max_stop_strings:
            raise PromptError(f"{len(req.stop)} stop strings; at most {self.max_stop_strings} are allowed")
        for stop in req.stop:
            if not stop:
                raise PromptError("a stop string is empty; remove it")
            if len(stop.encode()) > self.max_stop_bytes:
                raise PromptError(
                    f"a stop string is {len(stop.encode())} bytes; at most {self.max_stop_bytes} are allowed"
                )
        if len(req.stop_token_ids) > self.max_stop_token_ids:
            raise PromptError(
                f"{len(req.stop_token_ids)} stop token ids; at most {self.max_stop_token_ids} are allowed"
            )
        schema_bytes = len(req.response_format.json_schema.encode())
        if schema_bytes > self.max_schema_bytes:
            raise PromptError(
                f"response_format.json_schema is {schema_bytes} bytes; at most {self.max_schema_bytes} are allowed"
            )
        kind = req.WhichOneof("prompt")
        if req.tools_json and kind != "chat":
            raise PromptError("tools_json needs a chat prompt (chat messages); send the prompt as chat")
        if kind == "prompt_ids":
            count = len(req.prompt_ids.ids)
            if count > self.max_prompt_ids:
                raise PromptRejected(
                    RejectReason.PROMPT_TOO_LONG, f"the prompt has {count} tokens; the limit is {self.max_prompt_ids}"
                )
            return
        if kind == "text":
            size = len(req.text.encode())
        elif kind == "chat":
            if len(req.chat.messages) > self.max_chat_messages:
                raise PromptError(
                    f"chat has {len(req.chat.messages)} messages; at most {self.max_chat_messages} are allowed"
                )
            size = len(req.tools_json.encode()) + chat_bytes(req.chat)
        else:
            return
        if size > self.max_prompt_bytes:
            raise PromptError(
                f"the prompt is {size} bytes; the limit is {self.max_prompt_bytes} (--max-prompt-bytes); shorten it"
            )


class TextStream(Protocol):
    def push(self, token: int) -> tuple[str, bool]: ...  # (text delta, a stop string was hit)
    def flush(self) -> str: ...


class NoText:
    """Token-id-only models stream no text."""

    def push(self, token: int) -> tuple[str, bool]:
        return "", False

    def flush(self) -> str:
        return ""


class _DetokenizingStream:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        from kvfleet_models.tokenizer import IncrementalDetokenizer, StopStringMatcher

        # Special tokens (EOS, chat markers) end or shape a turn; they are not text to show.
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._stop = StopStringMatcher(stop) if stop else None
        self._stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        if self._stopped:
            return "", True
        text = self._detok.push(token)
        if self._stop is None:
            return text, False
        emit, stopped = self._stop.feed(text)
        self._stopped = stopped
        return emit, stopped

    def flush(self) -> str:
        if self._stopped:
            return ""
        text = self._detok.flush()
        if self._stop is None:
            return text
        emit, _ = self._stop.feed(text)
        return emit + self._stop.flush()


@dataclass
class PromptResolver:
    model_name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    tokenizer: Any | None = None
    limits: PromptLimits = field(default_factory=PromptLimits)

    @classmethod
    def for_model(cls, name: str, model: Any, limits: PromptLimits = PromptLimits()) -> "PromptResolver":
        """The resolver for the served model; a model without a tokenizer (tiny, a Hugging Face
        directory without tokenizer.json) is served on token ids, its text requests refused.
        A tokenizer that is there but unreadable raises ModelLoadError."""
        from kvfleet_models.errors import NoTokenizerError
        from kvfleet_models.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer.for_model(name)
        except NoTokenizerError as exc:
            log.info("%s; text and chat requests are refused", exc)
            tokenizer = None
        return cls(
            model_name=name,
            vocab_size=model.vocab_size,
            eos_token_ids=frozenset(model.eos_token_ids),
            tokenizer=tokenizer,
            limits=limits,
        )

    @property
    def supports_tools(self) -> bool:
        return self.tokenizer is not None and bool(self.tokenizer.supports_tools)

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise NoTokenizer(f"model {self.model_name!r} has no tokenizer; {what}")
        return self.tokenizer

    def prompt_ids(self, req: spb.GenerateRequest) -> tuple[int, ...]:
        kind = req.WhichOneof("prompt")
        if kind == "prompt_ids":
            return self._checked_ids(req.prompt_ids.ids)
        if kind is None:
            raise PromptError("the request has no prompt; set prompt_ids, text or chat")
        tokenizer = self._need_tokenizer(f"send prompt_ids instead of {kind}")
        if kind == "text":
            # A text prompt is the caller's whole prompt, markers and all (as vLLM reads one):
            # control tokens written in it are special tokens. Chat content never is.
            return tuple(tokenizer.encode(req.text))
        return tuple(self.encode_chat(req.chat, req.tools_json))

    def _checked_ids(self, values: Any) -> tuple[int, ...]:
        """A token-id prompt as a tuple, every id inside the vocabulary (max() runs in C; the
        first bad id is looked for only when there is one)."""
        ids = tuple(values)
        if ids and max(ids) >= self.vocab_size:
            bad = next(i for i in ids if i >= self.vocab_size)
            raise PromptRejected(
                RejectReason.INVALID_REQUEST,
                f"prompt token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}",
            )
        return ids

    def render_chat(self, chat: spb.ChatMessages, tools_json: str = "") -> str:
        """The chat template's text for the messages (and tools), generation prompt added."""
        tokenizer = self._need_tokenizer("send prompt_ids instead of chat")
        messages = chat_messages(chat, self.supports_tools, self.model_name)
        tools = parse_tools(tools_json, self.supports_tools, self.model_name)
        with self._template_errors():
            return str(tokenizer.render_chat(messages, tools=tools))

    def encode_chat(self, chat: spb.ChatMessages, tools_json: str = "", add_special_tokens: bool = True) -> list[int]:
        """The chat's token ids: the template's markers as special tokens, whatever the caller
        wrote (contents, tool calls, tools) as plain text, so it cannot forge a turn."""
        tokenizer = self._need_tokenizer("send prompt_ids instead of chat")
        messages = chat_messages(chat, self.supports_tools, self.model_name)
        tools = parse_tools(tools_json, self.supports_tools, self.model_name)
        with self._template_errors():
            return list(tokenizer.encode_chat(messages, tools=tools, add_special_tokens=add_special_tokens))

    @contextlib.contextmanager
    def _template_errors(self) -> Iterator[None]:
        try:
            yield
        except ModelLoadError as exc:  # no chat template at all
            raise PromptError(f"model {self.model_name!r}: {exc}") from None
        except (ValueError, TemplateError) as exc:  # raise_exception() in the template, or no tool support
            raise PromptError(f"the chat template refused the messages: {exc}") from None

    def prompt_text(self, req: spb.GenerateRequest, sreq: SessionRequest) -> str:
        """The prompt as text, for echo: the text, the rendered chat, or the ids detokenized
        ("" for a model without a tokenizer)."""
        kind = req.WhichOneof("prompt")
        if kind == "text":
            return req.text
        if self.tokenizer is None:
            return ""
        if kind == "chat":
            return self.render_chat(req.chat, req.tools_json)
        return str(self.tokenizer.decode(sreq.prompt_ids))

    def tokenize(self, req: spb.TokenizeRequest) -> tuple[list[int], list[str]]:
        """Token ids of a TokenizeRequest's text or chat, with each id's vocabulary entry."""
        kind = req.WhichOneof("input")
        if kind is None:
            raise PromptError("the request has no input; set text or chat")
        tokenizer = self._need_tokenizer("it takes and returns token ids only")
        if kind == "text":
            size = len(req.text.encode())
        else:
            size = chat_bytes(req.chat)
            if len(req.chat.messages) > self.limits.max_chat_messages:
                raise PromptError(
                    f"chat has {len(req.chat.messages)} messages; at most {self.limits.max_chat_messages} are allowed"
                )
        if size > self.limits.max_prompt_bytes:
            raise PromptError(
                f"the input is {size} bytes; the limit is {self.limits.max_prompt_bytes} (--max-prompt-bytes)"
            )
        if kind == "text":  # the same reading as a text prompt's: markers in it are special tokens
            ids = tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens)
        else:
            ids = self.encode_chat(req.chat, add_special_tokens=req.add_special_tokens)
        return ids, [tokenizer.token_text(i) or "" for i in ids]

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        tokenizer = self._need_tokenizer("it takes and returns token ids only")
        if len(ids) > self.limits.max_prompt_bytes:
            raise PromptError(f"{len(ids)} token ids; at most {self.limits.max_prompt_bytes} (--max-prompt-bytes)")
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise PromptError(
                f"token id {bad[0]} is outside the vocabulary (ids are 0..{self.vocab_size - 1}); "
                f"{len(bad)} of the {len(ids)} ids are"
            )
        return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    async def resolve(self, req: spb.GenerateRequest, owner: str = "") -> SessionRequest:
        """The core's request for a GenerateRequest: counts and sizes first (cheap, on the loop),
        then the expensive work (tokenizing, the chat template, a grammar compile, a long id
        list) in a thread, so one heavy request does not stall the others' streams."""
        self.precheck(req)
        if self.needs_thread(req):
            sreq = await asyncio.to_thread(self.session_request, req, owner)
        else:
            sreq = self.session_request(req, owner)
        if req.echo:  # rendering a chat or decoding ids may be slow: off the loop too
            sreq = replace(sreq, echo_text=await asyncio.to_thread(self.prompt_text, req, sreq))
        return sreq

    async def resolve_workload(self, sessions: Sequence[spb.GenerateRequest], owner: str) -> list[SessionRequest]:
        """A workload's sessions: every session's cheap checks before any is tokenized, then
        each resolved. A PromptError names its session in `where`."""
        for check in (check_workload_session, self.precheck):
            for i, r in enumerate(sessions):
                with _session(i):
                    check(r)
        out = []
        for i, r in enumerate(sessions):
            with _session(i):
                out.append(await self.resolve(r, owner))
        return out

    def precheck(self, req: spb.GenerateRequest) -> None:
        """The options and the limits: counts and sizes, no token id read, nothing tokenized."""
        check_options(req)
        self.limits.check(req)

    def needs_thread(self, req: spb.GenerateRequest) -> bool:
        """Whether resolving `req` may take more than microseconds."""
        kind = req.WhichOneof("prompt")
        if kind in ("text", "chat"):
            return self.tokenizer is not None
        if req.response_format.type not in grammar.NO_CONSTRAINT:
            return True  # a compile on a cache miss
        return kind == "prompt_ids" and len(req.prompt_ids.ids) > INLINE_PROMPT_IDS

    def session_request(self, req: spb.GenerateRequest, owner: str = "") -> SessionRequest:
        if req.stop and self.tokenizer is None:
            raise PromptError(f"stop strings need a tokenizer; model {self.model_name!r} has none (use stop_token_ids)")
        prompt_ids = self.prompt_ids(req)  # before the grammar: a compile may cost the most
        self._check_response_format(req.response_format)
        return SessionRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=req.max_new_tokens,
            sampling=convert.sampling_from_request(req),
            stop_token_ids=frozenset(req.stop_token_ids),
            stop_strings=tuple(req.stop),
            eos_token_ids=frozenset() if req.ignore_eos else self.eos_token_ids,
            priority=req.priority,
            owner=owner,
        )

    def _check_response_format(self, rf: spb.ResponseFormat) -> None:
        """Refuse here, not on a worker, what the grammar cannot enforce: a worker's refusal
        would read as a failed step (compiled grammars are cached, so this is cheap)."""
        if rf.type in ("", "text") and not rf.json_schema:
            return
        if self.tokenizer is None:
            raise PromptError(
                f"response_format {rf.type!r} needs the model's vocabulary; model {self.model_name!r} has no tokenizer"
            )
        if not grammar.constraint_eos(self.eos_token_ids, self.tokenizer.eos_token_ids):
            raise PromptError(
                f"response_format {rf.type!r} needs an end-of-sequence token to end the value; "
                f"model {self.model_name!r} has none (no eos_token_id in its config)"
            )
        try:
            grammar.check_response_format(rf.type, rf.json_schema)
        except ValueError as exc:
            raise PromptError(f"response_format: {exc}") from None

    def stream(self, sreq: SessionRequest) -> TextStream:
        """The session's text as it is generated, ending at its first stop string."""
        if self.tokenizer is None:
            return NoText()
        return _DetokenizingStream(self.tokenizer, list(sreq.stop_strings))

    def token_text(self, token: int) -> str:
        """One token's text, as logprobs show it ("" for a model without a tokenizer)."""
        return str(self.tokenizer.decode([token])) if self.tokenizer is not None else ""


@contextlib.contextmanager
def _session(index: int) -> Iterator[None]:
    try:
        yield
    except PromptError as exc:
        exc.where = f"session {index}: "
        raise


def chat_bytes(chat: spb.ChatMessages) -> int:
    """The UTF-8 size of a chat's messages, every field the template may render counted."""
    return sum(
        len(m.role.encode()) + len(m.content.encode()) + len(m.tool_call_id.encode()) + len(m.tool_calls_json.encode())
        for m in chat.messages
    )


CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"


def chat_messages(chat: spb.ChatMessages, tools_ok: bool, model: str) -> list[dict[str, Any]]:
    """ChatMessages as the template's message dicts; tool messages and assistant tool calls
    only where the template renders them (`tools_ok`)."""
    if not chat.messages:
        raise PromptError("chat has no messages; send at least one")
    roles = CHAT_ROLES + ((TOOL_ROLE,) if tools_ok else ())
    out: list[dict[str, Any]] = []
    for i, m in enumerate(chat.messages):
        if m.role == TOOL_ROLE and not tools_ok:
            raise PromptError(_no_tools(model))
        if m.role not in roles:
            raise PromptError(f"chat role {m.role!r} (message {i}) is not one of {', '.join(roles)}")
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            if not tools_ok:
                raise PromptError(_no_tools(model))
            if m.role != "assistant":
                raise PromptError(f"message {i}: only assistant messages carry tool_calls_json")
            msg["tool_calls"] = _json_array(m.tool_calls_json, f"message {i}: tool_calls_json")
        if m.tool_call_id:
            if m.role != TOOL_ROLE:
                raise PromptError(f"message {i}: tool_call_id belongs on a 'tool' message")
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def parse_tools(tools_json: str, tools_ok: bool, model: str) -> list[dict[str, Any]] | None:
    """GenerateRequest.tools_json as the template's tool list (None when not set)."""
    if not tools_json:
        return None
    if not tools_ok:
        raise PromptError(_no_tools(model))
    tools = _json_array(tools_json, "tools_json")
    if not all(isinstance(t, dict) for t in tools):
        raise PromptError('tools_json must be an array of objects like {"type": "function", "function": {...}}')
    return tools


def _no_tools(model: str) -> str:
    return (
        f"model {model!r}: its chat template has no tool support; send no tools_json, "
        "no 'tool' role messages and no assistant tool_calls_json to this model"
    )


def _json_array(text: str, name: str) -> list[Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PromptError(f"{name} is not valid JSON: {exc}") from None
    except RecursionError:  # the parser's own depth limit, about a thousand levels
        raise PromptError(f"{name} is nested too deeply") from None
    if not isinstance(value, list):
        raise PromptError(f"{name} must be a JSON array, got {type(value).__name__}")
    return value

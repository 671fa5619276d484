"""Turning a GenerateRequest's prompt (token ids, text or chat) into token ids, and tokens back
into streamed text. The tokenizer lives here, at the front door, so prompt lengths are known
before admission."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvfleet.v1 import scheduler_pb2 as spb
from scheduler_svc import convert
from scheduler_svc.core import SessionRequest

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt the scheduler cannot turn into token ids; the message says what to fix."""


@dataclass(frozen=True)
class PromptLimits:
    """Bounds checked before any tokenizing, so one request cannot stall the others."""

    max_prompt_bytes: int = 256 * 1024  # text, or all chat contents together (UTF-8)
    max_chat_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_bytes: int = 256  # each stop string (UTF-8)
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, req: spb.GenerateRequest) -> None:
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
        kind = req.WhichOneof("prompt")
        if kind == "text":
            size = len(req.text.encode())
        elif kind == "chat":
            if len(req.chat.messages) > self.max_chat_messages:
                raise PromptError(
                    f"chat has {len(req.chat.messages)} messages; at most {self.max_chat_messages} are allowed"
                )
            size = sum(len(m.content.encode()) + len(m.role.encode()) for m in req.chat.messages)
        else:
            return
        if size > self.max_prompt_bytes:
            raise PromptError(
                f"the prompt is {size} bytes; the limit is {self.max_prompt_bytes} (--max-prompt-bytes); shorten it"
            )


class TextStream(Protocol):
    def push(self, token: int) -> tuple[str, bool]: ...  # (text delta, a stop string was hit)
    def flush(self) -> str: ...


class _NoText:
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
        tokenizer = None
        if name != "tiny":
            from kvfleet_models.tokenizer import Tokenizer

            tokenizer = Tokenizer.for_model(name)
        return cls(
            model_name=name,
            vocab_size=model.vocab_size,
            eos_token_ids=frozenset(model.eos_token_ids),
            tokenizer=tokenizer,
            limits=limits,
        )

    def prompt_ids(self, req: spb.GenerateRequest) -> tuple[int, ...]:
        kind = req.WhichOneof("prompt")
        if kind == "prompt_ids":
            return tuple(req.prompt_ids.ids)
        if kind is None:
            raise PromptError("the request has no prompt; set prompt_ids, text or chat")
        if self.tokenizer is None:
            raise PromptError(f"model {self.model_name!r} has no tokenizer; send prompt_ids instead of {kind}")
        if kind == "text":
            return tuple(self.tokenizer.encode(req.text))
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not messages:
            raise PromptError("chat has no messages; send at least one")
        bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
        if bad:
            raise PromptError(f"chat role {bad[0]!r} is not one of system, user, assistant")
        return tuple(self.tokenizer.encode(self.tokenizer.render_chat(messages)))

    async def resolve(self, req: spb.GenerateRequest, owner: str = "") -> SessionRequest:
        """The core's request for a GenerateRequest: size limits first (cheap), then the
        tokenizer, in a thread when there is text to tokenize, so the event loop keeps serving."""
        self.limits.check(req)
        if req.WhichOneof("prompt") in ("text", "chat") and self.tokenizer is not None:
            return await asyncio.to_thread(self.session_request, req, owner)
        return self.session_request(req, owner)

    def session_request(self, req: spb.GenerateRequest, owner: str = "") -> SessionRequest:
        if req.stop and self.tokenizer is None:
            raise PromptError(f"stop strings need a tokenizer; model {self.model_name!r} has none (use stop_token_ids)")
        return SessionRequest(
            prompt_ids=self.prompt_ids(req),
            max_new_tokens=req.max_new_tokens,
            sampling=convert.sampling_from_pb(req.sampling),
            stop_token_ids=frozenset(req.stop_token_ids),
            eos_token_ids=frozenset() if req.ignore_eos else self.eos_token_ids,
            priority=req.priority,
            owner=owner,
        )

    def stream(self, sreq: SessionRequest, stop: list[str]) -> TextStream:
        if self.tokenizer is None:
            return _NoText()
        return _DetokenizingStream(self.tokenizer, stop)

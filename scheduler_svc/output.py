"""The one output processor (vLLM v1's output_processor is the model): what a session's client
sees of its tokens. The runtime feeds it each delivered token and finish, in order; it
detokenizes incrementally, watches for stop strings, renders logprob text and closes each
session with its usage. No protobuf here: the servicer only maps what it returns.

A stop string found in the text ends the session: ``token`` says so, and the runtime finishes
the session in the core (its finish event comes back through ``finish``). Tokens already
decoded past the stop keep their ids on the stream but add no text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvfleet_common.records import record
from scheduler_svc.core.types import SessionRequest, TokenLogprob
from scheduler_svc.prompts import TextStream


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a worker's prefix cache


@dataclass(frozen=True)
class LogprobText:
    """A token's logprob with its text, and the top alternatives', as the API shows them."""

    token_id: int
    logprob: float
    text: str
    top: tuple[tuple[int, float, str], ...] = ()


@record
class TokenOutput:
    text: str  # the text this token adds ("" past a stop string, or mid-character)
    stop_hit: bool  # a stop string ended in this token's text: finish the session
    logprob: LogprobText | None


class OutputProcessor:
    """Per-session output state, opened at submit and closed at the session's end."""

    def __init__(
        self,
        text_stream: Callable[[SessionRequest], TextStream],
        token_text: Callable[[int], str],
    ) -> None:
        self._text_stream = text_stream
        self._token_text = token_text
        self._streams: dict[str, TextStream] = {}
        self._stopped: set[str] = set()

    def open(self, session_id: str, request: SessionRequest) -> None:
        self._streams[session_id] = self._text_stream(request)

    def token(self, session_id: str, token: int, logprob: TokenLogprob | None) -> TokenOutput:
        stream = self._streams.get(session_id)
        text, stop = stream.push(token) if stream is not None else ("", False)
        first_stop = stop and session_id not in self._stopped
        if first_stop:
            self._stopped.add(session_id)
        return TokenOutput(text, first_stop, self._logprob_text(logprob) if logprob is not None else None)

    def finish(self, session_id: str) -> str:
        """The session ended: the text still held back (an incomplete character, a possible stop
        string's start), and the session's state is dropped."""
        stream = self._streams.pop(session_id, None)
        self._stopped.discard(session_id)
        return stream.flush() if stream is not None else ""

    def close(self, session_id: str) -> None:
        """Forget a session that ended without a finish (dropped, cut off)."""
        self._streams.pop(session_id, None)
        self._stopped.discard(session_id)

    def _logprob_text(self, lp: TokenLogprob) -> LogprobText:
        text = self._token_text
        return LogprobText(lp.token_id, lp.logprob, text(lp.token_id), tuple((t, v, text(t)) for t, v in lp.top))

    def held(self) -> int:
        """Sessions with output state (for tests: every session's is dropped at its end)."""
        return len(self._streams)

"""Structured output: the token mask that keeps a generation inside JSON or a JSON schema.

Built on llguidance (chosen by ``python -m bench.grammar_masks``: it needs neither torch nor
transformers, and its per-token mask on SmolLM2's 49152-token vocabulary costs tens of
microseconds, well under a decode step). Two kinds, as in OpenAI's ``response_format``:

* ``json_object``: any JSON object (``{...}``; values of any type). No schema.
* ``json_schema``: a value that validates against the schema. The schema text is either a bare
  JSON Schema or OpenAI's wrapper ``{"name": ..., "schema": {...}, "strict": ...}`` (recognised
  by a ``schema`` object and no keys but name/description/schema/strict). Keywords the library
  cannot enforce are refused, never ignored, so that an accepted schema's output validates.

Whitespace between JSON tokens is bounded (an optional newline, then at most 24 spaces or
tabs): small models otherwise drift into endless indentation. A generation cut off by
max_tokens is still incomplete JSON; nothing here can prevent that.

The worker's engine uses one ``GrammarConstraint`` per session::

    mask = c.allowed_mask(); logits[~mask] = -inf; token = sample(logits); c.accept(token)
    if c.is_done(): finish            # nothing but EOS could follow

and the scheduler calls ``check_response_format`` on each request to refuse bad input early.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvfleet_models.tokenizer import Tokenizer

KINDS = ("json_object", "json_schema")
NO_CONSTRAINT = ("", "text")  # response_format types that constrain nothing
# One optional newline then a bounded indent: enough for pretty-printed JSON a dozen levels deep.
WHITESPACE = r"(\r?\n)?[ \t]{0,24}"
_OPENAI_WRAPPER_KEYS = {"name", "description", "schema", "strict"}


T = TypeVar("T")


def cache_key(kind: str, schema: str) -> bytes:
    """A fixed-size key for (kind, schema): a cache holds 32 bytes per entry, not the schema."""
    h = hashlib.sha256(kind.encode(errors="surrogatepass"))
    h.update(b"\0")
    h.update(schema.encode(errors="surrogatepass"))
    return h.digest()


@dataclass(frozen=True)
class _Refused:
    message: str  # the ValueError a compile raised, raised again on each hit


class CompileCache(Generic[T]):
    """A bounded LRU of compile results keyed by ``cache_key``, refusals included: a bad schema
    sent again is refused without compiling again. Thread-safe (compiles run in threads); two
    threads missing the same key at once may both compile, and one result is kept."""

    def __init__(self, compile_fn: Callable[[str, str], T], max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._compile = compile_fn
        self._max = max_entries
        self._entries: OrderedDict[bytes, T | _Refused] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.compiles = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind: str, schema: str) -> T:
        """The compiled (kind, schema); ValueError, from the cache or a compile, for bad input."""
        key = cache_key(kind, schema)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
        if entry is None:
            try:
                entry = self._compile(kind, schema)
            except ValueError as exc:
                entry = _Refused(str(exc))
            with self._lock:
                self.compiles += 1
                self._entries[key] = entry
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        if isinstance(entry, _Refused):
            raise ValueError(entry.message)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.compiles = 0


def check_response_format(kind: str, schema: str) -> None:
    """Raise ValueError, saying what to fix, unless (kind, schema) is a usable response format.

    "" and "text" (no constraint) pass. Results are cached (GRAMMARS), so a server may call this
    per request; a miss compiles (milliseconds to seconds for a big schema), so call it off the
    event loop.
    """
    if kind in NO_CONSTRAINT:
        if schema:
            raise ValueError(f"response_format type {kind or '(empty)'!r} takes no schema; use 'json_schema'")
        return
    GRAMMARS.get(kind, schema)


def _grammar(kind: str, schema: str) -> str:
    """The llguidance grammar for (kind, schema), checked; ValueError for bad input. Uncached:
    callers go through GRAMMARS."""
    import llguidance

    if kind == "json_object":
        if schema:
            raise ValueError("response_format 'json_object' takes no schema; use 'json_schema' to send one")
        parsed: Any = {"type": "object"}
    elif kind == "json_schema":
        parsed = _schema_object(schema)
    else:
        raise ValueError(
            f"unknown response_format type {kind!r}: expected one of 'text', {', '.join(map(repr, KINDS))}"
        )
    # Overrides win over a schema's own "x-guidance" options: no lenient mode that skips keywords.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        parsed, overrides={"whitespace_pattern": WHITESPACE, "lenient": False}
    )
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"json_schema cannot be enforced: {error}")
    return grammar


# The process's checked grammars, shared by the scheduler's checks and the workers' factories.
GRAMMARS: CompileCache[str] = CompileCache(lambda kind, schema: _grammar(kind, schema))


def _schema_object(text: str) -> dict[str, Any]:
    """The JSON Schema in ``text``, unwrapped from OpenAI's {"name", "schema", "strict"} form."""
    if not text.strip():
        raise ValueError("response_format 'json_schema' needs a schema (a JSON object)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    except RecursionError:  # the parser's own depth limit, about a thousand levels
        raise ValueError("json_schema is nested too deeply to parse") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(value).__name__}")
    if isinstance(value.get("schema"), dict) and set(value) <= _OPENAI_WRAPPER_KEYS:
        value = value["schema"]
    return value


class GrammarConstraint:
    """One session's position in its grammar: which tokens may come next.

    Built by the factory that ``constraint_factory`` returns. Not thread-safe: one session's
    steps run one after another.
    """

    def __init__(self, matcher: Any, vocab_size: int, tokenizer_vocab: int, eos_ids: tuple[int, ...]) -> None:
        self._matcher = matcher  # llguidance.LLMatcher, this session's own copy
        self._vocab_size = vocab_size
        self._tokenizer_vocab = tokenizer_vocab
        self._eos_ids = eos_ids
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # llguidance's bitmask
        self._mask: np.ndarray | None = None  # of the current state; cleared by accept()

    def allowed_mask(self) -> np.ndarray:
        """bool [vocab_size], True = may be sampled next; read-only and cached until accept()."""
        if self._mask is None:
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            # Bit i of 32-bit word w is token 32w + i: little-endian bytes, little bit order.
            mask = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self._vocab_size].view(np.bool_)
            mask[self._tokenizer_vocab :] = False  # ids the model has but the tokenizer does not
            mask.flags.writeable = False
            self._mask = mask
        return self._mask

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; ValueError (state unchanged) if it was not allowed."""
        if not 0 <= token_id < self._vocab_size or not self.allowed_mask()[token_id]:
            raise ValueError(f"token {token_id} is not allowed by the response format here")
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} refused: {self._matcher.get_error()}")
        self._mask = None

    def is_done(self) -> bool:
        """Whether the value is complete: nothing but EOS may follow (or EOS was accepted)."""
        if self._matcher.is_stopped():
            return True
        if not self._matcher.is_accepting():
            return False
        allowed = np.flatnonzero(self.allowed_mask())
        return set(allowed.tolist()) <= set(self._eos_ids)


def constraint_eos(model_eos: Iterable[int], tokenizer_eos: Iterable[int]) -> tuple[int, ...]:
    """The ids that end a constrained value: the model config's EOS, else the tokenizer's;
    () when neither names one (constrained decoding is then off: the worker builds no factory
    and the scheduler refuses response_format)."""
    return tuple(dict.fromkeys(model_eos)) or tuple(dict.fromkeys(tokenizer_eos))


def constraint_factory(
    tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]
) -> Callable[[str, str], GrammarConstraint]:
    """A ``(kind, schema) -> GrammarConstraint`` factory for one model.

    ``vocab_size`` is the model's (its logits' width); ids past the tokenizer's vocabulary are
    never allowed. ``eos_ids`` are the tokens that may end a complete value. Building the
    factory reads the whole vocabulary (~0.2 s); each (kind, schema) is compiled once and kept
    (LRU), and a session starts from a copy of the compiled matcher (microseconds).
    """
    import llguidance

    tokenizer_vocab = tokenizer.vocab_size
    if vocab_size < tokenizer_vocab:
        raise ValueError(f"model vocabulary ({vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab})")
    eos = tuple(dict.fromkeys(int(e) for e in eos_ids))
    if not eos or any(not 0 <= e < tokenizer_vocab for e in eos):
        raise ValueError(f"eos_ids must be non-empty token ids of the tokenizer, got {list(eos_ids)}")
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(eos))

    def compile_matcher(kind: str, schema: str) -> Any:
        matcher = llguidance.LLMatcher(lltok, GRAMMARS.get(kind, schema), log_level=0)
        if matcher.is_error():
            raise ValueError(f"response format cannot be enforced: {matcher.get_error()}")
        return matcher

    compiled: CompileCache[Any] = CompileCache(compile_matcher, max_entries=64)

    def make(kind: str, schema: str) -> GrammarConstraint:
        return GrammarConstraint(compiled.get(kind, schema).deep_copy(), vocab_size, tokenizer_vocab, eos)

    return make

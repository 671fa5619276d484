"""Text <-> token ids for the served model, chat rendering, and streaming helpers.

The tokenizer is rebuilt with the ``tokenizers`` library from the vocabulary a GGUF file
carries (``gguf_vocab``: byte-level BPE or SentencePiece), or read from a Hugging Face
``tokenizer.json``, so no hub download is needed.
``IncrementalDetokenizer`` turns a stream of generated ids into text deltas that never split a
UTF-8 character, and ``StopStringMatcher`` cuts a text stream at a stop string without ever
emitting a prefix of one that might still complete.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

from kvfleet_models.errors import ModelLoadError, NoTokenizerError

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"  # what a decoder emits for bytes that do not (yet) form a character
# Ids the detokenizer holds back while its text ends in U+FFFD before it looks for a point
# where that text is final: a partial UTF-8 character has at most 3 bytes, so once more than
# 4 byte-carrying ids are held, the earlier ones can no longer be part of it.
_MAX_HELD = 4
# Where the stand-ins for control tokens typed into chat strings come from: private-use code
# points (planes 15 and 16, then the BMP's area), which no template or tokenizer gives meaning.
_PRIVATE_USE = (range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE), range(0xE000, 0xF900))


def _chat_environment() -> Any:
    """A sandboxed jinja2 environment set up like transformers' apply_chat_template.

    Templates come from model files, i.e. from strangers: the immutable sandbox stops them
    from reaching Python internals or mutating our objects.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # jinja2's own tojson escapes HTML characters, which templates do not expect.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer (byte-level BPE or SentencePiece) plus the model's special ids and chat template."""

    backend: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # the ids that end generation
    add_bos: bool  # whether encode() starts with BOS (the model file says)
    chat_template: str | None
    add_eos: bool = False  # whether encode() ends with EOS (the model file says; rare)
    # The text a chat template gets as ``eos_token``: the tokenizer's own EOS, which is not
    # always the first stop id (Llama 3 Instruct's config lists <|end_of_text|> first, its
    # tokenizer's EOS is <|eot_id|>). None: the first stop id's.
    eos_token: str | None = None

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's ``tokenizer.*`` metadata (byte-level BPE or
        SentencePiece, see gguf_vocab)."""
        from kvfleet_models.gguf_loader import field_value, open_gguf
        from kvfleet_models.gguf_vocab import GgufVocab

        path = Path(path)
        reader = open_gguf(path)
        vocab = GgufVocab.read(reader, path)
        stops = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        return cls(
            backend=vocab.backend(),
            bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(s) for s in stops if s is not None)),
            add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", vocab.model == "llama")),
            add_eos=bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)),
            chat_template=field_value(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory (tokenizer.json and friends);
        NoTokenizerError when it has no tokenizer.json (its model serves token ids only)."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise NoTokenizerError(f"model directory {path} has no tokenizer.json: it takes token ids only")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
            config = _read_json(path / "tokenizer_config.json")
            model_config = _read_json(path / "config.json")
            template_file = path / "chat_template.jinja"  # where transformers 5 keeps it
            template = template_file.read_text() if template_file.is_file() else _default_template(config)
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise ModelLoadError(f"{path}: unreadable tokenizer ({e})") from None

        def token_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if token else None

        eos = model_config.get("eos_token_id", token_id("eos_token"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        own_eos = token_id("eos_token")
        bos = token_id("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None and bos is not None:
            # Llama 3's files say it only in tokenizer.json's post-processor, which encode()
            # does not run (it adds BOS itself, once): ask that post-processor.
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend=backend,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=template,
            eos_token=None if own_eos is None else backend.id_to_token(own_eos),
        )

    @classmethod
    def for_model(cls, name_or_path: str) -> Tokenizer:
        """The tokenizer for a ``--model`` value (a known name, a .gguf file or an HF directory).
        NoTokenizerError for a model that has none (tiny, an HF directory without
        tokenizer.json); ModelLoadError for one that cannot be read."""
        from kvfleet_models.registry import SourceKind, resolve_model

        source = resolve_model(name_or_path)
        if source.kind is SourceKind.TINY or source.path is None:
            raise NoTokenizerError(f"model {name_or_path!r} has no tokenizer: it takes token ids only")
        if source.kind is SourceKind.GGUF:
            return cls.from_gguf(source.path)
        return cls.from_hf_dir(source.path)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) become one id.
        With ``add_special_tokens`` the ids start with BOS when the model file asks for it."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_specials(ids, add_special_tokens)

    def _with_specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.add_eos and self.eos_token_ids:
            ids = [*ids, self.eos_token_ids[0]]
        return ids

    def _with_chat_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        # Chat templates of BOS-using families write {{ bos_token }} themselves: a second one
        # would be a prompt the model never saw in training (transformers' apply_chat_template
        # adds none; llama.cpp strips the template's). EOS never ends a prompt to answer.
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            return [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def _plain_backend(self) -> Any:
        """A copy of the backend that reads special tokens' text as ordinary text (a copy, not
        a toggle on the shared one: prompts are encoded on several threads at once)."""
        from tokenizers import Tokenizer as Backend

        plain = Backend.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special token recognised: "<|im_start|>" in it is
        spelt with ordinary tokens, as any other text."""
        ids: list[int] = self._plain_backend.encode(text, add_special_tokens=False).ids
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Token ids of a conversation by the chat template. Only the template's own control
        tokens become special ids; every string the caller sent (contents, tool calls, names,
        tool definitions) is encoded as plain text, so a "<|im_start|>" typed into a message
        cannot open a turn of another role. Equal to ``encode(render_chat(...),
        add_special_tokens=False)`` when no such string holds a special token's text, with
        BOS put first only where the model adds one and the template wrote none.

        How: each special token's text in the caller's strings is swapped for a private-use
        character before rendering, so the template sees (and may trim, split or quote) the
        strings nearly as sent; the special tokens left in the rendered text are the
        template's own. Between those, the text is encoded with the stand-ins swapped back and
        no special token recognised. A special token spelt across two strings the template
        joins with nothing between (a name then its arguments) is not caught."""
        shield = _Shield.for_strings(self.special_tokens(), list(_strings([messages, tools])), self.chat_template or "")
        text = self.render_chat(
            shield.apply(messages), add_generation_prompt, None if tools is None else shield.apply(tools)
        )
        if not shield.marks:
            return self._with_chat_bos(self.encode(text, add_special_tokens=False), add_special_tokens)
        return self._with_chat_bos(self._encode_with_template_specials(text, shield), add_special_tokens)

    def _encode_with_template_specials(self, text: str, shield: _Shield) -> list[int]:
        # The backend finds the template's special tokens (as encode() would: longest match,
        # with the tokens' own strip rules), and their offsets cut the text into plain runs.
        special_ids = set(self.special_tokens().values())
        found = self.backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for token_id, (begin, end) in zip(found.ids, found.offsets):
            if token_id in special_ids:
                ids += self.encode_plain(shield.restore(text[start:begin]))
                ids.append(token_id)
                start = end
        return ids + self.encode_plain(shield.restore(text[start:]))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry for ``token_id`` (byte-level spelling, e.g. "Ġthe"), None if unknown."""
        token: str | None = self.backend.id_to_token(token_id)
        return token

    def special_tokens(self) -> dict[str, int]:
        """The special (control) tokens of the vocabulary: text -> id."""
        decoder = self.backend.get_added_tokens_decoder()
        return {tok.content: int(i) for i, tok in decoder.items() if tok.special}

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions (it reads a ``tools`` variable)."""
        return bool(self.chat_template) and template_reads_tools(self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, by the model's own chat template. ``tools``
        (OpenAI-style definitions) is passed to templates that render them; ValueError for
        tools, tool messages or tool calls on a template that has no tool support, since it
        would silently drop them."""
        if not self.chat_template:
            raise ModelLoadError("this model has no chat template; send a plain prompt instead")
        uses_tools = tools is not None or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
        if uses_tools and not self.supports_tools:
            raise ValueError(
                "the model's chat template has no tool support: send no tools, no 'tool' messages "
                "and no assistant tool calls to this model"
            )
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else None
        eos = self.eos_token or (self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else None)
        template = _compiled_chat_template(self.chat_template)
        extra: dict[str, Any] = {"tools": tools} if tools is not None else {}
        return str(
            template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos or "",
                eos_token=eos or "",
                **extra,
            )
        )


@functools.lru_cache(maxsize=8)
def _compiled_chat_template(source: str) -> Any:
    # Compiling a template costs milliseconds; a server renders the same one for every request.
    return _chat_environment().from_string(source)


@functools.lru_cache(maxsize=8)
def template_reads_tools(source: str) -> bool:
    """Whether a chat template's source reads a ``tools`` variable it does not set itself
    (parsed, so a comment or a string that mentions "tools" does not count)."""
    from jinja2 import meta

    return "tools" in meta.find_undeclared_variables(_chat_environment().parse(source))


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dict keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


@dataclass(frozen=True)
class _Shield:
    """Special tokens' text in caller strings, swapped for characters nobody else uses."""

    marks: dict[str, str]  # special token text -> its stand-in (one private-use character)

    @classmethod
    def for_strings(cls, specials: dict[str, int], texts: list[str], template: str) -> _Shield:
        """Stand-ins for the special tokens written in ``texts``, none of them a character
        that ``texts`` or the template holds."""
        pattern = _specials_pattern(tuple(specials))
        found = sorted({m for t in texts for m in pattern.findall(t)}) if pattern else []
        if not found:
            return cls({})
        used = {c for t in [*texts, template] for c in t}
        free = (chr(c) for c in itertools.chain(*_PRIVATE_USE) if chr(c) not in used)
        marks = dict(zip(found, free))
        if len(marks) < len(found):
            raise ValueError("the messages use every private-use character; remove some")
        return cls(marks)

    def apply(self, value: Any) -> Any:
        """``value`` with the special tokens' text in its strings replaced by stand-ins."""
        if not self.marks:
            return value
        if isinstance(value, str):
            pattern = _specials_pattern(tuple(self.marks))
            assert pattern is not None
            return pattern.sub(lambda m: self.marks[m.group()], value)
        if isinstance(value, dict):
            return {self.apply(k): self.apply(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.apply(v) for v in value]
        return value

    def restore(self, text: str) -> str:
        for special, mark in self.marks.items():
            text = text.replace(mark, special)
        return text


@functools.lru_cache(maxsize=16)
def _specials_pattern(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    # Longest first: Python's alternation takes the first that matches, the tokenizer the longest.
    if not specials:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))


def _default_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat template: a string, or (older files) a list of named
    templates of which "default" is the chat one."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    A character can span several byte-level tokens (an emoji is often 2-4), and decoding a
    token on its own then gives U+FFFD. We therefore decode a short window of recent ids and
    hold text back while it ends in U+FFFD. Invariants: "".join(pushes) + flush() equals
    ``tokenizer.decode(all ids)``, and no delta holds a U+FFFD that a later id could still
    turn into a character.

    The window starts at the last point known to be a character boundary, so every push
    decodes only a few ids. Output that stays invalid UTF-8 (a run of lone or broken bytes)
    would hold the window open for ever; after ``_MAX_HELD`` held ids we look among them for
    a boundary where the text before is final and restart the window there. That test is
    exact for decoders that read bytes as UTF-8 does (byte-level BPE: every GGUF model here);
    a byte-fallback decoder, which voids a whole run of byte tokens for one bad byte, may then
    show a character its full decode would void. Where no boundary shows within
    ``2 * _MAX_HELD`` held ids (tokens that straddle broken characters; SmolLM2 has none) the
    window stays open, as before.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to text already emitted, ending on a boundary
        self._read = 0
        self._done = ""  # that text (decoded from prefix: the first id gives the rest context)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _restart(self, prefix: int, read: int) -> None:
        self._prefix, self._read = prefix, read
        self._done = self._decode(prefix, read)

    def push(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        text = self._decode(self._prefix)
        if len(text) > len(self._done) and not text.endswith(_REPLACEMENT):
            delta = text[len(self._done) :]
            self._restart(self._read, len(self._ids))
            return delta
        if text == self._done:  # nothing new (a skipped special token): no need to re-decode it
            self._restart(self._read, len(self._ids))
            return ""
        if _MAX_HELD < len(self._ids) - self._read <= 2 * _MAX_HELD:
            return self._emit_final_part(text)
        return ""

    def _emit_final_part(self, text: str) -> str:
        """The text before the latest held boundary ``b`` that decoding from ``b`` on its own
        reproduces (so the bytes before it are settled), with the window restarted at ``b``;
        "" if there is none."""
        ids = len(self._ids)
        for b in range(ids - 1, self._read, -1):
            head, tail = self._decode(self._prefix, b), self._decode(b)
            # With the id at b in view, a U+FFFD at the end of head is final: had the id's
            # first byte continued that character, head + tail would have more U+FFFD.
            if tail and head + tail == text and head.startswith(self._done):
                delta = head[len(self._done) :]
                self._prefix, self._read, self._done = b, b, ""
                return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end of the stream)."""
        rest = self._decode(self._prefix)[len(self._done) :]
        self._restart(len(self._ids), len(self._ids))
        return rest


class StopResult(NamedTuple):
    text: str  # safe to emit now
    stopped: bool  # a stop string was found; ``text`` ends just before it


class StopStringMatcher:
    """Finds stop strings in streamed text, which may arrive split across any deltas.

    Text that could be the start of a stop string is held back until the next delta shows
    whether it is one; the stop string itself is never emitted.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> StopResult:
        if self._stopped:
            return StopResult("", True)
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held, self._stopped = "", True
            return StopResult(text[: min(hits)], True)
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The held-back text, at the end of a stream that never hit a stop string."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

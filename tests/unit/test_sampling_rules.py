"""One sampling rule for three layers: the gateway's body conversion, the scheduler's admission
and the worker's SamplingSpec refuse exactly the same values, naming the same field, and take
the same edge values (kvfleet_common.sampling_rules holds the rule; each layer calls it)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway_svc.openai_schema import Endpoint, SchemaError, parse_request
from kvfleet_common.sampling_rules import REQUEST_NAMES, SamplingRuleError, SamplingValues, validate
from scheduler_svc.core import AdmissionRejected, Sampling, SessionRequest
from scheduler_svc.core.admission import ModelBounds, check_request
from scheduler_svc.core.limits import SchedulerLimits
from worker_svc.sampling import SamplingSpec

JSON_SCHEMA = '{"type": "object"}'


# (the rule's field name, the core's / worker's values, the same values as an OpenAI chat body)
BAD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("temperature", {"temperature": -0.1}, {"temperature": -0.1}),
    ("temperature", {"temperature": 2.01}, {"temperature": 2.01}),
    ("temperature", {"temperature": float("nan")}, {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}, {"top_p": 0}),
    ("top_p", {"top_p": 1.01}, {"top_p": 1.01}),
    ("min_p", {"min_p": -0.01}, {"min_p": -0.01}),
    ("min_p", {"min_p": 1.01}, {"min_p": 1.01}),
    ("presence_penalty", {"presence_penalty": -2.01}, {"presence_penalty": -2.01}),
    ("presence_penalty", {"presence_penalty": 2.01}, {"presence_penalty": 2.01}),
    ("frequency_penalty", {"frequency_penalty": 2.5}, {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": float("inf")}, {"frequency_penalty": float("inf")}),
    ("repetition_penalty", {"repetition_penalty": 0.0}, {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}, {"repetition_penalty": -1}),
    ("repetition_penalty", {"repetition_penalty": float("inf")}, {"repetition_penalty": float("inf")}),
    ("top_k", {"top_k": -2}, {"top_k": -2}),
    ("top_k", {"top_k": 2**32}, {"top_k": 2**32}),
    ("seed", {"seed": 2**64}, {"seed": 2**64}),
    ("logit_bias", {"logit_bias": ((5, 100.5),)}, {"logit_bias": {"5": 100.5}}),
    ("logit_bias", {"logit_bias": ((5, -101.0),)}, {"logit_bias": {"5": -101}}),
    ("logit_bias", {"logit_bias": ((2**32, 1.0),)}, {"logit_bias": {str(2**32): 1}}),
    (
        "logit_bias",
        {"logit_bias": tuple((i, 1.0) for i in range(301))},
        {"logit_bias": {str(i): 1 for i in range(301)}},
    ),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": 2}, {"top_logprobs": 2}),
    ("constraint", {"constraint": "xml"}, {"response_format": {"type": "xml"}}),
    (
        "constraint_schema",
        {"constraint": "json_schema", "constraint_schema": "[1]"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
    ),
]

# The edges of each range, taken by all three.
GOOD: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"temperature": 0.0}, {"temperature": 0}),
    ({"temperature": 2.0}, {"temperature": 2}),
    ({"top_p": 1e-9}, {"top_p": 1e-9}),
    ({"top_p": 1.0}, {"top_p": 1}),
    (
        {"min_p": 0.0, "presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"min_p": 0, "presence_penalty": -2, "frequency_penalty": 2},
    ),
    (
        {"min_p": 1.0, "presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"min_p": 1, "presence_penalty": 2, "frequency_penalty": -2},
    ),
    ({"repetition_penalty": 1e-6}, {"repetition_penalty": 1e-6}),
    ({"repetition_penalty": 1e6}, {"repetition_penalty": 1e6}),
    ({"top_k": 0}, {"top_k": 0}),
    ({"top_k": 2**32 - 1}, {"top_k": 2**32 - 1}),
    ({"seed": 0}, {"seed": 0}),
    ({"seed": 2**64 - 1}, {"seed": 2**64 - 1}),
    ({"logit_bias": ((0, -100.0), (2**32 - 1, 100.0))}, {"logit_bias": {"0": -100, str(2**32 - 1): 100}}),
    ({"logit_bias": tuple((i, 0.0) for i in range(300))}, {"logit_bias": {str(i): 0 for i in range(300)}}),
    ({"logprobs": True, "top_logprobs": 20}, {"logprobs": True, "top_logprobs": 20}),
    ({"constraint": "json_object"}, {"response_format": {"type": "json_object"}}),
    (
        {"constraint": "json_schema", "constraint_schema": JSON_SCHEMA},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    ),
]


def _gateway(body: dict[str, Any]) -> None:
    parse_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def _scheduler(values: dict[str, Any]) -> None:
    check_request(SessionRequest((1, 2), 4, Sampling(**values)), SchedulerLimits(), ModelBounds())


def _worker(values: dict[str, Any]) -> None:
    SamplingSpec(**values)


def _id(case: tuple) -> str:
    return f"{case[0]}={str(case[1])[:40]}"


@pytest.mark.parametrize("case", BAD, ids=[_id(c) for c in BAD])
def test_every_layer_refuses_the_value_naming_the_same_field(case) -> None:
    field, values, body = case
    request_name = REQUEST_NAMES.get(field, field)  # what the gateway's and scheduler's callers call it
    with pytest.raises(SchemaError) as gateway:
        _gateway(body)
    assert gateway.value.param == request_name
    with pytest.raises(AdmissionRejected) as scheduler:
        _scheduler(values)
    assert scheduler.value.message.startswith(request_name + " ")
    with pytest.raises(SamplingRuleError) as worker:
        _worker(values)
    assert worker.value.field == field and str(worker.value).startswith(field + " ")


@pytest.mark.parametrize("case", GOOD, ids=[str(c[0])[:50] for c in GOOD])
def test_every_layer_takes_the_edge_values(case) -> None:
    values, body = case
    _gateway(body)
    _scheduler(values)
    _worker(values)


# Deliberate differences: the gateway's JSON takes two aliases that OpenAI's and vLLM's servers
# take, and maps them into the rule's range before it applies, so no layer past it sees them.
@pytest.mark.parametrize(
    ("body", "field", "mapped", "why"),
    [
        ({"top_k": -1}, "top_k", 0, "vLLM's top_k -1 means off, which is the rule's 0"),
        ({"seed": -1}, "seed", 2**64 - 1, "a signed 64-bit seed is taken mod 2**64 (the proto's uint64)"),
    ],
)
def test_the_gateways_aliases_map_into_the_rule(body, field, mapped, why) -> None:
    req = parse_request(Endpoint.COMPLETIONS, {"model": "m", "prompt": "x", **body})
    assert getattr(req.sampling, field) == mapped, why
    with pytest.raises(SamplingRuleError, match=field):
        validate(SamplingValues(**body))


def test_messages_give_the_allowed_range() -> None:
    with pytest.raises(SamplingRuleError) as info:
        validate(SamplingValues(temperature=3.0))
    assert str(info.value) == "temperature must be in [0, 2] (0 = greedy), got 3.0"
    with pytest.raises(SamplingRuleError) as info:
        validate(SamplingValues(logit_bias=((7, 1.0),)), vocab_size=5)
    assert str(info.value) == "logit_bias token id 7 is outside the vocabulary 0..4"


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field() -> None:
    """A prompt id the model has no row for, and a stop id it can never sample (which used to be
    taken and never stop anything)."""
    bounds, limits = ModelBounds(vocab_size=100), SchedulerLimits()
    check_request(SessionRequest((1, 99), 4, stop_token_ids=frozenset({0, 99})), limits, bounds)  # the edges
    with pytest.raises(AdmissionRejected, match=r"^prompt token id 100 is outside the vocabulary 0\.\.99$"):
        check_request(SessionRequest((1, 100), 4), limits, bounds)
    with pytest.raises(AdmissionRejected, match=r"^stop token id 100 is outside the vocabulary 0\.\.99$"):
        check_request(SessionRequest((1, 2), 4, stop_token_ids=frozenset({100, 7, 10**8})), limits, bounds)
    check_request(SessionRequest((1, 2), 4, stop_token_ids=frozenset({10**8})), limits, ModelBounds())  # not known yet

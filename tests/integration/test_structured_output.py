"""response_format through the scheduler's gRPC API on smollm2: the worker's grammar masks every
step, so the output parses (json_object) and validates (json_schema), greedy or sampled, and the
session ends (STOP) when the value is complete; what the grammar cannot enforce is refused."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from kvfleet.client import SchedulerClient
from kvfleet.v1 import scheduler_pb2 as spb
from tests.integration.inproc import InProcessCluster

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "member": {"type": "boolean"},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "member", "role"],
        "additionalProperties": False,
    },
    "cities": {
        "type": "object",
        "properties": {
            "cities": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 3}
        },
        "required": ["cities"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(smollm2_cluster):
    with SchedulerClient(smollm2_cluster.address) as cl:
        yield cl


def _chat(question: str, rf: spb.ResponseFormat, temperature: float = 0.0, seed: int = 0) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        chat=spb.ChatMessages(messages=[spb.ChatMessage(role="user", content=question)]),
        max_new_tokens=200,
        sampling=spb.SamplingParams(temperature=temperature, seed=seed),
        response_format=rf,
    )


def _run(client: SchedulerClient, req: spb.GenerateRequest) -> tuple[str, spb.GenerateEvent]:
    events = list(client.stream(req, timeout=300))
    return "".join(ev.text for ev in events), events[-1]


def test_json_object_parses_as_an_object(client):
    text, last = _run(
        client, _chat("Give a JSON object with a cat's name and age.", spb.ResponseFormat(type="json_object"))
    )
    assert isinstance(json.loads(text), dict), text
    assert last.finish_reason == spb.FINISH_STOP, "ends when the value is complete"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, name, temperature):
    rf = spb.ResponseFormat(type="json_schema", json_schema=json.dumps({"name": name, "schema": SCHEMAS[name]}))
    text, last = _run(client, _chat(f"Give me a {name} record.", rf, temperature, seed=11))
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert last.finish_reason == spb.FINISH_STOP


def test_unconstrained_output_of_the_same_prompt_is_not_json(client):
    """The constraint is what makes the output JSON: without it this prompt's answer is prose."""
    text, _ = _run(client, _chat("Give me a person record.", spb.ResponseFormat()))
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize(
    "rf, says",
    [
        (spb.ResponseFormat(type="xml"), "xml"),
        (spb.ResponseFormat(type="json_schema", json_schema="{not json"), "json_schema"),
        (spb.ResponseFormat(type="json_schema", json_schema='{"type": "string", "format": "no-such"}'), "format"),
        (spb.ResponseFormat(type="json_object", json_schema='{"type": "object"}'), "json_object"),
    ],
)
def test_what_the_grammar_cannot_enforce_is_invalid_argument(client, rf, says):
    with pytest.raises(grpc.RpcError) as err:
        _run(client, _chat("hi", rf))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in err.value.details() and "response_format" in err.value.details()
    still = _chat("Say hi.", spb.ResponseFormat(type="json_object"))
    still.max_new_tokens = 1  # still serving, constrained requests too: one token shows it
    _, last = _run(client, still)
    assert last.finish_reason == spb.FINISH_LENGTH and last.usage.output_tokens == 1


def test_tiny_model_refuses_response_format():
    with InProcessCluster(workers=1, model="tiny") as c, SchedulerClient(c.address) as cl:
        req = spb.GenerateRequest(
            prompt_ids=spb.TokenIds(ids=[1, 2]),
            max_new_tokens=2,
            response_format=spb.ResponseFormat(type="json_object"),
        )
        with pytest.raises(grpc.RpcError) as err:
            list(cl.stream(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no tokenizer" in err.value.details()

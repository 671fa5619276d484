"""The gateway's OpenAI fidelity, through the official `openai` client, on the real model.

Each implemented field once (penalties, logit_bias, logprobs, n, echo, response_format, tools,
cached tokens), checked against the scheduler's gRPC answer to the same request where the two
front doors must agree; refused fields are a BadRequestError naming the field; vLLM's
/tokenize, /detokenize and /version routes.
"""

from __future__ import annotations

import importlib.metadata
import json

import jsonschema
import openai
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.v1 import scheduler_pb2 as spb
from tests.helpers.gateway import http
from tests.helpers.telemetry_db import wait_for_session_span

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "Describe a cat in one sentence."}]


@pytest.fixture(scope="module")
def cluster(smollm2_services):
    return smollm2_services[0]


@pytest.fixture(scope="module")
def gateway(smollm2_services):
    return smollm2_services[1]


@pytest.fixture(scope="module")
def client(gateway):
    return gateway.client()


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with SchedulerClient(cluster.scheduler_address) as c:
        yield c


def _grpc_events(grpc_client: SchedulerClient, req: spb.GenerateRequest) -> list[spb.GenerateEvent]:
    return list(grpc_client.stream(req))


# ---- sampling --------------------------------------------------------------------------------


def test_penalties_change_the_output(client):
    prompt = "one two one two one two one two one two"

    def text(**kw):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, **kw)
        return got.choices[0].text

    plain = text()
    assert text(presence_penalty=2.0) != plain
    assert text(frequency_penalty=2.0) != plain
    assert text() == plain  # greedy repeats: the difference is the penalty's


def test_logit_bias_bans_a_token(client, grpc_client, gateway):
    prompt = "The capital of France is"
    want = grpc_client.generate(build_request(prompt, 6, temperature=0.0))
    banned = want.token_ids[0]
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(banned): -100}, logprobs=1
    )
    status, tokenized, _ = http("POST", gateway.url + "/tokenize", {"model": MODEL, "prompt": want.text})
    assert status == 200 and tokenized["tokens"][0] == banned
    first = got.choices[0].logprobs.tokens[0]
    banned_text = http("POST", gateway.url + "/detokenize", {"model": MODEL, "tokens": [banned]})[1]["prompt"]
    assert first != banned_text and got.choices[0].text != want.text
    # and the same through gRPC
    req = build_request(prompt, 6, temperature=0.0)
    req.sampling.logit_bias[banned] = -100
    assert banned not in grpc_client.generate(req).token_ids


def test_extra_vllm_sampling_fields_are_taken(client):
    got = client.completions.create(
        model=MODEL,
        prompt="My favourite animal is",
        max_tokens=8,
        temperature=1.0,
        seed=3,
        extra_body={"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.1},
    )
    greedy_ish = client.completions.create(
        model=MODEL,
        prompt="My favourite animal is",
        max_tokens=8,
        temperature=1.0,
        seed=4,
        extra_body={"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.1},
    )
    assert got.choices[0].text == greedy_ish.choices[0].text  # top_k=1: the seed no longer matters


# ---- logprobs --------------------------------------------------------------------------------


def test_chat_logprobs_agree_with_grpc(client, grpc_client):
    got = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    req = build_request(USER, 8, temperature=0.0)
    req.logprobs, req.top_logprobs = True, 3
    events = _grpc_events(grpc_client, req)
    want = [lp for ev in events for lp in ev.logprobs]
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == len(want) > 0
    for entry, lp in zip(content, want, strict=True):
        assert entry.token == lp.text and entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert bytes(entry.bytes) == entry.token.encode()
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(t <= 0 for t in tops)
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the likeliest
    assert "".join(e.token for e in content) == got.choices[0].message.content


def test_completion_logprobs_shape(client):
    got = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    n = got.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == got.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(
        len(top) <= 2 and max(top.values()) == pytest.approx(t) for top, t in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_streamed_logprobs(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True, stream=True
        )
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6
    assert "".join(e.token for e in entries) == "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ---- n and echo ------------------------------------------------------------------------------


def test_n_gives_distinct_seeded_choices(client, grpc_client):
    def sample():
        return client.completions.create(
            model=MODEL,
            prompt="My favourite animal is",
            max_tokens=12,
            temperature=1.0,
            seed=11,
            n=3,
            extra_body={"ignore_eos": True},
        )

    got = sample()
    assert [c.index for c in got.choices] == [0, 1, 2]
    texts = [c.text for c in got.choices]
    assert len(set(texts)) == 3, texts
    assert [c.text for c in sample().choices] == texts  # seeded: seed, seed+1, seed+2
    assert got.usage.completion_tokens == 3 * 12
    # The gRPC front door: the same request, the same three choices.
    req = build_request("My favourite animal is", 12, temperature=1.0, seed=11, ignore_eos=True)
    req.n = 3
    by_index: dict[int, str] = {}
    for ev in _grpc_events(grpc_client, req):
        by_index[ev.index] = by_index.get(ev.index, "") + ev.text
    assert [by_index[i] for i in range(3)] == texts


def test_n_streams_every_choice(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=5, temperature=1.0, seed=5, n=2, stream=True
        )
    )
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


def test_echo_prepends_the_prompt(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


# ---- structured output and tools --------------------------------------------------------------


def test_response_format_json_object(client):
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Reply with a JSON object like {"name": "Tom"} naming a cat.'}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
    assert isinstance(json.loads(got.choices[0].message.content), dict)


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
        "required": ["name", "legs"],
        "additionalProperties": False,
    }
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name an animal and its number of legs, as JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}},
    )
    assert got.choices[0].finish_reason == "stop", got.choices[0].message.content
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)


def test_tools_on_a_template_without_them_are_a_400(client):
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[tool])
    assert "tool" in info.value.body["message"].lower()
    # tool_choice "none": the tools are not sent, the model answers in text
    got = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, tools=[tool], tool_choice="none")
    assert got.choices[0].message.content
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tool_choice="none").choices


# ---- usage -----------------------------------------------------------------------------------


def test_cached_prompt_tokens_are_reported(client, cluster):
    prompt = "Here is a long shared preamble that repeats across requests. " * 6 + "Question:"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a prompt never seen before
    n = second.usage.prompt_tokens
    assert n == first.usage.prompt_tokens > 2 * cluster.spec.block_size
    # The worker reuses the full blocks of the prompt but the last token (which must still be
    # run for its logits): every whole block of the first n - 1 tokens.
    bs = cluster.spec.block_size
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // bs * bs


def test_a_long_prompt_is_served_within_the_workers_cache(client, grpc_client):
    """The scheduler's default KV budget is the workers' caches (here 256 blocks: 4,096 tokens):
    a prompt of about 1,500 tokens, more KV than the 64 MiB the scheduler once capped every
    cluster at (1,456 SmolLM2 tokens in float32), is served, not refused with kv_budget."""
    got = client.completions.create(model=MODEL, prompt="sea " * 1500, max_tokens=2, temperature=0)
    snap = grpc_client.telemetry()
    per_token = grpc_client.list_workers()[0].kv_bytes_per_token
    assert got.usage.prompt_tokens * per_token > 64 * 1024 * 1024
    assert got.choices[0].finish_reason == "length"
    assert snap.kv_budget_bytes == sum(w.kv_capacity_tokens * w.kv_bytes_per_token for w in grpc_client.list_workers())


# ---- refused fields --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint, field, kwargs",
    [
        ("completions", "best_of", {"best_of": 2}),
        ("completions", "suffix", {"suffix": "the end"}),
        ("completions", "echo", {"echo": True, "logprobs": 1}),
        ("chat", "audio", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}),
        ("chat", "store", {"store": True}),
        ("chat", "reasoning_effort", {"reasoning_effort": "low"}),
        ("chat", "prediction", {"prediction": {"type": "content", "content": "x"}}),
        ("chat", "tool_choice", {"tool_choice": "required"}),
        ("chat", "frobnicate", {"extra_body": {"frobnicate": 1}}),
    ],
)
def test_refused_fields_name_the_field(client, endpoint, field, kwargs):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **kwargs)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] in (field, "modalities", "audio") and field in info.value.body["message"]


# ---- vLLM's utility routes ---------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(gateway, grpc_client):
    text = "Hello, world! Ça va?"
    status, body, _ = http("POST", gateway.url + "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] >= 2048
    # the same ids the scheduler generates from
    want = grpc_client.generate(build_request(text, 1, temperature=0.0))
    assert body["tokens"] == list(want.prompt_token_ids)
    status, back, _ = http("POST", gateway.url + "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == text
    status, chat, _ = http("POST", gateway.url + "/tokenize", {"model": MODEL, "messages": USER})
    assert status == 200 and chat["count"] > body["count"]  # the template's turn markers
    assert chat["tokens"] == list(grpc_client.generate(build_request(USER, 1, temperature=0.0)).prompt_token_ids)
    assert http("POST", gateway.url + "/tokenize", {"model": "gpt-4o", "prompt": "x"})[0] == 404
    assert http("POST", gateway.url + "/detokenize", {"model": MODEL, "tokens": "x"})[0] == 400


def test_version_and_models(gateway, client):
    status, body, _ = http("GET", gateway.url + "/version")
    assert status == 200 and body == {"version": importlib.metadata.version("kvfleet")}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] >= 2048


def test_request_id_names_the_response_and_the_session_span(client, cluster):
    """A body's request_id (vLLM's extension) is the response's id after its prefix, in every
    streamed chunk too, and reaches the scheduler's session span (kvfleet.request.id)."""
    rid = "http-rid-42"
    done = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, temperature=0, extra_body={"request_id": rid}
    )
    assert done.id == f"cmpl-{rid}"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=2, stream=True, extra_body={"request_id": rid + "-chat"}
        )
    )
    assert chunks and {c.id for c in chunks} == {f"chatcmpl-{rid}-chat"}
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=1).id.startswith("cmpl-")

    attrs = wait_for_session_span(cluster.log_dir / "telemetry.db", "kvfleet.request.id", rid)
    assert attrs["gen_ai.request.model"] == MODEL

"""Out-of-range integers, oversized arrays and maps, and malformed strings are refused as the
caller's error, naming the field: 400 on a real gateway, INVALID_ARGUMENT on the scheduler's
gRPC API; never a 500/INTERNAL (tests/unit/test_cheap_checks.py: the order of the checks)."""

from __future__ import annotations

import json

import grpc
import pytest

from kvfleet.client import build_request
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet.v1 import scheduler_pb2_grpc as spb_grpc
from tests.helpers.gateway import http

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
U32 = "0..4294967295"


def _c(**fields) -> dict:
    return {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, **fields}


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        (C, _c(max_tokens=10**30), "max_tokens", "max_tokens must be in 1..4294967295, got 1" + "0" * 30),
        (C, _c(max_tokens=2**32), "max_tokens", "max_tokens must be in 1..4294967295, got 4294967296"),
        (CHAT, _chat(max_completion_tokens=2**40), "max_completion_tokens", "in 1..4294967295"),
        (C, _c(seed=2**70), "seed", "seed must be in -9223372036854775808..18446744073709551615"),
        (C, _c(seed=-(2**63) - 1), "seed", "seed must be in -9223372036854775808.."),
        (C, _c(n=2**40), "n", "n must be in 1..16"),
        (CHAT, _chat(logprobs=True, top_logprobs=10**12), "top_logprobs", "top_logprobs must be in 0..20"),
        (C, _c(logprobs=2**40), "logprobs", "logprobs must be in 0..20"),
        (C, _c(top_k=2**40), "top_k", "top_k must be in -1..4294967295"),
        (C, _c(prompt=[1, 2**40]), "prompt", f"prompt token ids must be in {U32}"),
        (C, _c(logit_bias={"9999999999": 1}), "logit_bias", f"decimal integers in {U32}"),
        (C, _c(logit_bias={"a": 1}), "logit_bias", "logit_bias keys must be token ids"),
        (C, _c(logit_bias={str(i): 1 for i in range(301)}), "logit_bias", "301 entries; at most 300"),
        (C, _c(stop=["x"] * 17), "stop", "17 strings; at most 16"),
        (CHAT, _chat(messages=USER * 1025), "messages", "1025 messages; at most 1024"),
        (CHAT, _chat(tools=[1]), "tools[0]", "tools[0] must be"),
        (CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}] * 129), "tools", "at most 128"),
        (C, _c(prompt="\ud800"), "prompt", "not valid Unicode"),
        (CHAT, _chat(messages=[{"role": "user", "content": "a\udc00"}]), "messages[0].content", "not valid Unicode"),
        (C, _c(repetition_penalty=float("inf")), "repetition_penalty", "must be a number > 0"),
    ],
)
def test_out_of_range_fields_are_a_400_naming_the_field(tiny_gateway, path, body, param, says) -> None:
    _, gateway = tiny_gateway
    status, answer, _ = http("POST", gateway.url + path, json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert says in answer["error"]["message"]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"model": "tiny", "prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", "number out of range"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', "not valid Unicode"),  # a raw surrogate (CESU-8)
        (b'{"model": "\\ud800", "prompt": [1]}', "model is not valid Unicode"),
    ],
)
def test_malformed_bodies_are_a_400(tiny_gateway, raw: bytes, says: str) -> None:
    _, gateway = tiny_gateway
    status, answer, _ = http("POST", gateway.url + C, raw)
    assert status == 400, answer
    assert says in answer["error"]["message"]


def test_the_body_limit_follows_the_prompt_limit(tiny_gateway) -> None:
    from gateway_svc.config import GatewayConfig

    _, gateway = tiny_gateway
    limit = GatewayConfig().max_body_bytes
    assert limit < 2 * 1024 * 1024  # was 16 MiB: 64x the default prompt limit
    over = json.dumps(_c(prompt="x" * limit)).encode()
    status, answer, _ = http("POST", gateway.url + C, over)
    assert status == 413 and "--max-prompt-bytes" in answer["error"]["message"]
    # a prompt at the scheduler's own limit, escaped as \uXXXX all through, still fits the body
    at_limit = json.dumps(_c(prompt="\u00e9" * (128 * 1024)), ensure_ascii=True).encode()
    assert len(at_limit) < limit
    status, answer, _ = http("POST", gateway.url + C, at_limit)
    assert status == 400 and "no tokenizer" in answer["error"]["message"]  # read, parsed, refused upstream


def test_an_error_quoting_a_lone_surrogate_still_answers_json(tiny_gateway) -> None:
    _, gateway = tiny_gateway
    status, answer, _ = http("POST", gateway.url + C, b'{"model": "tiny", "prompt": [1], "\\udfff": 1}')
    assert status == 400 and answer["error"]["message"].startswith("unknown field")


# ---- the scheduler's gRPC API ------------------------------------------------------------------


def _rpc(cluster, req: spb.GenerateRequest) -> tuple[grpc.StatusCode | None, str]:
    with grpc.insecure_channel(cluster.address) as ch:
        try:
            list(spb_grpc.SchedulerStub(ch).Generate(req, timeout=30))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return None, ""


def _req(**fields) -> spb.GenerateRequest:
    req = build_request([1, 2, 3], 2)
    for name, value in fields.items():
        target = req.sampling if name in ("top_k", "seed") else req
        setattr(target, name, value)
    return req


def _bias(n: int, token: int = 1) -> spb.GenerateRequest:
    req = build_request([1, 2, 3], 2)
    req.sampling.logit_bias.update({token + i: 1.0 for i in range(n)})
    return req


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (_req(max_new_tokens=2**32 - 1), "max_new_tokens 4294967295 exceeds the limit"),
        (_req(n=2**32 - 1), "n is 4294967295"),
        (_req(top_logprobs=2**32 - 1, logprobs=True), "top_logprobs must be in 0..20"),
        (_req(priority=-(2**31)), "priority must be in"),
        (_req(top_k=2**32 - 1, seed=2**64 - 1), None),  # in range for the worker: served
        (_bias(1, token=2**32 - 1), "logit_bias token id 4294967295 is outside the vocabulary"),
        (_bias(301), "logit_bias has 301 entries"),
        (build_request([1] * 4097 + [2**32 - 1], 2), "prompt_too_long: the prompt has 4098 tokens; the limit is 4096"),
        (build_request([1, 2**32 - 1], 2, echo=True), "token id 4294967295 is outside the vocabulary"),
    ],
)
def test_scheduler_refuses_out_of_range_values_as_invalid_argument(tiny_gateway, req, says) -> None:
    cluster, _ = tiny_gateway
    code, details = _rpc(cluster, req)
    if says is None:
        assert code is None, details
    else:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert says in details

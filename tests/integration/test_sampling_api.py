"""Sampling controls and logprobs through the real scheduler gRPC API on a two-worker tiny cluster:
logit_bias, penalties, min_p, seeded draws in and out of a batch, logprobs on every event,
Usage.cached_tokens, and INVALID_ARGUMENT for values out of range."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvfleet.client import SchedulerClient
from kvfleet.v1 import scheduler_pb2 as spb
from kvfleet_models.config import tiny_config
from kvfleet_models.reference import reference_logits
from kvfleet_models.tiny import tiny_weights
from tests.integration.inproc import InProcessCluster

CFG = tiny_config()
WEIGHTS = tiny_weights(CFG, seed=0)
PROMPT = [5, 6, 7]


def _request(n: int, prompt=PROMPT, **kw) -> spb.GenerateRequest:
    sampling = kw.pop("sampling", spb.SamplingParams())
    return spb.GenerateRequest(
        prompt_ids=spb.TokenIds(ids=prompt), max_new_tokens=n, ignore_eos=True, sampling=sampling, **kw
    )


def _generate(client: SchedulerClient, req: spb.GenerateRequest) -> tuple[list[int], list[spb.GenerateEvent]]:
    events = list(client.stream(req, timeout=60))
    return [t for ev in events for t in ev.token_ids], events


def test_logit_bias_bans_and_forces_tokens(cluster):
    with SchedulerClient(cluster.address) as client:
        plain, _ = _generate(client, _request(6))
        banned, _ = _generate(client, _request(6, sampling=spb.SamplingParams(logit_bias={plain[0]: -100})))
        forced, _ = _generate(client, _request(6, sampling=spb.SamplingParams(logit_bias={(plain[0] + 1) % 48: 100})))
    assert banned[0] != plain[0]
    assert plain[0] not in banned
    assert forced == [(plain[0] + 1) % 48] * 6


def test_large_penalties_leave_no_repeated_token(cluster):
    n = 16
    with SchedulerClient(cluster.address) as client:
        plain, _ = _generate(client, _request(n))
        strong = spb.SamplingParams(presence_penalty=2, frequency_penalty=2, repetition_penalty=50)
        penalised, _ = _generate(client, _request(n, sampling=strong))
    assert len(set(plain)) < n, "the tiny model's greedy output repeats itself (else this test shows nothing)"
    assert len(set(penalised)) == n, penalised


def test_logprobs_on_every_event_match_the_model(cluster):
    n = 8
    with SchedulerClient(cluster.address) as client:
        tokens, events = _generate(client, _request(n, logprobs=True, top_logprobs=5))
        _, plain_events = _generate(client, _request(2))
    assert all(not ev.logprobs for ev in plain_events), "no logprobs unless asked"
    per_token = []
    for ev in events:
        assert len(ev.logprobs) == len(ev.token_ids)
        per_token += list(ev.logprobs)
    assert [lp.token_id for lp in per_token] == tokens
    ref = reference_logits(CFG, WEIGHTS, PROMPT + tokens[:-1])[len(PROMPT) - 1 :]
    for lp, row in zip(per_token, ref):
        logsm = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        values = [t.logprob for t in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert lp.top[0].token_id == lp.token_id, "greedy picks the most likely token"
        assert lp.logprob == pytest.approx(lp.top[0].logprob)
        assert lp.logprob == pytest.approx(float(logsm[lp.token_id]), abs=1e-3)
        assert lp.text == "" and all(t.text == "" for t in lp.top), "tiny has no tokenizer"


def test_seeded_sampling_with_penalties_is_the_same_alone_and_in_a_batch(cluster):
    def sampling(seed: int) -> spb.SamplingParams:
        return spb.SamplingParams(
            temperature=1.3, top_k=30, min_p=0.02, seed=seed, presence_penalty=0.7, frequency_penalty=0.3
        )

    mine = _request(12, [9, 8, 7, 6], sampling=sampling(42))
    others = [
        _request(8 + i, [i + 1, 2 * i + 1], sampling=spb.SamplingParams(temperature=0.9, seed=i, frequency_penalty=1))
        for i in range(5)
    ]
    with SchedulerClient(cluster.address) as client:
        alone, _ = _generate(client, mine)
        again, _ = _generate(client, mine)
        batch = {i: [] for i in range(6)}
        for ev in client.stub.SubmitWorkload(
            spb.WorkloadRequest(sessions=[*others[:3], mine, *others[3:]]), timeout=60
        ):
            if not ev.done:
                batch[ev.session_index].extend(ev.event.token_ids)
        other_seed, _ = _generate(client, _request(12, [9, 8, 7, 6], sampling=sampling(43)))
    assert alone == again == batch[3]
    assert other_seed != alone


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"sampling": spb.SamplingParams(presence_penalty=2.5)}, "presence_penalty"),
        ({"sampling": spb.SamplingParams(frequency_penalty=-3)}, "frequency_penalty"),
        ({"sampling": spb.SamplingParams(repetition_penalty=-1)}, "repetition_penalty"),
        ({"sampling": spb.SamplingParams(min_p=1.5)}, "min_p"),
        ({"sampling": spb.SamplingParams(logit_bias={48: 1})}, "logit_bias token id 48"),
        ({"sampling": spb.SamplingParams(logit_bias={3: 150})}, "logit_bias for token 3"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        # tiny has no vocabulary to build a grammar over (smollm2's refusals: test_structured_output)
        ({"response_format": spb.ResponseFormat(type="json_object")}, "response_format 'json_object' needs"),
    ],
)
def test_out_of_range_values_are_invalid_argument_naming_the_field(cluster, kw, field):
    with SchedulerClient(cluster.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            _generate(client, _request(3, **kw))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        ok, _ = _generate(client, _request(2))  # the service keeps serving
    assert len(ok) == 2


def test_usage_reports_prefix_cached_prompt_tokens():
    prompt = [(7 * i + 2) % 48 for i in range(40)]  # two full 16-token blocks and a bit
    with InProcessCluster(workers=1) as c, SchedulerClient(c.address) as client:
        _, first = _generate(client, _request(2, prompt))
        _, second = _generate(client, _request(2, prompt))
    assert first[-1].usage.cached_tokens == 0
    assert 0 < second[-1].usage.cached_tokens <= len(prompt)
    assert second[-1].usage.cached_tokens % 16 == 0, "whole blocks are reused"


@pytest.mark.slow
def test_smollm2_logprob_texts_spell_the_streamed_text(smollm2_cluster):
    req = spb.GenerateRequest(
        text="The capital of France is", max_new_tokens=8, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    with SchedulerClient(smollm2_cluster.address) as client:
        _, events = _generate(client, req)
    text = "".join(ev.text for ev in events)
    pieces = [lp for ev in events for lp in ev.logprobs]
    assert len(pieces) == 8 and "".join(lp.text for lp in pieces) == text
    assert all(t.text for lp in pieces for t in lp.top), "every alternative has its text"

"""SmolLM2-135M through the cluster: token-exact with Hugging Face transformers on the same GGUF."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
import torch

from kvfleet.client import SchedulerClient, build_request
from worker_svc.engine import Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps

pytestmark = pytest.mark.slow
NEW_TOKENS = 32
# Varied on purpose: prose, code, a list, numbers, non-English text with CJK, emoji.
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here are three tips for staying healthy:\n1.",
    "In 1969, the Apollo 11 mission",
    "Le chat est sur la table. 日本語では、",
    "My favourite emoji are 🎉 and",
]
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


def _hf_choices(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at each position the cluster generated, from one forward over
    the prompt and the cluster's tokens (teacher-forced). Each choice is made on the prefix the
    cluster had, so the list equals the cluster's tokens exactly when transformers' own greedy
    decode produces them; at the first difference, that is where its decode would part."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.argmax(-1).tolist()


def test_greedy_tokens_equal_transformers_for_concurrent_prompts(smollm2_cluster, hf_smollm2, smollm2_tokenizer):
    requests = [build_request(p, NEW_TOKENS) for p in PROMPTS] + [build_request(CHAT, NEW_TOKENS)]
    with SchedulerClient(smollm2_cluster.address) as client, cf.ThreadPoolExecutor(len(requests)) as pool:
        # Sent together, so they share prefill and decode batches.
        results = list(pool.map(client.generate, requests))
    eos = set(smollm2_tokenizer.eos_token_ids)
    for req, r in zip(PROMPTS + ["<chat>"], results):
        assert r.token_ids, f"prompt {req!r}"
        assert _hf_choices(hf_smollm2, r.prompt_token_ids, r.token_ids) == r.token_ids, f"prompt {req!r}"
        # transformers stops at its first EOS (and includes it), as the cluster must.
        assert not eos & set(r.token_ids[:-1]), f"prompt {req!r}"
        if r.token_ids[-1] in eos:
            assert r.finish_reason == "eos", f"prompt {req!r}"
        else:
            assert (r.finish_reason, len(r.token_ids)) == ("length", NEW_TOKENS), f"prompt {req!r}"


def test_logits_of_one_forward_agree(smollm2_model, hf_smollm2, smollm2_tokenizer):
    """Tolerance: max |diff| <= 1e-3 x the largest |logit| (float32; logits reach ~30)."""
    cfg, weights = smollm2_model
    steps = LocalSteps(Engine(cfg, weights, EngineConfig(block_size=16, num_blocks=64)))
    ids = smollm2_tokenizer.encode(PROMPTS[2])
    out = steps.step([PrefillItem("x", tuple(ids), 0, True, SamplingSpec())], [], return_logits=True)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([ids])).logits[0, -1].numpy()
    got = out.logits[0]
    assert np.max(np.abs(got - ref)) <= 1e-3 * np.max(np.abs(ref))
    assert int(np.argmax(got)) == int(np.argmax(ref))


def test_streamed_text_is_whole_characters_and_equals_the_decode(smollm2_cluster, smollm2_tokenizer):
    with SchedulerClient(smollm2_cluster.address) as client:
        events = list(client.stream(build_request("Emoji party: 🎉🥳", 24, ignore_eos=True)))
    ids = [t for ev in events for t in ev.token_ids]
    deltas = [ev.text for ev in events]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_finish_reasons_and_usage(smollm2_cluster, smollm2_tokenizer):
    with SchedulerClient(smollm2_cluster.address) as client:
        chat = client.generate(build_request(CHAT, 200))
        stopped = client.generate(build_request("Count to ten: one, two, three,", 40, stop=[" six"]))
        seeded = [
            client.generate(build_request("Once upon a time", 16, temperature=0.9, top_p=0.9, seed=11)).token_ids
            for _ in range(2)
        ]
        events = list(client.stream(build_request("Hello", 5, ignore_eos=True)))
    assert chat.finish_reason == "eos" and "<|im_end|>" not in chat.text
    assert chat.prompt_token_ids == smollm2_tokenizer.encode(smollm2_tokenizer.render_chat(CHAT))
    assert stopped.finish_reason == "stop" and "six" not in stopped.text and "five" in stopped.text
    assert seeded[0] == seeded[1]
    assert events[-1].usage.input_tokens == len(smollm2_tokenizer.encode("Hello"))
    assert events[-1].usage.output_tokens == 5 and events[-1].finish_reason

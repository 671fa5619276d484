"""Each model family through a real cluster (scheduler + two workers over loopback gRPC, the
workers loading the Hugging Face directory themselves): the greedy tokens transformers'
generate gives, for several prompts at once. The checkpoints are made at test time by
transformers (``tests/helpers/families.py``), as it saves them: no tokenizer.json and no
eos_token_id, so the cluster serves token ids and no session stops on EOS, as transformers'
generate runs its full length (``test_hf_dir_tokenizer.py`` covers the tokenizer side).
A GGUF file with a family's own vocabulary and chat template is chatted with through the
gateway and ``kvfleet chat``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest

from kvfleet.cli import main as kvfleet_main
from kvfleet.client import SchedulerClient, build_request
from scheduler_svc.core import SchedulerLimits
from tests.helpers.families import CASES, Case, hf_greedy, make_checkpoint, prompts
from tests.helpers.gateway import GatewayProcess, http
from tests.helpers.gguf_families import write_gguf
from tests.helpers.vocabularies import CASES as VOCAB_CASES
from tests.helpers.vocabularies import make_original
from tests.integration.inproc import InProcessCluster

NEW_TOKENS = 8
# One case per family and per kind of window: the unit tests cover every case in the engine.
NAMES = ["llama3", "mistral-window", "qwen2-window", "qwen3", "phi3-longrope", "gemma3"]


@pytest.mark.parametrize("name", NAMES)
def test_cluster_serves_transformers_greedy_tokens(tmp_path: Path, name: str) -> None:
    hf = make_checkpoint(CASES[name], tmp_path, seed=4)
    plan = prompts()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in plan]
    # Small blocks and a small prefill budget, so that the 19-token prompt is chunked and
    # decodes share steps with prefills.
    limits = SchedulerLimits(prefill_token_budget=8)
    with InProcessCluster(workers=2, model=str(tmp_path), limits=limits, block_size=4, num_blocks=128) as cluster:
        with SchedulerClient(cluster.address) as client, cf.ThreadPoolExecutor(len(plan)) as pool:
            results = list(pool.map(lambda p: client.generate(build_request(p, NEW_TOKENS), timeout=120), plan))
    for p, r, w in zip(plan, results, want):
        assert r.token_ids == w, p
        assert r.finish_reason == "length"


@pytest.mark.parametrize("vocab, family", [("llama2", "llama"), ("gemma", "gemma3_text")])
def test_gguf_chat_with_the_familys_vocabulary_and_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], vocab: str, family: str
) -> None:
    # A random-weight GGUF model carrying a trained SentencePiece vocabulary and its family's
    # chat template, served as a user would: the prompt is transformers' apply_chat_template
    # ids (one BOS), the answer its greedy tokens up to EOS, as text through the gateway.
    original = make_original(VOCAB_CASES[vocab], tmp_path / "tokenizer")
    base = next(c for c in CASES.values() if c.family == family)
    case = Case(base.family, base.config_class, {**base.options, "vocab_size": len(original.hf)})
    hf = make_checkpoint(case, tmp_path / "checkpoint", seed=4)
    model = write_gguf(case, hf, tmp_path / "model.gguf", vocab=original)
    messages = [{"role": "user", "content": "Name three colours, please 🎨"}]
    text = original.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = original.hf(text, add_special_tokens=False)["input_ids"]
    eos = original.hf.eos_token_id
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    want = want[: want.index(eos) + 1] if eos in want else want
    with InProcessCluster(workers=1, model=str(model), block_size=4, num_blocks=128) as cluster:
        gateway = GatewayProcess(cluster.address, tmp_path)
        try:
            status, tokens, _ = http("POST", gateway.url + "/tokenize", {"messages": messages})
            assert status == 200 and tokens["tokens"] == prompt
            name = http("GET", gateway.url + "/v1/models")[1]["data"][0]["id"]
            body = {"model": name, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0}
            status, answer, _ = http("POST", gateway.url + "/v1/chat/completions", body)
        finally:
            gateway.stop()
        assert status == 200, answer
        content = answer["choices"][0]["message"]["content"]
        assert content == original.hf.decode(want, skip_special_tokens=True)
        assert answer["usage"] == answer["usage"] | {"prompt_tokens": len(prompt), "completion_tokens": len(want)}
        args = ["chat", messages[0]["content"], "--scheduler", cluster.address, "--json"]
        assert kvfleet_main([*args, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli["prompt_token_ids"] == prompt and cli["token_ids"] == want

"""Each model family through a real cluster (scheduler + two workers over loopback gRPC, the
workers loading the Hugging Face directory themselves): the greedy tokens transformers'
generate gives, for several prompts at once. The checkpoints are made at test time by
transformers (``tests/helpers/families.py``), as it saves them: no tokenizer.json and no
eos_token_id, so the cluster serves token ids and no session stops on EOS, as transformers'
generate runs its full length (``test_hf_dir_tokenizer.py`` covers the tokenizer side).
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest

from kvfleet.client import SchedulerClient, build_request
from scheduler_svc.core import SchedulerLimits
from tests.helpers.families import CASES, hf_greedy, make_checkpoint, prompts
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

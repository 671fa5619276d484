"""A Hugging Face directory with and without its own tokenizer, through a real cluster (issue 21
point 3). Without tokenizer.json the model is served on token ids (token-exact with
transformers), text and chat requests are refused with INVALID_ARGUMENT saying the model has no
tokenizer, and nothing fails at start-up; with one (a BPE trained at test time) the scheduler
tokenizes text with that file. A config without eos_token_id starts too: its sessions never stop
on EOS, and response_format (which needs an EOS to end a value) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from kvfleet.client import SchedulerClient, build_request
from kvfleet.local_cluster import ClusterSpec, LocalCluster
from kvfleet.v1 import scheduler_pb2 as spb
from tests.helpers.families import CASES, Case, hf_greedy, make_checkpoint, prompts, write_trained_tokenizer
from tests.integration.inproc import InProcessCluster

NEW_TOKENS = 8
TRAINED_VOCAB = 300  # the trained BPE's size, and the checkpoint's vocabulary


def _refusal(client: SchedulerClient, req: spb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(req, timeout=60))
    return err.value


def _json_format() -> spb.ResponseFormat:
    return spb.ResponseFormat(type="json_object")


def test_directory_without_tokenizer_serves_token_ids(tmp_path: Path) -> None:
    hf = make_checkpoint(CASES["llama3"], tmp_path, seed=4)
    assert not (tmp_path / "tokenizer.json").exists()
    assert json.loads((tmp_path / "config.json").read_text()).get("eos_token_id") is None
    plan = prompts()
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in plan]
    with InProcessCluster(workers=1, model=str(tmp_path), block_size=4, num_blocks=128) as cluster:
        with SchedulerClient(cluster.address) as client:
            info = client.model_info()
            assert list(info.eos_token_ids) == [] and not info.chat_template
            # No EOS: nothing to ignore, the sessions run their length (as transformers' do).
            got = [client.generate(build_request(p, NEW_TOKENS), timeout=120) for p in plan]
            assert [r.token_ids for r in got] == want
            assert all(r.finish_reason == "length" and r.text == "" for r in got)

            text = _refusal(client, build_request("Hello there", NEW_TOKENS))
            chat = _refusal(client, build_request([{"role": "user", "content": "Hi"}], NEW_TOKENS))
            for err, kind in ((text, "text"), (chat, "chat")):
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "has no tokenizer" in err.details() and f"instead of {kind}" in err.details()
            constrained = build_request(plan[1], NEW_TOKENS)
            constrained.response_format.CopyFrom(_json_format())
            err = _refusal(client, constrained)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "no tokenizer" in err.details()

            again = client.generate(build_request(plan[2], NEW_TOKENS), timeout=120)  # still serving
            assert again.token_ids == want[2]


def test_directory_tokenizer_json_serves_text(tmp_path: Path) -> None:
    tok = write_trained_tokenizer(tmp_path, TRAINED_VOCAB)
    case = Case("llama", "LlamaConfig", {"vocab_size": TRAINED_VOCAB})
    hf = make_checkpoint(case, tmp_path, seed=5)  # no eos_token_id in its config
    texts = ["The quick brown fox", "the scheduler serves the clients tick by tick"]
    with InProcessCluster(workers=1, model=str(tmp_path), block_size=4, num_blocks=128) as cluster:
        with SchedulerClient(cluster.address) as client:
            for text in texts:
                ids = tok.encode(text).ids  # the directory's tokenizer.json, merges and all
                assert len(ids) < len(text.encode()), "the trained merges are used"
                assert client.tokenize(text).token_ids == ids
                r = client.generate(build_request(text, NEW_TOKENS), timeout=120)
                assert r.prompt_token_ids == ids
                assert r.token_ids == hf_greedy(hf, ids, NEW_TOKENS)
                assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
                assert r.finish_reason == "length"
            constrained = build_request(texts[0], NEW_TOKENS)
            constrained.response_format.CopyFrom(_json_format())
            err = _refusal(client, constrained)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "end-of-sequence" in err.details() and "has none" in err.details()
            assert client.generate(build_request(texts[1], 2), timeout=120).token_ids  # still serving


def test_directory_with_eos_constrains_output(tmp_path: Path) -> None:
    """The same directory with eos_token_id set: the worker builds its grammar over the trained
    vocabulary and a response_format request is served."""
    write_trained_tokenizer(tmp_path, TRAINED_VOCAB)
    make_checkpoint(Case("llama", "LlamaConfig", {"vocab_size": TRAINED_VOCAB, "eos_token_id": 0}), tmp_path, seed=5)
    with InProcessCluster(workers=1, model=str(tmp_path), block_size=4, num_blocks=128) as cluster:
        with SchedulerClient(cluster.address) as client:
            assert list(client.model_info().eos_token_ids) == [0]
            req = build_request("The quick brown fox", 4)
            req.response_format.CopyFrom(_json_format())
            r = client.generate(req, timeout=120)
            assert r.token_ids and r.text.lstrip().startswith("{")


def test_processes_start_without_tokenizer_or_eos(tmp_path: Path) -> None:
    """The real processes (python -m scheduler_svc / worker_svc): both start on such a
    directory, serve token ids, refuse text, and log no traceback."""
    model = tmp_path / "model"
    hf = make_checkpoint(CASES["qwen2"], model, seed=3)
    spec = ClusterSpec(workers=1, model=str(model), telemetry=False, num_blocks=64, block_size=4)
    logs = tmp_path / "logs"
    logs.mkdir()
    with LocalCluster(spec, log_dir=logs) as cluster, SchedulerClient(cluster.scheduler_address) as client:
        plan = prompts(2)
        for p in plan:
            assert client.generate(build_request(p, NEW_TOKENS), timeout=120).token_ids == hf_greedy(hf, p, NEW_TOKENS)
        err = _refusal(client, build_request("Hello", NEW_TOKENS))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no tokenizer" in err.details()
    for log in logs.glob("*.log"):
        assert "Traceback" not in log.read_text(errors="replace"), log.name

"""Workers behind one scheduler serve one model (scheduler_svc/core/served_model.py), and a
worker that comes back with another served context moves the admission bound (the core)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler_svc.core import AdmissionRejected, RejectReason
from scheduler_svc.core.served_model import ServedModel, fleet_mismatch, returned_mismatch
from tests.unit.sim import VOCAB, make_core, req, tiny_worker

TINY = ServedModel(
    name="tiny",
    vocab_size=48,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    model_max_position=512,
    eos_token_ids=(),
)
OTHER = replace(TINY, name="llama3-random", vocab_size=256, num_layers=3, model_max_position=128)


def test_workers_of_one_model_agree_whatever_its_name():
    assert fleet_mismatch({}) == ""
    assert fleet_mismatch({"w0": TINY, "w1": TINY}) == ""
    # One file reached by two paths names the model twice: the shape is what must be equal.
    assert fleet_mismatch({"w0": TINY, "w1": replace(TINY, name="/models/tiny.gguf")}) == ""


def test_a_fleet_of_two_models_is_named_worker_by_worker_with_the_fix():
    why = fleet_mismatch({"w0": TINY, "w1": TINY, "w2": OTHER})
    assert why.startswith("the workers serve different models: w0 serves 'tiny', w2 serves 'llama3-random' (")
    assert "vocab_size 48 vs 256" in why and "num_layers 2 vs 3" in why and "model_max_position 512 vs 128" in why
    assert "w1" not in why  # it serves the first's model
    assert "hidden_size" not in why  # equal fields are not listed
    assert "the same --model" in why


@pytest.mark.parametrize(
    "change, named",
    [
        ({"hidden_size": 128}, "hidden_size 64 vs 128"),
        ({"num_heads": 8}, "num_heads 4 vs 8"),
        ({"num_kv_heads": 4}, "num_kv_heads 2 vs 4"),
        ({"head_dim": 32}, "head_dim 16 vs 32"),
        ({"intermediate_size": 96}, "intermediate_size 128 vs 96"),
        ({"eos_token_ids": (2,)}, "eos_token_ids () vs (2,)"),
    ],
)
def test_each_field_of_the_shape_tells_two_models_apart(change, named):
    assert TINY.differences(replace(TINY, **change)) == [named]
    assert named in fleet_mismatch({"w0": TINY, "w1": replace(TINY, **change)})


def test_a_worker_back_with_another_model_is_refused_and_with_the_same_one_taken():
    assert returned_mismatch("w1", TINY, replace(TINY, name="renamed")) == ""
    why = returned_mismatch("w1", TINY, OTHER)
    assert why.startswith("worker w1 answers again but serves 'llama3-random', not the fleet's 'tiny' (")
    assert "vocab_size 48 vs 256" in why and "not used until it serves that model again" in why


def _refused_length(core, prompt: int, new: int) -> str:
    with pytest.raises(AdmissionRejected) as refused:
        core.submit(req(prompt, new))
    assert refused.value.reason == RejectReason.PROMPT_TOO_LONG
    return str(refused.value)


def test_the_admission_bound_follows_a_worker_back_with_another_served_context():
    core = make_core(workers=(tiny_worker("w0"), tiny_worker("w1")), max_position=512)
    core.submit(req(4, 200))  # fits 512
    core.worker_failed("w1", "killed")
    core.worker_recovered(core.workers.get("w1").spec, VOCAB, 64)  # back with --max-model-len 64
    assert "exceeds the model's context of 64 tokens" in _refused_length(core, 4, 200)
    core.submit(req(4, 60))  # 64 fits
    # Back again at 512: the smallest of the workers' contexts is 512 once more.
    core.worker_failed("w1", "killed")
    core.worker_recovered(core.workers.get("w1").spec, VOCAB, 512)
    core.submit(req(4, 200))
    # The other worker's bound still counts: w0 back at 256 holds every session to 256.
    core.worker_failed("w0", "killed")
    core.worker_recovered(core.workers.get("w0").spec, VOCAB, 256)
    assert "context of 256 tokens" in _refused_length(core, 4, 300)

"""Behaviour added for speed in the worker's hot path: tied embeddings in the matmul layout,
the two attention groups, the thread split between torch and the host BLAS, bfloat16 on a
GQA model. Numbers are compared with the numpy reference; no timing is asserted here (the
benchmark, `python -m bench`, measures speed).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvfleet_models.config import LlamaConfig
from kvfleet_models.reference import reference_generate, reference_logits
from kvfleet_models.tiny import tiny_weights
from worker_svc.engine import DecodeItem, Engine, EngineConfig, ItemStatus, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.model.cpu_backend import default_cpu_threads, use_cpu_threads
from worker_svc.model.llama import LlamaModel

GREEDY = SamplingSpec()
TIED = LlamaConfig(
    name="tiny-tied",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    max_position=96,
    rope_theta=1000.0,
    tie_word_embeddings=True,
)
TIED_WEIGHTS = tiny_weights(TIED, seed=3)


def _prompt(n: int, salt: int, vocab: int = TIED.vocab_size) -> tuple[int, ...]:
    return tuple((5 * i + 11 * salt + 2) % vocab for i in range(n))


def _engine(kv_views: str = "rebuild", dtype: str = "float32", **kw) -> Engine:
    return Engine(TIED, TIED_WEIGHTS, EngineConfig(block_size=4, num_blocks=64, kv_views=kv_views, dtype=dtype, **kw))


def test_tied_head_has_no_second_copy() -> None:
    assert "lm_head.weight" not in TIED_WEIGHTS
    engine = _engine()
    assert engine.parameter_count == sum(w.size for w in TIED_WEIGHTS.values())


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_mixed_step_of_both_groups_matches_reference(kv_views: str) -> None:
    """One step holding a long chunk, a one-token prefill chunk and decodes: the one-token items
    share the decode group, the chunk its own group, and every logit matches the reference."""
    steps = LocalSteps(_engine(kv_views))
    a, b, c = _prompt(9, 1), _prompt(5, 2), _prompt(1, 3)
    first = steps.step([PrefillItem("a", a, 0, True, GREEDY), PrefillItem("b", b, 0, True, GREEDY)], [])
    ta, tb = (r.token_id for r in first.results)
    d = _prompt(13, 4)
    out = steps.step(
        [
            PrefillItem("d", d[:7], 0, False, GREEDY),  # multi-token, not sampled
            PrefillItem("c", c, 0, True, GREEDY),
        ],  # one token: decode group
        [DecodeItem("b", tb, len(b), GREEDY, 1), DecodeItem("a", ta, len(a), GREEDY, 1)],
        return_logits=True,
    )
    assert [r.status for r in out.results] == [ItemStatus.OK] * 4
    assert out.results[0].token_id is None and out.results[0].kv_tokens == 7
    assert out.logits is not None
    for row, (prompt, tok) in ((1, (c, None)), (2, (b, tb)), (3, (a, ta))):
        seq = list(prompt) + ([tok] if tok is not None else [])
        ref = reference_logits(TIED, TIED_WEIGHTS, seq)[-1]
        np.testing.assert_allclose(out.logits[row], ref, atol=1e-4, rtol=0)
    assert out.results[3].token_id == reference_generate(TIED, TIED_WEIGHTS, list(a), 2)[1]
    # d's second chunk continues from the cache and samples d's first token.
    out = steps.step([PrefillItem("d", d[7:], 7, True, GREEDY)], [])
    assert out.results[0].token_id == reference_generate(TIED, TIED_WEIGHTS, list(d), 1)[0]


def test_bfloat16_tied_gqa_decodes_close_to_reference() -> None:
    steps = LocalSteps(_engine(dtype="bfloat16"))
    prompt = _prompt(6, 5)
    out = steps.step([PrefillItem("s", prompt, 0, True, GREEDY)], [], return_logits=True)
    tok = out.results[0].token_id
    out = steps.step([], [DecodeItem("s", tok, len(prompt), GREEDY, 1)], return_logits=True)
    ref = reference_logits(TIED, TIED_WEIGHTS, list(prompt) + [tok])[-1]
    assert out.logits is not None and np.abs(out.logits[0] - ref).max() < 0.25


def test_threads_are_given_to_one_pool_only() -> None:
    saved = torch.get_num_threads()
    try:
        engine = _engine(num_threads=2)
        assert engine.model.host_blas  # float32 on a CPU
        assert torch.get_num_threads() == 1  # the BLAS pool has the threads, torch one
        use_cpu_threads(2, host_blas=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=-1)


def test_a_model_too_small_to_split_runs_on_one_thread_unless_told() -> None:
    """Hidden 32 and 64 ran as fast on one thread as on two (the second only spun); from
    hidden 128 x 512 two were faster (cpu_backend.SMALL_MODEL_ELEMENTS)."""
    assert default_cpu_threads(32, 64, available=4) == 1  # the tiny sweep model
    assert default_cpu_threads(64, 256, available=4) == 1
    assert default_cpu_threads(128, 256, available=4) == 4  # 32,768 elements: the process's setting
    assert default_cpu_threads(576, 1536, available=4) == 4  # SmolLM2
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _engine().num_threads == 1  # TIED: 32 x 48
        torch.set_num_threads(2)
        assert _engine(num_threads=2).num_threads == 2  # as told
        wide = dataclasses.replace(TIED, hidden_size=128, intermediate_size=256, num_layers=1)
        torch.set_num_threads(2)
        assert Engine(wide, tiny_weights(wide, seed=0), EngineConfig(num_blocks=8)).num_threads == 2
    finally:
        torch.set_num_threads(saved)


def test_untied_and_tied_layouts_agree_when_head_equals_embedding() -> None:
    untied_cfg = dataclasses.replace(TIED, tie_word_embeddings=False)
    untied = dict(TIED_WEIGHTS, **{"lm_head.weight": TIED_WEIGHTS["model.embed_tokens.weight"]})
    prompt = _prompt(7, 6)
    outs = []
    for cfg, weights in ((TIED, TIED_WEIGHTS), (untied_cfg, untied)):
        steps = LocalSteps(Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=16)))
        outs.append(steps.step([PrefillItem("s", prompt, 0, True, GREEDY)], [], return_logits=True).logits)
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_torch_matmul_path_matches_host_blas_path(kv_views: str) -> None:
    """The path GPUs take (torch matmuls, [out, in] weights, baddbmm attention) gives the same
    logits as the CPU's numpy path; both mixed groups and a masked decode group are run."""
    outs = []
    for host_blas in (True, False):
        engine = _engine(kv_views)
        # The GPU's path is torch's ops throughout: no fused C ops either.
        engine.model = LlamaModel(
            TIED,
            TIED_WEIGHTS,
            torch.device("cpu"),
            torch.float32,
            host_blas=host_blas,
            fused_ops=None if host_blas else False,
        )
        steps = LocalSteps(engine)
        a, b = _prompt(9, 1), _prompt(3, 2)
        first = steps.step(
            [PrefillItem("a", a, 0, True, GREEDY), PrefillItem("b", b, 0, True, GREEDY)], [], return_logits=True
        )
        ta, tb = (r.token_id for r in first.results)
        second = steps.step(
            [PrefillItem("c", _prompt(6, 3), 0, True, GREEDY)],
            [DecodeItem("a", ta, len(a), GREEDY, 1), DecodeItem("b", tb, len(b), GREEDY, 1)],
            return_logits=True,
        )
        outs.append(np.concatenate([first.logits, second.logits]))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="host_blas"):
        LlamaModel(TIED, TIED_WEIGHTS, torch.device("cpu"), torch.bfloat16, host_blas=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "kv_views,dtype,atol",
    [("rebuild", "float32", 1e-4), ("persistent", "float32", 1e-4), ("persistent", "bfloat16", 0.25)],
)
def test_cuda_mixed_groups_match_reference(kv_views: str, dtype: str, atol: float) -> None:
    steps = LocalSteps(_engine(kv_views, dtype=dtype, device="cuda"))
    a, b = _prompt(9, 1), _prompt(4, 2)
    first = steps.step([PrefillItem("a", a, 0, True, GREEDY), PrefillItem("b", b, 0, True, GREEDY)], [])
    ta, tb = (r.token_id for r in first.results)
    out = steps.step(
        [PrefillItem("c", _prompt(5, 3), 0, True, GREEDY)],
        [DecodeItem("a", ta, len(a), GREEDY, 1), DecodeItem("b", tb, len(b), GREEDY, 1)],
        return_logits=True,
    )
    assert out.logits is not None
    for row, seq in ((0, list(_prompt(5, 3))), (1, list(a) + [ta]), (2, list(b) + [tb])):
        ref = reference_logits(TIED, TIED_WEIGHTS, seq)[-1]
        assert np.abs(out.logits[row] - ref).max() < atol

"""Whole steps (``LlamaModel.whole_step``): a step of a plain Llama stack of small layers as one
C call, every token a row of its own. Against the per-op path on the same steps (prefill chunks,
a chunk continuing a session, a chunk not sampled, decodes across block boundaries, a mixed
step), in both KV dtypes and thread counts; which models and steps take it; and what the C
call refuses; the benchmark that measures both paths. No timing is asserted (``bench.whole_step``
and ``bench.control_plane``'s sweep line measure them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bench import whole_step as whole_step_bench
from kvfleet_models.tiny import tiny_weights
from tests.unit.model_configs import GQA_CFG
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.model import fused, llama
from worker_svc.model.llama import LlamaModel

GREEDY = SamplingSpec()
CFG = GQA_CFG  # 3 layers, 4 query heads sharing 2 K/V heads
WEIGHTS = tiny_weights(CFG, seed=11)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> fused.FusedOps:
    loaded = fused.load()
    if loaded is None:
        pytest.skip("no C compiler here: the per-op path is all there is")
    return loaded


def _steps(engine: Engine) -> tuple[np.ndarray, list[int]]:
    """Every step's logits and greedy tokens over: a batch of prompts (one of them a first
    chunk, not sampled); its second chunk beside the others' first decodes; then decodes
    crossing the 4-token blocks."""
    steps = LocalSteps(engine)
    prompts = {"a": (3, 9, 27, 4, 12, 36, 7), "b": (5, 15), "c": tuple((7 * i + 1) % CFG.vocab_size for i in range(10))}
    first = steps.step(
        [
            PrefillItem("a", prompts["a"], 0, True, GREEDY),
            PrefillItem("b", prompts["b"], 0, True, GREEDY),
            PrefillItem("c", prompts["c"][:6], 0, False, GREEDY),  # a chunk: no token
        ],
        [],
        return_logits=True,
    )
    logits = [first.logits[[0, 1]]]
    tokens = {r.session_id: r.token_id for r in first.results if r.token_id is not None}
    pos = {"a": 7, "b": 2}
    seen: list[int] = []
    for k in range(6):
        prefill = [PrefillItem("c", prompts["c"][6:], 6, True, GREEDY)] if k == 0 else []
        out = steps.step(prefill, [DecodeItem(s, tokens[s], pos[s], GREEDY, k + 1) for s in pos], return_logits=True)
        logits.append(out.logits)
        for r in out.results:
            tokens[r.session_id] = r.token_id
            seen.append(r.token_id)
        pos = {s: p + 1 for s, p in pos.items()}
        if k == 0:
            pos["c"] = 10
    return np.concatenate(logits), seen


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_whole_steps_equal_the_per_op_path(
    ops: fused.FusedOps, monkeypatch, kv_dtype: str, threads: int, tied: bool
) -> None:
    """Tied: the embedding is the head's [hidden, vocab] copy, its rows read by columns."""
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tied)
    weights = tiny_weights(cfg, seed=11)
    calls: list[int] = []
    whole_step = LlamaModel.whole_step

    def counted(self, cache, rows, *args):  # type: ignore[no-untyped-def]
        calls.append(rows.rows)
        return whole_step(self, cache, rows, *args)

    monkeypatch.setattr(LlamaModel, "whole_step", counted)
    results = {}
    for whole in (True, False):
        calls.clear()
        config = EngineConfig(block_size=4, num_blocks=64, kv_dtype=kv_dtype, num_threads=threads, whole_steps=whole)
        engine = Engine(cfg, weights, config)
        assert (engine.model.decode_stack is not None) == whole
        results[whole] = (*_steps(engine), engine.cache.kv.clone())
        # Whole: every step one call, its rows the step's tokens (7 + 2 + 6, then 4 + 2, then 3s).
        assert calls == ([15, 6, 3, 3, 3, 3, 3] if whole else [])
    (got, got_tokens, got_kv), (want, want_tokens, want_kv) = results[True], results[False]
    assert np.isfinite(got).all()
    # float16 K/V: the paths' K differ in float32's last bits (their products sum in other
    # orders), and now and then that moves a rounding to float16 by one step.
    # A tied head's logits run larger (to ~20): float32's rounding relative to them.
    np.testing.assert_allclose(got, want, atol=1e-4 if kv_dtype == "float16" else 1e-5, rtol=1e-5)
    assert got_tokens == want_tokens
    # The K/V written agree too (float16: the same rounding of nearly the same numbers).
    torch.testing.assert_close(got_kv.float(), want_kv.float(), atol=2e-3 if kv_dtype == "float16" else 1e-5, rtol=0)


def test_a_whole_step_times_its_kv_writes_and_attention(ops: fused.FusedOps) -> None:
    steps = LocalSteps(Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=16)))
    out = steps.step([PrefillItem("a", (1, 2, 3, 4, 5), 0, True, GREEDY)], [])
    assert out.profile.attention_ns > 0 and out.profile.kv_write_ns > 0
    assert out.profile.attention_ns + out.profile.kv_write_ns < out.profile.step_ns


def _model(cfg=CFG, **kwargs) -> LlamaModel:  # type: ignore[no-untyped-def]
    return LlamaModel(cfg, tiny_weights(cfg, seed=3), CPU, kwargs.pop("dtype", torch.float32), **kwargs)


def test_only_plain_stacks_of_small_layers_take_whole_steps(ops: fused.FusedOps, monkeypatch) -> None:
    """A plain float32 Llama on the C ops does, with either weight layout; a family option, a
    quantized or bfloat16 model, torch's ops, the switch or its environment variable, or
    layers over the limit keep the per-op path; a step too large for the C loops does too."""
    plain = _model(torch_copy=False)
    assert plain.decode_stack is not None and _model().decode_stack is not None
    per_row = sum(m.numel for m in plain.layers[0].matrices()) + CFG.vocab_size * CFG.hidden_size / CFG.num_layers
    assert plain.whole_step_fits(int(llama.WHOLE_STEP_MACS // per_row))
    assert not plain.whole_step_fits(int(llama.WHOLE_STEP_MACS // per_row) + 1)
    for option in ({"qkv_bias": True}, {"qk_norm": True}, {"hidden_act": "gelu_tanh"}, {"sliding_window": 4}):
        assert _model(dataclasses.replace(CFG, **option)).decode_stack is None, option
    assert _model(quant="int8").decode_stack is None
    assert _model(dtype=torch.bfloat16).decode_stack is None
    assert _model(fused_ops=False).decode_stack is None
    assert _model(whole_steps=False).decode_stack is None
    monkeypatch.setattr(llama, "WHOLE_STEP_MACS", int(per_row) - 1)  # not even one row
    assert _model().decode_stack is None
    monkeypatch.undo()
    monkeypatch.setenv("KVFLEET_WHOLE_STEPS", "0")
    assert _model().decode_stack is None


def test_the_persistent_views_mode_keeps_the_per_op_path(ops: fused.FusedOps, monkeypatch) -> None:
    """Its slab rows are the views' own bookkeeping, kept by the per-op path's appends."""
    calls: list[int] = []
    monkeypatch.setattr(LlamaModel, "whole_step", lambda *a: calls.append(1))
    steps = LocalSteps(Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=16, kv_views="persistent")))
    out = steps.step([PrefillItem("a", (1, 2, 3), 0, True, GREEDY)], [])
    steps.step([], [DecodeItem("a", out.results[0].token_id, 3, GREEDY, 1)])
    assert calls == []


def test_decode_step_refuses_what_it_cannot_run(ops: fused.FusedOps) -> None:
    """Weights of another dtype or head layout; a cache of another shape; and every index of a
    step's rows past what it indexes (the C code reads and writes where they say)."""
    model = _model()
    stack = model.decode_stack
    assert stack is not None
    layers, norm, head, embed, rotary = stack._held
    heads = (CFG.num_heads, CFG.num_kv_heads, 1e-5)
    with pytest.raises(ValueError, match="float32"):
        fused.DecodeStack([(w[0], w[1].double(), *w[2:]) for w in layers], norm, head, embed, rotary, *heads)
    with pytest.raises(ValueError, match="Hq"):
        fused.DecodeStack(layers, norm, head, embed, rotary, CFG.num_heads + 1, CFG.num_kv_heads, 1e-5)
    with pytest.raises(ValueError, match="RoPE"):
        fused.DecodeStack(layers, norm, head, embed, torch.view_as_real(rotary), *heads)
    cache = Engine(CFG, WEIGHTS, EngineConfig(block_size=4, num_blocks=16)).cache
    blocks = cache.kv.shape[3] // 4

    def rows(token: int = 5, position: int = 2, slot: int = 2, block: int = 0, width: int = 1) -> fused.StepRows:
        meta = np.array([token, position, slot] + [block] * width, dtype=np.int64)
        return fused.StepRows(meta, 1, width, 4)

    logits = ops.decode_step(stack, cache.kv, rows()).logits
    assert logits.shape == (1, CFG.vocab_size) and torch.isfinite(logits).all()
    for bad in (
        {"token": CFG.vocab_size},
        {"token": -1},
        {"position": CFG.max_position},
        {"slot": cache.kv.shape[3]},
        {"block": blocks},
    ):
        with pytest.raises(ValueError, match="outside what it indexes"):
            ops.decode_step(stack, cache.kv, rows(**bad))
    with pytest.raises(ValueError, match="past its blocks"):
        ops.decode_step(stack, cache.kv, rows(position=4))  # a fifth key, one block
    with pytest.raises(ValueError, match="must be"):
        ops.decode_step(stack, cache.kv[:1].contiguous(), rows())
    with pytest.raises(ValueError, match="3 \\+ page_width"):
        ops.decode_step(stack, cache.kv, fused.StepRows(rows().meta[:-1], 1, 1, 4))
    strided = np.repeat(rows().meta, 2)[::2]  # the same values, not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        ops.decode_step(stack, cache.kv, fused.StepRows(strided, 1, 1, 4))


def test_the_benchmark_measures_both_paths_past_the_limit(ops: fused.FusedOps) -> None:
    """``python -m bench.whole_step``: a row per width and batch, each path timed, the tokens of
    both the same, and the path the worker takes named by its own limit (restored after)."""
    limit = llama.WHOLE_STEP_MACS
    rows = whole_step_bench.compare([32], [1, 2], steps=2, rounds=1)
    assert llama.WHOLE_STEP_MACS == limit
    assert [(r["hidden"], r["batch"]) for r in rows] == [(32, 1), (32, 2)]
    assert all(r["same_tokens"] and r["per_op_ms"] > 0 and r["whole_ms"] > 0 for r in rows)
    assert {r["worker_takes"] for r in rows} == {"whole"}

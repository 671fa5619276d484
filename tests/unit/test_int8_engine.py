"""The int8 and bfloat16 CPU modes on the tiny models: configuration, sizes, the exactness of
int8's smoothing folds, closeness to the reference. The real model's quality is measured in
``test_quant_quality.py`` (slow); speed in ``python -m bench.modes`` (nothing timed here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import worker_svc.model.int8 as int8
import worker_svc.model.llama as llama
from kvfleet.v1 import worker_pb2 as pb
from kvfleet_models.config import LlamaConfig, tiny_config
from kvfleet_models.reference import reference_generate, reference_logits
from kvfleet_models.tiny import tiny_weights
from tests.helpers.int8_fakes import Unrounded
from tests.unit.model_configs import GQA_CFG
from worker_svc.__main__ import parse_args
from worker_svc.config import WorkerConfig
from worker_svc.convert import info_to_pb
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.model import q8

GREEDY = SamplingSpec()
# Untied GQA and tied MHA: the o-projection fold differs when query heads share a kv head, and
# a tied head's lookup reads the int8 head's rows.
GQA = GQA_CFG
TIED = LlamaConfig(
    name="tiny-tied",
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=48,
    max_position=96,
    rope_theta=1000.0,
    tie_word_embeddings=True,
)
MODELS = {
    "gqa": (GQA, tiny_weights(GQA, seed=1)),
    "tied": (TIED, tiny_weights(TIED, seed=3)),
    "tiny": (tiny_config(), tiny_weights(tiny_config())),
}


def _prompt(n: int, vocab: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((7 * i + 3 * salt + 1) % vocab for i in range(n))


def _logits(engine: Engine, prompt: tuple[int, ...], steps: int = 3) -> tuple[np.ndarray, list[int]]:
    """Prefill then greedy decodes (feeding back the engine's own tokens) on a fresh engine:
    logits [steps + 1, V]."""
    driver = LocalSteps(engine)
    out = driver.step([PrefillItem("s", prompt, 0, True, GREEDY)], [], return_logits=True)
    rows, tokens = [out.logits[0]], [out.results[0].token_id]
    for k in range(steps):
        out = driver.step([], [DecodeItem("s", tokens[-1], len(prompt) + k, GREEDY, k + 1)], return_logits=True)
        rows.append(out.logits[0])
        tokens.append(out.results[0].token_id)
    return np.stack(rows), tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_int8_smoothing_folds_are_exact_without_rounding(name, monkeypatch) -> None:
    """With the int8 rounding taken out (the 'packed' weight is the smoothed float matrix),
    the int8 model equals the reference: every division folded into the norms, V rows and up
    rows is matched by its weight column's multiplication, including through attention."""
    cfg, weights = MODELS[name]
    monkeypatch.setattr(int8, "quantize_blocks", lambda w, kernels: Unrounded(w))
    # The float32 KV of the exact mode: the default float16 KV rounds (held in test_kv_dtype.py).
    engine = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=64, quant="int8", kv_dtype="float32"))
    prompt = _prompt(9, cfg.vocab_size)
    got, tokens = _logits(engine, prompt)
    ref = reference_logits(cfg, weights, list(prompt) + tokens[:-1])[len(prompt) - 1 :]
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("level", q8.LEVELS)
@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_int8_logits_close_to_reference(name, level, monkeypatch) -> None:
    """Real int8 products at each kernel level this CPU runs: logits within 5 % of their range
    of the reference's (a wrong fold or scale moves them by the whole range; fbgemm's saturating
    AVX2 products moved them by 16 %), and the first greedy token equal."""
    if level not in q8.runnable_levels():
        pytest.skip(f"this CPU does not run the {level} kernels (it runs {', '.join(q8.runnable_levels())})")
    monkeypatch.setenv(q8.LEVEL_ENV, level)
    cfg, weights = MODELS[name]
    engine = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=64, quant="int8"))
    assert engine.model.int8_kernels == level
    prompt = _prompt(11, cfg.vocab_size, salt=2)
    got, tokens = _logits(engine, prompt)
    ref = reference_logits(cfg, weights, list(prompt) + tokens[:-1])[len(prompt) - 1 :]
    spread = ref.max() - ref.min()
    assert np.abs(got - ref).max() < 0.05 * spread
    assert tokens[0] == reference_generate(cfg, weights, list(prompt), 1)[0]


def test_int8_sizes_threads_and_info() -> None:
    cfg, weights = MODELS["tied"]
    saved = torch.get_num_threads()
    try:
        f32 = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=16))
        q = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=16, quant="int8", num_threads=2))
        assert torch.get_num_threads() == 2  # the int8 kernels run in torch's OpenMP pool
    finally:
        torch.set_num_threads(saved)
    assert q.parameter_count == f32.parameter_count == sum(w.size for w in weights.values())
    matrices = [m for layer in q.model.layers for m in layer.matrices()] + [q.model.lm_head]
    assert all(m.q8 is not None and m.kn is None and m.nk is None for m in matrices)
    # int8 products (rows padded to blocks of 32, row counts to groups of 16) + a scale per
    # block and float32 norms: the tied head is the lookup table too, no float copy beside it.
    vectors = q.parameter_count - sum(m.numel for m in matrices)
    padded = [-(-m.shape[0] // 16) * 16 * -(-m.shape[1] // 32) * 32 for m in matrices]
    assert q.weight_bytes == sum(n + 4 * n // 32 for n in padded) + 4 * vectors
    assert q.model.embed is None
    assert q.kv_bytes_per_token * 2 == f32.kv_bytes_per_token  # int8's KV is float16 by default
    info = info_to_pb("w", cfg, q, 4, 16, "i0")
    assert isinstance(info, pb.WorkerInfo) and info.quant == "int8" and info.dtype == "float32"
    assert info.kernels == q.model.kernel_level != ""  # the level its products picked at load
    assert (info.kv_dtype, info_to_pb("w", cfg, f32, 4, 16, "i0").kv_dtype) == ("float16", "float32")
    assert (info_to_pb("w", cfg, f32, 4, 16, "i0").quant, info_to_pb("w", cfg, f32, 4, 16, "i0").kernels) == (
        "none",
        "",
    )


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize("path", ["onednn", "torch"])
def test_bfloat16_on_cpu_keeps_activations_in_float32_and_kv_in_float16(path, monkeypatch) -> None:
    """Both bfloat16 product paths: oneDNN's packed weights where this CPU has its bfloat16
    kernels (AVX-512 BF16 / AMX), and torch's matmul on [out, in] bfloat16 weights (forced)."""
    if path == "onednn" and not _onednn_bf16():
        pytest.skip("this CPU has no oneDNN bfloat16 kernels (needs AVX-512 BF16 or AMX)")
    if path == "torch":
        monkeypatch.setattr(llama, "pack_bf16", lambda w: None)
    cfg, weights = MODELS["gqa"]
    engine = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=64, dtype="bfloat16"))
    assert engine.model.act_dtype == torch.float32 and engine.cache.kv.dtype == torch.float16
    qkv = engine.model.layers[0].qkv
    if path == "onednn":  # oneDNN's copy replaces torch's
        assert qkv.dnn is not None and qkv.dnn.dtype == torch.bfloat16 and qkv.nk is None and qkv.kn is None
    else:
        assert qkv.dnn is None and qkv.nk is not None and qkv.nk.dtype == torch.bfloat16
    assert engine.weight_bytes < 0.55 * 4 * engine.parameter_count
    prompt = _prompt(10, cfg.vocab_size, salt=4)
    got, tokens = _logits(engine, prompt)
    ref = reference_logits(cfg, weights, list(prompt) + tokens[:-1])[len(prompt) - 1 :]
    assert np.abs(got - ref).max() < 0.05  # bfloat16 weights only: ~1e-2 (all-bf16: 0.25)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"quant": "int4"}, "quant must be one of"),
        ({"quant": "INT8"}, "quant must be one of"),
        ({"quant": "int8", "dtype": "bfloat16"}, "float32"),
        ({"quant": "int8", "device": "cuda"}, "CPU"),
    ],
)
def test_quant_config_is_validated_once(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)
    worker_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    if worker_kwargs != kwargs:
        return
    with pytest.raises(ValueError, match="quant"):
        WorkerConfig(**worker_kwargs)


def test_quant_flag_and_environment(monkeypatch) -> None:
    assert parse_args([]).quant == "none"
    assert parse_args(["--quant", "int8"]).quant == "int8"
    monkeypatch.setenv("KVFLEET_QUANT", "int8")
    assert parse_args([]).quant == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--quant", "int4"])


def test_int8_is_a_transform_of_the_weights_that_leaves_its_input_alone() -> None:
    """int8.quantize takes the float weights the model would read and returns new ones (the
    float model built from the same weights is untouched), and int8 does not import the model."""
    import ast
    from pathlib import Path

    model = llama.LlamaModel(TIED, tiny_weights(TIED, seed=2), torch.device("cpu"), torch.float32, host_blas=False)
    before = [m.nk.clone() for layer in model.layers for m in layer.matrices()]
    weights = llama.ModelWeights(model.layers, model.norm, model.embed, model.lm_head, model.rotary)
    quantized, level = int8.quantize(TIED, weights)
    assert level in (*q8.LEVELS, "torch")
    assert all(m.q8 is not None and m.nk is None for layer in quantized.layers for m in layer.matrices())
    assert quantized.lm_head.q8 is not None and quantized.embed is None  # tied: the int8 head alone
    # Its lookup: the head's rows dequantized, the smoothing undone, near the float rows.
    tokens = torch.tensor([0, 5, TIED.vocab_size - 1])
    want = model.lm_head.nk.index_select(0, tokens)
    got = quantized.embed_rows(tokens)
    assert got.shape == want.shape and (got - want).abs().max() <= 0.01 * want.abs().max()
    after = [m.nk for layer in model.layers for m in layer.matrices()]
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and model.lm_head.q8 is None
    tree = ast.parse(Path(int8.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "worker_svc.model.llama" not in imported, imported

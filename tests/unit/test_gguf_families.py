"""Every family that llama.cpp's format carries, from a GGUF file: the checkpoints of
``tests/helpers/families.py`` (transformers' own, random weights) written as llama.cpp's
converter lays them out (``tests/helpers/gguf_families.py``: its architecture names, tensor
names, the Q/K permutation for "llama", rope_freqs for llama3, Phi-3's fused tensors), loaded
through the registry, and then

  * the config equals the one the Hugging Face directory loads (family options too; a
    Mistral is a "llama" there, as llama.cpp writes it; llama3's scaling arrives as
    ``rope_freqs``, whose frequencies equal transformers');
  * every weight equals the directory's, bit for bit, once the permutation is undone (the
    file does hold the permuted rows);
  * the engine's greedy tokens equal transformers' generate.

Cases the format cannot carry are left out: dynamic RoPE (the converter writes nothing for
it), Qwen2's per-layer windows (no key says which layers), and Gemma 3's layer types and
query_pre_attn_scalar where they are not llama.cpp's fixed ones ("gemma3-scalar"). A gemma3
file's norms hold Gemma's 1 + w, as the directory's load folds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfleet_models.config import FREQ_FACTORS, LlamaConfig
from kvfleet_models.errors import ModelLoadError
from kvfleet_models.registry import load_model
from kvfleet_models.rope import rope_frequencies
from kvfleet_models.safetensors_loader import load_hf_dir
from tests.helpers.engine_drive import drive
from tests.helpers.families import CASES, NEW_TOKENS, hf_greedy, make_checkpoint, prompts
from tests.helpers.gguf_families import ARCH, permute, write_gguf
from worker_svc.engine import Engine, EngineConfig

# (case, write llama.attention.sliding_window): the converter writes no window for Mistral;
# "mistral-window" is a file that carries one, which the loader honours.
GGUF_CASES = {
    "llama3": False,
    "llama-linear-tied": False,
    "llama-yarn": False,
    "mistral": False,
    "mistral-window": True,
    "qwen2": False,
    "qwen3": False,
    "phi3": False,
    "phi3-longrope": False,
    "gemma3": False,  # the converter always writes Gemma 3's window
}


@dataclass(frozen=True)
class Pair:
    name: str
    path: Path  # the GGUF file
    hf: Any  # transformers' model (the oracle)
    hf_cfg: LlamaConfig  # the HF directory's load
    hf_weights: dict[str, np.ndarray]
    cfg: LlamaConfig  # the GGUF's load
    weights: dict[str, np.ndarray]


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    name = request.param
    root = tmp_path_factory.mktemp(name)
    (root / "hf").mkdir()
    hf = make_checkpoint(CASES[name], root / "hf", seed=6)
    hf_cfg, hf_weights = load_hf_dir(root / "hf")
    path = write_gguf(CASES[name], hf, root / f"{name}.gguf", window=GGUF_CASES[name])
    cfg, weights = load_model(str(path))
    return Pair(name, path, hf, hf_cfg, hf_weights, cfg, weights)


def test_config_equals_the_hf_directorys(pair: Pair) -> None:
    ours, theirs = pair.cfg, pair.hf_cfg
    assert ours.family == ("llama" if theirs.family == "mistral" else theirs.family)
    ignored = {"name": None, "family": None, "rope_scaling": None}
    assert dataclasses.replace(ours, **ignored) == dataclasses.replace(theirs, **ignored)
    if theirs.rope_scaling is not None and theirs.rope_scaling.kind == "llama3":
        assert ours.rope_scaling is not None and ours.rope_scaling.kind == FREQ_FACTORS
        # rope_freqs holds float32 divisors: equal to transformers' float32 frequencies' precision.
        np.testing.assert_allclose(rope_frequencies(ours)[0], rope_frequencies(theirs)[0], rtol=1e-6, atol=0)
        assert len(set(ours.rope_scaling.freq_factors)) > 2  # high, blended and low bands all present
    elif theirs.rope_scaling is not None and theirs.rope_scaling.attention_factor is not None:
        # A float32 in the file (rope.scaling.attn_factor), a float64 in transformers' rule.
        assert ours.rope_scaling is not None
        assert ours.rope_scaling.attention_factor == pytest.approx(theirs.rope_scaling.attention_factor, rel=1e-7)
        assert dataclasses.replace(ours.rope_scaling, attention_factor=1.0) == dataclasses.replace(
            theirs.rope_scaling, attention_factor=1.0
        )
    else:
        assert ours.rope_scaling == theirs.rope_scaling


def test_weights_equal_the_hf_directorys(pair: Pair) -> None:
    import gguf

    assert pair.weights.keys() == pair.hf_weights.keys()
    for name, w in pair.weights.items():
        assert np.array_equal(w, pair.hf_weights[name]), name
    # The file really holds llama.cpp's layout: permuted q/k rows for "llama" only.
    tensors = {t.name: t for t in gguf.GGUFReader(pair.path).tensors}
    q = np.asarray(tensors.get("blk.0.attn_q.weight", tensors.get("blk.0.attn_qkv.weight")).data)
    hf_q = pair.hf_weights["model.layers.0.self_attn.q_proj.weight"]
    if ARCH[CASES[pair.name].family] == "llama":
        assert not np.array_equal(q, hf_q) and np.array_equal(q, permute(hf_q, pair.cfg.num_heads))
    else:
        assert np.array_equal(q[: hf_q.shape[0]], hf_q)


def test_engine_matches_transformers_generate(pair: Pair) -> None:
    engine = Engine(pair.cfg, pair.weights, EngineConfig(block_size=4, num_blocks=64))
    plan = prompts()
    tokens, _ = drive(engine, plan, NEW_TOKENS)
    assert [list(t) for t in tokens] == [hf_greedy(pair.hf, p, NEW_TOKENS) for p in plan]


def test_another_architecture_is_refused_naming_those_supported(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gemma2.gguf"
    w = gguf.GGUFWriter(path, "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "architecture 'gemma2' is not supported (supported: llama, qwen2, qwen3, phi3, gemma3)" in message, message
    assert str(path) in message


def _llama_metadata_only(path: Path, extra: Any) -> Path:
    """A "llama" GGUF with hyperparameters only (the RoPE checks run before any weight is read)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "extra, says",
    [
        (lambda w: (w.add_string("llama.rope.scaling.type", "linear"), w.add_rope_scaling_factor(2.0),
                    w.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))),
         "rope_freqs together with RoPE scaling 'linear' is not supported"),
        (lambda w: w.add_tensor("rope_freqs.weight", np.ones(3, dtype=np.float32)), "rope_freqs.weight has 3 entries"),
        (lambda w: w.add_string("llama.rope.scaling.type", "su"), "RoPE scaling 'su' is not supported"),
        (lambda w: w.add_rope_dimension_count(4), "partial rotary (4 of 8 dims)"),
    ],
)  # fmt: skip
def test_rope_the_engine_cannot_run_is_refused(tmp_path: Path, extra: Any, says: str) -> None:
    path = _llama_metadata_only(tmp_path / "m.gguf", extra)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    assert says in str(info.value) and str(path) in str(info.value), str(info.value)


def _gemma3_metadata_only(path: Path, layers: int, extra: Any) -> Path:
    """A "gemma3" GGUF with hyperparameters only, as the converter writes them (hidden 64,
    4 heads of 32)."""
    import gguf

    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_token_list([f"t{i}" for i in range(8)])
    extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "layers, extra, window, local_layers, local_theta, scalar",
    [
        # llama.cpp's fixed pattern: one global layer in every 6, local RoPE base 10000
        (6, lambda w: w.add_sliding_window(5), 5, (0, 1, 2, 3, 4), 10000.0, 32.0),
        (8, lambda w: (w.add_sliding_window(5), w.add_rope_freq_base_swa(2000.0)), 5, (0, 1, 2, 3, 4, 6, 7), 2000.0,
         32.0),
        # no window: every layer global, one RoPE
        (6, lambda w: None, 0, None, 0.0, 32.0),
        # a window the context fits in hides nothing, but the local layers keep their RoPE
        (6, lambda w: w.add_sliding_window(512), 0, (0, 1, 2, 3, 4), 10000.0, 32.0),
        # the 27B (62 layers): scores scaled by hidden / heads, not head_dim
        (62, lambda w: (w.add_sliding_window(5), w.add_final_logit_softcapping(30.0)), 5,
         tuple(i for i in range(62) if (i + 1) % 6), 10000.0, 16.0),
    ],
)  # fmt: skip
def test_gemma3_metadata_is_read_as_llama_cpp_reads_it(
    tmp_path: Path,
    layers: int,
    extra: Any,
    window: int,
    local_layers: tuple[int, ...] | None,
    local_theta: float,
    scalar: float,
) -> None:
    from kvfleet_models.gguf_loader import config_from_metadata, open_gguf

    path = _gemma3_metadata_only(tmp_path / "g.gguf", layers, extra)
    cfg = config_from_metadata(open_gguf(path), path)
    assert (cfg.family, cfg.sliding_window, cfg.sliding_layers) == ("gemma3_text", window, local_layers)
    assert (cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (local_theta, scalar)
    assert (cfg.hidden_act, cfg.scaled_embedding, cfg.sandwich_norms, cfg.qk_norm) == ("gelu_tanh", True, True, True)
    assert cfg.final_logit_softcap == (30.0 if layers == 62 else 0.0)

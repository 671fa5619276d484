"""Llama weights from a GGUF file (llama.cpp's format), as float32 arrays named like HF's.

A GGUF holds metadata (hyperparameters, tokenizer) and tensors that are usually quantized.
Three things differ from a Hugging Face checkpoint and are undone here:
  * names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``;
  * shape order: GGUF lists dimensions innermost first (``ne``), numpy outermost first;
  * the rows of q_proj and k_proj are permuted for llama.cpp's rotary layout (see
    ``unpermute_rotary_rows``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_models.config import LlamaConfig
from kvfleet_models.errors import ModelLoadError, check_weights

GGUF_MAGIC = b"GGUF"

# Per-layer tensors: GGUF name inside ``blk.N.`` -> HF name inside ``model.layers.N.``.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` on ``path``, or ModelLoadError saying why the file is unusable."""
    import gguf  # deferred: only GGUF users pay for the import

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader throws ValueError/IndexError/... on a damaged file
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
    # The reader maps tensors lazily; a tensor running past the end of the file shows up here.
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(f"{path}: truncated GGUF file ({path.stat().st_size} bytes, tensors need {end})")
    return reader


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python str/int/float/bool, or a list of them for arrays.

    Read from the raw ``parts`` rather than ``ReaderField.contents()``, which older gguf
    releases lack.
    """
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default

    def decode(part: np.ndarray, vtype: Any) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [decode(field.parts[i], field.types[-1]) for i in field.data]
    return decode(field.parts[field.data[0]], field.types[0])


def _required(reader: Any, key: str, path: Path) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
    return value


def config_from_metadata(reader: Any, path: Path) -> LlamaConfig:
    """The LlamaConfig a GGUF file's ``llama.*`` metadata describes."""
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (only 'llama')")
    heads = int(_required(reader, "llama.attention.head_count", path))
    hidden = int(_required(reader, "llama.embedding_length", path))
    rope_dims = field_value(reader, "llama.rope.dimension_count")
    if rope_dims is not None and rope_dims != hidden // heads:
        raise ModelLoadError(f"{path}: partial rotary ({rope_dims} of {hidden // heads} dims) is not supported")
    scaling = field_value(reader, "llama.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"{path}: RoPE scaling ({scaling!r} / rope_freqs) is not supported")
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    vocab = field_value(reader, "llama.vocab_size") or len(tokens)
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    # eot (end of turn) also ends generation in llama.cpp; keep both, once each, eos first.
    stops = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    try:
        return LlamaConfig(
            name=path.stem,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(_required(reader, "llama.block_count", path)),
            num_heads=heads,
            num_kv_heads=int(field_value(reader, "llama.attention.head_count_kv", heads)),
            intermediate_size=int(_required(reader, "llama.feed_forward_length", path)),
            rope_theta=float(field_value(reader, "llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(field_value(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position=int(field_value(reader, "llama.context_length", 2048)),
            # llama.cpp writes no output.weight when the head shares the embedding matrix.
            tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
            eos_token_ids=tuple(dict.fromkeys(int(s) for s in stops if s is not None)),
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: inconsistent hyperparameters: {e}") from None


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name for a GGUF tensor name, or None for one a Llama does not have."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        hf = _LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.weight" if hf else None
    stem = gguf_name.removesuffix(".weight")
    hf = _GLOBAL_NAMES.get(stem) if stem != gguf_name else None
    return f"{hf}.weight" if hf else None


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of the rows of q_proj / k_proj.

    HF's rotate_half pairs dimension i of a head with i + head_dim/2; llama.cpp's kernel pairs
    2i with 2i+1. Its converter therefore interleaves the two halves of every head's rows:
    GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i. We invert that so the HF convention
    applies. ``n_heads`` is the number of heads the matrix projects to (num_kv_heads for k).
    """
    half = w.shape[0] // n_heads // 2
    # w: [n_heads * head_dim, in] seen as [n_heads, half, 2, in] -> [n_heads, 2, half, in]
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor: Any, path: Path) -> np.ndarray:
    """One GGUF tensor as a float32 array in numpy (outermost-first) shape, owning its memory."""
    import gguf

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF ne is innermost first
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from None
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is damaged ({e})") from None
    if array.size != math.prod(shape):
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} holds {array.size} values, shape {shape} needs {math.prod(shape)}"
        )
    # F32 comes back as a view of the memory-mapped file: copy so the weights outlive the reader.
    return np.array(array, dtype=np.float32, copy=True).reshape(shape)


def load_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and float32 HF-named weights of the Llama model in a GGUF file.

    Raises ModelLoadError (naming the file) for a missing, foreign, damaged or non-Llama file.
    """
    path = Path(path)
    reader = open_gguf(path)
    cfg = config_from_metadata(reader, path)
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has no place in a Llama model")
        weights[name] = dequantize_tensor(tensor, path)
    check_weights(cfg, weights, path)  # first, so the reshapes below see the shapes they expect
    for n in range(cfg.num_layers):
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            key = f"model.layers.{n}.self_attn.{proj}.weight"
            weights[key] = unpermute_rotary_rows(weights[key], heads)
    return cfg, weights

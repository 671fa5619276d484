"""Weights of a GGUF file (llama.cpp's format), as float32 arrays named like HF's, for the
architectures in ``ARCHITECTURES`` (llama.cpp's names; Mistral is written as "llama").

A GGUF holds metadata (hyperparameters, tokenizer) and tensors that are usually quantized.
What differs from a Hugging Face checkpoint is undone here:
  * names: ``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``;
  * shape order: GGUF lists dimensions innermost first (``ne``), numpy outermost first;
  * for "llama" only, the rows of q_proj and k_proj are permuted for llama.cpp's rotary layout
    (see ``unpermute_rotary_rows``); qwen2/qwen3/phi3 use the NeoX layout, HF's own;
  * phi3 keeps q/k/v in one ``attn_qkv`` and gate/up in one ``ffn_up``: split at load;
  * llama3 RoPE scaling is a ``rope_freqs`` tensor of per-pair divisors, not parameters;
  * gemma3 names its sandwich norms ``post_attention_norm`` / ``ffn_norm`` / ``post_ffw_norm``,
    stores every norm with Gemma's + 1 already added (the multiplier our loaders hand on), and
    leaves to the reader what llama.cpp hard-codes: every 6th layer global, the others local
    with RoPE base 10000, the score scale 1/sqrt(head_dim) (hidden/heads for the 62-layer 27B).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_models.config import FREQ_FACTORS, LlamaConfig, RopeScaling
from kvfleet_models.errors import ModelLoadError, check_weights
from kvfleet_models.gguf_blocks import FORMATS, BlockTensor, dequantize_rows
from kvfleet_models.gguf_file import FLOAT32, GgufFile

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture differs from a Llama, in LlamaConfig's family options."""

    family: str  # the LlamaConfig.family it loads as
    permuted_qk: bool  # the converter interleaved q/k rows (llama.cpp's non-NeoX rotary)
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False  # attn_qkv = [q; k; v] rows, ffn_up = [gate; up] rows (Phi-3)
    windowed: bool = False  # {arch}.attention.sliding_window, when present, on every layer
    gemma: bool = False  # Gemma 3's options (``_gemma_options``)
    # Per-layer GGUF names that mean another HF tensor in this architecture than in ``_LAYER_NAMES``.
    names: tuple[tuple[str, str], ...] = ()


ARCHITECTURES = {
    # Mistral too: llama.cpp's converter writes MistralForCausalLM as "llama" (without its window).
    "llama": Architecture("llama", permuted_qk=True, windowed=True),
    "qwen2": Architecture("qwen2", permuted_qk=False, qkv_bias=True),
    "qwen3": Architecture("qwen3", permuted_qk=False, qk_norm=True),
    "phi3": Architecture("phi3", permuted_qk=False, fused=True, windowed=True),
    # Gemma's post_attention_layernorm is the attention output's norm; its MLP input norm is
    # pre_feedforward_layernorm (llama.cpp's ffn_norm).
    "gemma3": Architecture(
        "gemma3_text",
        permuted_qk=False,
        qk_norm=True,
        gemma=True,
        names=(
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ),
    ),
}
# llama.cpp's fixed Gemma 3 choices (llama-model.cpp): one global layer in every 6, RoPE base
# 10000 on the local ones, and the 27B (62 layers) scaling scores by hidden / heads.
_GEMMA_PATTERN = 6
_GEMMA_LOCAL_THETA = 10000.0
_GEMMA_27B_LAYERS = 62

# Per-layer tensors: GGUF name inside ``blk.N.`` -> HF name inside ``model.layers.N.``.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Phi-3's fused ones, split by ``split_fused`` under the HF names of their parts.
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# RoPE tables (not weights): read into the config.
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str | Path) -> GgufFile:
    """``path`` parsed (``gguf_file.GgufFile``), or ModelLoadError saying why it is unusable."""
    return GgufFile(path)


def field_value(reader: GgufFile, key: str, default: Any = None) -> Any:
    """A metadata value as a Python str/int/float/bool, or a list of them for arrays."""
    return reader.values.get(key, default)


def _required(reader: GgufFile, key: str, path: Path) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
    return value


def _float(reader: GgufFile, key: str, default: float) -> float:
    """A float metadata value; float32 ones as the shortest decimal that rounds to them (the
    value the converter was given: 1e-06, not 9.99999997e-07)."""
    value = field_value(reader, key)
    if value is None:
        return default
    if reader.types[key] == FLOAT32:
        return float(str(np.float32(value)))
    return float(value)


def _architecture(reader: GgufFile, path: Path) -> tuple[str, Architecture]:
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return str(arch), ARCHITECTURES[arch]


def _rope_table(reader: GgufFile, name: str, pairs: int, path: Path) -> tuple[float, ...] | None:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    if tensor is None:
        return None
    values = dequantize_tensor(tensor, path).reshape(-1)
    if values.size != pairs:
        raise ModelLoadError(f"{path}: {name} has {values.size} entries, head_dim / 2 is {pairs}")
    return tuple(float(str(v)) for v in values)  # float32: the shortest decimal, as ``_float``


def _rope(reader: GgufFile, arch: str, head_dim: int, context: int, path: Path) -> tuple[RopeScaling | None, int]:
    """(the RoPE scaling, the context served) from ``{arch}.rope.scaling.*`` and the RoPE
    tables llama.cpp's converter writes: ``rope_freqs`` (llama3), ``rope_factors_short``
    with ``attn_factor`` (Phi-3 longrope, served up to its original context as the Hugging
    Face loader serves it, so ``rope_factors_long`` is never read)."""
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none")
    factor = _float(reader, f"{arch}.rope.scaling.factor", 1.0)
    # Without an original context, the context itself (transformers' default too).
    original = int(field_value(reader, f"{arch}.rope.scaling.original_context_length", 0)) or context
    freqs = _rope_table(reader, "rope_freqs.weight", head_dim // 2, path)
    short = _rope_table(reader, "rope_factors_short.weight", head_dim // 2, path)
    try:
        if freqs is not None:
            if kind != "none" or short is not None:
                raise ModelLoadError(f"{path}: rope_freqs together with RoPE scaling {kind!r} is not supported")
            return RopeScaling(FREQ_FACTORS, freq_factors=freqs), context
        if short is not None:  # Phi-3 longrope (its converter writes no scaling type)
            attention = _float(reader, f"{arch}.rope.scaling.attn_factor", 1.0)
            factor = context / original  # transformers' rule for a longrope without a factor
            scaling = RopeScaling("longrope", factor=factor, original_max_position=original, short_factor=short,
                                  attention_factor=attention)  # fmt: skip
            if original < context:
                log.warning(
                    "%s: longrope RoPE switches to its long factors past %d positions, which this engine "
                    "does not run: serving up to %d tokens (of %d)", path, original, original, context,
                )  # fmt: skip
                return scaling, original
            return scaling, context
        if kind == "none":
            return None, context
        if kind == "linear":
            return RopeScaling("linear", factor=factor, original_max_position=original), context
        if kind == "yarn":
            key = f"{arch}.rope.scaling.yarn_attn_factor"  # absent: yarn's own 0.1 ln(factor) + 1
            return RopeScaling(
                "yarn",
                factor=factor,
                original_max_position=original,
                beta_fast=_float(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
                beta_slow=_float(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
                attention_factor=_float(reader, key, 1.0) if key in reader.values else None,
            ), context
    except ValueError as e:
        raise ModelLoadError(f"{path}: bad RoPE scaling {kind!r}: {e}") from None
    raise ModelLoadError(f"{path}: RoPE scaling {kind!r} is not supported (supported: none, linear, yarn, rope_freqs)")


def _gemma_options(reader: GgufFile, arch: str, window: int, head_dim: int, hidden_per_head: int) -> dict[str, Any]:
    """LlamaConfig options of a gemma3 file, as llama.cpp reads them: without a window every
    layer is global (one RoPE); with one, every 6th layer."""
    layers = int(field_value(reader, f"{arch}.block_count", 0))
    local = {}
    if window > 0:
        local = {
            "sliding_layers": tuple(i for i in range(layers) if (i + 1) % _GEMMA_PATTERN),
            "local_rope_theta": _float(reader, f"{arch}.rope.freq_base_swa", _GEMMA_LOCAL_THETA),
        }
    return {
        **local,
        "hidden_act": "gelu_tanh",
        "scaled_embedding": True,
        "sandwich_norms": True,
        "query_pre_attn_scalar": float(hidden_per_head if layers == _GEMMA_27B_LAYERS else head_dim),
        "final_logit_softcap": _float(reader, f"{arch}.final_logit_softcapping", 0.0),
    }


def config_from_metadata(reader: GgufFile, path: Path) -> LlamaConfig:
    """The LlamaConfig a GGUF file's ``{arch}.*`` metadata (and RoPE tables) describe."""
    arch, spec = _architecture(reader, path)
    heads = int(_required(reader, f"{arch}.attention.head_count", path))
    hidden = int(_required(reader, f"{arch}.embedding_length", path))
    # key_length is the head width where it is not hidden / heads (Qwen3, Mistral Nemo).
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", 0)) or hidden // heads
    value_dim = int(field_value(reader, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelLoadError(f"{path}: value_length {value_dim} differs from key_length {head_dim}")
    rope_dims = field_value(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    context = int(field_value(reader, f"{arch}.context_length", 2048))
    scaling, max_position = _rope(reader, arch, head_dim, context, path)
    # A window as long as the context hides nothing (Phi-3 writes 0 for none).
    window = int(field_value(reader, f"{arch}.attention.sliding_window", 0)) if spec.windowed or spec.gemma else 0
    gemma = _gemma_options(reader, arch, window, head_dim, hidden // heads) if spec.gemma else {}
    window = window if 0 < window < max_position else 0
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    vocab = field_value(reader, f"{arch}.vocab_size") or len(tokens)
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    # eot (end of turn) also ends generation in llama.cpp; keep both, once each, eos first.
    stops = [field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    try:
        return LlamaConfig(
            name=path.stem,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(_required(reader, f"{arch}.block_count", path)),
            num_heads=heads,
            num_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv", heads)),
            intermediate_size=int(_required(reader, f"{arch}.feed_forward_length", path)),
            rope_theta=_float(reader, f"{arch}.rope.freq_base", 10000.0),
            rms_norm_eps=_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            max_position=max_position,
            # llama.cpp writes no output.weight when the head shares the embedding matrix.
            tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
            eos_token_ids=tuple(dict.fromkeys(int(s) for s in stops if s is not None)),
            family=spec.family,
            head_dim=head_dim,
            rope_scaling=scaling,
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
            sliding_window=window,
            **gemma,
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: inconsistent hyperparameters: {e}") from None


def hf_tensor_name(gguf_name: str, fused: bool = False, names: tuple[tuple[str, str], ...] = ()) -> str | None:
    """The HF name for a GGUF tensor name (Phi-3's fused tensors under their fused HF names
    when ``fused``; ``names``: an architecture's own meanings, ``Architecture.names``), or None
    for one no family here has."""
    if m := _LAYER_RE.fullmatch(gguf_name):
        block, stem, kind = m.groups()
        hf = (_FUSED_NAMES.get(stem) if fused else None) or dict(names).get(stem) or _LAYER_NAMES.get(stem)
        return f"model.layers.{block}.{hf}.{kind}" if hf else None
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
    fmt = FORMATS.get(tensor.tensor_type.name)
    if fmt is not None:
        # Our reading of the block formats: the same floats as gguf's (test_gguf_kernels), in a
        # third of its time on SmolLM2's Q4_1 weights (0.28 s against 0.80), into fresh memory.
        try:
            rows = np.asarray(tensor.data).reshape(math.prod(shape[:-1]), -1)
            return dequantize_rows(fmt, rows, shape[-1]).reshape(shape)
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensor {tensor.name} is damaged ({e})") from None
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
    # F32 comes back as a view of the memory-mapped file: copy so the weights outlive the reader
    # (only then: a copy of what gguf made afresh cost 0.28 s of SmolLM2's load).
    if array.dtype != np.float32 or np.may_share_memory(array, tensor.data):
        array = np.array(array, dtype=np.float32, copy=True)
    return array.reshape(shape)


def load_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and float32 HF-named weights of the model in a GGUF file.

    Raises ModelLoadError (naming the file) for a missing, foreign or damaged file, or one of
    an architecture not in ``ARCHITECTURES``.
    """
    cfg, weights = _load(Path(path), keep_blocks=False)
    return cfg, {name: w for name, w in weights.items() if isinstance(w, np.ndarray)}


def load_gguf_blocks(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray | BlockTensor]]:
    """As ``load_gguf``, but every 2-D weight stays in the file's blocks (``BlockTensor``), for
    ``--quant gguf``; the 1-D ones (norms, biases) are float32. ModelLoadError for a weight in a
    format the block products do not run (naming the ones they do), and for Phi-3's fused
    tensors (not split in blocks yet)."""
    return _load(Path(path), keep_blocks=True)


def _block_tensor(tensor: Any, path: Path) -> BlockTensor:
    shape = tuple(int(n) for n in reversed(tensor.shape))
    fmt = FORMATS.get(tensor.tensor_type.name)
    if fmt is None:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}; --quant gguf serves "
            f"{', '.join(FORMATS)} weights (load it without --quant gguf to run it dequantized)"
        )
    rows = np.array(tensor.data, dtype=np.uint8, copy=True)  # own the bytes: they outlive the reader
    try:
        return BlockTensor(fmt, rows.reshape(shape[0], -1), shape[1])
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is damaged ({e})") from None


def _load(path: Path, keep_blocks: bool) -> tuple[LlamaConfig, dict[str, np.ndarray | BlockTensor]]:
    from kvfleet_models.safetensors_loader import split_fused

    reader = open_gguf(path)
    cfg = config_from_metadata(reader, path)
    spec = ARCHITECTURES[str(field_value(reader, "general.architecture"))]
    if keep_blocks and spec.fused:
        raise ModelLoadError(f"{path}: --quant gguf does not split {cfg.family}'s fused q/k/v and gate/up blocks yet")
    weights: dict[str, np.ndarray | BlockTensor] = {}
    for tensor in reader.tensors:
        if tensor.name in _ROPE_TENSORS:  # read into the config's RoPE scaling
            continue
        name = hf_tensor_name(tensor.name, fused=spec.fused, names=spec.names)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has no place in a {cfg.family} model")
        if keep_blocks and len(tensor.shape) == 2:
            weights[name] = _block_tensor(tensor, path)
        else:
            weights[name] = dequantize_tensor(tensor, path)
    if spec.fused:
        floats = {name: w for name, w in weights.items() if isinstance(w, np.ndarray)}
        weights = dict(split_fused(cfg, floats, path))
    check_weights(cfg, weights, path)  # first, so the reshapes below see the shapes they expect
    if spec.permuted_qk:
        for n in range(cfg.num_layers):
            for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
                key = f"model.layers.{n}.self_attn.{proj}.weight"
                w = weights[key]
                if isinstance(w, BlockTensor):  # whole rows move: the same permutation of row indices
                    weights[key] = w.take_rows(unpermute_rotary_rows(np.arange(w.shape[0]), heads))
                else:
                    weights[key] = unpermute_rotary_rows(w, heads)
    return cfg, weights

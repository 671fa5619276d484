"""GGUF files of the family checkpoints (``tests/helpers/families.py``), written with the
``gguf`` package's GGUFWriter the way llama.cpp's converter (convert_hf_to_gguf.py) lays
them out, at F32 (``--outtype f32``), so that a loaded weight is the checkpoint's bit for bit:

  * architecture names: Llama and Mistral as "llama", Qwen2 "qwen2", Qwen3 "qwen3", Phi-3 "phi3";
  * the hyperparameters under ``{arch}.*`` (key_length / value_length where the config has a
    head_dim, rope.dimension_count for llama and phi3, vocab_size for llama);
  * "llama" only: q_proj / k_proj rows permuted for llama.cpp's rotary (``permute``);
  * llama3 RoPE scaling as a ``rope_freqs`` tensor of per-pair divisors; linear and yarn as
    ``rope.scaling.*`` keys; Phi-3 longrope as rope_factors_short/long and attn_factor;
  * Phi-3's qkv_proj as ``attn_qkv``, its gate_up_proj as ``ffn_up``; Phi-3's window always
    written (0 for none). The converter writes no window for Mistral or Qwen2: ``window=True``
    adds ``llama.attention.sliding_window`` as some files carry it;
  * Gemma 3 as "gemma3": its sandwich norms as ``post_attention_norm`` / ``ffn_norm`` /
    ``post_ffw_norm``, every norm weight stored + 1, key/value_length always, the global
    layers' RoPE base and scaling, the window and final_logit_softcapping; nothing for the
    local layers or query_pre_attn_scalar (llama.cpp fixes those).

Written from our reading of the converter; none of its code is used.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers import kquants
from tests.helpers.families import Case
from tests.helpers.vocabularies import add_vocab

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma3_text": "gemma3"}  # fmt: skip
# Gemma's own meanings of the HF names (its post_attention_layernorm is the attention output's).
_GEMMA_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows: each head's two halves interleaved,
    so HF row h*D + j*D/2 + i becomes row h*D + 2i + j."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.weight|bias
    assert parts[:2] == ["model", "layers"], hf
    module = ".".join(parts[3:-1])
    stem = _GEMMA_LAYER.get(module) if arch == "gemma3" else None
    return f"blk.{parts[2]}.{stem or _LAYER[module]}.{parts[-1]}"


def _llama3_factors(rope: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The converter's rope_freqs: per pair, 1 (high frequencies), ``factor`` (low) or the
    reciprocal of the llama3 blend between."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(
    case: Case, model: Any, path: Path, window: bool = False, vocab: Any = None, quant: dict[str, str] | None = None
) -> Path:
    """``model`` (the transformers model of ``case``) as a GGUF file at ``path``, with the
    vocabulary of ``vocab`` (a ``vocabularies.Original``) or placeholder tokens. ``quant``:
    GGUF tensor name stem (``attn_q``, ``token_embd``, ...) -> a block format (``Q4_1``...)
    its 2-D weight is quantized to by the gguf package (as llama.cpp's quantizer writes it;
    Q4_K and Q6_K, which it does not write, by ``kquants``); the others stay F32."""
    import gguf

    hp = model.config
    arch = ARCH[case.family]
    w = gguf.GGUFWriter(path, arch)
    heads, kv_heads, hidden = hp.num_attention_heads, hp.num_key_value_heads, hp.hidden_size
    head_dim = getattr(hp, "head_dim", None) or hidden // heads
    w.add_block_count(hp.num_hidden_layers)
    w.add_context_length(hp.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hp.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    rope = dict(hp.rope_parameters)
    if arch == "gemma3":  # the global layers' (the local ones' are llama.cpp's fixed choice)
        rope = dict(rope["full_attention"])
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp.rms_norm_eps)
    if "head_dim" in case.options or arch == "gemma3":  # where config.json has head_dim; gemma3's always
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if arch == "llama":
        w.add_vocab_size(hp.vocab_size)
    if arch == "phi3":
        w.add_sliding_window(hp.sliding_window or 0)
        original = getattr(hp, "original_max_position_embeddings", None) or hp.max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
    elif window or arch == "gemma3":
        w.add_sliding_window(hp.sliding_window)
    if arch == "gemma3" and hp.final_logit_softcapping:
        w.add_final_logit_softcapping(hp.final_logit_softcapping)
    # The converter writes the tokenizer too; its token list gives qwen/phi3 their vocabulary.
    if vocab is not None:
        add_vocab(w, vocab)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(hp.vocab_size)])
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, rope["rope_theta"], head_dim))
    if kind == "longrope":
        scale = hp.max_position_embeddings / hp.original_max_position_embeddings
        attn = math.sqrt(1 + math.log(scale) / math.log(hp.original_max_position_embeddings)) if scale > 1 else 1.0
        w.add_rope_scaling_attn_factors(attn)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    tied = hp.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":  # a tied head is not in the checkpoint
            continue
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):  # Gemma's (1 + w), stored summed
            data = data + np.float32(1.0)
        stem = gguf_name(name, arch).split(".")[-2]
        if quant and stem in quant and data.ndim == 2:
            kind = gguf.GGMLQuantizationType[quant[stem]]
            w.add_tensor(gguf_name(name, arch), kquants.quantize(data, quant[stem]), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name(name, arch), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

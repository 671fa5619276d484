"""ModelLoadError, and the layout check every loader runs before handing weights on.

Loaders raise ModelLoadError instead of whatever the parsing library threw, so that a worker
can report a bad ``--model`` flag as one readable line naming the file, not a deep traceback.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvfleet_models.config import LlamaConfig
from kvfleet_models.gguf_blocks import BlockTensor


class ModelLoadError(Exception):
    """A model could not be located or read; the message names the file and the problem."""


class NoTokenizerError(ModelLoadError):
    """The model has no tokenizer at all (tiny, or a Hugging Face directory without
    tokenizer.json): it is served on token ids only. Not a load failure: callers turn text off."""


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model with this config needs (its family options' too), HF-named, with
    its [out, in] shape."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q_dim = cfg.q_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_dim, h),
                p + "self_attn.k_proj.weight": (cfg.kv_dim, h),
                p + "self_attn.v_proj.weight": (cfg.kv_dim, h),
                p + "self_attn.o_proj.weight": (h, q_dim),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
        if cfg.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_dim,),
                    p + "self_attn.k_proj.bias": (cfg.kv_dim,),
                    p + "self_attn.v_proj.bias": (cfg.kv_dim,),
                }
            )
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm is then the attention output's
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_weights(cfg: LlamaConfig, weights: Mapping[str, np.ndarray | BlockTensor], source: object) -> None:
    """Raise ModelLoadError unless ``weights`` is exactly the float32 set ``cfg`` calls for
    (a GGUF's weights kept in blocks, ``--quant gguf``: the shapes only).

    A wrong shape would otherwise surface much later as a broadcasting error deep in a forward
    pass, far from the file that caused it.
    """
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ModelLoadError(f"{source}: {len(missing)} weight(s) missing, e.g. {missing[:3]}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ModelLoadError(f"{source}: unexpected weight(s) for a {cfg.family} model: {extra[:3]}")
    for name, shape in expected.items():
        got = weights[name]
        if got.shape != shape:
            raise ModelLoadError(f"{source}: {name} has shape {got.shape}, config implies {shape}")
        if isinstance(got, np.ndarray) and got.dtype != np.float32:
            raise ModelLoadError(f"{source}: {name} has dtype {got.dtype}, loaders must give float32")

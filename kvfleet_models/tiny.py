"""Deterministic synthetic weights for the tiny test models, named as in HF LlamaForCausalLM."""

from __future__ import annotations

import numpy as np

from kvfleet_models.config import LlamaConfig


def tiny_weights(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights drawn in a fixed order from ``np.random.default_rng(seed)``.

    Projections are N(0, 1/fan_in) rather than the usual N(0, 0.02): with so few, so narrow
    layers a 0.02 init leaves the residual stream dominated by the input embedding, and greedy
    decoding collapses onto one repeated token. Unit-variance activations give varied outputs,
    which is what parity tests need. Norm weights are 1 + small noise so that a wrongly applied
    (or forgotten) norm weight shows up in the logits.
    """
    rng = np.random.default_rng(seed)
    h, kv, inter = cfg.hidden_size, cfg.kv_dim, cfg.intermediate_size

    def linear(out_features: int, in_features: int) -> np.ndarray:
        w = rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)
        return w.astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    weights: dict[str, np.ndarray] = {
        # Unit-variance embeddings: each layer's input goes through RMSNorm anyway.
        "model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, h)).astype(np.float32),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = linear(cfg.q_dim, h)
        weights[p + "self_attn.k_proj.weight"] = linear(kv, h)
        weights[p + "self_attn.v_proj.weight"] = linear(kv, h)
        weights[p + "self_attn.o_proj.weight"] = linear(h, cfg.q_dim)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, h)
        weights[p + "mlp.up_proj.weight"] = linear(inter, h)
        weights[p + "mlp.down_proj.weight"] = linear(h, inter)
    weights["model.norm.weight"] = norm()
    if not cfg.tie_word_embeddings:
        weights["lm_head.weight"] = linear(cfg.vocab_size, h)
    # Family options' tensors, drawn after the rest so that a plain Llama's weights stay as
    # they were.
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.self_attn."
        if cfg.qkv_bias:
            for proj, width in (("q", cfg.q_dim), ("k", kv), ("v", kv)):
                weights[p + f"{proj}_proj.bias"] = (0.5 * rng.standard_normal(width)).astype(np.float32)
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                weights[p + name + ".weight"] = (1.0 + 0.1 * rng.standard_normal(cfg.head_dim)).astype(np.float32)
        if cfg.sandwich_norms:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                weights[f"model.layers.{i}.{name}.weight"] = norm()
    return weights

"""The test oracle: a plain numpy decoder, one sequence at a time, no batching, no paging.

Written for obviousness, not speed; everything is computed in float64 so that the torch
model (float32) is compared against something strictly more accurate than itself. It reads
the same family options as the torch model (``LlamaConfig``), each applied where the family's
own Hugging Face model applies it; ``tests/unit/test_families.py`` keeps it equal to
transformers for every family.
"""

from __future__ import annotations

import numpy as np

from kvfleet_models.config import LlamaConfig
from kvfleet_models.rope import rope_frequencies


def _w(weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(weights[name], dtype=np.float64)


def _lm_head(cfg: LlamaConfig, weights: dict[str, np.ndarray]) -> np.ndarray:
    if "lm_head.weight" in weights:
        return _w(weights, "lm_head.weight")
    if cfg.tie_word_embeddings:
        return _w(weights, "model.embed_tokens.weight")
    raise KeyError("lm_head.weight is missing and tie_word_embeddings is False")


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float) -> np.ndarray:
    """HF "rotate_half" RoPE: dims i and i + D/2 form a pair. x: [T, H, D]; inv_freq: [D/2]."""
    d = x.shape[-1]
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, D/2]
    cos = scale * np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]  # [T, 1, D]
    sin = scale * np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated * sin


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _project(weights: dict[str, np.ndarray], name: str, h: np.ndarray, bias: bool = False) -> np.ndarray:
    """h @ W^T (+ b)."""
    y = h @ _w(weights, name + ".weight").T
    return y + _w(weights, name + ".bias") if bias else y


def _gated(cfg: LlamaConfig, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    if cfg.hidden_act == "gelu_tanh":  # GELU's tanh approximation, as transformers' gelu_pytorch_tanh
        act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)))
    else:
        act = gate / (1.0 + np.exp(-gate))  # silu
    return act * up


def _attention(
    cfg: LlamaConfig, i: int, q: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """Layer i's causal (and windowed) attention of q [T, Hq, D] over K, V [S, Hkv, D]: [T, Hq * D]."""
    t, hq, d = q.shape
    # GQA: query head j reads kv head j // (hq // hkv).
    k_rep = np.repeat(k_all, hq // cfg.num_kv_heads, axis=1)  # [S, Hq, D]
    v_rep = np.repeat(v_all, hq // cfg.num_kv_heads, axis=1)
    scores = np.einsum("thd,shd->hts", q, k_rep) * cfg.attention_scale  # [Hq, T, S]
    keys = np.arange(k_all.shape[0])[None, :]
    visible = keys <= positions[:, None]  # [T, S]
    if cfg.window(i):
        visible &= keys > positions[:, None] - cfg.window(i)
    scores = np.where(visible[None], scores, -np.inf)
    return np.einsum("hts,shd->thd", _softmax(scores), v_rep).reshape(t, hq * d)


def _forward(
    cfg: LlamaConfig, weights: dict[str, np.ndarray], token_ids: list[int], cache: list[tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """Run ``token_ids`` after the tokens already in ``cache`` (extended in place).

    ``cache[i]`` is layer i's (K, V), each [S, num_kv_heads, D] after RoPE. Returns [T, vocab].
    """
    d, hq, hkv, eps = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    start = cache[0][0].shape[0] if cache else 0
    t = len(token_ids)
    positions = np.arange(start, start + t)
    tables = {local: rope_frequencies(cfg, local) for local in {cfg.local_rope(i) for i in range(cfg.num_layers)}}
    x = _w(weights, "model.embed_tokens.weight")[np.asarray(token_ids)] * cfg.embed_multiplier  # [T, hidden]
    # The norm before the MLP: Llama's post_attention_layernorm is Gemma's pre_feedforward one.
    mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        inv_freq, rope_scale = tables[cfg.local_rope(i)]
        h = _rms_norm(x, _w(weights, p + "input_layernorm.weight"), eps)
        q = _project(weights, p + "self_attn.q_proj", h, cfg.qkv_bias).reshape(t, hq, d)
        k = _project(weights, p + "self_attn.k_proj", h, cfg.qkv_bias).reshape(t, hkv, d)
        v = _project(weights, p + "self_attn.v_proj", h, cfg.qkv_bias).reshape(t, hkv, d)
        if cfg.qk_norm:  # per head, over its D dims
            q = _rms_norm(q, _w(weights, p + "self_attn.q_norm.weight"), eps)
            k = _rms_norm(k, _w(weights, p + "self_attn.k_norm.weight"), eps)
        q, k = _rope(q, positions, inv_freq, rope_scale), _rope(k, positions, inv_freq, rope_scale)
        if len(cache) <= i:
            cache.append((np.zeros((0, hkv, d)), np.zeros((0, hkv, d))))
        cache[i] = (np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v]))  # [S, Hkv, D]
        attn = _attention(cfg, i, q, cache[i][0], cache[i][1], positions) @ _w(weights, p + "self_attn.o_proj.weight").T
        if cfg.sandwich_norms:  # normed before the residual add
            attn = _rms_norm(attn, _w(weights, p + "post_attention_layernorm.weight"), eps)
        x = x + attn
        h = _rms_norm(x, _w(weights, p + mlp_norm + ".weight"), eps)
        gate = h @ _w(weights, p + "mlp.gate_proj.weight").T
        up = h @ _w(weights, p + "mlp.up_proj.weight").T
        mlp = _gated(cfg, gate, up) @ _w(weights, p + "mlp.down_proj.weight").T
        if cfg.sandwich_norms:
            mlp = _rms_norm(mlp, _w(weights, p + "post_feedforward_layernorm.weight"), eps)
        x = x + mlp
    x = _rms_norm(x, _w(weights, "model.norm.weight"), eps)
    logits = x @ _lm_head(cfg, weights).T
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
    return logits


def reference_logits(
    cfg: LlamaConfig, weights: dict[str, np.ndarray], token_ids: list[int] | tuple[int, ...]
) -> np.ndarray:
    """Logits [T, vocab] (float64) of every position of one sequence."""
    return _forward(cfg, weights, list(token_ids), [])


def reference_generate(
    cfg: LlamaConfig, weights: dict[str, np.ndarray], prompt_ids: list[int] | tuple[int, ...], max_new_tokens: int
) -> list[int]:
    """Greedy continuation (argmax, ties to the lowest id) using an incremental KV cache."""
    cache: list[tuple[np.ndarray, np.ndarray]] = []
    out: list[int] = []
    logits = _forward(cfg, weights, list(prompt_ids), cache)
    for _ in range(max_new_tokens):
        out.append(int(np.argmax(logits[-1])))
        if len(out) < max_new_tokens:
            logits = _forward(cfg, weights, [out[-1]], cache)
    return out

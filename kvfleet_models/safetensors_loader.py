"""Weights of a Hugging Face model directory: config.json plus *.safetensors shards, for the
families in ``FAMILIES`` (the config says which; ``config_from_json`` reads its options)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_models.config import ROPE_KINDS, LlamaConfig, RopeScaling
from kvfleet_models.errors import ModelLoadError, check_weights

log = logging.getLogger(__name__)

# The families this engine runs (HF model_type), and the architecture names that imply them
# for a config whose model_type is none of those.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
_ARCHITECTURES = {
    "Gemma3ForCausalLM": "gemma3_text",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
_MAX_POSITION = 2048  # a config without max_position_embeddings
# The MLP activation each family's checkpoints use (HF's name): anything else is refused.
_ACTIVATION = {family: "silu" for family in FAMILIES} | {"gemma3_text": "gelu_pytorch_tanh"}
# Gemma3TextConfig's defaults where they are not the ones read below (released configs leave
# out tie_word_embeddings, say, and tie the head).
_GEMMA_DEFAULTS = {
    "tie_word_embeddings": True,
    "head_dim": 256,
    "sliding_window": 4096,
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
}
# Families whose window (if any) is on every layer.
_ALL_LAYER_WINDOWS = ("mistral", "phi3")
# Families with windowed layers named by use_sliding_window / max_window_layers / layer_types.
_LAYER_TYPED_WINDOWS = ("qwen2", "qwen3")


def _family(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return str(model_type)
    for arch in raw.get("architectures") or []:  # a fine-tune's own model_type, say
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ModelLoadError(
        f"{path}: model_type {model_type!r} is not a family this engine runs (it runs: {', '.join(FAMILIES)})"
    )


def _gemma_rope(raw: dict[str, Any], path: Path) -> tuple[dict[str, Any], float]:
    """(the global layers' RoPE parameters, the local layers' base) of a Gemma 3 config:
    transformers 5 nests rope_parameters per layer type; 4.x has rope_theta / rope_scaling
    for the global layers and rope_local_base_freq for the local ones."""
    nested = raw.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full, local = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
    else:
        full = {**(raw.get("rope_scaling") or {}), **nested}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(f"{path}: RoPE scaling on Gemma's local layers ({local}) is not supported")
    # transformers' defaults: 1e6 for the global layers, 1e4 for the local ones.
    return {"rope_theta": raw.get("rope_theta", 1_000_000.0), **full}, float(local.get("rope_theta", 10000.0))


def _rope(family: str, raw: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5's rope_parameters or 4.x's rope_theta/rope_scaling
    (Gemma: those of its global layers)."""
    if family == "gemma3_text":
        params = _gemma_rope(raw, path)[0]
    else:
        params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(f"{path}: partial rotary embeddings (partial_rotary_factor) are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if family == "phi3" and kind in ("su", "yarn"):  # Phi-3's older names for its longrope
        kind = "longrope"
    if kind == "default":
        return theta, None
    if kind not in ROPE_KINDS:
        raise ModelLoadError(
            f"{path}: RoPE scaling {kind!r} is not supported (supported: default, {', '.join(ROPE_KINDS)})"
        )
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if kind == "longrope":  # Phi-3 keeps it beside rope_parameters, and it takes precedence
        original = raw.get("original_max_position_embeddings", original)
    original = original or raw.get("max_position_embeddings", _MAX_POSITION)  # transformers' default
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope") and original:  # transformers' rule without one
        factor = raw.get("max_position_embeddings", _MAX_POSITION) / original
    attention_factor = params.get("attention_factor")
    if kind == "longrope" and attention_factor is None:
        f = float(factor or 1.0)
        attention_factor = math.sqrt(1 + math.log(f) / math.log(original)) if f > 1 else 1.0
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if kind == "yarn" and attention_factor is None and mscale and mscale_all:
        f = float(factor or 1.0)
        attention_factor = (0.1 * mscale * math.log(f) + 1) / (0.1 * mscale_all * math.log(f) + 1) if f > 1 else 1.0
    try:
        return theta, RopeScaling(
            kind=kind,
            factor=float(factor if factor is not None else 1.0),
            original_max_position=int(original or 0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(params.get("truncate", True)),
            short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad RoPE scaling {kind!r}: {e}") from None


def _windows(family: str, raw: dict[str, Any], layers: int, max_position: int) -> tuple[int, tuple[int, ...] | None]:
    """(sliding_window, sliding_layers) as the family's HF model reads its config."""
    window = raw.get("sliding_window")
    if family in _LAYER_TYPED_WINDOWS:
        if not raw.get("use_sliding_window"):
            return 0, None  # transformers drops the window then, whatever layer_types says
        types = raw.get("layer_types") or [
            "sliding_attention" if i >= int(raw.get("max_window_layers", layers)) else "full_attention"
            for i in range(layers)
        ]
        sliding: tuple[int, ...] | None = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif family == "gemma3_text":
        # Every layer is local or global; 4.x configs give the pattern (every n-th layer global).
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = raw.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        # The local layers keep their RoPE (``local_rope``) even where the window hides nothing.
        return (int(window) if window and int(window) < max_position else 0), sliding
    elif family in _ALL_LAYER_WINDOWS:
        sliding = None
    else:
        return 0, None
    # A window as long as the context hides nothing: every key is within it.
    if not window or int(window) >= max_position or sliding == ():
        return 0, None
    return int(window), sliding


def _refuse_unsupported(family: str, raw: dict[str, Any], path: Path) -> None:
    """Features the families' configs can switch on that our model does not implement: such a
    checkpoint would run but give wrong logits, so it is refused instead."""
    if raw.get("attention_bias") and family != "qwen2":  # qwen2's q/k/v biases are the family's
        raise ModelLoadError(f"{path}: attention_bias=true (a bias on every attention projection) is not supported")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported")
    act = raw.get("hidden_activation", raw.get("hidden_act")) if family == "gemma3_text" else raw.get("hidden_act")
    if (act or _ACTIVATION[family]) != _ACTIVATION[family]:
        raise ModelLoadError(f"{path}: activation {act!r} is not supported for {family} (only {_ACTIVATION[family]})")
    if family == "gemma3_text":
        if raw.get("attn_logit_softcapping"):  # Gemma 2's; no attention path here caps scores
            raise ModelLoadError(f"{path}: attn_logit_softcapping (attention score soft-capping) is not supported")
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{path}: use_bidirectional_attention=true (an encoder) is not supported")


def _served_positions(raw: dict[str, Any], scaling: RopeScaling | None, path: Path) -> int:
    """The context the engine serves: the config's, or longrope's original one (see
    ``RopeScaling``), said in the log when that is shorter."""
    max_position = int(raw.get("max_position_embeddings", _MAX_POSITION))
    if scaling is None or scaling.kind != "longrope" or scaling.original_max_position >= max_position:
        return max_position
    log.warning(
        "%s: longrope RoPE switches to its long factors past %d positions, which this engine does not run: "
        "serving up to %d tokens (of %d)",
        path, scaling.original_max_position, scaling.original_max_position, max_position,
    )  # fmt: skip
    return scaling.original_max_position


def _gemma_options(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The LlamaConfig options by which Gemma 3 differs from a Qwen3 (q/k norms, per-layer windows)."""
    return {
        "local_rope_theta": _gemma_rope(raw, path)[1],
        "hidden_act": "gelu_tanh",
        "scaled_embedding": True,
        "sandwich_norms": True,
        "query_pre_attn_scalar": float(raw["query_pre_attn_scalar"]),
        "final_logit_softcap": float(raw.get("final_logit_softcapping") or 0.0),
    }


def config_from_json(path: Path) -> LlamaConfig:
    """The LlamaConfig for a directory's config.json (``path`` is the file): its family's
    options as the family's Hugging Face model reads them; a family or feature the engine
    does not run is a ModelLoadError saying so."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: config is not a JSON object")
    family = _family(raw, path)
    if family == "gemma3_text":
        raw = {**_GEMMA_DEFAULTS, **raw}
    _refuse_unsupported(family, raw, path)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        theta, scaling = _rope(family, raw, path)
        max_position = _served_positions(raw, scaling, path)
        window, sliding = _windows(family, raw, layers, max_position)
        cfg = LlamaConfig(
            name=path.parent.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            intermediate_size=int(raw["intermediate_size"]),
            rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=max_position,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            family=family,
            head_dim=int(raw.get("head_dim") or 0),
            rope_scaling=scaling,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "gemma3_text"),
            sliding_window=window,
            sliding_layers=sliding,
            **(_gemma_options(raw, path) if family == "gemma3_text" else {}),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: inconsistent hyperparameters: {e}") from None
    return cfg


def _read_file(file: Path) -> dict[str, np.ndarray]:
    """All tensors of one shard as float32 numpy arrays.

    bf16 has no numpy dtype (the numpy framework refuses it), so those tensors go through torch.
    """
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    bf16: list[str] = []
    with safe_open(str(file), framework="np") as handle:
        for name in handle.keys():
            if handle.get_slice(name).get_dtype() == "BF16":
                bf16.append(name)
            else:
                out[name] = np.asarray(handle.get_tensor(name), dtype=np.float32)
    if bf16:
        import torch  # deferred: only bf16 checkpoints need it

        with safe_open(str(file), framework="pt") as handle:
            for name in bf16:
                out[name] = handle.get_tensor(name).to(torch.float32).numpy()
    return out


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors of the given shards, as float32 numpy arrays."""
    from safetensors import SafetensorError

    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            tensors.update(_read_file(file))
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{file}: unreadable safetensors file ({e})") from None
    return tensors


def split_fused(cfg: LlamaConfig, weights: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Phi-3's qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up]) under the Llama names
    (the torch model fuses them again its own way)."""
    out = dict(weights)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        qkv, gate_up = out.pop(p + "self_attn.qkv_proj.weight", None), out.pop(p + "mlp.gate_up_proj.weight", None)
        if qkv is None or gate_up is None:
            raise ModelLoadError(f"{path}: layer {n} lacks self_attn.qkv_proj or mlp.gate_up_proj")
        if qkv.shape[0] != cfg.q_dim + 2 * cfg.kv_dim or gate_up.shape[0] != 2 * cfg.intermediate_size:
            raise ModelLoadError(f"{path}: layer {n}'s fused projections have shapes {qkv.shape}, {gate_up.shape}")
        q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim])
        gate, up = np.split(gate_up, 2)
        for name, w in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                        ("mlp.gate_proj", gate), ("mlp.up_proj", up)):  # fmt: skip
            out[f"{p}{name}.weight"] = np.ascontiguousarray(w)
    return out


def fold_norm_offsets(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Gemma's RMS norms multiply by (1 + w): every norm weight (q/k norms too) becomes its
    multiplier 1 + w, once, here. Exact: transformers adds the 1 in float32 too
    (``1.0 + weight.float()``), and llama.cpp's converter stores the same sum."""
    return {k: (v + np.float32(1.0)) if k.endswith("norm.weight") else v for k, v in weights.items()}


def load_hf_dir(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and float32 HF-named weights of the checkpoint in directory ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json, not a Hugging Face model directory")
    cfg = config_from_json(config_file)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    weights = read_safetensors(files)
    # Buffers some older checkpoints saved, recomputed by every implementation.
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.family == "phi3":
        weights = split_fused(cfg, weights, path)
    if cfg.family == "gemma3_text":
        weights = fold_norm_offsets(weights)
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a tied head is the embedding; some files store it anyway
    check_weights(cfg, weights, path)
    return cfg, weights

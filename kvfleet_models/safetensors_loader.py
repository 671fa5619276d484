"""Llama weights from a Hugging Face-style directory: config.json plus *.safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvfleet_models.config import LlamaConfig
from kvfleet_models.errors import ModelLoadError, check_weights

# Features of HF's LlamaConfig that our model does not implement; loading such a checkpoint
# would run but give wrong logits, so it is refused instead.
_UNSUPPORTED_FLAGS = ("attention_bias", "mlp_bias")


def _rope_theta(raw: dict[str, Any], path: Path) -> float:
    # transformers 5 nests RoPE settings under rope_parameters; 4.x wrote rope_theta/rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ModelLoadError(f"{path}: RoPE scaling {rope_type!r} is not supported")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))


def config_from_json(path: Path) -> LlamaConfig:
    """The LlamaConfig for a directory's config.json (``path`` is the file)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable config ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: config is not a JSON object")
    if raw.get("model_type") != "llama" and "LlamaForCausalLM" not in (raw.get("architectures") or []):
        raise ModelLoadError(f"{path}: model_type {raw.get('model_type')!r} is not a Llama model")
    for flag in _UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ModelLoadError(f"{path}: {flag}=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: activation {raw['hidden_act']!r} is not supported (only silu)")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    try:
        heads = int(raw["num_attention_heads"])
        cfg = LlamaConfig(
            name=path.parent.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            intermediate_size=int(raw["intermediate_size"]),
            rope_theta=_rope_theta(raw, path),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: inconsistent hyperparameters: {e}") from None
    if raw.get("head_dim", cfg.head_dim) != cfg.head_dim:
        raise ModelLoadError(f"{path}: head_dim {raw['head_dim']} != hidden_size / num_heads is not supported")
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


def load_hf_dir(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and float32 HF-named weights of the Llama checkpoint in directory ``path``."""
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
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a tied head is the embedding; some files store it anyway
    check_weights(cfg, weights, path)
    return cfg, weights

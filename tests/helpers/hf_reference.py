"""transformers' own SmolLM2 from the GGUF file: the reference model (and tokenizer), loaded once per environment.

transformers takes ~11 s to build SmolLM2 from the GGUF file (measured on the 2-core Xeon), in
every test process that needs the reference. Its result (transformers' own dequantized weights
and config) is kept as a safetensors file in the environment's cache, under a key of the GGUF
file and the transformers and torch versions; a later process builds the model from it in ~1.4 s.
The weights are the ones transformers produced, saved and read back bit for bit
(``test_loaders`` compares them with ours; they never come from our loader). Processes that
start together wait on one lock, so the file is written once and never read half-written.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

CACHE = Path(sys.prefix) / "kvfleet-test-cache"  # the venv's: `make clean` removes it


def _key(gguf: Path) -> str:
    import torch
    import transformers

    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{torch.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _from_gguf(gguf: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)


def _save(model: Any, folder: Path) -> None:
    """Written beside ``folder`` and renamed into place: a folder that exists is whole."""
    import safetensors.torch

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    safetensors.torch.save_model(model, str(partial / "model.safetensors"))  # the tied head once
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF marker: the saved weights are plain float32
    model.config.__class__(**config).to_json_file(str(partial / "config.json"))
    model.generation_config.to_json_file(str(partial / "generation_config.json"))
    os.replace(partial, folder)


def _from_folder(folder: Path) -> Any:
    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder)), dtype=torch.float32)
    missing, unexpected = safetensors.torch.load_model(model, str(folder / "model.safetensors"))
    if missing or unexpected:
        raise RuntimeError(f"the cached reference in {folder} does not fit: missing {missing}, unexpected {unexpected}")
    model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model


def hf_reference(gguf: Path, cache: Path = CACHE) -> Any:
    """transformers' model of ``gguf``, float32, in eval mode."""
    folder = cache / f"hf-{gguf.stem}-{_key(gguf)}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not folder.is_dir():
            model = _from_gguf(gguf)
            _save(model, folder)
            return model.eval()
    return _from_folder(folder).eval()


def hf_tokenizer(gguf: Path, cache: Path = CACHE) -> Any:
    """transformers' tokenizer of ``gguf`` (~6 s to build from the file on the EPYC), kept in the
    cache as transformers saves it (its own tokenizer.json) under the same key, and read back
    from there (~0.1 s): what transformers made of the file, never our tokenizer's output."""
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = cache / f"hf-tokenizer-{gguf.stem}-{_key(gguf)}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            tokenizer.save_pretrained(str(partial))
            os.replace(partial, folder)  # a folder that exists is whole
            return tokenizer
    return AutoTokenizer.from_pretrained(str(folder))

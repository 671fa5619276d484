"""The cached transformers reference (tests/helpers/hf_reference.py): a model built from the
cache is the one transformers built from the GGUF file, bit for bit, and a changed file is
never answered from an old entry."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.helpers.families import CASES, make_checkpoint
from tests.helpers.gguf_families import write_gguf
from tests.helpers.hf_reference import hf_reference


def _state(model) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_cached_model_is_transformers_own_load_bit_for_bit(tmp_path: Path) -> None:
    case = CASES["llama-linear-tied"]
    gguf = write_gguf(case, make_checkpoint(case, tmp_path / "hf", seed=3), tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    fresh = hf_reference(gguf, cache)  # built by transformers from the file, and saved
    assert [p.name for p in cache.iterdir() if p.is_dir()] and not list(cache.glob("*.partial"))
    cached = hf_reference(gguf, cache)  # read back from the cache
    assert not cached.training
    assert getattr(cached.config, "quantization_config", None) is None
    want, got = _state(fresh), _state(cached)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # The tied head stays tied, as transformers made it.
    assert fresh.config.tie_word_embeddings and cached.config.tie_word_embeddings
    assert cached.lm_head.weight.data_ptr() == cached.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, cached(ids).logits)
    assert fresh.generation_config.to_dict() == cached.generation_config.to_dict()


def test_a_changed_file_gets_its_own_entry(tmp_path: Path) -> None:
    case = CASES["llama-linear-tied"]
    gguf = write_gguf(case, make_checkpoint(case, tmp_path / "a", seed=3), tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    first = _state(hf_reference(gguf, cache))
    # The same path, other weights (and a later mtime): not the old entry.
    write_gguf(case, make_checkpoint(case, tmp_path / "b", seed=4), gguf)
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = _state(hf_reference(gguf, cache))
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2
    assert any(not torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(second[k], v) for k, v in _state(hf_reference(gguf, cache)).items())

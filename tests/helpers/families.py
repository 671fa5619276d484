"""Checkpoints of each model family the engine runs, made at test time by transformers itself
(random weights, small shapes), and transformers' own answers on them: the oracle of the
family parity tests (``tests/unit/test_families.py``, ``tests/integration/test_families_cluster.py``).

Nothing is fetched from a hub. Each case is a fresh model built from a seed: no test ever
mutates a model another test reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import numpy as np

VOCAB = 256
NEW_TOKENS = 8  # greedy tokens each family parity test compares with transformers'
# Small shapes shared by the cases: 4 query heads over 2 kv heads, head_dim 16 unless a case
# sets its own.
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500.0,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,  # generate runs its full length, as the engine does
    "pad_token_id": None,
}


@dataclass(frozen=True)
class Case:
    """One family configuration: the transformers config class and what it changes."""

    family: str  # the model_type our loader must read
    config_class: str  # transformers' class
    options: dict[str, Any] = field(default_factory=dict)
    shard: bool = False  # save in several safetensors shards

    def hf_config(self) -> Any:
        import transformers

        kwargs = {**_BASE, **self.options}
        if self.config_class != "LlamaConfig":
            # Only Llama's config still takes rope_theta / rope_scaling in transformers 5;
            # the others take rope_parameters.
            rope = kwargs.pop("rope_parameters", {"rope_type": "default"})
            theta = kwargs.pop("rope_theta")
            # Gemma 3 nests them per layer type, each with its own theta (the case gives both).
            kwargs["rope_parameters"] = rope if "full_attention" in rope else {**rope, "rope_theta": theta}
        return getattr(transformers, self.config_class)(**kwargs)


CASES: dict[str, Case] = {
    # Llama 3.1-style: llama3 RoPE scaling whose original context (32) is shorter than the
    # prompts, so the low/medium/high frequency bands all matter; untied head; sharded.
    "llama3": Case(
        "llama",
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        shard=True,
    ),
    "llama-linear-tied": Case(
        "llama", "LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "tie_word_embeddings": True}
    ),
    "llama-yarn": Case(
        "llama",
        "LlamaConfig",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "llama-dynamic": Case("llama", "LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    # Mistral 7B v0.2+: no window, a head_dim of its own (as Mistral Nemo's).
    "mistral": Case("mistral", "MistralConfig", {"sliding_window": None, "head_dim": 24}),
    # Mistral 7B v0.1: a sliding window on every layer, shorter than the test's contexts.
    "mistral-window": Case("mistral", "MistralConfig", {"sliding_window": 6}),
    # Qwen2/2.5: q/k/v biases; the small ones tie the head.
    "qwen2": Case("qwen2", "Qwen2Config", {"tie_word_embeddings": True}),
    # Qwen2 with use_sliding_window: windowed layers from max_window_layers on, full before.
    "qwen2-window": Case(
        "qwen2", "Qwen2Config", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}
    ),
    # Qwen3: q/k RMS norms per head, head_dim independent of hidden / heads.
    "qwen3": Case("qwen3", "Qwen3Config", {"head_dim": 32}),
    # Phi-3 mini 4k: fused qkv_proj and gate_up_proj, a window on every layer.
    "phi3": Case("phi3", "Phi3Config", {"sliding_window": 10}),
    # Phi-3 128k: longrope, served up to its original context (64 here, past every test's).
    "phi3-longrope": Case(
        "phi3",
        "Phi3Config",
        {
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.4, 3.5, 5.0, 7.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            },
        },
    ),
    # Gemma 3 as released (1B-27B, shrunk): 6 layers, every 6th global (transformers' default
    # layer_types, and llama.cpp's fixed pattern), a window shorter than the prompts, local RoPE
    # base 10000 against the global one with its linear scaling (4B+), query_pre_attn_scalar
    # equal to head_dim, a tied head; plus final logit soft-capping (Gemma 2's, which Gemma 3
    # configs may set) at a cap the logits reach.
    "gemma3": Case(
        "gemma3_text",
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "head_dim": 32,
            "sliding_window": 5,
            "query_pre_attn_scalar": 32,
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # Gemma 3 with layer_types of its own (a global layer between local ones), a score scale
    # other than head_dim's (as the 27B's) and an untied head.
    "gemma3-scalar": Case(
        "gemma3_text",
        "Gemma3TextConfig",
        {
            "head_dim": 24,
            "sliding_window": 7,
            "query_pre_attn_scalar": 40,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 500.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        },
    ),
}


def _init_(model: Any, seed: int) -> None:
    """Weights that make greedy choices clear (no near-ties between float32 implementations):
    every matrix (the embedding too) N(0, 1/fan_in), norms 1 + noise (a forgotten norm weight
    shows) and the final one 3 times that, biases large enough to matter. transformers' own N(0, 0.02) leaves a tiny
    model's logits nearly flat. Gemma's norms multiply by 1 + w: its w are 1 less, for the
    same multipliers (and a forgotten + 1 leaves multipliers near 0)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shift = 1.0 if model.config.model_type == "gemma3_text" else 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name == "model.norm.weight":  # logits of std ~3: the top two of 256 stand apart
                p.copy_(3.0 * (1.0 + 0.1 * noise) - shift)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * noise - shift)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:  # the embedding too: a tied head of larger rows would repeat the last token
                p.copy_(noise / p.shape[-1] ** 0.5)


def make_checkpoint(case: Case, path: Path, seed: int = 0) -> Any:
    """Save a fresh random model of ``case`` in ``path`` (config.json + safetensors); returns
    the model (float32, eval mode) for the caller's oracle."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(case.hf_config(), dtype=torch.float32)
    _init_(model, seed)
    model.eval()
    model.save_pretrained(path, max_shard_size="40KB" if case.shard else "2GB")
    return model


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate (its own KV cache and masks)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == new_tokens
    return tokens


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    """[T, V] float64 logits of one full forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def prompts(n: int = 4, seed: int = 1) -> list[list[int]]:
    """Prompts of 1, 6, 11 and 19 tokens (the longer ones past the cases' windows)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=size).tolist() for size in (1, 6, 11, 19)[:n]]


# A few sentences to train a small BPE on (the directory's own tokenizer.json in the tests).
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cluster serves tokens to the clients that ask for them.",
    "The scheduler batches the sessions tick by tick, and the workers run them.",
]


def write_trained_tokenizer(path: Path, vocab_size: int) -> Any:
    """Train a byte-level BPE of exactly ``vocab_size`` ids on a few sentences (the 256 bytes,
    "<|endoftext|>" as id 0, then merges) and save it as ``path``/tokenizer.json; returns it
    (a ``tokenizers.Tokenizer``, the oracle of what the scheduler must encode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    assert tok.get_vocab_size() == vocab_size, "the corpus has too few merges for this vocabulary"
    tok.save(str(path / "tokenizer.json"))
    return tok

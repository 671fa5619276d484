"""Model hyperparameters shared by the torch model, the numpy reference and the loaders."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

    Weights are a dict of arrays named as in Hugging Face's LlamaForCausalLM
    (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight`` [out, in], ...,
    ``model.norm.weight``, ``lm_head.weight``), whatever file format they came from.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # K and V, for every layer.
        return 2 * self.num_layers * self.kv_dim * dtype_bytes


def tiny_config() -> LlamaConfig:
    """The synthetic unit model of the concurrency sweep: hidden 32, 4 heads, 6 layers, vocab 48."""
    return LlamaConfig(
        name="tiny",
        vocab_size=48,
        hidden_size=32,
        num_layers=6,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=64,
        max_position=512,
    )

"""Model hyperparameters shared by the torch model, the numpy reference and the loaders."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# RoPE scalings a config may name (HF's rope_type); "default" is no scaling (None).
ROPE_KINDS = ("linear", "llama3", "dynamic", "yarn", "longrope")
# A scaling given as one divisor per rotary pair, precomputed: llama.cpp's ``rope_freqs``
# tensor, which is how a GGUF file carries Llama 3.1's llama3 scaling.
FREQ_FACTORS = "freq_factors"
# The MLP gate's activations: silu (Llama, ...) and the tanh approximation of GELU (Gemma).
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """How a family stretches RoPE past its training context (HF's ``rope_parameters``).

    linear: every frequency divided by ``factor``. llama3: low frequencies (wavelength above
    ``original_max_position / low_freq_factor``) divided by ``factor``, high ones (below
    ``original_max_position / high_freq_factor``) kept, a smooth blend between. yarn: a ramp
    between the divided and the original frequencies over the dimensions that rotate between
    ``beta_slow`` and ``beta_fast`` times in the original context, and cos/sin multiplied by
    ``attention_factor`` (None: 0.1 ln(factor) + 1). dynamic: NTK scaling that changes only
    past ``max_position``, which the engine never runs, so the plain frequencies. longrope
    (Phi-3): each frequency divided by its own ``short_factor`` and cos/sin multiplied by
    ``attention_factor``; its long factors apply only past ``original_max_position``, where
    transformers switches every later token (and not the cached ones) to them, so the loader
    serves such a model up to ``original_max_position`` (``max_position`` is that).
    freq_factors: each frequency divided by its own entry of ``freq_factors`` (a GGUF's
    ``rope_freqs``: the llama3 rule evaluated by llama.cpp's converter).
    """

    kind: str
    factor: float = 1.0
    original_max_position: int = 0  # llama3, yarn: the pre-training context (0: max_position)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per rotary pair [D/2]
    freq_factors: tuple[float, ...] = ()  # freq_factors: one divisor per rotary pair [D/2]

    def __post_init__(self) -> None:
        if self.kind not in (*ROPE_KINDS, FREQ_FACTORS):
            raise ValueError(f"RoPE scaling {self.kind!r} is not one of {list(ROPE_KINDS)}")
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor")
        if self.kind == "longrope" and (not self.short_factor or self.attention_factor is None):
            raise ValueError("longrope RoPE scaling needs short_factor and attention_factor")
        if (self.kind == FREQ_FACTORS) != bool(self.freq_factors) or any(f <= 0 for f in self.freq_factors):
            raise ValueError("freq_factors RoPE scaling (and only it) needs positive freq_factors")


@dataclass(frozen=True)
class LlamaConfig:
    """A decoder of the Llama lineage (RMSNorm, RoPE, grouped-query attention, SwiGLU), with
    the options by which the families we run differ from Llama (see the "family options"
    fields); one model definition reads them, not a copy per family.

    Weights are a dict of arrays named as in Hugging Face's LlamaForCausalLM
    (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight`` [out, in], ...,
    ``model.norm.weight``, ``lm_head.weight``), whatever file format they came from, plus the
    tensors an option adds (``self_attn.q_proj.bias``, ``self_attn.q_norm.weight``, ...:
    ``errors.expected_shapes``).
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
    # -- family options (all off: Llama 1/2) --------------------------------------------------
    family: str = "llama"  # the checkpoint's model_type, for messages and logs
    # Width of a head; 0 = hidden_size // num_heads, resolved once here (Qwen3 and Mistral
    # Nemo choose it independently of the hidden size).
    head_dim: int = 0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMS norm over each head's q and k, before RoPE
    # (Phi-3's fused qkv_proj and gate_up_proj are split by its loader into the Llama names.)
    # Keys a query of a windowed layer sees, itself included (HF: key > query - window);
    # 0 = every key before it. Which layers are windowed: ``sliding_layers``, None = all.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] | None = None
    # Gemma 3: its "sliding_attention" layers (``sliding_layers``, kept even where the window
    # hides nothing) rotate with a RoPE of their own base and no scaling; 0 = one RoPE for all.
    local_rope_theta: float = 0.0
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (Gemma)
    # Gemma: embeddings multiplied by sqrt(hidden_size) (in the embedding's dtype).
    scaled_embedding: bool = False
    # Gemma's "sandwich" norms: the attention and MLP outputs are RMS-normed before their
    # residual add (HF post_attention_layernorm / post_feedforward_layernorm), and the MLP's
    # input norm is pre_feedforward_layernorm. Gemma's (1 + w) norm weights are folded at load
    # (every loader hands norms on as plain multipliers, as llama.cpp's converter stores them).
    sandwich_norms: bool = False
    # Attention scores are q.k * query_pre_attn_scalar^-0.5 (Gemma); 0 = head_dim's.
    query_pre_attn_scalar: float = 0.0
    # logits -> cap * tanh(logits / cap) (Gemma's final_logit_softcapping); 0 = none.
    final_logit_softcap: float = 0.0

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
        if self.head_dim < 0:
            raise ValueError(f"head_dim must be positive (0: hidden_size / num_heads), got {self.head_dim}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)  # frozen: resolved once
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {self.sliding_window}")
        s = self.rope_scaling
        if s is not None and s.kind == "longrope" and len(s.short_factor) != self.head_dim // 2:
            raise ValueError(
                f"longrope short_factor has {len(s.short_factor)} entries, head_dim / 2 is {self.head_dim // 2}"
            )
        if s is not None and s.kind == FREQ_FACTORS and len(s.freq_factors) != self.head_dim // 2:
            raise ValueError(f"freq_factors has {len(s.freq_factors)} entries, head_dim / 2 is {self.head_dim // 2}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.query_pre_attn_scalar < 0 or self.final_logit_softcap < 0 or self.local_rope_theta < 0:
            raise ValueError("query_pre_attn_scalar, final_logit_softcap and local_rope_theta must be >= 0")
        bad = [i for i in self.sliding_layers or () if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"sliding_layers {bad} outside the {self.num_layers} layers")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, itself included; 0 = all keys before it."""
        if not self.sliding_window or (self.sliding_layers is not None and layer not in self.sliding_layers):
            return 0
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def embed_multiplier(self) -> float:
        return math.sqrt(self.hidden_size) if self.scaled_embedding else 1.0

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with the local RoPE (``local_rope_theta``, unscaled)."""
        return bool(self.local_rope_theta) and (self.sliding_layers is None or layer in self.sliding_layers)

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

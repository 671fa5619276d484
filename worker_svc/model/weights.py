"""A model's weights in the layout the forward reads, and the two reference ops a weight
transform needs (the RMS norm and RoPE on torch), so that a transform such as ``int8`` works on
the weights alone, before the model is built, without depending on the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker_svc.model.cpu_backend import Matrix


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # hidden -> (Hq + 2 Hkv) * D, q/k pair-permuted, q pre-scaled
    o: Matrix  # Hq * D -> hidden
    post_norm: torch.Tensor  # [hidden] the MLP's input norm (Gemma's pre_feedforward_layernorm)
    gate_up: Matrix  # hidden -> 2 * intermediate
    down: Matrix  # intermediate -> hidden
    # Family options (None where the family has none):
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D], laid out as qkv's rows
    # [D] each, pair-permuted as q and k; q's carries the attention scale (q rows are then
    # not pre-scaled, as the norm would undo it).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # [hidden] each, Gemma's sandwich norms: of o's and down's outputs, before the residual add.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None

    def matrices(self) -> list[Matrix]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def vectors(self) -> list[torch.Tensor]:
        optional = (self.qkv_bias, self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm)
        extra = [v for v in optional if v is not None]
        return [self.input_norm, self.post_norm, *extra]


@dataclass(frozen=True)
class ModelWeights:
    layers: list[LayerWeights]
    norm: torch.Tensor  # the final norm [hidden]
    embed: torch.Tensor | None  # the lookup table [V, hidden]; None: the tied head's float rows
    lm_head: Matrix  # hidden -> V
    rotary: torch.Tensor  # e^(i * angle) [max_position, D/2], complex64
    # The same for the layers with the local RoPE (Gemma: ``LlamaConfig.local_rope``); None: none.
    local_rotary: torch.Tensor | None = None
    # Gemma: sqrt(hidden) as a 0-d tensor of the weights' dtype (transformers rounds it to the
    # embedding's dtype), multiplying each looked-up row; None: rows as they are.
    embed_scale: torch.Tensor | None = None
    # A tied head quantized to int8 (int8.quantize): no float table is kept; a row is the head's
    # row dequantized times this [hidden], 1 / the head's smoothing scale.
    embed_unsmooth: torch.Tensor | None = None

    def rotary_of(self, local: bool) -> torch.Tensor:
        return self.local_rotary if local and self.local_rotary is not None else self.rotary

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, hidden] the (scaled) embedding rows of ``tokens`` [T]."""
        if self.embed is None and self.lm_head.q8 is not None:
            assert self.embed_unsmooth is not None, "an int8 tied head needs its smoothing to undo"
            rows = self.lm_head.q8.rows(tokens) * self.embed_unsmooth
        else:
            table = self.embed if self.embed is not None else self.lm_head.nk  # a float tied head's own rows
            assert table is not None
            rows = table.index_select(0, tokens)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 (torch's kernel upcasts half types), as HF does.
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def gate_act_mul(gate_up: torch.Tensor, inter: int, act: str) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2 * inter] ([gate | up] columns): silu, or GELU's tanh
    approximation (Gemma; transformers' gelu_pytorch_tanh is this op)."""
    gate = gate_up[:, :inter]
    out = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return out.mul_(gate_up[:, inter:])


def qk_norm_(qkv: torch.Tensor, w: LayerWeights, num_heads: int, num_kv_heads: int, eps: float) -> None:
    """RMS-normalise each q and each k head of qkv [T, (Hq + 2 Hkv) * D] in place (Qwen3's
    q_norm / k_norm, before RoPE). Torch's op on the strided columns: the fused norm wants
    contiguous rows, and these are a small share of a step."""
    assert w.q_norm is not None and w.k_norm is not None
    t, d = qkv.shape[0], w.q_norm.shape[0]
    q = qkv[:, : num_heads * d].view(t, num_heads, d)
    k = qkv[:, num_heads * d : (num_heads + num_kv_heads) * d].view(t, num_kv_heads, d)
    q.copy_(rms_norm(q, w.q_norm, eps))
    k.copy_(rms_norm(k, w.k_norm, eps))


def rope_(qkv: torch.Tensor, rot: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotate the first ``heads`` heads of qkv [T, >= heads * D] in place (adjacent pairs);
    rot: [T, 1, D/2]."""
    t = qkv.shape[0]
    qk = qkv[:, : heads * head_dim].view(t, heads, head_dim // 2, 2)
    if qkv.dtype == torch.float32:
        torch.view_as_complex(qk).mul_(rot)
    else:
        rotated = torch.view_as_complex(qk.float()) * rot
        qk.copy_(torch.view_as_real(rotated))

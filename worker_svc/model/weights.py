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
    post_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # hidden -> 2 * intermediate
    down: Matrix  # intermediate -> hidden
    # Family options (None where the family has none):
    qkv_bias: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D], laid out as qkv's rows
    # [D] each, pair-permuted as q and k; q's carries the attention scale (q rows are then
    # not pre-scaled, as the norm would undo it).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    def matrices(self) -> list[Matrix]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def vectors(self) -> list[torch.Tensor]:
        extra = [v for v in (self.qkv_bias, self.q_norm, self.k_norm) if v is not None]
        return [self.input_norm, self.post_norm, *extra]


@dataclass(frozen=True)
class ModelWeights:
    layers: list[LayerWeights]
    norm: torch.Tensor  # the final norm [hidden]
    embed: torch.Tensor | None  # the lookup table [V, hidden]; None: the tied head's float rows
    lm_head: Matrix  # hidden -> V
    rotary: torch.Tensor  # e^(i * angle) [max_position, D/2], complex64

    @property
    def lookup(self) -> torch.Tensor:
        """The embedding rows (the head's own, for a tied head kept in float)."""
        table = self.embed if self.embed is not None else self.lm_head.nk
        assert table is not None, "a quantized tied head keeps its float table in embed"
        return table


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 (torch's kernel upcasts half types), as HF does.
    return F.rms_norm(x, (x.shape[-1],), w, eps)


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

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

    def matrices(self) -> list[Matrix]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def vectors(self) -> list[torch.Tensor]:
        return [self.input_norm, self.post_norm]


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
